//! The little dense linear algebra calibrated quantization needs: the upper Cholesky factor
//! of an inverse Hessian, in f64, on matrices up to a few thousand wide.

use rayon::prelude::*;

/// Lower Cholesky factor of the symmetric positive definite `a` (row-major n×n): `a = L·Lᵀ`.
/// `None` when a pivot is not positive (the matrix is not positive definite in f64).
pub fn cholesky_lower(a: &[f64], n: usize) -> Option<Vec<f64>> {
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
        // Entries (i, j) for i > j depend only on rows i and j: rows are independent.
        below.par_chunks_mut(n).enumerate().for_each(|(k, row_i)| {
            let i = j + 1 + k;
            let v = a[i * n + j] - dot(&row_i[..j], &row_j[..j]);
            row_i[j] = v / djj;
        });
    }
    Some(l)
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    // Four accumulators let the compiler vectorise without reassociating one long chain.
    let mut s = [0.0f64; 4];
    let chunks = a.len() / 4;
    for c in 0..chunks {
        for k in 0..4 {
            s[k] += a[c * 4 + k] * b[c * 4 + k];
        }
    }
    let mut t = s[0] + s[1] + s[2] + s[3];
    for k in chunks * 4..a.len() {
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
    let mut flipped = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            flipped[i * n + j] = h[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    let c = cholesky_lower(&flipped, n)?;
    // R = J·C·J, upper: R[i][j] = C[n-1-i][n-1-j].
    // U = R⁻¹ is upper too. Solve R·U = I column by column (back substitution); columns are
    // independent. Store U transposed while solving so each column is contiguous.
    let r = |i: usize, j: usize| c[(n - 1 - i) * n + (n - 1 - j)];
    let mut ut = vec![0.0f64; n * n];
    ut.par_chunks_mut(n).enumerate().for_each(|(col, u)| {
        // U[i][col] = 0 for i > col; back substitution from i = col down to 0.
        u[col] = 1.0 / r(col, col);
        for i in (0..col).rev() {
            // R[i][k] for k = col, col-1, .., i+1 is C's row n-1-i read forwards.
            let base = (n - 1 - i) * n;
            let c_row = &c[base + (n - 1 - col)..base + (n - 1 - i)];
            let s: f64 = c_row
                .iter()
                .zip(u[i + 1..=col].iter().rev())
                .map(|(a, b)| a * b)
                .sum();
            u[i] = -s / r(i, i);
        }
    });
    let mut u = vec![0.0f64; n * n];
    for col in 0..n {
        for i in 0..=col {
            u[i * n + col] = ut[col * n + i];
        }
    }
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

    /// Round-off of an n ≤ 40 factorisation of a well-conditioned matrix stays far below this.
    const TOL: f64 = 1e-9;

    #[test]
    fn cholesky_reproduces_the_matrix() {
        for n in [1, 2, 5, 17, 40] {
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
        for n in [1, 3, 8, 33] {
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
