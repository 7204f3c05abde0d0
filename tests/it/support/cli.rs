//! The binary as the tests run it: one place for its path and for the environment it sees.
//!
//! Every run starts from the test runner's environment with `CI` and `NO_COLOR` removed: both
//! only decide whether progress bars and colours are drawn on a terminal, so without them what
//! the binary prints depends on where its stderr goes (a pipe in every test but the terminal
//! ones), not on whether the runner happens to be a CI machine. Anything else a run needs is
//! asked for by name: [`Cli::python`], [`Cli::cache`], [`Cli::current_dir`], [`Cli::env`].

use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::process::{Command, Output};

/// The binary under test, built by cargo beside this test binary.
pub const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");

/// `hf2coreml ARGS` run to its end in the shared environment.
pub fn hf2coreml<S: AsRef<OsStr>>(args: &[S]) -> Output {
    cli(args).output()
}

/// `hf2coreml ARGS` to run with options.
pub fn cli<S: AsRef<OsStr>>(args: &[S]) -> Cli {
    Cli::new().args(args)
}

/// `hf2coreml convert SRC -o OUT` with the Python environment: add flags, then run it.
pub fn convert(src: impl AsRef<OsStr>, out: impl AsRef<OsStr>) -> Cli {
    cli(&[
        "convert".as_ref(),
        src.as_ref(),
        "-o".as_ref(),
        out.as_ref(),
    ])
    .python()
}

/// A command line of the binary, built like [`Command`] but by value.
pub struct Cli {
    cmd: Command,
    args: Vec<OsString>,
}

impl Default for Cli {
    fn default() -> Self {
        Self::new()
    }
}

impl Cli {
    /// The binary with no arguments, in the shared environment (see the module's notes).
    pub fn new() -> Self {
        let mut cmd = Command::new(BIN);
        cmd.env_remove("CI").env_remove("NO_COLOR");
        Cli {
            cmd,
            args: Vec::new(),
        }
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.cmd.arg(arg.as_ref());
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for a in args {
            self = self.arg(a);
        }
        self
    }

    /// The Python environment with coremltools (`HF2COREML_PYTHON_ENV`, as `make test` sets
    /// it, or the repository's `.venv`), given as `HF2COREML_PYTHON_ENV`; `VIRTUAL_ENV` is
    /// removed so that nothing else is consulted. A test that calls this starts with
    /// `needs!(Python)`.
    pub fn python(self) -> Self {
        self.env("HF2COREML_PYTHON_ENV", hf2coreml_testkit::python_env())
            .env_remove("VIRTUAL_ENV")
    }

    /// `HF2COREML_CACHE`: where imported GGUF files are cached.
    pub fn cache(self, dir: impl AsRef<Path>) -> Self {
        self.env("HF2COREML_CACHE", dir.as_ref())
    }

    pub fn current_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.cmd.current_dir(dir);
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.cmd.env(key, value);
        self
    }

    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> Self {
        self.cmd.env_remove(key);
        self
    }

    /// Run to the end, stdout and stderr captured, stdin closed.
    pub fn output(mut self) -> Output {
        self.cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"))
    }

    /// Run to the end and require exit 0; the panic shows the command line and both streams.
    pub fn ok(self) -> Output {
        let line = self.line();
        let o = self.output();
        assert!(o.status.success(), "hf2coreml {line}\n{}", report(&o));
        o
    }

    /// The configured [`Command`], for a test that spawns it (signals, terminals, memory).
    pub fn command(self) -> Command {
        self.cmd
    }

    /// The arguments as typed, for messages.
    fn line(&self) -> String {
        let args: Vec<_> = self.args.iter().map(|a| a.to_string_lossy()).collect();
        args.join(" ")
    }
}

/// stdout, lossily decoded.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr, lossily decoded.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit code and both streams, for assertion messages.
pub fn report(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        stdout(o),
        stderr(o)
    )
}

/// Bad input: exit 2, no panic, and every needle in stderr.
pub fn assert_refused(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
}

/// Copy the directory `from` (a package, a checkpoint) to `to`, created if missing.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    hf2coreml::fsutil::copy_tree(from, to)
        .unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), to.display()));
}
