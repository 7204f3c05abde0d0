//! Decode-step speed of the interpreter on a SmolLM2-135M-shaped contract-v1 package
//! (30 layers, 576 hidden, 1536 MLP, 9/3 heads, V 49152, S 512, 4-bit LUT projections, tied
//! fp16 embedding), against candle-core f32 doing only the same step's GEMVs over the same
//! decoded weights: a floor for the candle reference forward, whose linear layers dominate a
//! decode step.
//!
//! The package comes from `HF2COREML_BENCH_PKG`, or is built once into
//! ~/.cache/hf2coreml/bench/smollm2-shape with python/testgen/decode_step.py
//! (HF2COREML_STEP_DIMS=30,9,3,64,576,1536,49152,512).
//!
//! With the real model (HF2COREML_MODEL_DIR, default ~/.cache/hf2coreml/smollm2-135m-instruct)
//! and a package converted from it at HF2COREML_BENCH_REAL_PKG (default
//! ~/.cache/hf2coreml/bench/smollm2-real/model.mlpackage, made with `hf2coreml convert DIR -o
//! ... --max-seq-len 512`), a second group decodes 16 tokens from position 0 with the
//! interpreter (host static cache) and with the candle reference (its own KV cache).
//!
//! Run: `CARGO_PROFILE_DEV_OPT_LEVEL=3 cargo bench --profile dev --bench interp_decode`
//! (or plain `cargo bench --bench interp_decode` for the release profile).

use std::path::PathBuf;

use candle_core::{Device, Tensor as CTensor};
use criterion::{criterion_group, criterion_main, Criterion};
use half::f16;
use hf2coreml::runtime::interp::{Options, Package};
use hf2coreml::runtime::StepModel;

const DIMS: &str = "30,9,3,64,576,1536,49152,512";

fn package() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("HF2COREML_BENCH_PKG") {
        return Some(PathBuf::from(p));
    }
    let home = PathBuf::from(std::env::var_os("HOME")?);
    let dir = home.join(".cache/hf2coreml/bench/smollm2-shape");
    let pkg = dir.join("q1/model.mlpackage");
    if pkg.exists() {
        return Some(pkg);
    }
    let env = std::env::var_os("HF2COREML_PYTHON_ENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/hf2coreml/venv-probe"));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/testgen/decode_step.py");
    let status = std::process::Command::new(env.join("bin/python"))
        .arg(script)
        .arg(&dir)
        .arg("1")
        .env("HF2COREML_STEP_DIMS", DIMS)
        .status()
        .ok()?;
    (status.success() && pkg.exists()).then_some(pkg)
}

fn bench(c: &mut Criterion) {
    let Some(path) = package() else {
        eprintln!("SKIP: no bench package and no Python venv to build one");
        return;
    };
    let mut pkg = Package::load(&path, Options::default()).expect("load package");
    let ct = pkg.contract().clone();
    let n = ct.num_layers * ct.num_kv_heads * ct.max_seq_len * ct.head_dim;
    let cache = vec![f16::from_f32(0.01); n];
    let position = ct.max_seq_len / 2;
    let mut g = c.benchmark_group("decode_step_smollm2_shape");
    g.sample_size(10);
    g.bench_function("interp_fp16_q1_pos256", |b| {
        b.iter(|| pkg.step(&[42], position, &cache, &cache).expect("step"))
    });

    // The same GEMVs in candle f32: per layer q,k,v,o (576x576, 192x576 x2, 576x576), gate/up
    // (1536x576), down (576x1536), then the 49152x576 lm_head.
    let dev = Device::Cpu;
    let h = 576;
    let shapes: Vec<(usize, usize)> = (0..ct.num_layers)
        .flat_map(|_| {
            [
                (h, h),
                (192, h),
                (192, h),
                (h, h),
                (1536, h),
                (1536, h),
                (h, 1536),
            ]
        })
        .chain([(ct.vocab_size, h)])
        .collect();
    let weights: Vec<CTensor> = shapes
        .iter()
        .map(|&(o, i)| CTensor::ones((o, i), candle_core::DType::F32, &dev).expect("alloc"))
        .map(|w| w.t().expect("t"))
        .collect();
    let x576 = CTensor::ones((1, h), candle_core::DType::F32, &dev).expect("x");
    let x1536 = CTensor::ones((1, 1536), candle_core::DType::F32, &dev).expect("x");
    g.bench_function("candle_f32_gemvs_only", |b| {
        b.iter(|| {
            for w in &weights {
                let x = if w.dims()[0] == 1536 { &x1536 } else { &x576 };
                x.matmul(w).expect("matmul");
            }
        })
    });
    g.finish();
}

/// 16-token decodes on the real model: the interpreted package vs the candle reference.
fn bench_real(c: &mut Criterion) {
    const TOKENS: usize = 16;
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let model_dir = std::env::var_os("HF2COREML_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/hf2coreml/smollm2-135m-instruct"));
    let pkg_path = std::env::var_os("HF2COREML_BENCH_REAL_PKG")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/hf2coreml/bench/smollm2-real/model.mlpackage"));
    if !model_dir.join("config.json").exists() || !pkg_path.exists() {
        eprintln!(
            "SKIP real-model group: need {} and {}",
            model_dir.display(),
            pkg_path.display()
        );
        return;
    }
    let mut pkg = Package::load(&pkg_path, Options::default()).expect("load package");
    let ckpt = hf2coreml::checkpoint::Checkpoint::open(&model_dir).expect("checkpoint");
    let mut reference = hf2coreml::model::Reference::load(&ckpt).expect("reference");
    let ct = pkg.contract().clone();
    let (l, hkv, s, d) = (ct.num_layers, ct.num_kv_heads, ct.max_seq_len, ct.head_dim);
    let tokens: Vec<u32> = (0..TOKENS as u32).map(|i| 100 + 37 * i).collect();
    let mut g = c.benchmark_group("decode_16_tokens_smollm2_real");
    g.sample_size(10);
    g.bench_function("interp_package", |b| {
        let mut kc = vec![f16::ZERO; l * hkv * s * d];
        let mut vc = kc.clone();
        b.iter(|| {
            for (p, &t) in tokens.iter().enumerate() {
                let out = pkg.step(&[t as i32], p, &kc, &vc).expect("step");
                for (cache, upd) in [(&mut kc, &out.key_update), (&mut vc, &out.value_update)] {
                    for row in 0..l * hkv {
                        let dst = (row * s + p) * d;
                        cache[dst..dst + d].copy_from_slice(&upd[row * d..(row + 1) * d]);
                    }
                }
            }
        })
    });
    g.bench_function("candle_reference_kv_cache", |b| {
        b.iter(|| {
            for (p, &t) in tokens.iter().enumerate() {
                reference.step(&[t], p).expect("reference step");
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench, bench_real);
criterion_main!(benches);
