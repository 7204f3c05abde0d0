//! What a GGUF's header alone says about the model: its spec, tensor types, bits per weight,
//! where an incomplete file stops, and the precision its projections were quantized to (the
//! error floor a re-quantized package starts from). No tensor data is read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::dequant::block_layout;
use super::reader::GgufFile;
use super::tensor_types::type_name;
use super::{plan_tensors_unchecked, GgufError, GgufHParams};
use crate::arch::{self, ModelSpec};
use crate::checkpoint::ConfigError;

/// A tensor type's storage cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TypeCount {
    pub name: String,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
    /// Bits per weight of the type itself (block bytes × 8 / block elements).
    pub bits_per_weight: f64,
}

/// The header of a GGUF file, summarized.
#[derive(Debug, Clone, Serialize)]
pub struct HeaderInfo {
    pub path: PathBuf,
    pub spec: ModelSpec,
    pub file_size: u64,
    /// The file size when the tensor data is incomplete (the file stops at that byte).
    pub truncated_at: Option<u64>,
    /// By tensor type, most parameters first.
    pub tensor_types: Vec<TypeCount>,
    /// Elements of every tensor in the file.
    pub parameters: u64,
    /// Bytes of tensor data the header declares.
    pub data_bytes: u64,
    /// `data_bytes × 8 / parameters`.
    pub bits_per_weight: f64,
    /// The type holding most projection weights and its bits per weight: the precision the
    /// source was already quantized to.
    pub projection_type: Option<(String, f64)>,
    /// Bytes each checkpoint tensor takes in the file, by Hugging Face name.
    pub stored_bytes: BTreeMap<String, u64>,
}

/// Bits per weight of ggml type `id`, if ggml defines it.
pub fn type_bits(id: u32) -> Option<f64> {
    block_layout(id).map(|(e, b)| b as f64 * 8.0 / e as f64)
}

impl GgufHParams {
    /// The spec the imported checkpoint's config.json will describe (special token ids from
    /// the tokenizer metadata): that config.json, read back.
    pub fn spec(&self, g: &GgufFile) -> Result<ModelSpec, GgufError> {
        let config = self.config_json(super::SpecialIds::from_metadata(g)?);
        self.spec_of(g, &config)
    }

    /// `config` (what [`GgufHParams::config_json`] made of `g`) read back as config.json is:
    /// a value that makes no model is refused naming the GGUF key or tensor it came from.
    pub(super) fn spec_of(
        &self,
        g: &GgufFile,
        config: &serde_json::Value,
    ) -> Result<ModelSpec, GgufError> {
        ModelSpec::from_config_str(&config.to_string()).map_err(|e| {
            let message = format!("the hyperparameters make no model hf2coreml converts: {e}");
            let path = g.path().to_path_buf();
            let ConfigError::Field { field, .. } = &e else {
                let key = format!("{}.*", self.arch);
                return GgufError::Metadata { path, key, message };
            };
            match self.gguf_source(field) {
                Source::Key(key) => GgufError::Metadata { path, key, message },
                Source::Tensor(tensor) => GgufError::Tensor {
                    path,
                    tensor: tensor.into(),
                    message,
                },
            }
        })
    }

    /// Where the imported config.json's `field` comes from in the GGUF file.
    fn gguf_source(&self, field: &str) -> Source {
        let key = |k: &str| Source::Key(format!("{}.{k}", self.arch));
        let name = field.split('[').next().unwrap_or(field);
        if let Some(k) = self
            .hybrid
            .as_ref()
            .and_then(|h| super::hybrid::key_of(h, name))
        {
            return key(k);
        }
        match name {
            "rope_theta" | "rope_parameters.full_attention.rope_theta" => key("rope.freq_base"),
            "rope_scaling.factor" | "rope_parameters.full_attention.factor" => {
                key("rope.scaling.factor")
            }
            "rope_scaling.long_factor" => Source::Tensor(super::ROPE_FACTORS[0]),
            "rope_scaling.short_factor" => Source::Tensor(super::ROPE_FACTORS[1]),
            "rms_norm_eps" => key("attention.layer_norm_rms_epsilon"),
            "bos_token_id" | "eos_token_id" => Source::Key(format!("tokenizer.ggml.{name}")),
            _ => Source::Key(format!("{}.*", self.arch)),
        }
    }
}

/// A GGUF metadata key or tensor.
enum Source {
    Key(String),
    Tensor(&'static str),
}

/// Read `path`'s header (a file whose tensor data is cut short is accepted and said so).
pub fn read_header(path: &Path) -> Result<HeaderInfo, GgufError> {
    let g = GgufFile::open_header(path)?;
    summarize(&g)
}

/// Summarize an opened GGUF's header.
pub fn summarize(g: &GgufFile) -> Result<HeaderInfo, GgufError> {
    let hp = GgufHParams::from_gguf(g)?;
    let plan = plan_tensors_unchecked(g, &hp)?;
    let spec = hp.spec(g)?;
    let mut types: BTreeMap<u32, TypeCount> = BTreeMap::new();
    for t in g.tensors() {
        let e = types.entry(t.type_id).or_insert_with(|| TypeCount {
            name: type_name(t.type_id),
            tensors: 0,
            parameters: 0,
            bytes: 0,
            bits_per_weight: type_bits(t.type_id).unwrap_or(f64::NAN),
        });
        e.tensors += 1;
        e.parameters += t.numel() as u64;
        e.bytes += t.n_bytes;
    }
    let mut tensor_types: Vec<TypeCount> = types.into_values().collect();
    tensor_types.sort_by(|a, b| b.parameters.cmp(&a.parameters).then(a.name.cmp(&b.name)));
    let parameters: u64 = g.tensors().iter().map(|t| t.numel() as u64).sum();
    let data_bytes: u64 = g.tensors().iter().map(|t| t.n_bytes).sum();
    let mut stored_bytes = BTreeMap::new();
    let mut projection: BTreeMap<u32, u64> = BTreeMap::new();
    let slots = arch::expected_tensors(&spec);
    for p in &plan {
        let Some(t) = g.tensor(&p.gguf_name) else {
            continue;
        };
        // The name the pipeline knows the tensor by (LFM2's `feed_forward.w1` is
        // `mlp.gate_proj`).
        let name = arch::canonical_name(spec.architecture, &p.hf_name);
        if slots
            .iter()
            .any(|s| s.name == name && s.role.is_projection())
        {
            *projection.entry(t.type_id).or_default() += t.numel() as u64;
        }
        stored_bytes.insert(name, t.n_bytes);
    }
    let projection_type = projection
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .and_then(|(id, _)| type_bits(id).map(|b| (type_name(id), b)));
    Ok(HeaderInfo {
        path: g.path().to_path_buf(),
        spec,
        file_size: g.file_size(),
        truncated_at: g.truncated_at(),
        tensor_types,
        parameters,
        data_bytes,
        bits_per_weight: if parameters == 0 {
            0.0
        } else {
            data_bytes as f64 * 8.0 / parameters as f64
        },
        projection_type,
        stored_bytes,
    })
}
