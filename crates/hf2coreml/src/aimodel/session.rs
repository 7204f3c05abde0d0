//! An asset loaded by Apple's runtime for the length of a command ([`Session`]): its files
//! checked, then opened once in the worker process, its functions described and called.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::check::{check_asset, CheckedAsset};
use super::worker::{self, Worker};
use super::{AimodelError, Tensor};
use crate::pyenv::PythonEnv;

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
