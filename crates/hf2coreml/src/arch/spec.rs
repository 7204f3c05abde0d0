//! What a model is: its family, shapes and numerics ([`ModelSpec`]), read from config.json by
//! `checkpoint` and from GGUF metadata by `checkpoint::gguf`.

use serde::{Deserialize, Serialize};

/// The model families we convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    #[serde(rename = "LlamaForCausalLM")]
    Llama,
    #[serde(rename = "MistralForCausalLM")]
    Mistral,
    #[serde(rename = "Qwen2ForCausalLM")]
    Qwen2,
    /// Qwen2's layout without biases, with an RMSNorm on each head's q and k before RoPE.
    #[serde(rename = "Qwen3ForCausalLM")]
    Qwen3,
    /// Llama's layout with RoPE left out of some blocks (`no_rope_layers`).
    #[serde(rename = "SmolLM3ForCausalLM")]
    SmolLM3,
    /// Phi-3 and Phi-4-mini: Llama's math with q/k/v and gate/up stored fused (`qkv_proj`,
    /// `gate_up_proj`, split at load) and RoPE on a leading part of each head
    /// (`partial_rotary_factor`).
    #[serde(rename = "Phi3ForCausalLM")]
    Phi3,
    /// Gemma 3 (text): RMSNorm times (1 + w), four norms per block, q/k norms, GeGLU (tanh
    /// GELU), embeddings times √hidden, `query_pre_attn_scalar`, sliding-window blocks with
    /// their own RoPE base interleaved with global ones ([`GemmaSpec`]).
    #[serde(rename = "Gemma3ForCausalLM")]
    Gemma3,
    /// Liquid's LFM2: short causal convolution blocks ([`ShortConvSpec`]) between attention
    /// blocks with q/k norms; Llama's norms and SwiGLU under other names.
    #[serde(rename = "Lfm2ForCausalLM")]
    Lfm2,
    /// Qwen3.5's text decoder: Gated DeltaNet blocks ([`GatedDeltaSpec`]) between gated
    /// attention blocks (q_proj also gives a sigmoid gate on each head's output), every norm
    /// x·(1 + w), partial RoPE.
    #[serde(rename = "Qwen3_5ForCausalLM")]
    Qwen3_5,
    /// Gemma 4's text decoder: Gemma 3's block with plain x·w norms, a weightless norm on the
    /// values, attention scale 1, full blocks of their own head size with proportional partial
    /// RoPE, the last blocks reading earlier blocks' caches, per-layer input embeddings and a
    /// scalar per block ([`Gemma4Spec`]).
    #[serde(rename = "Gemma4ForCausalLM")]
    Gemma4,
}

impl Architecture {
    pub const ALL: [Architecture; 10] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::SmolLM3,
        Self::Phi3,
        Self::Gemma3,
        Self::Lfm2,
        Self::Qwen3_5,
        Self::Gemma4,
    ];

    /// The name transformers uses in `architectures`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::SmolLM3 => "SmolLM3ForCausalLM",
            Self::Phi3 => "Phi3ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Lfm2 => "Lfm2ForCausalLM",
            Self::Qwen3_5 => "Qwen3_5ForCausalLM",
            Self::Gemma4 => "Gemma4ForCausalLM",
        }
    }

    /// The `model_type` transformers uses.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::SmolLM3 => "smollm3",
            Self::Phi3 => "phi3",
            Self::Gemma3 => "gemma3_text",
            Self::Lfm2 => "lfm2",
            Self::Qwen3_5 => "qwen3_5_text",
            Self::Gemma4 => "gemma4_text",
        }
    }

    pub(crate) fn from_hf_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.hf_name() == name)
    }

    pub(crate) fn from_model_type(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == name)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hf_name())
    }
}

/// Rotary embedding frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Phi-3's LongRoPE (`longrope`, `su`): frequency i divided by `short_factor[i]` while the
    /// sequence fits the original context and by `long_factor[i]` beyond it (transformers
    /// switches by the sequence length), cos and sin times `attention_factor`.
    #[serde(rename = "longrope")]
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The factor cos and sin are multiplied by (1 except with LongRoPE).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::LongRope {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }
}

/// What Gemma 3 computes beyond the shared decoder layout. Every norm (the four of a block, the
/// q/k norms and the final one) multiplies by (1 + w); blocks are input norm → attention →
/// post-attention norm → residual, pre-feed-forward norm → GeGLU (tanh GELU) → post-feed-forward
/// norm → residual; the embedding rows are multiplied by [`GemmaSpec::embedding_scale`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmaSpec {
    /// The softmax scale is `query_pre_attn_scalar`^-½ (not head_dim^-½).
    pub query_pre_attn_scalar: f64,
    /// The RoPE base of the sliding-window blocks (`rope_local_base_freq`, or
    /// `rope_parameters.sliding_attention.rope_theta`); they have no rope scaling. Global
    /// blocks use `rope_theta` and `rope_scaling`.
    pub local_rope_theta: f64,
    /// The blocks whose attention is windowed (`sliding_attention`), ascending: token i sees
    /// keys j with i - window < j <= i (`sliding_window`).
    pub sliding_layers: Vec<usize>,
    /// √hidden rounded to the float type the config declares, as transformers multiplies it
    /// in the embedding's dtype (bf16: √1152 = 33.94 → 34.0).
    pub embedding_scale: f64,
}

/// What Gemma 4 computes beyond Gemma 3's block (whose [`GemmaSpec`] it also has, with
/// `query_pre_attn_scalar` 1: its q/k norms are the only temperature). Norms multiply by w, not
/// 1 + w; the values pass a norm without weight; full-attention blocks have their own head size
/// and KV heads and rotate only the first `global_rotated_pairs` pairs (j, j + D/2) of each
/// head, with exponents over the whole D (transformers' "proportional" RoPE); the blocks from
/// `first_shared` on read the keys and values of the last earlier block of their kind; every
/// block adds a per-layer input and ends by multiplying the residual stream by its
/// `layer_scalar`; the logits are soft-capped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Spec {
    /// Full-attention blocks' head size (`global_head_dim`, or `per_layer_config`).
    pub global_head_dim: usize,
    /// Full-attention blocks' KV heads (`num_global_key_value_heads` with k_eq_v, or
    /// `per_layer_config`; else `num_key_value_heads`).
    pub global_kv_heads: usize,
    /// Full-attention blocks have no v_proj: their values are the raw key projection
    /// (`attention_k_eq_v`).
    pub k_eq_v: bool,
    /// Pairs of each full head's dimensions RoPE rotates: ⌊factor · D / 2⌋.
    pub global_rotated_pairs: usize,
    /// The first block that reads another block's cache (`num_hidden_layers −
    /// num_kv_shared_layers`; `num_hidden_layers` when none does).
    pub first_shared: usize,
    /// The MLP width of those blocks (twice `intermediate_size` with `use_double_wide_mlp`).
    pub shared_intermediate_size: usize,
    /// P: the width of each block's per-layer input (`hidden_size_per_layer_input`; 0: none).
    pub per_layer_input: usize,
    /// Rows of the per-layer embedding table (`vocab_size_per_layer_input`).
    pub per_layer_vocab: usize,
    /// √P in the table's dtype, as the per-layer embedding rows are scaled.
    pub per_layer_scale: f64,
    /// Logits become c·tanh(logits / c) (`final_logit_softcapping`).
    pub final_logit_softcapping: Option<f64>,
}

impl Gemma4Spec {
    /// The full blocks' inverse frequencies, one per pair (j, j + D/2) of a head of size D:
    /// θ^(−2j/D) for the first `global_rotated_pairs` pairs, 0 (no rotation) for the rest
    /// (transformers' "proportional" RoPE: exponents over the whole head).
    pub fn full_inv_freq(&self, theta: f64) -> Vec<f64> {
        let d = self.global_head_dim as f64;
        (0..self.global_head_dim / 2)
            .map(|j| match j < self.global_rotated_pairs {
                true => 1.0 / theta.powf(2.0 * j as f64 / d),
                false => 0.0,
            })
            .collect()
    }
}

/// LFM2's short-convolution blocks: `in_proj` to three streams B, C and x, B·x through a
/// depthwise causal convolution of `kernel` taps (no activation), C times its output, then
/// `out_proj`. Each keeps the last `kernel − 1` conv inputs as its state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShortConvSpec {
    /// The blocks that are convolutions (`layer_types` "conv"), ascending; the others attend.
    pub layers: Vec<usize>,
    /// Taps of the depthwise convolution (`conv_L_cache`).
    pub kernel: usize,
    /// `in_proj`, the convolution and `out_proj` carry biases (`conv_bias`).
    pub bias: bool,
}

/// Qwen3.5's Gated DeltaNet blocks (transformers' `Qwen3_5GatedDeltaNet`): `in_proj_qkv`
/// through a depthwise causal convolution of `kernel` taps and SiLU, split into q, k (`key_heads`
/// × `key_dim` each) and v (`value_heads` × `value_dim`); q and k L2-normalised, q times
/// key_dim^-½; per value head the state S [key_dim, value_dim] decays by exp(g),
/// g = −exp(A_log)·softplus(a + dt_bias), and learns v through the delta rule with strength
/// β = sigmoid(b); the output Sᵀq through an RMSNorm gated by silu(z), then `out_proj`. Each
/// keeps the last `kernel − 1` conv inputs and S as its state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatedDeltaSpec {
    /// The blocks that are DeltaNets (`layer_types` "linear_attention"), ascending.
    pub layers: Vec<usize>,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// Taps of the depthwise convolution (`linear_conv_kernel_dim`).
    pub kernel: usize,
}

impl GatedDeltaSpec {
    /// The convolution's channels: q, k and v side by side.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// The output's width before `out_proj`: value heads × value_dim.
    pub fn value_width(&self) -> usize {
        self.value_heads * self.value_dim
    }
}

/// Everything the pipeline needs to know about a checkpoint's shape and numerics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub architecture: Architecture,
    pub num_hidden_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// The model's trained context (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// q/k/v projections carry biases (Qwen2).
    pub attention_bias: bool,
    /// The dtype the config declares (`torch_dtype` or `dtype`), if any.
    pub dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The sliding window of windowed layers, if any (the graph refuses a package whose
    /// context outgrows it; the reference refuses longer sequences).
    pub sliding_window: Option<usize>,
    /// An RMSNorm (weight [head_dim], ε = `rms_norm_eps`) over each head's q and k, after the
    /// projections and before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Blocks whose attention applies no RoPE at all, ascending (SmolLM3's NoPE layers).
    pub no_rope_layers: Vec<usize>,
    /// How many leading dimensions of each head RoPE rotates, when fewer than `head_dim`
    /// (Phi-4-mini's `partial_rotary_factor` 0.75); the rest pass through. `None`: all.
    #[serde(default)]
    pub partial_rotary_dim: Option<usize>,
    /// Gemma 3's numerics; `None` for every other architecture.
    #[serde(default)]
    pub gemma: Option<GemmaSpec>,
    /// The multimodal class whose text decoder this is (`Gemma3ForConditionalGeneration`):
    /// its config was `text_config`, its tensors are renamed from the class's prefixes and
    /// its towers are skipped unread. `None` for a text-only checkpoint.
    #[serde(default)]
    pub text_of: Option<String>,
    /// LFM2's convolution blocks; `None` when every block attends.
    #[serde(default)]
    pub short_conv: Option<ShortConvSpec>,
    /// Qwen3.5's Gated DeltaNet blocks; `None` when there are none.
    #[serde(default)]
    pub gated_delta: Option<GatedDeltaSpec>,
    /// q_proj gives each head a query and a gate (interleaved per head: D query rows, then D
    /// gate rows); the attention output is multiplied by sigmoid(gate) before o_proj
    /// (Qwen3.5).
    #[serde(default)]
    pub attention_output_gate: bool,
    /// Gemma 4's numerics beyond Gemma 3's (`gemma` is set too); `None` for every other.
    #[serde(default)]
    pub gemma4: Option<Gemma4Spec>,
}

impl ModelSpec {
    /// Query width (heads × head_dim); may differ from hidden_size.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// q_proj's rows: the query width, twice it with an output gate.
    pub fn q_proj_rows(&self) -> usize {
        self.q_dim() * if self.attention_output_gate { 2 } else { 1 }
    }

    /// Key/value projection width (kv heads × head_dim).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The leading dimensions of each head that RoPE rotates (even, at most `head_dim`).
    pub fn rotary_dim(&self) -> usize {
        self.partial_rotary_dim.unwrap_or(self.head_dim)
    }

    /// The longest context a package computes exactly, and so the longest calibration
    /// segment: the trained context, and with LongRoPE the original one (past it transformers
    /// and the reference switch to the long factors, which a package's fixed tables cannot).
    pub fn package_context(&self) -> usize {
        match self.rope_scaling {
            RopeScaling::LongRope {
                original_max_position_embeddings: n,
                ..
            } => n.min(self.max_position_embeddings),
            _ => self.max_position_embeddings,
        }
    }

    /// What every RMSNorm adds to its weight: 1 for Gemma 3's and Qwen3.5's x·(1 + w), else 0
    /// (Qwen3.5's DeltaNet output norm is plain: see [`GatedDeltaSpec`]).
    pub fn norm_offset(&self) -> f32 {
        if self.gemma4.is_some() {
            return 0.0;
        }
        if self.gemma.is_some() || self.architecture == Architecture::Qwen3_5 {
            1.0
        } else {
            0.0
        }
    }

    /// The softmax scale of q·k: `query_pre_attn_scalar`^-½ for Gemma, else head_dim^-½.
    pub fn attention_scale(&self) -> f64 {
        match &self.gemma {
            Some(g) => 1.0 / g.query_pre_attn_scalar.sqrt(),
            None => 1.0 / (self.head_dim as f64).sqrt(),
        }
    }

    /// What the embedding rows are multiplied by (Gemma: √hidden, else 1).
    pub fn embedding_scale(&self) -> f64 {
        self.gemma.as_ref().map_or(1.0, |g| g.embedding_scale)
    }

    /// The sequence length past which the references and the graph refuse to compute because
    /// they do not build the window: `sliding_window` except for Gemma, whose banded masks
    /// are built (None: no limit).
    pub fn unbuilt_window(&self) -> Option<usize> {
        match self.gemma {
            Some(_) => None,
            None => self.sliding_window,
        }
    }

    /// P, the width of each block's per-layer input (Gemma 4); 0 when the model has none.
    pub fn per_layer_input(&self) -> usize {
        self.gemma4.as_ref().map_or(0, |g| g.per_layer_input)
    }

    /// Bytes of the per-layer table's file beside the package: rows of L·P values, one per
    /// token of the per-layer vocabulary, as fp16 (`bits` `None`) or LUT indices of `bits`
    /// after one LUT per block (docs/contract.md, "The per-layer table"); 0 when the model
    /// has none.
    pub fn per_layer_table_bytes(&self, bits: Option<u8>) -> u64 {
        self.gemma4.as_ref().map_or(0, |g| {
            let (rows, layers) = (g.per_layer_vocab as u64, self.num_hidden_layers as u64);
            let row_len = layers * g.per_layer_input as u64;
            match bits {
                None => rows * row_len * 2,
                Some(n) => rows * (row_len * n as u64).div_ceil(8) + layers * (2u64 << n),
            }
        })
    }

    /// Block `l`'s MLP width (Gemma 4's KV-sharing blocks may be twice as wide).
    pub fn intermediate(&self, l: usize) -> usize {
        match &self.gemma4 {
            Some(g) if l >= g.first_shared => g.shared_intermediate_size,
            _ => self.intermediate_size,
        }
    }

    /// Query heads per key/value head.
    pub fn gqa_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}
