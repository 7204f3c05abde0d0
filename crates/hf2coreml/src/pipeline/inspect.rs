//! What `inspect` reports about a checkpoint.

use serde::Serialize;

use crate::arch::{ModelSpec, RoleGroup};
use crate::budget;
use crate::checkpoint::gguf::header::HeaderInfo;
use crate::checkpoint::Checkpoint;
use crate::quant::Recipe;
use crate::quant::Storage;

/// Tensors, parameters and bytes of one role group.
#[derive(Debug, Clone, Serialize)]
pub struct GroupSummary {
    pub role: &'static str,
    pub tensors: usize,
    pub parameters: u64,
    /// Bytes as stored in the checkpoint.
    pub bytes: u64,
}

/// The `inspect --json` document.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub path: String,
    pub architecture: String,
    /// Parameters, tied weights counted once.
    pub parameters: u64,
    pub layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// Per-head q/k RMSNorms (Qwen3).
    pub qk_norm: bool,
    /// Blocks without RoPE (SmolLM3).
    pub no_rope_layers: Vec<usize>,
    pub rope_theta: f64,
    pub rope_scaling: crate::arch::RopeScaling,
    pub rms_norm_eps: f64,
    /// The dtype most weights are stored in.
    pub dtype: &'static str,
    /// The dtype config.json declares.
    pub config_dtype: Option<String>,
    pub checkpoint_bytes: u64,
    pub groups: Vec<GroupSummary>,
    pub fp16_bytes: u64,
    /// Bytes under the default recipe (projections 4-bit, embedding/lm_head/norms fp16).
    pub default_recipe_bytes: u64,
    /// The recipe `inspect` was given (its file, or the built-in default).
    pub recipe: String,
    /// Bytes under that recipe.
    pub recipe_bytes: u64,
    /// What a GGUF source's header says (tensor types, bits per weight, truncation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gguf: Option<HeaderInfo>,
    /// The multimodal class whose text decoder this is, when it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_of: Option<String>,
    /// What a conversion of a multimodal checkpoint leaves out, part by part.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<DroppedPart>,
    /// The state of a model whose blocks are not all attention (LFM2's conv blocks, Qwen3.5's
    /// DeltaNets).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hybrid_state: Option<HybridState>,
    /// Gemma 4's blocks of two head shapes, shared caches and per-layer inputs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemma4: Option<Gemma4Summary>,
}

/// What Gemma 4's blocks keep and read beyond one head shape and one cache each.
#[derive(Debug, Clone, Serialize)]
pub struct Gemma4Summary {
    /// The full-attention blocks' head size and KV heads.
    pub global_head_dim: usize,
    pub global_kv_heads: usize,
    /// (block, the block whose cache it reads), for every block that keeps none of its own.
    pub shared: Vec<(usize, usize)>,
    /// The blocks that keep key and value rows.
    pub cache_blocks: usize,
    /// Their key and value bytes per position (fp16).
    pub kv_bytes_per_token: u64,
    /// P, each block's per-layer input width (0: none), and the per-layer table's parameters.
    pub per_layer_input: usize,
    pub per_layer_parameters: u64,
}

impl Gemma4Summary {
    fn of(spec: &crate::arch::ModelSpec) -> Option<Self> {
        let g = spec.gemma4.as_ref()?;
        let layers = 0..spec.num_hidden_layers;
        Some(Gemma4Summary {
            global_head_dim: g.global_head_dim,
            global_kv_heads: g.global_kv_heads,
            shared: layers
                .clone()
                .filter_map(|l| spec.kv_producer(l).map(|p| (l, p)))
                .collect(),
            cache_blocks: spec.attention_layers(layers).len(),
            kv_bytes_per_token: spec.state_bytes(1),
            per_layer_input: g.per_layer_input,
            per_layer_parameters: (g.per_layer_vocab * spec.num_hidden_layers * g.per_layer_input)
                as u64,
        })
    }
}

/// What a hybrid model keeps per sequence: key/value rows of its attention blocks, which grow
/// with the context, and the fixed state of its other blocks.
#[derive(Debug, Clone, Serialize)]
pub struct HybridState {
    pub attention_blocks: usize,
    /// Key and value bytes per position over the attention blocks (fp16).
    pub kv_bytes_per_token: u64,
    /// The blocks that do not attend (LFM2's conv blocks, Qwen3.5's DeltaNets).
    pub recurrent_blocks: usize,
    /// Their state's bytes, whatever the context (fp16).
    pub recurrent_state_bytes: u64,
}

impl HybridState {
    fn of(spec: &crate::arch::ModelSpec) -> Option<Self> {
        use crate::arch::{LayerKind, StateEntry};
        if spec.short_conv.is_none() && spec.gated_delta.is_none() {
            return None;
        }
        let kinds = spec.layers();
        let attention = kinds
            .iter()
            .filter(|k| matches!(k, LayerKind::Attention(_)))
            .count();
        let per_token = |e: &StateEntry| match e {
            StateEntry::Keys { .. } | StateEntry::Values { .. } => e.bytes(1),
            StateEntry::Conv { .. } | StateEntry::Delta { .. } => 0,
        };
        let fixed = |e: &StateEntry| match e {
            StateEntry::Conv { .. } | StateEntry::Delta { .. } => e.bytes(1),
            _ => 0,
        };
        let entries: Vec<StateEntry> = kinds.iter().flat_map(LayerKind::state).collect();
        Some(HybridState {
            attention_blocks: attention,
            kv_bytes_per_token: entries.iter().map(per_token).sum(),
            recurrent_blocks: kinds.len() - attention,
            recurrent_state_bytes: entries.iter().map(fixed).sum(),
        })
    }
}

/// One part of a multimodal checkpoint a conversion leaves out (never read).
#[derive(Debug, Clone, Serialize)]
pub struct DroppedPart {
    /// The tensor name prefix (`vision_tower.`).
    pub prefix: String,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
}

impl DroppedPart {
    /// The parts checkpoint `ckpt` leaves out, in prefix order.
    pub fn of(ckpt: &Checkpoint) -> Vec<Self> {
        ckpt.dropped()
            .parts
            .iter()
            .map(|(prefix, tensors, parameters, bytes)| DroppedPart {
                prefix: prefix.clone(),
                tensors: *tensors,
                parameters: *parameters,
                bytes: *bytes,
            })
            .collect()
    }
}

/// Bits per weight the recipe gives the projections (the palettized indices; tables aside),
/// the smallest over all projections.
pub fn recipe_projection_bits(slots: &[crate::arch::TensorSlot], recipe: &Recipe) -> Option<u8> {
    slots
        .iter()
        .filter(|s| s.role.is_projection())
        .map(|s| match recipe.storage(s) {
            Storage::Fp16 => 16,
            Storage::Lut { nbits, .. } => nbits,
        })
        .min()
}

/// The note to print when a recipe re-quantizes a source that was already quantized to as
/// few or fewer bits: the source's own error (its projection type's bits per weight) is a
/// floor the package's error adds to. `None` when the recipe keeps more bits than the source.
pub fn requantization_note(
    source: &HeaderInfo,
    slots: &[crate::arch::TensorSlot],
    recipe: &Recipe,
) -> Option<String> {
    let (ty, source_bits) = source.projection_type.as_ref()?;
    let bits = recipe_projection_bits(slots, recipe)?;
    (f64::from(bits) <= *source_bits).then(|| {
        format!(
            "the source's projections are already quantized ({ty}, {source_bits:.2} bits/weight); \
             the recipe's {bits}-bit palettization re-quantizes them, so the package's error adds \
             to the source's own (compare with `validate --against` the imported source)"
        )
    })
}

/// Summarize a GGUF from its header alone (no tensor data is read), sizing its weights under
/// `recipe` as [`summarize`] does for a checkpoint.
pub fn summarize_gguf(info: HeaderInfo, recipe: &Recipe) -> Summary {
    let spec = info.spec.clone();
    let slots = crate::arch::expected_tensors(&spec);
    let source = Source {
        path: info.path.display().to_string(),
        dtype: "gguf",
        config_dtype: None,
        checkpoint_bytes: info.file_size,
    };
    let stored = |name: &str| info.stored_bytes.get(name).copied().unwrap_or(0);
    let mut summary = build(&spec, &slots, stored, source, recipe);
    summary.gguf = Some(info);
    summary
}

/// Where a summary's weights come from: a checkpoint directory or a GGUF header.
struct Source {
    path: String,
    dtype: &'static str,
    config_dtype: Option<String>,
    checkpoint_bytes: u64,
}

/// The summary of `spec`'s `slots`, each stored in `stored(name)` bytes, sized under `recipe`
/// and the default recipe.
fn build(
    spec: &ModelSpec,
    slots: &[crate::arch::TensorSlot],
    stored: impl Fn(&str) -> u64,
    source: Source,
    recipe: &Recipe,
) -> Summary {
    let default = Recipe::default();
    let mut groups = empty_groups();
    for slot in slots {
        let g = group_of(&mut groups, slot);
        g.tensors += 1;
        g.parameters += slot.numel() as u64;
        g.bytes += stored(&slot.name);
    }
    Summary {
        path: source.path,
        architecture: spec.architecture.hf_name().to_string(),
        parameters: slots.iter().map(|s| s.numel() as u64).sum(),
        layers: spec.num_hidden_layers,
        hidden_size: spec.hidden_size,
        intermediate_size: spec.intermediate_size,
        num_attention_heads: spec.num_attention_heads,
        num_key_value_heads: spec.num_key_value_heads,
        head_dim: spec.head_dim,
        vocab_size: spec.vocab_size,
        context_length: spec.max_position_embeddings,
        tie_word_embeddings: spec.tie_word_embeddings,
        attention_bias: spec.attention_bias,
        qk_norm: spec.qk_norm,
        no_rope_layers: spec.no_rope_layers.clone(),
        rope_theta: spec.rope_theta,
        rope_scaling: spec.rope_scaling.clone(),
        rms_norm_eps: spec.rms_norm_eps,
        dtype: source.dtype,
        config_dtype: source.config_dtype,
        checkpoint_bytes: source.checkpoint_bytes,
        groups,
        fp16_bytes: budget::weights_bytes(slots, |_| Storage::Fp16),
        default_recipe_bytes: default.weights_bytes(slots),
        recipe: recipe.origin().to_string(),
        recipe_bytes: recipe.weights_bytes(slots),
        gguf: None,
        text_of: None,
        dropped: Vec::new(),
        hybrid_state: HybridState::of(spec),
        gemma4: Gemma4Summary::of(spec),
    }
}

fn empty_groups() -> Vec<GroupSummary> {
    RoleGroup::ALL
        .iter()
        .map(|g| GroupSummary {
            role: g.as_str(),
            tensors: 0,
            parameters: 0,
            bytes: 0,
        })
        .collect()
}

fn group_of<'a>(
    groups: &'a mut [GroupSummary],
    slot: &crate::arch::TensorSlot,
) -> &'a mut GroupSummary {
    &mut groups[RoleGroup::ALL
        .iter()
        .position(|x| *x == slot.role.group())
        .expect("every role has a group")]
}

/// Summarize `ckpt`, sizing its weights under `recipe` (and the default recipe).
pub fn summarize(ckpt: &Checkpoint, recipe: &Recipe) -> Summary {
    let source = Source {
        path: ckpt.dir().display().to_string(),
        dtype: ckpt.storage_dtype().short_name(),
        config_dtype: ckpt.spec().dtype.clone(),
        checkpoint_bytes: ckpt.file_bytes(),
    };
    let stored = |name: &str| ckpt.tensor(name).map_or(0, |t| t.data.len() as u64);
    let mut s = build(ckpt.spec(), &ckpt.slots(), stored, source, recipe);
    s.text_of = ckpt.spec().text_of.clone();
    s.dropped = DroppedPart::of(ckpt);
    s
}
