//! The runner's packed kernel against the dense one (docs/design.md, "The runner's memory"):
//! `linear` over a LUT-palettized weight left packed in a mapped weight file, against the same
//! weight decoded to fp16 at load (what `--dense-weights` holds), at Llama 3.2 1B's MLP shapes,
//! for x of 1 row (a decode step) and of 64 rows (a prefill chunk: each weight row is decoded
//! once per call for all rows). The two kernels alternate within every round, so both run
//! under the same load; it prints the median time per call of each, the ratio packed/dense,
//! and checks that both gave the same bits. The last case is an fp16 weight of half a 1B's
//! lm_head, read from the map against the same values in anonymous memory.
//!
//! Then the LUT dot product alone at every instruction-set level this CPU has (`HF2COREML_ISA`
//! caps what `run` uses; here each level is called explicitly), the levels alternating within
//! every round: the time per byte of packed weights and each level's time over the fastest's.
//!
//! Run: `cargo bench --profile dev --bench packed_kernel` (env ROUNDS, default 9; ONLY=isa for
//! the per-level section alone).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use half::f16;
use hf2coreml::mil::DType;
use hf2coreml::mlpackage::{pack_bits, BlobFile, BlobWriter, TensorTypeInfo};
use hf2coreml::runtime::interp::kernels::{self, LutTable, Table};
use hf2coreml::runtime::interp::ops::{self, Args};
use hf2coreml::runtime::interp::packed::{self, Form, Lut, Packed};
use hf2coreml::runtime::interp::tensor::{Data, Tensor};
use hf2coreml::util::isa::Isa;

/// Deterministic pseudo-random numbers (a 64-bit LCG's high bits).
fn lcg(n: usize, seed: u64) -> impl Iterator<Item = u32> {
    let mut s = seed;
    (0..n).map(move |_| {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (s >> 33) as u32
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds per call of `f`, one sample.
fn time<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let t = Instant::now();
    let out = f();
    (t.elapsed().as_secs_f64(), out)
}

fn case(dir: &std::path::Path, oc: usize, ic: usize, nbits: u32, rows: usize, rounds: usize) {
    let n = oc * ic;
    let entries = 1usize << nbits.min(8);
    let idx: Vec<u32> = lcg(n, 7).map(|v| v % entries as u32).collect();
    let table: Vec<f32> = lcg(entries, 3)
        .map(|v| f16::from_f32(v as f32 / u32::MAX as f32 - 0.25).to_f32())
        .collect();
    let mut w = BlobWriter::new();
    // nbits 16: an fp16 weight (the tied embedding and lm_head) read in place.
    let off = if nbits == 16 {
        let raw: Vec<u8> = idx
            .iter()
            .flat_map(|&i| f16::from_f32(table[i as usize]).to_le_bytes())
            .collect();
        w.push(DType::F16, &raw)
    } else {
        w.push(DType::U8, &pack_bits(&idx, nbits))
    };
    let path = dir.join(format!("w{oc}x{ic}b{nbits}.bin"));
    std::fs::write(&path, w.finish()).expect("write weight file");
    let file = Arc::new(BlobFile::open(&path).expect("map weight file"));
    let form = match nbits {
        16 => Form::Half,
        _ => Form::Lut(Lut {
            nbits,
            tables: table.clone(),
            rows_per_table: oc,
            scale: None,
        }),
    };
    let p = Packed::new(file, off, DType::F16, vec![oc, ic], form).expect("packed weight");
    // The dense loader's weight: decoded, stored as fp16 for linear.
    let half: Vec<f16> = idx
        .iter()
        .map(|&i| f16::from_f32(table[i as usize]))
        .collect();
    let dense = Tensor::new(DType::F16, vec![oc, ic], Data::Half(half));
    let xv: Vec<f32> = lcg(rows * ic, 5)
        .map(|v| v as f32 / u32::MAX as f32 - 0.5)
        .collect();
    let x = Tensor::f32(vec![1, rows, ic], xv);
    let out = [TensorTypeInfo {
        dtype: DType::F32,
        shape: vec![1, rows, oc],
    }];
    let args = |with_weight: bool| Args {
        map: [("x", vec![&x])]
            .into_iter()
            .chain(with_weight.then(|| ("weight", vec![&dense])))
            .collect::<HashMap<_, _>>(),
        outputs: &out,
    };
    let (mut td, mut tp) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (a, yd) = time(|| ops::linear(&args(true)).expect("dense linear"));
        let (b, yp) = time(|| packed::linear(&args(false), &p).expect("packed linear"));
        td.push(a);
        tp.push(b);
        let bits = |t: &Tensor| t.as_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&yd), bits(&yp), "packed and dense differ");
    }
    let (d, q) = (median(td), median(tp));
    println!(
        "linear {oc}x{ic}, {}, x {rows} row(s): dense fp16 {:.2} ms, packed {:.2} ms, packed/dense {:.2}",
        if nbits == 16 { "fp16 in the map".to_string() } else { format!("{nbits}-bit LUT") },
        d * 1e3,
        q * 1e3,
        q / d
    );
}

/// `oc` rows of `ic` `nbits`-bit indices against one x, through `dot_lut_f16_at` at every
/// level the CPU has, one thread: what a decode step's packed `linear` spends per row.
fn isa_case(oc: usize, ic: usize, nbits: u32, rounds: usize) {
    let entries = 1usize << nbits;
    let idx: Vec<u32> = lcg(oc * ic, 11).map(|v| v % entries as u32).collect();
    let data = pack_bits(&idx, nbits);
    let mut table: Table<f16> = [f16::ZERO; 256];
    for (t, v) in table.iter_mut().zip(lcg(entries, 13)) {
        *t = f16::from_f32(v as f32 / u32::MAX as f32 - 0.5);
    }
    let table = LutTable::new(&table, entries);
    let x: Vec<f32> = lcg(ic, 17)
        .map(|v| v as f32 / u32::MAX as f32 - 0.5)
        .collect();
    let levels: Vec<Isa> = Isa::ALL.into_iter().filter(|l| l.available()).collect();
    for l in Isa::ALL.iter().filter(|l| !l.available()) {
        println!("  {l}: not on this CPU, skipped");
    }
    let mut times = vec![Vec::new(); levels.len()];
    let mut row = Vec::new();
    for _ in 0..rounds {
        let mut sums = Vec::new();
        for (level, t) in levels.iter().zip(&mut times) {
            let (secs, sum) = time(|| {
                (0..oc)
                    .map(|r| {
                        kernels::dot_lut_f16_at(*level, &x, &data, r * ic, nbits, &table, &mut row)
                    })
                    .sum::<f32>()
            });
            t.push(secs);
            sums.push((*level, sum));
        }
        let x86: Vec<u32> = sums
            .iter()
            .filter(|(l, _)| *l >= Isa::Avx2)
            .map(|(_, s)| s.to_bits())
            .collect();
        assert!(x86.windows(2).all(|p| p[0] == p[1]), "x86 levels differ");
    }
    let med: Vec<f64> = times.into_iter().map(median).collect();
    let best = med.iter().copied().fold(f64::INFINITY, f64::min);
    let bytes = data.len() as f64;
    for (level, m) in levels.iter().zip(&med) {
        println!(
            "  {oc}x{ic} {nbits}-bit, {level:<12} {:7.2} ms, {:6.3} ns/byte, {:5.2} GB/s, {:.2}x the fastest",
            m * 1e3,
            m * 1e9 / bytes,
            bytes / m / 1e9,
            m / best
        );
    }
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(9);
    let dir = std::env::temp_dir().join(format!("packed_kernel.{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    println!(
        "load before: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let only_isa = std::env::var("ONLY").is_ok_and(|v| v == "isa");
    for (oc, ic, nbits) in [
        (8192, 2048, 4),
        (2048, 8192, 4),
        (8192, 2048, 6),
        (8192, 2048, 8),
    ] {
        isa_case(oc, ic, nbits, rounds);
    }
    if only_isa {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    for (oc, ic, nbits, rows) in [
        (8192, 2048, 4, 1),
        (2048, 8192, 4, 1),
        (8192, 2048, 8, 1),
        (8192, 2048, 2, 1),
        (8192, 2048, 4, 64),
        (2048, 8192, 4, 64),
        (65536, 2048, 16, 1),
    ] {
        case(&dir, oc, ic, nbits, rows, rounds);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
