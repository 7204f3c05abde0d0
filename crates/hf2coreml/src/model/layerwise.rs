//! The reference's logits over a known token list in bounded memory: validation teacher-forces
//! its text, so the whole sequence can go through the model one decoder block at a time (a
//! [`PlainModel::streaming`] model: one block's weights in f32 alive), the embedding rows read
//! straight from the checkpoint and the lm_head multiplied a slice of the vocabulary at a time.
//! Memory is one block in f32 plus the sequence's activations and its logits, whatever the
//! depth or the vocabulary: what an 8B checkpoint (32 GB in f32) needs to be validated here.

use candle_core::{Device, Tensor};

use super::plain::{self, PlainModel};
use super::reference_error::{check_tokens, ctx, ReferenceError};
use crate::arch::TensorId;
use crate::checkpoint::{Checkpoint, TensorView};

/// f32 weights above which `validate` computes its reference layer by layer (2 GiB: every
/// checkpoint up to ~500M parameters keeps candle-transformers as its witness).
pub const REFERENCE_BUDGET: u64 = 2 << 30;

/// The report's name for this reference.
pub const LAYERWISE_BACKEND: &str = "hf2coreml plain f32, block by block";

/// Bytes of lm_head converted to f32 at a time (a slice of the vocabulary).
pub const HEAD_SLICE_BYTES: usize = 64 << 20;

/// How the reference's logits are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReferencePath {
    /// The whole model loaded in f32 ([`super::Reference::load`]: candle-transformers where it
    /// can express the checkpoint).
    Whole,
    /// One block at a time ([`logits_layerwise`]).
    Layerwise,
}

impl ReferencePath {
    /// `Layerwise` when the checkpoint's weights in f32 exceed `budget` bytes.
    pub fn choose(ckpt: &Checkpoint, budget: u64) -> Self {
        if f32_weight_bytes(ckpt) > budget {
            ReferencePath::Layerwise
        } else {
            ReferencePath::Whole
        }
    }
}

/// What every tensor of `ckpt` takes in f32 (a tied table counted once, as it is loaded once).
pub fn f32_weight_bytes(ckpt: &Checkpoint) -> u64 {
    ckpt.slots().iter().map(|s| s.numel() as u64 * 4).sum()
}

/// Logits [T][V] at every position of `tokens` (a fresh sequence), computed block by block;
/// `on_block(l)` is called after block `l`. The same forward pass as the plain backend's
/// `logits_all`, to f32 rounding.
pub fn logits_layerwise(
    ckpt: &Checkpoint,
    tokens: &[u32],
    on_block: &mut dyn FnMut(usize),
) -> Result<Vec<Vec<f32>>, ReferenceError> {
    logits_layerwise_sliced(ckpt, tokens, HEAD_SLICE_BYTES, on_block)
}

/// [`logits_layerwise`] with the lm_head converted `slice_bytes` of f32 at a time (at least
/// one row).
pub fn logits_layerwise_sliced(
    ckpt: &Checkpoint,
    tokens: &[u32],
    slice_bytes: usize,
    on_block: &mut dyn FnMut(usize),
) -> Result<Vec<Vec<f32>>, ReferenceError> {
    check_tokens(ckpt.spec(), tokens, 0)?;
    let mut model = PlainModel::streaming(ckpt)?;
    let mut x = plain::embed_rows(ckpt, tokens)?;
    // Gemma 4's blocks read per-layer inputs and other blocks' keys and values: the sequence
    // carries them from block to block (its table's rows of these tokens only).
    let gemma4 = ckpt.spec().gemma4.is_some();
    model.fetch_per_layer(ckpt, tokens)?;
    let mut seg = ctx(model.segment(tokens, &x), "per-layer inputs")?;
    for l in 0..ckpt.spec().num_hidden_layers {
        model.fetch_layer(ckpt, l)?;
        let out = match gemma4 {
            true => model.block_in(l, &x, &mut seg, &mut plain::Blind),
            false => model.block(l, &x, &mut plain::Blind),
        };
        x = ctx(out, &format!("block {l}"))?;
        model.release_layer(l);
        on_block(l);
    }
    let h = ctx(model.final_norm(&x), "final norm")?;
    drop(model);
    head_in_slices(ckpt, &h, slice_bytes)
}

/// `h` [T, H] times lm_headᵀ, the head's rows (the vocabulary) converted to f32 a slice at a
/// time straight from the checkpoint.
fn head_in_slices(
    ckpt: &Checkpoint,
    h: &Tensor,
    slice_bytes: usize,
) -> Result<Vec<Vec<f32>>, ReferenceError> {
    let name = TensorId::head(ckpt.spec()).hf_name();
    let head = ckpt.tensor(&name)?;
    let (vocab, hidden) = (ckpt.spec().vocab_size, ckpt.spec().hidden_size);
    let t = ctx(h.dim(0), "lm_head")?;
    let mut rows = vec![Vec::with_capacity(vocab); t];
    let per_slice = (slice_bytes / (4 * hidden.max(1))).max(1);
    let row_bytes = head.data.len() / vocab.max(1);
    for start in (0..vocab).step_by(per_slice) {
        let n = per_slice.min(vocab - start);
        let shape = [n, hidden];
        let slice = TensorView {
            name: head.name,
            dtype: head.dtype,
            shape: &shape,
            data: &head.data[start * row_bytes..(start + n) * row_bytes],
        };
        let at = || format!("lm_head rows {start}..{}", start + n);
        let w = ctx(
            Tensor::from_vec(slice.to_f32(), (n, hidden), &Device::Cpu),
            &at(),
        )?;
        // Gemma 4's soft-capping is elementwise: slice by slice as on the whole.
        let part = ctx(
            w.t()
                .and_then(|wt| h.matmul(&wt))
                .and_then(|p| super::gemma4::softcap(ckpt.spec(), p))
                .and_then(|p| p.to_vec2::<f32>()),
            &at(),
        )?;
        for (row, p) in rows.iter_mut().zip(part) {
            row.extend(p);
        }
    }
    Ok(rows)
}
