//! The one place that writes to the terminal's stderr: the output mode (`--quiet`,
//! `--verbose`), notes, details and progress (bars on a terminal, a line now and then for a
//! long stage elsewhere).

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

static QUIET: AtomicBool = AtomicBool::new(false);
static VERBOSE: AtomicBool = AtomicBool::new(false);
static BARS_OFF: AtomicBool = AtomicBool::new(false);

/// Exit cleanly (code 3, one line on stderr) when writing results to stdout fails, e.g.
/// `> /dev/full`. Commands print their results with `println!`, which panics on a write
/// error; this hook turns exactly that panic, wherever it happens, into an error message and
/// exit code 3, and leaves every other panic to the default hook.
/// Outputs are committed before results are printed, so nothing is left half-written.
pub fn exit_cleanly_on_stdout_errors() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if let Some(why) = msg.strip_prefix("failed printing to stdout") {
            let why = why.trim_start_matches(": ");
            // stderr may be full too: ignore that error rather than panic inside the hook.
            let _ = writeln!(std::io::stderr(), "error: cannot write the results: {why}");
            std::process::exit(hf2coreml::error::ExitCode::Environment as i32);
        }
        default(info);
    }));
}

/// Writing a command's results to stdout failed (`> /dev/full`): exit code 3 and one line,
/// as for `println!` (see [`exit_cleanly_on_stdout_errors`]).
#[derive(Debug)]
pub struct Unwritten(pub std::io::Error);

impl std::fmt::Display for Unwritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot write the results: {}", self.0)
    }
}

impl std::error::Error for Unwritten {}

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
        eprintln!("{}", escape_controls(&message.to_string()));
    }
}

/// A warning on stderr, shown even with `--quiet` (what ended a session early).
pub fn warn(message: impl std::fmt::Display) {
    eprintln!("warning: {}", escape_controls(&message.to_string()));
}

/// A detail on stderr, shown with `--verbose` only.
pub fn detail(message: impl std::fmt::Display) {
    if is_verbose() {
        eprintln!("{}", escape_controls(&message.to_string()));
    }
}

/// `text` with the characters a terminal would act on escaped as `\u{..}`: control
/// characters other than newline and tab (ESC starts colour and cursor sequences, BEL rings)
/// and the bidirectional overrides that reorder what is shown. Messages quote names and
/// values from files (config.json, packages, batch files): a file must not be able to drive
/// the terminal.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    let acts = |c: char| {
        (c.is_control() && c != '\n' && c != '\t')
            || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
    };
    if !text.chars().any(acts) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if acts(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
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

/// A progress bar on stderr, hidden when stderr is not a terminal (see [`Lines`] for what is
/// written instead).
pub fn progress_bar(len: u64, label: &str) -> indicatif::ProgressBar {
    if !stderr_is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix:>12} [{bar:30}] {pos}/{len} {elapsed} (eta {eta}) {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .with_key(
            "eta",
            |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(&eta(s.elapsed(), s.pos(), s.len().unwrap_or(0)));
            },
        )
        .progress_chars("=> "),
    );
    pb.set_prefix(label.to_string());
    // The elapsed time moves while one long step (a decoder block) runs.
    pb.enable_steady_tick(std::time::Duration::from_millis(500));
    pb
}

/// The time left at the stage's mean pace so far: elapsed / pos × (len − pos); `?` before the
/// first step. (indicatif's own estimate weighs the last 15 s: with steps of a minute or more,
/// a calibrated 1B's decoder blocks, it decays between steps and read "eta 8w" at block 3/16.)
fn eta(elapsed: std::time::Duration, pos: u64, len: u64) -> String {
    if pos == 0 {
        return "?".to_string();
    }
    let left = elapsed.mul_f64(len.saturating_sub(pos) as f64 / pos as f64);
    format!("{:#}", indicatif::HumanDuration(left))
}

/// True when a stage reports itself as plain lines: output is wanted (no `--quiet`, one
/// export at a time) but no bar is drawn (stderr is a file or a pipe, or `CI` / `NO_COLOR`).
fn plain_progress() -> bool {
    !is_quiet() && !BARS_OFF.load(Ordering::Relaxed) && !stderr_is_terminal()
}

/// The least time between two of a stage's plain lines.
const LINE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// A stage's progress as plain lines, for a log instead of a terminal: a step that ends at
/// least [`LINE_EVERY`] after the stage began or after its last line writes one, and the end
/// of a stage that wrote any writes its total time. A short stage writes nothing; a long
/// convert shows it is moving (CI runners stop a job that prints nothing for some minutes).
struct Lines {
    label: String,
    total: u64,
    pos: u64,
    start: std::time::Instant,
    last: std::time::Instant,
    printed: bool,
}

impl Lines {
    fn new(label: &str, total: u64, now: std::time::Instant) -> Self {
        Lines {
            label: label.to_string(),
            total,
            pos: 0,
            start: now,
            last: now,
            printed: false,
        }
    }

    /// `steps` more done at `now`: the line to write, if one is due.
    fn advance(&mut self, steps: u64, now: std::time::Instant) -> Option<String> {
        self.pos = self.pos.saturating_add(steps);
        if now.duration_since(self.last) < LINE_EVERY {
            return None;
        }
        self.last = now;
        self.printed = true;
        let elapsed = now.duration_since(self.start);
        Some(format!(
            "{} {}/{}, {:#} (eta {})",
            self.label,
            self.pos,
            self.total,
            indicatif::HumanDuration(elapsed),
            eta(elapsed, self.pos, self.total)
        ))
    }

    /// The stage is over at `now`: its total time if it wrote lines and finished (an abandoned
    /// stage, an error, says nothing more: the error does).
    fn end(&self, now: std::time::Instant) -> Option<String> {
        (self.printed && self.pos >= self.total).then(|| {
            format!(
                "{} {}/{} in {:#}",
                self.label,
                self.pos,
                self.total,
                indicatif::HumanDuration(now.duration_since(self.start))
            )
        })
    }
}

/// Draws a library operation's [`Progress`](hf2coreml::progress::Progress) as one bar at a
/// time on stderr where bars are drawn, as plain lines for a long stage where they are not
/// ([`Lines`]), and prints its notes and details as [`info`] and [`detail`] do.
#[derive(Default)]
pub struct Bars {
    bar: std::sync::Mutex<Option<indicatif::ProgressBar>>,
    lines: std::sync::Mutex<Option<Lines>>,
}

impl Bars {
    fn with(&self, f: impl FnOnce(&mut Option<indicatif::ProgressBar>)) {
        f(&mut locked(&self.bar));
    }

    fn with_lines(&self, f: impl FnOnce(&mut Option<Lines>)) {
        f(&mut locked(&self.lines));
    }
}

/// A panic elsewhere while the lock was held only loses a bar's or a stage's state.
fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl hf2coreml::progress::Progress for Bars {
    fn begin(&self, label: &str, total: u64) {
        self.with(|b| {
            if let Some(old) = b.replace(progress_bar(total, label)) {
                old.finish_and_clear();
            }
        });
        self.with_lines(|l| {
            *l = plain_progress().then(|| Lines::new(label, total, std::time::Instant::now()));
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
                // Every step shows, however quickly the steps come (stages have few).
                b.force_draw();
            }
        });
        self.with_lines(|l| {
            if let Some(line) = l
                .as_mut()
                .and_then(|l| l.advance(steps, std::time::Instant::now()))
            {
                info(line);
            }
        });
    }

    /// A finished stage's bar stays on the terminal at 100%, with the stage's time; an
    /// abandoned one (an error) is cleared.
    fn end(&self) {
        self.with(|b| {
            if let Some(b) = b.take() {
                if b.length().is_some_and(|n| b.position() >= n) {
                    b.finish();
                } else {
                    b.finish_and_clear();
                }
            }
        });
        self.with_lines(|l| {
            if let Some(line) = l.take().and_then(|l| l.end(std::time::Instant::now())) {
                info(line);
            }
        });
    }

    fn note(&self, message: &str) {
        self.with(|b| match b {
            Some(b) => b.suspend(|| info(message)),
            None => info(message),
        });
    }

    fn detail(&self, message: &str) {
        self.with(|b| match b {
            Some(b) => b.suspend(|| detail(message)),
            None => detail(message),
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn eta_is_the_mean_pace_so_far() {
        // 2 of 16 blocks in 4 minutes: 14 more at 2 minutes each.
        assert_eq!(super::eta(Duration::from_secs(240), 2, 16), "28m");
        assert_eq!(super::eta(Duration::from_secs(30), 10, 20), "30s");
        assert_eq!(super::eta(Duration::from_secs(30), 0, 20), "?");
        assert_eq!(super::eta(Duration::from_secs(30), 20, 20), "0s");
    }

    #[test]
    fn a_long_stage_writes_a_line_at_most_every_30_seconds_and_its_total() {
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut lines = super::Lines::new("calibrate", 4, t0);
        assert_eq!(lines.advance(1, at(20)), None);
        assert_eq!(
            lines.advance(1, at(40)).as_deref(),
            Some("calibrate 2/4, 40s (eta 40s)")
        );
        assert_eq!(lines.advance(1, at(60)), None, "20 s after the last line");
        assert_eq!(
            lines.advance(1, at(125)).as_deref(),
            Some("calibrate 4/4, 2m (eta 0s)")
        );
        assert_eq!(lines.end(at(126)).as_deref(), Some("calibrate 4/4 in 2m"));

        // A short stage says nothing, neither on the way nor at its end.
        let mut short = super::Lines::new("serialize", 1, t0);
        assert_eq!(short.advance(1, at(3)), None);
        assert_eq!(short.end(at(3)), None);
        // An abandoned stage (an error) writes no total.
        let mut cut = super::Lines::new("calibrate", 4, t0);
        assert!(cut.advance(1, at(31)).is_some());
        assert_eq!(cut.end(at(32)), None);
    }
}
