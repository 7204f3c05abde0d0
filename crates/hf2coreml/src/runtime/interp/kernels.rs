//! The interpreter's inner loops: dot products of f32 activations with f32 or fp16 weights.
//!
//! A decode step is bound by reading the weights once, so these run at memory speed only when
//! they use the CPU's vector units fully. Every function runs at the process's instruction-set
//! level ([`crate::util::isa`]: the best the CPU has, capped by `HF2COREML_ISA`), and has an
//! `_at` variant taking the level, so tests and benches can hold every variant against the
//! portable one on one machine. At AVX2 (with FMA and F16C) they use 256-bit fused
//! multiply-adds and widen fp16 in registers; at AVX-512 VBMI the 4-bit LUT product looks its
//! weights up 16 at a time; at `scalar`, a portable 16-lane loop the compiler vectorizes for
//! the baseline target.
//!
//! Lookups (`unpack_f16`) give the same bits at every level. Dot products keep one summation
//! order per level: at AVX2 and AVX-512 four 8-lane FMA accumulators (the two levels agree bit
//! for bit), at `scalar` 16 lanes of multiply then add. The LUT product at a level gives the
//! bits of that level's `dot_f16` over the decoded row, so packed and dense weights agree.

use half::f16;

use crate::util::isa::{self, Isa};

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
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("no x86 level is available here"),
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
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("no x86 level is available here"),
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
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("no x86 level is available here"),
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
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("no x86 level is available here"),
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
}

impl LutTable {
    /// The first `entries` of `table` prepared (the rest read as zero).
    pub fn new(table: &Table<f16>, entries: usize) -> Self {
        let mut t = LutTable {
            wide: [0.0; 256],
            bytes: [[0; 64]; 2],
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
    }
}

/// `out[i] = table[index of element e0 + i]`, the `nbits`-bit indices (1-8) packed
/// LSB-first in `data` (Core ML's packing), for fp16 entries: from AVX2 up, 4-bit indices are
/// looked up 32 at a time with byte shuffles.
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
    let _ = usable(level);
    unpack(data, e0, nbits, table, out)
}

/// `dot_f16(x, w)` for the row `w` of `x.len()` fp16 values that `unpack_f16` would decode
/// (elements `e0..`) through the table `table` was prepared from, the same bits: from AVX2 up,
/// 4-bit rows starting on a byte are looked up and multiplied in one pass; otherwise the row is
/// decoded to f32 into `row` first (the widened values `dot_f16` would multiply).
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
            // SAFETY: the CPU has AVX2, FMA and F16C (`usable` checked), and data holds every
            // index.
            _ => unsafe { x86::dot_lut4_f16(x, data, e0, table) },
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
    row.resize(x.len(), 0.0);
    unpack(data, e0, nbits, &table.wide, row);
    // `dot` and `dot_f16` sum alike at every level, and the widened values are exact.
    dot_at(level, x, row)
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

/// Index `e` of a stream of `NB`-bit indices, one at a time (the head and tail of a run).
#[inline(always)]
fn index_at<const NB: usize>(data: &[u8], e: usize) -> u8 {
    let bit = e * NB;
    let lo = data[bit / 8] as u16;
    let hi = data.get(bit / 8 + 1).copied().unwrap_or(0) as u16;
    (((lo | hi << 8) >> (bit % 8)) & ((1 << NB) - 1)) as u8
}

fn unpack_n<const NB: usize, T: Copy>(data: &[u8], e0: usize, table: &Table<T>, out: &mut [T]) {
    let n = out.len();
    // Element e0 + head starts a byte: a group of 8 indices is NB whole bytes from there.
    let head = ((8 - e0 % 8) % 8).min(n);
    for (i, o) in out[..head].iter_mut().enumerate() {
        *o = table[index_at::<NB>(data, e0 + i) as usize];
    }
    let first = (e0 + head) * NB / 8;
    let done = head
        + match NB {
            1 => bytes::<1, 8, T>(&data[first..], table, &mut out[head..]),
            2 => bytes::<2, 4, T>(&data[first..], table, &mut out[head..]),
            4 => bytes::<4, 2, T>(&data[first..], table, &mut out[head..]),
            8 => bytes::<8, 1, T>(&data[first..], table, &mut out[head..]),
            _ => words::<NB, T>(&data[first..], table, &mut out[head..]),
        };
    for (i, o) in out[done..].iter_mut().enumerate() {
        *o = table[index_at::<NB>(data, e0 + done + i) as usize];
    }
}

/// Whole bytes of `PER` indices each (NB · PER = 8) from the first byte of `data`; the count
/// of values written.
#[inline(always)]
fn bytes<const NB: usize, const PER: usize, T: Copy>(
    data: &[u8],
    table: &Table<T>,
    out: &mut [T],
) -> usize {
    let mut n = 0;
    for (o, &b) in out.chunks_exact_mut(PER).zip(data) {
        let o: &mut [T; PER] = o.try_into().expect("chunks of PER");
        for (k, v) in o.iter_mut().enumerate() {
            *v = table[((b as usize) >> (k * NB)) & ((1 << NB) - 1)];
        }
        n += PER;
    }
    n
}

/// Groups of 8 indices, NB bytes read as one little-endian word (widths that split bytes).
#[inline(always)]
fn words<const NB: usize, T: Copy>(data: &[u8], table: &Table<T>, out: &mut [T]) -> usize {
    let mut n = 0;
    for (g, b) in out.chunks_exact_mut(8).zip(data.chunks_exact(NB)) {
        let mut w = [0u8; 8];
        w[..NB].copy_from_slice(b);
        let w = u64::from_le_bytes(w);
        let g: &mut [T; 8] = g.try_into().expect("chunks of 8");
        for (k, o) in g.iter_mut().enumerate() {
            *o = table[((w >> (k * NB)) & ((1 << NB) - 1)) as usize];
        }
        n += 8;
    }
    n
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

/// On the bits, with the sign cleared, |x| orders like an integer and inf/NaN are the values
/// from the exponent-all-ones pattern up: integer lanes the compiler vectorizes.
#[inline(always)]
fn scan_f32_lanes(v: &[f32]) -> (f32, u64) {
    const L: usize = 8;
    const INF: i32 = 0x7f80_0000;
    let mut m = [0i32; L];
    let mut bad = [0u32; L];
    let chunks = v.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            let a = (c[l].to_bits() & 0x7fff_ffff) as i32;
            let finite = a < INF;
            m[l] = m[l].max(if finite { a } else { 0 });
            bad[l] += (!finite) as u32;
        }
    }
    let mut best = m.iter().copied().max().unwrap_or(0);
    let mut n_bad: u64 = bad.iter().map(|&b| b as u64).sum();
    for x in tail {
        let a = (x.to_bits() & 0x7fff_ffff) as i32;
        if a < INF {
            best = best.max(a);
        } else {
            n_bad += 1;
        }
    }
    (f32::from_bits(best as u32), n_bad)
}

#[inline(always)]
fn scan_f16_lanes(v: &[f16]) -> (f32, u64) {
    const L: usize = 16;
    const INF: i16 = 0x7c00;
    let mut m = [0i16; L];
    let mut bad = [0u32; L];
    let chunks = v.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            let a = (c[l].to_bits() & 0x7fff) as i16;
            let finite = a < INF;
            m[l] = m[l].max(if finite { a } else { 0 });
            bad[l] += (!finite) as u32;
        }
    }
    let mut best = m.iter().copied().max().unwrap_or(0);
    let mut n_bad: u64 = bad.iter().map(|&b| b as u64).sum();
    for x in tail {
        let a = (x.to_bits() & 0x7fff) as i16;
        if a < INF {
            best = best.max(a);
        } else {
            n_bad += 1;
        }
    }
    (f16::from_bits(best as u16).to_f32(), n_bad)
}

const LANES: usize = 16;

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let body = n / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (ca, cb) in a[..body]
        .chunks_exact(LANES)
        .zip(b[..body].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in body..n {
        s += a[i] * b[i];
    }
    s
}

fn dot_f16_portable(x: &[f32], w: &[f16]) -> f32 {
    let n = x.len().min(w.len());
    let body = n / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (cx, cw) in x[..body]
        .chunks_exact(LANES)
        .zip(w[..body].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] += cx[l] * cw[l].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in body..n {
        s += x[i] * w[i].to_f32();
    }
    s
}

/// The blocked product's driver: tiles of T rows of x (6, then 4, then 1) by R rows of w (2,
/// then 1). `tile(t, r, T, R)` computes one tile.
#[inline(always)]
fn gemm_tiles(rows: usize, wrows: usize, mut tile: impl FnMut(usize, usize, usize, usize)) {
    let mut o = 0;
    while o < wrows {
        let r_n = if o + 2 <= wrows { 2 } else { 1 };
        let mut t = 0;
        while t < rows {
            let t_n = match rows - t {
                6.. => 6,
                4 | 5 => 4,
                _ => 1,
            };
            tile(t, o, t_n, r_n);
            t += t_n;
        }
        o += r_n;
    }
}

const GEMM_LANES: usize = 8;

fn gemm_nt_portable<W: Copy>(
    x: &[f32],
    rows: usize,
    w: &[W],
    wrows: usize,
    k: usize,
    out: &mut [f32],
    widen: impl Fn(W) -> f32,
) {
    let body = k / GEMM_LANES * GEMM_LANES;
    gemm_tiles(rows, wrows, |t0, o0, t_n, r_n| {
        for t in t0..t0 + t_n {
            let xr = &x[t * k..(t + 1) * k];
            for o in o0..o0 + r_n {
                let wr = &w[o * k..(o + 1) * k];
                let mut acc = [0f32; GEMM_LANES];
                for (cx, cw) in xr[..body]
                    .chunks_exact(GEMM_LANES)
                    .zip(wr[..body].chunks_exact(GEMM_LANES))
                {
                    for l in 0..GEMM_LANES {
                        acc[l] += cx[l] * widen(cw[l]);
                    }
                }
                let mut s: f32 = acc.iter().sum();
                for i in body..k {
                    s += xr[i] * widen(wr[i]);
                }
                out[o * rows + t] = s;
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn scan_f32(v: &[f32]) -> (f32, u64) {
        super::scan_f32_lanes(v)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn scan_f16(v: &[f16]) -> (f32, u64) {
        super::scan_f16_lanes(v)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let j = i + 8 * k;
                *acc =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(j)), _mm256_loadu_ps(pb.add(j)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// The 16 fp16 entries of `table` as a table of low bytes and one of high bytes, in
    /// both 128-bit lanes.
    #[target_feature(enable = "avx2")]
    unsafe fn split_table(table: &super::Table<f16>) -> (__m256i, __m256i) {
        let (mut lo, mut hi) = ([0u8; 16], [0u8; 16]);
        for (k, t) in table[..16].iter().enumerate() {
            [lo[k], hi[k]] = t.to_bits().to_le_bytes();
        }
        let tlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(lo.as_ptr() as *const __m128i));
        let thi = _mm256_broadcastsi128_si256(_mm_loadu_si128(hi.as_ptr() as *const __m128i));
        (tlo, thi)
    }

    /// The 32 fp16 values of the 32 4-bit indices in the 16 bytes at `p`, in order, as two
    /// vectors of 16.
    #[target_feature(enable = "avx2")]
    unsafe fn lookup32(p: *const u8, tlo: __m256i, thi: __m256i) -> (__m256i, __m256i) {
        let m = _mm_set1_epi8(0x0f);
        // Byte k holds element 2k (low nibble) and 2k + 1 (high nibble).
        let v = _mm_loadu_si128(p as *const __m128i);
        let (a, b) = (
            _mm_and_si128(v, m),
            _mm_and_si128(_mm_srli_epi16::<4>(v), m),
        );
        let idx = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
        let (l, h) = (_mm256_shuffle_epi8(tlo, idx), _mm256_shuffle_epi8(thi, idx));
        // Per 128-bit lane: elements 0-7 | 16-23, then 8-15 | 24-31.
        let (p0, p1) = (_mm256_unpacklo_epi8(l, h), _mm256_unpackhi_epi8(l, h));
        (
            _mm256_permute2x128_si256::<0x20>(p0, p1),
            _mm256_permute2x128_si256::<0x31>(p0, p1),
        )
    }

    /// The low and high bytes of fp16 entries `16·q..16·q + 16` of `table`.
    #[target_feature(enable = "avx2")]
    unsafe fn byte_tables(table: &super::LutTable, q: usize) -> [__m128i; 2] {
        table
            .bytes
            .map(|b| _mm_loadu_si128(b[16 * q..].as_ptr() as *const __m128i))
    }

    /// The 16 fp16 values `tables` looks up for 16 byte indices (< 16), widened to f32 as
    /// two vectors of 8 in order: one byte shuffle per byte of fp16, one unpack per vector,
    /// and the conversion. Every step stays inside 128 bits, where every x86 with AVX2 runs
    /// a shuffle in one operation.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn widen16(lo: __m128i, hi: __m128i) -> [__m256; 2] {
        [
            _mm256_cvtph_ps(_mm_unpacklo_epi8(lo, hi)),
            _mm256_cvtph_ps(_mm_unpackhi_epi8(lo, hi)),
        ]
    }

    /// `dot_f16` over the 4-bit row at element `e0` (even), looked up as it is multiplied:
    /// the same accumulators, in the same order, as `dot_f16` over the decoded row (the
    /// lookup yields the fp16 entry, widened exactly, as `dot_f16` widens a stored weight).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `data` must hold the indices of elements
    /// `e0..e0 + x.len()`, and `e0` must be even.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_lut4_f16(x: &[f32], data: &[u8], e0: usize, table: &super::LutTable) -> f32 {
        let n = x.len();
        let (px, pd) = (x.as_ptr(), data.as_ptr().add(e0 / 2));
        let [tlo, thi] = byte_tables(table, 0);
        let m = _mm_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            // Byte k holds element 2k (low nibble) and 2k + 1 (high nibble).
            let v = _mm_loadu_si128(pd.add(i / 2) as *const __m128i);
            let (a, b) = (
                _mm_and_si128(v, m),
                _mm_and_si128(_mm_srli_epi16::<4>(v), m),
            );
            for (h, idx) in [_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)]
                .into_iter()
                .enumerate()
            {
                let w = widen16(_mm_shuffle_epi8(tlo, idx), _mm_shuffle_epi8(thi, idx));
                for (k, w) in w.into_iter().enumerate() {
                    let j = 2 * h + k;
                    acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(i + 8 * j)), w, acc[j]);
                }
            }
            i += 32;
        }
        lut_tail::<4>(x, data, e0, table, i, acc)
    }

    /// `dot_f16` over the 6-bit row at element `e0` (a multiple of 4, so a group of four
    /// indices is three whole bytes), looked up as it is multiplied, as [`dot_lut4_f16`]
    /// does. Each 16 indices: their 12 bytes spread to 3 per dword, the four 6-bit fields of
    /// each dword shifted into its four bytes, each byte looked up in the four 16-entry
    /// slices of the table (a byte shuffle reads the low 4 bits) and the slice picked by bits
    /// 4 and 5 with two levels of byte blends (which read a byte's top bit: the index shifted
    /// left by 3, then by 2).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `data` must hold the indices of elements
    /// `e0..e0 + x.len()`, and `e0` must be a multiple of 4.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_lut6_f16(x: &[f32], data: &[u8], e0: usize, table: &super::LutTable) -> f32 {
        let n = x.len();
        let start = e0 / 4 * 3;
        let (px, pd, avail) = (x.as_ptr(), data.as_ptr().add(start), data.len() - start);
        let tables = [0, 1, 2, 3].map(|q| byte_tables(table, q));
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // Each 16 indices load 16 bytes and use 12: stop while a load would pass the data.
        while i + 32 <= n && (i + 32) / 4 * 3 + 4 <= avail {
            for h in 0..2 {
                let v = _mm_loadu_si128(pd.add((i + 16 * h) / 4 * 3) as *const __m128i);
                let idx = indices6(v);
                let (bit4, bit5) = (_mm_slli_epi16::<3>(idx), _mm_slli_epi16::<2>(idx));
                let [lo, hi] = [0, 1].map(|b| {
                    let look = |q: usize| _mm_shuffle_epi8(tables[q][b], idx);
                    _mm_blendv_epi8(
                        _mm_blendv_epi8(look(0), look(1), bit4),
                        _mm_blendv_epi8(look(2), look(3), bit4),
                        bit5,
                    )
                });
                for (k, w) in widen16(lo, hi).into_iter().enumerate() {
                    let j = 2 * h + k;
                    acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(i + 8 * j)), w, acc[j]);
                }
            }
            i += 32;
        }
        lut_tail::<6>(x, data, e0, table, i, acc)
    }

    /// The 16 6-bit indices packed LSB-first in the first 12 bytes of `v`, one per byte.
    #[target_feature(enable = "avx2")]
    unsafe fn indices6(v: __m128i) -> __m128i {
        const Z: i8 = -128;
        #[rustfmt::skip]
        let spread = _mm_setr_epi8(0, 1, 2, Z, 3, 4, 5, Z, 6, 7, 8, Z, 9, 10, 11, Z);
        // Dword g holds bytes 3g..3g + 3: index 4g + k at bits 6k..6k + 6, moved to byte k.
        let d = _mm_shuffle_epi8(v, spread);
        let field =
            |shifted: __m128i, k: i32| _mm_and_si128(shifted, _mm_set1_epi32(0x3f << (8 * k)));
        _mm_or_si128(
            _mm_or_si128(field(d, 0), field(_mm_slli_epi32::<2>(d), 1)),
            _mm_or_si128(
                field(_mm_slli_epi32::<4>(d), 2),
                field(_mm_slli_epi32::<6>(d), 3),
            ),
        )
    }

    /// The rest of an `NB`-bit row from element `i` on (fewer than 64 values), decoded,
    /// then what `dot_f16` does past its last whole block: whole blocks of 32 into the four
    /// accumulators, 8-wide steps into `acc[0]`, the reduction and the scalar tail.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn lut_tail<const NB: usize>(
        x: &[f32],
        data: &[u8],
        e0: usize,
        table: &super::LutTable,
        i: usize,
        mut acc: [__m256; 4],
    ) -> f32 {
        let (n, px) = (x.len(), x.as_ptr());
        let r = n - i;
        let mut rest = [0f32; 64];
        let rest = &mut rest[..r];
        super::unpack_n::<NB, f32>(data, e0 + i, &table.wide, rest);
        let mut j = 0;
        while j + 32 <= r {
            for (k, acc) in acc.iter_mut().enumerate() {
                let wv = _mm256_loadu_ps(rest.as_ptr().add(j + 8 * k));
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(i + j + 8 * k)), wv, *acc);
            }
            j += 32;
        }
        while j + 8 <= r {
            let wv = _mm256_loadu_ps(rest.as_ptr().add(j));
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(i + j)), wv, acc[0]);
            j += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while j < r {
            s += x[i + j] * rest[j];
            j += 1;
        }
        s
    }

    /// [`dot_lut4_f16`] with AVX-512: each 16 indices become the low nibbles of 16 dwords in
    /// one `vpmultishiftqb` of their 8 bytes broadcast, and select from the table widened to
    /// f32 with one `vpermps` (it reads an index's low 4 bits only). The two 16-lane
    /// accumulators are the AVX2 kernel's four 8-lane ones side by side, so every lane sums
    /// the same products in the same order and the result has the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW and VBMI besides AVX2, FMA and F16C; `data` and
    /// `e0` as for [`dot_lut4_f16`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vbmi")]
    pub unsafe fn dot_lut4_f16_avx512(
        x: &[f32],
        data: &[u8],
        e0: usize,
        table: &super::LutTable,
    ) -> f32 {
        let n = x.len();
        let (px, pd) = (x.as_ptr(), data.as_ptr().add(e0 / 2));
        let tab = _mm512_loadu_ps(table.wide.as_ptr());
        // Dword j's low byte is bits 4j.. of the 8 broadcast bytes: index j in its low nibble.
        let ctrl = _mm512_set_epi32(60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
        let lookup = |p: *const u8| {
            let packed = _mm512_set1_epi64(std::ptr::read_unaligned(p as *const i64));
            _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, packed), tab)
        };
        let (mut lo, mut hi) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            let p = pd.add(i / 2);
            lo = _mm512_fmadd_ps(_mm512_loadu_ps(px.add(i)), lookup(p), lo);
            hi = _mm512_fmadd_ps(_mm512_loadu_ps(px.add(i + 16)), lookup(p.add(8)), hi);
            i += 32;
        }
        let acc = [
            _mm512_castps512_ps256(lo),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(lo))),
            _mm512_castps512_ps256(hi),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(hi))),
        ];
        lut_tail::<4>(x, data, e0, table, i, acc)
    }

    /// 4-bit indices looked up 32 at a time: the 16 fp16 entries split into a table of low
    /// bytes and one of high bytes, each indexed by `_mm256_shuffle_epi8`, interleaved back.
    ///
    /// # Safety
    /// The CPU must support AVX2; `data` must hold the indices of elements `e0..e0 + out.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unpack4_f16(data: &[u8], e0: usize, table: &super::Table<f16>, out: &mut [f16]) {
        let n = out.len();
        let nibble = |e: usize| table[((data[e / 2] >> (4 * (e % 2))) & 15) as usize];
        let mut i = 0;
        if e0 % 2 == 1 && n > 0 {
            out[0] = nibble(e0);
            i = 1;
        }
        let (tlo, thi) = split_table(table);
        let po = out.as_mut_ptr();
        while i + 32 <= n {
            let (a, b) = lookup32(data.as_ptr().add((e0 + i) / 2), tlo, thi);
            _mm256_storeu_si256(po.add(i) as *mut __m256i, a);
            _mm256_storeu_si256(po.add(i + 16) as *mut __m256i, b);
            i += 32;
        }
        for (k, o) in out[i..].iter_mut().enumerate() {
            *o = nibble(e0 + i + k);
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; x, w and out must hold rows·k, wrows·k and
    /// rows·wrows elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemm_nt(
        x: &[f32],
        rows: usize,
        w: &[f32],
        wrows: usize,
        k: usize,
        out: &mut [f32],
    ) {
        let load = |p: *const f32| _mm256_loadu_ps(p);
        gemm(x, rows, w.as_ptr(), wrows, k, out, load, |p| *p);
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; lengths as for [`gemm_nt`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gemm_nt_f16(
        x: &[f32],
        rows: usize,
        w: &[f16],
        wrows: usize,
        k: usize,
        out: &mut [f32],
    ) {
        let load = |p: *const f16| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        gemm(x, rows, w.as_ptr(), wrows, k, out, load, |p| (*p).to_f32());
    }

    /// The tiles of [`super::gemm_nt`] over weights of any element type, 8 of which `load`
    /// widens to a vector and `one` a scalar.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm<W>(
        x: &[f32],
        rows: usize,
        w: *const W,
        wrows: usize,
        k: usize,
        out: &mut [f32],
        load: impl Fn(*const W) -> __m256 + Copy,
        one: impl Fn(*const W) -> f32 + Copy,
    ) {
        let (px, po) = (x.as_ptr(), out.as_mut_ptr());
        super::gemm_tiles(rows, wrows, |t, o, t_n, r_n| {
            let (x, w, out) = (px.add(t * k), w.add(o * k), po.add(o * rows + t));
            match (t_n, r_n) {
                (6, 2) => tile::<W, 6, 2>(x, w, k, out, rows, load, one),
                (6, _) => tile::<W, 6, 1>(x, w, k, out, rows, load, one),
                (4, 2) => tile::<W, 4, 2>(x, w, k, out, rows, load, one),
                (1, 2) => tile::<W, 1, 2>(x, w, k, out, rows, load, one),
                (4, _) => tile::<W, 4, 1>(x, w, k, out, rows, load, one),
                _ => tile::<W, 1, 1>(x, w, k, out, rows, load, one),
            }
        });
    }

    /// One T×R tile: rows t..t+T of x (at `x`, stride k) against rows o..o+R of w (at `w`,
    /// stride k), written to `out[r·stride + t]`.
    #[inline(always)]
    unsafe fn tile<W, const T: usize, const R: usize>(
        x: *const f32,
        w: *const W,
        k: usize,
        out: *mut f32,
        stride: usize,
        load: impl Fn(*const W) -> __m256,
        one: impl Fn(*const W) -> f32,
    ) {
        let mut acc = [[_mm256_setzero_ps(); R]; T];
        let mut i = 0;
        while i + 8 <= k {
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, wv) in wv.iter_mut().enumerate() {
                *wv = load(w.add(r * k + i));
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(t * k + i));
                for (acc, wv) in acc.iter_mut().zip(&wv) {
                    *acc = _mm256_fmadd_ps(xv, *wv, *acc);
                }
            }
            i += 8;
        }
        for (t, acc) in acc.iter().enumerate() {
            for (r, acc) in acc.iter().enumerate() {
                let mut s = hsum(*acc);
                for j in i..k {
                    s += *x.add(t * k + j) * one(w.add(r * k + j));
                }
                *out.add(r * stride + t) = s;
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(x: &[f32], w: &[f16]) -> f32 {
        let n = x.len().min(w.len());
        let (px, pw) = (x.as_ptr(), w.as_ptr() as *const u16);
        let widen = |j: usize| _mm256_cvtph_ps(_mm_loadu_si128(pw.add(j) as *const __m128i));
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let j = i + 8 * k;
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(j)), widen(j), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(i)), widen(i), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while i < n {
            s += x[i] * w[i].to_f32();
            i += 1;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact in f32 whatever the summation order: small integers.
    fn data(n: usize) -> (Vec<f32>, Vec<f16>) {
        let x: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let w: Vec<f16> = (0..n)
            .map(|i| f16::from_f32(((i * 5) % 13) as f32 - 6.0))
            .collect();
        (x, w)
    }

    /// The levels this CPU has. Each one it lacks is named on the test run's stderr (written
    /// past the harness's capture, so a passing run shows it too): skipped, never silently.
    fn levels() -> Vec<Isa> {
        use std::io::Write;
        Isa::ALL
            .into_iter()
            .filter(|&level| {
                let here = level.available();
                if !here {
                    let _ = writeln!(
                        std::io::stderr(),
                        "kernels: this CPU lacks {level} (best {}): its variants are skipped",
                        isa::detected()
                    );
                }
                here
            })
            .collect()
    }

    #[test]
    fn kernels_agree_with_the_definition_at_every_length() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 576, 1537] {
            let (x, w) = data(n);
            let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let want: f32 = x.iter().zip(&wf).map(|(a, b)| a * b).sum();
            assert_eq!(dot(&x, &wf), want, "dot n={n}");
            assert_eq!(dot_f16(&x, &w), want, "dot_f16 n={n}");
            for level in levels() {
                assert_eq!(dot_at(level, &x, &wf), want, "dot at {level}, n={n}");
                assert_eq!(dot_f16_at(level, &x, &w), want, "dot_f16 at {level}, n={n}");
            }
            assert_eq!(dot_portable(&x, &wf), want, "portable n={n}");
            assert_eq!(dot_f16_portable(&x, &w), want, "portable f16 n={n}");
        }
    }

    #[test]
    fn scans_find_the_largest_finite_magnitude_and_count_the_rest() {
        for n in [0, 1, 7, 8, 9, 16, 17, 100] {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - 40.0) * 0.5).collect();
            let want = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert_eq!(scan_f32(&v), (want, 0), "n={n}");
            assert_eq!(scan_f32_lanes(&v), (want, 0), "n={n}");
            #[cfg(target_arch = "x86_64")]
            if levels().contains(&Isa::Avx2) {
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                // SAFETY: the CPU has AVX2 (checked above).
                let (a, b) = unsafe { (x86::scan_f32(&v), x86::scan_f16(&h)) };
                assert_eq!((a, b), ((want, 0), (want, 0)), "AVX2 scans, n={n}");
            }
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            assert_eq!(scan_f16(&h), (want, 0), "n={n}");
            assert_eq!(scan_f16_lanes(&h), (want, 0), "n={n}");
            if n > 3 {
                v[1] = f32::INFINITY;
                v[n - 1] = f32::NAN;
                v[2] = -1e30;
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                let (m, bad) = scan_f32(&v);
                assert_eq!((m, bad), (1e30, 2), "n={n}");
                // -1e30 overflows fp16 to -inf.
                assert_eq!(scan_f16(&h).1, 3, "n={n}");
                assert_eq!(scan_f16(&h), scan_f16_lanes(&h), "n={n}");
            }
        }
    }

    /// Indices spread over the whole table, packed as Core ML packs them.
    fn packed_indices(n: usize, nbits: u32) -> (Vec<u32>, Vec<u8>) {
        let idx: Vec<u32> = (0..n)
            .map(|i| ((i * 37 + i / 3 + i * i) % (1 << nbits)) as u32)
            .collect();
        let bytes = crate::mlpackage::pack_bits(&idx, nbits);
        (idx, bytes)
    }

    fn table16() -> Table<f16> {
        let mut t = [f16::ZERO; 256];
        for (i, v) in t.iter_mut().enumerate() {
            // Distinct bit patterns in both bytes: a swapped or shifted byte shows.
            *v = f16::from_f32((i as f32 - 100.3) * 1.37);
        }
        t
    }

    #[test]
    fn unpacking_reads_every_bit_width_at_every_offset() {
        let t = table16();
        let tf: Table<f32> = t.map(|v| v.to_f32());
        for nbits in 1..=8 {
            let (idx, bytes) = packed_indices(203, nbits);
            for e0 in [0, 1, 3, 7, 8, 13] {
                for n in [0, 1, 5, 8, 31, 32, 33, 64, 65, 190 - e0] {
                    let want: Vec<f16> = idx[e0..e0 + n].iter().map(|&i| t[i as usize]).collect();
                    let mut got = vec![f16::ZERO; n];
                    unpack(&bytes, e0, nbits, &t, &mut got);
                    assert_eq!(got, want, "portable, {nbits} bits, e0={e0}, n={n}");
                    unpack_f16(&bytes, e0, nbits, &t, &mut got);
                    assert_eq!(got, want, "unpack_f16, {nbits} bits, e0={e0}, n={n}");
                    let mut full = vec![0f32; n];
                    unpack(&bytes, e0, nbits, &tf, &mut full);
                    let wf: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
                    assert_eq!(full, wf, "f32 entries, {nbits} bits, e0={e0}, n={n}");
                }
            }
        }
    }

    /// An x of n values and `dot_f16` of it with the row of n decoded from element e0 on: x
    /// is not exact in f32, so a different summation order would show in the bits.
    fn decoded_dot(
        bytes: &[u8],
        e0: usize,
        nbits: u32,
        t: &Table<f16>,
        n: usize,
    ) -> (Vec<f32>, f32) {
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.1 - 5.0)
            .collect();
        let mut w = vec![f16::ZERO; n];
        unpack(bytes, e0, nbits, t, &mut w);
        let want = dot_f16(&x, &w);
        (x, want)
    }

    #[test]
    fn dot_over_a_lut_row_gives_the_bits_of_dot_over_the_decoded_row() {
        let t = table16();
        for nbits in 1..=8 {
            let (_, bytes) = packed_indices(1200, nbits);
            for e0 in [0, 1, 2, 8, 64] {
                for n in [0, 1, 7, 8, 31, 32, 33, 40, 63, 64, 65, 575, 1100] {
                    let (x, want) = decoded_dot(&bytes, e0, nbits, &t, n);
                    let lut = LutTable::new(&t, 1 << nbits);
                    let got = dot_lut_f16(&x, &bytes, e0, nbits, &lut, &mut Vec::new());
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{nbits} bits, e0={e0}, n={n}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_level_looks_up_the_bits_of_the_portable_lookup() {
        let t = table16();
        for nbits in [2, 4, 6, 8] {
            let (_, bytes) = packed_indices(1000, nbits);
            for level in levels() {
                for e0 in [0, 1, 2, 31, 32, 33] {
                    for n in [0, 1, 31, 32, 33, 63, 64, 65, 96, 900] {
                        let (mut a, mut b) = (vec![f16::ZERO; n], vec![f16::ONE; n]);
                        unpack(&bytes, e0, nbits, &t, &mut a);
                        unpack_f16_at(level, &bytes, e0, nbits, &t, &mut b);
                        assert_eq!(a, b, "{level}, {nbits} bits, e0={e0}, n={n}");
                    }
                }
            }
        }
    }

    /// The LUT product at each level against that level's `dot_f16` over the decoded row (not
    /// exact in f32: a different summation order shows), and the x86 levels against each other.
    #[test]
    fn every_level_multiplies_a_lut_row_as_its_dense_product_does() {
        let t = table16();
        for nbits in [3, 4, 6] {
            let (_, bytes) = packed_indices(1300, nbits);
            for e0 in [0, 1, 2, 8, 64] {
                for n in [0, 1, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 575, 1100] {
                    let (x, _) = decoded_dot(&bytes, e0, nbits, &t, n);
                    let mut w = vec![f16::ZERO; n];
                    unpack(&bytes, e0, nbits, &t, &mut w);
                    let mut got = Vec::new();
                    let prepared = LutTable::new(&t, 1 << nbits);
                    for level in levels() {
                        let want = dot_f16_at(level, &x, &w);
                        let mut row = Vec::new();
                        let lut = dot_lut_f16_at(level, &x, &bytes, e0, nbits, &prepared, &mut row);
                        let what = format!("{level}, {nbits} bits, e0={e0}, n={n}");
                        assert_eq!(lut.to_bits(), want.to_bits(), "{what}");
                        got.push((level, lut));
                    }
                    // AVX2 and AVX-512 keep the same accumulators.
                    let x86: Vec<u32> = got
                        .iter()
                        .filter(|(l, _)| *l >= Isa::Avx2)
                        .map(|(_, v)| v.to_bits())
                        .collect();
                    assert!(
                        x86.windows(2).all(|p| p[0] == p[1]),
                        "{nbits} bits, e0={e0}, n={n}"
                    );
                }
            }
        }
    }

    /// Entries whose widening is unusual (signed zeros, subnormals, the extremes): the byte
    /// tables and the widened table hold exactly what `dot_f16` widens.
    #[test]
    fn every_level_reads_signed_zeros_subnormals_and_extremes_exactly() {
        let mut t = [f16::ZERO; 256];
        let special = [
            f16::ZERO,
            f16::NEG_ZERO,
            f16::from_bits(0x0001),
            f16::from_bits(0x83ff),
            f16::MIN_POSITIVE,
            f16::MAX,
            f16::MIN,
            f16::from_f32(-1.0),
        ];
        for (k, v) in t[..64].iter_mut().enumerate() {
            *v = special[k % 8];
        }
        t[9] = f16::from_f32(3.0e-5);
        t[41] = f16::from_f32(-7.5e-6);
        for nbits in [4, 6] {
            let (_, bytes) = packed_indices(700, nbits);
            let x: Vec<f32> = (0..600).map(|i| ((i * 31) % 17) as f32 - 8.5).collect();
            let mut w = vec![f16::ZERO; 600];
            unpack(&bytes, 0, nbits, &t, &mut w);
            let prepared = LutTable::new(&t, 1 << nbits);
            for level in levels() {
                let want = dot_f16_at(level, &x, &w);
                let got = dot_lut_f16_at(level, &x, &bytes, 0, nbits, &prepared, &mut Vec::new());
                assert_eq!(got.to_bits(), want.to_bits(), "{level}, {nbits} bits");
            }
        }
    }

    /// Rows that end where the packed data ends: the vector loops stop before a load would
    /// pass the last byte, and the tail (up to 37 values for 6-bit rows) sums as `dot_f16`.
    #[test]
    fn rows_ending_at_the_end_of_the_data_multiply_as_their_dense_product() {
        let t = table16();
        for nbits in [4, 6] {
            for e0 in [0, 4, 8, 64] {
                for n in [32, 36, 60, 64, 68, 92, 96, 100, 124, 128, 1024, 1028] {
                    let (_, bytes) = packed_indices(e0 + n, nbits);
                    let (x, _) = decoded_dot(&bytes, e0, nbits, &t, n);
                    let mut w = vec![f16::ZERO; n];
                    unpack(&bytes, e0, nbits, &t, &mut w);
                    let prepared = LutTable::new(&t, 1 << nbits);
                    for level in levels() {
                        let want = dot_f16_at(level, &x, &w);
                        let got = dot_lut_f16_at(
                            level,
                            &x,
                            &bytes,
                            e0,
                            nbits,
                            &prepared,
                            &mut Vec::new(),
                        );
                        let what = format!("{level}, {nbits} bits, e0={e0}, n={n}");
                        assert_eq!(got.to_bits(), want.to_bits(), "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_blocked_product_is_every_dot_product_at_every_shape() {
        for k in [0, 1, 7, 8, 9, 17, 64, 70] {
            for rows in [1, 2, 3, 4, 5, 8, 9] {
                for wrows in [1, 2, 3, 5] {
                    let x: Vec<f32> = (0..rows * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
                    let w: Vec<f32> = (0..wrows * k)
                        .map(|i| ((i * 5) % 13) as f32 - 6.0)
                        .collect();
                    let want: Vec<f32> = (0..wrows)
                        .flat_map(|o| {
                            let (x, w) = (&x, &w);
                            (0..rows).map(move |r| {
                                (0..k).map(|i| x[r * k + i] * w[o * k + i]).sum::<f32>()
                            })
                        })
                        .collect();
                    for level in levels() {
                        let mut got = vec![f32::NAN; rows * wrows];
                        gemm_nt_at(level, &x, rows, &w, wrows, k, &mut got);
                        assert_eq!(got, want, "{level} k={k} rows={rows} wrows={wrows}");
                        let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
                        let mut got = vec![f32::NAN; rows * wrows];
                        gemm_nt_f16_at(level, &x, rows, &h, wrows, k, &mut got);
                        assert_eq!(got, want, "{level} fp16 k={k} rows={rows} wrows={wrows}");
                    }
                    let mut got = vec![f32::NAN; rows * wrows];
                    gemm_nt(&x, rows, &w, wrows, k, &mut got);
                    assert_eq!(got, want, "k={k} rows={rows} wrows={wrows}");
                    let mut port = vec![f32::NAN; rows * wrows];
                    gemm_nt_portable(&x, rows, &w, wrows, k, &mut port, |v| v);
                    assert_eq!(port, want, "portable k={k} rows={rows} wrows={wrows}");
                    let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
                    let mut half = vec![f32::NAN; rows * wrows];
                    gemm_nt_f16(&x, rows, &h, wrows, k, &mut half);
                    assert_eq!(half, want, "fp16 k={k} rows={rows} wrows={wrows}");
                    let mut port = vec![f32::NAN; rows * wrows];
                    gemm_nt_portable(&x, rows, &h, wrows, k, &mut port, f16::to_f32);
                    assert_eq!(port, want, "portable fp16 k={k} rows={rows} wrows={wrows}");
                }
            }
        }
    }

    #[test]
    fn the_blocked_product_rounds_like_a_dot_product() {
        // Not small integers: the sums round, and agree with dot's to f32 rounding.
        let (rows, wrows, k) = (6, 3, 1000);
        let x: Vec<f32> = (0..rows * k).map(|i| ((i as f32) * 0.37).sin()).collect();
        let w: Vec<f32> = (0..wrows * k).map(|i| ((i as f32) * 0.11).cos()).collect();
        let mut got = vec![0f32; rows * wrows];
        gemm_nt(&x, rows, &w, wrows, k, &mut got);
        for o in 0..wrows {
            for r in 0..rows {
                let exact: f64 = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[o * k + i] as f64)
                    .sum();
                let g = got[o * rows + r] as f64;
                assert!((g - exact).abs() < 1e-4, "{g} vs {exact}");
                let d = dot(&x[r * k..(r + 1) * k], &w[o * k..(o + 1) * k]) as f64;
                assert!((g - d).abs() < 1e-4, "{g} vs dot {d}");
            }
        }
        // fp16 weights: the same product as their exact f32 widening.
        let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let wide: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let (mut a, mut b) = (vec![0f32; rows * wrows], vec![0f32; rows * wrows]);
        gemm_nt_f16(&x, rows, &h, wrows, k, &mut a);
        gemm_nt(&x, rows, &wide, wrows, k, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn uneven_lengths_use_the_common_prefix() {
        let (x, w) = data(40);
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        assert_eq!(dot(&x[..33], &wf), dot(&x[..33], &wf[..33]));
        assert_eq!(dot_f16(&x, &w[..17]), dot_f16(&x[..17], &w[..17]));
    }
}
