//! Decode speed of the f32 reference on the real model (SmolLM2-135M from `make model`, or
//! HF2COREML_MODEL_DIR): one token per step through the backend's own KV cache, the baseline
//! the runner's decode speed is compared with; and whole-sequence logits for validation.
//!
//! cargo bench --bench reference_decode

use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::{BackendChoice, Reference};

fn model_dir() -> PathBuf {
    std::env::var_os("HF2COREML_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/hf2coreml/smollm2-135m-instruct")
        })
}

/// Tokens of context before the timed decode steps start (a short chat prompt).
const PROMPT: usize = 32;
/// Decode steps timed per prompt, so the context stays in a realistic 32..160 range.
const STEPS: u64 = 128;

fn decode(c: &mut Criterion) {
    let dir = model_dir();
    let ckpt = Checkpoint::open(&dir)
        .unwrap_or_else(|e| panic!("{} (run `make model`): {e}", dir.display()));
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| 100 + i * 37).collect();
    let mut group = c.benchmark_group("reference_decode");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    for (name, choice) in [
        ("candle", BackendChoice::Auto),
        ("plain", BackendChoice::Plain),
    ] {
        let mut r = Reference::load_with(&ckpt, choice).expect("load reference");
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    r.step(&prompt, 0).expect("prompt");
                    let n = (iters - done).min(STEPS);
                    let start = Instant::now();
                    for _ in 0..n {
                        let pos = r.position();
                        std::hint::black_box(r.step(&[42], pos).expect("step"));
                    }
                    total += start.elapsed();
                    done += n;
                }
                total
            })
        });
    }
    group.finish();

    let tokens: Vec<u32> = (0..256u32).map(|i| 100 + (i * 7919) % 40000).collect();
    let mut group = c.benchmark_group("reference_logits_all_256");
    group.throughput(Throughput::Elements(tokens.len() as u64));
    group.sample_size(10);
    for (name, choice) in [
        ("candle", BackendChoice::Auto),
        ("plain", BackendChoice::Plain),
    ] {
        let mut r = Reference::load_with(&ckpt, choice).expect("load reference");
        group.bench_function(name, |b| {
            b.iter(|| std::hint::black_box(r.logits_all(&tokens).expect("logits")))
        });
    }
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
