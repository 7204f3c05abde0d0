//! Criterion micro-benchmarks of the palettizer on one SmolLM2-sized projection (1536 × 576,
//! normal weights in fp16): the exact k-means at each supported bit width, and index packing.
//! The real-model comparison with coremltools is `make bench-palettize`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use half::f16;
use hf2coreml::quant::{pack_indices, palettize_f16, unpack_indices};
use hf2coreml_testkit::SplitMix64;

fn projection() -> Vec<f16> {
    let mut rng = SplitMix64(9);
    (0..1536 * 576)
        .map(|_| f16::from_f32(rng.normal() * 0.05))
        .collect()
}

fn kmeans(c: &mut Criterion) {
    let w = projection();
    let mut g = c.benchmark_group("palettize_f16_1536x576");
    g.sample_size(10);
    for nbits in [1u8, 2, 4, 6, 8] {
        g.bench_with_input(BenchmarkId::from_parameter(nbits), &nbits, |b, &n| {
            b.iter(|| palettize_f16(&w, n, None))
        });
    }
    g.finish();
}

fn packing(c: &mut Criterion) {
    let n = 1536 * 576;
    let mut rng = SplitMix64(3);
    let mut g = c.benchmark_group("pack_1536x576");
    for nbits in [4u8, 6] {
        let idx: Vec<u8> = (0..n)
            .map(|_| (rng.next_u64() % (1 << nbits)) as u8)
            .collect();
        let packed = pack_indices(&idx, nbits);
        g.bench_with_input(BenchmarkId::new("pack", nbits), &nbits, |b, &k| {
            b.iter(|| pack_indices(&idx, k))
        });
        g.bench_with_input(BenchmarkId::new("unpack", nbits), &nbits, |b, &k| {
            b.iter(|| unpack_indices(&packed, k, n))
        });
    }
    g.finish();
}

criterion_group!(benches, kmeans, packing);
criterion_main!(benches);
