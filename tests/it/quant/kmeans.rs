//! The palettizer against brute force, and its round trips (property tests).

use half::f16;
use hf2coreml::quant::{
    pack_indices, packed_len, palettize_f16, palettize_tensor, try_unpack_indices, unpack_indices,
    Granularity, SUPPORTED_NBITS,
};
use proptest::prelude::*;

/// Weighted squared error of every labelling of `xs` into `k` labels, minimised, with each
/// label's centre its weighted mean: the true optimum over all partitions (not only contiguous
/// ones), feasible for n ≤ 7, k ≤ 4.
fn brute_force(xs: &[f64], ws: &[f64], k: usize) -> f64 {
    let n = xs.len();
    let mut best = f64::INFINITY;
    let total = k.pow(n as u32);
    let mut labels = vec![0usize; n];
    for code in 0..total {
        let mut c = code;
        for l in labels.iter_mut() {
            *l = c % k;
            c /= k;
        }
        let mut cost = 0.0;
        for g in 0..k {
            let (mut w, mut s) = (0.0, 0.0);
            for i in 0..n {
                if labels[i] == g {
                    w += ws[i];
                    s += ws[i] * xs[i];
                }
            }
            if w == 0.0 {
                continue;
            }
            let m = s / w;
            for i in 0..n {
                if labels[i] == g {
                    cost += ws[i] * (xs[i] - m).powi(2);
                }
            }
        }
        best = best.min(cost);
    }
    best
}

/// Bound on what rounding one cluster mean to f16 can add per unit weight: (half an ulp at the
/// largest magnitude)². Re-assignment after rounding only lowers the error further.
fn rounding_slack(xs: &[f64]) -> f64 {
    let max = xs.iter().fold(0.0f64, |a, x| a.max(x.abs()));
    let v = f16::from_f64(max);
    let ulp = f16::from_bits(v.to_bits() + 1).to_f64() - v.to_f64();
    (ulp / 2.0).powi(2)
}

fn f16s() -> impl Strategy<Value = f16> {
    (-2000i32..2000).prop_map(|i| f16::from_f32(i as f32 / 512.0))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn optimal_against_every_partition(
        vals in prop::collection::vec(f16s(), 1..7),
        raw_w in prop::collection::vec(0.05f32..4.0, 7),
        nbits in prop::sample::select(vec![1u8, 2]),
        weighted in any::<bool>(),
    ) {
        let n = vals.len();
        let w: Vec<f32> = raw_w[..n].to_vec();
        let p = palettize_f16(&vals, nbits, weighted.then_some(w.as_slice())).unwrap();
        let xs: Vec<f64> = vals.iter().map(|v| v.to_f64()).collect();
        let ws: Vec<f64> = if weighted { w.iter().map(|&x| x as f64).collect() } else { vec![1.0; n] };
        let ours: f64 = xs.iter().zip(&ws).zip(&p.indices)
            .map(|((x, w), &i)| w * (x - p.lut[i as usize].to_f64()).powi(2)).sum();
        let k = (1usize << nbits).min(4);
        let best = brute_force(&xs, &ws, k);
        let slack = rounding_slack(&xs) * ws.iter().sum::<f64>();
        prop_assert!(ours <= best + slack + 1e-15, "ours {ours} best {best} slack {slack}");
    }

    #[test]
    fn lut_and_indices_reproduce_the_reported_mse(
        vals in prop::collection::vec(f16s(), 0..400),
        nbits in prop::sample::select(SUPPORTED_NBITS.to_vec()),
    ) {
        let p = palettize_f16(&vals, nbits, None).unwrap();
        prop_assert_eq!(p.lut.len(), 1usize << nbits);
        prop_assert!(p.lut.windows(2).all(|w| w[0] <= w[1]));
        prop_assert_eq!(p.indices.len(), vals.len());
        let deq = p.dequantize();
        let mse = vals.iter().zip(&deq).map(|(a, b)| (a.to_f64() - b.to_f64()).powi(2)).sum::<f64>()
            / vals.len().max(1) as f64;
        // The report sums the same squared errors grouped by distinct value: f64 rounding only.
        prop_assert!((mse - p.mse).abs() <= 1e-12 * mse.max(1e-300));
        // Every element sits at its nearest LUT entry (no better entry exists).
        for (v, &i) in vals.iter().zip(&p.indices) {
            let d = (v.to_f64() - p.lut[i as usize].to_f64()).abs();
            prop_assert!(p.lut.iter().all(|l| (v.to_f64() - l.to_f64()).abs() >= d));
        }
    }

    #[test]
    fn pack_round_trips(
        raw in prop::collection::vec(any::<u8>(), 0..300),
        nbits in prop::sample::select(vec![1u8, 2, 3, 4, 5, 6, 7, 8]),
    ) {
        let idx: Vec<u8> = raw.iter().map(|&b| (b as u16 % (1u16 << nbits)) as u8).collect();
        let packed = pack_indices(&idx, nbits);
        prop_assert_eq!(packed.len(), packed_len(idx.len(), nbits));
        prop_assert_eq!(unpack_indices(&packed, nbits, idx.len()), idx.clone());
        // Bit-exact LSB-first stream: element k's bit b is stream bit k·nbits + b.
        for (k, &v) in idx.iter().enumerate() {
            for b in 0..nbits as usize {
                let s = k * nbits as usize + b;
                prop_assert_eq!((packed[s / 8] >> (s % 8)) & 1, (v >> b) & 1);
            }
        }
        if !idx.is_empty() {
            prop_assert!(try_unpack_indices(&packed[..packed.len() - 1], nbits, idx.len()).is_err());
        }
    }

    #[test]
    fn packed_tensor_dequantizes_to_lut_of_indices(
        vals in prop::collection::vec(f16s(), 24..25),
        nbits in prop::sample::select(SUPPORTED_NBITS.to_vec()),
    ) {
        let t = palettize_tensor(&vals, &[4, 6], nbits, Granularity::PerTensor, None).unwrap();
        let p = palettize_f16(&vals, nbits, None).unwrap();
        prop_assert_eq!(t.indices(), p.indices.clone());
        prop_assert_eq!(t.dequantize(), p.dequantize());
    }
}

#[test]
fn realistic_tensor_is_optimal_against_lloyd_refinement() {
    // No brute force at this size: check that Lloyd iterations started from our LUT cannot
    // lower the error (a local-optimality certificate for the exact solution).
    let mut rng = hf2coreml_testkit::SplitMix64(11);
    let vals: Vec<f16> = (0..200_000)
        .map(|_| f16::from_f32(rng.normal() * 0.04))
        .collect();
    let p = palettize_f16(&vals, 4, None).unwrap();
    let xs: Vec<f64> = vals.iter().map(|v| v.to_f64()).collect();
    let mut centers: Vec<f64> = p.lut.iter().map(|v| v.to_f64()).collect();
    for _ in 0..5 {
        let mut s = [0.0; 16];
        let mut c = [0.0; 16];
        for &x in &xs {
            let j = (0..16)
                .min_by(|&a, &b| (x - centers[a]).abs().total_cmp(&(x - centers[b]).abs()))
                .unwrap_or(0);
            s[j] += x;
            c[j] += 1.0;
        }
        for j in 0..16 {
            if c[j] > 0.0 {
                centers[j] = s[j] / c[j];
            }
        }
    }
    let lloyd = xs
        .iter()
        .map(|&x| {
            centers
                .iter()
                .map(|c| (x - c).powi(2))
                .fold(f64::INFINITY, f64::min)
        })
        .sum::<f64>()
        / xs.len() as f64;
    // Lloyd keeps float centres, ours are rounded to f16: allow the rounding slack only.
    let slack = rounding_slack(&xs);
    assert!(p.mse <= lloyd + slack, "ours {} lloyd {}", p.mse, lloyd);
    assert!(
        p.snr_db > 15.0,
        "4-bit SNR of a Gaussian is ~20 dB, got {}",
        p.snr_db
    );
}
