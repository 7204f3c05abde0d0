//! llama.cpp's hybrid architectures read back as transformers holds them: `lfm2` (LFM2's
//! short-convolution blocks between attention blocks, `Lfm2ForCausalLM`) and `qwen35` (Qwen3.5's
//! Gated DeltaNet blocks between gated attention blocks, `Qwen3_5ForCausalLM`).
//!
//! The keys, names and transforms are listed in docs/reference/gguf-archs.md. In short: LFM2's
//! files only rename (the final norm is `token_embd_norm`) and squeeze the convolution taps;
//! which blocks convolve is the per-block `attention.head_count_kv` (0 for a convolution).
//! Qwen3.5's files store every norm but the DeltaNet's output norm as 1 + w, `ssm_a` as
//! −exp(A_log), the convolution squeezed, and the value heads tiled where transformers groups
//! them (when key heads ≠ value heads); which blocks attend is read from the tensors each
//! block holds.

use candle_core::quantized::gguf_file::Value;
use serde::Serialize;

use super::gguf_error::GgufError;
use super::metadata_keys::{meta_err, optional_dim, required_dim};
use super::reader::GgufFile;
use super::tensor_map::{self, TensorPlan, TiledHeads};
use crate::arch::{self, Architecture, LayerTensor as T, ModelSpec, Role, TensorId};

/// What a hybrid GGUF declares beyond the hyperparameters every architecture shares.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Hybrid {
    /// `lfm2`: the blocks whose `attention.head_count_kv` entry is 0 convolve, with
    /// `shortconv.l_cache` taps; biases when the file holds `shortconv.in_proj.bias`.
    Lfm2 {
        conv_layers: Vec<usize>,
        kernel: usize,
        bias: bool,
    },
    /// `qwen35`: the blocks holding `ssm_a` are Gated DeltaNets (`ssm.*` sizes), the blocks
    /// holding `attn_q` attend.
    Qwen35 {
        delta_layers: Vec<usize>,
        key_heads: usize,
        value_heads: usize,
        key_dim: usize,
        value_dim: usize,
        kernel: usize,
        /// `full_attention_interval` (default 4): what llama.cpp derives the block kinds from.
        /// The tensors decide here; config.json lists the kinds (`layer_types`).
        full_attention_interval: usize,
        /// `rope.dimension_sections` without its zeros: transformers' `mrope_section`.
        rope_sections: Vec<usize>,
        /// MTP blocks stored after the decoder's (`nextn_predict_layers`): not imported.
        mtp_layers: usize,
    },
}

/// LFM2's `attention.head_count_kv`: one entry per block, 0 for a convolution (a single
/// number: every block attends). Returns the KV heads of the attention blocks (`heads` when
/// none attends) and the convolution blocks.
pub(super) fn lfm2_kv_heads(
    g: &GgufFile,
    key: &str,
    layers: usize,
    heads: usize,
) -> Result<(usize, Vec<usize>), GgufError> {
    if !matches!(g.metadata().get(key), Some(Value::Array(_))) {
        return Ok((optional_dim(g, key)?.unwrap_or(heads), Vec::new()));
    }
    let per_block = g.get_uint_array(key)?.unwrap_or_default();
    if per_block.len() != layers {
        return Err(meta_err(
            g,
            key,
            format!(
                "{} entries for {layers} blocks (one per block, 0 for a convolution)",
                per_block.len()
            ),
        ));
    }
    let attending: Vec<u64> = per_block.iter().copied().filter(|&n| n > 0).collect();
    let kv = match attending.first() {
        None => return Ok((heads, (0..layers).collect())),
        Some(&kv) => kv,
    };
    if let Some(other) = attending.iter().find(|&&n| n != kv) {
        return Err(meta_err(
            g,
            key,
            format!("attention blocks with {kv} and {other} KV heads: one count is supported"),
        ));
    }
    let kv = usize::try_from(kv).map_err(|_| meta_err(g, key, format!("{kv} is too large")))?;
    let conv = (0..layers).filter(|&l| per_block[l] == 0).collect();
    Ok((kv, conv))
}

/// The hybrid part of `arch`'s hyperparameters (`None` for the other architectures) and the
/// decoder's blocks (`block_count` less Qwen3.5's MTP blocks).
pub(super) fn read(
    g: &GgufFile,
    arch: &str,
    block_count: usize,
    heads: usize,
) -> Result<(Option<Hybrid>, usize), GgufError> {
    match arch {
        "lfm2" => {
            let key = "lfm2.attention.head_count_kv";
            let (_, conv_layers) = lfm2_kv_heads(g, key, block_count, heads)?;
            let kernel = required_dim(g, "lfm2.shortconv.l_cache")?;
            let bias = conv_layers.first().is_some_and(|l| {
                g.tensor(&format!("blk.{l}.shortconv.in_proj.bias"))
                    .is_some()
            });
            let h = Hybrid::Lfm2 {
                conv_layers,
                kernel,
                bias,
            };
            Ok((Some(h), block_count))
        }
        "qwen35" => qwen35(g, block_count).map(|(h, layers)| (Some(h), layers)),
        _ => Ok((None, block_count)),
    }
}

/// Qwen3.5's keys: the MTP blocks, the DeltaNet sizes (`ssm.*`), the RoPE sections, and which
/// blocks are DeltaNets.
fn qwen35(g: &GgufFile, block_count: usize) -> Result<(Hybrid, usize), GgufError> {
    let key = |k: &str| format!("qwen35.{k}");
    let mtp_key = key("nextn_predict_layers");
    let mtp = g.get_uint(&mtp_key)?.unwrap_or(0);
    let mtp_layers = usize::try_from(mtp)
        .ok()
        .filter(|&n| n < block_count)
        .ok_or_else(|| {
            meta_err(
                g,
                &mtp_key,
                format!("{mtp} MTP blocks leave none of the {block_count} blocks to the decoder"),
            )
        })?;
    let layers = block_count - mtp_layers;
    let kernel = required_dim(g, &key("ssm.conv_kernel"))?;
    let key_dim = required_dim(g, &key("ssm.state_size"))?;
    let key_heads = required_dim(g, &key("ssm.group_count"))?;
    let value_heads = required_dim(g, &key("ssm.time_step_rank"))?;
    let inner = required_dim(g, &key("ssm.inner_size"))?;
    if !value_heads.is_multiple_of(key_heads) {
        return Err(meta_err(
            g,
            &key("ssm.time_step_rank"),
            format!(
                "{value_heads} value heads are not a multiple of the {key_heads} key heads \
                 (ssm.group_count): each key head serves a group of value heads"
            ),
        ));
    }
    if !inner.is_multiple_of(value_heads) {
        return Err(meta_err(
            g,
            &key("ssm.inner_size"),
            format!("{inner} is not a whole number of the {value_heads} value heads' widths"),
        ));
    }
    let full_attention_interval = optional_dim(g, &key("full_attention_interval"))?.unwrap_or(4);
    let rope_sections = match g.get_uint_array(&key("rope.dimension_sections"))? {
        None => Vec::new(),
        Some(s) => s
            .into_iter()
            .filter(|&n| n > 0)
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
            .collect(),
    };
    let h = Hybrid::Qwen35 {
        delta_layers: delta_layers(g, layers)?,
        key_heads,
        value_heads,
        key_dim,
        value_dim: inner / value_heads,
        kernel,
        full_attention_interval,
        rope_sections,
        mtp_layers,
    };
    Ok((h, layers))
}

/// The DeltaNet blocks, by the tensors each block holds: `ssm_a` (a DeltaNet) or `attn_q`
/// (attention). llama.cpp derives the kinds from `full_attention_interval` instead; a file
/// whose tensors say otherwise was converted from a config.json with its own `layer_types`,
/// and the tensors are what the model computes with.
fn delta_layers(g: &GgufFile, layers: usize) -> Result<Vec<usize>, GgufError> {
    let mut delta = Vec::new();
    for l in 0..layers {
        let q = format!("blk.{l}.attn_q.weight");
        let a = format!("blk.{l}.ssm_a");
        match (g.tensor(&q).is_some(), g.tensor(&a).is_some()) {
            (true, false) => {}
            (false, true) => delta.push(l),
            (both, _) => {
                let what = match both {
                    true => "both",
                    false => "neither",
                };
                return Err(GgufError::Tensor {
                    path: g.path().to_path_buf(),
                    tensor: q,
                    message: format!(
                        "block {l} holds {what} `attn_q.weight` and `ssm_a`: it must be an \
                         attention block or a Gated DeltaNet"
                    ),
                });
            }
        }
    }
    Ok(delta)
}

/// Every tensor `spec` (what config.json describes) needs, with its GGUF name and the transforms
/// that undo llama.cpp's converter.
pub(super) fn expected(spec: &ModelSpec) -> Vec<TensorPlan> {
    arch::tensor_ids(spec)
        .into_iter()
        .map(|id| expected_one(id, spec))
        .collect()
}

/// How tensor `id` of `spec` is read from a hybrid GGUF.
pub fn expected_one(id: TensorId, spec: &ModelSpec) -> TensorPlan {
    let lfm2 = spec.architecture == Architecture::Lfm2;
    let gguf_name = match id {
        TensorId::FinalNorm if lfm2 => "token_embd_norm.weight".to_string(),
        _ => tensor_map::gguf_name(id, !lfm2),
    };
    let t = match id {
        TensorId::Layer(_, t) => Some(t),
        _ => None,
    };
    TensorPlan {
        hf_name: arch::stored_name(spec.architecture, &id.hf_name()),
        gguf_name,
        shape: id.shape(spec),
        unpermute_heads: None,
        minus_one: !lfm2 && id.role() == Role::Norm && t != Some(T::DeltaNorm),
        squeezed: matches!(t, Some(T::Conv | T::DeltaConv)),
        negated_exp: t == Some(T::DeltaALog),
        tiled_heads: t.and_then(|t| tiled_heads(t, spec)),
    }
}

/// How `t` holds Qwen3.5's value heads, when llama.cpp tiled them (key heads ≠ value heads).
pub fn tiled_heads(t: T, spec: &ModelSpec) -> Option<TiledHeads> {
    let g = spec
        .gated_delta
        .as_ref()
        .filter(|g| g.key_heads != g.value_heads)?;
    let heads = |head_dim, offset, columns| TiledHeads {
        key_heads: g.key_heads,
        ratio: g.value_heads / g.key_heads,
        head_dim,
        offset,
        columns,
    };
    // q and k come first in the convolution's channels; v after them.
    let qk = 2 * g.key_heads * g.key_dim;
    Some(match t {
        T::DeltaQkv | T::DeltaConv => heads(g.value_dim, qk, false),
        T::DeltaZ => heads(g.value_dim, 0, false),
        T::DeltaB | T::DeltaA | T::DeltaALog | T::DeltaDtBias => heads(1, 0, false),
        T::DeltaOut => heads(g.value_dim, 0, true),
        _ => return None,
    })
}

/// The GGUF key a hybrid config.json field comes from (`None`: not a hybrid field).
pub(super) fn key_of(h: &Hybrid, field: &str) -> Option<&'static str> {
    Some(match (h, field) {
        (Hybrid::Lfm2 { .. }, "conv_L_cache") => "shortconv.l_cache",
        (Hybrid::Lfm2 { .. }, "layer_types" | "num_key_value_heads") => "attention.head_count_kv",
        (Hybrid::Lfm2 { .. }, "norm_eps") => "attention.layer_norm_rms_epsilon",
        (_, "rope_parameters.rope_theta") => "rope.freq_base",
        (_, "intermediate_size") => "feed_forward_length",
        (Hybrid::Qwen35 { .. }, field) => match field {
            "linear_conv_kernel_dim" => "ssm.conv_kernel",
            "linear_key_head_dim" => "ssm.state_size",
            "linear_num_key_heads" => "ssm.group_count",
            "linear_num_value_heads" => "ssm.time_step_rank",
            "linear_value_head_dim" => "ssm.inner_size",
            "partial_rotary_factor" | "rope_parameters.partial_rotary_factor" => {
                "rope.dimension_count"
            }
            _ => return None,
        },
        _ => return None,
    })
}
