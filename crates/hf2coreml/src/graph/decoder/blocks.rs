//! A part's blocks run in order over the hidden state, each by its kind (attention, short
//! convolution, Gated DeltaNet) with its norms, MLP and Gemma's extras, in the layout a
//! [`Lowering`] builds; what they keep for the next step sorted by kind and stacked into the
//! step's updates (outputs, or a stateful package's states).

use super::linear::{Projections, Weights};
use super::lower::{out_norm, Lowering};
use super::shared::Shared;
use super::step::Part;
use super::{attention, conv, delta, mlp, per_layer, stateful};
use crate::arch::{LayerTensor, TensorId};
use crate::graph::{var, Arg, Builder, GraphError, Op};
use crate::mil::contract;

/// The state a block leaves for the next step.
enum Kept {
    /// Nothing: a block that reads another block's keys and values (Gemma 4's KV sharing).
    Nothing,
    /// An attention block's new key and value rows.
    Rows(String, String),
    /// A short-convolution block's new state [1, W, C].
    Conv(String),
    /// A Gated DeltaNet's new conv state [1, W, C] and state [1, Hv, Dk, Dv].
    Delta(String, String),
}

/// What a step's blocks kept, by kind, each in block order.
#[derive(Default)]
pub(super) struct Sorted {
    pub(super) keys: Vec<String>,
    pub(super) values: Vec<String>,
    pub(super) conv: Vec<String>,
    pub(super) delta: Vec<String>,
}

/// Run `part`'s blocks in order over the hidden state `x` (left as the last block's output),
/// lowered by `lower`; what they keep, by kind.
pub(super) fn blocks(
    b: &mut Builder,
    weights: &mut Weights,
    lower: &Lowering,
    shared: &Shared,
    part: &Part,
    x: &mut String,
) -> Result<Sorted, GraphError> {
    let mut kept = Vec::with_capacity(part.layers.len());
    for l in part.layers.clone() {
        let (out, k) = block(b, weights, lower, shared, l, x)?;
        *x = out;
        kept.push(k);
    }
    Ok(Kept::sort(kept))
}

impl Kept {
    fn sort(kept: Vec<Kept>) -> Sorted {
        let mut s = Sorted::default();
        for k in kept {
            match k {
                Kept::Nothing => {}
                Kept::Rows(k, v) => {
                    s.keys.push(k);
                    s.values.push(v);
                }
                Kept::Conv(st) => s.conv.push(st),
                Kept::Delta(c, st) => {
                    s.conv.push(c);
                    s.delta.push(st);
                }
            }
        }
        s
    }
}

/// Decoder block `l` on the residual stream `x` (in the layout `lower` builds): returns the new
/// stream and the layer's new keys and values as the contract's cache rows.
fn block(
    b: &mut Builder,
    weights: &mut Weights,
    lower: &Lowering,
    shared: &Shared,
    l: usize,
    x: &str,
) -> Result<(String, Kept), GraphError> {
    let tag = format!("layers_{l}");
    let id = |t| TensorId::Layer(l, t);
    let off = shared.norm_offset;
    let nw = lower.norm_weight(b, weights, id(LayerTensor::InputNorm), off)?;
    let ranged = shared.ranged_norms;
    let name = format!("{tag}_input_norm");
    let hn = lower.residual_norm(b, x, &nw, shared.eps, ranged, &name)?;
    let mut proj = Projections::new(shared.dims.q);
    let (mixed, kept) = match shared.kinds[l] {
        crate::arch::LayerKind::Attention(_) => {
            let a = attention::attention(b, weights, &mut proj, lower, shared, l, &hn)?;
            let kept = match a.rows {
                Some((k, v)) => Kept::Rows(k, v),
                None => Kept::Nothing,
            };
            (a.out, kept)
        }
        crate::arch::LayerKind::ShortConv(_) => {
            let slot = (l, shared.slot(l));
            let c = conv::short_conv(b, weights, &mut proj, lower, shared, slot, &hn)?;
            (c.out, Kept::Conv(c.state))
        }
        crate::arch::LayerKind::GatedDelta(g) => {
            let at = (l, shared.slot(l), &g);
            let d = delta::gated_delta(b, weights, &mut proj, lower, shared, at, &hn)?;
            (d.out, Kept::Delta(d.conv_state, d.state))
        }
    };
    let (attn_out, mlp_in) = if shared.sandwich {
        let out = out_norm(b, weights, lower, shared, id(LayerTensor::PostNorm), &mixed)?;
        (out, LayerTensor::PreFfnNorm)
    } else {
        (mixed, LayerTensor::PostNorm)
    };
    let x = b.op(
        Op::Add,
        &format!("{tag}_residual_attn"),
        vec![("x", var(x)), ("y", var(&attn_out))],
    );
    let nw = lower.norm_weight(b, weights, id(mlp_in), off)?;
    let name = format!("{tag}_post_norm");
    let hn = lower.residual_norm(b, &x, &nw, shared.eps, ranged, &name)?;
    let mut down = mlp::mlp(b, weights, &mut proj, lower, shared, l, &hn)?;
    if shared.sandwich {
        down = out_norm(
            b,
            weights,
            lower,
            shared,
            id(LayerTensor::PostFfnNorm),
            &down,
        )?;
    }
    let mut x = b.op(
        Op::Add,
        &format!("{tag}_residual_mlp"),
        vec![("x", var(&x)), ("y", var(&down))],
    );
    // Gemma 4: the block's per-layer input, then its scalar on the whole stream.
    if let Some(inputs) = &shared.per_layer {
        x = per_layer::block(b, weights, lower, shared, (l, inputs), &x)?;
    }
    if shared.gemma4.is_some() {
        let scalar = weights.single(b, id(LayerTensor::LayerScalar))?;
        x = b.op(
            Op::Mul,
            &format!("{tag}_scaled"),
            vec![("x", var(&x)), ("y", var(&scalar))],
        );
    }
    Ok((x, kept))
}

/// A hybrid step's new conv and DeltaNet states, stacked over the blocks: outputs, or stored
/// into a stateful package's Core ML states.
pub(super) fn recurrent_updates(
    b: &mut Builder,
    sh: &Shared,
    (conv, delta): (Vec<String>, Vec<String>),
    outputs: &mut Vec<String>,
) {
    let conv_stored = sh.conv.as_ref().and_then(|c| c.stored.clone());
    let delta_stored = sh.delta.as_ref().and_then(|d| d.stored.clone());
    for (states, name, stored) in [
        (conv, contract::CONV_STATE_UPDATE, conv_stored),
        (delta, contract::DELTA_STATE_UPDATE, delta_stored),
    ] {
        if states.is_empty() {
            continue;
        }
        let update = stack(b, states, name);
        match stored {
            Some(state) => stateful::write_recurrent(b, &state, &update),
            None => outputs.push(update),
        }
    }
}

/// The per-layer rows stacked along axis 0 (an `identity` for a single layer).
pub(super) fn stack(b: &mut Builder, rows: Vec<String>, name: &str) -> String {
    if rows.len() == 1 {
        b.op(Op::Identity, name, vec![("x", var(&rows[0]))])
    } else {
        b.op(
            Op::Concat,
            name,
            vec![
                ("values", Arg::Vars(rows)),
                ("axis", Arg::Int(0)),
                ("interleave", Arg::Bool(false)),
            ],
        )
    }
}
