//! The package contract (docs/design.md, "The package contract"): what a package's inputs and
//! outputs mean. The emitter writes it as JSON into
//! `user_defined_metadata["hf2coreml.contract"]`; the runner and `validate` read it back.
//! Plain data, shared by both sides so they cannot drift apart.

use serde::{Deserialize, Serialize};

/// The metadata key holding the contract JSON.
pub const METADATA_KEY: &str = "hf2coreml.contract";

/// Contract version 1: iOS17, one decode/chunk step, caches passed in and out.
pub const CONTRACT_VERSION: u32 = 1;

pub const INPUT_IDS: &str = "input_ids";
pub const POSITION: &str = "position";
pub const KEY_CACHE: &str = "key_cache";
pub const VALUE_CACHE: &str = "value_cache";
pub const LOGITS: &str = "logits";
pub const KEY_UPDATE: &str = "key_update";
pub const VALUE_UPDATE: &str = "value_update";

/// Name, dtype and shape of one input or output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoSpec {
    pub name: String,
    /// `int32` or `fp16` (or `fp32` for a `--compute-precision fp32` package).
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// Where the package came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Source {
    pub architecture: String,
    /// File name → sha256 hex of the checkpoint files (config.json, safetensors, tokenizer).
    pub files: std::collections::BTreeMap<String, String>,
}

/// The contract JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contract {
    pub version: u32,
    /// S: max_sequence_length; cache rows.
    pub max_seq_len: usize,
    /// Q: tokens per step.
    pub query_len: usize,
    /// L
    pub num_layers: usize,
    /// Hkv
    pub num_kv_heads: usize,
    /// D
    pub head_dim: usize,
    /// V
    pub vocab_size: usize,
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Rope settings as applied (theta, scaling), for apps that want to check.
    pub rope: serde_json::Value,
    /// The recipe actually applied (per-tensor decisions or the resolved rules).
    pub recipe: serde_json::Value,
    /// fp16 range safety: the scales folded into the weights (docs/design.md, "fp16 range safety").
    pub scaling: serde_json::Value,
    /// `fp16` or `fp32`: the precision the program computes in.
    pub compute_precision: String,
    pub source: Source,
    pub tool: String,
    pub tool_version: String,
}

impl Contract {
    /// The standard contract-v1 inputs and outputs for these dimensions.
    pub fn io(
        s: usize,
        q: usize,
        l: usize,
        hkv: usize,
        d: usize,
        v: usize,
        float: &str,
    ) -> (Vec<IoSpec>, Vec<IoSpec>) {
        let io = |name: &str, dtype: &str, shape: Vec<usize>| IoSpec {
            name: name.into(),
            dtype: dtype.into(),
            shape,
        };
        (
            vec![
                io(INPUT_IDS, "int32", vec![1, q]),
                io(POSITION, "int32", vec![1]),
                io(KEY_CACHE, float, vec![l, hkv, s, d]),
                io(VALUE_CACHE, float, vec![l, hkv, s, d]),
            ],
            vec![
                io(LOGITS, float, vec![1, q, v]),
                io(KEY_UPDATE, float, vec![l, hkv, q, d]),
                io(VALUE_UPDATE, float, vec![l, hkv, q, d]),
            ],
        )
    }
}
