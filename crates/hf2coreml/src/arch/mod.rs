//! Per-architecture facts: which tensors a checkpoint holds, their shapes and their roles.
//!
//! Llama, Mistral, Qwen2, Qwen3, SmolLM3 and Phi-3 share one decoder layout; they differ in q/k/v
//! biases (Qwen2), per-head q/k norms (Qwen3), blocks without RoPE (SmolLM3), partial RoPE
//! (Phi-4-mini), tied embeddings and rope details, all carried by [`ModelSpec`]. Phi-3 stores
//! q/k/v and gate/up fused ([`fused_tensors`]); the checkpoint splits them at load, so every
//! later stage sees the one layout. Gemma 3 adds a norm before and after the MLP
//! ([`LayerTensor::PreFfnNorm`], [`LayerTensor::PostFfnNorm`]).

use serde::{Deserialize, Serialize};

mod layers;
mod spec;

pub use layers::{slot_pieces, Attention, GatedDelta, LayerKind, Rope, ShortConv, StateEntry};
pub use spec::{
    Architecture, GatedDeltaSpec, Gemma4Spec, GemmaSpec, ModelSpec, RopeScaling, ShortConvSpec,
};

/// What a tensor does in the model; recipes match on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    Norm,
    /// q/k/v biases (Qwen2), LFM2's conv biases: tiny, always kept in fp16.
    Bias,
    LmHead,
    /// LFM2's conv-block input projection (to B, C and x), beside q/k/v on the block input.
    ConvIn,
    /// LFM2's depthwise convolution taps [channels, 1, kernel]: kept in fp16 like a norm.
    Conv,
    /// A Gated DeltaNet's `in_proj_z`: the gate on its output, beside `in_proj_qkv` (whose
    /// role is [`Role::ConvIn`]) on the block input.
    OutputGate,
    /// A Gated DeltaNet's decay and write strength: `in_proj_a`, `in_proj_b` ([value heads,
    /// hidden]), `A_log` and `dt_bias`: tiny, always kept in fp16 (the decay compounds over
    /// every step).
    DeltaStep,
    /// Gemma 4's per-layer embedding table [rows, layers × P].
    PerLayerEmbedding,
    /// Gemma 4's per-layer input projections: the model's projection of the embeddings to
    /// every block's P values, and each block's gate [P, H] and projection [H, P].
    PerLayer,
}

impl Role {
    pub const ALL: [Role; 17] = [
        Role::Embedding,
        Role::Q,
        Role::K,
        Role::V,
        Role::O,
        Role::Gate,
        Role::Up,
        Role::Down,
        Role::Norm,
        Role::Bias,
        Role::LmHead,
        Role::ConvIn,
        Role::Conv,
        Role::OutputGate,
        Role::DeltaStep,
        Role::PerLayerEmbedding,
        Role::PerLayer,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::Q => "q",
            Role::K => "k",
            Role::V => "v",
            Role::O => "o",
            Role::Gate => "gate",
            Role::Up => "up",
            Role::Down => "down",
            Role::Norm => "norm",
            Role::Bias => "bias",
            Role::LmHead => "lm_head",
            Role::ConvIn => "conv_in",
            Role::Conv => "conv",
            Role::OutputGate => "output_gate",
            Role::DeltaStep => "delta_step",
            Role::PerLayerEmbedding => "per_layer_embedding",
            Role::PerLayer => "per_layer",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The coarse group `inspect` reports.
    pub fn group(self) -> RoleGroup {
        match self {
            Role::Embedding | Role::PerLayerEmbedding => RoleGroup::Embedding,
            Role::Q
            | Role::K
            | Role::V
            | Role::O
            | Role::Bias
            | Role::ConvIn
            | Role::Conv
            | Role::OutputGate
            | Role::DeltaStep => RoleGroup::Attention,
            Role::Gate | Role::Up | Role::Down | Role::PerLayer => RoleGroup::Mlp,
            Role::Norm => RoleGroup::Norms,
            Role::LmHead => RoleGroup::LmHead,
        }
    }

    /// A 2-D projection inside a decoder block (the bulk a recipe palettizes).
    pub fn is_projection(self) -> bool {
        matches!(
            self,
            Role::Q
                | Role::K
                | Role::V
                | Role::O
                | Role::Gate
                | Role::Up
                | Role::Down
                | Role::ConvIn
                | Role::OutputGate
                | Role::PerLayer
        )
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rows of the `inspect` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleGroup {
    Embedding,
    Attention,
    Mlp,
    Norms,
    LmHead,
}

impl RoleGroup {
    pub const ALL: [RoleGroup; 5] = [
        RoleGroup::Embedding,
        RoleGroup::Attention,
        RoleGroup::Mlp,
        RoleGroup::Norms,
        RoleGroup::LmHead,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RoleGroup::Embedding => "embedding",
            RoleGroup::Attention => "attention",
            RoleGroup::Mlp => "mlp",
            RoleGroup::Norms => "norms",
            RoleGroup::LmHead => "lm_head",
        }
    }
}

/// One tensor the architecture expects in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSlot {
    /// The Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    /// Decoder block index, `None` for embedding, final norm and lm_head.
    pub layer: Option<usize>,
}

impl TensorSlot {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A tensor of one decoder block, in the order a block holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerTensor {
    InputNorm,
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    /// Qwen3's per-head RMSNorm weights [head_dim] on q and k, before RoPE.
    QNorm,
    KNorm,
    O,
    /// `post_attention_layernorm`: the MLP's input norm, except in Gemma, where it normalises
    /// the attention output before the residual add.
    PostNorm,
    /// Gemma's MLP input norm.
    PreFfnNorm,
    Gate,
    Up,
    Down,
    /// Gemma's norm of the MLP output, before the residual add.
    PostFfnNorm,
    /// LFM2's conv block: `in_proj` [3H, H] (B, C, x), the depthwise taps [H, 1, K] and
    /// `out_proj` [H, H], each with a bias under `conv_bias`.
    ConvIn,
    ConvInBias,
    Conv,
    ConvBias,
    ConvOut,
    ConvOutBias,
    /// A Gated DeltaNet block (`linear_attn.*`): `in_proj_qkv` [2·Hk·Dk + Hv·Dv, H] into
    /// the depthwise conv [that, 1, K], `in_proj_z` [Hv·Dv, H], `in_proj_b` and `in_proj_a`
    /// [Hv, H], `dt_bias` and `A_log` [Hv], the gated output norm [Dv], `out_proj` [H, Hv·Dv].
    DeltaQkv,
    DeltaZ,
    DeltaB,
    DeltaA,
    DeltaConv,
    DeltaDtBias,
    DeltaALog,
    DeltaNorm,
    DeltaOut,
    /// Gemma 4's per-layer input sub-block: the gate [P, H] on the residual stream, the
    /// projection [H, P] back, its output norm [H]; and the block's output scalar [1].
    PerLayerGate,
    PerLayerProjection,
    PerLayerNorm,
    LayerScalar,
}

impl LayerTensor {
    /// The tensor a block's MLP input norm is: Gemma's `pre_feedforward_layernorm` (its
    /// `post_attention_layernorm` normalises the attention output), else
    /// `post_attention_layernorm`.
    pub fn mlp_norm(spec: &ModelSpec) -> LayerTensor {
        if spec.gemma.is_some() {
            LayerTensor::PreFfnNorm
        } else {
            LayerTensor::PostNorm
        }
    }

    /// Every block tensor, in model order (the biases exist only with `attention_bias`, the
    /// q/k norms only with `qk_norm`, the conv tensors only in conv blocks, which have no
    /// attention tensors).
    pub const ALL: [LayerTensor; 35] = [
        LayerTensor::InputNorm,
        LayerTensor::DeltaQkv,
        LayerTensor::DeltaZ,
        LayerTensor::DeltaB,
        LayerTensor::DeltaA,
        LayerTensor::DeltaConv,
        LayerTensor::DeltaDtBias,
        LayerTensor::DeltaALog,
        LayerTensor::DeltaNorm,
        LayerTensor::DeltaOut,
        LayerTensor::ConvIn,
        LayerTensor::ConvInBias,
        LayerTensor::Conv,
        LayerTensor::ConvBias,
        LayerTensor::ConvOut,
        LayerTensor::ConvOutBias,
        LayerTensor::Q,
        LayerTensor::K,
        LayerTensor::V,
        LayerTensor::QBias,
        LayerTensor::KBias,
        LayerTensor::VBias,
        LayerTensor::QNorm,
        LayerTensor::KNorm,
        LayerTensor::O,
        LayerTensor::PostNorm,
        LayerTensor::PreFfnNorm,
        LayerTensor::Gate,
        LayerTensor::Up,
        LayerTensor::Down,
        LayerTensor::PostFfnNorm,
        LayerTensor::PerLayerGate,
        LayerTensor::PerLayerProjection,
        LayerTensor::PerLayerNorm,
        LayerTensor::LayerScalar,
    ];

    /// The name inside the block, after `model.layers.{l}.`.
    fn suffix(self) -> &'static str {
        match self {
            LayerTensor::InputNorm => "input_layernorm.weight",
            LayerTensor::Q => "self_attn.q_proj.weight",
            LayerTensor::K => "self_attn.k_proj.weight",
            LayerTensor::V => "self_attn.v_proj.weight",
            LayerTensor::QBias => "self_attn.q_proj.bias",
            LayerTensor::KBias => "self_attn.k_proj.bias",
            LayerTensor::VBias => "self_attn.v_proj.bias",
            LayerTensor::QNorm => "self_attn.q_norm.weight",
            LayerTensor::KNorm => "self_attn.k_norm.weight",
            LayerTensor::O => "self_attn.o_proj.weight",
            LayerTensor::PostNorm => "post_attention_layernorm.weight",
            LayerTensor::PreFfnNorm => "pre_feedforward_layernorm.weight",
            LayerTensor::PostFfnNorm => "post_feedforward_layernorm.weight",
            LayerTensor::Gate => "mlp.gate_proj.weight",
            LayerTensor::Up => "mlp.up_proj.weight",
            LayerTensor::Down => "mlp.down_proj.weight",
            LayerTensor::ConvIn => "conv.in_proj.weight",
            LayerTensor::ConvInBias => "conv.in_proj.bias",
            LayerTensor::Conv => "conv.conv.weight",
            LayerTensor::ConvBias => "conv.conv.bias",
            LayerTensor::ConvOut => "conv.out_proj.weight",
            LayerTensor::ConvOutBias => "conv.out_proj.bias",
            LayerTensor::DeltaQkv => "linear_attn.in_proj_qkv.weight",
            LayerTensor::DeltaZ => "linear_attn.in_proj_z.weight",
            LayerTensor::DeltaB => "linear_attn.in_proj_b.weight",
            LayerTensor::DeltaA => "linear_attn.in_proj_a.weight",
            LayerTensor::DeltaConv => "linear_attn.conv1d.weight",
            LayerTensor::DeltaDtBias => "linear_attn.dt_bias",
            LayerTensor::DeltaALog => "linear_attn.A_log",
            LayerTensor::DeltaNorm => "linear_attn.norm.weight",
            LayerTensor::DeltaOut => "linear_attn.out_proj.weight",
            LayerTensor::PerLayerGate => "per_layer_input_gate.weight",
            LayerTensor::PerLayerProjection => "per_layer_projection.weight",
            LayerTensor::PerLayerNorm => "post_per_layer_input_norm.weight",
            LayerTensor::LayerScalar => "layer_scalar",
        }
    }

    pub fn role(self) -> Role {
        match self {
            LayerTensor::InputNorm
            | LayerTensor::PostNorm
            | LayerTensor::PreFfnNorm
            | LayerTensor::PostFfnNorm
            | LayerTensor::QNorm
            | LayerTensor::KNorm
            | LayerTensor::DeltaNorm
            | LayerTensor::PerLayerNorm
            | LayerTensor::LayerScalar => Role::Norm,
            LayerTensor::PerLayerGate | LayerTensor::PerLayerProjection => Role::PerLayer,
            LayerTensor::Q => Role::Q,
            LayerTensor::K => Role::K,
            LayerTensor::V => Role::V,
            LayerTensor::QBias
            | LayerTensor::KBias
            | LayerTensor::VBias
            | LayerTensor::ConvInBias
            | LayerTensor::ConvBias
            | LayerTensor::ConvOutBias => Role::Bias,
            LayerTensor::O | LayerTensor::ConvOut | LayerTensor::DeltaOut => Role::O,
            LayerTensor::ConvIn | LayerTensor::DeltaQkv => Role::ConvIn,
            LayerTensor::Conv | LayerTensor::DeltaConv => Role::Conv,
            LayerTensor::DeltaZ => Role::OutputGate,
            LayerTensor::DeltaB
            | LayerTensor::DeltaA
            | LayerTensor::DeltaDtBias
            | LayerTensor::DeltaALog => Role::DeltaStep,
            LayerTensor::Gate => Role::Gate,
            LayerTensor::Up => Role::Up,
            LayerTensor::Down => Role::Down,
        }
    }

    /// The projection weight of a projection role in a block of kind `kind`.
    pub fn projection(role: Role, kind: &LayerKind) -> Option<LayerTensor> {
        let conv = matches!(kind, LayerKind::ShortConv(_));
        let delta = matches!(kind, LayerKind::GatedDelta(_));
        let attends = kind.attention().is_some();
        Some(match role {
            Role::Q if attends => LayerTensor::Q,
            Role::K if attends => LayerTensor::K,
            Role::V if attends => LayerTensor::V,
            Role::O if conv => LayerTensor::ConvOut,
            Role::O if delta => LayerTensor::DeltaOut,
            Role::O => LayerTensor::O,
            Role::ConvIn if conv => LayerTensor::ConvIn,
            Role::ConvIn if delta => LayerTensor::DeltaQkv,
            Role::OutputGate if delta => LayerTensor::DeltaZ,
            Role::Gate => LayerTensor::Gate,
            Role::Up => LayerTensor::Up,
            Role::Down => LayerTensor::Down,
            _ => return None,
        })
    }

    /// Whether block `l` of `spec` holds this tensor.
    pub fn present(self, spec: &ModelSpec, l: usize) -> bool {
        let kind = spec.layer(l);
        let conv = match kind {
            LayerKind::ShortConv(c) => Some(c),
            _ => None,
        };
        let delta = matches!(kind, LayerKind::GatedDelta(_));
        match self {
            LayerTensor::DeltaQkv
            | LayerTensor::DeltaZ
            | LayerTensor::DeltaB
            | LayerTensor::DeltaA
            | LayerTensor::DeltaConv
            | LayerTensor::DeltaDtBias
            | LayerTensor::DeltaALog
            | LayerTensor::DeltaNorm
            | LayerTensor::DeltaOut => delta,
            LayerTensor::ConvIn | LayerTensor::Conv | LayerTensor::ConvOut => conv.is_some(),
            LayerTensor::ConvInBias | LayerTensor::ConvBias | LayerTensor::ConvOutBias => {
                conv.is_some_and(|c| c.bias)
            }
            LayerTensor::Q
            | LayerTensor::K
            | LayerTensor::V
            | LayerTensor::QBias
            | LayerTensor::KBias
            | LayerTensor::VBias
            | LayerTensor::QNorm
            | LayerTensor::KNorm
            | LayerTensor::O
                if kind.attention().is_none() =>
            {
                false
            }
            // Gemma 4's KV-sharing blocks compute no keys or values of their own, and with
            // k_eq_v its full blocks' values are their keys.
            LayerTensor::K | LayerTensor::V | LayerTensor::KNorm
                if kind.attention().is_some_and(|a| a.kv_from.is_some()) =>
            {
                false
            }
            LayerTensor::V => !spec
                .gemma4
                .as_ref()
                .is_some_and(|g| g.k_eq_v && kind.attention().is_some_and(|a| a.window.is_none())),
            LayerTensor::QBias | LayerTensor::KBias | LayerTensor::VBias => spec.attention_bias,
            LayerTensor::QNorm | LayerTensor::KNorm => spec.qk_norm,
            LayerTensor::PreFfnNorm | LayerTensor::PostFfnNorm => spec.gemma.is_some(),
            LayerTensor::PerLayerGate
            | LayerTensor::PerLayerProjection
            | LayerTensor::PerLayerNorm => spec.per_layer_input() > 0,
            LayerTensor::LayerScalar => spec.gemma4.is_some(),
            _ => true,
        }
    }

    /// [rows, cols] (or [n] for norms and biases) in block `l`.
    fn shape(self, spec: &ModelSpec, l: usize) -> Vec<usize> {
        // A DeltaNet's conv channels, value width, value heads, kernel and value head size.
        let (dc, dv, dh, dk, dd) = spec.gated_delta.as_ref().map_or((0, 0, 0, 0, 0), |g| {
            (
                g.conv_channels(),
                g.value_width(),
                g.value_heads,
                g.kernel,
                g.value_dim,
            )
        });
        // Gemma 4's blocks differ in head shape and MLP width.
        let (kv, d) = match spec.layer(l).attention() {
            Some(a) => (a.kv_heads * a.head_dim, a.head_dim),
            None => (spec.kv_dim(), spec.head_dim),
        };
        let (h, q, i) = (spec.hidden_size, spec.q_dim_of(l), spec.intermediate(l));
        let p = spec.per_layer_input();
        match self {
            LayerTensor::InputNorm
            | LayerTensor::PostNorm
            | LayerTensor::PreFfnNorm
            | LayerTensor::PostFfnNorm
            | LayerTensor::ConvBias
            | LayerTensor::ConvOutBias => vec![h],
            LayerTensor::ConvIn => vec![3 * h, h],
            LayerTensor::ConvInBias => vec![3 * h],
            LayerTensor::Conv => vec![h, 1, spec.short_conv.as_ref().map_or(0, |c| c.kernel)],
            LayerTensor::ConvOut => vec![h, h],
            LayerTensor::Q => vec![q * if spec.attention_output_gate { 2 } else { 1 }, h],
            LayerTensor::K | LayerTensor::V => vec![kv, h],
            LayerTensor::QBias => vec![q],
            LayerTensor::KBias | LayerTensor::VBias => vec![kv],
            LayerTensor::QNorm | LayerTensor::KNorm => vec![d],
            LayerTensor::O => vec![h, q],
            LayerTensor::Gate | LayerTensor::Up => vec![i, h],
            LayerTensor::Down => vec![h, i],
            LayerTensor::DeltaQkv => vec![dc, h],
            LayerTensor::DeltaZ => vec![dv, h],
            LayerTensor::DeltaB | LayerTensor::DeltaA => vec![dh, h],
            LayerTensor::DeltaConv => vec![dc, 1, dk],
            LayerTensor::DeltaDtBias | LayerTensor::DeltaALog => vec![dh],
            LayerTensor::DeltaNorm => vec![dd],
            LayerTensor::DeltaOut => vec![h, dv],
            LayerTensor::PerLayerGate => vec![p, h],
            LayerTensor::PerLayerProjection => vec![h, p],
            LayerTensor::PerLayerNorm => vec![h],
            LayerTensor::LayerScalar => vec![1],
        }
    }
}

/// A tensor of the model, by its place: what the graph builder, the float model and the
/// calibration look weights up by. [`TensorId::hf_name`] is the one place Hugging Face names
/// are spelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorId {
    Embedding,
    /// Gemma 4's per-layer input: the embedding table [rows, L × P], the projection of the
    /// embeddings [L × P, H] and the norm [P] of each block's share of it.
    PerLayerEmbedding,
    PerLayerModelProjection,
    PerLayerProjectionNorm,
    Layer(usize, LayerTensor),
    FinalNorm,
    LmHead,
}

impl TensorId {
    /// The Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub fn hf_name(self) -> String {
        match self {
            TensorId::Embedding => "model.embed_tokens.weight".into(),
            TensorId::PerLayerEmbedding => "model.embed_tokens_per_layer.weight".into(),
            TensorId::PerLayerModelProjection => "model.per_layer_model_projection.weight".into(),
            TensorId::PerLayerProjectionNorm => "model.per_layer_projection_norm.weight".into(),
            TensorId::Layer(l, t) => format!("model.layers.{l}.{}", t.suffix()),
            TensorId::FinalNorm => "model.norm.weight".into(),
            TensorId::LmHead => "lm_head.weight".into(),
        }
    }

    /// The tensor the lm_head multiplies by: the embedding when tied.
    pub fn head(spec: &ModelSpec) -> TensorId {
        if spec.tie_word_embeddings {
            TensorId::Embedding
        } else {
            TensorId::LmHead
        }
    }

    pub fn role(self) -> Role {
        match self {
            TensorId::Embedding => Role::Embedding,
            TensorId::PerLayerEmbedding => Role::PerLayerEmbedding,
            TensorId::PerLayerModelProjection => Role::PerLayer,
            TensorId::PerLayerProjectionNorm => Role::Norm,
            TensorId::Layer(_, t) => t.role(),
            TensorId::FinalNorm => Role::Norm,
            TensorId::LmHead => Role::LmHead,
        }
    }

    pub fn layer(self) -> Option<usize> {
        match self {
            TensorId::Layer(l, _) => Some(l),
            _ => None,
        }
    }

    pub fn shape(self, spec: &ModelSpec) -> Vec<usize> {
        match self {
            TensorId::Embedding | TensorId::LmHead => vec![spec.vocab_size, spec.hidden_size],
            TensorId::Layer(l, t) => t.shape(spec, l),
            TensorId::FinalNorm => vec![spec.hidden_size],
            TensorId::PerLayerEmbedding | TensorId::PerLayerModelProjection => {
                let (rows, p) = spec
                    .gemma4
                    .as_ref()
                    .map_or((0, 0), |g| (g.per_layer_vocab, g.per_layer_input));
                let width = spec.num_hidden_layers * p;
                match self {
                    TensorId::PerLayerEmbedding => vec![rows, width],
                    _ => vec![width, spec.hidden_size],
                }
            }
            TensorId::PerLayerProjectionNorm => {
                vec![spec.per_layer_input()]
            }
        }
    }

    pub fn slot(self, spec: &ModelSpec) -> TensorSlot {
        TensorSlot {
            name: self.hf_name(),
            shape: self.shape(spec),
            role: self.role(),
            layer: self.layer(),
        }
    }
}

/// LFM2's names for tensors every other architecture here names Llama's way: (LFM2's suffix,
/// the shared suffix), inside `model.layers.{l}.` or, for the final norm, `model.`.
const LFM2_NAMES: [(&str, &str); 9] = [
    ("operator_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("self_attn.out_proj.weight", "self_attn.o_proj.weight"),
    ("self_attn.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attn.k_layernorm.weight", "self_attn.k_norm.weight"),
    ("embedding_norm.weight", "norm.weight"),
];

/// Swap a name's suffix by `pairs` (from `.0` to `.1`), inside a block or, for the final norm,
/// at the top of `model.`.
fn swap_suffix(name: &str, pairs: impl Iterator<Item = (&'static str, &'static str)>) -> String {
    let (head, tail) = match name.strip_prefix("model.layers.") {
        Some(rest) => match rest.split_once('.') {
            Some((l, tail)) => (format!("model.layers.{l}."), tail),
            None => return name.to_string(),
        },
        None => match name.strip_prefix("model.") {
            Some(tail) => ("model.".to_string(), tail),
            None => return name.to_string(),
        },
    };
    let block = head != "model.";
    for (from, to) in pairs {
        let top_level = from == "embedding_norm.weight" || to == "embedding_norm.weight";
        if tail == from && top_level != block {
            return format!("{head}{to}");
        }
    }
    name.to_string()
}

/// The name the pipeline knows a checkpoint tensor by ([`TensorId::hf_name`]): LFM2's
/// `feed_forward.w1` is `mlp.gate_proj`, and so on; every other architecture's as stored.
pub fn canonical_name(architecture: Architecture, stored: &str) -> String {
    match architecture {
        Architecture::Lfm2 => swap_suffix(stored, LFM2_NAMES.into_iter()),
        _ => stored.to_string(),
    }
}

/// The name `architecture`'s checkpoints store a tensor under: what messages about the file
/// name (the inverse of [`canonical_name`]).
pub fn stored_name(architecture: Architecture, canonical: &str) -> String {
    match architecture {
        Architecture::Lfm2 => swap_suffix(canonical, LFM2_NAMES.into_iter().map(|(a, b)| (b, a))),
        _ => canonical.to_string(),
    }
}

/// The Hugging Face name of tensor `t` of block `layer`.
pub fn tensor_name(layer: usize, t: LayerTensor) -> String {
    TensorId::Layer(layer, t).hf_name()
}

/// Every tensor the checkpoint must hold, in model order. With tied embeddings there is no
/// `lm_head.weight` slot: the embedding serves both roles.
pub fn tensor_ids(spec: &ModelSpec) -> Vec<TensorId> {
    let mut out = Vec::with_capacity(spec.num_hidden_layers * LayerTensor::ALL.len() + 3);
    out.push(TensorId::Embedding);
    if spec.per_layer_input() > 0 {
        out.extend([
            TensorId::PerLayerEmbedding,
            TensorId::PerLayerModelProjection,
            TensorId::PerLayerProjectionNorm,
        ]);
    }
    for l in 0..spec.num_hidden_layers {
        out.extend(
            LayerTensor::ALL
                .into_iter()
                .filter(|t| t.present(spec, l))
                .map(|t| TensorId::Layer(l, t)),
        );
    }
    out.push(TensorId::FinalNorm);
    if !spec.tie_word_embeddings {
        out.push(TensorId::LmHead);
    }
    out
}

/// A stored tensor the model does not read, which transformers skips on load too
/// (`_keys_to_ignore_on_load_unexpected`): Gemma 4's KV-sharing blocks' key and value
/// projections and key norm, which Google's original releases still ship.
pub fn unread_tensor(spec: &ModelSpec, name: &str) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return false;
    };
    let Some((l, suffix)) = rest.split_once('.') else {
        return false;
    };
    let Ok(l) = l.parse::<usize>() else {
        return false;
    };
    l < spec.num_hidden_layers
        && spec.kv_producer(l).is_some()
        && [LayerTensor::K, LayerTensor::V, LayerTensor::KNorm]
            .iter()
            .any(|t| t.suffix() == suffix)
}

/// Gemma 4's per-layer table's slot (role `per_layer_embedding`), when the model has one.
pub fn per_layer_slot(spec: &ModelSpec) -> Option<TensorSlot> {
    expected_tensors(spec)
        .into_iter()
        .find(|s| s.role == Role::PerLayerEmbedding)
}

/// Every tensor the checkpoint must hold, in model order (see [`tensor_ids`]).
pub fn expected_tensors(spec: &ModelSpec) -> Vec<TensorSlot> {
    tensor_ids(spec).into_iter().map(|t| t.slot(spec)).collect()
}

/// The tensors a package stores, in model order: every one of [`expected_tensors`] but Gemma
/// 4's per-layer table, which is a file beside the package (docs/contract.md, "The per-layer
/// table").
pub fn package_tensors(spec: &ModelSpec) -> Vec<TensorSlot> {
    let mut slots = expected_tensors(spec);
    slots.retain(|s| s.role != Role::PerLayerEmbedding);
    slots
}

/// A stored tensor holding several block tensors stacked along its rows (Phi-3's `qkv_proj`
/// and `gate_up_proj`): part `i` is rows `sum(rows[..i]) .. sum(rows[..=i])`, so each part is a
/// contiguous byte range of the stored tensor and is palettized on its own, as if stored apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedTensor {
    /// The Hugging Face name of the stored tensor.
    pub name: String,
    /// The columns every part shares.
    pub cols: usize,
    /// The parts in stored order, with their row counts.
    pub parts: Vec<(TensorId, usize)>,
}

impl FusedTensor {
    /// [Σ rows, cols]: the stored tensor's shape.
    pub fn shape(&self) -> Vec<usize> {
        vec![self.parts.iter().map(|p| p.1).sum(), self.cols]
    }
}

/// The fused tensors `spec`'s checkpoints store in place of their parts (none outside Phi-3).
pub fn fused_tensors(spec: &ModelSpec) -> Vec<FusedTensor> {
    if spec.architecture != Architecture::Phi3 {
        return Vec::new();
    }
    let (h, i) = (spec.hidden_size, spec.intermediate_size);
    let mut out = Vec::with_capacity(2 * spec.num_hidden_layers);
    for l in 0..spec.num_hidden_layers {
        let id = |t| TensorId::Layer(l, t);
        out.push(FusedTensor {
            name: format!("model.layers.{l}.self_attn.qkv_proj.weight"),
            cols: h,
            parts: vec![
                (id(LayerTensor::Q), spec.q_dim()),
                (id(LayerTensor::K), spec.kv_dim()),
                (id(LayerTensor::V), spec.kv_dim()),
            ],
        });
        // transformers' Phi3MLP: `gate, up = gate_up_proj(x).chunk(2)`: gate first.
        out.push(FusedTensor {
            name: format!("model.layers.{l}.mlp.gate_up_proj.weight"),
            cols: h,
            parts: vec![(id(LayerTensor::Gate), i), (id(LayerTensor::Up), i)],
        });
    }
    out
}

/// The MIL-safe name of a checkpoint tensor: `model.layers.0.self_attn.q_proj.weight` →
/// `model_layers_0_self_attn_q_proj_weight`. Packages name weight ops this way so they map
/// back to their source.
pub fn mil_name(hf_name: &str) -> String {
    hf_name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tied: bool, bias: bool) -> ModelSpec {
        let arch = if bias {
            "Qwen2ForCausalLM"
        } else {
            "LlamaForCausalLM"
        };
        let text = format!(
            r#"{{"architectures":["{arch}"],"hidden_size":64,"intermediate_size":96,"num_attention_heads":4,
            "num_hidden_layers":2,"num_key_value_heads":2,"vocab_size":50,"tie_word_embeddings":{tied}}}"#
        );
        ModelSpec::from_config_str(&text).unwrap()
    }

    #[test]
    fn tensor_counts_follow_ties_and_biases() {
        assert_eq!(expected_tensors(&spec(true, false)).len(), 1 + 2 * 9 + 1);
        assert_eq!(expected_tensors(&spec(false, false)).len(), 1 + 2 * 9 + 2);
        assert_eq!(expected_tensors(&spec(false, true)).len(), 1 + 2 * 12 + 2);
    }

    #[test]
    fn gqa_shapes() {
        let t = expected_tensors(&spec(true, false));
        let k = t
            .iter()
            .find(|s| s.name == "model.layers.1.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k.shape, vec![32, 64]);
        assert_eq!(k.role, Role::K);
        assert_eq!(k.layer, Some(1));
    }

    #[test]
    fn hugging_face_names() {
        let names: Vec<String> = expected_tensors(&spec(false, true))
            .into_iter()
            .filter(|s| s.layer != Some(1))
            .map(|s| s.name)
            .collect();
        assert_eq!(
            names,
            [
                "model.embed_tokens.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight",
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.v_proj.bias",
                "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight",
                "model.norm.weight",
                "lm_head.weight",
            ]
        );
        let head = TensorId::head(&spec(true, false));
        assert_eq!(head.hf_name(), "model.embed_tokens.weight");
    }

    #[test]
    fn lfm2_names_swap_both_ways_and_leave_others_alone() {
        let a = Architecture::Lfm2;
        for (stored, canonical) in [
            (
                "model.layers.3.feed_forward.w1.weight",
                "model.layers.3.mlp.gate_proj.weight",
            ),
            (
                "model.layers.0.operator_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            ("model.embedding_norm.weight", "model.norm.weight"),
            (
                "model.layers.1.conv.in_proj.weight",
                "model.layers.1.conv.in_proj.weight",
            ),
            ("model.embed_tokens.weight", "model.embed_tokens.weight"),
            ("lm_head.weight", "lm_head.weight"),
        ] {
            assert_eq!(canonical_name(a, stored), canonical);
            assert_eq!(stored_name(a, canonical), stored);
        }
        // A block has no final norm, nor the model a block's norm.
        let odd = "model.layers.2.embedding_norm.weight";
        assert_eq!(canonical_name(a, odd), odd);
        assert_eq!(
            canonical_name(a, "model.ffn_norm.weight"),
            "model.ffn_norm.weight"
        );
        let llama = "model.layers.0.feed_forward.w1.weight";
        assert_eq!(canonical_name(Architecture::Llama, llama), llama);
    }

    #[test]
    fn mil_names() {
        assert_eq!(
            mil_name("model.layers.0.self_attn.q_proj.weight"),
            "model_layers_0_self_attn_q_proj_weight"
        );
    }
}
