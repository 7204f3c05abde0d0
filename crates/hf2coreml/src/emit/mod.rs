//! Graph → coremltools → .mlpackage, and graph → coreai-core → .aimodel ([`coreai`]).
//!
//! The bridge modules (`python/hf2coreml_bridge.py`, `python/hf2coreml_coreai.py`) are compiled
//! into the binary and loaded through [`crate::pyenv`]. Constants cross as numpy arrays that take ownership of the Rust buffers
//! (no copy on the Rust side). A package is written into a directory the caller owns (the
//! [`crate::fsutil::Staged`] output it renames into place with its sidecars once complete).

pub mod coreai;
pub mod metadata;
mod multifunction;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::f16;
use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule, PyTuple};
use thiserror::Error;

use crate::error::EnvironmentError;
use crate::pyenv::{self, on_python_thread, Bridge, PyEnvError, PYTHON_HOLDS_STDERR};

use crate::graph::{ConstData, Graph};
use crate::mil::contract::Target;
use crate::mil::DType;
pub use crate::pyenv::{setup_hint, when_output_is_ours, EnvOrigin, PythonEnv};

pub use metadata::Metadata;
pub use multifunction::emit_functions;

/// The coremltools bridge, compiled in.
const BRIDGE: Bridge = Bridge {
    source: include_str!("../../../../python/hf2coreml_bridge.py"),
    file: "hf2coreml_bridge.py",
    name: "hf2coreml_bridge",
    needs: "coremltools/numpy",
};

/// Everything that can go wrong while emitting.
#[derive(Debug, Error)]
pub enum EmitError {
    /// No usable Python environment; carries the marker that makes the binary exit 3.
    #[error("Python environment unusable")]
    Environment(#[source] EnvironmentError),
    /// Python raised while building, converting or saving.
    #[error("coremltools failed while {stage}: {message}")]
    Python { stage: String, message: String },
    /// coreai-core raised while building or saving an `.aimodel`.
    #[error("coreai-core failed while {stage}: {message}")]
    CoreAi { stage: String, message: String },
    #[error("graph is invalid: {0}")]
    Graph(#[from] crate::graph::GraphError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Python failed because the file system holding the output filled up: said in one line
    /// instead of the library's traceback (coremltools reports it as "Unknown error occurred
    /// while writing data").
    #[error(
        "{}: the file system ran out of space while {stage} ({free} bytes free once Python \
         removed its temporaries): free space there and convert again",
        .dir.display()
    )]
    DiskFull {
        dir: PathBuf,
        free: u64,
        stage: String,
    },
    #[error("the bridge returned an unexpected result: {0}")]
    Protocol(String),
    /// The graph holds an op the target's bridge cannot express.
    #[error("target {} cannot express op `{op}`", target.as_str())]
    Unsupported { target: Target, op: String },
}

impl From<PyEnvError> for EmitError {
    fn from(e: PyEnvError) -> Self {
        match e {
            PyEnvError::Environment(e) => EmitError::Environment(e),
            PyEnvError::Python { stage, message } => EmitError::Python { stage, message },
        }
    }
}

impl EmitError {
    /// `self`, or [`EmitError::DiskFull`] when Python failed while the file system holding
    /// `dir` has (next to) no room left, or Python said so.
    pub(crate) fn or_disk_full(self, dir: &Path) -> Self {
        let (EmitError::Python { stage, message } | EmitError::CoreAi { stage, message }) = &self
        else {
            return self;
        };
        let free = crate::fsutil::free_bytes(dir).unwrap_or(u64::MAX);
        // ENOSPC as Python spells it, and coremltools' blob writer failing to write.
        let said = [
            "No space left on device",
            "[Errno 28]",
            "error occurred while writing data",
        ]
        .iter()
        .any(|m| message.contains(m));
        if free >= FULL_BELOW && !said {
            return self;
        }
        EmitError::DiskFull {
            dir: dir.parent().unwrap_or(dir).to_path_buf(),
            free,
            stage: stage.clone(),
        }
    }

    fn io(path: &Path, source: std::io::Error) -> Self {
        EmitError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What a finished emit reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EmitReport {
    pub package: PathBuf,
    /// Empty for a Core AI asset.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub coremltools_version: String,
    /// The coreai-core that wrote a Core AI asset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coreai_version: Option<String>,
    pub specification_version: i64,
    /// Ops in the saved program by type (after coremltools' passes).
    pub op_counts: BTreeMap<String, usize>,
    pub python_env: PythonEnv,
}

fn python_err(py: Python<'_>, stage: &str, e: PyErr) -> EmitError {
    pyenv::python_err(py, stage, e).into()
}

/// Bring up the interpreter, add the venv, load the coremltools bridge and check its imports.
fn load_bridge<'py>(py: Python<'py>, env: &PythonEnv) -> Result<Bound<'py, PyModule>, EmitError> {
    Ok(pyenv::load_bridge(py, env, BRIDGE)?)
}

/// The coremltools version in `env`, or why it cannot be used.
pub fn check_environment(env: &PythonEnv) -> Result<String, EmitError> {
    let env = env.clone();
    on_python_thread(move || {
        Python::initialize();
        let _quiet = PYTHON_HOLDS_STDERR
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Python::attach(|py| {
            let m = load_bridge(py, &env)?;
            m.call_method0("check_environment")
                .and_then(|v| v.extract::<String>())
                .map_err(|e| python_err(py, "importing coremltools", e))
        })
    })
}

/// The constants as the bridge takes them: `dense` (name → fp16 bits or int32) and `luts`
/// (name → (packed uint8 indices, LUT bits) for iOS17; (unpacked indices, LUT bits, row-scale
/// bits or None) for iOS18, whose uintN packing coremltools does itself; for Core AI, the
/// iOS18 triple with the indices packed, the bit stream its uintN constants hold: unpacked, an
/// 8B part's indices would cross at twice their size).
fn consts_to_python<'py>(
    py: Python<'py>,
    consts: Vec<crate::graph::Const>,
    target: Target,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let dense = PyDict::new(py);
    let luts = PyDict::new(py);
    // fp16 crosses as its bits (the map reuses the allocation: same layout); Python views them
    // as float16 without a copy.
    let bits = |v: Vec<f16>| -> Vec<u16> { v.into_iter().map(|x| x.to_bits()).collect() };
    let lut18 = |idx: Vec<u8>, lut: Vec<f16>, scale: Option<Vec<f16>>| {
        let scale = match scale {
            Some(s) => bits(s).into_pyarray(py).into_any(),
            None => py.None().into_bound(py),
        };
        PyTuple::new(
            py,
            [
                idx.into_pyarray(py).into_any(),
                bits(lut).into_pyarray(py).into_any(),
                scale,
            ],
        )
    };
    for c in consts {
        let numel = c.numel();
        match c.data {
            ConstData::F16(v) => dense.set_item(&c.name, bits(v).into_pyarray(py))?,
            ConstData::I32(v) => dense.set_item(&c.name, v.into_pyarray(py))?,
            ConstData::Lut(p) if target == Target::CoreAi => {
                luts.set_item(&c.name, lut18(p.packed, p.lut, None)?)?
            }
            ConstData::Lut(p) if target == Target::Ios18 => {
                luts.set_item(&c.name, lut18(p.indices(numel), p.lut, None)?)?
            }
            ConstData::GroupedLut(g) if target == Target::CoreAi => {
                luts.set_item(&c.name, lut18(g.packed, g.luts, g.row_scale)?)?
            }
            ConstData::GroupedLut(g) => {
                let idx = g.indices(numel);
                luts.set_item(&c.name, lut18(idx, g.luts, g.row_scale)?)?
            }
            ConstData::Lut(p) => {
                let pair = PyTuple::new(
                    py,
                    [
                        p.packed.into_pyarray(py).into_any(),
                        bits(p.lut).into_pyarray(py).into_any(),
                    ],
                )?;
                luts.set_item(&c.name, pair)?
            }
        }
    }
    Ok((dense, luts))
}

/// A file system with less room than this after a failed save is taken to have filled up.
const FULL_BELOW: u64 = 1 << 20;

/// Where the bridge points Python's `tempfile` (its `SCRATCH_NAME`), inside the package's
/// partial directory.
pub const COREMLTOOLS_SCRATCH: &str = ".coremltools-tmp";

/// Serialize `graph` as a package's contents in `into`, an empty directory. The graph is
/// consumed: its buffers move into numpy arrays.
pub fn emit(
    graph: Graph,
    meta: &Metadata,
    env: &PythonEnv,
    into: &Path,
) -> Result<EmitReport, EmitError> {
    graph.validate()?;
    let desc = serde_json::to_string(&graph.description())
        .map_err(|e| EmitError::Protocol(e.to_string()))?;
    let program = Described {
        desc,
        consts: graph.consts,
        target: graph.target,
        float: graph.float,
    };
    emit_described(program, meta, env, into)
}

/// A program as it crosses to Python: its description (one graph's, or several functions')
/// and the constants it hands over, once each.
struct Described {
    desc: String,
    consts: Vec<crate::graph::Const>,
    target: Target,
    float: DType,
}

fn emit_described(
    program: Described,
    meta: &Metadata,
    env: &PythonEnv,
    into: &Path,
) -> Result<EmitReport, EmitError> {
    let Described {
        desc,
        consts,
        target,
        float,
    } = program;
    let meta_json = serde_json::to_string(meta).map_err(|e| EmitError::Protocol(e.to_string()))?;
    let precision = match float {
        DType::F32 => "fp32",
        _ => "fp16",
    };
    let work = into.to_path_buf();
    let env_owned = env.clone();
    let work_py = work.clone();
    let result = on_python_thread(move || {
        let env = &env_owned;
        let work = work_py;
        Python::initialize();
        let _quiet = PYTHON_HOLDS_STDERR
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Python::attach(
            |py| -> Result<(String, i64, BTreeMap<String, usize>), EmitError> {
                let bridge = load_bridge(py, env)?;
                let to_py = |e: PyErr| python_err(py, "handing weights to Python", e);
                let (dense, luts) = consts_to_python(py, consts, target).map_err(to_py)?;
                let res = bridge
                    .call_method1(
                        "emit",
                        (
                            desc,
                            dense,
                            luts,
                            meta_json,
                            precision,
                            work.to_string_lossy().into_owned(),
                        ),
                    )
                    .map_err(|e| {
                        python_err(py, "building, converting and saving the program", e)
                    })?;
                let get = |k: &str| {
                    res.get_item(k)
                        .map_err(|e| EmitError::Protocol(format!("missing `{k}`: {e}")))
                };
                let version: String = get("coremltools_version")?
                    .extract()
                    .map_err(|e: PyErr| EmitError::Protocol(e.to_string()))?;
                let spec_version: i64 = get("specification_version")?
                    .extract()
                    .map_err(|e: PyErr| EmitError::Protocol(e.to_string()))?;
                let counts: BTreeMap<String, usize> = get("op_counts")?
                    .extract()
                    .map_err(|e: PyErr| EmitError::Protocol(e.to_string()))?;
                drop(res);
                // coremltools' program objects refer to each other: the weights handed over
                // are freed only when Python's cycle collector runs, which it may not do
                // before the next part of a chain is built (docs/design.md, "Streaming
                // convert").
                py.import("gc")
                    .and_then(|gc| gc.call_method0("collect"))
                    .map_err(|e| python_err(py, "freeing the program", e))?;
                Ok((version, spec_version, counts))
            },
        )
    })
    .map_err(|e| e.or_disk_full(&work))?;
    // coremltools saves to a path ending in .mlpackage; lift its contents into `into`.
    let saved = work.join("model.mlpackage");
    let entries = std::fs::read_dir(&saved).map_err(|e| EmitError::io(&saved, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| EmitError::io(&saved, e))?;
        let to = work.join(entry.file_name());
        std::fs::rename(entry.path(), &to).map_err(|e| EmitError::io(&to, e))?;
    }
    std::fs::remove_dir(&saved).map_err(|e| EmitError::io(&saved, e))?;
    // The bridge keeps coremltools' temporaries in this folder of the partial directory and
    // removes it; should it survive, it must not ship.
    let scratch = work.join(COREMLTOOLS_SCRATCH);
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch).map_err(|e| EmitError::io(&scratch, e))?;
    }
    Ok(EmitReport {
        package: work,
        coremltools_version: result.0,
        coreai_version: None,
        specification_version: result.1,
        op_counts: result.2,
        python_env: env.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_that_failed_for_want_of_space_says_so_in_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let failed = |message: &str| EmitError::Python {
            stage: "saving".into(),
            message: message.into(),
        };
        for said in [
            "Traceback ...\nRuntimeError: Unknown error occurred while writing data",
            "OSError: [Errno 28] No space left on device",
        ] {
            let e = failed(said).or_disk_full(dir.path());
            assert!(matches!(e, EmitError::DiskFull { .. }), "{e}");
            let text = e.to_string();
            assert!(text.contains("ran out of space while saving"), "{text}");
            assert!(!text.contains("Traceback"), "{text}");
        }
        // Another failure, with room left, stays what it was.
        let other = failed("ValueError: bad shape").or_disk_full(dir.path());
        assert!(matches!(other, EmitError::Python { .. }), "{other}");
    }
}
