//! Safety promises from the README tested through the CLI: pickle-only checkpoints are refused
//! without being opened, and the size caps on config.json and Manifest.json hold (exit 2, the
//! file named, nothing written).

use std::process::{Command, Output};

use hf2coreml::testing::TinyModel;

const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");

fn hf2coreml(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn assert_bad(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn pickle_only_checkpoints_are_refused_unopened() {
    for file in ["pytorch_model.bin", "model.pt", "model.pth", "model.ckpt"] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            TinyModel::llama().config_json().to_string(),
        )
        .unwrap();
        // Not a pickle at all: a loader that opened it would fail differently.
        std::fs::write(dir.path().join(file), b"not a pickle").unwrap();
        let d = dir.path().to_str().unwrap();
        assert_bad(&hf2coreml(&["inspect", d]), &[file, "pickle"]);
        assert_bad(
            &hf2coreml(&["budget", d, "--device", "iphone-15"]),
            &[file, "pickle"],
        );
        let elsewhere = tempfile::tempdir().unwrap();
        let out = elsewhere.path().join("o.mlpackage");
        let o = hf2coreml(&["convert", d, "-o", out.to_str().unwrap()]);
        assert_bad(&o, &[file, "pickle"]);
        assert!(!out.exists());
    }
}

#[test]
fn config_json_over_1_mib_is_refused() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let mut config = TinyModel::llama().config_json();
    // Valid JSON, one byte over the cap.
    let pad = (1usize << 20) - config.to_string().len() + 1 - ",\"pad\":\"\"".len();
    config["pad"] = "x".repeat(pad).into();
    let text = config.to_string();
    assert_eq!(text.len(), (1 << 20) + 1);
    std::fs::write(dir.path().join("config.json"), text).unwrap();
    let o = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert_bad(&o, &["config.json", "too large"]);
    // At the cap exactly it is read (and the unknown field is then judged on its own).
    let mut config = TinyModel::llama().config_json();
    config["pad"] = "x".repeat(pad - 1).into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let o = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("larger than") && !err.contains("too large"),
        "{err}"
    );
}

#[test]
fn manifest_over_1_mib_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    std::fs::create_dir_all(pkg.join("Data/com.apple.CoreML")).unwrap();
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(1 << 20));
    std::fs::write(pkg.join("Manifest.json"), big).unwrap();
    let o = hf2coreml(&["run", pkg.to_str().unwrap(), "--prompt-ids", "1"]);
    assert_bad(&o, &["Manifest.json"]);
}
