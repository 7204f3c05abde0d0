//! Hostile inputs through the binary, by what they attack: checkpoints, GGUF files, packages,
//! outputs, the options of a run, the terminal; and killed runs (`interrupts`). (The memory
//! bound of `convert` and `validate` is tests/it's convert::memory, the inputs that once crashed
//! a fuzz target are replayed by its `fuzz`.)
//!
//! Every case runs under a timeout with its peak memory measured (wait4's ru_maxrss of that
//! one child): it must exit with the documented code, never panic, abort or hang, stay under
//! 1 GiB, and leave nothing behind. The hostile inputs are built in code.
//!
//! A test binary of its own, beside tests/it: on Linux a child's ru_maxrss starts from the peak
//! resident size of the process that spawned it (exec keeps the old address space's high-water
//! mark), and tests/it grows to about 1 GiB (the real model's reference runs in it), which would
//! be measured as every child's peak. So nothing here may grow this process: inputs are small
//! or written piece by piece, and a test that builds a large input in process belongs in
//! tests/it. (The chat template's sandbox is a third binary, tests/chat_template_files.rs: it
//! changes the process's working directory.)

// tests/it's support module, shared: this binary uses part of it.
#[allow(dead_code, unused_imports)]
#[path = "../it/support/mod.rs"]
mod support;

mod assets;
mod batch;
mod checkpoints;
mod gguf;
mod hub;
mod interrupts;
mod numerics;
mod options;
mod outputs;
mod packages;
mod terminal;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use hf2coreml_testkit::TinyModel;

use crate::support::{cli, Cli};

/// Every case finishes well within this (the slowest, a tiny conversion, takes seconds).
const TIMEOUT: Duration = Duration::from_secs(120);
/// The acceptance bound on peak RSS for packages whose files total under 300 MB.
const MAX_RSS_BYTES: u64 = 1 << 30;

struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    max_rss: u64,
    elapsed: Duration,
}

/// Run the binary with `args` (stdout to `stdout` if given), under [`TIMEOUT`], measuring
/// the child's own peak RSS with wait4.
fn run_bin(args: &[&OsStr], stdout: Option<std::fs::File>) -> Outcome {
    run_cli(cli(args), &format!("{args:?}"), stdout)
}

/// [`run_bin`] with `env` added to the child's environment.
fn run_bin_env(args: &[&OsStr], stdout: Option<std::fs::File>, env: &[(&str, &OsStr)]) -> Outcome {
    let command = env.iter().fold(cli(args), |c, (k, v)| c.env(k, v));
    run_cli(command, &format!("{args:?}"), stdout)
}

/// [`run_bin`] of a command line built with its own environment; `what` names it in messages.
fn run_cli(command: Cli, what: &str, stdout: Option<std::fs::File>) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (dir.path().join("out"), dir.path().join("err"));
    let out_file = match stdout {
        Some(f) => f,
        None => std::fs::File::create(&out_path).unwrap(),
    };
    let started = Instant::now();
    // Reaped by wait4 below (which also gives its peak RSS), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let child = command
        .command()
        .stdin(Stdio::null())
        .stdout(out_file)
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let (status, usage) = loop {
        let mut status = 0;
        // SAFETY: rusage is plain data; wait4 fills it for our own child.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break (status, usage);
        }
        if started.elapsed() > TIMEOUT {
            // SAFETY: our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{what} hung: killed after {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Outcome {
        code,
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap(),
        max_rss: usage.ru_maxrss as u64 * 1024,
        elapsed: started.elapsed(),
    }
}

/// Top-level names in `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Expect `code`, every needle in stderr, no panic, bounded memory, and `root` unchanged.
fn expect(root: &Path, args: &[&OsStr], code: i32, needles: &[&str]) -> Outcome {
    expect_cli(root, cli(args), &format!("{args:?}"), code, needles)
}

/// [`expect`] of a command line built with its own environment; `what` names it in messages.
fn expect_cli(root: &Path, command: Cli, what: &str, code: i32, needles: &[&str]) -> Outcome {
    let before = entries(root);
    let o = run_cli(command, what, None);
    assert_eq!(
        o.code,
        Some(code),
        "{what}\nstdout: {}\nstderr: {}",
        o.stdout,
        o.stderr
    );
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    for n in needles {
        assert!(o.stderr.contains(n), "`{n}` not in stderr:\n{}", o.stderr);
    }
    assert!(
        o.max_rss < MAX_RSS_BYTES,
        "peak RSS {} MiB",
        o.max_rss >> 20
    );
    assert_eq!(entries(root), before, "left behind; stderr:\n{}", o.stderr);
    o
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// A scratch root: inputs are created in it, outputs are aimed at `root/out/...`, and afterwards
/// nothing but the inputs may remain.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn out(&self) -> PathBuf {
        self.path().join("out")
    }
}

/// Run `args`, expect exit 2 and every needle in stderr (the file and the problem), within the
/// bounds of [`expect`], and the scratch root holding exactly what it held before.
fn expect_bad(s: &Scratch, args: &[&OsStr], needles: &[&str]) {
    expect(s.path(), args, 2, needles);
    assert!(!s.out().exists());
}

/// `convert CKPT -o out/m.mlpackage`, refused: see [`expect_bad`].
fn convert_refused(s: &Scratch, ckpt: &Path, needles: &[&str]) {
    let pkg = s.out().join("m.mlpackage");
    expect_bad(
        s,
        &[
            "convert".as_ref(),
            ckpt.as_os_str(),
            "-o".as_ref(),
            pkg.as_os_str(),
            "--recipe".as_ref(),
            "data-free-4bit".as_ref(),
        ],
        needles,
    );
}

/// The tiny llama checkpoint in `s/ckpt`.
fn checkpoint(s: &Scratch) -> PathBuf {
    tiny_checkpoint(s.path())
}

fn write_model(s: &Scratch, m: TinyModel) -> PathBuf {
    let dir = s.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    m.write(&dir).unwrap();
    dir
}

/// The tiny llama checkpoint in `root/ckpt`.
fn tiny_checkpoint(root: &Path) -> PathBuf {
    let ckpt = root.join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    TinyModel::llama().write(&ckpt).unwrap();
    ckpt
}

#[cfg(unix)]
fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}
