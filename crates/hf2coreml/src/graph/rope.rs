//! Rotary position embedding tables, precomputed for positions [0, S).
//!
//! The graph gathers rows of these tables by position, so no trigonometry runs on device and
//! rope scaling (linear, llama3) is applied exactly once, here, in f64.

use crate::arch::RopeScaling;

/// Inverse frequencies for the first half of a head (`head_dim / 2` values), with the
/// checkpoint's rope scaling applied (transformers' `_compute_*_parameters`).
pub fn inv_freq(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f64> {
    let half = head_dim / 2;
    let base: Vec<f64> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    match scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = *original_max_position_embeddings as f64;
            let low_freq_wavelen = old / low_freq_factor;
            let high_freq_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        // The short factors: `check_spec` refuses a package whose context outgrows the
        // original one, past which transformers would switch to the long factors.
        RopeScaling::LongRope { short_factor, .. } => {
            base.iter().zip(short_factor).map(|(f, s)| f / s).collect()
        }
    }
}

/// cos and sin tables, each `[positions, head_dim]` row-major, in the rotate-half layout
/// (the half-width angles repeated twice per row), as Hugging Face Llama computes them. With
/// partial RoPE (`2 × inv_freq.len() < head_dim`) the dimensions past the rotated ones get
/// cos 1 and sin 0, so x·cos + rotated·sin passes them through exactly.
///
/// `scale` multiplies the rotated entries (LongRoPE's attention factor; 1 otherwise).
pub fn tables(
    positions: usize,
    head_dim: usize,
    inv_freq: &[f64],
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let half = inv_freq.len();
    debug_assert!(2 * half <= head_dim);
    let pass = head_dim - 2 * half;
    let mut cos = Vec::with_capacity(positions * head_dim);
    let mut sin = Vec::with_capacity(positions * head_dim);
    for p in 0..positions {
        for _ in 0..2 {
            for f in inv_freq {
                let a = p as f64 * f;
                cos.push(scale * a.cos());
                sin.push(scale * a.sin());
            }
        }
        cos.extend(std::iter::repeat_n(1.0, pass));
        sin.extend(std::iter::repeat_n(0.0, pass));
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 trigonometry against closed forms: only rounding differs.
    const EXACT: f64 = 1e-12;

    #[test]
    fn default_frequencies() {
        let f = inv_freq(8, 10_000.0, &RopeScaling::None);
        assert_eq!(f.len(), 4);
        assert!((f[0] - 1.0).abs() < EXACT);
        assert!((f[1] - 0.1).abs() < EXACT);
        assert!((f[2] - 0.01).abs() < EXACT);
    }

    #[test]
    fn linear_scaling_divides() {
        let a = inv_freq(8, 10_000.0, &RopeScaling::None);
        let b = inv_freq(8, 10_000.0, &RopeScaling::Linear { factor: 4.0 });
        for (x, y) in a.iter().zip(&b) {
            assert!((x / 4.0 - y).abs() < EXACT);
        }
    }

    #[test]
    fn llama3_keeps_high_and_scales_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let a = inv_freq(128, 500_000.0, &RopeScaling::None);
        let b = inv_freq(128, 500_000.0, &s);
        // wavelength 2π < 8192/4: untouched.
        assert!((a[0] - b[0]).abs() < EXACT);
        // the lowest frequency has a wavelength far beyond 8192: divided by the factor.
        assert!((a[63] / 8.0 - b[63]).abs() < EXACT);
        // in between: between the two.
        let mid = (0..64)
            .find(|&i| {
                let w = 2.0 * std::f64::consts::PI / a[i];
                w > 2048.0 && w < 8192.0
            })
            .unwrap();
        assert!(b[mid] < a[mid] && b[mid] > a[mid] / 8.0);
    }

    #[test]
    fn tables_repeat_halves() {
        let f = inv_freq(4, 10_000.0, &RopeScaling::None);
        let (cos, sin) = tables(3, 4, &f, 1.0);
        assert_eq!(cos.len(), 12);
        assert_eq!(&cos[0..4], &[1.0, 1.0, 1.0, 1.0]);
        assert!((sin[4] - 1f64.sin()).abs() < EXACT);
        assert_eq!(cos[4], cos[6]);
        assert_eq!(sin[9], sin[11]);
    }

    #[test]
    fn partial_tables_pass_the_rest_through() {
        // 4 of 8 dimensions rotate: the exponents run over the 4.
        let f = inv_freq(4, 10_000.0, &RopeScaling::None);
        let (cos, sin) = tables(2, 8, &f, 1.0);
        assert_eq!(cos.len(), 16);
        assert!((sin[8] - 1f64.sin()).abs() < EXACT);
        assert_eq!(sin[10], sin[8]);
        assert_eq!(&cos[12..16], &[1.0; 4]);
        assert_eq!(&sin[12..16], &[0.0; 4]);
    }

    #[test]
    fn longrope_divides_by_the_short_factors_and_scales_rotated_entries() {
        let s = RopeScaling::LongRope {
            short_factor: vec![1.0, 2.0],
            long_factor: vec![4.0, 8.0],
            original_max_position_embeddings: 32,
            attention_factor: 1.5,
        };
        let (a, b) = (
            inv_freq(4, 100.0, &RopeScaling::None),
            inv_freq(4, 100.0, &s),
        );
        assert!((a[0] - b[0]).abs() < EXACT && (a[1] / 2.0 - b[1]).abs() < EXACT);
        let (cos, sin) = tables(1, 6, &b, s.attention_factor());
        assert_eq!(&cos[..6], &[1.5, 1.5, 1.5, 1.5, 1.0, 1.0]);
        assert_eq!(&sin[..6], &[0.0; 6]);
    }
}
