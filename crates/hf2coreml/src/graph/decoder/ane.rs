//! `--layout ane`: the same decode/chunk step laid out for the Neural Engine, as Apple's rules
//! and ml-ane-transformers describe it (docs/design.md, "The Neural Engine layout"). The
//! blocks are the default layout's, lowered here ([`super::lower`]); this file holds the
//! step's edges (its part builder), and [`super::ane_ops`] the pieces that differ.
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

use super::ane_ops::{channels_first, conv, conv_shape, norm_weight, tokens_first, Cf, CHANNELS};
use super::blocks::{blocks, recurrent_updates, stack, Sorted};
use super::linear::Weights;
use super::logits::{self, last_real};
use super::lower::Lowering;
use super::norms::{plus_offset, rms_norm, rms_norm_ranged};
use super::per_layer;
use super::shared::shared_inputs;
use super::step::{Dims, Part, StepOptions};
use crate::arch::{ModelSpec, TensorId};
use crate::graph::{ints, var, Arg, Builder, Graph, GraphError, Op, Weight};
use crate::mil::chain_file::{HIDDEN_IN, HIDDEN_OUT};
use crate::mil::contract;
use crate::mil::DType;

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
    let (per_layer_rows, per_layer_in) = per_layer::declare(&mut b, spec, part, q);
    // The io cache only: `--kv-cache state` is refused for this layout (`stateful::check`).
    let mut shared =
        (!part.layers.is_empty()).then(|| shared_inputs(&mut b, spec, dims, part, alpha, opts).0);
    let (x, mut head) = if part.embedding {
        let scale = alpha * spec.embedding_scale();
        embedding(&mut b, &mut weights, spec, (&first, q), scale, part.head)?
    } else {
        (first, None)
    };
    let mut x = channels_first(&mut b, &x, spec.hidden_size, q, "hidden_cf");
    // Gemma 4's per-layer inputs, [1, Q, L, P] in either layout: computed here from the rows
    // and the embedded tokens, or given by the chain's first part.
    if let (Some(sh), Some(rows)) = (&mut shared, &per_layer_rows) {
        sh.per_layer = per_layer::inputs(&mut b, &mut weights, spec, sh, (rows, &x, true))?;
    }
    if let (Some(sh), Some(given)) = (&mut shared, &per_layer_in) {
        sh.per_layer = Some(per_layer::given(&mut b, spec, sh, given));
    }
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
        let nw = plus_offset(&mut b, nw, TensorId::FinalNorm, offset);
        let rows = if opts.last_logits_only { 1 } else { q };
        if rows < q {
            let valid = shared.as_ref().and_then(|sh| sh.valid.as_deref());
            x = last_position(&mut b, &x, (spec.hidden_size, q), valid);
        }
        let eps = spec.rms_norm_eps * alpha * alpha;
        let hn = match spec.gemma.is_some() {
            true => rms_norm_ranged(&mut b, &x, &nw, eps, CHANNELS, "final_norm"),
            false => rms_norm(&mut b, &x, &nw, eps, CHANNELS, "final_norm"),
        };
        let widths = contract::logits_widths(spec.vocab_size);
        let softcap = spec.gemma4.as_ref().and_then(|g| g.final_logit_softcapping);
        logits_parts(&mut b, &parts, (&widths, softcap), &hn, rows)
    } else {
        let t = tokens_first(&mut b, &x, spec.hidden_size, q, "hidden_out_bqc");
        let hidden = b.op(Op::Identity, HIDDEN_OUT, vec![("x", var(&t))]);
        let handed = shared
            .as_ref()
            .and_then(|sh| per_layer::hand_on(&mut b, spec, sh, part));
        std::iter::once(hidden).chain(handed).collect()
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

/// A part within the model (what this layout does not build, rotated inputs, is refused where
/// a projection meets one: [`super::ane_ops::project`]).
fn check(spec: &ModelSpec, part: &Part) -> Result<(), GraphError> {
    if part.layers.end > spec.num_hidden_layers {
        return Err(GraphError::Unsupported(format!(
            "layers {:?} of a {}-layer model",
            part.layers, spec.num_hidden_layers
        )));
    }
    Ok(())
}

/// The hidden state [1, C, 1, 1] the logits of a `prefill` function with `--prefill-logits
/// last` come from: a hybrid chunk's last real token (`valid_len − 1`: its padding follows
/// it), else the last of the Q.
fn last_position(b: &mut Builder, x: &str, (c, q): (usize, usize), valid: Option<&str>) -> String {
    if let Some(valid) = valid {
        return last_real(b, x, valid, 3);
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

/// One conv per logits part, each [1, w, 1, Q] → [1, Q, w], named as the contract's outputs;
/// soft-capped as [`logits::logits`] caps them (Gemma 4).
fn logits_parts(
    b: &mut Builder,
    parts: &[String],
    (widths, softcap): (&[usize], Option<f64>),
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
            match softcap {
                None => tokens_first(b, &y, width, q, &name),
                Some(c) => {
                    let raw = tokens_first(b, &y, width, q, &format!("{name}_uncapped"));
                    logits::soft_cap(b, &raw, c, &name)
                }
            }
        })
        .collect()
}
