//! One block's self-attention: q/k/v projections (with Qwen2's biases), heads, Qwen3's
//! per-head q/k norms, rotate-half RoPE (not in SmolLM3's NoPE blocks; on the leading part of
//! each head with Phi-4-mini's partial RoPE), the layer's cache rows joined with the new keys
//! and values, scaled dot-product attention under the shared mask, and the o projection.
//!
//! Grouped-query attention reads each key/value head once: the G query heads that share it are
//! stacked as rows ([1, H, Q, D] → [1, Hkv, G·Q, D], a reshape) and multiplied with the
//! unrepeated cache rows, so no copy of the cache is made per query head (the default
//! layout's core is [`super::attend`]; this file groups the masks for it, [`group_masks`]).

use super::linear::{Projections, Weights};
use super::lower::Lowering;
use super::norms::{rms_norm_ranged, rms_normalize_ranged};
use super::shared::Shared;
use super::step::Dims;
use crate::arch::{LayerTensor, TensorId};
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};

/// What attention hands back to the block.
pub(super) struct Attention {
    /// The o projection's output [1, Q, hidden].
    pub(super) out: String,
    /// This block's new keys (after RoPE) and values as the contract's cache rows of its slots
    /// [m, Hkv, Q, D], for the cache updates; `None` for a block that reads another block's
    /// (Gemma 4's KV sharing) and keeps none.
    pub(super) rows: Option<(String, String)>,
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
    let tag = format!("layers_{l}");
    let (q, kv, gate) = qkv(b, weights, proj, lower, shared, l, hn)?;
    let qs = b.op(
        Op::Mul,
        &format!("{tag}_q_scaled"),
        vec![("x", var(&q)), ("y", Arg::Float(shared.q_scale))],
    );
    let (keys, values, rows) = match kv {
        Some((k, v)) => {
            let (k, v) = lower.cache_rows(b, k, v, &tag);
            // The caches hold this package's attention blocks only (a chain's part starts at
            // `first_layer`; a hybrid model's other blocks keep no rows).
            let at = shared.slot(l);
            let kc = block_cache(b, &shared.key_cache, shared, (l, at), "key");
            let at = at + shared.value_offset;
            let vc = block_cache(b, &shared.value_cache, shared, (l, at), "value");
            let keys = join(b, &kc, &k, &format!("{tag}_keys"));
            let values = join(b, &vc, &v, &format!("{tag}_values"));
            let read_later = (l + 1..shared.kinds.len())
                .any(|c| shared.kinds[c].attention().and_then(|a| a.kv_from) == Some(l));
            if read_later {
                let joined = (keys.clone(), values.clone());
                shared.produced.borrow_mut().insert(l, joined);
            }
            let rows = (
                slot_rows(b, &k, shared, l, "key"),
                slot_rows(b, &v, shared, l, "value"),
            );
            (keys, values, Some(rows))
        }
        None => {
            let producer = shared.kinds[l].attention().and_then(|a| a.kv_from);
            let joined = producer.and_then(|p| shared.produced.borrow().get(&p).cloned());
            let (keys, values) = joined.ok_or_else(|| {
                GraphError::Unsupported(format!(
                    "block {l} reads the keys and values of block {producer:?}, which this \
                     package does not compute"
                ))
            })?;
            (keys, values, None)
        }
    };
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
    Ok(Attention { out, rows })
}

/// The queries, the keys and values (`None` for a block that reads another's) and Qwen3.5's
/// output gate, as [`qkv`] returns them.
type Qkv = (String, Option<(String, String)>, Option<String>);

/// Block `l`'s projections: q alone for a block that reads another's keys and values (Gemma
/// 4's KV sharing), q and k where the values are the raw key projection (Gemma 4's
/// `attention_k_eq_v` full blocks), else q, k and v.
fn projected(shared: &Shared, l: usize) -> &'static [(LayerTensor, &'static str)] {
    const ALL: &[(LayerTensor, &str)] = &[
        (LayerTensor::Q, "q"),
        (LayerTensor::K, "k"),
        (LayerTensor::V, "v"),
    ];
    let a = shared.kinds[l].attention();
    let k_eq_v =
        shared.gemma4.as_ref().is_some_and(|g| g.k_eq_v) && a.is_some_and(|a| a.window.is_none());
    match a.and_then(|a| a.kv_from) {
        Some(_) => &ALL[..1],
        None if k_eq_v => &ALL[..2],
        None => ALL,
    }
}

/// The queries after RoPE, and the keys after RoPE and the values (`None` for a block that
/// reads another's), as heads in the layout `lower` builds; with Qwen3.5's output gate, the
/// gate [1, Q, H·D] too.
fn qkv(
    b: &mut Builder,
    weights: &mut Weights,
    proj: &mut Projections,
    lower: &Lowering,
    shared: &Shared,
    l: usize,
    hn: &str,
) -> Result<Qkv, GraphError> {
    let (dims, tag) = (&shared.dims_of(l), format!("layers_{l}"));
    let tensors = projected(shared, l);
    let mut ws = Vec::with_capacity(3);
    for &(t, _) in tensors {
        ws.push(weights.linear(b, TensorId::Layer(l, t), 1.0)?);
    }
    let mut biases = [None, None, None];
    if shared.attention_bias {
        let ts = [LayerTensor::QBias, LayerTensor::KBias, LayerTensor::VBias];
        for (bias, t) in biases.iter_mut().zip(ts).take(tensors.len()) {
            *bias = Some(weights.single(b, TensorId::Layer(l, t))?);
        }
    }
    let mut out = Vec::with_capacity(3);
    for ((w, bias), &(_, n)) in ws.into_iter().zip(biases).zip(tensors) {
        out.push(lower.project(b, proj, w, bias, hn, &format!("{tag}_{n}"))?);
    }
    let gate = if shared.output_gate {
        let (query, gate) = lower.query_and_gate(b, &out[0], dims, &tag);
        out[0] = query;
        Some(gate)
    } else {
        None
    };
    let mut qh = lower.heads(b, &out[0], dims.h, dims, &format!("{tag}_q"));
    let mut kv = match out.get(1) {
        Some(k) => {
            let kh = lower.heads(b, k, dims.hkv, dims, &format!("{tag}_k"));
            let v = out.get(2).unwrap_or(k);
            let vh = lower.heads(b, v, dims.hkv, dims, &format!("{tag}_v"));
            Some((kh, vh))
        }
        None => None,
    };
    if let Some(eps) = shared.qk_norm_eps {
        let off = shared.norm_offset;
        let qw = lower.head_norm_weight(b, weights, TensorId::Layer(l, LayerTensor::QNorm), off)?;
        let kw = match kv {
            Some(_) => {
                let id = TensorId::Layer(l, LayerTensor::KNorm);
                Some(lower.head_norm_weight(b, weights, id, off)?)
            }
            None => None,
        };
        // Gemma 4's heads are normalised whatever their size (no softmax scale follows):
        // ranged norms keep small heads' squares out of fp16's subnormals.
        let norm = |b: &mut Builder, x: &str, w: &str, name: &str| match shared.gemma4 {
            Some(_) => Ok(rms_norm_ranged(b, x, w, eps, lower.head_axis(), name)),
            None => lower.head_norm(b, x, w, eps, name),
        };
        qh = norm(b, &qh, &qw, &format!("{tag}_q_norm"))?;
        if let (Some((kh, _)), Some(kw)) = (&mut kv, kw) {
            *kh = norm(b, kh, &kw, &format!("{tag}_k_norm"))?;
        }
    }
    // Gemma 4's values pass an RMSNorm without weight.
    if let (Some(_), Some((_, vh))) = (&shared.gemma4, &mut kv) {
        let name = format!("{tag}_v_norm");
        *vh = rms_normalize_ranged(b, vh, shared.plain_eps, lower.head_axis(), &name);
    }
    if !shared.rope_in_layer[l] {
        return Ok((qh, kv, gate));
    }
    let rope = lower.rope_tables(shared, l);
    let axis = lower.head_axis();
    let name = format!("{tag}_q_rope");
    let qr = apply_rope(b, &qh, (dims, dims.h, axis), shared, rope, &name)?;
    let kv = match kv {
        Some((kh, vh)) => {
            let name = format!("{tag}_k_rope");
            let kr = apply_rope(b, &kh, (dims, dims.hkv, axis), shared, rope, &name)?;
            Some((kr, vh))
        }
        None => None,
    };
    Ok((qr, kv, gate))
}

/// x·cos + rotate_half(x)·sin with rotate_half([a, b]) = [-b, a] along the heads' D `axis`
/// of x ([1, n, Q, D], or the Neural Engine layout's [1, n, D, Q] with its transposed tables).
/// With partial RoPE (Phi-4-mini, Qwen3.5) the first R dimensions form [a, b]; the rest are
/// carried along into the rotated copy, where the table's sin 0 (and cos 1) leave x's own.
fn apply_rope(
    b: &mut Builder,
    x: &str,
    (dims, n, axis): (&Dims, usize, i64),
    shared: &Shared,
    (cos, sin): (&str, &str),
    name: &str,
) -> Result<String, GraphError> {
    // Gemma 4's tables leave the unrotated pairs of a head as they are: it rotates it whole.
    let (d, r) = match shared.gemma4 {
        Some(_) => (dims.d, dims.d),
        None => (dims.d, shared.rotary),
    };
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
    } else {
        // The heads [1, n, Q, D] (default) or [1, n, D, Q]; D along `axis`.
        let (q, at) = (dims.q as i64, if axis == -1 { 3 } else { axis as usize });
        let shape = match at {
            3 => [1, n as i64, q, d as i64],
            _ => [1, n as i64, d as i64, q],
        };
        let mut slice = |from: usize, to: usize, part: &str| {
            let (mut begin, mut end) = ([0; 4], shape);
            (begin[at], end[at]) = (from as i64, to as i64);
            b.op(
                Op::SliceByIndex,
                &format!("{name}_{part}"),
                vec![("x", var(x)), ("begin", ints(&begin)), ("end", ints(&end))],
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

/// How block `l`'s heads fill the caches' slots: (m slots, k pieces of each head), (1, 1) for
/// a block of the model's own head shape ([`crate::arch::slot_pieces`]).
fn pieces(shared: &Shared, l: usize) -> (usize, usize) {
    let slot = (shared.dims.hkv, shared.dims.d);
    match shared.kinds[l].attention() {
        Some(a) => crate::arch::slot_pieces(*a, slot).unwrap_or((1, 1)),
        None => (1, 1),
    }
}

/// Block `l`'s rows of `cache` [L, Hkv, S, D] from slot `at`: [1, Hkv', S, D'] in its own head
/// shape. A block of another shape reads its m slots and puts each head's k pieces back side
/// by side along D.
fn block_cache(
    b: &mut Builder,
    cache: &str,
    shared: &Shared,
    (l, at): (usize, usize),
    what: &str,
) -> String {
    let dims = &shared.dims;
    let (m, k) = pieces(shared, l);
    let (hkv, s, d) = (dims.hkv as i64, dims.s as i64, dims.d as i64);
    let name = format!("layers_{l}_{what}_cache");
    let (at, m64) = (at as i64, m as i64);
    let slots = b.op(
        Op::SliceByIndex,
        &name,
        vec![
            ("x", var(cache)),
            ("begin", ints(&[at, 0, 0, 0])),
            ("end", ints(&[at + m64, hkv, s, d])),
        ],
    );
    if (m, k) == (1, 1) {
        return slots;
    }
    let flat = b.op(
        Op::Reshape,
        &format!("{name}_pieces"),
        vec![("x", var(&slots)), ("shape", ints(&[1, m64 * hkv, s, d]))],
    );
    match k {
        1 => flat,
        _ => regroup(b, &flat, k, (1, -1), &name),
    }
}

/// `x` split into `k` equal pieces along axis `from` and those joined along axis `to`
/// (`{name}_heads`).
fn regroup(b: &mut Builder, x: &str, k: usize, (from, to): (i64, i64), name: &str) -> String {
    let names: Vec<String> = (0..k).map(|j| format!("{name}_piece{j}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let parts = b.op_multi(
        Op::Split,
        &refs,
        vec![
            ("x", var(x)),
            ("num_splits", Arg::Int(k as i64)),
            ("axis", Arg::Int(from)),
        ],
    );
    b.op(
        Op::Concat,
        &format!("{name}_heads"),
        vec![
            ("values", Arg::Vars(parts)),
            ("axis", Arg::Int(to)),
            ("interleave", Arg::Bool(false)),
        ],
    )
}

/// Block `l`'s new rows [1, Hkv', Q, D'] as the rows of its slots [m, Hkv, Q, D]: each head
/// cut into k pieces along D, piece j of head h becoming head j·Hkv' + h.
fn slot_rows(b: &mut Builder, rows: &str, shared: &Shared, l: usize, what: &str) -> String {
    let (m, k) = pieces(shared, l);
    if (m, k) == (1, 1) {
        return rows.to_string();
    }
    let dims = &shared.dims;
    let name = format!("layers_{l}_{what}_slot_rows");
    let heads = match k {
        1 => rows.to_string(),
        _ => regroup(b, rows, k, (-1, 1), &name),
    };
    let (hkv, q, d) = (dims.hkv as i64, dims.q as i64, dims.d as i64);
    b.op(
        Op::Reshape,
        &name,
        vec![("x", var(&heads)), ("shape", ints(&[m as i64, hkv, q, d]))],
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
///
/// Blocks whose query heads per KV head differ from the model's (Gemma 4's full blocks) get
/// masks of their own, [`Shared::regrouped`].
pub(super) fn group_masks(b: &mut Builder, shared: &mut Shared) {
    let dims = &shared.dims;
    if dims.q == 1 {
        return;
    }
    let tile = |b: &mut Builder, m: &str, groups: usize, name: &str| {
        b.op(
            Op::Tile,
            name,
            vec![("x", var(m)), ("reps", ints(&[groups as i64, 1]))],
        )
    };
    let base = dims.h / dims.hkv;
    // (groups, windowed) of the blocks whose groups differ from the model's.
    let mut others: Vec<(usize, bool)> = (0..shared.kinds.len())
        .filter_map(|l| {
            let a = shared.kinds[l].attention()?;
            let windowed = shared.local.is_some() && shared.sliding[l];
            Some((dims.h / a.kv_heads, windowed))
        })
        .filter(|&(g, _)| g != base)
        .collect();
    others.sort_unstable();
    others.dedup();
    let mut groups: Vec<usize> = others.iter().map(|&(g, _)| g).collect();
    groups.dedup();
    for g in groups {
        let made = |b: &mut Builder, m: &str, name: &str| match g {
            1 => m.to_string(),
            _ => tile(b, m, g, &format!("{name}{g}")),
        };
        let mask = match others.contains(&(g, false)) {
            true => made(b, &shared.mask, "mask_grouped"),
            false => String::new(),
        };
        let window = match (&shared.local, others.contains(&(g, true))) {
            (Some((_, _, w)), true) => Some(made(b, w, "window_mask_grouped")),
            _ => None,
        };
        shared.regrouped.push((g, mask, window));
    }
    if base == 1 {
        return;
    }
    shared.mask = tile(b, &shared.mask, base, "mask_grouped");
    if let Some((_, _, window)) = &mut shared.local {
        *window = tile(b, window, base, "window_mask_grouped");
    }
}
