//! The weights a package stores: what the recipe palettizes (data-free or calibrated), the
//! rest as dense fp16, in the form the graph builder takes.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use half::f16;

use super::convert_error::ConvertError;
use crate::arch::TensorSlot;
use crate::checkpoint::Checkpoint;
use crate::graph::Weight;
use crate::progress::Progress;
use crate::quant::calibrate::QuantizedLinear;
use crate::quant::{self, Decision, Granularity, QuantError, QuantizedWeight, Recipe};

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
    let mut stream = calibrated_stream(ckpt, recipe, calibration, None, progress, &tensor_done)?;
    progress.begin(
        "palettize",
        stream.report().totals.palettized_tensors as u64,
    );
    let weights = stream.take_all();
    progress.end();
    Ok((weights?, stream.finish().report))
}

/// [`WeightStream::new`] (`spill`: where fitted projections wait for their package, see
/// [`Fitted`]), its calibration reported to `progress` as a "calibrate" stage of one
/// step per decoder block, with a detail line per block and the time so far (`-v`).
pub fn calibrated_stream<'a>(
    ckpt: &'a Checkpoint,
    recipe: &Recipe,
    calibration: &[u32],
    spill: Option<&Path>,
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
    let stream = WeightStream::new(ckpt, recipe, calibration, spill, &blocks, tensor_done);
    if calibrates {
        progress.end();
    }
    stream
}

/// The weights of a conversion, produced when a package asks for them (docs/design.md,
/// "Streaming convert"): [`WeightStream::take`] reads and palettizes a package's tensors from
/// the memory-mapped checkpoint, so only that package's weights are in memory at a time. A
/// calibrated recipe fits its projections up front, block by block (each fit needs the
/// previous blocks' quantized outputs); the stream then holds the fitted projections, packed
/// (their indices on disk with a spill directory: [`Fitted`]), until their package takes them.
pub struct WeightStream<'a> {
    ckpt: &'a Checkpoint,
    slots: Vec<TensorSlot>,
    report: quant::Report,
    /// Calibrated projections, packed, by tensor name.
    fitted: Fitted,
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
    /// (`blocks(done, total)` after each decoder block). Nothing else is read yet. With
    /// `spill`, the fitted projections' indices wait in an unnamed file there.
    pub fn new(
        ckpt: &'a Checkpoint,
        recipe: &Recipe,
        calibration: &[u32],
        spill: Option<&Path>,
        blocks: &(dyn Fn(usize, usize) + Sync),
        progress: &'a (dyn Fn(&quant::TensorReport) + Sync),
    ) -> Result<Self, ConvertError> {
        let t = Instant::now();
        let mut report = quant::Report::plan(ckpt, recipe)?;
        let mut fitted = Fitted::default();
        let mut replaced = BTreeMap::new();
        let mut sink = |name: String, q: QuantizedLinear| {
            if let Some(line) = report.tensors.iter_mut().find(|l| l.name == name) {
                fitted_line(line, &q);
            }
            fitted.insert(spill, name, q.into())
        };
        if let Some(c) = calibrate(ckpt, recipe, calibration, blocks, &mut sink)? {
            if let (Some(target), false) = (
                recipe.calibration().and_then(|c| c.target_bpw),
                c.allocation.is_empty(),
            ) {
                report.mixed_precision = Some(quant::MixedPrecision::new(target, &c.allocation));
            }
            replaced = c.replaced;
            crate::fsutil::release_free_memory();
        }
        Ok(WeightStream {
            ckpt,
            slots: ckpt.package_slots(),
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
        if let Some(bytes) = self.fitted.bytes(&slot.name) {
            return bytes;
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
                !self.fitted.contains(name) && !self.replaced.contains_key(name)
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
        if let Some(w) = self.fitted.remove(name)? {
            return Ok((Weight::Quantized(w), true));
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

/// Calibrated projections, packed, until their package takes them. With a spill directory
/// their indices (all but a few bytes of each) wait in an unnamed file there, written as each
/// block is fitted: at 8B and 4 bits they are 3.5 GB, more than the rest of calibration holds
/// at its peak. The file is unlinked from the start, so nothing is left behind, even by a
/// killed run.
#[derive(Default)]
struct Fitted {
    /// Each projection, its bytes in weight.bin and, spilled, where each group's indices are
    /// in the file.
    weights: BTreeMap<String, (QuantizedWeight, u64, Vec<Span>)>,
    file: Option<(std::fs::File, PathBuf)>,
    end: u64,
}

impl Fitted {
    /// Keep `w`, its indices in a file in `spill` if given (the file is made on first use).
    fn insert(
        &mut self,
        spill: Option<&Path>,
        name: String,
        mut w: QuantizedWeight,
    ) -> Result<(), QuantError> {
        let bytes = quantized_bytes(&w);
        let mut spans = Vec::new();
        if let Some(dir) = spill {
            if self.file.is_none() {
                std::fs::create_dir_all(dir).map_err(|e| spill_err(dir, e))?;
                let file = tempfile::tempfile_in(dir).map_err(|e| spill_err(dir, e))?;
                self.file = Some((file, dir.to_path_buf()));
            }
            let (file, dir) = self.file.as_ref().expect("made above");
            for g in &mut w.groups {
                let packed = std::mem::take(&mut g.lut.packed);
                file.write_all_at(&packed, self.end)
                    .map_err(|e| spill_err(dir, e))?;
                spans.push((self.end, packed.len()));
                self.end += packed.len() as u64;
            }
        }
        self.weights.insert(name, (w, bytes, spans));
        Ok(())
    }

    fn contains(&self, name: &str) -> bool {
        self.weights.contains_key(name)
    }

    /// Bytes the projection takes in weight.bin.
    fn bytes(&self, name: &str) -> Option<u64> {
        self.weights.get(name).map(|(_, b, _)| *b)
    }

    /// The projection, whole (moved out: a projection is in one package).
    fn remove(&mut self, name: &str) -> Result<Option<QuantizedWeight>, ConvertError> {
        let Some((mut w, _, spans)) = self.weights.remove(name) else {
            return Ok(None);
        };
        if let Some((file, dir)) = &self.file {
            for (g, (at, len)) in w.groups.iter_mut().zip(spans) {
                let mut packed = vec![0u8; len];
                file.read_exact_at(&mut packed, at)
                    .map_err(|e| ConvertError::Quant(spill_err(dir, e)))?;
                g.lut.packed = packed;
            }
        }
        Ok(Some(w))
    }
}

/// Where a group's indices are in the spill file: offset, length.
type Span = (u64, usize);

/// A spill file's I/O error, naming its directory.
fn spill_err(dir: &Path, e: std::io::Error) -> QuantError {
    QuantError::Calibration {
        message: format!(
            "keeping the fitted projections in an unnamed file in {}: {e}",
            dir.display()
        ),
    }
}

/// Fit the recipe's calibrated projections, if it has any to fit, handing each to `sink` as
/// its block is done.
fn calibrate(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    calibration: &[u32],
    blocks: &(dyn Fn(usize, usize) + Sync),
    sink: quant::calibrate::Sink<'_>,
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
    let w = quant::calibrate::quantize_streaming(
        ckpt,
        calibration,
        &method_for,
        &options,
        blocks,
        Some(sink),
    )?;
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
        Weight::Quantized(q) => quantized_bytes(q),
    }
}

fn quantized_bytes(q: &QuantizedWeight) -> u64 {
    let luts: u64 = q.groups.iter().map(|g| g.lut.bytes()).sum();
    let scales = q.row_scale.as_ref().map_or(0, |s| s.len() as u64 * 2);
    let restore = q.restore.as_ref().map_or(0, |r| r.len() as u64 * 4);
    luts + scales + restore
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{pack_indices, LutRows, PackedLut};

    /// A spilled projection comes back whole, sized as it was, and the spill directory shows
    /// no file at any point.
    #[test]
    fn spilled_projections_come_back_whole() {
        let group = |rows: usize, nbits: u8, seed: u8| LutRows {
            rows,
            lut: PackedLut {
                nbits,
                lut: (0..1u16 << nbits)
                    .map(|i| f16::from_f32(i as f32))
                    .collect(),
                packed: pack_indices(
                    &(0..rows * 5)
                        .map(|i| (i as u8).wrapping_mul(seed) % (1 << nbits))
                        .collect::<Vec<_>>(),
                    nbits,
                ),
            },
        };
        let w = |seed: u8| QuantizedWeight {
            groups: vec![group(3, 4, seed), group(2, 6, seed + 1)],
            restore: Some(vec![0, 1, 2, 3, 4]),
            row_scale: Some(vec![f16::ONE; 5]),
            rotated: true,
        };
        let dir = tempfile::tempdir().unwrap();
        let spill = dir.path().join("out");
        for at in [None, Some(spill.as_path())] {
            let mut fitted = Fitted::default();
            for seed in [3, 7] {
                fitted.insert(at, format!("w{seed}"), w(seed)).unwrap();
            }
            if at.is_some() {
                assert_eq!(std::fs::read_dir(&spill).unwrap().count(), 0);
            }
            assert!(fitted.contains("w7") && !fitted.contains("w1"));
            assert_eq!(fitted.bytes("w3"), Some(quantized_bytes(&w(3))));
            assert_eq!(fitted.remove("w7").unwrap(), Some(w(7)));
            assert_eq!(fitted.remove("w3").unwrap(), Some(w(3)));
            assert_eq!(fitted.remove("w3").unwrap(), None);
        }
    }
}
