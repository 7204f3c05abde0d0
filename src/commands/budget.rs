//! `hf2coreml budget`: a plan's memory against a device's app limit (exit 1 when it does not
//! fit), or the device table.

use std::path::PathBuf;

use hf2coreml::budget::{self, Devices, Limit, PlanInput, PlanSource};
use hf2coreml::checkpoint::gguf;
use hf2coreml::error::CheckFailed;
use hf2coreml::util::{fmt_bytes, fmt_count};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + *.safetensors), a .gguf file (planned from its
    /// header alone), a config.json (a file, or a directory holding no weights: a plan needs
    /// the shapes, not the weights), or a Hub id (ORG/NAME[@REV]) in the local Hugging Face
    /// cache.
    #[arg(required_unless_present = "list_devices")]
    pub dir: Option<PathBuf>,
    /// Target device profile (see --list-devices).
    #[arg(long, conflicts_with = "memory_limit")]
    pub device: Option<String>,
    /// Check against an explicit limit instead of a device, e.g. `3.5GiB` or bytes.
    #[arg(long, value_parser = budget::parse_size)]
    pub memory_limit: Option<u64>,
    /// Use the limit with the increased-memory-limit entitlement.
    #[arg(long)]
    pub increased_memory_limit: bool,
    /// The fraction of the limit not planned into (default: the device's, else the device
    /// table's default, 0.10).
    #[arg(long, value_parser = parse_margin)]
    pub safety_margin: Option<f64>,
    /// What Core ML and the app cost besides the model (default: the device's, else the
    /// device table's default, 150 MiB), e.g. `200MiB`.
    #[arg(long, value_parser = budget::parse_size)]
    pub runtime_overhead: Option<u64>,
    /// The package's fixed max_sequence_length S.
    #[arg(long, default_value_t = 512)]
    pub max_seq_len: usize,
    /// Tokens per step Q.
    #[arg(long, default_value_t = 1)]
    pub query_len: usize,
    /// Device table to use instead of the built-in one.
    #[arg(long)]
    pub devices: Option<PathBuf>,
    /// Print the device table and exit.
    #[arg(long)]
    pub list_devices: bool,
    /// Also size every shipped recipe and name the least compressed that fits at S, with the
    /// largest S it allows. Exit 0 when one fits, 1 when none does.
    #[arg(long)]
    pub suggest: bool,
    /// The largest package before the model is split into a chain (as `convert`): bytes or
    /// with a unit; default: the device's (1 GB for iPhones), else 1 GB.
    #[arg(long, value_parser = budget::parse_size)]
    pub max_package_size: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub recipe: super::args::RecipeArgs,
}

fn parse_margin(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(m) if (0.0..1.0).contains(&m) => Ok(m),
        _ => Err(format!("`{s}` is not a fraction in [0, 1), e.g. 0.1")),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let devices = match &args.devices {
        Some(p) => Devices::from_file(p)?,
        None => Devices::builtin(),
    };
    if args.list_devices {
        return list_devices(&devices, args.json);
    }
    let dir = args.dir.as_ref().expect("clap requires dir");
    hf2coreml::pipeline::job::check_shape(args.max_seq_len, args.query_len)?;
    let mut limit = match (&args.device, args.memory_limit) {
        (Some(id), _) => Limit::for_device(devices.get(id)?, args.increased_memory_limit),
        (None, Some(bytes)) => Limit::explicit(bytes, devices.defaults),
        (None, None) => anyhow::bail!("give --device NAME or --memory-limit BYTES"),
    };
    if let Some(m) = args.safety_margin {
        limit.safety_margin = m;
    }
    if let Some(o) = args.runtime_overhead {
        limit.runtime_overhead_bytes = o;
    }
    let recipe = args.recipe.load()?;
    let input = PlanInput::open(dir)?;
    let spec = &input.spec;
    hf2coreml::pipeline::job::check_context(spec, args.max_seq_len)?;
    let weights = input.weights_bytes(&recipe);
    let per_layer_bits = hf2coreml::pipeline::job::per_layer_bits(spec, &recipe)?;
    let shape = (args.max_seq_len, args.query_len);
    let b = budget::compute(spec, weights, shape, per_layer_bits, &limit);
    let package_limit = match (args.max_package_size, &args.device) {
        (Some(bytes), _) => bytes,
        (None, Some(id)) => devices.get(id)?.max_package_size_bytes,
        (None, None) => budget::DEFAULT_MAX_PACKAGE_BYTES,
    };
    let per_part = budget::split::part_overhead_bytes(spec, args.max_seq_len);
    let units = budget::split::ModelBytes::measure(spec, &input.slots, per_part, |s| {
        recipe.storage(s).bytes(s.numel())
    });
    let packages = budget::split::plan(&units, package_limit);
    let suggestion = match args.suggest {
        true => Some(budget::suggest(
            &input,
            args.max_seq_len,
            args.query_len,
            &limit,
            package_limit,
        )?),
        false => None,
    };
    if args.json {
        super::print_json(&Report {
            budget: &b,
            packages: match &packages {
                Ok(plan) => serde_json::json!(plan),
                Err(e) => serde_json::json!({ "limit": package_limit, "error": e.to_string() }),
            },
            suggest: suggestion.as_ref(),
        })?;
    } else {
        print_budget(&b, &input, &recipe, &devices)?;
        print_packages(&packages, package_limit);
        if let Some(s) = &suggestion {
            print_suggestion(s);
        }
    }
    match suggestion {
        Some(s) if s.recipe.is_none() => Err(CheckFailed(format!(
            "no shipped recipe fits at S={}: the smallest needs {} of weights, {} is usable",
            s.max_seq_len,
            fmt_bytes(s.candidates.last().map_or(0, |c| c.weights_bytes)),
            fmt_bytes(b.usable_bytes)
        ))
        .into()),
        Some(_) => Ok(()),
        None if !b.fits => Err(CheckFailed(format!(
            "the plan needs {} but only {} is usable",
            fmt_bytes(b.total_bytes),
            fmt_bytes(b.usable_bytes)
        ))
        .into()),
        None if packages.is_err() => Err(CheckFailed(format!(
            "the model cannot be split into packages: {}",
            packages
                .as_ref()
                .err()
                .map_or(String::new(), |e| e.to_string())
        ))
        .into()),
        None => Ok(()),
    }
}

/// `budget --json`: the budget's fields, and `suggest` with `--suggest`.
#[derive(serde::Serialize)]
struct Report<'a> {
    #[serde(flatten)]
    budget: &'a budget::Budget,
    /// The split into packages under the package size limit (`convert`'s plan), or why none.
    packages: serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    suggest: Option<&'a budget::Suggestion>,
}

/// The packages `convert` would write: one, or a chain of parts under the limit.
fn print_packages(
    packages: &Result<budget::split::ChainPlan, budget::split::ChainError>,
    limit: u64,
) {
    let plan = match packages {
        Ok(plan) => plan,
        Err(e) => {
            println!(
                "  packages               none under {}: {e}",
                fmt_bytes(limit)
            );
            return;
        }
    };
    println!(
        "  packages               {} under {} each (convert --max-package-size)",
        plan.parts.len(),
        fmt_bytes(limit)
    );
    for (i, p) in plan.parts.iter().enumerate() {
        let what = match (p.embedding, p.layers.is_empty(), p.head) {
            (true, true, false) => "embedding".to_string(),
            (false, true, true) => "head".to_string(),
            (e, _, h) => format!(
                "{}blocks {}-{}{}",
                if e { "embedding, " } else { "" },
                p.layers.start,
                p.layers.end.saturating_sub(1),
                if h { ", head" } else { "" }
            ),
        };
        println!("    part {i:<3} {:>12}  {what}", fmt_bytes(p.bytes));
    }
}

/// The budget's terms, the total against the limit, and what a GGUF source adds.
fn print_budget(
    b: &budget::Budget,
    input: &PlanInput,
    recipe: &hf2coreml::quant::Recipe,
    devices: &Devices,
) -> anyhow::Result<()> {
    let spec = &input.spec;
    let target = match &b.device {
        Some(id) => format!(
            "{} ({}{})",
            id,
            devices.get(id)?.name,
            if b.increased_memory_limit {
                ", increased-memory-limit entitlement"
            } else {
                ""
            }
        ),
        None => "explicit limit".to_string(),
    };
    println!(
        "Budget for {} at S={} Q={} on {}",
        spec.architecture, b.max_seq_len, b.query_len, target
    );
    if let PlanSource::Config = input.source {
        println!("  (planned from the configuration alone: no weights read)");
    }
    let row = |k: &str, v: u64, note: &str| {
        println!("  {k:<22} {:>12}  {note}", fmt_bytes(v));
    };
    row(
        "weights",
        b.weights_bytes,
        &format!("recipe: {}", recipe.origin()),
    );
    if b.mapped_bytes > 0 {
        let stored = b
            .per_layer_bits
            .map_or("fp16".to_string(), |n| format!("{n}-bit LUT indices"));
        row(
            "per-layer table",
            b.mapped_bytes,
            &format!(
                "{stored}, a file beside the package, memory-mapped: not in the total (a step \
                 reads its tokens' rows)"
            ),
        );
    }
    row(
        "kv cache",
        b.kv_cache_bytes,
        &kv_formula(spec, b.max_seq_len),
    );
    let recurrent = spec
        .recurrent_state(0..spec.num_hidden_layers)
        .map_or(0, |r| r.blocks - r.attention_layers.len());
    if recurrent > 0 {
        // What the same blocks would keep if every one attended: the memory the recurrent
        // blocks' fixed state saves at this context.
        let all = 2
            * spec.num_hidden_layers as u64
            * spec.num_key_value_heads as u64
            * spec.head_dim as u64
            * b.max_seq_len as u64
            * 2;
        row(
            "  if all attended",
            all,
            &format!(
                "the same {} blocks all keeping KV rows ({recurrent} of them recurrent here)",
                spec.num_hidden_layers
            ),
        );
    }
    row(
        "step working set",
        b.working_set_bytes,
        "logits, updates, scores, activations",
    );
    row(
        "runtime overhead",
        b.runtime_overhead_bytes,
        "Core ML + app",
    );
    row("total", b.total_bytes, "");
    row(
        "usable",
        b.usable_bytes,
        &format!(
            "limit {} less {:.0}% safety margin",
            fmt_bytes(b.limit_bytes),
            b.safety_margin * 100.0
        ),
    );
    println!(
        "  {}: headroom {}{}; largest max_seq_len that fits: {}",
        if b.fits { "FITS" } else { "DOES NOT FIT" },
        if b.headroom_bytes < 0 { "-" } else { "" },
        fmt_bytes(b.headroom_bytes.unsigned_abs()),
        fmt_count(b.max_seq_len_that_fits as u64)
    );
    if let PlanSource::Gguf(info) = &input.source {
        print_source(info, &input.slots, recipe);
    }
    Ok(())
}

/// `--suggest`: every shipped recipe by size, and the pick.
fn print_suggestion(s: &budget::Suggestion) {
    println!(
        "  shipped recipes, least compressed first, at S={}:",
        s.max_seq_len
    );
    for c in &s.candidates {
        let packages = match c.packages {
            0 => "no split fits".to_string(),
            1 => "1 package".to_string(),
            n => format!("{n} packages"),
        };
        println!(
            "    {:<16} weights {:>10}  {:<12}  largest S {:<8} {packages}",
            c.recipe,
            fmt_bytes(c.weights_bytes),
            if c.fits { "fits" } else { "does not fit" },
            fmt_count(c.max_seq_len_that_fits as u64)
        );
    }
    match &s.recipe {
        Some(r) => println!(
            "  suggest: --recipe {r} (the least compressed that fits), --max-seq-len up to {}",
            fmt_count(s.max_seq_len_that_fits as u64)
        ),
        None if s.max_seq_len_that_fits > 0 => println!(
            "  suggest: nothing fits at S={}; the most compressed fits up to S={}",
            s.max_seq_len,
            fmt_count(s.max_seq_len_that_fits as u64)
        ),
        None => println!("  suggest: no shipped recipe fits this device at any S"),
    }
}

/// `--list-devices`: the device table.
fn list_devices(devices: &Devices, json: bool) -> anyhow::Result<()> {
    if json {
        return super::print_json(&devices.devices);
    }
    println!(
        "{:<20} {:<44} {:>9} {:>11} {:>11}",
        "device", "name", "RAM", "app limit", "increased"
    );
    for d in &devices.devices {
        println!(
            "{:<20} {:<44} {:>9} {:>11} {:>11}",
            d.id,
            d.name,
            fmt_bytes(d.ram_bytes),
            fmt_bytes(d.app_limit_bytes),
            fmt_bytes(d.app_limit_increased_bytes)
        );
    }
    Ok(())
}

/// What a GGUF source adds to the budget: its parameters, bits per weight, the note when the
/// recipe re-quantizes to as few bits, and where an incomplete file stops.
fn print_source(
    info: &gguf::header::HeaderInfo,
    slots: &[hf2coreml::arch::TensorSlot],
    recipe: &hf2coreml::quant::Recipe,
) {
    println!(
        "  source                 {} parameters at {:.2} bits/weight ({}, header only)",
        fmt_count(slots.iter().map(|s| s.numel() as u64).sum()),
        info.bits_per_weight,
        info.path.display()
    );
    if let Some(note) = hf2coreml::pipeline::inspect::requantization_note(info, slots, recipe) {
        println!("  note: {note}");
    }
    if let Some(at) = info.truncated_at {
        println!("  source                 tensor data truncated at byte {at}");
    }
}

/// How the state bytes are made: the attention blocks' rows, and a hybrid model's fixed
/// convolution (and DeltaNet) states beside them.
fn kv_formula(spec: &hf2coreml::arch::ModelSpec, max_seq_len: usize) -> String {
    let recurrent = spec.recurrent_state(0..spec.num_hidden_layers).is_some();
    // The blocks that keep rows, by head shape (Gemma 4's full blocks have their own).
    let mut shapes: Vec<((usize, usize), usize)> = Vec::new();
    for l in spec.attention_layers(0..spec.num_hidden_layers) {
        let a = *spec.layer(l).attention().expect("a cache block attends");
        match shapes
            .iter_mut()
            .find(|(s, _)| *s == (a.kv_heads, a.head_dim))
        {
            Some((_, n)) => *n += 1,
            None => shapes.push(((a.kv_heads, a.head_dim), 1)),
        }
    }
    let terms: Vec<String> = shapes
        .iter()
        .map(|((heads, d), n)| {
            let kind = if recurrent { "attention " } else { "" };
            let layers = if *n == 1 { "layer" } else { "layers" };
            format!("{n} {kind}{layers} × {heads} kv heads × {d}")
        })
        .collect();
    let terms = match terms.len() {
        1 => terms[0].clone(),
        _ => format!("({})", terms.join(" + ")),
    };
    let rows = format!("2 × {terms} × S {max_seq_len} × 2 B");
    let shared = (0..spec.num_hidden_layers)
        .filter(|&l| spec.kv_producer(l).is_some())
        .count();
    let rows = match shared {
        0 => rows,
        n => format!("{rows}; {n} blocks read another's"),
    };
    let conv = spec
        .short_conv
        .as_ref()
        .map(|c| (c.layers.len(), spec.hidden_size, c.kernel));
    let delta = spec.gated_delta.as_ref();
    let conv = conv.or(delta.map(|g| (g.layers.len(), g.conv_channels(), g.kernel)));
    let mut out = rows;
    if let Some((n, channels, kernel)) = conv {
        out += &format!(" + {n} conv states of {channels} × {} × 2 B", kernel - 1);
    }
    if let Some(g) = delta {
        out += &format!(
            " + {} DeltaNet states of {} × {} × {} × 2 B",
            g.layers.len(),
            g.value_heads,
            g.key_dim,
            g.value_dim
        );
    }
    out
}
