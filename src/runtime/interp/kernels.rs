//! The interpreter's inner loops: dot products of f32 activations with f32 or fp16 weights.
//!
//! A decode step is bound by reading the weights once, so these run at memory speed only when
//! they use the CPU's vector units fully. On x86-64 with AVX2, FMA and F16C (checked at run
//! time, once) they use 256-bit fused multiply-adds and widen fp16 in registers; elsewhere a
//! portable 16-lane loop the compiler vectorizes for the baseline target.

use half::f16;

/// Σ a[i]·b[i] over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
        return unsafe { x86::dot_f32(a, b) };
    }
    dot_portable(a, b)
}

/// Σ x[i]·w[i] with fp16 weights, widened exactly.
#[inline]
pub fn dot_f16(x: &[f32], w: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
        return unsafe { x86::dot_f16(x, w) };
    }
    dot_f16_portable(x, w)
}

/// `out[o·rows + r] = Σ_k x[r·k + kk] · w[o·k + kk]` for every row r of x (`rows` rows of k)
/// and every row o of w (`wrows` rows of k): the projections of several tokens at once
/// (prefill), where `dot` would read each weight row once per token. Register-blocked, 4 rows
/// of x by 2 of w, one 8-lane accumulator per pair, so each loaded weight vector serves four
/// tokens. The summation order is not `dot`'s: results agree with it to f32 rounding, not bit
/// for bit.
pub fn gemm_nt(x: &[f32], rows: usize, w: &[f32], wrows: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() >= rows * k && w.len() >= wrows * k && out.len() >= rows * wrows);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked above); the lengths are checked above.
        return unsafe { x86::gemm_nt(x, rows, w, wrows, k, out) };
    }
    gemm_nt_portable(x, rows, w, wrows, k, out, |v| v)
}

/// [`gemm_nt`] with fp16 weights, widened exactly in registers as they are loaded (each
/// widened vector serves four tokens).
pub fn gemm_nt_f16(x: &[f32], rows: usize, w: &[f16], wrows: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() >= rows * k && w.len() >= wrows * k && out.len() >= rows * wrows);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above); lengths checked above.
        return unsafe { x86::gemm_nt_f16(x, rows, w, wrows, k, out) };
    }
    gemm_nt_portable(x, rows, w, wrows, k, out, f16::to_f32)
}

/// Largest finite |x| and the count of inf/NaN (range statistics of every op's result).
pub fn scan_f32(v: &[f32]) -> (f32, u64) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { x86::scan_f32(v) };
    }
    scan_f32_lanes(v)
}

/// The same on fp16 bits.
pub fn scan_f16(v: &[f16]) -> (f32, u64) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 (checked above).
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

#[cfg(target_arch = "x86_64")]
#[inline]
fn avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
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

/// The blocked product's driver: tiles of T rows of x by R rows of w, the tail rows of each
/// in tiles of one. `tile(t, r, T, R)` computes one tile.
#[inline(always)]
fn gemm_tiles(rows: usize, wrows: usize, mut tile: impl FnMut(usize, usize, usize, usize)) {
    let mut o = 0;
    while o < wrows {
        let r_n = if o + 2 <= wrows { 2 } else { 1 };
        let mut t = 0;
        while t < rows {
            let t_n = if t + 4 <= rows { 4 } else { 1 };
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

    #[test]
    fn kernels_agree_with_the_definition_at_every_length() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 576, 1537] {
            let (x, w) = data(n);
            let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let want: f32 = x.iter().zip(&wf).map(|(a, b)| a * b).sum();
            assert_eq!(dot(&x, &wf), want, "dot n={n}");
            assert_eq!(dot_f16(&x, &w), want, "dot_f16 n={n}");
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
