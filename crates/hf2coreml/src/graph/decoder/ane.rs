//! `--layout ane`: the same decode/chunk step laid out for the Neural Engine, as Apple's rules
//! and ml-ane-transformers describe it (docs/design.md, "The Neural Engine layout"). The
//! blocks are the default layout's, lowered here ([`super::lower`]); this file holds the
//! step's edges and the pieces that differ.
//!
//! The hidden state is (B, C, 1, Q), channels first. Every projection is a 1×1 `conv` whose
//! weight is the checkpoint's [out, in] constant given the shape [out, in, 1, 1] (the same
//! values, dense or palettized: only the declared shape differs). RMSNorm reduces over the
//! channel axis. Attention runs one key/value group at a time: the group's queries [1, G, D, Q]
//! against its keys [1, 1, S+Q, D] give scores [1, G, S+Q, Q] (keys before queries, as
//! ml-ane-transformers' `bchq,bkhc->bkhq`), masked, soft-maxed over the keys and applied to
//! the values; no fused attention op. RoPE uses the tables as the default layout does.
//!
//! The package's inputs and outputs are the default layout's ([`crate::mil::contract`]): token
//! ids, position, the [L, Hkv, S, D] caches in, the logits parts [1, Q, w] and the key/value
//! rows [L, Hkv, Q, D] out, so the runner, `validate`, chains and apps cannot tell the layouts
//! apart. The transposes this takes sit at the graph's edges.

use std::collections::BTreeMap;

use super::linear::{LinearWeight, Weights};
use super::lower::Lowering;
use super::{blocks, logits, recurrent_updates, rms_norm, shared_inputs, stack};
use super::{Dims, Part, Shared, Sorted, StepOptions};
use crate::arch::{ModelSpec, TensorId};
use crate::graph::{ints, var, Arg, Builder, Graph, GraphError, Op, Weight};
use crate::mil::chain_file::{HIDDEN_IN, HIDDEN_OUT};
use crate::mil::contract;
use crate::mil::DType;

/// The channel axis of the (B, C, 1, Q) hidden state.
pub(super) const CHANNELS: i64 = 1;

/// The shared values in the channels-first form: RoPE rows [D, Q] and the mask [S+Q, Q].
pub(super) struct Cf<'a> {
    shared: &'a Shared,
    pub(super) cos: String,
    pub(super) sin: String,
    mask: String,
}

/// Build one part's step graph in the Neural Engine layout (see the module doc).
pub(super) fn build_part(
    spec: &ModelSpec,
    weights: BTreeMap<String, Weight>,
    opts: &StepOptions,
    part: &Part,
) -> Result<Graph, GraphError> {
    check(spec, part)?;
    let dims = Dims::new(spec, opts)?;
    let (fl, q) = (opts.float, dims.q);
    let alpha = opts.scaling.residual_scale;
    let mut b = Builder::new(fl);
    b.set_target(opts.target);
    let mut weights = Weights::new(spec, weights);

    let first = if part.embedding {
        b.input(contract::INPUT_IDS, DType::I32, vec![1, q])
    } else {
        b.input(HIDDEN_IN, fl, vec![1, q, spec.hidden_size])
    };
    // The io cache only: `--kv-cache state` is refused for this layout (`stateful::check`).
    let shared =
        (!part.layers.is_empty()).then(|| shared_inputs(&mut b, spec, dims, part, alpha, opts).0);
    let (x, mut head) = if part.embedding {
        embedding(&mut b, &mut weights, spec, (&first, q), alpha, part.head)?
    } else {
        (first, None)
    };
    let mut x = channels_first(&mut b, &x, spec.hidden_size, q, "hidden_cf");
    let Sorted {
        keys: key_rows,
        values: value_rows,
        conv,
        delta,
    } = match &shared {
        Some(sh) => {
            let lower = Lowering::Ane(Cf::new(&mut b, sh));
            blocks(&mut b, &mut weights, &lower, sh, part, &mut x)?
        }
        None => Sorted::default(),
    };
    let mut outputs = if part.head {
        let parts = match head.take() {
            Some(p) => p,
            None => {
                let h = logits::head(&mut b, &mut weights, spec.tie_word_embeddings)?;
                conv_head(&mut b, h)?
            }
        };
        let nw = norm_weight(&mut b, &mut weights, TensorId::FinalNorm)?;
        let offset = spec.norm_offset().into();
        let nw = super::plus_offset(&mut b, nw, TensorId::FinalNorm, offset);
        let rows = if opts.last_logits_only { 1 } else { q };
        if rows < q {
            let valid = shared.as_ref().and_then(|sh| sh.valid.as_deref());
            x = last_position(&mut b, &x, (spec.hidden_size, q), valid);
        }
        let hn = rms_norm(
            &mut b,
            &x,
            &nw,
            spec.rms_norm_eps * alpha * alpha,
            CHANNELS,
            "final_norm",
        );
        logits_parts(
            &mut b,
            &parts,
            &contract::logits_widths(spec.vocab_size),
            &hn,
            rows,
        )
    } else {
        let t = tokens_first(&mut b, &x, spec.hidden_size, q, "hidden_out_bqc");
        vec![b.op(Op::Identity, HIDDEN_OUT, vec![("x", var(&t))])]
    };
    // A hybrid model's part may hold no attention block, and then no cache.
    if !key_rows.is_empty() {
        outputs.push(stack(&mut b, key_rows, contract::KEY_UPDATE));
        outputs.push(stack(&mut b, value_rows, contract::VALUE_UPDATE));
    }
    if let Some(sh) = &shared {
        recurrent_updates(&mut b, sh, (conv, delta), &mut outputs);
    }
    weights.finish()?;
    b.finish(outputs)
}

/// What this layout does not build (yet): refused, never silently computed otherwise.
fn check(spec: &ModelSpec, part: &Part) -> Result<(), GraphError> {
    if part.layers.end > spec.num_hidden_layers {
        return Err(GraphError::Unsupported(format!(
            "layers {:?} of a {}-layer model",
            part.layers, spec.num_hidden_layers
        )));
    }
    // Gemma 3's (1 + w) and extra norms, scaled embedding, GeGLU and windowed layers are
    // built by the default layout only.
    if spec.gemma.is_some() {
        return Err(GraphError::Unsupported(format!(
            "{} is not built in --layout ane: use --layout default",
            spec.architecture
        )));
    }
    Ok(())
}

impl<'a> Cf<'a> {
    fn new(b: &mut Builder, shared: &'a Shared) -> Self {
        let t = |b: &mut Builder, x: &str, name: &str| {
            b.op(
                Op::Transpose,
                name,
                vec![("x", var(x)), ("perm", ints(&[1, 0]))],
            )
        };
        Cf {
            cos: t(b, &shared.cos, "rope_cos_cf"),
            sin: t(b, &shared.sin, "rope_sin_cf"),
            mask: t(b, &shared.mask, "mask_cf"),
            shared,
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

/// The hidden state [1, C, 1, 1] the logits of a `prefill` function with `--prefill-logits
/// last` come from: a hybrid chunk's last real token (`valid_len − 1`: its padding follows
/// it), else the last of the Q.
fn last_position(b: &mut Builder, x: &str, (c, q): (usize, usize), valid: Option<&str>) -> String {
    if let Some(valid) = valid {
        return super::last_real(b, x, valid, 3);
    }
    let (q, c) = (q as i64, c as i64);
    b.op(
        Op::SliceByIndex,
        "last_position",
        vec![
            ("x", var(x)),
            ("begin", ints(&[0, 0, 0, q - 1])),
            ("end", ints(&[1, c, 1, q])),
        ],
    )
}

/// The embedded tokens [1, Q, C] times α, and the lm_head as conv weights when `with_head`.
/// A tied table is stored once, as the [w, C, 1, 1] parts the head's convs read; the embedding
/// gathers its rows from them as [`logits`] does from the [w, C] parts.
fn embedding(
    b: &mut Builder,
    weights: &mut Weights,
    spec: &ModelSpec,
    (input_ids, q): (&str, usize),
    alpha: f64,
    with_head: bool,
) -> Result<(String, Option<Vec<String>>), GraphError> {
    if !spec.tie_word_embeddings {
        let (x, _) = logits::embedding_and_head(b, weights, false, input_ids, alpha, false)?;
        let head = match with_head {
            true => {
                let h = logits::head(b, weights, false)?;
                Some(conv_head(b, h)?)
            }
            false => None,
        };
        return Ok((x, head));
    }
    let (name, shape, table) = weights.take(TensorId::Embedding)?;
    let widths = contract::logits_widths(shape[0]);
    let parts = logits::row_parts(b, &name, &shape, table, &widths)?;
    let head = conv_head(b, logits::Head { parts })?;
    let mut x = logits::gather_rows(b, &head, &widths, input_ids, true, Some((q, shape[1])))?;
    if alpha != 1.0 {
        x = b.op(
            Op::Mul,
            "embed_scaled",
            vec![("x", var(&x)), ("y", Arg::Float(alpha))],
        );
    }
    Ok((x, with_head.then_some(head)))
}

/// The lm_head's parts as conv weights [w, C, 1, 1].
fn conv_head(b: &mut Builder, head: logits::Head) -> Result<Vec<String>, GraphError> {
    for p in &head.parts {
        b.reshape_const(p, conv_shape)?;
    }
    Ok(head.parts)
}

/// [out, in] → [out, in, 1, 1].
fn conv_shape(s: &[usize]) -> Vec<usize> {
    s.iter().copied().chain([1, 1]).collect()
}

/// One conv per logits part, each [1, w, 1, Q] → [1, Q, w], named as the contract's outputs.
fn logits_parts(
    b: &mut Builder,
    parts: &[String],
    widths: &[usize],
    hn: &str,
    q: usize,
) -> Vec<String> {
    let n = parts.len();
    parts
        .iter()
        .zip(widths)
        .enumerate()
        .map(|(i, (w, &width))| {
            let name = contract::logits_name(i, n);
            let y = conv(b, hn, w, None, &format!("{name}_cf"));
            tokens_first(b, &y, width, q, &name)
        })
        .collect()
}

/// A 1×1 conv: unit strides and dilations, no padding, one group.
fn conv(b: &mut Builder, x: &str, w: &str, bias: Option<&String>, name: &str) -> String {
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
    cf: &Cf,
    qs: &str,
    keys: &str,
    values: &str,
    tag: &str,
) -> String {
    let dims = &cf.shared.dims;
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
            vec![("x", var(&scores)), ("y", var(&cf.mask))],
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
