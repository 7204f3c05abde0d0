//! Mixed precision: every selected projection's error measured at 4, 6 and 8 bits, then bits
//! spent greedily where they remove the most error per stored bit, within a bits-per-weight
//! target.

use std::borrow::Cow;

use candle_core::{Device, Tensor};
use serde::Serialize;

use super::linear_fit::LinearMethod;
use super::sequential::{calib_err, fetch, output_error, to_vec, Sensitivity, SequentialOptions};
use super::site::{Grams, SiteFit, SITES};
use crate::arch::{Role, TensorSlot};
use crate::checkpoint::Checkpoint;
use crate::model::calibrate::Gram;
use crate::model::plain::{Blind, PlainModel};
use crate::quant::QuantError;

/// Calibration segments the mixed-precision allocation measures sensitivities on.
const ALLOCATION_SEGMENTS: usize = 2;

/// Candidate bit widths of the mixed-precision allocation.
pub const MIXED_NBITS: [u8; 3] = [4, 6, 8];

/// How a sensitivity probe palettizes a projection that `m` calibrates: at `nbits`, without
/// error feedback.
fn probe_method(m: &LinearMethod, nbits: u8) -> LinearMethod {
    LinearMethod {
        nbits,
        gptq: false,
        ..*m
    }
}

/// The probe methods of the projections of block `l` reading one input site (`roles`). The
/// probes fit without error feedback: no GPTQ factor is needed.
fn site_probes(
    roles: &[Role],
    l: usize,
    slots: &[TensorSlot],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
) -> Vec<LinearMethod> {
    roles
        .iter()
        .filter_map(|&role| {
            let slot = slots
                .iter()
                .find(|s| s.layer == Some(l) && s.role == role)?;
            Some(probe_method(&method_for(slot)?, 0))
        })
        .collect()
}

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
pub(super) fn allocate_bits(
    model: &mut PlainModel,
    ckpt: &Checkpoint,
    xs: &[Tensor],
    slots: &[TensorSlot],
    method_for: &(dyn Fn(&TensorSlot) -> Option<LinearMethod> + Sync),
    target: f64,
    options: &SequentialOptions,
) -> Result<Vec<BitChoice>, QuantError> {
    let spec = model.spec().clone();
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
            grams: spec.site_widths(l).iter().map(|&d| Gram::new(d)).collect(),
            scratch: Vec::new(),
        };
        // The float block outputs: the reference of the block-output errors, then the next
        // block's inputs (nothing here changes the model for good).
        let ys: Vec<Tensor> = xs
            .iter()
            .map(|x| model.block(l, x, &mut obs))
            .collect::<Result<_, _>>()
            .map_err(|e| calib_err(format!("block {l}"), e))?;
        obs.scratch = Vec::new();
        for (site, (_, roles)) in SITES.iter().enumerate() {
            let gram = &mut obs.grams[site];
            let cols = gram.dim;
            let h32: Vec<f32> = gram.sum.iter().map(|&v| v as f32).collect();
            let h =
                Tensor::from_vec(h32, (cols, cols), &Device::Cpu).map_err(|e| calib_err("H", e))?;
            let probes = site_probes(roles, l, slots, method_for);
            let probes: Vec<&LinearMethod> = probes.iter().collect();
            let site_fit = SiteFit::new(Cow::Owned(std::mem::take(&mut gram.sum)), cols, &probes)?;
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
                    let probe = probe_method(&m, nbits);
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
                if best.is_none_or(|b| rate > b.3) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::plain::embed_rows;
    use crate::quant::calibrate::tests::tiny_qwen3;

    /// The model-KL probe: zero for the float weights themselves, positive for perturbed ones,
    /// larger for a larger perturbation, and the block's weight is restored afterwards.
    #[test]
    fn model_kl_probe_measures_the_logits_and_restores_the_weight() {
        let ckpt = tiny_qwen3();
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
}
