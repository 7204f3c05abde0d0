//! Converted packages compute what the checkpoint computes: each tiny architecture is converted
//! (all-fp16), interpreted step by step with host-side cache writes (runtime::interp, rounding
//! every op to its declared fp16 dtype) and compared with the float reference forward pass.

use half::f16;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::Reference;
use hf2coreml::runtime::interp::{Options, Package};
use hf2coreml::runtime::StepModel;
use hf2coreml_testkit::TinyModel;

use hf2coreml_testkit::FP16_LOGIT_TOL;

use crate::support::{convert, needs};

fn agree(model: TinyModel, query_len: usize) {
    let arch = model.architecture;
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    let s = 16usize;
    convert(dir.path(), &pkg)
        .args([
            "--max-seq-len",
            &s.to_string(),
            "--query-len",
            &query_len.to_string(),
            "--keep-fp16",
            "*",
        ])
        .ok();

    let mut package = Package::load(&pkg, Options::default()).unwrap();
    let c = package.contract().clone();
    let (l, hkv, d, v) = (c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size);
    let tokens: Vec<u32> = (0..12u32).map(|i| (i * 7 + 3) % v as u32).collect();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let reference = Reference::load(&ckpt).unwrap().logits_all(&tokens).unwrap();

    let mut kc = vec![f16::ZERO; l * hkv * s * d];
    let mut vc = kc.clone();
    let mut worst = 0f32;
    let mut top1 = 0;
    for chunk_start in (0..tokens.len()).step_by(query_len) {
        let ids: Vec<i32> = tokens[chunk_start..chunk_start + query_len]
            .iter()
            .map(|&t| t as i32)
            .collect();
        let out = package.step(&ids, chunk_start, &kc, &vc).unwrap();
        // Host-side cache write: rows [p, p+Q) of every layer and head.
        for li in 0..l {
            for h in 0..hkv {
                for qi in 0..query_len {
                    let src = ((li * hkv + h) * query_len + qi) * d;
                    let dst = ((li * hkv + h) * s + chunk_start + qi) * d;
                    kc[dst..dst + d].copy_from_slice(&out.key_update[src..src + d]);
                    vc[dst..dst + d].copy_from_slice(&out.value_update[src..src + d]);
                }
            }
        }
        for qi in 0..query_len {
            let got = &out.logits[qi * v..(qi + 1) * v];
            let want = &reference[chunk_start + qi];
            for (a, b) in got.iter().zip(want) {
                worst = worst.max((a - b).abs());
            }
            let argmax = |r: &[f32]| {
                r.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i)
            };
            top1 += usize::from(argmax(got) == argmax(want));
        }
    }
    eprintln!("{arch:?} Q={query_len}: max |Δlogit| {worst}");
    assert!(
        worst < FP16_LOGIT_TOL,
        "max |Δlogit| {worst} over {} tokens",
        tokens.len()
    );
    assert_eq!(top1, tokens.len());
}

#[test]
fn llama_fp16_package_matches_reference() {
    needs!(Python);
    agree(TinyModel::llama(), 1);
}

#[test]
fn qwen2_fp16_package_matches_reference_in_chunks() {
    needs!(Python);
    agree(TinyModel::qwen2(), 4);
}

#[test]
fn mistral_fp16_package_matches_reference() {
    needs!(Python);
    agree(TinyModel::mistral(), 2);
}
