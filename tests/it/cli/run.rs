//! `hf2coreml run` at the process boundary: argument errors and the platform check exit with
//! the documented codes, never a panic.

use crate::support::hf2coreml;

#[test]
fn a_missing_package_is_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = dir.path().join("nope.mlpackage");
    let out = hf2coreml(&["run", pkg.to_str().unwrap(), "--prompt-ids", "1,2,3"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope.mlpackage"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_text_prompt_without_a_tokenizer_names_the_expected_file() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = dir.path().join("m.mlpackage");
    let out = hf2coreml(&["run", pkg.to_str().unwrap(), "--prompt", "hello"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("m.tokenizer.json"), "{err}");
}

#[test]
fn conflicting_or_malformed_arguments_exit_2() {
    for args in [
        &["run", "m.mlpackage"][..],
        &["run", "m.mlpackage", "--prompt", "a", "--prompt-ids", "1"],
        &["run", "m.mlpackage", "--prompt-ids", "1,x"],
        &["run", "m.mlpackage", "--prompt-ids", "1", "--chat"],
        &[
            "run",
            "m.mlpackage",
            "--prompt-ids",
            "1",
            "--compute",
            "int8",
        ],
        &[
            "run",
            "m.mlpackage",
            "--prompt-ids",
            "1",
            "--temperature",
            "-1",
        ],
        &["run", "m.mlpackage", "--prompt-ids", "1", "--top-p", "2"],
    ] {
        let out = hf2coreml(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
