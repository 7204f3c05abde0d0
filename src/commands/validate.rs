use std::path::PathBuf;

use anyhow::Context;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::error::CheckFailed;
use hf2coreml::runtime::interp::{Compute, Options};
use hf2coreml::validate::gates::Gate;
use hf2coreml::validate::run::{validate, ValidateOptions};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ComputeArg {
    /// Round every op to the dtype the program declares (what the device does).
    Fp16,
    /// Keep every float in f32 (separates range problems from logic errors).
    F32,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The .mlpackage to validate.
    pub package: PathBuf,
    /// The checkpoint it was converted from.
    #[arg(long)]
    pub against: PathBuf,
    /// Text to evaluate on (default: the evaluation passage shipped in fixtures/).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// A gate such as `kl_mean<0.3` or `top1>=0.85` (repeatable; default: per recipe kind).
    #[arg(long = "gate", value_parser = parse_gate)]
    pub gates: Vec<Gate>,
    /// Evaluate at most this many tokens (the package's S caps it too).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    #[arg(long, value_enum, default_value = "fp16")]
    pub compute: ComputeArg,
    /// Tokenizer (default: the checkpoint's tokenizer.json; without one, the text's bytes
    /// modulo the vocabulary, as `convert` calibrates).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn parse_gate(s: &str) -> Result<Gate, String> {
    s.parse()
        .map_err(|e: hf2coreml::validate::gates::GateError| e.to_string())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(&args.against)
        .with_context(|| format!("cannot read checkpoint {}", args.against.display()))?;
    let (text, name) = hf2coreml::pipeline::job::evaluation_text(args.text.as_deref())?;
    // An explicit --tokenizer, else the checkpoint's tokenizer.json, else (a checkpoint that
    // ships none, e.g. a test fixture) the text's bytes modulo the vocabulary, as `convert`
    // calibrates such checkpoints.
    let (tokens, label) = match &args.tokenizer {
        Some(path) => {
            let tokenizer = hf2coreml::runtime::text::load_tokenizer(path)?;
            let enc = tokenizer
                .encode(text.as_str(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing {name} with {}: {e}", path.display()))?;
            let ids = enc.get_ids().to_vec();
            let label = format!("{name}, {} tokens ({})", ids.len(), path.display());
            (ids, label)
        }
        None => hf2coreml::pipeline::convert::text_tokens(&ckpt, &text, &name)?,
    };
    let opts = ValidateOptions {
        tokens: &tokens,
        text_name: &label,
        gates: args.gates.clone(),
        interp: Options {
            compute: match args.compute {
                ComputeArg::Fp16 => Compute::Declared,
                ComputeArg::F32 => Compute::F32,
            },
        },
        max_tokens: args.max_tokens,
    };
    let report = validate(&args.package, &ckpt, &opts)
        .with_context(|| format!("cannot validate {}", args.package.display()))?;
    if args.json {
        super::print_json(&report)?;
    } else {
        print!("{}", report.render_table());
    }
    if !report.passed() {
        return Err(CheckFailed(format!(
            "{} failed validation (contract ok: {}, overflow: {}, gates ok: {})",
            args.package.display(),
            report.contract_ok(),
            report.overflowed(),
            report.gates_ok()
        ))
        .into());
    }
    Ok(())
}
