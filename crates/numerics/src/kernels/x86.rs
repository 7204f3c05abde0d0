//! The x86-64 kernels: AVX2 (with FMA and F16C) for every product, and the AVX-512 VBMI
//! 4-bit LUT product, whose two 16-lane accumulators are the AVX2 kernel's four 8-lane ones
//! side by side. Each function is `unsafe` for the instruction sets it names.

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
            *acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(j)), _mm256_loadu_ps(pb.add(j)), *acc);
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

/// [`dot_lut4_f16`] with 256-bit shuffles and no fp16 stage: each 32 indices are looked up
/// in the three byte planes of the widened table (byte 0 of an fp16 value widened to f32 is
/// zero) and the f32 bits rebuilt with in-lane unpacks, 13 shuffles per 32 weights against
/// [`dot_lut4_f16`]'s 10 shuffles and 4 two-µop conversions. Faster where a 256-bit shuffle
/// is one operation; [`dot_lut4_f16`] is faster where the CPU splits it in two (AMD before Zen
/// 3). The same accumulators in the same order: the same bits.
///
/// # Safety
/// As for [`dot_lut4_f16`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_lut4_f16_planes(
    x: &[f32],
    data: &[u8],
    e0: usize,
    table: &super::LutTable,
) -> f32 {
    let n = x.len();
    let (px, pd) = (x.as_ptr(), data.as_ptr().add(e0 / 2));
    let [t1, t2, t3] = table
        .planes
        .map(|p| _mm256_broadcastsi128_si256(_mm_loadu_si128(p.as_ptr() as *const __m128i)));
    const Z: i8 = -128;
    // Lane 0 keeps bytes 0, 1, 4, 5, ... (elements 0-3, 8-11, ...), lane 1 bytes 2, 3, 6, 7,
    // ... (elements 4-7, 12-15, ...), so that the unpacks below put every value in place.
    #[rustfmt::skip]
    let sel = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, Z, Z, Z, Z, Z, Z, Z, Z,
        2, 3, 6, 7, 10, 11, 14, 15, Z, Z, Z, Z, Z, Z, Z, Z,
    );
    let m = _mm256_set1_epi8(0x0f);
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(pd.add(i / 2) as *const __m128i));
        let s = _mm256_shuffle_epi8(v, sel);
        // Each byte's two nibbles become two bytes: lane L, byte q holds element
        // 8·(q / 4) + 4·L + q % 4.
        let idx = _mm256_unpacklo_epi8(
            _mm256_and_si256(s, m),
            _mm256_and_si256(_mm256_srli_epi16::<4>(s), m),
        );
        let (b1, b2, b3) = (
            _mm256_shuffle_epi8(t1, idx),
            _mm256_shuffle_epi8(t2, idx),
            _mm256_shuffle_epi8(t3, idx),
        );
        let (lo01, hi01) = (
            _mm256_unpacklo_epi8(zero, b1),
            _mm256_unpackhi_epi8(zero, b1),
        );
        let (lo23, hi23) = (_mm256_unpacklo_epi8(b2, b3), _mm256_unpackhi_epi8(b2, b3));
        let w = [
            _mm256_unpacklo_epi16(lo01, lo23),
            _mm256_unpackhi_epi16(lo01, lo23),
            _mm256_unpacklo_epi16(hi01, hi23),
            _mm256_unpackhi_epi16(hi01, hi23),
        ];
        for (k, (acc, w)) in acc.iter_mut().zip(w).enumerate() {
            let xv = _mm256_loadu_ps(px.add(i + 8 * k));
            *acc = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(w), *acc);
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
    let field = |shifted: __m128i, k: i32| _mm_and_si128(shifted, _mm_set1_epi32(0x3f << (8 * k)));
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
pub unsafe fn gemm_nt(x: &[f32], rows: usize, w: &[f32], wrows: usize, k: usize, out: &mut [f32]) {
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
