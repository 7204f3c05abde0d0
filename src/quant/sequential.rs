//! Calibrated palettization of a whole checkpoint, block by block (issue 7).
//!
//! The calibration text runs through the float model one decoder block at a time. For block
//! l, the inputs come from blocks 0..l *as already quantized*, so each block's LUTs and indices
//! correct for the error upstream (GPTQ's sequential order). Per block:
//! 1. one pass collects XᵀX of the four projection inputs (q/k/v, o, gate/up, down);
//! 2. optionally, AWQ-style per-input-channel scales `s = E[x²]^(a/2)` are searched per input
//!    site (the exponent a minimising the quantized output error) and folded into what precedes
//!    the projection: the RMSNorm weight for q/k/v and gate/up, the rows of v_proj for o_proj
//!    (shared across the query heads of one kv head), the rows of up_proj for down_proj. They
//!    cost nothing at run time;
//! 3. every selected projection is palettized with [`quantize_linear`];
//! 4. the block runs again with its quantized weights to produce the next block's inputs.
//!
//! Memory: the hidden states of the calibration text ([tokens, hidden] f32) plus one block's
//! four XᵀX matrices.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use rayon::prelude::*;
use serde::Serialize;

use super::calibrated::{
    gptq_factor, quantize_linear, quantize_linear_factored, GptqFactor, LinearMethod,
    QuantizedLinear,
};
use super::QuantError;
use crate::arch::{expected_tensors, LayerTensor, Role, TensorSlot};
use crate::checkpoint::Checkpoint;
use crate::model::calibrate::Gram;
use crate::model::plain::{embed_rows, Blind, Observer, PlainModel, Point};

/// The four projection inputs of a block and the projections reading each.
const SITES: [(Point, &[Role]); 4] = [
    (Point::AttentionInput, &[Role::Q, Role::K, Role::V]),
    (Point::OInput, &[Role::O]),
    (Point::MlpInput, &[Role::Gate, Role::Up]),
    (Point::SiluUp, &[Role::Down]),
];

/// A projection's method and (mixed precision) its rows' bit widths.
type SlotMethod = (LinearMethod, Option<Vec<u8>>);

/// A projection of one input site, its method and (mixed precision) its rows' bit widths.
type SiteProjection = (Role, TensorSlot, LinearMethod, Option<Vec<u8>>);

/// Exponents tried by the AWQ search (0 = no scaling).
const AWQ_GRID: [f64; 7] = [0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75];

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

/// What one input site's AWQ search chose.
#[derive(Debug, Clone, Serialize)]
pub struct AwqChoice {
    pub layer: usize,
    pub roles: Vec<Role>,
    pub exponent: f64,
    /// Relative output error without scaling and with the chosen exponent.
    pub error_unscaled: f64,
    pub error_chosen: f64,
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

/// Calibration segments the mixed-precision allocation measures sensitivities on.
const ALLOCATION_SEGMENTS: usize = 2;

/// Candidate bit widths of the mixed-precision allocation.
pub const MIXED_NBITS: [u8; 3] = [4, 6, 8];

/// One projection's sensitivity and the bit width the allocation gave it.
#[derive(Debug, Clone, Serialize)]
pub struct BitChoice {
    pub tensor: String,
    pub nbits: u8,
    /// Weights in the tensor.
    pub numel: usize,
    /// Error at 4, 6 and 8 bits on the calibration inputs (no error feedback), as
    /// [`Sensitivity`] measures it: the block output's Σ_t ‖Δy_t‖²/‖y_t‖² at 4 bits, scaled to 6
    /// and 8 bits by the tensor's own relative output errors tr(ΔW·H·ΔWᵀ)/tr(W·H·Wᵀ) (8 bits
    /// extrapolated from 6, ÷16); or those relative output errors alone.
    pub error: [f64; 3],
    /// Stored bits of the tensor at 4, 6 and 8 bits (indices, LUTs, row scales).
    pub bits: [f64; 3],
    /// Rows given 4, 6 and 8 bits (the allocation hands out bits by chunks of rows).
    pub rows: [usize; 3],
    /// Stored bits of the tensor as allocated.
    pub spent: f64,
    /// Each row's bit width.
    #[serde(skip)]
    pub row_bits: Vec<u8>,
    /// Each row's part of `error` at 4 and 6 bits: the tensor's error split over its rows in
    /// proportion to their own output errors ΔwᵢHΔwᵢᵀ (internal to the allocation).
    #[serde(skip)]
    row_error: [Vec<f64>; 2],
    #[serde(skip)]
    cols: usize,
}

fn calib_err(what: impl std::fmt::Display, e: candle_core::Error) -> QuantError {
    QuantError::Calibration {
        message: format!("{what}: {e}"),
    }
}

/// Collects XᵀX at the four input sites of one block.
struct Grams {
    layer: usize,
    grams: Vec<Gram>,
}

impl Observer for Grams {
    fn observe(
        &mut self,
        layer: Option<usize>,
        point: Point,
        x: &Tensor,
    ) -> candle_core::Result<()> {
        if layer == Some(self.layer) {
            if let Some(i) = SITES.iter().position(|(p, _)| *p == point) {
                self.grams[i].accumulate(x)?;
            }
        }
        Ok(())
    }

    fn wants(&self, point: Point) -> bool {
        SITES.iter().any(|(p, _)| *p == point)
    }
}

/// The randomized block-Hadamard rotation of `n` input channels behind
/// [`LinearMethod::rotate`]: Q = D·(I_m ⊗ H_b/√b)·(M ⊗ I_b), D a fixed ±1 diagonal, b the
/// largest power of two dividing n (up to 512), M a random orthogonal [m, m], m = n / b.
///
/// The graph applies it in this factored form (a `mul` by the signs, a `linear` by H_b/√b on
/// [.., m, b], a `matmul` by Mᵀ): n·(b + m) multiply-adds per token instead of n² for the
/// dense Q, and three small constants (n + b² + m² values) instead of an n×n one.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotation {
    /// D's diagonal, ±1.
    pub signs: Vec<f32>,
    /// b: the Walsh-Hadamard block size.
    pub block: usize,
    /// An orthogonal [m, m] mixing the m = n / block blocks (row-major): position j of every
    /// block goes through it, so the rotation mixes all n channels, not only within blocks.
    pub mix: Vec<f32>,
}

impl Rotation {
    /// b for `n` channels: the largest power of two dividing n, at most 512.
    pub fn block_for(n: usize) -> usize {
        let mut block = 1;
        while n % (block * 2) == 0 && block < 512 {
            block *= 2;
        }
        block
    }

    /// Values the graph stores for the rotation of `n` channels: D's signs [n], H_b [b, b]
    /// and, when there is more than one block, the mix [m, m].
    pub fn constant_values(n: usize) -> u64 {
        let b = Self::block_for(n) as u64;
        let m = n as u64 / b;
        n as u64 + b * b + if m > 1 { m * m } else { 0 }
    }
    /// The rotation of `n` channels (deterministic: seeded by n).
    pub fn new(n: usize) -> Self {
        let block = Self::block_for(n);
        let mut rng = crate::util::SplitMix64(0x5eed ^ n as u64);
        let signs = (0..n)
            .map(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 })
            .collect();
        let m = n / block;
        // A random orthogonal matrix: Gram-Schmidt on Gaussian rows.
        let mut mix: Vec<f64> = (0..m * m).map(|_| rng.normal() as f64).collect();
        for i in 0..m {
            for k in 0..i {
                let d: f64 = (0..m).map(|j| mix[i * m + j] * mix[k * m + j]).sum();
                for j in 0..m {
                    mix[i * m + j] -= d * mix[k * m + j];
                }
            }
            let norm = (0..m).map(|j| mix[i * m + j].powi(2)).sum::<f64>().sqrt();
            for j in 0..m {
                mix[i * m + j] /= norm;
            }
        }
        // One block: nothing to mix (M = [1], not a random ±1).
        let mix = if m < 2 {
            vec![1.0]
        } else {
            mix.into_iter().map(|v| v as f32).collect()
        };
        Rotation { signs, block, mix }
    }

    /// v ← v·(M ⊗ I_b) (or Mᵀ with `transpose`) on the m blocks of v.
    fn mix_blocks(&self, v: &mut [f32], transpose: bool) {
        let (b, m) = (self.block, v.len() / self.block);
        if m < 2 {
            return;
        }
        // Output block `out` = Σ_k v_k·M[k][out] (Mᵀ: M[out][k]), a whole block at a time.
        let src = v.to_vec();
        for (out, dst) in v.chunks_exact_mut(b).enumerate() {
            dst.fill(0.0);
            for (k, block) in src.chunks_exact(b).enumerate() {
                let e = if transpose {
                    self.mix[out * m + k]
                } else {
                    self.mix[k * m + out]
                };
                dst.iter_mut().zip(block).for_each(|(d, &x)| *d += e * x);
            }
        }
    }

    /// H_b/√b, [b, b] row-major (symmetric): the weight of the `linear` that rotates each
    /// block.
    pub fn hadamard_matrix(&self) -> Vec<f32> {
        let b = self.block;
        let mut h = vec![0.0f32; b * b];
        for i in 0..b {
            h[i * b + i] = 1.0;
        }
        for row in h.chunks_mut(b) {
            self.hadamard(row);
        }
        h
    }

    /// Mᵀ, [m, m] row-major: `matmul(Mᵀ, z)` on z [.., m, b] computes z·(M ⊗ I_b).
    pub fn mix_transpose(&self) -> Vec<f32> {
        let m = self.signs.len() / self.block;
        let mut t = vec![0.0f32; m * m];
        for i in 0..m {
            for j in 0..m {
                t[j * m + i] = self.mix[i * m + j];
            }
        }
        t
    }

    /// In-place orthonormal Walsh-Hadamard transform of each block of `v`.
    fn hadamard(&self, v: &mut [f32]) {
        let b = self.block;
        let norm = 1.0 / (b as f32).sqrt();
        for chunk in v.chunks_mut(b) {
            let mut h = 1;
            while h < b {
                for pair in chunk.chunks_exact_mut(2 * h) {
                    let (lo, hi) = pair.split_at_mut(h);
                    for (x, y) in lo.iter_mut().zip(hi.iter_mut()) {
                        (*x, *y) = (*x + *y, *x - *y);
                    }
                }
                h *= 2;
            }
            chunk.iter_mut().for_each(|x| *x *= norm);
        }
    }

    /// w·Q for each row of w [rows, n].
    fn rotate_rows(&self, w: &mut [f32]) {
        let n = self.signs.len();
        w.par_chunks_mut(n).for_each(|row| {
            row.iter_mut().zip(&self.signs).for_each(|(x, s)| *x *= s);
            self.hadamard(row);
            self.mix_blocks(row, false);
        });
    }

    /// w·Qᵀ for each row of w [rows, n] (the inverse of [`Rotation::rotate_rows`]).
    fn unrotate_rows(&self, w: &mut [f32]) {
        let n = self.signs.len();
        w.par_chunks_mut(n).for_each(|row| {
            self.mix_blocks(row, true);
            self.hadamard(row);
            row.iter_mut().zip(&self.signs).for_each(|(x, s)| *x *= s);
        });
    }

    /// Qᵀ·G·Q for a symmetric G [n, n] (the Gram matrix of the rotated inputs x·Q).
    fn rotate_gram(&self, g: &[f64]) -> Vec<f64> {
        let n = self.signs.len();
        let mut m: Vec<f32> = g.iter().map(|&v| v as f32).collect();
        // (G·Q) row by row, then Qᵀ·(G·Q) = ((G·Q)ᵀ·Q)ᵀ: G·Q is not symmetric, transpose.
        self.rotate_rows(&mut m);
        let mut t = vec![0.0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                t[j * n + i] = m[i * n + j];
            }
        }
        self.rotate_rows(&mut t);
        let mut out = vec![0.0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                out[i * n + j] = t[j * n + i] as f64;
            }
        }
        out
    }
}

/// Qᵀ of the input rotation of `n` channels, [n, n] row-major: the weight of a `linear` that
/// maps x to x·Q (the dense form of [`Rotation`]).
pub fn rotation_transpose(n: usize) -> Vec<f32> {
    let r = Rotation::new(n);
    let mut q = vec![0.0f32; n * n];
    for i in 0..n {
        q[i * n + i] = 1.0;
    }
    r.rotate_rows(&mut q);
    let mut t = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            t[j * n + i] = q[i * n + j];
        }
    }
    t
}

/// One input site's Gram matrix and what the projections reading it (q/k/v, gate/up) share:
/// the matrix rotated once under [`LinearMethod::rotate`], and GPTQ's factor once per
/// (rotation, act order, damping).
struct SiteFit<'a> {
    gram: &'a [f64],
    cols: usize,
    rotated: Option<(Rotation, Vec<f64>)>,
    factors: Vec<((bool, bool, u64), GptqFactor)>,
}

impl<'a> SiteFit<'a> {
    fn new(gram: &'a [f64], cols: usize) -> Self {
        SiteFit {
            gram,
            cols,
            rotated: None,
            factors: Vec::new(),
        }
    }

    /// Palettize a [rows, cols] projection reading this site; returns it and the f32 weights
    /// the float model should compute with from now on (its dequantized values, rotated back
    /// under [`LinearMethod::rotate`]).
    fn fit(
        &mut self,
        w: &[f32],
        rows: usize,
        method: &LinearMethod,
        row_bits: Option<&[u8]>,
    ) -> Result<(QuantizedLinear, Vec<f32>), QuantError> {
        let cols = self.cols;
        if method.rotate && self.rotated.is_none() {
            let r = Rotation::new(cols);
            let g = r.rotate_gram(self.gram);
            self.rotated = Some((r, g));
        }
        let (rotation, gram) = match &self.rotated {
            Some((r, g)) if method.rotate => (Some(r), g.as_slice()),
            _ => (None, self.gram),
        };
        let factor = if method.gptq {
            let key = (method.rotate, method.act_order, method.damp.to_bits());
            let at = match self.factors.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None => {
                    self.factors.push((key, gptq_factor(gram, cols, method)?));
                    self.factors.len() - 1
                }
            };
            Some(&self.factors[at].1)
        } else {
            None
        };
        let Some(r) = rotation else {
            let q = quantize_linear_factored(w, rows, cols, Some(gram), method, row_bits, factor)?;
            let d = q.dequantize();
            return Ok((q, d));
        };
        let mut wr = w.to_vec();
        r.rotate_rows(&mut wr);
        let mut q =
            quantize_linear_factored(&wr, rows, cols, Some(gram), method, row_bits, factor)?;
        q.rotated = true;
        let mut d = q.dequantize();
        r.unrotate_rows(&mut d);
        Ok((q, d))
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
    let weights = quantize_model(&mut model, ckpt, tokens, method_for, options, progress)?;
    Ok((weights, model))
}

/// [`quantize_checkpoint`] on a [`PlainModel::streaming`] model: one block is in memory in
/// f32 at a time (read, fitted, dropped), so memory does not grow with the model's depth.
/// The weights are the same.
pub fn quantize_streaming(
    ckpt: &Checkpoint,
    tokens: &[u32],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
    options: &SequentialOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<CalibratedWeights, QuantError> {
    let mut model = PlainModel::streaming(ckpt).map_err(|e| QuantError::Calibration {
        message: e.to_string(),
    })?;
    quantize_model(&mut model, ckpt, tokens, method_for, options, progress)
}

fn fetch(model: &mut PlainModel, ckpt: &Checkpoint, l: usize) -> Result<(), QuantError> {
    model
        .fetch_layer(ckpt, l)
        .map_err(|e| QuantError::Calibration {
            message: e.to_string(),
        })
}

fn quantize_model(
    model: &mut PlainModel,
    ckpt: &Checkpoint,
    tokens: &[u32],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
    options: &SequentialOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<CalibratedWeights, QuantError> {
    let spec = ckpt.spec().clone();
    if tokens.is_empty() {
        return Err(QuantError::Calibration {
            message: "no calibration tokens".into(),
        });
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= spec.vocab_size) {
        return Err(QuantError::Calibration {
            message: format!("token {t} is outside the vocabulary ({})", spec.vocab_size),
        });
    }
    let seg = options
        .segment_len
        .clamp(16, spec.package_context().max(16));
    let mut xs: Vec<Tensor> = tokens
        .chunks(seg)
        .map(|c| embed_rows(ckpt, c))
        .collect::<Result<_, _>>()
        .map_err(|e| QuantError::Calibration {
            message: format!("embedding the calibration text: {e}"),
        })?;
    let slots = expected_tensors(&spec);
    let dims = block_dims(&spec);
    let mut out = CalibratedWeights {
        linears: BTreeMap::new(),
        replaced: BTreeMap::new(),
        awq: Vec::new(),
        allocation: Vec::new(),
        tokens: tokens.len(),
    };
    let mut chosen: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    if let Some(target) = options.target_bpw {
        out.allocation = allocate_bits(model, ckpt, &xs, &slots, method_for, target, options)?;
        chosen = out
            .allocation
            .iter()
            .map(|c| (c.tensor.clone(), c.row_bits.clone()))
            .collect();
    }
    let method_for = |slot: &TensorSlot| {
        method_for(slot).map(|m| {
            let bits = chosen.get(&slot.name);
            let m = LinearMethod {
                nbits: bits
                    .and_then(|b| b.iter().copied().min())
                    .unwrap_or(m.nbits),
                ..m
            };
            (m, bits.cloned())
        })
    };
    let n_layers = spec.num_hidden_layers;
    if options.true_sequential && !options.awq {
        for l in 0..n_layers {
            fetch(model, ckpt, l)?;
            xs = true_sequential_block(model, l, &xs, &slots, &method_for, &dims, &mut out)?;
            model.release_layer(l);
            progress(l + 1, n_layers);
        }
        return Ok(out);
    }
    for l in 0..n_layers {
        fetch(model, ckpt, l)?;
        xs = calibrate_block(model, l, &xs, &slots, &method_for, options, &mut out)?;
        model.release_layer(l);
        progress(l + 1, n_layers);
    }
    Ok(out)
}

/// One block of calibration: each input site's XᵀX is accumulated from the block's float
/// inputs, AWQ scales (if enabled) are folded, then the site's projections are palettized.
/// Returns the block outputs with the palettized weights (the next block's inputs).
fn calibrate_block(
    model: &mut PlainModel,
    l: usize,
    xs: &[Tensor],
    slots: &[TensorSlot],
    method_for: &dyn Fn(&TensorSlot) -> Option<SlotMethod>,
    options: &SequentialOptions,
    out: &mut CalibratedWeights,
) -> Result<Vec<Tensor>, QuantError> {
    let spec = &model.spec().clone();
    let dims = block_dims(spec);
    let mut obs = Grams {
        layer: l,
        grams: dims.iter().map(|&d| Gram::new(d)).collect(),
    };
    for x in xs {
        model
            .block(l, x, &mut obs)
            .map_err(|e| calib_err(format!("block {l}"), e))?;
    }
    let slot_of = |role: Role| {
        slots
            .iter()
            .find(|s| s.layer == Some(l) && s.role == role)
            .cloned()
    };
    // Per site: the projections to palettize and the XᵀX they are fitted with.
    let mut work: Vec<(usize, Vec<f64>, Vec<SiteProjection>)> = Vec::new();
    for (site, (_, roles)) in SITES.iter().enumerate() {
        let methods: Vec<SiteProjection> = roles
            .iter()
            .filter_map(|&r| {
                let slot = slot_of(r)?;
                method_for(&slot).map(|(m, bits)| (r, slot, m, bits))
            })
            .collect();
        if !methods.is_empty() {
            work.push((site, obs.grams[site].sum.clone(), methods));
        }
    }
    // AWQ folds first, all of them: the o and down scales fold into v_proj and up_proj
    // rows, which must carry them before they are palettized.
    if options.awq {
        for (site, h, methods) in work.iter_mut() {
            let cols = obs.grams[*site].dim;
            let choice = awq_search(model, l, *site, methods, h, cols)?;
            if choice.exponent > 0.0 {
                let sc = awq_scales(h, cols, choice.exponent);
                let sc = site_scales(spec, *site, &sc);
                apply_scales(model, spec, l, *site, &sc, &mut out.replaced, slots)?;
                let s_full = expand_o_scales(spec, *site, &sc);
                for i in 0..cols {
                    for j in 0..cols {
                        h[i * cols + j] /= s_full[i] * s_full[j];
                    }
                }
            }
            out.awq.push(choice);
        }
    }
    for (site, h, methods) in &work {
        let cols = obs.grams[*site].dim;
        let mut site_fit = SiteFit::new(h, cols);
        for (role, slot, method, row_bits) in methods {
            let w = model
                .weight_mut(l, *role, false)
                .ok_or_else(|| QuantError::Calibration {
                    message: format!("block {l} has no {role} projection"),
                })?;
            let rows = slot.shape[0];
            let values = to_vec(w)?;
            let (q, effective) = site_fit
                .fit(&values, rows, method, row_bits.as_deref())
                .map_err(|e| e.in_tensor(&slot.name))?;
            *w = Tensor::from_vec(effective, (rows, cols), &Device::Cpu)
                .map_err(|e| calib_err(&slot.name, e))?;
            out.replaced.remove(&slot.name);
            out.linears.insert(slot.name.clone(), q);
        }
    }
    xs.iter()
        .map(|x| model.block(l, x, &mut Blind))
        .collect::<Result<_, _>>()
        .map_err(|e| calib_err(format!("block {l}"), e))
}

/// The input width of each of the four [`SITES`].
fn block_dims(spec: &crate::arch::ModelSpec) -> [usize; 4] {
    [
        spec.hidden_size,
        spec.q_dim(),
        spec.hidden_size,
        spec.intermediate_size,
    ]
}

/// One block of true-sequential calibration: each input site's XᵀX is accumulated from the
/// activations computed with every earlier projection of the block already palettized, then
/// the site's projections are palettized. Returns the block outputs (the next block's inputs).
fn true_sequential_block(
    model: &mut PlainModel,
    l: usize,
    xs: &[Tensor],
    slots: &[TensorSlot],
    method_for: &dyn Fn(&TensorSlot) -> Option<SlotMethod>,
    dims: &[usize; 4],
    out: &mut CalibratedWeights,
) -> Result<Vec<Tensor>, QuantError> {
    let err = |e| calib_err(format!("block {l}"), e);
    let mut fit = |model: &mut PlainModel, site: usize, inputs: &[Tensor]| {
        let mut gram = Gram::new(dims[site]);
        for x in inputs {
            gram.accumulate(x).map_err(err)?;
        }
        let mut site_fit = SiteFit::new(&gram.sum, gram.dim);
        for &role in SITES[site].1 {
            let Some(slot) = slots.iter().find(|s| s.layer == Some(l) && s.role == role) else {
                continue;
            };
            let Some((method, row_bits)) = method_for(slot) else {
                continue;
            };
            let w = model
                .weight_mut(l, role, false)
                .ok_or_else(|| QuantError::Calibration {
                    message: format!("block {l} has no {role} projection"),
                })?;
            let rows = slot.shape[0];
            let values = to_vec(w)?;
            let (q, effective) = site_fit
                .fit(&values, rows, &method, row_bits.as_deref())
                .map_err(|e| e.in_tensor(&slot.name))?;
            *w = Tensor::from_vec(effective, (rows, gram.dim), &Device::Cpu)
                .map_err(|e| calib_err(&slot.name, e))?;
            out.linears.insert(slot.name.clone(), q);
        }
        Ok::<(), QuantError>(())
    };
    let h: Vec<Tensor> = xs
        .iter()
        .map(|x| model.step_attention_input(l, x))
        .collect::<Result<_, _>>()
        .map_err(err)?;
    fit(model, 0, &h)?;
    let attn: Vec<Tensor> = h
        .iter()
        .map(|h| model.step_attention(l, h))
        .collect::<Result<_, _>>()
        .map_err(err)?;
    drop(h);
    fit(model, 1, &attn)?;
    let (mid, h): (Vec<Tensor>, Vec<Tensor>) = xs
        .iter()
        .zip(&attn)
        .map(|(x, a)| model.step_mlp_input(l, x, a))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?
        .into_iter()
        .unzip();
    drop(attn);
    fit(model, 2, &h)?;
    let act: Vec<Tensor> = h
        .iter()
        .map(|h| model.step_mlp_act(l, h))
        .collect::<Result<_, _>>()
        .map_err(err)?;
    drop(h);
    fit(model, 3, &act)?;
    mid.iter()
        .zip(&act)
        .map(|(x, a)| model.step_output(l, x, a))
        .collect::<Result<_, _>>()
        .map_err(err)
}

/// Stored bits of a [rows, cols] projection whose rows are split `counts` over
/// [`MIXED_NBITS`] under `m` (each width present has its own LUTs).
fn mixed_bits(rows: usize, cols: usize, counts: [usize; 3], m: &LinearMethod) -> f64 {
    let groups = m.row_groups.clamp(1, rows.max(1)) as f64;
    let scale = if m.row_scale { 16.0 * rows as f64 } else { 0.0 };
    let mut bits = scale;
    for (&n, &nb) in counts.iter().zip(&MIXED_NBITS) {
        if n > 0 {
            // Each width's rows are split into groups of their own (`plan_groups`).
            let luts = match m.group_size {
                0 => groups,
                g => n.div_ceil(g) as f64,
            };
            bits += (n * cols) as f64 * nb as f64 + luts * 16.0 * (1u64 << nb) as f64;
        }
    }
    bits
}

/// Measure every selected projection's output error at 4, 6 and 8 bits on the float model's
/// calibration inputs, then spend bits greedily where they remove the most error per bit
/// until the palettized projections average `target` bits per weight. Bits go to chunks of
/// `options.chunk_rows` rows (each projection's rows ranked by how much error 6 bits would
/// remove from them), or to whole projections.
fn allocate_bits(
    model: &mut PlainModel,
    ckpt: &Checkpoint,
    xs: &[Tensor],
    slots: &[TensorSlot],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
    target: f64,
    options: &SequentialOptions,
) -> Result<Vec<BitChoice>, QuantError> {
    let spec = model.spec().clone();
    let dims = [
        spec.hidden_size,
        spec.q_dim(),
        spec.hidden_size,
        spec.intermediate_size,
    ];
    // Sensitivities rank tensors; they need far fewer tokens than the fit itself.
    let mut xs: Vec<Tensor> = xs.iter().take(ALLOCATION_SEGMENTS).cloned().collect();
    let mut choices = Vec::new();
    let mut methods = Vec::new();
    let kl_ref = if options.sensitivity == Sensitivity::ModelKl {
        for l in 0..spec.num_hidden_layers {
            fetch(model, ckpt, l)?;
        }
        model
            .fetch_head(ckpt)
            .map_err(|e| QuantError::Calibration {
                message: e.to_string(),
            })?;
        Some(KlReference::new(model, &xs)?)
    } else {
        None
    };
    for l in 0..spec.num_hidden_layers {
        fetch(model, ckpt, l)?;
        let mut obs = Grams {
            layer: l,
            grams: dims.iter().map(|&d| Gram::new(d)).collect(),
        };
        // The float block outputs: the reference of the block-output errors, then the next
        // block's inputs (nothing here changes the model for good).
        let ys: Vec<Tensor> = xs
            .iter()
            .map(|x| model.block(l, x, &mut obs))
            .collect::<Result<_, _>>()
            .map_err(|e| calib_err(format!("block {l}"), e))?;
        for (site, (_, roles)) in SITES.iter().enumerate() {
            let gram = &obs.grams[site];
            let cols = gram.dim;
            let h32: Vec<f32> = gram.sum.iter().map(|&v| v as f32).collect();
            let h =
                Tensor::from_vec(h32, (cols, cols), &Device::Cpu).map_err(|e| calib_err("H", e))?;
            let mut site_fit = SiteFit::new(&gram.sum, cols);
            for &role in roles.iter() {
                let Some(slot) = slots.iter().find(|s| s.layer == Some(l) && s.role == role) else {
                    continue;
                };
                let Some(m) = method_for(slot) else { continue };
                let rows = slot.shape[0];
                let w = to_vec(model.weight_mut(l, role, false).ok_or_else(|| {
                    QuantError::Calibration {
                        message: format!("block {l} has no {role} projection"),
                    }
                })?)?;
                let mut error = [0.0; 3];
                let mut bits = [0.0; 3];
                let mut row_error = [Vec::new(), Vec::new()];
                let mut block_error = 0.0;
                for (i, &nbits) in MIXED_NBITS.iter().enumerate() {
                    let mut counts = [0; 3];
                    counts[i] = rows;
                    bits[i] = mixed_bits(rows, cols, counts, &m);
                    if i == MIXED_NBITS.len() - 1 {
                        // Two more bits quarter the error twice (measured on SmolLM2: 6→8
                        // bits divides it by 17-20); probing 8 bits would cost more than
                        // everything else here.
                        error[i] = error[i - 1] / 16.0;
                        continue;
                    }
                    let probe = LinearMethod {
                        nbits,
                        gptq: false,
                        ..m
                    };
                    let (_, wq) = site_fit
                        .fit(&w, rows, &probe, None)
                        .map_err(|e| e.in_tensor(&slot.name))?;
                    let (per_row, den) = output_error(&w, &wq, rows, cols, &h)?;
                    let num: f64 = per_row.iter().sum();
                    error[i] = if den > 0.0 { num / den } else { 0.0 };
                    // Each row's share of the tensor's error.
                    row_error[i] = per_row
                        .iter()
                        .map(|&e| if num > 0.0 { e / num } else { 0.0 })
                        .collect();
                    if i == 0 {
                        match (options.sensitivity, &kl_ref) {
                            (Sensitivity::BlockOutput, _) => {
                                block_error = block_output_error(model, l, role, &w, wq, &xs, &ys)?
                            }
                            (Sensitivity::ModelKl, Some(r)) => {
                                block_error = r.model_kl(model, l, role, &w, wq, &xs)?
                            }
                            _ => {}
                        }
                    }
                }
                if options.sensitivity != Sensitivity::LayerOutput {
                    // What the tensor's 4-bit error does to the residual stream; 6 and 8 bits
                    // scale it by the tensor's own error ratios.
                    let e4 = error[0];
                    for e in error.iter_mut() {
                        *e = if e4 > 0.0 { block_error * *e / e4 } else { 0.0 };
                    }
                }
                for (k, r) in row_error.iter_mut().enumerate() {
                    r.iter_mut().for_each(|e| *e *= error[k]);
                }
                choices.push(BitChoice {
                    tensor: slot.name.clone(),
                    nbits: MIXED_NBITS[0],
                    numel: rows * cols,
                    error,
                    bits,
                    rows: [rows, 0, 0],
                    spent: bits[0],
                    row_bits: vec![MIXED_NBITS[0]; rows],
                    row_error,
                    cols,
                });
                methods.push(m);
            }
        }
        if kl_ref.is_none() {
            model.release_layer(l);
        }
        xs = ys;
    }
    if kl_ref.is_some() {
        (0..spec.num_hidden_layers).for_each(|l| model.release_layer(l));
        model.release_head();
    }
    spend_bits(&mut choices, &methods, target, options.chunk_rows);
    // The block inputs must be the float model's again: nothing above changed weights.
    Ok(choices)
}

/// The greedy allocation over measured choices: starting from 4 bits everywhere, repeatedly
/// take the upgrade (the next chunk of a projection's rows to 6 bits, or of its 6-bit rows to
/// 8) that removes the most error per extra stored bit and still fits the budget.
fn spend_bits(choices: &mut [BitChoice], methods: &[LinearMethod], target: f64, chunk_rows: usize) {
    struct State {
        /// Rows by decreasing error removed at 6 bits.
        order: Vec<usize>,
        /// Prefix sums over `order` of the error 4→6 and 6→8 bits remove.
        gain6: Vec<f64>,
        gain8: Vec<f64>,
        /// The first k6 rows of `order` have at least 6 bits, the first k8 have 8.
        k6: usize,
        k8: usize,
        chunk: usize,
    }
    let mut states: Vec<State> = choices
        .iter()
        .map(|c| {
            let rows = c.row_bits.len();
            let [e4, e6] = &c.row_error;
            let d6 = |r: usize| e4[r] - e6[r];
            let mut order: Vec<usize> = (0..rows).collect();
            order.sort_by(|&a, &b| d6(b).total_cmp(&d6(a)));
            let prefix = |f: &dyn Fn(usize) -> f64| {
                let mut p = vec![0.0; rows + 1];
                for (i, &r) in order.iter().enumerate() {
                    p[i + 1] = p[i] + f(r);
                }
                p
            };
            let gain6 = prefix(&d6);
            let gain8 = prefix(&|r| e6[r] * (1.0 - 1.0 / 16.0));
            State {
                order,
                gain6,
                gain8,
                k6: 0,
                k8: 0,
                chunk: if chunk_rows == 0 {
                    rows
                } else {
                    chunk_rows.min(rows).max(1)
                },
            }
        })
        .collect();
    let numel: f64 = choices.iter().map(|c| c.numel as f64).sum();
    let budget = target * numel;
    let bits_of = |c: &BitChoice, m: &LinearMethod, k6: usize, k8: usize| {
        let rows = c.row_bits.len();
        mixed_bits(rows, c.cols, [rows - k6, k6 - k8, k8], m)
    };
    let mut spent: f64 = choices
        .iter()
        .zip(methods)
        .map(|(c, m)| bits_of(c, m, 0, 0))
        .sum();
    // When even 4 bits everywhere exceeds the target (tiny tensors, where LUTs and row scales
    // weigh more), everything stays at 4 bits: the report shows the bits actually spent.
    loop {
        let mut best: Option<(usize, usize, usize, f64, f64)> = None;
        for (i, (st, (c, m))) in states.iter().zip(choices.iter().zip(methods)).enumerate() {
            let rows = c.row_bits.len();
            let now = bits_of(c, m, st.k6, st.k8);
            let mut consider = |k6: usize, k8: usize, gain: f64| {
                let cost = bits_of(c, m, k6, k8) - now;
                if cost <= 0.0 || spent + cost > budget || gain <= 0.0 {
                    return;
                }
                let rate = gain / cost;
                if best.map_or(true, |b| rate > b.3) {
                    best = Some((i, k6, k8, rate, cost));
                }
            };
            if st.k6 < rows {
                let k6 = (st.k6 + st.chunk).min(rows);
                consider(k6, st.k8, st.gain6[k6] - st.gain6[st.k6]);
            }
            if st.k8 < st.k6 {
                let k8 = (st.k8 + st.chunk).min(st.k6);
                consider(st.k6, k8, st.gain8[k8] - st.gain8[st.k8]);
            }
        }
        let Some((i, k6, k8, _, cost)) = best else {
            break;
        };
        states[i].k6 = k6;
        states[i].k8 = k8;
        spent += cost;
    }
    for ((c, st), m) in choices.iter_mut().zip(&states).zip(methods) {
        let rows = c.row_bits.len();
        for (i, &r) in st.order.iter().enumerate() {
            c.row_bits[r] = if i < st.k8 {
                MIXED_NBITS[2]
            } else if i < st.k6 {
                MIXED_NBITS[1]
            } else {
                MIXED_NBITS[0]
            };
        }
        c.rows = [rows - st.k6, st.k6 - st.k8, st.k8];
        c.nbits = c.row_bits.iter().copied().max().unwrap_or(MIXED_NBITS[0]);
        c.spent = bits_of(c, m, st.k6, st.k8);
    }
}

/// Σ_t ‖Δy_t‖² / ‖y_t‖² over the block outputs y when projection `role` of block l computes
/// with `wq` instead of `w` (restored afterwards): its quantization error as the residual
/// stream sees it, per token relative because every later layer reads it through an RMSNorm.
fn block_output_error(
    model: &mut PlainModel,
    l: usize,
    role: Role,
    w: &[f32],
    wq: Vec<f32>,
    xs: &[Tensor],
    ys: &[Tensor],
) -> Result<f64, QuantError> {
    with_weight(model, l, role, w, wq, |model| {
        let mut acc = 0.0;
        for (x, y) in xs.iter().zip(ys) {
            let yq = model.block(l, x, &mut Blind)?;
            let num = (yq - y)?.sqr()?.sum(1)?;
            let den = y.sqr()?.sum(1)?;
            acc += (num / den)?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        Ok(acc)
    })
}

/// `run` on the model with projection `role` of block l computing with `wq` instead of its
/// weight `w`, which is put back afterwards whatever `run` returns.
fn with_weight(
    model: &mut PlainModel,
    l: usize,
    role: Role,
    w: &[f32],
    wq: Vec<f32>,
    run: impl FnOnce(&mut PlainModel) -> candle_core::Result<f64>,
) -> Result<f64, QuantError> {
    let f = |e| calib_err(format!("block {l} {role} sensitivity"), e);
    let missing = || QuantError::Calibration {
        message: format!("block {l} has no {role} projection"),
    };
    let weight = model.weight_mut(l, role, false).ok_or_else(missing)?;
    let shape = weight.dims().to_vec();
    *weight = Tensor::from_vec(wq, shape.clone(), &Device::Cpu).map_err(f)?;
    let result = run(model);
    *model.weight_mut(l, role, false).ok_or_else(missing)? =
        Tensor::from_slice(w, shape, &Device::Cpu).map_err(f)?;
    result.map_err(f)
}

/// The float model's next-token distributions on the allocation's calibration segments, for
/// [`Sensitivity::ModelKl`]: per segment p [T, V] and Σ_v p log p per token.
struct KlReference {
    p: Vec<Tensor>,
    neg_entropy: Vec<Tensor>,
}

fn log_sum_exp(logits: &Tensor) -> candle_core::Result<Tensor> {
    let max = logits.max_keepdim(1)?;
    let sum = logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?;
    (sum.log()? + max)?.squeeze(1)
}

impl KlReference {
    fn new(model: &mut PlainModel, xs: &[Tensor]) -> Result<Self, QuantError> {
        let f = |e| calib_err("the float model's logits", e);
        let mut p = Vec::new();
        let mut neg_entropy = Vec::new();
        for x in xs {
            let mut h = x.clone();
            for l in 0..model.spec().num_hidden_layers {
                h = model.block(l, &h, &mut Blind).map_err(f)?;
            }
            let logits = model.head(&h).map_err(f)?;
            let lse = log_sum_exp(&logits).map_err(f)?;
            let logp = logits
                .broadcast_sub(&lse.unsqueeze(1).map_err(f)?)
                .map_err(f)?;
            let prob = logp.exp().map_err(f)?;
            neg_entropy.push((&prob * &logp).and_then(|t| t.sum(1)).map_err(f)?);
            p.push(prob);
        }
        Ok(KlReference { p, neg_entropy })
    }

    /// Σ_t KL(p_t ‖ q_t) over the segments when projection `role` of block l computes with
    /// `wq` instead of `w` (restored afterwards); `xs` are block l's float inputs.
    fn model_kl(
        &self,
        model: &mut PlainModel,
        l: usize,
        role: Role,
        w: &[f32],
        wq: Vec<f32>,
        xs: &[Tensor],
    ) -> Result<f64, QuantError> {
        with_weight(model, l, role, w, wq, |model| {
            let mut acc = 0.0;
            for ((x, p), ne) in xs.iter().zip(&self.p).zip(&self.neg_entropy) {
                let mut h = x.clone();
                for b in l..model.spec().num_hidden_layers {
                    h = model.block(b, &h, &mut Blind)?;
                }
                let q = model.head(&h)?;
                // KL = Σ p log p − Σ p·q + logsumexp(q), per token.
                let cross = (p * &q)?.sum(1)?;
                let kl = ((ne - cross)? + log_sum_exp(&q)?)?;
                acc += kl.sum_all()?.to_scalar::<f32>()? as f64;
            }
            Ok(acc)
        })
    }
}

/// s_j = E[x_j²]^(a/2), normalised to geometric mean 1 (so the folded weights keep their
/// overall magnitude).
fn awq_scales(gram: &[f64], n: usize, exponent: f64) -> Vec<f64> {
    let ms: Vec<f64> = (0..n).map(|j| gram[j * n + j].max(1e-12)).collect();
    let raw: Vec<f64> = ms.iter().map(|m| m.powf(exponent / 2.0)).collect();
    let log_mean = raw.iter().map(|v| v.ln()).sum::<f64>() / n.max(1) as f64;
    let g = log_mean.exp();
    raw.iter().map(|v| v / g).collect()
}

/// (kv heads, head dim, query heads per kv head).
fn gqa(spec: &crate::arch::ModelSpec) -> (usize, usize, usize) {
    let hkv = spec.num_key_value_heads.max(1);
    (hkv, spec.head_dim, spec.num_attention_heads / hkv)
}

/// o_proj's input channels (query head h, dim d) are fed by v_proj row (h / groups, d): one
/// scale per kv row, the geometric mean over the heads sharing it. Other sites pass through.
fn site_scales(spec: &crate::arch::ModelSpec, site: usize, s: &[f64]) -> Vec<f64> {
    if site != 1 {
        return s.to_vec();
    }
    let (hkv, d, groups) = gqa(spec);
    (0..hkv * d)
        .map(|kv_row| {
            let (g, dd) = (kv_row / d, kv_row % d);
            let logs: f64 = (0..groups).map(|k| s[(g * groups + k) * d + dd].ln()).sum();
            (logs / groups as f64).exp()
        })
        .collect()
}

/// Per-input-channel scales of the site's projections from [`site_scales`]' output.
fn expand_o_scales(spec: &crate::arch::ModelSpec, site: usize, s: &[f64]) -> Vec<f64> {
    if site != 1 {
        return s.to_vec();
    }
    let (hkv, d, groups) = gqa(spec);
    (0..hkv * groups * d)
        .map(|c| s[(c / d / groups) * d + c % d])
        .collect()
}

fn scale_tensor(t: &mut Tensor, factor: &[f64], axis_cols: bool) -> Result<(), QuantError> {
    let dims = t.dims().to_vec();
    let mut v = to_vec(t)?;
    let cols = *dims.last().unwrap_or(&1);
    for (i, x) in v.iter_mut().enumerate() {
        let k = if axis_cols { i % cols } else { i / cols };
        *x = (*x as f64 * factor[k]) as f32;
    }
    *t = Tensor::from_vec(v, dims, &Device::Cpu).map_err(|e| calib_err("scaling", e))?;
    Ok(())
}

/// Fold per-input-channel scales `s` of `site` into block l: the site's projections'
/// columns × s, the producer (norm weight, v rows, up rows) × 1/s.
fn apply_scales(
    model: &mut PlainModel,
    spec: &crate::arch::ModelSpec,
    l: usize,
    site: usize,
    s: &[f64],
    replaced: &mut BTreeMap<String, Vec<f32>>,
    slots: &[TensorSlot],
) -> Result<(), QuantError> {
    if spec.gemma.is_some() {
        // The reference holds Gemma's norms as 1 + w; the package stores w.
        return Err(QuantError::Calibration {
            message: "AWQ folds scales into RMSNorm weights, which Gemma stores as w in \
                      x·(1 + w): not supported for Gemma3ForCausalLM (use awq = false)"
                .into(),
        });
    }
    let inv: Vec<f64> = s.iter().map(|v| 1.0 / v).collect();
    let cols_scale = expand_o_scales(spec, site, s);
    let missing = || QuantError::Calibration {
        message: format!("block {l} lacks a tensor AWQ folds into"),
    };
    // The tensor's checkpoint name, if the architecture has it.
    let name_of = |t: LayerTensor| {
        let name = crate::arch::tensor_name(l, t);
        slots.iter().any(|x| x.name == name).then_some(name)
    };
    for &role in SITES[site].1 {
        let w = model.weight_mut(l, role, false).ok_or_else(missing)?;
        scale_tensor(w, &cols_scale, true)?;
        // Recorded in case the recipe keeps it fp16; dropped again once it is palettized.
        let name = LayerTensor::projection(role)
            .and_then(name_of)
            .ok_or_else(missing)?;
        replaced.insert(name, to_vec(w)?);
    }
    match site {
        0 | 2 => {
            let post = site == 2;
            let norm = model.norm_tensor(post);
            let w = model.weight_mut(l, Role::Norm, post).ok_or_else(missing)?;
            scale_tensor(w, &inv, true)?;
            let name = name_of(norm).ok_or_else(missing)?;
            replaced.insert(name, to_vec(w)?);
        }
        1 => {
            // v_proj and up_proj are recorded too: when the recipe keeps them fp16 the package
            // must still carry the fold (a palettized one is replaced by its LUT form).
            let w = model.weight_mut(l, Role::V, false).ok_or_else(missing)?;
            scale_tensor(w, &inv, false)?;
            let name = name_of(LayerTensor::V).ok_or_else(missing)?;
            replaced.insert(name, to_vec(w)?);
            if let Some(b) = model.bias_mut(l, Role::V) {
                scale_tensor(b, &inv, true)?;
                let name = name_of(LayerTensor::VBias).ok_or_else(missing)?;
                replaced.insert(name, to_vec(b)?);
            }
        }
        _ => {
            let w = model.weight_mut(l, Role::Up, false).ok_or_else(missing)?;
            scale_tensor(w, &inv, false)?;
            let name = name_of(LayerTensor::Up).ok_or_else(missing)?;
            replaced.insert(name, to_vec(w)?);
        }
    }
    Ok(())
}

/// Output error of the site's projections quantized (without error feedback, as the search
/// is repeated per exponent) after scaling by `s`, relative to their float outputs.
fn awq_search(
    model: &mut PlainModel,
    l: usize,
    site: usize,
    methods: &[SiteProjection],
    gram: &[f64],
    cols: usize,
) -> Result<AwqChoice, QuantError> {
    let spec = model.spec().clone();
    let mut weights = Vec::new();
    for (role, slot, m, _) in methods {
        let w = model
            .weight_mut(l, *role, false)
            .ok_or_else(|| QuantError::Calibration {
                message: format!("block {l} has no {role} projection"),
            })?;
        weights.push((to_vec(w)?, slot.shape[0], *m));
    }
    let h32: Vec<f32> = gram.iter().map(|&v| v as f32).collect();
    let h = Tensor::from_vec(h32, (cols, cols), &Device::Cpu).map_err(|e| calib_err("H", e))?;
    let mut best = (f64::INFINITY, 0.0);
    let mut unscaled = 0.0;
    for &a in &AWQ_GRID {
        let s = expand_o_scales(
            &spec,
            site,
            &site_scales(&spec, site, &awq_scales(gram, cols, a)),
        );
        let mut hs = gram.to_vec();
        for i in 0..cols {
            for j in 0..cols {
                hs[i * cols + j] /= s[i] * s[j];
            }
        }
        let (mut num, mut den) = (0.0, 0.0);
        for (w, rows, m) in &weights {
            let scaled: Vec<f32> = w
                .iter()
                .enumerate()
                .map(|(i, &v)| (v as f64 * s[i % cols]) as f32)
                .collect();
            let search = LinearMethod { gptq: false, ..*m };
            let q = quantize_linear(&scaled, *rows, cols, Some(&hs), &search)?;
            let back: Vec<f32> = q
                .dequantize()
                .iter()
                .enumerate()
                .map(|(i, &v)| (v as f64 / s[i % cols]) as f32)
                .collect();
            let (n, d) = output_error(w, &back, *rows, cols, &h)?;
            num += n.iter().sum::<f64>();
            den += d;
        }
        let e = if den > 0.0 { num / den } else { 0.0 };
        if a == 0.0 {
            unscaled = e;
        }
        if e < best.0 {
            best = (e, a);
        }
    }
    Ok(AwqChoice {
        layer: l,
        roles: SITES[site].1.to_vec(),
        exponent: best.1,
        error_unscaled: unscaled,
        error_chosen: best.0,
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

    /// The steps true-sequential calibration runs a block in compute what the block computes.
    #[test]
    fn block_steps_compose_to_the_block() {
        for tiny in [TinyModel::llama(), TinyModel::qwen2()] {
            let dir = tiny.write_temp().unwrap();
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            let mut model = PlainModel::load(&ckpt).unwrap();
            let tokens: Vec<u32> = (0..20).map(|i| (i * 7 % 50) as u32).collect();
            let x = model.embed(&tokens).unwrap();
            assert_eq!(
                embed_rows(&ckpt, &tokens)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap(),
                x.to_vec2::<f32>().unwrap()
            );
            let want = model.block(0, &x, &mut Blind).unwrap();
            let h = model.step_attention_input(0, &x).unwrap();
            let attn = model.step_attention(0, &h).unwrap();
            let (mid, h) = model.step_mlp_input(0, &x, &attn).unwrap();
            let act = model.step_mlp_act(0, &h).unwrap();
            let got = model.step_output(0, &mid, &act).unwrap();
            let diff = (got - want)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            // The same f32 operations in the same order: bit-identical.
            assert_eq!(diff, 0.0);
        }
    }

    /// A 3-block random Qwen2 checkpoint in a temporary directory (kept while the guard lives).
    fn tiny_qwen2() -> (tempfile::TempDir, Checkpoint) {
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
                quantize_streaming(&ckpt, &tokens, &method, &options, &|_, _| {}).unwrap();
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

    /// The model-KL probe: zero for the float weights themselves, positive for perturbed ones,
    /// larger for a larger perturbation, and the block's weight is restored afterwards.
    #[test]
    fn model_kl_probe_measures_the_logits_and_restores_the_weight() {
        let (_dir, ckpt) = tiny_qwen2();
        let mut model = PlainModel::load(&ckpt).unwrap();
        let tokens: Vec<u32> = (0..64).map(|i| (i * 7 % 50) as u32).collect();
        let xs: Vec<Tensor> = tokens
            .chunks(32)
            .map(|c| embed_rows(&ckpt, c).unwrap())
            .collect();
        let reference = KlReference::new(&mut model, &xs).unwrap();
        // Block 1's inputs: the float outputs of block 0.
        let x1: Vec<Tensor> = xs
            .iter()
            .map(|x| model.block(0, x, &mut Blind).unwrap())
            .collect();
        let w = to_vec(model.weight_mut(1, Role::Down, false).unwrap()).unwrap();
        let kl = |model: &mut PlainModel, f: f32| {
            let wq: Vec<f32> = w
                .iter()
                .enumerate()
                .map(|(i, &v)| v + f * if i % 3 == 0 { v.abs() } else { -v.abs() })
                .collect();
            reference
                .model_kl(model, 1, Role::Down, &w, wq, &x1)
                .unwrap()
        };
        let same = kl(&mut model, 0.0);
        let small = kl(&mut model, 0.1);
        let large = kl(&mut model, 0.5);
        assert!(same.abs() < 1e-3, "{same}");
        assert!(
            small > 10.0 * same.abs() && large > small,
            "{same} {small} {large}"
        );
        assert_eq!(
            to_vec(model.weight_mut(1, Role::Down, false).unwrap()).unwrap(),
            w
        );
    }

    /// A projection whose rows' 4-bit errors are `e4` (6 bits: ÷16).
    fn choice(name: &str, cols: usize, e4: &[f64]) -> BitChoice {
        let rows = e4.len();
        let e6: Vec<f64> = e4.iter().map(|e| e / 16.0).collect();
        let total = |v: &[f64]| v.iter().sum::<f64>();
        BitChoice {
            tensor: name.into(),
            nbits: 4,
            numel: rows * cols,
            error: [total(e4), total(&e6), total(&e6) / 16.0],
            bits: [0.0; 3],
            rows: [rows, 0, 0],
            spent: 0.0,
            row_bits: vec![4; rows],
            row_error: [e4.to_vec(), e6],
            cols,
        }
    }

    #[test]
    fn bits_go_to_the_rows_that_need_them_within_budget() {
        let m = LinearMethod::calibrated(4);
        // Projection a: 4 loud rows of 64; b: uniform and quieter.
        let mut a_err = vec![1.0; 64];
        for r in [3, 17, 40, 41] {
            a_err[r] = 100.0;
        }
        let b_err = vec![2.0; 64];
        let fresh = || vec![choice("a", 256, &a_err), choice("b", 256, &b_err)];
        let methods = [m, m];
        let numel = 2.0 * 64.0 * 256.0;
        let four: f64 = fresh()
            .iter()
            .map(|c| mixed_bits(64, 256, [64, 0, 0], &m) / c.numel as f64)
            .sum::<f64>()
            / 2.0;
        // A budget for 4 rows at 6 bits: 2 more bits per weight and a 64-entry LUT.
        let target = four + (4.0 * 256.0 * 2.0 + 64.0 * 16.0) / numel + 0.001;
        let mut rows = fresh();
        spend_bits(&mut rows, &methods, target, 4);
        let a = &rows[0];
        for r in 0..64 {
            let want = if [3, 17, 40, 41].contains(&r) { 6 } else { 4 };
            assert_eq!(a.row_bits[r], want, "row {r}");
        }
        assert_eq!(a.rows, [60, 4, 0]);
        assert_eq!(a.nbits, 6);
        assert_eq!(rows[1].rows, [64, 0, 0]);
        let spent: f64 = rows.iter().map(|c| c.spent).sum();
        assert!(spent <= target * numel, "{spent} > {}", target * numel);
        // Whole projections: the same budget cannot buy one, so nothing moves.
        let mut whole = fresh();
        spend_bits(&mut whole, &methods, target, 0);
        assert!(whole.iter().all(|c| c.rows == [64, 0, 0] && c.nbits == 4));
        // Enough for all of a at 8 bits (8 bits after 6: the loud rows first).
        let mut rich = fresh();
        spend_bits(&mut rich, &methods, 7.9, 16);
        let spent: f64 = rich.iter().map(|c| c.spent).sum();
        assert!(spent <= 7.9 * numel);
        assert!(rich[0].row_bits.iter().all(|&b| b >= 6));
        assert_eq!(rich[0].row_bits[40], 8);
    }

    /// The rotation is orthogonal, its inverse undoes it, and the rotated Gram matrix is the
    /// Gram matrix of the rotated inputs.
    #[test]
    fn rotation_is_orthogonal_and_rotates_the_gram_matrix() {
        let mut rng = crate::testing::SplitMix64(3);
        for n in [12, 64, 96] {
            let r = Rotation::new(n);
            let t = 7;
            let x: Vec<f32> = (0..t * n).map(|_| rng.normal()).collect();
            let mut xr = x.clone();
            r.rotate_rows(&mut xr);
            let norm = |v: &[f32]| v.iter().map(|a| (a * a) as f64).sum::<f64>();
            assert!((norm(&x) - norm(&xr)).abs() < 1e-3 * norm(&x));
            let mut back = xr.clone();
            r.unrotate_rows(&mut back);
            assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() < 1e-5));
            let gram = |v: &[f32]| -> Vec<f64> {
                let mut g = vec![0.0f64; n * n];
                for row in v.chunks(n) {
                    for i in 0..n {
                        for j in 0..n {
                            g[i * n + j] += (row[i] * row[j]) as f64;
                        }
                    }
                }
                g
            };
            let want = gram(&xr);
            let got = r.rotate_gram(&gram(&x));
            assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() < 1e-3));
        }
    }

    /// The graph's factored form — signs, H_b/√b on each block, Mᵀ·[m, b] — is x·Q, and the
    /// dense Qᵀ agrees with it.
    #[test]
    fn factored_rotation_is_the_dense_one() {
        let mut rng = crate::testing::SplitMix64(8);
        for n in [64, 96, 576, 1536] {
            let r = Rotation::new(n);
            let (b, m) = (r.block, n / r.block);
            let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let mut want = x.clone();
            r.rotate_rows(&mut want);
            // mul by the signs, linear by H (y = z·Hᵀ) on each block, matmul(Mᵀ, z).
            let h = r.hadamard_matrix();
            let z: Vec<f32> = (0..n)
                .map(|o| {
                    let (blk, j) = (o / b, o % b);
                    (0..b)
                        .map(|k| x[blk * b + k] * r.signs[blk * b + k] * h[j * b + k])
                        .sum()
                })
                .collect();
            let mt = r.mix_transpose();
            let got: Vec<f32> = (0..n)
                .map(|o| {
                    let (row, j) = (o / b, o % b);
                    (0..m).map(|k| mt[row * m + k] * z[k * b + j]).sum()
                })
                .collect();
            let qt = rotation_transpose(n);
            let dense: Vec<f32> = (0..n)
                .map(|o| (0..n).map(|k| qt[o * n + k] * x[k]).sum())
                .collect();
            for ((a, g), d) in want.iter().zip(&got).zip(&dense) {
                assert!((a - g).abs() < 1e-4, "n={n}: {a} vs {g}");
                assert!((a - d).abs() < 1e-4, "n={n}: {a} vs {d}");
            }
        }
    }
}
