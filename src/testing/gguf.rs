//! Test fixtures: GGUF files written byte by byte from the format specification, with their
//! own block quantizers, so tests of the importer do not depend on the reader they test.
//!
//! [`GgufWriter`] writes any metadata and raw tensors (for malformed-file tests);
//! [`TinyGguf`] builds a complete small llama with a byte-level BPE tokenizer, and remembers
//! the values every tensor dequantizes to in Hugging Face layout.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};

use crate::checkpoint::gguf::weights::permute_rows;
use crate::testing::SplitMix64;

/// GGUF tensor type ids (ggml.h) used by the fixtures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FixtureType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    /// Type id without an encoder: the tensor gets `bytes_per_block` zero bytes per 32 values.
    Other {
        id: u32,
        bytes_per_block: usize,
    },
}

impl FixtureType {
    pub fn id(self) -> u32 {
        match self {
            FixtureType::F32 => 0,
            FixtureType::F16 => 1,
            FixtureType::Q4_0 => 2,
            FixtureType::Q4_1 => 3,
            FixtureType::Q8_0 => 8,
            FixtureType::BF16 => 30,
            FixtureType::Other { id, .. } => id,
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone)]
pub enum Meta {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
    U8Array(Vec<u8>),
}

impl Meta {
    fn type_id(&self) -> u32 {
        match self {
            Meta::U32(_) => 4,
            Meta::I32(_) => 5,
            Meta::F32(_) => 6,
            Meta::Bool(_) => 7,
            Meta::Str(_) => 8,
            Meta::StrArray(_) | Meta::I32Array(_) | Meta::U8Array(_) => 9,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Meta::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Meta::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Meta::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Meta::Bool(v) => out.push(u8::from(*v)),
            Meta::Str(s) => put_str(out, s),
            Meta::StrArray(items) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for s in items {
                    put_str(out, s);
                }
            }
            Meta::U8Array(items) => {
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                out.extend_from_slice(items);
            }
            Meta::I32Array(items) => {
                out.extend_from_slice(&5u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for v in items {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A raw tensor: row-major shape (written fastest-first, as GGUF lists dims) and its bytes.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub name: String,
    pub type_id: u32,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A GGUF v3 file in memory.
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    pub metadata: Vec<(String, Meta)>,
    pub tensors: Vec<RawTensor>,
}

/// GGUF's default data alignment.
const ALIGNMENT: usize = 32;

impl GgufWriter {
    pub fn meta(&mut self, key: &str, value: Meta) -> &mut Self {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_string(), value));
        self
    }

    pub fn remove_meta(&mut self, key: &str) -> &mut Self {
        self.metadata.retain(|(k, _)| k != key);
        self
    }

    pub fn tensor(&mut self, t: RawTensor) -> &mut Self {
        self.tensors.retain(|x| x.name != t.name);
        self.tensors.push(t);
        self
    }

    /// The file's bytes: header, metadata, tensor infos, padding, 32-aligned tensor data.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            v.write(&mut out);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in t.shape.iter().rev() {
                out.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += t.data.len().div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        }
        out
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

/// Encode `values` (row-major, a multiple of 32 for block types) as `ty`. Returns the bytes
/// and the values they decode to by the formulas of ggml's reference dequantizers.
pub fn encode(values: &[f32], ty: FixtureType) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut decoded = Vec::with_capacity(values.len());
    match ty {
        FixtureType::F32 => {
            for v in values {
                bytes.extend_from_slice(&v.to_le_bytes());
                decoded.push(*v);
            }
        }
        FixtureType::F16 => {
            for v in values {
                let h = f16::from_f32(*v);
                bytes.extend_from_slice(&h.to_le_bytes());
                decoded.push(h.to_f32());
            }
        }
        FixtureType::BF16 => {
            for v in values {
                let h = bf16::from_f32(*v);
                bytes.extend_from_slice(&h.to_le_bytes());
                decoded.push(h.to_f32());
            }
        }
        FixtureType::Q8_0 => {
            for block in values.chunks(32) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let inv = if d.to_f32() == 0.0 {
                    0.0
                } else {
                    1.0 / d.to_f32()
                };
                bytes.extend_from_slice(&d.to_le_bytes());
                for v in block {
                    let q = (v * inv).round().clamp(-127.0, 127.0) as i8;
                    bytes.push(q as u8);
                    decoded.push(d.to_f32() * q as f32);
                }
            }
        }
        FixtureType::Q4_0 => {
            for block in values.chunks(32) {
                // ggml: the scale maps the value of largest magnitude to -8.
                let max = block
                    .iter()
                    .copied()
                    .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                let d = f16::from_f32(max / -8.0);
                let inv = if d.to_f32() == 0.0 {
                    0.0
                } else {
                    1.0 / d.to_f32()
                };
                let q: Vec<u8> = block
                    .iter()
                    .map(|v| ((v * inv + 8.5).floor()).clamp(0.0, 15.0) as u8)
                    .collect();
                bytes.extend_from_slice(&d.to_le_bytes());
                for i in 0..16 {
                    bytes.push(q[i] | (q[i + 16] << 4));
                }
                decoded.extend(q.iter().map(|&q| (q as f32 - 8.0) * d.to_f32()));
            }
        }
        FixtureType::Q4_1 => {
            for block in values.chunks(32) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = f16::from_f32((max - min) / 15.0);
                let m = f16::from_f32(min);
                let inv = if d.to_f32() == 0.0 {
                    0.0
                } else {
                    1.0 / d.to_f32()
                };
                let q: Vec<u8> = block
                    .iter()
                    .map(|v| ((v - m.to_f32()) * inv).round().clamp(0.0, 15.0) as u8)
                    .collect();
                bytes.extend_from_slice(&d.to_le_bytes());
                bytes.extend_from_slice(&m.to_le_bytes());
                // Low nibbles hold elements 0..15, high nibbles 16..31.
                for i in 0..16 {
                    bytes.push(q[i] | (q[i + 16] << 4));
                }
                decoded.extend(q.iter().map(|&q| q as f32 * d.to_f32() + m.to_f32()));
            }
        }
        FixtureType::Other {
            bytes_per_block, ..
        } => {
            bytes = vec![0u8; values.len().div_ceil(32) * bytes_per_block];
            decoded = vec![0.0; values.len()];
        }
    }
    (bytes, decoded)
}

/// A small llama GGUF with a byte-level BPE tokenizer, like llama.cpp's converter writes.
#[derive(Debug, Clone)]
pub struct TinyGguf {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub tied: bool,
    /// Type of the 2-D projection tensors.
    pub matrix_type: FixtureType,
    /// Type of the token embedding.
    pub embedding_type: FixtureType,
    /// Type of the norm weights.
    pub norm_type: FixtureType,
    pub pre: String,
    pub seed: u64,
}

/// The byte-level BPE vocabulary of [`TinyGguf`]: three control tokens, the 256 byte symbols,
/// then one token per merge.
pub const TINY_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const TINY_MERGES: [(&str, &str); 6] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("1", "2"),
];

/// GPT-2's byte → printable character table (bytes that are printable map to themselves,
/// the rest to U+0100 upwards in byte order).
pub fn byte_to_char() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                let c = char::from_u32(next).unwrap_or('?');
                next += 1;
                c
            }
        })
        .collect()
}

/// A built fixture: the file and the Hugging Face tensors it should import as.
#[derive(Debug, Clone)]
pub struct BuiltGguf {
    pub writer: GgufWriter,
    /// HF name → (shape, dequantized values in HF layout).
    pub expected: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    pub tokens: Vec<String>,
}

impl TinyGguf {
    /// Two layers, GQA, tied embeddings, Q4_1 projections, Q8_0 embedding, F32 norms
    /// (the real SmolLM2 file's mix), `smollm` pre-tokenizer.
    pub fn llama() -> Self {
        TinyGguf {
            layers: 2,
            hidden: 64,
            intermediate: 96,
            heads: 4,
            kv_heads: 2,
            tied: true,
            matrix_type: FixtureType::Q4_1,
            embedding_type: FixtureType::Q8_0,
            norm_type: FixtureType::F32,
            pre: "smollm".into(),
            seed: 7,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    pub fn tokens(&self) -> Vec<String> {
        let mut tokens: Vec<String> = TINY_SPECIALS.iter().map(|s| s.to_string()).collect();
        tokens.extend(byte_to_char().into_iter().map(String::from));
        tokens.extend(TINY_MERGES.iter().map(|(a, b)| format!("{a}{b}")));
        tokens
    }

    pub fn build(&self) -> BuiltGguf {
        let mut rng = SplitMix64(self.seed);
        let tokens = self.tokens();
        let vocab = tokens.len();
        let hd = self.head_dim();
        let (h, f) = (self.hidden, self.intermediate);
        let q = self.heads * hd;
        let kv = self.kv_heads * hd;
        let mut w = GgufWriter::default();
        w.meta("general.architecture", Meta::Str("llama".into()))
            .meta("general.name", Meta::Str("tiny".into()))
            .meta("llama.block_count", Meta::U32(self.layers as u32))
            .meta("llama.context_length", Meta::U32(256))
            .meta("llama.embedding_length", Meta::U32(h as u32))
            .meta("llama.feed_forward_length", Meta::U32(f as u32))
            .meta("llama.attention.head_count", Meta::U32(self.heads as u32))
            .meta("llama.attention.head_count_kv", Meta::U32(self.kv_heads as u32))
            .meta("llama.rope.freq_base", Meta::F32(100_000.0))
            .meta("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5))
            .meta("llama.vocab_size", Meta::U32(vocab as u32))
            .meta("llama.rope.dimension_count", Meta::U32(hd as u32))
            .meta("tokenizer.ggml.model", Meta::Str("gpt2".into()))
            .meta("tokenizer.ggml.pre", Meta::Str(self.pre.clone()))
            .meta("tokenizer.ggml.tokens", Meta::StrArray(tokens.clone()))
            .meta(
                "tokenizer.ggml.token_type",
                Meta::I32Array(
                    (0..vocab)
                        .map(|i| if i < TINY_SPECIALS.len() { 3 } else { 1 })
                        .collect(),
                ),
            )
            .meta(
                "tokenizer.ggml.merges",
                Meta::StrArray(TINY_MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect()),
            )
            .meta("tokenizer.ggml.bos_token_id", Meta::U32(1))
            .meta("tokenizer.ggml.eos_token_id", Meta::U32(2))
            .meta("tokenizer.ggml.unknown_token_id", Meta::U32(0))
            .meta("tokenizer.ggml.padding_token_id", Meta::U32(2))
            .meta("tokenizer.ggml.add_bos_token", Meta::Bool(false))
            .meta(
                "tokenizer.chat_template",
                Meta::Str("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}".into()),
            );
        let mut expected = BTreeMap::new();
        let mut add = |gguf: String,
                       shape: Vec<usize>,
                       ty: FixtureType,
                       permute: Option<usize>,
                       scale: f32| {
            let n: usize = shape.iter().product();
            let hf_values: Vec<f32> = (0..n)
                .map(|_| scale * (2.0 * rng.uniform() - 1.0))
                .collect();
            // llama.cpp's converter permutes q/k rows before writing; the importer must undo it.
            let stored = match permute {
                Some(heads) => permute_rows(&hf_values, shape[0], shape[1], heads),
                None => hf_values,
            };
            let (data, decoded) = encode(&stored, ty);
            let decoded_hf = match permute {
                Some(heads) => crate::checkpoint::gguf::weights::unpermute_rows(
                    &decoded, shape[0], shape[1], heads,
                ),
                None => decoded,
            };
            let hf = crate::checkpoint::gguf::weights::hf_tensor_name(&gguf).unwrap_or_default();
            expected.insert(hf, (shape.clone(), decoded_hf));
            w.tensor(RawTensor {
                name: gguf,
                type_id: ty.id(),
                shape,
                data,
            });
        };
        add(
            "token_embd.weight".into(),
            vec![vocab, h],
            self.embedding_type,
            None,
            0.5,
        );
        for l in 0..self.layers {
            let b = |p: &str| format!("blk.{l}.{p}.weight");
            add(b("attn_norm"), vec![h], self.norm_type, None, 2.0);
            add(
                b("attn_q"),
                vec![q, h],
                self.matrix_type,
                Some(self.heads),
                0.2,
            );
            add(
                b("attn_k"),
                vec![kv, h],
                self.matrix_type,
                Some(self.kv_heads),
                0.2,
            );
            add(b("attn_v"), vec![kv, h], self.matrix_type, None, 0.2);
            add(b("attn_output"), vec![h, q], self.matrix_type, None, 0.2);
            add(b("ffn_norm"), vec![h], self.norm_type, None, 2.0);
            add(b("ffn_gate"), vec![f, h], self.matrix_type, None, 0.2);
            add(b("ffn_up"), vec![f, h], self.matrix_type, None, 0.2);
            add(b("ffn_down"), vec![h, f], self.matrix_type, None, 0.2);
        }
        add(
            "output_norm.weight".into(),
            vec![h],
            self.norm_type,
            None,
            2.0,
        );
        if !self.tied {
            add(
                "output.weight".into(),
                vec![vocab, h],
                self.matrix_type,
                None,
                0.5,
            );
        }
        BuiltGguf {
            writer: w,
            expected,
            tokens,
        }
    }
}
