//! `.aimodel` assets (Apple's Core AI, iOS / macOS 27) read back and executed by Apple's own
//! runtime, the one `coreai-core` carries for Linux, through the embedded Python
//! (`python/hf2coreml_coreai.py`). One [`Session`] per command: the asset is loaded once and
//! each step is one call of one of its functions.
//!
//! This is the judge of a graph that hf2coreml did not write itself: `run` and `validate` use
//! it for `.aimodel` assets, and `validate --cross-check coreai` sets it beside the MIL
//! interpreter.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::f16;
use numpy::{IntoPyArray, PyArrayDyn, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use thiserror::Error;

use crate::mil::contract::{self, Contract};
use crate::pyenv::{self, Bridge, PyEnvError, PythonEnv};

/// The Core AI bridge, compiled in: the same module authors assets (`emit::coreai`).
pub const BRIDGE: Bridge = Bridge {
    source: include_str!("../../python/hf2coreml_coreai.py"),
    file: "hf2coreml_coreai.py",
    name: "hf2coreml_coreai",
    needs: "coreai (coreai-core)",
};

/// The file Core AI writes beside each function's bytecode: the asset's metadata, where the
/// contract is kept under `userDefined`.
pub const METADATA_FILE: &str = "metadata.json";

/// The largest metadata file read (a contract is a few kilobytes).
const MAX_METADATA_BYTES: u64 = 16 << 20;

/// Whether `path` is an `.aimodel` asset: a directory holding Core AI's metadata file and at
/// least one function's bytecode (`*.mlirb`).
pub fn is_aimodel(path: &Path) -> bool {
    path.join(METADATA_FILE).is_file()
        && std::fs::read_dir(path).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "mlirb"))
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

    fn to_python<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let shape = self.shape().to_vec();
        Ok(match self {
            Tensor::F16(v, _) => {
                let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
                let arr = bits.into_pyarray(py).reshape(shape)?;
                arr.call_method1("view", ("float16",))?
            }
            Tensor::F32(v, _) => v.clone().into_pyarray(py).reshape(shape)?.into_any(),
            Tensor::I32(v, _) => v.clone().into_pyarray(py).reshape(shape)?.into_any(),
        })
    }

    fn from_python(a: &Bound<'_, PyAny>) -> PyResult<Tensor> {
        let dtype: String = a.getattr("dtype")?.getattr("name")?.extract()?;
        let shape: Vec<usize> = a.getattr("shape")?.extract()?;
        let flat = a.call_method0("ravel")?;
        Ok(match dtype.as_str() {
            "float16" => {
                let bits = flat.call_method1("view", ("uint16",))?;
                let bits = bits.cast::<PyArrayDyn<u16>>()?.to_vec()?;
                Tensor::F16(bits.into_iter().map(f16::from_bits).collect(), shape)
            }
            "float32" => Tensor::F32(flat.cast::<PyArrayDyn<f32>>()?.to_vec()?, shape),
            "int32" => Tensor::I32(flat.cast::<PyArrayDyn<i32>>()?.to_vec()?, shape),
            other => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "output of dtype {other}"
                )))
            }
        })
    }
}

/// One input as the runtime describes it.
#[derive(Debug, Clone, serde::Serialize, pyo3::FromPyObject)]
#[pyo3(from_item_all)]
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

/// An asset loaded by Apple's runtime for the length of a command.
pub struct Session {
    path: PathBuf,
    handle: Arc<Py<PyAny>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("path", &self.path).finish()
    }
}

impl Session {
    /// Load `path` with the runtime in `env`.
    pub fn open(env: &PythonEnv, path: &Path) -> Result<Session, AimodelError> {
        let (env, owned) = (env.clone(), path.to_path_buf());
        let handle = pyenv::on_python_thread(move || {
            Python::initialize();
            let _quiet = pyenv::PYTHON_HOLDS_STDERR
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Python::attach(|py| -> Result<Py<PyAny>, PyEnvError> {
                let m = pyenv::load_bridge(py, &env, BRIDGE)?;
                m.call_method1("open_session", (owned.to_string_lossy().into_owned(),))
                    .map(|s| s.unbind())
                    .map_err(|e| pyenv::python_err(py, "loading the asset", e))
            })
        });
        let handle = handle.map_err(|e| match e {
            PyEnvError::Environment(_) => AimodelError::Python(e),
            PyEnvError::Python { stage, message } => AimodelError::Runtime {
                path: path.to_path_buf(),
                stage,
                message,
            },
        })?;
        Ok(Session {
            path: path.to_path_buf(),
            handle: Arc::new(handle),
        })
    }

    /// Run `f` on the Python thread with the session object.
    fn with<R: Send + 'static>(
        &self,
        stage: &str,
        f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<R> + Send + 'static,
    ) -> Result<R, AimodelError> {
        let handle = Arc::clone(&self.handle);
        let r = pyenv::on_python_thread(move || {
            let _quiet = pyenv::PYTHON_HOLDS_STDERR
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Python::attach(|py| f(handle.bind(py)).map_err(|e| pyenv::py_message(py, &e)))
        });
        r.map_err(|message| AimodelError::Runtime {
            path: self.path.clone(),
            stage: stage.into(),
            message,
        })
    }

    /// The functions the asset holds, each with its interface.
    pub fn functions(&self) -> Result<Vec<FunctionDesc>, AimodelError> {
        self.with("describing its functions", |s| {
            let names: Vec<String> = s.call_method0("function_names")?.extract()?;
            let mut out = Vec::new();
            for name in names {
                let d = s.call_method1("describe", (name.as_str(),))?;
                out.push(FunctionDesc {
                    name,
                    inputs: d.get_item("inputs")?.extract()?,
                    outputs: d.get_item("outputs")?.extract()?,
                    states: d.get_item("states")?.extract()?,
                });
            }
            Ok(out)
        })
    }

    /// Run `function` on `inputs`; its outputs by name.
    pub fn call(
        &self,
        function: &str,
        inputs: Vec<(String, Tensor)>,
    ) -> Result<BTreeMap<String, Tensor>, AimodelError> {
        let function = function.to_string();
        self.with("running a step", move |s| {
            let py = s.py();
            let dict = PyDict::new(py);
            for (name, t) in &inputs {
                dict.set_item(name, t.to_python(py)?)?;
            }
            let out = s.call_method1("call", (function, dict))?;
            let out = out.cast::<PyDict>()?;
            let mut res = BTreeMap::new();
            for (k, v) in out.iter() {
                res.insert(k.extract::<String>()?, Tensor::from_python(&v)?);
            }
            Ok(res)
        })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.with("closing the asset", |s| s.call_method0("close").map(|_| ()));
    }
}
