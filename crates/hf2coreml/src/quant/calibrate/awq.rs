//! AWQ-style activation-aware scaling: per-input-channel scales `s = E[x²]^(a/2)` searched per
//! input site (the exponent a minimising the quantized output error) and folded into what
//! precedes the projection, so they cost nothing at run time.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use serde::Serialize;

use super::linear_fit::{quantize_linear, LinearMethod};
use super::sequential::{calib_err, output_error, to_vec};
use super::site::{SiteProjection, SITES};
use crate::arch::{LayerTensor, Role, TensorSlot};
use crate::model::plain::PlainModel;
use crate::quant::QuantError;

/// Exponents tried by the AWQ search (0 = no scaling).
const AWQ_GRID: [f64; 7] = [0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75];

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

/// s_j = E[x_j²]^(a/2), normalised to geometric mean 1 (so the folded weights keep their
/// overall magnitude).
pub(super) fn awq_scales(gram: &[f64], n: usize, exponent: f64) -> Vec<f64> {
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
pub(super) fn site_scales(spec: &crate::arch::ModelSpec, site: usize, s: &[f64]) -> Vec<f64> {
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
pub(super) fn expand_o_scales(spec: &crate::arch::ModelSpec, site: usize, s: &[f64]) -> Vec<f64> {
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
pub(super) fn apply_scales(
    model: &mut PlainModel,
    spec: &crate::arch::ModelSpec,
    l: usize,
    site: usize,
    s: &[f64],
    replaced: &mut BTreeMap<String, Vec<f32>>,
    slots: &[TensorSlot],
) -> Result<(), QuantError> {
    if spec.norm_offset() != 0.0 {
        // The reference holds Gemma's and Qwen3.5's norms as 1 + w; the package stores w.
        return Err(QuantError::Calibration {
            message: format!(
                "AWQ folds scales into RMSNorm weights, which {} stores as w in x·(1 + w): \
                 not supported (use awq = false)",
                spec.architecture
            ),
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
    let kind = spec.layer(l);
    // The site's projections this block has (a conv block reads its input with in_proj alone).
    let present = SITES[site].1.iter().filter_map(|&role| {
        Some((
            role,
            LayerTensor::projection(role, &kind).and_then(name_of)?,
        ))
    });
    for (role, name) in present {
        let w = model.weight_mut(l, role, false).ok_or_else(missing)?;
        scale_tensor(w, &cols_scale, true)?;
        // Recorded in case the recipe keeps it fp16; dropped again once it is palettized.
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
pub(super) fn awq_search(
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
        roles: SITES[site]
            .1
            .iter()
            .copied()
            .filter(|&r| LayerTensor::projection(r, &spec.layer(l)).is_some())
            .collect(),
        exponent: best.1,
        error_unscaled: unscaled,
        error_chosen: best.0,
    })
}
