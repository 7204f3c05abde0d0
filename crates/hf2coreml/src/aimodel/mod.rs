//! `.aimodel` assets (Apple's Core AI, iOS / macOS 27) read back and executed by Apple's own
//! runtime, the one `coreai-core` carries for Linux. One [`Session`] per command: the asset's
//! files are checked ([`check_asset`]), then a child process running the bridge
//! (`python/hf2coreml_coreai.py`, `serve`) loads it once and runs one of its functions per step
//! (`worker.rs`): whatever the runtime does to a bad asset ends that process, not the command.
//!
//! This is the judge of a graph that hf2coreml did not write itself: `run` and `validate` use
//! it for `.aimodel` assets, and `validate --cross-check coreai` sets it beside the MIL
//! interpreter.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::f16;
use thiserror::Error;

use crate::mil::contract::{self, Contract};
use crate::pyenv::{Bridge, PyEnvError};

mod check;
mod session;
mod worker;

pub use check::{check_asset, Bytecode, CheckedAsset};
pub use session::{FunctionDesc, InputDesc, Session};

/// The Core AI bridge, compiled in: the same module authors assets (`emit::coreai`).
pub const BRIDGE: Bridge = Bridge {
    source: include_str!("../../../../python/hf2coreml_coreai.py"),
    file: "hf2coreml_coreai.py",
    name: "hf2coreml_coreai",
    needs: "coreai (coreai-core)",
};

/// The file Core AI writes beside each function's bytecode: the asset's metadata, where the
/// contract is kept under `userDefined`.
pub const METADATA_FILE: &str = "metadata.json";

/// The largest metadata file read (a contract is a few kilobytes).
const MAX_METADATA_BYTES: u64 = 16 << 20;

/// Whether `path` is meant as an `.aimodel` asset: a directory named `*.aimodel`, or one that
/// holds Core AI's files (its metadata, a function's bytecode or hash) and neither an ML
/// package's manifest nor a chain file. Whether the asset is whole is [`check_asset`]'s to say, so a damaged one is
/// reported as an asset, not as a package without its manifest.
pub fn is_aimodel(path: &Path) -> bool {
    let other = |name: &str| std::fs::symlink_metadata(path.join(name)).is_ok();
    if !path.is_dir() || other("Manifest.json") || other(crate::mil::chain_file::CHAIN_FILE) {
        return false;
    }
    if path.extension().is_some_and(|x| x == "aimodel") {
        return true;
    }
    std::fs::read_dir(path).is_ok_and(|entries| {
        entries.flatten().take(1024).any(|e| {
            let name = e.file_name();
            let p = Path::new(&name);
            name == METADATA_FILE || p.extension().is_some_and(|x| x == "mlirb" || x == "hash")
        })
    })
}

#[derive(Debug, Error)]
pub enum AimodelError {
    #[error("{path}: {msg}")]
    Asset { path: PathBuf, msg: String },
    #[error("{path}: Apple's Core AI runtime failed while {stage}: {message}")]
    Runtime {
        path: PathBuf,
        stage: String,
        message: String,
    },
    #[error(transparent)]
    Python(#[from] PyEnvError),
}

impl AimodelError {
    fn asset(path: &Path, msg: impl Into<String>) -> Self {
        AimodelError::Asset {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }
}

/// The asset's metadata as Core AI wrote it, with hf2coreml's keys under `userDefined`.
#[derive(Debug, Clone)]
pub struct AssetMetadata {
    pub producer: Option<String>,
    pub user_defined: BTreeMap<String, String>,
}

/// Read `metadata.json` (bounded) and the contract it carries.
pub fn read_metadata(path: &Path) -> Result<AssetMetadata, AimodelError> {
    let file = path.join(METADATA_FILE);
    if std::fs::symlink_metadata(&file).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(AimodelError::asset(
            &file,
            "a symlink: an asset's files are its own",
        ));
    }
    let text = crate::fsutil::read_input_text(&file, MAX_METADATA_BYTES)
        .map_err(|e| AimodelError::asset(&file, e.to_string()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| AimodelError::asset(&file, format!("not JSON: {e}")))?;
    let user_defined = match v.get("userDefined") {
        None => BTreeMap::new(),
        Some(u) => serde_json::from_value(u.clone()).map_err(|e| {
            AimodelError::asset(&file, format!("`userDefined` is not a string map: {e}"))
        })?,
    };
    Ok(AssetMetadata {
        producer: v
            .get("producer")
            .and_then(|p| p.as_str())
            .map(str::to_string),
        user_defined,
    })
}

/// The contract an asset hf2coreml wrote carries in its metadata.
pub fn read_contract(path: &Path) -> Result<Contract, AimodelError> {
    let meta = read_metadata(path)?;
    let text = meta
        .user_defined
        .get(contract::METADATA_KEY)
        .ok_or_else(|| {
            AimodelError::asset(
                path,
                format!(
                    "no `{}` in its metadata: not an asset hf2coreml wrote",
                    contract::METADATA_KEY
                ),
            )
        })?;
    serde_json::from_str(text).map_err(|e| AimodelError::asset(path, format!("contract: {e}")))
}

/// A tensor crossing to or from the runtime.
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    F16(Vec<f16>, Vec<usize>),
    F32(Vec<f32>, Vec<usize>),
    I32(Vec<i32>, Vec<usize>),
}

impl Tensor {
    pub fn shape(&self) -> &[usize] {
        match self {
            Tensor::F16(_, s) | Tensor::F32(_, s) | Tensor::I32(_, s) => s,
        }
    }

    /// The values as f32 (an int tensor's values converted).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Tensor::F16(v, _) => v.iter().map(|x| x.to_f32()).collect(),
            Tensor::F32(v, _) => v.clone(),
            Tensor::I32(v, _) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// The values as fp16 (an fp16 tensor's moved, others rounded).
    pub fn to_f16(self) -> Vec<f16> {
        match self {
            Tensor::F16(v, _) => v,
            other => other.to_f32().into_iter().map(f16::from_f32).collect(),
        }
    }
}
