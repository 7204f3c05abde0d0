//! The one place that writes to the terminal's stderr: the output mode (`--quiet`,
//! `--verbose`), notes, details and progress bars (hidden when stderr is not a terminal).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

static QUIET: AtomicBool = AtomicBool::new(false);
static VERBOSE: AtomicBool = AtomicBool::new(false);
static BARS_OFF: AtomicBool = AtomicBool::new(false);

/// The process-wide output mode, set once from `--quiet` / `--verbose`.
pub fn set_output_mode(quiet: bool, verbose: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
    VERBOSE.store(verbose && !quiet, Ordering::Relaxed);
}

/// Hide progress bars from here on (e.g. while several exports run at once and their bars
/// would fight over the terminal).
pub fn disable_progress_bars() {
    BARS_OFF.store(true, Ordering::Relaxed);
}

/// `--quiet`: only results (stdout) and errors.
pub fn is_quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// `--verbose`: details on stderr.
pub fn is_verbose() -> bool {
    VERBOSE.load(Ordering::Relaxed)
}

/// A progress note on stderr (suppressed by `--quiet`).
pub fn info(message: impl std::fmt::Display) {
    if !is_quiet() {
        eprintln!("{message}");
    }
}

/// A detail on stderr, shown with `--verbose` only.
pub fn detail(message: impl std::fmt::Display) {
    if is_verbose() {
        eprintln!("{message}");
    }
}

/// True when progress bars and colours make sense: stderr is a terminal, and neither `CI`,
/// `NO_COLOR` nor `--quiet` asks for plain output.
pub fn stderr_is_terminal() -> bool {
    !is_quiet()
        && !BARS_OFF.load(Ordering::Relaxed)
        && std::io::stderr().is_terminal()
        && std::env::var_os("CI").is_none()
        && std::env::var_os("NO_COLOR").is_none()
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress_bar(len: u64, label: &str) -> indicatif::ProgressBar {
    if !stderr_is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_prefix(label.to_string());
    pb
}

/// Draws a library operation's [`Progress`](hf2coreml::progress::Progress) as one bar at a
/// time on stderr (hidden where [`progress_bar`] hides bars), and prints its notes and
/// details as [`info`] and [`detail`] do.
#[derive(Default)]
pub struct Bars {
    bar: std::sync::Mutex<Option<indicatif::ProgressBar>>,
}

impl Bars {
    fn with(&self, f: impl FnOnce(&mut Option<indicatif::ProgressBar>)) {
        // A panic elsewhere while the lock was held only loses a bar's state.
        let mut guard = self.bar.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard);
    }
}

impl hf2coreml::progress::Progress for Bars {
    fn begin(&self, label: &str, total: u64) {
        self.with(|b| {
            if let Some(old) = b.replace(progress_bar(total, label)) {
                old.finish_and_clear();
            }
        });
    }

    fn working_on(&self, what: &str) {
        self.with(|b| {
            if let Some(b) = b {
                b.set_message(what.to_string());
            }
        });
    }

    fn advance(&self, steps: u64) {
        self.with(|b| {
            if let Some(b) = b {
                b.inc(steps);
            }
        });
    }

    fn end(&self) {
        self.with(|b| {
            if let Some(b) = b.take() {
                b.finish_and_clear();
            }
        });
    }

    fn note(&self, message: &str) {
        info(message);
    }

    fn detail(&self, message: &str) {
        detail(message);
    }
}
