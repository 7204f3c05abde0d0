//! `inspect PKG`: a package's functions, inputs, outputs, metadata, contract,
//! ops by kind and weight bytes by storage kind, on our packages, on a chain and on packages
//! coremltools itself wrote (iOS17 and iOS18 LUTs).

use std::path::Path;
use std::process::Command;

use hf2coreml_testkit::{python_env, TinyModel};
use serde_json::Value;

use crate::support::{cli, convert, needs};

fn inspect_json(path: &Path) -> Value {
    let out = cli(&["inspect", "--json"]).arg(path).output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn weight_kinds(v: &Value) -> Vec<(String, u64)> {
    v["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["kind"].as_str().unwrap().to_string(),
                w["bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn our_package_declares_its_contract_io_and_weights() {
    needs!(Python);
    let m = TinyModel::llama();
    let dir = m.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["-q", "--max-seq-len", "32", "--recipe", "data-free-4bit"])
        .ok();
    let v = inspect_json(&pkg);
    assert_eq!(v["schema"], "hf2coreml.package/1");
    assert_eq!(v["spec_version"], 8);
    assert_eq!(v["contract"]["max_seq_len"], 32);
    assert_eq!(v["contract"]["num_layers"], m.layers);
    let inputs: Vec<&str> = v["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        inputs,
        ["input_ids", "position", "key_cache", "value_cache"],
        "{v:#}"
    );
    let f = &v["functions"][0];
    assert_eq!(f["name"], "main");
    assert_eq!(f["opset"], "CoreML7");
    let by_type = f["ops_by_type"].as_object().unwrap();
    let total: u64 = by_type.values().map(|n| n.as_u64().unwrap()).sum();
    assert_eq!(total, f["ops"].as_u64().unwrap());
    // 7 projections per block at 4 bits; the embedding stays fp16.
    assert_eq!(by_type["constexpr_lut_to_dense"], 7 * m.layers as u64);
    let kinds = weight_kinds(&v);
    let lut = kinds
        .iter()
        .find(|(k, _)| k == "constexpr_lut_to_dense 4-bit")
        .unwrap_or_else(|| panic!("{kinds:?}"));
    assert!(kinds.iter().any(|(k, _)| k == "const fp16"), "{kinds:?}");
    // Every blob byte is in weight.bin, and nearly all of weight.bin is blob bytes.
    let weight_bin = std::fs::metadata(pkg.join("Data/com.apple.CoreML/weights/weight.bin"))
        .unwrap()
        .len();
    // weight.bin: a 64-byte header, then per blob a 64-byte header and its data padded to 64.
    let bytes = v["weight_bytes"].as_u64().unwrap();
    let blobs: u64 = v["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["constants"].as_u64().unwrap())
        .sum();
    assert!(
        bytes <= weight_bin && bytes + 64 + 127 * blobs >= weight_bin,
        "{bytes} in {blobs} blobs, weight.bin {weight_bin}"
    );
    assert!(lut.1 > 0);

    // The human form names the same things; recipe options are refused for a package.
    let out = cli(&["inspect"]).arg(&pkg).output();
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "specification 8 (iOS17)",
        "key_cache",
        "constexpr_lut_to_dense 4-bit",
        "contract    v",
    ] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }
    let out = cli(&["inspect", "--nbits", "8"]).arg(&pkg).output();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("recipe options"));
}

#[test]
fn a_chain_is_inspected_part_by_part() {
    needs!(Python);
    let m = TinyModel::llama();
    let dir = m.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    // Each part carries a 1 MiB allowance (tests/chain.rs): 1.1 MB holds one block per part.
    let out = root.path().join("chain.mlpackage");
    convert(dir.path(), &out)
        .args(["-q", "--max-seq-len", "32", "--recipe", "data-free-4bit"])
        .args(["--max-package-size", "1100000"])
        .ok();
    let v = inspect_json(&out);
    let parts = v["parts"].as_array().unwrap();
    assert!(parts.len() >= 2, "{v:#}");
    assert_eq!(parts.len(), v["chain"]["parts"].as_array().unwrap().len());
    assert_eq!(parts[0]["inputs"][0]["name"], "input_ids");
    assert_eq!(parts[1]["inputs"][0]["name"], "hidden_in");
}

#[test]
fn packages_coremltools_wrote_are_read_too() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let py = python_env().join("bin/python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/testgen/mil_cases.py");
    let out = Command::new(py)
        .arg(&script)
        .arg(root.path())
        .args(["lut4", "pal18_n3_g16"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let v = inspect_json(&root.path().join("lut4/model.mlpackage"));
    assert!(v["contract"].is_null());
    assert_eq!(v["spec_version"], 8);
    assert_eq!(v["inputs"][0]["name"], "x");
    assert_eq!(v["inputs"][0]["shape"], serde_json::json!([2, 10]));
    let kinds = weight_kinds(&v);
    assert!(
        kinds
            .iter()
            .any(|(k, _)| k == "constexpr_lut_to_dense 4-bit"),
        "{kinds:?}"
    );

    let v = inspect_json(&root.path().join("pal18_n3_g16/model.mlpackage"));
    assert_eq!(v["spec_version"], 9);
    assert_eq!(v["functions"][0]["opset"], "CoreML8");
    let kinds = weight_kinds(&v);
    assert!(
        kinds
            .iter()
            .any(|(k, _)| k == "constexpr_lut_to_dense 3-bit"),
        "{kinds:?}"
    );
}
