//! The little dense linear algebra calibrated quantization needs: the upper Cholesky factor
//! of an inverse Hessian, on matrices up to a few thousand wide, in f32 or f64.

use rayon::prelude::*;

/// The element types the factorisations run in: f64 where a factor is checked to tight
/// tolerances, f32 for GPTQ, which reads its factor in f32 anyway.
pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    fn sqrt(self) -> Self;
    fn mul_add(self, a: Self, b: Self) -> Self;
    fn is_finite(self) -> bool;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn mul_add(self, a: Self, b: Self) -> Self {
                <$t>::mul_add(self, a, b)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
        }
    };
}
real!(f32);
real!(f64);

/// Below this width the factorisations and triangular solves run as plain loops; above, they
/// recurse on halves and do the bulk of the work as matrix products (the `gemm` crate,
/// cache-blocked, all cores), in place on strided views of the one n×n matrix.
const BLOCK: usize = 64;

/// Below this many rows the symmetric update is one product over the whole square, the half
/// above the diagonal included (it is never read).
const SYRK_LEAF: usize = 256;

/// A strided view of a row-major matrix: element (i, j) at `ptr + i·rs + j·cs`. Views of
/// one matrix are disjoint wherever a step writes through one and reads another.
struct View<T> {
    ptr: *mut T,
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
}

impl<T> Clone for View<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for View<T> {}

impl<T: Real> View<T> {
    fn of(a: &mut [T], rows: usize, cols: usize) -> Self {
        assert_eq!(a.len(), rows * cols);
        View {
            ptr: a.as_mut_ptr(),
            rows,
            cols,
            rs: cols as isize,
            cs: 1,
        }
    }

    fn t(self) -> Self {
        View {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    fn sub(self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Self {
        debug_assert!(rows.end <= self.rows && cols.end <= self.cols);
        View {
            // SAFETY: the offset stays inside the viewed matrix (checked in debug builds).
            ptr: unsafe {
                self.ptr
                    .offset(rows.start as isize * self.rs + cols.start as isize * self.cs)
            },
            rows: rows.len(),
            cols: cols.len(),
            ..self
        }
    }

    /// # Safety
    /// (i, j) must be inside the view.
    unsafe fn at(&self, i: usize, j: usize) -> *mut T {
        self.ptr.offset(i as isize * self.rs + j as isize * self.cs)
    }

    /// The view copied into a dense row-major buffer.
    fn dense(&self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for i in 0..self.rows {
            // SAFETY: (i, j) is inside the view.
            out.extend((0..self.cols).map(|j| unsafe { *self.at(i, j) }));
        }
        out
    }

    /// Write the dense row-major `src` back, where `keep(i, j)`.
    fn store(&self, src: &[T], keep: impl Fn(usize, usize) -> bool) {
        for i in 0..self.rows {
            for j in 0..self.cols {
                if keep(i, j) {
                    // SAFETY: (i, j) is inside the view.
                    unsafe { *self.at(i, j) = src[i * self.cols + j] };
                }
            }
        }
    }
}

/// `c ← c + beta·a·b`.
///
/// # Safety
/// The shapes must agree, and `c` must not overlap `a` or `b`.
unsafe fn gemm_acc<T: Real>(c: View<T>, a: View<T>, b: View<T>, beta: T) {
    debug_assert!(c.rows == a.rows && c.cols == b.cols && a.cols == b.rows);
    if c.rows == 0 || c.cols == 0 {
        return;
    }
    gemm::gemm(
        c.rows,
        c.cols,
        a.cols,
        c.ptr,
        c.cs,
        c.rs,
        true,
        a.ptr,
        a.cs,
        a.rs,
        b.ptr,
        b.cs,
        b.rs,
        T::ONE,
        beta,
        false,
        false,
        false,
        gemm::Parallelism::Rayon(0),
    );
}

/// `c[.., c_cols] −= a · b[b_rows, b_cols]` in place, on row-major matrices: `c` has rows of
/// `c_stride` elements, `a` is dense [rows, k] (k = `b_rows.len()`), `b` has rows of
/// `b_stride`. GPTQ's lazy-batch update of the columns after a block: one product written
/// into the weights where they lie, with no product or copy allocated (at 8B a block's
/// product is up to 235 MB, fresh pages for every one of down_proj's 112 blocks).
///
/// # Panics
/// If a range or shape falls outside its matrix.
#[allow(clippy::too_many_arguments)]
pub fn sub_product(
    c: &mut [f32],
    c_stride: usize,
    c_cols: std::ops::Range<usize>,
    a: &[f32],
    b: &[f32],
    b_stride: usize,
    b_rows: std::ops::Range<usize>,
    b_cols: std::ops::Range<usize>,
) {
    let k = b_rows.len();
    let rows = a.len().checked_div(k).unwrap_or(0);
    assert!(a.len() == rows * k && c_cols.len() == b_cols.len());
    assert!(c_cols.end <= c_stride && c.len() >= rows * c_stride);
    assert!(b_cols.end <= b_stride && b.len() >= b_rows.end * b_stride);
    if rows == 0 || c_cols.is_empty() {
        return;
    }
    let c = View::of(&mut c[..rows * c_stride], rows, c_stride).sub(0..rows, c_cols);
    let a = View {
        ptr: a.as_ptr().cast_mut(),
        rows,
        cols: k,
        rs: k as isize,
        cs: 1,
    };
    let b = View {
        ptr: b.as_ptr().cast_mut(),
        rows: b.len() / b_stride,
        cols: b_stride,
        rs: b_stride as isize,
        cs: 1,
    }
    .sub(b_rows, b_cols);
    // SAFETY: the shapes agree (checked above), `c` is borrowed mutably so it overlaps
    // neither `a` nor `b`, and gemm only reads through `a` and `b`.
    unsafe { gemm_acc(c, a, b, -1.0) };
}

/// Lower Cholesky factor of the symmetric positive definite `a` (row-major n×n): `a = L·Lᵀ`.
/// Only the lower triangle of `a` is read. `None` when a pivot is not positive (the matrix is
/// not positive definite at T's precision).
pub fn cholesky_lower<T: Real>(a: &[T], n: usize) -> Option<Vec<T>> {
    let mut l = a.to_vec();
    let v = View::of(&mut l, n, n);
    // SAFETY: v views all of l, which lives to the end of this function.
    if !unsafe { cholesky_in_place(v) } {
        return None;
    }
    zero_upper(&mut l, n);
    Some(l)
}

/// With A = [[A11, ·], [A21, A22]]: L11 = chol(A11), L21 = A21·L11⁻ᵀ (a triangular solve),
/// L22 = chol(A22 − L21·L21ᵀ) (the lower half of the update only): n³/3 flops, written over
/// the lower triangle of `a`; the upper triangle is left with garbage.
///
/// # Safety
/// `a` must be a square view of live memory no other view writes meanwhile.
unsafe fn cholesky_in_place<T: Real>(a: View<T>) -> bool {
    let n = a.rows;
    if n <= BLOCK {
        return cholesky_leaf(a);
    }
    let m = n / 2;
    if !cholesky_in_place(a.sub(0..m, 0..m)) {
        return false;
    }
    let a21 = a.sub(m..n, 0..m);
    solve_right(a21, a.sub(0..m, 0..m).t(), false);
    gram_update_lower(a.sub(m..n, m..n), a21, -T::ONE);
    cholesky_in_place(a.sub(m..n, m..n))
}

unsafe fn cholesky_leaf<T: Real>(a: View<T>) -> bool {
    let n = a.rows;
    let mut l = a.dense();
    for j in 0..n {
        // The diagonal entry, then column j below it; rows are contiguous, so each entry is a
        // dot product of two row prefixes.
        let (row_j, below) = l[j * n..].split_at_mut(n);
        let d = row_j[j] - dot(&row_j[..j], &row_j[..j]);
        if d.partial_cmp(&T::ZERO) != Some(std::cmp::Ordering::Greater) {
            return false;
        }
        let djj = d.sqrt();
        row_j[j] = djj;
        let row_j: &[T] = row_j;
        for row_i in below.chunks_mut(n) {
            let v = row_i[j] - dot(&row_i[..j], &row_j[..j]);
            row_i[j] = v / djj;
        }
    }
    a.store(&l, |i, j| j <= i);
    true
}

/// Solve X·T = B for X, over B in place: `x` is B (r×m), `t` the m×m triangular T (lower
/// triangular with `lower`, upper otherwise; only that triangle is read).
///
/// With X = [X1 | X2] and T in halves: lower, X2·T22 = B2 first, then X1·T11 = B1 − X2·T21;
/// upper, X1·T11 = B1 first, then X2·T22 = B2 − X1·T12.
///
/// # Safety
/// `x` and `t` must be views of live memory that do not overlap.
unsafe fn solve_right<T: Real>(x: View<T>, t: View<T>, lower: bool) {
    let m = t.rows;
    if m <= BLOCK {
        return solve_right_leaf(x, t, lower);
    }
    let h = m / 2;
    let r = x.rows;
    let (x1, x2) = (x.sub(0..r, 0..h), x.sub(0..r, h..m));
    let (t11, t22) = (t.sub(0..h, 0..h), t.sub(h..m, h..m));
    if lower {
        solve_right(x2, t22, true);
        gemm_acc(x1, x2, t.sub(h..m, 0..h), -T::ONE);
        solve_right(x1, t11, true);
    } else {
        solve_right(x1, t11, false);
        gemm_acc(x2, x1, t.sub(0..h, h..m), -T::ONE);
        solve_right(x2, t22, false);
    }
}

/// The solve row by row, each row a substitution over T's columns (copied contiguous).
unsafe fn solve_right_leaf<T: Real>(x: View<T>, t: View<T>, lower: bool) {
    let (r, m) = (x.rows, t.rows);
    // Column j of T as row j of tc.
    let tc = t.t().dense();
    let mut b = x.dense();
    b.par_chunks_mut(m.max(1)).for_each(|row| {
        // Σ_k x_k·T[k][j] = b_j, where T[k][j] is zero above (lower) or below (upper) j.
        let col = |j: usize| &tc[j * m..(j + 1) * m];
        if lower {
            for j in (0..m).rev() {
                let s = dot(&row[j + 1..], &col(j)[j + 1..]);
                row[j] = (row[j] - s) / col(j)[j];
            }
        } else {
            for j in 0..m {
                let s = dot(&row[..j], &col(j)[..j]);
                row[j] = (row[j] - s) / col(j)[j];
            }
        }
    });
    debug_assert_eq!(b.len(), r * m);
    x.store(&b, |_, _| true);
}

/// The lower triangle of `c ← c − x·xᵀ` (x r×m): with x's rows split [x1; x2], the blocks
/// x1·x1ᵀ, x2·x1ᵀ and x2·x2ᵀ, the upper right one never formed.
///
/// # Safety
/// `c` and `x` must be views of live memory that do not overlap.
unsafe fn gram_update_lower<T: Real>(c: View<T>, x: View<T>, beta: T) {
    let r = c.rows;
    if r <= SYRK_LEAF {
        return gemm_acc(c, x, x.t(), beta);
    }
    let h = r / 2;
    let k = x.cols;
    let (x1, x2) = (x.sub(0..h, 0..k), x.sub(h..r, 0..k));
    gram_update_lower(c.sub(0..h, 0..h), x1, beta);
    gemm_acc(c.sub(h..r, 0..h), x2, x1.t(), beta);
    gram_update_lower(c.sub(h..r, h..r), x2, beta);
}

/// Inverse of the lower-triangular `l` (row-major n×n, non-zero diagonal), lower too.
pub fn lower_inverse<T: Real>(l: &[T], n: usize) -> Option<Vec<T>> {
    let mut x = l.to_vec();
    zero_upper(&mut x, n);
    let v = View::of(&mut x, n, n);
    // SAFETY: v views all of x, which lives to the end of this function.
    unsafe { lower_inverse_in_place(v) };
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// With L = [[A, 0], [B, D]]: L⁻¹ = [[A⁻¹, 0], [−D⁻¹·B·A⁻¹, D⁻¹]]. B becomes D⁻¹·B and then
/// (D⁻¹·B)·A⁻¹ by two triangular solves against the A and D not yet inverted, then A and D
/// are inverted in place: n³/3 flops. Only the lower triangle is read or written.
///
/// # Safety
/// `l` must be a square view of live memory no other view writes meanwhile.
unsafe fn lower_inverse_in_place<T: Real>(l: View<T>) {
    let n = l.rows;
    if n <= BLOCK {
        let x = lower_inverse_unblocked(&l.dense(), n);
        l.store(&x, |i, j| j <= i);
        return;
    }
    let m = n / 2;
    let (a, b, d) = (l.sub(0..m, 0..m), l.sub(m..n, 0..m), l.sub(m..n, m..n));
    // D·Y = B is Yᵀ·Dᵀ = Bᵀ, Dᵀ upper triangular.
    solve_right(b.t(), d.t(), false);
    solve_right(b, a, true);
    for i in 0..b.rows {
        for j in 0..b.cols {
            *b.at(i, j) = -*b.at(i, j);
        }
    }
    lower_inverse_in_place(a);
    lower_inverse_in_place(d);
}

fn zero_upper<T: Real>(a: &mut [T], n: usize) {
    for (i, row) in a.chunks_mut(n).enumerate() {
        row[i + 1..].iter_mut().for_each(|v| *v = T::ZERO);
    }
}

fn lower_inverse_unblocked<T: Real>(l: &[T], n: usize) -> Vec<T> {
    // Column j of X = L⁻¹ by forward substitution, stored as row j of Xᵀ (contiguous):
    // X[i][j] = −(Σ_{k=j}^{i−1} L[i][k]·X[k][j]) / L[i][i].
    let mut xt = vec![T::ZERO; n * n];
    xt.par_chunks_mut(n).enumerate().for_each(|(j, col)| {
        col[j] = T::ONE / l[j * n + j];
        for i in j + 1..n {
            let s = dot(&l[i * n + j..i * n + i], &col[j..i]);
            col[i] = -s / l[i * n + i];
        }
    });
    let mut x = vec![T::ZERO; n * n];
    for j in 0..n {
        for i in j..n {
            x[i * n + j] = xt[j * n + i];
        }
    }
    x
}

/// Σ a[i]·b[i]. The inner loop of both factorisations (n³/3 multiply-adds each), so it runs
/// with AVX2+FMA when the process's instruction-set level ([`crate::isa::selected`])
/// includes them, and as portable code otherwise.
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::selected() >= crate::isa::Isa::Avx2 {
        // SAFETY: the selected level is one the CPU has, and it includes AVX2 and FMA.
        return unsafe { dot_avx2(a, b) };
    }
    dot_lanes::<T, false>(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2<T: Real>(a: &[T], b: &[T]) -> T {
    dot_lanes::<T, true>(a, b)
}

/// Eight independent accumulators: the compiler vectorises them without reassociating one
/// long chain (two 4-wide FMA chains with AVX2). `FMA` only where the CPU fuses: elsewhere
/// `mul_add` would be a slow library call.
#[inline(always)]
fn dot_lanes<T: Real, const FMA: bool>(a: &[T], b: &[T]) -> T {
    const L: usize = 8;
    let n = a.len().min(b.len());
    let mut s = [T::ZERO; L];
    for (ca, cb) in a[..n].chunks_exact(L).zip(b[..n].chunks_exact(L)) {
        for k in 0..L {
            s[k] = if FMA {
                ca[k].mul_add(cb[k], s[k])
            } else {
                s[k] + ca[k] * cb[k]
            };
        }
    }
    let mut t = s.iter().fold(T::ZERO, |a, &b| a + b);
    for k in n / L * L..n {
        t = t + a[k] * b[k];
    }
    t
}

/// The upper-triangular U with `H⁻¹ = Uᵀ·U`, the factor GPTQ's error feedback reads row by row.
///
/// Computed without forming H⁻¹: with J the reversal permutation, the lower Cholesky factor C of
/// J·H·J gives `H = R·Rᵀ` with `R = J·C·J` upper triangular, so `H⁻¹ = R⁻ᵀ·R⁻¹` and `U = R⁻¹`.
/// One factorisation and one triangular inverse (⅔n³ flops) instead of three n³/3 steps plus a
/// full inverse. `None` when H is not positive definite.
pub fn inverse_upper_factor<T: Real>(h: &[T], n: usize) -> Option<Vec<T>> {
    inverse_upper_factor_owned(h.to_vec(), n)
}

/// [`inverse_upper_factor`] consuming H: both steps work in place on H's own buffer, so one
/// n×n matrix is alive (for down_proj's 8192 inputs, 537 MB), and no copy is made.
pub fn inverse_upper_factor_owned<T: Real>(mut h: Vec<T>, n: usize) -> Option<Vec<T>> {
    if h.len() != n * n {
        return None;
    }
    // Reversing the row-major array maps (i, j) to (n-1-i, n-1-j): J·H·J in place.
    h.reverse();
    let v = View::of(&mut h, n, n);
    // SAFETY: v views all of h, which lives to the end of this function; each step works on
    // the one matrix in place.
    unsafe {
        if !cholesky_in_place(v) {
            return None;
        }
        lower_inverse_in_place(v);
    }
    // C⁻¹ is lower triangular: the garbage the factorisation left above the diagonal goes.
    zero_upper(&mut h, n);
    if !h.iter().all(|v| v.is_finite()) {
        return None;
    }
    // U = R⁻¹ = J·C⁻¹·J: C⁻¹ is lower triangular, so its reversal is upper triangular.
    h.reverse();
    Some(h)
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
    fn the_triangular_inverse_inverts() {
        for n in [1, 4, 129, 300, 517] {
            let l = cholesky_lower(&random_spd(n, 3 + n as u64), n).unwrap();
            let x = lower_inverse(&l, n).unwrap();
            let id = matmul(&x, &l, n);
            for i in 0..n {
                for j in 0..n {
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((id[i * n + j] - want).abs() < 1e-9, "n={n} ({i},{j})");
                    if j > i {
                        assert_eq!(x[i * n + j], 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn the_block_update_subtracts_the_product_in_place() {
        let (rows, cs, k, bs) = (5, 9, 3, 7);
        let c0: Vec<f32> = (0..rows * cs).map(|i| (i % 11) as f32 - 5.0).collect();
        let a: Vec<f32> = (0..rows * k).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
        let b: Vec<f32> = (0..6 * bs).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut c = c0.clone();
        sub_product(&mut c, cs, 4..8, &a, &b, bs, 2..5, 1..5);
        for r in 0..rows {
            for j in 0..cs {
                let want = if (4..8).contains(&j) {
                    let dot: f32 = (0..k)
                        .map(|t| a[r * k + t] * b[(2 + t) * bs + 1 + j - 4])
                        .sum();
                    c0[r * cs + j] - dot
                } else {
                    c0[r * cs + j]
                };
                assert_eq!(c[r * cs + j], want, "({r}, {j})");
            }
        }
    }

    #[test]
    fn not_positive_definite_is_none() {
        assert!(cholesky_lower(&[1.0, 2.0, 2.0, 1.0], 2).is_none());
        assert!(inverse_upper_factor(&[0.0], 1).is_none());
    }
}
