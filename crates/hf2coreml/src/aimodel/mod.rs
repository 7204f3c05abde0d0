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
use std::sync::Mutex;

use half::f16;
use thiserror::Error;

use crate::mil::contract::{self, Contract};
use crate::pyenv::{Bridge, PyEnvError, PythonEnv};

mod check;
mod worker;

pub use check::{check_asset, Bytecode, CheckedAsset};
use worker::Worker;

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

/// One input as the runtime describes it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct InputDesc {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: String,
}

/// One function's interface as the runtime describes it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FunctionDesc {
    pub name: String,
    pub inputs: Vec<InputDesc>,
    pub outputs: Vec<String>,
    pub states: Vec<String>,
}

/// An asset loaded by Apple's runtime, in a process of its own, for the length of a command.
pub struct Session {
    path: PathBuf,
    checked: CheckedAsset,
    worker: Mutex<Worker>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("path", &self.path).finish()
    }
}

impl Session {
    /// Check the asset's files ([`check_asset`]), then load it with the runtime in `env`, in
    /// the worker process.
    pub fn open(env: &PythonEnv, path: &Path) -> Result<Session, AimodelError> {
        let checked = check_asset(path)?;
        let bytes = checked.bytecode_bytes();
        let mut worker = Worker::spawn(env, path, bytes)?;
        worker.request(
            "loading the asset",
            serde_json::json!({"op": "open", "path": path.to_string_lossy()}),
            &[],
            Worker::load_timeout(bytes),
        )?;
        Ok(Session {
            path: path.to_path_buf(),
            checked,
            worker: Mutex::new(worker),
        })
    }

    /// What the checks of the asset's files found (its bytecode and their sha256).
    pub fn checked(&self) -> &CheckedAsset {
        &self.checked
    }

    fn request(
        &self,
        stage: &str,
        header: serde_json::Value,
        tensors: &[(String, Tensor)],
    ) -> Result<worker::Reply, AimodelError> {
        self.worker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .request(stage, header, tensors, Worker::call_timeout())
    }

    /// The functions the asset holds, each with its interface.
    pub fn functions(&self) -> Result<Vec<FunctionDesc>, AimodelError> {
        let stage = "describing its functions";
        let (reply, _) = self.request(stage, serde_json::json!({"op": "functions"}), &[])?;
        let raw: Vec<RawFunction> = serde_json::from_value(
            reply.get("functions").cloned().unwrap_or_default(),
        )
        .map_err(|e| AimodelError::Runtime {
            path: self.path.clone(),
            stage: stage.into(),
            message: format!("an unreadable description: {e}"),
        })?;
        Ok(raw
            .into_iter()
            .map(|f| FunctionDesc {
                name: f.name,
                inputs: f.inputs,
                outputs: f.outputs,
                states: f.states,
            })
            .collect())
    }

    /// Run `function` on `inputs`; its outputs by name.
    pub fn call(
        &self,
        function: &str,
        inputs: Vec<(String, Tensor)>,
    ) -> Result<BTreeMap<String, Tensor>, AimodelError> {
        self.call_timed(function, inputs).map(|(out, _)| out)
    }

    /// [`Session::call`], and the time the runtime itself took (as the worker measured it
    /// around the call): the rest of a call's time is the wall's (benches/coreai_wall.rs).
    pub fn call_timed(
        &self,
        function: &str,
        inputs: Vec<(String, Tensor)>,
    ) -> Result<(BTreeMap<String, Tensor>, std::time::Duration), AimodelError> {
        let (reply, out) = self.request(
            "running a step",
            serde_json::json!({"op": "call", "function": function}),
            &inputs,
        )?;
        let inside = reply
            .get("runtime_seconds")
            .and_then(|s| s.as_f64())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map_or(
                std::time::Duration::ZERO,
                std::time::Duration::from_secs_f64,
            );
        Ok((out.into_iter().collect(), inside))
    }
}

/// A function as the worker describes it.
#[derive(serde::Deserialize)]
struct RawFunction {
    name: String,
    inputs: Vec<InputDesc>,
    outputs: Vec<String>,
    states: Vec<String>,
}
