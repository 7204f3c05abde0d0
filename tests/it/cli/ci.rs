//! The command line as CI sees it: results on stdout, diagnostics on stderr, nothing on stderr
//! under --quiet, JSON from every command that reports, completions and man pages.

use std::process::Output;

use hf2coreml_testkit::TinyModel;
use serde_json::Value;

use crate::support::{cli, hf2coreml, needs};

/// With the Python environment: these runs convert.
fn run(args: &[&str]) -> Output {
    cli(args).python().output()
}

fn ok(o: &Output) -> (String, String) {
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(
        o.status.success(),
        "exit {:?}\n{out}\n{err}",
        o.status.code()
    );
    (out, err)
}

fn json(o: &Output) -> Value {
    let (out, _) = ok(o);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"))
}

#[test]
fn every_reporting_command_speaks_json_on_stdout() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let dir = TinyModel::llama().write_temp().unwrap();
    let d = dir.path().to_str().unwrap();
    let v = json(&run(&["inspect", d, "--json"]));
    assert!(v.is_object());
    let v = json(&run(&["budget", d, "--device", "iphone-15", "--json"]));
    assert!(v["kv_cache_bytes"].as_u64().unwrap() > 0, "{v}");
    let v = json(&run(&[
        "palettize",
        d,
        "--nbits",
        "4",
        "--data-free",
        "--json",
    ]));
    assert!(!v["tensors"].as_array().unwrap().is_empty());
    let pkg = root.path().join("m.mlpackage");
    let p = pkg.to_str().unwrap();
    let v = json(&run(&[
        "convert",
        d,
        "-o",
        p,
        "--max-seq-len",
        "16",
        "--data-free",
        "--json",
    ]));
    assert_eq!(v["contract"]["max_seq_len"], 16);
    assert!(v["inputs"]["fingerprint"].as_str().unwrap().len() == 64);
    let o = run(&[
        "run",
        p,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
        "--json",
    ]);
    let v = json(&o);
    assert_eq!(v["schema"], "hf2coreml.run/1");
    assert_eq!(v["prompt_ids"], serde_json::json!([1, 2, 3]));
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 4);
    // A failed gate still prints the whole report: CI keeps it as an artifact.
    let o = run(&[
        "validate",
        p,
        "--against",
        d,
        "--max-tokens",
        "16",
        "--json",
        "--gate",
        "kl_mean<1e-12",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["gates"][0]["passed"], false);
}

#[test]
fn quiet_leaves_stderr_empty_and_results_on_stdout() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let dir = TinyModel::llama().write_temp().unwrap();
    let d = dir.path().to_str().unwrap();
    let pkg = root.path().join("m.mlpackage");
    let p = pkg.to_str().unwrap();
    let (out, err) = ok(&run(&[
        "--quiet",
        "convert",
        d,
        "-o",
        p,
        "--max-seq-len",
        "16",
    ]));
    assert!(out.contains("wrote"), "{out}");
    assert!(err.is_empty(), "{err}");
    let (out, err) = ok(&run(&[
        "run",
        p,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "-q",
    ]));
    assert_eq!(out.split_whitespace().count(), 3, "{out}");
    assert!(err.is_empty(), "{err}");
    // Without --quiet the statistics are diagnostics: on stderr, never in the results.
    let (out, err) = ok(&run(&[
        "run",
        p,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "3",
    ]));
    assert!(
        !out.contains("tok/s") && err.contains("tok/s"),
        "{out}\n{err}"
    );
    // Not a terminal: no progress-bar escape sequences anywhere.
    assert!(!err.contains('\u{1b}'));
    let o = run(&["--quiet", "--verbose", "inspect", d]);
    assert_eq!(o.status.code(), Some(2), "--quiet and --verbose conflict");
}

#[test]
fn completions_and_man_pages_come_from_the_real_flags() {
    let (bash, _) = ok(&hf2coreml(&["completions", "bash"]));
    assert!(
        bash.contains("_hf2coreml") && bash.contains("--max-seq-len") && bash.contains("batch")
    );
    let (zsh, _) = ok(&hf2coreml(&["completions", "zsh"]));
    assert!(zsh.starts_with("#compdef hf2coreml"));
    let (man, _) = ok(&hf2coreml(&["man"]));
    assert!(man.contains(".TH hf2coreml 1") && man.contains("batch"));
    let root = tempfile::tempdir().unwrap();
    ok(&hf2coreml(&[
        "man",
        "--out-dir",
        root.path().to_str().unwrap(),
    ]));
    let page = std::fs::read_to_string(root.path().join("hf2coreml-batch.1")).unwrap();
    assert!(page.contains("keep\\-going"), "{page}");
    assert_eq!(hf2coreml(&["completions", "tcsh"]).status.code(), Some(2));
}
