//! The depthwise causal convolution the short-convolution block ([`super::conv`]) and the Gated
//! DeltaNet ([`super::delta`]) run over their projected inputs, continuing each block's state
//! (its last W = K − 1 inputs), and the state inputs it reads ([`ConvInputs`]).
//!
//! The convolution is K shifted slices of [state; B·x] times one tap each: no `conv` op, so it
//! lowers the same on every backend and is exact per tap. The new state is the W rows that
//! follow the real tokens: a static slice when every token is real (Q = 1), else a `gather` at
//! `valid_len + [0, W)`, so a padded chunk leaves the state as its real tokens alone would.

use super::linear::Weights;
use crate::arch::TensorId;
use crate::graph::{ints, var, Arg, Builder, ConstData, GraphError, Op};

/// What every short-convolution block of a step reads besides its weights.
pub(super) struct ConvInputs {
    /// The `conv_state` input [Lc, W, C] (a stateful package: its value, read).
    pub(super) state: String,
    /// A stateful package's Core ML state, where the update is stored.
    pub(super) stored: Option<String>,
    /// `valid_len + [0, W)`: where the new state starts in [state; B·x] (Q > 1 only).
    pub(super) keep: Option<String>,
    /// W.
    pub(super) width: usize,
    /// C.
    pub(super) channels: usize,
    pub(super) bias: bool,
}

impl ConvInputs {
    /// The inputs of a step with `layers` conv blocks of `width` × `channels` state, Q tokens;
    /// `valid` is the `valid_len` input when Q > 1; `stateful` the `position` input of a
    /// `--kv-cache state` package, whose conv state is a Core ML state.
    pub(super) fn new(
        b: &mut Builder,
        (layers, width, channels, bias): (usize, usize, usize, bool),
        valid: Option<&str>,
        stateful: Option<&str>,
    ) -> Self {
        let fl = b.float();
        let (name, shape) = (
            crate::mil::contract::CONV_STATE,
            vec![layers, width, channels],
        );
        let (state, stored) = match stateful {
            Some(position) => {
                let (stored, value) = super::stateful::recurrent(b, name, shape, position);
                (value, Some(stored))
            }
            None => (b.input(name, fl, shape), None),
        };
        let keep = valid.map(|valid| {
            let offsets = b.constant(
                "conv_state_offsets",
                vec![width],
                ConstData::I32((0..width as i32).collect()),
                None,
            );
            b.op(
                Op::Add,
                "conv_state_keep",
                vec![("x", var(valid)), ("y", var(&offsets))],
            )
        });
        ConvInputs {
            state,
            stored,
            keep,
            width,
            channels,
            bias,
        }
    }
}

impl ConvInputs {
    /// The depthwise causal convolution of block slot `slot` over x [1, Q, C] with the taps
    /// `taps` (a checkpoint's [C, 1, K]), continuing the slot's state: the outputs [1, Q, C]
    /// (before any bias) and the new state [1, W, C] after the real tokens.
    pub(super) fn convolve(
        &self,
        b: &mut Builder,
        weights: &mut Weights,
        (slot, taps): (usize, TensorId),
        (x, q): (&str, i64),
        tag: &str,
    ) -> Result<(String, String), GraphError> {
        let (slot, w, c) = (slot as i64, self.width as i64, self.channels as i64);
        let past = b.op(
            Op::SliceByIndex,
            &format!("{tag}_state"),
            vec![
                ("x", var(&self.state)),
                ("begin", ints(&[slot, 0, 0])),
                ("end", ints(&[slot + 1, w, c])),
            ],
        );
        // Row i + W of `seq` is input i; output i sums tap j times row i + j.
        let seq = b.op(
            Op::Concat,
            &format!("{tag}_seq"),
            vec![
                ("values", Arg::Vars(vec![past, x.to_string()])),
                ("axis", Arg::Int(1)),
                ("interleave", Arg::Bool(false)),
            ],
        );
        let taps = conv_taps(b, weights, taps, (w + 1, c), tag)?;
        let y = causal_conv(b, &seq, &taps, (q, w, c), tag);
        let state = new_state(b, &seq, self.keep.as_deref(), (q, w, c), tag);
        Ok((y, state))
    }
}

/// Tap j times rows j .. j + Q of `seq` [1, W + Q, C], summed over the K = W + 1 taps
/// [K, C]: the depthwise causal convolution of the Q inputs.
fn causal_conv(
    b: &mut Builder,
    seq: &str,
    taps: &str,
    (q, w, c): (i64, i64, i64),
    tag: &str,
) -> String {
    let mut y: Option<String> = None;
    for j in 0..=w {
        let rows = b.op(
            Op::SliceByIndex,
            &format!("{tag}_rows_{j}"),
            vec![
                ("x", var(seq)),
                ("begin", ints(&[0, j, 0])),
                ("end", ints(&[1, j + q, c])),
            ],
        );
        let tap = b.op(
            Op::SliceByIndex,
            &format!("{tag}_tap_{j}"),
            vec![
                ("x", var(taps)),
                ("begin", ints(&[j, 0])),
                ("end", ints(&[j + 1, c])),
            ],
        );
        let term = b.op(
            Op::Mul,
            &format!("{tag}_term_{j}"),
            vec![("x", var(&rows)), ("y", var(&tap))],
        );
        y = Some(match y {
            None => term,
            Some(acc) => b.op(
                Op::Add,
                &format!("{tag}_sum_{j}"),
                vec![("x", var(&acc)), ("y", var(&term))],
            ),
        });
    }
    y.unwrap_or_default()
}

/// The W rows of `seq` [1, W + Q, C] after the real inputs: rows Q .. Q + W when all Q are
/// real, else the rows `keep` (`valid_len + [0, W)`) names.
fn new_state(
    b: &mut Builder,
    seq: &str,
    keep: Option<&str>,
    (q, w, c): (i64, i64, i64),
    tag: &str,
) -> String {
    let name = format!("{tag}_state_update");
    match keep {
        None => b.op(
            Op::SliceByIndex,
            &name,
            vec![
                ("x", var(seq)),
                ("begin", ints(&[0, q, 0])),
                ("end", ints(&[1, q + w, c])),
            ],
        ),
        Some(keep) => b.op(
            Op::Gather,
            &name,
            vec![
                ("x", var(seq)),
                ("indices", var(keep)),
                ("axis", Arg::Int(1)),
            ],
        ),
    }
}

/// The depthwise taps [K, C] of tensor `id` (the checkpoint's [C, 1, K], transposed once in
/// the program).
fn conv_taps(
    b: &mut Builder,
    weights: &mut Weights,
    id: TensorId,
    (k, c): (i64, i64),
    tag: &str,
) -> Result<String, GraphError> {
    let raw = weights.single(b, id)?;
    let flat = b.op(
        Op::Reshape,
        &format!("{tag}_taps_flat"),
        vec![("x", var(&raw)), ("shape", ints(&[c, k]))],
    );
    Ok(b.op(
        Op::Transpose,
        &format!("{tag}_taps"),
        vec![("x", var(&flat)), ("perm", ints(&[1, 0]))],
    ))
}
