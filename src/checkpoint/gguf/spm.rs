//! SentencePiece vocabularies (`tokenizer.ggml.model = llama`: Llama 2, Mistral, Gemma) as the
//! BPE tokenizer transformers builds from the same file: the pieces as the vocabulary, merges
//! recovered from it (a GGUF stores none), byte fallback to the `<0xNN>` pieces, `▁` for spaces
//! with one prepended to the text.
//!
//! The merges are transformers' `generate_merges`: every split of a piece into two pieces of
//! the vocabulary, the best piece's first, ties broken by the longer left, then right, part,
//! then by file order. Gemma's scores do not follow its merge order, so transformers ranks its
//! pieces by position instead and spells its whitespace pieces with `▁`.

use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{DecoderWrapper, SplitDelimiterBehavior, Tokenizer};

/// SentencePiece's space.
pub const SPACE: char = '▁';

/// How a family's pieces are ranked and spelled (transformers picks it by architecture).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// Llama 2, Mistral: pieces ranked by score, spaces prepended to the text.
    Llama,
    /// Gemma: pieces ranked by position, all-space pieces respelled with `▁`, spaces replaced
    /// by `▁` and nothing prepended, `<unk>` for what bytes cannot spell.
    Gemma,
}

/// The pieces as the tokenizer spells them: Gemma's pieces of two or more spaces as `▁`s.
pub fn spelled(tokens: &[&str], flavour: Flavour) -> Vec<String> {
    tokens
        .iter()
        .map(|t| {
            let respell =
                flavour == Flavour::Gemma && t.contains(' ') && t.chars().all(char::is_whitespace);
            match respell {
                true => SPACE.to_string().repeat(t.chars().count()),
                false => t.to_string(),
            }
        })
        .collect()
}

/// transformers' `generate_merges(vocab, ranks)`: for each piece in file order, its splits into
/// two vocabulary pieces (ordered by the parts' ids), all sorted best rank first, then by the
/// longer left and right part; equal keys keep their order. A piece spelled twice counts once,
/// at its first place with its last id and rank (Python dicts built from the lists).
pub fn merges(tokens: &[String], ranks: &[f32]) -> Vec<(String, String)> {
    let vocab: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut order: Vec<(&str, f32)> = Vec::with_capacity(tokens.len());
    let mut place: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (piece, &rank) in tokens.iter().zip(ranks) {
        match place.get(piece.as_str()) {
            Some(&k) => order[k].1 = rank,
            None => {
                place.insert(piece, order.len());
                order.push((piece, rank));
            }
        }
    }
    let mut all: Vec<(&str, &str, f32)> = Vec::new();
    for (piece, rank) in order {
        let mut local: Vec<(&str, &str, f32)> = piece
            .char_indices()
            .skip(1)
            .map(|(at, _)| piece.split_at(at))
            .filter(|(l, r)| vocab.contains_key(l) && vocab.contains_key(r))
            .map(|(l, r)| (l, r, rank))
            .collect();
        local.sort_by_key(|(l, r, _)| (vocab[l], vocab[r]));
        all.extend(local);
    }
    let key = |(l, r, rank): &(&str, &str, f32)| (*rank, l.chars().count(), r.chars().count());
    all.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0)
            .then(kb.1.cmp(&ka.1))
            .then(kb.2.cmp(&ka.2))
    });
    all.into_iter()
        .map(|(l, r, _)| (l.to_string(), r.to_string()))
        .collect()
}

/// The ranks transformers sorts `flavour`'s merges by: the scores, or Gemma's −position.
pub fn ranks(scores: &[f32], flavour: Flavour) -> Vec<f32> {
    match flavour {
        Flavour::Llama => scores.to_vec(),
        Flavour::Gemma => (0..scores.len()).map(|i| -(i as f32)).collect(),
    }
}

/// The tokenizer without its added tokens and post-processor: BPE over `tokens` (a piece
/// spelled twice has its last id) with byte fallback, the space handling of `flavour`, and
/// the decoder back to text.
pub fn tokenizer(
    tokens: &[String],
    merges: Vec<(String, String)>,
    flavour: Flavour,
) -> tokenizers::Result<Tokenizer> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(true)
        .byte_fallback(true);
    if flavour == Flavour::Gemma {
        // GemmaTokenizer names `<unk>` whatever the file calls its unknown piece.
        bpe = bpe.unk_token("<unk>".into());
    }
    let bpe = bpe.build()?;
    let mut tok = Tokenizer::new(bpe);
    let to_space: DecoderWrapper = Replace::new(SPACE.to_string(), " ")?.into();
    let mut decoders = vec![
        to_space,
        ByteFallback::default().into(),
        Fuse::default().into(),
    ];
    match flavour {
        Flavour::Llama => {
            tok.with_pre_tokenizer(Some(Metaspace::new(SPACE, PrependScheme::First, false)));
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        Flavour::Gemma => {
            tok.with_normalizer(Some(Replace::new(" ", SPACE.to_string())?))?;
            let split = Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false)?;
            tok.with_pre_tokenizer(Some(split));
        }
    }
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn merges_follow_the_best_piece_then_the_longer_parts() {
        let t = strings(&["a", "b", "c", "ab", "bc", "abc", "▁", "▁a"]);
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, 0.0, -1.0];
        let m = merges(&t, &scores);
        let pairs: Vec<(&str, &str)> = m.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        // ab and ▁a tie at -1: file order. abc splits as a+bc and ab+c: the longer left first.
        assert_eq!(
            pairs,
            [("a", "b"), ("▁", "a"), ("b", "c"), ("ab", "c"), ("a", "bc")]
        );
    }

    #[test]
    fn gemma_ranks_by_position_and_respells_spaces() {
        let t = spelled(&["a", "  ", "b", " x"], Flavour::Gemma);
        assert_eq!(t, strings(&["a", "▁▁", "b", " x"]));
        assert_eq!(ranks(&[5.0, -1.0, 7.0], Flavour::Gemma), [0.0, -1.0, -2.0]);
        assert_eq!(spelled(&["  "], Flavour::Llama), strings(&["  "]));
    }

    #[test]
    fn text_round_trips_through_pieces_and_bytes() {
        let mut t = strings(&["<unk>", "▁", "h", "i", "▁h", "▁hi"]);
        t.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        let ranks: Vec<f32> = (0..t.len()).map(|i| -(i as f32)).collect();
        let tok = tokenizer(&t, merges(&t, &ranks), Flavour::Llama).unwrap();
        let enc = tok.encode("hi hé", false).unwrap();
        let pieces: Vec<&str> = enc.get_tokens().iter().map(String::as_str).collect();
        // é is not a piece: its two UTF-8 bytes.
        assert_eq!(pieces, ["▁hi", "▁h", "<0xC3>", "<0xA9>"]);
        assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), "hi hé");
    }
}
