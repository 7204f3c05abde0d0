//! What sequential calibration is asked ([`SequentialOptions`], [`Sensitivity`]), and the
//! helpers every step shares: a calibration error, a weight read back, a block fetched, a
//! projection's output error.

use candle_core::{Device, Tensor};

use crate::checkpoint::Checkpoint;
use crate::model::plain::PlainModel;
use crate::quant::QuantError;

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

pub(super) fn calib_err(what: impl std::fmt::Display, e: candle_core::Error) -> QuantError {
    QuantError::Calibration {
        message: format!("{what}: {e}"),
    }
}

pub(super) fn to_vec(t: &Tensor) -> Result<Vec<f32>, QuantError> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| calib_err("reading a weight", e))
}

pub(super) fn fetch(model: &mut PlainModel, ckpt: &Checkpoint, l: usize) -> Result<(), QuantError> {
    model
        .fetch_layer(ckpt, l)
        .map_err(|e| QuantError::Calibration {
            message: e.to_string(),
        })
}

/// (diag(ΔW·H·ΔWᵀ) per row, tr(W·H·Wᵀ)) through candle's matmul.
pub(super) fn output_error(
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
