//! `convert` on the real model (SmolLM2-135M-Instruct from `make model`; HF2COREML_MODEL_DIR
//! points elsewhere if wanted): fp16 range safety is measured and applied, and the all-fp16
//! package, interpreted in fp16, agrees with the f32 reference on the evaluation text.

use std::path::Path;

use half::f16;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::Reference;
use hf2coreml::runtime::interp::{Options, Package};
use hf2coreml::runtime::StepModel;

use crate::support::{convert, needs};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// The gate for the all-fp16 package against the reference.
const MIN_TOP1: f64 = 0.95;
/// Evaluation tokens interpreted (the interpreter runs the whole 30-layer graph per token).
const EVAL_TOKENS: usize = 48;

#[test]
fn smollm2_all_fp16_package_agrees_with_reference() {
    needs!(Model, Python);
    let dir = hf2coreml_testkit::model_dir();
    let ckpt = Checkpoint::open(&dir).unwrap_or_else(|e| {
        panic!(
            "the real model is needed at {} (run `make model`): {e}",
            dir.display()
        )
    });
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("smol.mlpackage");
    let s = 64usize;
    let o = convert(&dir, &pkg)
        .args([
            "--max-seq-len",
            &s.to_string(),
            "--keep-fp16",
            "*",
            "--json",
        ])
        .ok();
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // docs/design.md: SmolLM2's residual stream reaches ~24,900; α = 1/128 keeps RMSNorm's x² in
    // fp16 range. The scale must come out of the measurement.
    let scaling = &summary["contract"]["scaling"];
    assert_eq!(scaling["residual_scale"], 1.0 / 128.0, "{scaling}");
    assert!(scaling["measured_max_abs"].as_f64().unwrap() > 10_000.0);
    assert!(summary["outputs"]["tokenizer"].is_string());

    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let text = std::fs::read_to_string(Path::new(REPO).join("assets/evaluation.txt")).unwrap();
    let mut tokens = tok.encode(text, false).unwrap().get_ids().to_vec();
    tokens.truncate(EVAL_TOKENS);
    let reference = Reference::load(&ckpt).unwrap().logits_all(&tokens).unwrap();

    let mut package = Package::load(&pkg, Options::default()).unwrap();
    let c = package.contract().clone();
    let (l, hkv, d, v) = (c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size);
    let mut kc = vec![f16::ZERO; l * hkv * s * d];
    let mut vc = kc.clone();
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    let mut top1 = 0usize;
    for (p, &t) in tokens.iter().enumerate() {
        let out = package.step(&[t as i32], p, &kc, &vc).unwrap();
        for lh in 0..l * hkv {
            let dst = (lh * s + p) * d;
            kc[dst..dst + d].copy_from_slice(&out.key_update[lh * d..(lh + 1) * d]);
            vc[dst..dst + d].copy_from_slice(&out.value_update[lh * d..(lh + 1) * d]);
        }
        assert!(
            out.logits.iter().all(|x| x.is_finite()),
            "non-finite logits at {p}"
        );
        top1 += usize::from(argmax(&out.logits[..v]) == argmax(&reference[p]));
    }
    let rate = top1 as f64 / tokens.len() as f64;
    assert!(
        rate >= MIN_TOP1,
        "top-1 agreement {rate} over {} tokens",
        tokens.len()
    );
}
