//! The embedding and the lm_head, with the logits in parts of at most 16,384
//! ([`contract::logits_widths`]): the Neural Engine compiler refuses a last axis wider than
//! that (docs/design.md, "Neural Engine readiness"). Each part is one `linear` over its own
//! rows of the lm_head, returned as its own output (`logits_0`, `logits_1`, ...); the host
//! concatenates them. A tied table is stored once, as the parts (`NAME_g0`, `NAME_g1`, ...,
//! the row-group names `validate` already reassembles), and the embedding gathers from them:
//! each part is gathered at the token's row clamped into it, and `select` keeps the part that
//! holds the token.
//!
//! A `prefill` function with `--prefill-logits last` takes its logits from one row: a padded
//! chunk's last real token is [`last_real`], in either layout.

use super::linear::Weights;
use crate::arch::{mil_name, TensorId};
use crate::graph::{ints, var, Arg, Builder, ConstData, GraphError, Op, Weight};
use crate::mil::contract;
use crate::quant::pack::{pack_indices, unpack_indices};
use crate::quant::{PackedLut, QuantizedWeight};

/// The lm_head as the graph holds it: one constant per logits part.
pub(super) struct Head {
    pub(super) parts: Vec<String>,
}

/// The embedded tokens times α, and the lm_head (the same constants when tied) when
/// `with_head` (a chain's first part computes no logits: docs/design.md, "Chained packages").
pub(super) fn embedding_and_head(
    b: &mut Builder,
    weights: &mut Weights,
    tied: bool,
    input_ids: &str,
    alpha: f64,
    with_head: bool,
) -> Result<(String, Option<Head>), GraphError> {
    let (name, shape, table) = weights.take(TensorId::Embedding)?;
    let widths = contract::logits_widths(shape[0]);
    let table_parts = if tied {
        row_parts(b, &name, &shape, table, &widths)?
    } else {
        vec![constant(b, &mil_name(&name), shape, table, &name)?]
    };
    let mut x = gather_rows(b, &table_parts, &widths, input_ids, tied, None)?;
    if alpha != 1.0 {
        x = b.op(
            Op::Mul,
            "embed_scaled",
            vec![("x", var(&x)), ("y", Arg::Float(alpha))],
        );
    }
    let head = match (with_head, tied) {
        (false, _) => None,
        (true, true) => Some(Head { parts: table_parts }),
        (true, false) => Some(head(b, weights, false)?),
    };
    Ok((x, head))
}

/// The lm_head alone (the tied table, laid out as [`embedding_and_head`] lays it out), for a
/// chain's last part, which takes the hidden state instead of token ids.
pub(super) fn head(b: &mut Builder, weights: &mut Weights, tied: bool) -> Result<Head, GraphError> {
    let id = if tied {
        TensorId::Embedding
    } else {
        TensorId::LmHead
    };
    let (name, shape, w) = weights.take(id)?;
    let parts = row_parts(b, &name, &shape, w, &contract::logits_widths(shape[0]))?;
    Ok(Head { parts })
}

/// One `linear` per part, named as the contract's outputs; with a soft cap c (Gemma 4's
/// `final_logit_softcapping`) each part becomes c·tanh(part / c).
pub(super) fn logits(b: &mut Builder, head: &Head, hn: &str, softcap: Option<f64>) -> Vec<String> {
    let n = head.parts.len();
    head.parts
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let name = contract::logits_name(i, n);
            let args = vec![("x", var(hn)), ("weight", var(w))];
            let Some(c) = softcap else {
                return b.op(Op::Linear, &name, args);
            };
            let raw = b.op(Op::Linear, &format!("{name}_uncapped"), args);
            soft_cap(b, &raw, c, &name)
        })
        .collect()
}

/// c·tanh(x / c), named `name`: Gemma 4's `final_logit_softcapping` of the logits `x`.
pub(super) fn soft_cap(b: &mut Builder, x: &str, c: f64, name: &str) -> String {
    let t = b.op(
        Op::Mul,
        &format!("{name}_over_cap"),
        vec![("x", var(x)), ("y", Arg::Float(1.0 / c))],
    );
    let t = b.op(Op::Tanh, &format!("{name}_tanh"), vec![("x", var(&t))]);
    b.op(Op::Mul, name, vec![("x", var(&t)), ("y", Arg::Float(c))])
}

/// The rows of `input_ids` [1, Q] from the table's parts: one `gather` when the table is one
/// part (or `split` is off), else each part gathered at the token's row clamped into it and
/// `select` keeping the part that holds it. With `conv` = (Q, C) the parts are the Neural
/// Engine layout's [w, C, 1, 1] convolution weights, and each gather is reshaped to [1, Q, C].
pub(super) fn gather_rows(
    b: &mut Builder,
    parts: &[String],
    widths: &[usize],
    input_ids: &str,
    split: bool,
    conv: Option<(usize, usize)>,
) -> Result<String, GraphError> {
    let gather = |b: &mut Builder, part: &str, rows: &str, i: usize, name: &str| {
        let args = |rows: &str| {
            vec![
                ("x", var(part)),
                ("indices", var(rows)),
                ("axis", Arg::Int(0)),
            ]
        };
        match conv {
            None => b.op(Op::Gather, name, args(rows)),
            Some((q, c)) => {
                let got = b.op(Op::Gather, &format!("embed_part{i}_rows"), args(rows));
                b.op(
                    Op::Reshape,
                    name,
                    vec![("x", var(&got)), ("shape", ints(&[1, q as i64, c as i64]))],
                )
            }
        }
    };
    if !split || parts.len() == 1 {
        return Ok(gather(b, &parts[0], input_ids, 0, "embed"));
    }
    let mut x = String::new();
    let mut offset = 0usize;
    for (i, (part, &w)) in parts.iter().zip(widths).enumerate() {
        let local = b.op(
            Op::Sub,
            &format!("embed_part{i}_local"),
            vec![("x", var(input_ids)), ("y", Arg::Int(offset as i64))],
        );
        let below = b.op(
            Op::Minimum,
            &format!("embed_part{i}_below"),
            vec![("x", var(&local)), ("y", Arg::Int(w as i64 - 1))],
        );
        let row = b.op(
            Op::Maximum,
            &format!("embed_part{i}_row"),
            vec![("x", var(&below)), ("y", Arg::Int(0))],
        );
        let got = gather(b, part, &row, i, &format!("embed_part{i}"));
        x = if i == 0 {
            got
        } else {
            let inside = b.op(
                Op::GreaterEqual,
                &format!("embed_part{i}_holds"),
                vec![("x", var(input_ids)), ("y", Arg::Int(offset as i64))],
            );
            let inside = b.op(
                Op::ExpandDims,
                &format!("embed_part{i}_holds_3d"),
                vec![("x", var(&inside)), ("axes", ints(&[-1]))],
            );
            let name = if i + 1 == parts.len() {
                "embed".to_string()
            } else {
                format!("embed_upto{i}")
            };
            b.op(
                Op::Select,
                &name,
                vec![("cond", var(&inside)), ("a", var(&got)), ("b", var(&x))],
            )
        };
        offset += w;
    }
    Ok(x)
}

/// One constant of the whole weight.
fn constant(
    b: &mut Builder,
    cname: &str,
    shape: Vec<usize>,
    w: Weight,
    source: &str,
) -> Result<String, GraphError> {
    let data = match w {
        Weight::Dense(v) => ConstData::F16(v),
        Weight::Quantized(q) if q.is_plain() => match q.groups.into_iter().next() {
            Some(g) => ConstData::Lut(g.lut),
            None => return Err(calibrated(source)),
        },
        Weight::Quantized(_) => return Err(calibrated(source)),
    };
    Ok(b.constant(cname, shape, data, Some(source.to_string())))
}

fn calibrated(name: &str) -> GraphError {
    GraphError::Unsupported(format!(
        "`{name}` is calibrated (row groups, row scales or a rotated input), which only \
         projections can be"
    ))
}

/// The weight's rows split into consecutive parts of `widths` rows (`NAME_g0`, ...), or one
/// constant named `NAME` when one part covers them all.
pub(super) fn row_parts(
    b: &mut Builder,
    name: &str,
    shape: &[usize],
    w: Weight,
    widths: &[usize],
) -> Result<Vec<String>, GraphError> {
    let cname = mil_name(name);
    if widths.len() == 1 {
        return Ok(vec![constant(b, &cname, shape.to_vec(), w, name)?]);
    }
    let cols = shape.get(1).copied().unwrap_or(1);
    let rows = widths.iter().map(|&r| r * cols);
    let datas: Vec<ConstData> = match w {
        // The first part keeps the table's own allocation (truncated), so the split holds the
        // table once plus the other parts, not two whole copies (tests/it/convert/memory.rs).
        Weight::Dense(mut v) => {
            let first = (widths[0] * cols).min(v.len());
            let rest: Vec<ConstData> = split(&v[first..], rows.skip(1))
                .map(ConstData::F16)
                .collect();
            v.truncate(first);
            v.shrink_to_fit();
            std::iter::once(ConstData::F16(v)).chain(rest).collect()
        }
        Weight::Quantized(q) => split_lut(q, rows, name)?,
    };
    Ok(datas
        .into_iter()
        .zip(widths)
        .enumerate()
        .map(|(g, (data, &r))| {
            b.constant(
                &format!("{cname}_g{g}"),
                vec![r, cols],
                data,
                Some(name.to_string()),
            )
        })
        .collect())
}

/// `v` cut into consecutive chunks of the given lengths.
fn split<'a, T: Clone + 'a>(
    v: &'a [T],
    lens: impl Iterator<Item = usize> + 'a,
) -> impl Iterator<Item = Vec<T>> + 'a {
    let mut at = 0;
    lens.map(move |n| {
        let part = v[at.min(v.len())..(at + n).min(v.len())].to_vec();
        at += n;
        part
    })
}

/// A one-LUT palettized weight cut into row parts that share its LUT.
fn split_lut(
    q: QuantizedWeight,
    lens: impl Iterator<Item = usize>,
    name: &str,
) -> Result<Vec<ConstData>, GraphError> {
    if !q.is_plain() {
        return Err(calibrated(name));
    }
    let Some(g) = q.groups.into_iter().next() else {
        return Err(calibrated(name));
    };
    let lens: Vec<usize> = lens.collect();
    let n: usize = lens.iter().sum();
    let idx = unpack_indices(&g.lut.packed, g.lut.nbits, n);
    Ok(split(&idx, lens.into_iter())
        .map(|part| {
            ConstData::Lut(PackedLut {
                nbits: g.lut.nbits,
                lut: g.lut.lut.clone(),
                packed: pack_indices(&part, g.lut.nbits),
            })
        })
        .collect())
}

/// Row `valid_len − 1` of `x` along its token `axis`: a padded chunk's last real token.
pub(super) fn last_real(b: &mut Builder, x: &str, valid: &str, axis: i64) -> String {
    let last = b.op(
        Op::Sub,
        "last_position_index",
        vec![("x", var(valid)), ("y", Arg::Int(1))],
    );
    b.op(
        Op::Gather,
        "last_position",
        vec![
            ("x", var(x)),
            ("indices", var(&last)),
            ("axis", Arg::Int(axis)),
        ],
    )
}
