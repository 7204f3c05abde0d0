//! Comparing two models' logits over the same tokens: KL(ref‖pkg), top-k agreement,
//! perplexity, largest logit difference. Probabilities are formed in f64 with a max-shifted
//! log-sum-exp, so neither large logits nor long vocabularies lose precision.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Inputs that cannot be compared.
#[derive(Debug, Error, PartialEq)]
pub enum MetricError {
    #[error("logit rows differ in length at position {position}: reference {reference}, package {package}")]
    RowLength {
        position: usize,
        reference: usize,
        package: usize,
    },
    #[error("{reference} reference rows but {package} package rows")]
    RowCount { reference: usize, package: usize },
    #[error("{rows} logit rows for {tokens} tokens: need one row per token")]
    TokenCount { rows: usize, tokens: usize },
    #[error("token {token} at position {position} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        token: u32,
        position: usize,
        vocab: usize,
    },
    #[error("empty logit row")]
    Empty,
    #[error("the reference's logits at position {position} are not finite")]
    ReferenceNotFinite { position: usize },
}

/// log-softmax of a row in f64. Non-finite inputs propagate (a NaN logit gives NaN).
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}

fn all_finite(row: &[f32]) -> bool {
    row.iter().all(|v| v.is_finite())
}

/// KL(p_ref ‖ p_pkg) in nats. A package row with any non-finite logit has diverged: +∞.
pub fn kl_divergence(reference: &[f32], package: &[f32]) -> Result<f64, MetricError> {
    check_row(0, reference, package)?;
    if !all_finite(reference) {
        return Err(MetricError::ReferenceNotFinite { position: 0 });
    }
    Ok(kl_rows(reference, package))
}

fn kl_rows(reference: &[f32], package: &[f32]) -> f64 {
    if !all_finite(package) {
        return f64::INFINITY;
    }
    let lp = log_softmax(reference);
    let lq = log_softmax(package);
    let kl: f64 = lp
        .iter()
        .zip(&lq)
        .map(|(&a, &b)| {
            if a == f64::NEG_INFINITY {
                0.0
            } else {
                a.exp() * (a - b)
            }
        })
        .sum();
    // Rounding can leave a tiny negative for identical distributions; KL is never negative.
    kl.max(0.0)
}

fn check_row(position: usize, reference: &[f32], package: &[f32]) -> Result<(), MetricError> {
    if reference.is_empty() {
        return Err(MetricError::Empty);
    }
    if reference.len() != package.len() {
        return Err(MetricError::RowLength {
            position,
            reference: reference.len(),
            package: package.len(),
        });
    }
    Ok(())
}

/// Indices of the k largest values, largest first (ties: lower index first; NaN last).
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    let key = |i: usize| {
        if row[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            row[i]
        }
    };
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx
}

/// |top-k(a) ∩ top-k(b)| / k.
pub fn top_k_overlap(a: &[f32], b: &[f32], k: usize) -> f64 {
    let ta = top_k(a, k);
    let tb = top_k(b, k);
    if ta.is_empty() {
        return 0.0;
    }
    ta.iter().filter(|i| tb.contains(i)).count() as f64 / ta.len() as f64
}

/// Largest |a_i − b_i| (∞ when either side is non-finite where the other is not).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let d = (x as f64 - y as f64).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                d
            }
        })
        .fold(0.0, f64::max)
}

/// Perplexity of `tokens` under next-token logit rows: row t predicts tokens[t + 1], so T
/// rows score T − 1 tokens. ∞ if any scored row is non-finite.
pub fn perplexity(rows: &[Vec<f32>], tokens: &[u32]) -> Result<f64, MetricError> {
    if rows.len() != tokens.len() {
        return Err(MetricError::TokenCount {
            rows: rows.len(),
            tokens: tokens.len(),
        });
    }
    if tokens.len() < 2 {
        return Ok(f64::NAN);
    }
    let mut nll = 0.0;
    for t in 0..tokens.len() - 1 {
        let next = tokens[t + 1];
        let row = &rows[t];
        if next as usize >= row.len() {
            return Err(MetricError::TokenOutOfRange {
                token: next,
                position: t + 1,
                vocab: row.len(),
            });
        }
        if !all_finite(row) {
            return Ok(f64::INFINITY);
        }
        nll -= log_softmax(row)[next as usize];
    }
    Ok((nll / (tokens.len() - 1) as f64).exp())
}

/// The behaviour comparison of `validate` (c).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogitComparison {
    pub positions: usize,
    pub kl_mean: f64,
    pub kl_max: f64,
    /// Position of the largest KL.
    pub kl_argmax: usize,
    /// Fraction of positions whose argmax agrees.
    pub top1: f64,
    /// Mean |top-5 ∩ top-5| / 5.
    pub top5: f64,
    pub ppl_reference: f64,
    pub ppl_package: f64,
    /// ppl_package / ppl_reference.
    pub ppl_ratio: f64,
    pub max_abs_dlogit: f64,
    /// Package rows holding inf or NaN.
    pub nonfinite_rows: usize,
    /// KL per position (for plots and for finding where a package goes wrong).
    pub kl: Vec<f64>,
}

/// Compare the rows of a reference and a package fed the same `tokens` (row t follows
/// tokens[..=t]).
pub fn compare_logits(
    reference: &[Vec<f32>],
    package: &[Vec<f32>],
    tokens: &[u32],
) -> Result<LogitComparison, MetricError> {
    if reference.len() != package.len() {
        return Err(MetricError::RowCount {
            reference: reference.len(),
            package: package.len(),
        });
    }
    if reference.is_empty() {
        return Err(MetricError::Empty);
    }
    let mut kl = Vec::with_capacity(reference.len());
    let (mut top1, mut top5, mut dmax, mut nonfinite) = (0usize, 0.0f64, 0.0f64, 0usize);
    for (t, (r, p)) in reference.iter().zip(package).enumerate() {
        check_row(t, r, p)?;
        if !all_finite(r) {
            return Err(MetricError::ReferenceNotFinite { position: t });
        }
        if !all_finite(p) {
            nonfinite += 1;
        }
        kl.push(kl_rows(r, p));
        if top_k(r, 1) == top_k(p, 1) {
            top1 += 1;
        }
        top5 += top_k_overlap(r, p, 5);
        dmax = dmax.max(max_abs_diff(r, p));
    }
    let n = reference.len() as f64;
    let (kl_argmax, kl_max) = kl.iter().copied().enumerate().fold(
        (0, 0.0f64),
        |(bi, bv), (i, v)| if v > bv { (i, v) } else { (bi, bv) },
    );
    let ppl_reference = perplexity(reference, tokens)?;
    let ppl_package = perplexity(package, tokens)?;
    Ok(LogitComparison {
        positions: reference.len(),
        kl_mean: kl.iter().sum::<f64>() / n,
        kl_max,
        kl_argmax,
        top1: top1 as f64 / n,
        top5: top5 / n,
        ppl_reference,
        ppl_package,
        ppl_ratio: ppl_package / ppl_reference,
        max_abs_dlogit: dmax,
        nonfinite_rows: nonfinite,
        kl,
    })
}

/// How well a decoded weight tensor matches its checkpoint tensor (`validate` (b)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightError {
    pub tensor: String,
    /// 10·log10(Σw² / Σ(w − ŵ)²); +∞ when identical.
    pub snr_db: f64,
    pub max_abs_error: f64,
}

impl WeightError {
    /// Compare `decoded` against `original` (same length; extra values on either side are
    /// compared as far as both go and make the result +∞ error).
    pub fn measure(tensor: &str, original: &[f32], decoded: &[f32]) -> Self {
        let mut sum = ErrorSum::default();
        sum.add(original, decoded);
        if original.len() != decoded.len() {
            sum.noise = f64::NAN;
        }
        sum.finish(tensor)
    }
}

/// [`WeightError::measure`] a piece at a time (the same sums in the same order): `add` the
/// pieces in order, then `finish`.
#[derive(Debug, Default, Clone, Copy)]
pub struct ErrorSum {
    signal: f64,
    noise: f64,
    max_err: f64,
}

impl ErrorSum {
    /// The next piece of the original and the decoded tensor (compared as far as both go).
    pub fn add(&mut self, original: &[f32], decoded: &[f32]) {
        for (&w, &q) in original.iter().zip(decoded) {
            let e = w as f64 - q as f64;
            self.signal += (w as f64) * (w as f64);
            self.noise += e * e;
            let err = if e.is_nan() { f64::INFINITY } else { e.abs() };
            self.max_err = self.max_err.max(err);
        }
    }

    pub fn finish(self, tensor: &str) -> WeightError {
        if self.noise.is_nan() {
            return WeightError {
                tensor: tensor.to_string(),
                snr_db: f64::NEG_INFINITY,
                max_abs_error: f64::INFINITY,
            };
        }
        let snr_db = if self.noise == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (self.signal / self.noise).log10()
        };
        WeightError {
            tensor: tensor.to_string(),
            snr_db,
            max_abs_error: self.max_err,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 accumulation over a few hundred terms: anything above this is a real difference.
    const EXACT: f64 = 1e-12;

    #[test]
    fn kl_of_identical_rows_is_zero() {
        let r = vec![1.0, -2.0, 3.5, 0.25, 100.0];
        assert!(kl_divergence(&r, &r).unwrap().abs() < EXACT);
        // Softmax is shift-invariant, so is KL.
        let shifted: Vec<f32> = r.iter().map(|v| v + 7.0).collect();
        assert!(kl_divergence(&r, &shifted).unwrap() < 1e-9);
    }

    #[test]
    fn kl_known_value() {
        // p = softmax(0, 0) = (1/2, 1/2), q = softmax(ln 3, 0) = (3/4, 1/4):
        // KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
        let kl = kl_divergence(&[0.0, 0.0], &[3f32.ln(), 0.0]).unwrap();
        assert!((kl - 0.5 * (4.0f64 / 3.0).ln()).abs() < 1e-7, "{kl}");
    }

    #[test]
    fn kl_is_asymmetric_and_nonnegative() {
        let a = [2.0, 0.0, -1.0];
        let b = [0.0, 1.0, 0.5];
        let ab = kl_divergence(&a, &b).unwrap();
        let ba = kl_divergence(&b, &a).unwrap();
        assert!(ab > 0.0 && ba > 0.0 && (ab - ba).abs() > 1e-3);
    }

    #[test]
    fn nonfinite_package_row_is_infinite_divergence() {
        assert_eq!(
            kl_divergence(&[1.0, 2.0], &[f32::INFINITY, 2.0]).unwrap(),
            f64::INFINITY
        );
        assert_eq!(
            kl_divergence(&[1.0, 2.0], &[f32::NAN, 2.0]).unwrap(),
            f64::INFINITY
        );
        assert!(matches!(
            kl_divergence(&[f32::NAN, 2.0], &[1.0, 2.0]),
            Err(MetricError::ReferenceNotFinite { .. })
        ));
    }

    #[test]
    fn large_logits_keep_precision() {
        // Naive exp would overflow at 1e4.
        let kl = kl_divergence(&[1e4, 1e4 - 1.0], &[1e4, 1e4 - 1.0]).unwrap();
        assert!(kl.abs() < EXACT);
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        assert!(matches!(
            kl_divergence(&[1.0, 2.0], &[1.0]),
            Err(MetricError::RowLength { .. })
        ));
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_index() {
        let r = [0.5, 3.0, 3.0, -1.0, 2.0];
        assert_eq!(top_k(&r, 3), vec![1, 2, 4]);
        assert_eq!(top_k(&r, 10).len(), 5);
        assert_eq!(top_k_overlap(&r, &[0.0, 0.0, 9.0, 0.0, 8.0], 2), 0.5);
    }

    #[test]
    fn perplexity_of_uniform_is_vocab_size() {
        let rows = vec![vec![0.0f32; 8]; 4];
        let p = perplexity(&rows, &[0, 3, 5, 7]).unwrap();
        assert!((p - 8.0).abs() < 1e-9, "{p}");
    }

    #[test]
    fn perplexity_of_a_sure_model_is_one() {
        let mut rows = vec![vec![-1e4f32; 4]; 3];
        rows[0][2] = 0.0;
        rows[1][1] = 0.0;
        let p = perplexity(&rows, &[0, 2, 1]).unwrap();
        assert!((p - 1.0).abs() < 1e-9, "{p}");
        assert!(matches!(
            perplexity(&rows, &[0, 9, 1]),
            Err(MetricError::TokenOutOfRange { token: 9, .. })
        ));
    }

    #[test]
    fn compare_identical_sequences() {
        let rows: Vec<Vec<f32>> = (0..6)
            .map(|t| {
                (0..10)
                    .map(|v| ((t * 7 + v * 3) % 11) as f32 * 0.3)
                    .collect()
            })
            .collect();
        let tokens = [1, 2, 3, 4, 5, 6];
        let c = compare_logits(&rows, &rows, &tokens).unwrap();
        assert_eq!(c.top1, 1.0);
        assert_eq!(c.top5, 1.0);
        assert!(c.kl_mean < EXACT && c.kl_max < EXACT);
        assert_eq!(c.max_abs_dlogit, 0.0);
        assert!((c.ppl_ratio - 1.0).abs() < EXACT);
        assert_eq!(c.nonfinite_rows, 0);
    }

    #[test]
    fn compare_counts_disagreements() {
        let reference = vec![vec![1.0, 0.0, 0.0], vec![0.0, 1.0, 0.0]];
        let package = vec![vec![1.0, 0.0, 0.0], vec![0.0, 0.0, 1.0]];
        let c = compare_logits(&reference, &package, &[0, 1]).unwrap();
        assert_eq!(c.top1, 0.5);
        assert_eq!(c.kl_argmax, 1);
        assert_eq!(c.max_abs_dlogit, 1.0);
        assert!(c.kl[0] < EXACT && c.kl[1] > 0.1);
    }

    #[test]
    fn weight_error_snr() {
        let w = [1.0f32, -1.0, 1.0, -1.0];
        let q = [1.1f32, -1.0, 0.9, -1.0];
        let e = WeightError::measure("w", &w, &q);
        // signal 4, noise 0.02 → 10·log10(200)
        assert!(
            (e.snr_db - 10.0 * 200f64.log10()).abs() < 1e-4,
            "{}",
            e.snr_db
        );
        assert!((e.max_abs_error - 0.1).abs() < 1e-6);
        assert_eq!(WeightError::measure("w", &w, &w).snr_db, f64::INFINITY);
        assert_eq!(
            WeightError::measure("w", &w, &q[..3]).snr_db,
            f64::NEG_INFINITY
        );
    }
}
