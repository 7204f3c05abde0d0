//! `validate` on the real model (SmolLM2-135M-Instruct from `make model`): an 8-bit package
//! passes its default gates, and the same package with one LUT entry corrupted in weight.bin
//! fails (exit 1) — validation reads what was saved, not what was meant.

use std::path::Path;

use hf2coreml::mlpackage::proto::value::Value as ValueKind;
use hf2coreml::mlpackage::MlPackage;

use crate::support::{convert, needs, Cli};

/// Tokens of the evaluation text interpreted per validation (the 30-layer graph runs per token).
const EVAL_TOKENS: &str = "24";
/// A small S keeps the caches and attention cheap; the contract is the same at any S.
const MAX_SEQ_LEN: &str = "64";
/// Mean KL bound for the 8-bit package: the 8-bit gate is 0.02, ten times what 8-bit LUTs
/// measure (0.0021 over 384 tokens; 0.0033 over these 24, data-free so
/// deterministic); 2.4× the measured value catches an 8-bit package that degraded without
/// failing its gate.
const MAX_KL_MEAN_8BIT: f64 = 0.008;

fn validate(pkg: &Path, model: &Path) -> (Option<i32>, serde_json::Value, String) {
    let out = Cli::new()
        .args(["validate", pkg.to_str().unwrap(), "--against"])
        .arg(model)
        .args(["--max-tokens", EVAL_TOKENS, "--json"])
        .output();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn eight_bit_package_passes_and_a_corrupted_lut_fails() {
    needs!(Model, Python);
    let model = hf2coreml_testkit::model_dir();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("smol8.mlpackage");
    convert(&model, &pkg)
        .args([
            "--max-seq-len",
            MAX_SEQ_LEN,
            "--recipe",
            "data-free-4bit",
            "--nbits",
            "8",
        ])
        .ok();
    assert!(root.path().join("smol8.tokenizer_config.json").is_file());

    let (code, report, err) = validate(&pkg, &model);
    assert_eq!(code, Some(0), "{err}\n{report:#}");
    // The 8-bit default gates, each evaluated and passed.
    let gates = report["gates"].as_array().unwrap();
    let names: Vec<&str> = gates.iter().map(|g| g["gate"].as_str().unwrap()).collect();
    assert_eq!(names, ["kl_mean<=0.02", "top1>=0.93", "ppl_ratio<=1.03"]);
    assert!(gates.iter().all(|g| g["passed"] == true), "{gates:#?}");
    // The measured quality, not only the gates.
    let kl = report["behaviour"]["kl_mean"].as_f64().unwrap();
    eprintln!(
        "8-bit over {EVAL_TOKENS} tokens: kl_mean {kl}, top1 {}",
        report["behaviour"]["top1"]
    );
    assert!(kl < MAX_KL_MEAN_8BIT, "kl_mean {kl}");
    // Every contract item checked and met: names, shapes, dtypes and dimensions.
    let contract = report["contract"].as_array().unwrap();
    assert!(contract.len() >= 12, "{contract:#?}");
    for what in [
        "layers",
        "kv heads",
        "head_dim",
        "vocab",
        "input count",
        "output count",
    ] {
        assert!(
            contract
                .iter()
                .any(|c| c["what"] == what && c["ok"] == true),
            "contract item `{what}`: {contract:#?}"
        );
    }
    assert!(contract.iter().all(|c| c["ok"] == true), "{contract:#?}");
    // 7 projections × 30 layers decoded from the package, plus the embedding and norms. A
    // palettized projection has a finite SNR; a tensor kept fp16 is exact (JSON null for +∞,
    // with no error at all).
    let weights = report["weights"].as_array().unwrap();
    assert!(weights.len() >= 210, "{} weights checked", weights.len());
    for w in weights {
        let name = w["tensor"].as_str().unwrap();
        match w["snr_db"].as_f64() {
            Some(snr) => assert!(snr > 30.0, "{w}"),
            None => {
                assert!(
                    !name.ends_with("_proj.weight"),
                    "a palettized tensor is exact? {w}"
                );
                assert_eq!(w["max_abs_error"].as_f64(), Some(0.0), "{w}");
            }
        }
    }
    let projections = weights
        .iter()
        .filter(|w| w["tensor"].as_str().unwrap().ends_with("_proj.weight"))
        .count();
    assert_eq!(projections, 210);

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
