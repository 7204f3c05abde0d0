//! What a conversion is asked for besides the checkpoint's weights: [`ConvertOptions`], and the
//! precision the program computes in.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use super::convert_summary::Inputs;
use crate::emit::PythonEnv;
use crate::graph::decoder::StepOptions;
use crate::graph::scaling::{ActivationRanges, Scaling};
use crate::mil::contract::{self, Target};
use crate::mil::DType;

/// Precision the program computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputePrecision {
    /// fp16 everywhere (Neural Engine, GPU and CPU).
    Fp16,
    /// fp32 program (CPU/GPU only on device): for diagnosis and models that cannot be kept in
    /// fp16 range.
    Fp32,
}

impl ComputePrecision {
    pub fn as_str(self) -> &'static str {
        match self {
            ComputePrecision::Fp16 => "fp16",
            ComputePrecision::Fp32 => "fp32",
        }
    }

    pub(super) fn dtype(self) -> DType {
        match self {
            ComputePrecision::Fp16 => DType::F16,
            ComputePrecision::Fp32 => DType::F32,
        }
    }
}

/// Everything a conversion needs besides the checkpoint's weights.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    pub checkpoint: PathBuf,
    /// The package path, ending in `.mlpackage`.
    pub output: PathBuf,
    pub max_seq_len: usize,
    pub query_len: usize,
    pub precision: ComputePrecision,
    /// Activation ranges for fp16 range safety; `None` means no scaling (recorded as such).
    pub ranges: Option<ActivationRanges>,
    pub force: bool,
    pub python_env: PythonEnv,
    /// What the package is made from, recorded in `X.report.json` (see [`Inputs`]).
    pub inputs: Option<Inputs>,
    /// sha256 of the checkpoint's files as [`super::package_files::source_hashes`] computes
    /// them, when the caller has them already (hashing an 8B checkpoint reads 16 GB); `None`:
    /// computed when the contract is written.
    pub source_hashes: Option<BTreeMap<String, String>>,
    /// Split into a chain of packages of at most this many bytes each when the model does not
    /// fit in one (docs/design.md, "Chained packages"); `None`: always one package.
    pub max_package_size: Option<u64>,
    /// The OS the package is built for.
    pub target: Target,
    /// The graph's layout (`--layout`, the recipe file's `layout`).
    pub layout: contract::Layout,
    /// How the cache is passed (`--kv-cache`, the recipe file's `kv_cache`).
    pub kv_cache: contract::KvCache,
    /// Q of a `prefill` function beside the `decode` one (iOS18 `--prefill-len`); 0: one
    /// function, `main`.
    pub prefill_len: usize,
    /// The rows of logits the prefill function returns (`--prefill-logits`).
    pub prefill_logits: contract::PrefillLogits,
    /// Gemma 4's per-layer table beside the package: the bits of its LUT indices, or `None`
    /// for fp16 rows ([`super::job::per_layer_bits`]).
    pub per_layer_bits: Option<u8>,
}

impl ConvertOptions {
    /// The checkpoint's file hashes the contract records.
    pub(super) fn source_hashes(
        &self,
        ckpt: &crate::checkpoint::Checkpoint,
    ) -> Result<BTreeMap<String, String>, super::convert_error::ConvertError> {
        match &self.source_hashes {
            Some(h) => Ok(h.clone()),
            None => super::package_files::source_hashes(ckpt),
        }
    }

    /// The graph builder's options for these settings and the chosen residual scaling (one
    /// package and every part of a chain are built with the same).
    pub(super) fn step_options(&self, scaling: &Scaling) -> StepOptions {
        StepOptions {
            max_seq_len: self.max_seq_len,
            query_len: self.query_len,
            float: self.precision.dtype(),
            scaling: scaling.clone(),
            target: self.target,
            layout: self.layout,
            kv_cache: self.kv_cache,
            last_logits_only: false,
        }
    }
}
