//! `hf2coreml convert`: flags → a [`Job`], run (or planned, with `--dry-run`), printed.

use std::path::PathBuf;

use crate::printer::Bars;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::emit::{EmitError, PythonEnv};
use hf2coreml::pipeline::convert_summary::ConvertSummary;
use hf2coreml::pipeline::job::{Job, Plan};
use hf2coreml::pipeline::options::ComputePrecision;
use hf2coreml::pipeline::package_files::Outputs;
use hf2coreml::quant::recipe::RecipeFile;
use hf2coreml::util::{fmt_bytes, fmt_count};

use super::args::{KvCacheArg, LayoutArg, PrefillLogitsArg, RecipeArgs};
use hf2coreml::mil::contract::PrefillLogits;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + *.safetensors), a .gguf file (imported first, as
    /// `import-gguf` does), or a Hub id (ORG/NAME[@REV]) in the local Hugging Face cache.
    pub dir: PathBuf,
    /// The package to write (must end in .mlpackage); X.tokenizer.json and X.report.json are
    /// written beside it (and Gemma 4's per-layer table, X.per_layer.bin).
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
    /// The graph's layout, overriding the recipe's `layout` (default: default). `ane` builds
    /// the Neural Engine's (B, C, 1, S) form: 1×1 convs, per-head attention, the same inputs
    /// and outputs (docs/targets.md, "The Neural Engine layout").
    #[arg(long, value_enum, value_name = "LAYOUT")]
    pub layout: Option<LayoutArg>,
    /// How the KV cache crosses the package boundary, overriding the recipe's `kv_cache`
    /// (default: io). `state` (needs --target ios18) keeps it inside Core ML as one state
    /// (`MLState`), for GPU and Mac targets (docs/targets.md, "Stateful KV cache").
    #[arg(long, value_enum, value_name = "MODE")]
    pub kv_cache: Option<KvCacheArg>,
    /// iOS18 and Core AI: one package (or asset) with a `prefill` function of Q tokens a call
    /// (for prompts) and a `decode` function of one token (the default function), sharing
    /// every weight; overrides the recipe's `prefill_len`. Default with --target ios18: 64 (at
    /// most --max-seq-len); with coreai: none. 0 keeps one function. iOS17 packages have one
    /// function: refused there.
    #[arg(long, value_name = "Q")]
    pub prefill_len: Option<usize>,
    /// The logits the prefill function returns, overriding the recipe's `prefill_logits`:
    /// `last` (the default) the last position's row, the one a host samples from; `all` every
    /// position's (diagnosis: `run --logits-out` through prefill). Needs a prefill function.
    #[arg(long, value_enum, value_name = "ROWS")]
    pub prefill_logits: Option<PrefillLogitsArg>,
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
    /// Split the model into a chain of packages of at most SIZE each when it does not fit in
    /// one (bytes, or with a unit: 900MB, 1GiB). Default: the --device profile's (1 GB for
    /// iPhones, 2 GiB for Macs), else 1 GB.
    #[arg(long, value_name = "SIZE", value_parser = parse_package_size)]
    pub max_package_size: Option<u64>,
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
    let RecipeFile {
        recipe,
        mut package,
    } = args.recipe.load_file()?;
    if let Some(l) = args.layout {
        package.layout = l.into();
    }
    if let Some(k) = args.kv_cache {
        package.kv_cache = k.into();
    }
    if let Some(q) = args.prefill_len {
        package.prefill_len = Some(q);
    }
    if let Some(p) = args.prefill_logits {
        package.prefill_logits = Some(p.into());
    }
    let job = Job {
        source: args.dir.clone(),
        output: args.output.clone(),
        max_seq_len: args.max_seq_len,
        query_len: args.query_len,
        recipe,
        package,
        calibration: args.recipe.calibration.clone(),
        compute_precision: args.compute_precision.into(),
        activation_ranges: args.activation_ranges.clone(),
        no_range_scaling: args.no_range_scaling,
        device: args.device.clone(),
        increased_memory_limit: args.increased_memory_limit,
        allow_over_budget: args.allow_over_budget,
        max_package_size: args.max_package_size,
        force: args.force,
        python_env: args.python_env.clone(),
    };
    job.check()?;
    if !args.dry_run {
        job.refuse_existing()?;
    }
    let progress = Bars::default();
    if args.dry_run {
        let opened = job.open(&progress)?;
        let plan = job.plan(&opened.ckpt)?;
        let outputs = Outputs::for_package(&job.output)?;
        // The plan is printed either way; a conversion that could not emit fails the dry run.
        let python = python_check(job.python_env.as_deref());
        print_plan(&job, &opened.ckpt, &plan, &outputs, &python, args.json)?;
        return python.map(|_| ()).map_err(Into::into);
    }
    let summary = job.run(&progress)?;
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

/// The Python environment a conversion would use and its coremltools version.
fn python_check(flag: Option<&std::path::Path>) -> Result<(PythonEnv, String), EmitError> {
    let env = PythonEnv::discover(flag)?;
    let version = hf2coreml::emit::check_environment(&env)?;
    Ok((env, version))
}

fn print_plan(
    job: &Job,
    ckpt: &Checkpoint,
    plan: &Plan,
    outputs: &Outputs,
    python: &Result<(PythonEnv, String), EmitError>,
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
            "prefill_len": job.prefill_len()?,
            "prefill_logits": match job.prefill_len()? {
                0 => None,
                _ => Some(job.prefill_logits()?.as_str()),
            },
            "compute_precision": job.compute_precision.as_str(),
            "recipe": job.recipe.origin(),
            "range_scaling": range_scaling,
            "predicted_weight_bytes": plan.predicted_weight_bytes,
            "budget": plan.budget,
            "outputs": outputs,
            "python_env": match python {
                Ok((env, version)) => serde_json::json!({
                    "root": env.root, "origin": env.origin, "coremltools": version,
                }),
                Err(e) => serde_json::json!({
                    "error": hf2coreml::error::causes(e)
                        .map(|c| c.to_string())
                        .collect::<Vec<_>>()
                        .join(": "),
                }),
            },
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
    match job.prefill_len()? {
        0 => {}
        q => println!(
            "  functions     prefill (Q={q}, logits of {}) and decode (Q=1, the default)",
            match job.prefill_logits()? {
                PrefillLogits::Last => "the last position",
                PrefillLogits::All => "every position",
            }
        ),
    }
    match python {
        Ok((env, version)) => println!(
            "  python env    {} (coremltools {version})",
            env.root.display()
        ),
        Err(_) => println!("  python env    unusable (see the error below)"),
    }
    println!("  (dry run: nothing written)");
    Ok(())
}

fn print_summary(summary: &ConvertSummary) {
    let o = &summary.outputs;
    println!("wrote {}", o.package.display());
    for side in [&o.tokenizer, &o.tokenizer_config].into_iter().flatten() {
        println!("      {}", side.display());
    }
    println!("      {}", o.report.display());
    if let (Some(file), Some(t)) = (&o.per_layer, &summary.contract.per_layer) {
        println!(
            "      {} (the per-layer table, {}: the app memory-maps it beside the package)",
            file.display(),
            fmt_bytes(t.file_bytes())
        );
    }
    // A Core AI asset keeps its weights in each function's bytecode.
    let coreai = summary.contract.target.is_coreai();
    let (kind, weights) = if coreai {
        ("asset", "bytecode")
    } else {
        ("package", "weight.bin")
    };
    println!(
        "  {kind} {} on disk ({weights} {}, predicted {}), {:.2} bits/weight over {} parameters",
        fmt_bytes(summary.package_bytes),
        fmt_bytes(summary.weight_bin_bytes),
        fmt_bytes(summary.predicted_weight_bytes),
        summary.bits_per_weight,
        fmt_count(summary.parameters)
    );
    if let Some(chain) = &summary.chain {
        println!(
            "  a chain of {} {kind}s (chain.json; run, validate and {} take {}):",
            chain.parts.len(),
            if coreai { "inspect" } else { "lint" },
            o.package.display()
        );
        for p in &chain.parts {
            println!(
                "    {}  layers {}..{}{}{}  {}",
                p.path,
                p.layers.start,
                p.layers.end,
                if p.embedding { ", embedding" } else { "" },
                if p.head { ", lm_head" } else { "" },
                fmt_bytes(p.bytes)
            );
        }
    }
    let tm = &summary.times;
    println!(
        "  time: read {:.2}s, ranges {:.2}s, palettize {:.2}s, build {:.2}s, serialize {:.2}s, total {:.2}s",
        tm.read, tm.ranges, tm.palettize, tm.build, tm.serialize, tm.total
    );
    let sc = &summary.contract.scaling;
    println!(
        "  residual scale {} ({})",
        sc["residual_scale"],
        sc["source"].as_str().unwrap_or("")
    );
}

/// `--max-package-size`: a size, at least 1 byte.
fn parse_package_size(s: &str) -> Result<u64, String> {
    hf2coreml::budget::parse_size(s)
        .and_then(|b| hf2coreml::budget::package_size(b, s))
        .map_err(|e| e.to_string())
}
