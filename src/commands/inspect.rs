use std::path::{Path, PathBuf};

use anyhow::Context;
use hf2coreml::checkpoint::gguf;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::mil::chain_file::{is_chain, ChainFile};
use hf2coreml::pipeline::inspect as summary;

use hf2coreml::util::{fmt_bytes, fmt_count};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + *.safetensors), a .gguf file (its header only:
    /// no tensor data is read, so an incomplete download works too), or a saved package
    /// (an .mlpackage, ours or anyone's, a chain directory, or a Core AI .aimodel); a Hub id
    /// (ORG/NAME[@REV]) names a checkpoint in the local Hugging Face cache.
    pub dir: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub recipe: super::args::RecipeArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if hf2coreml::aimodel::is_aimodel(&args.dir) {
        if args.recipe != super::args::RecipeArgs::default() {
            anyhow::bail!(
                "{}: a Core AI asset has its weights stored already: recipe options apply to \
                 checkpoints",
                args.dir.display()
            );
        }
        return super::inspect_asset::run(&args.dir, args.json);
    }
    // Named a package, it is read as one (an unreadable one then says so, not "no config.json").
    let named_package = args.dir.extension().is_some_and(|x| x == "mlpackage");
    if named_package || is_chain(&args.dir) || args.dir.join("Manifest.json").is_file() {
        if args.recipe != super::args::RecipeArgs::default() {
            anyhow::bail!(
                "{}: a saved package has its weights stored already: recipe options apply to \
                 checkpoints",
                args.dir.display()
            );
        }
        return saved(&args.dir, args.json);
    }
    let recipe = args.recipe.load()?;
    let s = if gguf::is_gguf_file(&args.dir) {
        let info = gguf::header::read_header(&args.dir)
            .with_context(|| format!("cannot read GGUF header {}", args.dir.display()))?;
        summary::summarize_gguf(info, &recipe)
    } else {
        let ckpt = Checkpoint::open(&args.dir)
            .with_context(|| format!("cannot read checkpoint {}", args.dir.display()))?;
        summary::summarize(&ckpt, &recipe)
    };
    if args.json {
        return super::print_json(&s);
    }
    println!("{}  {}", s.architecture, s.path);
    if let Some(class) = &s.text_of {
        println!("  text decoder of {class}; a conversion leaves out, unread:");
        for d in &s.dropped {
            println!(
                "    {}*  {} tensors, {} parameters, {}",
                d.prefix,
                d.tensors,
                hf2coreml::util::fmt_count(d.parameters),
                hf2coreml::util::fmt_bytes(d.bytes)
            );
        }
    }
    println!(
        "  parameters   {} ({}tied embeddings)",
        fmt_count(s.parameters),
        if s.tie_word_embeddings { "" } else { "un" }
    );
    println!(
        "  layers       {}   hidden {}   intermediate {}",
        s.layers, s.hidden_size, s.intermediate_size
    );
    println!(
        "  heads        {} query, {} key/value (GQA ×{}), head_dim {}",
        s.num_attention_heads,
        s.num_key_value_heads,
        s.num_attention_heads / s.num_key_value_heads,
        s.head_dim
    );
    println!("  vocab        {}", fmt_count(s.vocab_size as u64));
    println!(
        "  context      {}   rope θ {}   scaling {}",
        s.context_length,
        s.rope_theta,
        match &s.rope_scaling {
            hf2coreml::arch::RopeScaling::None => "none".to_string(),
            hf2coreml::arch::RopeScaling::Linear { factor } => format!("linear ×{factor}"),
            hf2coreml::arch::RopeScaling::Llama3 { factor, .. } => format!("llama3 ×{factor}"),
            hf2coreml::arch::RopeScaling::LongRope {
                original_max_position_embeddings: n,
                ..
            } => format!("longrope (short factors up to {n} tokens)"),
        }
    );
    if let Some(h) = &s.hybrid_state {
        println!(
            "  state        {} attention blocks: {} per token; {} recurrent blocks: {} in all",
            h.attention_blocks,
            fmt_bytes(h.kv_bytes_per_token),
            h.recurrent_blocks,
            fmt_bytes(h.recurrent_state_bytes)
        );
    }
    if let Some(g) = &s.gemma4 {
        print_gemma4(g);
    }
    match &s.gguf {
        Some(g) => print_gguf(g),
        None => println!(
            "  dtype        {} (config: {})",
            s.dtype,
            s.config_dtype.as_deref().unwrap_or("unset")
        ),
    }
    println!();
    println!(
        "  {:<10} {:>8} {:>14} {:>12}",
        "role", "tensors", "parameters", "bytes"
    );
    for g in &s.groups {
        if g.tensors == 0 {
            continue;
        }
        println!(
            "  {:<10} {:>8} {:>14} {:>12}",
            g.role,
            g.tensors,
            fmt_count(g.parameters),
            fmt_bytes(g.bytes)
        );
    }
    println!();
    println!(
        "  checkpoint files        {}",
        fmt_bytes(s.checkpoint_bytes)
    );
    println!("  all fp16                {}", fmt_bytes(s.fp16_bytes));
    println!(
        "  default recipe          {}  ({}; {:.2} bits/weight)",
        fmt_bytes(s.default_recipe_bytes),
        hf2coreml::quant::Recipe::default().summary(),
        s.default_recipe_bytes as f64 * 8.0 / s.parameters as f64
    );
    if let Some(g) = &s.gguf {
        let slots = hf2coreml::arch::expected_tensors(&g.spec);
        if let Some(note) = summary::requantization_note(g, &slots, &recipe) {
            println!("  note: {note}");
        }
    }
    if s.recipe_bytes != s.default_recipe_bytes || args.recipe.recipe.is_some() {
        println!(
            "  this recipe             {}  ({}; {:.2} bits/weight)",
            fmt_bytes(s.recipe_bytes),
            s.recipe,
            s.recipe_bytes as f64 * 8.0 / s.parameters as f64
        );
    }
    Ok(())
}

/// A saved package, or a chain of packages or of Core AI assets.
fn saved(path: &Path, json: bool) -> anyhow::Result<()> {
    if is_chain(path) {
        let chain = ChainFile::read(path)?;
        if chain.contract.target.is_coreai() {
            return super::inspect_asset::run_chain(path, chain, json);
        }
    }
    super::inspect_package::run(path, json)
}

/// The GGUF lines of `inspect`: tensor types with counts, bits per weight, truncation.
fn print_gguf(g: &gguf::header::HeaderInfo) {
    let types: Vec<String> = g
        .tensor_types
        .iter()
        .map(|t| format!("{} {}", t.tensors, t.name))
        .collect();
    println!(
        "  gguf         {} tensors: {}; {:.2} bits/weight",
        g.tensor_types.iter().map(|t| t.tensors).sum::<usize>(),
        types.join(", "),
        g.bits_per_weight
    );
    if let Some((ty, bits)) = &g.projection_type {
        println!("  source       projections stored as {ty} ({bits:.2} bits/weight): the error floor of anything converted from it");
    }
    if let Some(at) = g.truncated_at {
        println!(
            "  incomplete   tensor data truncated at byte {at} (the header declares {} bytes of data)",
            fmt_count(g.data_bytes)
        );
    }
}

/// Gemma 4's full blocks' head shape, shared caches and per-layer inputs.
fn print_gemma4(g: &hf2coreml::pipeline::inspect::Gemma4Summary) {
    println!(
        "  full blocks  head_dim {}, {} key/value heads",
        g.global_head_dim, g.global_kv_heads
    );
    let shared: Vec<String> = g.shared.iter().map(|(l, p)| format!("{l}←{p}")).collect();
    println!(
        "  KV cache     {} blocks keep one: {} per token; {} read another's{}",
        g.cache_blocks,
        fmt_bytes(g.kv_bytes_per_token),
        g.shared.len(),
        match shared.is_empty() {
            true => String::new(),
            false => format!(" ({})", shared.join(", ")),
        }
    );
    if g.per_layer_input > 0 {
        println!(
            "  per-layer    inputs {} wide, table {} parameters",
            g.per_layer_input,
            fmt_count(g.per_layer_parameters)
        );
    }
}
