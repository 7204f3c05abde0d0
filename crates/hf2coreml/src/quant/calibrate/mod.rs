//! Calibrated palettization of a whole checkpoint, block by block.
//!
//! The calibration text runs through the float model one decoder block at a time ([`driver`]).
//! For block l, the inputs come from blocks 0..l *as already quantized*, so each block's LUTs
//! and indices correct for the error upstream (GPTQ's sequential order). Before the first block,
//! with a bits-per-weight target, every projection's sensitivity is measured and its rows' bit
//! widths chosen ([`allocate`]). Per block:
//! 1. one pass collects XᵀX of the four projection inputs (q/k/v, o, gate/up, down: [`site`]);
//! 2. optionally, AWQ-style per-input-channel scales `s = E[x²]^(a/2)` are searched per input
//!    site (the exponent a minimising the quantized output error) and folded into what precedes
//!    the projection: the RMSNorm weight for q/k/v and gate/up, the rows of v_proj for o_proj
//!    (shared across the query heads of one kv head), the rows of up_proj for down_proj. They
//!    cost nothing at run time ([`awq`]);
//! 3. every selected projection is palettized with [`quantize_linear`] ([`linear_fit`]: GPTQ, row
//!    scales, row groups), optionally on rotated inputs ([`crate::quant::rotation`]);
//! 4. the block runs again with its quantized weights to produce the next block's inputs.
//!
//! Memory: the hidden states of the calibration text ([tokens, hidden] f32) plus one block's
//! four XᵀX matrices.

mod allocate;
mod awq;
mod driver;
mod linear_fit;
mod sequential;
mod site;

use crate::arch::TensorSlot;
use crate::checkpoint::Checkpoint;
use crate::model::plain::PlainModel;
use crate::quant::QuantError;
pub use allocate::{BitChoice, MIXED_NBITS};
pub use awq::AwqChoice;
pub use driver::{CalibratedWeights, Sink};
pub use linear_fit::{
    quantize_linear, quantize_linear_mixed, relative_output_error, LinearMethod, QuantizedLinear,
    RowGroup,
};
pub use sequential::{Sensitivity, SequentialOptions};

/// Calibrate on `tokens` and palettize every projection `method_for` selects (others stay
/// float). Returns the palettized weights and the plain model carrying them (for evaluating
/// the result without building a package). The whole model is in memory in f32: `convert`
/// uses [`quantize_streaming`].
pub fn quantize_checkpoint(
    ckpt: &Checkpoint,
    tokens: &[u32],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
    options: &SequentialOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<(CalibratedWeights, PlainModel), QuantError> {
    let mut model = PlainModel::load(ckpt).map_err(|e| QuantError::Calibration {
        message: e.to_string(),
    })?;
    let weights = driver::quantize_model(
        &mut model, ckpt, tokens, method_for, options, progress, None,
    )?;
    Ok((weights, model))
}

/// [`quantize_checkpoint`] on a [`PlainModel::streaming`] model: one block is in memory in
/// f32 at a time (read, fitted, dropped), so memory does not grow with the model's depth.
/// The weights are the same. With a `sink`, each block's fitted projections go to it as the
/// block is done and the returned [`CalibratedWeights::linears`] is empty.
pub fn quantize_streaming(
    ckpt: &Checkpoint,
    tokens: &[u32],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
    options: &SequentialOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
    sink: Option<Sink<'_>>,
) -> Result<CalibratedWeights, QuantError> {
    let mut model = PlainModel::streaming(ckpt).map_err(|e| QuantError::Calibration {
        message: e.to_string(),
    })?;
    driver::quantize_model(
        &mut model, ckpt, tokens, method_for, options, progress, sink,
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::checkpoint::transformers_fixture;

    /// A 2-block random Qwen3 checkpoint transformers wrote.
    pub(super) fn tiny_qwen3() -> Checkpoint {
        transformers_fixture("qwen3")
    }

    /// A streaming model (one block in memory at a time) fits exactly the weights the fully
    /// loaded model fits, on every path: true-sequential, AWQ, and mixed precision.
    #[test]
    fn streaming_fits_the_same_weights_as_the_loaded_model() {
        let ckpt = tiny_qwen3();
        let tokens: Vec<u32> = (0..96).map(|i| (i * 13 % 50) as u32).collect();
        let method = |_: &TensorSlot| Some(LinearMethod::calibrated(4));
        let cases = [
            SequentialOptions {
                segment_len: 32,
                ..Default::default()
            },
            SequentialOptions {
                segment_len: 32,
                awq: true,
                ..Default::default()
            },
            SequentialOptions {
                segment_len: 32,
                target_bpw: Some(5.0),
                ..Default::default()
            },
            SequentialOptions {
                segment_len: 32,
                target_bpw: Some(5.0),
                sensitivity: Sensitivity::ModelKl,
                ..Default::default()
            },
        ];
        for options in cases {
            let (loaded, _) =
                quantize_checkpoint(&ckpt, &tokens, &method, &options, &|_, _| {}).unwrap();
            let streamed =
                quantize_streaming(&ckpt, &tokens, &method, &options, &|_, _| {}, None).unwrap();
            assert!(!loaded.linears.is_empty());
            let dense = |w: &CalibratedWeights| -> BTreeMap<String, (u8, Vec<f32>)> {
                w.linears
                    .iter()
                    .map(|(k, q)| (k.clone(), (q.max_nbits(), q.dequantize())))
                    .collect()
            };
            assert_eq!(dense(&loaded), dense(&streamed), "{options:?}");
            assert_eq!(loaded.replaced, streamed.replaced, "{options:?}");
        }
    }
}
