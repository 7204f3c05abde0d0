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
    let max_seq_len = generator.model().contract().max_seq_len;
    let limit = hf2coreml::runtime::text::max_line_bytes(conv.tokenizer, max_seq_len);
    let mut input = stdin.lock();
    let mut buf = Vec::new();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush().ok();
        }
        let line = match read_line(&mut input, limit, &mut buf).context("reading stdin")? {
            Read::End => break,
            Read::Line(line) => line,
            Read::TooLong if interactive => {
                skip_line(&mut input).context("reading stdin")?;
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
    out.flush().map_err(crate::printer::Unwritten)?;
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
