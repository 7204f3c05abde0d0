//! Comparing a package's logits with a reference's.

/// The index of the largest value.
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

/// Whether the token `got` picks is the reference's, or one the reference scores within `tie`
/// of its best: two tokens that close are a tie the reference itself does not decide past its
/// own rounding (transformers' fixtures of random weights hold a few, 0.007 apart of 23), and
/// fp16 arithmetic breaks it either way.
pub fn same_top(got: &[f32], want: &[f32], tie: f32) -> bool {
    let best = want[argmax(want)];
    want[argmax(got)] >= best - tie
}

/// The share of rows whose top token agrees by [`same_top`], ties within `tie` either way.
pub fn top1(got: &[Vec<f32>], want: &[Vec<f32>], tie: f32) -> f64 {
    let same = got
        .iter()
        .zip(want)
        .filter(|(g, w)| same_top(g, w, tie))
        .count();
    same as f64 / want.len().max(1) as f64
}

/// RMS(got − want) / RMS(want) over every logit, and [`top1`] with ties within 0.5% of the
/// largest |logit| of `want`.
pub fn agreement(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f64, f64) {
    let (mut err, mut norm) = (0f64, 0f64);
    for (a, b) in got.iter().flatten().zip(want.iter().flatten()) {
        err += f64::from(a - b).powi(2);
        norm += f64::from(*b).powi(2);
    }
    let largest = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    ((err / norm).sqrt(), top1(got, want, 0.005 * largest))
}
