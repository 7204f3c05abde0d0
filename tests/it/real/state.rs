//! `--kv-cache state` on the real model (SmolLM2-135M-Instruct from `make model`): the
//! stateful iOS18 package generates the io package's greedy text, token for token, and its
//! per-position logits are the io package's bit for bit (the same ops in the same order; see
//! state::tiny). S = 200 is not a multiple of 32: the state's rows are padded to 224.

use std::path::{Path, PathBuf};

use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::interp::Package;
use hf2coreml::runtime::sampling::SamplingParams;
use hf2coreml::runtime::text::load_tokenizer;
use hf2coreml_testkit::model_dir;

use crate::support::{convert, needs};

const PROMPT: &str = "The three primary colors are";
const NEW: usize = 24;

fn convert_smollm2(root: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let pkg = root.join(name);
    convert(model_dir(), &pkg)
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
        .ok();
    pkg
}

#[test]
fn the_stateful_package_writes_the_io_packages_text() {
    needs!(Model, Python);
    let root = tempfile::tempdir().unwrap();
    let io = convert_smollm2(root.path(), "io.mlpackage", &[]);
    let st = convert_smollm2(root.path(), "st.mlpackage", &["--kv-cache", "state"]);
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
