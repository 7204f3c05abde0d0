//! What config.json's text is read into before it is checked ([`RawConfig`]), what can be
//! wrong with it ([`ConfigError`]), the limits on its sizes, and its `rope_scaling` object:
//! what the entry (`mod.rs`) and the per-architecture readers share.

use serde::Deserialize;

use crate::arch::RopeScaling;

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
    /// A field whose value the model cannot compute with; `field` is its path in config.json
    /// (`rope_scaling.short_factor[3]`), so that an importer can name its own key.
    #[error("`{field}` {message}")]
    Field { field: String, message: String },
}

impl From<String> for ConfigError {
    fn from(msg: String) -> Self {
        ConfigError::Invalid(msg)
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct RawConfig {
    pub(super) architectures: Option<Vec<String>>,
    pub(super) model_type: Option<String>,
    pub(super) num_hidden_layers: Option<usize>,
    pub(super) hidden_size: Option<usize>,
    pub(super) intermediate_size: Option<usize>,
    pub(super) num_attention_heads: Option<usize>,
    pub(super) num_key_value_heads: Option<usize>,
    pub(super) head_dim: Option<usize>,
    pub(super) vocab_size: Option<usize>,
    pub(super) rms_norm_eps: Option<f64>,
    pub(super) tie_word_embeddings: Option<bool>,
    pub(super) rope_theta: Option<f64>,
    pub(super) rope_scaling: Option<serde_json::Value>,
    pub(super) rope_parameters: Option<serde_json::Value>,
    pub(super) max_position_embeddings: Option<usize>,
    pub(super) attention_bias: Option<bool>,
    pub(super) torch_dtype: Option<String>,
    pub(super) dtype: Option<String>,
    pub(super) bos_token_id: Option<serde_json::Value>,
    pub(super) eos_token_id: Option<serde_json::Value>,
    pub(super) sliding_window: Option<serde_json::Value>,
    pub(super) use_sliding_window: Option<bool>,
    pub(super) layer_types: Option<Vec<String>>,
    pub(super) no_rope_layers: Option<Vec<serde_json::Value>>,
    pub(super) no_rope_layer_interval: Option<usize>,
    pub(super) partial_rotary_factor: Option<f64>,
    pub(super) original_max_position_embeddings: Option<usize>,
    /// Every other key: checked against [`UNHONOURED`] so that a field changing the math is
    /// refused, never ignored.
    #[serde(flatten)]
    pub(super) rest: serde_json::Map<String, serde_json::Value>,
}

// Limits on config sizes, far above any real model (Llama 3.1 405B: 126 layers, hidden 16384,
// intermediate 53248, 128 heads; Gemma: vocabulary 256000), low enough that every product the
// pipeline forms (vocab × hidden, layers × S × kv_dim, ...) stays far from u64 overflow and a
// config cannot talk us into a giant allocation before the weights are checked against it.
pub(super) const MAX_LAYERS: usize = 1 << 12;
pub(super) const MAX_HIDDEN: usize = 1 << 18;
pub(super) const MAX_INTERMEDIATE: usize = 1 << 20;
pub(super) const MAX_HEADS: usize = 1 << 12;
pub(super) const MAX_HEAD_DIM: usize = 1 << 12;
pub(super) const MAX_VOCAB: usize = 1 << 23;
pub(super) const MAX_POSITIONS: usize = 1 << 24;

pub(super) fn max_for(key: &str) -> usize {
    match key {
        "num_hidden_layers" => MAX_LAYERS,
        "hidden_size" => MAX_HIDDEN,
        "intermediate_size" => MAX_INTERMEDIATE,
        "num_attention_heads" | "num_key_value_heads" => MAX_HEADS,
        "vocab_size" => MAX_VOCAB,
        _ => usize::MAX,
    }
}

/// The rope scaling of `obj`; `None` for LongRoPE, which needs more of the config
/// (`per_arch::long_rope`).
pub(super) fn parse_rope_scaling(
    obj: Option<&serde_json::Value>,
) -> Result<Option<RopeScaling>, ConfigError> {
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
            original_max_position_embeddings: match obj
                .get("original_max_position_embeddings")
                .and_then(|v| v.as_u64())
            {
                Some(n) if n > 0 && n <= MAX_POSITIONS as u64 => n as usize,
                _ => {
                    return Err(format!(
                        "rope scaling `{kind}` needs `original_max_position_embeddings`, an \
                         integer from 1 to {MAX_POSITIONS}"
                    )
                    .into())
                }
            },
        },
        "longrope" | "su" => return Ok(None),
        other => return Err(ConfigError::UnsupportedRopeScaling(other.to_string())),
    }))
}
