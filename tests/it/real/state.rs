//! `--kv-cache state` on the real model (SmolLM2-135M-Instruct from `make model`): the
//! stateful iOS18 package generates the io package's greedy text, token for token, and its
//! per-position logits are the io package's bit for bit (the same ops in the same order; see
//! tests/state_tiny.rs). S = 200 is not a multiple of 32: the state's rows are padded to 224.

use std::path::{Path, PathBuf};
use std::process::Command;

use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::interp::Package;
use hf2coreml::runtime::sampling::SamplingParams;
use hf2coreml::runtime::text::load_tokenizer;
use hf2coreml::testing::{model_dir, python_env};

const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");
const PROMPT: &str = "The three primary colors are";
const NEW: usize = 24;

fn convert(root: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let pkg = root.join(name);
    let o = Command::new(BIN)
        .arg("convert")
        .arg(model_dir())
        .arg("-o")
        .arg(&pkg)
        // fp16: a model that writes sentences (data-free 4-bit SmolLM2 does not keep it).
        .args([
            "--max-seq-len",
            "200",
            "--keep-fp16",
            "*",
            "--target",
            "ios18",
            "-q",
        ])
        .args(extra)
        .arg("--python-env")
        .arg(python_env())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    pkg
}

#[test]
fn the_stateful_package_writes_the_io_packages_text() {
    let root = tempfile::tempdir().unwrap();
    let io = convert(root.path(), "io.mlpackage", &[]);
    let st = convert(root.path(), "st.mlpackage", &["--kv-cache", "state"]);
    let tok = load_tokenizer(&model_dir().join("tokenizer.json")).unwrap();
    let prompt: Vec<u32> = tok.encode(PROMPT, false).unwrap().get_ids().to_vec();
    let opts = GenerateOptions {
        max_new_tokens: NEW,
        sampling: SamplingParams::greedy(),
        stop_at_eos: false,
        record_logits: true,
    };
    let mut out = Vec::new();
    for pkg in [&io, &st] {
        let mut g = Generator::new(Package::load(pkg, Default::default()).unwrap()).unwrap();
        out.push(g.generate(&prompt, &opts, &mut |_| Ok(())).unwrap());
    }
    let text = tok.decode(&out[0].tokens, true).unwrap();
    assert!(text.split_whitespace().count() >= 8, "a sentence: {text:?}");
    assert_eq!(out[0].tokens, out[1].tokens, "io: {text:?}");
    let (a, b) = (
        out[0].logits.as_ref().unwrap(),
        out[1].logits.as_ref().unwrap(),
    );
    assert_eq!(a.rows(), prompt.len() + NEW - 1);
    assert!(
        a.data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "logits differ"
    );
}
