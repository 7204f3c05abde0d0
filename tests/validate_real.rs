//! `validate` on the real model (SmolLM2-135M-Instruct from `make model`): an 8-bit package
//! passes its default gates, and the same package with one LUT entry corrupted in weight.bin
//! fails (exit 1) — validation reads what was saved, not what was meant.

use std::path::Path;
use std::process::Command;

use hf2coreml::mlpackage::proto::value::Value as ValueKind;
use hf2coreml::mlpackage::MlPackage;
use hf2coreml::testing::python_env;

const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");

/// Tokens of the evaluation text interpreted per validation (the 30-layer graph runs per token).
const EVAL_TOKENS: &str = "24";
/// A small S keeps the caches and attention cheap; the contract is the same at any S.
const MAX_SEQ_LEN: &str = "64";

fn validate(pkg: &Path, model: &Path) -> (Option<i32>, serde_json::Value, String) {
    let out = Command::new(BIN)
        .args(["validate", pkg.to_str().unwrap(), "--against"])
        .arg(model)
        .args(["--max-tokens", EVAL_TOKENS, "--json"])
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn eight_bit_package_passes_and_a_corrupted_lut_fails() {
    let model = hf2coreml::testing::model_dir();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("smol8.mlpackage");
    let out = Command::new(BIN)
        .arg("convert")
        .arg(&model)
        .arg("-o")
        .arg(&pkg)
        .args([
            "--max-seq-len",
            MAX_SEQ_LEN,
            "--recipe",
            "data-free-4bit",
            "--nbits",
            "8",
        ])
        .arg("--python-env")
        .arg(python_env())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "convert failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(root.path().join("smol8.tokenizer_config.json").is_file());

    let (code, report, err) = validate(&pkg, &model);
    assert_eq!(code, Some(0), "{err}\n{report:#}");
    assert!(report["gates"]
        .as_array()
        .unwrap()
        .iter()
        .all(|g| g["passed"] == true));
    assert!(report["contract"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["ok"] == true));
    // 7 projections × 30 layers decoded from the package, plus the embedding and norms.
    let weights = report["weights"].as_array().unwrap();
    assert!(weights.len() >= 210, "{} weights checked", weights.len());
    assert!(weights
        .iter()
        .all(|w| w["snr_db"].as_f64().unwrap_or(f64::INFINITY) > 30.0));

    // Corrupt one entry of layer 0's v_proj LUT: the entry in the middle of the sorted table,
    // which the many near-zero weights use.
    let (offset, lut_len) = {
        let p = MlPackage::open(&pkg).unwrap();
        let main = p.main_function().unwrap();
        let op = main
            .block
            .operations
            .iter()
            .find(|op| {
                op.outputs
                    .first()
                    .is_some_and(|o| o.name == "model_layers_0_self_attn_v_proj_weight")
            })
            .expect("v_proj weight op");
        assert_eq!(op.r#type, "constexpr_lut_to_dense");
        match &op.attributes["lut"].value {
            Some(ValueKind::BlobFileValue(b)) => (b.offset as usize, 256usize),
            other => panic!("LUT not in weight.bin: {other:?}"),
        }
    };
    let wb = pkg.join("Data/com.apple.CoreML/weights/weight.bin");
    let mut bytes = std::fs::read(&wb).unwrap();
    // Blob record: 64-byte header, then the fp16 LUT data.
    let entry = offset + 64 + 2 * (lut_len / 2);
    bytes[entry..entry + 2].copy_from_slice(&half::f16::from_f32(8.0).to_le_bytes());
    std::fs::write(&wb, &bytes).unwrap();

    let (code, report, err) = validate(&pkg, &model);
    assert_eq!(
        code,
        Some(1),
        "a corrupted LUT must fail validation: {err}\n{report:#}"
    );
    let v = report["weights"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["tensor"] == "model.layers.0.self_attn.v_proj.weight")
        .unwrap();
    assert!(
        v["snr_db"].as_f64().unwrap_or(f64::NEG_INFINITY) < 20.0,
        "{v}"
    );
}
