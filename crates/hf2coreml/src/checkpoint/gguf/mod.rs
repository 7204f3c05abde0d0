//! GGUF (llama.cpp) files → Hugging Face checkpoints.
//!
//! [`import`] reads a `llama`, `qwen2`, `qwen3`, `gemma3`, `phi3`, `smollm3`, `lfm2` or `qwen35`
//! GGUF ([`hybrid`]: the last two's own keys, names and transforms), dequantizes
//! every tensor (the legacy, K and IQ4 quant types: [`dequant`]) into an fp16
//! `model.safetensors` with llama.cpp's q/k row permutation undone where its converter applied
//! it (llama and smollm3), and writes
//! config.json, generation_config.json and a tokenizer rebuilt from the GGUF vocabulary. Everything about the input is checked before the output directory is created,
//! and the output appears under its name only when complete ([`AtomicDir`]).

pub mod cache;
pub use hf2coreml_numerics::dequant;
pub mod header;
pub mod hybrid;
pub mod reader;
pub mod spm;
pub mod tensor_map;
pub mod tokenizer;

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use thiserror::Error;

pub use hybrid::Hybrid;
pub use reader::{supported_types_list, type_name, GgufFile, GgufTensor, SUPPORTED_TYPES};
pub use tensor_map::{hf_tensor_name, permute_rows, unpermute_rows, TensorPlan};
pub use tokenizer::{GgufTokenizer, SUPPORTED_PRE};

use crate::arch::Architecture;
use crate::fsutil::AtomicDir;
use crate::progress::Progress;

/// Architectures (`general.architecture`) the importer understands.
pub const SUPPORTED_ARCHITECTURES: [&str; 8] = [
    "llama", "qwen2", "qwen3", "gemma3", "phi3", "smollm3", "lfm2", "qwen35",
];

/// The transformers version whose config keys we write (v4: `rope_theta`, `torch_dtype`).
const TRANSFORMERS_VERSION: &str = "4.46.0";

/// Everything that can be wrong with a GGUF import. Every variant names the file.
#[derive(Debug, Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a readable GGUF file: {message}")]
    Malformed { path: PathBuf, message: String },
    #[error(
        "{path}: truncated: tensor `{tensor}` needs bytes {start}..{end} but the file has {file_size} bytes"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_size: u64,
    },
    #[error("{path}: metadata `{key}`: {message}")]
    Metadata {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("{path}: architecture `{arch}` is not supported (supported: {})", SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture { path: PathBuf, arch: String },
    /// llama.cpp's multimodal projector file (`mmproj-*.gguf`), which ships beside a
    /// multimodal model's text GGUF.
    #[error(
        "{path}: a multimodal projector (`mmproj`, architecture `clip`): it holds the vision or \
         audio tower, not the text model; import the text model's GGUF beside it, which is what \
         hf2coreml converts"
    )]
    Projector { path: PathBuf },
    #[error(
        "{path}: tensor `{tensor}` has type {dtype}; supported: {}",
        supported_types_list()
    )]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{path}: cannot rebuild tokenizer {what} (supported: {supported})")]
    UnsupportedTokenizer {
        path: PathBuf,
        what: String,
        supported: String,
    },
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("{path} already exists (use --force to replace it)")]
    OutputExists { path: PathBuf },
}

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

/// The special token ids config.json names.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
}

impl SpecialIds {
    /// The ids `tokenizer.ggml.*_token_id` declare (against the vocabulary: the tokenizer and
    /// config.json check them). An id wider than 32 bits is refused, never dropped.
    pub fn from_metadata(g: &GgufFile) -> Result<Self, GgufError> {
        let id = |k: &str| -> Result<Option<u32>, GgufError> {
            g.get_uint(k)?
                .map(|v| {
                    u32::try_from(v)
                        .map_err(|_| meta_err(g, k, format!("token id {v} does not fit 32 bits")))
                })
                .transpose()
        };
        Ok(SpecialIds {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
        })
    }
}

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

/// An error about metadata `key` of `g`.
fn meta_err(g: &GgufFile, key: &str, message: String) -> GgufError {
    GgufError::Metadata {
        path: g.path().to_path_buf(),
        key: key.to_string(),
        message,
    }
}

/// A positive integer `key` that may be absent.
fn optional_dim(g: &GgufFile, key: &str) -> Result<Option<usize>, GgufError> {
    match g.get_uint(key)? {
        None => Ok(None),
        Some(0) => Err(meta_err(g, key, "must be positive".into())),
        Some(v) => usize::try_from(v)
            .map(Some)
            .map_err(|_| meta_err(g, key, format!("{v} is too large"))),
    }
}

/// A positive integer `key` that must be present.
fn required_dim(g: &GgufFile, key: &str) -> Result<usize, GgufError> {
    match g.get_uint(key)? {
        None => Err(meta_err(g, key, "missing".into())),
        Some(0) => Err(meta_err(g, key, "must be positive".into())),
        Some(v) => usize::try_from(v).map_err(|_| meta_err(g, key, format!("{v} is too large"))),
    }
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
    let rope_theta = g.get_float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(meta_err(
            g,
            &key("rope.freq_base"),
            format!("{rope_theta} must be positive"),
        ));
    }
    let rms_norm_eps = g
        .get_float(&key("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| {
            meta_err(
                g,
                &key("attention.layer_norm_rms_epsilon"),
                "missing".into(),
            )
        })?;
    if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
        return Err(meta_err(
            g,
            &key("attention.layer_norm_rms_epsilon"),
            format!("{rms_norm_eps} must be positive"),
        ));
    }
    let rope_linear_factor = match g.get_str(&key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => {
            let f = g.get_float(&key("rope.scaling.factor"))?.ok_or_else(|| {
                meta_err(
                    g,
                    &key("rope.scaling.factor"),
                    "missing for linear scaling".into(),
                )
            })?;
            if !(f.is_finite() && f > 0.0) {
                return Err(meta_err(
                    g,
                    &key("rope.scaling.factor"),
                    format!("{f} must be positive"),
                ));
            }
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

/// Check that the file holds exactly the tensors `hp` implies, with the right shapes and
/// dequantizable types.
pub fn plan_tensors(g: &GgufFile, hp: &GgufHParams) -> Result<Vec<TensorPlan>, GgufError> {
    let plan = plan_tensors_unchecked(g, hp)?;
    for p in &plan {
        let Some(t) = g.tensor(&p.gguf_name) else {
            continue;
        };
        if t.dtype.is_none() {
            return Err(GgufError::UnsupportedTensorType {
                path: g.path().to_path_buf(),
                tensor: t.name.clone(),
                dtype: t.type_name(),
            });
        }
    }
    Ok(plan)
}

/// [`plan_tensors`] without the type check (what a header-only summary needs).
pub fn plan_tensors_unchecked(
    g: &GgufFile,
    hp: &GgufHParams,
) -> Result<Vec<TensorPlan>, GgufError> {
    // A hybrid's tensors are the ones its config.json describes (block kinds, DeltaNet sizes).
    let plan = match &hp.hybrid {
        Some(_) => hybrid::expected(&hp.spec(g)?),
        None => hp.expected(),
    };
    for p in &plan {
        let t = g.tensor(&p.gguf_name).ok_or_else(|| GgufError::Tensor {
            path: g.path().to_path_buf(),
            tensor: p.gguf_name.clone(),
            message: "missing".into(),
        })?;
        if t.shape != p.gguf_shape() {
            return Err(GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: p.gguf_name.clone(),
                message: format!("shape {:?}, expected {:?}", t.shape, p.gguf_shape()),
            });
        }
    }
    let extra: Vec<&str> = g
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !plan.iter().any(|p| p.gguf_name == *n))
        .filter(|n| hp.long_rope.is_none() || !ROPE_FACTORS.contains(n))
        .filter(|n| !hybrid::is_mtp_tensor(hp, n))
        .collect();
    if let Some(first) = extra.first() {
        let message = if *first == "rope_freqs.weight" {
            "per-frequency rope factors (Llama 3.1 style) are not supported".to_string()
        } else {
            format!(
                "not part of a {}-layer {} ({} unexpected tensor(s): {})",
                hp.layers,
                hp.arch,
                extra.len(),
                extra.iter().take(5).copied().collect::<Vec<_>>().join(", ")
            )
        };
        return Err(GgufError::Tensor {
            path: g.path().to_path_buf(),
            tensor: first.to_string(),
            message,
        });
    }
    Ok(plan)
}

/// True when `path` is a file starting with the GGUF magic (for commands that accept either
/// a checkpoint directory or a GGUF file).
pub fn is_gguf_file(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    crate::fsutil::open_input(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Options of [`import`].
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// Replace an existing output directory.
    pub force: bool,
}

/// What [`import`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ImportReport {
    pub source: PathBuf,
    pub output: PathBuf,
    pub hparams: GgufHParams,
    pub parameters: u64,
    pub tensors: usize,
    /// GGUF tensor type → number of tensors of that type.
    pub tensor_types: BTreeMap<String, usize>,
    pub pre_tokenizer: String,
    pub tokenizer_vocab: usize,
    pub safetensors_bytes: u64,
}

/// Import the GGUF at `src` as a Hugging Face checkpoint directory `dest`.
pub fn import(
    src: &Path,
    dest: &Path,
    opts: &ImportOptions,
    progress: &dyn Progress,
) -> Result<ImportReport, GgufError> {
    let mut g = GgufFile::open(src)?;
    let mut hp = GgufHParams::from_gguf(&g)?;
    hp.read_rope_factors(&mut g)?;
    let plan = plan_tensors(&g, &hp)?;
    let tok = tokenizer::build(&g)?;
    if tok.vocab_size > hp.vocab {
        return Err(GgufError::Tokenizer {
            path: src.to_path_buf(),
            message: format!(
                "{} tokens but the embedding has only {} rows",
                tok.vocab_size, hp.vocab
            ),
        });
    }
    // The config.json written below is read back as any checkpoint's is: a value that makes
    // no model (a RoPE factor whose angles overflow, ...) is refused here, naming its key.
    let config = hp.config_json(tok.special_ids());
    hp.spec_of(&g, &config)?;

    let out = AtomicDir::new(dest, opts.force).map_err(|source| {
        if source.kind() == std::io::ErrorKind::AlreadyExists {
            GgufError::OutputExists {
                path: dest.to_path_buf(),
            }
        } else {
            GgufError::Io {
                path: dest.to_path_buf(),
                source,
            }
        }
    })?;
    let dir = out.path().to_path_buf();
    let st_path = dir.join("model.safetensors");
    let (parameters, tensor_types, safetensors_bytes) = write_weights(
        &mut g,
        &plan,
        &st_path,
        &dest.join("model.safetensors"),
        progress,
    )?;

    let json = |v: &serde_json::Value| {
        let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
        s.push('\n');
        s
    };
    let files = [
        ("config.json", json(&config)),
        ("generation_config.json", json(&generation_config(&tok))),
        ("tokenizer_config.json", json(&tok.config_json(hp.context))),
        (
            "special_tokens_map.json",
            json(&tok.special_tokens_map_json()),
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.join(name), text).map_err(|source| GgufError::Io {
            path: dest.join(name),
            source,
        })?;
    }
    let tok_path = dir.join("tokenizer.json");
    tok.tokenizer
        .save(&tok_path, false)
        .map_err(|e| GgufError::Tokenizer {
            path: dest.join("tokenizer.json"),
            message: format!("cannot write: {e}"),
        })?;
    let output = out.commit().map_err(|source| GgufError::Io {
        path: dest.to_path_buf(),
        source,
    })?;
    Ok(ImportReport {
        source: src.to_path_buf(),
        output,
        parameters,
        tensors: plan.len(),
        tensor_types,
        pre_tokenizer: tok.pre.clone(),
        tokenizer_vocab: tok.vocab_size,
        safetensors_bytes,
        hparams: hp,
    })
}

fn generation_config(tok: &GgufTokenizer) -> serde_json::Value {
    let id = |t: &Option<(u32, String)>| t.as_ref().map(|(i, _)| *i);
    serde_json::json!({
        "bos_token_id": id(&tok.bos),
        "eos_token_id": id(&tok.eos),
        "pad_token_id": id(&tok.pad),
        "transformers_version": TRANSFORMERS_VERSION,
    })
}

/// Stream every planned tensor, dequantized and in fp16, into one safetensors file.
/// Returns (parameters, tensor types seen, bytes written).
fn write_weights(
    g: &mut GgufFile,
    plan: &[TensorPlan],
    path: &Path,
    shown_as: &Path,
    progress: &dyn Progress,
) -> Result<(u64, BTreeMap<String, usize>, u64), GgufError> {
    let io_err = |source| GgufError::Io {
        path: shown_as.to_path_buf(),
        source,
    };
    let entries: Vec<(&str, &[usize])> = plan
        .iter()
        .map(|p| (p.hf_name.as_str(), p.shape.as_slice()))
        .collect();
    let header = tensor_map::safetensors_header(&entries);
    let file = std::fs::File::create(path).map_err(io_err)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&header).map_err(io_err)?;
    let mut written = header.len() as u64;
    let mut parameters = 0u64;
    let mut types = BTreeMap::new();
    progress.begin("importing", plan.len() as u64);
    for p in plan {
        let t = g
            .tensor(&p.gguf_name)
            .cloned()
            .ok_or_else(|| GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: p.gguf_name.clone(),
                message: "missing".into(),
            })?;
        progress.working_on(&p.gguf_name);
        *types.entry(t.type_name()).or_insert(0) += 1;
        let stored = g.read_f32(&t)?;
        let values = transform(g, p, stored)?;
        let bytes = tensor_map::to_f16_bytes(&values).map_err(|i| GgufError::Tensor {
            path: g.path().to_path_buf(),
            tensor: p.gguf_name.clone(),
            message: format!(
                "element {i} ({}) is outside the fp16 range",
                values.get(i).copied().unwrap_or(f32::NAN)
            ),
        })?;
        w.write_all(&bytes).map_err(io_err)?;
        written += bytes.len() as u64;
        parameters += values.len() as u64;
        progress.advance(1);
    }
    progress.end();
    let file = w.into_inner().map_err(|e| io_err(e.into_error()))?;
    file.sync_all().map_err(io_err)?;
    Ok((parameters, types, written))
}

/// `values` (a tensor as stored) in the Hugging Face layout: llama.cpp's converter's transforms
/// undone.
fn transform(g: &GgufFile, p: &TensorPlan, mut values: Vec<f32>) -> Result<Vec<f32>, GgufError> {
    if let Some(heads) = p.unpermute_heads {
        values = unpermute_rows(&values, p.shape[0], p.shape[1], heads);
    }
    if p.minus_one {
        values.iter_mut().for_each(|v| *v -= 1.0);
    }
    if p.negated_exp {
        if let Some(i) = values.iter().position(|v| !(*v < 0.0 && v.is_finite())) {
            return Err(GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: p.gguf_name.clone(),
                message: format!(
                    "element {i} ({}) is not a negative number: the file stores A = −exp(A_log)",
                    values[i]
                ),
            });
        }
        values.iter_mut().for_each(|v| *v = (-*v).ln());
    }
    if let Some(tiled) = &p.tiled_heads {
        // The plan's shapes were checked against the file: the axis holds every value head.
        let shape = p.gguf_shape();
        let rows = shape.first().copied().unwrap_or(1);
        let cols = shape.iter().skip(1).product::<usize>();
        values = tiled.untile(&values, rows, cols);
    }
    Ok(values)
}

/// The `partial_rotary_factor` that readers turn back into `rot` rotated dimensions: they
/// take `int(head_dim × factor)`, and rot / head_dim rounded to f64 can land a hair below, which
/// truncates to rot − 1 (6 of 47); the next f64 up then gives rot.
fn rotary_factor(rot: usize, head_dim: usize) -> f64 {
    let f = rot as f64 / head_dim as f64;
    if (head_dim as f64 * f) as usize == rot {
        f
    } else {
        // The next f64 above a positive finite value (`f64::next_up` needs a newer Rust).
        f64::from_bits(f.to_bits() + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::rotary_factor;

    #[test]
    fn rotary_factor_gives_back_the_rotated_count() {
        for head_dim in 2..=1024usize {
            for rot in (2..head_dim).step_by(2) {
                let f = rotary_factor(rot, head_dim);
                assert_eq!((head_dim as f64 * f) as usize, rot, "{rot} of {head_dim}");
            }
        }
        assert_eq!(rotary_factor(96, 128), 0.75);
    }
}
