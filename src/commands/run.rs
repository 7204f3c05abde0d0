//! `hf2coreml run`: a package generating on the CPU interpreter, streamed to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::chat::{ChatTemplate, Message};
use hf2coreml::runtime::generate::{GenerateError, GenerateOptions, Generation, Generator};
use hf2coreml::runtime::interp::kernels;
use hf2coreml::runtime::interp::Options;
use hf2coreml::runtime::kvfile::KvFile;
use hf2coreml::runtime::sampling::SamplingParams;
use hf2coreml::runtime::text::{self, Conversation, Prompt, TextError};
use hf2coreml::util::isa::Isa;
use tokenizers::Tokenizer;

use super::run_args::Args;
use super::run_output::{report, save_cache, stop_reason};

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
        compute: args.compute.into(),
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
