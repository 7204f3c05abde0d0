//! What a batch run reports: each export's status, sizes, validation and time, the counts and
//! the exit code (`batch --json`, schema [`REPORT_SCHEMA`]), and the text of `--list` and of
//! the closing summary, as strings.

use std::fmt::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::file::{BatchFile, Export, RecipeSource};
use crate::error::ExitCode;
use crate::util::fmt_bytes;
use crate::validate::gates::GateResult;

/// The report's schema name. Stable: fields are only ever added.
pub const REPORT_SCHEMA: &str = "hf2coreml.batch-report/1";

/// What happened to one export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// Converted now (and validated, when asked).
    Converted,
    /// The package's recorded inputs match: not rebuilt.
    UpToDate,
    /// A check or gate failed (exit 1): the budget, or validation.
    Failed,
    /// Bad input or configuration (exit 2): nothing was written.
    Invalid,
    /// The environment lacks something (exit 3), e.g. coremltools.
    Environment,
    /// Not started: an earlier export failed and --keep-going was not given.
    NotRun,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Converted => "converted",
            Status::UpToDate => "up-to-date",
            Status::Failed => "failed",
            Status::Invalid => "invalid",
            Status::Environment => "environment",
            Status::NotRun => "not-run",
        }
    }

    pub fn exit_code(self) -> ExitCode {
        match self {
            Status::Converted | Status::UpToDate | Status::NotRun => ExitCode::Success,
            Status::Failed => ExitCode::CheckFailed,
            Status::Invalid => ExitCode::BadInput,
            Status::Environment => ExitCode::Environment,
        }
    }

    /// The status of an export that stopped with an error calling for `code`.
    pub fn from_exit_code(code: ExitCode) -> Status {
        match code {
            ExitCode::CheckFailed => Status::Failed,
            ExitCode::Environment => Status::Environment,
            _ => Status::Invalid,
        }
    }

    /// Converted or up to date.
    pub fn is_ok(self) -> bool {
        matches!(self, Status::Converted | Status::UpToDate)
    }
}

/// Validation metrics, as kept beside the package and in the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Validation {
    pub passed: bool,
    /// Taken from the package's X.validation.json (same package, same request) instead of
    /// validating again.
    #[serde(default)]
    pub reused: bool,
    pub positions: usize,
    pub kl_mean: f64,
    pub kl_max: f64,
    pub top1: f64,
    pub top5: f64,
    pub ppl_ratio: f64,
    pub contract_ok: bool,
    pub overflow: bool,
    pub gates: Vec<GateResult>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Seconds {
    pub convert: f64,
    pub validate: f64,
    pub total: f64,
}

/// One export's line in the report.
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    #[serde(flatten)]
    pub export: Export,
    pub status: Status,
    pub exit_code: i32,
    pub fingerprint: Option<String>,
    pub package_bytes: Option<u64>,
    pub bits_per_weight: Option<f64>,
    pub validation: Option<Validation>,
    pub seconds: Seconds,
    /// The error and its causes, when the export did not succeed.
    pub error: Option<String>,
    /// The export of this run whose package this one copied (the same bytes: the two differ
    /// only in what the budget checks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copied_from: Option<String>,
}

impl ExportReport {
    /// The line of an export that has not run (yet).
    pub fn not_run(e: &Export) -> ExportReport {
        ExportReport {
            export: e.clone(),
            status: Status::NotRun,
            exit_code: 0,
            fingerprint: None,
            package_bytes: None,
            bits_per_weight: None,
            validation: None,
            seconds: Seconds::default(),
            error: None,
            copied_from: None,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Counts {
    pub total: usize,
    pub converted: usize,
    pub up_to_date: usize,
    pub failed: usize,
    pub invalid: usize,
    pub environment: usize,
    pub not_run: usize,
}

impl Counts {
    /// How many exports ended in each status.
    pub fn of(reports: &[ExportReport]) -> Counts {
        let mut counts = Counts {
            total: reports.len(),
            ..Counts::default()
        };
        for r in reports {
            match r.status {
                Status::Converted => counts.converted += 1,
                Status::UpToDate => counts.up_to_date += 1,
                Status::Failed => counts.failed += 1,
                Status::Invalid => counts.invalid += 1,
                Status::Environment => counts.environment += 1,
                Status::NotRun => counts.not_run += 1,
            }
        }
        counts
    }
}

/// The whole run (`--json`). Stable: fields are only ever added.
#[derive(Debug, Clone, Serialize)]
pub struct BatchReport {
    pub schema: &'static str,
    pub file: PathBuf,
    pub tool_version: &'static str,
    pub shard: Option<String>,
    pub jobs: usize,
    pub exports: Vec<ExportReport>,
    pub counts: Counts,
    pub exit_code: i32,
}

impl BatchReport {
    /// The batch's exit code.
    pub fn exit(&self) -> ExitCode {
        worst(self.exports.iter().map(|r| r.status))
    }
}

/// Exit code precedence: environment > invalid > failed > success.
pub fn worst(statuses: impl Iterator<Item = Status>) -> ExitCode {
    let rank = |c: ExitCode| match c {
        ExitCode::Success => 0,
        ExitCode::CheckFailed => 1,
        ExitCode::BadInput => 2,
        ExitCode::Environment => 3,
    };
    statuses
        .map(Status::exit_code)
        .max_by_key(|&c| rank(c))
        .unwrap_or(ExitCode::Success)
}

/// The text of `--list`.
pub fn render_list(file: &BatchFile, selected: &[Export]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} of {} exports in {}",
        selected.len(),
        file.exports.len(),
        file.path.display()
    );
    let w = selected
        .iter()
        .map(|e| e.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        s,
        "{:>3}  {:w$}  {:>6}  {:>2}  {:<16}  {:<14}  {:<11}  {:<8}  output",
        "#", "name", "S", "Q", "recipe", "device", "max package", "validate"
    );
    for e in selected {
        let validate = match &e.validate {
            None => "no".to_string(),
            Some(v) if v.gates.is_empty() => "default".to_string(),
            Some(v) => v.gates.join(","),
        };
        let _ = writeln!(
            s,
            "{:>3}  {:w$}  {:>6}  {:>2}  {:<16}  {:<14}  {:<11}  {:<8}  {}",
            e.index + 1,
            e.name,
            e.max_seq_len,
            e.query_len,
            short_recipe(e),
            e.device.as_deref().unwrap_or("-"),
            e.max_package_size
                .map_or_else(|| "-".to_string(), fmt_bytes),
            validate,
            e.output.display()
        );
    }
    s
}

fn short_recipe(e: &Export) -> String {
    match &e.recipe {
        RecipeSource::File(p) => p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        RecipeSource::Inline { .. } => "inline".into(),
        r => r.describe(),
    }
}

/// The summary printed at the end.
pub fn render_summary(report: &BatchReport) -> String {
    let mut s = String::new();
    let w = report
        .exports
        .iter()
        .map(|r| r.export.name.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let _ = writeln!(
        s,
        "{:w$}  {:<11}  {:>10}  {:>6}  {:>8}  {:>6}  {:>8}",
        "export", "status", "size", "bpw", "KL mean", "top-1", "time"
    );
    for r in &report.exports {
        render_export(&mut s, r, w);
    }
    let c = &report.counts;
    let parts: Vec<String> = [
        (c.converted, "converted"),
        (c.up_to_date, "up to date"),
        (c.failed, "failed"),
        (c.invalid, "invalid"),
        (c.environment, "environment"),
        (c.not_run, "not run"),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    let _ = writeln!(
        s,
        "{} export{}: {} · exit {}",
        c.total,
        if c.total == 1 { "" } else { "s" },
        if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(", ")
        },
        report.exit_code
    );
    s
}

/// One export's row of the summary (names padded to `w`), and what went wrong under it.
fn render_export(s: &mut String, r: &ExportReport, w: usize) {
    let dash = || "-".to_string();
    let v = r.validation.as_ref();
    let _ = writeln!(
        s,
        "{:w$}  {:<11}  {:>10}  {:>6}  {:>8}  {:>6}  {:>8}",
        r.export.name,
        r.status.as_str(),
        r.package_bytes.map_or_else(dash, fmt_bytes),
        r.bits_per_weight.map_or_else(dash, |b| format!("{b:.2}")),
        v.map_or_else(dash, |v| format!("{:.4}", v.kl_mean)),
        v.map_or_else(dash, |v| format!("{:.3}", v.top1)),
        if r.status == Status::NotRun {
            dash()
        } else {
            format!("{:.1} s", r.seconds.total)
        }
    );
    if let Some(from) = &r.copied_from {
        let _ = writeln!(s, "  copied from {from} (the same package)");
    }
    if let Some(v) = v {
        let failed: Vec<String> = v
            .gates
            .iter()
            .filter(|g| !g.passed)
            .map(|g| format!("{} (was {:.4})", g.gate, g.value))
            .collect();
        if !failed.is_empty() {
            let _ = writeln!(s, "  gate failed: {}", failed.join(", "));
        }
        if v.overflow {
            let _ = writeln!(s, "  inf/NaN in the package's activations");
        }
        if !v.contract_ok {
            let _ = writeln!(s, "  the package does not follow the contract");
        }
    }
    if let Some(e) = &r.error {
        let _ = writeln!(s, "  error: {e}");
    }
}
