//! Calibrated palettization of one linear layer: the LUT fits what the layer
//! computes on real inputs, not the weights alone.
//!
//! A projection W [out, in] becomes `y = s ⊙ (Ŵ·x)` with Ŵ[r, j] = LUT_g(r)[idx[r, j]]:
//! - `s`: an optional per-output-row fp16 scale (one `mul` after the linear on device). Rows
//!   normalised by their largest |w| share one LUT far better than raw rows of very different
//!   magnitudes do.
//! - the LUT is fitted by the exact weighted k-means of [`crate::quant::kmeans`], each element weighted
//!   by E[x_j²] of its input channel (times s_r², so the error is measured in W's units).
//! - indices are chosen by GPTQ-style error feedback: columns are quantised in turn and each
//!   column's output error, measured through the inverse Hessian of the calibration inputs,
//!   is compensated in the columns not yet quantised.
//! - optionally the rows are split into a few contiguous groups, each with its own LUT (one
//!   `constexpr_lut_to_dense` + linear per group on device, outputs concatenated: all iOS17).

use half::f16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::quant::linalg::inverse_upper_factor_owned;
use crate::quant::{kmeans, palettize_f16, NumericsError, QuantError};

/// How one linear layer is palettized with calibration data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinearMethod {
    pub nbits: u8,
    /// Normalise each output row by its largest |w| (a fp16 `mul` after the linear).
    pub row_scale: bool,
    /// Weight k-means points by E[x_j²] of their input channel.
    pub weighted: bool,
    /// GPTQ error feedback over the inverse Hessian.
    pub gptq: bool,
    /// GPTQ: quantise columns in order of decreasing E[x_j²] ("act order").
    pub act_order: bool,
    /// Hessian damping, relative to the mean of its diagonal.
    pub damp: f64,
    /// Contiguous row groups, each with its own LUT (1 = one LUT per tensor).
    pub row_groups: usize,
    /// Rows per group instead (0 = use `row_groups`): iOS18 grouped LUTs.
    pub group_size: usize,
    /// Rotate the input channels by a fixed orthogonal Q (random signs, Walsh-Hadamard blocks,
    /// a random orthogonal mix across blocks) and palettize W·Q against QᵀHQ; the graph feeds
    /// the projection x·Q. Outlier channels, which one LUT per tensor serves badly, are spread
    /// over all channels.
    pub rotate: bool,
}

impl LinearMethod {
    /// Everything on: the method the calibrated recipes use.
    pub fn calibrated(nbits: u8) -> Self {
        LinearMethod {
            nbits,
            row_scale: true,
            weighted: true,
            gptq: true,
            act_order: true,
            damp: 0.01,
            row_groups: 1,
            group_size: 0,
            rotate: false,
        }
    }

    /// Data-free: one LUT over the raw weights (the textbook iOS17 recipe).
    pub fn data_free(nbits: u8) -> Self {
        LinearMethod {
            nbits,
            row_scale: false,
            weighted: false,
            gptq: false,
            act_order: false,
            damp: 0.01,
            row_groups: 1,
            group_size: 0,
            rotate: false,
        }
    }
}

/// A palettized linear layer: `y = row_scale ⊙ (LUT[idx] · x)`, each row reading the LUT of
/// its group. Each group holds its rows' indices packed as a package stores them: an 8B's
/// fitted projections are 3.5 GB at 4 bits, twice that unpacked. A package stores the layer as
/// a [`crate::quant::QuantizedWeight`] (`From`).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedLinear {
    pub rows: usize,
    pub cols: usize,
    /// The row groups, each with its own bit width, LUT and indices; together they hold every
    /// row once.
    pub groups: Vec<RowGroup>,
    /// Per-row fp16 scale multiplied into the linear's output.
    pub row_scale: Option<Vec<f16>>,
    /// The stored weight is W·Q for the input rotation Q of [`LinearMethod::rotate`]: the
    /// graph must feed it x·Q ([`crate::quant::rotation::rotation_transpose`]).
    pub rotated: bool,
    /// Per-element MSE and SNR of the stored weight against the input weight.
    pub mse: f64,
    pub snr_db: f64,
}

/// Rows of a [`QuantizedLinear`] that share one LUT (one `constexpr_lut_to_dense` on device).
#[derive(Debug, Clone, PartialEq)]
pub struct RowGroup {
    /// The rows, ascending.
    pub rows: Vec<usize>,
    pub nbits: u8,
    /// Sorted, `2^nbits` entries.
    pub lut: Vec<f16>,
    /// The rows' indices in `rows` order, `cols` each, packed at `nbits`
    /// ([`crate::quant::pack_indices`]).
    pub packed: Vec<u8>,
}

impl RowGroup {
    /// The group of `rows` at `nbits` with `lut`, its indices taken from all of a layer's,
    /// `indices` [.., cols] row-major.
    fn pack(rows: Vec<usize>, nbits: u8, lut: Vec<f16>, indices: &[u8], cols: usize) -> Self {
        let mut idx = Vec::with_capacity(rows.len() * cols);
        for &r in &rows {
            idx.extend_from_slice(&indices[r * cols..(r + 1) * cols]);
        }
        RowGroup {
            packed: crate::quant::pack_indices(&idx, nbits),
            rows,
            nbits,
            lut,
        }
    }

    /// The group's indices unpacked, [rows.len(), cols] in `rows` order.
    pub fn indices(&self, cols: usize) -> Vec<u8> {
        crate::quant::unpack_indices(&self.packed, self.nbits, self.rows.len() * cols)
    }
}

impl QuantizedLinear {
    /// The group of each row.
    pub fn group_of_rows(&self) -> Vec<usize> {
        let mut g = vec![0; self.rows];
        for (i, group) in self.groups.iter().enumerate() {
            for &r in &group.rows {
                g[r] = i;
            }
        }
        g
    }

    /// Every index, [rows, cols] row-major.
    pub fn indices(&self) -> Vec<u8> {
        let cols = self.cols;
        let mut out = vec![0u8; self.rows * cols];
        for g in &self.groups {
            for (&r, idx) in g.rows.iter().zip(g.indices(cols).chunks_exact(cols.max(1))) {
                out[r * cols..(r + 1) * cols].copy_from_slice(idx);
            }
        }
        out
    }

    /// The weight the layer computes with, [rows, cols] row-major, in f32 (LUT entry times row
    /// scale, as the device multiplies them: the product of two fp16 numbers).
    pub fn dequantize(&self) -> Vec<f32> {
        let cols = self.cols;
        let mut out = vec![0.0f32; self.rows * cols];
        for g in &self.groups {
            for (&r, idx) in g.rows.iter().zip(g.indices(cols).chunks_exact(cols.max(1))) {
                let s = self.row_scale.as_ref().map_or(1.0, |s| s[r].to_f32());
                for (o, &i) in out[r * cols..(r + 1) * cols].iter_mut().zip(idx) {
                    *o = g.lut[i as usize].to_f32() * s;
                }
            }
        }
        out
    }

    /// The widest bit width of any group.
    pub fn max_nbits(&self) -> u8 {
        self.groups.iter().map(|g| g.nbits).max().unwrap_or(0)
    }

    /// Rows at each bit width, ascending by width.
    pub fn rows_by_nbits(&self) -> Vec<(u8, usize)> {
        let mut m = std::collections::BTreeMap::new();
        for g in &self.groups {
            *m.entry(g.nbits).or_insert(0) += g.rows.len();
        }
        m.into_iter().collect()
    }
}

/// The row groups: the rows of each bit width (ascending widths), each split into `row_groups`
/// contiguous (within that width) runs, or into runs of `group_size` rows when it is not 0.
fn plan_groups(
    rows: usize,
    row_bits: &[u8],
    row_groups: usize,
    group_size: usize,
) -> Vec<(u8, Vec<usize>)> {
    let mut widths: Vec<u8> = row_bits.to_vec();
    widths.sort_unstable();
    widths.dedup();
    let mut out = Vec::new();
    for nbits in widths {
        let members: Vec<usize> = (0..rows).filter(|&r| row_bits[r] == nbits).collect();
        let per = match group_size {
            0 => members.len().div_ceil(row_groups.max(1)).max(1),
            g => g,
        };
        for chunk in members.chunks(per) {
            out.push((nbits, chunk.to_vec()));
        }
    }
    out
}

/// Nearest entry of a sorted LUT.
fn nearest(lut: &[f32], v: f32) -> usize {
    let i = lut.partition_point(|&x| x < v);
    if i == 0 {
        0
    } else if i == lut.len() {
        lut.len() - 1
    } else if v - lut[i - 1] <= lut[i] - v {
        i - 1
    } else {
        i
    }
}

/// Palettize W [rows, cols] (row-major f32) with `method`. `gram` is XᵀX of the layer's
/// calibration inputs (cols × cols, any positive multiple: only ratios matter); without it the
/// method runs data-free (no weighting, no error feedback).
pub fn quantize_linear(
    w: &[f32],
    rows: usize,
    cols: usize,
    gram: Option<&[f64]>,
    method: &LinearMethod,
) -> Result<QuantizedLinear, QuantError> {
    quantize_linear_mixed(w, rows, cols, gram, method, None)
}

/// [`quantize_linear`] with a bit width per output row (`None`: `method.nbits` for all): the
/// rows of each width get their own LUT(s).
pub fn quantize_linear_mixed(
    w: &[f32],
    rows: usize,
    cols: usize,
    gram: Option<&[f64]>,
    method: &LinearMethod,
    row_bits: Option<&[u8]>,
) -> Result<QuantizedLinear, QuantError> {
    if let Some(g) = gram {
        if g.len() != cols * cols {
            return Err(QuantError::from(NumericsError::WeightsLength {
                values: cols * cols,
                weights: g.len(),
            }));
        }
    }
    let diag: Option<Vec<f64>> = gram.map(|g| gram_diagonal(g, cols));
    let factor = match gram {
        Some(g) if method.gptq => Some(gptq_factor(g, cols, method)?),
        _ => None,
    };
    quantize_linear_prepared(
        w,
        rows,
        cols,
        diag.as_deref(),
        method,
        row_bits,
        factor.as_ref(),
    )
}

/// The diagonal of a Gram matrix [n, n]: E[x_j²] up to the number of samples.
pub(crate) fn gram_diagonal(g: &[f64], n: usize) -> Vec<f64> {
    (0..n).map(|j| g[j * n + j]).collect()
}

/// [`quantize_linear_mixed`] from what it reads of the Gram matrix: its diagonal (`None`:
/// data-free) and, under GPTQ, its factor ([`gptq_factor`] under the same act order and
/// damping; required then). The projections that read one input share both.
pub(crate) fn quantize_linear_prepared(
    w: &[f32],
    rows: usize,
    cols: usize,
    diag: Option<&[f64]>,
    method: &LinearMethod,
    row_bits: Option<&[u8]>,
    factor: Option<&GptqFactor>,
) -> Result<QuantizedLinear, QuantError> {
    kmeans::check_nbits(method.nbits)?;
    let uniform;
    let row_bits = match row_bits {
        Some(b) => {
            if b.len() != rows {
                return Err(QuantError::from(NumericsError::WeightsLength {
                    values: rows,
                    weights: b.len(),
                }));
            }
            for &n in b {
                kmeans::check_nbits(n)?;
            }
            b
        }
        None => {
            uniform = vec![method.nbits; rows];
            &uniform
        }
    };
    if w.len() != rows * cols {
        return Err(QuantError::from(NumericsError::WeightsLength {
            values: rows * cols,
            weights: w.len(),
        }));
    }
    if let Some((index, &value)) = w.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(QuantError::from(NumericsError::NonFinite { index, value }));
    }
    if let Some(d) = diag {
        if d.len() != cols {
            return Err(QuantError::from(NumericsError::WeightsLength {
                values: cols,
                weights: d.len(),
            }));
        }
    }
    let row_scale: Option<Vec<f16>> = method.row_scale.then(|| {
        (0..rows)
            .map(|r| {
                let m = w[r * cols..(r + 1) * cols]
                    .iter()
                    .fold(0.0f32, |m, v| m.max(v.abs()));
                let s = f16::from_f32(m);
                if s.to_f32() > 0.0 && s.is_finite() {
                    s
                } else {
                    f16::ONE
                }
            })
            .collect()
    });
    let scale = |r: usize| row_scale.as_ref().map_or(1.0f32, |s| s[r].to_f32());

    // The LUT of each row group: weighted k-means over the normalised weights.
    let plan = plan_groups(rows, row_bits, method.row_groups, method.group_size);
    let luts: Vec<Vec<f16>> = plan
        .par_iter()
        .map(|(nbits, members)| {
            let mut values = Vec::with_capacity(members.len() * cols);
            let mut weights = Vec::with_capacity(members.len() * cols);
            for &r in members {
                let s = scale(r);
                for j in 0..cols {
                    values.push(f16::from_f32(w[r * cols + j] / s));
                    let h = match (&diag, method.weighted) {
                        (Some(d), true) => d[j] as f32,
                        _ => 1.0,
                    };
                    weights.push(s * s * h);
                }
            }
            palettize_f16(&values, *nbits, Some(&weights)).map(|p| p.lut)
        })
        .collect::<Result<_, _>>()?;
    let luts_f32: Vec<Vec<f32>> = luts
        .iter()
        .map(|l| l.iter().map(|v| v.to_f32()).collect())
        .collect();
    // Each row's LUT (every row is in exactly one planned group).
    let mut row_luts: Vec<&[f32]> = vec![&[]; rows];
    for ((_, members), lut) in plan.iter().zip(&luts_f32) {
        for &r in members {
            row_luts[r] = lut;
        }
    }

    let mut indices = vec![0u8; rows * cols];
    match (diag, method.gptq) {
        (Some(_), true) => {
            let (order, u) = factor.ok_or_else(|| QuantError::Calibration {
                message: "GPTQ needs the Gram matrix's factor".into(),
            })?;
            let scales: Vec<f32> = (0..rows).map(scale).collect();
            indices = gptq_indices(w, rows, cols, order, u, &row_luts, &scales)?;
        }
        _ => {
            indices
                .par_chunks_mut(cols)
                .enumerate()
                .for_each(|(r, idx)| {
                    let lut = row_luts[r];
                    let s = scale(r);
                    for (j, i) in idx.iter_mut().enumerate() {
                        *i = nearest(lut, w[r * cols + j] / s) as u8;
                    }
                });
        }
    }
    let groups = plan
        .into_iter()
        .zip(luts)
        .map(|((nbits, rows), lut)| RowGroup::pack(rows, nbits, lut, &indices, cols))
        .collect();
    drop(indices);
    let mut q = QuantizedLinear {
        rows,
        cols,
        groups,
        row_scale,
        rotated: false,
        mse: 0.0,
        snr_db: 0.0,
    };
    let (sig, err) = q
        .dequantize()
        .iter()
        .zip(w)
        .fold((0.0f64, 0.0f64), |(s, e), (&a, &b)| {
            (s + (b as f64).powi(2), e + (a as f64 - b as f64).powi(2))
        });
    q.mse = err / w.len().max(1) as f64;
    q.snr_db = kmeans::snr_db(sig, err);
    Ok(q)
}

/// Columns per GPTQ block: inside a block the error feedback is applied column by column;
/// the block's accumulated errors then update all later columns in one matrix product.
const GPTQ_BLOCK: usize = 128;

/// GPTQ index assignment ("lazy batch" form): rows are independent given U, so each block
/// runs in parallel over rows, and the update of the remaining columns is one gemm.
#[allow(clippy::too_many_arguments)]
fn gptq_indices(
    w: &[f32],
    rows: usize,
    cols: usize,
    order: &[usize],
    u32s: &[f32],
    luts: &[&[f32]],
    scales: &[f32],
) -> Result<Vec<u8>, QuantError> {
    // Work in quantisation order.
    let mut wp: Vec<f32> = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        wp.extend(order.iter().map(|&j| w[r * cols + j]));
    }
    let mut idx_p = vec![0u8; rows * cols];
    // One block's scaled errors, [rows, b], reused by every block.
    let mut err = vec![0.0f32; rows * GPTQ_BLOCK.min(cols)];
    let mut i1 = 0;
    while i1 < cols {
        let i2 = (i1 + GPTQ_BLOCK).min(cols);
        let b = i2 - i1;
        let err = &mut err[..rows * b];
        wp.par_chunks_mut(cols)
            .zip(idx_p.par_chunks_mut(cols))
            .zip(err.par_chunks_mut(b))
            .enumerate()
            .for_each(|(r, ((row, idx), e))| {
                let lut = luts[r];
                let s = scales[r];
                for k in i1..i2 {
                    let v = row[k];
                    let i = nearest(lut, v / s);
                    idx[k] = i as u8;
                    let ek = (v - lut[i] * s) / u32s[k * cols + k];
                    e[k - i1] = ek;
                    let urow = &u32s[k * cols + k + 1..k * cols + i2];
                    for (x, &uk) in row[k + 1..i2].iter_mut().zip(urow) {
                        *x -= ek * uk;
                    }
                }
            });
        // The columns after the block take the block's errors through U's rows i1..i2.
        crate::quant::linalg::sub_product(
            &mut wp,
            cols,
            i2..cols,
            err,
            u32s,
            cols,
            i1..i2,
            i2..cols,
        );
        i1 = i2;
    }
    let mut indices = vec![0u8; rows * cols];
    for r in 0..rows {
        for (k, &j) in order.iter().enumerate() {
            indices[r * cols + j] = idx_p[r * cols + k];
        }
    }
    Ok(indices)
}

/// GPTQ's column order and the upper factor U of the damped, permuted inverse Hessian.
pub(crate) type GptqFactor = (Vec<usize>, Vec<f32>);

/// The [`GptqFactor`] of Gram matrix `g` [n, n] under `method`'s act order and damping.
pub(crate) fn gptq_factor(
    g: &[f64],
    n: usize,
    method: &LinearMethod,
) -> Result<GptqFactor, QuantError> {
    let mut order: Vec<usize> = (0..n).collect();
    if method.act_order {
        order.sort_by(|&a, &b| g[b * n + b].total_cmp(&g[a * n + a]));
    }
    let mean_diag = (0..n).map(|j| g[j * n + j]).sum::<f64>() / n.max(1) as f64;
    let mean_diag = if mean_diag > 0.0 { mean_diag } else { 1.0 };
    let mut damp = method.damp.max(1e-6);
    // Retry with more damping if the calibration data leaves H numerically singular.
    for _ in 0..8 {
        // The factor in f32, as GPTQ computes it: half the memory and twice the speed of
        // f64, and the error feedback reads it in f32. The damping is added in f64 first.
        let mut h = vec![0.0f32; n * n];
        for (a, &i) in order.iter().enumerate() {
            for (b, &j) in order.iter().enumerate() {
                h[a * n + b] = g[i * n + j] as f32;
            }
            // A channel the calibration never excited: any value is as good as another.
            let d = g[i * n + i];
            let d = if d > 0.0 { d } else { mean_diag };
            h[a * n + a] = (d + damp * mean_diag) as f32;
        }
        if let Some(u) = inverse_upper_factor_owned(h, n) {
            return Ok((order, u));
        }
        damp *= 10.0;
    }
    Err(QuantError::Calibration {
        message: "the calibration Hessian stays singular even with heavy damping".into(),
    })
}

/// Output error of a quantized layer on the calibration inputs, relative to the output's
/// energy: tr(ΔW·H·ΔWᵀ) / tr(W·H·Wᵀ).
pub fn relative_output_error(w: &[f32], wq: &[f32], rows: usize, cols: usize, gram: &[f64]) -> f64 {
    let (num, den) = (0..rows)
        .into_par_iter()
        .map(|r| {
            let a = &w[r * cols..(r + 1) * cols];
            let b = &wq[r * cols..(r + 1) * cols];
            let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| (x - y) as f64).collect();
            let x: Vec<f64> = a.iter().map(|&v| v as f64).collect();
            let (mut num, mut den) = (0.0, 0.0);
            for i in 0..cols {
                let gi = &gram[i * cols..(i + 1) * cols];
                let (mut hd, mut hx) = (0.0, 0.0);
                for j in 0..cols {
                    hd += gi[j] * d[j];
                    hx += gi[j] * x[j];
                }
                num += d[i] * hd;
                den += x[i] * hx;
            }
            (num, den)
        })
        .reduce(|| (0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::SplitMix64;

    /// A layer whose inputs have a few loud channels, like a real attention/MLP input.
    fn layer(rows: usize, cols: usize, tokens: usize, seed: u64) -> (Vec<f32>, Vec<f64>) {
        let mut r = SplitMix64(seed);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| r.normal() * 0.05 * (1.0 + (i / cols % 7) as f32))
            .collect();
        let loud: Vec<f32> = (0..cols)
            .map(|j| if j % 11 == 0 { 20.0 } else { 1.0 })
            .collect();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| r.normal() * loud[i % cols])
            .collect();
        let mut g = vec![0.0f64; cols * cols];
        for t in 0..tokens {
            let xt = &x[t * cols..(t + 1) * cols];
            for i in 0..cols {
                for j in 0..cols {
                    g[i * cols + j] += (xt[i] * xt[j]) as f64;
                }
            }
        }
        (w, g)
    }

    #[test]
    fn each_step_lowers_the_output_error() {
        let (rows, cols) = (48, 64);
        let (w, g) = layer(rows, cols, 256, 5);
        let err = |m: LinearMethod| {
            let q = quantize_linear(&w, rows, cols, Some(&g), &m).unwrap();
            relative_output_error(&w, &q.dequantize(), rows, cols, &g)
        };
        let free = err(LinearMethod::data_free(4));
        let scaled = err(LinearMethod {
            row_scale: true,
            ..LinearMethod::data_free(4)
        });
        let weighted = err(LinearMethod {
            row_scale: true,
            weighted: true,
            ..LinearMethod::data_free(4)
        });
        let full = err(LinearMethod::calibrated(4));
        assert!(scaled < free, "row scales: {scaled} vs {free}");
        assert!(weighted < scaled, "E[x²] weights: {weighted} vs {scaled}");
        assert!(full < weighted, "GPTQ: {full} vs {weighted}");
    }

    #[test]
    fn dequantize_is_lut_times_scale_and_groups_split_rows() {
        let (rows, cols) = (10, 8);
        let (w, g) = layer(rows, cols, 64, 9);
        let m = LinearMethod {
            row_groups: 3,
            ..LinearMethod::calibrated(2)
        };
        let q = quantize_linear(&w, rows, cols, Some(&g), &m).unwrap();
        let ranges: Vec<Vec<usize>> = q.groups.iter().map(|g| g.rows.clone()).collect();
        assert_eq!(ranges, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        let d = q.dequantize();
        let s = q.row_scale.as_ref().unwrap();
        let indices = q.indices();
        for r in 0..rows {
            for c in 0..cols {
                let lut = &q.groups[r / 4].lut;
                let want = lut[indices[r * cols + c] as usize].to_f32() * s[r].to_f32();
                assert_eq!(d[r * cols + c], want);
            }
        }
    }

    #[test]
    fn rows_of_each_width_share_their_own_lut() {
        let (rows, cols) = (12, 32);
        let (w, g) = layer(rows, cols, 128, 4);
        let bits: Vec<u8> = (0..rows).map(|r| [4, 6, 4, 8][r % 4]).collect();
        let m = LinearMethod::calibrated(4);
        let q = quantize_linear_mixed(&w, rows, cols, Some(&g), &m, Some(&bits)).unwrap();
        let widths: Vec<(u8, Vec<usize>)> =
            q.groups.iter().map(|g| (g.nbits, g.rows.clone())).collect();
        assert_eq!(
            widths,
            vec![
                (4, vec![0, 2, 4, 6, 8, 10]),
                (6, vec![1, 5, 9]),
                (8, vec![3, 7, 11])
            ]
        );
        assert!(q.groups.iter().all(|g| g.lut.len() == 1 << g.nbits));
        assert_eq!(q.rows_by_nbits(), vec![(4, 6), (6, 3), (8, 3)]);
        // Every index fits its row's LUT, and wider rows come out closer to the weights.
        let d = q.dequantize();
        let indices = q.indices();
        let mut err = [0.0f64; 3];
        for r in 0..rows {
            let lut = 1usize << bits[r];
            assert!(indices[r * cols..(r + 1) * cols]
                .iter()
                .all(|&i| (i as usize) < lut));
            let e: f64 = (0..cols)
                .map(|c| ((d[r * cols + c] - w[r * cols + c]) as f64).powi(2))
                .sum::<f64>()
                / w[r * cols..(r + 1) * cols]
                    .iter()
                    .map(|&v| (v as f64).powi(2))
                    .sum::<f64>();
            err[(bits[r] as usize - 4) / 2] += e;
        }
        // Rows at 4 bits are twice as many: compare per-row means.
        assert!(
            err[0] / 6.0 > err[1] / 3.0 && err[1] / 3.0 > err[2] / 3.0,
            "{err:?}"
        );
        // A uniform width is the plain quantizer; a wrong-length or unsupported one is refused.
        let plain = quantize_linear(&w, rows, cols, Some(&g), &m).unwrap();
        let same = quantize_linear_mixed(&w, rows, cols, Some(&g), &m, Some(&[4; 12])).unwrap();
        assert_eq!(plain, same);
        assert!(quantize_linear_mixed(&w, rows, cols, Some(&g), &m, Some(&[4; 11])).is_err());
        assert!(quantize_linear_mixed(&w, rows, cols, Some(&g), &m, Some(&[5; 12])).is_err());
    }

    #[test]
    fn bad_inputs_are_errors() {
        let m = LinearMethod::calibrated(4);
        assert!(quantize_linear(&[0.0; 5], 2, 3, None, &m).is_err());
        assert!(quantize_linear(&[f32::NAN; 6], 2, 3, None, &m).is_err());
        assert!(quantize_linear(&[0.0; 6], 2, 3, Some(&[1.0; 4]), &m).is_err());
        let bad = LinearMethod {
            nbits: 5,
            ..LinearMethod::calibrated(4)
        };
        assert!(quantize_linear(&[0.0; 6], 2, 3, None, &bad).is_err());
    }

    #[test]
    fn zero_and_dead_channels_do_not_break_gptq() {
        // An all-zero row and an input channel that never fires (zero Hessian row/column).
        let (rows, cols) = (4, 6);
        let (mut w, mut g) = layer(rows, cols, 32, 2);
        w[..cols].iter_mut().for_each(|v| *v = 0.0);
        for k in 0..cols {
            g[2 * cols + k] = 0.0;
            g[k * cols + 2] = 0.0;
        }
        let q = quantize_linear(&w, rows, cols, Some(&g), &LinearMethod::calibrated(4)).unwrap();
        assert!(q.dequantize().iter().all(|v| v.is_finite()));
    }
}
