//! The embedded Python: where its virtual environment is, the one thread that enters the
//! interpreter, and loading a bridge module compiled into the binary. The two bridges use it:
//! `emit` (coremltools, coreai-core's authoring side) and `aimodel` (coreai-core's runtime).
//!
//! CPython is embedded through pyo3. A bridge module is loaded from its source text, so the tool
//! works from any directory; the venv is found by [`PythonEnv::discover`] and added with
//! `site.addsitedir`.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyModule;
use thiserror::Error;

use crate::error::EnvironmentError;

/// The pinned requirements of the bridges' environment, compiled in so the hint can name them.
const REQUIREMENTS: &str = include_str!("../../../python/requirements.txt");

/// How to make an environment the bridge can use, outside a checkout as well as inside one:
/// the pinned coremltools, numpy and coreai-core, where hf2coreml looks, and how to point it elsewhere.
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
         pinned packages: `{python} -m venv ENV && ENV/bin/pip install {} {} {}` (in a checkout, \
         `make setup` does this and links it as ./.venv); then give `--python-env ENV` or set \
         HF2COREML_PYTHON_ENV=ENV (hf2coreml looks at --python-env, HF2COREML_PYTHON_ENV, \
         VIRTUAL_ENV, then ./.venv)",
        pin("coremltools"),
        pin("numpy"),
        pin("coreai-core")
    )
}

/// What can go wrong before a bridge runs, or while it does.
#[derive(Debug, Error)]
pub enum PyEnvError {
    /// No usable Python environment; carries the marker that makes the binary exit 3.
    #[error("Python environment unusable")]
    Environment(#[source] EnvironmentError),
    /// Python raised.
    #[error("{stage}: {message}")]
    Python { stage: String, message: String },
}

impl PyEnvError {
    pub(crate) fn env(message: String) -> Self {
        PyEnvError::Environment(EnvironmentError {
            message,
            fix: setup_hint(),
        })
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

/// A Python virtual environment holding coremltools and coreai-core.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PythonEnv {
    pub root: PathBuf,
    pub origin: EnvOrigin,
}

impl PythonEnv {
    /// Find the environment: `--python-env`, then `HF2COREML_PYTHON_ENV`, `$VIRTUAL_ENV`,
    /// `./.venv`. An explicitly named environment that does not exist is an error, not a
    /// reason to look further.
    pub fn discover(flag: Option<&Path>) -> Result<Self, PyEnvError> {
        Self::discover_with(flag, |k| std::env::var_os(k), Path::new(".venv"))
    }

    fn discover_with(
        flag: Option<&Path>,
        env: impl Fn(&str) -> Option<std::ffi::OsString>,
        dot_venv: &Path,
    ) -> Result<Self, PyEnvError> {
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
                return Err(PyEnvError::env(format!(
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
        Err(PyEnvError::env(
            "no Python environment with coremltools found (looked at --python-env, \
             HF2COREML_PYTHON_ENV, VIRTUAL_ENV and ./.venv)"
                .into(),
        ))
    }

    /// The venv's site-packages for the interpreter version this binary embeds.
    fn site_packages(&self, major: u8, minor: u8) -> Result<PathBuf, PyEnvError> {
        let p = self
            .root
            .join("lib")
            .join(format!("python{major}.{minor}"))
            .join("site-packages");
        if p.is_dir() {
            return Ok(p);
        }
        Err(PyEnvError::env(format!(
            "{} has no lib/python{major}.{minor}/site-packages; hf2coreml embeds Python \
             {major}.{minor}, so the environment must be built with that version",
            self.root.display()
        )))
    }
}

/// `python3.X`, the interpreter this binary embeds (its venv must match it).
pub fn embedded_python() -> String {
    on_python_thread(|| {
        Python::initialize();
        Python::attach(|py| {
            let v = py.version_info();
            format!("python{}.{}", v.major, v.minor)
        })
    })
}

pub fn py_message(py: Python<'_>, e: &PyErr) -> String {
    let mut msg = e.to_string();
    if let Some(tb) = e.traceback(py) {
        if let Ok(t) = tb.format() {
            msg = format!("{msg}\n{}", t.trim_end());
        }
    }
    msg
}

/// The error Python raised in `stage`, with its traceback.
pub fn python_err(py: Python<'_>, stage: &str, e: PyErr) -> PyEnvError {
    PyEnvError::Python {
        stage: stage.to_string(),
        message: py_message(py, &e),
    }
}

/// A bridge module compiled into the binary: its source, the file name its tracebacks show, and
/// the packages whose import `check_environment()` proves (for the error when it fails).
#[derive(Debug, Clone, Copy)]
pub struct Bridge {
    pub source: &'static str,
    pub file: &'static str,
    pub name: &'static str,
    pub needs: &'static str,
}

/// Bring up the interpreter's path to the venv, load `bridge` and run its
/// `check_environment()`: an ImportError there means the environment lacks `bridge.needs`.
pub fn load_bridge<'py>(
    py: Python<'py>,
    env: &PythonEnv,
    bridge: Bridge,
) -> Result<Bound<'py, PyModule>, PyEnvError> {
    let vi = py.version_info();
    let site_packages = env.site_packages(vi.major, vi.minor)?;
    py.import("site")
        .and_then(|site| site.call_method1("addsitedir", (site_packages.to_string_lossy(),)))
        .map_err(|e| python_err(py, "adding the environment's site-packages", e))?;
    let nul = || PyEnvError::Python {
        stage: "loading the bridge module".into(),
        message: "its source contains a NUL byte".into(),
    };
    let code = CString::new(bridge.source).map_err(|_| nul())?;
    let file = CString::new(bridge.file).map_err(|_| nul())?;
    let name = CString::new(bridge.name).map_err(|_| nul())?;
    let module = PyModule::from_code(py, &code, &file, &name)
        .map_err(|e| python_err(py, "loading the bridge module", e))?;
    match module.call_method0("check_environment") {
        Ok(_) => Ok(module),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyImportError>(py) => {
            Err(PyEnvError::env(format!(
                "cannot import {} from {}: {}",
                bridge.needs,
                env.root.display(),
                e
            )))
        }
        Err(e) => Err(python_err(py, &format!("importing {}", bridge.needs), e)),
    }
}

/// Run `f` on the one thread that ever enters the embedded interpreter. CPython itself
/// supports calls from many threads, but coremltools' C++ extensions crash (seen in
/// `_PyFrame_InitializeSpecials` under `libmilstoragepython`) when successive conversions
/// enter from different threads, as `batch --jobs N` does. One long-lived thread (with a
/// main-thread-sized stack: the MIL builder recurses deeply) sidesteps that.
pub fn on_python_thread<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
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

/// Held while the bridge runs: it points file descriptors 1 and 2 at a capture file, so
/// anything another thread prints meanwhile would vanish into it.
pub static PYTHON_HOLDS_STDERR: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `f` (which prints) when no emit has stdout/stderr redirected; for callers that print
/// from threads while another thread may be emitting.
pub fn when_output_is_ours<R>(f: impl FnOnce() -> R) -> R {
    let _guard = PYTHON_HOLDS_STDERR
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f()
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
        let PyEnvError::Environment(e) = err else {
            panic!("expected an environment error, got {err}");
        };
        assert_eq!(e.fix, setup_hint());
        assert!(
            e.fix.contains("pip install coremltools==9.0 numpy=="),
            "{}",
            e.fix
        );
        assert!(e.fix.contains("coreai-core=="), "{}", e.fix);
        assert!(e.fix.contains("HF2COREML_PYTHON_ENV=ENV"), "{}", e.fix);
        let err =
            PythonEnv::discover_with(Some(Path::new("/nonexistent/env")), no_env, Path::new("."))
                .unwrap_err();
        assert!(chain(&err).contains("/nonexistent/env"), "{}", chain(&err));
    }

    /// An error and its causes, as the binary prints them.
    fn chain(e: &PyEnvError) -> String {
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
