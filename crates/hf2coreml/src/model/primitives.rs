//! What the plain forward pass and Gemma 4's additions to it ([`super::gemma4`]) share: a
//! checkpoint tensor loaded in f32, RMSNorm with a weight, the tanh-approximated GELU.

use candle_core::{Device, Tensor, D};

use super::reference_error::ReferenceError;
use crate::checkpoint::Checkpoint;

/// Tensor `name` of the checkpoint in f32.
pub(super) fn load(
    ckpt: &Checkpoint,
    name: &str,
    device: &Device,
) -> Result<Tensor, ReferenceError> {
    let view = ckpt.tensor(name)?;
    Tensor::from_vec(view.to_f32(), view.shape, device)
        .map_err(|e| ReferenceError::candle(format!("loading `{name}`"), e))
}

/// x / sqrt(mean(x²) + eps) · w over the last dimension.
pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(w)
}

/// The tanh-approximated GELU (`gelu_pytorch_tanh`):
/// 0.5 · g · (1 + tanh(√(2/π) · (g + 0.044715 · g³))).
pub(super) fn gelu_tanh(gate: &Tensor) -> candle_core::Result<Tensor> {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let inner = ((gate + (gate.powf(3.0)? * 0.044715)?)? * c)?;
    (gate * 0.5)? * (inner.tanh()? + 1.0)?
}
