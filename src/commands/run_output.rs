//! What `hf2coreml run` (one prompt or a chat) reports and saves when it ends: the timing and
//! stop line, the stop reason, and the KV cache of `--save-cache`.

use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::chat::Message;
use hf2coreml::runtime::generate::{Generation, Generator, StopReason};
use hf2coreml::runtime::kvfile::KvFile;

use super::run_args::Args;

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

pub(super) fn stop_reason(g: &Generation) -> String {
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
