//! `validate` end to end on each tiny architecture (Llama GQA tied, Qwen2 biases, Mistral
//! explicit head_dim): the all-fp16 package passes the fp16 gates, a calibrated 4-bit package
//! passes the 4-bit defaults, and a package whose LUT entry was flipped fails (exit 1).
//! The checkpoints ship no tokenizer, so the evaluation text goes in as bytes.

use std::path::{Path, PathBuf};

use hf2coreml::mlpackage::proto::value::Value as ValueKind;
use hf2coreml::mlpackage::MlPackage;
use hf2coreml_testkit::TinyModel;

use crate::support::{cli, convert, needs, Cli};

/// Next-token distributions peaked like a trained model's: with the fixtures' near-uniform
/// logits, top-1 agreement would measure ties, not the package.
fn peaked(model: TinyModel) -> TinyModel {
    TinyModel {
        logit_gain: 4.0,
        ..model
    }
}

fn validate(pkg: &Path, dir: &Path) -> (Option<i32>, serde_json::Value, String) {
    let o = Cli::new()
        .arg("validate")
        .arg(pkg)
        .arg("--against")
        .arg(dir)
        .arg("--json")
        .output();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let report = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {stderr}"));
    (o.status.code(), report, stderr)
}

fn metric(report: &serde_json::Value, name: &str) -> f64 {
    report["behaviour"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("no behaviour.{name} in {report:#}"))
}

fn check(model: TinyModel) {
    let model = peaked(model);
    let dir = model.write_temp().unwrap();
    let out = tempfile::tempdir().unwrap();

    // Convert with `flags`, validate, and require a pass (exit 0).
    let passing = |name: &str, flags: &[&str]| {
        let pkg = out.path().join(format!("{name}.mlpackage"));
        convert(dir.path(), &pkg)
            .args(["--max-seq-len", "256"])
            .args(flags)
            .ok();
        let (code, report, err) = validate(&pkg, dir.path());
        eprintln!(
            "{:?} {name}: kl {} top1 {}",
            model.architecture,
            metric(&report, "kl_mean"),
            metric(&report, "top1")
        );
        assert_eq!(code, Some(0), "{name} package: {err}\n{report:#}");
        (pkg, report)
    };

    let (_, report) = passing("fp16", &["--keep-fp16", "*"]);
    assert!(metric(&report, "kl_mean") < 1e-3, "{report:#}");
    assert!(report["text"]
        .as_str()
        .is_some_and(|t| t.contains("byte tokens")));

    let (q4, report) = passing("q4", &["--recipe", "calibrated-4bit"]);
    let gates = report["gates"].as_array().unwrap();
    assert!(
        gates.len() == 3 && gates.iter().all(|g| g["passed"] == true),
        "{report:#}"
    );

    // Flip the largest entry of the first palettized tensor's LUT.
    let (offset, entries) = {
        let p = MlPackage::open(&q4).unwrap();
        let main = p.main_function().unwrap();
        let op = main
            .block
            .operations
            .iter()
            .find(|op| op.r#type == "constexpr_lut_to_dense")
            .expect("a palettized weight");
        match &op.attributes["lut"].value {
            Some(ValueKind::BlobFileValue(b)) => (b.offset as usize, 16usize),
            other => panic!("LUT not in weight.bin: {other:?}"),
        }
    };
    let wb = q4.join("Data/com.apple.CoreML/weights/weight.bin");
    let mut bytes = std::fs::read(&wb).unwrap();
    // Blob record: a 64-byte header, then the fp16 LUT.
    let last = offset + 64 + 2 * (entries - 1);
    let v = half::f16::from_le_bytes([bytes[last], bytes[last + 1]]);
    bytes[last..last + 2].copy_from_slice(&(-v * half::f16::from_f32(4.0)).to_le_bytes());
    std::fs::write(&wb, &bytes).unwrap();
    let (code, report, err) = validate(&q4, dir.path());
    assert_eq!(
        code,
        Some(1),
        "a flipped LUT entry must fail: {err}\n{report:#}"
    );
}

#[test]
fn llama_packages_validate() {
    needs!(Python);
    check(TinyModel::llama());
}

#[test]
fn qwen2_packages_validate() {
    needs!(Python);
    check(TinyModel::qwen2());
}

#[test]
fn mistral_packages_validate() {
    needs!(Python);
    check(TinyModel::mistral());
}

/// `validate --json` over a few tokens, against `against` or the recorded checkpoint.
fn validate_raw(pkg: &Path, against: Option<&Path>) -> (Option<i32>, String, String) {
    let mut cmd = cli(&["validate", "--json", "--max-tokens", "24"]).arg(pkg);
    if let Some(dir) = against {
        cmd = cmd.arg("--against").arg(dir);
    }
    let o = cmd.output();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The peaked tiny Llama's checkpoint, and its 8-bit package in a directory of its own.
fn peaked_8bit_package() -> (tempfile::TempDir, tempfile::TempDir, PathBuf) {
    let dir = peaked(TinyModel::llama()).write_temp().unwrap();
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "256"])
        .args(["--recipe", "data-free-4bit", "--nbits", "8"])
        .ok();
    (dir, out, pkg)
}

#[test]
fn validate_for_ci_names_its_checkpoint_and_its_verdict() {
    needs!(Python);
    let (dir, _out, pkg) = peaked_8bit_package();

    // Without --against: the checkpoint the report records, and a JSON verdict with a schema.
    let (code, stdout, stderr) = validate_raw(&pkg, None);
    assert_eq!(code, Some(0), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["schema"], "hf2coreml.validate/1");
    assert_eq!(report["passed"], true);
    assert_eq!(report["gates_ok"], true);
    let recorded = std::path::absolute(dir.path()).unwrap();
    assert_eq!(report["checkpoint"], recorded.to_str().unwrap());

    // Against another model's checkpoint: named as such, not a shape error (exit 2).
    let other = TinyModel {
        layers: 3,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let (code, _, err) = validate_raw(&pkg, Some(other.path()));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("was not converted from") && err.contains("layers 2 vs 3"),
        "{err}"
    );

    // A recorded checkpoint that changed since is not silently used.
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace('{', "{\"edited\": true, ")).unwrap();
    let (code, _, err) = validate_raw(&pkg, None);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("has changed since (config.json differs)") && err.contains("--against"),
        "{err}"
    );
}

/// `validate --json` with `--reference-budget SIZE`.
fn validate_budget(pkg: &Path, dir: &Path, budget: &str) -> serde_json::Value {
    let o = Cli::new()
        .args(["validate", "--json", "--reference-budget", budget])
        .arg(pkg)
        .arg("--against")
        .arg(dir)
        .output();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(0),
        "--reference-budget {budget}: {stderr}"
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("no JSON report ({e}): {stderr}"))
}

#[test]
fn a_checkpoint_over_the_reference_budget_is_validated_block_by_block() {
    needs!(Python);
    // A model whose f32 weights exceed the budget (here every model: budget 0) gets
    // the block-by-block reference, and its verdict and metrics are the whole model's.
    let (dir, _out, pkg) = peaked_8bit_package();
    let whole = validate_budget(&pkg, dir.path(), "2GiB");
    let layerwise = validate_budget(&pkg, dir.path(), "0");
    assert_eq!(whole["reference"], "candle-transformers llama", "{whole:#}");
    assert_eq!(
        layerwise["reference"],
        "hf2coreml plain f32, block by block"
    );
    for name in ["kl_mean", "kl_max", "top1", "ppl_ratio"] {
        let (a, b) = (metric(&whole, name), metric(&layerwise, name));
        assert!(
            (a - b).abs() <= 1e-4 * a.abs().max(1e-3),
            "{name}: {a} vs {b}"
        );
    }
    assert!(
        metric(&whole, "kl_mean") > 0.0,
        "8-bit weights differ from the reference"
    );
    // A size that is not one is refused before anything runs.
    let o = Cli::new()
        .args(["validate", "--reference-budget", "lots"])
        .arg(&pkg)
        .output();
    assert_eq!(o.status.code(), Some(2));
}
