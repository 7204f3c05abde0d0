//! The tokenizers rebuilt from GGUF vocabularies agree token for token with a reference
//! byte-level BPE over the same vocabulary and merges, on a multilingual text with digits,
//! whitespace runs and emoji: Qwen2 (`deepseek-r1-qwen`, the real DeepSeek-R1-Distill-Qwen-7B
//! vocabulary from `make gguf-7b-head`), Llama 3 (`llama-bpe`: that vocabulary under Llama 3's
//! splitting and whole-word lookup) and SmolLM (`smollm`, the real SmolLM2 file).
//! The reference splitters are hand-written scanners of llama.cpp's patterns
//! (`llama-vocab.cpp`), not the regexes the importer uses.

use std::collections::HashMap;
use std::path::Path;

use hf2coreml::checkpoint::gguf::{tokenizer, GgufFile};
use hf2coreml_testkit::gguf::{byte_to_char, GgufWriter, Meta};

use crate::support::need::gguf_7b_head;
use crate::support::needs;

const TEXT: &str = "Hello, World! Ünïcödé façade — 東京タワーは333メートル。 Привет, мир! \
    안녕하세요 Γειά σου 🙂🚀👍🏽 emoji;numbers 1234567 and 3.14159, $42.00!\n\
    tabs\t\tand   spaces,\n\n\nnewlines\r\n  indented  \n   DON'T I'M we'LL they've it's ... \
    «quotes» (parens) [x] {y} a+b=c   trailing   ";

/// How the reference splits text before BPE.
#[derive(Clone, Copy)]
enum Split {
    /// Llama 3 / Qwen2: the pattern with digit runs of at most this many.
    Gpt4 { digits: usize },
    /// SmolLM: each digit alone, then GPT-2's pattern.
    SmolLm,
}

struct ReferenceBpe {
    vocab: HashMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    specials: Vec<(String, u32)>,
    byte_chars: Vec<char>,
    split: Split,
    ignore_merges: bool,
}

impl ReferenceBpe {
    fn new(g: &GgufFile, split: Split, ignore_merges: bool) -> Self {
        let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap();
        let types = g
            .get_uint_array("tokenizer.ggml.token_type")
            .unwrap()
            .unwrap();
        let merges = g.get_str_array("tokenizer.ggml.merges").unwrap().unwrap();
        ReferenceBpe {
            vocab: tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (t.to_string(), i as u32))
                .collect(),
            ranks: merges
                .iter()
                .enumerate()
                .map(|(r, m)| {
                    let (a, b) = m.split_once(' ').unwrap();
                    ((a.to_string(), b.to_string()), r)
                })
                .collect(),
            specials: tokens
                .iter()
                .zip(&types)
                .enumerate()
                .filter(|(_, (_, ty))| **ty == 3)
                .map(|(i, (t, _))| (t.to_string(), i as u32))
                .collect(),
            byte_chars: byte_to_char(),
            split,
            ignore_merges,
        }
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next = self
                .specials
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s, *id)))
                .min_by_key(|(at, s, _)| (*at, std::cmp::Reverse(s.len())));
            let Some((at, s, id)) = next else {
                self.encode_plain(rest, &mut ids);
                break;
            };
            self.encode_plain(&rest[..at], &mut ids);
            ids.push(id);
            rest = &rest[at + s.len()..];
        }
        ids
    }

    fn pieces(&self, text: &str) -> Vec<String> {
        match self.split {
            Split::Gpt4 { digits } => gpt4_split(text, digits),
            Split::SmolLm => split_digits(text)
                .iter()
                .flat_map(|p| gpt2_split(p))
                .collect(),
        }
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) {
        for piece in self.pieces(text) {
            let mapped: String = piece.bytes().map(|b| self.byte_chars[b as usize]).collect();
            if self.ignore_merges {
                if let Some(id) = self.vocab.get(&mapped) {
                    ids.push(*id);
                    continue;
                }
            }
            let mut parts: Vec<String> = mapped.chars().map(String::from).collect();
            loop {
                let best = (0..parts.len().saturating_sub(1))
                    .filter_map(|i| {
                        self.ranks
                            .get(&(parts[i].clone(), parts[i + 1].clone()))
                            .map(|r| (*r, i))
                    })
                    .min();
                let Some((_, i)) = best else { break };
                let merged = format!("{}{}", parts[i], parts[i + 1]);
                parts.splice(i..i + 2, [merged]);
            }
            ids.extend(parts.iter().map(|p| self.vocab[p]));
        }
    }
}

fn letter(c: char) -> bool {
    c.is_alphabetic()
}

fn number(c: char) -> bool {
    c.is_numeric()
}

fn newline(c: char) -> bool {
    c == '\r' || c == '\n'
}

/// A contraction at the start of `chars` (case-insensitive), by length.
fn contraction(chars: &[char]) -> Option<usize> {
    if chars.first() != Some(&'\'') {
        return None;
    }
    let lower: String = chars[1..]
        .iter()
        .take(2)
        .flat_map(|c| c.to_lowercase())
        .collect();
    if ["re", "ve", "ll"].iter().any(|c| lower.starts_with(c)) && lower.chars().count() >= 2 {
        return Some(3);
    }
    ["s", "t", "m", "d"]
        .iter()
        .any(|c| lower.starts_with(c))
        .then_some(2)
}

/// Llama 3's / Qwen2's pattern (`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|
/// \p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`), alternative by
/// alternative.
fn gpt4_split(text: &str, digits: usize) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    let other = |x: char| !x.is_whitespace() && !letter(x) && !number(x);
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let run = |mut j: usize, f: &dyn Fn(char) -> bool| {
            while j < c.len() && f(c[j]) {
                j += 1;
            }
            j
        };
        let end = if let Some(n) = contraction(&c[i..]) {
            i + n
        } else if letter(c[i]) {
            run(i, &letter)
        } else if !newline(c[i]) && !number(c[i]) && c.get(i + 1).is_some_and(|x| letter(*x)) {
            run(i + 1, &letter)
        } else if number(c[i]) {
            (i..c.len().min(i + digits))
                .take_while(|j| number(c[*j]))
                .count()
                + i
        } else if other(c[i]) || (c[i] == ' ' && c.get(i + 1).is_some_and(|x| other(*x))) {
            let j = run(if c[i] == ' ' { i + 1 } else { i }, &other);
            run(j, &newline)
        } else {
            // Whitespace: up to the last newline of the run, else the run less the space
            // before a word (unless the run ends the text), else the whole run.
            let k = run(i, &|x: char| x.is_whitespace());
            match (i..k).rev().find(|j| newline(c[*j])) {
                Some(last) => last + 1,
                None if k == c.len() || k - i == 1 => k,
                None => k - 1,
            }
        };
        out.push(c[i..end].iter().collect());
        i = end;
    }
    out
}

/// Each digit its own piece.
fn split_digits(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in text.chars() {
        if number(ch) {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            out.push(ch.to_string());
        } else {
            cur.push(ch);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// GPT-2's pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn gpt2_split(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    let other = |x: char| !x.is_whitespace() && !letter(x) && !number(x);
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let rest: String = c[i..].iter().take(3).collect();
        let con = ["'re", "'ve", "'ll", "'s", "'t", "'m", "'d"]
            .iter()
            .find(|x| rest.starts_with(**x));
        let mut j = i;
        if c[j] == ' ' && c.get(j + 1).is_some_and(|x| !x.is_whitespace()) {
            j += 1;
        }
        let class: Option<&dyn Fn(char) -> bool> = if letter(c[j]) {
            Some(&letter)
        } else if number(c[j]) {
            Some(&number)
        } else if other(c[j]) {
            Some(&other)
        } else {
            None
        };
        let end = if let Some(x) = con {
            i + x.chars().count()
        } else if let Some(class) = class {
            while j < c.len() && class(c[j]) {
                j += 1;
            }
            j
        } else {
            let mut k = i;
            while k < c.len() && c[k].is_whitespace() {
                k += 1;
            }
            if k < c.len() && k - i > 1 {
                k - 1
            } else {
                k
            }
        };
        out.push(c[i..end].iter().collect());
        i = end;
    }
    out
}

/// The 7B header's metadata (no tensors) with `tokenizer.ggml.pre` set to `pre`.
fn with_pre(g: &GgufFile, pre: &str) -> GgufFile {
    let mut w = GgufWriter::default();
    for (k, v) in g.metadata() {
        w.meta(k, Meta::Value(v.clone()));
    }
    w.meta("tokenizer.ggml.pre", Meta::Str(pre.into()));
    GgufFile::from_bytes(Path::new("meta.gguf"), w.to_bytes()).unwrap()
}

fn check(g: &GgufFile, split: Split, ignore_merges: bool) {
    let reference = ReferenceBpe::new(g, split, ignore_merges);
    let tok = tokenizer::build(g).unwrap().tokenizer;
    for text in TEXT.split_inclusive('\n').chain([TEXT]) {
        let want = reference.encode(text);
        let got = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(
            got,
            want,
            "{} on {text:?}",
            tokenizer::build(g).unwrap().pre
        );
        assert_eq!(tok.decode(&got, false).unwrap(), text);
    }
}

#[test]
fn qwen2_tokenizer_matches_the_vocabulary() {
    needs!(Gguf7bHead);
    let g = GgufFile::open_header(&gguf_7b_head()).unwrap();
    assert_eq!(
        g.get_str("tokenizer.ggml.pre").unwrap(),
        Some("deepseek-r1-qwen")
    );
    check(&g, Split::Gpt4 { digits: 1 }, false);
    check(&with_pre(&g, "qwen2"), Split::Gpt4 { digits: 1 }, false);
}

#[test]
fn llama3_tokenizer_matches_the_vocabulary() {
    needs!(Gguf7bHead);
    let g = with_pre(
        &GgufFile::open_header(&gguf_7b_head()).unwrap(),
        "llama-bpe",
    );
    check(&g, Split::Gpt4 { digits: 3 }, true);
}

#[test]
fn smollm_tokenizer_matches_the_vocabulary() {
    needs!(Gguf);
    let g = GgufFile::open(&hf2coreml_testkit::gguf_file()).unwrap();
    check(&g, Split::SmolLm, false);
}

#[test]
fn reference_scanner_follows_the_pattern() {
    assert_eq!(gpt4_split("Hello world", 3), ["Hello", " world"]);
    assert_eq!(gpt4_split("a  b", 3), ["a", " ", " b"]);
    assert_eq!(gpt4_split("12345", 3), ["123", "45"]);
    assert_eq!(gpt4_split("12345", 1), ["1", "2", "3", "4", "5"]);
    assert_eq!(gpt4_split("x\n\n  y", 3), ["x", "\n\n", " ", " y"]);
    assert_eq!(gpt4_split("DON'T!!\n", 3), ["DON", "'T", "!!\n"]);
    assert_eq!(gpt4_split(" (a)", 3), [" (", "a", ")"]);
}
