//! The weights a package stores: what the recipe palettizes (data-free or calibrated), the
//! rest as dense fp16, in the form the graph builder takes.

use std::collections::BTreeMap;

use half::f16;

use super::convert::ConvertError;
use crate::checkpoint::Checkpoint;
use crate::graph::Weight;
use crate::progress::Progress;
use crate::quant::{self, Decision, Granularity, Recipe};

/// The calibration passes as a "calibrate" stage: one step per block, with the time so far.
fn calibrate(
    ckpt: &Checkpoint,
    tokens: &[u32],
    method_for: &(dyn Fn(&crate::arch::TensorSlot) -> Option<quant::calibrated::LinearMethod>
          + Sync),
    options: &quant::sequential::SequentialOptions,
    progress: &dyn Progress,
) -> Result<quant::sequential::CalibratedWeights, ConvertError> {
    let blocks = ckpt.spec().num_hidden_layers;
    let t = std::time::Instant::now();
    progress.begin("calibrate", blocks as u64);
    progress.working_on(&format!("block 1/{blocks}"));
    let block_done = |done: usize, total: usize| {
        progress.advance(1);
        progress.detail(&format!(
            "calibrated block {done}/{total} ({:.1} s)",
            t.elapsed().as_secs_f64()
        ));
        if done < total {
            progress.working_on(&format!("block {}/{total}", done + 1));
        }
    };
    let w = quant::sequential::quantize_streaming(ckpt, tokens, method_for, options, &block_done);
    progress.end();
    Ok(w?)
}

/// Palettize what `recipe` selects and read the rest as dense fp16. A recipe with
/// `[calibration]` fits its palettized projections on `calibration` tokens
/// ([`quant::sequential`]), reported to `progress` as a "calibrate" stage of one step per
/// decoder block (a detail line per block); then a "palettize" stage advances once per
/// palettized tensor, from worker threads. Other palettized tensors (an embedding, say) are
/// palettized data-free either way.
pub fn prepare_weights(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    calibration: &[u32],
    progress: &dyn Progress,
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
            let w = calibrate(ckpt, calibration, &method_for, &options, progress)?;
            crate::fsutil::release_free_memory();
            Some(w)
        }
        None => None,
    };
    let skip: std::collections::HashSet<String> = calibrated
        .as_ref()
        .map(|c| c.linears.keys().cloned().collect())
        .unwrap_or_default();
    let planned = quant::Report::plan(ckpt, recipe)?.totals.palettized_tensors;
    progress.begin("palettize", planned as u64);
    let tensor_done = |line: &quant::TensorReport| {
        progress.working_on(&line.name);
        progress.advance(1);
    };
    let out = quant::palettize_checkpoint_skipping(ckpt, recipe, &skip, &tensor_done);
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            progress.end();
            return Err(e.into());
        }
    };
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
                tensor_done(line);
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
