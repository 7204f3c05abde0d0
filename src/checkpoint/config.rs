//! config.json → [`ModelSpec`].
//!
//! A raw serde struct mirrors what transformers writes (both the v4 keys `rope_theta`,
//! `rope_scaling`, `torch_dtype` and the v5 keys `rope_parameters`, `dtype`); it is then
//! checked and turned into a clean `ModelSpec` whose fields are always present.

use std::path::Path;

use serde::Deserialize;

use super::CheckpointError;
use crate::arch::{Architecture, GemmaSpec, ModelSpec, RopeScaling};

/// What is wrong with config.json text; the message names no file ([`CheckpointError::Config`]
/// adds the path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("not valid config JSON: {0}")]
    Json(String),
    #[error("neither `architectures` nor `model_type` is set")]
    NoArchitecture,
    #[error("unsupported architecture `{name}` (supported: {supported})")]
    UnsupportedArchitecture { name: String, supported: String },
    #[error("unsupported model_type `{name}` (supported: {supported})")]
    UnsupportedModelType { name: String, supported: String },
    #[error("unsupported `rope_scaling` type `{0}` (supported: none, linear, llama3; longrope for Phi3ForCausalLM)")]
    UnsupportedRopeScaling(String),
    #[error("missing `{0}`")]
    Missing(String),
    #[error("`{0}` must be positive")]
    NotPositive(String),
    #[error("`{key}` = {value} exceeds the limit of {max}")]
    ExceedsLimit {
        key: String,
        value: usize,
        max: usize,
    },
    /// A field that changes the model's math to something hf2coreml does not compute.
    #[error("`{key}` = {value} is not supported for {architecture} (supported: {supported})")]
    Unhonoured {
        key: String,
        value: String,
        architecture: String,
        supported: String,
    },
    /// A value out of range, or values inconsistent with each other.
    #[error("{0}")]
    Invalid(String),
}

impl From<String> for ConfigError {
    fn from(msg: String) -> Self {
        ConfigError::Invalid(msg)
    }
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    num_hidden_layers: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    sliding_window: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    layer_types: Option<Vec<String>>,
    no_rope_layers: Option<Vec<serde_json::Value>>,
    no_rope_layer_interval: Option<usize>,
    partial_rotary_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
    /// Every other key: checked against [`UNHONOURED`] so that a field changing the math is
    /// refused, never ignored.
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

/// What a config field may hold for us to compute exactly what transformers computes.
#[derive(Clone, Copy)]
enum Accept {
    /// Absent, null, or one of these strings.
    Strings(&'static [&'static str]),
    /// Absent, null or false.
    False,
    /// Absent, null or this number.
    Number(f64),
    /// Absent, null or 0 (MoE expert counts).
    Zero,
    /// Absent or null.
    Null,
}

impl Accept {
    fn allows(self, v: &serde_json::Value) -> bool {
        use serde_json::Value;
        match (self, v) {
            (_, Value::Null) => true,
            (Accept::Strings(ok), Value::String(s)) => ok.contains(&s.as_str()),
            (Accept::False, Value::Bool(b)) => !b,
            (Accept::Number(n), Value::Number(x)) => x.as_f64() == Some(n),
            (Accept::Zero, Value::Number(x)) => x.as_f64() == Some(0.0),
            _ => false,
        }
    }

    fn describe(self) -> String {
        match self {
            Accept::Strings(ok) => ok.join(", "),
            Accept::False => "false or absent".into(),
            Accept::Number(n) => format!("{n} or absent"),
            Accept::Zero => "0 or absent (dense MLP blocks only)".into(),
            Accept::Null => "absent or null".into(),
        }
    }
}

/// Config fields that change the math, with what the Llama-family graph and reference compute.
/// Any other value is refused ([`ConfigError::Unhonoured`]). Fields not listed either do not
/// change the output (dropout, `pretraining_tp`, `use_cache`, ...) or are parsed into
/// `ModelSpec` (`head_dim`, `tie_word_embeddings`, rope, `sliding_window`, `attention_bias`).
const UNHONOURED: &[(&str, Accept)] = &[
    ("hidden_act", Accept::Strings(&["silu", "swish"])),
    ("hidden_activation", Accept::Strings(&["silu", "swish"])),
    ("mlp_bias", Accept::False),
    ("attn_logit_softcapping", Accept::Null),
    ("final_logit_softcapping", Accept::Null),
    ("query_pre_attn_scalar", Accept::Null),
    ("num_experts", Accept::Zero),
    ("num_local_experts", Accept::Zero),
    ("n_routed_experts", Accept::Zero),
    ("moe_num_experts", Accept::Zero),
    ("num_experts_per_tok", Accept::Zero),
    ("rope_interleave", Accept::False),
    ("qk_layernorm", Accept::False),
    ("use_qk_norm", Accept::False),
    ("embedding_multiplier", Accept::Number(1.0)),
    ("residual_multiplier", Accept::Number(1.0)),
    ("attention_multiplier", Accept::Null),
    ("logits_scaling", Accept::Number(1.0)),
    ("sliding_window_pattern", Accept::Null),
    ("rope_local_base_freq", Accept::Null),
    ("use_bidirectional_attention", Accept::False),
];

/// Keys of [`UNHONOURED`] that Gemma 3 honours (read by [`gemma`]).
const GEMMA_KEYS: &[&str] = &[
    "hidden_act",
    "hidden_activation",
    "query_pre_attn_scalar",
    "sliding_window_pattern",
    "rope_local_base_freq",
];

/// Refuse any field in `rest` whose value changes the math away from what we compute.
fn check_unhonoured(raw: &RawConfig, architecture: Architecture) -> Result<(), ConfigError> {
    let rest = &raw.rest;
    if architecture != Architecture::SmolLM3 {
        let nope = [
            ("no_rope_layers", raw.no_rope_layers.is_some()),
            (
                "no_rope_layer_interval",
                raw.no_rope_layer_interval.is_some(),
            ),
        ];
        if let Some((key, _)) = nope.into_iter().find(|(_, set)| *set) {
            return Err(ConfigError::Unhonoured {
                key: key.into(),
                value: "(set)".into(),
                architecture: architecture.hf_name().into(),
                supported: "absent (NoPE layers: SmolLM3ForCausalLM)".into(),
            });
        }
    }
    for &(key, accept) in UNHONOURED {
        if architecture == Architecture::Gemma3 && GEMMA_KEYS.contains(&key) {
            continue;
        }
        if let Some(v) = rest.get(key) {
            if !accept.allows(v) {
                return Err(ConfigError::Unhonoured {
                    key: key.into(),
                    value: v.to_string(),
                    architecture: architecture.hf_name().into(),
                    supported: accept.describe(),
                });
            }
        }
    }
    Ok(())
}

// Limits on config sizes, far above any real model (Llama 3.1 405B: 126 layers, hidden 16384,
// intermediate 53248, 128 heads; Gemma: vocabulary 256000), low enough that every product the
// pipeline forms (vocab × hidden, layers × S × kv_dim, ...) stays far from u64 overflow and a
// config cannot talk us into a giant allocation before the weights are checked against it.
const MAX_LAYERS: usize = 1 << 12;
const MAX_HIDDEN: usize = 1 << 18;
const MAX_INTERMEDIATE: usize = 1 << 20;
const MAX_HEADS: usize = 1 << 12;
const MAX_HEAD_DIM: usize = 1 << 12;
const MAX_VOCAB: usize = 1 << 23;
const MAX_POSITIONS: usize = 1 << 24;

fn max_for(key: &str) -> usize {
    match key {
        "num_hidden_layers" => MAX_LAYERS,
        "hidden_size" => MAX_HIDDEN,
        "intermediate_size" => MAX_INTERMEDIATE,
        "num_attention_heads" | "num_key_value_heads" => MAX_HEADS,
        "vocab_size" => MAX_VOCAB,
        _ => usize::MAX,
    }
}

fn token_ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelSpec {
    /// Read and check `config.json`.
    pub fn from_config_file(path: &Path) -> Result<Self, CheckpointError> {
        let text = super::read_text_limited(path, super::MAX_CONFIG_BYTES, "config.json")?;
        Self::from_config_str(&text).map_err(|e| CheckpointError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Parse and check config.json text; the error is a message without the path.
    pub fn from_config_str(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        refuse_multimodal_gemma(&raw)?;
        let architecture = match (&raw.architectures, &raw.model_type) {
            (Some(list), _) if !list.is_empty() => {
                let name = &list[0];
                Architecture::from_hf_name(name).ok_or_else(|| {
                    ConfigError::UnsupportedArchitecture {
                        name: name.clone(),
                        supported: Architecture::ALL.map(|a| a.hf_name()).join(", "),
                    }
                })?
            }
            (_, Some(mt)) => Architecture::from_model_type(mt).ok_or_else(|| {
                ConfigError::UnsupportedModelType {
                    name: mt.clone(),
                    supported: Architecture::ALL.map(|a| a.model_type()).join(", "),
                }
            })?,
            _ => return Err(ConfigError::NoArchitecture),
        };
        let need = |v: Option<usize>, key: &str| -> Result<usize, ConfigError> {
            let max = max_for(key);
            match v {
                Some(0) => Err(ConfigError::NotPositive(key.to_string())),
                Some(x) if x > max => Err(ConfigError::ExceedsLimit {
                    key: key.to_string(),
                    value: x,
                    max,
                }),
                Some(x) => Ok(x),
                None => Err(ConfigError::Missing(key.to_string())),
            }
        };
        let num_hidden_layers = need(raw.num_hidden_layers, "num_hidden_layers")?;
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let intermediate_size = need(raw.intermediate_size, "intermediate_size")?;
        let num_attention_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = need(
            Some(raw.num_key_value_heads.unwrap_or(num_attention_heads)),
            "num_key_value_heads",
        )?;
        let vocab_size = need(raw.vocab_size, "vocab_size")?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(format!(
                "num_key_value_heads ({num_key_value_heads}) does not divide num_attention_heads ({num_attention_heads})"
            ).into());
        }
        let head_dim = head_dim(raw.head_dim, hidden_size, num_attention_heads)?;
        if head_dim % 2 != 0 {
            return Err(format!("head_dim ({head_dim}) must be even for rotary embeddings").into());
        }
        // transformers 5 nests rope settings in `rope_parameters`; v4 has top-level keys.
        let rope_params = raw.rope_parameters.as_ref().filter(|v| v.is_object());
        let rope_theta = raw
            .rope_theta
            .or_else(|| {
                rope_params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(|v| v.as_f64())
            })
            .unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(format!("rope_theta ({rope_theta}) must be a positive number").into());
        }
        let scaling_obj = raw
            .rope_scaling
            .as_ref()
            .filter(|v| v.is_object())
            .or(rope_params);
        let rope_scaling = parse_rope_scaling(scaling_obj)?;
        // Gemma 3 in transformers 5 nests one rope object per layer type.
        let (rope_theta, rope_scaling) = match gemma_global_rope(&raw, rope_params, architecture)? {
            Some((theta, scaling)) => (theta, Some(scaling)),
            None => (rope_theta, rope_scaling),
        };
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
            return Err(
                format!("rms_norm_eps ({rms_norm_eps}) must be a non-negative number").into(),
            );
        }
        let max_position_embeddings = positions(raw.max_position_embeddings)?;
        check_unhonoured(&raw, architecture)?;
        let partial_rotary_dim = partial_rotary_dim(&raw, rope_params, architecture, head_dim)?;
        let rope_scaling = long_rope(
            scaling_obj,
            rope_scaling,
            &raw,
            architecture,
            (
                partial_rotary_dim.unwrap_or(head_dim),
                max_position_embeddings,
            ),
        )?;
        let attention_bias = attention_bias(architecture, raw.attention_bias)?;
        let no_rope_layers = no_rope_layers(&raw, architecture, num_hidden_layers)?;
        let (gemma, sliding_window) = match architecture {
            Architecture::Gemma3 => {
                let g = gemma(&raw, rope_params, num_hidden_layers, hidden_size)?;
                // Gemma3TextConfig's default window is 4096.
                let w = (!g.sliding_layers.is_empty())
                    .then(|| sliding_window(&raw).map(|w| w.unwrap_or(4096)))
                    .transpose()?;
                (Some(g), w)
            }
            _ => (None, sliding_window(&raw)?),
        };
        let dtype = raw.dtype.clone().or(raw.torch_dtype.clone());
        Ok(ModelSpec {
            architecture,
            num_hidden_layers,
            hidden_size,
            intermediate_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps,
            // Gemma3TextConfig ties by default; the other configs do not.
            tie_word_embeddings: raw
                .tie_word_embeddings
                .unwrap_or(architecture == Architecture::Gemma3),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            attention_bias,
            dtype,
            bos_token_id: token_ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: token_ids(&raw.eos_token_id),
            sliding_window,
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
            no_rope_layers,
            partial_rotary_dim,
            gemma,
        })
    }
}

/// The explicit `head_dim`, or hidden / heads when they divide.
fn head_dim(
    head_dim: Option<usize>,
    hidden_size: usize,
    num_attention_heads: usize,
) -> Result<usize, ConfigError> {
    match head_dim {
        Some(0) => Err(ConfigError::NotPositive("head_dim".into())),
        Some(d) if d > MAX_HEAD_DIM => Err(ConfigError::ExceedsLimit {
            key: "head_dim".into(),
            value: d,
            max: MAX_HEAD_DIM,
        }),
        Some(d) => Ok(d),
        None if hidden_size % num_attention_heads != 0 => Err(format!(
            "num_attention_heads ({num_attention_heads}) does not divide hidden_size \
             ({hidden_size}) and no head_dim is given"
        )
        .into()),
        None => Ok(hidden_size / num_attention_heads),
    }
}

/// `max_position_embeddings`: positive, within [`MAX_POSITIONS`], 2048 when absent.
fn positions(n: Option<usize>) -> Result<usize, ConfigError> {
    match n {
        Some(0) => Err(ConfigError::NotPositive("max_position_embeddings".into())),
        Some(n) if n > MAX_POSITIONS => Err(ConfigError::ExceedsLimit {
            key: "max_position_embeddings".into(),
            value: n,
            max: MAX_POSITIONS,
        }),
        Some(n) => Ok(n),
        None => Ok(2048),
    }
}

/// The multimodal Gemma 3 config (`Gemma3ForConditionalGeneration`, model_type `gemma3`) is
/// refused, saying what is missing: its text model's fields are nested under `text_config` and
/// its tensors named `language_model.*` beside a vision tower.
fn refuse_multimodal_gemma(raw: &RawConfig) -> Result<(), ConfigError> {
    let arch = raw.architectures.as_ref().and_then(|a| a.first());
    let multimodal = arch.is_some_and(|a| a == "Gemma3ForConditionalGeneration")
        || (arch.is_none() && raw.model_type.as_deref() == Some("gemma3"));
    if multimodal {
        return Err(ConfigError::Invalid(
            "`Gemma3ForConditionalGeneration` (model_type `gemma3`) is Gemma 3 with a vision \
             tower: hf2coreml converts the text model only (Gemma3ForCausalLM, model_type \
             `gemma3_text`) and does not read a nested `text_config` nor the \
             `language_model.*` tensor names; save the text model on its own first"
                .into(),
        ));
    }
    Ok(())
}

/// Gemma 3's global RoPE from transformers 5's per-layer-type `rope_parameters`
/// (`full_attention`), if that is how the config gives it; `None` otherwise (top-level
/// `rope_theta` and `rope_scaling`, transformers 4: then Gemma's default base is 10^6).
fn gemma_global_rope(
    raw: &RawConfig,
    rope_params: Option<&serde_json::Value>,
    architecture: Architecture,
) -> Result<Option<(f64, RopeScaling)>, ConfigError> {
    if architecture != Architecture::Gemma3 {
        return Ok(None);
    }
    let Some(full) = rope_params.and_then(|p| p.get("full_attention")) else {
        let theta = raw.rope_theta.unwrap_or(1_000_000.0);
        let scaling = parse_rope_scaling(raw.rope_scaling.as_ref().filter(|v| v.is_object()))?;
        // LongRoPE (None here) is Phi-3's: refused for Gemma.
        let scaling = scaling.ok_or_else(|| gemma_unhonoured("rope_scaling", "longrope"))?;
        return Ok(Some((theta, scaling)));
    };
    let theta = positive(
        full.get("rope_theta"),
        "rope_parameters.full_attention.rope_theta",
    )?;
    let scaling = parse_rope_scaling(Some(full))?
        .ok_or_else(|| gemma_unhonoured("rope_parameters.full_attention", "longrope"))?;
    Ok(Some((theta, scaling)))
}

fn gemma_unhonoured(key: &str, value: &str) -> ConfigError {
    ConfigError::Unhonoured {
        key: key.into(),
        value: value.into(),
        architecture: Architecture::Gemma3.hf_name().into(),
        supported: "default or linear RoPE on global blocks, default on sliding blocks".into(),
    }
}

/// A positive finite number, or an error naming `key` (absent included).
fn positive(v: Option<&serde_json::Value>, key: &str) -> Result<f64, ConfigError> {
    match v.and_then(|v| v.as_f64()) {
        Some(x) if x.is_finite() && x > 0.0 => Ok(x),
        Some(x) => Err(format!("`{key}` ({x}) must be a positive number").into()),
        None => Err(ConfigError::Missing(key.into())),
    }
}

/// Gemma 3's own fields: the activation (tanh GELU only), `query_pre_attn_scalar`, the local
/// RoPE base, which blocks are windowed (`layer_types`, or transformers 4's
/// `sliding_window_pattern`: every block but each pattern-th) and the embedding scale.
fn gemma(
    raw: &RawConfig,
    rope_params: Option<&serde_json::Value>,
    layers: usize,
    hidden: usize,
) -> Result<GemmaSpec, ConfigError> {
    let rest = &raw.rest;
    for key in ["hidden_activation", "hidden_act"] {
        match rest.get(key) {
            None | Some(serde_json::Value::Null) => {}
            Some(v) if v.as_str() == Some("gelu_pytorch_tanh") => {}
            Some(v) => {
                return Err(ConfigError::Unhonoured {
                    key: key.into(),
                    value: v.to_string(),
                    architecture: Architecture::Gemma3.hf_name().into(),
                    supported: "gelu_pytorch_tanh".into(),
                })
            }
        }
    }
    let scalar = match rest.get("query_pre_attn_scalar") {
        None | Some(serde_json::Value::Null) => 256.0,
        v => positive(v, "query_pre_attn_scalar")?,
    };
    let local_rope_theta = match rope_params.and_then(|p| p.get("sliding_attention")) {
        Some(local) => {
            let kind = local.get("rope_type").and_then(|v| v.as_str());
            if !matches!(kind, None | Some("default")) {
                return Err(gemma_unhonoured(
                    "rope_parameters.sliding_attention.rope_type",
                    kind.unwrap_or_default(),
                ));
            }
            positive(
                local.get("rope_theta"),
                "rope_parameters.sliding_attention.rope_theta",
            )?
        }
        None => match rest.get("rope_local_base_freq") {
            None | Some(serde_json::Value::Null) => 10_000.0,
            v => positive(v, "rope_local_base_freq")?,
        },
    };
    let sliding_layers = match &raw.layer_types {
        Some(types) if types.len() != layers => {
            return Err(format!(
                "`layer_types` has {} entries for {layers} layers",
                types.len()
            )
            .into())
        }
        Some(types) => (0..layers)
            .filter(|&l| types[l] == "sliding_attention")
            .collect(),
        None => {
            let every = match rest.get("sliding_window_pattern") {
                None | Some(serde_json::Value::Null) => 6,
                Some(v) => match v.as_u64() {
                    Some(n) if n > 0 => n as usize,
                    _ => return Err(ConfigError::NotPositive("sliding_window_pattern".into())),
                },
            };
            (0..layers).filter(|l| (l + 1) % every != 0).collect()
        }
    };
    let root = (hidden as f64).sqrt();
    let dtype = raw.dtype.as_deref().or(raw.torch_dtype.as_deref());
    let embedding_scale = match dtype {
        Some("bfloat16") => half::bf16::from_f64(root).to_f64(),
        Some("float16") => half::f16::from_f64(root).to_f64(),
        _ => root as f32 as f64,
    };
    Ok(GemmaSpec {
        query_pre_attn_scalar: scalar,
        local_rope_theta,
        sliding_layers,
        embedding_scale,
    })
}

/// Phi-3's LongRoPE (`rope_scaling` type `longrope` or its old name `su`; other types pass
/// through): the factors (one per rotated pair), the original context (in `rope_scaling` /
/// `rope_parameters` or at the top level) and the attention factor, derived as transformers'
/// `_compute_longrope_parameters` does when not given.
fn long_rope(
    obj: Option<&serde_json::Value>,
    parsed: Option<RopeScaling>,
    raw: &RawConfig,
    architecture: Architecture,
    (rotary_dim, max_positions): (usize, usize),
) -> Result<RopeScaling, ConfigError> {
    if let Some(other) = parsed {
        return Ok(other);
    }
    let obj = obj.expect("LongRoPE is only parsed from a rope object");
    if architecture != Architecture::Phi3 {
        return Err(ConfigError::Unhonoured {
            key: "rope_scaling".into(),
            value: "longrope".into(),
            architecture: architecture.hf_name().into(),
            supported: "none, linear, llama3 (longrope: Phi3ForCausalLM)".into(),
        });
    }
    let factors = |key: &str| -> Result<Vec<f64>, ConfigError> {
        let list = obj.get(key).and_then(|v| v.as_array());
        let values: Option<Vec<f64>> = list.and_then(|a| a.iter().map(|v| v.as_f64()).collect());
        match values {
            Some(v) if v.len() == rotary_dim / 2 && v.iter().all(|f| f.is_finite() && *f > 0.0) => {
                Ok(v)
            }
            _ => Err(format!(
                "`rope_scaling.{key}` must hold {} positive numbers (one per rotated pair)",
                rotary_dim / 2
            )
            .into()),
        }
    };
    let original = obj
        .get("original_max_position_embeddings")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .or(raw.original_max_position_embeddings)
        .filter(|&n| n > 1)
        .ok_or_else(|| ConfigError::Missing("original_max_position_embeddings".into()))?;
    let number = |key: &str| obj.get(key).and_then(|v| v.as_f64());
    let factor = number("factor").unwrap_or(max_positions as f64 / original as f64);
    let attention_factor = match number("attention_factor") {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    };
    Ok(RopeScaling::LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

/// Phi-3's `partial_rotary_factor` (top level in transformers 4, in `rope_parameters` in 5):
/// RoPE rotates the first `int(head_dim × factor)` dimensions of each head, as transformers
/// rounds it. 1.0 or absent is the whole head; another value on another architecture is refused.
fn partial_rotary_dim(
    raw: &RawConfig,
    rope_params: Option<&serde_json::Value>,
    architecture: Architecture,
    head_dim: usize,
) -> Result<Option<usize>, ConfigError> {
    let nested = rope_params
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(|v| v.as_f64());
    let Some(factor) = raw.partial_rotary_factor.or(nested) else {
        return Ok(None);
    };
    if factor == 1.0 {
        return Ok(None);
    }
    if architecture != Architecture::Phi3 {
        return Err(ConfigError::Unhonoured {
            key: "partial_rotary_factor".into(),
            value: factor.to_string(),
            architecture: architecture.hf_name().into(),
            supported: "1 or absent (partial RoPE: Phi3ForCausalLM)".into(),
        });
    }
    let dim = (head_dim as f64 * factor) as usize;
    if !(factor > 0.0 && factor < 1.0) || dim == 0 || dim % 2 != 0 {
        return Err(format!(
            "`partial_rotary_factor` ({factor}) must be in (0, 1] and rotate an even, non-zero \
             number of the head's {head_dim} dimensions (it gives {dim})"
        )
        .into());
    }
    Ok(Some(dim))
}

/// SmolLM3's blocks without RoPE: `no_rope_layers` holds 1 (RoPE) or 0 (none) per block;
/// without it, every `no_rope_layer_interval`-th block (default 4) has none, as transformers
/// derives it.
fn no_rope_layers(
    raw: &RawConfig,
    architecture: Architecture,
    layers: usize,
) -> Result<Vec<usize>, ConfigError> {
    if architecture != Architecture::SmolLM3 {
        return Ok(Vec::new());
    }
    match &raw.no_rope_layers {
        Some(flags) => {
            if flags.len() != layers {
                return Err(format!(
                    "`no_rope_layers` has {} entries for {layers} layers",
                    flags.len()
                )
                .into());
            }
            let mut out = Vec::new();
            for (l, f) in flags.iter().enumerate() {
                match f.as_u64() {
                    Some(1) => {}
                    Some(0) => out.push(l),
                    _ => {
                        return Err(format!(
                            "`no_rope_layers`[{l}] = {f}: must be 1 (RoPE) or 0 (no RoPE)"
                        )
                        .into())
                    }
                }
            }
            Ok(out)
        }
        None => {
            let every = raw.no_rope_layer_interval.unwrap_or(4);
            if every == 0 {
                return Err(ConfigError::NotPositive("no_rope_layer_interval".into()));
            }
            Ok((0..layers).filter(|l| (l + 1) % every == 0).collect())
        }
    }
}

/// Qwen2 biases q/k/v (never o); Llama's `attention_bias` also biases o_proj, and Mistral's
/// attention has no biases, so `true` there is refused rather than half-honoured.
fn attention_bias(architecture: Architecture, raw: Option<bool>) -> Result<bool, ConfigError> {
    match (architecture, raw) {
        (Architecture::Qwen2, v) => Ok(v.unwrap_or(true)),
        (_, Some(true)) => Err(ConfigError::Unhonoured {
            key: "attention_bias".into(),
            value: "true".into(),
            architecture: architecture.hf_name().into(),
            supported: "false (q/k/v biases: Qwen2ForCausalLM)".into(),
        }),
        _ => Ok(false),
    }
}

/// The sliding window, when any layer uses one: `use_sliding_window: false` turns it off
/// (Qwen2), `layer_types` without a `sliding_attention` entry too (transformers 5).
fn sliding_window(raw: &RawConfig) -> Result<Option<usize>, ConfigError> {
    if let Some(types) = &raw.layer_types {
        if let Some(t) = types
            .iter()
            .find(|t| !matches!(t.as_str(), "full_attention" | "sliding_attention"))
        {
            return Err(ConfigError::Unhonoured {
                key: "layer_types".into(),
                value: format!("[.., \"{t}\", ..]"),
                architecture: "this architecture".into(),
                supported: "full_attention, sliding_attention".into(),
            });
        }
        if !types.iter().any(|t| t == "sliding_attention") {
            return Ok(None);
        }
    }
    match (&raw.sliding_window, raw.use_sliding_window) {
        (_, Some(false)) | (None, _) | (Some(serde_json::Value::Null), _) => Ok(None),
        (Some(v), _) => match v.as_u64() {
            Some(0) => Err(ConfigError::NotPositive("sliding_window".into())),
            Some(w) => Ok(Some(w as usize)),
            None => Err(format!("`sliding_window` ({v}) must be a positive integer").into()),
        },
    }
}

/// The rope scaling of `obj`; `None` for LongRoPE, which needs more of the config
/// ([`long_rope`]).
fn parse_rope_scaling(obj: Option<&serde_json::Value>) -> Result<Option<RopeScaling>, ConfigError> {
    let Some(obj) = obj else {
        return Ok(Some(RopeScaling::None));
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let num = |key: &str| -> Result<f64, ConfigError> {
        let v = obj
            .get(key)
            .and_then(|v| v.as_f64())
            .ok_or_else(|| ConfigError::from(format!("rope scaling `{kind}` needs `{key}`")))?;
        if !(v.is_finite() && v > 0.0) {
            return Err(
                format!("rope scaling `{kind}`: `{key}` ({v}) must be a positive number").into(),
            );
        }
        Ok(v)
    };
    Ok(Some(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        },
        "longrope" | "su" => return Ok(None),
        other => return Err(ConfigError::UnsupportedRopeScaling(other.to_string())),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
      "num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,"vocab_size":49152,
      "rms_norm_eps":1e-5,"rope_theta":100000.0,"rope_scaling":null,"tie_word_embeddings":true,
      "torch_dtype":"bfloat16","max_position_embeddings":8192,"bos_token_id":1,"eos_token_id":2}"#;

    #[test]
    fn transformers4_config() {
        let s = ModelSpec::from_config_str(V4).unwrap();
        assert_eq!(s.architecture, Architecture::Llama);
        assert_eq!(s.head_dim, 64);
        assert_eq!(s.gqa_groups(), 3);
        assert_eq!(s.rope_theta, 100000.0);
        assert_eq!(s.rope_scaling, RopeScaling::None);
        assert_eq!(s.dtype.as_deref(), Some("bfloat16"));
        assert_eq!(s.eos_token_ids, vec![2]);
        assert!(s.tie_word_embeddings);
    }

    #[test]
    fn transformers5_config_with_llama3_rope() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
          "num_attention_heads":4,"num_hidden_layers":2,"num_key_value_heads":2,"vocab_size":100,
          "head_dim":32,"dtype":"float16","rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,
          "factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},
          "eos_token_id":[5,6]}"#;
        let s = ModelSpec::from_config_str(text).unwrap();
        assert_eq!(s.head_dim, 32, "explicit head_dim overrides hidden/heads");
        assert_eq!(s.rope_theta, 500000.0);
        assert!(matches!(s.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert_eq!(s.dtype.as_deref(), Some("float16"));
        assert_eq!(s.eos_token_ids, vec![5, 6]);
    }

    #[test]
    fn v5_default_rope_type_is_no_scaling() {
        let text = r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
          "num_attention_heads":4,"num_hidden_layers":2,"num_key_value_heads":2,"vocab_size":100,
          "rope_parameters":{"rope_type":"default","rope_theta":1000000.0}}"#;
        let s = ModelSpec::from_config_str(text).unwrap();
        assert_eq!(s.rope_scaling, RopeScaling::None);
        assert_eq!(s.rope_theta, 1e6);
        assert!(s.attention_bias, "Qwen2 has q/k/v biases");
    }

    #[test]
    fn inconsistent_configs_are_refused() {
        let bad_kv = V4.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4");
        assert!(ModelSpec::from_config_str(&bad_kv)
            .unwrap_err()
            .to_string()
            .contains("does not divide"));
        let bad_heads = V4
            .replace("\"num_attention_heads\":9", "\"num_attention_heads\":7")
            .replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":7");
        assert!(ModelSpec::from_config_str(&bad_heads)
            .unwrap_err()
            .to_string()
            .contains("hidden_size"));
        let unknown = V4.replace("LlamaForCausalLM", "GPT2LMHeadModel");
        assert!(ModelSpec::from_config_str(&unknown)
            .unwrap_err()
            .to_string()
            .contains("GPT2LMHeadModel"));
        let rope = V4.replace(
            "\"rope_scaling\":null",
            "\"rope_scaling\":{\"type\":\"yarn\",\"factor\":4.0}",
        );
        assert!(ModelSpec::from_config_str(&rope)
            .unwrap_err()
            .to_string()
            .contains("yarn"));
    }

    #[test]
    fn qwen3_has_qk_norms_and_no_biases() {
        let v5 = r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":64,"intermediate_size":128,
          "num_attention_heads":4,"num_hidden_layers":2,"num_key_value_heads":2,"vocab_size":100,
          "head_dim":32,"attention_bias":false,"tie_word_embeddings":true,"use_sliding_window":false,
          "sliding_window":null,"max_window_layers":28,"layer_types":["full_attention","full_attention"],
          "rope_parameters":{"rope_type":"default","rope_theta":1000000.0}}"#;
        let s = ModelSpec::from_config_str(v5).unwrap();
        assert_eq!(s.architecture, Architecture::Qwen3);
        assert!(s.qk_norm && !s.attention_bias && s.no_rope_layers.is_empty());
        assert_eq!(
            (s.head_dim, s.rope_theta, s.sliding_window),
            (32, 1e6, None)
        );
        let v4 = r#"{"model_type":"qwen3","hidden_size":64,"intermediate_size":128,
          "num_attention_heads":4,"num_hidden_layers":2,"vocab_size":100,"rope_theta":1000000.0,
          "rope_scaling":null,"torch_dtype":"bfloat16"}"#;
        let s = ModelSpec::from_config_str(v4).unwrap();
        assert!(s.qk_norm && s.head_dim == 16);
        // Qwen3's attention_bias also biases o_proj: refused, not half-honoured.
        let biased = v5.replace("\"attention_bias\":false", "\"attention_bias\":true");
        let e = ModelSpec::from_config_str(&biased).unwrap_err().to_string();
        assert!(e.contains("attention_bias"), "{e}");
    }

    #[test]
    fn phi3_partial_rotary_and_longrope() {
        // transformers 4 names: top-level factor and original context, `su` for longrope.
        let v4 = r#"{"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":128,
          "num_attention_heads":4,"num_hidden_layers":2,"vocab_size":100,"partial_rotary_factor":0.75,
          "max_position_embeddings":1024,"original_max_position_embeddings":256,
          "rope_scaling":{"type":"su","short_factor":[1,1,1,1,1,2],"long_factor":[2,2,2,2,2,4]}}"#;
        let s = ModelSpec::from_config_str(v4).unwrap();
        assert_eq!((s.head_dim, s.rotary_dim()), (16, 12));
        let RopeScaling::LongRope {
            original_max_position_embeddings: n,
            attention_factor: a,
            ref long_factor,
            ..
        } = s.rope_scaling
        else {
            panic!("{:?}", s.rope_scaling)
        };
        assert_eq!((n, long_factor[5]), (256, 4.0));
        assert!((a - (1.0 + 4f64.ln() / 256f64.ln()).sqrt()).abs() < 1e-12);
        // An explicit attention factor wins; LongRoPE elsewhere is refused, naming the field.
        let given = v4.replace(
            "\"type\":\"su\"",
            "\"type\":\"su\",\"attention_factor\":1.25",
        );
        let s = ModelSpec::from_config_str(&given).unwrap();
        assert_eq!(s.rope_scaling.attention_factor(), 1.25);
        let llama = v4
            .replace("Phi3ForCausalLM", "LlamaForCausalLM")
            .replace("\"partial_rotary_factor\":0.75,", "");
        let e = ModelSpec::from_config_str(&llama).unwrap_err().to_string();
        assert!(e.contains("rope_scaling") && e.contains("Phi3"), "{e}");
    }

    #[test]
    fn smollm3_nope_layers() {
        let base = r#"{"architectures":["SmolLM3ForCausalLM"],"hidden_size":64,"intermediate_size":128,
          "num_attention_heads":4,"num_hidden_layers":8,"num_key_value_heads":2,"vocab_size":100"#;
        // transformers' own list: 1 = RoPE, 0 = none.
        let listed = format!("{base},\"no_rope_layers\":[1,1,1,0,1,0,1,0]}}");
        let s = ModelSpec::from_config_str(&listed).unwrap();
        assert_eq!(s.no_rope_layers, vec![3, 5, 7]);
        assert!(s.uses_rope(0) && !s.uses_rope(3));
        // Derived from the interval when the list is absent (every 4th block).
        let derived = format!("{base}}}");
        assert_eq!(
            ModelSpec::from_config_str(&derived).unwrap().no_rope_layers,
            vec![3, 7]
        );
        let every2 = format!("{base},\"no_rope_layer_interval\":2}}");
        assert_eq!(
            ModelSpec::from_config_str(&every2).unwrap().no_rope_layers,
            vec![1, 3, 5, 7]
        );
        for bad in [
            format!("{base},\"no_rope_layers\":[1,1,0]}}"),
            format!("{base},\"no_rope_layers\":[1,1,1,2,1,1,1,1]}}"),
        ] {
            let e = ModelSpec::from_config_str(&bad).unwrap_err().to_string();
            assert!(e.contains("no_rope_layers"), "{e}");
        }
        // Another architecture with NoPE layers is refused, naming the field.
        let llama = format!(
            "{},\"no_rope_layers\":[1,0]}}",
            V4.trim_end().trim_end_matches('}')
        );
        let e = ModelSpec::from_config_str(&llama).unwrap_err().to_string();
        assert!(e.contains("no_rope_layers") && e.contains("SmolLM3"), "{e}");
    }

    #[test]
    fn gemma3_transformers4_config() {
        // Gemma 3 4B's text config as transformers 4 writes it (shapes shrunk).
        let v4 = r#"{"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text",
          "hidden_size":2560,"intermediate_size":128,"num_attention_heads":8,"num_hidden_layers":12,
          "num_key_value_heads":4,"head_dim":256,"vocab_size":100,"query_pre_attn_scalar":256,
          "rope_theta":1000000.0,"rope_local_base_freq":10000.0,"sliding_window":1024,
          "sliding_window_pattern":6,"rope_scaling":{"factor":8.0,"rope_type":"linear"},
          "hidden_activation":"gelu_pytorch_tanh","final_logit_softcapping":null,
          "attn_logit_softcapping":null,"torch_dtype":"bfloat16"}"#;
        let s = ModelSpec::from_config_str(v4).unwrap();
        let g = s.gemma.clone().unwrap();
        assert_eq!(s.architecture, Architecture::Gemma3);
        assert!(s.tie_word_embeddings && s.qk_norm, "Gemma ties by default");
        assert_eq!(g.sliding_layers, vec![0, 1, 2, 3, 4, 6, 7, 8, 9, 10]);
        assert_eq!((s.sliding_window, g.local_rope_theta), (Some(1024), 1e4));
        assert_eq!(s.rope_theta, 1e6);
        assert_eq!(s.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(g.embedding_scale, 50.5, "√2560 = 50.596 rounded to bf16");
        assert_eq!(s.attention_scale(), 1.0 / 16.0);
        assert_eq!(s.window(5), None);
        assert_eq!(s.unbuilt_window(), None);
        // The same fields on another architecture are refused, naming them.
        let llama = v4.replace("Gemma3ForCausalLM", "LlamaForCausalLM");
        let e = ModelSpec::from_config_str(&llama).unwrap_err().to_string();
        assert!(
            e.contains("hidden_activation") || e.contains("query_pre_attn_scalar"),
            "{e}"
        );
        let multimodal = v4.replace("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration");
        let e = ModelSpec::from_config_str(&multimodal)
            .unwrap_err()
            .to_string();
        assert!(e.contains("text_config"), "{e}");
    }

    #[test]
    fn fields_that_change_the_math_are_refused() {
        let with = |extra: &str| format!("{},{extra}}}", V4.trim_end().trim_end_matches('}'));
        for (extra, key) in [
            ("\"hidden_act\":\"gelu\"", "hidden_act"),
            ("\"mlp_bias\":true", "mlp_bias"),
            ("\"attention_bias\":true", "attention_bias"),
            (
                "\"final_logit_softcapping\":30.0",
                "final_logit_softcapping",
            ),
            ("\"num_local_experts\":8", "num_local_experts"),
            ("\"partial_rotary_factor\":0.5", "partial_rotary_factor"),
            (
                "\"layer_types\":[\"full_attention\",\"chunked_attention\"]",
                "layer_types",
            ),
        ] {
            let e = ModelSpec::from_config_str(&with(extra))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains("supported"), "{extra}: {e}");
        }
        for extra in [
            "\"hidden_act\":\"silu\"",
            "\"mlp_bias\":false",
            "\"num_local_experts\":null",
            "\"partial_rotary_factor\":1.0",
        ] {
            ModelSpec::from_config_str(&with(extra)).unwrap();
        }
        let windowed = with(
            "\"sliding_window\":4096,\"layer_types\":[\"sliding_attention\",\"full_attention\"]",
        );
        assert_eq!(
            ModelSpec::from_config_str(&windowed)
                .unwrap()
                .sliding_window,
            Some(4096)
        );
        let full =
            with("\"sliding_window\":4096,\"layer_types\":[\"full_attention\",\"full_attention\"]");
        assert_eq!(
            ModelSpec::from_config_str(&full).unwrap().sliding_window,
            None
        );
    }
}
