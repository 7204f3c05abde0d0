//! What every block shares: the RoPE rows of this step's positions and the attention mask
//! [Q, S+Q] over the cache and the new tokens.

use half::f16;

use super::{Dims, MASK_VALUE};
use crate::arch::ModelSpec;
use crate::graph::{ints, rope, var, Arg, Builder, ConstData, Op};

/// The shared constants: RoPE tables, position offsets, mask pieces.
pub(super) struct Tables {
    cos: String,
    sin: String,
    arange_q: String,
    arange_s: String,
    open: String,
    closed: String,
    causal: String,
}

impl Tables {
    pub(super) fn new(b: &mut Builder, spec: &ModelSpec, dims: &Dims) -> Self {
        let (s, q, d) = (dims.s, dims.q, dims.d);
        let inv = rope::inv_freq(spec.rotary_dim(), spec.rope_theta, &spec.rope_scaling);
        let scale = spec.rope_scaling.attention_factor();
        let (cos_t, sin_t) = rope::tables(s, d, &inv, scale);
        let to16 = |v: Vec<f64>| v.into_iter().map(f16::from_f64).collect::<Vec<_>>();
        let cos = b.constant("rope_cos", vec![s, d], ConstData::F16(to16(cos_t)), None);
        let sin = b.constant("rope_sin", vec![s, d], ConstData::F16(to16(sin_t)), None);
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
            ConstData::F16(causal_block(q)),
            None,
        );
        Tables {
            cos,
            sin,
            arange_q,
            arange_s,
            open,
            closed,
            causal,
        }
    }
}

/// [Q, Q]: new token k visible from query i iff k <= i.
fn causal_block(q: usize) -> Vec<f16> {
    (0..q)
        .flat_map(|i| {
            (0..q).map(move |k| {
                if k <= i {
                    f16::ZERO
                } else {
                    f16::from_f32(MASK_VALUE)
                }
            })
        })
        .collect()
}

/// Positions p .. p+Q-1 → the cos and sin rows [Q, D].
pub(super) fn rope_rows(b: &mut Builder, t: &Tables, position: &str) -> (String, String) {
    let pos_ids = b.op(
        Op::Add,
        "position_ids",
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
    let cos = rows(&t.cos, "rope_cos_rows");
    let sin = rows(&t.sin, "rope_sin_rows");
    (cos, sin)
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
