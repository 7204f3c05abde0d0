//! Gemma 4's per-layer inputs (docs/reference/gemma4.md §2.1-2.2): computed once per step from
//! the tokens and their embedding, [1, Q, L, P], and added by every block through a sub-block of
//! its own after the MLP.

use super::ane_ops;
use super::linear::{Projections, Weights};
use super::lower::{out_norm, Lowering};
use super::mlp::gelu_tanh;
use super::norms::{norm_weight, residual_norm};
use super::shared::Shared;
use super::step::Part;
use crate::arch::{LayerTensor, ModelSpec, TensorId};
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};
#[cfg(doc)]
use crate::mil::contract;

/// Every block's per-layer input of this step [1, Q, L, P]:
/// (RMSNorm(h0·Wᵀ / √H) + table rows · √P) / √2, h0 being the embedded tokens `embedded` and
/// `rows` the [`contract::PER_LAYER_ROWS`] input [1, Q, L·P] (the host gathers them from the
/// table beside the package); `None` for a model without them.
///
/// `embedded` carries α and lacks the reference's 1/√H: RMSNorm is scale-free but for ε, so
/// the norm takes ε·α²·H instead of scaling the projection. `embedded` is in the layout's
/// hidden form: [1, Q, C], or the Neural Engine's [1, C, 1, Q] with `channels_first`, where
/// the projection is a 1×1 conv whose output is turned back to [1, Q, L·P].
pub(super) fn inputs(
    b: &mut Builder,
    weights: &mut Weights,
    spec: &ModelSpec,
    shared: &Shared,
    (rows, embedded, channels_first): (&str, &str, bool),
) -> Result<Option<String>, GraphError> {
    let Some(g) = spec.gemma4.as_ref().filter(|g| g.per_layer_input > 0) else {
        return Ok(None);
    };
    let q = shared.dims.q as i64;
    let (layers, p) = (spec.num_hidden_layers as i64, g.per_layer_input as i64);
    let rows = b.op(
        Op::Mul,
        "per_layer_rows_scaled",
        vec![("x", var(rows)), ("y", Arg::Float(g.per_layer_scale))],
    );
    let rows = b.op(
        Op::Reshape,
        "per_layer_rows_blocks",
        vec![("x", var(&rows)), ("shape", ints(&[1, q, layers, p]))],
    );
    let w = weights.linear(b, TensorId::PerLayerModelProjection, 1.0)?;
    let projected = if channels_first {
        let y = ane_ops::project(b, w, None, embedded, "per_layer_projected_cf")?;
        let width = (layers * p) as usize;
        ane_ops::tokens_first(b, &y, width, shared.dims.q, "per_layer_projected")
    } else {
        Projections::new(shared.dims.q).apply(b, w, None, embedded, "per_layer_projected")
    };
    let projected = b.op(
        Op::Reshape,
        "per_layer_projected_blocks",
        vec![("x", var(&projected)), ("shape", ints(&[1, q, layers, p]))],
    );
    let nw = norm_weight(b, weights, TensorId::PerLayerProjectionNorm, 0.0)?;
    let eps = shared.eps * spec.hidden_size as f64;
    let ranged = shared.ranged_norms;
    let normed = residual_norm(b, &projected, &nw, eps, ranged, "per_layer_projected_norm");
    let sum = b.op(
        Op::Add,
        "per_layer_sum",
        vec![("x", var(&normed)), ("y", var(&rows))],
    );
    Ok(Some(b.op(
        Op::Mul,
        "per_layer_inputs",
        vec![
            ("x", var(&sum)),
            ("y", Arg::Float(std::f64::consts::FRAC_1_SQRT_2)),
        ],
    )))
}

/// Gemma 4's inputs of a step (or chain part): the per-layer table's rows of the tokens,
/// gathered by the host, where the tokens are embedded; in a later chain part with blocks, the
/// per-layer inputs the first part computed. (None, None) for other models.
pub(super) fn declare(
    b: &mut Builder,
    spec: &ModelSpec,
    part: &Part,
    q: usize,
) -> (Option<String>, Option<String>) {
    let width = spec.num_hidden_layers * spec.per_layer_input();
    let fl = b.float();
    if width == 0 {
        (None, None)
    } else if part.embedding {
        let rows = b.input(crate::mil::contract::PER_LAYER_ROWS, fl, vec![1, q, width]);
        (Some(rows), None)
    } else if part.layers.is_empty() {
        (None, None)
    } else {
        let given = b.input(crate::mil::chain_file::PER_LAYER_IN, fl, vec![1, q, width]);
        (None, Some(given))
    }
}

/// The first part of a Gemma 4 chain hands every block's per-layer inputs on, [1, Q, L·P]
/// (`per_layer_out`); `None` for any other part or model.
pub(super) fn hand_on(
    b: &mut Builder,
    spec: &ModelSpec,
    shared: &Shared,
    part: &Part,
) -> Option<String> {
    let inputs = shared
        .per_layer
        .as_ref()
        .filter(|_| part.embedding && !part.head)?;
    let width = (spec.num_hidden_layers * spec.per_layer_input()) as i64;
    let shape = ints(&[1, shared.dims.q as i64, width]);
    let flat = vec![("x", var(inputs)), ("shape", shape)];
    Some(b.op(Op::Reshape, crate::mil::chain_file::PER_LAYER_OUT, flat))
}

/// The per-layer inputs a later chain part is given (`given`, [1, Q, L·P], as the first part
/// computed them), as the blocks read them: [1, Q, L, P].
pub(super) fn given(b: &mut Builder, spec: &ModelSpec, shared: &Shared, given: &str) -> String {
    let q = shared.dims.q as i64;
    let (layers, p) = (spec.num_hidden_layers as i64, spec.per_layer_input() as i64);
    b.op(
        Op::Reshape,
        "per_layer_inputs",
        vec![("x", var(given)), ("shape", ints(&[1, q, layers, p]))],
    )
}

/// Block `l`'s per-layer sub-block on the residual stream `x`:
/// x + RMSNorm(gelu(x·Gᵀ) ⊙ input_l · Pᵀ). x carries α: the gate's weights are divided by it
/// (the GELU is not linear) and the projection's multiplied, so its output carries α into the
/// norm as o_proj's does.
pub(super) fn block(
    b: &mut Builder,
    weights: &mut Weights,
    lower: &Lowering,
    shared: &Shared,
    (l, inputs): (usize, &str),
    x: &str,
) -> Result<String, GraphError> {
    let tag = format!("layers_{l}_per_layer");
    let id = |t| TensorId::Layer(l, t);
    let (q, p) = (shared.dims.q as i64, per_layer_width(shared));
    let mut proj = Projections::new(shared.dims.q);
    let gw = weights.linear(b, id(LayerTensor::PerLayerGate), 1.0 / shared.alpha)?;
    let gate = lower.project(b, &mut proj, gw, None, x, &format!("{tag}_gate"))?;
    let gate = gelu_tanh(b, &gate, &format!("{tag}_gate_act"));
    let at = l as i64;
    let input = b.op(
        Op::SliceByIndex,
        &format!("{tag}_input"),
        vec![
            ("x", var(inputs)),
            ("begin", ints(&[0, 0, at, 0])),
            ("end", ints(&[1, q, at + 1, p])),
        ],
    );
    let input = b.op(
        Op::Reshape,
        &format!("{tag}_input_rows"),
        vec![("x", var(&input)), ("shape", ints(&[1, q, p]))],
    );
    let input = lower.hidden(b, &input, p as usize, q as usize, &format!("{tag}_input_h"));
    let gated = b.op(
        Op::Mul,
        &format!("{tag}_gated"),
        vec![("x", var(&gate)), ("y", var(&input))],
    );
    let pw = weights.linear(b, id(LayerTensor::PerLayerProjection), shared.alpha)?;
    let y = lower.project(b, &mut proj, pw, None, &gated, &format!("{tag}_out"))?;
    let y = out_norm(b, weights, lower, shared, id(LayerTensor::PerLayerNorm), &y)?;
    Ok(b.op(
        Op::Add,
        &format!("{tag}_residual"),
        vec![("x", var(x)), ("y", var(&y))],
    ))
}

/// P, the width of each block's per-layer input.
fn per_layer_width(shared: &Shared) -> i64 {
    shared
        .gemma4
        .as_ref()
        .map_or(0, |g| g.per_layer_input as i64)
}
