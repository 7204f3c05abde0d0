//! The NEON kernels (aarch64, where NEON is part of the baseline, so no run-time check is
//! needed): the AVX2 kernels four lanes at a time. An AVX2 accumulator of 8 lanes is two
//! NEON registers ([`F8`]), every fused multiply-add is the same, and the horizontal sum adds
//! in AVX2's order, so every product has the bits it has on an x86 with AVX2 (a package
//! validated on Linux computes the same numbers on an Apple silicon Mac).
//!
//! fp16 is widened with `fcvtl`/`fcvtl2` through inline assembly: Rust's fp16 vector
//! intrinsics are not stable, and the instruction widens every fp16 value exactly.

use half::f16;
use std::arch::aarch64::*;
use std::arch::asm;

use super::{LutTable, Table};

/// Eight f32 lanes as one AVX2 register holds them: lanes 0-3, then 4-7.
#[derive(Clone, Copy)]
struct F8(float32x4_t, float32x4_t);

impl F8 {
    #[inline(always)]
    unsafe fn zero() -> F8 {
        F8(vdupq_n_f32(0.0), vdupq_n_f32(0.0))
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> F8 {
        F8(vld1q_f32(p), vld1q_f32(p.add(4)))
    }

    /// `self + a·b`, fused, lane by lane (`_mm256_fmadd_ps(a, b, self)`).
    #[inline(always)]
    unsafe fn fma(self, a: F8, b: F8) -> F8 {
        F8(vfmaq_f32(self.0, a.0, b.0), vfmaq_f32(self.1, a.1, b.1))
    }

    #[inline(always)]
    unsafe fn add(self, o: F8) -> F8 {
        F8(vaddq_f32(self.0, o.0), vaddq_f32(self.1, o.1))
    }

    /// The AVX2 kernels' horizontal sum: lanes i and i + 4, then (0 + 2) and (1 + 3), then
    /// the two.
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        let s = vaddq_f32(self.0, self.1);
        let t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
        vget_lane_f32::<0>(t) + vget_lane_f32::<1>(t)
    }
}

/// Eight fp16 values (their bits) widened exactly to f32.
#[inline(always)]
unsafe fn widen8(h: uint16x8_t) -> F8 {
    let (lo, hi): (float32x4_t, float32x4_t);
    asm!(
        "fcvtl {lo:v}.4s, {h:v}.4h",
        "fcvtl2 {hi:v}.4s, {h:v}.8h",
        h = in(vreg) h,
        lo = out(vreg) lo,
        hi = lateout(vreg) hi,
        options(pure, nomem, nostack, preserves_flags),
    );
    F8(lo, hi)
}

/// Eight fp16 values at `p`, widened.
#[inline(always)]
unsafe fn load_f16(p: *const f16) -> F8 {
    widen8(vld1q_u16(p as *const u16))
}

/// The four accumulators of a dot product added and summed as AVX2 adds them.
#[inline(always)]
unsafe fn reduce(acc: [F8; 4]) -> f32 {
    acc[0].add(acc[1]).add(acc[2].add(acc[3])).hsum()
}

/// # Safety
/// None beyond the slices': NEON is always there on aarch64.
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    dot_with(
        n,
        |j| F8::load(pa.add(j)),
        |j| F8::load(pb.add(j)),
        |i| a[i] * b[i],
    )
}

/// # Safety
/// None beyond the slices'.
pub unsafe fn dot_f16(x: &[f32], w: &[f16]) -> f32 {
    let n = x.len().min(w.len());
    let (px, pw) = (x.as_ptr(), w.as_ptr());
    dot_with(
        n,
        |j| F8::load(px.add(j)),
        |j| load_f16(pw.add(j)),
        |i| x[i] * w[i].to_f32(),
    )
}

/// The AVX2 dot product's loop over 8 lanes of x (`xs`) and of w (`ws`) at each element:
/// blocks of 32 into four accumulators, then 8 at a time into the first, the reduction, and
/// the scalar tail (`one`: one product, unfused).
#[inline(always)]
unsafe fn dot_with(
    n: usize,
    xs: impl Fn(usize) -> F8,
    ws: impl Fn(usize) -> F8,
    one: impl Fn(usize) -> f32,
) -> f32 {
    let mut acc = [F8::zero(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            *acc = acc.fma(xs(j), ws(j));
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = acc[0].fma(xs(i), ws(i));
        i += 8;
    }
    let mut s = reduce(acc);
    while i < n {
        s += one(i);
        i += 1;
    }
    s
}

/// The 16 fp16 values the byte tables `lo`/`hi` give 16 indices, widened, as two vectors of
/// 8 in order.
#[inline(always)]
unsafe fn widen16(lo: uint8x16_t, hi: uint8x16_t) -> [F8; 2] {
    [
        widen8(vreinterpretq_u16_u8(vzip1q_u8(lo, hi))),
        widen8(vreinterpretq_u16_u8(vzip2q_u8(lo, hi))),
    ]
}

/// `dot_f16` over the 4-bit row at element `e0` (even), looked up as it is multiplied: the
/// AVX2 kernel's accumulators in its order (two `tbl` per 16 weights, on the fp16 entries'
/// low and high bytes).
///
/// # Safety
/// `data` must hold the indices of elements `e0..e0 + x.len()`, and `e0` must be even.
pub unsafe fn dot_lut4_f16(x: &[f32], data: &[u8], e0: usize, table: &LutTable) -> f32 {
    let n = x.len();
    let (px, pd) = (x.as_ptr(), data.as_ptr().add(e0 / 2));
    let [tlo, thi] = table.bytes.map(|b| vld1q_u8(b.as_ptr()));
    let m = vdupq_n_u8(0x0f);
    let mut acc = [F8::zero(); 4];
    let mut i = 0;
    while i + 32 <= n {
        // Byte k holds element 2k (low nibble) and 2k + 1 (high nibble).
        let v = vld1q_u8(pd.add(i / 2));
        let (a, b) = (vandq_u8(v, m), vshrq_n_u8::<4>(v));
        for (h, idx) in [vzip1q_u8(a, b), vzip2q_u8(a, b)].into_iter().enumerate() {
            let w = widen16(vqtbl1q_u8(tlo, idx), vqtbl1q_u8(thi, idx));
            for (k, w) in w.into_iter().enumerate() {
                let j = 2 * h + k;
                acc[j] = acc[j].fma(F8::load(px.add(i + 8 * j)), w);
            }
        }
        i += 32;
    }
    lut_tail::<4>(x, data, e0, table, i, acc)
}

/// `dot_f16` over the 6-bit row at element `e0` (a multiple of 4), as the AVX2 kernel: each
/// 16 indices spread from their 12 bytes, then looked up in the 64 entries' low and high
/// bytes with one four-register `tbl` each (it reads all six bits).
///
/// # Safety
/// `data` must hold the indices of elements `e0..e0 + x.len()`, and `e0` must be a
/// multiple of 4.
pub unsafe fn dot_lut6_f16(x: &[f32], data: &[u8], e0: usize, table: &LutTable) -> f32 {
    let n = x.len();
    let start = e0 / 4 * 3;
    let (px, pd, avail) = (x.as_ptr(), data.as_ptr().add(start), data.len() - start);
    let [tlo, thi] = table.bytes.map(|b| vld1q_u8_x4(b.as_ptr()));
    let mut acc = [F8::zero(); 4];
    let mut i = 0;
    // Each 16 indices load 16 bytes and use 12: stop while a load would pass the data.
    while i + 32 <= n && (i + 32) / 4 * 3 + 4 <= avail {
        for h in 0..2 {
            let idx = indices6(vld1q_u8(pd.add((i + 16 * h) / 4 * 3)));
            let w = widen16(vqtbl4q_u8(tlo, idx), vqtbl4q_u8(thi, idx));
            for (k, w) in w.into_iter().enumerate() {
                let j = 2 * h + k;
                acc[j] = acc[j].fma(F8::load(px.add(i + 8 * j)), w);
            }
        }
        i += 32;
    }
    lut_tail::<6>(x, data, e0, table, i, acc)
}

/// The 16 6-bit indices packed LSB-first in the first 12 bytes of `v`, one per byte.
#[inline(always)]
unsafe fn indices6(v: uint8x16_t) -> uint8x16_t {
    const Z: u8 = 0xff;
    const SPREAD: [u8; 16] = [0, 1, 2, Z, 3, 4, 5, Z, 6, 7, 8, Z, 9, 10, 11, Z];
    // Dword g holds bytes 3g..3g + 3 (an index past the table reads 0): index 4g + k at
    // bits 6k..6k + 6, moved to byte k.
    let d = vreinterpretq_u32_u8(vqtbl1q_u8(v, vld1q_u8(SPREAD.as_ptr())));
    let field = |shifted: uint32x4_t, k: u32| vandq_u32(shifted, vdupq_n_u32(0x3f << (8 * k)));
    let f = vorrq_u32(
        vorrq_u32(field(d, 0), field(vshlq_n_u32::<2>(d), 1)),
        vorrq_u32(field(vshlq_n_u32::<4>(d), 2), field(vshlq_n_u32::<6>(d), 3)),
    );
    vreinterpretq_u8_u32(f)
}

/// The rest of an `NB`-bit row from element `i` on (fewer than 64 values), decoded, then
/// what `dot_f16` does past its last whole block (the AVX2 kernel's tail).
#[inline(always)]
unsafe fn lut_tail<const NB: usize>(
    x: &[f32],
    data: &[u8],
    e0: usize,
    table: &LutTable,
    i: usize,
    mut acc: [F8; 4],
) -> f32 {
    let (n, px) = (x.len(), x.as_ptr());
    let r = n - i;
    let mut rest = [0f32; 64];
    let rest = &mut rest[..r];
    super::portable::unpack_n::<NB, f32>(data, e0 + i, &table.wide, rest);
    let pr = rest.as_ptr();
    let mut j = 0;
    while j + 32 <= r {
        for (k, acc) in acc.iter_mut().enumerate() {
            *acc = acc.fma(F8::load(px.add(i + j + 8 * k)), F8::load(pr.add(j + 8 * k)));
        }
        j += 32;
    }
    while j + 8 <= r {
        acc[0] = acc[0].fma(F8::load(px.add(i + j)), F8::load(pr.add(j)));
        j += 8;
    }
    let mut s = reduce(acc);
    while j < r {
        s += x[i + j] * rest[j];
        j += 1;
    }
    s
}

/// 4-bit indices looked up 32 at a time into fp16 (two `tbl` per 16, the bytes zipped).
///
/// # Safety
/// `data` must hold the indices of elements `e0..e0 + out.len()`.
pub unsafe fn unpack4_f16(data: &[u8], e0: usize, table: &Table<f16>, out: &mut [f16]) {
    let n = out.len();
    let nibble = |e: usize| table[((data[e / 2] >> (4 * (e % 2))) & 15) as usize];
    let mut i = 0;
    if e0 % 2 == 1 && n > 0 {
        out[0] = nibble(e0);
        i = 1;
    }
    let (mut lo, mut hi) = ([0u8; 16], [0u8; 16]);
    for (k, t) in table[..16].iter().enumerate() {
        [lo[k], hi[k]] = t.to_bits().to_le_bytes();
    }
    let (tlo, thi) = (vld1q_u8(lo.as_ptr()), vld1q_u8(hi.as_ptr()));
    let m = vdupq_n_u8(0x0f);
    let po = out.as_mut_ptr() as *mut u8;
    while i + 32 <= n {
        let v = vld1q_u8(data.as_ptr().add((e0 + i) / 2));
        let (a, b) = (vandq_u8(v, m), vshrq_n_u8::<4>(v));
        for (h, idx) in [vzip1q_u8(a, b), vzip2q_u8(a, b)].into_iter().enumerate() {
            let (l, hb) = (vqtbl1q_u8(tlo, idx), vqtbl1q_u8(thi, idx));
            let p = po.add(2 * (i + 16 * h));
            vst1q_u8(p, vzip1q_u8(l, hb));
            vst1q_u8(p.add(16), vzip2q_u8(l, hb));
        }
        i += 32;
    }
    for (k, o) in out[i..].iter_mut().enumerate() {
        *o = nibble(e0 + i + k);
    }
}

/// # Safety
/// x, w and out must hold rows·k, wrows·k and rows·wrows elements.
pub unsafe fn gemm_nt(x: &[f32], rows: usize, w: &[f32], wrows: usize, k: usize, out: &mut [f32]) {
    gemm(x, rows, w.as_ptr(), wrows, k, out, |p| F8::load(p), |p| *p);
}

/// # Safety
/// Lengths as for [`gemm_nt`].
pub unsafe fn gemm_nt_f16(
    x: &[f32],
    rows: usize,
    w: &[f16],
    wrows: usize,
    k: usize,
    out: &mut [f32],
) {
    gemm(
        x,
        rows,
        w.as_ptr(),
        wrows,
        k,
        out,
        |p| load_f16(p),
        |p| (*p).to_f32(),
    );
}

/// The AVX2 blocked product's tiles, each 8-lane accumulator two NEON registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm<W>(
    x: &[f32],
    rows: usize,
    w: *const W,
    wrows: usize,
    k: usize,
    out: &mut [f32],
    load: impl Fn(*const W) -> F8 + Copy,
    one: impl Fn(*const W) -> f32 + Copy,
) {
    let (px, po) = (x.as_ptr(), out.as_mut_ptr());
    super::portable::gemm_tiles(rows, wrows, |t, o, t_n, r_n| {
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

/// One T×R tile, as the AVX2 kernel's.
#[inline(always)]
unsafe fn tile<W, const T: usize, const R: usize>(
    x: *const f32,
    w: *const W,
    k: usize,
    out: *mut f32,
    stride: usize,
    load: impl Fn(*const W) -> F8,
    one: impl Fn(*const W) -> f32,
) {
    let mut acc = [[F8::zero(); R]; T];
    let mut i = 0;
    while i + 8 <= k {
        let mut wv = [F8::zero(); R];
        for (r, wv) in wv.iter_mut().enumerate() {
            *wv = load(w.add(r * k + i));
        }
        for (t, acc) in acc.iter_mut().enumerate() {
            let xv = F8::load(x.add(t * k + i));
            for (acc, wv) in acc.iter_mut().zip(&wv) {
                *acc = acc.fma(xv, *wv);
            }
        }
        i += 8;
    }
    for (t, acc) in acc.iter().enumerate() {
        for (r, acc) in acc.iter().enumerate() {
            let mut s = acc.hsum();
            for j in i..k {
                s += *x.add(t * k + j) * one(w.add(r * k + j));
            }
            *out.add(r * stride + t) = s;
        }
    }
}
