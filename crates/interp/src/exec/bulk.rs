//! Bulk copies and fp16 → f32 widening, split across the thread pool when they are large.
//!
//! A decode step of a long cache moves the cache several times outside the projections (the
//! caller's rows into the inputs, each layer's slice, its join with the new rows, widened to
//! f32): hundreds of MB at S = 2,048 on an 8B model, which one thread copies while the others
//! wait. Each function here writes its output once, straight into place (no zeroed buffer
//! first), and gives each thread a share of the work when there is enough of it.

use std::mem::MaybeUninit;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// Elements below which one thread copies (waking the pool costs more than the copy).
const PARALLEL_FROM: usize = 1 << 18;
/// Elements per task: a few hundred KB, in a core's cache.
const CHUNK: usize = 1 << 15;
/// Elements widened at a time through a buffer on the stack (`convert_to_f32_slice` writes
/// initialized f32; the output is not initialized yet).
const STAGE: usize = 512;

/// `out.extend_from_slice(src)`.
pub fn extend_copy<T: Copy + Send + Sync>(out: &mut Vec<T>, src: &[T]) {
    if src.len() < PARALLEL_FROM {
        out.extend_from_slice(src);
        return;
    }
    fill(out, src, |dst, s| {
        let n = dst.len().min(s.len());
        // SAFETY: both ranges hold n elements, and a fresh tail cannot overlap `src`. (libc's
        // memcpy, unlike an element loop, uses the CPU's widest moves.)
        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), dst.as_mut_ptr().cast::<T>(), n) };
    });
}

/// `src` widened to f32 (exactly) and appended to `out`.
pub fn extend_widened(out: &mut Vec<f32>, src: &[f16]) {
    fill(out, src, |dst, s| {
        let mut stage = [0f32; STAGE];
        for (d, s) in dst.chunks_mut(STAGE).zip(s.chunks(STAGE)) {
            let stage = &mut stage[..s.len()];
            s.convert_to_f32_slice(stage);
            for (d, v) in d.iter_mut().zip(stage.iter()) {
                d.write(*v);
            }
        }
    });
}

/// `src.to_vec()`.
pub fn copied<T: Copy + Send + Sync>(src: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(src.len());
    extend_copy(&mut out, src);
    out
}

/// `src` widened to f32.
pub fn widened(src: &[f16]) -> Vec<f32> {
    let mut out = Vec::with_capacity(src.len());
    extend_widened(&mut out, src);
    out
}

/// Append `src.len()` values to `out`, `write(dst, src)` filling every element of each
/// chunk of the new tail from the same chunk of `src`, in parallel when large.
fn fill<S: Sync, T: Send>(
    out: &mut Vec<T>,
    src: &[S],
    write: impl Fn(&mut [MaybeUninit<T>], &[S]) + Sync,
) {
    let n = src.len();
    out.reserve(n);
    let tail = &mut out.spare_capacity_mut()[..n];
    if n < PARALLEL_FROM {
        write(tail, src);
    } else {
        tail.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| write(d, s));
    }
    let len = out.len();
    // SAFETY: `write` initialized every element of the n spare slots (each chunk of the tail
    // is zipped with the chunk of src of the same length, and both callers write each one).
    unsafe { out.set_len(len + n) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_widenings_equal_the_plain_ones_at_every_size() {
        for n in [
            0,
            1,
            511,
            512,
            513,
            PARALLEL_FROM - 1,
            PARALLEL_FROM,
            PARALLEL_FROM + 77,
        ] {
            let h: Vec<f16> = (0..n)
                .map(|i| f16::from_bits((i as u16).wrapping_mul(40_503)))
                .collect();
            let mut plain = vec![0f32; n];
            h.convert_to_f32_slice(&mut plain);
            let want: Vec<u32> = plain.iter().map(|v| v.to_bits()).collect();
            let got: Vec<u32> = widened(&h).iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "n={n}");
            let bits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
            assert_eq!(bits(&copied(&h)), bits(&h), "n={n}");
            let mut out = vec![7.0f32; 3];
            extend_widened(&mut out, &h);
            assert_eq!(out.len(), n + 3);
            assert_eq!(out[..3], [7.0; 3]);
            let x: Vec<i64> = (0..n as i64).collect();
            let mut out = vec![-1i64];
            extend_copy(&mut out, &x);
            assert_eq!(out[1..], x[..], "n={n}");
        }
    }
}
