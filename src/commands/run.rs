//! `hf2coreml run`: a package generating on the CPU interpreter, streamed to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use hf2coreml::runtime::chain::Saved;
use hf2coreml::runtime::chat::ChatTemplate;
use hf2coreml::runtime::generate::{
    GenerateError, GenerateOptions, Generation, Generator, StopReason,
};
use hf2coreml::runtime::interp::{Compute, Options};
use hf2coreml::runtime::sampling::SamplingParams;
use hf2coreml::runtime::text::{self, Prompt, TextError};
use tokenizers::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ComputeArg {
    /// Round every op to the dtype the program declares, as the device does.
    Fp16,
    /// Keep every float in f32 (debugging: separates range problems from logic errors).
    F32,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The .mlpackage to run, or a chain of packages (the directory `convert` wrote).
    pub package: PathBuf,
    /// Text to continue (tokenized with the package's tokenizer).
    #[arg(
        long,
        required_unless_present = "prompt_ids",
        conflicts_with = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Token ids to continue, comma-separated, e.g. `1,2,3` (no tokenizer needed).
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Send --prompt as a user message through the checkpoint's chat template.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Tokens to generate; 0 processes the prompt only.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities sum to p.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Random seed for sampling (the same seed gives the same text).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// tokenizer.json [default: X.tokenizer.json beside X.mlpackage].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// tokenizer_config.json holding the chat template [default: beside the tokenizer].
    #[arg(long)]
    pub tokenizer_config: Option<PathBuf>,
    /// Float precision of the CPU interpreter.
    #[arg(long, value_enum, default_value_t = ComputeArg::Fp16)]
    pub compute: ComputeArg,
    /// Write the logits of every processed position as float32 [T, V] .npy.
    #[arg(long, value_name = "FILE.npy")]
    pub logits_out: Option<PathBuf>,
    /// Print one JSON object at the end (prompt and generated ids, text, stop reason, timing)
    /// instead of streaming the text.
    #[arg(long)]
    pub json: bool,
}

/// `X.tokenizer.json` → `X.tokenizer_config.json`, `tokenizer.json` → `tokenizer_config.json`.
fn config_beside(tokenizer: &Path) -> Option<PathBuf> {
    let name = tokenizer.file_name()?.to_str()?;
    let stem = name.strip_suffix("tokenizer.json")?;
    Some(tokenizer.with_file_name(format!("{stem}tokenizer_config.json")))
}

/// The prompt's token ids, and the tokenizer (none for `--prompt-ids` without one), through
/// the chat template with `--chat`.
fn prompt(args: &Args) -> anyhow::Result<(Vec<u32>, Option<Tokenizer>)> {
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) if args.chat => Prompt::Chat(text.clone()),
        (Some(text), _) => Prompt::Text(text.clone()),
        (None, Some(ids)) => Prompt::Ids(ids.clone()),
        (None, None) => anyhow::bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let tokenizer_path = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| text::beside_package(&args.package, "tokenizer.json"));
    // Ids need no tokenizer; with one, the output is text instead of ids.
    let tokenizer =
        if matches!(prompt, Prompt::Ids(_)) && args.tokenizer.is_none() && !tokenizer_path.exists()
        {
            None
        } else {
            Some(text::load_tokenizer(&tokenizer_path).context(
                "a text prompt needs the tokenizer saved beside the package (or --tokenizer PATH)",
            )?)
        };
    let template = if args.chat {
        let path = match &args.tokenizer_config {
            Some(p) => p.clone(),
            None => config_beside(&tokenizer_path)
                .unwrap_or_else(|| text::beside_package(&args.package, "tokenizer_config.json")),
        };
        Some(ChatTemplate::from_tokenizer_config(&path).context("--chat needs a chat template")?)
    } else {
        None
    };
    let ids = text::prompt_ids(&prompt, tokenizer.as_ref(), template.as_ref())?;
    Ok((ids, tokenizer))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate()?;

    let (ids, tokenizer) = prompt(&args)?;

    let options = Options {
        compute: match args.compute {
            ComputeArg::Fp16 => Compute::Declared,
            ComputeArg::F32 => Compute::F32,
        },
    };
    let package = Saved::load(&args.package, options)
        .with_context(|| format!("cannot load {}", args.package.display()))?;
    let mut generator = Generator::new(package)?;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling,
        stop_at_eos: !args.ignore_eos,
        record_logits: args.logits_out.is_some(),
    };

    let stdout = std::io::stdout();
    let mut streamed = Vec::new();
    let result = if args.json {
        text::stream_to(
            &mut generator,
            &ids,
            &opts,
            tokenizer.as_ref(),
            &mut streamed,
        )
    } else {
        let mut out = stdout.lock();
        let r = text::stream_to(&mut generator, &ids, &opts, tokenizer.as_ref(), &mut out);
        out.flush().context("writing to stdout")?;
        r
    };
    let (generation, error) = match result {
        Ok(g) => (g, None),
        Err(TextError::Generate(GenerateError::ContextFull {
            max_seq_len,
            partial,
        })) => {
            let g = (*partial).clone();
            (
                g,
                Some(TextError::Generate(GenerateError::ContextFull {
                    max_seq_len,
                    partial,
                })),
            )
        }
        Err(e) => return Err(e.into()),
    };
    report(&generation);
    if args.json {
        let text = String::from_utf8_lossy(&streamed);
        let t = &generation.timing;
        super::print_json(&serde_json::json!({
            "schema": "hf2coreml.run/1",
            "package": args.package,
            "prompt_ids": generation.prompt,
            "generated_ids": generation.tokens,
            // Decoded text, or the ids space-separated without a tokenizer.
            "text": text.strip_suffix('\n').unwrap_or(&text),
            "stop": stop_reason(&generation),
            "timing": {
                "prompt_tokens": t.prompt_tokens,
                "prompt_seconds": t.prompt_time.as_secs_f64(),
                "decode_tokens": t.decode_tokens,
                "decode_seconds": t.decode_time.as_secs_f64(),
                "decode_tokens_per_second": t.decode_tokens_per_sec(),
            },
            "error": error.as_ref().map(|e| e.to_string()),
        }))?;
    }
    if let (Some(path), Some(rows)) = (&args.logits_out, &generation.logits) {
        hf2coreml::fsutil::atomic_write(path, &rows.to_npy())
            .with_context(|| format!("cannot write {}", path.display()))?;
        crate::printer::info(format_args!(
            "logits: [{}, {}] float32 → {}",
            rows.rows(),
            rows.vocab_size,
            path.display()
        ));
    }
    match error {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

fn stop_reason(g: &Generation) -> String {
    match g.stop {
        StopReason::Eos(id) => format!("eos (id {id})"),
        StopReason::MaxNewTokens => "max new tokens".to_string(),
        StopReason::ContextFull => "context full".to_string(),
    }
}

fn report(g: &Generation) {
    let t = &g.timing;
    let stop = stop_reason(g);
    crate::printer::info(format_args!(
        "prompt: {} tokens in {:.2} s ({:.1} tok/s) · generated: {} tokens, decode {:.1} tok/s · \
         stop: {stop}",
        t.prompt_tokens,
        t.prompt_time.as_secs_f64(),
        t.prompt_tokens_per_sec(),
        g.tokens.len(),
        t.decode_tokens_per_sec(),
    ));
}
