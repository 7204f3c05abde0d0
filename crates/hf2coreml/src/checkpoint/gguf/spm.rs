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
            let respell = flavour == Flavour::Gemma && t.contains(' ') && t.chars().all(py_space);
            match respell {
                true => SPACE.to_string().repeat(t.chars().count()),
                false => t.to_string(),
            }
        })
        .collect()
}

/// Python's `str.isspace` (transformers tests `not t.strip()`): Unicode's white space and the
/// four ASCII separators U+001C..U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
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
    // Every split of every piece is looked up, so a lookup must cost O(1), not the length of
    // the part (hashing the parts of one 1 MiB piece took minutes): parts are found by their
    // polynomial hash, computed for all splits of a piece in one pass, and a hit is confirmed
    // by comparing the strings (what the merge list then holds anyway).
    let hashes = PieceHashes::new(tokens);
    let mut all: Vec<(&str, &str, f32)> = Vec::new();
    let mut prefix = Vec::new();
    for (piece, rank) in order {
        hashes.prefixes(piece, &mut prefix);
        let n = piece.len();
        let mut local: Vec<(&str, &str, f32)> = (1..n)
            .filter(|&at| piece.is_char_boundary(at))
            .map(|at| (at, prefix[at], hashes.suffix(&prefix, at, n)))
            .filter(|&(_, hl, hr)| hashes.known(hl) && hashes.known(hr))
            .map(|(at, hl, hr)| (piece.split_at(at), hl, hr))
            .filter(|&((l, r), hl, hr)| hashes.is_piece(hl, l) && hashes.is_piece(hr, r))
            .map(|((l, r), _, _)| (l, r, rank))
            .collect();
        local.sort_by_key(|(l, r, _)| (vocab[l], vocab[r]));
        all.extend(local);
    }
    // The parts' lengths in characters, counted once (not at every comparison).
    let mut keyed: Vec<(&str, &str, f32, usize, usize)> = all
        .into_iter()
        .map(|(l, r, rank)| (l, r, rank, l.chars().count(), r.chars().count()))
        .collect();
    keyed.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.3.cmp(&a.3)).then(b.4.cmp(&a.4)));
    keyed
        .into_iter()
        .map(|(l, r, ..)| (l.to_string(), r.to_string()))
        .collect()
}

/// Polynomial hashes modulo the Mersenne prime 2^61 − 1 with a base drawn per run (a fixed
/// base would let a crafted vocabulary collide on purpose; a collision costs only time, as
/// every hit is checked against the strings).
struct PieceHashes<'t> {
    base: u64,
    /// base^k for k up to the longest piece.
    powers: Vec<u64>,
    /// Each distinct piece's hash → the pieces with that hash.
    pieces: HashMap<u64, Vec<&'t str>>,
}

const MERSENNE_61: u64 = (1 << 61) - 1;

fn mul_mod(a: u64, b: u64) -> u64 {
    let p = a as u128 * b as u128;
    let r = (p & MERSENNE_61 as u128) as u64 + (p >> 61) as u64;
    if r >= MERSENNE_61 {
        r - MERSENNE_61
    } else {
        r
    }
}

fn add_mod(a: u64, b: u64) -> u64 {
    let r = a + b;
    if r >= MERSENNE_61 {
        r - MERSENNE_61
    } else {
        r
    }
}

impl<'t> PieceHashes<'t> {
    fn new(tokens: &'t [String]) -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u8(0);
        let base = 256 + h.finish() % (MERSENNE_61 - 512);
        let longest = tokens.iter().map(String::len).max().unwrap_or(0);
        let mut powers = Vec::with_capacity(longest + 1);
        powers.push(1);
        for k in 0..longest {
            powers.push(mul_mod(powers[k], base));
        }
        let mut this = PieceHashes {
            base,
            powers,
            pieces: HashMap::with_capacity(tokens.len()),
        };
        let mut prefix = Vec::new();
        for t in tokens {
            this.prefixes(t, &mut prefix);
            let list = this.pieces.entry(prefix[t.len()]).or_default();
            if !list.contains(&t.as_str()) {
                list.push(t);
            }
        }
        this
    }

    /// `out[k]` = the hash of `piece[..k]`, for k in 0..=len.
    fn prefixes(&self, piece: &str, out: &mut Vec<u64>) {
        out.clear();
        out.push(0);
        let mut h = 0;
        for &b in piece.as_bytes() {
            h = add_mod(mul_mod(h, self.base), b as u64 + 1);
            out.push(h);
        }
    }

    /// Whether some piece has this hash.
    fn known(&self, hash: u64) -> bool {
        self.pieces.contains_key(&hash)
    }

    /// Whether `part`, whose hash is `hash`, is a piece.
    fn is_piece(&self, hash: u64, part: &str) -> bool {
        self.pieces.get(&hash).is_some_and(|l| l.contains(&part))
    }

    /// The hash of `piece[at..n]` from its prefix hashes.
    fn suffix(&self, prefix: &[u64], at: usize, n: usize) -> u64 {
        let shifted = mul_mod(prefix[at], self.powers[n - at]);
        add_mod(prefix[n], MERSENNE_61 - shifted)
    }
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
