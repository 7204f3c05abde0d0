//! Gemma 4's text config (`Gemma4TextConfig`, transformers 5.23; docs/reference/gemma4.md §1):
//! which blocks are windowed, the full blocks' head shape (`per_layer_config`, or the Hub's
//! `global_head_dim` and `num_global_key_value_heads`), RoPE per block kind, KV sharing, the
//! per-layer inputs and the soft-capping, each computed as transformers computes it.

use serde_json::Value;

use super::numerics::RopeKeys;
use super::raw_config::{ConfigError, RawConfig};
use crate::arch::{Architecture, Gemma4Spec, GemmaSpec, RopeScaling};

const MODEL: &str = "Gemma4ForCausalLM";

/// What [`gemma4`] reads: Gemma 3's part of the numerics, Gemma 4's own, the full blocks'
/// RoPE base (the spec's `rope_theta`) and the window.
pub(super) struct Gemma4Config {
    pub gemma: GemmaSpec,
    pub gemma4: Gemma4Spec,
    pub global_theta: f64,
    pub sliding_window: Option<usize>,
}

fn field(key: &str, message: String) -> ConfigError {
    ConfigError::Field {
        field: key.into(),
        message,
    }
}

fn unhonoured(key: &str, value: &Value, supported: &str) -> ConfigError {
    ConfigError::Unhonoured {
        key: key.into(),
        value: value.to_string(),
        architecture: MODEL.into(),
        supported: supported.into(),
    }
}

/// A non-negative integer field, `default` when absent or null.
fn count(raw: &RawConfig, key: &str, default: usize) -> Result<usize, ConfigError> {
    match raw.rest.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_u64()
            .filter(|&n| n <= u32::MAX as u64)
            .map(|n| n as usize)
            .ok_or_else(|| field(key, format!("({v}) must be a non-negative integer"))),
    }
}

/// A boolean field, false when absent or null.
fn flag(raw: &RawConfig, key: &str) -> Result<bool, ConfigError> {
    match raw.rest.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(field(key, format!("({v}) must be true or false"))),
    }
}

/// The settings that would make transformers compute something else than the dense, causal
/// text decoder: refused by name.
fn check_refusals(raw: &RawConfig) -> Result<(), ConfigError> {
    let rest = &raw.rest;
    if flag(raw, "enable_moe_block")? {
        return Err(unhonoured(
            "enable_moe_block",
            &Value::Bool(true),
            "false (the dense Gemma 4 models; the MoE variant is not converted)",
        ));
    }
    match rest.get("use_bidirectional_attention") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_str() == Some("vision") => {}
        Some(v) => {
            return Err(unhonoured(
                "use_bidirectional_attention",
                v,
                "absent, null or \"vision\" (causal over text)",
            ))
        }
    }
    for key in ["hidden_activation", "hidden_act"] {
        match rest.get(key) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_str() == Some("gelu_pytorch_tanh") => {}
            Some(v) => return Err(unhonoured(key, v, "gelu_pytorch_tanh")),
        }
    }
    if let Some(v) = rest.get("attn_logit_softcapping").filter(|v| !v.is_null()) {
        return Err(unhonoured("attn_logit_softcapping", v, "absent or null"));
    }
    Ok(())
}

/// The windowed blocks: `layer_types` (its last entry forced to full attention, as transformers
/// does), or every block but each sixth.
fn sliding_layers(raw: &RawConfig, layers: usize) -> Result<Vec<bool>, ConfigError> {
    let mut sliding: Vec<bool> = match &raw.layer_types {
        Some(types) if types.len() != layers => {
            return Err(field(
                "layer_types",
                format!("has {} entries for {layers} layers", types.len()),
            ))
        }
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(field(
                    "layer_types",
                    format!(
                        "names \"{other}\"; Gemma 4's blocks are sliding_attention or \
                         full_attention"
                    ),
                )),
            })
            .collect::<Result<_, _>>()?,
        None => (0..layers).map(|l| (l + 1) % 6 != 0).collect(),
    };
    if let Some(last) = sliding.last_mut() {
        *last = false;
    }
    Ok(sliding)
}

/// The full blocks' (head size, KV heads): `per_layer_config` when the config has it (what
/// `save_pretrained` writes), else `global_head_dim` and, with `attention_k_eq_v`,
/// `num_global_key_value_heads` (the Hub's form).
fn global_shape(
    raw: &RawConfig,
    sliding: &[bool],
    (head_dim, kv_heads): (usize, usize),
    k_eq_v: bool,
) -> Result<(usize, usize), ConfigError> {
    let Some(per_layer) = raw.rest.get("per_layer_config").filter(|v| !v.is_null()) else {
        let global_head_dim = count(raw, "global_head_dim", 512)?;
        let global_kv = match k_eq_v {
            true => count(raw, "num_global_key_value_heads", kv_heads)?,
            false => kv_heads,
        };
        return Ok((global_head_dim, global_kv));
    };
    let key = "per_layer_config";
    let Value::Object(map) = per_layer else {
        return Err(field(key, format!("({per_layer}) must be an object")));
    };
    let mut shape: Option<(usize, usize)> = None;
    for (l, overrides) in map {
        let block = l
            .parse::<usize>()
            .ok()
            .filter(|&b| b < sliding.len())
            .ok_or_else(|| field(key, format!("names block \"{l}\" of {}", sliding.len())))?;
        let Value::Object(o) = overrides else {
            return Err(field(
                key,
                format!("block {block}: ({overrides}) is no object"),
            ));
        };
        let mut here = (head_dim, kv_heads);
        for (name, v) in o {
            let n = v
                .as_u64()
                .filter(|&n| n > 0 && n <= 1 << 12)
                .map(|n| n as usize)
                .ok_or_else(|| field(key, format!("block {block}: {name} ({v}) is no size")))?;
            match name.as_str() {
                "head_dim" => here.0 = n,
                "num_key_value_heads" => here.1 = n,
                _ => {
                    return Err(field(
                        key,
                        format!(
                            "block {block} overrides `{name}`; hf2coreml reads head_dim and \
                             num_key_value_heads there"
                        ),
                    ))
                }
            }
        }
        if sliding[block] {
            return Err(field(
                key,
                format!("block {block} is a sliding block; only full blocks have their own shape"),
            ));
        }
        if shape.is_some_and(|s| s != here) {
            return Err(field(key, "the full blocks differ in shape".into()));
        }
        shape = Some(here);
    }
    // Full blocks it does not name keep the config's shape; they must agree with the others.
    let named = map.len();
    let full = sliding.iter().filter(|s| !**s).count();
    match shape {
        Some(s) if named == full || s == (head_dim, kv_heads) => Ok(s),
        Some(_) => Err(field(key, "the full blocks differ in shape".into())),
        None => Ok((head_dim, kv_heads)),
    }
}

/// A RoPE base of `rope_parameters.<kind>`, refused unless positive.
fn theta(params: &Value, kind: &str) -> Result<f64, ConfigError> {
    let key = format!("rope_parameters.{kind}.rope_theta");
    match params.get("rope_theta").and_then(Value::as_f64) {
        Some(t) if t.is_finite() && t > 0.0 => Ok(t),
        _ => Err(field(&key, "must be a positive number".into())),
    }
}

/// (sliding base, full base, pairs of each full head rotated).
fn rope(raw: &RawConfig, global_head_dim: usize) -> Result<(f64, f64, usize), ConfigError> {
    let defaults = serde_json::json!({
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0},
    });
    let params = raw
        .rope_parameters
        .as_ref()
        .filter(|v| !v.is_null())
        .unwrap_or(&defaults);
    let kind = |k: &str| {
        params
            .get(k)
            .filter(|v| v.is_object())
            .ok_or_else(|| ConfigError::Missing(format!("rope_parameters.{k}")))
    };
    let (sliding, full) = (kind("sliding_attention")?, kind("full_attention")?);
    let rope_type = |p: &Value| p.get("rope_type").and_then(Value::as_str).map(String::from);
    if !matches!(rope_type(sliding).as_deref(), None | Some("default")) {
        return Err(unhonoured(
            "rope_parameters.sliding_attention.rope_type",
            &sliding["rope_type"],
            "default",
        ));
    }
    let full_type = rope_type(full);
    // transformers' "proportional" RoPE, and "default" as its factor 1.
    let factor = match full_type.as_deref() {
        Some("proportional") => match full.get("partial_rotary_factor") {
            None | Some(Value::Null) => 1.0,
            Some(v) => v
                .as_f64()
                .filter(|f| *f > 0.0 && *f <= 1.0)
                .ok_or_else(|| {
                    field(
                        "rope_parameters.full_attention.partial_rotary_factor",
                        format!("({v}) must be in (0, 1]"),
                    )
                })?,
        },
        None | Some("default") => 1.0,
        Some(_) => {
            return Err(unhonoured(
                "rope_parameters.full_attention.rope_type",
                &full["rope_type"],
                "proportional or default",
            ))
        }
    };
    if let Some(v) = full.get("factor").filter(|v| !v.is_null()) {
        if v.as_f64() != Some(1.0) {
            return Err(unhonoured("rope_parameters.full_attention.factor", v, "1"));
        }
    }
    let pairs = ((factor * global_head_dim as f64) as usize / 2).min(global_head_dim / 2);
    Ok((
        theta(sliding, "sliding_attention")?,
        theta(full, "full_attention")?,
        pairs,
    ))
}

/// Gemma 4's part of a config (`None` for another architecture), and the model's RoPE base and
/// scaling: for Gemma 4 the full blocks' (`rope_parameters.full_attention`, its proportional
/// part in the spec's Gemma 4 part, no scaling), else `rope` as it is.
pub(super) fn read(
    raw: &RawConfig,
    architecture: Architecture,
    shape: ((usize, usize, usize, usize), usize),
    keys: &mut RopeKeys,
    rope: (f64, Option<RopeScaling>),
) -> Result<(Option<Gemma4Config>, f64, Option<RopeScaling>), ConfigError> {
    if architecture != Architecture::Gemma4 {
        return Ok((None, rope.0, rope.1));
    }
    let ((layers, hidden, head_dim, kv_heads), intermediate) = shape;
    let g = gemma4(raw, (layers, hidden, head_dim, kv_heads, intermediate))?;
    keys.theta = "rope_parameters.full_attention.rope_theta".into();
    keys.local_theta = "rope_parameters.sliding_attention.rope_theta";
    let theta = g.global_theta;
    Ok((Some(g), theta, Some(RopeScaling::None)))
}

/// √x as transformers multiplies it: in the weights' dtype.
fn in_dtype(raw: &RawConfig, x: f64) -> f64 {
    match raw.dtype.as_deref().or(raw.torch_dtype.as_deref()) {
        Some("bfloat16") => half::bf16::from_f64(x).to_f64(),
        Some("float16") => half::f16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

/// Gemma 4's own fields (see the module header). `shape` is (layers, hidden, head_dim,
/// num_key_value_heads, intermediate_size).
fn gemma4(
    raw: &RawConfig,
    (layers, hidden, head_dim, kv_heads, intermediate): (usize, usize, usize, usize, usize),
) -> Result<Gemma4Config, ConfigError> {
    check_refusals(raw)?;
    let sliding = sliding_layers(raw, layers)?;
    let k_eq_v = flag(raw, "attention_k_eq_v")?;
    let (global_head_dim, global_kv_heads) =
        global_shape(raw, &sliding, (head_dim, kv_heads), k_eq_v)?;
    if global_head_dim % 2 != 0 || head_dim % 2 != 0 {
        return Err(ConfigError::Invalid(
            "Gemma 4's head sizes must be even for rotary embeddings".into(),
        ));
    }
    let heads = raw.num_attention_heads.unwrap_or(0);
    if global_kv_heads == 0 || !heads.is_multiple_of(global_kv_heads) {
        return Err(format!(
            "the full blocks' {global_kv_heads} KV heads do not divide the {heads} query heads"
        )
        .into());
    }
    let (local_theta, global_theta, pairs) = rope(raw, global_head_dim)?;
    let shared = count(raw, "num_kv_shared_layers", 0)?;
    if shared >= layers {
        return Err(field(
            "num_kv_shared_layers",
            format!("({shared}) leaves none of the {layers} blocks to keep a cache"),
        ));
    }
    let first_shared = layers - shared;
    // transformers' `kv_sharing_modes`: every kind of block that shares has a producer.
    if shared > 0 {
        for kind in [true, false] {
            if sliding.contains(&kind) && !sliding[..first_shared].contains(&kind) {
                return Err(field(
                    "num_kv_shared_layers",
                    format!(
                        "({shared}) leaves no {} block before the shared ones to keep their \
                         cache",
                        if kind { "sliding" } else { "full" }
                    ),
                ));
            }
        }
    }
    let double = flag(raw, "use_double_wide_mlp")?;
    let per_layer_input = count(raw, "hidden_size_per_layer_input", 256)?;
    let per_layer_vocab = count(raw, "vocab_size_per_layer_input", 262_144)?;
    if per_layer_input > 0 && per_layer_vocab == 0 {
        return Err(ConfigError::NotPositive(
            "vocab_size_per_layer_input".into(),
        ));
    }
    let softcap = match raw.rest.get("final_logit_softcapping") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_f64()
                .filter(|c| c.is_finite() && *c > 0.0)
                .ok_or_else(|| {
                    field(
                        "final_logit_softcapping",
                        format!("({v}) must be a positive number"),
                    )
                })?,
        ),
    };
    let window = match raw.sliding_window.as_ref() {
        None | Some(Value::Null) => 512,
        Some(v) => v
            .as_u64()
            .filter(|&w| w > 0)
            .map(|w| w as usize)
            .ok_or_else(|| {
                field(
                    "sliding_window",
                    format!("({v}) must be a positive integer"),
                )
            })?,
    };
    let sliding_layers: Vec<usize> = (0..layers).filter(|&l| sliding[l]).collect();
    let sliding_layers_empty = sliding_layers.is_empty();
    Ok(Gemma4Config {
        gemma: GemmaSpec {
            // Gemma 4's attention scale is 1: q/k norms set the temperature.
            query_pre_attn_scalar: 1.0,
            local_rope_theta: local_theta,
            embedding_scale: in_dtype(raw, (hidden as f64).sqrt()),
            sliding_layers,
        },
        gemma4: Gemma4Spec {
            global_head_dim,
            global_kv_heads,
            k_eq_v,
            global_rotated_pairs: pairs,
            first_shared,
            shared_intermediate_size: intermediate * if double { 2 } else { 1 },
            per_layer_input,
            per_layer_vocab,
            per_layer_scale: in_dtype(raw, (per_layer_input as f64).sqrt()),
            final_logit_softcapping: softcap,
        },
        global_theta,
        sliding_window: (!sliding_layers_empty).then_some(window),
    })
}
