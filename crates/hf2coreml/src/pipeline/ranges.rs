//! fp16 range safety: the residual stream's ranges, measured by the float reference on the
//! shipped calibration text, and the residual scale chosen from them.

use super::convert_error::ConvertError;
use super::options::ComputePrecision;
use super::texts::shipped_calibration_tokens;
use crate::checkpoint::Checkpoint;
use crate::graph::scaling::{ActivationRanges, Scaling};
use crate::model::calibrate::{self, ActivationStats, CalibrationOptions};

/// The residual scale for these options: none for fp32 programs or without measurements.
pub fn scaling_for(precision: ComputePrecision, ranges: Option<&ActivationRanges>) -> Scaling {
    match (precision, ranges) {
        (ComputePrecision::Fp32, _) => Scaling::identity("fp32 program: no range scaling needed"),
        (ComputePrecision::Fp16, Some(r)) => Scaling::choose(r),
        (ComputePrecision::Fp16, None) => {
            Scaling::identity("no activation ranges measured: residual stream not scaled")
        }
    }
}

/// Per-site residual maxima from calibration statistics.
pub fn ranges_from_stats(stats: &ActivationStats, source: String) -> ActivationRanges {
    let mut residual_max_abs = vec![stats.embedding_max_abs];
    residual_max_abs.extend(stats.layers.iter().map(|l| {
        l.max_abs_residual_after_attention
            .max(l.max_abs_residual_after_mlp)
    }));
    residual_max_abs.push(stats.final_norm_max_abs);
    ActivationRanges {
        residual_max_abs,
        source,
    }
}

/// Tokens of the calibration text ranges are measured on: one 512-token segment. Massive
/// activations appear within the first tokens of a sequence, and SQUARE_HEADROOM covers inputs
/// larger than measured; a second segment would double the cost of this stage for little new
/// information.
pub const RANGE_TOKENS: usize = 512;

/// Run the float reference over the calibration text and collect residual-stream ranges.
pub fn measure_ranges(ckpt: &Checkpoint) -> Result<ActivationRanges, ConvertError> {
    let (mut tokens, source) = shipped_calibration_tokens(ckpt)?;
    tokens.truncate(RANGE_TOKENS);
    let source = format!("{source}, first {} used", tokens.len());
    let stats = calibrate::calibrate(ckpt, &tokens, &CalibrationOptions::default())?;
    crate::fsutil::release_free_memory();
    Ok(ranges_from_stats(&stats, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp32_and_unmeasured_programs_are_not_scaled() {
        let r = ActivationRanges {
            residual_max_abs: vec![24_900.0],
            source: "t".into(),
        };
        assert!(scaling_for(ComputePrecision::Fp32, Some(&r)).is_identity());
        assert!(scaling_for(ComputePrecision::Fp16, None).is_identity());
        assert_eq!(
            scaling_for(ComputePrecision::Fp16, Some(&r)).residual_scale,
            1.0 / 128.0
        );
    }
}
