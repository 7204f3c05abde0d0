use std::path::PathBuf;

use anyhow::Context;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::quant::{self, Recipe};
use hf2coreml::util::{atomic_write, progress_bar};

/// The recipe flags shared by `palettize`, `budget` and `inspect`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RecipeArgs {
    /// Recipe file (TOML) instead of the built-in default (see configs/recipes/).
    #[arg(long, value_name = "FILE")]
    pub recipe: Option<PathBuf>,
    /// Bit width of every palettized tensor (1, 2, 4, 6 or 8), overriding the recipe.
    #[arg(long, value_name = "N")]
    pub nbits: Option<u8>,
    /// Keep tensors whose name matches GLOB in fp16 (repeatable; `*` keeps everything).
    #[arg(long = "keep-fp16", value_name = "GLOB")]
    pub keep_fp16: Vec<String>,
}

impl RecipeArgs {
    /// The recipe file (or the default) with the flags applied.
    pub fn load(&self) -> anyhow::Result<Recipe> {
        let base = match &self.recipe {
            Some(p) => Recipe::from_file(p)?,
            None => Recipe::default(),
        };
        Ok(base.with_overrides(self.nbits, &self.keep_fp16)?)
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + *.safetensors).
    pub dir: PathBuf,
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Also write the report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let recipe = args.recipe.load()?;
    let ckpt = Checkpoint::open(&args.dir)
        .with_context(|| format!("cannot read checkpoint {}", args.dir.display()))?;
    let plan = quant::Report::plan(&ckpt, &recipe)?;
    let pb = progress_bar(plan.totals.palettized_tensors as u64, "palettize");
    let out = quant::palettize_checkpoint(&ckpt, &recipe, &|line| {
        pb.set_message(line.name.clone());
        pb.inc(1);
    })?;
    pb.finish_and_clear();
    println!(
        "Palettizing {} with recipe {}",
        ckpt.dir().display(),
        recipe.origin()
    );
    print!("{}", out.report.to_text());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&out.report)?;
        atomic_write(path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
