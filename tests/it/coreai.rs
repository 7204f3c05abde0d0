//! `--target coreai`: every architecture fixture written by transformers
//! (tests/fixtures/hf/<arch>/) converted to an `.aimodel` in fp16 and executed by Apple's Core AI
//! runtime (coreai-core, from the Python environment `make setup` builds), its logits against
//! transformers' own; `validate` and `run` on an asset; the settings the backend refuses.

use std::path::{Path, PathBuf};
use std::process::Command;

use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::interp::Options;
use hf2coreml_testkit::{python_env, TinyModel, FP16_LOGIT_TOL};

use crate::support::logits::same_top;
use crate::support::needs;

const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");

/// fp16 compute on Apple's CPU runtime against transformers' f32 logits: the relative RMS
/// error of the logits, over every position and in the worst position's row. Measured
/// 1.5e-3 to 4.6e-3 (worst rows) on the attention and LFM2 fixtures.
const MAX_REL_RMS: f32 = 0.01;
/// Share of positions whose top-1 token is transformers', ties within 0.5% of the row's
/// largest |logit| either way (`support::logits::same_top`).
const MIN_TOP1: f32 = 0.99;

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/hf/{arch}"))
}

fn hf2coreml(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env("HF2COREML_PYTHON_ENV", python_env())
        .output()
        .unwrap()
}

fn convert(dir: &Path, out: &Path, flags: &[&str]) {
    convert_at(dir, out, 64, flags)
}

fn convert_at(dir: &Path, out: &Path, max_seq_len: usize, flags: &[&str]) {
    let s = max_seq_len.to_string();
    let mut args = vec![
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--max-seq-len",
        &s,
        "--target",
        "coreai",
    ];
    args.extend_from_slice(flags);
    let o = hf2coreml(&args);
    assert!(
        o.status.success(),
        "convert {flags:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// transformers' tokens and logits for the fixture: a LongRoPE fixture's first tokens, within
/// the original context a package's fixed RoPE tables are built for.
fn expected(dir: &Path) -> (Vec<u32>, Vec<Vec<f32>>) {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tokens = crate::support::json::ids(&j["tokens"]);
    let key = if j.get("prefix_logits").is_some() {
        "prefix_logits"
    } else {
        "logits"
    };
    let logits = crate::support::json::rows(&j[key]);
    (tokens[..logits.len()].to_vec(), logits)
}

/// The asset's logits at every position of `tokens`, stepped by Apple's runtime (found where
/// `HF2COREML_PYTHON_ENV` points, as `make test` sets it, or at ./.venv).
fn asset_logits(asset: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let model = Saved::load(asset, Options::default()).unwrap();
    assert!(matches!(model, Saved::CoreAi(_)));
    let mut gen = Generator::new(model).unwrap();
    let out = gen
        .generate(
            tokens,
            &GenerateOptions {
                max_new_tokens: 0,
                record_logits: true,
                ..GenerateOptions::default()
            },
            &mut |_| Ok(()),
        )
        .unwrap();
    let rows = out.logits.unwrap();
    (0..rows.rows())
        .map(|t| rows.row(t).unwrap().to_vec())
        .collect()
}

fn fp16_matches_transformers(arch: &str) {
    fp16_matches_transformers_in(arch, "default");
}

fn fp16_matches_transformers_in(arch: &str, layout: &str) {
    fp16_matches_transformers_within(arch, layout, (MAX_REL_RMS, MIN_TOP1));
}

/// [`fp16_matches_transformers_in`] with its own bounds (the worst row's relative RMS, top-1);
/// the relative RMS over every row is held to [`MAX_REL_RMS`].
fn fp16_matches_transformers_within(arch: &str, layout: &str, (max_rms, min_top1): (f32, f32)) {
    let dir = fixture(arch);
    let tmp = tempfile::tempdir().unwrap();
    let asset = tmp.path().join(format!("{arch}.aimodel"));
    let (tokens, want) = expected(&dir);
    convert_at(
        &dir,
        &asset,
        tokens.len().next_multiple_of(64),
        &["--keep-fp16", "*", "--layout", layout],
    );
    assert!(asset.join("metadata.json").is_file());
    assert!(tmp.path().join(format!("{arch}.report.json")).is_file());
    let got = asset_logits(&asset, &tokens);
    assert_eq!(got.len(), want.len());
    let (mut worst, mut err_all, mut norm_all) = (0f32, 0f64, 0f64);
    let mut top1 = 0;
    for (g, w) in got.iter().zip(&want) {
        let err: f32 = g.iter().zip(w).map(|(a, b)| (a - b) * (a - b)).sum();
        let norm: f32 = w.iter().map(|b| b * b).sum();
        worst = worst.max((err / norm.max(f32::MIN_POSITIVE)).sqrt());
        (err_all, norm_all) = (err_all + f64::from(err), norm_all + f64::from(norm));
        let tie = 0.005 * w.iter().fold(0f32, |m, v| m.max(v.abs()));
        top1 += usize::from(same_top(g, w, tie));
    }
    let all = (err_all / norm_all).sqrt() as f32;
    let top1 = top1 as f32 / want.len() as f32;
    eprintln!(
        "{arch} ({layout} layout): Core AI fp16, relative RMS {all:.2e} (worst row {worst:.2e}), \
         top-1 {top1:.3}"
    );
    assert!(all <= MAX_REL_RMS, "{arch}: relative RMS {all}");
    assert!(worst <= max_rms, "{arch}: relative RMS {worst} in one row");
    assert!(top1 >= min_top1, "{arch}: top-1 {top1}");
}

/// LFM2's hybrid contract on Apple's runtime: the conv blocks' state through every step of
/// the fp16 assets (both fixtures: kernels 3 and 4, conv biases), against transformers.
#[test]
fn lfm2_fp16_assets_match_transformers() {
    needs!(Python);
    fp16_matches_transformers("lfm2");
    fp16_matches_transformers("lfm2_untied");
}

/// Qwen3.5's conv and DeltaNet states through every step of an fp16 asset on Apple's
/// runtime, against transformers. Its worst row may reach 0.015 (measured 1.05e-2 of 72): the
/// fixture's random weights make Sᵀq a sum of terms ten times its size, so the state's own
/// fp16 rounding shows in the output (rounding only the DeltaNet's projections, its
/// convolution or its recurrence in the f32 reference moves the logits by 0.07-0.09 each, of 23).
#[test]
fn qwen3_5_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers_within("qwen3_5", "default", (0.015, MIN_TOP1));
}

/// An LFM2 asset with a prefill function (`valid_len` picks the last real row of a padded
/// chunk) passes validate on Apple's runtime, prefill held to decode.
#[test]
fn lfm2_asset_with_prefill_passes_validate() {
    needs!(Python);
    let dir = fixture("lfm2_untied");
    let tmp = tempfile::tempdir().unwrap();
    let asset = tmp.path().join("lfm2.aimodel");
    convert(&dir, &asset, &["--keep-fp16", "*", "--prefill-len", "8"]);
    let o = hf2coreml(&[
        "validate",
        asset.to_str().unwrap(),
        "--against",
        dir.to_str().unwrap(),
        "--max-tokens",
        "40",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    assert!(
        o.status.success(),
        "{}\n{report:#}",
        String::from_utf8_lossy(&o.stderr)
    );
    let items = report["contract"].to_string();
    assert!(
        items.contains("prefill (Q=8) agrees with decode"),
        "{items}"
    );
}

/// Gemma 3, and the text decoder of the multimodal checkpoint transformers writes.
#[test]
fn gemma3_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers("gemma3");
    fp16_matches_transformers("gemma3_vl");
}

/// The Neural Engine layout (1×1 `conv` projections on [1, C, 1, Q], attention per kv head)
/// as an asset: Apple's runtime runs it as it runs the default layout, on the fixtures of
/// architectures that layout builds: partial RoPE, Gemma 3's sliding blocks and ranged norms,
/// Gemma 4's per-layer inputs and shared caches, and the hybrids' recurrent blocks, whose
/// cores run on [1, Q, C] between the convs. Qwen3.5's worst row is
/// held to the default layout's bound ([`qwen3_5_fp16_asset_matches_transformers`]).
#[test]
fn ane_layout_assets_match_transformers() {
    needs!(Python);
    for arch in [
        "phi3",
        "phi3_partial",
        "smollm3",
        "lfm2_untied",
        "gemma3",
        "gemma4",
    ] {
        fp16_matches_transformers_in(arch, "ane");
    }
    fp16_matches_transformers_within("qwen3_5", "ane", (0.015, MIN_TOP1));
}

/// Both layouts as assets on Apple's runtime, over the same tokens: Qwen2's biases (the conv's
/// bias) in fp16, and 4-bit LUT weights decoded into conv kernels.
#[test]
fn ane_and_default_layout_assets_agree() {
    needs!(Python);
    for (model, flags) in [
        (TinyModel::qwen2(), &["--keep-fp16", "*"][..]),
        (TinyModel::llama(), &["--recipe", "data-free-4bit"][..]),
    ] {
        let arch = model.architecture;
        let dir = model.write_temp().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % model.vocab as u32).collect();
        let mut logits = Vec::new();
        for layout in ["default", "ane"] {
            let asset = tmp.path().join(format!("{layout}.aimodel"));
            let mut all = flags.to_vec();
            all.extend(["--layout", layout]);
            convert_at(dir.path(), &asset, 16, &all);
            logits.push(asset_logits(&asset, &tokens));
        }
        let worst = logits[0]
            .iter()
            .flatten()
            .zip(logits[1].iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{arch} {flags:?}: layouts differ by {worst} at most");
        assert!(worst <= FP16_LOGIT_TOL, "{arch} {flags:?}: {worst}");
    }
}

#[test]
fn phi3_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers("phi3");
}

#[test]
fn phi3_partial_rotary_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers("phi3_partial");
}

#[test]
fn qwen3_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers("qwen3");
}

#[test]
fn smollm3_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers("smollm3");
}

/// A palettized asset (grouped 4-bit LUTs with row scales, packed sub-byte indices) through
/// `validate`: the report names Apple's runtime and the logits agree with the same recipe's
/// Core ML package as the interpreter runs it.
/// Two saves of one program are the same bytes, as two packages are
/// (`convert::tiny::same_inputs_give_a_byte_identical_package`): the bridge names the storage
/// of every weight (coreai-core names a large constant's at random) and keeps the day of
/// `creationDate` alone. 8-bit indices (handed over as bytes), their tables and fp16
/// constants; the asset still runs on Apple's runtime.
#[test]
fn same_inputs_give_a_byte_identical_asset() {
    needs!(Python);
    let dir = fixture("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let mut assets = Vec::new();
    for name in ["a.aimodel", "b.aimodel"] {
        let asset = tmp.path().join(name);
        convert(&dir, &asset, &["--data-free", "--nbits", "8"]);
        assets.push(hf2coreml_testkit::files_under(&asset).unwrap());
    }
    let names: Vec<_> = assets[0].keys().map(|p| p.file_name().unwrap()).collect();
    assert_eq!(names, ["main.hash", "main.mlirb", "metadata.json"]);
    for (path, bytes) in &assets[0] {
        assert!(
            assets[1].get(path) == Some(bytes),
            "{} differs between two saves",
            path.display()
        );
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&assets[0][Path::new("metadata.json")]).unwrap();
    let stamp = meta["creationDate"].as_str().unwrap();
    assert!(stamp.len() == 16 && stamp.ends_with("T000000Z"), "{stamp}");
    let o = hf2coreml(&[
        "validate",
        tmp.path().join("a.aimodel").to_str().unwrap(),
        "--against",
        dir.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn validate_runs_a_palettized_asset_on_apples_runtime() {
    needs!(Python);
    let dir = fixture("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let asset = tmp.path().join("a.aimodel");
    let package = tmp.path().join("q.mlpackage");
    convert(&dir, &asset, &["--recipe", "ios18-4bit", "--data-free"]);
    let o = hf2coreml(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        package.to_str().unwrap(),
        "--max-seq-len",
        "64",
        "--recipe",
        "ios18-4bit",
        "--data-free",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report = |p: &Path| -> serde_json::Value {
        let o = hf2coreml(&[
            "validate",
            p.to_str().unwrap(),
            "--against",
            dir.to_str().unwrap(),
            "--gate",
            "kl_mean<=100",
            "--json",
        ]);
        serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("no report ({e}): {}", String::from_utf8_lossy(&o.stderr)))
    };
    let a = report(&asset);
    let p = report(&package);
    assert_eq!(a["runtime"], "Apple Core AI runtime (coreai-core)");
    assert!(p.get("runtime").is_none());
    assert!(a["contract"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["ok"] == true));
    let kl = |r: &serde_json::Value| r["behaviour"]["kl_mean"].as_f64().unwrap();
    eprintln!("KL asset {} package {}", kl(&a), kl(&p));
    assert!(
        (kl(&a) - kl(&p)).abs() <= 0.05 * kl(&p).max(1e-3),
        "{a} {p}"
    );
}

#[test]
fn run_generates_from_an_asset() {
    needs!(Python);
    let dir = fixture("phi3");
    let tmp = tempfile::tempdir().unwrap();
    let asset = tmp.path().join("p.aimodel");
    convert(&dir, &asset, &["--keep-fp16", "*"]);
    // `inspect` describes it as Apple's runtime loads it.
    let o = hf2coreml(&["inspect", asset.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["functions"][0]["name"], "main");
    let inputs: Vec<&str> = s["functions"][0]["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        inputs,
        ["input_ids", "position", "key_cache", "value_cache"]
    );
    assert!(s["user_defined"]["hf2coreml.contract"].is_string());
    // The fixture has no tokenizer: `run` takes token ids.
    let o = hf2coreml(&[
        "run",
        asset.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `--prefill-len` on Core AI: one asset with `prefill` (8 tokens a call, its last row's
/// logits) and `decode`, the weights stored once; Apple's runtime runs both, `validate` holds
/// prefill to decode, and `run` feeds the prompt through prefill.
#[test]
fn a_prefill_and_decode_asset_runs_both_functions_on_apples_runtime() {
    needs!(Python);
    let dir = fixture("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let (mf, one) = (
        tmp.path().join("mf.aimodel"),
        tmp.path().join("one.aimodel"),
    );
    let fp16 = ["--keep-fp16", "*"];
    convert(&dir, &mf, &[&fp16[..], &["--prefill-len", "8"]].concat());
    convert(&dir, &one, &fp16);
    let o = hf2coreml(&["inspect", mf.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut names: Vec<&str> = s["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["decode", "prefill"], "{s:#}");
    let bytes = |p: &Path| hf2coreml::fsutil::dir_bytes(p).unwrap();
    eprintln!(
        "asset bytes: prefill + decode {} vs one function {}",
        bytes(&mf),
        bytes(&one)
    );
    // Weights held twice would nearly double the asset; what a second function adds is its
    // ops and its few Q-dependent constants (22 KB of 247 KB on this fixture).
    assert!(
        (bytes(&mf) - bytes(&one)) * 4 < bytes(&one),
        "{} vs {}",
        bytes(&mf),
        bytes(&one)
    );

    let o = hf2coreml(&[
        "validate",
        mf.to_str().unwrap(),
        "--against",
        dir.to_str().unwrap(),
        "--json",
    ]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no report ({e}): {}", String::from_utf8_lossy(&o.stderr)));
    let items = r["contract"].as_array().unwrap();
    for i in items {
        if i["what"].as_str().unwrap().starts_with("prefill") {
            eprintln!("{i}");
        }
        assert_eq!(i["ok"], true, "{i}");
    }
    assert!(
        items
            .iter()
            .filter(|i| i["what"].as_str().unwrap().starts_with("prefill (Q=8)"))
            .count()
            == 2,
        "{r:#}"
    );
    assert_eq!(o.status.code(), Some(0), "{r:#}");

    let o = hf2coreml(&[
        "run",
        mf.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3,4,5,6,7,8,9,10,11",
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(run["timing"]["prefill_calls"], 2, "{run:#}");
    assert_eq!(run["timing"]["decode_calls"], 2, "{run:#}");
}

#[test]
fn settings_the_backend_does_not_build_are_refused_before_work() {
    needs!(Python);
    let dir = fixture("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let d = dir.to_str().unwrap();
    let asset = tmp.path().join("x.aimodel");
    let a = asset.to_str().unwrap();
    let pkg = tmp.path().join("x.mlpackage");
    for (args, says) in [
        (
            vec![
                "convert",
                d,
                "-o",
                a,
                "--target",
                "coreai",
                "--kv-cache",
                "state",
            ],
            "--kv-cache state",
        ),
        (
            vec![
                "convert",
                d,
                "-o",
                pkg.to_str().unwrap(),
                "--target",
                "coreai",
            ],
            "must end in .aimodel",
        ),
        (vec!["convert", d, "-o", a], "must end in .mlpackage"),
    ] {
        let o = hf2coreml(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!asset.exists() && !pkg.exists(), "{args:?} left an output");
    }
}

#[test]
fn gemma3_big_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers("gemma3_big");
}

#[test]
fn phi3_longrope_fp16_asset_matches_transformers() {
    needs!(Python);
    fp16_matches_transformers("phi3_longrope");
}
