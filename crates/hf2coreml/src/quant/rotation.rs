//! The input rotation of calibrated palettization ([`Rotation`]): projections fitted on
//! rotated inputs (x·Q) spread outlier channels over all channels, which a LUT fits better. The
//! fit rotates the weights and their Gram matrix ([`crate::quant::calibrate`]); the graph applies
//! the same Q to the projection's input in its factored form.

use rayon::prelude::*;

/// The randomized block-Hadamard rotation of `n` input channels behind
/// [`LinearMethod::rotate`](crate::quant::calibrate::LinearMethod::rotate): Q = D·(I_m ⊗ H_b/√b)·(M ⊗ I_b), D a fixed ±1 diagonal, b the
/// largest power of two dividing n (up to 512), M a random orthogonal [m, m], m = n / b.
///
/// The graph applies it in this factored form (a `mul` by the signs, a `linear` by H_b/√b on
/// [.., m, b], a `matmul` by Mᵀ): n·(b + m) multiply-adds per token instead of n² for the
/// dense Q, and three small constants (n + b² + m² values) instead of an n×n one.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotation {
    /// D's diagonal, ±1.
    pub signs: Vec<f32>,
    /// b: the Walsh-Hadamard block size.
    pub block: usize,
    /// An orthogonal [m, m] mixing the m = n / block blocks (row-major): position j of every
    /// block goes through it, so the rotation mixes all n channels, not only within blocks.
    pub mix: Vec<f32>,
}

impl Rotation {
    /// b for `n` channels: the largest power of two dividing n, at most 512.
    pub fn block_for(n: usize) -> usize {
        let mut block = 1;
        while n.is_multiple_of(block * 2) && block < 512 {
            block *= 2;
        }
        block
    }

    /// Values the graph stores for the rotation of `n` channels: D's signs [n], H_b [b, b]
    /// and, when there is more than one block, the mix [m, m].
    pub fn constant_values(n: usize) -> u64 {
        let b = Self::block_for(n) as u64;
        let m = n as u64 / b;
        n as u64 + b * b + if m > 1 { m * m } else { 0 }
    }
    /// The rotation of `n` channels (deterministic: seeded by n).
    pub fn new(n: usize) -> Self {
        let block = Self::block_for(n);
        let mut rng = crate::util::SplitMix64(0x5eed ^ n as u64);
        let signs = (0..n)
            .map(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 })
            .collect();
        let m = n / block;
        // A random orthogonal matrix: Gram-Schmidt on Gaussian rows.
        let mut mix: Vec<f64> = (0..m * m).map(|_| rng.normal() as f64).collect();
        for i in 0..m {
            for k in 0..i {
                let d: f64 = (0..m).map(|j| mix[i * m + j] * mix[k * m + j]).sum();
                for j in 0..m {
                    mix[i * m + j] -= d * mix[k * m + j];
                }
            }
            let norm = (0..m).map(|j| mix[i * m + j].powi(2)).sum::<f64>().sqrt();
            for j in 0..m {
                mix[i * m + j] /= norm;
            }
        }
        // One block: nothing to mix (M = [1], not a random ±1).
        let mix = if m < 2 {
            vec![1.0]
        } else {
            mix.into_iter().map(|v| v as f32).collect()
        };
        Rotation { signs, block, mix }
    }

    /// v ← v·(M ⊗ I_b) (or Mᵀ with `transpose`) on the m blocks of v.
    fn mix_blocks(&self, v: &mut [f32], transpose: bool) {
        let (b, m) = (self.block, v.len() / self.block);
        if m < 2 {
            return;
        }
        // Output block `out` = Σ_k v_k·M[k][out] (Mᵀ: M[out][k]), a whole block at a time.
        let src = v.to_vec();
        for (out, dst) in v.chunks_exact_mut(b).enumerate() {
            dst.fill(0.0);
            for (k, block) in src.chunks_exact(b).enumerate() {
                let e = if transpose {
                    self.mix[out * m + k]
                } else {
                    self.mix[k * m + out]
                };
                dst.iter_mut().zip(block).for_each(|(d, &x)| *d += e * x);
            }
        }
    }

    /// H_b/√b, [b, b] row-major (symmetric): the weight of the `linear` that rotates each
    /// block.
    pub fn hadamard_matrix(&self) -> Vec<f32> {
        let b = self.block;
        let mut h = vec![0.0f32; b * b];
        for i in 0..b {
            h[i * b + i] = 1.0;
        }
        for row in h.chunks_mut(b) {
            self.hadamard(row);
        }
        h
    }

    /// Mᵀ, [m, m] row-major: `matmul(Mᵀ, z)` on z [.., m, b] computes z·(M ⊗ I_b).
    pub fn mix_transpose(&self) -> Vec<f32> {
        let m = self.signs.len() / self.block;
        let mut t = vec![0.0f32; m * m];
        for i in 0..m {
            for j in 0..m {
                t[j * m + i] = self.mix[i * m + j];
            }
        }
        t
    }

    /// In-place orthonormal Walsh-Hadamard transform of each block of `v`.
    fn hadamard(&self, v: &mut [f32]) {
        let b = self.block;
        let norm = 1.0 / (b as f32).sqrt();
        for chunk in v.chunks_mut(b) {
            let mut h = 1;
            while h < b {
                for pair in chunk.chunks_exact_mut(2 * h) {
                    let (lo, hi) = pair.split_at_mut(h);
                    for (x, y) in lo.iter_mut().zip(hi.iter_mut()) {
                        (*x, *y) = (*x + *y, *x - *y);
                    }
                }
                h *= 2;
            }
            chunk.iter_mut().for_each(|x| *x *= norm);
        }
    }

    /// w·Q for each row of w [rows, n].
    pub(super) fn rotate_rows(&self, w: &mut [f32]) {
        let n = self.signs.len();
        w.par_chunks_mut(n).for_each(|row| {
            row.iter_mut().zip(&self.signs).for_each(|(x, s)| *x *= s);
            self.hadamard(row);
            self.mix_blocks(row, false);
        });
    }

    /// w·Qᵀ for each row of w [rows, n] (the inverse of [`Rotation::rotate_rows`]).
    pub(super) fn unrotate_rows(&self, w: &mut [f32]) {
        let n = self.signs.len();
        w.par_chunks_mut(n).for_each(|row| {
            self.mix_blocks(row, true);
            self.hadamard(row);
            row.iter_mut().zip(&self.signs).for_each(|(x, s)| *x *= s);
        });
    }

    /// G ← Qᵀ·G·Q for a symmetric G [n, n] (the Gram matrix of the rotated inputs x·Q), in
    /// place: beside G only one f32 copy of it is held.
    pub(super) fn rotate_gram_in_place(&self, g: &mut [f64]) {
        let n = self.signs.len();
        let mut m: Vec<f32> = g.iter().map(|&v| v as f32).collect();
        // (G·Q) row by row, then Qᵀ·(G·Q) = ((G·Q)ᵀ·Q)ᵀ: G·Q is not symmetric, transpose.
        self.rotate_rows(&mut m);
        transpose_in_place(&mut m, n);
        self.rotate_rows(&mut m);
        for i in 0..n {
            for j in 0..n {
                g[i * n + j] = m[j * n + i] as f64;
            }
        }
    }
}

/// Transpose a square [n, n] row-major matrix in place.
fn transpose_in_place(m: &mut [f32], n: usize) {
    for i in 0..n {
        for j in i + 1..n {
            m.swap(i * n + j, j * n + i);
        }
    }
}

/// Qᵀ of the input rotation of `n` channels, [n, n] row-major: the weight of a `linear` that
/// maps x to x·Q (the dense form of [`Rotation`]).
pub fn rotation_transpose(n: usize) -> Vec<f32> {
    let r = Rotation::new(n);
    let mut q = vec![0.0f32; n * n];
    for i in 0..n {
        q[i * n + i] = 1.0;
    }
    r.rotate_rows(&mut q);
    let mut t = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            t[j * n + i] = q[i * n + j];
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rotation is orthogonal, its inverse undoes it, and the rotated Gram matrix is the
    /// Gram matrix of the rotated inputs.
    #[test]
    fn rotation_is_orthogonal_and_rotates_the_gram_matrix() {
        let mut rng = crate::util::SplitMix64(3);
        for n in [12, 64, 96] {
            let r = Rotation::new(n);
            let t = 7;
            let x: Vec<f32> = (0..t * n).map(|_| rng.normal()).collect();
            let mut xr = x.clone();
            r.rotate_rows(&mut xr);
            let norm = |v: &[f32]| v.iter().map(|a| (a * a) as f64).sum::<f64>();
            assert!((norm(&x) - norm(&xr)).abs() < 1e-3 * norm(&x));
            let mut back = xr.clone();
            r.unrotate_rows(&mut back);
            assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() < 1e-5));
            let gram = |v: &[f32]| -> Vec<f64> {
                let mut g = vec![0.0f64; n * n];
                for row in v.chunks(n) {
                    for i in 0..n {
                        for j in 0..n {
                            g[i * n + j] += (row[i] * row[j]) as f64;
                        }
                    }
                }
                g
            };
            let want = gram(&xr);
            let mut got = gram(&x);
            r.rotate_gram_in_place(&mut got);
            assert!(want.iter().zip(&got).all(|(a, b)| (a - b).abs() < 1e-3));
        }
    }

    /// The graph's factored form — signs, H_b/√b on each block, Mᵀ·[m, b] — is x·Q, and the
    /// dense Qᵀ agrees with it.
    #[test]
    fn factored_rotation_is_the_dense_one() {
        let mut rng = crate::util::SplitMix64(8);
        for n in [64, 96, 576, 1536] {
            let r = Rotation::new(n);
            let (b, m) = (r.block, n / r.block);
            let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let mut want = x.clone();
            r.rotate_rows(&mut want);
            // mul by the signs, linear by H (y = z·Hᵀ) on each block, matmul(Mᵀ, z).
            let h = r.hadamard_matrix();
            let z: Vec<f32> = (0..n)
                .map(|o| {
                    let (blk, j) = (o / b, o % b);
                    (0..b)
                        .map(|k| x[blk * b + k] * r.signs[blk * b + k] * h[j * b + k])
                        .sum()
                })
                .collect();
            let mt = r.mix_transpose();
            let got: Vec<f32> = (0..n)
                .map(|o| {
                    let (row, j) = (o / b, o % b);
                    (0..m).map(|k| mt[row * m + k] * z[k * b + j]).sum()
                })
                .collect();
            let qt = rotation_transpose(n);
            let dense: Vec<f32> = (0..n)
                .map(|o| (0..n).map(|k| qt[o * n + k] * x[k]).sum())
                .collect();
            for ((a, g), d) in want.iter().zip(&got).zip(&dense) {
                assert!((a - g).abs() < 1e-4, "n={n}: {a} vs {g}");
                assert!((a - d).abs() < 1e-4, "n={n}: {a} vs {d}");
            }
        }
    }
}
