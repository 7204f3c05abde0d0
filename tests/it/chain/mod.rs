//! Chained packages: a tiny model converted under a tiny `--max-package-size`
//! splits into 3+ packages whose logits are bit-identical to the same model as one package, in
//! `run --logits-out` and in `validate`; `lint` and `validate` read the chain; a size one block
//! alone exceeds is refused (exit 2) and leaves nothing at the output.

mod coreai;

use std::path::Path;
use std::process::Output;

use hf2coreml::mil::chain_file::{ChainFile, CHAIN_FILE};
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, Cli};

const PROMPT: &str = "3,10,17,24,31,2,90,45";

/// Four blocks (fp16: about 74 kB each), peaked logits (so top-1 measures the package, not ties).
fn model() -> TinyModel {
    TinyModel {
        layers: 4,
        logit_gain: 4.0,
        ..TinyModel::llama()
    }
}

/// Each part carries a 1 MiB allowance plus the RoPE tables; a block of the tiny model is
/// about 74 kB, so 1.2 MB holds at most two blocks per part: 3+ parts.
const SPLIT: &str = "1200000";
/// Over one part's allowance but under allowance + one block: every split is refused.
const TOO_SMALL: &str = "1100000";

/// `convert` at S = 32, quiet, with the activation ranges given (not measured).
fn convert_ranged(src: &Path, out: &Path, ranges: &Path) -> Cli {
    convert(src, out)
        .args(["--max-seq-len", "32", "-q"])
        .arg("--activation-ranges")
        .arg(ranges)
}

fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn run_logits(pkg: &Path, npy: &Path) -> Vec<u8> {
    let o = Cli::new()
        .arg("run")
        .arg(pkg)
        .args([
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "-q",
        ])
        .arg("--logits-out")
        .arg(npy)
        .output();
    ok(&o, "run");
    std::fs::read(npy).unwrap()
}

fn validate(pkg: &Path, src: &Path) -> (Option<i32>, serde_json::Value) {
    let o = Cli::new()
        .arg("validate")
        .arg(pkg)
        .arg("--against")
        .arg(src)
        .args(["--json", "--max-tokens", "48"])
        .output();
    let report = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {}",
            String::from_utf8_lossy(&o.stderr)
        )
    });
    (o.status.code(), report)
}

#[test]
fn a_chain_computes_what_one_package_computes_bit_for_bit() {
    needs!(Python);
    let src = model().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    // A residual scale of 1/8 (α ≠ 1), so the hidden state between parts is a scaled one.
    let ranges = root.path().join("ranges.json");
    std::fs::write(
        &ranges,
        r#"{"residual_max_abs": [1000, 1000, 1000, 1000, 1000, 1000], "source": "test"}"#,
    )
    .unwrap();
    let one = root.path().join("one.mlpackage");
    let chain = root.path().join("chain.mlpackage");
    ok(
        &convert_ranged(src.path(), &one, &ranges)
            .args(["--keep-fp16", "*"])
            .output(),
        "convert (one)",
    );
    ok(
        &convert_ranged(src.path(), &chain, &ranges)
            .args(["--keep-fp16", "*"])
            .args(["--max-package-size", SPLIT])
            .output(),
        "convert (chain)",
    );
    assert!(
        one.join("Manifest.json").is_file(),
        "one package, as before"
    );
    assert!(!one.join(CHAIN_FILE).exists());
    let desc = ChainFile::read(&chain).unwrap();
    assert!(desc.parts.len() >= 3, "{desc:#?}");
    assert_eq!(desc.residual_scale, 0.125);
    for p in &desc.parts {
        assert!(p.bytes <= 1_200_000, "{}: {} bytes", p.path, p.bytes);
        assert!(ChainFile::part_path(&chain, p)
            .join("Manifest.json")
            .is_file());
    }
    assert!(root.path().join("chain.report.json").is_file());

    let a = run_logits(&one, &root.path().join("one.npy"));
    let b = run_logits(&chain, &root.path().join("chain.npy"));
    assert!(a.len() > 128);
    assert!(a == b, "the chain's logits differ from the package's");

    let (code_one, rep_one) = validate(&one, src.path());
    let (code_chain, rep_chain) = validate(&chain, src.path());
    assert_eq!(code_one, Some(0), "{rep_one:#}");
    assert_eq!(code_chain, Some(0), "{rep_chain:#}");
    assert_eq!(rep_one["behaviour"], rep_chain["behaviour"]);
    assert_eq!(rep_one["weights"], rep_chain["weights"]);
    let items = rep_chain["contract"].as_array().unwrap();
    assert!(items.len() > 10 * desc.parts.len() / 2, "{items:#?}");
    assert!(items.iter().all(|i| i["ok"] == true), "{items:#?}");

    let lint = |p: &Path| Cli::new().arg("lint").arg(p).arg("--json").output();
    let (l1, l2) = (lint(&one), lint(&chain));
    let r2: serde_json::Value = serde_json::from_slice(&l2.stdout).unwrap();
    assert_eq!(l1.status.code(), l2.status.code());
    assert!(r2["summary"]["ops"].as_u64().unwrap() > 0, "{r2:#}");

    // A chain.json naming one part for two layer ranges, and a part copied over another,
    // are refused when any command loads the chain.
    let refused = |pkg: &Path, needle: &str| {
        for verb in ["inspect", "lint", "run"] {
            let mut cli = Cli::new().arg(verb).arg(pkg);
            if verb == "run" {
                cli = cli.args(["--prompt-ids", "1", "--max-new-tokens", "1"]);
            }
            let o = cli.output();
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{verb}: {err}");
            assert!(err.contains(needle), "{verb}: {err}");
        }
    };
    let copy = |from: &Path, to: &Path| {
        std::fs::create_dir(to).unwrap();
        hf2coreml::fsutil::copy_tree(from, to).unwrap();
    };
    let twice = root.path().join("twice.mlpackage");
    copy(&chain, &twice);
    let text = std::fs::read_to_string(twice.join(CHAIN_FILE)).unwrap();
    let (a, b) = (&desc.parts[1].path, &desc.parts[2].path);
    let named = text.replacen(&format!("\"{b}\""), &format!("\"{a}\""), 1);
    assert_ne!(named, text);
    std::fs::write(twice.join(CHAIN_FILE), named).unwrap();
    refused(&twice, &format!("parts 1 and 2 are both `{a}`"));
    let copied = root.path().join("copied.mlpackage");
    copy(&chain, &copied);
    std::fs::remove_dir_all(copied.join(b)).unwrap();
    copy(&copied.join(a), &copied.join(b));
    refused(&copied, "is not the program the chain recorded");
}

/// Data-free 4-bit projections and an 8-bit tied table: every part palettizes its own tensors
/// when it is built (the streaming convert), the tied table in the first and the last part.
const STREAMED_RECIPE: &str = r#"
default = "fp16"
[roles]
embedding = { palettize = { nbits = 8 } }
lm_head = { palettize = { nbits = 8 } }
q = { palettize = { nbits = 4 } }
k = { palettize = { nbits = 4 } }
v = { palettize = { nbits = 4 } }
o = { palettize = { nbits = 4 } }
gate = { palettize = { nbits = 4 } }
up = { palettize = { nbits = 4 } }
down = { palettize = { nbits = 4 } }
"#;

/// The per-part allowance (1 MiB + RoPE tables) plus about two 4-bit blocks (18.6 kB each):
/// the 4-block model at 4 bits splits into 3 parts.
const STREAMED_SPLIT: &str = "1090000";

#[test]
fn a_streamed_palettized_chain_stores_what_one_package_stores() {
    needs!(Python);
    let src = model().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let ranges = root.path().join("ranges.json");
    std::fs::write(
        &ranges,
        r#"{"residual_max_abs": [1000, 1000, 1000, 1000, 1000, 1000], "source": "test"}"#,
    )
    .unwrap();
    let recipe = root.path().join("streamed.toml");
    std::fs::write(&recipe, STREAMED_RECIPE).unwrap();
    let recipe = recipe.to_str().unwrap();
    let one = root.path().join("one.mlpackage");
    let chain = root.path().join("chain.mlpackage");
    ok(
        &convert_ranged(src.path(), &one, &ranges)
            .args(["--recipe", recipe])
            .output(),
        "convert (one)",
    );
    let split = ["--recipe", recipe, "--max-package-size", STREAMED_SPLIT];
    ok(
        &convert_ranged(src.path(), &chain, &ranges)
            .args(split)
            .output(),
        "convert (chain)",
    );
    let desc = ChainFile::read(&chain).unwrap();
    assert!(desc.parts.len() >= 3, "{desc:#?}");
    for p in &desc.parts {
        assert!(p.bytes <= 1_090_000, "{}: {} bytes", p.path, p.bytes);
    }
    let report = |name: &str| -> serde_json::Value {
        let text = std::fs::read(root.path().join(name)).unwrap();
        serde_json::from_slice(&text).unwrap()
    };
    let (r1, r2) = (report("one.report.json"), report("chain.report.json"));
    assert_eq!(r1["tensors"]["model.embed_tokens.weight"], "lut8", "{r1:#}");
    let q = "model.layers.3.self_attn.q_proj.weight";
    assert_eq!(r1["tensors"][q], "lut4", "{r1:#}");
    assert_eq!(r1["tensors"], r2["tensors"]);
    // Every palettized tensor's error, measured as each part was built, is the whole model's.
    let lines = |r: &serde_json::Value| r["palettize"]["tensors"].clone();
    assert_eq!(lines(&r1), lines(&r2));
    assert_eq!(r1["palettize"]["totals"], r2["palettize"]["totals"]);
    let measured = lines(&r2)
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["snr_db"].is_number())
        .count();
    assert_eq!(
        measured,
        4 * 7 + 1,
        "every projection and the table: {r2:#}"
    );

    let a = run_logits(&one, &root.path().join("one.npy"));
    let b = run_logits(&chain, &root.path().join("chain.npy"));
    assert!(
        a == b,
        "the streamed chain's logits differ from the package's"
    );
}

#[test]
fn a_block_over_the_limit_is_refused_and_leaves_nothing() {
    needs!(Python);
    let src = model().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let ranges = root.path().join("ranges.json");
    std::fs::write(
        &ranges,
        r#"{"residual_max_abs": [1, 1, 1, 1, 1, 1], "source": "test"}"#,
    )
    .unwrap();
    let out = root.path().join("m.mlpackage");
    let o = convert_ranged(src.path(), &out, &ranges)
        .args(["--keep-fp16", "*"])
        .args(["--max-package-size", TOO_SMALL])
        .output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("decoder block"), "{err}");
    assert!(err.contains("--max-package-size"), "{err}");
    let left: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["ranges.json"], "nothing but the input is left");
}
