//! Graph → coremltools → .mlpackage. The only code that touches Python.
//!
//! CPython is embedded through pyo3. The bridge module (`python/hf2coreml_bridge.py`) is compiled
//! into the binary and loaded from its source text, so the tool works from any directory; the
//! venv holding coremltools is found by [`PythonEnv::discover`] and added with
//! `site.addsitedir`. Constants cross as numpy arrays that take ownership of the Rust buffers
//! (no copy on the Rust side). The package is written into an [`AtomicDir`] beside the
//! destination and renamed into place only when complete.

mod functions;
pub mod metadata;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};

use half::f16;
use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule, PyTuple};
use thiserror::Error;

use crate::error::EnvironmentError;
use crate::fsutil::AtomicDir;
use crate::graph::{ConstData, Graph};
use crate::mil::contract::Target;
use crate::mil::DType;

pub use functions::emit_functions;
pub use metadata::Metadata;

/// The bridge module's source, compiled in.
const BRIDGE_SOURCE: &str = include_str!("../../python/hf2coreml_bridge.py");
const BRIDGE_NAME: &str = "hf2coreml_bridge";

/// The pinned requirements of the bridge's environment, compiled in so the hint can name them.
const REQUIREMENTS: &str = include_str!("../../python/requirements.txt");

/// How to make an environment the bridge can use, outside a checkout as well as inside one:
/// the pinned coremltools and numpy, where hf2coreml looks, and how to point it elsewhere.
pub fn setup_hint() -> String {
    let pin = |name: &str| {
        REQUIREMENTS
            .lines()
            .find(|l| l.starts_with(&format!("{name}==")))
            .unwrap_or(name)
            .to_string()
    };
    let python = embedded_python();
    format!(
        "create a virtual environment with {python} (the Python this binary embeds) and the \
         pinned packages: `{python} -m venv ENV && ENV/bin/pip install {} {}` (in a checkout, \
         `make setup` does this and links it as ./.venv); then give `--python-env ENV` or set \
         HF2COREML_PYTHON_ENV=ENV (hf2coreml looks at --python-env, HF2COREML_PYTHON_ENV, \
         VIRTUAL_ENV, then ./.venv)",
        pin("coremltools"),
        pin("numpy")
    )
}

/// Everything that can go wrong while emitting.
#[derive(Debug, Error)]
pub enum EmitError {
    /// No usable Python environment; carries the marker that makes the binary exit 3.
    #[error("Python environment unusable")]
    Environment(#[source] EnvironmentError),
    /// Python raised while building, converting or saving.
    #[error("coremltools failed while {stage}: {message}")]
    Python { stage: String, message: String },
    #[error("graph is invalid: {0}")]
    Graph(#[from] crate::graph::GraphError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the bridge returned an unexpected result: {0}")]
    Protocol(String),
}

impl EmitError {
    fn env(message: String) -> Self {
        EmitError::Environment(EnvironmentError {
            message,
            fix: setup_hint(),
        })
    }

    fn io(path: &Path, source: std::io::Error) -> Self {
        EmitError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Where the environment was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvOrigin {
    Flag,
    Hf2coremlPythonEnv,
    VirtualEnv,
    DotVenv,
}

/// A Python virtual environment holding coremltools.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PythonEnv {
    pub root: PathBuf,
    pub origin: EnvOrigin,
}

impl PythonEnv {
    /// Find the environment: `--python-env`, then `HF2COREML_PYTHON_ENV`, `$VIRTUAL_ENV`,
    /// `./.venv`. An explicitly named environment that does not exist is an error, not a
    /// reason to look further.
    pub fn discover(flag: Option<&Path>) -> Result<Self, EmitError> {
        Self::discover_with(flag, |k| std::env::var_os(k), Path::new(".venv"))
    }

    fn discover_with(
        flag: Option<&Path>,
        env: impl Fn(&str) -> Option<std::ffi::OsString>,
        dot_venv: &Path,
    ) -> Result<Self, EmitError> {
        let candidates = [
            (flag.map(Path::to_path_buf), EnvOrigin::Flag, "--python-env"),
            (
                env("HF2COREML_PYTHON_ENV").map(PathBuf::from),
                EnvOrigin::Hf2coremlPythonEnv,
                "HF2COREML_PYTHON_ENV",
            ),
            (
                env("VIRTUAL_ENV").map(PathBuf::from),
                EnvOrigin::VirtualEnv,
                "VIRTUAL_ENV",
            ),
        ];
        for (path, origin, what) in candidates {
            let Some(root) = path.filter(|p| !p.as_os_str().is_empty()) else {
                continue;
            };
            if !root.is_dir() {
                return Err(EmitError::env(format!(
                    "{what} points at {}, which is not a directory",
                    root.display()
                )));
            }
            return Ok(PythonEnv { root, origin });
        }
        if dot_venv.is_dir() {
            return Ok(PythonEnv {
                root: dot_venv.to_path_buf(),
                origin: EnvOrigin::DotVenv,
            });
        }
        Err(EmitError::env(
            "no Python environment with coremltools found (looked at --python-env, \
             HF2COREML_PYTHON_ENV, VIRTUAL_ENV and ./.venv)"
                .into(),
        ))
    }

    /// The venv's site-packages for the interpreter version this binary embeds.
    fn site_packages(&self, major: u8, minor: u8) -> Result<PathBuf, EmitError> {
        let p = self
            .root
            .join("lib")
            .join(format!("python{major}.{minor}"))
            .join("site-packages");
        if p.is_dir() {
            return Ok(p);
        }
        Err(EmitError::env(format!(
            "{} has no lib/python{major}.{minor}/site-packages; hf2coreml embeds Python \
             {major}.{minor}, so the environment must be built with that version",
            self.root.display()
        )))
    }
}

/// `python3.X`, the interpreter this binary embeds (its venv must match it).
fn embedded_python() -> String {
    on_python_thread(|| {
        Python::initialize();
        Python::attach(|py| {
            let v = py.version_info();
            format!("python{}.{}", v.major, v.minor)
        })
    })
}

/// What a finished emit reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EmitReport {
    pub package: PathBuf,
    pub coremltools_version: String,
    pub specification_version: i64,
    /// Ops in the saved program by type (after coremltools' passes).
    pub op_counts: BTreeMap<String, usize>,
    pub python_env: PythonEnv,
}

fn py_message(py: Python<'_>, e: &PyErr) -> String {
    let mut msg = e.to_string();
    if let Some(tb) = e.traceback(py) {
        if let Ok(t) = tb.format() {
            msg = format!("{msg}\n{}", t.trim_end());
        }
    }
    msg
}

fn python_err(py: Python<'_>, stage: &str, e: PyErr) -> EmitError {
    EmitError::Python {
        stage: stage.to_string(),
        message: py_message(py, &e),
    }
}

/// Bring up the interpreter, add the venv, load the bridge and check coremltools imports.
fn load_bridge<'py>(py: Python<'py>, env: &PythonEnv) -> Result<Bound<'py, PyModule>, EmitError> {
    let vi = py.version_info();
    let site_packages = env.site_packages(vi.major, vi.minor)?;
    py.import("site")
        .and_then(|site| site.call_method1("addsitedir", (site_packages.to_string_lossy(),)))
        .map_err(|e| python_err(py, "adding the environment's site-packages", e))?;
    let code = CString::new(BRIDGE_SOURCE)
        .map_err(|_| EmitError::Protocol("bridge source contains a NUL byte".into()))?;
    let file = CString::new("hf2coreml_bridge.py").expect("literal has no NUL");
    let name = CString::new(BRIDGE_NAME).expect("literal has no NUL");
    let module = PyModule::from_code(py, &code, &file, &name)
        .map_err(|e| python_err(py, "loading the bridge module", e))?;
    match module.call_method0("check_environment") {
        Ok(_) => Ok(module),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyImportError>(py) => {
            Err(EmitError::env(format!(
                "cannot import coremltools/numpy from {}: {}",
                env.root.display(),
                e
            )))
        }
        Err(e) => Err(python_err(py, "importing coremltools", e)),
    }
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

/// Serialize `graph` as an iOS17 package at `dest` (a `.mlpackage` path). The graph is
/// consumed: its buffers move into numpy arrays. With `force`, an existing `dest` is replaced
/// once the new package is complete; without it, an existing `dest` is refused up front.
/// Run `f` on the one thread that ever enters the embedded interpreter. CPython itself
/// supports calls from many threads, but coremltools' C++ extensions crash (seen in
/// `_PyFrame_InitializeSpecials` under `libmilstoragepython`) when successive conversions
/// enter from different threads, as `batch --jobs N` does. One long-lived thread (with a
/// main-thread-sized stack: the MIL builder recurses deeply) sidesteps that.
fn on_python_thread<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    // Already there (an error built inside a job asks for the interpreter's version): run
    // inline, since waiting for the queue from its own thread would never return.
    if std::thread::current().name() == Some("python") {
        return f();
    }
    type Job = Box<dyn FnOnce() + Send>;
    static QUEUE: std::sync::OnceLock<Mutex<Option<mpsc::Sender<Job>>>> =
        std::sync::OnceLock::new();
    let queue = QUEUE.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("python".into())
            .stack_size(64 << 20)
            .spawn(move || {
                for job in rx {
                    job();
                }
            });
        Mutex::new(spawned.ok().map(|_| tx))
    });
    let guard = queue
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // No thread could be started (resource limits): run here, as a single caller may.
    let Some(tx) = guard.as_ref() else {
        drop(guard);
        return f();
    };
    let (done_tx, done_rx) = mpsc::sync_channel(1);
    let job: Job = Box::new(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        // Python (or a module it imported) may have taken over SIGINT: Ctrl-C during the
        // Rust stages that follow must still stop the run.
        crate::fsutil::reassert_interrupt_handlers();
        let _ = done_tx.send(r);
    });
    let sent = tx.send(job);
    drop(guard);
    // The thread catches every panic, so it outlives every job.
    assert!(sent.is_ok(), "the Python thread has ended");
    match done_rx.recv() {
        Ok(Ok(r)) => r,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("the Python thread dropped a job"),
    }
}

/// The constants as the bridge takes them: `dense` (name → fp16 bits or int32) and `luts`
/// (name → (packed uint8 indices, LUT bits) for iOS17; (unpacked indices, LUT bits, row-scale
/// bits or None) for iOS18, whose uintN packing coremltools does itself).
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
            ConstData::Lut(p) if target == Target::Ios18 => {
                luts.set_item(&c.name, lut18(p.indices(numel), p.lut, None)?)?
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

/// Held while the bridge runs: it points file descriptors 1 and 2 at a capture file, so
/// anything another thread prints meanwhile would vanish into it.
static PYTHON_HOLDS_STDERR: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `f` (which prints) when no emit has stdout/stderr redirected; for callers that print
/// from threads while another thread may be emitting.
pub fn when_output_is_ours<R>(f: impl FnOnce() -> R) -> R {
    let _guard = PYTHON_HOLDS_STDERR
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f()
}

/// Where the bridge points Python's `tempfile` (its `SCRATCH_NAME`), inside the package's
/// partial directory.
pub const COREMLTOOLS_SCRATCH: &str = ".coremltools-tmp";

pub fn emit(
    graph: Graph,
    meta: &Metadata,
    env: &PythonEnv,
    dest: &Path,
    force: bool,
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
    emit_described(program, meta, env, dest, force)
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
    dest: &Path,
    force: bool,
) -> Result<EmitReport, EmitError> {
    let Described {
        desc,
        consts,
        target,
        float,
    } = program;
    let out = AtomicDir::new(dest, force).map_err(|e| EmitError::io(dest, e))?;
    let meta_json = serde_json::to_string(meta).map_err(|e| EmitError::Protocol(e.to_string()))?;
    let precision = match float {
        DType::F32 => "fp32",
        _ => "fp16",
    };
    let work = out.path().to_path_buf();
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
    })?;
    // coremltools saves to a path ending in .mlpackage; lift its contents into the atomic dir
    // so the rename below is the only step that makes a package appear under `dest`.
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
    let package = out.commit().map_err(|e| EmitError::io(dest, e))?;
    Ok(EmitReport {
        package,
        coremltools_version: result.0,
        specification_version: result.1,
        op_counts: result.2,
        python_env: env.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn no_env(_: &str) -> Option<OsString> {
        None
    }

    #[test]
    fn discovery_order() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let missing = Path::new("/nonexistent/.venv");
        let env = |k: &str| match k {
            "HF2COREML_PYTHON_ENV" => Some(OsString::from(b.path())),
            "VIRTUAL_ENV" => Some(OsString::from(a.path())),
            _ => None,
        };
        let e = PythonEnv::discover_with(Some(a.path()), env, missing).unwrap();
        assert_eq!(e.origin, EnvOrigin::Flag);
        let e = PythonEnv::discover_with(None, env, missing).unwrap();
        assert_eq!(
            (e.origin, e.root.as_path()),
            (EnvOrigin::Hf2coremlPythonEnv, b.path())
        );
        let only_virtual = |k: &str| (k == "VIRTUAL_ENV").then(|| OsString::from(a.path()));
        let e = PythonEnv::discover_with(None, only_virtual, missing).unwrap();
        assert_eq!(e.origin, EnvOrigin::VirtualEnv);
        let e = PythonEnv::discover_with(None, no_env, a.path()).unwrap();
        assert_eq!(e.origin, EnvOrigin::DotVenv);
    }

    #[test]
    fn missing_environment_is_an_environment_error() {
        let err =
            PythonEnv::discover_with(None, no_env, Path::new("/nonexistent/.venv")).unwrap_err();
        let EmitError::Environment(e) = err else {
            panic!("expected an environment error, got {err}");
        };
        assert_eq!(e.fix, setup_hint());
        assert!(
            e.fix.contains("pip install coremltools==9.0 numpy=="),
            "{}",
            e.fix
        );
        assert!(e.fix.contains("HF2COREML_PYTHON_ENV=ENV"), "{}", e.fix);
        let err =
            PythonEnv::discover_with(Some(Path::new("/nonexistent/env")), no_env, Path::new("."))
                .unwrap_err();
        assert!(chain(&err).contains("/nonexistent/env"), "{}", chain(&err));
    }

    /// An error and its causes, as the binary prints them.
    fn chain(e: &EmitError) -> String {
        std::iter::successors(Some(e as &dyn std::error::Error), |c| c.source())
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(": ")
    }

    #[test]
    fn wrong_python_version_names_the_expected_directory() {
        let root = tempfile::tempdir().unwrap();
        let env = PythonEnv {
            root: root.path().to_path_buf(),
            origin: EnvOrigin::Flag,
        };
        let err = env.site_packages(3, 99).unwrap_err();
        assert!(chain(&err).contains("python3.99"), "{}", chain(&err));
    }
}
