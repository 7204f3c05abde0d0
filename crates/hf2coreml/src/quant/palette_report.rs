//! The palettization report: one line per tensor, then totals (llama.cpp's quantize report is
//! the model). Built as a plan first (decisions and sizes, no k-means: what `convert --dry-run`
//! prints) and filled with MSE/SNR as tensors finish.

use serde::Serialize;

use super::{Decision, QuantError, Recipe};
use crate::arch::{Role, TensorSlot};
use crate::checkpoint::Checkpoint;
use crate::util::fmt_bytes;

/// One tensor's line.
#[derive(Debug, Clone, Serialize)]
pub struct TensorReport {
    /// 1-based position in model order.
    pub index: usize,
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    /// `fp16`, `lut4`, ... (see [`Decision`]'s Display).
    #[serde(serialize_with = "display")]
    pub decision: Decision,
    pub nbits: Option<u8>,
    /// Bytes in the checkpoint (its own dtype).
    pub bytes_before: u64,
    /// Bytes in the package's weight.bin (indices + LUTs, or fp16).
    pub bytes_after: u64,
    /// Per-element MSE against the f16 source; `None` until palettized, and for fp16 tensors.
    pub mse: Option<f64>,
    /// `None` as for `mse`; JSON `null` also stands for +inf (an exact reconstruction).
    pub snr_db: Option<f64>,
}

fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

fn display<S: serde::Serializer>(d: &Decision, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

/// Totals over all tensors.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    pub tensors: usize,
    pub palettized_tensors: usize,
    pub parameters: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// bytes_after · 8 / parameters.
    pub bits_per_weight: f64,
    /// Mean SNR over palettized tensors with a finite SNR (exact ones would make it +inf).
    pub mean_snr_db: Option<f64>,
    pub min_snr_db: Option<f64>,
    pub min_snr_tensor: Option<String>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The recipe's origin (file path or the built-in default).
    pub recipe: String,
    pub tensors: Vec<TensorReport>,
    pub totals: Totals,
    /// What `--target-bpw` chose and why (mixed precision only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<MixedPrecision>,
}

/// The mixed-precision allocation behind `--target-bpw`: every palettized projection's
/// measured sensitivity at each candidate width, and the widths its rows got. Bits go greedily
/// to the upgrade (a chunk of a projection's rows, or a whole projection) that removes the
/// most error per extra stored bit until the budget is spent.
#[derive(Debug, Clone, Serialize)]
pub struct MixedPrecision {
    pub target_bpw: f64,
    /// Bits per weight spent over the allocated projections (LUTs and row scales counted).
    pub achieved_bpw: f64,
    /// Projections by the width of their widest rows.
    pub count_by_nbits: std::collections::BTreeMap<u8, usize>,
    /// Rows of all allocated projections at each width.
    pub rows_by_nbits: std::collections::BTreeMap<u8, usize>,
    /// Every allocated projection, the most sensitive (largest error at 4 bits) first.
    pub tensors: Vec<super::calibrate::BitChoice>,
}

impl MixedPrecision {
    pub fn new(target_bpw: f64, choices: &[super::calibrate::BitChoice]) -> Self {
        let (bits, numel) = choices
            .iter()
            .fold((0.0, 0.0), |(b, n), c| (b + c.spent, n + c.numel as f64));
        let mut count_by_nbits = std::collections::BTreeMap::new();
        let mut rows_by_nbits = std::collections::BTreeMap::new();
        for c in choices {
            *count_by_nbits.entry(c.nbits).or_insert(0) += 1;
            for (&nbits, &rows) in super::calibrate::MIXED_NBITS.iter().zip(&c.rows) {
                *rows_by_nbits.entry(nbits).or_insert(0) += rows;
            }
        }
        let mut tensors = choices.to_vec();
        tensors.sort_by(|a, b| b.error[0].total_cmp(&a.error[0]));
        MixedPrecision {
            target_bpw,
            achieved_bpw: if numel > 0.0 { bits / numel } else { 0.0 },
            count_by_nbits,
            rows_by_nbits,
            tensors,
        }
    }

    /// A few lines: widths chosen, bits spent, and the most sensitive projections.
    pub fn to_text(&self) -> String {
        let rows: Vec<String> = self
            .rows_by_nbits
            .iter()
            .map(|(b, n)| format!("{n} at {b} bits"))
            .collect();
        let mixed = self.tensors.iter().filter(|c| c.nbits > 4).count();
        let mut s = format!(
            "mixed precision: target {:.2} bits/weight, spent {:.2}: rows {} ({} of {} \
             projections have rows above 4 bits)\n",
            self.target_bpw,
            self.achieved_bpw,
            rows.join(", "),
            mixed,
            self.tensors.len()
        );
        s.push_str(
            "  most sensitive (block-output error at 4 / 6 / 8 bits → rows at 4 / 6 / 8 bits):\n",
        );
        for c in self.tensors.iter().take(8) {
            s.push_str(&format!(
                "    {:<44} {:.2e} / {:.2e} / {:.2e} → {} / {} / {}\n",
                c.tensor, c.error[0], c.error[1], c.error[2], c.rows[0], c.rows[1], c.rows[2]
            ));
        }
        s
    }
}

impl Report {
    /// Decisions and sizes for every tensor of the checkpoint, without palettizing.
    pub fn plan(ckpt: &Checkpoint, recipe: &Recipe) -> Result<Self, QuantError> {
        let slots = ckpt.package_slots();
        let mut tensors = Vec::with_capacity(slots.len());
        for (i, slot) in slots.iter().enumerate() {
            let dtype = ckpt.tensor(&slot.name)?.dtype;
            tensors.push(Self::line(i + 1, slot, recipe, dtype.size_bytes() as u64));
        }
        let mut r = Report {
            recipe: recipe.origin().to_string(),
            tensors,
            totals: Totals::default(),
            mixed_precision: None,
        };
        r.recompute_totals();
        Ok(r)
    }

    /// A plan from slots alone (no checkpoint), with `source_bytes_per_element` for "before".
    pub fn plan_slots(
        slots: &[TensorSlot],
        recipe: &Recipe,
        source_bytes_per_element: u64,
    ) -> Self {
        let tensors = slots
            .iter()
            .enumerate()
            .map(|(i, s)| Self::line(i + 1, s, recipe, source_bytes_per_element))
            .collect();
        let mut r = Report {
            recipe: recipe.origin().to_string(),
            tensors,
            totals: Totals::default(),
            mixed_precision: None,
        };
        r.recompute_totals();
        r
    }

    fn line(index: usize, slot: &TensorSlot, recipe: &Recipe, elem_bytes: u64) -> TensorReport {
        let decision = recipe.decide(slot);
        TensorReport {
            index,
            name: slot.name.clone(),
            shape: slot.shape.clone(),
            role: slot.role,
            decision,
            nbits: decision.nbits(),
            bytes_before: slot.numel() as u64 * elem_bytes,
            bytes_after: decision.storage(&slot.shape).bytes(slot.numel()),
            mse: None,
            snr_db: None,
        }
    }

    /// Recompute [`Totals`] from the lines.
    pub fn recompute_totals(&mut self) {
        let t = &self.tensors;
        let parameters: u64 = t
            .iter()
            .map(|l| l.shape.iter().product::<usize>() as u64)
            .sum();
        let bytes_after: u64 = t.iter().map(|l| l.bytes_after).sum();
        let snrs: Vec<(&str, f64)> = t
            .iter()
            .filter_map(|l| l.snr_db.map(|s| (l.name.as_str(), s)))
            .collect();
        let finite: Vec<f64> = snrs.iter().map(|s| s.1).filter(|s| s.is_finite()).collect();
        let min = snrs.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1));
        self.totals = Totals {
            tensors: t.len(),
            palettized_tensors: t.iter().filter(|l| l.nbits.is_some()).count(),
            parameters,
            bytes_before: t.iter().map(|l| l.bytes_before).sum(),
            bytes_after,
            bits_per_weight: if parameters == 0 {
                0.0
            } else {
                bytes_after as f64 * 8.0 / parameters as f64
            },
            mean_snr_db: (!finite.is_empty())
                .then(|| finite.iter().sum::<f64>() / finite.len() as f64),
            min_snr_db: min.map(|m| m.1),
            min_snr_tensor: min.map(|m| m.0.to_string()),
        };
    }

    /// `[i/N] name [shape] decision  before → after  SNR dB`, columns aligned across the report.
    pub fn format_line(&self, l: &TensorReport) -> String {
        let name_w = self.tensors.iter().map(|t| t.name.len()).max().unwrap_or(0);
        let shape_w = self
            .tensors
            .iter()
            .map(|t| shape_str(&t.shape).len())
            .max()
            .unwrap_or(0);
        let snr = match l.snr_db {
            Some(s) if s.is_finite() => format!("  SNR {s:6.2} dB"),
            Some(_) => "  SNR    inf dB".to_string(),
            None => String::new(),
        };
        let width = self.tensors.len().to_string().len();
        format!(
            "[{:>width$}/{}] {:<name_w$} {:<shape_w$} {:<5} {:>10} → {:>10}{}",
            l.index,
            self.tensors.len(),
            l.name,
            shape_str(&l.shape),
            l.decision.to_string(),
            fmt_bytes(l.bytes_before),
            fmt_bytes(l.bytes_after),
            snr
        )
    }

    /// The totals block.
    pub fn format_totals(&self) -> String {
        let t = &self.totals;
        let mut s = format!(
            "{} tensors ({} palettized), {} parameters\nsize: {} → {} ({:.3} bits per weight, {:.2}× smaller)",
            t.tensors,
            t.palettized_tensors,
            crate::util::fmt_count(t.parameters),
            fmt_bytes(t.bytes_before),
            fmt_bytes(t.bytes_after),
            t.bits_per_weight,
            if t.bytes_after == 0 {
                1.0
            } else {
                t.bytes_before as f64 / t.bytes_after as f64
            }
        );
        if let (Some(min), Some(name)) = (t.min_snr_db, &t.min_snr_tensor) {
            let mean = t
                .mean_snr_db
                .map_or("inf".to_string(), |m| format!("{m:.2}"));
            s.push_str(&format!(
                "\nSNR: mean {mean} dB, min {} dB ({name})",
                if min.is_finite() {
                    format!("{min:.2}")
                } else {
                    "inf".into()
                }
            ));
        }
        s
    }

    /// Every line, then the totals.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for l in &self.tensors {
            s.push_str(&self.format_line(l));
            s.push('\n');
        }
        s.push_str(&self.format_totals());
        s.push('\n');
        if let Some(m) = &self.mixed_precision {
            s.push_str(&m.to_text());
        }
        s
    }
}
