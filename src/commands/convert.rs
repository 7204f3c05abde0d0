use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use hf2coreml::budget::{self, Devices, Limit};
use hf2coreml::checkpoint::gguf::{self, ImportOptions};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::emit::pipeline::{self, ComputePrecision, ConvertOptions, Outputs, StageTimes};
use hf2coreml::emit::PythonEnv;
use hf2coreml::graph::scaling::ActivationRanges;
use hf2coreml::util::{fmt_bytes, fmt_count, progress_bar};

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
    #[arg(long, value_enum, default_value_t = ComputePrecision::Fp16)]
    pub compute_precision: ComputePrecision,
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
    let start = Instant::now();
    if args.max_seq_len == 0 || args.query_len == 0 {
        anyhow::bail!("--max-seq-len and --query-len must be at least 1");
    }
    if args.max_seq_len > budget::MAX_SEQ_CAP {
        anyhow::bail!(
            "--max-seq-len {} exceeds the limit of {}",
            args.max_seq_len,
            budget::MAX_SEQ_CAP
        );
    }
    if args.query_len > args.max_seq_len {
        anyhow::bail!(
            "--query-len ({}) cannot exceed --max-seq-len ({})",
            args.query_len,
            args.max_seq_len
        );
    }
    let outputs = Outputs::for_package(&args.output)?;
    if args.output.exists() && !args.force {
        anyhow::bail!(
            "{} already exists (use --force to replace it)",
            args.output.display()
        );
    }
    hf2coreml::util::check_writable(&args.output)?;
    // A GGUF file converts directly: imported into a temporary checkpoint first.
    let imported = if args.dir.is_file() && gguf::is_gguf_file(&args.dir) {
        let tmp = tempfile::Builder::new()
            .prefix("hf2coreml-gguf-")
            .tempdir()
            .context("cannot create a temporary directory for the GGUF import")?;
        hf2coreml::util::remove_on_interrupt(tmp.path());
        let stem = args
            .dir
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let dest = tmp.path().join(stem);
        let pb = progress_bar(1, "import");
        pb.set_message("GGUF → checkpoint");
        gguf::import(&args.dir, &dest, &ImportOptions { force: false })
            .with_context(|| format!("cannot import {}", args.dir.display()))?;
        pb.finish_and_clear();
        Some((tmp, dest))
    } else {
        None
    };
    let dir = imported.as_ref().map_or(&args.dir, |(_, d)| d);
    let ckpt = Checkpoint::open(dir)
        .with_context(|| format!("cannot read checkpoint {}", args.dir.display()))?;
    let open_secs = start.elapsed().as_secs_f64();
    let spec = ckpt.spec().clone();
    let slots = ckpt.slots();
    let recipe = args.recipe.load()?;
    let predicted = budget::weights_bytes(&slots, |s| recipe.storage(s));

    let budget = match &args.device {
        Some(id) => {
            let devices = Devices::builtin();
            let limit = Limit::for_device(devices.get(id)?, args.increased_memory_limit);
            let b = budget::compute(&spec, predicted, args.max_seq_len, args.query_len, &limit);
            if !b.fits && !args.allow_over_budget {
                anyhow::bail!(
                    "the plan needs {} on {id} but only {} is usable (largest max_seq_len that \
                     fits: {}); use a smaller --max-seq-len, or --allow-over-budget",
                    fmt_bytes(b.total_bytes),
                    fmt_bytes(b.usable_bytes),
                    fmt_count(b.max_seq_len_that_fits as u64)
                );
            }
            Some(b)
        }
        None => None,
    };
    let ranges: Option<ActivationRanges> = match &args.activation_ranges {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("{}: not an activation-ranges JSON", p.display()))?,
            )
        }
        None => None,
    };

    if args.dry_run {
        let plan = serde_json::json!({
            "checkpoint": args.dir,
            "architecture": spec.architecture.hf_name(),
            "max_seq_len": args.max_seq_len,
            "query_len": args.query_len,
            "compute_precision": args.compute_precision.as_str(),
            "recipe": recipe.origin(),
            "range_scaling": match (&args.activation_ranges, args.no_range_scaling) {
                (_, true) => "off".to_string(),
                (Some(p), false) => format!("from {}", p.display()),
                (None, false) => "measured on the calibration text".to_string(),
            },
            "predicted_weight_bytes": predicted,
            "budget": budget,
            "outputs": outputs,
        });
        if args.json {
            return super::print_json(&plan);
        }
        println!(
            "Plan: {} → {}",
            args.dir.display(),
            outputs.package.display()
        );
        println!(
            "  {} layers, S={} Q={}, {} compute",
            spec.num_hidden_layers,
            args.max_seq_len,
            args.query_len,
            args.compute_precision.as_str()
        );
        println!(
            "  weights       {} (recipe {})",
            fmt_bytes(predicted),
            recipe.origin()
        );
        if let Some(b) = &budget {
            println!(
                "  budget        {} of {} usable on {} ({})",
                fmt_bytes(b.total_bytes),
                fmt_bytes(b.usable_bytes),
                b.device.as_deref().unwrap_or("?"),
                if b.fits { "fits" } else { "over budget" }
            );
        }
        println!("  (dry run: nothing written)");
        return Ok(());
    }

    // NaN/Inf weights would poison every output; refuse them before any work.
    ckpt.check_finite()
        .with_context(|| format!("cannot convert {}", args.dir.display()))?;
    // Find Python before the expensive stages so a missing environment fails fast.
    let python_env = PythonEnv::discover(args.python_env.as_deref())?;
    hf2coreml::emit::check_environment(&python_env)?;

    let mut times = StageTimes {
        read: open_secs,
        ..StageTimes::default()
    };
    let measure = args.compute_precision == ComputePrecision::Fp16
        && !args.no_range_scaling
        && ranges.is_none();
    let ranges = if measure {
        let t = Instant::now();
        let pb = progress_bar(1, "calibrate");
        pb.set_message("reference forward pass on calibration text");
        let r = pipeline::measure_ranges(&ckpt)?;
        pb.finish_and_clear();
        times.calibrate = t.elapsed().as_secs_f64();
        Some(r)
    } else if args.no_range_scaling {
        None
    } else {
        ranges
    };

    let t = Instant::now();
    let plan = hf2coreml::quant::Report::plan(&ckpt, &recipe)?;
    let (tokens, _) = args.recipe.calibration_tokens(&recipe, &ckpt)?;
    let pb = progress_bar(plan.totals.palettized_tensors as u64, "palettize");
    if !tokens.is_empty() {
        pb.set_message("calibrating");
    }
    let (weights, report) = pipeline::prepare_weights(&ckpt, &recipe, &tokens, &|line| {
        pb.set_message(line.name.clone());
        pb.inc(1);
    })?;
    pb.finish_and_clear();
    times.palettize = t.elapsed().as_secs_f64();
    let applied = serde_json::json!({
        "origin": recipe.origin(),
        "toml": recipe.to_toml(),
        "tensors": report
            .tensors
            .iter()
            .map(|l| (l.name.clone(), l.decision.to_string()))
            .collect::<std::collections::BTreeMap<_, _>>(),
    });
    let opts = ConvertOptions {
        checkpoint: args.dir.clone(),
        output: args.output.clone(),
        max_seq_len: args.max_seq_len,
        query_len: args.query_len,
        precision: args.compute_precision,
        ranges,
        force: args.force,
        python_env,
    };
    let summary = pipeline::convert(&ckpt, &opts, weights, applied, Some(report), times)?;
    if args.json {
        return super::print_json(&summary);
    }
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
    Ok(())
}
