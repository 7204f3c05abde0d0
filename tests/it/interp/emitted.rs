//! The interpreter on packages written by `hf2coreml convert` (all-fp16 weights) for each tiny
//! architecture, driven through [`StepModel`] with a host-side static cache and compared with
//! the candle float32 reference forward of the same checkpoint.

use half::f16;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::Reference;
use hf2coreml::runtime::interp::{Compute, ConstantReader, Options, Package, Stats};
use hf2coreml::runtime::StepModel;
use hf2coreml_testkit::TinyModel;

use hf2coreml_testkit::{top1_is_decided, F32_LOGIT_TOL, FP16_LOGIT_TOL};

use crate::support::{convert, needs};

/// Convert `model` (Q = `q`) and return (checkpoint dir, package dir).
fn convert_model(model: &TinyModel, q: usize) -> (tempfile::TempDir, tempfile::TempDir) {
    let ckpt = model.write_temp().expect("fixture");
    let out = tempfile::tempdir().expect("temp dir");
    convert(ckpt.path(), out.path().join("m.mlpackage"))
        .args(["--max-seq-len", "32", "--query-len", &q.to_string()])
        // All-fp16: the default recipe palettizes the projections, which is not what this
        // test measures (the interpreter against the reference, within fp16 rounding).
        .args(["--keep-fp16", "*"])
        .ok();
    (ckpt, out)
}

fn drive(pkg: &mut Package, tokens: &[i32], mut stats: Option<&mut Stats>) -> Vec<Vec<f32>> {
    let c = pkg.contract().clone();
    let (l, hkv, s, d, q, v) = (
        c.num_layers,
        c.num_kv_heads,
        c.max_seq_len,
        c.head_dim,
        c.query_len,
        c.vocab_size,
    );
    let mut kc = vec![f16::ZERO; l * hkv * s * d];
    let mut vc = kc.clone();
    let mut rows = Vec::new();
    for (i, chunk) in tokens.chunks(q).enumerate() {
        let p = i * q;
        let out = pkg
            .step_with_stats(chunk, p, &kc, &vc, stats.as_deref_mut())
            .unwrap();
        for (cache, upd) in [(&mut kc, &out.key_update), (&mut vc, &out.value_update)] {
            for li in 0..l {
                for h in 0..hkv {
                    for t in 0..q {
                        let src = ((li * hkv + h) * q + t) * d;
                        let dst = ((li * hkv + h) * s + p + t) * d;
                        cache[dst..dst + d].copy_from_slice(&upd[src..src + d]);
                    }
                }
            }
        }
        for t in 0..q {
            rows.push(out.logits[t * v..(t + 1) * v].to_vec());
        }
    }
    rows
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

fn check(model: TinyModel, q: usize, compute: Compute, tol: f32) {
    let (ckpt, out) = convert_model(&model, q);
    let load = |dense_weights| {
        let opts = Options {
            compute,
            dense_weights,
        };
        Package::load(&out.path().join("m.mlpackage"), opts).unwrap()
    };
    let mut pkg = load(false);
    // The embedding stays in its weight file: its `gather` reads `axis` and `batch_dims` from
    // named `const` ops, as coremltools writes them (the loader once looked only for inline
    // values, and decoded an 8B's embedding to 2.1 GB of f32 at load).
    let embed = hf2coreml::arch::mil_name("model.embed_tokens.weight");
    assert!(
        matches!(
            pkg.program().constant_reader(&embed),
            Some(ConstantReader::Packed(_))
        ),
        "`{embed}` was decoded at load"
    );
    let v = pkg.contract().vocab_size;
    let tokens: Vec<i32> = (0..12).map(|i| ((i * 7 + 3) % v) as i32).collect();
    let mut stats = Stats::default();
    let got = drive(&mut pkg, &tokens, Some(&mut stats));
    assert!(!stats.any_non_finite(), "{stats:?}");
    // Weights read in place and weights decoded at load: the same logits, bit for bit.
    let dense = drive(&mut load(true), &tokens, None);
    let bits =
        |rows: &[Vec<f32>]| -> Vec<u32> { rows.iter().flatten().map(|x| x.to_bits()).collect() };
    assert!(
        bits(&got) == bits(&dense),
        "packed and dense weights differ"
    );
    let mut reference = Reference::load(&Checkpoint::open(ckpt.path()).unwrap()).unwrap();
    let want = reference
        .logits_all(&tokens.iter().map(|&t| t as u32).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(got.len(), want.len());
    for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
        let max = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{:?} {compute:?} Q={q} position {pos}: max |Δlogit| {max}",
            model.architecture
        );
        assert!(max <= tol, "position {pos}: max |Δlogit| {max} > {tol}");
        if top1_is_decided(w, tol) {
            assert_eq!(argmax(g), argmax(w), "top-1 at position {pos}");
        }
    }
}

#[test]
fn llama_fp16_token_by_token() {
    needs!(Python);
    check(TinyModel::llama(), 1, Compute::Declared, FP16_LOGIT_TOL);
}

#[test]
fn qwen2_fp16_chunks() {
    needs!(Python);
    check(TinyModel::qwen2(), 4, Compute::Declared, FP16_LOGIT_TOL);
}

#[test]
fn mistral_compute_f32() {
    needs!(Python);
    check(TinyModel::mistral(), 1, Compute::F32, F32_LOGIT_TOL);
}
