//! `hf2coreml run`: a package generating on the CPU interpreter, streamed to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::chat::{ChatTemplate, Message};
use hf2coreml::runtime::generate::{
    GenerateError, GenerateOptions, Generation, Generator, StopReason,
};
use hf2coreml::runtime::interp::kernels;
use hf2coreml::runtime::interp::{Compute, Options};
use hf2coreml::runtime::kvfile::KvFile;
use hf2coreml::runtime::sampling::SamplingParams;
use hf2coreml::runtime::text::{self, Conversation, Prompt, TextError};
use hf2coreml::util::isa::Isa;
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
    /// The .mlpackage to run, a chain of packages (the directory `convert` wrote), or a Core AI
    /// .aimodel or chain of them (run by Apple's runtime from the Python environment).
    pub package: PathBuf,
    /// Text to continue (tokenized with the package's tokenizer).
    #[arg(
        long,
        required_unless_present_any = ["prompt_ids", "chat"],
        conflicts_with = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Token ids to continue, comma-separated, e.g. `1,2,3` (no tokenizer needed).
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Chat through the checkpoint's chat template: with --prompt, one user message; without,
    /// an interactive session reading stdin line by line (`/reset`, `/exit`).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: bool,
    /// The system message a --chat conversation starts with.
    #[arg(long, requires = "chat", value_name = "TEXT")]
    pub system: Option<String>,
    /// Continue from a KV cache saved by --save-cache (the same package only): the prompt, or
    /// the chat, carries on after it.
    #[arg(long, value_name = "FILE")]
    pub load_cache: Option<PathBuf>,
    /// Save the KV cache's valid rows at the end (docs/contract.md, "The KV-cache file").
    #[arg(long, value_name = "FILE")]
    pub save_cache: Option<PathBuf>,
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
    /// Decode every weight when the package loads instead of reading packed weights in place
    /// from the memory-mapped weight files (the same results, bit for bit; more memory).
    #[arg(long)]
    pub dense_weights: bool,
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

/// The tokenizer (none for `--prompt-ids` without one) and its path.
fn tokenizer(args: &Args) -> anyhow::Result<(Option<Tokenizer>, PathBuf)> {
    let path = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| text::beside_package(&args.package, "tokenizer.json"));
    // Ids need no tokenizer; with one, the output is text instead of ids.
    if args.prompt_ids.is_some() && args.tokenizer.is_none() && !path.exists() {
        return Ok((None, path));
    }
    let tok = text::load_tokenizer(&path).context(
        "a text prompt needs the tokenizer saved beside the package (or --tokenizer PATH)",
    )?;
    Ok((Some(tok), path))
}

/// The chat template, with --chat.
pub(super) fn template(args: &Args, tokenizer_path: &Path) -> anyhow::Result<Option<ChatTemplate>> {
    if !args.chat {
        return Ok(None);
    }
    let path = match &args.tokenizer_config {
        Some(p) => p.clone(),
        None => config_beside(tokenizer_path)
            .unwrap_or_else(|| text::beside_package(&args.package, "tokenizer_config.json")),
    };
    Ok(Some(
        ChatTemplate::from_tokenizer_config(&path).context("--chat needs a chat template")?,
    ))
}

/// The conversation a `--chat` cache file holds (none without a cache), checked against what
/// the package's context can hold before any of it is rendered or tokenized: every message
/// takes at least one position, and its text no more bytes than `max_seq_len` tokens spell
/// ([`text::max_line_bytes`]). A file outside these bounds was not saved by a chat with this
/// package, and rendering it could cost far more than its size.
pub(super) fn restored_messages(
    args: &Args,
    kv: Option<&KvFile>,
    tokenizer: &Tokenizer,
    max_seq_len: usize,
) -> anyhow::Result<Vec<Message>> {
    let Some(kv) = kv else {
        return Ok(Vec::new());
    };
    let path = args
        .load_cache
        .as_deref()
        .unwrap_or(Path::new(""))
        .display();
    if kv.conversation.is_empty() {
        if !kv.tokens.is_empty() {
            anyhow::bail!(
                "--chat continues a conversation: the cache {path} was saved without --chat"
            );
        }
        return Ok(Vec::new());
    }
    let messages: Vec<Message> = serde_json::from_str(&kv.conversation)
        .with_context(|| format!("{path}: the conversation is not a list of messages"))?;
    if messages.len() > max_seq_len {
        anyhow::bail!(
            "{path}: the conversation holds {} messages, more than the package's context has \
             positions ({max_seq_len}): a chat with this package cannot have saved it",
            messages.len()
        );
    }
    let bytes: usize = messages
        .iter()
        .map(|m| m.role.len() + m.content.len())
        .sum();
    let limit = text::max_line_bytes(tokenizer, max_seq_len);
    if bytes > limit {
        anyhow::bail!(
            "{path}: the conversation's text is {bytes} bytes, more than {max_seq_len} tokens \
             can spell (at most {limit}): a chat with this package cannot have saved it"
        );
    }
    Ok(messages)
}

/// The prompt's token ids: after the restored cache's tokens, if any; a chat renders the whole
/// conversation (the restored one, then --prompt).
fn prompt_ids(
    args: &Args,
    tokenizer: Option<&Tokenizer>,
    conversation: Option<&Conversation>,
    kv: Option<&KvFile>,
) -> anyhow::Result<Vec<u32>> {
    if let (Some(conv), Some(text)) = (conversation, &args.prompt) {
        return Ok(conv.ids_with(text)?);
    }
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) if kv.is_some() => Prompt::More(text.clone()),
        (Some(text), _) => Prompt::Text(text.clone()),
        (None, Some(ids)) => Prompt::Ids(ids.clone()),
        (None, None) => anyhow::bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let new = text::prompt_ids(&prompt, tokenizer, None)?;
    let before = kv.map(|k| k.tokens.as_slice()).unwrap_or_default();
    Ok([before, &new].concat())
}

/// The package, with the cache --load-cache names restored into its generator.
pub(super) fn load(args: &Args) -> anyhow::Result<(Generator<Saved>, Option<KvFile>)> {
    let options = Options {
        compute: match args.compute {
            ComputeArg::Fp16 => Compute::Declared,
            ComputeArg::F32 => Compute::F32,
        },
        dense_weights: args.dense_weights,
    };
    let package = Saved::load(&args.package, options)
        .with_context(|| format!("cannot load {}", args.package.display()))?;
    let mut generator = Generator::new(package)?;
    let kv = match &args.load_cache {
        Some(path) => {
            let kv = KvFile::load(path, generator.model().contract())?;
            kv.restore(&mut generator)
                .with_context(|| format!("cannot restore {}", path.display()))?;
            Some(kv)
        }
        None => None,
    };
    Ok((generator, kv))
}

/// Write --save-cache: the cached rows, the tokens of `sequence`, the conversation as JSON.
pub(super) fn save_cache(
    args: &Args,
    generator: &Generator<Saved>,
    sequence: &[u32],
    messages: Option<&[Message]>,
) -> anyhow::Result<()> {
    let Some(path) = &args.save_cache else {
        return Ok(());
    };
    let conversation = match messages {
        Some(m) => serde_json::to_string(m)?,
        None => String::new(),
    };
    let kv = KvFile::from_generator(generator, sequence, conversation)?;
    kv.save(path)?;
    crate::printer::info(format_args!(
        "cache: {} positions ({} tokens) → {}",
        kv.position,
        kv.tokens.len(),
        path.display()
    ));
    Ok(())
}

pub(super) fn generate_options(args: &Args) -> anyhow::Result<GenerateOptions> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate()?;
    Ok(GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling,
        stop_at_eos: !args.ignore_eos,
        record_logits: args.logits_out.is_some(),
    })
}

/// Flags a session cannot honour, refused rather than ignored.
fn check_session(args: &Args) -> anyhow::Result<()> {
    if args.chat && args.prompt.is_none() && (args.json || args.logits_out.is_some()) {
        anyhow::bail!("--json and --logits-out need --prompt: an interactive --chat streams text");
    }
    for path in [&args.logits_out, &args.save_cache].into_iter().flatten() {
        hf2coreml::fsutil::check_file_output(path)?;
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    super::tune_allocator_for_the_runner();
    check_session(&args)?;
    let opts = generate_options(&args)?;
    let (tokenizer, tokenizer_path) = tokenizer(&args)?;
    let template = template(&args, &tokenizer_path)?;
    let (mut generator, kv) = load(&args)?;
    let mut conversation = match (&template, &tokenizer) {
        (Some(t), Some(tok)) => {
            let mut c = Conversation::new(tok, t, args.system.clone());
            let s = generator.model().contract().max_seq_len;
            c.messages = restored_messages(&args, kv.as_ref(), tok, s)?;
            Some(c)
        }
        _ => None,
    };
    if args.prompt.is_none() && args.chat {
        let Some(conv) = conversation.as_mut() else {
            anyhow::bail!("--chat needs a tokenizer");
        };
        return super::chat::repl(&args, &mut generator, conv, &opts);
    }
    let ids = prompt_ids(
        &args,
        tokenizer.as_ref(),
        conversation.as_ref(),
        kv.as_ref(),
    )?;
    one_shot(
        &args,
        &mut generator,
        &ids,
        &opts,
        tokenizer.as_ref(),
        conversation,
    )
}

/// Generate once from `ids`, streaming (or collecting for --json), then the report, the
/// logits file and the cache file.
fn one_shot(
    args: &Args,
    generator: &mut Generator<Saved>,
    ids: &[u32],
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    mut conversation: Option<Conversation>,
) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut streamed = Vec::new();
    let result = if args.json {
        text::stream_extend(generator, ids, opts, tokenizer, &mut streamed)
    } else {
        let mut out = stdout.lock();
        let r = text::stream_extend(generator, ids, opts, tokenizer, &mut out);
        out.flush().map_err(crate::printer::Unwritten)?;
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
        let kernels = kernels(generator.model());
        print_json(args, &generation, &streamed, error.as_ref(), kernels)?;
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
    let sequence = [generation.prompt.as_slice(), &generation.tokens].concat();
    if let (Some(conv), Some(text)) = (conversation.as_mut(), &args.prompt) {
        conv.push_turn(text, generation.reply_tokens())?;
    }
    let messages = conversation.as_ref().map(|c| c.messages.as_slice());
    save_cache(args, generator, &sequence, messages)?;
    match error {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// What ran the model's ops: the interpreter's instruction-set level (`HF2COREML_ISA` caps
/// it), or Apple's runtime for a Core AI asset.
pub(super) fn kernels(model: &Saved) -> &'static str {
    match model {
        Saved::CoreAi(_) => "core-ai-runtime",
        Saved::Package(_) | Saved::Chain(_) => hf2coreml::util::isa::selected().name(),
    }
}

fn print_json(
    args: &Args,
    generation: &Generation,
    streamed: &[u8],
    error: Option<&TextError>,
    kernels: &str,
) -> anyhow::Result<()> {
    let text = String::from_utf8_lossy(streamed);
    let t = &generation.timing;
    super::print_json(&serde_json::json!({
        "schema": "hf2coreml.run/1",
        "package": args.package,
        "prompt_ids": generation.prompt,
        "generated_ids": generation.tokens,
        // Decoded text, or the ids space-separated without a tokenizer.
        "text": text.strip_suffix('\n').unwrap_or(&text),
        "stop": stop_reason(generation),
        "kernels": kernels,
        // How AVX2 looked 4-bit weights up (`planes` or `halves`), when it ran.
        "kernel_lookup4": Isa::parse(kernels)
            .and_then(kernels::Avx2Lookup::at)
            .map(kernels::Avx2Lookup::name),
        "timing": {
            "prompt_tokens": t.prompt_tokens,
            "prompt_seconds": t.prompt_time.as_secs_f64(),
            "decode_tokens": t.decode_tokens,
            "decode_seconds": t.decode_time.as_secs_f64(),
            "decode_tokens_per_second": t.decode_tokens_per_sec(),
            // Model calls by function: `prefill` (a multifunction package's prompt chunks)
            // and the one-token step (`decode`, or `main`).
            "prefill_calls": t.prefill_calls,
            "decode_calls": t.model_calls - t.prefill_calls,
        },
        "error": error.map(|e| e.to_string()),
    }))
}

fn stop_reason(g: &Generation) -> String {
    match g.stop {
        StopReason::Eos(id) => format!("eos (id {id})"),
        StopReason::MaxNewTokens => "max new tokens".to_string(),
        StopReason::ContextFull => "context full".to_string(),
        StopReason::Interrupted => "interrupted".to_string(),
    }
}

pub(super) fn report(g: &Generation) {
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
    crate::printer::detail(format_args!(
        "model calls: {} prefill, {} decode",
        t.prefill_calls,
        t.model_calls - t.prefill_calls
    ));
}
