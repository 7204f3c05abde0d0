//! Text around the token loop: finding the tokenizer saved beside a package, turning a prompt
//! (plain, chat or explicit ids) into ids, and streaming generated ids back out as text.

use std::io::Write;
use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use super::chat::{ChatError, ChatTemplate, Message};
use super::generate::{GenerateError, GenerateOptions, Generation, Generator};
use super::StepModel;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("cannot load the tokenizer {path}: {detail}")]
    Load { path: PathBuf, detail: String },
    #[error("tokenizing the prompt failed: {0}")]
    Encode(String),
    #[error("decoding token ids failed: {0}")]
    Decode(String),
    #[error("a text prompt needs a tokenizer; give --tokenizer PATH or --prompt-ids")]
    NoTokenizer,
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error("writing the output failed")]
    Output(#[source] std::io::Error),
}

/// `X.mlpackage` (or `X.aimodel`) → `X.<suffix>` in the same directory: where `convert` saves the tokenizer
/// files (`tokenizer.json`, `tokenizer_config.json`).
pub fn beside_package(pkg: &Path, suffix: &str) -> PathBuf {
    let name = pkg
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name
        .strip_suffix(".mlpackage")
        .or_else(|| name.strip_suffix(".aimodel"))
        .unwrap_or(&name);
    pkg.with_file_name(format!("{stem}.{suffix}"))
}

/// Largest tokenizer.json read (real ones are 2-10 MB; Llama 3's is 9 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// Load a tokenizer.json: a regular file of at most [`MAX_TOKENIZER_BYTES`].
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, TextError> {
    let load = |detail: String| TextError::Load {
        path: path.into(),
        detail,
    };
    let bytes =
        crate::fsutil::read_input(path, MAX_TOKENIZER_BYTES).map_err(|e| load(e.to_string()))?;
    Tokenizer::from_bytes(bytes).map_err(|e| load(e.to_string()))
}

/// What the user asked the model to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Tokenized with the tokenizer's own special tokens (e.g. a bos it adds).
    Text(String),
    /// One user turn, rendered through the chat template with the generation prompt.
    Chat(String),
    /// Used as given.
    Ids(Vec<u32>),
    /// Text continuing a restored cache: tokenized without the tokenizer's special tokens (a
    /// bos in the middle of a sequence would change it).
    More(String),
}

/// The ids to feed the model.
pub fn prompt_ids(
    prompt: &Prompt,
    tokenizer: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
) -> Result<Vec<u32>, TextError> {
    let encode = |text: &str, add_special: bool| -> Result<Vec<u32>, TextError> {
        let tok = tokenizer.ok_or(TextError::NoTokenizer)?;
        let enc = tok
            .encode(text, add_special)
            .map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    };
    match prompt {
        Prompt::Ids(ids) => Ok(ids.clone()),
        Prompt::Text(text) => encode(text, true),
        Prompt::More(text) => encode(text, false),
        Prompt::Chat(text) => {
            let template = template.ok_or_else(|| {
                TextError::Chat(ChatError::NoTemplate {
                    origin: "the tokenizer config".into(),
                })
            })?;
            let tok = tokenizer.ok_or(TextError::NoTokenizer)?;
            chat_ids(&[Message::new("user", text)], tok, template)
        }
    }
}

/// The ids of `messages` rendered through the template, ending with the generation prompt.
pub fn chat_ids(
    messages: &[Message],
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<Vec<u32>, TextError> {
    let rendered = template.render(messages, true)?;
    // The template wrote the special tokens itself; adding them again would double bos.
    let enc = tokenizer
        .encode(rendered, false)
        .map_err(|e| TextError::Encode(e.to_string()))?;
    Ok(enc.get_ids().to_vec())
}

/// The most bytes of text a line can hold and still fit in `max_seq_len` tokens of
/// `tokenizer`: no token stands for more bytes than its longest piece is spelled with (a
/// byte-level piece spells each byte as one character of one to two bytes, a SentencePiece
/// byte piece `<0xFF>` one byte with six), so a line of more bytes than every position times
/// the longest piece cannot fit. Four times that, for normalizers that shorten text.
pub fn max_line_bytes(tokenizer: &Tokenizer, max_seq_len: usize) -> usize {
    let longest = tokenizer
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1)
        .max(1);
    max_seq_len
        .saturating_mul(longest)
        .saturating_mul(4)
        .max(4096)
}

/// A chat whose turns share the generator's cache: each turn renders the whole conversation
/// through the template, and [`Generator::extend`] feeds only the tokens past the ones already
/// cached (the new turn, when the template renders earlier turns as they were generated).
pub struct Conversation<'t> {
    pub tokenizer: &'t Tokenizer,
    pub template: &'t ChatTemplate,
    /// The system message the conversation starts with, if any.
    pub system: Option<String>,
    pub messages: Vec<Message>,
}

impl<'t> Conversation<'t> {
    pub fn new(
        tokenizer: &'t Tokenizer,
        template: &'t ChatTemplate,
        system: Option<String>,
    ) -> Self {
        let mut c = Conversation {
            tokenizer,
            template,
            system,
            messages: Vec::new(),
        };
        c.clear();
        c
    }

    /// Back to the system message alone.
    pub fn clear(&mut self) {
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(Message::new("system", s));
        }
    }

    /// The ids of the conversation with `user` as the next turn.
    pub fn ids_with(&self, user: &str) -> Result<Vec<u32>, TextError> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        chat_ids(&messages, self.tokenizer, self.template)
    }

    /// One turn: `user`'s message, the reply streamed to `out`, both kept in the conversation.
    /// On an error the conversation is left as it was (a full context keeps the partial reply
    /// in the error only).
    pub fn turn<M: StepModel>(
        &mut self,
        generator: &mut Generator<M>,
        user: &str,
        opts: &GenerateOptions,
        out: &mut dyn Write,
    ) -> Result<Generation, TextError> {
        let ids = self.ids_with(user)?;
        let generation = stream_extend(generator, &ids, opts, Some(self.tokenizer), out)?;
        self.push_turn(user, generation.reply_tokens())?;
        Ok(generation)
    }

    /// Keep `user`'s message and the reply made of `reply` ids (without the eos that ended
    /// it). Special tokens inside the reply are kept as text, which the tokenizer reads back
    /// as the same ids: the next turn's rendering then starts with the tokens in the cache.
    pub fn push_turn(&mut self, user: &str, reply: &[u32]) -> Result<(), TextError> {
        let reply = self
            .tokenizer
            .decode(reply, false)
            .map_err(|e| TextError::Decode(e.to_string()))?;
        self.messages.push(Message::new("user", user));
        self.messages.push(Message::new("assistant", &reply));
        Ok(())
    }
}

/// Incremental detokenization: emits text only once it is stable, so a character whose UTF-8
/// bytes are split across byte-level tokens comes out whole, and decoders that look at
/// neighbouring tokens (leading-space rules) see enough context.
pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    // Decoding ids[prefix..read] reproduces text already emitted; ids[read..] are pending.
    prefix: usize,
    read: usize,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer, skip_special_tokens: bool) -> Self {
        TextStream {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.tokenizer
            .decode(ids, self.skip_special_tokens)
            .map_err(|e| TextError::Decode(e.to_string()))
    }

    /// Add one id; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TextError> {
        self.ids.push(id);
        self.emit(false)
    }

    /// Whatever is still pending (an incomplete character comes out as U+FFFD).
    pub fn finish(&mut self) -> Result<Option<String>, TextError> {
        self.emit(true)
    }

    fn emit(&mut self, force: bool) -> Result<Option<String>, TextError> {
        if self.read == self.ids.len() {
            return Ok(None);
        }
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let now = self.decode(&self.ids[self.prefix..])?;
        // A trailing replacement character means the last token ended inside a character.
        if now.len() <= before.len() || (!force && now.ends_with('\u{FFFD}')) {
            if force {
                self.read = self.ids.len();
            }
            return Ok(None);
        }
        let text = match now.get(before.len()..) {
            Some(t) if now.starts_with(&before) => t.to_string(),
            // The decoder rewrote earlier text (rare): emit the part past the common prefix.
            _ => {
                let common = before
                    .char_indices()
                    .zip(now.chars())
                    .find(|((_, a), b)| a != b)
                    .map(|((i, _), _)| i)
                    .unwrap_or(before.len());
                now[common..].to_string()
            }
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(Some(text))
    }
}

/// Generate from `ids`, writing text to `out` as it is produced (or the ids, space-separated,
/// when there is no tokenizer), then a final newline.
pub fn stream_to<M: StepModel>(
    generator: &mut Generator<M>,
    ids: &[u32],
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    out: &mut dyn Write,
) -> Result<Generation, TextError> {
    generator.reset();
    stream_extend(generator, ids, opts, tokenizer, out)
}

/// [`stream_to`] through [`Generator::extend`]: the cached prefix of `ids` is not processed
/// again.
pub fn stream_extend<M: StepModel>(
    generator: &mut Generator<M>,
    ids: &[u32],
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    out: &mut dyn Write,
) -> Result<Generation, TextError> {
    let mut stream = tokenizer.map(|t| TextStream::new(t, true));
    let mut decode_error = None;
    let mut on_token = |id: u32| -> std::io::Result<()> {
        match stream.as_mut() {
            Some(s) => match s.push(id) {
                Ok(Some(text)) => out.write_all(text.as_bytes())?,
                Ok(None) => {}
                Err(e) => {
                    decode_error.get_or_insert(e);
                }
            },
            None => write!(out, "{id} ")?,
        }
        out.flush()
    };
    let result = generator.extend(ids, opts, &mut on_token);
    if let Some(e) = decode_error {
        return Err(e);
    }
    if let Some(s) = stream.as_mut() {
        if let Some(rest) = s.finish()? {
            out.write_all(rest.as_bytes()).map_err(TextError::Output)?;
        }
    }
    writeln!(out).map_err(TextError::Output)?;
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_path_sits_beside_the_package() {
        assert_eq!(
            beside_package(Path::new("/x/m.mlpackage"), "tokenizer.json"),
            PathBuf::from("/x/m.tokenizer.json")
        );
        assert_eq!(
            beside_package(Path::new("out/m.mlpackage/"), "tokenizer_config.json"),
            PathBuf::from("out/m.tokenizer_config.json")
        );
        assert_eq!(
            beside_package(Path::new("pkg"), "tokenizer.json"),
            PathBuf::from("pkg.tokenizer.json")
        );
    }
}
