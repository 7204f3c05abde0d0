//! The real SmolLM2-135M-Instruct GGUF (docs/reference/real-model.md): imported into a temp dir, it opens as
//! a checkpoint with the published parameter count, and its tokenizer encodes text to the ids
//! a reference byte-level BPE written here computes from the GGUF vocabulary and merges.
//!
//! `make test` fetches the GGUF first; a plain `cargo test` without it skips these tests
//! (`needs!(Gguf)`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use hf2coreml::checkpoint::gguf::{import, GgufFile, ImportOptions};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::pipeline::inspect as summary;
use hf2coreml_testkit::gguf::byte_to_char;

use crate::support::needs;

struct Imported {
    _root: tempfile::TempDir,
    dir: PathBuf,
    gguf: PathBuf,
}

/// One import shared by the tests of this file.
fn imported() -> &'static Imported {
    static CELL: OnceLock<Imported> = OnceLock::new();
    CELL.get_or_init(|| {
        let gguf = hf2coreml_testkit::gguf_file();
        let root = tempfile::tempdir().expect("temp dir");
        let dir = root.path().join("smollm2");
        import(
            &gguf,
            &dir,
            &ImportOptions::default(),
            &hf2coreml::progress::Silent,
        )
        .expect("the real model imports");
        Imported {
            _root: root,
            dir,
            gguf,
        }
    })
}

#[test]
fn real_model_opens_with_published_parameter_count() {
    needs!(Gguf);
    let m = imported();
    let ckpt = Checkpoint::open(&m.dir).unwrap();
    let s = summary::summarize(&ckpt, &hf2coreml::quant::Recipe::default());
    assert_eq!(s.parameters, 134_515_008);
    let spec = ckpt.spec();
    assert_eq!(spec.num_hidden_layers, 30);
    assert_eq!(spec.hidden_size, 576);
    assert_eq!(spec.intermediate_size, 1536);
    assert_eq!(
        (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim
        ),
        (9, 3, 64)
    );
    assert_eq!(spec.vocab_size, 49_152);
    assert_eq!(spec.rope_theta, 100_000.0);
    assert_eq!(spec.rms_norm_eps, 1e-5);
    assert_eq!(spec.max_position_embeddings, 8192);
    assert!(spec.tie_word_embeddings);
    assert_eq!(spec.bos_token_id, Some(1));
    assert_eq!(spec.eos_token_ids, vec![2]);
}

/// The q projection of block 0 in HF order equals the GGUF rows with llama.cpp's rope
/// interleave undone, checked on one head's rows against the raw dequantized GGUF tensor.
#[test]
fn real_model_q_rows_are_unpermuted() {
    needs!(Gguf);
    let m = imported();
    let mut g = GgufFile::open(&m.gguf).unwrap();
    let t = g.tensor("blk.0.attn_q.weight").unwrap().clone();
    let raw = g.read_f32(&t).unwrap();
    let ckpt = Checkpoint::open(&m.dir).unwrap();
    let hf = ckpt
        .tensor("model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .to_f32();
    let cols = 576;
    let head_dim = 64;
    for head in [0usize, 4, 8] {
        for i in 0..head_dim / 2 {
            for j in 0..2 {
                let gguf_row = head * head_dim + 2 * i + j;
                let hf_row = head * head_dim + j * head_dim / 2 + i;
                for c in [0usize, 17, 575] {
                    let want = half::f16::from_f32(raw[gguf_row * cols + c]).to_f32();
                    assert_eq!(
                        hf[hf_row * cols + c],
                        want,
                        "head {head} i {i} j {j} col {c}"
                    );
                }
            }
        }
    }
}

/// A reference byte-level BPE over the GGUF vocabulary: special tokens first, then SmolLM's
/// pre-tokenizer (each digit alone, then GPT-2's split pattern), then rank-ordered merges.
struct ReferenceBpe {
    vocab: HashMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    specials: Vec<(String, u32)>,
    byte_chars: Vec<char>,
}

impl ReferenceBpe {
    fn from_gguf(path: &Path) -> Self {
        let g = GgufFile::open(path).unwrap();
        let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap();
        let types = g
            .get_uint_array("tokenizer.ggml.token_type")
            .unwrap()
            .unwrap();
        let merges = g.get_str_array("tokenizer.ggml.merges").unwrap().unwrap();
        let vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let ranks = merges
            .iter()
            .enumerate()
            .map(|(r, m)| {
                let (a, b) = m.split_once(' ').unwrap();
                ((a.to_string(), b.to_string()), r)
            })
            .collect();
        // llama.cpp token type 3 = control.
        let specials = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, ty))| **ty == 3)
            .map(|(i, (t, _))| (t.to_string(), i as u32))
            .collect();
        ReferenceBpe {
            vocab,
            ranks,
            specials,
            byte_chars: byte_to_char(),
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
            match next {
                Some((at, s, id)) => {
                    self.encode_plain(&rest[..at], &mut ids);
                    ids.push(id);
                    rest = &rest[at + s.len()..];
                }
                None => {
                    self.encode_plain(rest, &mut ids);
                    rest = "";
                }
            }
        }
        ids
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) {
        for piece in split_digits(text).iter().flat_map(|p| gpt2_split(p)) {
            let mut parts: Vec<String> = piece
                .bytes()
                .map(|b| self.byte_chars[b as usize].to_string())
                .collect();
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

/// Each decimal digit becomes its own piece (the `Digits(individual_digits)` step).
fn split_digits(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in text.chars() {
        if c.is_numeric() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            out.push(c.to_string());
        } else {
            cur.push(c);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// GPT-2's pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
/// as a hand-written scanner. `char::is_alphabetic`/`is_numeric` stand in for \p{L}/\p{N},
/// which agree on the Latin, accented and CJK text these tests use.
fn gpt2_split(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let letter = |c: char| c.is_alphabetic();
    let number = |c: char| c.is_numeric();
    let other = |c: char| !c.is_whitespace() && !letter(c) && !number(c);
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let rest: String = chars[i..].iter().take(3).collect();
        if let Some(c) = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
            .iter()
            .filter(|c| rest.starts_with(**c))
            .max_by_key(|c| c.len())
        {
            out.push(c.to_string());
            i += c.chars().count();
            continue;
        }
        let start = i;
        let mut j = i;
        if chars[j] == ' ' && j + 1 < chars.len() && !chars[j + 1].is_whitespace() {
            j += 1;
        }
        let class: Option<&dyn Fn(char) -> bool> = if letter(chars[j]) {
            Some(&letter)
        } else if number(chars[j]) {
            Some(&number)
        } else if other(chars[j]) {
            Some(&other)
        } else {
            None
        };
        if let Some(class) = class {
            while j < chars.len() && class(chars[j]) {
                j += 1;
            }
            out.push(chars[start..j].iter().collect());
            i = j;
            continue;
        }
        // A whitespace run; if a non-space follows, its last character goes with that word.
        let mut k = i;
        while k < chars.len() && chars[k].is_whitespace() {
            k += 1;
        }
        let end = if k < chars.len() && k - i > 1 {
            k - 1
        } else {
            k
        };
        out.push(chars[i..end].iter().collect());
        i = end;
    }
    out
}

const SAMPLES: [&str; 8] = [
    "What is the capital of France?",
    "In 2024, 1,234.5 apples cost $99.",
    "  leading spaces and trailing  ",
    "Café, naïve, déjà vu, Ångström, über",
    "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "line one\n\nline two\ttabbed",
    "don't won't it's we'll I'd they've",
    "東京 and Zürich",
];

#[test]
fn real_model_tokenizer_matches_reference_bpe() {
    needs!(Gguf);
    let m = imported();
    let reference = ReferenceBpe::from_gguf(&m.gguf);
    let tok = tokenizers::Tokenizer::from_file(m.dir.join("tokenizer.json")).unwrap();
    for text in SAMPLES {
        let want = reference.encode(text);
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "encoding {text:?}");
        assert_eq!(tok.decode(&got, false).unwrap(), text, "decoding {text:?}");
    }
}

/// Ids read off the vocabulary by hand, so the reference above is not the only witness.
#[test]
fn real_model_tokenizer_known_ids() {
    needs!(Gguf);
    let m = imported();
    let tok = tokenizers::Tokenizer::from_file(m.dir.join("tokenizer.json")).unwrap();
    let g = GgufFile::open(&m.gguf).unwrap();
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap();
    let id = |t: &str| tokens.iter().position(|x| *x == t).unwrap() as u32;
    let enc = |s: &str| tok.encode(s, true).unwrap().get_ids().to_vec();
    assert_eq!(enc("<|im_start|>user<|im_end|>"), vec![1, id("user"), 2]);
    // Digits are split one by one, and the space before them stands alone.
    assert_eq!(enc(" 42"), vec![id("Ġ"), id("4"), id("2")]);
    assert_eq!(enc("Paris"), vec![id("Paris")]);
    assert_eq!(enc(" Paris"), vec![id("ĠParis")]);
    assert_eq!(tok.decode(&[id("ĠParis")], false).unwrap(), " Paris");
}

#[test]
fn reference_scanner_follows_gpt2_rules() {
    assert_eq!(gpt2_split("Hello world"), ["Hello", " world"]);
    assert_eq!(gpt2_split("a  b"), ["a", " ", " b"]);
    assert_eq!(gpt2_split("end  "), ["end", "  "]);
    assert_eq!(gpt2_split("it's!!"), ["it", "'s", "!!"]);
    assert_eq!(split_digits("ab12c"), ["ab", "1", "2", "c"]);
}
