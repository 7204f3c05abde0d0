//! End to end through [`StepModel`]: a tiny Llama contract-v1 decode step with 4-bit LUT
//! projections, built and saved by coremltools (python/testgen/decode_step.py), driven token by
//! token (Q = 1) and in chunks (Q = 2) with a host-side static cache, against the float32 numpy
//! forward pass of the same weights.

use std::path::Path;
use std::sync::OnceLock;

use half::f16;
use hf2coreml::runtime::interp::{Compute, Options, Package, Stats};
use hf2coreml::runtime::StepModel;
use serde_json::Value;

use hf2coreml_testkit::{top1_is_decided, F32_LOGIT_TOL, FP16_LOGIT_TOL};

use crate::support::{copy_dir, needs};

/// The decode step coremltools saved, generated once per test binary by the venv with
/// coremltools (every test here starts with `needs!(Python)`).
fn fixture() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let py = hf2coreml_testkit::python_env().join("bin/python");
        let dir = tempfile::tempdir().expect("temp dir");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/testgen/decode_step.py");
        let out = std::process::Command::new(py)
            .args([
                script.as_os_str(),
                dir.path().as_os_str(),
                "1".as_ref(),
                "2".as_ref(),
            ])
            .output()
            .expect("run python");
        assert!(
            out.status.success(),
            "decode_step.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
    .path()
}

struct Reference {
    tokens: Vec<i32>,
    logits: Vec<Vec<f32>>,
}

fn reference(dir: &Path) -> Reference {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    Reference {
        tokens: doc["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap() as i32)
            .collect(),
        logits: crate::support::json::rows(&doc["logits"]),
    }
}

/// Feed `tokens` in chunks of Q, writing each step's key/value rows into the static cache.
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
    for (chunk_i, chunk) in tokens.chunks(q).enumerate() {
        let p = chunk_i * q;
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

fn compare(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len());
    for (pos, (g, w)) in got.iter().zip(want).enumerate() {
        let max = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{what}: position {pos}: max |Δlogit| {max}");
        assert!(
            max <= tol,
            "{what}: position {pos}: max |Δlogit| {max} > {tol}"
        );
        if top1_is_decided(w, tol) {
            assert_eq!(argmax(g), argmax(w), "{what}: top-1 at position {pos}");
        }
    }
}

#[test]
fn token_by_token_matches_reference() {
    needs!(Python);
    let dir = fixture();
    let r = reference(dir);
    let mut pkg = Package::load(&dir.join("q1/model.mlpackage"), Options::default()).unwrap();
    assert_eq!(pkg.contract().query_len, 1);
    let mut stats = Stats::default();
    let got = drive(&mut pkg, &r.tokens, Some(&mut stats));
    compare(&got, &r.logits, FP16_LOGIT_TOL, "fp16 Q=1");
    assert!(!stats.any_non_finite(), "{stats:?}");
    assert!(stats.ops.contains_key("linear") && stats.ops["linear"].max_abs > 0.0);
}

#[test]
fn chunks_match_reference() {
    needs!(Python);
    let dir = fixture();
    let r = reference(dir);
    let mut pkg = Package::load(&dir.join("q2/model.mlpackage"), Options::default()).unwrap();
    let got = drive(&mut pkg, &r.tokens, None);
    compare(&got, &r.logits, FP16_LOGIT_TOL, "fp16 Q=2");
}

#[test]
fn compute_f32_is_tighter() {
    needs!(Python);
    let dir = fixture();
    let r = reference(dir);
    let opts = Options {
        compute: Compute::F32,
        ..Options::default()
    };
    let mut pkg = Package::load(&dir.join("q1/model.mlpackage"), opts).unwrap();
    let got = drive(&mut pkg, &r.tokens, None);
    compare(&got, &r.logits, F32_LOGIT_TOL, "f32 Q=1");
}

#[test]
fn context_overflow_is_an_error() {
    needs!(Python);
    let dir = fixture();
    let mut pkg = Package::load(&dir.join("q2/model.mlpackage"), Options::default()).unwrap();
    let c = pkg.contract().clone();
    let n = c.num_layers * c.num_kv_heads * c.max_seq_len * c.head_dim;
    let cache = vec![f16::ZERO; n];
    let err = pkg
        .step(&[1, 2], c.max_seq_len - 1, &cache, &cache)
        .unwrap_err();
    assert!(err.to_string().contains("max_seq_len"), "{err}");
    let err = pkg.step(&[1], 0, &cache, &cache).unwrap_err();
    assert!(err.to_string().contains("input_ids"), "{err}");
}

#[test]
fn package_without_contract_is_refused() {
    needs!(Python);
    let dir = fixture();
    // The op test packages carry no contract metadata; build one from the q1 package by
    // dropping the key.
    let src = dir.join("q1/model.mlpackage");
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("m.mlpackage");
    copy_dir(&src, &dst);
    let path = dst.join("Data/com.apple.CoreML/model.mlmodel");
    let mut model = <hf2coreml::mlpackage::proto::Model as prost::Message>::decode(
        std::fs::read(&path).unwrap().as_slice(),
    )
    .unwrap();
    if let Some(md) = model.description.as_mut().and_then(|d| d.metadata.as_mut()) {
        md.user_defined
            .remove(hf2coreml::mil::contract::METADATA_KEY);
    }
    std::fs::write(&path, prost::Message::encode_to_vec(&model)).unwrap();
    let err = Package::load(&dst, Options::default()).unwrap_err();
    assert!(err.to_string().contains("hf2coreml.contract"), "{err}");
}
