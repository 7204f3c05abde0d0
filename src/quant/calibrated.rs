//! Calibrated palettization of one linear layer (issue 7): the LUT fits what the layer
//! computes on real inputs, not the weights alone.
//!
//! A projection W [out, in] becomes `y = s ⊙ (Ŵ·x)` with Ŵ[r, j] = LUT_g(r)[idx[r, j]]:
//! - `s`: an optional per-output-row fp16 scale (one `mul` after the linear on device). Rows
//!   normalised by their largest |w| share one LUT far better than raw rows of very different
//!   magnitudes do.
//! - the LUT is fitted by the exact weighted k-means of [`super::kmeans`], each element weighted
//!   by E[x_j²] of its input channel (times s_r², so the error is measured in W's units).
//! - indices are chosen by GPTQ-style error feedback: columns are quantised in turn and each
//!   column's output error, measured through the inverse Hessian of the calibration inputs,
//!   is compensated in the columns not yet quantised.
//! - optionally the rows are split into a few contiguous groups, each with its own LUT (one
//!   `constexpr_lut_to_dense` + linear per group on device, outputs concatenated: all iOS17).

use half::f16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::linalg::inverse_upper_factor_owned;
use super::{kmeans, palettize_f16, QuantError};

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
            rotate: false,
        }
    }
}

/// A palettized linear layer: `y = row_scale ⊙ (LUT[idx] · x)`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedLinear {
    pub rows: usize,
    pub cols: usize,
    pub nbits: u8,
    /// Rows per LUT group; group g covers rows `g·group_rows .. min((g+1)·group_rows, rows)`.
    pub group_rows: usize,
    /// One sorted LUT of `2^nbits` entries per group.
    pub luts: Vec<Vec<f16>>,
    /// One index per weight, row-major [rows, cols], unpacked.
    pub indices: Vec<u8>,
    /// Per-row fp16 scale multiplied into the linear's output.
    pub row_scale: Option<Vec<f16>>,
    /// The stored weight is W·Q for the input rotation Q of [`LinearMethod::rotate`]: the
    /// graph must feed it x·Q ([`crate::quant::sequential::rotation_transpose`]).
    pub rotated: bool,
    /// Per-element MSE and SNR of the stored weight against the input weight.
    pub mse: f64,
    pub snr_db: f64,
}

impl QuantizedLinear {
    /// The weight the layer computes with, [rows, cols] row-major, in f32 (LUT entry times row
    /// scale, as the device multiplies them: the product of two fp16 numbers).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            let lut = &self.luts[r / self.group_rows.max(1)];
            let s = self.row_scale.as_ref().map_or(1.0, |s| s[r].to_f32());
            out.extend(
                self.indices[r * self.cols..(r + 1) * self.cols]
                    .iter()
                    .map(|&i| lut[i as usize].to_f32() * s),
            );
        }
        out
    }

    /// Rows of each group, in order.
    pub fn group_ranges(&self) -> Vec<std::ops::Range<usize>> {
        let g = self.group_rows.max(1);
        (0..self.rows.div_ceil(g))
            .map(|i| i * g..((i + 1) * g).min(self.rows))
            .collect()
    }
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
    kmeans::check_nbits(method.nbits)?;
    if w.len() != rows * cols {
        return Err(QuantError::WeightsLength {
            values: rows * cols,
            weights: w.len(),
        });
    }
    if let Some((index, &value)) = w.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(QuantError::NonFinite { index, value });
    }
    if let Some(g) = gram {
        if g.len() != cols * cols {
            return Err(QuantError::WeightsLength {
                values: cols * cols,
                weights: g.len(),
            });
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
    let diag: Option<Vec<f64>> = gram.map(|g| (0..cols).map(|j| g[j * cols + j]).collect());

    // The LUT of each row group: weighted k-means over the normalised weights.
    let group_rows = rows.div_ceil(method.row_groups.max(1)).max(1);
    let groups: Vec<std::ops::Range<usize>> = (0..rows.div_ceil(group_rows))
        .map(|i| i * group_rows..((i + 1) * group_rows).min(rows))
        .collect();
    let luts: Vec<Vec<f16>> = groups
        .par_iter()
        .map(|range| {
            let mut values = Vec::with_capacity(range.len() * cols);
            let mut weights = Vec::with_capacity(range.len() * cols);
            for r in range.clone() {
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
            palettize_f16(&values, method.nbits, Some(&weights)).map(|p| p.lut)
        })
        .collect::<Result<_, _>>()?;
    let luts_f32: Vec<Vec<f32>> = luts
        .iter()
        .map(|l| l.iter().map(|v| v.to_f32()).collect())
        .collect();

    let mut indices = vec![0u8; rows * cols];
    match (gram, method.gptq) {
        (Some(g), true) => {
            let (order, u) = gptq_factor(g, cols, method)?;
            let scales: Vec<f32> = (0..rows).map(scale).collect();
            indices = gptq_indices(w, rows, cols, &order, u, &luts_f32, group_rows, &scales)?;
        }
        _ => {
            indices
                .par_chunks_mut(cols)
                .enumerate()
                .for_each(|(r, idx)| {
                    let lut = &luts_f32[r / group_rows];
                    let s = scale(r);
                    for (j, i) in idx.iter_mut().enumerate() {
                        *i = nearest(lut, w[r * cols + j] / s) as u8;
                    }
                });
        }
    }
    let mut q = QuantizedLinear {
        rows,
        cols,
        nbits: method.nbits,
        group_rows,
        luts,
        indices,
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
    u: Vec<f64>,
    luts: &[Vec<f32>],
    group_rows: usize,
    scales: &[f32],
) -> Result<Vec<u8>, QuantError> {
    use candle_core::{Device, Tensor};
    let fail = |e: candle_core::Error| QuantError::Calibration {
        message: format!("GPTQ update: {e}"),
    };
    // Work in quantisation order.
    let mut wp: Vec<f32> = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        wp.extend(order.iter().map(|&j| w[r * cols + j]));
    }
    let u32s: Vec<f32> = u.iter().map(|&v| v as f32).collect();
    drop(u);
    let mut idx_p = vec![0u8; rows * cols];
    let mut i1 = 0;
    while i1 < cols {
        let i2 = (i1 + GPTQ_BLOCK).min(cols);
        let b = i2 - i1;
        let mut err = vec![0.0f32; rows * b];
        wp.par_chunks_mut(cols)
            .zip(idx_p.par_chunks_mut(cols))
            .zip(err.par_chunks_mut(b))
            .enumerate()
            .for_each(|(r, ((row, idx), e))| {
                let lut = &luts[r / group_rows];
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
        if i2 < cols {
            let rest = cols - i2;
            let mut ub = Vec::with_capacity(b * rest);
            for k in i1..i2 {
                ub.extend_from_slice(&u32s[k * cols + i2..(k + 1) * cols]);
            }
            let et = Tensor::from_vec(err, (rows, b), &Device::Cpu).map_err(fail)?;
            let ut = Tensor::from_vec(ub, (b, rest), &Device::Cpu).map_err(fail)?;
            let upd: Vec<f32> = et
                .matmul(&ut)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1())
                .map_err(fail)?;
            wp.par_chunks_mut(cols)
                .zip(upd.par_chunks(rest))
                .for_each(|(row, d)| {
                    for (x, y) in row[i2..].iter_mut().zip(d) {
                        *x -= y;
                    }
                });
        }
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

/// The column order and the upper factor U of the damped, permuted inverse Hessian.
fn gptq_factor(
    g: &[f64],
    n: usize,
    method: &LinearMethod,
) -> Result<(Vec<usize>, Vec<f64>), QuantError> {
    let mut order: Vec<usize> = (0..n).collect();
    if method.act_order {
        order.sort_by(|&a, &b| g[b * n + b].total_cmp(&g[a * n + a]));
    }
    let mean_diag = (0..n).map(|j| g[j * n + j]).sum::<f64>() / n.max(1) as f64;
    let mean_diag = if mean_diag > 0.0 { mean_diag } else { 1.0 };
    let mut damp = method.damp.max(1e-6);
    // Retry with more damping if the calibration data leaves H numerically singular.
    for _ in 0..8 {
        let mut h = vec![0.0f64; n * n];
        for (a, &i) in order.iter().enumerate() {
            for (b, &j) in order.iter().enumerate() {
                h[a * n + b] = g[i * n + j];
            }
            // A channel the calibration never excited: any value is as good as another.
            if h[a * n + a] <= 0.0 {
                h[a * n + a] = mean_diag;
            }
            h[a * n + a] += damp * mean_diag;
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
    use crate::testing::SplitMix64;

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
        assert_eq!(q.luts.len(), 3);
        assert_eq!(q.group_ranges(), vec![0..4, 4..8, 8..10]);
        let d = q.dequantize();
        let s = q.row_scale.as_ref().unwrap();
        for r in 0..rows {
            for c in 0..cols {
                let want = q.luts[r / 4][q.indices[r * cols + c] as usize].to_f32() * s[r].to_f32();
                assert_eq!(d[r * cols + c], want);
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let m = LinearMethod::calibrated(4);
        assert!(quantize_linear(&[0.0; 5], 2, 3, None, &m).is_err());
        assert!(quantize_linear(&[f32::NAN; 6], 2, 3, None, &m).is_err());
        assert!(quantize_linear(&[0.0; 6], 2, 3, Some(&[1.0; 4]), &m).is_err());
        let bad = LinearMethod {
            nbits: 3,
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
