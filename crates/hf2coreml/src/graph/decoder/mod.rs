//! The decode/chunk step of the package contract for every decoder architecture hf2coreml
//! converts (Llama, Mistral, Qwen2, Qwen3, Phi-3/Phi-4-mini, Gemma 3, SmolLM3): one builder,
//! the differences between them read from [`ModelSpec`].
//!
//! Inputs and outputs follow the package contract (docs/contract.md) exactly. What the graph is
//! made of follows docs/reference/mil-ops.md, "A decode step in iOS17 MIL": gathered RoPE
//! tables, the cache mask from `less(arange(S), position)` → `select` → `tile`, concatenated
//! with a constant causal block ([`mask`]); per-layer `slice_by_index` of the caches; GQA with
//! the query heads of a group stacked as rows against the unrepeated cache; rotate-half RoPE
//! with `split` + `concat` ([`attention`], [`attend`]); the gated MLP ([`mlp`]); projections
//! over dense, palettized or calibrated weights ([`linear`]); the key/value updates as a
//! `concat` of per-layer rows along axis 0 ([`blocks`]).
//!
//! [`build`] reads like the model: embedding, then per block norm → attention → residual →
//! norm → MLP → residual ([`blocks`]), then the final norm and the lm_head. Weights are looked
//! up by their place in the model ([`TensorId`]).
//!
//! This file is the entry: the checks, [`build_part`] (the default layout's step; the Neural
//! Engine's is [`ane`]'s) and what the rest of the crate reads. The files below it import
//! downwards only: the step's options and dimensions ([`step`]) and the norms ([`norms`]) at
//! the bottom; what every block reads ([`shared`]); each layout's pieces ([`attend`],
//! [`ane_ops`]) under [`lower`]; the blocks over it; [`blocks`] over them; the two part
//! builders on top.

mod ane;
mod ane_ops;
mod attend;
mod attention;
mod blocks;
mod causal_conv;
mod conv;
mod delta;
mod linear;
mod logits;
mod lower;
mod mask;
mod mlp;
mod norms;
mod per_layer;
mod shared;
mod stateful;
mod step;

pub use stateful::check as check_kv_cache;
pub use step::{Part, StepOptions, MASK_VALUE};

use std::collections::BTreeMap;

use super::{ints, var, Builder, DType, Graph, GraphError, Op, Weight};
use crate::arch::{ModelSpec, RopeScaling, TensorId};
use crate::mil::chain_file::{HIDDEN_IN, HIDDEN_OUT};
use crate::mil::contract;
use blocks::{blocks, recurrent_updates, stack, Sorted};
use linear::Weights;
use logits::last_real;
use lower::Lowering;
use norms::{norm_weight, residual_norm};
use shared::shared_inputs;
use step::Dims;

/// Refuse hyperparameters that become constants the program's float type cannot hold: in
/// fp16, RMSNorm's ε times the range scale² (beyond 65504 it is +inf, every normalized
/// activation 0 and every logit equal), LongRoPE's factor on cos and sin, and the embedding's
/// scale times the range scale.
fn check_constants(spec: &ModelSpec, opts: &StepOptions) -> Result<(), GraphError> {
    if opts.float != DType::F16 {
        return Ok(());
    }
    let alpha = opts.scaling.residual_scale;
    let limit = f64::from(half::f16::MAX);
    let constants = [
        (
            "rms_norm_eps",
            spec.rms_norm_eps,
            spec.rms_norm_eps * alpha * alpha,
        ),
        (
            "rope_scaling.attention_factor",
            spec.rope_scaling.attention_factor(),
            spec.rope_scaling.attention_factor(),
        ),
        (
            "the embedding scale",
            spec.embedding_scale(),
            spec.embedding_scale() * alpha,
        ),
    ];
    for (what, value, constant) in constants {
        if !(constant.is_finite() && constant.abs() <= limit) {
            return Err(GraphError::Unsupported(format!(
                "{what} ({value}) becomes the constant {constant:e} (after the range scale \
                 {alpha}), beyond fp16's largest value (65504): the package would compute \
                 nothing but inf or 0"
            )));
        }
    }
    Ok(())
}

/// Refuse a spec this builder would not compute exactly at cache length `max_seq_len`.
///
/// Every [`ModelSpec`] field is named here, without `..`: a field added to the spec does not
/// compile until the builder says what it does with it, so the spec cannot describe math the
/// graph silently ignores.
pub fn check_spec(spec: &ModelSpec, max_seq_len: usize) -> Result<(), GraphError> {
    let ModelSpec {
        // One decoder layout for every architecture the spec can name.
        architecture: _,
        // Shapes: checked against every weight by `Weights`.
        num_hidden_layers: _,
        hidden_size: _,
        intermediate_size: _,
        num_attention_heads: _,
        num_key_value_heads: _,
        head_dim: _,
        vocab_size: _,
        // The norms' ε (`rms_norm`), the lm_head (`build`), RoPE tables (`mask::Tables`),
        // q/k/v biases, per-head q/k norms and blocks without RoPE (`attention::qkv`).
        rms_norm_eps: _,
        tie_word_embeddings: _,
        rope_theta: _,
        rope_scaling,
        attention_bias: _,
        qk_norm: _,
        no_rope_layers: _,
        // Partial RoPE: the tables (`mask::Tables`) and the rotation (`attention::apply_rope`).
        partial_rotary_dim: _,
        // Not math: metadata and the run's limits.
        max_position_embeddings: _,
        dtype: _,
        bos_token_id: _,
        eos_token_ids: _,
        // Where the text decoder came from (its tensors renamed at load).
        text_of: _,
        sliding_window: _,
        // Gemma: (1 + w) norms (`norm_weight`), sandwich norms (`block`), GeGLU (`mlp`), the
        // embedding scale (`build_part`), q scale, local RoPE tables and banded masks
        // (`shared_inputs`, `mask::window_mask`).
        gemma: _,
        // LFM2's short-convolution blocks (`conv::short_conv`), their state an input and an
        // output beside the caches (or a Core ML state), in both layouts.
        short_conv: _,
        // Qwen3.5's DeltaNet blocks (`delta::gated_delta`), their states inputs and outputs
        // beside the caches, and its gated attention (`attention::attention`).
        gated_delta: _,
        attention_output_gate: _,
        // Gemma 4: per-layer inputs (`per_layer::inputs`, `per_layer::block`), KV sharing
        // (`Shared::produced`), full blocks' head shapes (`Shared::dims_of`, their cache
        // slots `attention::block_cache` and `slot_rows`), their proportional RoPE
        // (`mask::Tables`), the value norm and k_eq_v (`attention::qkv`), `layer_scalar`
        // (`block`), soft-capped logits (`logits::logits`); chain parts pass the per-layer
        // inputs on (`PER_LAYER_OUT`, `PER_LAYER_IN`) and keep shared blocks with their
        // producers (`check_part`).
        gemma4: _,
    } = spec;
    // The caches are stacked slots of one shape: every block's rows must fill whole slots.
    if spec.layers().iter().any(|k| k.attention().is_some()) && spec.stacked_kv().is_none() {
        return Err(GraphError::Unsupported(format!(
            "a block's key and value heads do not fill whole slots of the model's \
             [{}, {}] heads: a cache of that shape is not built",
            spec.num_key_value_heads, spec.head_dim
        )));
    }
    // LongRoPE switches to its long factors once the sequence outgrows the original
    // context; a package's tables are fixed, so its context stays within it.
    if let RopeScaling::LongRope {
        original_max_position_embeddings: original,
        ..
    } = rope_scaling
    {
        if max_seq_len > *original {
            return Err(GraphError::Unsupported(format!(
                "`rope_scaling` longrope uses its long factors past \
                 original_max_position_embeddings = {original} tokens and its short ones \
                 within it, as the sequence grows; a package's RoPE tables are fixed: use \
                 --max-seq-len {original} or less"
            )));
        }
    }
    // No windowed mask outside Gemma: a window only matters once the context outgrows it.
    if let Some(window) = spec.unbuilt_window() {
        if max_seq_len > window {
            return Err(GraphError::Unsupported(format!(
                "`sliding_window` = {window} is shorter than the package's context of \
                 {max_seq_len} tokens and windowed attention is not built: use \
                 --max-seq-len {window} or less"
            )));
        }
    }
    Ok(())
}

/// Refuse a chain part that lacks what its blocks read within a step: a block that shares
/// (Gemma 4) attends over its producer's keys and values of the same step, which only the
/// producer's part computes; and the part that embeds Gemma 4's tokens computes every block's
/// per-layer inputs with its own blocks, so it holds at least one. The planner keeps both
/// together (`budget::split::ModelBytes::measure`).
pub fn check_part(spec: &ModelSpec, part: &Part) -> Result<(), GraphError> {
    for l in part.layers.clone() {
        let producer = spec.layer(l).attention().and_then(|a| a.kv_from);
        if let Some(p) = producer.filter(|p| !part.layers.contains(p)) {
            return Err(GraphError::Unsupported(format!(
                "a chain part of blocks {:?}: block {l} reads block {p}'s keys and values, \
                 which another part computes",
                part.layers
            )));
        }
    }
    if part.embedding && !part.head && part.layers.is_empty() && spec.per_layer_input() > 0 {
        return Err(GraphError::Unsupported(
            "a chain part that embeds Gemma 4's tokens and runs no block: its per-layer \
             inputs are computed with the first blocks"
                .into(),
        ));
    }
    Ok(())
}

/// Build the step graph. `weights` holds every slot of [`crate::arch::expected_tensors`], by
/// checkpoint name; they are moved into the graph.
pub fn build(
    spec: &ModelSpec,
    weights: BTreeMap<String, Weight>,
    opts: &StepOptions,
) -> Result<Graph, GraphError> {
    build_part(spec, weights, opts, &Part::whole(spec))
}

/// Build the step graph of one part: `weights` holds exactly the slots the part uses (its
/// blocks', the embedding when it embeds, the final norm and lm_head when it computes the
/// logits, the tied table in both). The hidden state it takes or returns is the residual
/// stream times α, fp16 in an fp16 program, so a chain computes what one package computes.
pub fn build_part(
    spec: &ModelSpec,
    weights: BTreeMap<String, Weight>,
    opts: &StepOptions,
    part: &Part,
) -> Result<Graph, GraphError> {
    check_spec(spec, opts.max_seq_len)?;
    check_constants(spec, opts)?;
    let whole = *part == Part::whole(spec);
    stateful::check(opts.kv_cache, opts.target, opts.layout, whole)?;
    if !whole {
        check_part(spec, part)?;
    }
    if opts.layout == crate::mil::contract::Layout::Ane {
        return ane::build_part(spec, weights, opts, part);
    }
    if part.layers.end > spec.num_hidden_layers {
        return Err(GraphError::Unsupported(format!(
            "layers {:?} of a {}-layer model",
            part.layers, spec.num_hidden_layers
        )));
    }
    let dims = Dims::new(spec, opts)?;
    let fl = opts.float;
    let alpha = opts.scaling.residual_scale;
    let mut b = Builder::new(fl);
    b.set_target(opts.target);
    let mut weights = Weights::new(spec, weights);

    // Inputs, in contract order.
    let first = if part.embedding {
        b.input(contract::INPUT_IDS, DType::I32, vec![1, dims.q])
    } else {
        b.input(HIDDEN_IN, fl, vec![1, dims.q, spec.hidden_size])
    };
    let (per_layer_rows, per_layer_in) = per_layer::declare(&mut b, spec, part, dims.q);
    let (mut shared, state) = if part.layers.is_empty() {
        (None, None)
    } else {
        let (mut shared, state) = shared_inputs(&mut b, spec, dims, part, alpha, opts);
        attention::group_masks(&mut b, &mut shared);
        (Some(shared), state)
    };
    let (mut x, mut head) = if part.embedding {
        let (x, head) = logits::embedding_and_head(
            &mut b,
            &mut weights,
            spec.tie_word_embeddings,
            &first,
            alpha * spec.embedding_scale(),
            part.head,
        )?;
        (x, head)
    } else {
        (first.clone(), None)
    };
    if let (Some(shared), Some(rows)) = (&mut shared, &per_layer_rows) {
        shared.per_layer =
            per_layer::inputs(&mut b, &mut weights, spec, shared, (rows, &x, false))?;
    }
    if let (Some(shared), Some(given)) = (&mut shared, &per_layer_in) {
        shared.per_layer = Some(per_layer::given(&mut b, spec, shared, given));
    }
    let Sorted {
        keys: key_rows,
        values: value_rows,
        conv,
        delta,
    } = match &shared {
        Some(sh) => blocks(&mut b, &mut weights, &Lowering::Default, sh, part, &mut x)?,
        None => Sorted::default(),
    };

    let mut outputs = if part.head {
        if head.is_none() {
            head = Some(logits::head(
                &mut b,
                &mut weights,
                spec.tie_word_embeddings,
            )?);
        }
        let head = head.as_ref().expect("set above");
        let eps = spec.rms_norm_eps * alpha * alpha;
        let nw = norm_weight(
            &mut b,
            &mut weights,
            TensorId::FinalNorm,
            spec.norm_offset().into(),
        )?;
        let ranged = spec.gemma.is_some();
        let valid = shared.as_ref().and_then(|sh| sh.valid.clone());
        if opts.last_logits_only {
            x = last_position(&mut b, &x, opts, spec.hidden_size, valid.as_deref());
        }
        let hn = residual_norm(&mut b, &x, &nw, eps, ranged, "final_norm");
        let softcap = spec.gemma4.as_ref().and_then(|g| g.final_logit_softcapping);
        logits::logits(&mut b, head, &hn, softcap)
    } else {
        let hidden = b.op(Op::Identity, HIDDEN_OUT, vec![("x", var(&x))]);
        let handed = shared
            .as_ref()
            .and_then(|sh| per_layer::hand_on(&mut b, spec, sh, part));
        std::iter::once(hidden).chain(handed).collect()
    };
    match (&shared, &state) {
        (Some(sh), Some(st)) => {
            let position = sh.position.clone();
            stateful::write(&mut b, st, key_rows, value_rows, &position, &sh.dims);
        }
        // A hybrid model's part may hold no attention block, and then no cache.
        (Some(_), None) if !key_rows.is_empty() => {
            outputs.push(stack(&mut b, key_rows, contract::KEY_UPDATE));
            outputs.push(stack(&mut b, value_rows, contract::VALUE_UPDATE));
        }
        _ => {}
    }
    if let Some(sh) = &shared {
        recurrent_updates(&mut b, sh, (conv, delta), &mut outputs);
    }
    weights.finish()?;
    b.finish(outputs)
}

/// The rows the logits of a `prefill` function with `--prefill-logits last` come from: a hybrid
/// chunk's last real token (`valid_len − 1`: its padding follows it), else the last of the Q.
fn last_position(
    b: &mut Builder,
    x: &str,
    opts: &StepOptions,
    hidden: usize,
    valid: Option<&str>,
) -> String {
    if let Some(valid) = valid {
        return last_real(b, x, valid, 1);
    }
    if opts.query_len == 1 {
        return x.to_string();
    }
    let (q, c) = (opts.query_len as i64, hidden as i64);
    b.op(
        Op::SliceByIndex,
        "last_position",
        vec![
            ("x", var(x)),
            ("begin", ints(&[0, q - 1, 0])),
            ("end", ints(&[1, q, c])),
        ],
    )
}

/// Checkpoint tensors as dense fp16 weights (the all-fp16 recipe).
pub fn dense_weights(
    ckpt: &crate::checkpoint::Checkpoint,
) -> Result<BTreeMap<String, Weight>, crate::checkpoint::CheckpointError> {
    let mut out = BTreeMap::new();
    for slot in ckpt.package_slots() {
        let t = ckpt.tensor(&slot.name)?;
        out.insert(slot.name.clone(), Weight::Dense(t.to_f16()));
    }
    Ok(out)
}
