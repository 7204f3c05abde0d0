//! What the README promises of `run` and `validate` on the real model (SmolLM2-135M-Instruct from
//! `make model`), through the CLI, on one small data-free 4-bit package:
//! - `validate` rejects data-free 4-bit SmolLM2 (the README's quality table: it does not keep
//!   the model), and `--text` evaluates the file given;
//! - `run --chat` renders the checkpoint's chat template (checked against the ChatML text written
//!   out by hand), `--tokenizer` reads the file given;
//! - sampling: the same `--seed` gives the same tokens, `--top-k 1` is greedy whatever the
//!   temperature.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use hf2coreml_testkit::model_dir;
use serde_json::Value;

use crate::support::{convert, hf2coreml, needs, Cli};

/// The package, converted once per test binary.
fn package() -> &'static Path {
    static PKG: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &PKG.get_or_init(|| {
        let root = tempfile::tempdir().unwrap();
        let pkg = root.path().join("smol.mlpackage");
        convert(model_dir(), &pkg)
            .args(["--max-seq-len", "64", "--recipe", "data-free-4bit", "-q"])
            .ok();
        (root, pkg)
    })
    .1
}

fn run_json(extra: &[&str]) -> Value {
    let pkg = package().to_str().unwrap();
    let o = hf2coreml(&[&["run", pkg, "--json"], extra].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn ids(v: &Value, key: &str) -> Vec<u64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {v:#}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn validate_rejects_data_free_4bit_and_reads_the_text_given() {
    needs!(Model, Python);
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/evaluation_code.txt");
    let model = model_dir();
    let o = Cli::new()
        .arg("validate")
        .arg(package())
        .arg("--against")
        .arg(&model)
        .args(["--max-tokens", "24", "--json", "--text"])
        .arg(&text)
        .output();
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    // The gates fail (exit 1): a package that does not keep the model is not passed.
    assert_eq!(o.status.code(), Some(1), "{report:#}");
    let failed: Vec<&Value> = report["gates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["passed"] == false)
        .collect();
    assert!(!failed.is_empty(), "{report:#}");
    assert!(report["behaviour"]["kl_mean"].as_f64().unwrap() > 1.0);
    assert!(
        report["text"]
            .as_str()
            .is_some_and(|t| t.contains("evaluation_code.txt")),
        "{}",
        report["text"]
    );
}

#[test]
fn chat_renders_the_template_and_tokenizer_is_honoured() {
    needs!(Model, Python);
    let chat = run_json(&["--chat", "--prompt", "Hi there", "--max-new-tokens", "0"]);
    let by_hand = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                   Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n\
                   <|im_start|>assistant\n";
    let plain = run_json(&["--prompt", by_hand, "--max-new-tokens", "0"]);
    assert_eq!(ids(&chat, "prompt_ids"), ids(&plain, "prompt_ids"));
    assert!(ids(&chat, "prompt_ids").len() > 20);

    // The tokenizer beside the package moved elsewhere: found only through --tokenizer.
    let root = tempfile::tempdir().unwrap();
    let moved = root.path().join("tok.json");
    std::fs::copy(model_dir().join("tokenizer.json"), &moved).unwrap();
    let pkg = package().to_str().unwrap();
    let o = hf2coreml(&[
        "run",
        pkg,
        "--json",
        "--prompt",
        by_hand,
        "--max-new-tokens",
        "0",
        "--tokenizer",
        moved.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids(&v, "prompt_ids"), ids(&plain, "prompt_ids"));
    // A tokenizer that is not one is bad input.
    std::fs::write(&moved, "{not json").unwrap();
    let o = hf2coreml(&[
        "run",
        pkg,
        "--prompt",
        "x",
        "--tokenizer",
        moved.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn seeds_repeat_and_top_k_1_is_greedy() {
    needs!(Model, Python);
    let sample = |seed: &str, extra: &[&str]| {
        let base = [
            "--prompt-ids",
            "1,504,3458,314",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--temperature",
            "1.5",
            "--seed",
            seed,
        ];
        ids(&run_json(&[&base[..], extra].concat()), "generated_ids")
    };
    let a = sample("7", &[]);
    assert_eq!(a.len(), 6);
    assert_eq!(a, sample("7", &[]), "the same seed repeats");
    let others: Vec<Vec<u64>> = ["8", "9", "10"].iter().map(|s| sample(s, &[])).collect();
    assert!(
        others.iter().any(|o| *o != a),
        "other seeds sample other tokens at temperature 1.5"
    );

    let greedy = ids(
        &run_json(&[
            "--prompt-ids",
            "1,504,3458,314",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
        ]),
        "generated_ids",
    );
    assert_eq!(sample("7", &["--top-k", "1"]), greedy);
    assert_eq!(sample("8", &["--top-k", "1"]), greedy);
}
