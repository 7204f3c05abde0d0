//! stdout and the terminal: a full stdout is an error (exit 3, one line), not a panic, and bytes
//! from an input that a terminal would act on (escape sequences, bells, bidi overrides) are
//! printed escaped.

use std::ffi::OsStr;

use super::{expect, os, run_bin, tiny_checkpoint};

#[cfg(target_os = "linux")]
#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let cases: Vec<Vec<&OsStr>> = vec![
        vec![os("inspect"), ckpt.as_os_str()],
        vec![os("inspect"), ckpt.as_os_str(), os("--json")],
        vec![os("completions"), os("bash")],
        vec![os("man")],
        vec![os("--help")],
        vec![os("--version")],
        vec![os("convert"), os("--help")],
        vec![
            os("budget"),
            ckpt.as_os_str(),
            os("--device"),
            os("iphone-15"),
        ],
    ];
    for args in cases {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let o = run_bin(&args, Some(full));
        assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
        assert_eq!(o.code, Some(3), "{args:?}: {}", o.stderr);
        assert_eq!(o.stderr.lines().count(), 1, "{args:?}: {}", o.stderr);
        assert!(
            o.stderr
                .starts_with("error: cannot write the results: No space left"),
            "{args:?}: {}",
            o.stderr
        );
    }
}

#[test]
fn control_bytes_from_config_json_are_escaped() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let cfg = ckpt.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    json["architectures"] = serde_json::json!(["\u{1b}[31mEvil\u{7}\u{202e}Model"]);
    std::fs::write(&cfg, json.to_string()).unwrap();
    let o = expect(root.path(), &[os("inspect"), ckpt.as_os_str()], 2, &[]);
    for raw in ['\u{1b}', '\u{7}', '\u{202e}'] {
        assert!(!o.stderr.contains(raw), "raw {raw:?} in {:?}", o.stderr);
    }
    assert!(o.stderr.contains("\\u{1b}[31mEvil"), "{}", o.stderr);
}
