//! What every block of a step reads besides its weights ([`Shared`]): the dimensions and
//! numerics, the position, the caches (inputs or the state read), RoPE rows and masks, the
//! recurrent blocks' state inputs; declared once per step by [`shared_inputs`] for both
//! layouts.

use std::collections::BTreeMap;

use super::causal_conv::ConvInputs;
use super::delta::delta_inputs::DeltaInputs;
use super::step::{Dims, Part, StepOptions};
use super::{mask, stateful};
use crate::arch::ModelSpec;
use crate::graph::{Builder, DType};
use crate::mil::contract;

/// What every block reads besides its weights.
pub(super) struct Shared {
    pub(super) dims: Dims,
    /// The residual scale α (folded into the embedding, o_proj and down_proj).
    pub(super) alpha: f64,
    /// The norms' ε, times α² (RMSNorm(αx) with ε·α² equals RMSNorm(x) with ε).
    pub(super) eps: f64,
    /// The model's ε itself, for norms of what does not carry α (a DeltaNet's output).
    pub(super) plain_eps: f64,
    /// 1/√D (Gemma: `query_pre_attn_scalar`^-½).
    pub(super) q_scale: f64,
    /// What every norm adds to its weight (Gemma's 1 + w).
    pub(super) norm_offset: f64,
    /// Gemma: the sublayer outputs pass through their own norms before the residual add.
    pub(super) sandwich: bool,
    /// Gemma's tanh-approximated GELU in place of SiLU.
    pub(super) gelu_tanh: bool,
    /// Gemma: the norms of the residual stream divide by each token's largest |x| before
    /// squaring ([`super::norms::rms_norm_ranged`]).
    pub(super) ranged_norms: bool,
    /// Gemma's sliding blocks: their RoPE rows and banded mask.
    pub(super) local: Option<(String, String, String)>,
    /// Per block: whether it is one of Gemma's sliding blocks.
    pub(super) sliding: Vec<bool>,
    pub(super) attention_bias: bool,
    /// Qwen3.5: q_proj also gives a gate, sigmoid(gate) times the attention output.
    pub(super) output_gate: bool,
    /// Qwen3's per-head q/k norms: their ε (the model's, unscaled: q and k do not carry α).
    pub(super) qk_norm_eps: Option<f64>,
    /// Per block: whether it rotates q and k (SmolLM3's NoPE blocks do not).
    pub(super) rope_in_layer: Vec<bool>,
    /// The leading dimensions of each head RoPE rotates (D unless partial, Phi-4-mini; Gemma
    /// 4's full blocks rotate their whole head against a table whose unrotated pairs have
    /// cos 1 and sin 0).
    pub(super) rotary: usize,
    /// Gemma 4: the values pass an RMSNorm without weight, and the full blocks' values are
    /// their raw key projection with `attention_k_eq_v`.
    pub(super) gemma4: Option<crate::arch::Gemma4Spec>,
    /// The masks grouped for blocks whose query heads per KV head differ from the model's
    /// (Gemma 4's full blocks): (groups, mask, window mask).
    pub(super) regrouped: Vec<(usize, String, Option<String>)>,
    /// The joined keys and values [1, Hkv, S+Q, D] of the blocks a later block of this step
    /// reads (Gemma 4's KV sharing), by block.
    pub(super) produced: std::cell::RefCell<BTreeMap<usize, (String, String)>>,
    /// Gemma 4's per-layer inputs of this step [1, Q, L, P].
    pub(super) per_layer: Option<String>,
    /// The first layer this package runs: its caches' row 0.
    pub(super) first_layer: usize,
    /// This step's RoPE rows [Q, D].
    pub(super) cos: String,
    pub(super) sin: String,
    /// [Q, S+Q].
    pub(super) mask: String,
    pub(super) key_cache: String,
    pub(super) value_cache: String,
    /// Where layer 0's values start in `value_cache`: 0 for the io inputs, L in the state.
    pub(super) value_offset: usize,
    /// The `position` input.
    pub(super) position: String,
    /// Every block's kind (by absolute index).
    pub(super) kinds: Vec<crate::arch::LayerKind>,
    /// Per block of this part (from `first_layer`): its index among the part's blocks of its
    /// kind, the slot of its cache rows or conv state.
    pub(super) slots: Vec<usize>,
    /// The conv state's inputs (LFM2's conv blocks, or the DeltaNets'), if the part has any.
    pub(super) conv: Option<ConvInputs>,
    /// The DeltaNet state's inputs, if the part has DeltaNet blocks.
    pub(super) delta: Option<DeltaInputs>,
    /// A hybrid step's `valid_len` input (Q > 1).
    pub(super) valid: Option<String>,
}

impl Shared {
    /// Block `l`'s slot in the caches (an attention block: its first) or the conv state.
    pub(super) fn slot(&self, l: usize) -> usize {
        self.slots[l - self.first_layer]
    }

    /// The step's dimensions with block `l`'s own KV heads and head width.
    pub(super) fn dims_of(&self, l: usize) -> Dims {
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

/// The position, the caches (this part's layers: inputs, or the state read), RoPE rows and the
/// mask: what every block reads besides its weights.
pub(super) fn shared_inputs(
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
        ConvInputs::new(
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
        DeltaInputs::new(
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
