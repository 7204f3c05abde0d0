//! The little dense linear algebra calibrated quantization needs: the upper Cholesky factor
//! of an inverse Hessian, in f64, on matrices up to a few thousand wide.

use rayon::prelude::*;

/// Below this width the factorisations run as plain loops; above, they recurse on halves and
/// do the bulk of the n³/3 work as matrix products (candle's gemm, cache-blocked, all cores).
const BLOCK: usize = 128;

/// Lower Cholesky factor of the symmetric positive definite `a` (row-major n×n): `a = L·Lᵀ`.
/// `None` when a pivot is not positive (the matrix is not positive definite in f64).
///
/// With A = [[A11, A21ᵀ], [A21, A22]]: L11 = chol(A11), L21 = A21·L11⁻ᵀ, L22 = chol(A22 −
/// L21·L21ᵀ).
pub fn cholesky_lower(a: &[f64], n: usize) -> Option<Vec<f64>> {
    if n <= BLOCK {
        return cholesky_unblocked(a, n);
    }
    let m = n / 2;
    let r = n - m;
    let l11 = cholesky_lower(&block(a, n, 0..m, 0..m), m)?;
    let l11_inv = lower_inverse(&l11, m)?;
    let l21 = matmul(&block(a, n, m..n, 0..m), (r, m), &l11_inv, (m, m), true)?;
    drop(l11_inv);
    let mut s = block(a, n, m..n, m..n);
    let p = matmul(&l21, (r, m), &l21, (r, m), true)?;
    for (x, y) in s.iter_mut().zip(&p) {
        *x -= y;
    }
    drop(p);
    let l22 = cholesky_lower(&s, r)?;
    drop(s);
    let mut l = vec![0.0f64; n * n];
    put(&mut l, n, (0, 0), &l11, (m, m));
    put(&mut l, n, (m, 0), &l21, (r, m));
    put(&mut l, n, (m, m), &l22, (r, r));
    Some(l)
}

fn cholesky_unblocked(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0.0f64; n * n];
    for j in 0..n {
        // The diagonal entry, then column j below it; rows are contiguous, so each entry is a
        // dot product of two row prefixes.
        let (row_j, below) = l[j * n..].split_at_mut(n);
        let d = a[j * n + j] - dot(&row_j[..j], &row_j[..j]);
        if d.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return None;
        }
        let djj = d.sqrt();
        row_j[j] = djj;
        let row_j: &[f64] = row_j;
        for (k, row_i) in below.chunks_mut(n).enumerate() {
            let i = j + 1 + k;
            let v = a[i * n + j] - dot(&row_i[..j], &row_j[..j]);
            row_i[j] = v / djj;
        }
    }
    Some(l)
}

/// Inverse of the lower-triangular `l` (row-major n×n, non-zero diagonal), lower too.
///
/// With L = [[A, 0], [B, D]]: L⁻¹ = [[A⁻¹, 0], [−D⁻¹·B·A⁻¹, D⁻¹]].
pub fn lower_inverse(l: &[f64], n: usize) -> Option<Vec<f64>> {
    if n <= BLOCK {
        return Some(lower_inverse_unblocked(l, n));
    }
    let m = n / 2;
    let r = n - m;
    let a_inv = lower_inverse(&block(l, n, 0..m, 0..m), m)?;
    let d_inv = lower_inverse(&block(l, n, m..n, m..n), r)?;
    let db = matmul(&d_inv, (r, r), &block(l, n, m..n, 0..m), (r, m), false)?;
    let mut x = matmul(&db, (r, m), &a_inv, (m, m), false)?;
    drop(db);
    x.iter_mut().for_each(|v| *v = -*v);
    let mut out = vec![0.0f64; n * n];
    put(&mut out, n, (0, 0), &a_inv, (m, m));
    put(&mut out, n, (m, 0), &x, (r, m));
    put(&mut out, n, (m, m), &d_inv, (r, r));
    Some(out)
}

fn lower_inverse_unblocked(l: &[f64], n: usize) -> Vec<f64> {
    // Column j of X = L⁻¹ by forward substitution, stored as row j of Xᵀ (contiguous):
    // X[i][j] = −(Σ_{k=j}^{i−1} L[i][k]·X[k][j]) / L[i][i].
    let mut xt = vec![0.0f64; n * n];
    xt.par_chunks_mut(n).enumerate().for_each(|(j, col)| {
        col[j] = 1.0 / l[j * n + j];
        for i in j + 1..n {
            let s = dot(&l[i * n + j..i * n + i], &col[j..i]);
            col[i] = -s / l[i * n + i];
        }
    });
    let mut x = vec![0.0f64; n * n];
    for j in 0..n {
        for i in j..n {
            x[i * n + j] = xt[j * n + i];
        }
    }
    x
}

/// Rows `rows` and columns `cols` of the row-major n-wide `a`, as a dense matrix.
fn block(
    a: &[f64],
    n: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for i in rows {
        out.extend_from_slice(&a[i * n + cols.start..i * n + cols.end]);
    }
    out
}

/// Write the dense `src` (rows × cols) into the n-wide `dst` at (r0, c0).
fn put(
    dst: &mut [f64],
    n: usize,
    (r0, c0): (usize, usize),
    src: &[f64],
    (rows, cols): (usize, usize),
) {
    for i in 0..rows {
        dst[(r0 + i) * n + c0..(r0 + i) * n + c0 + cols]
            .copy_from_slice(&src[i * cols..(i + 1) * cols]);
    }
}

/// a·b (or a·bᵀ with `b_transposed`, b then given as its own rows × cols) in f64.
fn matmul(
    a: &[f64],
    (m, k): (usize, usize),
    b: &[f64],
    (br, bc): (usize, usize),
    b_transposed: bool,
) -> Option<Vec<f64>> {
    use candle_core::{Device, Tensor};
    let ta = Tensor::from_slice(a, (m, k), &Device::Cpu).ok()?;
    let tb = Tensor::from_slice(b, (br, bc), &Device::Cpu).ok()?;
    let tb = if b_transposed { tb.t().ok()? } else { tb };
    ta.matmul(&tb).ok()?.flatten_all().ok()?.to_vec1().ok()
}

/// Σ a[i]·b[i]. The inner loop of both factorisations (n³/3 multiply-adds each), so it runs
/// with AVX2+FMA when the CPU has them (checked once) and as portable code otherwise.
fn dot(a: &[f64], b: &[f64]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX2: OnceLock<bool> = OnceLock::new();
        if *AVX2.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        }) {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_lanes::<false>(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f64], b: &[f64]) -> f64 {
    dot_lanes::<true>(a, b)
}

/// Eight independent accumulators: the compiler vectorises them without reassociating one
/// long chain (two 4-wide FMA chains with AVX2). `FMA` only where the CPU fuses: elsewhere
/// `mul_add` would be a slow library call.
#[inline(always)]
fn dot_lanes<const FMA: bool>(a: &[f64], b: &[f64]) -> f64 {
    const L: usize = 8;
    let n = a.len().min(b.len());
    let mut s = [0.0f64; L];
    for (ca, cb) in a[..n].chunks_exact(L).zip(b[..n].chunks_exact(L)) {
        for k in 0..L {
            s[k] = if FMA {
                ca[k].mul_add(cb[k], s[k])
            } else {
                s[k] + ca[k] * cb[k]
            };
        }
    }
    let mut t: f64 = s.iter().sum();
    for k in n / L * L..n {
        t += a[k] * b[k];
    }
    t
}

/// The upper-triangular U with `H⁻¹ = Uᵀ·U`, the factor GPTQ's error feedback reads row by row.
///
/// Computed without forming H⁻¹: with J the reversal permutation, the lower Cholesky factor C of
/// J·H·J gives `H = R·Rᵀ` with `R = J·C·J` upper triangular, so `H⁻¹ = R⁻ᵀ·R⁻¹` and `U = R⁻¹`.
/// One factorisation and one triangular inverse (⅔n³ flops) instead of three n³/3 steps plus a
/// full inverse. `None` when H is not positive definite.
pub fn inverse_upper_factor(h: &[f64], n: usize) -> Option<Vec<f64>> {
    inverse_upper_factor_owned(h.to_vec(), n)
}

/// [`inverse_upper_factor`] consuming H, so no more than two n×n matrices (plus the blocked
/// steps' quarter-size temporaries) are alive at once: for down_proj's 5632 inputs each one is
/// 254 MB.
pub fn inverse_upper_factor_owned(mut h: Vec<f64>, n: usize) -> Option<Vec<f64>> {
    if h.len() != n * n {
        return None;
    }
    // Reversing the row-major array maps (i, j) to (n-1-i, n-1-j): J·H·J in place.
    h.reverse();
    let c = cholesky_lower(&h, n)?;
    drop(h);
    let mut u = lower_inverse(&c, n)?;
    drop(c);
    // U = R⁻¹ = J·C⁻¹·J: C⁻¹ is lower triangular, so its reversal is upper triangular.
    u.reverse();
    Some(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_spd(n: usize, seed: u64) -> Vec<f64> {
        // X has more rows than columns, so XᵀX is positive definite almost surely.
        let mut state = seed;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64) - 0.5
        };
        let rows = 2 * n + 3;
        let x: Vec<f64> = (0..rows * n).map(|_| next()).collect();
        let mut h = vec![0.0; n * n];
        for r in 0..rows {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += x[r * n + i] * x[r * n + j];
                }
            }
        }
        h
    }

    fn matmul(a: &[f64], b: &[f64], n: usize) -> Vec<f64> {
        let mut c = vec![0.0; n * n];
        for i in 0..n {
            for k in 0..n {
                for j in 0..n {
                    c[i * n + j] += a[i * n + k] * b[k * n + j];
                }
            }
        }
        c
    }

    fn transpose(a: &[f64], n: usize) -> Vec<f64> {
        let mut t = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                t[j * n + i] = a[i * n + j];
            }
        }
        t
    }

    /// Round-off of these factorisations of well-conditioned matrices stays far below this.
    const TOL: f64 = 1e-9;

    #[test]
    fn cholesky_reproduces_the_matrix() {
        // 300 and 517 take the recursive path (halves of odd widths, two levels).
        for n in [1, 2, 5, 17, 40, 300, 517] {
            let h = random_spd(n, n as u64);
            let l = cholesky_lower(&h, n).unwrap();
            let back = matmul(&l, &transpose(&l, n), n);
            for (a, b) in h.iter().zip(&back) {
                assert!((a - b).abs() < TOL * (1.0 + a.abs()), "n={n}: {a} vs {b}");
            }
            for i in 0..n {
                for j in i + 1..n {
                    assert_eq!(l[i * n + j], 0.0);
                }
            }
        }
    }

    #[test]
    fn inverse_factor_inverts() {
        for n in [1, 3, 8, 33, 300] {
            let h = random_spd(n, 7 + n as u64);
            let u = inverse_upper_factor(&h, n).unwrap();
            for i in 0..n {
                for j in 0..i {
                    assert_eq!(u[i * n + j], 0.0, "U must be upper triangular");
                }
            }
            // Uᵀ·U·H = I
            let hinv = matmul(&transpose(&u, n), &u, n);
            let id = matmul(&hinv, &h, n);
            for i in 0..n {
                for j in 0..n {
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!(
                        (id[i * n + j] - want).abs() < 1e-7,
                        "n={n} ({i},{j}): {}",
                        id[i * n + j]
                    );
                }
            }
        }
    }

    #[test]
    fn not_positive_definite_is_none() {
        assert!(cholesky_lower(&[1.0, 2.0, 2.0, 1.0], 2).is_none());
        assert!(inverse_upper_factor(&[0.0], 1).is_none());
    }
}
