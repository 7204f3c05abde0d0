use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use crate::printer::{detail, progress_bar};
use anyhow::Context;
use hf2coreml::budget::{self, Budget, Devices, Limit};
use hf2coreml::checkpoint::gguf::{self, ImportOptions};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::emit::PythonEnv;
use hf2coreml::error::CheckFailed;
use hf2coreml::graph::scaling::ActivationRanges;
use hf2coreml::pipeline::convert::{
    self, ComputePrecision, ConvertOptions, ConvertSummary, Inputs, Outputs, StageTimes,
};
use hf2coreml::quant::Recipe;
use hf2coreml::util::{fmt_bytes, fmt_count};

use super::palettize::RecipeArgs;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + *.safetensors), or a .gguf file (imported first, as
    /// `import-gguf` does).
    pub dir: PathBuf,
    /// The package to write (must end in .mlpackage); X.tokenizer.json and X.report.json are
    /// written beside it.
    #[arg(short, long)]
    pub output: PathBuf,
    /// The package's fixed max_sequence_length S (cache rows).
    #[arg(long, default_value_t = 512)]
    pub max_seq_len: usize,
    /// Tokens per step Q.
    #[arg(long, default_value_t = 1)]
    pub query_len: usize,
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Precision the program computes in: fp16 (all compute units) or fp32 (CPU/GPU only).
    #[arg(long, value_enum, default_value_t = Precision::Fp16)]
    pub compute_precision: Precision,
    /// Activation ranges (JSON: {"residual_max_abs": [...], "source": "..."}) to choose the
    /// fp16 residual scale from, instead of measuring them on the shipped calibration text.
    #[arg(long, conflicts_with = "no_range_scaling")]
    pub activation_ranges: Option<PathBuf>,
    /// Do not scale the residual stream for fp16 (diagnosis: shows what overflow does).
    #[arg(long)]
    pub no_range_scaling: bool,
    /// Check the plan against this device profile first; refuse it if it does not fit.
    #[arg(long)]
    pub device: Option<String>,
    /// Use the device's limit with the increased-memory-limit entitlement.
    #[arg(long, requires = "device")]
    pub increased_memory_limit: bool,
    /// Convert even when the budget says the plan does not fit the device.
    #[arg(long, requires = "device")]
    pub allow_over_budget: bool,
    /// Replace an existing output.
    #[arg(long)]
    pub force: bool,
    /// Show the plan (dimensions, budget, outputs) without converting.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Python environment holding coremltools (default: HF2COREML_PYTHON_ENV, VIRTUAL_ENV,
    /// ./.venv).
    #[arg(long)]
    pub python_env: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let job = Job {
        source: args.dir.clone(),
        output: args.output.clone(),
        max_seq_len: args.max_seq_len,
        query_len: args.query_len,
        recipe: args.recipe.load()?,
        calibration: args.recipe.calibration.clone(),
        compute_precision: args.compute_precision.into(),
        activation_ranges: args.activation_ranges.clone(),
        no_range_scaling: args.no_range_scaling,
        device: args.device.clone(),
        increased_memory_limit: args.increased_memory_limit,
        allow_over_budget: args.allow_over_budget,
        force: args.force,
        python_env: args.python_env.clone(),
    };
    job.check()?;
    if args.dry_run {
        let opened = job.open()?;
        let plan = job.plan(&opened.ckpt)?;
        let outputs = Outputs::for_package(&job.output)?;
        return print_plan(&job, &opened.ckpt, &plan, &outputs, args.json);
    }
    let summary = job.run()?;
    if args.json {
        return super::print_json(&summary);
    }
    print_summary(&summary);
    Ok(())
}

/// `--compute-precision`'s values ([`ComputePrecision`] without clap in the library).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    /// fp16 everywhere (Neural Engine, GPU and CPU).
    Fp16,
    /// fp32 program (CPU/GPU only on device): for diagnosis and models that cannot be kept in
    /// fp16 range.
    Fp32,
}

impl From<Precision> for ComputePrecision {
    fn from(p: Precision) -> Self {
        match p {
            Precision::Fp16 => ComputePrecision::Fp16,
            Precision::Fp32 => ComputePrecision::Fp32,
        }
    }
}

/// One conversion, as `convert` and `batch` run it: the source, the output, the settings.
#[derive(Debug, Clone)]
pub struct Job {
    /// Checkpoint directory or .gguf file.
    pub source: PathBuf,
    pub output: PathBuf,
    pub max_seq_len: usize,
    pub query_len: usize,
    /// The recipe with every flag applied.
    pub recipe: Recipe,
    /// Calibration text (default: the shipped one), used when the recipe calibrates.
    pub calibration: Option<PathBuf>,
    pub compute_precision: ComputePrecision,
    pub activation_ranges: Option<PathBuf>,
    pub no_range_scaling: bool,
    pub device: Option<String>,
    pub increased_memory_limit: bool,
    pub allow_over_budget: bool,
    pub force: bool,
    pub python_env: Option<PathBuf>,
}

/// A job's checkpoint, opened; a GGUF source is imported into a temporary directory that
/// lives as long as this.
pub struct Opened {
    pub ckpt: Checkpoint,
    _imported: Option<tempfile::TempDir>,
}

/// What a job will produce and whether it fits its device.
#[derive(Debug, Clone)]
pub struct Plan {
    pub predicted_weight_bytes: u64,
    pub budget: Option<Budget>,
}

impl Job {
    /// Checks that need no input file: the shape, the output name, a writable output place.
    pub fn check(&self) -> anyhow::Result<()> {
        super::check_shape(self.max_seq_len, self.query_len)?;
        Outputs::for_package(&self.output)?;
        // Refuse an output that cannot be written before minutes of work, not after.
        hf2coreml::fsutil::check_writable(&self.output)?;
        Ok(())
    }

    fn is_gguf(&self) -> bool {
        self.source.is_file() && gguf::is_gguf_file(&self.source)
    }

    /// Open the checkpoint (importing a GGUF file first).
    pub fn open(&self) -> anyhow::Result<Opened> {
        let imported = if self.is_gguf() {
            let tmp = hf2coreml::fsutil::scratch_dir("gguf")
                .context("cannot create a temporary directory for the GGUF import")?;
            let stem = self
                .source
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into());
            let dest = tmp.path().join(stem);
            let pb = progress_bar(1, "import");
            pb.set_message("GGUF → checkpoint");
            gguf::import(
                &self.source,
                &dest,
                &ImportOptions { force: false },
                &crate::printer::Bars::default(),
            )
            .with_context(|| format!("cannot import {}", self.source.display()))?;
            pb.finish_and_clear();
            Some((tmp, dest))
        } else {
            None
        };
        let dir = imported.as_ref().map_or(&self.source, |(_, d)| d);
        let ckpt = Checkpoint::open(dir)
            .with_context(|| format!("cannot read checkpoint {}", self.source.display()))?;
        Ok(Opened {
            ckpt,
            _imported: imported.map(|(t, _)| t),
        })
    }

    /// Predicted weights and, with a device, the budget; refuses (exit 1) a plan that does not
    /// fit unless over-budget plans are allowed.
    pub fn plan(&self, ckpt: &Checkpoint) -> anyhow::Result<Plan> {
        let spec = ckpt.spec();
        let predicted = budget::weights_bytes(&ckpt.slots(), |s| self.recipe.storage(s));
        let budget = match &self.device {
            Some(id) => {
                let devices = Devices::builtin();
                let limit = Limit::for_device(devices.get(id)?, self.increased_memory_limit);
                let b = budget::compute(spec, predicted, self.max_seq_len, self.query_len, &limit);
                if !b.fits && !self.allow_over_budget {
                    return Err(CheckFailed(format!(
                        "the plan needs {} on {id} but only {} is usable (largest max_seq_len \
                         that fits: {}); use a smaller --max-seq-len, or --allow-over-budget",
                        fmt_bytes(b.total_bytes),
                        fmt_bytes(b.usable_bytes),
                        fmt_count(b.max_seq_len_that_fits as u64)
                    ))
                    .into());
                }
                Some(b)
            }
            None => None,
        };
        Ok(Plan {
            predicted_weight_bytes: predicted,
            budget,
        })
    }

    /// What the package will be made from: hashes of the source files and of the calibration
    /// text, the applied recipe and the settings.
    pub fn inputs(&self) -> anyhow::Result<Inputs> {
        let sources = if self.is_gguf() {
            let name = self
                .source
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            BTreeMap::from([(name, convert::sha256_file(&self.source)?)])
        } else {
            let ckpt = Checkpoint::open(&self.source)
                .with_context(|| format!("cannot read checkpoint {}", self.source.display()))?;
            convert::source_hashes(&ckpt)?
        };
        let calibration = match (&self.calibration, self.recipe.calibration()) {
            (_, None) => None,
            (Some(p), Some(_)) => Some(convert::sha256_file(p)?),
            (None, Some(_)) => Some(convert::sha256_hex(convert::CALIBRATION_TEXT.as_bytes())),
        };
        let ranges = match (&self.activation_ranges, self.no_range_scaling) {
            (_, true) => serde_json::json!("off"),
            (Some(p), false) => serde_json::json!(convert::sha256_file(p)?),
            (None, false) => serde_json::json!("measured"),
        };
        let settings = BTreeMap::from([
            (
                "max_seq_len".to_string(),
                serde_json::json!(self.max_seq_len),
            ),
            ("query_len".to_string(), serde_json::json!(self.query_len)),
            (
                "compute_precision".to_string(),
                serde_json::json!(self.compute_precision.as_str()),
            ),
            ("range_scaling".to_string(), ranges),
            ("device".to_string(), serde_json::json!(self.device)),
            (
                "increased_memory_limit".to_string(),
                serde_json::json!(self.increased_memory_limit),
            ),
            (
                "allow_over_budget".to_string(),
                serde_json::json!(self.allow_over_budget),
            ),
        ]);
        Ok(Inputs::new(
            sources,
            self.recipe.to_toml(),
            calibration,
            settings,
        ))
    }

    /// Open, plan and convert.
    pub fn run(&self) -> anyhow::Result<ConvertSummary> {
        let inputs = self.inputs()?;
        let opened = self.open()?;
        self.convert(&opened, inputs)
    }

    /// Convert an opened checkpoint (the plan is checked again first).
    pub fn convert(&self, opened: &Opened, inputs: Inputs) -> anyhow::Result<ConvertSummary> {
        let start = Instant::now();
        self.check()?;
        if self.output.exists() && !self.force {
            anyhow::bail!(
                "{} already exists (use --force to replace it)",
                self.output.display()
            );
        }
        let ckpt = &opened.ckpt;
        self.plan(ckpt)?;
        // NaN/Inf weights would poison every output; refuse them before any work.
        ckpt.check_finite()
            .with_context(|| format!("cannot convert {}", self.source.display()))?;
        let ranges: Option<ActivationRanges> =
            match &self.activation_ranges {
                Some(p) => {
                    let text = std::fs::read_to_string(p)
                        .with_context(|| format!("cannot read {}", p.display()))?;
                    Some(serde_json::from_str(&text).with_context(|| {
                        format!("{}: not an activation-ranges JSON", p.display())
                    })?)
                }
                None => None,
            };
        // Find Python before the expensive stages so a missing environment fails fast.
        let python_env = PythonEnv::discover(self.python_env.as_deref())?;
        hf2coreml::emit::check_environment(&python_env)?;
        detail(format!("python environment: {}", python_env.root.display()));

        let mut times = StageTimes {
            read: start.elapsed().as_secs_f64(),
            ..StageTimes::default()
        };
        let measure = self.compute_precision == ComputePrecision::Fp16
            && !self.no_range_scaling
            && ranges.is_none();
        let ranges = if measure {
            let t = Instant::now();
            let pb = progress_bar(1, "calibrate");
            pb.set_message("reference forward pass on calibration text");
            let r = convert::measure_ranges(ckpt)?;
            pb.finish_and_clear();
            times.calibrate = t.elapsed().as_secs_f64();
            detail(format!(
                "activation ranges: residual max |x| {:.0} ({}), {:.1} s",
                r.residual_max_abs.iter().fold(0.0f32, |a, &b| a.max(b)),
                r.source,
                times.calibrate
            ));
            Some(r)
        } else if self.no_range_scaling {
            None
        } else {
            ranges
        };

        let t = Instant::now();
        let plan = hf2coreml::quant::Report::plan(ckpt, &self.recipe)?;
        let (tokens, source) =
            super::palettize::calibration_tokens(self.calibration.as_deref(), &self.recipe, ckpt)?;
        if let Some(source) = &source {
            detail(format!("calibrating on {source}"));
        }
        let pb = progress_bar(plan.totals.palettized_tensors as u64, "palettize");
        if !tokens.is_empty() {
            pb.set_message("calibrating");
        }
        let (weights, report) =
            hf2coreml::pipeline::weights::prepare_weights(ckpt, &self.recipe, &tokens, &|line| {
                pb.set_message(line.name.clone());
                pb.inc(1);
            })?;
        pb.finish_and_clear();
        times.palettize = t.elapsed().as_secs_f64();
        detail(format!(
            "palettized {} tensors in {:.1} s",
            plan.totals.palettized_tensors, times.palettize
        ));
        let applied = serde_json::json!({
            "origin": self.recipe.origin(),
            "toml": self.recipe.to_toml(),
            "tensors": report
                .tensors
                .iter()
                .map(|l| (l.name.clone(), l.decision.to_string()))
                .collect::<BTreeMap<_, _>>(),
        });
        let opts = ConvertOptions {
            checkpoint: self.source.clone(),
            output: self.output.clone(),
            max_seq_len: self.max_seq_len,
            query_len: self.query_len,
            precision: self.compute_precision,
            ranges,
            force: self.force,
            python_env,
            inputs: Some(inputs),
        };
        Ok(convert::convert(
            ckpt,
            &opts,
            weights,
            applied,
            Some(report),
            times,
            &crate::printer::Bars::default(),
        )?)
    }
}

fn print_plan(
    job: &Job,
    ckpt: &Checkpoint,
    plan: &Plan,
    outputs: &Outputs,
    json: bool,
) -> anyhow::Result<()> {
    let spec = ckpt.spec();
    let range_scaling = match (&job.activation_ranges, job.no_range_scaling) {
        (_, true) => "off".to_string(),
        (Some(p), false) => format!("from {}", p.display()),
        (None, false) => "measured on the calibration text".to_string(),
    };
    if json {
        return super::print_json(&serde_json::json!({
            "checkpoint": job.source,
            "architecture": spec.architecture.hf_name(),
            "max_seq_len": job.max_seq_len,
            "query_len": job.query_len,
            "compute_precision": job.compute_precision.as_str(),
            "recipe": job.recipe.origin(),
            "range_scaling": range_scaling,
            "predicted_weight_bytes": plan.predicted_weight_bytes,
            "budget": plan.budget,
            "outputs": outputs,
        }));
    }
    println!(
        "Plan: {} → {}",
        job.source.display(),
        outputs.package.display()
    );
    println!(
        "  {} layers, S={} Q={}, {} compute",
        spec.num_hidden_layers,
        job.max_seq_len,
        job.query_len,
        job.compute_precision.as_str()
    );
    println!(
        "  weights       {} (recipe {})",
        fmt_bytes(plan.predicted_weight_bytes),
        job.recipe.origin()
    );
    if let Some(b) = &plan.budget {
        println!(
            "  budget        {} of {} usable on {} ({})",
            fmt_bytes(b.total_bytes),
            fmt_bytes(b.usable_bytes),
            b.device.as_deref().unwrap_or("?"),
            if b.fits { "fits" } else { "over budget" }
        );
    }
    println!("  range scaling {range_scaling}");
    println!("  (dry run: nothing written)");
    Ok(())
}

fn print_summary(summary: &ConvertSummary) {
    let o = &summary.outputs;
    println!("wrote {}", o.package.display());
    if let Some(t) = &o.tokenizer {
        println!("      {}", t.display());
    }
    println!("      {}", o.report.display());
    println!(
        "  package {} on disk (weight.bin {}, predicted {}), {:.2} bits/weight over {} parameters",
        fmt_bytes(summary.package_bytes),
        fmt_bytes(summary.weight_bin_bytes),
        fmt_bytes(summary.predicted_weight_bytes),
        summary.bits_per_weight,
        fmt_count(summary.parameters)
    );
    let tm = &summary.times;
    println!(
        "  time: read {:.2}s, calibrate {:.2}s, palettize {:.2}s, build {:.2}s, serialize {:.2}s, total {:.2}s",
        tm.read, tm.calibrate, tm.palettize, tm.build, tm.serialize, tm.total
    );
    let sc = &summary.contract.scaling;
    println!(
        "  residual scale {} ({})",
        sc["residual_scale"],
        sc["source"].as_str().unwrap_or("")
    );
}
