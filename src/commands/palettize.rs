//! `hf2coreml palettize`: a recipe's weights, palettized and reported (no package).

use std::path::{Path, PathBuf};

use anyhow::Context;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::fsutil::atomic_write;
use hf2coreml::pipeline::texts;

use super::args::RecipeArgs;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + *.safetensors), or a Hub id (ORG/NAME[@REV]) in the
    /// local Hugging Face cache.
    pub dir: PathBuf,
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// The report as JSON: to FILE (the text still goes to stdout), or instead of the text to
    /// stdout without FILE or with `-`.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
    pub json: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(path) = args.json.as_deref().filter(|p| *p != Path::new("-")) {
        hf2coreml::fsutil::check_file_output(path)?;
    }
    let recipe = args.recipe.load()?;
    let ckpt = Checkpoint::open(&args.dir)
        .with_context(|| format!("cannot read checkpoint {}", args.dir.display()))?;
    let (tokens, source) =
        texts::calibration_tokens(args.recipe.calibration.as_deref(), &recipe, &ckpt)?;
    if let Some(source) = &source {
        crate::printer::info(format_args!("calibrating on {source}"));
    }
    let bars = crate::printer::Bars::default();
    let (_, report) =
        hf2coreml::pipeline::weight_stream::prepare_weights(&ckpt, &recipe, &tokens, &bars)?;
    if args.json.as_deref() == Some(Path::new("-")) {
        return super::print_json(&report);
    }
    println!(
        "Palettizing {} with recipe {}",
        ckpt.dir().display(),
        recipe.origin()
    );
    print!("{}", report.to_text());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        atomic_write(path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
