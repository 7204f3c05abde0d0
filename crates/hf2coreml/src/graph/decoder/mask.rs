//! What every block shares: the RoPE rows of this step's positions and the attention mask
//! [Q, S+Q] over the cache and the new tokens.

use half::f16;

use super::step::{Dims, MASK_VALUE};
use crate::arch::ModelSpec;
use crate::graph::{ints, rope, var, Arg, Builder, ConstData, Op};

/// The shared constants: RoPE tables, position offsets, mask pieces.
pub(super) struct Tables {
    cos: String,
    sin: String,
    /// Gemma's sliding blocks: their RoPE tables and window W.
    local: Option<(String, String, usize)>,
    arange_q: String,
    arange_s: String,
    open: String,
    closed: String,
    causal: String,
}

impl Tables {
    /// `padded_tail`: the RoPE tables cover S + Q − 1 positions, so a chunk whose padding
    /// runs past S gathers rows for it (a hybrid package's chunks never slide back).
    pub(super) fn new(b: &mut Builder, spec: &ModelSpec, dims: &Dims, padded_tail: bool) -> Self {
        let (s, q) = (dims.s, dims.q);
        let rows = if padded_tail { s + q - 1 } else { s };
        let scaling = &spec.rope_scaling;
        // Gemma 4's full blocks: heads of their own size, proportional frequencies.
        let (width, inv) = match &spec.gemma4 {
            Some(g) => (g.global_head_dim, g.full_inv_freq(spec.rope_theta)),
            None => (
                dims.d,
                rope::inv_freq(spec.rotary_dim(), spec.rope_theta, scaling),
            ),
        };
        let factor = scaling.attention_factor();
        let (cos, sin) = rope_table(b, (rows, width), (&inv, factor), "rope");
        let local = match (&spec.gemma, spec.sliding_window) {
            (Some(g), Some(w)) if !g.sliding_layers.is_empty() => {
                let none = crate::arch::RopeScaling::None;
                let inv = rope::inv_freq(spec.rotary_dim(), g.local_rope_theta, &none);
                let (c, s) = rope_table(b, (rows, dims.d), (&inv, 1.0), "rope_local");
                Some((c, s, w))
            }
            _ => None,
        };
        let arange_q = b.constant(
            "arange_q",
            vec![q],
            ConstData::I32((0..q as i32).collect()),
            None,
        );
        let arange_s = b.constant(
            "arange_s",
            vec![s],
            ConstData::I32((0..s as i32).collect()),
            None,
        );
        let open = b.constant(
            "mask_open",
            vec![s],
            ConstData::F16(vec![f16::ZERO; s]),
            None,
        );
        let closed = b.constant(
            "mask_closed",
            vec![s],
            ConstData::F16(vec![f16::from_f32(MASK_VALUE); s]),
            None,
        );
        let causal = b.constant(
            "mask_causal",
            vec![q, q],
            ConstData::F16(causal_block(q, None)),
            None,
        );
        Tables {
            cos,
            sin,
            local,
            arange_q,
            arange_s,
            open,
            closed,
            causal,
        }
    }
}

/// The cos and sin tables [S, D] of inverse frequencies `inv` (a pair each) with their rotated
/// entries times `factor`, named `name_cos`/`_sin`.
fn rope_table(
    b: &mut Builder,
    (s, d): (usize, usize),
    (inv, factor): (&[f64], f64),
    name: &str,
) -> (String, String) {
    let (cos_t, sin_t) = rope::tables(s, d, inv, factor);
    let to16 = |v: Vec<f64>| v.into_iter().map(f16::from_f64).collect::<Vec<_>>();
    let cos = b.constant(
        &format!("{name}_cos"),
        vec![s, d],
        ConstData::F16(to16(cos_t)),
        None,
    );
    let sin = b.constant(
        &format!("{name}_sin"),
        vec![s, d],
        ConstData::F16(to16(sin_t)),
        None,
    );
    (cos, sin)
}

/// [Q, Q]: new token k visible from query i iff k <= i (and i - k < W within a window W).
fn causal_block(q: usize, window: Option<usize>) -> Vec<f16> {
    (0..q)
        .flat_map(|i| {
            (0..q).map(move |k| {
                if k <= i && window.is_none_or(|w| i - k < w) {
                    f16::ZERO
                } else {
                    f16::from_f32(MASK_VALUE)
                }
            })
        })
        .collect()
}

/// Positions p .. p+Q-1 → the cos and sin rows [Q, D] (`local`: of Gemma's sliding blocks'
/// tables, if the model has them).
pub(super) fn rope_rows(
    b: &mut Builder,
    t: &Tables,
    position: &str,
    local: bool,
) -> Option<(String, String)> {
    let (cos, sin, tag) = match (&t.local, local) {
        (_, false) => (&t.cos, &t.sin, "rope"),
        (Some((cos, sin, _)), true) => (cos, sin, "rope_local"),
        (None, true) => return None,
    };
    let pos_ids = b.op(
        Op::Add,
        &format!("{tag}_position_ids"),
        vec![("x", var(position)), ("y", var(&t.arange_q))],
    );
    let mut rows = |table: &str, name: &str| {
        b.op(
            Op::Gather,
            name,
            vec![
                ("x", var(table)),
                ("indices", var(&pos_ids)),
                ("axis", Arg::Int(0)),
            ],
        )
    };
    let cos = rows(cos, &format!("{tag}_cos_rows"));
    let sin = rows(sin, &format!("{tag}_sin_rows"));
    Some((cos, sin))
}

/// Gemma's sliding blocks' mask [Q, S+Q], if the model has them: query i (position p + i) sees
/// cache row j iff p + i - W < j < p, and new token k iff i - W < k <= i (transformers'
/// `sliding_window_overlay`: kv > q - W).
pub(super) fn window_mask(
    b: &mut Builder,
    t: &Tables,
    position: &str,
    dims: &Dims,
) -> Option<String> {
    let (_, _, w) = t.local.as_ref()?;
    let (s, q) = (dims.s as i64, dims.q as i64);
    let pos = b.op(
        Op::Add,
        "window_position_ids",
        vec![("x", var(position)), ("y", var(&t.arange_q))],
    );
    let lower = b.op(
        Op::Add,
        "window_lowest_row",
        vec![("x", var(&pos)), ("y", Arg::Int(1 - *w as i64))],
    );
    let lower = b.op(
        Op::Reshape,
        "window_lowest_row_2d",
        vec![("x", var(&lower)), ("shape", ints(&[q, 1]))],
    );
    let rows = b.op(
        Op::Reshape,
        "window_rows_2d",
        vec![("x", var(&t.arange_s)), ("shape", ints(&[1, s]))],
    );
    let in_window = b.op(
        Op::GreaterEqual,
        "window_in",
        vec![("x", var(&rows)), ("y", var(&lower))],
    );
    let cached = b.op(
        Op::Less,
        "window_cached",
        vec![("x", var(&t.arange_s)), ("y", var(position))],
    );
    let visible = b.op(
        Op::LogicalAnd,
        "window_visible",
        vec![("x", var(&in_window)), ("y", var(&cached))],
    );
    // coremltools' `select` takes its shape from `a` and `b`: they are [Q, S] here.
    let n = dims.q * dims.s;
    let open = b.constant(
        "window_open",
        vec![dims.q, dims.s],
        ConstData::F16(vec![f16::ZERO; n]),
        None,
    );
    let closed = b.constant(
        "window_closed",
        vec![dims.q, dims.s],
        ConstData::F16(vec![f16::from_f32(MASK_VALUE); n]),
        None,
    );
    let cache_mask = b.op(
        Op::Select,
        "window_mask_cache",
        vec![
            ("cond", var(&visible)),
            ("a", var(&open)),
            ("b", var(&closed)),
        ],
    );
    let block = b.constant(
        "window_mask_causal",
        vec![dims.q, dims.q],
        ConstData::F16(causal_block(dims.q, Some(*w))),
        None,
    );
    Some(b.op(
        Op::Concat,
        "window_mask",
        vec![
            ("values", Arg::Vars(vec![cache_mask, block])),
            ("axis", Arg::Int(-1)),
            ("interleave", Arg::Bool(false)),
        ],
    ))
}

/// The mask [Q, S+Q]: cache row j visible iff j < p; new token k visible from i iff k <= i.
pub(super) fn mask(b: &mut Builder, t: &Tables, position: &str, dims: &Dims) -> String {
    let visible = b.op(
        Op::Less,
        "mask_cache_visible",
        vec![("x", var(&t.arange_s)), ("y", var(position))],
    );
    let row = b.op(
        Op::Select,
        "mask_cache_row",
        vec![
            ("cond", var(&visible)),
            ("a", var(&t.open)),
            ("b", var(&t.closed)),
        ],
    );
    let row = b.op(
        Op::Reshape,
        "mask_cache_row_2d",
        vec![("x", var(&row)), ("shape", ints(&[1, dims.s as i64]))],
    );
    let cache_mask = b.op(
        Op::Tile,
        "mask_cache",
        vec![("x", var(&row)), ("reps", ints(&[dims.q as i64, 1]))],
    );
    b.op(
        Op::Concat,
        "mask",
        vec![
            ("values", Arg::Vars(vec![cache_mask, t.causal.clone()])),
            ("axis", Arg::Int(-1)),
            ("interleave", Arg::Bool(false)),
        ],
    )
}
