//! fp16 range safety (docs/design.md, "fp16 range safety").
//!
//! Real checkpoints carry "massive activations" on the residual stream; RMSNorm squares them and
//! fp16 overflows past 65,504. A residual-stream scale α (a power of two, so scaling is exact
//! except where values become subnormal) is folded into the embedding output, o_proj and
//! down_proj, and the norms' epsilon by α². RMSNorm is scale-invariant, so logits, keys and
//! values are unchanged while every residual value shrinks by α.
//!
//! The scale is chosen from measured activation ranges ([`ActivationRanges`], from the reference
//! forward pass on calibration text); nothing here is specific to one model.

use serde::{Deserialize, Serialize};

/// Largest finite fp16.
pub const FP16_MAX: f64 = 65_504.0;

/// Headroom kept on the largest squared residual value inside RMSNorm: x·x must stay below
/// FP16_MAX / SQUARE_HEADROOM. Calibration text does not see every input, so the square keeps a
/// factor of 1.5 in reserve (about 22% on |x| itself) for activations larger than measured.
pub const SQUARE_HEADROOM: f64 = 1.5;

/// Smallest α considered: 2^-20. Below it the folded weights would mostly be subnormal.
pub const MIN_LOG2_ALPHA: i32 = -20;

/// Measured activation ranges of a float forward pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActivationRanges {
    /// Largest |value| on the residual stream entering each decoder block's norms and the
    /// final norm (any order; only the maximum matters for a global α).
    pub residual_max_abs: Vec<f32>,
    /// What the ranges were measured on (e.g. the calibration text's name and token count).
    pub source: String,
}

impl ActivationRanges {
    pub fn max_residual(&self) -> f32 {
        self.residual_max_abs
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(0.0, f32::max)
    }
}

/// The scales folded into a package, recorded in the contract metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scaling {
    /// Residual-stream scale α (1 = none).
    pub residual_scale: f64,
    /// The measured maximum |residual| the scale was chosen from, if any.
    pub measured_max_abs: Option<f32>,
    /// Where the measurement came from, or why there is none.
    pub source: String,
}

impl Scaling {
    /// No scaling (fp32 programs, or when no measurement is available).
    pub fn identity(reason: &str) -> Self {
        Scaling {
            residual_scale: 1.0,
            measured_max_abs: None,
            source: reason.to_string(),
        }
    }

    /// The largest power-of-two α ≤ 1 that keeps (α·max)² below FP16_MAX / SQUARE_HEADROOM.
    pub fn choose(ranges: &ActivationRanges) -> Self {
        let max = ranges.max_residual() as f64;
        let limit = (FP16_MAX / SQUARE_HEADROOM).sqrt();
        let log2 = if max <= limit {
            0
        } else {
            ((limit / max).log2().floor() as i32).max(MIN_LOG2_ALPHA)
        };
        Scaling {
            residual_scale: 2f64.powi(log2),
            measured_max_abs: Some(max as f32),
            source: ranges.source.clone(),
        }
    }

    pub fn is_identity(&self) -> bool {
        self.residual_scale == 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(v: &[f32]) -> ActivationRanges {
        ActivationRanges {
            residual_max_abs: v.to_vec(),
            source: "test".into(),
        }
    }

    #[test]
    fn smollm2_massive_activation_gets_one_over_128() {
        // docs/design.md: SmolLM2-135M's residual reaches about 24,900 from block 11 on; α = 1/128
        // was measured to fix it.
        let s = Scaling::choose(&ranges(&[3.0, 40.0, 24_900.0, 24_000.0]));
        assert_eq!(s.residual_scale, 1.0 / 128.0);
        let scaled = 24_900.0 * s.residual_scale;
        assert!(scaled * scaled < FP16_MAX);
    }

    #[test]
    fn small_activations_need_no_scale() {
        assert!(Scaling::choose(&ranges(&[1.0, 200.0])).is_identity());
    }

    #[test]
    fn non_finite_measurements_are_ignored_and_tiny_alpha_is_bounded() {
        let s = Scaling::choose(&ranges(&[f32::INFINITY, 5.0]));
        assert!(s.is_identity());
        let s = Scaling::choose(&ranges(&[f32::MAX]));
        assert_eq!(s.residual_scale, 2f64.powi(MIN_LOG2_ALPHA));
    }

    proptest::proptest! {
        #[test]
        fn chosen_scale_keeps_the_square_in_range(max in 1.0f32..1.0e7) {
            let s = Scaling::choose(&ranges(&[max]));
            let x = max as f64 * s.residual_scale;
            proptest::prop_assert!(x * x <= FP16_MAX / SQUARE_HEADROOM);
            // and it is the largest such power of two (or 1)
            if s.residual_scale < 1.0 {
                let y = 2.0 * x;
                proptest::prop_assert!(y * y > FP16_MAX / SQUARE_HEADROOM);
            }
        }
    }
}
