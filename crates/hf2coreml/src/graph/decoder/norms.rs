//! The norms every block and both layouts build: a norm's weight (with Gemma's 1 + w offset),
//! RMSNorm as Hugging Face computes it over any axis, and the ranged RMSNorm of a residual
//! stream whose squares outgrow fp16 (Gemma).

use super::linear::Weights;
use super::step::TOKENS_CHANNELS;
use crate::arch::TensorId;
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};

/// A norm's weight as it multiplies: w, or with Gemma's offset 1 + w (an `add` on the stored
/// weight, so a package stores the checkpoint's w).
pub(super) fn norm_weight(
    b: &mut Builder,
    weights: &mut Weights,
    id: TensorId,
    offset: f64,
) -> Result<String, GraphError> {
    let w = weights.single(b, id)?;
    Ok(plus_offset(b, w, id, offset))
}

/// A norm weight `w` of tensor `id` plus `offset` (an `add`, so a package stores the
/// checkpoint's w); `w` itself when the offset is 0.
pub(super) fn plus_offset(b: &mut Builder, w: String, id: TensorId, offset: f64) -> String {
    if offset == 0.0 {
        return w;
    }
    b.op(
        Op::Add,
        &format!("{}_plus_one", crate::arch::mil_name(&id.hf_name())),
        vec![("x", var(&w)), ("y", Arg::Float(offset))],
    )
}

/// [`rms_norm`], or with `ranged` [`rms_norm_ranged`].
pub(super) fn residual_norm(
    b: &mut Builder,
    x: &str,
    w: &str,
    eps: f64,
    ranged: bool,
    name: &str,
) -> String {
    if ranged {
        rms_norm_ranged(b, x, w, eps, TOKENS_CHANNELS, name)
    } else {
        rms_norm(b, x, w, eps, TOKENS_CHANNELS, name)
    }
}

/// Smallest per-token maximum |x| [`rms_norm_ranged`] divides by (fp16's smallest normal):
/// an all-zero token stays finite.
const RANGED_FLOOR: f64 = 6.103_515_625e-5;

/// RMSNorm of a residual stream whose range outgrows fp16's squares (Gemma: from ~1 at the
/// embedding to ~300,000 after the post-norms, a ratio no single α brings into
/// [6.1e-5, 65,504] once squared). Each token is first divided by its largest |x| m, so every
/// square lies in [0, 1] and their mean in [1/H, 1]; ε is divided by m² too:
/// x/m / sqrt(mean((x/m)²) + (√ε/m)²) = x / sqrt(mean(x²) + ε), exactly RMSNorm, for any
/// m > 0: m is floored at √ε/255 as well, so (√ε/m)² stays within fp16 however small a row is
/// (a DeltaNet's output rows reach 1e-5 against an ε of 4e-3). Over `axis`: the last of
/// [1, Q, C] and of heads [1, n, Q, D], the channels of the Neural Engine's [1, C, 1, Q].
pub(super) fn rms_norm_ranged(
    b: &mut Builder,
    x: &str,
    w: &str,
    eps: f64,
    axis: i64,
    name: &str,
) -> String {
    let n = rms_normalize_ranged(b, x, eps, axis, name);
    b.op(Op::Mul, name, vec![("x", var(&n)), ("y", var(w))])
}

/// [`rms_norm_ranged`] without a weight, named `{name}_normed`: over `axis`, so also per head
/// (Gemma 4's q, k and v norms, whose heads range from 1e-3 to 1e3).
pub(super) fn rms_normalize_ranged(
    b: &mut Builder,
    x: &str,
    eps: f64,
    axis: i64,
    name: &str,
) -> String {
    let floor = RANGED_FLOOR.max(eps.sqrt() / 255.0);
    let a = b.op(Op::Abs, &format!("{name}_abs"), vec![("x", var(x))]);
    let m = b.op(
        Op::ReduceMax,
        &format!("{name}_max"),
        vec![
            ("x", var(&a)),
            ("axes", ints(&[axis])),
            ("keep_dims", Arg::Bool(true)),
        ],
    );
    let m = b.op(
        Op::Maximum,
        &format!("{name}_max_floor"),
        vec![("x", var(&m)), ("y", Arg::Float(floor))],
    );
    let xs = b.op(
        Op::RealDiv,
        &format!("{name}_ranged"),
        vec![("x", var(x)), ("y", var(&m))],
    );
    let sq = b.op(
        Op::Mul,
        &format!("{name}_sq"),
        vec![("x", var(&xs)), ("y", var(&xs))],
    );
    let ms = b.op(
        Op::ReduceMean,
        &format!("{name}_mean"),
        vec![
            ("x", var(&sq)),
            ("axes", ints(&[axis])),
            ("keep_dims", Arg::Bool(true)),
        ],
    );
    let root_eps = b.op(
        Op::RealDiv,
        &format!("{name}_root_eps"),
        vec![("x", Arg::Float(eps.sqrt())), ("y", var(&m))],
    );
    let e = b.op(
        Op::Mul,
        &format!("{name}_eps"),
        vec![("x", var(&root_eps)), ("y", var(&root_eps))],
    );
    let ms = b.op(
        Op::Add,
        &format!("{name}_mean_eps"),
        vec![("x", var(&ms)), ("y", var(&e))],
    );
    let r = b.op(
        Op::Rsqrt,
        &format!("{name}_rsqrt"),
        vec![("x", var(&ms)), ("epsilon", Arg::Float(0.0))],
    );
    b.op(
        Op::Mul,
        &format!("{name}_normed"),
        vec![("x", var(&xs)), ("y", var(&r))],
    )
}

/// x / sqrt(mean(x²) + ε) · w over `axis`, the way Hugging Face computes it (ε inside the
/// root).
pub(super) fn rms_norm(
    b: &mut Builder,
    x: &str,
    w: &str,
    eps: f64,
    axis: i64,
    name: &str,
) -> String {
    let sq = b.op(
        Op::Mul,
        &format!("{name}_sq"),
        vec![("x", var(x)), ("y", var(x))],
    );
    let ms = b.op(
        Op::ReduceMean,
        &format!("{name}_mean"),
        vec![
            ("x", var(&sq)),
            ("axes", ints(&[axis])),
            ("keep_dims", Arg::Bool(true)),
        ],
    );
    let r = b.op(
        Op::Rsqrt,
        &format!("{name}_rsqrt"),
        vec![("x", var(&ms)), ("epsilon", Arg::Float(eps))],
    );
    let n = b.op(
        Op::Mul,
        &format!("{name}_normed"),
        vec![("x", var(x)), ("y", var(&r))],
    );
    b.op(Op::Mul, name, vec![("x", var(&n)), ("y", var(w))])
}
