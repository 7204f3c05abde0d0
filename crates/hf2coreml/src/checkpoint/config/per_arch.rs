//! The config.json fields only some architectures have: Gemma 3's own settings (and the
//! refusal of its multimodal config), Phi-3's LongRoPE and partial rotary factor, SmolLM3's
//! blocks without RoPE. The keys every architecture shares are read in [`super`].

use super::raw_config::{
    parse_rope_scaling, ConfigError, RawConfig, MAX_HEADS, MAX_HEAD_DIM, MAX_LAYERS,
};
use crate::arch::{Architecture, GatedDeltaSpec, GemmaSpec, RopeScaling, ShortConvSpec};

/// `Gemma3TextConfig`'s defaults (transformers 5.23) for the keys a multimodal config's
/// `text_config` may leave out (the Hub's Gemma 3 4B-27B configs list only what differs).
const GEMMA3_TEXT_DEFAULTS: [(&str, f64); 12] = [
    ("vocab_size", 262_208.0),
    ("hidden_size", 2304.0),
    ("intermediate_size", 9216.0),
    ("num_hidden_layers", 26.0),
    ("num_attention_heads", 8.0),
    ("num_key_value_heads", 4.0),
    ("head_dim", 256.0),
    ("rms_norm_eps", 1e-6),
    ("max_position_embeddings", 131_072.0),
    ("query_pre_attn_scalar", 256.0),
    ("sliding_window", 4096.0),
    ("rope_local_base_freq", 10_000.0),
];

/// The multimodal classes whose text decoder converts: (class, its model_type, the text
/// decoder's class and model_type).
const MULTIMODAL: [(&str, &str, &str, &str); 3] = [
    (
        "Gemma3ForConditionalGeneration",
        "gemma3",
        "Gemma3ForCausalLM",
        "gemma3_text",
    ),
    (
        "Qwen3_5ForConditionalGeneration",
        "qwen3_5",
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
    ),
    (
        "Gemma4ForConditionalGeneration",
        "gemma4",
        "Gemma4ForCausalLM",
        "gemma4_text",
    ),
];

/// The text decoder's config out of a multimodal one: for `Gemma3ForConditionalGeneration` or
/// `Qwen3_5ForConditionalGeneration` (or their model_type without `architectures`), its
/// `text_config` (Gemma 3's with `Gemma3TextConfig`'s defaults filled in), the top level's
/// `tie_word_embeddings` and dtype where the text config has none, named as the text class;
/// with the class's name, which tells the checkpoint to rename its tensors. Any other config
/// as it is.
pub(super) fn text_model(
    mut config: serde_json::Value,
) -> Result<(serde_json::Value, Option<String>), ConfigError> {
    let arch = config["architectures"].get(0).and_then(|a| a.as_str());
    let model_type = config["model_type"].as_str();
    let Some(&(class, outer_type, text_class, text_type)) = MULTIMODAL
        .iter()
        .find(|m| arch == Some(m.0) || (arch.is_none() && model_type == Some(m.1)))
    else {
        return Ok((config, None));
    };
    let Some(serde_json::Value::Object(mut text)) =
        config.get_mut("text_config").map(std::mem::take)
    else {
        return Err(ConfigError::Invalid(format!(
            "`{class}` (model_type `{outer_type}`) nests its text model's settings in \
             `text_config`, and this config has no `text_config` object"
        )));
    };
    if class == "Gemma3ForConditionalGeneration" {
        gemma3_text_defaults(&mut text);
    }
    for key in ["tie_word_embeddings", "dtype", "torch_dtype"] {
        if let (false, Some(v)) = (text.contains_key(key), config.get(key)) {
            if !v.is_null() {
                text.insert(key.into(), v.clone());
            }
        }
    }
    text.insert("architectures".into(), serde_json::json!([text_class]));
    text.insert("model_type".into(), text_type.into());
    Ok((serde_json::Value::Object(text), Some(class.to_string())))
}

/// `Gemma3TextConfig`'s defaults for what a multimodal config's `text_config` leaves out.
fn gemma3_text_defaults(text: &mut serde_json::Map<String, serde_json::Value>) {
    if !text.contains_key("rope_parameters") && !text.contains_key("rope_theta") {
        text.insert("rope_theta".into(), 1_000_000.0.into());
    }
    if !text.contains_key("layer_types") && !text.contains_key("sliding_window_pattern") {
        text.insert("sliding_window_pattern".into(), 6.into());
    }
    for (key, value) in GEMMA3_TEXT_DEFAULTS {
        if !text.contains_key(key) {
            let v = match value.fract() == 0.0 && value >= 1.0 {
                true => serde_json::Value::from(value as u64),
                false => serde_json::Value::from(value),
            };
            text.insert(key.into(), v);
        }
    }
}

/// Gemma 3's global RoPE from transformers 5's per-layer-type `rope_parameters`
/// (`full_attention`), if that is how the config gives it; `None` otherwise (top-level
/// `rope_theta` and `rope_scaling`, transformers 4: then Gemma's default base is 10^6). The
/// flag says whether they came from `rope_parameters.full_attention`.
pub(super) fn gemma_global_rope(
    raw: &RawConfig,
    rope_params: Option<&serde_json::Value>,
    architecture: Architecture,
) -> Result<Option<(f64, RopeScaling, bool)>, ConfigError> {
    if architecture != Architecture::Gemma3 {
        return Ok(None);
    }
    let Some(full) = rope_params.and_then(|p| p.get("full_attention")) else {
        let theta = raw.rope_theta.unwrap_or(1_000_000.0);
        let scaling = parse_rope_scaling(raw.rope_scaling.as_ref().filter(|v| v.is_object()))?;
        // LongRoPE (None here) is Phi-3's: refused for Gemma.
        let scaling = scaling.ok_or_else(|| gemma_unhonoured("rope_scaling", "longrope"))?;
        return Ok(Some((theta, scaling, false)));
    };
    let theta = positive(
        full.get("rope_theta"),
        "rope_parameters.full_attention.rope_theta",
    )?;
    let scaling = parse_rope_scaling(Some(full))?
        .ok_or_else(|| gemma_unhonoured("rope_parameters.full_attention", "longrope"))?;
    Ok(Some((theta, scaling, true)))
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
        Some(x) => Err(format!(
            "`{key}` ({}) must be a positive number",
            super::numerics::short(x)
        )
        .into()),
        None => Err(ConfigError::Missing(key.into())),
    }
}

/// `layer_types` of a hybrid model as one flag per block: true where it names `kinds.0`, false
/// where it names `kinds.1`; a list of another length or another kind is refused naming both.
fn layer_kinds(
    types: &[String],
    layers: usize,
    kinds: (&str, &str),
    model: &str,
) -> Result<Vec<bool>, ConfigError> {
    let field = |message: String| ConfigError::Field {
        field: "layer_types".into(),
        message,
    };
    if types.len() != layers {
        return Err(field(format!(
            "has {} entries for {layers} layers",
            types.len()
        )));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            k if k == kinds.0 => Ok(true),
            k if k == kinds.1 => Ok(false),
            other => Err(field(format!(
                "names a block kind \"{other}\" that {model} does not have ({}, {})",
                kinds.1, kinds.0
            ))),
        })
        .collect()
}

/// Largest convolution LFM2's blocks may declare (`conv_L_cache`; the released models use 3).
const MAX_CONV_KERNEL: usize = 64;

/// What LFM2 reads from config.json beside the shared keys, as transformers 5.23's
/// `Lfm2Config` and `Lfm2MLP` compute it.
pub(super) struct Lfm2 {
    pub conv: ShortConvSpec,
    /// The feed-forward width `w1`/`w3` have.
    pub intermediate_size: usize,
    pub tie_word_embeddings: bool,
    /// `norm_eps`, every RMSNorm's ε (LFM2 has no `rms_norm_eps`).
    pub norm_eps: Option<f64>,
}

/// LFM2's fields: which blocks convolve (`layer_types` "conv", or every block not in
/// `full_attn_idxs`), the convolution (`conv_L_cache` taps, `conv_bias`), the feed-forward
/// width from `intermediate_size` (alias `block_ff_dim`) by `block_auto_adjust_ff_dim`,
/// `block_ffn_dim_multiplier` and `block_multiple_of`, and the tie (alias `tie_embedding`).
pub(super) fn lfm2(raw: &RawConfig, layers: usize) -> Result<Lfm2, ConfigError> {
    use serde_json::Value;
    let rest = &raw.rest;
    let field = |key: &str, message: String| ConfigError::Field {
        field: key.into(),
        message,
    };
    let get = |key: &str| rest.get(key).filter(|v| !v.is_null());
    let uint = |key: &str| -> Result<Option<usize>, ConfigError> {
        get(key)
            .map(|v| {
                v.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| field(key, format!("({v}) must be a whole number")))
            })
            .transpose()
    };
    let boolean = |key: &str| -> Result<Option<bool>, ConfigError> {
        get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| field(key, format!("({v}) must be true or false")))
            })
            .transpose()
    };
    let attention: Vec<bool> = match (&raw.layer_types, get("full_attn_idxs")) {
        (Some(types), _) => layer_kinds(types, layers, ("full_attention", "conv"), "LFM2")?,
        (None, Some(Value::Array(idxs))) => {
            let mut attention = vec![false; layers];
            for v in idxs {
                match v.as_u64().map(|i| i as usize) {
                    Some(i) if i < layers => attention[i] = true,
                    _ => {
                        return Err(field(
                            "full_attn_idxs",
                            format!("({v}) is not a block index below {layers}"),
                        ))
                    }
                }
            }
            attention
        }
        (None, Some(v)) => {
            return Err(field(
                "full_attn_idxs",
                format!("({v}) must be a list of block indices"),
            ))
        }
        // Lfm2Config: every block attends when neither is given.
        (None, None) => vec![true; layers],
    };
    let kernel = uint("conv_L_cache")?.unwrap_or(3);
    if !(2..=MAX_CONV_KERNEL).contains(&kernel) {
        return Err(field(
            "conv_L_cache",
            format!(
                "({kernel}) must be between 2 and {MAX_CONV_KERNEL}: the taps of each block's \
                 causal convolution, whose state keeps the last conv_L_cache − 1 inputs"
            ),
        ));
    }
    let bias = boolean("conv_bias")?.unwrap_or(false);
    // transformers pops `block_ff_dim` into `intermediate_size` when both are given.
    let declared = match uint("block_ff_dim")? {
        Some(n) => Some(n),
        None => raw.intermediate_size,
    }
    .unwrap_or(12_288);
    if declared == 0 {
        return Err(ConfigError::NotPositive("intermediate_size".into()));
    }
    let mut width = declared;
    if boolean("block_auto_adjust_ff_dim")?.unwrap_or(true) {
        // Python's int(2 * n / 3): the float quotient, truncated.
        width = (2.0 * declared as f64 / 3.0) as usize;
        let multiplier = match rest.get("block_ffn_dim_multiplier") {
            None => Some(1.0),
            Some(Value::Null) => None,
            Some(v) => match v.as_f64() {
                Some(m) if m.is_finite() && m > 0.0 => Some(m),
                _ => {
                    return Err(field(
                        "block_ffn_dim_multiplier",
                        format!("({v}) must be a positive number"),
                    ))
                }
            },
        };
        if let Some(m) = multiplier {
            let multiple = uint("block_multiple_of")?.unwrap_or(256);
            if multiple == 0 {
                return Err(ConfigError::NotPositive("block_multiple_of".into()));
            }
            width = (m * width as f64) as usize;
            width = width.div_ceil(multiple).saturating_mul(multiple);
        }
        if width == 0 {
            return Err(field(
                "intermediate_size",
                format!("({declared}) leaves LFM2's adjusted feed-forward width at 0"),
            ));
        }
    }
    let tie_word_embeddings = match boolean("tie_embedding")? {
        Some(t) => t,
        None => raw.tie_word_embeddings.unwrap_or(true),
    };
    let norm_eps = get("norm_eps")
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| field("norm_eps", format!("({v}) must be a number")))
        })
        .transpose()?
        .or(Some(1e-5));
    Ok(Lfm2 {
        conv: ShortConvSpec {
            layers: (0..layers).filter(|&l| !attention[l]).collect(),
            kernel,
            bias,
        },
        intermediate_size: width,
        tie_word_embeddings,
        norm_eps,
    })
}

/// Qwen3.5's Gated DeltaNet blocks as transformers 5.23's `Qwen3_5TextConfig` reads them:
/// `layer_types` ("linear_attention" / "full_attention"; absent, every
/// `full_attention_interval`-th block attends, default 4), the `linear_*` head counts and sizes
/// (defaults 16 key heads, 32 value heads of 128 each, kernel 4).
pub(super) fn qwen3_5(raw: &RawConfig, layers: usize) -> Result<GatedDeltaSpec, ConfigError> {
    let rest = &raw.rest;
    let field = |key: &str, message: String| ConfigError::Field {
        field: key.into(),
        message,
    };
    let uint = |key: &str, default: usize, max: usize| -> Result<usize, ConfigError> {
        let n = match rest.get(key).filter(|v| !v.is_null()) {
            None => default,
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| field(key, format!("({v}) must be a whole number")))?,
        };
        if n == 0 {
            return Err(ConfigError::NotPositive(key.into()));
        }
        if n > max {
            return Err(ConfigError::ExceedsLimit {
                key: key.into(),
                value: n,
                max,
            });
        }
        Ok(n)
    };
    let linear: Vec<bool> = match &raw.layer_types {
        Some(types) => layer_kinds(
            types,
            layers,
            ("linear_attention", "full_attention"),
            "Qwen3.5",
        )?,
        None => {
            let every = uint("full_attention_interval", 4, MAX_LAYERS)?;
            (0..layers).map(|l| (l + 1) % every != 0).collect()
        }
    };
    let heads = MAX_HEADS;
    let size = MAX_HEAD_DIM;
    let spec = GatedDeltaSpec {
        layers: (0..layers).filter(|&l| linear[l]).collect(),
        key_heads: uint("linear_num_key_heads", 16, heads)?,
        value_heads: uint("linear_num_value_heads", 32, heads)?,
        key_dim: uint("linear_key_head_dim", 128, size)?,
        value_dim: uint("linear_value_head_dim", 128, size)?,
        kernel: uint("linear_conv_kernel_dim", 4, MAX_CONV_KERNEL)?,
    };
    if spec.kernel < 2 {
        return Err(field(
            "linear_conv_kernel_dim",
            "(1) must be at least 2: the state keeps the last kernel − 1 conv inputs".into(),
        ));
    }
    if !spec.value_heads.is_multiple_of(spec.key_heads) {
        return Err(field(
            "linear_num_value_heads",
            format!(
                "({}) must be a multiple of linear_num_key_heads ({}): each key head serves \
                 a group of value heads",
                spec.value_heads, spec.key_heads
            ),
        ));
    }
    Ok(spec)
}

/// Gemma 3's own fields: the activation (tanh GELU only), `query_pre_attn_scalar`, the local
/// RoPE base, which blocks are windowed (`layer_types`, or transformers 4's
/// `sliding_window_pattern`: every block but each pattern-th) and the embedding scale.
pub(super) fn gemma(
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
pub(super) fn long_rope(
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
        Some(a) if a.is_finite() && a > 0.0 && a <= f64::from(half::f16::MAX) => a,
        Some(a) => {
            return Err(format!(
                "`rope_scaling.attention_factor` ({a}) must be a positive number fp16 can hold \
                 (it multiplies cos and sin)"
            )
            .into())
        }
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
pub(super) fn partial_rotary_dim(
    raw: &RawConfig,
    rope_params: Option<&serde_json::Value>,
    architecture: Architecture,
    head_dim: usize,
) -> Result<Option<usize>, ConfigError> {
    let nested = rope_params
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(|v| v.as_f64());
    // Qwen3_5TextConfig rotates a quarter of each head when the config names no factor.
    let default = (architecture == Architecture::Qwen3_5).then_some(0.25);
    let Some(factor) = raw.partial_rotary_factor.or(nested).or(default) else {
        return Ok(None);
    };
    if factor == 1.0 {
        return Ok(None);
    }
    if !matches!(architecture, Architecture::Phi3 | Architecture::Qwen3_5) {
        return Err(ConfigError::Unhonoured {
            key: "partial_rotary_factor".into(),
            value: factor.to_string(),
            architecture: architecture.hf_name().into(),
            supported: "1 or absent (partial RoPE: Phi3ForCausalLM, Qwen3_5ForCausalLM)".into(),
        });
    }
    let dim = (head_dim as f64 * factor) as usize;
    if !(factor > 0.0 && factor < 1.0) || dim == 0 || !dim.is_multiple_of(2) {
        return Err(format!(
            "`partial_rotary_factor` ({}) must be in (0, 1] and rotate an even, non-zero \
             number of the head's {head_dim} dimensions (it gives {dim})",
            super::numerics::short(factor)
        )
        .into());
    }
    Ok(Some(dim))
}

/// SmolLM3's blocks without RoPE: `no_rope_layers` holds 1 (RoPE) or 0 (none) per block;
/// without it, every `no_rope_layer_interval`-th block (default 4) has none, as transformers
/// derives it.
pub(super) fn no_rope_layers(
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

#[cfg(test)]
mod tests {
    use crate::arch::{Architecture, ModelSpec, RopeScaling};

    use super::super::tests::V4;

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
        // It multiplies cos and sin in the package: a value fp16 cannot hold is refused.
        for bad in ["0", "-1", "1e300", "70000"] {
            let c = v4.replace(
                "\"type\":\"su\"",
                &format!("\"type\":\"su\",\"attention_factor\":{bad}"),
            );
            let e = ModelSpec::from_config_str(&c).unwrap_err().to_string();
            assert!(e.contains("attention_factor"), "{bad}: {e}");
        }
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
        let rope = |l: usize| s.layer(l).attention().unwrap().rope;
        assert_eq!(
            (rope(0), rope(3)),
            (crate::arch::Rope::Global, crate::arch::Rope::None)
        );
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
        let (sliding, global) = (s.layer(4), s.layer(5));
        assert_eq!(global.attention().unwrap().window, None);
        assert_eq!(global.attention().unwrap().rope, crate::arch::Rope::Global);
        assert_eq!(sliding.attention().unwrap().window, Some(1024));
        assert_eq!(sliding.attention().unwrap().rope, crate::arch::Rope::Local);
        assert_eq!(s.unbuilt_window(), None);
        // The same fields on another architecture are refused, naming them.
        let llama = v4.replace("Gemma3ForCausalLM", "LlamaForCausalLM");
        let e = ModelSpec::from_config_str(&llama).unwrap_err().to_string();
        assert!(
            e.contains("hidden_activation") || e.contains("query_pre_attn_scalar"),
            "{e}"
        );
        // Values that compute nothing, named as the config spells them.
        for (from, to, says) in [
            (
                "\"query_pre_attn_scalar\":256",
                "\"query_pre_attn_scalar\":1e-30",
                "`query_pre_attn_scalar` (1e-30) gives the attention scale 1e15",
            ),
            (
                "\"query_pre_attn_scalar\":256",
                "\"query_pre_attn_scalar\":1e30",
                "`query_pre_attn_scalar` (1e30)",
            ),
            (
                "\"rope_local_base_freq\":10000.0",
                "\"rope_local_base_freq\":1e-300",
                "`rope_local_base_freq` (1e-300) must be greater than 1",
            ),
            (
                "\"factor\":8.0",
                "\"factor\":1e-38",
                "`rope_scaling.factor` makes pair 0's",
            ),
            (
                "\"rope_theta\":1000000.0,",
                "\"rope_parameters\":{\"full_attention\":{\"rope_type\":\"linear\",\
                 \"rope_theta\":1e6,\"factor\":1e-38},\"sliding_attention\":\
                 {\"rope_type\":\"default\",\"rope_theta\":1e39}},",
                "`rope_parameters.full_attention.factor` makes pair 0's",
            ),
        ] {
            let c = v4.replace(from, to);
            let c = match to.contains("full_attention") {
                // transformers 5's nested form replaces the top-level scaling.
                true => c.replace(
                    "\"rope_scaling\":{\"factor\":8.0,\"rope_type\":\"linear\"},",
                    "",
                ),
                false => c,
            };
            let e = ModelSpec::from_config_str(&c).unwrap_err().to_string();
            assert!(e.contains(says), "{to}: {e}");
        }
        let multimodal = v4.replace("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration");
        let e = ModelSpec::from_config_str(&multimodal)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no `text_config` object"), "{e}");
        // The same settings nested, as the multimodal class writes them: the same text model.
        let text: serde_json::Value = serde_json::from_str(v4).unwrap();
        let nested = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": text,
            "vision_config": {"hidden_size": 32},
        });
        let m = ModelSpec::from_config_str(&nested.to_string()).unwrap();
        assert_eq!(m.text_of.as_deref(), Some("Gemma3ForConditionalGeneration"));
        // Gemma3TextConfig's own context, where a text-only config without the key gets 2048.
        assert_eq!(m.max_position_embeddings, 131_072);
        let m = ModelSpec {
            text_of: None,
            short_conv: None,
            gated_delta: None,
            attention_output_gate: false,
            max_position_embeddings: s.max_position_embeddings,
            ..m
        };
        assert_eq!(m, s);
    }
}
