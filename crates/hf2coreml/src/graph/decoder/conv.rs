//! LFM2's gated short-convolution block: in_proj to B, C and x, B·x through a depthwise causal
//! convolution that continues the block's state (its last W = K − 1 inputs), C times the
//! result, out_proj. The convolution and its state are [`super::causal_conv`]'s.

use super::linear::{Projections, Weights};
use super::lower::Lowering;
use super::shared::Shared;
use crate::arch::{LayerTensor, TensorId};
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};

/// What the block hands back: its output [1, Q, C] (times α, as o_proj's) and its new state
/// [1, W, C].
pub(super) struct ConvOut {
    pub(super) out: String,
    pub(super) state: String,
}

/// Block `l`'s short convolution over its normed input `hn` (in the layout's hidden form);
/// `slot` is its index in the `conv_state` input. The convolution runs on [1, Q, C] in every
/// layout: the Neural Engine's turns in_proj's output to it and the gated result back.
pub(super) fn short_conv(
    b: &mut Builder,
    weights: &mut Weights,
    proj: &mut Projections,
    lower: &Lowering,
    shared: &Shared,
    (l, slot): (usize, usize),
    hn: &str,
) -> Result<ConvOut, GraphError> {
    let conv = shared
        .conv
        .as_ref()
        .ok_or_else(|| GraphError::Unsupported(format!("block {l} has no conv state input")))?;
    let (q, c) = (shared.dims.q as i64, conv.channels as i64);
    let tag = format!("layers_{l}_conv");
    let id = |t| TensorId::Layer(l, t);
    let w_in = weights.linear(b, id(LayerTensor::ConvIn), 1.0)?;
    let in_bias = if conv.bias {
        Some(weights.single(b, id(LayerTensor::ConvInBias))?)
    } else {
        None
    };
    let bcx = lower.project(b, proj, w_in, in_bias, hn, &format!("{tag}_in"))?;
    let n = shared.dims.q;
    let bcx = lower.tokens(b, &bcx, 3 * conv.channels, n, &format!("{tag}_in_tokens"));
    let third = |b: &mut Builder, i: i64, name: &str| {
        b.op(
            Op::SliceByIndex,
            &format!("{tag}_{name}"),
            vec![
                ("x", var(&bcx)),
                ("begin", ints(&[0, 0, i * c])),
                ("end", ints(&[1, q, (i + 1) * c])),
            ],
        )
    };
    let gate_b = third(b, 0, "b");
    let gate_c = third(b, 1, "c");
    let x = third(b, 2, "x");
    let bx = b.op(
        Op::Mul,
        &format!("{tag}_bx"),
        vec![("x", var(&gate_b)), ("y", var(&x))],
    );
    let taps = id(LayerTensor::Conv);
    let (mut y, state) = conv.convolve(b, weights, (slot, taps), (&bx, q), &tag)?;
    if conv.bias {
        let bias = weights.single(b, id(LayerTensor::ConvBias))?;
        y = b.op(
            Op::Add,
            &format!("{tag}_biased"),
            vec![("x", var(&y)), ("y", var(&bias))],
        );
    }
    let gated = b.op(
        Op::Mul,
        &format!("{tag}_gated"),
        vec![("x", var(&gate_c)), ("y", var(&y))],
    );
    let w_out = weights.linear(b, id(LayerTensor::ConvOut), shared.alpha)?;
    let out_bias = if conv.bias {
        let bias = weights.single(b, id(LayerTensor::ConvOutBias))?;
        Some(if shared.alpha == 1.0 {
            bias
        } else {
            b.op(
                Op::Mul,
                &format!("{tag}_out_bias_scaled"),
                vec![("x", var(&bias)), ("y", Arg::Float(shared.alpha))],
            )
        })
    } else {
        None
    };
    let gated = lower.hidden(b, &gated, conv.channels, n, &format!("{tag}_gated_hidden"));
    let out = lower.project(b, proj, w_out, out_bias, &gated, &format!("{tag}_out"))?;
    Ok(ConvOut { out, state })
}
