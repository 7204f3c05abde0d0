//! The pieces a block lowers to in the Neural Engine layout (`--layout ane`, [`super::ane`]),
//! channels first: the hidden state (B, C, 1, Q) and its turns to and from [1, Q, C], 1×1
//! `conv` projections (the checkpoint's [out, in] constant given the shape [out, in, 1, 1]),
//! norm weights shaped to the channels, heads [1, n, D, Q], and attention one key/value group
//! at a time against the shared tables and mask transposed once ([`Cf`]).

use super::linear::{LinearWeight, Weights};
use super::shared::Shared;
use super::step::Dims;
use crate::arch::TensorId;
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};

/// The channel axis of the (B, C, 1, Q) hidden state.
pub(super) const CHANNELS: i64 = 1;

/// The shared values in the channels-first form: RoPE rows [D, Q] and the mask [S+Q, Q].
pub(super) struct Cf {
    pub(super) cos: String,
    pub(super) sin: String,
    pub(super) mask: String,
    /// Gemma's sliding blocks' RoPE rows and window mask, transposed as the others.
    pub(super) local: Option<(String, String, String)>,
}

impl Cf {
    pub(super) fn new(b: &mut Builder, shared: &Shared) -> Self {
        let t = |b: &mut Builder, x: &str, name: &str| {
            b.op(
                Op::Transpose,
                name,
                vec![("x", var(x)), ("perm", ints(&[1, 0]))],
            )
        };
        let local = shared.local.as_ref().map(|(cos, sin, window)| {
            (
                t(b, cos, "rope_cos_local_cf"),
                t(b, sin, "rope_sin_local_cf"),
                t(b, window, "window_mask_cf"),
            )
        });
        Cf {
            cos: t(b, &shared.cos, "rope_cos_cf"),
            sin: t(b, &shared.sin, "rope_sin_cf"),
            mask: t(b, &shared.mask, "mask_cf"),
            local,
        }
    }
}

/// [1, Q, C] → [1, C, 1, Q].
pub(super) fn channels_first(b: &mut Builder, x: &str, c: usize, q: usize, name: &str) -> String {
    let t = b.op(
        Op::Transpose,
        &format!("{name}_t"),
        vec![("x", var(x)), ("perm", ints(&[0, 2, 1]))],
    );
    b.op(
        Op::Reshape,
        name,
        vec![("x", var(&t)), ("shape", ints(&[1, c as i64, 1, q as i64]))],
    )
}

/// [1, C, 1, Q] → [1, Q, C].
pub(super) fn tokens_first(b: &mut Builder, x: &str, c: usize, q: usize, name: &str) -> String {
    let r = b.op(
        Op::Reshape,
        &format!("{name}_r"),
        vec![("x", var(x)), ("shape", ints(&[1, c as i64, q as i64]))],
    );
    b.op(
        Op::Transpose,
        name,
        vec![("x", var(&r)), ("perm", ints(&[0, 2, 1]))],
    )
}

/// [out, in] → [out, in, 1, 1].
pub(super) fn conv_shape(s: &[usize]) -> Vec<usize> {
    s.iter().copied().chain([1, 1]).collect()
}

/// A 1×1 conv: unit strides and dilations, no padding, one group.
pub(super) fn conv(b: &mut Builder, x: &str, w: &str, bias: Option<&String>, name: &str) -> String {
    let mut args = vec![
        ("x", var(x)),
        ("weight", var(w)),
        ("strides", ints(&[1, 1])),
        ("pad", ints(&[0, 0, 0, 0])),
        ("dilations", ints(&[1, 1])),
        ("groups", Arg::Int(1)),
    ];
    if let Some(bn) = bias {
        args.push(("bias", var(bn)));
    }
    b.op(Op::Conv, name, args)
}

/// `W·x (+ bias)` over [1, in, 1, Q] for a dense, palettized or calibrated weight (row
/// groups concatenated along the channels, restored to row order, scaled per row). A rotated
/// input is refused: its x·Q is written for the tokens-first layout.
pub(super) fn project(
    b: &mut Builder,
    w: LinearWeight,
    bias: Option<String>,
    x: &str,
    out: &str,
) -> Result<String, GraphError> {
    let (restore, scale, rotated) = w.restore_and_scale();
    if rotated {
        return Err(GraphError::Unsupported(format!(
            "`{out}`: rotated inputs (calibration.rotate) are not built in --layout ane"
        )));
    }
    for p in w.parts() {
        b.reshape_const(p, conv_shape)?;
    }
    let (restore, scale) = (restore.cloned(), scale.cloned());
    let plain = w.parts().len() == 1 && scale.is_none();
    if plain {
        return Ok(conv(b, x, &w.parts()[0], bias.as_ref(), out));
    }
    let mut y = if w.parts().len() == 1 {
        conv(b, x, &w.parts()[0], None, &format!("{out}_unscaled"))
    } else {
        let outs: Vec<String> = (w.parts().iter().enumerate())
            .map(|(g, p)| conv(b, x, p, None, &format!("{out}_g{g}")))
            .collect();
        b.op(
            Op::Concat,
            &format!("{out}_grouped"),
            vec![
                ("values", Arg::Vars(outs)),
                ("axis", Arg::Int(1)),
                ("interleave", Arg::Bool(false)),
            ],
        )
    };
    if let Some(at) = restore {
        y = b.op(
            Op::Gather,
            &format!("{out}_restored"),
            vec![("x", var(&y)), ("indices", var(&at)), ("axis", Arg::Int(1))],
        );
    }
    if let Some(sc) = scale {
        b.reshape_const(&sc, conv_bias_shape)?;
        let name = match bias {
            Some(_) => format!("{out}_scaled"),
            None => out.to_string(),
        };
        y = b.op(Op::Mul, &name, vec![("x", var(&y)), ("y", var(&sc))]);
    } else if bias.is_none() {
        y = b.op(Op::Identity, out, vec![("x", var(&y))]);
    }
    if let Some(bn) = bias {
        b.reshape_const(&bn, conv_bias_shape)?;
        y = b.op(Op::Add, out, vec![("x", var(&y)), ("y", var(&bn))]);
    }
    Ok(y)
}

/// [n] → [n, 1, 1]: a per-channel vector broadcasting over (1, n, 1, Q).
fn conv_bias_shape(s: &[usize]) -> Vec<usize> {
    s.iter().copied().chain([1, 1]).collect()
}

/// A norm's weight [C] as [C, 1, 1].
pub(super) fn norm_weight(
    b: &mut Builder,
    weights: &mut Weights,
    id: TensorId,
) -> Result<String, GraphError> {
    let w = weights.single(b, id)?;
    b.reshape_const(&w, conv_bias_shape)?;
    Ok(w)
}

/// A per-head norm's weight [D] as [D, 1]: it multiplies heads [1, n, D, Q] along D.
pub(super) fn head_norm_weight(
    b: &mut Builder,
    weights: &mut Weights,
    id: TensorId,
) -> Result<String, GraphError> {
    let w = weights.single(b, id)?;
    b.reshape_const(&w, |s: &[usize]| s.iter().copied().chain([1]).collect())?;
    Ok(w)
}

/// [1, n·D, 1, Q] → [1, n, D, Q]: each head's D channels (a reshape: the channels of head i are
/// contiguous).
pub(super) fn heads(b: &mut Builder, x: &str, n: usize, dims: &Dims, name: &str) -> String {
    b.op(
        Op::Reshape,
        &format!("{name}_heads"),
        vec![
            ("x", var(x)),
            ("shape", ints(&[1, n as i64, dims.d as i64, dims.q as i64])),
        ],
    )
}

/// [1, Hkv, D, Q] → [1, Hkv, Q, D]: the contract's key/value rows.
pub(super) fn rows(b: &mut Builder, x: &str, name: &str) -> String {
    b.op(
        Op::Transpose,
        name,
        vec![("x", var(x)), ("perm", ints(&[0, 1, 3, 2]))],
    )
}

/// Attention one key/value group at a time: queries [1, G, D, Q] · keys [1, 1, S+Q, D] →
/// scores [1, G, S+Q, Q], masked, soft-maxed over the keys, times the values → [1, G, D, Q];
/// the groups joined and laid out as [1, H·D, 1, Q].
pub(super) fn per_group(
    b: &mut Builder,
    qs: &str,
    keys: &str,
    values: &str,
    (mask, dims): (&str, &Dims),
    tag: &str,
) -> String {
    let (g, n) = (dims.h / dims.hkv, dims.s + dims.q);
    let (d, q) = (dims.d as i64, dims.q as i64);
    let slice = |b: &mut Builder, x: &str, from: usize, len: usize, last: [i64; 2], name: &str| {
        b.op(
            Op::SliceByIndex,
            name,
            vec![
                ("x", var(x)),
                ("begin", ints(&[0, from as i64, 0, 0])),
                ("end", ints(&[1, (from + len) as i64, last[0], last[1]])),
            ],
        )
    };
    let mut ctxs = Vec::with_capacity(dims.hkv);
    for grp in 0..dims.hkv {
        let t = format!("{tag}_group{grp}");
        let qg = match dims.hkv {
            1 => qs.to_string(),
            _ => slice(b, qs, grp * g, g, [d, q], &format!("{t}_q")),
        };
        let (kg, vg) = match dims.hkv {
            1 => (keys.to_string(), values.to_string()),
            _ => (
                slice(b, keys, grp, 1, [n as i64, d], &format!("{t}_k")),
                slice(b, values, grp, 1, [n as i64, d], &format!("{t}_v")),
            ),
        };
        let scores = matmul(b, &kg, &qg, false, &format!("{t}_scores"));
        let masked = b.op(
            Op::Add,
            &format!("{t}_scores_masked"),
            vec![("x", var(&scores)), ("y", var(mask))],
        );
        let probs = b.op(
            Op::Softmax,
            &format!("{t}_probs"),
            vec![("x", var(&masked)), ("axis", Arg::Int(2))],
        );
        ctxs.push(matmul(b, &vg, &probs, true, &format!("{t}_context")));
    }
    let ctx = match ctxs.len() {
        1 => ctxs.remove(0),
        _ => b.op(
            Op::Concat,
            &format!("{tag}_context"),
            vec![
                ("values", Arg::Vars(ctxs)),
                ("axis", Arg::Int(1)),
                ("interleave", Arg::Bool(false)),
            ],
        ),
    };
    b.op(
        Op::Reshape,
        &format!("{tag}_context_cf"),
        vec![
            ("x", var(&ctx)),
            ("shape", ints(&[1, (dims.h * dims.d) as i64, 1, q])),
        ],
    )
}

fn matmul(b: &mut Builder, x: &str, y: &str, transpose_x: bool, name: &str) -> String {
    b.op(
        Op::Matmul,
        name,
        vec![
            ("x", var(x)),
            ("y", var(y)),
            ("transpose_x", Arg::Bool(transpose_x)),
            ("transpose_y", Arg::Bool(false)),
        ],
    )
}
