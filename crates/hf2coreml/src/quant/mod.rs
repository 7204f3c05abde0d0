//! Weight palettization: exact 1-D k-means LUTs ([`kmeans`]), index packing ([`pack`]),
//! recipes deciding what to palettize ([`recipe`]), calibrated palettization ([`calibrate`])
//! with its input rotation ([`rotation`]) and the per-tensor report ([`palette_report`]).
//!
//! Nothing here does file I/O or calls Python; [`palettize_checkpoint`] reads tensors through
//! the memory-mapped [`Checkpoint`] one at a time per worker.

pub mod calibrate;
mod granularity;
pub mod palette_report;
mod quant_error;
pub mod recipe;
pub mod rotation;
pub mod weight;

// The solver, the packing and the linear algebra are the numerics crate's (opt-level 3).
pub use hf2coreml_numerics::{kmeans, linalg, pack, NumericsError};

use half::f16;
use rayon::prelude::*;

use crate::arch::TensorSlot;
use crate::checkpoint::Checkpoint;

pub use granularity::Granularity;
pub use kmeans::{nbits_list, palettize_f16, LutFit, IOS17_NBITS, SUPPORTED_NBITS};
pub use pack::{pack_indices, packed_len, try_unpack_indices, unpack_indices};
pub use palette_report::{MixedPrecision, Report, TensorReport, Totals};
pub use quant_error::QuantError;
pub use recipe::{Decision, Recipe, RecipeError, Storage};
pub use weight::{GroupedLut, LutRows, PackedLut, QuantizedWeight};

/// A palettized tensor as a package stores it: packed indices in element order plus one LUT
/// per group (exactly one for [`Granularity::PerTensor`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PalettizedTensor {
    pub shape: Vec<usize>,
    pub nbits: u8,
    pub granularity: Granularity,
    /// Each sorted, `2^nbits` entries; group g covers channels `g·group_size ..` along the axis.
    pub luts: Vec<Vec<f16>>,
    /// LSB-first packed indices, `ceil(numel·nbits/8)` bytes (see [`pack`]).
    pub packed_indices: Vec<u8>,
    /// Per-element MSE of the stored tensor against the f16 source.
    pub mse: f64,
    pub snr_db: f64,
}

impl PalettizedTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The single LUT of a per-tensor palettization (the first group's otherwise).
    pub fn lut(&self) -> &[f16] {
        self.luts.first().map_or(&[], |l| l.as_slice())
    }

    /// The stored form: one LUT, or one per group of output channels (rows, axis 0: row
    /// groups in order, which an iOS18 package stores as one grouped LUT); `None` for groups
    /// along another axis.
    pub fn into_weight(self) -> Option<QuantizedWeight> {
        let rows = self.shape.first().copied().unwrap_or(1);
        let group_rows = match self.granularity {
            Granularity::PerTensor if self.luts.len() == 1 => rows,
            Granularity::PerGroupedChannel {
                group_size,
                axis: 0,
            } if group_size > 0 && rows % group_size == 0 => group_size,
            _ => return None,
        };
        if self.luts.len() * group_rows != rows {
            return None;
        }
        let nbits = self.nbits;
        let group = |lut, packed| LutRows {
            rows: group_rows,
            lut: PackedLut { nbits, lut, packed },
        };
        let per_group = self.numel() / self.luts.len().max(1);
        let groups = if self.luts.len() == 1 {
            // One table: the packed indices are already the stored form (no copy: unpacking a
            // projection's indices costs a byte per weight, and a conversion holds many).
            let lut = self.luts.into_iter().next().unwrap_or_default();
            vec![group(lut, self.packed_indices)]
        } else if (per_group * nbits as usize).is_multiple_of(8) {
            // Each group starts on a byte: its packed indices are a byte range.
            let step = (per_group * nbits as usize / 8).max(1);
            self.luts
                .into_iter()
                .zip(self.packed_indices.chunks(step))
                .map(|(lut, bytes)| group(lut, bytes.to_vec()))
                .collect()
        } else {
            let idx = self.indices();
            self.luts
                .into_iter()
                .zip(idx.chunks(per_group.max(1)))
                .map(|(lut, chunk)| group(lut, pack_indices(chunk, nbits)))
                .collect()
        };
        Some(QuantizedWeight {
            groups,
            restore: None,
            row_scale: None,
            rotated: false,
        })
    }

    /// Unpacked indices, one per element.
    pub fn indices(&self) -> Vec<u8> {
        unpack_indices(&self.packed_indices, self.nbits, self.numel())
    }

    /// The stored tensor: each element looked up in its group's LUT.
    pub fn dequantize(&self) -> Vec<f16> {
        let idx = self.indices();
        match self.granularity {
            Granularity::PerTensor => idx.iter().map(|&i| self.luts[0][i as usize]).collect(),
            Granularity::PerGroupedChannel { group_size, axis } => {
                let (channels, inner) = channel_layout(&self.shape, axis);
                idx.iter()
                    .enumerate()
                    .map(|(e, &i)| {
                        let g = ((e / inner) % channels) / group_size;
                        self.luts[g][i as usize]
                    })
                    .collect()
            }
        }
    }
}

/// (channels along `axis`, elements per channel step) for row-major `shape`.
fn channel_layout(shape: &[usize], axis: usize) -> (usize, usize) {
    let channels = shape.get(axis).copied().unwrap_or(1).max(1);
    let inner = shape.get(axis + 1..).map_or(1, |s| s.iter().product());
    (channels, inner.max(1))
}

/// Palettize one tensor of `shape` (row-major `values`) at `nbits` and `granularity`.
pub fn palettize_tensor(
    values: &[f16],
    shape: &[usize],
    nbits: u8,
    granularity: Granularity,
    weights: Option<&[f32]>,
) -> Result<PalettizedTensor, QuantError> {
    let numel: usize = shape.iter().product();
    if numel != values.len() {
        return Err(QuantError::Granularity {
            granularity: granularity.to_string(),
            shape: shape.to_vec(),
            message: format!("{} values for {numel} elements", values.len()),
        });
    }
    match granularity {
        Granularity::PerTensor => {
            let p = palettize_f16(values, nbits, weights)?;
            Ok(PalettizedTensor {
                shape: shape.to_vec(),
                nbits,
                granularity,
                packed_indices: pack_indices(&p.indices, nbits),
                luts: vec![p.lut],
                mse: p.mse,
                snr_db: p.snr_db,
            })
        }
        Granularity::PerGroupedChannel { group_size, axis } => {
            let bad = |message: String| QuantError::Granularity {
                granularity: granularity.to_string(),
                shape: shape.to_vec(),
                message,
            };
            let Some(&channels) = shape.get(axis) else {
                return Err(bad(format!("the tensor has no axis {axis}")));
            };
            if group_size == 0 || channels % group_size != 0 {
                return Err(bad(format!(
                    "{channels} channels are not a multiple of group_size {group_size}"
                )));
            }
            let (channels, inner) = channel_layout(shape, axis);
            let groups = channels / group_size;
            let group_of = |e: usize| ((e / inner) % channels) / group_size;
            // Gather each group's elements (contiguous for axis 0, strided otherwise).
            let mut members: Vec<Vec<usize>> = vec![Vec::new(); groups];
            for e in 0..numel {
                members[group_of(e)].push(e);
            }
            let fitted: Vec<LutFit> = members
                .par_iter()
                .map(|m| {
                    let v: Vec<f16> = m.iter().map(|&e| values[e]).collect();
                    let w: Option<Vec<f32>> = weights.map(|w| m.iter().map(|&e| w[e]).collect());
                    palettize_f16(&v, nbits, w.as_deref())
                })
                .collect::<Result<_, _>>()?;
            let mut indices = vec![0u8; numel];
            let mut err = 0.0f64;
            for (m, p) in members.iter().zip(&fitted) {
                for (&e, &i) in m.iter().zip(&p.indices) {
                    indices[e] = i;
                }
                err += p.mse * m.len() as f64;
            }
            let sig: f64 = values.iter().map(|v| v.to_f64() * v.to_f64()).sum();
            Ok(PalettizedTensor {
                shape: shape.to_vec(),
                nbits,
                granularity,
                packed_indices: pack_indices(&indices, nbits),
                luts: fitted.into_iter().map(|p| p.lut).collect(),
                mse: err / numel.max(1) as f64,
                snr_db: kmeans::snr_db(sig, err),
            })
        }
    }
}

/// One tensor of the checkpoint after [`palettize_checkpoint`].
#[derive(Debug, Clone)]
pub struct TensorOutcome {
    pub slot: TensorSlot,
    pub decision: Decision,
    /// `None` for fp16 tensors: callers read those straight from the checkpoint.
    pub palettized: Option<PalettizedTensor>,
}

/// Everything [`palettize_checkpoint`] produced, in model order.
#[derive(Debug, Clone)]
pub struct PalettizeOutput {
    pub tensors: Vec<TensorOutcome>,
    pub report: Report,
}

/// Per-tensor importance weights (calibrated palettization): given a slot, per-element weights or `None`.
pub type Importance<'a> = &'a (dyn Fn(&TensorSlot) -> Option<Vec<f32>> + Sync);

/// Palettize every tensor `recipe` selects, in parallel across tensors (largest first, for
/// balance). Each worker reads its tensor from the mmap only when its turn comes, so peak
/// memory is about one working tensor per thread plus the packed outputs. `progress` is called
/// from worker threads as each palettized tensor finishes.
pub fn palettize_checkpoint(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    progress: &(dyn Fn(&TensorReport) + Sync),
) -> Result<PalettizeOutput, QuantError> {
    palettize_checkpoint_with(ckpt, recipe, &|_| None, progress)
}

/// [`palettize_checkpoint`] with importance weights per tensor.
pub fn palettize_checkpoint_with(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    importance: Importance<'_>,
    progress: &(dyn Fn(&TensorReport) + Sync),
) -> Result<PalettizeOutput, QuantError> {
    palettize_inner(ckpt, recipe, importance, &Default::default(), progress)
}

/// [`palettize_checkpoint`] leaving the tensors named in `skip` unpalettized (`palettized:
/// None`, decision as planned): the caller palettizes those itself (calibrated projections).
pub fn palettize_checkpoint_skipping(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    skip: &std::collections::HashSet<String>,
    progress: &(dyn Fn(&TensorReport) + Sync),
) -> Result<PalettizeOutput, QuantError> {
    palettize_inner(ckpt, recipe, &|_| None, skip, progress)
}

fn palettize_inner(
    ckpt: &Checkpoint,
    recipe: &Recipe,
    importance: Importance<'_>,
    skip: &std::collections::HashSet<String>,
    progress: &(dyn Fn(&TensorReport) + Sync),
) -> Result<PalettizeOutput, QuantError> {
    let plan = Report::plan(ckpt, recipe)?;
    let slots = ckpt.package_slots();
    let order: Vec<usize> = (0..slots.len())
        .filter(|&i| !skip.contains(&slots[i].name))
        .collect();
    let done = palettize_slots(ckpt, &slots, &plan, &order, importance, progress)?;
    let mut palettized: Vec<Option<PalettizedTensor>> = vec![None; slots.len()];
    for (i, p) in done {
        palettized[i] = Some(p);
    }
    let mut report = plan;
    for (line, p) in report.tensors.iter_mut().zip(&palettized) {
        if let Some(p) = p {
            line.mse = Some(p.mse);
            line.snr_db = Some(p.snr_db);
        }
    }
    report.recompute_totals();
    let tensors = slots
        .into_iter()
        .zip(palettized)
        .zip(&report.tensors)
        .map(|((slot, palettized), line)| TensorOutcome {
            decision: line.decision,
            slot,
            palettized,
        })
        .collect();
    Ok(PalettizeOutput { tensors, report })
}

/// Palettize the slots at `indices` (into `slots` and `plan.tensors`) that `plan` palettizes,
/// in parallel across tensors, largest first; the others are left out. Each worker reads its
/// tensor from the mmap only when its turn comes. The streaming convert calls this once per
/// package with that package's tensors (docs/design.md, "Streaming convert").
pub fn palettize_slots(
    ckpt: &Checkpoint,
    slots: &[TensorSlot],
    plan: &Report,
    indices: &[usize],
    importance: Importance<'_>,
    progress: &(dyn Fn(&TensorReport) + Sync),
) -> Result<Vec<(usize, PalettizedTensor)>, QuantError> {
    let mut order: Vec<usize> = indices
        .iter()
        .copied()
        .filter(|&i| matches!(plan.tensors[i].decision, Decision::Palettize { .. }))
        .collect();
    order.sort_by_key(|&i| std::cmp::Reverse(slots[i].numel()));
    order
        .par_iter()
        .map(|&i| {
            let slot = &slots[i];
            let Decision::Palettize { nbits, granularity } = plan.tensors[i].decision else {
                unreachable!("filtered to palettize decisions above")
            };
            let view = ckpt.tensor(&slot.name)?;
            let values = view.to_f16();
            let weights = importance(slot);
            let p = palettize_tensor(&values, &slot.shape, nbits, granularity, weights.as_deref())
                .map_err(|e| e.in_tensor(&slot.name))?;
            drop(values);
            let mut line = plan.tensors[i].clone();
            line.mse = Some(p.mse);
            line.snr_db = Some(p.snr_db);
            progress(&line);
            Ok((i, p))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::SplitMix64;

    fn random(n: usize, seed: u64) -> Vec<f16> {
        let mut r = SplitMix64(seed);
        (0..n).map(|_| f16::from_f32(r.normal() * 0.05)).collect()
    }

    #[test]
    fn grouped_matches_separate_per_group_fits() {
        let shape = [8, 6];
        let v = random(48, 3);
        for axis in [0, 1] {
            let g = Granularity::PerGroupedChannel {
                group_size: 2,
                axis,
            };
            let t = palettize_tensor(&v, &shape, 2, g, None).unwrap();
            assert_eq!(t.luts.len(), shape[axis] / 2);
            let deq = t.dequantize();
            // every element is reproduced by its own group's LUT, at least as well as per-tensor
            let per = palettize_tensor(&v, &shape, 2, Granularity::PerTensor, None).unwrap();
            assert!(t.mse <= per.mse);
            let mse: f64 = v
                .iter()
                .zip(&deq)
                .map(|(a, b)| (a.to_f64() - b.to_f64()).powi(2))
                .sum::<f64>()
                / 48.0;
            assert!((mse - t.mse).abs() <= 1e-12 * mse.max(1e-30));
        }
        let g = Granularity::PerGroupedChannel {
            group_size: 3,
            axis: 0,
        };
        assert!(palettize_tensor(&v, &shape, 2, g, None).is_err());
    }

    #[test]
    fn grouped_rows_are_stored_as_row_groups() {
        let v = random(48, 5);
        let g = Granularity::PerGroupedChannel {
            group_size: 2,
            axis: 0,
        };
        let t = palettize_tensor(&v, &[8, 6], 2, g, None).unwrap();
        let deq = t.dequantize();
        let w = t.into_weight().unwrap();
        assert_eq!(w.groups.len(), 4);
        let gl = w.grouped_lut(6).unwrap();
        let stored: Vec<f16> = gl
            .indices(48)
            .iter()
            .enumerate()
            .map(|(e, &i)| gl.luts[(e / 12) * 4 + i as usize])
            .collect();
        assert_eq!(stored, deq);
        let g = Granularity::PerGroupedChannel {
            group_size: 2,
            axis: 1,
        };
        let t = palettize_tensor(&v, &[8, 6], 2, g, None).unwrap();
        assert!(t.into_weight().is_none(), "groups along the input axis");
    }

    #[test]
    fn row_groups_off_byte_boundaries_and_one_table_store_the_same_values() {
        // 2 rows of 5 at 2 bits: each group's indices end mid-byte (repacked), 2 rows of 4:
        // on a byte (sliced), one table: moved as is.
        for (shape, group_size) in [([8, 5], 2), ([8, 4], 2), ([8, 5], 8)] {
            let numel = shape[0] * shape[1];
            let v = random(numel, 7);
            let g = if group_size == shape[0] {
                Granularity::PerTensor
            } else {
                Granularity::PerGroupedChannel {
                    group_size,
                    axis: 0,
                }
            };
            let t = palettize_tensor(&v, &shape, 2, g, None).unwrap();
            let deq = t.dequantize();
            let w = t.into_weight().unwrap();
            assert_eq!(w.groups.len(), shape[0] / group_size);
            let stored: Vec<f16> = w
                .groups
                .iter()
                .flat_map(|r| {
                    r.lut
                        .indices(r.rows * shape[1])
                        .into_iter()
                        .map(|i| r.lut.lut[i as usize])
                })
                .collect();
            assert_eq!(stored, deq, "{shape:?} in groups of {group_size}");
        }
    }

    #[test]
    fn length_mismatch_is_an_error() {
        assert!(palettize_tensor(&random(5, 1), &[2, 3], 4, Granularity::PerTensor, None).is_err());
    }
}
