//! `hf2coreml run --chat` without `--prompt`: an interactive session. Each line read is a user
//! turn; the conversation is rendered through the chat template and the generator feeds only
//! what its cache does not hold yet. `/reset` starts over, `/exit` or the end of input ends.
//!
//! Ctrl-C stops the reply under way and returns to the prompt: the words already printed stay
//! in the conversation and in the cache (a press before the reply began drops the message, and
//! the cache keeps only the conversation's own positions). Ctrl-C again at the prompt, or
//! Ctrl-D, ends the session; `--save-cache` saves what the conversation holds on the way out.

use std::io::{BufRead, IsTerminal, Write};

use hf2coreml::fsutil::{is_ctrl_c, take_ctrl_c, CtrlC, CtrlCStdin};

use anyhow::Context;
use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::generate::{GenerateError, GenerateOptions, Generator, StopReason};
use hf2coreml::runtime::text::{Conversation, TextError};

use super::run_args::Args;
use super::run_output::{report, save_cache};

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
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        crate::printer::info(format_args!(
            "chat: type a message; Ctrl-C stops a reply; /reset starts over, /exit or Ctrl-D ends"
        ));
    }
    let max_seq_len = generator.model().contract().max_seq_len;
    let limit = hf2coreml::runtime::text::max_line_bytes(conv.tokenizer, max_seq_len);
    let _ctrl_c = CtrlC::catch();
    generator.stop_when(Some(hf2coreml::fsutil::ctrl_c_pending));
    let mut input = std::io::BufReader::new(CtrlCStdin);
    let mut buf = Vec::new();
    // The last thing that happened was a Ctrl-C (a stopped reply, or a press at the prompt).
    let mut after_ctrl_c = false;
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush().ok();
        }
        let read = match read_line(&mut input, limit, &mut buf) {
            Err(e) if is_ctrl_c(&e) => {
                take_ctrl_c();
                eprintln!();
                if after_ctrl_c {
                    break;
                }
                crate::printer::info(format_args!("chat: Ctrl-C again, or Ctrl-D, ends the chat"));
                after_ctrl_c = true;
                continue;
            }
            read => read.context("reading stdin")?,
        };
        after_ctrl_c = false;
        let line = match read {
            Read::End => break,
            Read::Line(line) => line,
            Read::TooLong if interactive => {
                match skip_line(&mut input) {
                    Err(e) if is_ctrl_c(&e) => {
                        take_ctrl_c();
                    }
                    skipped => skipped.context("reading stdin")?,
                }
                too_long(limit, max_seq_len, "not sent");
                continue;
            }
            Read::TooLong => {
                anyhow::bail!(
                    "stdin: a line of more than {limit} bytes cannot fit in the context \
                     ({max_seq_len} tokens)"
                );
            }
        };
        match parse(line) {
            Line::Skip => continue,
            Line::Exit => break,
            Line::Reset => {
                conv.clear();
                generator.reset();
                crate::printer::info(format_args!("chat: conversation cleared"));
            }
            Line::Say(text) => match turn(generator, conv, text, opts)? {
                Turn::Done => {}
                Turn::Stopped => after_ctrl_c = true,
                Turn::Full => break,
            },
        }
    }
    let sequence = generator.cached_tokens().to_vec();
    save_cache(args, generator, &sequence, Some(&conv.messages))
}

/// What [`read_line`] read.
enum Read<'b> {
    End,
    Line(&'b str),
    /// More than the limit without a newline: refused as it is read.
    TooLong,
}

/// One line of at most `limit` bytes (without its newline), read into `buf` and never more:
/// an endless line (`/dev/zero` as stdin) costs `limit` bytes, not all memory.
fn read_line<'b>(
    input: &mut impl BufRead,
    limit: usize,
    buf: &'b mut Vec<u8>,
) -> std::io::Result<Read<'b>> {
    buf.clear();
    let n = std::io::Read::take(&mut *input, limit as u64 + 1).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(Read::End);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > limit {
        return Ok(Read::TooLong);
    }
    std::str::from_utf8(buf)
        .map(Read::Line)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Read past the rest of a line a terminal sent (its lines end), in bounded memory.
fn skip_line(input: &mut impl BufRead) -> std::io::Result<()> {
    loop {
        let chunk = input.fill_buf()?;
        if chunk.is_empty() {
            return Ok(());
        }
        match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => {
                input.consume(i + 1);
                return Ok(());
            }
            None => {
                let n = chunk.len();
                input.consume(n);
            }
        }
    }
}

fn too_long(limit: usize, max_seq_len: usize, what: &str) {
    crate::printer::warn(format_args!(
        "chat: a line of more than {limit} bytes cannot fit in the context ({max_seq_len} \
         tokens): {what}"
    ));
}

/// How a turn ended.
enum Turn {
    Done,
    /// Ctrl-C stopped it.
    Stopped,
    /// The context is full: the session ends there, with a message saying so, not an error.
    Full,
}

/// One turn, streamed to stdout.
fn turn(
    generator: &mut Generator<Saved>,
    conv: &mut Conversation,
    text: &str,
    opts: &GenerateOptions,
) -> anyhow::Result<Turn> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let result = conv.turn(generator, text, opts, &mut out);
    out.flush().map_err(crate::printer::Unwritten)?;
    let s = generator.model().contract().max_seq_len;
    match result {
        Ok(g) if g.stop == StopReason::Interrupted => {
            take_ctrl_c();
            report(&g);
            crate::printer::info(format_args!(
                "chat: reply stopped (Ctrl-C); what it said stays in the conversation"
            ));
            Ok(Turn::Stopped)
        }
        Ok(g) => {
            report(&g);
            Ok(Turn::Done)
        }
        Err(TextError::Generate(GenerateError::Interrupted { .. })) => {
            take_ctrl_c();
            writeln!(out).ok();
            crate::printer::info(format_args!(
                "chat: stopped before the reply (Ctrl-C); the message was dropped"
            ));
            Ok(Turn::Stopped)
        }
        Err(TextError::Generate(GenerateError::ContextFull { partial, .. })) => {
            writeln!(out).ok();
            report(&partial);
            full(s, "the reply filled it");
            Ok(Turn::Full)
        }
        Err(TextError::Generate(GenerateError::PromptTooLong { prompt_len, .. })) => {
            full(
                s,
                &format!("this turn would make the conversation {prompt_len} tokens"),
            );
            Ok(Turn::Full)
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
