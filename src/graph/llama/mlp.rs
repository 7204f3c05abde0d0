//! One block's gated MLP: `down(silu(gate(x)) ⊙ up(x))`.

use super::linear::{Projections, Weights};
use super::Shared;
use crate::arch::{LayerTensor, TensorId};
use crate::graph::{var, Builder, GraphError, Op};

/// The MLP of block `l` over its normed input `hn`; the down projection carries the residual
/// scale.
pub(super) fn mlp(
    b: &mut Builder,
    weights: &mut Weights,
    proj: &mut Projections,
    shared: &Shared,
    l: usize,
    hn: &str,
) -> Result<String, GraphError> {
    let tag = format!("layers_{l}");
    let id = |t: LayerTensor| TensorId::Layer(l, t);
    let wg = weights.linear(b, id(LayerTensor::Gate), 1.0)?;
    let wu = weights.linear(b, id(LayerTensor::Up), 1.0)?;
    let wd = weights.linear(b, id(LayerTensor::Down), shared.alpha)?;
    let g = proj.apply(b, wg, None, hn, &format!("{tag}_gate"));
    let g = b.op(Op::Silu, &format!("{tag}_gate_act"), vec![("x", var(&g))]);
    let u = proj.apply(b, wu, None, hn, &format!("{tag}_up"));
    let gu = b.op(
        Op::Mul,
        &format!("{tag}_gate_up"),
        vec![("x", var(&g)), ("y", var(&u))],
    );
    Ok(proj.apply(b, wd, None, &gu, &format!("{tag}_mlp_out")))
}
