//! Calibration statistics: an instrumented float32 forward pass over calibration text that
//! records, layer by layer, how large every intermediate gets (for fp16 range safety) and the
//! second moments of every projection's input (for calibrated palettization).
//!
//! The text is cut into segments that each start a fresh sequence at position 0; a segment
//! passes through the model one layer at a time with only that layer's activations alive, so
//! memory stays bounded by one segment's [T, intermediate] and [heads, T, T] tensors plus the
//! accumulators (and the optional Gram matrices).

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, D};
use serde::{Deserialize, Serialize};

use super::plain::{embed_rows, max_abs, Observer, PlainModel, Point};
use super::reference_error::{check_vocabulary, ReferenceError};
use crate::arch::Role;
use crate::checkpoint::Checkpoint;

/// fp16's largest finite value.
pub const F16_MAX: f32 = 65504.0;

/// Kinds of intermediate whose largest |value| is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    Embedding,
    /// The input of an RMSNorm (the residual stream, final norm included).
    RmsNormInput,
    /// x² inside an RMSNorm: overflows fp16 once |x| > 255.9.
    RmsNormSquare,
    /// mean(x²) per token inside an RMSNorm.
    RmsNormMeanSquare,
    Q,
    K,
    V,
    /// Scaled q·k/√d before the mask and softmax (visible entries only).
    AttentionScores,
    O,
    Gate,
    Up,
    /// silu(gate)·up, the down_proj input.
    SiluUp,
    Down,
    ResidualAfterAttention,
    ResidualAfterMlp,
}

impl OpKind {
    pub const ALL: [OpKind; 15] = [
        OpKind::Embedding,
        OpKind::RmsNormInput,
        OpKind::RmsNormSquare,
        OpKind::RmsNormMeanSquare,
        OpKind::Q,
        OpKind::K,
        OpKind::V,
        OpKind::AttentionScores,
        OpKind::O,
        OpKind::Gate,
        OpKind::Up,
        OpKind::SiluUp,
        OpKind::Down,
        OpKind::ResidualAfterAttention,
        OpKind::ResidualAfterMlp,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Embedding => "embedding",
            OpKind::RmsNormInput => "rms_norm_input",
            OpKind::RmsNormSquare => "rms_norm_square",
            OpKind::RmsNormMeanSquare => "rms_norm_mean_square",
            OpKind::Q => "q",
            OpKind::K => "k",
            OpKind::V => "v",
            OpKind::AttentionScores => "attention_scores",
            OpKind::O => "o",
            OpKind::Gate => "gate",
            OpKind::Up => "up",
            OpKind::SiluUp => "silu_up",
            OpKind::Down => "down",
            OpKind::ResidualAfterAttention => "residual_after_attention",
            OpKind::ResidualAfterMlp => "residual_after_mlp",
        }
    }
}

/// Which projections' inputs get a Gram matrix XᵀX (they cost in² f64 each).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum GramSelection {
    #[default]
    None,
    All,
    /// Only inputs feeding one of these projection roles.
    Roles(Vec<Role>),
}

/// How to run calibration.
#[derive(Debug, Clone)]
pub struct CalibrationOptions {
    /// Tokens per independent sequence.
    pub segment_len: usize,
    pub gram: GramSelection,
}

impl Default for CalibrationOptions {
    fn default() -> Self {
        CalibrationOptions {
            // Long enough for attention patterns and massive activations to develop as in
            // real use (they appear within the first tokens), short enough that a segment's
            // [heads, T, T] scores stay small.
            segment_len: 512,
            gram: GramSelection::None,
        }
    }
}

/// A running XᵀX over the rows X of one projection input, summed (not averaged) in f64.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gram {
    pub dim: usize,
    /// Rows accumulated.
    pub count: u64,
    /// Row-major dim × dim.
    pub sum: Vec<f64>,
}

impl Gram {
    pub fn new(dim: usize) -> Self {
        Gram {
            dim,
            count: 0,
            sum: vec![0.0; dim * dim],
        }
    }

    /// Add the rows of x [T, dim].
    pub fn accumulate(&mut self, x: &Tensor) -> candle_core::Result<()> {
        self.accumulate_with(x, &mut Vec::new())
    }

    /// [`Gram::accumulate`], the segment's f32 product xᵀx formed in `scratch` (grown to
    /// dim² once, then reused): at 8B down_proj's is 822 MB, and a fresh product and its copy
    /// for every segment would cost more in page faults than in arithmetic.
    pub fn accumulate_with(
        &mut self,
        x: &Tensor,
        scratch: &mut Vec<f32>,
    ) -> candle_core::Result<()> {
        let (t, n) = x.dims2()?;
        if n != self.dim {
            return Err(candle_core::Error::Msg(format!(
                "a Gram matrix of width {} given rows of {n}",
                self.dim
            )));
        }
        let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(candle_core::Error::Msg(
                "a Gram matrix of rows off the CPU".into(),
            ));
        };
        let rows = &cpu.as_slice::<f32>()?[layout.start_offset()..][..t * n];
        scratch.resize(n * n, 0.0);
        gram_f32(rows, t, n, &mut scratch[..n * n]);
        for (s, &v) in self.sum.iter_mut().zip(scratch.iter()) {
            *s += v as f64;
        }
        self.count += t as u64;
        Ok(())
    }

    /// E[x xᵀ] (the sum divided by the row count).
    pub fn mean(&self) -> Vec<f64> {
        let n = self.count.max(1) as f64;
        self.sum.iter().map(|v| v / n).collect()
    }
}

/// `out ← xᵀx` for `x` dense row-major [t, n], `out` [n, n] (overwritten, not read): one
/// `gemm` call (the crate candle's matmul uses), written where the caller keeps it.
///
/// # Panics
/// If a length does not match.
fn gram_f32(x: &[f32], t: usize, n: usize, out: &mut [f32]) {
    assert!(x.len() == t * n && out.len() == n * n);
    if t == 0 || n == 0 {
        out.fill(0.0);
        return;
    }
    let (n_i, one) = (n as isize, 1isize);
    // SAFETY: xᵀ is [n, t] with column stride n and row stride 1, x is [t, n] with column
    // stride 1 and row stride n, both inside `x`; `out` is [n, n] dense, borrowed mutably so
    // it overlaps neither; gemm only reads `x`, and does not read `out` (`read_dst` false).
    unsafe {
        gemm::gemm(
            n,
            n,
            t,
            out.as_mut_ptr(),
            one,
            n_i,
            false,
            x.as_ptr(),
            n_i,
            one,
            x.as_ptr(),
            one,
            n_i,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        )
    };
}

/// Statistics of one projection input (shared by the projections reading the same tensor:
/// q/k/v, gate/up).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputSite {
    /// The projections that read this input.
    pub roles: Vec<Role>,
    /// E[x²] per input channel over all calibration tokens.
    pub mean_square: Vec<f32>,
    /// Largest |x| per input channel.
    pub max_abs: Vec<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gram: Option<Gram>,
}

/// One decoder block's statistics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerStats {
    pub layer: usize,
    pub max_abs_residual_after_attention: f32,
    pub max_abs_residual_after_mlp: f32,
    /// Largest per-token mean(x²) at either of the block's two RMSNorm inputs.
    pub max_mean_square_residual: f32,
    /// Largest |value| per op kind inside this block.
    pub max_abs: BTreeMap<OpKind, f32>,
    /// q/k/v input, o input, gate/up input, down input.
    pub inputs: Vec<InputSite>,
}

/// What calibration measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActivationStats {
    pub tokens: usize,
    pub segments: usize,
    pub embedding_max_abs: f32,
    /// The final RMSNorm's input.
    pub final_norm_max_abs: f32,
    pub final_norm_max_mean_square: f32,
    pub layers: Vec<LayerStats>,
}

impl ActivationStats {
    /// Largest |residual stream| anywhere (embedding, every block, the final norm input).
    pub fn max_abs_residual(&self) -> f32 {
        self.layers
            .iter()
            .flat_map(|l| {
                [
                    l.max_abs_residual_after_attention,
                    l.max_abs_residual_after_mlp,
                ]
            })
            .chain([self.embedding_max_abs, self.final_norm_max_abs])
            .fold(0.0, f32::max)
    }

    /// Largest per-token mean(x²) of the residual stream at any RMSNorm input.
    pub fn max_mean_square_residual(&self) -> f32 {
        self.layers
            .iter()
            .map(|l| l.max_mean_square_residual)
            .chain([self.final_norm_max_mean_square])
            .fold(0.0, f32::max)
    }

    /// Largest |value| of one op kind over all blocks (and the embedding/final norm where
    /// the kind applies there).
    pub fn max_abs(&self, kind: OpKind) -> f32 {
        let extra = match kind {
            OpKind::Embedding => self.embedding_max_abs,
            OpKind::RmsNormInput => self.final_norm_max_abs,
            OpKind::RmsNormSquare => self.final_norm_max_abs * self.final_norm_max_abs,
            OpKind::RmsNormMeanSquare => self.final_norm_max_mean_square,
            _ => 0.0,
        };
        self.layers
            .iter()
            .filter_map(|l| l.max_abs.get(&kind).copied())
            .fold(extra, f32::max)
    }

    /// Largest |value| per op kind over the model.
    pub fn max_abs_by_kind(&self) -> BTreeMap<OpKind, f32> {
        OpKind::ALL
            .into_iter()
            .map(|k| (k, self.max_abs(k)))
            .collect()
    }

    /// The statistics of the input of projection `role` in block `layer`.
    pub fn input(&self, layer: usize, role: Role) -> Option<&InputSite> {
        self.layers
            .get(layer)?
            .inputs
            .iter()
            .find(|s| s.roles.contains(&role))
    }

    /// E[x²] per input channel of projection `role` in block `layer`.
    pub fn input_mean_square(&self, layer: usize, role: Role) -> Option<&[f32]> {
        self.input(layer, role).map(|s| s.mean_square.as_slice())
    }

    /// The largest power-of-two residual-stream scale α ≤ 1 such that (α·max|x|)², the
    /// RMSNorm's x² at the largest residual seen, stays below fp16's max divided by `margin`
    /// (margin ≥ 1; e.g. 1.5 leaves room for text larger than the calibration text).
    /// Powers of two fold into fp16 weights without rounding anything.
    pub fn residual_scale_for_fp16(&self, margin: f32) -> f32 {
        let limit = (F16_MAX / margin.max(1.0)).sqrt();
        let m = self.max_abs_residual();
        let mut alpha = 1.0f32;
        while alpha * m > limit && alpha > f32::MIN_POSITIVE {
            alpha *= 0.5;
        }
        alpha
    }
}

/// Accumulates statistics while the plain forward pass runs.
struct Collector {
    layers: Vec<LayerStats>,
    embedding_max_abs: f32,
    final_norm_max_abs: f32,
    final_norm_max_mean_square: f32,
    /// Per layer, per input site: Σx² per channel.
    sum_sq: Vec<Vec<Vec<f64>>>,
    rows: u64,
}

const SITES: [(Point, &[Role]); 4] = [
    (
        Point::AttentionInput,
        &[Role::Q, Role::K, Role::V, Role::ConvIn, Role::OutputGate],
    ),
    (Point::OInput, &[Role::O]),
    (Point::MlpInput, &[Role::Gate, Role::Up]),
    (Point::SiluUp, &[Role::Down]),
];

impl Collector {
    fn new(model: &PlainModel, gram: GramSelection) -> Self {
        let spec = model.spec();
        let layers = (0..spec.num_hidden_layers)
            .map(|layer| LayerStats {
                layer,
                max_abs_residual_after_attention: 0.0,
                max_abs_residual_after_mlp: 0.0,
                max_mean_square_residual: 0.0,
                max_abs: BTreeMap::new(),
                inputs: SITES
                    .iter()
                    .zip(spec.site_widths(layer))
                    .map(|((_, roles), dim)| InputSite {
                        // The site's projections this block has (q/k/v or a conv's in_proj).
                        roles: roles
                            .iter()
                            .copied()
                            .filter(|&r| {
                                crate::arch::LayerTensor::projection(r, &spec.layer(layer))
                                    .is_some()
                                    || !r.is_projection()
                            })
                            .collect(),
                        mean_square: vec![0.0; dim],
                        max_abs: vec![0.0; dim],
                        gram: match &gram {
                            GramSelection::None => None,
                            GramSelection::All => Some(Gram::new(dim)),
                            GramSelection::Roles(r) => {
                                roles.iter().any(|x| r.contains(x)).then(|| Gram::new(dim))
                            }
                        },
                    })
                    .collect(),
            })
            .collect();
        let sum_sq = (0..spec.num_hidden_layers)
            .map(|l| spec.site_widths(l).iter().map(|&d| vec![0.0; d]).collect())
            .collect();
        Collector {
            layers,
            embedding_max_abs: 0.0,
            final_norm_max_abs: 0.0,
            final_norm_max_mean_square: 0.0,
            sum_sq,
            rows: 0,
        }
    }

    fn bump(map: &mut BTreeMap<OpKind, f32>, kind: OpKind, v: f32) {
        let e = map.entry(kind).or_insert(0.0);
        *e = e.max(v);
    }

    fn finish(mut self, segments: usize) -> ActivationStats {
        let n = self.rows.max(1) as f64;
        for (layer, sums) in self.layers.iter_mut().zip(&self.sum_sq) {
            for (site, s) in layer.inputs.iter_mut().zip(sums) {
                site.mean_square = s.iter().map(|v| (v / n) as f32).collect();
            }
        }
        ActivationStats {
            tokens: self.rows as usize,
            segments,
            embedding_max_abs: self.embedding_max_abs,
            final_norm_max_abs: self.final_norm_max_abs,
            final_norm_max_mean_square: self.final_norm_max_mean_square,
            layers: self.layers,
        }
    }
}

fn per_token_mean_square_max(x: &Tensor) -> candle_core::Result<f32> {
    x.sqr()?
        .mean(D::Minus1)?
        .max(0)?
        .to_dtype(DType::F32)?
        .to_scalar()
}

impl Observer for Collector {
    fn observe(
        &mut self,
        layer: Option<usize>,
        point: Point,
        x: &Tensor,
    ) -> candle_core::Result<()> {
        let Some(l) = layer else {
            match point {
                Point::Embedding => {
                    self.embedding_max_abs = self.embedding_max_abs.max(max_abs(x)?);
                    self.rows += x.dim(0)? as u64;
                }
                Point::NormInput => {
                    self.final_norm_max_abs = self.final_norm_max_abs.max(max_abs(x)?);
                    self.final_norm_max_mean_square = self
                        .final_norm_max_mean_square
                        .max(per_token_mean_square_max(x)?);
                }
                _ => {}
            }
            return Ok(());
        };
        let Some(stats) = self.layers.get_mut(l) else {
            return Ok(());
        };
        let m = max_abs(x)?;
        let kind = match point {
            Point::Embedding => None,
            Point::NormInput => {
                let ms = per_token_mean_square_max(x)?;
                stats.max_mean_square_residual = stats.max_mean_square_residual.max(ms);
                Self::bump(&mut stats.max_abs, OpKind::RmsNormMeanSquare, ms);
                Self::bump(&mut stats.max_abs, OpKind::RmsNormSquare, m * m);
                Some(OpKind::RmsNormInput)
            }
            Point::AttentionInput | Point::OInput | Point::MlpInput => None,
            Point::Q => Some(OpKind::Q),
            Point::K => Some(OpKind::K),
            Point::V => Some(OpKind::V),
            Point::Scores => Some(OpKind::AttentionScores),
            Point::O => Some(OpKind::O),
            Point::ResidualAfterAttention => {
                stats.max_abs_residual_after_attention =
                    stats.max_abs_residual_after_attention.max(m);
                Some(OpKind::ResidualAfterAttention)
            }
            Point::Gate => Some(OpKind::Gate),
            Point::Up => Some(OpKind::Up),
            Point::SiluUp => Some(OpKind::SiluUp),
            Point::Down => Some(OpKind::Down),
            Point::ResidualAfterMlp => {
                stats.max_abs_residual_after_mlp = stats.max_abs_residual_after_mlp.max(m);
                Some(OpKind::ResidualAfterMlp)
            }
        };
        if let Some(kind) = kind {
            Self::bump(&mut stats.max_abs, kind, m);
        }
        if let Some(site) = SITES.iter().position(|(p, _)| *p == point) {
            let sq: Vec<f32> = x.sqr()?.sum(0)?.to_vec1()?;
            for (acc, v) in self.sum_sq[l][site].iter_mut().zip(sq) {
                *acc += v as f64;
            }
            let mx: Vec<f32> = x.abs()?.max(0)?.to_vec1()?;
            let input = &mut stats.inputs[site];
            for (acc, v) in input.max_abs.iter_mut().zip(mx) {
                *acc = acc.max(v);
            }
            if let Some(g) = input.gram.as_mut() {
                g.accumulate(x)?;
            }
        }
        Ok(())
    }
}

/// Run the instrumented forward pass over `tokens` (cut into independent segments of
/// `options.segment_len`; a final piece shorter than a quarter segment joins the previous one
/// so no statistic rests on a handful of tokens at the start of a sequence).
///
/// The pass runs layer by layer over all segments on a [`PlainModel::streaming`] model: one
/// block is in memory in f32 at a time, plus the segments' activations.
pub fn calibrate(
    ckpt: &Checkpoint,
    tokens: &[u32],
    options: &CalibrationOptions,
) -> Result<ActivationStats, ReferenceError> {
    check_vocabulary(ckpt.spec(), tokens)?;
    let mut model = PlainModel::streaming(ckpt)?;
    let spec = model.spec().clone();
    let seg = options.segment_len.clamp(1, spec.package_context().max(1));
    let mut bounds: Vec<(usize, usize)> = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let end = (start + seg).min(tokens.len());
        bounds.push((start, end));
        start = end;
    }
    if bounds.len() > 1 {
        let (s, e) = bounds[bounds.len() - 1];
        if e - s < seg / 4
            && bounds[bounds.len() - 2].1 - bounds[bounds.len() - 2].0 + e - s
                <= spec.package_context()
        {
            bounds.pop();
            if let Some(last) = bounds.last_mut() {
                last.1 = e;
            }
        }
    }
    if let Some(window) = spec.unbuilt_window() {
        if let Some(&(s, e)) = bounds.iter().find(|&&(s, e)| e - s > window) {
            return Err(ReferenceError::SlidingWindow { len: e - s, window });
        }
    }
    let mut collector = Collector::new(&model, options.gram.clone());
    let at = |s: usize, e: usize| format!("calibration tokens {s}..{e}");
    let mut xs = Vec::with_capacity(bounds.len());
    for &(s, e) in &bounds {
        let x = embed_rows(ckpt, &tokens[s..e])?;
        collector
            .observe(None, Point::Embedding, &x)
            .map_err(|err| ReferenceError::candle(at(s, e), err))?;
        xs.push(x);
    }
    // Gemma 4's blocks read per-layer inputs and other blocks' keys and values: each segment
    // carries them from block to block.
    let gemma4 = spec.gemma4.is_some();
    model.fetch_per_layer(ckpt, tokens)?;
    let mut segs = Vec::with_capacity(bounds.len());
    for (x, &(s, e)) in xs.iter().zip(&bounds) {
        let seg = model.segment(&tokens[s..e], x);
        segs.push(seg.map_err(|err| ReferenceError::candle(at(s, e), err))?);
    }
    for l in 0..spec.num_hidden_layers {
        model.fetch_layer(ckpt, l)?;
        for ((x, seg), &(s, e)) in xs.iter_mut().zip(&mut segs).zip(&bounds) {
            let out = match gemma4 {
                true => model.block_in(l, x, seg, &mut collector),
                false => model.block(l, x, &mut collector),
            };
            *x =
                out.map_err(|err| ReferenceError::candle(format!("{}, block {l}", at(s, e)), err))?;
        }
        model.release_layer(l);
    }
    for (x, &(s, e)) in xs.iter().zip(&bounds) {
        collector
            .observe(None, Point::NormInput, x)
            .map_err(|err| ReferenceError::candle(at(s, e), err))?;
    }
    Ok(collector.finish(bounds.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gram_product_is_xt_x() {
        let (t, n) = (7, 5);
        let x: Vec<f32> = (0..t * n).map(|i| ((i * 37) % 13) as f32 - 6.0).collect();
        let mut out = vec![f32::NAN; n * n];
        gram_f32(&x, t, n, &mut out);
        for i in 0..n {
            for j in 0..n {
                let want: f32 = (0..t).map(|r| x[r * n + i] * x[r * n + j]).sum();
                assert_eq!(out[i * n + j], want, "({i}, {j})");
            }
        }
        gram_f32(&[], 0, n, &mut out);
        assert!(out.iter().all(|&v| v == 0.0));
    }
}
