//! A block is written once ([`super::blocks`], [`super::attention`], [`super::mlp`]) and lowered
//! to the layout the package is built in: what differs between the default layout (tokens
//! first, [1, Q, C]) and the Neural Engine's (channels first, [1, C, 1, Q], [`super::ane`]) is
//! here, one method per step that differs: a norm's weight and the axis it reduces, a
//! projection (`linear` or 1×1 `conv`), the heads' layout, the axis RoPE rotates, the cache
//! rows of the new keys and values, and the attention core. The pieces each layout lowers to
//! are [`super::attend`]'s and [`super::norms`]' (default) and [`super::ane_ops`]' (Neural
//! Engine). Gemma's norm of a sublayer output ([`out_norm`]) is written once over them too.

use super::ane_ops::{self, Cf};
use super::linear::{LinearWeight, Projections, Weights};
use super::shared::Shared;
use super::step::{Dims, TOKENS_CHANNELS};
use super::{attend, norms};
use crate::arch::TensorId;
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};

/// The layout a block is lowered to.
pub(super) enum Lowering {
    /// Tokens first: [1, Q, C], heads [1, n, Q, D].
    Default,
    /// Channels first: [1, C, 1, Q], heads [1, n, D, Q], with the shared tables and mask
    /// transposed once for the whole step.
    Ane(Cf),
}

impl Lowering {
    /// A norm's weight as it multiplies (with the (1 + w) offset of Gemma and Qwen3.5; a
    /// [C, 1, 1] constant in the Neural Engine layout).
    pub(super) fn norm_weight(
        &self,
        b: &mut Builder,
        weights: &mut Weights,
        id: TensorId,
        offset: f64,
    ) -> Result<String, GraphError> {
        match self {
            Lowering::Default => norms::norm_weight(b, weights, id, offset),
            Lowering::Ane(_) => {
                let w = ane_ops::norm_weight(b, weights, id)?;
                Ok(norms::plus_offset(b, w, id, offset))
            }
        }
    }

    /// RMSNorm of the residual stream over its channel axis (`ranged`: dividing each token by
    /// its largest |x| first, [`norms::rms_norm_ranged`]).
    pub(super) fn residual_norm(
        &self,
        b: &mut Builder,
        x: &str,
        w: &str,
        eps: f64,
        ranged: bool,
        name: &str,
    ) -> Result<String, GraphError> {
        match self {
            Lowering::Default => Ok(norms::residual_norm(b, x, w, eps, ranged, name)),
            Lowering::Ane(_) if ranged => Ok(norms::rms_norm_ranged(
                b,
                x,
                w,
                eps,
                ane_ops::CHANNELS,
                name,
            )),
            Lowering::Ane(_) => Ok(norms::rms_norm(b, x, w, eps, ane_ops::CHANNELS, name)),
        }
    }

    /// `W·x (+ bias)` over the layout's hidden form.
    pub(super) fn project(
        &self,
        b: &mut Builder,
        proj: &mut Projections,
        w: LinearWeight,
        bias: Option<String>,
        x: &str,
        name: &str,
    ) -> Result<String, GraphError> {
        match self {
            Lowering::Default => Ok(proj.apply(b, w, bias, x, name)),
            Lowering::Ane(_) => ane_ops::project(b, w, bias, x, name),
        }
    }

    /// A projection's output `x` of `c` channels as [1, Q, C]: the form the recurrent blocks'
    /// cores (convolution, delta rule) are written in, whatever the layout.
    pub(super) fn tokens(
        &self,
        b: &mut Builder,
        x: &str,
        c: usize,
        q: usize,
        name: &str,
    ) -> String {
        match self {
            Lowering::Default => x.to_string(),
            Lowering::Ane(_) => ane_ops::tokens_first(b, x, c, q, name),
        }
    }

    /// [1, Q, C] back in the layout's hidden form, for the projection that follows.
    pub(super) fn hidden(
        &self,
        b: &mut Builder,
        x: &str,
        c: usize,
        q: usize,
        name: &str,
    ) -> String {
        match self {
            Lowering::Default => x.to_string(),
            Lowering::Ane(_) => ane_ops::channels_first(b, x, c, q, name),
        }
    }

    /// q_proj's output of Qwen3.5's gated attention split into the queries and the output
    /// gate (each head's rows are D query rows, then D gate rows), both in the layout's hidden
    /// form [1, Q, H·D] or [1, H·D, 1, Q].
    pub(super) fn query_and_gate(
        &self,
        b: &mut Builder,
        x: &str,
        dims: &Dims,
        tag: &str,
    ) -> (String, String) {
        let (q, n, d) = (dims.q as i64, dims.h as i64, dims.d as i64);
        // The heads' shape, the axis each head's 2·D rows run along, the flat shape.
        let (shape, axis, flat) = match self {
            Lowering::Default => ([1, q, n, 2 * d], 3, vec![1, q, n * d]),
            Lowering::Ane(_) => ([1, n, 2 * d, q], 2, vec![1, n * d, 1, q]),
        };
        let both = b.op(
            Op::Reshape,
            &format!("{tag}_q_gate"),
            vec![("x", var(x)), ("shape", ints(&shape))],
        );
        let mut half = |i: i64, what: &str| {
            let (mut begin, mut end) = ([0; 4], shape);
            (begin[axis], end[axis]) = (i * d, (i + 1) * d);
            let part = b.op(
                Op::SliceByIndex,
                &format!("{tag}_{what}_heads"),
                vec![
                    ("x", var(&both)),
                    ("begin", ints(&begin)),
                    ("end", ints(&end)),
                ],
            );
            b.op(
                Op::Reshape,
                &format!("{tag}_{what}_flat"),
                vec![("x", var(&part)), ("shape", ints(&flat))],
            )
        };
        (half(0, "query"), half(1, "gate"))
    }

    /// A projection's output as `n` heads.
    pub(super) fn heads(
        &self,
        b: &mut Builder,
        x: &str,
        n: usize,
        dims: &Dims,
        name: &str,
    ) -> String {
        match self {
            Lowering::Default => attend::heads(b, x, n, dims, name),
            Lowering::Ane(_) => ane_ops::heads(b, x, n, dims, name),
        }
    }

    /// The axis of a head's D values in the heads' layout: RoPE rotates along it.
    pub(super) fn head_axis(&self) -> i64 {
        match self {
            Lowering::Default => -1,
            Lowering::Ane(_) => 2,
        }
    }

    /// A per-head q/k norm's weight [D] as it multiplies the heads (with the (1 + w) offset;
    /// [D, 1] in the Neural Engine layout, where each head's D values run down axis 2).
    pub(super) fn head_norm_weight(
        &self,
        b: &mut Builder,
        weights: &mut Weights,
        id: TensorId,
        offset: f64,
    ) -> Result<String, GraphError> {
        match self {
            Lowering::Default => norms::norm_weight(b, weights, id, offset),
            Lowering::Ane(_) => {
                let w = ane_ops::head_norm_weight(b, weights, id)?;
                Ok(norms::plus_offset(b, w, id, offset))
            }
        }
    }

    /// Per-head q/k RMSNorm (Qwen3, LFM2) over each head's D values: the last axis of the
    /// default heads [1, n, Q, D], axis 2 of the Neural Engine's [1, n, D, Q].
    pub(super) fn head_norm(
        &self,
        b: &mut Builder,
        x: &str,
        w: &str,
        eps: f64,
        name: &str,
    ) -> Result<String, GraphError> {
        let axis = match self {
            Lowering::Default => TOKENS_CHANNELS,
            Lowering::Ane(_) => 2,
        };
        Ok(attend::head_norm(b, x, w, eps, axis, name))
    }

    /// The RoPE rows block `l` rotates with (`cos`, `sin`): Gemma's sliding blocks have their
    /// own; the Neural Engine layout's are the transposed [D, Q] rows.
    pub(super) fn rope_tables<'s>(&'s self, shared: &'s Shared, l: usize) -> (&'s str, &'s str) {
        match (self, &shared.local, shared.sliding[l]) {
            (Lowering::Ane(cf), _, true) if cf.local.is_some() => {
                let (cos, sin, _) = cf.local.as_ref().expect("checked");
                (cos, sin)
            }
            (Lowering::Ane(cf), _, _) => (&cf.cos, &cf.sin),
            (Lowering::Default, Some((cos, sin, _)), true) => (cos, sin),
            _ => (&shared.cos, &shared.sin),
        }
    }

    /// The new keys and values as the contract's cache rows [1, Hkv, Q, D].
    pub(super) fn cache_rows(
        &self,
        b: &mut Builder,
        k: String,
        v: String,
        tag: &str,
    ) -> (String, String) {
        match self {
            Lowering::Default => (k, v),
            Lowering::Ane(_) => (
                ane_ops::rows(b, &k, &format!("{tag}_k_rows")),
                ane_ops::rows(b, &v, &format!("{tag}_v_rows")),
            ),
        }
    }

    /// softmax(q·kᵀ + mask)·v of block `l`, the heads joined in the layout's hidden form.
    pub(super) fn attend(
        &self,
        b: &mut Builder,
        shared: &Shared,
        l: usize,
        (qs, keys, values): (&str, &str, &str),
        tag: &str,
    ) -> String {
        match self {
            Lowering::Default => {
                let dims = shared.dims_of(l);
                let windowed = shared.local.is_some() && shared.sliding[l];
                // A block grouped otherwise than the model (Gemma 4's full blocks) has its own.
                let own = shared
                    .regrouped
                    .iter()
                    .find(|(g, _, _)| *g == dims.h / dims.hkv);
                let mask = match (own, &shared.local, windowed) {
                    (Some((_, _, Some(window))), _, true) => window,
                    (Some((_, mask, _)), _, false) => mask,
                    (_, Some((_, _, window_mask)), true) => window_mask,
                    _ => &shared.mask,
                };
                attend::attend(b, qs, keys, values, mask, &dims, tag)
            }
            Lowering::Ane(cf) => {
                // Gemma's sliding blocks attend within the window (its mask transposed too).
                let mask = match (&cf.local, shared.sliding[l]) {
                    (Some((_, _, window)), true) => window,
                    _ => &cf.mask,
                };
                let dims = shared.dims_of(l);
                ane_ops::per_group(b, qs, keys, values, (mask, &dims), tag)
            }
        }
    }
}

/// Gemma's norm `id` of a sublayer output `x` (o_proj's or down_proj's, which carry α, so ε
/// is scaled by α² as on the residual stream), its weight times α again: the normalised output
/// joins a residual stream that carries α, and Gemma's large post-norm weights would overflow
/// fp16 before a later scale.
pub(super) fn out_norm(
    b: &mut Builder,
    weights: &mut Weights,
    lower: &Lowering,
    shared: &Shared,
    id: TensorId,
    x: &str,
) -> Result<String, GraphError> {
    let name = crate::arch::mil_name(&id.hf_name());
    let mut nw = lower.norm_weight(b, weights, id, shared.norm_offset)?;
    if shared.alpha != 1.0 {
        nw = b.op(
            Op::Mul,
            &format!("{name}_scaled"),
            vec![("x", var(&nw)), ("y", Arg::Float(shared.alpha))],
        );
    }
    let ranged = shared.ranged_norms;
    lower.residual_norm(b, x, &nw, shared.eps, ranged, &format!("{name}_out"))
}
