//! The decode/chunk step of the package contract for every decoder architecture hf2coreml
//! converts (Llama, Mistral, Qwen2, Qwen3, Phi-3/Phi-4-mini, Gemma 3, SmolLM3): one builder,
//! the differences between them read from [`ModelSpec`].
//!
//! Inputs and outputs follow the package contract (docs/contract.md) exactly. What the graph is
//! made of follows docs/reference/mil-ops.md, "A decode step in iOS17 MIL": gathered RoPE
//! tables, the cache mask from `less(arange(S), position)` → `select` → `tile`, concatenated
//! with a constant causal block ([`mask`]); per-layer `slice_by_index` of the caches; GQA with
//! the query heads of a group stacked as rows against the unrepeated cache; rotate-half RoPE with `split` + `concat` ([`attention`]); the
//! gated MLP ([`mlp`]); projections over dense, palettized or calibrated weights ([`linear`]);
//! the key/value updates as a `concat` of per-layer rows along axis 0.
//!
//! [`build`] reads like the model: embedding, then per block norm → attention → residual →
//! norm → MLP → residual, then the final norm and the lm_head. Weights are looked up by their
//! place in the model ([`TensorId`]).

mod ane;
mod attention;
mod conv;
mod delta;
mod linear;
mod logits;
mod lower;
mod mask;
mod mlp;
mod per_layer;
mod stateful;

pub use stateful::check as check_kv_cache;

use std::collections::BTreeMap;

use super::scaling::Scaling;
use super::{ints, var, Arg, Builder, DType, Graph, GraphError, Op, Weight};
use crate::arch::{LayerTensor, ModelSpec, RopeScaling, TensorId};
use crate::mil::chain_file::{HIDDEN_IN, HIDDEN_OUT};
use crate::mil::contract;
use linear::{Projections, Weights};
use lower::Lowering;

/// Masked attention scores: large and finite, because -inf turns a fully masked row into NaN
/// (and the Neural Engine mishandles -inf in softmax) and fp16 has no room for anything below
/// -65,504 anyway. Apple's rules use -40,000; -30,000 is as safe: any value fp16 holds works.
pub const MASK_VALUE: f32 = -30_000.0;

/// Fixed dimensions and numerics of one package.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOptions {
    /// S: cache rows.
    pub max_seq_len: usize,
    /// Q: tokens per step.
    pub query_len: usize,
    /// The float type the program computes in.
    pub float: DType,
    pub scaling: Scaling,
    /// The OS the program is built for.
    pub target: crate::mil::contract::Target,
    /// The hidden state's layout (`--layout`): [`ane`] builds the (B, C, 1, S) form.
    pub layout: crate::mil::contract::Layout,
    /// How the cache is passed (`--kv-cache`): inputs/outputs, or one state ([`state`]).
    pub kv_cache: crate::mil::contract::KvCache,
    /// Compute the logits of the last of the Q positions only (a `prefill` function's
    /// `--prefill-logits last`): the final norm and the lm_head see one row.
    pub last_logits_only: bool,
}

/// The step's dimensions (a block's own: its KV heads and head width, [`Shared::dims_of`]).
#[derive(Clone, Copy)]
struct Dims {
    /// S: cache rows.
    s: usize,
    /// Q: tokens per step.
    q: usize,
    /// Query heads, key/value heads, head width.
    h: usize,
    hkv: usize,
    d: usize,
}

impl Dims {
    fn new(spec: &ModelSpec, opts: &StepOptions) -> Result<Self, GraphError> {
        let (s, q) = (opts.max_seq_len, opts.query_len);
        let (h, hkv, d) = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        );
        if s == 0 || q == 0 || q > s {
            return Err(GraphError::Unsupported(format!(
                "query length {q} and max sequence length {s}: need 1 <= Q <= S"
            )));
        }
        if d % 2 != 0 || h % hkv != 0 {
            return Err(GraphError::Unsupported(format!(
                "head_dim {d} must be even and {h} query heads a multiple of {hkv} key/value heads"
            )));
        }
        if !matches!(opts.float, DType::F16 | DType::F32) {
            return Err(GraphError::Unsupported(format!(
                "float type {} is not a float",
                opts.float.name()
            )));
        }
        // A state's rows are padded to a multiple of 32 (always masked: see [`state`]).
        let s = stateful::rows(opts);
        for l in 0..spec.num_hidden_layers {
            let Some(a) = spec.layer(l).attention().copied() else {
                continue;
            };
            if a.head_dim % 2 != 0 || h % a.kv_heads != 0 {
                return Err(GraphError::Unsupported(format!(
                    "block {l}: head_dim {} must be even and {h} query heads a multiple of its \
                     {} key/value heads",
                    a.head_dim, a.kv_heads
                )));
            }
        }
        Ok(Dims { s, q, h, hkv, d })
    }
}

/// What every block reads besides its weights.
struct Shared {
    dims: Dims,
    /// The residual scale α (folded into the embedding, o_proj and down_proj).
    alpha: f64,
    /// The norms' ε, times α² (RMSNorm(αx) with ε·α² equals RMSNorm(x) with ε).
    eps: f64,
    /// The model's ε itself, for norms of what does not carry α (a DeltaNet's output).
    plain_eps: f64,
    /// 1/√D (Gemma: `query_pre_attn_scalar`^-½).
    q_scale: f64,
    /// What every norm adds to its weight (Gemma's 1 + w).
    norm_offset: f64,
    /// Gemma: the sublayer outputs pass through their own norms before the residual add.
    sandwich: bool,
    /// Gemma's tanh-approximated GELU in place of SiLU.
    gelu_tanh: bool,
    /// Gemma: the norms of the residual stream divide by each token's largest |x| before
    /// squaring ([`rms_norm_ranged`]).
    ranged_norms: bool,
    /// Gemma's sliding blocks: their RoPE rows and banded mask.
    local: Option<(String, String, String)>,
    /// Per block: whether it is one of Gemma's sliding blocks.
    sliding: Vec<bool>,
    attention_bias: bool,
    /// Qwen3.5: q_proj also gives a gate, sigmoid(gate) times the attention output.
    output_gate: bool,
    /// Qwen3's per-head q/k norms: their ε (the model's, unscaled: q and k do not carry α).
    qk_norm_eps: Option<f64>,
    /// Per block: whether it rotates q and k (SmolLM3's NoPE blocks do not).
    rope_in_layer: Vec<bool>,
    /// The leading dimensions of each head RoPE rotates (D unless partial, Phi-4-mini; Gemma
    /// 4's full blocks rotate their whole head against a table whose unrotated pairs have
    /// cos 1 and sin 0).
    rotary: usize,
    /// Gemma 4: the values pass an RMSNorm without weight, and the full blocks' values are
    /// their raw key projection with `attention_k_eq_v`.
    gemma4: Option<crate::arch::Gemma4Spec>,
    /// The masks grouped for blocks whose query heads per KV head differ from the model's
    /// (Gemma 4's full blocks): (groups, mask, window mask).
    regrouped: Vec<(usize, String, Option<String>)>,
    /// The joined keys and values [1, Hkv, S+Q, D] of the blocks a later block of this step
    /// reads (Gemma 4's KV sharing), by block.
    produced: std::cell::RefCell<BTreeMap<usize, (String, String)>>,
    /// Gemma 4's per-layer inputs of this step [1, Q, L, P].
    per_layer: Option<String>,
    /// The first layer this package runs: its caches' row 0.
    first_layer: usize,
    /// This step's RoPE rows [Q, D].
    cos: String,
    sin: String,
    /// [Q, S+Q].
    mask: String,
    key_cache: String,
    value_cache: String,
    /// Where layer 0's values start in `value_cache`: 0 for the io inputs, L in the state.
    value_offset: usize,
    /// The `position` input.
    position: String,
    /// Every block's kind (by absolute index).
    kinds: Vec<crate::arch::LayerKind>,
    /// Per block of this part (from `first_layer`): its index among the part's blocks of its
    /// kind, the slot of its cache rows or conv state.
    slots: Vec<usize>,
    /// The conv state's inputs (LFM2's conv blocks, or the DeltaNets'), if the part has any.
    conv: Option<conv::ConvInputs>,
    /// The DeltaNet state's inputs, if the part has DeltaNet blocks.
    delta: Option<delta::DeltaInputs>,
    /// A hybrid step's `valid_len` input (Q > 1).
    valid: Option<String>,
}

impl Shared {
    /// Block `l`'s slot in the caches (an attention block: its first) or the conv state.
    fn slot(&self, l: usize) -> usize {
        self.slots[l - self.first_layer]
    }

    /// The step's dimensions with block `l`'s own KV heads and head width.
    fn dims_of(&self, l: usize) -> Dims {
        match self.kinds[l].attention() {
            Some(a) => Dims {
                hkv: a.kv_heads,
                d: a.head_dim,
                ..self.dims
            },
            None => self.dims,
        }
    }
}

/// The state a block leaves for the next step.
enum Kept {
    /// Nothing: a block that reads another block's keys and values (Gemma 4's KV sharing).
    Nothing,
    /// An attention block's new key and value rows.
    Rows(String, String),
    /// A short-convolution block's new state [1, W, C].
    Conv(String),
    /// A Gated DeltaNet's new conv state [1, W, C] and state [1, Hv, Dk, Dv].
    Delta(String, String),
}

/// What a step's blocks kept, by kind, each in block order.
#[derive(Default)]
struct Sorted {
    keys: Vec<String>,
    values: Vec<String>,
    conv: Vec<String>,
    delta: Vec<String>,
}

/// Run `part`'s blocks in order over the hidden state `x` (left as the last block's output),
/// lowered by `lower`; what they keep, by kind.
fn blocks(
    b: &mut Builder,
    weights: &mut Weights,
    lower: &Lowering,
    shared: &Shared,
    part: &Part,
    x: &mut String,
) -> Result<Sorted, GraphError> {
    let mut kept = Vec::with_capacity(part.layers.len());
    for l in part.layers.clone() {
        let (out, k) = block(b, weights, lower, shared, l, x)?;
        *x = out;
        kept.push(k);
    }
    Ok(Kept::sort(kept))
}

impl Kept {
    fn sort(kept: Vec<Kept>) -> Sorted {
        let mut s = Sorted::default();
        for k in kept {
            match k {
                Kept::Nothing => {}
                Kept::Rows(k, v) => {
                    s.keys.push(k);
                    s.values.push(v);
                }
                Kept::Conv(st) => s.conv.push(st),
                Kept::Delta(c, st) => {
                    s.conv.push(c);
                    s.delta.push(st);
                }
            }
        }
        s
    }
}

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

/// Which slice of the model one package computes: the whole model, or one part of a chain
/// (docs/design.md, "Chained packages").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The decoder blocks it runs; its caches hold these layers only.
    pub layers: std::ops::Range<usize>,
    /// It takes `input_ids` and embeds them (else it takes `hidden`).
    pub embedding: bool,
    /// It ends in the final norm and the logits (else it returns `hidden`).
    pub head: bool,
}

impl Part {
    /// The whole model: one package.
    pub fn whole(spec: &ModelSpec) -> Self {
        Part {
            layers: 0..spec.num_hidden_layers,
            embedding: true,
            head: true,
        }
    }
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
        shared.per_layer = per_layer::inputs(&mut b, &mut weights, spec, shared, (rows, &x))?;
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

/// Row `valid_len − 1` of `x` along its token `axis`: a padded chunk's last real token.
fn last_real(b: &mut Builder, x: &str, valid: &str, axis: i64) -> String {
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

/// A hybrid step's new conv and DeltaNet states, stacked over the blocks: outputs, or stored
/// into a stateful package's Core ML states.
fn recurrent_updates(
    b: &mut Builder,
    sh: &Shared,
    (conv, delta): (Vec<String>, Vec<String>),
    outputs: &mut Vec<String>,
) {
    let conv_stored = sh.conv.as_ref().and_then(|c| c.stored.clone());
    let delta_stored = sh.delta.as_ref().and_then(|d| d.stored.clone());
    for (states, name, stored) in [
        (conv, contract::CONV_STATE_UPDATE, conv_stored),
        (delta, contract::DELTA_STATE_UPDATE, delta_stored),
    ] {
        if states.is_empty() {
            continue;
        }
        let update = stack(b, states, name);
        match stored {
            Some(state) => stateful::write_recurrent(b, &state, &update),
            None => outputs.push(update),
        }
    }
}

/// The position, the caches (this part's layers: inputs, or the state read), RoPE rows and the
/// mask: what every block reads besides its weights.
fn shared_inputs(
    b: &mut Builder,
    spec: &ModelSpec,
    dims: Dims,
    part: &Part,
    alpha: f64,
    opts: &StepOptions,
) -> (Shared, Option<stateful::StateCache>) {
    let fl = b.float();
    let position = b.input(contract::POSITION, DType::I32, vec![1]);
    let layers = spec.layers();
    let recurrent = spec.recurrent_state(part.layers.clone());
    let valid = (recurrent.is_some() && dims.q > 1)
        .then(|| b.input(contract::VALID_LEN, DType::I32, vec![1]));
    // Each block's first slot in the caches (the slots of this part's earlier blocks: a block
    // of another head shape fills several, one reading another's keys none), or its index
    // among this part's blocks that convolve: its slot in the conv state.
    let mut counts = [0usize; 2];
    let slots = part
        .layers
        .clone()
        .map(|l| {
            let (kind, n) = match layers[l].attention() {
                Some(_) => (0, spec.kv_slots(l)),
                None => (1, 1),
            };
            counts[kind] += n;
            counts[kind] - n
        })
        .collect();
    let cache_layers = counts[0];
    let (key_cache, value_cache, value_offset, state) =
        if opts.kv_cache == crate::mil::contract::KvCache::State {
            let st = stateful::read(b, cache_layers, &dims);
            (st.read.clone(), st.read.clone(), st.layers, Some(st))
        } else if cache_layers == 0 {
            // A chain part of a hybrid model whose blocks all convolve: nothing attends.
            (String::new(), String::new(), 0, None)
        } else {
            let cache_shape = vec![cache_layers, dims.hkv, dims.s, dims.d];
            let k = b.input(contract::KEY_CACHE, fl, cache_shape.clone());
            let v = b.input(contract::VALUE_CACHE, fl, cache_shape);
            (k, v, 0, None)
        };
    // A stateful package keeps the recurrent state in Core ML states too.
    let stateful = (opts.kv_cache == crate::mil::contract::KvCache::State).then_some(&*position);
    let conv = recurrent.as_ref().and_then(|r| r.conv.as_ref()).map(|c| {
        let bias = spec.short_conv.as_ref().is_some_and(|s| s.bias);
        conv::ConvInputs::new(
            b,
            (c.layers.len(), c.width, c.channels, bias),
            valid.as_deref(),
            stateful,
        )
    });
    let delta = recurrent
        .as_ref()
        .and_then(|r| r.delta.as_ref())
        .zip(spec.gated_delta.as_ref());
    let delta = delta.map(|(d, g)| {
        let shape = crate::arch::GatedDelta {
            key_heads: g.key_heads,
            value_heads: g.value_heads,
            key_dim: g.key_dim,
            value_dim: g.value_dim,
            kernel: g.kernel,
        };
        delta::DeltaInputs::new(
            b,
            (d.layers.len(), &shape),
            (dims.q, valid.as_deref()),
            stateful,
        )
    });
    // A hybrid step's padding may run past S (its real tokens end by S): RoPE rows for it too,
    // in every part of a chain.
    let hybrid = spec.short_conv.is_some() || spec.gated_delta.is_some();
    let tables = mask::Tables::new(b, spec, &dims, hybrid);
    let (cos, sin) = mask::rope_rows(b, &tables, &position, false).expect("global tables");
    let mask = mask::mask(b, &tables, &position, &dims);
    let local = mask::rope_rows(b, &tables, &position, true)
        .zip(mask::window_mask(b, &tables, &position, &dims))
        .map(|((c, s), m)| (c, s, m));
    let sliding = layers
        .iter()
        .map(|k| {
            k.attention()
                .is_some_and(|a| a.rope == crate::arch::Rope::Local)
        })
        .collect();
    let shared = Shared {
        q_scale: spec.attention_scale(),
        norm_offset: spec.norm_offset() as f64,
        sandwich: spec.gemma.is_some(),
        gelu_tanh: spec.gemma.is_some(),
        ranged_norms: spec.gemma.is_some(),
        local,
        sliding,
        dims,
        alpha,
        eps: spec.rms_norm_eps * alpha * alpha,
        plain_eps: spec.rms_norm_eps,
        output_gate: spec.attention_output_gate,
        attention_bias: spec.attention_bias,
        qk_norm_eps: spec.qk_norm.then_some(spec.rms_norm_eps),
        rope_in_layer: layers
            .iter()
            .map(|k| {
                k.attention()
                    .is_some_and(|a| a.rope != crate::arch::Rope::None)
            })
            .collect(),
        rotary: spec.rotary_dim(),
        gemma4: spec.gemma4.clone(),
        regrouped: Vec::new(),
        produced: Default::default(),
        per_layer: None,
        first_layer: part.layers.start,
        cos,
        sin,
        mask,
        key_cache,
        value_cache,
        value_offset,
        position,
        kinds: layers,
        slots,
        conv,
        delta,
        valid,
    };
    (shared, state)
}

/// Decoder block `l` on the residual stream `x` (in the layout `lower` builds): returns the new
/// stream and the layer's new keys and values as the contract's cache rows.
fn block(
    b: &mut Builder,
    weights: &mut Weights,
    lower: &Lowering,
    shared: &Shared,
    l: usize,
    x: &str,
) -> Result<(String, Kept), GraphError> {
    let tag = format!("layers_{l}");
    let id = |t| TensorId::Layer(l, t);
    let off = shared.norm_offset;
    let nw = lower.norm_weight(b, weights, id(LayerTensor::InputNorm), off)?;
    let ranged = shared.ranged_norms;
    let name = format!("{tag}_input_norm");
    let hn = lower.residual_norm(b, x, &nw, shared.eps, ranged, &name)?;
    let mut proj = Projections::new(shared.dims.q);
    let (mixed, kept) = match shared.kinds[l] {
        crate::arch::LayerKind::Attention(_) => {
            let a = attention::attention(b, weights, &mut proj, lower, shared, l, &hn)?;
            let kept = match a.rows {
                Some((k, v)) => Kept::Rows(k, v),
                None => Kept::Nothing,
            };
            (a.out, kept)
        }
        crate::arch::LayerKind::ShortConv(_) => {
            let slot = (l, shared.slot(l));
            let c = conv::short_conv(b, weights, &mut proj, lower, shared, slot, &hn)?;
            (c.out, Kept::Conv(c.state))
        }
        crate::arch::LayerKind::GatedDelta(g) => {
            let at = (l, shared.slot(l), &g);
            let d = delta::gated_delta(b, weights, &mut proj, lower, shared, at, &hn)?;
            (d.out, Kept::Delta(d.conv_state, d.state))
        }
    };
    let (attn_out, mlp_in) = if shared.sandwich {
        let out = out_norm(b, weights, lower, shared, id(LayerTensor::PostNorm), &mixed)?;
        (out, LayerTensor::PreFfnNorm)
    } else {
        (mixed, LayerTensor::PostNorm)
    };
    let x = b.op(
        Op::Add,
        &format!("{tag}_residual_attn"),
        vec![("x", var(x)), ("y", var(&attn_out))],
    );
    let nw = lower.norm_weight(b, weights, id(mlp_in), off)?;
    let name = format!("{tag}_post_norm");
    let hn = lower.residual_norm(b, &x, &nw, shared.eps, ranged, &name)?;
    let mut down = mlp::mlp(b, weights, &mut proj, lower, shared, l, &hn)?;
    if shared.sandwich {
        down = out_norm(
            b,
            weights,
            lower,
            shared,
            id(LayerTensor::PostFfnNorm),
            &down,
        )?;
    }
    let mut x = b.op(
        Op::Add,
        &format!("{tag}_residual_mlp"),
        vec![("x", var(&x)), ("y", var(&down))],
    );
    // Gemma 4: the block's per-layer input, then its scalar on the whole stream.
    if let Some(inputs) = &shared.per_layer {
        x = per_layer::block(b, weights, lower, shared, (l, inputs), &x)?;
    }
    if shared.gemma4.is_some() {
        let scalar = weights.single(b, id(LayerTensor::LayerScalar))?;
        x = b.op(
            Op::Mul,
            &format!("{tag}_scaled"),
            vec![("x", var(&x)), ("y", var(&scalar))],
        );
    }
    Ok((x, kept))
}

/// A norm's weight as it multiplies: w, or with Gemma's offset 1 + w (an `add` on the stored
/// weight, so a package stores the checkpoint's w).
fn norm_weight(
    b: &mut Builder,
    weights: &mut Weights,
    id: TensorId,
    offset: f64,
) -> Result<String, GraphError> {
    let w = weights.single(b, id)?;
    Ok(plus_offset(b, w, id, offset))
}

/// A norm weight `w` of tensor `id` plus `offset` (an `add`, so a package stores the
/// checkpoint's w); `w` itself when the offset is 0.
fn plus_offset(b: &mut Builder, w: String, id: TensorId, offset: f64) -> String {
    if offset == 0.0 {
        return w;
    }
    b.op(
        Op::Add,
        &format!("{}_plus_one", crate::arch::mil_name(&id.hf_name())),
        vec![("x", var(&w)), ("y", Arg::Float(offset))],
    )
}

/// Gemma's norm `id` of a sublayer output `x` (o_proj's or down_proj's, which carry α, so ε
/// is scaled by α² as on the residual stream), its weight times α again: the normalised output
/// joins a residual stream that carries α, and Gemma's large post-norm weights would overflow
/// fp16 before a later scale.
fn out_norm(
    b: &mut Builder,
    weights: &mut Weights,
    lower: &Lowering,
    shared: &Shared,
    id: TensorId,
    x: &str,
) -> Result<String, GraphError> {
    let name = crate::arch::mil_name(&id.hf_name());
    let mut nw = lower.norm_weight(b, weights, id, shared.norm_offset)?;
    if shared.alpha != 1.0 {
        nw = b.op(
            Op::Mul,
            &format!("{name}_scaled"),
            vec![("x", var(&nw)), ("y", Arg::Float(shared.alpha))],
        );
    }
    let ranged = shared.ranged_norms;
    lower.residual_norm(b, x, &nw, shared.eps, ranged, &format!("{name}_out"))
}

/// [`rms_norm`], or with `ranged` [`rms_norm_ranged`].
fn residual_norm(b: &mut Builder, x: &str, w: &str, eps: f64, ranged: bool, name: &str) -> String {
    if ranged {
        rms_norm_ranged(b, x, w, eps, name)
    } else {
        rms_norm(b, x, w, eps, TOKENS_CHANNELS, name)
    }
}

/// The channel axis of the default layout's [1, Q, C] (and of a head's [1, n, Q, D]).
const TOKENS_CHANNELS: i64 = -1;

/// Smallest per-token maximum |x| [`rms_norm_ranged`] divides by (fp16's smallest normal):
/// an all-zero token stays finite.
const RANGED_FLOOR: f64 = 6.103_515_625e-5;

/// RMSNorm of a residual stream whose range outgrows fp16's squares (Gemma: from ~1 at the
/// embedding to ~300,000 after the post-norms, a ratio no single α brings into
/// [6.1e-5, 65,504] once squared). Each token is first divided by its largest |x| m, so every
/// square lies in [0, 1] and their mean in [1/H, 1]; ε is divided by m² too:
/// x/m / sqrt(mean((x/m)²) + (√ε/m)²) = x / sqrt(mean(x²) + ε), exactly RMSNorm, for any
/// m > 0: m is floored at √ε/255 as well, so (√ε/m)² stays within fp16 however small a row is
/// (a DeltaNet's output rows reach 1e-5 against an ε of 4e-3).
fn rms_norm_ranged(b: &mut Builder, x: &str, w: &str, eps: f64, name: &str) -> String {
    let n = rms_normalize_ranged(b, x, eps, name);
    b.op(Op::Mul, name, vec![("x", var(&n)), ("y", var(w))])
}

/// [`rms_norm_ranged`] without a weight, named `{name}_normed`: over the last axis, so also
/// per head of [1, n, Q, D] (Gemma 4's q, k and v norms, whose heads range from 1e-3 to 1e3).
fn rms_normalize_ranged(b: &mut Builder, x: &str, eps: f64, name: &str) -> String {
    let floor = RANGED_FLOOR.max(eps.sqrt() / 255.0);
    let a = b.op(Op::Abs, &format!("{name}_abs"), vec![("x", var(x))]);
    let m = b.op(
        Op::ReduceMax,
        &format!("{name}_max"),
        vec![
            ("x", var(&a)),
            ("axes", ints(&[-1])),
            ("keep_dims", Arg::Bool(true)),
        ],
    );
    let m = b.op(
        Op::Maximum,
        &format!("{name}_max_floor"),
        vec![("x", var(&m)), ("y", Arg::Float(floor))],
    );
    let xs = b.op(
        Op::RealDiv,
        &format!("{name}_ranged"),
        vec![("x", var(x)), ("y", var(&m))],
    );
    let sq = b.op(
        Op::Mul,
        &format!("{name}_sq"),
        vec![("x", var(&xs)), ("y", var(&xs))],
    );
    let ms = b.op(
        Op::ReduceMean,
        &format!("{name}_mean"),
        vec![
            ("x", var(&sq)),
            ("axes", ints(&[-1])),
            ("keep_dims", Arg::Bool(true)),
        ],
    );
    let root_eps = b.op(
        Op::RealDiv,
        &format!("{name}_root_eps"),
        vec![("x", Arg::Float(eps.sqrt())), ("y", var(&m))],
    );
    let e = b.op(
        Op::Mul,
        &format!("{name}_eps"),
        vec![("x", var(&root_eps)), ("y", var(&root_eps))],
    );
    let ms = b.op(
        Op::Add,
        &format!("{name}_mean_eps"),
        vec![("x", var(&ms)), ("y", var(&e))],
    );
    let r = b.op(
        Op::Rsqrt,
        &format!("{name}_rsqrt"),
        vec![("x", var(&ms)), ("epsilon", Arg::Float(0.0))],
    );
    b.op(
        Op::Mul,
        &format!("{name}_normed"),
        vec![("x", var(&xs)), ("y", var(&r))],
    )
}

/// x / sqrt(mean(x²) + ε) · w over `axis`, the way Hugging Face computes it (ε inside the
/// root).
fn rms_norm(b: &mut Builder, x: &str, w: &str, eps: f64, axis: i64, name: &str) -> String {
    let sq = b.op(
        Op::Mul,
        &format!("{name}_sq"),
        vec![("x", var(x)), ("y", var(x))],
    );
    let ms = b.op(
        Op::ReduceMean,
        &format!("{name}_mean"),
        vec![
            ("x", var(&sq)),
            ("axes", ints(&[axis])),
            ("keep_dims", Arg::Bool(true)),
        ],
    );
    let r = b.op(
        Op::Rsqrt,
        &format!("{name}_rsqrt"),
        vec![("x", var(&ms)), ("epsilon", Arg::Float(eps))],
    );
    let n = b.op(
        Op::Mul,
        &format!("{name}_normed"),
        vec![("x", var(x)), ("y", var(&r))],
    );
    b.op(Op::Mul, name, vec![("x", var(&n)), ("y", var(w))])
}

/// The per-layer rows stacked along axis 0 (an `identity` for a single layer).
fn stack(b: &mut Builder, rows: Vec<String>, name: &str) -> String {
    if rows.len() == 1 {
        b.op(Op::Identity, name, vec![("x", var(&rows[0]))])
    } else {
        b.op(
            Op::Concat,
            name,
            vec![
                ("values", Arg::Vars(rows)),
                ("axis", Arg::Int(0)),
                ("interleave", Arg::Bool(false)),
            ],
        )
    }
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
