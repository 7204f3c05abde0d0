//! `hf2coreml run --chat` without `--prompt`: an interactive session. Each line read is a user
//! turn; the conversation is rendered through the chat template and the generator feeds only
//! what its cache does not hold yet. `/reset` starts over, `/exit` or the end of input ends.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Context;
use hf2coreml::runtime::chain::Saved;
use hf2coreml::runtime::generate::{GenerateError, GenerateOptions, Generator};
use hf2coreml::runtime::text::{Conversation, TextError};

use super::run::{report, save_cache, Args};

/// What one line asks for.
enum Line<'a> {
    Skip,
    Exit,
    Reset,
    Say(&'a str),
}

fn parse(line: &str) -> Line<'_> {
    match line.trim() {
        "" => Line::Skip,
        "/exit" | "/quit" => Line::Exit,
        "/reset" => Line::Reset,
        text => Line::Say(text),
    }
}

/// Read turns from stdin until `/exit`, the end of input, or a full context.
pub fn repl(
    args: &Args,
    generator: &mut Generator<Saved>,
    conv: &mut Conversation,
    opts: &GenerateOptions,
) -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    if interactive {
        crate::printer::info(format_args!(
            "chat: type a message; /reset starts over, /exit or Ctrl-D ends"
        ));
    }
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush().ok();
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        match parse(&line) {
            Line::Skip => continue,
            Line::Exit => break,
            Line::Reset => {
                conv.clear();
                generator.reset();
                crate::printer::info(format_args!("chat: conversation cleared"));
            }
            Line::Say(text) => {
                if !turn(generator, conv, text, opts)? {
                    break;
                }
            }
        }
    }
    let sequence = generator.cached_tokens().to_vec();
    save_cache(args, generator, &sequence, Some(&conv.messages))
}

/// One turn, streamed to stdout; false when the context is full (the session ends there,
/// with a message saying so, not an error).
fn turn(
    generator: &mut Generator<Saved>,
    conv: &mut Conversation,
    text: &str,
    opts: &GenerateOptions,
) -> anyhow::Result<bool> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let result = conv.turn(generator, text, opts, &mut out);
    out.flush().context("writing to stdout")?;
    let s = generator.model().contract().max_seq_len;
    match result {
        Ok(g) => {
            report(&g);
            Ok(true)
        }
        Err(TextError::Generate(GenerateError::ContextFull { partial, .. })) => {
            writeln!(out).ok();
            report(&partial);
            full(s, "the reply filled it");
            Ok(false)
        }
        Err(TextError::Generate(GenerateError::PromptTooLong { prompt_len, .. })) => {
            full(
                s,
                &format!("this turn would make the conversation {prompt_len} tokens"),
            );
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

fn full(max_seq_len: usize, why: &str) {
    crate::printer::warn(format_args!(
        "chat: the context is full ({max_seq_len} tokens, the package's max_seq_len): {why}; \
         the session ends here (start again, or convert with a larger --max-seq-len)"
    ));
}
