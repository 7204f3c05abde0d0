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
mod site;

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};

use crate::arch::TensorSlot;
use crate::checkpoint::Checkpoint;
use crate::model::plain::PlainModel;
use crate::quant::QuantError;
pub use allocate::{BitChoice, MIXED_NBITS};
pub use awq::AwqChoice;
pub use linear_fit::{
    quantize_linear, quantize_linear_mixed, relative_output_error, LinearMethod, QuantizedLinear,
    RowGroup,
};

/// How the checkpoint is calibrated and palettized.
#[derive(Debug, Clone)]
pub struct SequentialOptions {
    /// Tokens per independent calibration sequence.
    pub segment_len: usize,
    /// Search per-input-channel scales (folded into the preceding op).
    pub awq: bool,
    /// True-sequential within a block: q/k/v are palettized first and o_proj is fitted to the
    /// attention output computed with them, gate/up before down_proj likewise, so each
    /// projection sees (and corrects for) the errors of the ones before it; and the block runs
    /// once instead of twice. Without it (and always with AWQ, whose o_proj/down_proj scales
    /// fold into v_proj/up_proj before those are palettized) every projection is fitted to the
    /// block's float activations.
    pub true_sequential: bool,
    /// Mixed precision: choose 4, 6 or 8 bits per projection from measured sensitivity so the
    /// palettized projections average at most this many bits per weight (LUTs and row scales
    /// counted). `None`: every projection at the bits its method says.
    pub target_bpw: Option<f64>,
    /// How the mixed-precision allocation measures a projection's sensitivity.
    pub sensitivity: Sensitivity,
    /// Rows per unit of the mixed-precision allocation: each projection's rows, most
    /// error-prone first, are upgraded in chunks of this many (0: whole projections).
    pub chunk_rows: usize,
}

/// The error the mixed-precision allocation ranks projections by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sensitivity {
    /// The projection's own output error relative to its output, tr(ΔW·H·ΔWᵀ)/tr(W·H·Wᵀ):
    /// blind to how much that output matters downstream.
    LayerOutput,
    /// The block output's error (the residual stream) with only this projection quantized.
    #[default]
    BlockOutput,
    /// The model's next-token KL(float ‖ quantized) on the calibration segments with only this
    /// projection quantized: what the allocation is for, at one forward pass from the
    /// projection's block to the logits per probe (every block is brought into memory).
    ModelKl,
}

impl Default for SequentialOptions {
    fn default() -> Self {
        SequentialOptions {
            segment_len: 512,
            awq: false,
            true_sequential: true,
            target_bpw: None,
            sensitivity: Sensitivity::default(),
            chunk_rows: 0,
        }
    }
}

/// The calibrated checkpoint.
#[derive(Debug, Clone)]
pub struct CalibratedWeights {
    /// Palettized projections by checkpoint tensor name.
    pub linears: BTreeMap<String, QuantizedLinear>,
    /// Unpalettized tensors whose values changed (AWQ scales folded into RMSNorm weights,
    /// biases, or projections the recipe keeps fp16), by checkpoint tensor name, f32 row-major.
    pub replaced: BTreeMap<String, Vec<f32>>,
    pub awq: Vec<AwqChoice>,
    /// With a target bpw: what was measured and chosen per projection.
    pub allocation: Vec<BitChoice>,
    pub tokens: usize,
}

fn calib_err(what: impl std::fmt::Display, e: candle_core::Error) -> QuantError {
    QuantError::Calibration {
        message: format!("{what}: {e}"),
    }
}

fn to_vec(t: &Tensor) -> Result<Vec<f32>, QuantError> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| calib_err("reading a weight", e))
}

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

/// Where fitted projections go as each block is done (tensor name, projection), instead of
/// [`CalibratedWeights::linears`].
pub type Sink<'a> = &'a mut dyn FnMut(String, QuantizedLinear) -> Result<(), QuantError>;

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

fn fetch(model: &mut PlainModel, ckpt: &Checkpoint, l: usize) -> Result<(), QuantError> {
    model
        .fetch_layer(ckpt, l)
        .map_err(|e| QuantError::Calibration {
            message: e.to_string(),
        })
}

/// (diag(ΔW·H·ΔWᵀ) per row, tr(W·H·Wᵀ)) through candle's matmul.
fn output_error(
    w: &[f32],
    wq: &[f32],
    rows: usize,
    cols: usize,
    h: &Tensor,
) -> Result<(Vec<f64>, f64), QuantError> {
    let f = |e| calib_err("output error", e);
    let wt = Tensor::from_slice(w, (rows, cols), &Device::Cpu).map_err(f)?;
    let qt = Tensor::from_slice(wq, (rows, cols), &Device::Cpu).map_err(f)?;
    let d = (&wt - &qt).map_err(f)?;
    let per_row = |x: &Tensor| -> candle_core::Result<Vec<f64>> {
        let xh = x.matmul(h)?;
        let v: Vec<f32> = (xh * x)?.sum(1)?.to_vec1()?;
        Ok(v.into_iter().map(f64::from).collect())
    };
    let num = per_row(&d).map_err(f)?;
    let den = per_row(&wt).map_err(f)?.iter().sum();
    Ok((num, den))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TinyModel;

    /// A 3-block random Qwen2 checkpoint in a temporary directory (kept while the guard lives).
    pub(super) fn tiny_qwen2() -> (tempfile::TempDir, Checkpoint) {
        let tiny = TinyModel {
            layers: 3,
            ..TinyModel::qwen2()
        };
        let dir = tiny.write_temp().unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        (dir, ckpt)
    }

    /// A streaming model (one block in memory at a time) fits exactly the weights the fully
    /// loaded model fits, on every path: true-sequential, AWQ, and mixed precision.
    #[test]
    fn streaming_fits_the_same_weights_as_the_loaded_model() {
        let (_dir, ckpt) = tiny_qwen2();
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
