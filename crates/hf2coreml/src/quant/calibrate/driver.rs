//! The block driver: the calibration text runs through the model one decoder block at a time,
//! each block's projections are palettized on the inputs its quantized predecessors produce, and
//! the block then runs with its quantized weights to give the next block's inputs.

use std::borrow::Cow;
use std::collections::BTreeMap;

use candle_core::{Device, Tensor};

use super::allocate::allocate_bits;
use super::allocate::BitChoice;
use super::awq::AwqChoice;
use super::awq::{apply_scales, awq_scales, awq_search, expand_o_scales, site_scales};
use super::linear_fit::LinearMethod;
use super::linear_fit::QuantizedLinear;
use super::sequential::{calib_err, fetch, to_vec, SequentialOptions};
use super::site::{Grams, SiteFit, SiteProjection, SlotMethod, SITES};
use crate::arch::{expected_tensors, Role, TensorSlot};
use crate::checkpoint::Checkpoint;
use crate::model::calibrate::Gram;
use crate::model::plain::{embed_rows, Blind, PlainModel, Segment};
use crate::quant::QuantError;

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

/// Where fitted projections go as each block is done (tensor name, projection), instead of
/// [`CalibratedWeights::linears`].
pub type Sink<'a> = &'a mut dyn FnMut(String, QuantizedLinear) -> Result<(), QuantError>;

/// Calibrate on `tokens` and palettize what `method_for` selects, block by block, on `model`
/// (loaded whole or streaming: each block is fetched before and released after its turn).
pub(super) fn quantize_model(
    model: &mut PlainModel,
    ckpt: &Checkpoint,
    tokens: &[u32],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
    options: &SequentialOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
    mut sink: Option<Sink<'_>>,
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
    // What each segment's blocks read from outside themselves (Gemma 4's per-layer inputs and
    // shared keys and values).
    model
        .fetch_per_layer(ckpt, tokens)
        .map_err(|e| QuantError::Calibration {
            message: e.to_string(),
        })?;
    let mut segs: Vec<Segment> = tokens
        .chunks(seg)
        .zip(&xs)
        .map(|(c, x)| model.segment(c, x))
        .collect::<Result<_, _>>()
        .map_err(|e| calib_err("the per-layer inputs", e))?;
    let slots = expected_tensors(&spec);
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
            let dims = spec.site_widths(l);
            let at = (l, &mut segs[..]);
            xs = true_sequential_block(model, at, &xs, &slots, &method_for, &dims, &mut out)?;
            model.release_layer(l);
            hand_over(&mut out, &mut sink)?;
            progress(l + 1, n_layers);
        }
        return Ok(out);
    }
    for l in 0..n_layers {
        fetch(model, ckpt, l)?;
        let at = (l, &mut segs[..]);
        xs = calibrate_block(model, at, &xs, &slots, &method_for, options, &mut out)?;
        model.release_layer(l);
        hand_over(&mut out, &mut sink)?;
        progress(l + 1, n_layers);
    }
    Ok(out)
}

/// A block's fitted projections to the sink, if there is one.
fn hand_over(out: &mut CalibratedWeights, sink: &mut Option<Sink<'_>>) -> Result<(), QuantError> {
    if let Some(sink) = sink {
        for (name, q) in std::mem::take(&mut out.linears) {
            sink(name, q)?;
        }
    }
    Ok(())
}

/// One block of calibration: each input site's XᵀX is accumulated from the block's float
/// inputs, AWQ scales (if enabled) are folded, then the site's projections are palettized.
/// Returns the block outputs with the palettized weights (the next block's inputs).
fn calibrate_block(
    model: &mut PlainModel,
    (l, segs): (usize, &mut [Segment]),
    xs: &[Tensor],
    slots: &[TensorSlot],
    method_for: &dyn Fn(&TensorSlot) -> Option<SlotMethod>,
    options: &SequentialOptions,
    out: &mut CalibratedWeights,
) -> Result<Vec<Tensor>, QuantError> {
    let spec = &model.spec().clone();
    let dims = spec.site_widths(l);
    let mut obs = Grams {
        layer: l,
        grams: dims.iter().map(|&d| Gram::new(d)).collect(),
        scratch: Vec::new(),
    };
    for (x, seg) in xs.iter().zip(segs.iter_mut()) {
        model
            .block_in(l, x, seg, &mut obs)
            .map_err(|e| calib_err(format!("block {l}"), e))?;
    }
    // Not held through the fits: at 8B it is the size of down_proj's factor.
    obs.scratch = Vec::new();
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
            work.push((site, std::mem::take(&mut obs.grams[site].sum), methods));
        }
    }
    drop(obs);
    // AWQ folds first, all of them: the o and down scales fold into v_proj and up_proj
    // rows, which must carry them before they are palettized.
    if options.awq {
        for (site, h, methods) in work.iter_mut() {
            let cols = dims[*site];
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
    // Site by site, each Gram matrix is consumed by its fit.
    for (site, h, methods) in work {
        let cols = dims[site];
        let prepared: Vec<&LinearMethod> = methods.iter().map(|(_, _, m, _)| m).collect();
        let site_fit = SiteFit::new(Cow::Owned(h), cols, &prepared)?;
        for (role, slot, method, row_bits) in &methods {
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
        .zip(segs.iter_mut())
        .map(|(x, seg)| model.block_in(l, x, seg, &mut Blind))
        .collect::<Result<_, _>>()
        .map_err(|e| calib_err(format!("block {l}"), e))
}

/// One block of true-sequential calibration: each input site's XᵀX is accumulated from the
/// activations computed with every earlier projection of the block already palettized, then
/// the site's projections are palettized. Returns the block outputs (the next block's inputs).
fn true_sequential_block(
    model: &mut PlainModel,
    (l, segs): (usize, &mut [Segment]),
    xs: &[Tensor],
    slots: &[TensorSlot],
    method_for: &dyn Fn(&TensorSlot) -> Option<SlotMethod>,
    dims: &[usize; 4],
    out: &mut CalibratedWeights,
) -> Result<Vec<Tensor>, QuantError> {
    let err = |e| calib_err(format!("block {l}"), e);
    let mut fit = |model: &mut PlainModel, site: usize, inputs: &[Tensor]| {
        let mut gram = Gram::new(dims[site]);
        let mut scratch = Vec::new();
        for x in inputs {
            gram.accumulate_with(x, &mut scratch).map_err(err)?;
        }
        drop(scratch);
        let methods: Vec<(Role, &TensorSlot, SlotMethod)> = SITES[site]
            .1
            .iter()
            .filter_map(|&role| {
                let slot = slots
                    .iter()
                    .find(|s| s.layer == Some(l) && s.role == role)?;
                Some((role, slot, method_for(slot)?))
            })
            .collect();
        let prepared: Vec<&LinearMethod> = methods.iter().map(|(_, _, (m, _))| m).collect();
        let site_fit = SiteFit::new(Cow::Owned(gram.sum), gram.dim, &prepared)?;
        for (role, slot, (method, row_bits)) in methods {
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
        .zip(segs.iter_mut())
        .map(|(h, seg)| model.step_attention(l, h, seg))
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
        .zip(segs.iter())
        .map(|((x, a), seg)| model.step_output(l, x, a, seg))
        .collect::<Result<_, _>>()
        .map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::transformers_fixture;

    /// The steps true-sequential calibration runs a block in compute what the block computes.
    #[test]
    fn block_steps_compose_to_the_block() {
        for name in ["qwen3", "smollm3", "phi3"] {
            let ckpt = transformers_fixture(name);
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
            let attn = model
                .step_attention(0, &h, &mut Segment::default())
                .unwrap();
            let (mid, h) = model.step_mlp_input(0, &x, &attn).unwrap();
            let act = model.step_mlp_act(0, &h).unwrap();
            let got = model
                .step_output(0, &mid, &act, &Segment::default())
                .unwrap();
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
}
