//! A block is written once ([`super::block`], [`super::attention`], [`super::mlp`]) and lowered
//! to the layout the package is built in: what differs between the default layout (tokens
//! first, [1, Q, C]) and the Neural Engine's (channels first, [1, C, 1, Q], [`super::ane`]) is
//! here, one method per step that differs: a norm's weight and the axis it reduces, a
//! projection (`linear` or 1×1 `conv`), the heads' layout, the axis RoPE rotates, the cache
//! rows of the new keys and values, and the attention core.

use super::ane::{self, Cf};
use super::linear::{LinearWeight, Projections, Weights};
use super::{Dims, Shared};
use crate::arch::TensorId;
use crate::graph::{Builder, GraphError};

/// The layout a block is lowered to.
pub(super) enum Lowering<'a> {
    /// Tokens first: [1, Q, C], heads [1, n, Q, D].
    Default,
    /// Channels first: [1, C, 1, Q], heads [1, n, D, Q], with the shared tables and mask
    /// transposed once for the whole step.
    Ane(Cf<'a>),
}

impl Lowering<'_> {
    /// A norm's weight as it multiplies (with Gemma's offset; a [C, 1, 1] constant in the
    /// Neural Engine layout).
    pub(super) fn norm_weight(
        &self,
        b: &mut Builder,
        weights: &mut Weights,
        id: TensorId,
        offset: f64,
    ) -> Result<String, GraphError> {
        match self {
            Lowering::Default => super::norm_weight(b, weights, id, offset),
            Lowering::Ane(_) => {
                refuse_if(offset != 0.0, "(1 + w) norms (Gemma)")?;
                ane::norm_weight(b, weights, id)
            }
        }
    }

    /// RMSNorm of the residual stream over its channel axis (`ranged`: dividing each token by
    /// its largest |x| first, [`super::rms_norm_ranged`]).
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
            Lowering::Default => Ok(super::residual_norm(b, x, w, eps, ranged, name)),
            Lowering::Ane(_) => {
                refuse_if(ranged, "ranged norms (Gemma)")?;
                Ok(super::rms_norm(b, x, w, eps, ane::CHANNELS, name))
            }
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
            Lowering::Ane(_) => ane::project(b, w, bias, x, name),
        }
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
            Lowering::Default => super::attention::heads(b, x, n, dims, name),
            Lowering::Ane(_) => ane::heads(b, x, n, dims, name),
        }
    }

    /// The axis of a head's D values in the heads' layout: RoPE rotates along it.
    pub(super) fn head_axis(&self) -> i64 {
        match self {
            Lowering::Default => -1,
            Lowering::Ane(_) => 2,
        }
    }

    /// A per-head q/k norm's weight [D] as it multiplies the heads (with Gemma's offset; [D, 1]
    /// in the Neural Engine layout, where each head's D values run down axis 2).
    pub(super) fn head_norm_weight(
        &self,
        b: &mut Builder,
        weights: &mut Weights,
        id: TensorId,
        offset: f64,
    ) -> Result<String, GraphError> {
        match self {
            Lowering::Default => super::norm_weight(b, weights, id, offset),
            Lowering::Ane(_) => {
                refuse_if(offset != 0.0, "(1 + w) norms (Gemma)")?;
                ane::head_norm_weight(b, weights, id)
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
            Lowering::Default => super::TOKENS_CHANNELS,
            Lowering::Ane(_) => 2,
        };
        Ok(super::attention::head_norm(b, x, w, eps, axis, name))
    }

    /// The RoPE rows block `l` rotates with (`cos`, `sin`): Gemma's sliding blocks have their
    /// own; the Neural Engine layout's are the transposed [D, Q] rows.
    pub(super) fn rope_tables<'s>(&'s self, shared: &'s Shared, l: usize) -> (&'s str, &'s str) {
        match (self, &shared.local, shared.sliding[l]) {
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
                ane::rows(b, &k, &format!("{tag}_k_rows")),
                ane::rows(b, &v, &format!("{tag}_v_rows")),
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
                super::attention::attend(b, qs, keys, values, mask, &dims, tag)
            }
            Lowering::Ane(cf) => ane::per_group(b, cf, qs, keys, values, tag),
        }
    }
}

/// What the Neural Engine layout does not build; `ane::check` refuses such a model before any
/// block is lowered, so this is the second line.
fn not_built(what: &str) -> GraphError {
    GraphError::Unsupported(format!(
        "{what} are not built in --layout ane: use --layout default"
    ))
}

fn refuse_if(cond: bool, what: &str) -> Result<(), GraphError> {
    if cond {
        Err(not_built(what))
    } else {
        Ok(())
    }
}
