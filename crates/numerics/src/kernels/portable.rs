//! The code every level shares: unpacking indices of any width, the range scans, and the
//! `scalar` level's dot products and blocked product (portable loops the compiler vectorizes
//! for the baseline target).

use half::f16;

use super::Table;

/// Index `e` of a stream of `NB`-bit indices, one at a time (the head and tail of a run).
#[inline(always)]
pub(super) fn index_at<const NB: usize>(data: &[u8], e: usize) -> u8 {
    let bit = e * NB;
    let lo = data[bit / 8] as u16;
    let hi = data.get(bit / 8 + 1).copied().unwrap_or(0) as u16;
    (((lo | hi << 8) >> (bit % 8)) & ((1 << NB) - 1)) as u8
}

pub(super) fn unpack_n<const NB: usize, T: Copy>(
    data: &[u8],
    e0: usize,
    table: &Table<T>,
    out: &mut [T],
) {
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

/// On the bits, with the sign cleared, |x| orders like an integer and inf/NaN are the values
/// from the exponent-all-ones pattern up: integer lanes the compiler vectorizes.
#[inline(always)]
pub(super) fn scan_f32_lanes(v: &[f32]) -> (f32, u64) {
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
pub(super) fn scan_f16_lanes(v: &[f16]) -> (f32, u64) {
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

pub(super) fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
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

pub(super) fn dot_f16_portable(x: &[f32], w: &[f16]) -> f32 {
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
pub(super) fn gemm_tiles(
    rows: usize,
    wrows: usize,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
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

pub(super) fn gemm_nt_portable<W: Copy>(
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
