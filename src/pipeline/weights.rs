//! The weights a package stores: what the recipe palettizes (data-free or calibrated), the
//! rest as dense fp16, in the form the graph builder takes.

use std::collections::BTreeMap;

use half::f16;

use super::convert::ConvertError;
use crate::checkpoint::Checkpoint;
use crate::graph::Weight;
use crate::quant::{self, Decision, Granularity, Recipe};

/// Palettize what `recipe` selects and read the rest as dense fp16. `progress` is called once
/// per palettized tensor, from worker threads. A recipe with `[calibration]` fits its
/// palettized projections on `calibration` tokens ([`quant::sequential`]); other palettized
/// tensors (an embedding, say) are palettized data-free either way.
pub fn prepare_weights(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    calibration: &[u32],
    progress: &(dyn Fn(&quant::TensorReport) + Sync),
) -> Result<(BTreeMap<String, Weight>, quant::Report), ConvertError> {
    let method_for = |slot: &crate::arch::TensorSlot| {
        let cal = recipe.calibration()?;
        match recipe.decide(slot) {
            Decision::Palettize {
                nbits,
                granularity: Granularity::PerTensor,
            } if slot.role.is_projection() => Some(cal.method(nbits)),
            _ => None,
        }
    };
    // Nothing to fit (e.g. `--keep-fp16 '*'`): skip the calibration passes altogether.
    let calibrates = recipe.calibrates(&ckpt.slots());
    let calibrated = match recipe.calibration().filter(|_| calibrates) {
        Some(cal) => {
            let cal = *cal;
            let options = quant::sequential::SequentialOptions {
                awq: cal.awq,
                target_bpw: cal.target_bpw,
                chunk_rows: cal.allocation_rows,
                ..Default::default()
            };
            let w = quant::sequential::quantize_streaming(
                ckpt,
                calibration,
                &method_for,
                &options,
                &|_, _| {},
            )?;
            crate::fsutil::release_free_memory();
            Some(w)
        }
        None => None,
    };
    let skip: std::collections::HashSet<String> = calibrated
        .as_ref()
        .map(|c| c.linears.keys().cloned().collect())
        .unwrap_or_default();
    let out = quant::palettize_checkpoint_skipping(ckpt, recipe, &skip, progress)?;
    let mut report = out.report;
    if let (Some(c), Some(target)) = (
        calibrated.as_ref(),
        recipe.calibration().and_then(|c| c.target_bpw),
    ) {
        if !c.allocation.is_empty() {
            report.mixed_precision = Some(quant::MixedPrecision::new(target, &c.allocation));
        }
    }
    let mut weights = BTreeMap::new();
    let mut calibrated = calibrated;
    for t in out.tensors {
        let name = t.slot.name.clone();
        if let Some(q) = calibrated.as_mut().and_then(|c| c.linears.remove(&name)) {
            if let Some(line) = report.tensors.iter_mut().find(|l| l.name == name) {
                // A mixed projection reports its widest rows' width.
                let nbits = q.max_nbits();
                if let Decision::Palettize { granularity, .. } = line.decision {
                    line.decision = Decision::Palettize { nbits, granularity };
                }
                line.nbits = Some(nbits);
                line.bytes_after = q
                    .groups
                    .iter()
                    .map(|g| {
                        crate::quant::Storage::Lut {
                            nbits: g.nbits,
                            luts: 1,
                        }
                        .bytes(g.rows.len() * q.cols)
                    })
                    .sum::<u64>()
                    + q.row_scale.as_ref().map_or(0, |s| 2 * s.len() as u64);
                line.mse = Some(q.mse);
                line.snr_db = Some(q.snr_db);
                progress(line);
            }
            weights.insert(name, Weight::Quantized(q.into()));
            continue;
        }
        if let Some(v) = calibrated.as_mut().and_then(|c| c.replaced.remove(&name)) {
            weights.insert(
                name,
                Weight::Dense(v.iter().map(|&x| f16::from_f32(x)).collect()),
            );
            continue;
        }
        let w = match t.palettized {
            Some(p) => {
                let granularity = p.granularity.to_string();
                let q = p.into_weight().ok_or_else(|| ConvertError::Granularity {
                    tensor: t.slot.name.clone(),
                    granularity,
                })?;
                Weight::Quantized(q)
            }
            None => Weight::Dense(ckpt.tensor(&t.slot.name)?.to_f16()),
        };
        weights.insert(name, w);
    }
    report.recompute_totals();
    crate::fsutil::release_free_memory();
    Ok((weights, report))
}
