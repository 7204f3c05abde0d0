//! The interpreter's inner loops: dot products of f32 activations with f32 or fp16 weights,
//! and the lookups of palettized weights.
//!
//! A decode step is bound by reading the weights once, so these run at memory speed only when
//! they use the CPU's vector units fully. Every function runs at the process's instruction-set
//! level ([`crate::isa`]: the best the CPU has, capped by `HF2COREML_ISA`), and has an `_at`
//! variant taking the level, so tests and benches can hold every variant against the portable
//! one on one machine. At AVX2 (with FMA and F16C) they use 256-bit fused multiply-adds and
//! widen fp16 in registers; at AVX-512 VBMI the 4-bit LUT product looks its weights up 16 at a
//! time; NEON (aarch64) runs the AVX2 kernels four lanes at a time ([`neon`]); at `scalar`, a
//! portable 16-lane loop the compiler vectorizes for the baseline target.
//!
//! Lookups (`unpack_f16`) give the same bits at every level. Dot products keep one summation
//! order per level: at AVX2, AVX-512 and NEON four 8-lane FMA accumulators (the three levels
//! agree bit for bit: the tests hold each to that order written in portable code), at `scalar` 16 lanes of multiply then add. The LUT product at a level
//! gives the bits of that level's `dot_f16` over the decoded row, so packed and dense weights
//! agree.
//!
//! Files: this one dispatches; `portable.rs` holds the code every level shares (unpacking,
//! scans, the scalar level), `x86.rs` and `neon.rs` the vector kernels of each architecture.

use half::f16;

use crate::isa::{self, Isa};

#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use portable::{
    dot_f16_portable, dot_portable, gemm_nt_portable, scan_f16_lanes, scan_f32_lanes, unpack_n,
};

/// `level`, checked: a variant the CPU lacks must never run.
///
/// # Panics
/// When the CPU lacks `level` ([`Isa::available`] says so beforehand).
#[inline]
fn usable(level: Isa) -> Isa {
    assert!(
        level.available(),
        "kernels at {level} asked for on a CPU whose best is {}",
        isa::detected()
    );
    level
}

/// Σ a[i]·b[i] over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_at(isa::selected(), a, b)
}

/// [`dot`] at `level`.
pub fn dot_at(level: Isa, a: &[f32], b: &[f32]) -> f32 {
    match usable(level) {
        Isa::Scalar => dot_portable(a, b),
        // SAFETY: the CPU has AVX2, FMA and F16C (`usable` checked).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vbmi => unsafe { x86::dot_f32(a, b) },
        // SAFETY: NEON is part of aarch64; the lengths are the slices'.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::dot_f32(a, b) },
        _ => unreachable!("{level} is not a level of this architecture"),
    }
}

/// Σ x[i]·w[i] with fp16 weights, widened exactly.
#[inline]
pub fn dot_f16(x: &[f32], w: &[f16]) -> f32 {
    dot_f16_at(isa::selected(), x, w)
}

/// [`dot_f16`] at `level`.
pub fn dot_f16_at(level: Isa, x: &[f32], w: &[f16]) -> f32 {
    match usable(level) {
        Isa::Scalar => dot_f16_portable(x, w),
        // SAFETY: the CPU has AVX2, FMA and F16C (`usable` checked).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vbmi => unsafe { x86::dot_f16(x, w) },
        // SAFETY: NEON is part of aarch64; the lengths are the slices'.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::dot_f16(x, w) },
        _ => unreachable!("{level} is not a level of this architecture"),
    }
}

/// `out[o·rows + r] = Σ_k x[r·k + kk] · w[o·k + kk]` for every row r of x (`rows` rows of k)
/// and every row o of w (`wrows` rows of k): the projections of several tokens at once
/// (prefill), where `dot` would read each weight row once per token. Register-blocked, 6 rows
/// of x by 2 of w, one 8-lane accumulator per pair, so each loaded weight vector serves six
/// tokens. The summation order is not `dot`'s: results agree with it to f32 rounding, not bit
/// for bit.
pub fn gemm_nt(x: &[f32], rows: usize, w: &[f32], wrows: usize, k: usize, out: &mut [f32]) {
    gemm_nt_at(isa::selected(), x, rows, w, wrows, k, out)
}

/// [`gemm_nt`] at `level`.
pub fn gemm_nt_at(
    level: Isa,
    x: &[f32],
    rows: usize,
    w: &[f32],
    wrows: usize,
    k: usize,
    out: &mut [f32],
) {
    assert!(x.len() >= rows * k && w.len() >= wrows * k && out.len() >= rows * wrows);
    match usable(level) {
        Isa::Scalar => gemm_nt_portable(x, rows, w, wrows, k, out, |v| v),
        // SAFETY: the CPU has AVX2 and FMA (`usable` checked); the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vbmi => unsafe { x86::gemm_nt(x, rows, w, wrows, k, out) },
        // SAFETY: NEON is part of aarch64; the lengths are the slices'.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::gemm_nt(x, rows, w, wrows, k, out) },
        _ => unreachable!("{level} is not a level of this architecture"),
    }
}

/// [`gemm_nt`] with fp16 weights, widened exactly in registers as they are loaded (each
/// widened vector serves four tokens).
pub fn gemm_nt_f16(x: &[f32], rows: usize, w: &[f16], wrows: usize, k: usize, out: &mut [f32]) {
    gemm_nt_f16_at(isa::selected(), x, rows, w, wrows, k, out)
}

/// [`gemm_nt_f16`] at `level`.
pub fn gemm_nt_f16_at(
    level: Isa,
    x: &[f32],
    rows: usize,
    w: &[f16],
    wrows: usize,
    k: usize,
    out: &mut [f32],
) {
    assert!(x.len() >= rows * k && w.len() >= wrows * k && out.len() >= rows * wrows);
    match usable(level) {
        Isa::Scalar => gemm_nt_portable(x, rows, w, wrows, k, out, f16::to_f32),
        // SAFETY: the CPU has AVX2, FMA and F16C (`usable` checked); lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vbmi => unsafe { x86::gemm_nt_f16(x, rows, w, wrows, k, out) },
        // SAFETY: NEON is part of aarch64; the lengths are the slices'.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::gemm_nt_f16(x, rows, w, wrows, k, out) },
        _ => unreachable!("{level} is not a level of this architecture"),
    }
}

/// A table of LUT entries, padded to 256 so that an index byte needs no bound check.
pub type Table<T> = [T; 256];

/// A LUT's fp16 entries prepared for [`dot_lut_f16`], once per table rather than once per
/// row: the entries widened to f32 (exactly, so a product reads the values `dot_f16` would
/// widen), and the low and high bytes of the first 64 fp16 entries, the AVX2 kernels'
/// byte-shuffle tables (16-entry slices of them: one for 4-bit indices, four for 6-bit).
#[derive(Clone)]
pub struct LutTable {
    wide: Table<f32>,
    bytes: [[u8; 64]; 2],
    planes: [[u8; 16]; 3],
}

impl LutTable {
    /// The first `entries` of `table` prepared (the rest read as zero).
    pub fn new(table: &Table<f16>, entries: usize) -> Self {
        let mut t = LutTable {
            wide: [0.0; 256],
            bytes: [[0; 64]; 2],
            planes: [[0; 16]; 3],
        };
        t.set(table, entries);
        t
    }

    /// Prepare the first `entries` of `table` in place.
    pub fn set(&mut self, table: &Table<f16>, entries: usize) {
        let entries = entries.min(256);
        for (w, h) in self.wide[..entries].iter_mut().zip(table) {
            *w = h.to_f32();
        }
        let [lo, hi] = &mut self.bytes;
        for (k, h) in table[..entries.min(64)].iter().enumerate() {
            [lo[k], hi[k]] = h.to_bits().to_le_bytes();
        }
        // Byte 0 of an fp16 value widened to f32 is always zero (13 low mantissa bits).
        for k in 0..16 {
            let [_, b1, b2, b3] = self.wide[k].to_bits().to_le_bytes();
            [self.planes[0][k], self.planes[1][k], self.planes[2][k]] = [b1, b2, b3];
        }
    }
}

/// `out[i] = table[index of element e0 + i]`, the `nbits`-bit indices (1-8) packed
/// LSB-first in `data` (Core ML's packing), for fp16 entries: at AVX2 and up and at NEON,
/// 4-bit indices are looked up 32 at a time with byte shuffles.
pub fn unpack_f16(data: &[u8], e0: usize, nbits: u32, table: &Table<f16>, out: &mut [f16]) {
    unpack_f16_at(isa::selected(), data, e0, nbits, table, out)
}

/// [`unpack_f16`] at `level`: the same bits at every level.
pub fn unpack_f16_at(
    level: Isa,
    data: &[u8],
    e0: usize,
    nbits: u32,
    table: &Table<f16>,
    out: &mut [f16],
) {
    #[cfg(target_arch = "x86_64")]
    if nbits == 4 && usable(level) >= Isa::Avx2 {
        assert!(
            data.len() * 2 >= e0 + out.len(),
            "4-bit indices past the data"
        );
        // SAFETY: the CPU has AVX2 (`usable` checked), and data holds every index read.
        return unsafe { x86::unpack4_f16(data, e0, table, out) };
    }
    #[cfg(target_arch = "aarch64")]
    if nbits == 4 && usable(level) == Isa::Neon {
        assert!(
            data.len() * 2 >= e0 + out.len(),
            "4-bit indices past the data"
        );
        // SAFETY: NEON is part of aarch64, and data holds every index read.
        return unsafe { neon::unpack4_f16(data, e0, table, out) };
    }
    let _ = usable(level);
    unpack(data, e0, nbits, table, out)
}

/// `dot_f16(x, w)` for the row `w` of `x.len()` fp16 values that `unpack_f16` would decode
/// (elements `e0..`) through the table `table` was prepared from, the same bits: at the vector
/// levels, 4-bit rows starting on a byte and 6-bit rows starting a group of four are looked up
/// and multiplied in one pass; otherwise the row is decoded to f32 into `row` first (the
/// widened values `dot_f16` would multiply).
pub fn dot_lut_f16(
    x: &[f32],
    data: &[u8],
    e0: usize,
    nbits: u32,
    table: &LutTable,
    row: &mut Vec<f32>,
) -> f32 {
    dot_lut_f16_at(isa::selected(), x, data, e0, nbits, table, row)
}

/// [`dot_lut_f16`] at `level`: the bits of `dot_f16_at(level, ..)` over the decoded row.
pub fn dot_lut_f16_at(
    level: Isa,
    x: &[f32],
    data: &[u8],
    e0: usize,
    nbits: u32,
    table: &LutTable,
    row: &mut Vec<f32>,
) -> f32 {
    let level = usable(level);
    #[cfg(target_arch = "x86_64")]
    if nbits == 4 && e0.is_multiple_of(2) && level >= Isa::Avx2 {
        assert!(
            data.len() * 2 >= e0 + x.len(),
            "4-bit indices past the data"
        );
        return match level {
            // SAFETY: the CPU has AVX-512 F/BW/VBMI, AVX2, FMA and F16C (`usable` checked),
            // and data holds every index.
            Isa::Avx512Vbmi => unsafe { x86::dot_lut4_f16_avx512(x, data, e0, table) },
            _ => dot_lut4_avx2(Avx2Lookup::here(), x, data, e0, table),
        };
    }
    // Both x86 levels run the AVX2 kernel for 6-bit rows: the same accumulators either way.
    #[cfg(target_arch = "x86_64")]
    if nbits == 6 && e0.is_multiple_of(4) && level >= Isa::Avx2 {
        assert!(
            data.len() * 4 >= (e0 + x.len()) * 3,
            "6-bit indices past the data"
        );
        // SAFETY: the CPU has AVX2, FMA and F16C (`usable` checked), data holds every index,
        // and e0 starts a group of four indices (three whole bytes).
        return unsafe { x86::dot_lut6_f16(x, data, e0, table) };
    }
    #[cfg(target_arch = "aarch64")]
    if level == Isa::Neon
        && (nbits == 4 && e0.is_multiple_of(2) || nbits == 6 && e0.is_multiple_of(4))
    {
        assert!(
            data.len() * 8 >= (e0 + x.len()) * nbits as usize,
            "{nbits}-bit indices past the data"
        );
        // SAFETY: NEON is part of aarch64, data holds every index, and e0 starts a byte (4
        // bits) or a group of four indices (6 bits).
        return unsafe {
            if nbits == 4 {
                neon::dot_lut4_f16(x, data, e0, table)
            } else {
                neon::dot_lut6_f16(x, data, e0, table)
            }
        };
    }
    row.resize(x.len(), 0.0);
    unpack(data, e0, nbits, &table.wide, row);
    // `dot` and `dot_f16` sum alike at every level, and the widened values are exact.
    dot_at(level, x, row)
}

/// The two ways the AVX2 level looks 4-bit weights up, with the same bits: which is faster
/// depends on how the CPU runs 256-bit byte shuffles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Avx2Lookup {
    /// 256-bit shuffles on the byte planes of the table widened to f32, no conversion: 13
    /// shuffles per 32 weights. For CPUs that run a 256-bit shuffle as one operation.
    Planes,
    /// Every shuffle in 128 bits, into fp16 widened by `vcvtph2ps`: 10 shuffles and 4
    /// conversions per 32 weights. For CPUs that split 256-bit shuffles in two (AMD families
    /// up to 17h: Zen and Zen 2).
    Halves,
}

impl Avx2Lookup {
    /// Both, for tests and benches.
    pub const ALL: [Avx2Lookup; 2] = [Avx2Lookup::Planes, Avx2Lookup::Halves];

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Avx2Lookup::Planes => "planes",
            Avx2Lookup::Halves => "halves",
        }
    }

    /// The lookup the 4-bit LUT product runs at `level`: AVX2's choice, `None` at the other
    /// levels (each has one way).
    pub fn at(level: Isa) -> Option<Avx2Lookup> {
        (level == Isa::Avx2).then(Avx2Lookup::here)
    }

    /// The one this CPU runs faster, chosen once per process from its vendor and family.
    pub fn here() -> Avx2Lookup {
        static HERE: std::sync::OnceLock<Avx2Lookup> = std::sync::OnceLock::new();
        *HERE.get_or_init(|| {
            if isa::splits_256_bit_shuffles() {
                Avx2Lookup::Halves
            } else {
                Avx2Lookup::Planes
            }
        })
    }
}

/// [`dot_lut_f16_at`] at AVX2 for a 4-bit row starting on a byte, with the lookup `lookup`:
/// every lookup gives the same bits.
///
/// # Panics
/// When the CPU lacks AVX2 or `data` does not hold the row's indices.
pub fn dot_lut4_avx2(
    lookup: Avx2Lookup,
    x: &[f32],
    data: &[u8],
    e0: usize,
    table: &LutTable,
) -> f32 {
    let _ = usable(Isa::Avx2);
    assert!(e0.is_multiple_of(2), "a 4-bit row starting inside a byte");
    assert!(
        data.len() * 2 >= e0 + x.len(),
        "4-bit indices past the data"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX2, FMA and F16C (`usable` checked), data holds every index and
    // e0 is even.
    unsafe {
        match lookup {
            Avx2Lookup::Planes => x86::dot_lut4_f16_planes(x, data, e0, table),
            Avx2Lookup::Halves => x86::dot_lut4_f16(x, data, e0, table),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, table);
        unreachable!("AVX2 ({lookup:?}) on a CPU that is not x86")
    }
}

/// The same for any entries, in portable code: whole groups of 8 indices (`nbits` bytes)
/// at a time, the group's bytes read as one little-endian word.
pub fn unpack<T: Copy>(data: &[u8], e0: usize, nbits: u32, table: &Table<T>, out: &mut [T]) {
    match nbits {
        1 => unpack_n::<1, T>(data, e0, table, out),
        2 => unpack_n::<2, T>(data, e0, table, out),
        3 => unpack_n::<3, T>(data, e0, table, out),
        4 => unpack_n::<4, T>(data, e0, table, out),
        5 => unpack_n::<5, T>(data, e0, table, out),
        6 => unpack_n::<6, T>(data, e0, table, out),
        7 => unpack_n::<7, T>(data, e0, table, out),
        _ => unpack_n::<8, T>(data, e0, table, out),
    }
}

/// Largest finite |x| and the count of inf/NaN (range statistics of every op's result).
pub fn scan_f32(v: &[f32]) -> (f32, u64) {
    #[cfg(target_arch = "x86_64")]
    if isa::selected() >= Isa::Avx2 {
        // SAFETY: the selected level is one the CPU has, and it includes AVX2.
        return unsafe { x86::scan_f32(v) };
    }
    scan_f32_lanes(v)
}

/// The same on fp16 bits.
pub fn scan_f16(v: &[f16]) -> (f32, u64) {
    #[cfg(target_arch = "x86_64")]
    if isa::selected() >= Isa::Avx2 {
        // SAFETY: the selected level is one the CPU has, and it includes AVX2.
        return unsafe { x86::scan_f16(v) };
    }
    scan_f16_lanes(v)
}
