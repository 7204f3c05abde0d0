//! `validate`'s contract check (a) can fail: a package whose description or contract metadata
//! disagrees with the checkpoint or the contract exits 1 and names the item, while the same
//! package untouched passes. The packages are edited the way protobuf merges: a message appended
//! to model.mlmodel overrides the map entry and adds to repeated fields, leaving the program as
//! it was (so the logits still agree and only the contract can fail).

use std::path::Path;

use hf2coreml::mil::contract;
use hf2coreml::mlpackage::proto;
use hf2coreml_testkit::TinyModel;
use prost::Message;

use crate::support::{convert, copy_dir, needs, Cli};

fn validate(pkg: &Path, dir: &Path) -> (Option<i32>, serde_json::Value) {
    let o = Cli::new()
        .arg("validate")
        .arg(pkg)
        .arg("--against")
        .arg(dir)
        .args(["--json", "--max-tokens", "16"])
        .output();
    let report = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no report ({e}): {}", String::from_utf8_lossy(&o.stderr)));
    (o.status.code(), report)
}

/// Append `description` to the package's model.mlmodel (protobuf merges it into the original).
fn append_description(pkg: &Path, description: proto::ModelDescription) {
    let path = pkg.join("Data/com.apple.CoreML/model.mlmodel");
    let mut bytes = std::fs::read(&path).unwrap();
    let patch = proto::Model {
        specification_version: 0,
        description: Some(description),
        ml_program: None,
    };
    bytes.extend(patch.encode_to_vec());
    std::fs::write(&path, bytes).unwrap();
}

fn failed_items(report: &serde_json::Value) -> Vec<String> {
    report["contract"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ok"] == false)
        .map(|c| c["what"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_package_that_breaks_its_contract_fails_validation() {
    needs!(Python);
    let dir = TinyModel::llama().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "32", "--keep-fp16", "*", "-q"])
        .ok();
    let (code, report) = validate(&pkg, dir.path());
    assert_eq!(code, Some(0), "{report:#}");
    let items = report["contract"].as_array().unwrap();
    assert!(items.len() >= 12, "{items:#?}");
    assert!(failed_items(&report).is_empty());

    // 1. The contract metadata claims a contract version this tool does not write.
    let copy = root.path().join("version.mlpackage");
    copy_dir(&pkg, &copy);
    let mut c: serde_json::Value = serde_json::from_str(
        &hf2coreml::mlpackage::MlPackage::open(&pkg)
            .unwrap()
            .description()
            .user_defined[contract::METADATA_KEY],
    )
    .unwrap();
    c["version"] = 99.into();
    append_description(
        &copy,
        proto::ModelDescription {
            metadata: Some(proto::Metadata {
                user_defined: [(contract::METADATA_KEY.to_string(), c.to_string())].into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (code, report) = validate(&copy, dir.path());
    assert_eq!(code, Some(1), "{report:#}");
    assert!(
        failed_items(&report) == ["contract version"],
        "{:?}",
        failed_items(&report)
    );

    // 2. The description declares an output the contract does not have.
    let copy = root.path().join("outputs.mlpackage");
    copy_dir(&pkg, &copy);
    append_description(
        &copy,
        proto::ModelDescription {
            output: vec![proto::FeatureDescription {
                name: "extra".into(),
                short_description: String::new(),
                r#type: Some(proto::FeatureType {
                    multi_array_type: Some(proto::ArrayFeatureType {
                        shape: vec![1, 64],
                        data_type: 65552, // FLOAT16
                    }),
                    state_type: None,
                    is_optional: false,
                }),
            }],
            ..Default::default()
        },
    );
    let (code, report) = validate(&copy, dir.path());
    assert_eq!(code, Some(1), "{report:#}");
    assert_eq!(failed_items(&report), ["output count"]);
}
