//! The weights a package stores: what the recipe palettizes (data-free or calibrated), the
//! rest as dense fp16, in the form the graph builder takes.

use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

use half::f16;

use super::error::ConvertError;
use crate::arch::TensorSlot;
use crate::checkpoint::Checkpoint;
use crate::graph::Weight;
use crate::progress::Progress;
use crate::quant::{self, Decision, Granularity, Recipe};

/// Palettize what `recipe` selects and read the rest as dense fp16, all at once (`palettize`
/// reports them; `convert` takes them package by package through a [`WeightStream`]). A recipe
/// with `[calibration]` fits its palettized projections on `calibration` tokens
/// ([`quant::calibrate`]), reported to `progress` as a "calibrate" stage of one step per
/// decoder block (see [`calibrated_stream`]); then a "palettize" stage advances once per
/// palettized tensor, from worker threads. Other palettized tensors (an embedding, say) are
/// palettized data-free either way.
pub fn prepare_weights(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    calibration: &[u32],
    progress: &dyn Progress,
) -> Result<(BTreeMap<String, Weight>, quant::Report), ConvertError> {
    let tensor_done = |line: &quant::TensorReport| {
        progress.working_on(&line.name);
        progress.advance(1);
    };
    let mut stream = calibrated_stream(ckpt, recipe, calibration, progress, &tensor_done)?;
    progress.begin(
        "palettize",
        stream.report().totals.palettized_tensors as u64,
    );
    let weights = stream.take_all();
    progress.end();
    Ok((weights?, stream.finish().report))
}

/// [`WeightStream::new`], its calibration reported to `progress` as a "calibrate" stage of one
/// step per decoder block, with a detail line per block and the time so far (`-v`).
pub fn calibrated_stream<'a>(
    ckpt: &'a Checkpoint,
    recipe: &Recipe,
    calibration: &[u32],
    progress: &dyn Progress,
    tensor_done: &'a (dyn Fn(&quant::TensorReport) + Sync),
) -> Result<WeightStream<'a>, ConvertError> {
    let calibrates = !calibration.is_empty() && recipe.calibrates(&ckpt.slots());
    let total = ckpt.spec().num_hidden_layers;
    let t = Instant::now();
    if calibrates {
        progress.begin("calibrate", total as u64);
        progress.working_on(&format!("block 1/{total}"));
    }
    let blocks = |done: usize, total: usize| {
        progress.advance(1);
        progress.detail(&format!(
            "calibrated block {done}/{total} ({:.1} s)",
            t.elapsed().as_secs_f64()
        ));
        if done < total {
            progress.working_on(&format!("block {}/{total}", done + 1));
        }
    };
    let stream = WeightStream::new(ckpt, recipe, calibration, &blocks, tensor_done);
    if calibrates {
        progress.end();
    }
    stream
}

/// The weights of a conversion, produced when a package asks for them (docs/design.md,
/// "Streaming convert"): [`WeightStream::take`] reads and palettizes a package's tensors from
/// the memory-mapped checkpoint, so only that package's weights are in memory at a time. A
/// calibrated recipe fits its projections up front, block by block (each fit needs the
/// previous blocks' quantized outputs); the stream then holds the fitted projections, packed,
/// until their package takes them.
pub struct WeightStream<'a> {
    ckpt: &'a Checkpoint,
    slots: Vec<TensorSlot>,
    report: quant::Report,
    /// Calibrated projections, packed, by tensor name.
    fitted: BTreeMap<String, Weight>,
    /// Unpalettized tensors calibration changed (f32).
    replaced: BTreeMap<String, Vec<f32>>,
    /// Slots already taken once (a tied table is taken by the first and the last package).
    taken: HashSet<usize>,
    labels: BTreeMap<String, String>,
    progress: &'a (dyn Fn(&quant::TensorReport) + Sync),
    /// Seconds spent fitting calibrated projections (in [`WeightStream::new`]).
    fit_secs: f64,
    /// Seconds spent calibrating and palettizing so far.
    secs: f64,
}

/// What a [`WeightStream`] leaves once every package has taken its weights.
pub struct Streamed {
    /// The palettizer's report, every line filled in.
    pub report: quant::Report,
    /// Per-tensor storage labels (`fp16`, `lut4`, ...), by tensor name.
    pub labels: BTreeMap<String, String>,
    /// Seconds spent calibrating and palettizing.
    pub secs: f64,
    /// Of those, seconds spent fitting calibrated projections before any package was built.
    pub fit_secs: f64,
}

impl<'a> WeightStream<'a> {
    /// Plan every tensor's storage and run calibration, if the recipe calibrates
    /// (`blocks(done, total)` after each decoder block). Nothing else is read yet.
    pub fn new(
        ckpt: &'a Checkpoint,
        recipe: &Recipe,
        calibration: &[u32],
        blocks: &(dyn Fn(usize, usize) + Sync),
        progress: &'a (dyn Fn(&quant::TensorReport) + Sync),
    ) -> Result<Self, ConvertError> {
        let t = Instant::now();
        let mut report = quant::Report::plan(ckpt, recipe)?;
        let mut fitted = BTreeMap::new();
        let mut replaced = BTreeMap::new();
        if let Some(c) = calibrate(ckpt, recipe, calibration, blocks)? {
            if let (Some(target), false) = (
                recipe.calibration().and_then(|c| c.target_bpw),
                c.allocation.is_empty(),
            ) {
                report.mixed_precision = Some(quant::MixedPrecision::new(target, &c.allocation));
            }
            for (name, q) in c.linears {
                if let Some(line) = report.tensors.iter_mut().find(|l| l.name == name) {
                    fitted_line(line, &q);
                }
                fitted.insert(name, Weight::Quantized(q.into()));
            }
            replaced = c.replaced;
            crate::fsutil::release_free_memory();
        }
        Ok(WeightStream {
            ckpt,
            slots: ckpt.slots(),
            report,
            fitted,
            replaced,
            taken: HashSet::new(),
            labels: BTreeMap::new(),
            progress,
            fit_secs: t.elapsed().as_secs_f64(),
            secs: t.elapsed().as_secs_f64(),
        })
    }

    /// The report so far: every decision is final (calibration has run); the errors of
    /// tensors not yet taken are still missing.
    pub fn report(&self) -> &quant::Report {
        &self.report
    }

    /// Bytes `slot` will take in weight.bin, before it is palettized (what the planner splits).
    pub fn bytes(&self, slot: &TensorSlot) -> u64 {
        if let Some(w) = self.fitted.get(&slot.name) {
            return weight_bytes(w);
        }
        self.report
            .tensors
            .iter()
            .find(|l| l.name == slot.name)
            .map_or(slot.numel() as u64 * 2, |l| l.bytes_after)
    }

    /// The weights named (checkpoint tensor names), read and palettized now; a name the
    /// checkpoint does not have is left out.
    pub fn take(&mut self, names: &[String]) -> Result<BTreeMap<String, Weight>, ConvertError> {
        let t = Instant::now();
        let indices: Vec<usize> = names
            .iter()
            .filter_map(|n| self.slots.iter().position(|s| &s.name == n))
            .collect();
        let first: HashSet<usize> = indices
            .iter()
            .copied()
            .filter(|i| !self.taken.contains(i))
            .collect();
        let progress = self.progress;
        let report_first = |line: &quant::TensorReport| {
            if first.contains(&(line.index - 1)) {
                progress(line)
            }
        };
        // Calibration's results come first: its fitted projections and the tensors it changed
        // are not palettized data-free.
        let data_free: Vec<usize> = indices
            .iter()
            .copied()
            .filter(|&i| {
                let name = &self.slots[i].name;
                !self.fitted.contains_key(name) && !self.replaced.contains_key(name)
            })
            .collect();
        let done = quant::palettize_slots(
            self.ckpt,
            &self.slots,
            &self.report,
            &data_free,
            &|_| None,
            &report_first,
        )?;
        let mut out = BTreeMap::new();
        for (i, p) in done {
            let line = &mut self.report.tensors[i];
            line.mse = Some(p.mse);
            line.snr_db = Some(p.snr_db);
            let granularity = p.granularity.to_string();
            let q = p.into_weight().ok_or_else(|| ConvertError::Granularity {
                tensor: line.name.clone(),
                granularity,
            })?;
            out.insert(line.name.clone(), Weight::Quantized(q));
        }
        for &i in &indices {
            let name = self.slots[i].name.clone();
            if out.contains_key(&name) {
                continue;
            }
            let (w, fitted) = self.unpalettized(&name)?;
            if fitted && first.contains(&i) {
                progress(&self.report.tensors[i]);
            }
            out.insert(name, w);
        }
        for (name, w) in &out {
            self.labels.insert(name.clone(), w.label());
        }
        self.taken.extend(indices);
        self.secs += t.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Every weight of the checkpoint.
    pub fn take_all(&mut self) -> Result<BTreeMap<String, Weight>, ConvertError> {
        let names: Vec<String> = self.slots.iter().map(|s| s.name.clone()).collect();
        let out = self.take(&names)?;
        crate::fsutil::release_free_memory();
        Ok(out)
    }

    /// A calibrated projection (moved out: a projection is in one package; the flag says it
    /// was one), a tensor calibration changed, or a tensor read as fp16.
    fn unpalettized(&mut self, name: &str) -> Result<(Weight, bool), ConvertError> {
        if let Some(w) = self.fitted.remove(name) {
            return Ok((w, true));
        }
        if let Some(v) = self.replaced.get(name) {
            let dense = v.iter().map(|&x| f16::from_f32(x)).collect();
            return Ok((Weight::Dense(dense), false));
        }
        Ok((Weight::Dense(self.ckpt.tensor(name)?.to_f16()), false))
    }

    /// The report with every line and the totals, the labels and the time spent.
    pub fn finish(mut self) -> Streamed {
        self.report.recompute_totals();
        Streamed {
            report: self.report,
            labels: self.labels,
            secs: self.secs,
            fit_secs: self.fit_secs,
        }
    }
}

/// Fit the recipe's calibrated projections, if it has any to fit.
fn calibrate(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    calibration: &[u32],
    blocks: &(dyn Fn(usize, usize) + Sync),
) -> Result<Option<quant::calibrate::CalibratedWeights>, ConvertError> {
    let method_for = |slot: &TensorSlot| {
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
    let Some(cal) = recipe
        .calibration()
        .filter(|_| recipe.calibrates(&ckpt.slots()))
    else {
        return Ok(None);
    };
    let options = quant::calibrate::SequentialOptions {
        awq: cal.awq,
        target_bpw: cal.target_bpw,
        chunk_rows: cal.allocation_rows,
        ..Default::default()
    };
    let w = quant::calibrate::quantize_streaming(ckpt, calibration, &method_for, &options, blocks)?;
    crate::fsutil::release_free_memory();
    Ok(Some(w))
}

/// A calibrated projection's report line: its widest rows' width, bytes and error.
fn fitted_line(line: &mut quant::TensorReport, q: &quant::calibrate::QuantizedLinear) {
    let nbits = q.max_nbits();
    if let Decision::Palettize { granularity, .. } = line.decision {
        line.decision = Decision::Palettize { nbits, granularity };
    }
    line.nbits = Some(nbits);
    line.bytes_after = q
        .groups
        .iter()
        .map(|g| {
            quant::Storage::Lut {
                nbits: g.nbits,
                luts: 1,
            }
            .bytes(g.rows.len() * q.cols)
        })
        .sum::<u64>()
        + q.row_scale.as_ref().map_or(0, |s| 2 * s.len() as u64);
    line.mse = Some(q.mse);
    line.snr_db = Some(q.snr_db);
}

/// Bytes `w` takes in weight.bin.
pub fn weight_bytes(w: &Weight) -> u64 {
    match w {
        Weight::Dense(v) => v.len() as u64 * 2,
        Weight::Quantized(q) => {
            let luts: u64 = q.groups.iter().map(|g| g.lut.bytes()).sum();
            let scales = q.row_scale.as_ref().map_or(0, |s| s.len() as u64 * 2);
            let restore = q.restore.as_ref().map_or(0, |r| r.len() as u64 * 4);
            luts + scales + restore
        }
    }
}
