use std::path::{Path, PathBuf};

use anyhow::Context;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::error::CheckFailed;
use hf2coreml::mil::contract::{self, Contract};
use hf2coreml::runtime::interp::Options;

use super::args::ComputeArg;
use hf2coreml::validate::gates::Gate;
use hf2coreml::validate::run_checks::{validate_with_progress, ValidateOptions};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The .mlpackage to validate, a chain of packages, or a Core AI .aimodel or chain of them
    /// (run by Apple's runtime from the Python environment).
    pub package: PathBuf,
    /// The checkpoint it was converted from: a directory, a .gguf file (through its import in
    /// the model cache) or a Hub id in the local Hugging Face cache (default: the one its
    /// report records, while its files still hash as the package's contract records).
    #[arg(long)]
    pub against: Option<PathBuf>,
    /// Text to evaluate on (default: the evaluation passage shipped in assets/).
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
    /// Decode every weight when the package loads instead of reading packed weights in place
    /// from the memory-mapped weight files (the same results, bit for bit; more memory).
    #[arg(long)]
    pub dense_weights: bool,
    /// Compute the float reference block by block (one block's weights in f32 in memory)
    /// when the checkpoint's weights in f32 exceed SIZE (900MB, 2GiB; 0: always); below it,
    /// the whole model is loaded (candle-transformers where it can express the checkpoint).
    #[arg(long, value_name = "SIZE", default_value = "2GiB", value_parser = parse_budget)]
    pub reference_budget: u64,
    /// Tokenizer (default: the checkpoint's tokenizer.json; without one, the text's bytes
    /// modulo the vocabulary, as `convert` calibrates).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Also run the package's program on another runtime and compare the two, op by op where
    /// they differ most (`coreai`: Apple's Core AI runtime from the Python environment).
    #[arg(long, value_enum, value_name = "RUNTIME")]
    pub cross_check: Option<CrossCheckArg>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum CrossCheckArg {
    /// Apple's Core AI runtime (coreai-core).
    Coreai,
}

fn parse_budget(s: &str) -> Result<u64, String> {
    hf2coreml::budget::parse_size(s).map_err(|e| e.to_string())
}

fn parse_gate(s: &str) -> Result<Gate, String> {
    s.parse()
        .map_err(|e: hf2coreml::validate::gates::GateError| e.to_string())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    super::tune_allocator_for_the_runner();
    let against = match &args.against {
        Some(dir) => dir.clone(),
        None => recorded_checkpoint(&args.package)?,
    };
    // A GGUF file is read as `convert` reads it: its import in the model cache.
    let ckpt_dir = if against.is_file() && hf2coreml::checkpoint::gguf::is_gguf_file(&against) {
        let bars = crate::printer::Bars::default();
        let cached = hf2coreml::checkpoint::gguf::cache::import_cached(&against, &bars)
            .with_context(|| format!("cannot import {}", against.display()))?;
        crate::printer::info(format_args!(
            "{} {} {} {}",
            if cached.reused { "reusing" } else { "imported" },
            against.display(),
            if cached.reused { "from" } else { "into" },
            cached.dir.display()
        ));
        cached.dir
    } else {
        against.clone()
    };
    let ckpt = Checkpoint::open(&ckpt_dir)
        .with_context(|| format!("cannot read checkpoint {}", against.display()))?;
    let (text, name) = hf2coreml::pipeline::texts::evaluation_text(args.text.as_deref())?;
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
        None => hf2coreml::pipeline::texts::text_tokens(&ckpt, &text, &name)?,
    };
    let opts = ValidateOptions {
        tokens: &tokens,
        text_name: &label,
        gates: args.gates.clone(),
        interp: Options {
            compute: args.compute.into(),
            dense_weights: args.dense_weights,
        },
        max_tokens: args.max_tokens,
        reference_budget: args.reference_budget,
        cross_check: args.cross_check.is_some(),
    };
    let bars = crate::printer::Bars::default();
    let report = validate_with_progress(&args.package, &ckpt, &opts, &bars)
        .with_context(|| format!("cannot validate {}", args.package.display()))?;
    if args.json {
        // The report's fields, with the verdict and the schema beside them.
        let mut value = serde_json::to_value(&report)?;
        if let Some(map) = value.as_object_mut() {
            map.insert("schema".into(), "hf2coreml.validate/1".into());
            map.insert("passed".into(), report.passed().into());
            map.insert("contract_ok".into(), report.contract_ok().into());
            map.insert("overflow".into(), report.overflowed().into());
            map.insert("gates_ok".into(), report.gates_ok().into());
            if report.cross_check.is_some() {
                map.insert("cross_check_ok".into(), report.cross_check_ok().into());
            }
        }
        super::print_json(&value)?;
    } else {
        print!("{}", report.render_table());
    }
    if !report.passed() {
        return Err(CheckFailed(format!(
            "{} failed validation (contract ok: {}, overflow: {}, gates ok: {}{})",
            args.package.display(),
            report.contract_ok(),
            report.overflowed(),
            report.gates_ok(),
            if report.cross_check.is_some() {
                format!(", runtimes agree: {}", report.cross_check_ok())
            } else {
                String::new()
            }
        ))
        .into());
    }
    Ok(())
}

/// The checkpoint `package`'s report names, if its files still hash as the package's contract
/// records them; else an error asking for `--against`.
fn recorded_checkpoint(package: &Path) -> anyhow::Result<PathBuf> {
    let ask = |why: String| anyhow::anyhow!("{}: {why}; give --against DIR", package.display());
    let Some(source) = hf2coreml::pipeline::convert_summary::recorded_source(package) else {
        return Err(ask(format!(
            "its report ({}) does not name the checkpoint it was converted from",
            hf2coreml::runtime::text::beside_package(package, "report.json").display()
        )));
    };
    // A Hub id (as convert was given it) is found in the local Hub cache again.
    let source = hf2coreml::checkpoint::resolve_source(&source).map_err(|e| ask(e.to_string()))?;
    let contract = recorded_contract(package)?
        .ok_or_else(|| ask("it carries no hf2coreml contract".into()))?;
    for (name, recorded) in &contract.source.files {
        let found = hf2coreml::fsutil::sha256_file(&source.join(name)).ok();
        if found.as_ref() != Some(recorded) {
            return Err(ask(format!(
                "the checkpoint it was converted from, {}, has changed since ({name} {})",
                source.display(),
                if found.is_some() {
                    "differs"
                } else {
                    "is gone"
                }
            )));
        }
    }
    crate::printer::info(format!(
        "validating against {} (recorded in the package's report)",
        source.display()
    ));
    Ok(source)
}

/// The contract a package (or a chain's `chain.json`) declares, if it declares one.
fn recorded_contract(package: &Path) -> anyhow::Result<Option<Contract>> {
    if hf2coreml::mil::chain_file::is_chain(package) {
        let chain = hf2coreml::mil::chain_file::ChainFile::read(package)
            .with_context(|| format!("cannot read {}", package.display()))?;
        return Ok(Some(chain.contract));
    }
    if hf2coreml::aimodel::is_aimodel(package) {
        let contract = hf2coreml::aimodel::read_contract(package)
            .with_context(|| format!("cannot read {}", package.display()))?;
        return Ok(Some(contract));
    }
    let pkg = hf2coreml::mlpackage::MlPackage::open(package)
        .with_context(|| format!("cannot read {}", package.display()))?;
    Ok(pkg
        .description()
        .user_defined
        .get(contract::METADATA_KEY)
        .and_then(|json| serde_json::from_str(json).ok()))
}
