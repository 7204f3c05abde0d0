//! The GGUF vocabulary → a Hugging Face `tokenizer.json` (built with the `tokenizers` crate)
//! and `tokenizer_config.json`.
//!
//! Byte-level BPE (`tokenizer.ggml.model = gpt2`) is rebuilt as stored: its vocabulary and
//! merges are verbatim, and the pre-tokenizer is named by `tokenizer.ggml.pre`, which maps onto
//! the splitting transformers' tokenizer.json describes for that family. SentencePiece
//! vocabularies (`llama`) become the BPE tokenizer transformers builds from them ([`spm`]).

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::sequence::Sequence as ProcessorSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::reader::GgufFile;
use super::spm::{self, Flavour};
use super::GgufError;

/// `tokenizer.ggml.pre` values we can rebuild.
pub const SUPPORTED_PRE: [&str; 7] = [
    "smollm",
    "llama-bpe",
    "lfm2",
    "qwen2",
    "deepseek-r1-qwen",
    "qwen35",
    "gpt2",
];

/// llama.cpp token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// Llama 3's split pattern (transformers' tokenizer.json for Meta-Llama-3): contractions
/// case-insensitively, letters with one leading non-letter, digits in groups of up to three.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split pattern (its tokenizer.json; llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`, which
/// `deepseek-r1-qwen` shares): as Llama 3's, but every digit on its own.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5's split pattern (its tokenizer.json; llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN35`):
/// Qwen2's, with combining marks (`\p{M}`) kept with the letters they follow.
const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Everything known about the tokenizer, for tokenizer.json and the config files.
#[derive(Debug)]
pub struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    pub pre: String,
    pub vocab_size: usize,
    pub bos: Option<(u32, String)>,
    pub eos: Option<(u32, String)>,
    pub pad: Option<(u32, String)>,
    pub unk: Option<(u32, String)>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// Control and user-defined tokens: (id, content, special).
    pub added: Vec<(u32, String, bool)>,
    pub chat_template: Option<String>,
}

fn tok_err(g: &GgufFile, message: impl Into<String>) -> GgufError {
    GgufError::Tokenizer {
        path: g.path().to_path_buf(),
        message: message.into(),
    }
}

/// A special token: its id and its text.
type Special = Option<(u32, String)>;

/// Rebuild the tokenizer stored in `g`'s metadata.
pub fn build(g: &GgufFile) -> Result<GgufTokenizer, GgufError> {
    let model = g.get_str("tokenizer.ggml.model")?.ok_or_else(|| {
        tok_err(
            g,
            "no `tokenizer.ggml.model` (the file carries no tokenizer)",
        )
    })?;
    if !matches!(model, "gpt2" | "llama") {
        return Err(GgufError::UnsupportedTokenizer {
            path: g.path().to_path_buf(),
            what: format!("model `{model}`"),
            supported: "gpt2 (byte-level BPE), llama (SentencePiece)".into(),
        });
    }
    let byte_level = model == "gpt2";
    let tokens = tokens(g)?;
    let types = token_types(g, tokens.len())?;
    // llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise, and so
    // does transformers.
    let specials = Specials::read(g, &tokens, !byte_level)?;
    let (pre, mut tokenizer) = match byte_level {
        true => byte_level_bpe(g, &tokens, &specials)?,
        false => sentencepiece(g, &tokens)?,
    };
    tokenizer.with_post_processor(post_processor(g, &specials, byte_level)?);
    let added = added_tokens(types.as_deref(), &tokens, &specials, &tokenizer);
    add_tokens(g, &mut tokenizer, &added)?;

    let chat_template = g.get_str("tokenizer.chat_template")?.map(str::to_string);
    let Specials {
        bos,
        eos,
        pad,
        unk,
        add_bos,
        add_eos,
    } = specials;
    Ok(GgufTokenizer {
        tokenizer,
        pre,
        vocab_size: tokens.len(),
        bos,
        eos,
        pad,
        unk,
        add_bos,
        add_eos,
        added,
        chat_template,
    })
}

/// Byte-level BPE: the vocabulary and merges as stored, split as `tokenizer.ggml.pre` names.
fn byte_level_bpe(
    g: &GgufFile,
    tokens: &[&str],
    specials: &Specials,
) -> Result<(String, Tokenizer), GgufError> {
    let (pre, pre_tokenizer) = pre_tokenizer(g)?;
    let (vocab, merges) = vocab_and_merges(g, tokens)?;
    // Llama 3 takes a piece that is a whole token as is, before any merge (transformers'
    // `ignore_merges`, llama.cpp's LLAMA3 pre-type); the others always merge.
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(matches!(pre.as_str(), "llama-bpe" | "llama3" | "lfm2"));
    if let Some((_, t)) = &specials.unk {
        builder = builder.unk_token(t.clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| tok_err(g, format!("BPE model: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok((pre, tokenizer))
}

/// A SentencePiece vocabulary ([`spm`]): Gemma's files as transformers reads Gemma's, the
/// rest as Llama's. The merges are the file's when it has them, else recovered from the
/// scores (Gemma: the positions).
fn sentencepiece(g: &GgufFile, tokens: &[&str]) -> Result<(String, Tokenizer), GgufError> {
    let arch = g.get_str("general.architecture")?.unwrap_or_default();
    let flavour = match arch {
        "gemma" | "gemma2" | "gemma3" => Flavour::Gemma,
        "phi3" => {
            return Err(GgufError::UnsupportedTokenizer {
                path: g.path().to_path_buf(),
                what: "a phi3 SentencePiece vocabulary".into(),
                supported: "SentencePiece of llama and gemma3 files".into(),
            })
        }
        _ => Flavour::Llama,
    };
    // SentencePiece refuses a model that defines a piece twice; Gemma's respelling may still
    // make two pieces one (transformers keeps the last id, and so does `spm`).
    unique(g, tokens)?;
    let spelled = spm::spelled(tokens, flavour);
    let merges = match g.get_str_array("tokenizer.ggml.merges")? {
        Some(_) => vocab_and_merges(g, tokens)?.1,
        None => {
            let scores = match flavour {
                Flavour::Gemma => vec![0.0; tokens.len()],
                Flavour::Llama => scores(g, tokens.len())?,
            };
            spm::merges(&spelled, &spm::ranks(&scores, flavour))
        }
    };
    let tokenizer = spm::tokenizer(&spelled, merges, flavour)
        .map_err(|e| tok_err(g, format!("SentencePiece model: {e}")))?;
    let name = match flavour {
        Flavour::Gemma => "sentencepiece (gemma)",
        Flavour::Llama => "sentencepiece (llama)",
    };
    Ok((name.to_string(), tokenizer))
}

/// `tokenizer.ggml.scores`: one finite score per piece.
fn scores(g: &GgufFile, n_tokens: usize) -> Result<Vec<f32>, GgufError> {
    let scores = g.get_f32_array("tokenizer.ggml.scores")?.ok_or_else(|| {
        tok_err(
            g,
            "no `tokenizer.ggml.scores` (a SentencePiece vocabulary without merges needs them)",
        )
    })?;
    if scores.len() != n_tokens {
        return Err(tok_err(
            g,
            format!(
                "`tokenizer.ggml.scores` has {} entries for {n_tokens} tokens",
                scores.len()
            ),
        ));
    }
    if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
        return Err(tok_err(
            g,
            format!("`tokenizer.ggml.scores` element {i} is {}", scores[i]),
        ));
    }
    Ok(scores)
}

/// The byte-level pre-tokenizer `tokenizer.ggml.pre` names; returns that name and it.
fn pre_tokenizer(g: &GgufFile) -> Result<(String, PreTokenizerWrapper), GgufError> {
    // Without `pre`, llama.cpp falls back to a splitting no transformers tokenizer uses;
    // guessing would give a tokenizer that silently disagrees with the model's training.
    let pre = g
        .get_str("tokenizer.ggml.pre")?
        .ok_or_else(|| GgufError::UnsupportedTokenizer {
            path: g.path().to_path_buf(),
            what: "pre-tokenizer (no `tokenizer.ggml.pre`)".into(),
            supported: SUPPORTED_PRE.join(", "),
        })?
        .to_string();
    let pre_tokenizer = pre_tokenizer_for(g, &pre)?;
    Ok((pre, pre_tokenizer))
}

/// `tokenizer.ggml.tokens`: present, not empty, with ids that fit u32.
fn tokens(g: &GgufFile) -> Result<Vec<&str>, GgufError> {
    let tokens = g
        .get_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| tok_err(g, "no `tokenizer.ggml.tokens`"))?;
    if tokens.is_empty() {
        return Err(tok_err(g, "`tokenizer.ggml.tokens` is empty"));
    }
    if u32::try_from(tokens.len()).is_err() {
        return Err(tok_err(g, format!("{} tokens is too many", tokens.len())));
    }
    // A piece read with U+FFFD in place of its bytes is another piece: the text would
    // tokenize differently from the model's training (transformers refuses such a file too).
    for key in [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.chat_template",
    ] {
        if let Some(at) = g.not_utf8(key) {
            return Err(tok_err(
                g,
                format!("`{key}` holds a string that is not UTF-8 (at byte {at})"),
            ));
        }
    }
    Ok(tokens)
}

/// Refuse a vocabulary that spells a piece twice: only one of the two ids could ever be
/// produced, and which one is a guess.
fn unique(g: &GgufFile, tokens: &[&str]) -> Result<(), GgufError> {
    let mut seen = std::collections::HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        if let Some(first) = seen.insert(*t, id) {
            return Err(tok_err(
                g,
                format!("token {t:?} appears twice in the vocabulary (ids {first} and {id})"),
            ));
        }
    }
    Ok(())
}

/// The BPE vocabulary (every token once) and `tokenizer.ggml.merges` as pairs.
fn vocab_and_merges(
    g: &GgufFile,
    tokens: &[&str],
) -> Result<(Vocab, Vec<(String, String)>), GgufError> {
    unique(g, tokens)?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.to_string(), id as u32))
        .collect();
    let merges_raw = g.get_str_array("tokenizer.ggml.merges")?.ok_or_else(|| {
        tok_err(
            g,
            "no `tokenizer.ggml.merges` (a BPE vocabulary needs them)",
        )
    })?;
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| {
            tok_err(
                g,
                format!("merge {i} ({m:?}) is not two tokens separated by a space"),
            )
        })?;
        merges.push((a.to_string(), b.to_string()));
    }
    Ok((vocab, merges))
}

/// `tokenizer.ggml.token_type`, when present: one entry per token.
fn token_types(g: &GgufFile, n_tokens: usize) -> Result<Option<Vec<u64>>, GgufError> {
    let types = g.get_uint_array("tokenizer.ggml.token_type")?;
    if let Some(types) = &types {
        if types.len() != n_tokens {
            return Err(tok_err(
                g,
                format!(
                    "`tokenizer.ggml.token_type` has {} entries for {} tokens",
                    types.len(),
                    n_tokens
                ),
            ));
        }
    }
    Ok(types)
}

/// The special tokens and whether BOS/EOS are added to every sequence.
struct Specials {
    bos: Special,
    eos: Special,
    pad: Special,
    unk: Special,
    add_bos: bool,
    add_eos: bool,
}

impl Specials {
    fn read(g: &GgufFile, tokens: &[&str], add_bos_default: bool) -> Result<Self, GgufError> {
        let special_id = |key: &str| -> Result<Special, GgufError> {
            match g.get_uint(key)? {
                None => Ok(None),
                Some(id) => match tokens.get(id as usize) {
                    Some(t) if id <= u32::MAX as u64 => Ok(Some((id as u32, t.to_string()))),
                    _ => Err(GgufError::Metadata {
                        path: g.path().to_path_buf(),
                        key: key.to_string(),
                        message: format!(
                            "token id {id} is outside the vocabulary of {}",
                            tokens.len()
                        ),
                    }),
                },
            }
        };
        let specials = Specials {
            bos: special_id("tokenizer.ggml.bos_token_id")?,
            eos: special_id("tokenizer.ggml.eos_token_id")?,
            pad: special_id("tokenizer.ggml.padding_token_id")?,
            unk: special_id("tokenizer.ggml.unknown_token_id")?,
            add_bos: g
                .get_bool("tokenizer.ggml.add_bos_token")?
                .unwrap_or(add_bos_default),
            add_eos: g.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        };
        let flag_err = |key: &str, what: &str| GgufError::Metadata {
            path: g.path().to_path_buf(),
            key: key.to_string(),
            message: format!("is true but there is no {what} token id"),
        };
        if specials.add_bos && specials.bos.is_none() {
            return Err(flag_err("tokenizer.ggml.add_bos_token", "BOS"));
        }
        if specials.add_eos && specials.eos.is_none() {
            return Err(flag_err("tokenizer.ggml.add_eos_token", "EOS"));
        }
        Ok(specials)
    }

    /// BOS when it is added to every sequence.
    fn bos_added(&self) -> Option<&(u32, String)> {
        self.bos.as_ref().filter(|_| self.add_bos)
    }

    /// EOS when it is added to every sequence.
    fn eos_added(&self) -> Option<&(u32, String)> {
        self.eos.as_ref().filter(|_| self.add_eos)
    }
}

/// Byte-level offsets as transformers writes them (byte-level vocabularies), then BOS/EOS when
/// the GGUF asks for them.
fn post_processor(
    g: &GgufFile,
    specials: &Specials,
    byte_level: bool,
) -> Result<Option<PostProcessorWrapper>, GgufError> {
    let mut steps: Vec<PostProcessorWrapper> = Vec::new();
    if byte_level {
        steps.push(ByteLevel::new(true, false, true).into());
    }
    let (bos, eos) = (specials.bos_added(), specials.eos_added());
    if bos.is_some() || eos.is_some() {
        let template =
            special_template(bos, eos).map_err(|e| tok_err(g, format!("BOS/EOS template: {e}")))?;
        steps.push(template.into());
    }
    Ok(match steps.len() {
        0 => None,
        1 => steps.pop(),
        _ => Some(ProcessorSequence::new(steps).into()),
    })
}

/// Control and user-defined tokens as (id, content, special), sorted by id; bos/eos/pad/unk are
/// special even when a converter forgot to mark them as control. As transformers adds them:
/// every control token, and each user-defined token the vocabulary spells as the file does
/// (Gemma's runs of spaces are user-defined but respelled with `▁`: they stay pieces the
/// model finds by merging, not added tokens). Each keeps the id the vocabulary gives it.
fn added_tokens(
    types: Option<&[u64]>,
    tokens: &[&str],
    specials: &Specials,
    tokenizer: &Tokenizer,
) -> Vec<(u32, String, bool)> {
    let mut added: Vec<(u32, String, bool)> = Vec::new();
    if let Some(types) = types {
        for (id, (&ty, t)) in types.iter().zip(tokens.iter()).enumerate() {
            let in_vocab = tokenizer.token_to_id(t);
            match ty {
                TOKEN_TYPE_CONTROL => {
                    added.push((in_vocab.unwrap_or(id as u32), t.to_string(), true))
                }
                TOKEN_TYPE_USER_DEFINED => {
                    if let Some(id) = in_vocab {
                        added.push((id, t.to_string(), false));
                    }
                }
                _ => {}
            }
        }
    }
    let named = [&specials.bos, &specials.eos, &specials.pad, &specials.unk];
    for (id, t) in named.into_iter().flatten() {
        if !added.iter().any(|(a, _, _)| a == id) {
            added.push((*id, t.clone(), true));
        }
    }
    added.sort_by_key(|(id, _, _)| *id);
    added.dedup_by_key(|(id, _, _)| *id);
    added
}

/// Register the added tokens with the tokenizer, special ones first.
fn add_tokens(
    g: &GgufFile,
    tokenizer: &mut Tokenizer,
    added: &[(u32, String, bool)],
) -> Result<(), GgufError> {
    let specials: Vec<AddedToken> = added
        .iter()
        .filter(|(_, _, s)| *s)
        .map(|(_, t, _)| AddedToken::from(t.clone(), true))
        .collect();
    let users: Vec<AddedToken> = added
        .iter()
        .filter(|(_, _, s)| !*s)
        .map(|(_, t, _)| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    tokenizer
        .add_special_tokens(specials)
        .and_then(|_| tokenizer.add_tokens(users))
        .map_err(|e| tok_err(g, format!("added tokens: {e}")))?;
    Ok(())
}

/// `[BOS] $A [EOS]` for single sequences and the same per segment for pairs (transformers'
/// layout for Llama-style tokenizers).
fn special_template(
    bos: Option<&(u32, String)>,
    eos: Option<&(u32, String)>,
) -> tokenizers::Result<TemplateProcessing> {
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    for (segment, seq) in [("A", 0), ("B", 1)] {
        if let Some((_, t)) = bos {
            pair.push(format!("{t}:{seq}"));
        }
        pair.push(format!("${segment}:{seq}"));
        if let Some((_, t)) = eos {
            pair.push(format!("{t}:{seq}"));
        }
    }
    if let Some((id, t)) = bos {
        single.push(t.clone());
        specials.push((t.clone(), *id));
    }
    single.push("$A".to_string());
    if let Some((id, t)) = eos {
        single.push(t.clone());
        if !specials.iter().any(|(s, _)| s == t) {
            specials.push((t.clone(), *id));
        }
    }
    Ok(TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))?
        .special_tokens(specials)
        .build()?)
}

/// The pre-tokenizer transformers uses for the family llama.cpp calls `pre`.
fn pre_tokenizer_for(g: &GgufFile, pre: &str) -> Result<PreTokenizerWrapper, GgufError> {
    // GPT-2's own regex, no prefix space: what llama.cpp applies for these types.
    let gpt2 = || ByteLevel::new(false, true, true);
    match pre {
        "gpt2" => Ok(gpt2().into()),
        // SmolLM: every digit on its own, then GPT-2 byte-level splitting.
        "smollm" => Ok(Sequence::new(vec![Digits::new(true).into(), gpt2().into()]).into()),
        // LFM2's vocabulary is split as Llama 3's (llama.cpp's LLAMA3 pre-type).
        "llama-bpe" | "llama3" | "lfm2" => regex_split(g, pre, LLAMA3_PATTERN),
        "qwen2" | "deepseek-r1-qwen" => regex_split(g, pre, QWEN2_PATTERN),
        "qwen35" => regex_split(g, pre, QWEN35_PATTERN),
        _ => Err(GgufError::UnsupportedTokenizer {
            path: g.path().to_path_buf(),
            what: format!("pre-tokenizer `{pre}`"),
            supported: SUPPORTED_PRE.join(", "),
        }),
    }
}

/// A regex split (each match its own piece) followed by byte-level mapping without GPT-2's
/// regex: how transformers' tokenizer.json describes the Llama 3 and Qwen2 families.
fn regex_split(g: &GgufFile, pre: &str, pattern: &str) -> Result<PreTokenizerWrapper, GgufError> {
    let split = Split::new(
        SplitPattern::Regex(pattern.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| tok_err(g, format!("{pre} split pattern: {e}")))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ])
    .into())
}

impl GgufTokenizer {
    /// The ids config.json names.
    pub fn special_ids(&self) -> super::SpecialIds {
        let id = |t: &Option<(u32, String)>| t.as_ref().map(|(i, _)| *i);
        super::SpecialIds {
            bos: id(&self.bos),
            eos: id(&self.eos),
            pad: id(&self.pad),
        }
    }

    /// `tokenizer_config.json` as transformers writes it for a fast tokenizer.
    pub fn config_json(&self, model_max_length: usize) -> serde_json::Value {
        // Keys are ids as strings; transformers parses them, so map order does not matter.
        let mut decoder = serde_json::Map::new();
        for (id, content, special) in &self.added {
            decoder.insert(
                id.to_string(),
                serde_json::json!({
                    "content": content,
                    "lstrip": false,
                    "normalized": false,
                    "rstrip": false,
                    "single_word": false,
                    "special": special,
                }),
            );
        }
        let named = [&self.bos, &self.eos, &self.pad, &self.unk];
        let additional: Vec<&str> = self
            .added
            .iter()
            .filter(|(id, _, special)| {
                *special
                    && !named
                        .iter()
                        .any(|n| n.as_ref().is_some_and(|(i, _)| i == id))
            })
            .map(|(_, t, _)| t.as_str())
            .collect();
        let content = |t: &Option<(u32, String)>| match t {
            Some((_, s)) => serde_json::Value::String(s.clone()),
            None => serde_json::Value::Null,
        };
        let mut cfg = serde_json::json!({
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "add_prefix_space": false,
            "added_tokens_decoder": decoder,
            "additional_special_tokens": additional,
            "bos_token": content(&self.bos),
            "clean_up_tokenization_spaces": false,
            "eos_token": content(&self.eos),
            "model_max_length": model_max_length,
            "pad_token": content(&self.pad),
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": content(&self.unk),
        });
        if let (Some(t), Some(obj)) = (&self.chat_template, cfg.as_object_mut()) {
            obj.insert("chat_template".into(), serde_json::Value::String(t.clone()));
        }
        cfg
    }

    /// `special_tokens_map.json`.
    pub fn special_tokens_map_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (key, tok) in [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("pad_token", &self.pad),
            ("unk_token", &self.unk),
        ] {
            if let Some((_, t)) = tok {
                m.insert(key.into(), serde_json::Value::String(t.clone()));
            }
        }
        serde_json::Value::Object(m)
    }
}
