//! `hf2coreml batch FILE.toml`: run a batch file's exports through the same code path as
//! `convert` (+ `validate`), skip the up-to-date ones, report each, exit with the worst.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::exit_code_for;
use crate::printer;
use anyhow::Context;
use hf2coreml::emit::when_output_is_ours;
use hf2coreml::error::ExitCode;
use hf2coreml::fsutil::atomic_write;
use hf2coreml::pipeline::batch::{BatchFile, Export, Shard, ValidateSpec};
use hf2coreml::pipeline::convert::{self, Inputs, Outputs};
use hf2coreml::runtime::interp::{Compute, Options};
use hf2coreml::util::fmt_bytes;
use hf2coreml::validate::gates::{Gate, GateResult};
use hf2coreml::validate::run::{validate, ValidateOptions};
use serde::{Deserialize, Serialize};

use super::convert::Job;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The batch file: a [defaults] table and [[export]] entries (see configs/batch/).
    pub file: PathBuf,
    /// Exports to run at once; fewer when the machine's available memory would not hold them.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub jobs: usize,
    /// Run every export even after one fails (default: stop at the first failure).
    #[arg(long)]
    pub keep_going: bool,
    /// Run only the I-th of N slices (1-based; round-robin in file order), e.g. `--shard 2/4`
    /// on the second of four CI machines.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<Shard>,
    /// Run only the export called NAME (repeatable; `--list` prints the names).
    #[arg(long, value_name = "NAME")]
    pub only: Vec<String>,
    /// Print the expanded exports (after --shard/--only) instead of running them.
    #[arg(long)]
    pub list: bool,
    /// JSON instead of text: the report (with --list, the exports as one JSON array) to FILE,
    /// or to stdout without FILE or with `-`.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
    pub json: Option<PathBuf>,
    /// Rebuild up-to-date packages too, and replace outputs that hf2coreml did not write.
    #[arg(long)]
    pub force: bool,
    /// Python environment holding coremltools (as for `convert`).
    #[arg(long)]
    pub python_env: Option<PathBuf>,
}

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
    fn as_str(self) -> &'static str {
        match self {
            Status::Converted => "converted",
            Status::UpToDate => "up-to-date",
            Status::Failed => "failed",
            Status::Invalid => "invalid",
            Status::Environment => "environment",
            Status::NotRun => "not-run",
        }
    }

    fn exit_code(self) -> ExitCode {
        match self {
            Status::Converted | Status::UpToDate | Status::NotRun => ExitCode::Success,
            Status::Failed => ExitCode::CheckFailed,
            Status::Invalid => ExitCode::BadInput,
            Status::Environment => ExitCode::Environment,
        }
    }

    fn from_error(err: &anyhow::Error) -> Status {
        match exit_code_for(err) {
            ExitCode::CheckFailed => Status::Failed,
            ExitCode::Environment => Status::Environment,
            _ => Status::Invalid,
        }
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

/// X.validation.json: a validation and what it was of.
#[derive(Debug, Serialize, Deserialize)]
struct ValidationRecord {
    fingerprint: String,
    request: serde_json::Value,
    validation: Validation,
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

pub const REPORT_SCHEMA: &str = "hf2coreml.batch-report/1";

pub fn run(args: Args) -> anyhow::Result<()> {
    let file = BatchFile::load(&args.file)?;
    let selected: Vec<Export> = file
        .select(args.shard, &args.only)?
        .into_iter()
        .cloned()
        .collect();
    if args.list {
        return list(&file, &selected, &args);
    }
    if args.jobs == 0 {
        anyhow::bail!("--jobs must be at least 1");
    }
    let jobs = bounded_jobs(args.jobs, &selected);
    if jobs > 1 {
        printer::disable_progress_bars();
    }
    let shard = args.shard.map(|s| s.to_string());
    printer::info(format!(
        "{} export{} from {}{}{}",
        selected.len(),
        if selected.len() == 1 { "" } else { "s" },
        args.file.display(),
        shard
            .as_ref()
            .map_or(String::new(), |s| format!(", shard {s}")),
        if jobs > 1 {
            format!(", {jobs} at a time")
        } else {
            String::new()
        }
    ));
    let reports = run_all(&selected, jobs, &args);
    let mut counts = Counts {
        total: reports.len(),
        ..Counts::default()
    };
    for r in &reports {
        match r.status {
            Status::Converted => counts.converted += 1,
            Status::UpToDate => counts.up_to_date += 1,
            Status::Failed => counts.failed += 1,
            Status::Invalid => counts.invalid += 1,
            Status::Environment => counts.environment += 1,
            Status::NotRun => counts.not_run += 1,
        }
    }
    let exit = worst(reports.iter().map(|r| r.status));
    let report = BatchReport {
        schema: REPORT_SCHEMA,
        file: args.file.clone(),
        tool_version: hf2coreml::VERSION,
        shard,
        jobs,
        exports: reports,
        counts,
        exit_code: exit as i32,
    };
    match args.json.as_deref() {
        Some(p) if p == Path::new("-") => super::print_json(&report)?,
        Some(p) => {
            let text = serde_json::to_string_pretty(&report)? + "\n";
            atomic_write(p, text.as_bytes())
                .with_context(|| format!("cannot write {}", p.display()))?;
            print!("{}", render_summary(&report));
        }
        None => print!("{}", render_summary(&report)),
    }
    match exit {
        ExitCode::Success => Ok(()),
        _ => Err(BatchFailed(exit).into()),
    }
}

/// The batch's exit code, carried to `main` (which prints no further message for it: the
/// summary already said what failed).
#[derive(Debug)]
pub struct BatchFailed(pub ExitCode);

impl std::fmt::Display for BatchFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            ExitCode::CheckFailed => f.write_str("a check or gate failed (see the summary)"),
            ExitCode::Environment => {
                f.write_str("the environment is missing something (see the summary)")
            }
            _ => f.write_str("an export was invalid (see the summary)"),
        }
    }
}
impl std::error::Error for BatchFailed {}

/// Exit code precedence: environment > invalid > failed > success.
fn worst(statuses: impl Iterator<Item = Status>) -> ExitCode {
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

fn list(file: &BatchFile, selected: &[Export], args: &Args) -> anyhow::Result<()> {
    match args.json.as_deref() {
        // One line: ready for `echo "exports=$(...)" >> $GITHUB_OUTPUT` and fromJSON().
        Some(p) if p == Path::new("-") => println!("{}", serde_json::to_string(selected)?),
        Some(p) => {
            let text = serde_json::to_string(selected)? + "\n";
            atomic_write(p, text.as_bytes())
                .with_context(|| format!("cannot write {}", p.display()))?;
        }
        None => print!("{}", render_list(file, selected)),
    }
    Ok(())
}

/// The text of `--list`.
pub fn render_list(file: &BatchFile, selected: &[Export]) -> String {
    use std::fmt::Write;
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
        "{:>3}  {:w$}  {:>6}  {:>2}  {:<16}  {:<14}  {:<8}  output",
        "#", "name", "S", "Q", "recipe", "device", "validate"
    );
    for e in selected {
        let validate = match &e.validate {
            None => "no".to_string(),
            Some(v) if v.gates.is_empty() => "default".to_string(),
            Some(v) => v.gates.join(","),
        };
        let _ = writeln!(
            s,
            "{:>3}  {:w$}  {:>6}  {:>2}  {:<16}  {:<14}  {:<8}  {}",
            e.index + 1,
            e.name,
            e.max_seq_len,
            e.query_len,
            short_recipe(e),
            e.device.as_deref().unwrap_or("-"),
            validate,
            e.output.display()
        );
    }
    s
}

fn short_recipe(e: &Export) -> String {
    match &e.recipe {
        hf2coreml::pipeline::batch::RecipeSource::File(p) => p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        hf2coreml::pipeline::batch::RecipeSource::Inline { .. } => "inline".into(),
        r => r.describe(),
    }
}

/// The summary printed at the end.
pub fn render_summary(report: &BatchReport) -> String {
    use std::fmt::Write;
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

/// How many exports may run at once: `requested`, fewer if the available memory cannot hold
/// that many of the largest.
fn bounded_jobs(requested: usize, exports: &[Export]) -> usize {
    let want = requested.min(exports.len()).max(1);
    if want == 1 {
        return 1;
    }
    let per_export = exports.iter().map(memory_estimate).max().unwrap_or(0);
    let Some(available) = available_memory() else {
        return want;
    };
    let fit = (available / per_export.max(1)).max(1) as usize;
    if fit < want {
        printer::info(format!(
            "--jobs {requested}: running {fit} at a time (each export may need ~{}, {} available)",
            fmt_bytes(per_export),
            fmt_bytes(available)
        ));
    }
    want.min(fit)
}

/// A conservative peak for one conversion: the Python side's fixed cost plus four times the
/// source weights (mmap'd source, f32 working copies while calibrating, fp16 weights handed to
/// coremltools, the written package).
fn memory_estimate(e: &Export) -> u64 {
    const FIXED: u64 = 1 << 30;
    let source: u64 = if e.model.is_file() {
        std::fs::metadata(&e.model).map_or(0, |m| m.len())
    } else {
        std::fs::read_dir(&e.model)
            .map(|d| {
                d.flatten()
                    .filter(|f| f.file_name().to_string_lossy().ends_with(".safetensors"))
                    .filter_map(|f| f.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    };
    FIXED + 4 * source
}

/// MemAvailable from /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn run_all(exports: &[Export], jobs: usize, args: &Args) -> Vec<ExportReport> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<ExportReport>>> = Mutex::new(vec![None; exports.len()]);
    let total = exports.len();
    let worker = || loop {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let i = next.fetch_add(1, Ordering::SeqCst);
        let Some(export) = exports.get(i) else {
            break;
        };
        let report = run_one_guarded(export, args);
        let ok = matches!(report.status, Status::Converted | Status::UpToDate);
        if !ok && !args.keep_going {
            stop.store(true, Ordering::SeqCst);
        }
        let n = done.fetch_add(1, Ordering::SeqCst) + 1;
        when_output_is_ours(|| {
            printer::info(format!(
                "[{n}/{total}] {} {} ({:.1} s)",
                export.name,
                report.status.as_str(),
                report.seconds.total
            ))
        });
        if let Ok(mut r) = results.lock() {
            r[i] = Some(report);
        }
    };
    if jobs <= 1 {
        worker();
    } else {
        // The main thread's stack size: the embedded Python interpreter (coremltools' MIL
        // builder, protobuf) recurses deeper than a spawned thread's default 2 MiB allows.
        const STACK: usize = 64 << 20;
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..jobs)
                .map(|_| {
                    std::thread::Builder::new()
                        .name("export".into())
                        .stack_size(STACK)
                        .spawn_scoped(s, worker)
                })
                .collect();
            // A worker that cannot start leaves its share to the others.
            if handles.iter().all(Result::is_err) {
                worker();
            }
        });
    }
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    results
        .into_iter()
        .zip(exports)
        .map(|(r, e)| r.unwrap_or_else(|| not_run(e)))
        .collect()
}

fn not_run(e: &Export) -> ExportReport {
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
    }
}

/// [`run_one`], with a panic (a bug) reported as this export's failure instead of ending the
/// batch.
fn run_one_guarded(export: &Export, args: &Args) -> ExportReport {
    let start = Instant::now();
    let mut report = not_run(export);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_one(export, args, &mut report)
    }));
    let error = match outcome {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Some(anyhow::anyhow!(
                "internal error (a bug; please report it): {msg}"
            ))
        }
    };
    if let Some(e) = error {
        report.status = Status::from_error(&e);
        report.error = Some(
            e.chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": "),
        );
    }
    report.exit_code = report.status.exit_code() as i32;
    report.seconds.total = start.elapsed().as_secs_f64();
    report
}

fn run_one(export: &Export, args: &Args, report: &mut ExportReport) -> anyhow::Result<()> {
    let recipe = export
        .recipe
        .load()
        .with_context(|| format!("export `{}`: recipe", export.name))?;
    let mut job = Job {
        source: export.model.clone(),
        output: export.output.clone(),
        max_seq_len: export.max_seq_len,
        query_len: export.query_len,
        recipe,
        calibration: export.calibration.clone(),
        compute_precision: export.compute_precision,
        activation_ranges: None,
        no_range_scaling: false,
        device: export.device.clone(),
        increased_memory_limit: export.increased_memory_limit,
        allow_over_budget: export.allow_over_budget,
        force: args.force,
        python_env: args.python_env.clone(),
    };
    job.check()?;
    if !export.model.exists() {
        anyhow::bail!(
            "{}: no such checkpoint directory or file",
            export.model.display()
        );
    }
    let inputs = job.inputs()?;
    report.fingerprint = Some(inputs.fingerprint.clone());
    let outputs = Outputs::for_package(&export.output)?;
    let recorded = Inputs::recorded(&export.output);
    let up_to_date = !args.force
        && export.output.join("Manifest.json").is_file()
        && recorded.as_ref() == Some(&inputs);
    let mut opened = None;
    if up_to_date {
        report.status = Status::UpToDate;
        read_sizes(&outputs.report, report);
    } else {
        if export.output.exists() && recorded.is_none() && !args.force {
            anyhow::bail!(
                "{} exists and was not written by hf2coreml (no readable {}); use --force to \
                 replace it",
                export.output.display(),
                outputs.report.display()
            );
        }
        // A package this tool wrote from other inputs is rebuilt in place.
        job.force = true;
        let t = Instant::now();
        let o = job.open()?;
        let summary = job.convert(&o, inputs.clone())?;
        report.seconds.convert = t.elapsed().as_secs_f64();
        report.package_bytes = Some(summary.package_bytes);
        report.bits_per_weight = Some(summary.bits_per_weight);
        report.status = Status::Converted;
        opened = Some(o);
    }
    let Some(spec) = &export.validate else {
        return Ok(());
    };
    let t = Instant::now();
    let v = validation(&job, spec, &inputs, &outputs, opened)?;
    report.seconds.validate = t.elapsed().as_secs_f64();
    let passed = v.passed;
    report.validation = Some(v);
    if !passed {
        report.status = Status::Failed;
    }
    Ok(())
}

/// Sizes of an up-to-date package, from its recorded report.
fn read_sizes(report_path: &Path, report: &mut ExportReport) {
    let Ok(text) = std::fs::read_to_string(report_path) else {
        return;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return;
    };
    report.package_bytes = v["package_bytes"].as_u64();
    report.bits_per_weight = v["bits_per_weight"].as_f64();
}

/// Validate the package, or reuse X.validation.json when it validated this very package with
/// the same request.
fn validation(
    job: &Job,
    spec: &ValidateSpec,
    inputs: &Inputs,
    outputs: &Outputs,
    opened: Option<super::convert::Opened>,
) -> anyhow::Result<Validation> {
    let (text, text_name) = super::evaluation_text(spec.text.as_deref())?;
    let request = serde_json::json!({
        "gates": spec.gates,
        "max_tokens": spec.max_tokens,
        "text": convert::sha256_hex(text.as_bytes()),
    });
    let record_path = validation_path(&outputs.package);
    if let Some(previous) = std::fs::read_to_string(&record_path)
        .ok()
        .and_then(|t| serde_json::from_str::<ValidationRecord>(&t).ok())
        .filter(|r| r.fingerprint == inputs.fingerprint && r.request == request)
    {
        return Ok(Validation {
            reused: true,
            ..previous.validation
        });
    }
    let opened = match opened {
        Some(o) => o,
        None => job.open()?,
    };
    let gates = spec
        .gates
        .iter()
        .map(|g| g.parse::<Gate>())
        .collect::<Result<Vec<_>, _>>()?;
    let (tokens, label) = convert::text_tokens(&opened.ckpt, &text, &text_name)?;
    let opts = ValidateOptions {
        tokens: &tokens,
        text_name: &label,
        gates,
        interp: Options {
            compute: Compute::Declared,
        },
        max_tokens: spec.max_tokens,
    };
    let r = validate(&outputs.package, &opened.ckpt, &opts)
        .with_context(|| format!("cannot validate {}", outputs.package.display()))?;
    let b = r
        .behaviour
        .as_ref()
        .context("validate compared no logits")?;
    let v = Validation {
        passed: r.passed(),
        reused: false,
        positions: b.positions,
        kl_mean: b.kl_mean,
        kl_max: b.kl_max,
        top1: b.top1,
        top5: b.top5,
        ppl_ratio: b.ppl_ratio,
        contract_ok: r.contract_ok(),
        overflow: r.overflowed(),
        gates: r.gates.clone(),
    };
    let record = ValidationRecord {
        fingerprint: inputs.fingerprint.clone(),
        request,
        validation: v.clone(),
    };
    let json = serde_json::to_string_pretty(&record)? + "\n";
    atomic_write(&record_path, json.as_bytes())
        .with_context(|| format!("cannot write {}", record_path.display()))?;
    Ok(v)
}

/// `X.mlpackage` → `X.validation.json`.
fn validation_path(package: &Path) -> PathBuf {
    let name = package
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".mlpackage").unwrap_or(&name);
    package.with_file_name(format!("{stem}.validation.json"))
}
