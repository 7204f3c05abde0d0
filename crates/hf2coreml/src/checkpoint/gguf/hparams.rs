//! The hyperparameters of a GGUF ([`GgufHParams`]), read from its metadata and checked against
//! each other and its tensors, and the config.json they describe.

use serde::Serialize;

use super::gguf_error::{GgufError, SUPPORTED_ARCHITECTURES};
use super::hybrid::{self, Hybrid};
use super::metadata_keys::{meta_err, optional_dim, required_dim, rotary_factor, SpecialIds};
use super::reader::GgufFile;
use super::tensor_map::{self, TensorPlan};
use crate::arch::Architecture;

/// The transformers version whose config keys we write (v4: `rope_theta`, `torch_dtype`).
pub(super) const TRANSFORMERS_VERSION: &str = "4.46.0";

/// The hyperparameters of a GGUF (`llama`, `qwen2`, `qwen3`, `gemma3`, `phi3`, `smollm3`, and
/// the hybrids `lfm2` and `qwen35`), checked for consistency.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GgufHParams {
    /// `general.architecture`: one of [`SUPPORTED_ARCHITECTURES`].
    pub arch: String,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    /// Linear rope scaling factor, when the file declares one (Gemma 3: its global blocks').
    pub rope_linear_factor: Option<f64>,
    pub tied: bool,
    /// The attention window: Gemma 3's sliding blocks' (`gemma3.attention.sliding_window`),
    /// Phi-3's every block's (`phi3.attention.sliding_window`, 0 for none).
    pub sliding_window: Option<usize>,
    /// Phi-3's rotated dimensions of each head when fewer than head_dim
    /// (`phi3.rope.dimension_count`: Phi-4-mini's partial rotary factor).
    pub rotary_dim: Option<usize>,
    /// Phi-3's LongRoPE, when the file holds `rope_factors_long` and `rope_factors_short`.
    pub long_rope: Option<LongRope>,
    /// LFM2's convolution blocks or Qwen3.5's DeltaNet blocks (`layers` is then the decoder's
    /// blocks, without Qwen3.5's MTP blocks; `intermediate` LFM2's adjusted width).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<Hybrid>,
}

/// Phi-3's LongRoPE as llama.cpp's converter stores it: the per-pair factors as two f32
/// tensors (`rope_factors_long.weight`, `rope_factors_short.weight`, rotary_dim / 2 each),
/// the original context (`phi3.rope.scaling.original_context_length`) and the factor on cos
/// and sin (`phi3.rope.scaling.attn_factor`, computed by the converter as transformers does).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LongRope {
    pub original_context: usize,
    pub attention_factor: Option<f64>,
    /// (long, short) factors: read with the tensors by [`import`]; a header-only read leaves
    /// them `None` and its spec carries factors of 1 (it is used for sizes only).
    #[serde(skip)]
    pub factors: Option<(Vec<f32>, Vec<f32>)>,
}

/// The tensors of Phi-3's LongRoPE factors.
pub const ROPE_FACTORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

/// SmolLM3's blocks without RoPE: every fourth, fixed by llama.cpp for the architecture
/// (`n_no_rope_layer_step`; its files carry no key), as transformers' default interval.
const SMOLLM3_NO_ROPE_INTERVAL: usize = 4;

/// Gemma 3's sliding-window pattern, local RoPE base and attention scale: not in its GGUF files,
/// fixed by the architecture in llama.cpp (`llama-model.cpp`), and transformers' defaults.
const GEMMA3_SLIDING_PATTERN: usize = 6;
const GEMMA3_LOCAL_ROPE_THETA: f64 = 10_000.0;
/// Gemma 3 27B (62 blocks) scales attention by (hidden / heads)^-½, the others by head_dim^-½.
const GEMMA3_27B_LAYERS: usize = 62;

impl GgufHParams {
    /// q/k/v projections carry biases (qwen2).
    pub fn attention_bias(&self) -> bool {
        self.arch == "qwen2"
    }

    /// llama.cpp's converter permuted q/k rows for rope (`LlamaModel.permute`); its Qwen2
    /// and Qwen3 converters write them as transformers has them.
    pub fn permuted_qk(&self) -> bool {
        matches!(self.arch.as_str(), "llama" | "smollm3")
    }

    /// Phi-3: q/k/v stored as one `attn_qkv` and gate/up as one `ffn_up` (gate first), as
    /// transformers stores them (`qkv_proj`, `gate_up_proj`).
    pub fn fused(&self) -> bool {
        self.arch == "phi3"
    }

    /// Per-head RMSNorms on q and k (`attn_q_norm`, `attn_k_norm`: qwen3, gemma3).
    pub fn qk_norm(&self) -> bool {
        matches!(self.arch.as_str(), "qwen3" | "gemma3")
    }

    /// Gemma 3: four norms a block, each stored as 1 + w (transformers' and llama.cpp's
    /// Gemma RMSNorm multiplies by 1 + w, and the converter adds the 1).
    pub fn gemma(&self) -> bool {
        self.arch == "gemma3"
    }

    pub fn architecture(&self) -> Architecture {
        match self.arch.as_str() {
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "gemma3" => Architecture::Gemma3,
            "phi3" => Architecture::Phi3,
            "smollm3" => Architecture::SmolLM3,
            "lfm2" => Architecture::Lfm2,
            "qwen35" => Architecture::Qwen3_5,
            _ => Architecture::Llama,
        }
    }

    /// Gemma 3's `query_pre_attn_scalar`, as llama.cpp fixes it by model size.
    fn query_pre_attn_scalar(&self) -> usize {
        match self.layers == GEMMA3_27B_LAYERS {
            true => self.hidden / self.heads,
            false => self.head_dim,
        }
    }
}

/// `general.architecture`, checked to be one we import.
pub fn architecture(g: &GgufFile) -> Result<String, GgufError> {
    let arch = g
        .get_str("general.architecture")?
        .ok_or_else(|| meta_err(g, "general.architecture", "missing".into()))?;
    if arch == "clip" {
        return Err(GgufError::Projector {
            path: g.path().to_path_buf(),
        });
    }
    if !SUPPORTED_ARCHITECTURES.contains(&arch) {
        return Err(GgufError::UnsupportedArchitecture {
            path: g.path().to_path_buf(),
            arch: arch.to_string(),
        });
    }
    Ok(arch.to_string())
}

/// The block and attention dimensions of a llama GGUF, checked against each other.
struct Dims {
    layers: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: Option<usize>,
}

impl Dims {
    fn from_gguf(g: &GgufFile, arch: &str) -> Result<Self, GgufError> {
        let key = |k: &str| format!("{arch}.{k}");
        let layers = required_dim(g, &key("block_count"))?;
        let hidden = required_dim(g, &key("embedding_length"))?;
        let intermediate = required_dim(g, &key("feed_forward_length"))?;
        let heads = required_dim(g, &key("attention.head_count"))?;
        let kv_key = key("attention.head_count_kv");
        let kv_heads = match arch {
            // One entry per block, 0 for a convolution.
            "lfm2" => hybrid::lfm2_kv_heads(g, &kv_key, layers, heads)?.0,
            _ => optional_dim(g, &kv_key)?.unwrap_or(heads),
        };
        if heads % kv_heads != 0 {
            return Err(meta_err(
                g,
                &key("attention.head_count_kv"),
                format!("{kv_heads} does not divide the {heads} query heads"),
            ));
        }
        let head_dim = match optional_dim(g, &key("attention.key_length"))? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(meta_err(
                    g,
                    &key("attention.head_count"),
                    format!("{heads} heads do not divide embedding_length {hidden}"),
                ))
            }
        };
        if let Some(v) = optional_dim(g, &key("attention.value_length"))? {
            if v != head_dim {
                return Err(meta_err(
                    g,
                    &key("attention.value_length"),
                    format!("{v} differs from the key length {head_dim}; transformers' llama needs them equal"),
                ));
            }
        }
        // Each block has nine tensors (six fused ones in Phi-3, eight in an LFM2 convolution
        // block, eleven in a Qwen3.5 attention block): a corrupt count must not drive a huge
        // allocation.
        let per_block = match arch {
            "phi3" => 6,
            "lfm2" => 8,
            "qwen35" => 11,
            _ => 9,
        };
        let n_tensors = g.tensors().len();
        if layers > n_tensors / per_block {
            return Err(meta_err(
                g,
                &key("block_count"),
                format!(
                    "{layers} blocks need at least {} tensors; the file has {n_tensors}",
                    layers.saturating_mul(per_block)
                ),
            ));
        }
        if heads.checked_mul(head_dim).is_none() {
            return Err(meta_err(
                g,
                &key("attention.head_count"),
                format!("{heads} heads of {head_dim} overflow"),
            ));
        }
        if head_dim % 2 != 0 {
            return Err(meta_err(
                g,
                &key("attention.key_length"),
                format!("head dimension {head_dim} must be even for rotary embeddings"),
            ));
        }
        let mut rotary_dim = None;
        if let Some(rot) = optional_dim(g, &key("rope.dimension_count"))? {
            // Phi-4-mini rotates the leading 3/4 of each head, Qwen3.5 a quarter; nothing else
            // may rotate fewer.
            if matches!(arch, "phi3" | "qwen35") && rot < head_dim && rot % 2 == 0 {
                rotary_dim = Some(rot);
            } else if rot != head_dim {
                return Err(meta_err(
                    g,
                    &key("rope.dimension_count"),
                    format!(
                        "{rot} rotated of {head_dim} dims: partial rotary embeddings are \
                         supported for phi3 and qwen35 only, an even number below head_dim"
                    ),
                ));
            }
        }
        Ok(Dims {
            layers,
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim,
            rotary_dim,
        })
    }
}

/// Rope base, RMSNorm epsilon and the linear rope scaling factor (if any), checked.
fn rope_and_norm(g: &GgufFile, arch: &str) -> Result<(f64, f64, Option<f64>), GgufError> {
    let key = |k: &str| format!("{arch}.{k}");
    let rope_theta = positive(g, &key("rope.freq_base"), Some(10_000.0), "missing")?;
    let rms_norm_eps = positive(g, &key("attention.layer_norm_rms_epsilon"), None, "missing")?;
    let rope_linear_factor = match g.get_str(&key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => {
            let f = positive(
                g,
                &key("rope.scaling.factor"),
                None,
                "missing for linear scaling",
            )?;
            // llama.cpp writes factor 1 for "no scaling" in some converters.
            (f != 1.0).then_some(f)
        }
        Some(other) => {
            return Err(meta_err(
                g,
                &key("rope.scaling.type"),
                format!("rope scaling `{other}` is not supported (supported: none, linear)"),
            ))
        }
    };
    Ok((rope_theta, rms_norm_eps, rope_linear_factor))
}

/// The finite positive float `key`, `default` when absent (without one, an error saying
/// `missing`).
fn positive(
    g: &GgufFile,
    key: &str,
    default: Option<f64>,
    missing: &str,
) -> Result<f64, GgufError> {
    let v = match (g.get_float(key)?, default) {
        (Some(v), _) | (None, Some(v)) => v,
        (None, None) => return Err(meta_err(g, key, missing.into())),
    };
    if !(v.is_finite() && v > 0.0) {
        return Err(meta_err(g, key, format!("{v} must be positive")));
    }
    Ok(v)
}

/// Phi-3's LongRoPE, when the file holds its factor tensors (both, rotary_dim / 2 each) and
/// the original context they switch at.
fn long_rope(g: &GgufFile, rotary_dim: usize) -> Result<Option<LongRope>, GgufError> {
    let [long, short] = ROPE_FACTORS.map(|n| g.tensor(n));
    let (long, short) = match (long, short) {
        (None, None) => return Ok(None),
        (Some(l), Some(s)) => (l, s),
        (l, _) => {
            let missing = ROPE_FACTORS[usize::from(l.is_some())];
            return Err(GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: missing.to_string(),
                message: "missing: LongRoPE needs both factor tensors".into(),
            });
        }
    };
    for t in [long, short] {
        if t.shape != [rotary_dim / 2] {
            return Err(GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: t.name.clone(),
                message: format!(
                    "shape {:?}, expected [{}] (one factor per rotated pair)",
                    t.shape,
                    rotary_dim / 2
                ),
            });
        }
    }
    let key = "phi3.rope.scaling.original_context_length";
    let original_context = required_dim(g, key)?;
    let attention_factor = g.get_float("phi3.rope.scaling.attn_factor")?;
    if let Some(a) = attention_factor {
        if !(a.is_finite() && a > 0.0) {
            return Err(meta_err(
                g,
                "phi3.rope.scaling.attn_factor",
                format!("{a} must be positive"),
            ));
        }
    }
    Ok(Some(LongRope {
        original_context,
        attention_factor,
        factors: None,
    }))
}

/// The vocabulary size: token_embd.weight's rows, agreeing with `llama.vocab_size` if given.
fn vocab_size(g: &GgufFile, arch: &str, hidden: usize) -> Result<usize, GgufError> {
    let key = |k: &str| format!("{arch}.{k}");
    let embd = g
        .tensor("token_embd.weight")
        .ok_or_else(|| GgufError::Tensor {
            path: g.path().to_path_buf(),
            tensor: "token_embd.weight".into(),
            message: "missing".into(),
        })?;
    let vocab = match embd.shape.as_slice() {
        [v, h] if *h == hidden => *v,
        other => {
            return Err(GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: embd.name.clone(),
                message: format!("shape {other:?}, expected [vocab, {hidden}]"),
            })
        }
    };
    if let Some(v) = optional_dim(g, &key("vocab_size"))? {
        if v != vocab {
            return Err(meta_err(
                g,
                &key("vocab_size"),
                format!("{v} differs from token_embd.weight's {vocab} rows"),
            ));
        }
    }
    Ok(vocab)
}

impl GgufHParams {
    /// Read `{arch}.*` metadata; `vocab` and `tied` come from the tensors.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, GgufError> {
        let arch = architecture(g)?;
        let Dims {
            layers,
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim,
            rotary_dim,
        } = Dims::from_gguf(g, &arch)?;
        let (hybrid, layers) = hybrid::read(g, &arch, layers, heads)?;
        let context = required_dim(g, &format!("{arch}.context_length"))?;
        let (rope_theta, rms_norm_eps, rope_linear_factor) = rope_and_norm(g, &arch)?;
        let vocab = vocab_size(g, &arch, hidden)?;
        let tied = g.tensor("output.weight").is_none();
        let sliding_window = match arch.as_str() {
            "gemma3" => Some(required_dim(
                g,
                &format!("{arch}.attention.sliding_window"),
            )?),
            // The converter writes 0 for none (Phi-4).
            "phi3" => match g.get_uint("phi3.attention.sliding_window")? {
                None | Some(0) => None,
                Some(_) => optional_dim(g, "phi3.attention.sliding_window")?,
            },
            _ => None,
        };
        let long_rope = match arch.as_str() {
            "phi3" => long_rope(g, rotary_dim.unwrap_or(head_dim))?,
            _ => None,
        };
        Ok(GgufHParams {
            arch,
            layers,
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim,
            vocab,
            context,
            rope_theta,
            rms_norm_eps,
            rope_linear_factor,
            tied,
            sliding_window,
            rotary_dim,
            long_rope,
            hybrid,
        })
    }

    /// Read Phi-3's LongRoPE factors (tensor data, so not in [`GgufHParams::from_gguf`]).
    pub fn read_rope_factors(&mut self, g: &mut GgufFile) -> Result<(), GgufError> {
        let Some(lr) = self.long_rope.as_mut() else {
            return Ok(());
        };
        let mut read = |name: &str| -> Result<Vec<f32>, GgufError> {
            let t = g.tensor(name).cloned().ok_or_else(|| GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: name.to_string(),
                message: "missing".into(),
            })?;
            let v = g.read_f32(&t)?;
            if let Some(bad) = v.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                return Err(GgufError::Tensor {
                    path: g.path().to_path_buf(),
                    tensor: name.to_string(),
                    message: format!("factor {bad}: every factor must be positive"),
                });
            }
            Ok(v)
        };
        lr.factors = Some((read(ROPE_FACTORS[0])?, read(ROPE_FACTORS[1])?));
        Ok(())
    }

    /// Every tensor the checkpoint needs, in model order, with its expected shape.
    pub fn expected(&self) -> Vec<TensorPlan> {
        use crate::arch::{LayerTensor as T, TensorId};
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        let (h, f) = (self.hidden, self.intermediate);
        let gemma = self.gemma();
        let plan = |id: TensorId, shape: Vec<usize>| {
            let heads = match id {
                TensorId::Layer(_, T::Q) => Some(self.heads),
                TensorId::Layer(_, T::K) => Some(self.kv_heads),
                _ => None,
            };
            TensorPlan {
                hf_name: id.hf_name(),
                gguf_name: tensor_map::gguf_name(id, gemma),
                shape,
                unpermute_heads: heads.filter(|_| self.permuted_qk()),
                minus_one: gemma && id.role() == crate::arch::Role::Norm,
                ..TensorPlan::default()
            }
        };
        let mut out = vec![plan(TensorId::Embedding, vec![self.vocab, h])];
        let fused = |l: usize, gguf: &str, hf: String, rows: usize| TensorPlan {
            hf_name: hf,
            gguf_name: format!("blk.{l}.{gguf}.weight"),
            shape: vec![rows, h],
            ..TensorPlan::default()
        };
        for l in 0..self.layers {
            if self.fused() {
                out.push(plan(TensorId::Layer(l, T::InputNorm), vec![h]));
                let qkv = format!("model.layers.{l}.self_attn.qkv_proj.weight");
                out.push(fused(l, "attn_qkv", qkv, q + 2 * kv));
                out.push(plan(TensorId::Layer(l, T::O), vec![h, q]));
                out.push(plan(TensorId::Layer(l, T::PostNorm), vec![h]));
                let gate_up = format!("model.layers.{l}.mlp.gate_up_proj.weight");
                out.push(fused(l, "ffn_up", gate_up, 2 * f));
                out.push(plan(TensorId::Layer(l, T::Down), vec![h, f]));
                continue;
            }
            for t in T::ALL {
                let shape = match t {
                    T::InputNorm | T::PostNorm => vec![h],
                    T::Q => vec![q, h],
                    T::K | T::V => vec![kv, h],
                    T::QBias if self.attention_bias() => vec![q],
                    T::KBias | T::VBias if self.attention_bias() => vec![kv],
                    T::QNorm | T::KNorm if self.qk_norm() => vec![self.head_dim],
                    T::O => vec![h, q],
                    T::PreFfnNorm | T::PostFfnNorm if gemma => vec![h],
                    T::Gate | T::Up => vec![f, h],
                    T::Down => vec![h, f],
                    _ => continue,
                };
                out.push(plan(TensorId::Layer(l, t), shape));
            }
        }
        out.push(plan(TensorId::FinalNorm, vec![h]));
        if !self.tied {
            out.push(plan(TensorId::LmHead, vec![self.vocab, h]));
        }
        out
    }

    /// config.json (transformers 4 keys; Gemma 3's in transformers 5's form).
    pub fn config_json(&self, ids: SpecialIds) -> serde_json::Value {
        if let Some(h) = &self.hybrid {
            return self.hybrid_config_json(h, ids);
        }
        if self.gemma() {
            return self.gemma3_config_json(ids);
        }
        let rope_scaling = match (self.rope_linear_factor, &self.long_rope) {
            (_, Some(lr)) => {
                let pairs = self.rotary_dim.unwrap_or(self.head_dim) / 2;
                let (long, short) = match &lr.factors {
                    Some((l, s)) => (l.clone(), s.clone()),
                    None => (vec![1.0; pairs], vec![1.0; pairs]),
                };
                let mut r = serde_json::json!({
                    "type": "longrope",
                    "rope_type": "longrope",
                    "long_factor": long,
                    "short_factor": short,
                });
                if let Some(a) = lr.attention_factor {
                    r["attention_factor"] = a.into();
                }
                r
            }
            (Some(f), None) => {
                serde_json::json!({"type": "linear", "rope_type": "linear", "factor": f})
            }
            (None, None) => serde_json::Value::Null,
        };
        let arch = self.architecture();
        let mut config = serde_json::json!({
            "architectures": [arch.hf_name()],
            "attention_bias": self.attention_bias(),
            "attention_dropout": 0.0,
            "bos_token_id": ids.bos,
            "eos_token_id": ids.eos,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": self.context,
            "mlp_bias": false,
            "model_type": arch.model_type(),
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "pad_token_id": ids.pad,
            "pretraining_tp": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": rope_scaling,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tied,
            "torch_dtype": "float16",
            "transformers_version": TRANSFORMERS_VERSION,
            "use_cache": true,
            "vocab_size": self.vocab,
        });
        match arch {
            Architecture::Phi3 => {
                if let Some(rot) = self.rotary_dim {
                    config["partial_rotary_factor"] = rotary_factor(rot, self.head_dim).into();
                }
                if let Some(lr) = &self.long_rope {
                    config["original_max_position_embeddings"] = lr.original_context.into();
                }
                config["sliding_window"] = self.sliding_window.into();
            }
            Architecture::SmolLM3 => {
                let uses_rope: Vec<u8> = (0..self.layers)
                    .map(|l| u8::from((l + 1) % SMOLLM3_NO_ROPE_INTERVAL != 0))
                    .collect();
                config["no_rope_layers"] = uses_rope.into();
            }
            _ => {}
        }
        config
    }

    /// Gemma 3's config.json: what the file stores, and what llama.cpp fixes for the
    /// architecture (window pattern, local RoPE base, attention scale).
    fn gemma3_config_json(&self, ids: SpecialIds) -> serde_json::Value {
        let layer_types: Vec<&str> = (0..self.layers)
            .map(|l| match (l + 1) % GEMMA3_SLIDING_PATTERN {
                0 => "full_attention",
                _ => "sliding_attention",
            })
            .collect();
        let full = match self.rope_linear_factor {
            Some(f) => {
                serde_json::json!({"rope_type": "linear", "rope_theta": self.rope_theta, "factor": f})
            }
            None => serde_json::json!({"rope_type": "default", "rope_theta": self.rope_theta}),
        };
        serde_json::json!({
            "architectures": [Architecture::Gemma3.hf_name()],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": null,
            "bos_token_id": ids.bos,
            "dtype": "float16",
            "eos_token_id": ids.eos,
            "final_logit_softcapping": null,
            "head_dim": self.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "layer_types": layer_types,
            "max_position_embeddings": self.context,
            "model_type": Architecture::Gemma3.model_type(),
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "pad_token_id": ids.pad,
            "query_pre_attn_scalar": self.query_pre_attn_scalar(),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
            },
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": self.tied,
            "transformers_version": "5.23.0",
            "use_cache": true,
            "vocab_size": self.vocab,
        })
    }
}

/// Whether `name` is a tensor of Qwen3.5's MTP blocks (`blk.N.*` at or past the decoder's
/// blocks), which the import leaves out.
pub(super) fn is_mtp_tensor(hp: &GgufHParams, name: &str) -> bool {
    let Some(Hybrid::Qwen35 { mtp_layers, .. }) = &hp.hybrid else {
        return false;
    };
    let block = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(n, _)| n.parse::<usize>().ok());
    block.is_some_and(|b| b >= hp.layers && b < hp.layers + mtp_layers)
}

impl GgufHParams {
    /// config.json of a hybrid model, in transformers 5's form: what the file stores, the
    /// block kinds as `layer_types`, and LFM2's feed-forward width as the file has it
    /// (`feed_forward_length` is already the adjusted width: no further adjustment).
    pub(super) fn hybrid_config_json(&self, h: &Hybrid, ids: SpecialIds) -> serde_json::Value {
        let arch = self.architecture();
        let mut c = serde_json::json!({
            "architectures": [arch.hf_name()],
            "model_type": arch.model_type(),
            "bos_token_id": ids.bos,
            "eos_token_id": ids.eos,
            "pad_token_id": ids.pad,
            "dtype": "float16",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": self.context,
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "tie_word_embeddings": self.tied,
            "transformers_version": "5.23.0",
            "use_cache": true,
            "vocab_size": self.vocab,
        });
        let kinds = |recurrent: &[usize], (yes, no): (&str, &str)| -> Vec<String> {
            (0..self.layers)
                .map(|l| if recurrent.contains(&l) { yes } else { no }.to_string())
                .collect()
        };
        let extra = match h {
            Hybrid::Lfm2 {
                conv_layers,
                kernel,
                bias,
            } => serde_json::json!({
                "block_auto_adjust_ff_dim": false,
                "conv_L_cache": kernel,
                "conv_bias": bias,
                "layer_types": kinds(conv_layers, ("conv", "full_attention")),
                "norm_eps": self.rms_norm_eps,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            }),
            Hybrid::Qwen35 {
                delta_layers,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
                kernel,
                rope_sections,
                ..
            } => {
                let rot = self.rotary_dim.unwrap_or(self.head_dim);
                let mut rope = serde_json::json!({
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": rotary_factor(rot, self.head_dim),
                });
                if !rope_sections.is_empty() {
                    rope["mrope_interleaved"] = true.into();
                    rope["mrope_section"] = rope_sections.clone().into();
                }
                serde_json::json!({
                    "attention_bias": false,
                    "head_dim": self.head_dim,
                    "hidden_act": "silu",
                    "layer_types": kinds(delta_layers, ("linear_attention", "full_attention")),
                    "linear_conv_kernel_dim": kernel,
                    "linear_key_head_dim": key_dim,
                    "linear_num_key_heads": key_heads,
                    "linear_num_value_heads": value_heads,
                    "linear_value_head_dim": value_dim,
                    "rms_norm_eps": self.rms_norm_eps,
                    "rope_parameters": rope,
                })
            }
        };
        if let (Some(c), serde_json::Value::Object(extra)) = (c.as_object_mut(), extra) {
            c.extend(extra);
        }
        c
    }
}
