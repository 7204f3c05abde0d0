//! The 2026 architectures on checkpoints written by transformers itself
//! (python/testgen/hf_models.py → tests/fixtures/hf/<arch>/): the Rust reference matches
//! transformers' float32 logits, and converted packages pass validate's gates against the
//! checkpoint (all-fp16: the fp16 gates; calibrated 4-bit: the 4-bit gates), as the Llama-family
//! fixtures do in validate_tiny.rs.

use std::path::{Path, PathBuf};
use std::process::Command;

use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::{BackendChoice, Reference};
use hf2coreml::testing::python_env;

const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/hf/{arch}"))
}

struct Expected {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn expected(dir: &Path) -> Expected {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tokens = j["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let logits = j["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    Expected { tokens, logits }
}

/// The Rust reference (plain f32 forward) against transformers' logits at every position:
/// max |Δ| ≤ 1e-4 of the largest |logit|.
fn reference_matches_transformers(arch: &str) {
    let dir = fixture(arch);
    let want = expected(&dir);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut r = Reference::load_with(&ckpt, BackendChoice::Auto).unwrap();
    let got = r.logits_all(&want.tokens).unwrap();
    assert_eq!(got.len(), want.logits.len());
    let scale = want
        .logits
        .iter()
        .flatten()
        .fold(0f32, |m, v| m.max(v.abs()));
    let mut worst = 0f32;
    for (g, w) in got.iter().zip(&want.logits) {
        for (a, b) in g.iter().zip(w) {
            worst = worst.max((a - b).abs());
        }
    }
    eprintln!("{arch}: max |Δ| {worst:e} (largest |logit| {scale})");
    assert!(
        worst <= 1e-4 * scale,
        "{arch}: max |Δ| {worst} > 1e-4 × {scale}"
    );
    // The step API (cache continued token by token) agrees with the whole-sequence pass.
    for (i, &t) in want.tokens.iter().enumerate().take(6) {
        let row = r.step(&[t], i).unwrap();
        let d = row
            .iter()
            .zip(&want.logits[i])
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-4 * scale, "{arch}: step {i} differs by {d}");
    }
}

fn convert(dir: &Path, out: &Path, flags: &[&str]) {
    let o = Command::new(BIN)
        .arg("convert")
        .arg(dir)
        .arg("-o")
        .arg(out)
        .args(["--max-seq-len", "128"])
        .args(flags)
        .env("HF2COREML_PYTHON_ENV", python_env())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "convert {flags:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn validate(pkg: &Path, dir: &Path) -> (Option<i32>, serde_json::Value, String) {
    let o = Command::new(BIN)
        .arg("validate")
        .arg(pkg)
        .arg("--against")
        .arg(dir)
        .arg("--json")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let report = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {stderr}"));
    (o.status.code(), report, stderr)
}

/// The all-fp16 package passes every gate against the checkpoint (exit 0); the calibrated
/// 4-bit package passes every 4-bit gate when `q4_passes`, else the KL gate.
///
/// Open (README, "Architectures"): on the random Qwen3 fixture the calibrated 4-bit package
/// misses the top-1 gate (measured 0.836 against 0.85; KL 0.088 against 0.2), so validate exits
/// 1 for it; the test holds what is measured.
fn packages_validate(arch: &str, q4_passes: bool) {
    let dir = fixture(arch);
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("fp16.mlpackage");
    convert(&dir, &pkg, &["--keep-fp16", "*"]);
    let (code, report, err) = validate(&pkg, &dir);
    let metric = |r: &serde_json::Value, m: &str| r["behaviour"][m].as_f64().unwrap();
    eprintln!(
        "{arch} fp16: kl {} top1 {}",
        metric(&report, "kl_mean"),
        metric(&report, "top1")
    );
    assert_eq!(code, Some(0), "{arch} fp16: {err}\n{report:#}");
    assert!(metric(&report, "kl_mean") < 1e-3, "{report:#}");
    let gates = report["gates"].as_array().unwrap();
    assert!(
        !gates.is_empty() && gates.iter().all(|g| g["passed"] == true),
        "{report:#}"
    );

    let pkg = out.path().join("q4.mlpackage");
    convert(&dir, &pkg, &["--recipe", "calibrated-4bit"]);
    let (code, report, err) = validate(&pkg, &dir);
    let (kl, top1) = (metric(&report, "kl_mean"), metric(&report, "top1"));
    eprintln!("{arch} q4: exit {code:?} kl {kl} top1 {top1}");
    if q4_passes {
        assert_eq!(code, Some(0), "{arch} q4: {err}\n{report:#}");
    }
    let kl_gate = report["gates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["gate"].as_str().is_some_and(|n| n.starts_with("kl_mean")))
        .expect("a KL gate");
    assert_eq!(kl_gate["passed"], true, "{report:#}");
    assert!(kl > 1e-4 && top1 > 0.7, "a real 4-bit package: {report:#}");
}

#[test]
fn qwen3_reference_matches_transformers() {
    let spec = Checkpoint::open(fixture("qwen3")).unwrap().spec().clone();
    assert!(spec.qk_norm && spec.tie_word_embeddings && !spec.attention_bias);
    assert_eq!(
        spec.head_dim, 32,
        "explicit head_dim, not hidden/heads = 16"
    );
    reference_matches_transformers("qwen3");
}

#[test]
fn qwen3_packages_validate() {
    packages_validate("qwen3", false);
}

#[test]
fn smollm3_reference_matches_transformers() {
    let spec = Checkpoint::open(fixture("smollm3")).unwrap().spec().clone();
    assert_eq!(spec.no_rope_layers, vec![1], "every second block is NoPE");
    reference_matches_transformers("smollm3");
}

#[test]
fn smollm3_packages_validate() {
    packages_validate("smollm3", true);
}
