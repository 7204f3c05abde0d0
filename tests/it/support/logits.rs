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
