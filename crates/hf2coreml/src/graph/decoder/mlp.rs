//! One block's gated MLP: `down(silu(gate(x)) ⊙ up(x))`.

use super::linear::{Projections, Weights};
use super::lower::Lowering;
use super::shared::Shared;
use crate::arch::{LayerTensor, TensorId};
use crate::graph::{var, Arg, Builder, GraphError, Op};

/// The MLP of block `l` over its normed input `hn` (in the layout `lower` builds); the down
/// projection carries the residual scale.
pub(super) fn mlp(
    b: &mut Builder,
    weights: &mut Weights,
    proj: &mut Projections,
    lower: &Lowering,
    shared: &Shared,
    l: usize,
    hn: &str,
) -> Result<String, GraphError> {
    let tag = format!("layers_{l}");
    let id = |t: LayerTensor| TensorId::Layer(l, t);
    let wg = weights.linear(b, id(LayerTensor::Gate), 1.0)?;
    let wu = weights.linear(b, id(LayerTensor::Up), 1.0)?;
    let wd = weights.linear(b, id(LayerTensor::Down), shared.alpha)?;
    let g = lower.project(b, proj, wg, None, hn, &format!("{tag}_gate"))?;
    let g = if shared.gelu_tanh {
        gelu_tanh(b, &g, &format!("{tag}_gate_act"))
    } else {
        b.op(Op::Silu, &format!("{tag}_gate_act"), vec![("x", var(&g))])
    };
    let u = lower.project(b, proj, wu, None, hn, &format!("{tag}_up"))?;
    let gu = b.op(
        Op::Mul,
        &format!("{tag}_gate_up"),
        vec![("x", var(&g)), ("y", var(&u))],
    );
    lower.project(b, proj, wd, None, &gu, &format!("{tag}_mlp_out"))
}

/// Where the cube is taken: tanh(√(2/π)·(x + 0.044715·x³)) is ±1 in f32 for |x| ≥ 10, so
/// clipping x there first changes nothing and keeps x³ (1,000 at most) inside fp16.
const GELU_CLIP: f64 = 10.0;

/// transformers' `gelu_pytorch_tanh`: 0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²))), with the
/// polynomial on x clipped to ±[`GELU_CLIP`].
pub(super) fn gelu_tanh(b: &mut Builder, x: &str, name: &str) -> String {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let xc = b.op(
        Op::Clip,
        &format!("{name}_clipped"),
        vec![
            ("x", var(x)),
            ("alpha", Arg::Float(-GELU_CLIP)),
            ("beta", Arg::Float(GELU_CLIP)),
        ],
    );
    let sq = b.op(
        Op::Mul,
        &format!("{name}_sq"),
        vec![("x", var(&xc)), ("y", var(&xc))],
    );
    let poly = b.op(
        Op::Mul,
        &format!("{name}_poly"),
        vec![("x", var(&sq)), ("y", Arg::Float(0.044715 * c))],
    );
    let poly = b.op(
        Op::Add,
        &format!("{name}_poly1"),
        vec![("x", var(&poly)), ("y", Arg::Float(c))],
    );
    let inner = b.op(
        Op::Mul,
        &format!("{name}_inner"),
        vec![("x", var(&xc)), ("y", var(&poly))],
    );
    let t = b.op(Op::Tanh, &format!("{name}_tanh"), vec![("x", var(&inner))]);
    let t = b.op(
        Op::Add,
        &format!("{name}_tanh1"),
        vec![("x", var(&t)), ("y", Arg::Float(1.0))],
    );
    let half = b.op(
        Op::Mul,
        &format!("{name}_half"),
        vec![("x", var(x)), ("y", Arg::Float(0.5))],
    );
    b.op(Op::Mul, name, vec![("x", var(&half)), ("y", var(&t))])
}
