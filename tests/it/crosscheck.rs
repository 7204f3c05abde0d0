//! `validate --cross-check coreai`: the saved package's program replayed on Apple's Core AI
//! runtime and compared with hf2coreml's interpreter, over the evaluation tokens and op by op
//! at the position where the two differ most.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hf2coreml_testkit::python_env;

use crate::support::needs;

const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/hf/{arch}"))
}

fn hf2coreml(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("HF2COREML_PYTHON_ENV", python_env())
        .output()
        .unwrap()
}

fn convert(dir: &Path, out: &Path, flags: &[&str]) {
    let mut args = vec![
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--max-seq-len",
        "64",
    ];
    args.extend_from_slice(flags);
    let o = hf2coreml(&args);
    assert!(
        o.status.success(),
        "convert {flags:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `validate --cross-check coreai --json` of `pkg`: the report (whatever the verdict).
fn cross_check(pkg: &Path, dir: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "validate",
        pkg.to_str().unwrap(),
        "--against",
        dir.to_str().unwrap(),
        "--cross-check",
        "coreai",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = hf2coreml(&args);
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "no report ({e}), exit {:?}: {}",
            o.status.code(),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

/// The two runtimes agree on the logits as the targets ask, and no op differs beyond
/// fp16 rounding at the probed position.
fn assert_agree(what: &str, r: &serde_json::Value) {
    let x = &r["cross_check"];
    let between = &x["coreai_vs_interpreter"];
    let kl = between["kl_mean"].as_f64().unwrap();
    let top1 = between["top1"].as_f64().unwrap();
    let probe = &x["probe"];
    eprintln!(
        "{what}: KL(Core AI ‖ interpreter) {kl:.2e}, top-1 {top1:.3}; vs reference: interpreter \
         KL {:.2e}, Core AI KL {:.2e}; probe at {}: {} values, largest rel {:.2e} ({})",
        x["interpreter_vs_reference"]["kl_mean"].as_f64().unwrap(),
        x["coreai_vs_reference"]["kl_mean"].as_f64().unwrap(),
        probe["position"],
        probe["compared"],
        probe["largest"][0]["rel_rms"].as_f64().unwrap_or(0.0),
        probe["largest"][0]["op"],
    );
    assert!(kl <= 1e-3 && top1 >= 0.95, "{what}: {x:#}");
    assert!(
        x["decisive_top1"].as_f64().unwrap() >= 0.99,
        "{what}: {x:#}"
    );
    assert_eq!(x["passed"], true, "{what}: {x:#}");
    assert!(
        probe["compared"].as_u64().unwrap() > 50,
        "{what}: {probe:#}"
    );
    assert_eq!(probe["beyond_count"], 0, "{what}: {probe:#}");
    assert_eq!(r["passed"], true, "{what}");
    assert_eq!(r["cross_check_ok"], true, "{what}");
}

fn fp16_runtimes_agree(arch: &str) {
    let dir = fixture(arch);
    let tmp = tempfile::tempdir().unwrap();
    let pkg = tmp.path().join(format!("{arch}.mlpackage"));
    convert(&dir, &pkg, &["--keep-fp16", "*"]);
    let r = cross_check(&pkg, &dir, &[]);
    assert_agree(arch, &r);
}

#[test]
fn gemma3_runtimes_agree_in_fp16() {
    needs!(Python);
    fp16_runtimes_agree("gemma3");
}

#[test]
fn phi3_runtimes_agree_in_fp16() {
    needs!(Python);
    fp16_runtimes_agree("phi3");
}

#[test]
fn phi3_partial_rotary_runtimes_agree_in_fp16() {
    needs!(Python);
    fp16_runtimes_agree("phi3_partial");
}

#[test]
fn qwen3_runtimes_agree_in_fp16() {
    needs!(Python);
    fp16_runtimes_agree("qwen3");
}

#[test]
fn smollm3_runtimes_agree_in_fp16() {
    needs!(Python);
    fp16_runtimes_agree("smollm3");
}

/// Palettized weights cross over as their tables and packed indices, and Apple's runtime
/// decodes them: an iOS17 per-tensor 4-bit package and an iOS18 one with grouped tables and
/// per-row scales (and, as iOS18 builds by default, prefill and decode functions).
#[test]
fn runtimes_agree_on_palettized_packages() {
    needs!(Python);
    let dir = fixture("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    for (name, flags) in [
        ("ios17", vec!["--recipe", "data-free-4bit"]),
        ("ios18", vec!["--recipe", "ios18-4bit", "--data-free"]),
    ] {
        let pkg = tmp.path().join(format!("{name}.mlpackage"));
        convert(&dir, &pkg, &flags);
        let r = cross_check(&pkg, &dir, &["--gate", "kl_mean<=100"]);
        assert_agree(name, &r);
        // The iOS18 package has prefill and decode: decode, the scored function, is replayed.
        let function = if name == "ios18" { "decode" } else { "main" };
        assert_eq!(r["cross_check"]["function"], function, "{name}");
    }
}

#[test]
fn what_cannot_be_cross_checked_is_refused_before_work() {
    needs!(Python);
    let dir = fixture("qwen3");
    let d = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let pkg = tmp.path().join("q.mlpackage");
    let asset = tmp.path().join("a.aimodel");
    let state = tmp.path().join("s.mlpackage");
    convert(&dir, &pkg, &["--keep-fp16", "*"]);
    convert(&dir, &asset, &["--keep-fp16", "*", "--target", "coreai"]);
    convert(
        &dir,
        &state,
        &[
            "--keep-fp16",
            "*",
            "--target",
            "ios18",
            "--kv-cache",
            "state",
        ],
    );
    for (path, extra, says) in [
        (&asset, vec![], "already runs on Apple's runtime"),
        (&state, vec![], "keeps its cache in a state"),
        (&pkg, vec!["--compute", "f32"], "drop --compute f32"),
    ] {
        let mut args = vec![
            "validate",
            path.to_str().unwrap(),
            "--against",
            d,
            "--cross-check",
            "coreai",
        ];
        args.extend(extra);
        let o = hf2coreml(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?} printed a report");
    }
}
