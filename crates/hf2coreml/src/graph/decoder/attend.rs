//! The default layout's attention pieces (tokens first) that [`super::lower::Lowering`] picks:
//! a projection as heads [1, n, Q, D], the per-head q/k RMSNorm, and softmax(q·kᵀ + mask)·v
//! with the G query heads of a key/value group stacked as rows against the unrepeated cache.

use super::norms::rms_norm;
use super::step::Dims;
use crate::graph::{ints, var, Arg, Builder, Op};

/// Scale applied to q and k before their per-head RMSNorm, with ε scaled by its square:
/// RMSNorm is scale-invariant, and squares of |q| up to ~4,000 stay inside fp16 (no measurement
/// covers q and k, so the headroom is fixed, a power of two so the scaling itself is exact).
const HEAD_NORM_PRESCALE: f64 = 1.0 / 16.0;

/// RMSNorm over `axis` (each head's D values) of the heads with weight [D] shaped to it.
pub(super) fn head_norm(
    b: &mut Builder,
    x: &str,
    w: &str,
    eps: f64,
    axis: i64,
    name: &str,
) -> String {
    let c = HEAD_NORM_PRESCALE;
    let xs = b.op(
        Op::Mul,
        &format!("{name}_prescaled"),
        vec![("x", var(x)), ("y", Arg::Float(c))],
    );
    rms_norm(b, &xs, w, eps * c * c, axis, name)
}

/// [1, Q, n·D] → [1, n, Q, D].
pub(super) fn heads(b: &mut Builder, t: &str, n: usize, dims: &Dims, name: &str) -> String {
    let r = b.op(
        Op::Reshape,
        &format!("{name}_heads"),
        vec![
            ("x", var(t)),
            ("shape", ints(&[1, dims.q as i64, n as i64, dims.d as i64])),
        ],
    );
    b.op(
        Op::Transpose,
        &format!("{name}_bhqd"),
        vec![("x", var(&r)), ("perm", ints(&[0, 2, 1, 3]))],
    )
}

/// softmax(q·kᵀ + mask)·v, heads merged back: [1, Q, H·D].
pub(super) fn attend(
    b: &mut Builder,
    qs: &str,
    keys: &str,
    values: &str,
    mask: &str,
    dims: &Dims,
    tag: &str,
) -> String {
    let groups = dims.h / dims.hkv;
    let grouped_q = (groups * dims.q) as i64;
    let (hkv, q, d) = (dims.hkv as i64, dims.q as i64, dims.d as i64);
    let qs = if groups == 1 {
        qs.to_string()
    } else {
        b.op(
            Op::Reshape,
            &format!("{tag}_q_grouped"),
            vec![("x", var(qs)), ("shape", ints(&[1, hkv, grouped_q, d]))],
        )
    };
    let scores = b.op(
        Op::Matmul,
        &format!("{tag}_scores"),
        vec![
            ("x", var(&qs)),
            ("y", var(keys)),
            ("transpose_x", Arg::Bool(false)),
            ("transpose_y", Arg::Bool(true)),
        ],
    );
    let scores = b.op(
        Op::Add,
        &format!("{tag}_scores_masked"),
        vec![("x", var(&scores)), ("y", var(mask))],
    );
    let probs = b.op(
        Op::Softmax,
        &format!("{tag}_probs"),
        vec![("x", var(&scores)), ("axis", Arg::Int(-1))],
    );
    let ctx = b.op(
        Op::Matmul,
        &format!("{tag}_context"),
        vec![
            ("x", var(&probs)),
            ("y", var(values)),
            ("transpose_x", Arg::Bool(false)),
            ("transpose_y", Arg::Bool(false)),
        ],
    );
    let ctx = if groups == 1 {
        ctx
    } else {
        b.op(
            Op::Reshape,
            &format!("{tag}_context_heads"),
            vec![("x", var(&ctx)), ("shape", ints(&[1, dims.h as i64, q, d]))],
        )
    };
    let ctx = b.op(
        Op::Transpose,
        &format!("{tag}_context_bqhd"),
        vec![("x", var(&ctx)), ("perm", ints(&[0, 2, 1, 3]))],
    );
    b.op(
        Op::Reshape,
        &format!("{tag}_context_flat"),
        vec![
            ("x", var(&ctx)),
            ("shape", ints(&[1, q, (dims.h * dims.d) as i64])),
        ],
    )
}
