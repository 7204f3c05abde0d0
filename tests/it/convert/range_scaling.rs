//! fp16 range safety by construction, measured: a tiny model whose residual stream leaves fp16's
//! range (its squares overflow 65,504 in the RMSNorms) gets a residual scale α < 1, and its fp16
//! package then computes what the f32 reference computes (KL bounded, not only top-1). The same
//! model converted with `--no-range-scaling` (α forced to 1) fails validation.

use std::path::Path;

use hf2coreml::mil::contract::{self, Contract};
use hf2coreml::mlpackage::MlPackage;
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, Cli};

/// Mean KL allowed between the scaled fp16 package and the f32 reference, as measured
/// on this fixture: 7.3e-6 with α = 1/128; the unscaled package (α = 1) 1.12, top-1 0.00.
const MAX_KL_MEAN: f64 = 1e-4;

/// Every conversion here: all-fp16, quiet.
const FLAGS: [&str; 5] = ["--max-seq-len", "64", "--keep-fp16", "*", "-q"];

fn validate(pkg: &Path, dir: &Path) -> (Option<i32>, serde_json::Value) {
    let o = Cli::new()
        .arg("validate")
        .arg(pkg)
        .arg("--against")
        .arg(dir)
        .args(["--json", "--max-tokens", "48"])
        .output();
    let report = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no report ({e}): {}", String::from_utf8_lossy(&o.stderr)));
    (o.status.code(), report)
}

fn residual_scale(pkg: &Path) -> f64 {
    let p = MlPackage::open(pkg).unwrap();
    let c: Contract =
        serde_json::from_str(&p.description().user_defined[contract::METADATA_KEY]).unwrap();
    c.scaling["residual_scale"].as_f64().unwrap()
}

#[test]
fn a_residual_beyond_fp16_is_scaled_and_stays_exact() {
    needs!(Python);
    let model = TinyModel {
        // Weights 25× the fixtures' usual scale: the residual stream reaches the thousands. The
        // final norm is turned down so the logits stay O(1) as a trained model's (with the
        // embedding at this scale they would reach ±100, and perplexities 1e66).
        scale: 2.0,
        logit_gain: 0.1,
        ..TinyModel::llama()
    };
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();

    let scaled = root.path().join("scaled.mlpackage");
    convert(dir.path(), &scaled).args(FLAGS).ok();
    let alpha = residual_scale(&scaled);
    assert!(alpha < 1.0, "the fixture must need scaling: α = {alpha}");
    let (code, report) = validate(&scaled, dir.path());
    let kl = report["behaviour"]["kl_mean"].as_f64().unwrap();
    eprintln!(
        "α = {alpha}: kl_mean {kl}, top1 {}",
        report["behaviour"]["top1"]
    );
    assert_eq!(code, Some(0), "{report:#}");
    assert!(kl <= MAX_KL_MEAN, "kl_mean {kl}");

    let unscaled = root.path().join("unscaled.mlpackage");
    convert(dir.path(), &unscaled)
        .args(FLAGS)
        .args(["--no-range-scaling"])
        .ok();
    assert_eq!(residual_scale(&unscaled), 1.0);
    let (code, report) = validate(&unscaled, dir.path());
    eprintln!(
        "α = 1: kl_mean {}, top1 {}",
        report["behaviour"]["kl_mean"], report["behaviour"]["top1"]
    );
    assert_eq!(
        code,
        Some(1),
        "an overflowing package must fail: {report:#}"
    );
}
