//! config.json → [`ModelSpec`].
//!
//! A raw serde struct mirrors what transformers writes (both the v4 keys `rope_theta`,
//! `rope_scaling`, `torch_dtype` and the v5 keys `rope_parameters`, `dtype`); it is then
//! checked and turned into a clean `ModelSpec` whose fields are always present. The fields only
//! some architectures have are read in [`per_arch`].

use std::path::Path;

mod gemma4_text;
mod numerics;
mod per_arch;
mod raw_config;

use per_arch::{
    gemma, gemma_global_rope, lfm2, long_rope, no_rope_layers, partial_rotary_dim, qwen3_5,
    text_model,
};

pub use raw_config::ConfigError;
use raw_config::{max_for, parse_rope_scaling, RawConfig, MAX_HEAD_DIM, MAX_POSITIONS};

use super::CheckpointError;
use crate::arch::{Architecture, ModelSpec, RopeScaling};

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
    ("attn_output_gate", Accept::False),
];

/// Keys of [`UNHONOURED`] that Gemma 3 honours (read by [`gemma`]).
const GEMMA_KEYS: &[&str] = &[
    "hidden_act",
    "hidden_activation",
    "query_pre_attn_scalar",
    "sliding_window_pattern",
    "rope_local_base_freq",
];

/// Keys of [`UNHONOURED`] that Gemma 4 honours or, like transformers, does not read.
const GEMMA4_KEYS: &[&str] = &[
    "hidden_act",
    "hidden_activation",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "use_bidirectional_attention",
    "num_experts",
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
        // Gemma 4's, read and checked by `gemma4_text::gemma4`; it has no `query_pre_attn_scalar`
        // (transformers ignores one left in a config: its scale is 1).
        if architecture == Architecture::Gemma4 && GEMMA4_KEYS.contains(&key) {
            continue;
        }
        // Qwen3.5's gated attention, read into `attention_output_gate`.
        if architecture == Architecture::Qwen3_5 && key == "attn_output_gate" {
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

/// A special token id field: absent, null, one id or a list of ids, each a non-negative
/// integer inside the vocabulary. Anything else is refused rather than dropped or truncated:
/// a wrapped id would make another token a stop token.
fn token_ids(
    field: &str,
    v: &Option<serde_json::Value>,
    vocab_size: usize,
) -> Result<Vec<u32>, ConfigError> {
    use serde_json::Value;
    let items: Vec<(String, &Value)> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, x)| (format!("{field}[{i}]"), x))
            .collect(),
        Some(x) => vec![(field.to_string(), x)],
    };
    let mut ids = Vec::with_capacity(items.len());
    for (key, x) in items {
        let id = x.as_u64().ok_or_else(|| ConfigError::Field {
            field: key.clone(),
            message: format!("({x}) must be a token id: a non-negative integer"),
        })?;
        if id >= vocab_size as u64 {
            return Err(ConfigError::Field {
                field: key,
                message: format!("({id}) is outside the vocabulary (vocab_size {vocab_size})"),
            });
        }
        // Below vocab_size, itself within MAX_VOCAB: the id fits a u32.
        ids.push(id as u32);
    }
    Ok(ids)
}

/// RMSNorm's ε (default 1e-6): a non-negative number fp16 can hold, since it becomes a
/// constant of the package (beyond fp16's largest value it is +inf there, and every normalized
/// activation 0).
fn rms_norm_eps(eps: Option<f64>) -> Result<f64, ConfigError> {
    let eps = eps.unwrap_or(1e-6);
    if !(eps.is_finite() && eps >= 0.0) {
        let eps = numerics::short(eps);
        return Err(format!("rms_norm_eps ({eps}) must be a non-negative number").into());
    }
    if eps > f64::from(half::f16::MAX) {
        return Err(format!(
            "rms_norm_eps ({}) is beyond fp16's largest value (65504), which the package \
             computes in",
            numerics::short(eps)
        )
        .into());
    }
    Ok(eps)
}

/// BOS and EOS ids, each inside the vocabulary.
fn special_tokens(
    raw: &RawConfig,
    vocab_size: usize,
) -> Result<(Option<u32>, Vec<u32>), ConfigError> {
    let bos = token_ids("bos_token_id", &raw.bos_token_id, vocab_size)?;
    let eos = token_ids("eos_token_id", &raw.eos_token_id, vocab_size)?;
    Ok((bos.first().copied(), eos))
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
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let (value, text_of) = text_model(value)?;
        let raw: RawConfig =
            serde_json::from_value(value).map_err(|e| ConfigError::Json(e.to_string()))?;
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
        let lfm2 = match architecture {
            Architecture::Lfm2 => Some(lfm2(&raw, num_hidden_layers)?),
            _ => None,
        };
        let gated_delta = match architecture {
            Architecture::Qwen3_5 => Some(qwen3_5(&raw, num_hidden_layers)?),
            _ => None,
        };
        let intermediate_size = need(
            lfm2.as_ref()
                .map_or(raw.intermediate_size, |m| Some(m.intermediate_size)),
            "intermediate_size",
        )?;
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
        let Rope {
            params: rope_params,
            scaling_obj,
            theta: rope_theta,
            scaling: rope_scaling,
            keys: mut rope_keys,
        } = rope(&raw, architecture)?;
        let shape = (
            num_hidden_layers,
            hidden_size,
            head_dim,
            num_key_value_heads,
        );
        let (g4, rope_theta, rope_scaling) = gemma4_text::read(
            &raw,
            architecture,
            (shape, intermediate_size),
            &mut rope_keys,
            (rope_theta, rope_scaling),
        )?;
        let rms_norm_eps = rms_norm_eps(lfm2.as_ref().map_or(raw.rms_norm_eps, |m| m.norm_eps))?;
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
        let (gemma, sliding_window) = gemma_and_window(
            &raw,
            architecture,
            (rope_params, g4.as_ref()),
            num_hidden_layers,
            hidden_size,
        )?;
        let dtype = raw.dtype.clone().or(raw.torch_dtype.clone());
        let (bos_token_id, eos_token_ids) = special_tokens(&raw, vocab_size)?;
        let spec = ModelSpec {
            architecture,
            num_hidden_layers,
            hidden_size,
            intermediate_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps,
            tie_word_embeddings: tied(&raw, architecture, lfm2.as_ref()),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            attention_bias,
            dtype,
            bos_token_id,
            eos_token_ids,
            sliding_window,
            qk_norm: matches!(
                architecture,
                Architecture::Qwen3
                    | Architecture::Gemma3
                    | Architecture::Lfm2
                    | Architecture::Qwen3_5
                    | Architecture::Gemma4
            ),
            no_rope_layers,
            partial_rotary_dim,
            gemma,
            text_of,
            short_conv: lfm2.map(|m| m.conv),
            gated_delta,
            attention_output_gate: architecture == Architecture::Qwen3_5
                && attention_output_gate(&raw)?,
            gemma4: g4.map(|g| g.gemma4),
        };
        numerics::check(&spec, &rope_keys)?;
        Ok(spec)
    }
}

/// Whether the lm_head is the embedding: LFM2's rule, else `tie_word_embeddings`, whose default
/// is true in Gemma's configs and false in the others.
fn tied(raw: &RawConfig, architecture: Architecture, lfm2: Option<&per_arch::Lfm2>) -> bool {
    match lfm2 {
        Some(m) => m.tie_word_embeddings,
        None => raw.tie_word_embeddings.unwrap_or(matches!(
            architecture,
            Architecture::Gemma3 | Architecture::Gemma4
        )),
    }
}

/// Gemma's part of the spec (Gemma 3's own, or Gemma 4's Gemma 3 part) and the window of the
/// windowed blocks.
fn gemma_and_window(
    raw: &RawConfig,
    architecture: Architecture,
    (rope_params, g4): (
        Option<&serde_json::Value>,
        Option<&gemma4_text::Gemma4Config>,
    ),
    num_hidden_layers: usize,
    hidden_size: usize,
) -> Result<(Option<crate::arch::GemmaSpec>, Option<usize>), ConfigError> {
    Ok(match (architecture, g4) {
        (_, Some(g)) => (Some(g.gemma.clone()), g.sliding_window),
        (Architecture::Gemma3, None) => {
            let g = gemma(raw, rope_params, num_hidden_layers, hidden_size)?;
            // Gemma3TextConfig's default window is 4096.
            let w = (!g.sliding_layers.is_empty())
                .then(|| sliding_window(raw).map(|w| w.unwrap_or(4096)))
                .transpose()?;
            (Some(g), w)
        }
        // LFM2's and Qwen3.5's `layer_types` name their recurrent and attention blocks, none
        // windowed.
        (Architecture::Lfm2 | Architecture::Qwen3_5, None) => (None, None),
        _ => (None, sliding_window(raw)?),
    })
}

/// Qwen3.5's `attn_output_gate`: true or absent, as transformers' `Qwen3_5Attention` always
/// gates (its q_proj is twice as wide whatever the key says).
fn attention_output_gate(raw: &RawConfig) -> Result<bool, ConfigError> {
    match raw.rest.get("attn_output_gate") {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(true)) => Ok(true),
        Some(v) => Err(ConfigError::Field {
            field: "attn_output_gate".into(),
            message: format!(
                "({v}) is not what transformers computes: Qwen3.5's attention always gates \
                 its output (true or absent)"
            ),
        }),
    }
}

/// The RoPE settings of a config, and the fields they were read from.
struct Rope<'a> {
    /// transformers 5's `rope_parameters` object, if any.
    params: Option<&'a serde_json::Value>,
    /// The object the scaling is read from (`rope_scaling`, else `rope_parameters`).
    scaling_obj: Option<&'a serde_json::Value>,
    theta: f64,
    /// `None`: LongRoPE, finished by [`long_rope`].
    scaling: Option<RopeScaling>,
    keys: numerics::RopeKeys,
}

/// The base and scaling of the model's RoPE: transformers 4's top-level `rope_theta` and
/// `rope_scaling`, transformers 5's `rope_parameters` (Gemma 3: one object per layer type).
fn rope(raw: &RawConfig, architecture: Architecture) -> Result<Rope<'_>, ConfigError> {
    let params = raw.rope_parameters.as_ref().filter(|v| v.is_object());
    let nested_theta = match params.and_then(|p| p.get("rope_theta")) {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(v.as_f64().ok_or_else(|| ConfigError::Field {
            field: "rope_parameters.rope_theta".into(),
            message: format!("({v}) must be a number"),
        })?),
    };
    // Lfm2Config's `default_theta`; every other config here defaults to 10⁴.
    let default_theta = match architecture {
        Architecture::Lfm2 => 1_000_000.0,
        _ => 10_000.0,
    };
    let theta = raw.rope_theta.or(nested_theta).unwrap_or(default_theta);
    let theta_key = match (raw.rope_theta, nested_theta) {
        (None, Some(_)) => "rope_parameters.rope_theta",
        _ => "rope_theta",
    };
    if !(theta.is_finite() && theta > 0.0) {
        let theta = numerics::short(theta);
        return Err(format!("{theta_key} ({theta}) must be a positive number").into());
    }
    let top_scaling = raw.rope_scaling.as_ref().filter(|v| v.is_object());
    let scaling_obj = top_scaling.or(params);
    let scaling_key = match (top_scaling, params) {
        (None, Some(_)) => "rope_parameters",
        _ => "rope_scaling",
    };
    let scaling = parse_rope_scaling(scaling_obj)?;
    let local_theta = match params.and_then(|p| p.get("sliding_attention")) {
        Some(_) => "rope_parameters.sliding_attention.rope_theta",
        None => "rope_local_base_freq",
    };
    let mut keys = numerics::RopeKeys {
        theta: theta_key.into(),
        scaling: scaling_key.into(),
        local_theta,
    };
    // Gemma 3 in transformers 5 nests one rope object per layer type.
    let (theta, scaling) = match gemma_global_rope(raw, params, architecture)? {
        Some((theta, scaling, nested)) => {
            if nested {
                keys.theta = "rope_parameters.full_attention.rope_theta".into();
                keys.scaling = "rope_parameters.full_attention".into();
            }
            (theta, Some(scaling))
        }
        None => (theta, scaling),
    };
    Ok(Rope {
        params,
        scaling_obj,
        theta,
        scaling,
        keys,
    })
}

/// The explicit `head_dim`, or hidden / heads when they divide; even, for rotary embeddings.
fn head_dim(
    head_dim: Option<usize>,
    hidden_size: usize,
    num_attention_heads: usize,
) -> Result<usize, ConfigError> {
    let d = explicit_or_derived_head_dim(head_dim, hidden_size, num_attention_heads)?;
    if d % 2 != 0 {
        return Err(format!("head_dim ({d}) must be even for rotary embeddings").into());
    }
    Ok(d)
}

fn explicit_or_derived_head_dim(
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
        None if !hidden_size.is_multiple_of(num_attention_heads) => Err(format!(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M's config.json as transformers 4 writes it.
    pub(super) const V4: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
      "num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,"vocab_size":49152,
      "rms_norm_eps":1e-5,"rope_theta":100000.0,"rope_scaling":null,"tie_word_embeddings":true,
      "torch_dtype":"bfloat16","max_position_embeddings":8192,"bos_token_id":1,"eos_token_id":2}"#;

    #[test]
    fn special_tokens_outside_the_vocabulary_and_an_epsilon_fp16_cannot_hold_are_refused() {
        for (from, to, says) in [
            (
                r#""bos_token_id":1"#,
                r#""bos_token_id":49152"#,
                "`bos_token_id` (49152) is outside",
            ),
            (
                r#""eos_token_id":2"#,
                r#""eos_token_id":[2, 99999]"#,
                "`eos_token_id[1]` (99999) is outside",
            ),
            // Wider than 32 bits, negative, fractional or not a number: refused, never
            // wrapped to another token or dropped.
            (
                r#""eos_token_id":2"#,
                r#""eos_token_id":[2, 1099511627776]"#,
                "`eos_token_id[1]` (1099511627776) is outside",
            ),
            (
                r#""eos_token_id":2"#,
                r#""eos_token_id":[2, -1]"#,
                "`eos_token_id[1]` (-1) must be a token id",
            ),
            (
                r#""eos_token_id":2"#,
                r#""eos_token_id":2.5"#,
                "`eos_token_id` (2.5) must be a token id",
            ),
            (
                r#""bos_token_id":1"#,
                r#""bos_token_id":"1""#,
                "`bos_token_id` (\"1\") must be a token id",
            ),
            (
                r#""eos_token_id":2"#,
                r#""eos_token_id":[2, null]"#,
                "`eos_token_id[1]` (null) must be a token id",
            ),
            (
                r#""rms_norm_eps":1e-5"#,
                r#""rms_norm_eps":1e300"#,
                "rms_norm_eps",
            ),
            (
                r#""rms_norm_eps":1e-5"#,
                r#""rms_norm_eps":1e5"#,
                "beyond fp16",
            ),
        ] {
            let e = ModelSpec::from_config_str(&V4.replace(from, to)).unwrap_err();
            assert!(e.to_string().contains(says), "{to}: {e}");
        }
        assert!(ModelSpec::from_config_str(
            &V4.replace(r#""rms_norm_eps":1e-5"#, r#""rms_norm_eps":0.5"#)
        )
        .is_ok());
    }

    #[test]
    fn rope_values_that_compute_nothing_are_refused_naming_the_field_as_written() {
        let v4_rope = r#""rope_theta":100000.0,"rope_scaling":null"#;
        for (to, says) in [
            (
                r#""rope_theta":1e-300"#,
                "`rope_theta` (1e-300) must be greater than 1",
            ),
            (
                r#""rope_theta":1e39"#,
                "`rope_theta` (1e39) overflows float32",
            ),
            (
                r#""rope_scaling":{"type":"linear","factor":1e-38}"#,
                "`rope_scaling.factor` makes pair 0's RoPE frequency 1e38, whose angle",
            ),
            (
                r#""rope_scaling":{"type":"linear","factor":1e39}"#,
                "`rope_scaling.factor` (1e39) overflows float32",
            ),
            (
                r#""rope_parameters":{"rope_type":"linear","rope_theta":1e4,"factor":1e-38}"#,
                "`rope_parameters.factor` makes pair 0's",
            ),
            (
                r#""rope_parameters":{"rope_type":"default","rope_theta":1e39}"#,
                "`rope_parameters.rope_theta` (1e39) overflows",
            ),
            (
                r#""rope_parameters":{"rope_type":"default","rope_theta":"1e4"}"#,
                "`rope_parameters.rope_theta` (\"1e4\") must be a number",
            ),
            (
                r#""rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
                  "high_freq_factor":4.0,"original_max_position_embeddings":0.5}"#,
                "`original_max_position_embeddings`, an integer",
            ),
            (
                r#""rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":4.0,
                  "high_freq_factor":1.0,"original_max_position_embeddings":8192}"#,
                "`rope_scaling.high_freq_factor` (1) must be greater than low_freq_factor",
            ),
            (
                r#""rope_scaling":{"type":"dynamic","factor":1e-38}"#,
                "unsupported `rope_scaling` type `dynamic`",
            ),
        ] {
            let e = ModelSpec::from_config_str(&V4.replace(v4_rope, to))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{to}: {e}");
        }
    }

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
