//! The one form a quantized weight takes on its way into a package: [`QuantizedWeight`], row
//! groups of packed LUT indices ([`PackedLut`], one iOS17 `constexpr_lut_to_dense` each), plus
//! what a calibrated projection adds (a row order, per-row scales, a rotated input). The graph
//! builder consumes it as it is.

use half::f16;

use super::calibrate::QuantizedLinear;
use super::{nbits_list, pack_indices, SUPPORTED_NBITS};

/// Indices into one LUT, packed: `out = lut[indices]` (iOS17 `constexpr_lut_to_dense`).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedLut {
    pub nbits: u8,
    /// 2^nbits entries.
    pub lut: Vec<f16>,
    /// Indices packed LSB-first, ceil(nbits × numel / 8) bytes
    /// (docs/reference/mlpackage-format.md, "weight.bin").
    pub packed: Vec<u8>,
}

impl PackedLut {
    /// Multiply every LUT entry by `scale` (rounded to fp16). k-means is scale-equivariant:
    /// scaling a LUT equals palettizing the scaled tensor.
    pub fn scale(&mut self, scale: f64) {
        if scale != 1.0 {
            for x in &mut self.lut {
                *x = f16::from_f64(x.to_f64() * scale);
            }
        }
    }

    /// The `numel` indices, unpacked (the graph checked the packed length).
    pub fn indices(&self, numel: usize) -> Vec<u8> {
        super::unpack_indices(&self.packed, self.nbits, numel)
    }

    /// Bytes stored: packed indices plus the fp16 LUT.
    pub fn bytes(&self) -> u64 {
        self.packed.len() as u64 + 2 * self.lut.len() as u64
    }

    /// Why this cannot hold `numel` elements, if it cannot: an unsupported width, a LUT of the
    /// wrong size or the wrong number of packed bytes.
    pub fn check(&self, numel: usize) -> Result<(), String> {
        if !SUPPORTED_NBITS.contains(&self.nbits) {
            return Err(format!(
                "LUTs take {} bits, not {}",
                nbits_list(),
                self.nbits
            ));
        }
        if self.lut.len() != 1usize << self.nbits {
            return Err(format!(
                "LUT has {} entries, {} bits need {}",
                self.lut.len(),
                self.nbits,
                1usize << self.nbits
            ));
        }
        let bytes = (numel * self.nbits as usize).div_ceil(8);
        if self.packed.len() != bytes {
            return Err(format!(
                "{} packed index bytes, {} elements at {} bits need {bytes}",
                self.packed.len(),
                numel,
                self.nbits
            ));
        }
        Ok(())
    }
}

/// iOS18: a weight of `rows` rows whose consecutive runs of `group_rows` rows each have their
/// own LUT, in one `constexpr_lut_to_dense` (LUT shape `[rows / group_rows, 1, 2^nbits, 1]`),
/// then an optional per-row scale applied to the dense weight by a
/// `constexpr_blockwise_shift_scale` (scale shape `[rows, 1]`): nothing runs per step.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupedLut {
    pub nbits: u8,
    pub group_rows: usize,
    /// The groups' tables one after another, `2^nbits` entries each.
    pub luts: Vec<f16>,
    /// All indices in row-major order, packed LSB-first as [`PackedLut::packed`].
    pub packed: Vec<u8>,
    pub row_scale: Option<Vec<f16>>,
}

impl GroupedLut {
    /// The `numel` indices, unpacked (the graph checked the packed length).
    pub fn indices(&self, numel: usize) -> Vec<u8> {
        super::unpack_indices(&self.packed, self.nbits, numel)
    }

    /// Number of tables.
    pub fn groups(&self) -> usize {
        self.luts.len() >> self.nbits
    }

    /// Bytes stored: packed indices, the fp16 tables and the fp16 scales.
    pub fn bytes(&self) -> u64 {
        self.packed.len() as u64
            + 2 * self.luts.len() as u64
            + 2 * self.row_scale.as_ref().map_or(0, |s| s.len()) as u64
    }

    /// Why this cannot be a `shape` weight, if it cannot.
    pub fn check(&self, shape: &[usize]) -> Result<(), String> {
        let numel: usize = shape.iter().product();
        let rows = shape.first().copied().unwrap_or(1);
        let lut = PackedLut {
            nbits: self.nbits,
            lut: vec![f16::ZERO; 1 << self.nbits.min(8)],
            packed: self.packed.clone(),
        };
        lut.check(numel)?;
        if self.group_rows == 0
            || !self.luts.len().is_multiple_of(1 << self.nbits)
            || self.groups() * self.group_rows != rows
        {
            return Err(format!(
                "{} LUT entries in groups of {} rows do not cover {rows} rows at {} bits",
                self.luts.len(),
                self.group_rows,
                self.nbits
            ));
        }
        match &self.row_scale {
            Some(s) if s.len() != rows => Err(format!("{} row scales for {rows} rows", s.len())),
            _ => Ok(()),
        }
    }

    /// Multiply every value by `scale` (the LUTs; k-means is scale-equivariant).
    pub fn scale(&mut self, scale: f64) {
        if scale != 1.0 {
            for x in &mut self.luts {
                *x = f16::from_f64(x.to_f64() * scale);
            }
        }
    }
}

/// Consecutive stored rows sharing one LUT.
#[derive(Debug, Clone, PartialEq)]
pub struct LutRows {
    pub rows: usize,
    pub lut: PackedLut,
}

/// A quantized weight as a package stores it: row groups each palettized with its own LUT and
/// bit width (one `constexpr_lut_to_dense` + `linear` per group, outputs concatenated, then a
/// `gather` back to row order if the groups are not contiguous runs in order), then an
/// optional fp16 per-row scale applied with one `mul` (before the bias, if any). A plain
/// palettized tensor is one group and nothing else.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedWeight {
    /// In stored order; their rows sum to the tensor's rows.
    pub groups: Vec<LutRows>,
    /// With groups that are not contiguous runs in row order: for each row, its position in
    /// the groups' concatenated outputs (a `gather` along the last axis restores row order).
    pub restore: Option<Vec<u32>>,
    pub row_scale: Option<Vec<f16>>,
    /// The stored weight is W·Q for the input rotation Q of its width
    /// ([`crate::quant::rotation::Rotation`]): the input is rotated (x·Q) first.
    pub rotated: bool,
}

impl QuantizedWeight {
    /// A tensor of `rows` rows palettized with one LUT.
    pub fn per_tensor(rows: usize, lut: PackedLut) -> Self {
        QuantizedWeight {
            groups: vec![LutRows { rows, lut }],
            restore: None,
            row_scale: None,
            rotated: false,
        }
    }

    /// The iOS18 single-op form of this weight, when it has one: groups of equal size and
    /// width in row order (no row permutation), `cols` columns each. The row scale moves
    /// into the constant; an input rotation stays with the caller.
    pub fn grouped_lut(&self, cols: usize) -> Option<GroupedLut> {
        let first = self.groups.first()?;
        let (nbits, group_rows) = (first.lut.nbits, first.rows);
        let uniform = self
            .groups
            .iter()
            .all(|g| g.lut.nbits == nbits && g.rows == group_rows);
        if !uniform || self.restore.is_some() || group_rows == 0 {
            return None;
        }
        let mut idx = Vec::with_capacity(self.rows() * cols);
        let mut luts = Vec::with_capacity(self.groups.len() << nbits);
        for g in &self.groups {
            idx.extend(super::try_unpack_indices(&g.lut.packed, nbits, g.rows * cols).ok()?);
            luts.extend_from_slice(&g.lut.lut);
        }
        Some(GroupedLut {
            nbits,
            group_rows,
            luts,
            packed: pack_indices(&idx, nbits),
            row_scale: self.row_scale.clone(),
        })
    }

    /// Rows over all groups.
    pub fn rows(&self) -> usize {
        self.groups.iter().map(|g| g.rows).sum()
    }

    /// One LUT over the whole tensor and nothing applied after it.
    pub fn is_plain(&self) -> bool {
        self.groups.len() == 1
            && self.restore.is_none()
            && self.row_scale.is_none()
            && !self.rotated
    }

    /// How the report names this storage: `lut4`, `lut4x2` (two LUTs), `lut4/6` (rows at 4 and
    /// 6 bits), with `+row_scale` when rows are scaled.
    pub fn label(&self) -> String {
        let mut widths: Vec<u8> = self.groups.iter().map(|g| g.lut.nbits).collect();
        widths.dedup();
        let nbits = widths
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join("/");
        let groups = if self.groups.len() > widths.len() {
            format!("x{}", self.groups.len())
        } else {
            String::new()
        };
        let scale = if self.row_scale.is_some() {
            "+row_scale"
        } else {
            ""
        };
        format!("lut{nbits}{groups}{scale}")
    }
}

impl From<QuantizedLinear> for QuantizedWeight {
    /// A calibrated projection as a package stores it. The row scales' geometric mean (a power
    /// of two, so nothing rounds) moves into the LUTs: the linear's output before the `mul`
    /// then has the magnitude of the float layer's output, which keeps it inside fp16's range.
    fn from(q: QuantizedLinear) -> Self {
        let shift = q.row_scale.as_ref().map_or(0, |s| {
            let n = s.len().max(1) as f64;
            let log2 = s
                .iter()
                .map(|v| (v.to_f64().max(1e-30)).log2())
                .sum::<f64>()
                / n;
            log2.round() as i32
        });
        let c = 2f64.powi(shift);
        // Where each row lands when the groups' outputs are concatenated, if not in place.
        let stored: Vec<usize> = q
            .groups
            .iter()
            .flat_map(|g| g.rows.iter().copied())
            .collect();
        let groups = q
            .groups
            .into_iter()
            .map(|g| LutRows {
                rows: g.rows.len(),
                lut: PackedLut {
                    nbits: g.nbits,
                    lut: g
                        .lut
                        .iter()
                        .map(|v| f16::from_f64(v.to_f64() * c))
                        .collect(),
                    packed: g.packed,
                },
            })
            .collect();
        let restore = (stored.iter().enumerate().any(|(i, &r)| i != r)).then(|| {
            let mut at = vec![0u32; q.rows];
            for (i, &r) in stored.iter().enumerate() {
                at[r] = i as u32;
            }
            at
        });
        let row_scale = q
            .row_scale
            .map(|s| s.iter().map(|v| f16::from_f64(v.to_f64() / c)).collect());
        QuantizedWeight {
            groups,
            restore,
            row_scale,
            rotated: q.rotated,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_row_groups_become_one_grouped_lut() {
        let idx = [0u8, 1, 2, 3, 0, 1, 3, 2, 1, 0, 3, 2];
        let group = |rows: std::ops::Range<usize>, base: f32| LutRows {
            rows: 2,
            lut: PackedLut {
                nbits: 2,
                lut: (0..4).map(|i| f16::from_f32(base + i as f32)).collect(),
                packed: pack_indices(&idx[rows.start * 3..rows.end * 3], 2),
            },
        };
        let w = QuantizedWeight {
            groups: vec![group(0..2, 0.0), group(2..4, 10.0)],
            restore: None,
            row_scale: Some(vec![f16::ONE; 4]),
            rotated: false,
        };
        let g = w.grouped_lut(3).unwrap();
        assert_eq!((g.groups(), g.group_rows, g.nbits), (2, 2, 2));
        assert_eq!(g.indices(12), idx.to_vec());
        assert_eq!(g.luts[4], f16::from_f32(10.0));
        assert_eq!(g.bytes(), 3 + 2 * 8 + 2 * 4);
        assert_eq!(g.check(&[4, 3]), Ok(()));
        assert!(
            g.check(&[6, 2]).is_err(),
            "2 tables of 2 rows do not cover 6 rows"
        );
        let mut permuted = w.clone();
        permuted.restore = Some(vec![1, 0, 3, 2]);
        assert!(permuted.grouped_lut(3).is_none());
        let mut uneven = w;
        uneven.groups[1].rows = 1;
        assert!(uneven.grouped_lut(3).is_none());
    }

    #[test]
    fn labels() {
        let lut = |nbits: u8| PackedLut {
            nbits,
            lut: vec![f16::ZERO; 1 << nbits],
            packed: vec![],
        };
        let mut w = QuantizedWeight::per_tensor(4, lut(4));
        assert_eq!(w.label(), "lut4");
        assert!(w.is_plain());
        w.groups.push(LutRows {
            rows: 2,
            lut: lut(4),
        });
        assert_eq!(w.label(), "lut4x2");
        w.groups.push(LutRows {
            rows: 2,
            lut: lut(6),
        });
        w.row_scale = Some(vec![f16::ONE; 8]);
        assert_eq!(w.label(), "lut4/6x3+row_scale");
        assert_eq!(w.rows(), 8);
    }
}
