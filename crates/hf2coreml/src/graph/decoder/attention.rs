//! One block's self-attention: q/k/v projections (with Qwen2's biases), heads, Qwen3's
//! per-head q/k norms, rotate-half RoPE (not in SmolLM3's NoPE blocks; on the leading part of
//! each head with Phi-4-mini's partial RoPE), the layer's cache rows joined with the new keys
//! and values, scaled dot-product attention under the shared mask, and the o projection.
//!
//! Grouped-query attention reads each key/value head once: the G query heads that share it are
//! stacked as rows ([1, H, Q, D] → [1, Hkv, G·Q, D], a reshape) and multiplied with the
//! unrepeated cache rows, so no copy of the cache is made per query head.

use super::linear::{Projections, Weights};
use super::lower::Lowering;
use super::{Dims, Shared};
use crate::arch::{LayerTensor, TensorId};
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};

/// What attention hands back to the block.
pub(super) struct Attention {
    /// The o projection's output [1, Q, hidden].
    pub(super) out: String,
    /// This layer's new keys (after RoPE) and values as the contract's cache rows
    /// [1, Hkv, Q, D], for the cache updates.
    pub(super) key_row: String,
    pub(super) value_row: String,
}

/// Self-attention of block `l` over its normed input `hn`, in the layout `lower` builds.
pub(super) fn attention(
    b: &mut Builder,
    weights: &mut Weights,
    proj: &mut Projections,
    lower: &Lowering,
    shared: &Shared,
    l: usize,
    hn: &str,
) -> Result<Attention, GraphError> {
    let dims = &shared.dims;
    let tag = format!("layers_{l}");
    let (q, k, v, gate) = qkv(b, weights, proj, lower, shared, l, hn)?;
    let qs = b.op(
        Op::Mul,
        &format!("{tag}_q_scaled"),
        vec![("x", var(&q)), ("y", Arg::Float(shared.q_scale))],
    );
    let (k, v) = lower.cache_rows(b, k, v, &tag);
    // The caches hold this package's attention blocks only (a chain's part starts at
    // `first_layer`; a hybrid model's other blocks keep no rows).
    let at = shared.slot(l);
    let kc = cache_rows(b, &shared.key_cache, dims, at, &format!("{tag}_key_cache"));
    let vc = cache_rows(
        b,
        &shared.value_cache,
        dims,
        at + shared.value_offset,
        &format!("{tag}_value_cache"),
    );
    let keys = join(b, &kc, &k, &format!("{tag}_keys"));
    let values = join(b, &vc, &v, &format!("{tag}_values"));
    let mut ctx = lower.attend(b, shared, l, (&qs, &keys, &values), &tag);
    if let Some(gate) = gate {
        let sg = b.op(
            Op::Sigmoid,
            &format!("{tag}_output_gate_sigmoid"),
            vec![("x", var(&gate))],
        );
        ctx = b.op(
            Op::Mul,
            &format!("{tag}_output_gated"),
            vec![("x", var(&ctx)), ("y", var(&sg))],
        );
    }
    let wo = weights.linear(b, TensorId::Layer(l, LayerTensor::O), shared.alpha)?;
    let out = lower.project(b, proj, wo, None, &ctx, &format!("{tag}_attn_out"))?;
    Ok(Attention {
        out,
        key_row: k,
        value_row: v,
    })
}

/// The queries and keys after RoPE, and the values, as heads in the layout `lower` builds;
/// with Qwen3.5's output gate, the gate [1, Q, H·D] too.
fn qkv(
    b: &mut Builder,
    weights: &mut Weights,
    proj: &mut Projections,
    lower: &Lowering,
    shared: &Shared,
    l: usize,
    hn: &str,
) -> Result<(String, String, String, Option<String>), GraphError> {
    let (dims, tag) = (&shared.dims, format!("layers_{l}"));
    let mut ws = Vec::with_capacity(3);
    for t in [LayerTensor::Q, LayerTensor::K, LayerTensor::V] {
        ws.push(weights.linear(b, TensorId::Layer(l, t), 1.0)?);
    }
    let mut biases = [None, None, None];
    if shared.attention_bias {
        let ts = [LayerTensor::QBias, LayerTensor::KBias, LayerTensor::VBias];
        for (bias, t) in biases.iter_mut().zip(ts) {
            *bias = Some(weights.single(b, TensorId::Layer(l, t))?);
        }
    }
    let mut out = Vec::with_capacity(3);
    for ((w, bias), n) in ws.into_iter().zip(biases).zip(["q", "k", "v"]) {
        out.push(lower.project(b, proj, w, bias, hn, &format!("{tag}_{n}"))?);
    }
    let gate = if shared.output_gate {
        let Lowering::Default = lower else {
            return Err(GraphError::Unsupported(
                "gated attention (Qwen3.5) is built in the default layout only: use --layout \
                 default"
                    .into(),
            ));
        };
        let (q, n, d) = (dims.q as i64, dims.h as i64, dims.d as i64);
        // Each head's rows are D query rows, then D gate rows.
        let both = b.op(
            Op::Reshape,
            &format!("{tag}_q_gate"),
            vec![("x", var(&out[0])), ("shape", ints(&[1, q, n, 2 * d]))],
        );
        let mut half = |i: i64, what: &str| {
            let part = b.op(
                Op::SliceByIndex,
                &format!("{tag}_{what}_heads"),
                vec![
                    ("x", var(&both)),
                    ("begin", ints(&[0, 0, 0, i * d])),
                    ("end", ints(&[1, q, n, (i + 1) * d])),
                ],
            );
            b.op(
                Op::Reshape,
                &format!("{tag}_{what}_flat"),
                vec![("x", var(&part)), ("shape", ints(&[1, q, n * d]))],
            )
        };
        out[0] = half(0, "query");
        Some(half(1, "gate"))
    } else {
        None
    };
    let mut qh = lower.heads(b, &out[0], dims.h, dims, &format!("{tag}_q"));
    let mut kh = lower.heads(b, &out[1], dims.hkv, dims, &format!("{tag}_k"));
    let vh = lower.heads(b, &out[2], dims.hkv, dims, &format!("{tag}_v"));
    if let Some(eps) = shared.qk_norm_eps {
        let off = shared.norm_offset;
        let qw = lower.head_norm_weight(b, weights, TensorId::Layer(l, LayerTensor::QNorm), off)?;
        let kw = lower.head_norm_weight(b, weights, TensorId::Layer(l, LayerTensor::KNorm), off)?;
        qh = lower.head_norm(b, &qh, &qw, eps, &format!("{tag}_q_norm"))?;
        kh = lower.head_norm(b, &kh, &kw, eps, &format!("{tag}_k_norm"))?;
    }
    if !shared.rope_in_layer[l] {
        return Ok((qh, kh, vh, gate));
    }
    let rope = lower.rope_tables(shared, l);
    let axis = lower.head_axis();
    let qr = apply_rope(
        b,
        &qh,
        (dims.h, axis),
        shared,
        rope,
        &format!("{tag}_q_rope"),
    )?;
    let kr = apply_rope(
        b,
        &kh,
        (dims.hkv, axis),
        shared,
        rope,
        &format!("{tag}_k_rope"),
    )?;
    Ok((qr, kr, vh, gate))
}

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
    super::rms_norm(b, &xs, w, eps * c * c, axis, name)
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

/// x·cos + rotate_half(x)·sin with rotate_half([a, b]) = [-b, a] along the heads' D `axis`
/// of x ([1, n, Q, D], or the Neural Engine layout's [1, n, D, Q] with its transposed tables).
/// With partial RoPE (the default layout only) the first R dimensions form [a, b]; the rest are
/// carried along into the rotated copy, where the table's sin 0 (and cos 1) leave x's own.
fn apply_rope(
    b: &mut Builder,
    x: &str,
    (n, axis): (usize, i64),
    shared: &Shared,
    (cos, sin): (&str, &str),
    name: &str,
) -> Result<String, GraphError> {
    let (d, r) = (shared.dims.d, shared.rotary);
    let pieces: Vec<String> = if r == d {
        b.op_multi(
            Op::Split,
            &[&format!("{name}_lo"), &format!("{name}_hi")],
            vec![
                ("x", var(x)),
                ("num_splits", Arg::Int(2)),
                ("axis", Arg::Int(axis)),
            ],
        )
    } else if axis != -1 {
        return Err(GraphError::Unsupported(
            "partial RoPE (Phi-4-mini) is not built in --layout ane: use --layout default".into(),
        ));
    } else {
        let end = [1, n as i64, shared.dims.q as i64];
        let mut slice = |from: usize, to: usize, part: &str| {
            b.op(
                Op::SliceByIndex,
                &format!("{name}_{part}"),
                vec![
                    ("x", var(x)),
                    ("begin", ints(&[0, 0, 0, from as i64])),
                    ("end", ints(&[end[0], end[1], end[2], to as i64])),
                ],
            )
        };
        vec![
            slice(0, r / 2, "lo"),
            slice(r / 2, r, "hi"),
            slice(r, d, "pass"),
        ]
    };
    let neg_hi = b.op(
        Op::Mul,
        &format!("{name}_neg_hi"),
        vec![("x", var(&pieces[1])), ("y", Arg::Float(-1.0))],
    );
    let mut rotated = vec![neg_hi, pieces[0].clone()];
    rotated.extend(pieces.get(2).cloned());
    let rot = b.op(
        Op::Concat,
        &format!("{name}_rotated"),
        vec![
            ("values", Arg::Vars(rotated)),
            ("axis", Arg::Int(axis)),
            ("interleave", Arg::Bool(false)),
        ],
    );
    let xc = b.op(
        Op::Mul,
        &format!("{name}_cos"),
        vec![("x", var(x)), ("y", var(cos))],
    );
    let rs = b.op(
        Op::Mul,
        &format!("{name}_sin"),
        vec![("x", var(&rot)), ("y", var(sin))],
    );
    Ok(b.op(Op::Add, name, vec![("x", var(&xc)), ("y", var(&rs))]))
}

/// Layer `l`'s rows of `cache` [L, Hkv, S, D]: [1, Hkv, S, D].
fn cache_rows(b: &mut Builder, cache: &str, dims: &Dims, l: usize, name: &str) -> String {
    let (hkv, s, d) = (dims.hkv as i64, dims.s as i64, dims.d as i64);
    b.op(
        Op::SliceByIndex,
        name,
        vec![
            ("x", var(cache)),
            ("begin", ints(&[l as i64, 0, 0, 0])),
            ("end", ints(&[l as i64 + 1, hkv, s, d])),
        ],
    )
}

/// The cached rows followed by the new ones: [1, Hkv, S+Q, D].
fn join(b: &mut Builder, cached: &str, new: &str, name: &str) -> String {
    b.op(
        Op::Concat,
        name,
        vec![
            (
                "values",
                Arg::Vars(vec![cached.to_string(), new.to_string()]),
            ),
            ("axis", Arg::Int(2)),
            ("interleave", Arg::Bool(false)),
        ],
    )
}

/// The masks as the grouped scores [1, Hkv, G·Q, N] read them: their Q rows once per query
/// head of a group (G·Q rows, once for the whole step). With Q = 1 or without grouping the
/// [Q, N] masks broadcast as they are and nothing is made.
pub(super) fn group_masks(b: &mut Builder, shared: &mut Shared) {
    let dims = &shared.dims;
    let groups = dims.h / dims.hkv;
    if groups == 1 || dims.q == 1 {
        return;
    }
    let mut tile = |m: &str, name: &str| {
        b.op(
            Op::Tile,
            name,
            vec![("x", var(m)), ("reps", ints(&[groups as i64, 1]))],
        )
    };
    shared.mask = tile(&shared.mask, "mask_grouped");
    if let Some((_, _, window)) = &mut shared.local {
        *window = tile(window, "window_mask_grouped");
    }
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
