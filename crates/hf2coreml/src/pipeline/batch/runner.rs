//! Running a batch: each export through the same [`Job`] as `convert` (+ validation), the
//! up-to-date ones skipped, several at once when memory allows, every outcome reported.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::batch_report::{BatchReport, Counts, ExportReport, Status, Validation, REPORT_SCHEMA};
use super::file::{Export, Shard, ValidateSpec};
use crate::emit::when_output_is_ours;
use crate::error::ExitCode;
use crate::fsutil::{atomic_write, Staged};
use crate::pipeline::convert_error::ConvertError;
use crate::pipeline::convert_summary::{report_bytes, ConvertSummary, Inputs};
use crate::pipeline::job::{Job, JobError, Opened};
use crate::pipeline::package_files::{validation_path, Outputs};
use crate::pipeline::texts;
use crate::progress::Progress;
use crate::quant::QuantError;
use crate::runtime::interp::{Compute, Options};
use crate::util::fmt_bytes;
use crate::validate::gates::{Gate, GateError};
use crate::validate::run_checks::{validate, ValidateError, ValidateOptions};

/// How a batch runs its exports.
#[derive(Debug, Clone, Default)]
pub struct BatchSettings {
    /// Exports run at once (see [`bounded_jobs`]).
    pub jobs: usize,
    /// Run every export even after one fails.
    pub keep_going: bool,
    /// Rebuild up-to-date packages too, and replace outputs that hf2coreml did not write.
    pub force: bool,
    /// Python environment holding coremltools.
    pub python_env: Option<PathBuf>,
}

/// Why one export stopped; its text (with its causes) goes into the report.
#[derive(Debug, Error)]
pub enum ExportError {
    #[error("export `{name}`: recipe")]
    Recipe {
        name: String,
        #[source]
        source: Box<QuantError>,
    },
    #[error(transparent)]
    Job(Box<JobError>),
    #[error(transparent)]
    Convert(#[from] ConvertError),
    #[error("{}: no such checkpoint directory or file", .0.display())]
    NoModel(PathBuf),
    #[error(
        "{} exists and was not written by hf2coreml (no readable {}); use --force to replace it",
        package.display(),
        report.display()
    )]
    NotOurs { package: PathBuf, report: PathBuf },
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error("cannot validate {}", path.display())]
    Validate {
        path: PathBuf,
        #[source]
        source: Box<ValidateError>,
    },
    #[error("validate compared no logits")]
    NoLogits,
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A bug, caught so that it fails one export instead of the batch.
    #[error("internal error (a bug; please report it): {0}")]
    Panic(String),
}

impl From<JobError> for ExportError {
    fn from(e: JobError) -> Self {
        ExportError::Job(Box::new(e))
    }
}

impl ExportError {
    /// The exit code this error calls for (as `main` would classify it).
    pub fn exit_code(&self) -> ExitCode {
        match self {
            ExportError::Job(e) => e.exit_code(),
            other => crate::error::exit_code_of(other),
        }
    }
}

/// X.validation.json: a validation and what it was of.
#[derive(Debug, Serialize, Deserialize)]
struct ValidationRecord {
    fingerprint: String,
    request: serde_json::Value,
    validation: Validation,
}

/// How many exports may run at once: `requested`, fewer if the available memory cannot hold
/// that many of the largest (a note says so).
pub fn bounded_jobs(requested: usize, exports: &[Export], progress: &dyn Progress) -> usize {
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
        progress.note(&format!(
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
pub fn memory_estimate(e: &Export) -> u64 {
    const FIXED: u64 = 1 << 30;
    let model = crate::checkpoint::resolve_source(&e.model).unwrap_or_else(|_| e.model.clone());
    let source: u64 = if model.is_file() {
        std::fs::metadata(&model).map_or(0, |m| m.len())
    } else {
        std::fs::read_dir(&model)
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
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Run `exports` (selected from the batch file `file`, maybe a `shard` of it) and report them
/// all; each finished export is noted as `[n/total] name status (time)`.
pub fn run(
    file: &Path,
    shard: Option<Shard>,
    exports: &[Export],
    settings: &BatchSettings,
    progress: &dyn Progress,
) -> BatchReport {
    let reports = run_all(exports, settings, progress);
    let counts = Counts::of(&reports);
    let mut report = BatchReport {
        schema: REPORT_SCHEMA,
        file: file.to_path_buf(),
        tool_version: crate::VERSION,
        shard: shard.map(|s| s.to_string()),
        jobs: settings.jobs,
        exports: reports,
        counts,
        exit_code: 0,
    };
    report.exit_code = report.exit() as i32;
    report
}

fn run_all(
    exports: &[Export],
    settings: &BatchSettings,
    progress: &dyn Progress,
) -> Vec<ExportReport> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<ExportReport>>> = Mutex::new(vec![None; exports.len()]);
    let converted = Converted::default();
    let total = exports.len();
    let worker = || loop {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let i = next.fetch_add(1, Ordering::SeqCst);
        let Some(export) = exports.get(i) else {
            break;
        };
        let report = run_one_guarded(export, settings, &converted, progress);
        if !report.status.is_ok() && !settings.keep_going {
            stop.store(true, Ordering::SeqCst);
        }
        let n = done.fetch_add(1, Ordering::SeqCst) + 1;
        when_output_is_ours(|| {
            progress.note(&format!(
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
    if settings.jobs <= 1 {
        worker();
    } else {
        // The main thread's stack size: the embedded Python interpreter (coremltools' MIL
        // builder, protobuf) recurses deeper than a spawned thread's default 2 MiB allows.
        const STACK: usize = 64 << 20;
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..settings.jobs)
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
        .map(|(r, e)| r.unwrap_or_else(|| ExportReport::not_run(e)))
        .collect()
}

/// [`run_one`], with a panic (a bug) reported as this export's failure instead of ending the
/// batch.
pub fn run_one_guarded(
    export: &Export,
    settings: &BatchSettings,
    converted: &Converted,
    progress: &dyn Progress,
) -> ExportReport {
    let start = Instant::now();
    let mut report = ExportReport::not_run(export);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_one(export, settings, converted, progress, &mut report)
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
            Some(ExportError::Panic(msg.to_string()))
        }
    };
    if let Some(e) = error {
        report.status = Status::from_exit_code(e.exit_code());
        report.error = Some(
            crate::error::causes(&e)
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": "),
        );
    }
    report.exit_code = report.status.exit_code() as i32;
    report.seconds.total = start.elapsed().as_secs_f64();
    report
}

/// The packages converted in this run, by what decides their bytes ([`package_key`]), with the
/// name of the export that converted each.
pub type Converted = Mutex<HashMap<String, (String, ConvertSummary)>>;

/// What decides a package's bytes: its inputs without the budget's settings (the device, the
/// entitlement, the over-budget permission), with the package size limit the device implies
/// instead. Exports with the same key write the same package: the second one copies it.
fn package_key(inputs: &Inputs, package_limit: u64) -> String {
    let mut settings = inputs.settings.clone();
    for k in ["device", "increased_memory_limit", "allow_over_budget"] {
        settings.remove(k);
    }
    settings.insert("max_package_size".into(), serde_json::json!(package_limit));
    let i = Inputs::new(
        inputs.sources.clone(),
        inputs.recipe.clone(),
        inputs.calibration.clone(),
        settings,
    );
    i.fingerprint
}

/// Copy a package converted in this run (and its tokenizer files) to `to`, and write its
/// report with this export's inputs, as a conversion would have.
fn copy_package(
    from: &ConvertSummary,
    to: &Outputs,
    inputs: Inputs,
) -> Result<ConvertSummary, ExportError> {
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ExportError::Write { path, source }
    };
    let mut dir = Staged::new(&to.package, true).map_err(write_err(&to.package))?;
    crate::fsutil::copy_tree(&from.outputs.package, dir.path()).map_err(write_err(&to.package))?;
    let mut outputs = to.clone();
    let sides = [
        (&from.outputs.tokenizer, &mut outputs.tokenizer),
        (
            &from.outputs.tokenizer_config,
            &mut outputs.tokenizer_config,
        ),
    ];
    for (src, dst) in sides {
        match (src, dst.as_ref()) {
            (Some(src), Some(d)) => {
                let bytes = std::fs::read(src).map_err(write_err(src))?;
                dir.add_file(d, &bytes).map_err(write_err(d))?;
            }
            _ => *dst = None,
        }
    }
    // A per-layer table may be larger than memory: copied as a stream.
    match (&from.outputs.per_layer, outputs.per_layer.as_ref()) {
        (Some(src), Some(d)) => {
            let mut f = crate::fsutil::open_input(src).map_err(write_err(src))?;
            dir.add_file_with(d, |w| std::io::copy(&mut f, w).map(drop))
                .map_err(write_err(d))?;
        }
        _ => outputs.per_layer = None,
    }
    let mut summary = from.clone();
    summary.outputs = outputs;
    summary.inputs = Some(inputs);
    let report = &summary.outputs.report;
    dir.add_file(report, &report_bytes(&summary)?)
        .map_err(write_err(report))?;
    dir.commit().map_err(write_err(&to.package))?;
    Ok(summary)
}

/// Convert one export unless its package is up to date (or was converted by another export of
/// this run: then it is copied), then validate it when asked; what happened goes into
/// `report` as it happens.
pub fn run_one(
    export: &Export,
    settings: &BatchSettings,
    converted: &Converted,
    progress: &dyn Progress,
    report: &mut ExportReport,
) -> Result<(), ExportError> {
    let file = export.recipe.load().map_err(|source| ExportError::Recipe {
        name: export.name.clone(),
        source: Box::new(source),
    })?;
    let mut job = Job {
        source: export.model.clone(),
        output: export.output.clone(),
        max_seq_len: export.max_seq_len,
        query_len: export.query_len,
        recipe: file.recipe,
        package: file.package,
        calibration: export.calibration.clone(),
        compute_precision: export.compute_precision,
        activation_ranges: None,
        no_range_scaling: false,
        device: export.device.clone(),
        increased_memory_limit: export.increased_memory_limit,
        allow_over_budget: export.allow_over_budget,
        max_package_size: export.max_package_size,
        force: settings.force,
        python_env: settings.python_env.clone(),
    };
    job.check()?;
    // A Hub id missing from the cache is left to the job, whose error names every place looked.
    let present = crate::checkpoint::resolve_source(&export.model).map_or(true, |p| p.exists());
    if !present {
        return Err(ExportError::NoModel(export.model.clone()));
    }
    let inputs = job.inputs()?;
    report.fingerprint = Some(inputs.fingerprint.clone());
    let outputs = Outputs::for_package(&export.output)?;
    let recorded = Inputs::recorded(&export.output);
    let up_to_date =
        !settings.force && is_output(&export.output) && recorded.as_ref() == Some(&inputs);
    let mut opened = None;
    if up_to_date {
        report.status = Status::UpToDate;
        read_sizes(&outputs.report, report);
    } else {
        if export.output.exists() && recorded.is_none() && !settings.force {
            return Err(ExportError::NotOurs {
                package: export.output.clone(),
                report: outputs.report.clone(),
            });
        }
        // A package this tool wrote from other inputs is rebuilt in place.
        job.force = true;
        let t = Instant::now();
        // Opened (and budgeted for this export's device) even when the package is copied.
        let o = job.open(progress)?;
        let key = package_key(&inputs, job.package_limit()?);
        let donor = converted.lock().ok().and_then(|m| m.get(&key).cloned());
        let summary = match donor {
            Some((name, from)) => {
                report.copied_from = Some(name);
                copy_package(&from, &outputs, inputs.clone())?
            }
            None => {
                let summary = job.convert(&o, inputs.clone(), progress)?;
                if let Ok(mut m) = converted.lock() {
                    m.insert(key, (export.name.clone(), summary.clone()));
                }
                summary
            }
        };
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
    let v = validation(&job, spec, &inputs, &outputs, opened, progress)?;
    report.seconds.validate = t.elapsed().as_secs_f64();
    let passed = v.passed;
    report.validation = Some(v);
    if !passed {
        report.status = Status::Failed;
    }
    Ok(())
}

/// Whether `path` holds what a conversion writes there: an ML package, a Core AI asset, or a
/// chain of either (a model larger than the device's package limit).
fn is_output(path: &Path) -> bool {
    path.join("Manifest.json").is_file()
        || crate::aimodel::is_aimodel(path)
        || crate::mil::chain_file::is_chain(path)
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
    opened: Option<Opened>,
    progress: &dyn Progress,
) -> Result<Validation, ExportError> {
    let (text, text_name) = texts::evaluation_text(spec.text.as_deref()).map_err(JobError::from)?;
    let request = serde_json::json!({
        "gates": spec.gates,
        "max_tokens": spec.max_tokens,
        "text": crate::util::sha256_hex(text.as_bytes()),
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
        None => job.open(progress)?,
    };
    let gates = spec
        .gates
        .iter()
        .map(|g| g.parse::<Gate>())
        .collect::<Result<Vec<_>, _>>()?;
    let (tokens, label) =
        texts::text_tokens(&opened.ckpt, &text, &text_name).map_err(ConvertError::from)?;
    let opts = ValidateOptions {
        tokens: &tokens,
        text_name: &label,
        gates,
        interp: Options {
            compute: Compute::Declared,
            ..Options::default()
        },
        max_tokens: spec.max_tokens,
        reference_budget: crate::model::layerwise::REFERENCE_BUDGET,
        cross_check: false,
    };
    let r = validate(&outputs.package, &opened.ckpt, &opts).map_err(|source| {
        ExportError::Validate {
            path: outputs.package.clone(),
            source: Box::new(source),
        }
    })?;
    let b = r.behaviour.as_ref().ok_or(ExportError::NoLogits)?;
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
    atomic_write(&record_path, json.as_bytes()).map_err(|source| ExportError::Write {
        path: record_path.clone(),
        source,
    })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::batch::BatchFile;
    use crate::progress::Silent;

    #[test]
    fn a_missing_model_is_invalid_and_stops_the_batch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.toml");
        let file = BatchFile::parse(
            &path,
            "[[export]]\nmodel = \"nope\"\noutput = \"o-{max_seq_len}.mlpackage\"\nmax_seq_len = [8, 16]\n",
        )
        .unwrap();
        let settings = BatchSettings {
            jobs: 1,
            ..BatchSettings::default()
        };
        let r = run(&path, None, &file.exports, &settings, &Silent);
        assert_eq!(r.exit_code, 2);
        assert_eq!(r.exports[0].status, Status::Invalid);
        let error = r.exports[0].error.as_deref().unwrap_or_default();
        assert!(
            error.ends_with("nope: no such checkpoint directory or file"),
            "{error}"
        );
        assert_eq!(r.exports[1].status, Status::NotRun);
        assert_eq!((r.counts.invalid, r.counts.not_run), (1, 1));
        assert!(crate::pipeline::batch::render_summary(&r)
            .ends_with("2 exports: 1 invalid, 1 not run · exit 2\n"));
    }

    /// A chain directory is a conversion's output as much as one package is: an export whose
    /// model was split can be up to date.
    #[test]
    fn chains_and_assets_are_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str, files: &[&str]| {
            let p = dir.path().join(name);
            std::fs::create_dir(&p).unwrap();
            for f in files {
                std::fs::write(p.join(f), b"{}").unwrap();
            }
            p
        };
        assert!(is_output(&at("a.mlpackage", &["Manifest.json"])));
        assert!(is_output(&at(
            "b.aimodel",
            &["metadata.json", "main.mlirb"]
        )));
        assert!(is_output(&at(
            "c.mlpackage",
            &[crate::mil::chain_file::CHAIN_FILE]
        )));
        assert!(!is_output(&at("d.mlpackage", &["weight.bin"])));
        assert!(!is_output(&dir.path().join("missing.mlpackage")));
    }

    #[test]
    fn errors_keep_their_exit_class_through_wrappers() {
        use crate::error::{CheckFailed, EnvironmentError};
        let over = ExportError::from(JobError::OverBudget(CheckFailed("over".into())));
        assert_eq!(over.exit_code(), ExitCode::CheckFailed);
        let env = ExportError::from(JobError::Emit(crate::emit::EmitError::Environment(
            EnvironmentError {
                message: "no python".into(),
                fix: "make setup".into(),
            },
        )));
        assert_eq!(env.exit_code(), ExitCode::Environment);
        assert_eq!(ExportError::NoLogits.exit_code(), ExitCode::BadInput);
        assert_eq!(
            Status::from_exit_code(ExitCode::Environment),
            Status::Environment
        );
    }
}
