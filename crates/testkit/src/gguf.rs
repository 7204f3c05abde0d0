//! Test fixtures: GGUF files written byte by byte from the format specification, with their
//! own block quantizers, so tests of the importer do not depend on the reader they test.
//!
//! [`GgufWriter`] writes any metadata and raw tensors (for malformed-file tests);
//! [`TinyGguf`] builds a complete small llama with a byte-level BPE tokenizer, and remembers
//! the values every tensor dequantizes to in Hugging Face layout.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};

use crate::SplitMix64;
use hf2coreml::checkpoint::gguf::tensor_map::permute_rows;

/// GGUF tensor type ids (ggml.h) used by the fixtures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FixtureType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q4K,
    Q6K,
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
            FixtureType::Q5_0 => 6,
            FixtureType::Q4K => 12,
            FixtureType::Q6K => 14,
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
    /// An array of strings written as these bytes, UTF-8 or not (a damaged file).
    BytesArray(Vec<Vec<u8>>),
    /// Any value as the reader parsed it (copying another file's metadata).
    Value(candle_core::quantized::gguf_file::Value),
}

impl Meta {
    fn type_id(&self) -> u32 {
        match self {
            Meta::U32(_) => 4,
            Meta::I32(_) => 5,
            Meta::F32(_) => 6,
            Meta::Bool(_) => 7,
            Meta::Str(_) => 8,
            Meta::StrArray(_) | Meta::I32Array(_) | Meta::U8Array(_) | Meta::BytesArray(_) => 9,
            Meta::Value(v) => value_type(v),
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
            Meta::BytesArray(items) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for b in items {
                    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
                    out.extend_from_slice(b);
                }
            }
            Meta::U8Array(items) => {
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                out.extend_from_slice(items);
            }
            Meta::Value(v) => write_value(v, out),
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

fn value_type(v: &candle_core::quantized::gguf_file::Value) -> u32 {
    use candle_core::quantized::gguf_file::Value as V;
    match v {
        V::U8(_) => 0,
        V::I8(_) => 1,
        V::U16(_) => 2,
        V::I16(_) => 3,
        V::U32(_) => 4,
        V::I32(_) => 5,
        V::F32(_) => 6,
        V::Bool(_) => 7,
        V::String(_) => 8,
        V::Array(_) => 9,
        V::U64(_) => 10,
        V::I64(_) => 11,
        V::F64(_) => 12,
    }
}

fn write_value(v: &candle_core::quantized::gguf_file::Value, out: &mut Vec<u8>) {
    use candle_core::quantized::gguf_file::Value as V;
    match v {
        V::U8(x) => out.push(*x),
        V::I8(x) => out.push(*x as u8),
        V::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::Bool(x) => out.push(u8::from(*x)),
        V::String(s) => put_str(out, s),
        V::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        V::Array(items) => {
            let elem = items.first().map_or(0, value_type);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                write_value(i, out);
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
    /// Declare every tensor at this data offset (a crafted file whose tensors overlap).
    pub same_offset: Option<u64>,
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
            let declared = self.same_offset.unwrap_or(offset as u64);
            out.extend_from_slice(&declared.to_le_bytes());
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
        FixtureType::Q5_0 => {
            for block in values.chunks(32) {
                encode_q5_0(block, &mut bytes, &mut decoded);
            }
        }
        FixtureType::Q4K => {
            for block in values.chunks(256) {
                encode_q4_k(block, &mut bytes, &mut decoded);
            }
        }
        FixtureType::Q6K => {
            for block in values.chunks(256) {
                encode_q6_k(block, &mut bytes, &mut decoded);
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

/// 1/x, 0 for 0.
fn inverse(x: f32) -> f32 {
    if x == 0.0 {
        0.0
    } else {
        1.0 / x
    }
}

/// Q5_0: the value of largest magnitude maps to -16; 5-bit values offset by 16.
fn encode_q5_0(block: &[f32], bytes: &mut Vec<u8>, decoded: &mut Vec<f32>) {
    let max = block
        .iter()
        .copied()
        .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let d = f16::from_f32(max / -16.0);
    let inv = inverse(d.to_f32());
    let q: Vec<u8> = block
        .iter()
        .map(|v| (v * inv + 16.5).floor().clamp(0.0, 31.0) as u8)
        .collect();
    let mut qh = 0u32;
    for (j, &v) in q.iter().enumerate() {
        qh |= u32::from(v >> 4) << j;
    }
    bytes.extend_from_slice(&d.to_le_bytes());
    bytes.extend_from_slice(&qh.to_le_bytes());
    for i in 0..16 {
        bytes.push((q[i] & 0x0F) | ((q[i + 16] & 0x0F) << 4));
    }
    decoded.extend(q.iter().map(|&v| d.to_f32() * (v as i8 - 16) as f32));
}

/// A 6-bit code for `x` of at most 63 (`round(x / step)`), and its value.
fn code6(x: f32, step: f32) -> u8 {
    (x * inverse(step)).round().clamp(0.0, 63.0) as u8
}

/// Q4_K: 8 sub-blocks of 32, each `d·sc·q − dmin·m` with 6-bit sc and m packed as ggml's
/// `get_scale_min_k4` reads them, 4-bit q.
fn encode_q4_k(block: &[f32], bytes: &mut Vec<u8>, decoded: &mut Vec<f32>) {
    let subs: Vec<&[f32]> = block.chunks(32).collect();
    // Each sub-block spans [−m, −m + 15·s] with m ≥ 0.
    let mins: Vec<f32> = subs
        .iter()
        .map(|s| -s.iter().copied().fold(0f32, f32::min))
        .collect();
    let steps: Vec<f32> = subs
        .iter()
        .zip(&mins)
        .map(|(s, m)| (s.iter().copied().fold(f32::MIN, f32::max) + m) / 15.0)
        .collect();
    let d = f16::from_f32(steps.iter().copied().fold(0f32, f32::max) / 63.0);
    let dmin = f16::from_f32(mins.iter().copied().fold(0f32, f32::max) / 63.0);
    let sc: Vec<u8> = steps.iter().map(|s| code6(*s, d.to_f32())).collect();
    let m: Vec<u8> = mins.iter().map(|v| code6(*v, dmin.to_f32())).collect();
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    let mut q = [0u8; 256];
    for (e, x) in block.iter().enumerate() {
        let j = e / 32;
        let dl = d.to_f32() * sc[j] as f32;
        let ml = dmin.to_f32() * m[j] as f32;
        q[e] = ((x + ml) * inverse(dl)).round().clamp(0.0, 15.0) as u8;
        decoded.push(dl * q[e] as f32 - ml);
    }
    bytes.extend_from_slice(&d.to_le_bytes());
    bytes.extend_from_slice(&dmin.to_le_bytes());
    bytes.extend_from_slice(&scales);
    // Element 64c + 32h + l is nibble h of byte 32c + l.
    for c in 0..4 {
        for l in 0..32 {
            bytes.push(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
        }
    }
}

/// Q6_K: 16 sub-blocks of 16, each `d·sc·(q − 32)` with int8 sc and 6-bit q.
fn encode_q6_k(block: &[f32], bytes: &mut Vec<u8>, decoded: &mut Vec<f32>) {
    let amax: Vec<f32> = block
        .chunks(16)
        .map(|s| s.iter().fold(0f32, |m, v| m.max(v.abs())) / 31.0)
        .collect();
    let d = f16::from_f32(amax.iter().copied().fold(0f32, f32::max) / 127.0);
    let sc: Vec<i8> = amax
        .iter()
        .map(|a| (a * inverse(d.to_f32())).round().clamp(0.0, 127.0) as i8)
        .collect();
    let mut q = [0u8; 256];
    for (e, x) in block.iter().enumerate() {
        let dl = d.to_f32() * sc[e / 16] as f32;
        let v = (x * inverse(dl)).round().clamp(-32.0, 31.0) as i8;
        q[e] = (v + 32) as u8;
        decoded.push(dl * v as f32);
    }
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for (e, &v) in q.iter().enumerate() {
        let (h, i) = (e / 128, e % 128);
        ql[64 * h + i % 64] |= (v & 0x0F) << (4 * (i / 64));
        qh[32 * h + i % 32] |= (v >> 4) << (2 * (i / 32));
    }
    bytes.extend_from_slice(&ql);
    bytes.extend_from_slice(&qh);
    bytes.extend(sc.iter().map(|&s| s as u8));
    bytes.extend_from_slice(&d.to_le_bytes());
}

/// llama.cpp's `Q4_K_M` choice for a tensor (`llama-quant.cpp`): q6_K for `output`, for
/// `attn_v`/`ffn_down` in the layers `use_more_bits` picks and for `attn_qkv` (q5_K there),
/// q4_K for the other matrices,
/// f32 for vectors; rows not a multiple of 256 fall back (q4_K → q5_0, q6_K → q8_0).
pub fn q4_k_m_type(
    gguf_name: &str,
    shape: &[usize],
    layer: Option<usize>,
    layers: usize,
) -> FixtureType {
    // llama.cpp keeps the convolutions' taps (a few per channel) in f32.
    if shape.len() < 2 || gguf_name.contains("ssm_conv1d") || gguf_name.contains("shortconv.conv") {
        return FixtureType::F32;
    }
    let more_bits = |i: usize| i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2;
    // llama.cpp gives Phi-3's fused attn_qkv q5_K; the fixtures have no q5_K encoder, so it
    // takes the wider type here too.
    let wide = gguf_name == "output.weight"
        || gguf_name.contains("attn_qkv")
        || ((gguf_name.contains("attn_v") || gguf_name.contains("ffn_down"))
            && layer.is_some_and(more_bits));
    let row = shape[shape.len() - 1];
    match (wide, row.is_multiple_of(256)) {
        (true, true) => FixtureType::Q6K,
        (true, false) => FixtureType::Q8_0,
        (false, true) => FixtureType::Q4K,
        (false, false) => FixtureType::Q5_0,
    }
}

/// The tokenizer metadata of the fixtures: gpt2-style BPE over [`TinyGguf::tokens`] (without
/// `merges`, a prefix of them: their merges' results are not in it).
fn tokenizer_meta(w: &mut GgufWriter, pre: &str, tokens: &[String], merges: bool) {
    let vocab = tokens.len();
    w            .meta("tokenizer.ggml.model", Meta::Str("gpt2".into()))
            .meta("tokenizer.ggml.pre", Meta::Str(pre.into()))
            .meta("tokenizer.ggml.tokens", Meta::StrArray(tokens.to_vec()))
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
                Meta::StrArray(
                    TINY_MERGES
                        .iter()
                        .filter(|_| merges)
                        .map(|(a, b)| format!("{a} {b}"))
                        .collect(),
                ),
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
            .meta(
                "llama.attention.head_count_kv",
                Meta::U32(self.kv_heads as u32),
            )
            .meta("llama.rope.freq_base", Meta::F32(100_000.0))
            .meta("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5))
            .meta("llama.vocab_size", Meta::U32(vocab as u32))
            .meta("llama.rope.dimension_count", Meta::U32(hd as u32));
        tokenizer_meta(&mut w, &self.pre, &tokens, true);
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
                Some(heads) => hf2coreml::checkpoint::gguf::tensor_map::unpermute_rows(
                    &decoded, shape[0], shape[1], heads,
                ),
                None => decoded,
            };
            let hf =
                hf2coreml::checkpoint::gguf::tensor_map::hf_tensor_name(&gguf).unwrap_or_default();
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

/// A GGUF of an existing checkpoint as llama.cpp's converter and quantizer would write it:
/// `{arch}.*` metadata, the fixtures' tokenizer ([`TinyGguf::tokens`]; a smaller vocabulary
/// takes its first tokens and no merges), q/k rows permuted for `llama` and `smollm3`, Phi-3's
/// q/k/v and gate/up fused (`attn_qkv`, `ffn_up`), its partial rotary dimensions and LongRoPE
/// factors as `Phi3MiniModel` writes them, and each tensor in the type
/// `layout(gguf name, shape, layer, layers)` picks (e.g. [`q4_k_m_type`]).
pub fn from_checkpoint(
    ckpt: &hf2coreml::checkpoint::Checkpoint,
    layout: impl Fn(&str, &[usize], Option<usize>, usize) -> FixtureType,
) -> BuiltGguf {
    use hf2coreml::arch::{Architecture, LayerTensor, TensorId};
    let spec = ckpt.spec().clone();
    let arch = match spec.architecture {
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
        Architecture::Gemma3 => "gemma3",
        Architecture::Phi3 => "phi3",
        Architecture::SmolLM3 => "smollm3",
        Architecture::Lfm2 => "lfm2",
        Architecture::Qwen3_5 => "qwen35",
        _ => "llama",
    };
    let gemma = arch == "gemma3";
    let phi3 = arch == "phi3";
    let mut tokens = TinyGguf::llama().tokens();
    let merges = tokens.len() <= spec.vocab_size;
    tokens.truncate(spec.vocab_size);
    let mut w = GgufWriter::default();
    architecture_meta(&mut w, &spec, arch);
    // Qwen3's vocabulary is Qwen2's: llama.cpp names its pre-tokenizer `qwen2`.
    let pre = match arch {
        "llama" => "llama-bpe",
        "lfm2" | "qwen35" => arch,
        _ => "qwen2",
    };
    tokenizer_meta(&mut w, pre, &tokens, merges);
    let mut expected = BTreeMap::new();
    let layers = spec.num_hidden_layers;
    let rows_of = |id: TensorId| {
        let t = ckpt.tensor(&id.hf_name()).expect("checkpoint tensor");
        (t.shape.to_vec(), t.to_f32())
    };
    for id in hf2coreml::arch::tensor_ids(&spec) {
        let hf = id.hf_name();
        // Phi-3's fused tensors: q/k/v (gate/up) rows stacked in one, written at q (gate).
        let parts = match id {
            TensorId::Layer(_, LayerTensor::K | LayerTensor::V | LayerTensor::Up) if phi3 => {
                continue
            }
            TensorId::Layer(l, LayerTensor::Q) if phi3 => Some((
                format!("blk.{l}.attn_qkv.weight"),
                vec![LayerTensor::Q, LayerTensor::K, LayerTensor::V],
                l,
            )),
            TensorId::Layer(l, LayerTensor::Gate) if phi3 => Some((
                format!("blk.{l}.ffn_up.weight"),
                vec![LayerTensor::Gate, LayerTensor::Up],
                l,
            )),
            _ => None,
        };
        if let Some((gguf, parts, l)) = parts {
            let stacked: Vec<(Vec<usize>, Vec<f32>)> = parts
                .iter()
                .map(|&t| rows_of(TensorId::Layer(l, t)))
                .collect();
            let cols = stacked[0].0[1];
            let shape = vec![stacked.iter().map(|(s, _)| s[0]).sum(), cols];
            let values: Vec<f32> = stacked.iter().flat_map(|(_, v)| v.clone()).collect();
            let ty = layout(&gguf, &shape, Some(l), layers);
            let (data, decoded) = encode(&values, ty);
            let mut at = 0;
            for (&t, (s, _)) in parts.iter().zip(&stacked) {
                let n = s[0] * s[1];
                let part = decoded[at..at + n].to_vec();
                expected.insert(TensorId::Layer(l, t).hf_name(), (s.clone(), part));
                at += n;
            }
            w.tensor(RawTensor {
                name: gguf,
                type_id: ty.id(),
                shape,
                data,
            });
            continue;
        }
        if matches!(arch, "lfm2" | "qwen35") {
            let (tensor, decoded_hf) = hybrid_tensor(ckpt, id, &layout);
            expected.insert(hf, (id.shape(&spec), decoded_hf));
            w.tensor(tensor);
            continue;
        }
        let t = ckpt.tensor(&hf).expect("checkpoint tensor");
        let shape = t.shape.to_vec();
        let values = t.to_f32();
        let gguf = hf2coreml::checkpoint::gguf::tensor_map::gguf_name(id, gemma);
        let heads = match id {
            TensorId::Layer(_, LayerTensor::Q) => Some(spec.num_attention_heads),
            TensorId::Layer(_, LayerTensor::K) => Some(spec.num_key_value_heads),
            _ => None,
        }
        .filter(|_| matches!(arch, "llama" | "smollm3"));
        let mut stored = match heads {
            Some(h) => permute_rows(&values, shape[0], shape[1], h),
            None => values,
        };
        // Gemma's converter stores every norm as 1 + w.
        let shifted = gemma && id.role() == hf2coreml::arch::Role::Norm;
        if shifted {
            stored.iter_mut().for_each(|v| *v += 1.0);
        }
        let ty = layout(&gguf, &shape, id.layer(), layers);
        let (data, decoded) = encode(&stored, ty);
        let mut decoded_hf = match heads {
            Some(h) => hf2coreml::checkpoint::gguf::tensor_map::unpermute_rows(
                &decoded, shape[0], shape[1], h,
            ),
            None => decoded,
        };
        if shifted {
            decoded_hf.iter_mut().for_each(|v| *v -= 1.0);
        }
        expected.insert(hf, (shape.clone(), decoded_hf));
        w.tensor(RawTensor {
            name: gguf,
            type_id: ty.id(),
            shape,
            data,
        });
    }
    BuiltGguf {
        writer: w,
        expected,
        tokens,
    }
}

/// Tensor `id` of a hybrid checkpoint as llama.cpp's converter writes it for `lfm2` and
/// `qwen35` (the importer's plan, run forwards: tiled value heads, −exp(A_log), norms + 1, taps
/// squeezed), in the type `layout` picks, and what it decodes to in the Hugging Face layout.
fn hybrid_tensor(
    ckpt: &hf2coreml::checkpoint::Checkpoint,
    id: hf2coreml::arch::TensorId,
    layout: &impl Fn(&str, &[usize], Option<usize>, usize) -> FixtureType,
) -> (RawTensor, Vec<f32>) {
    let spec = ckpt.spec();
    let plan = hf2coreml::checkpoint::gguf::hybrid::expected_one(id, spec);
    let mut stored = ckpt
        .tensor(&id.hf_name())
        .expect("checkpoint tensor")
        .to_f32();
    let shape = plan.gguf_shape();
    let (rows, cols) = (shape[0], shape[1..].iter().product::<usize>());
    if let Some(t) = plan.tiled_heads {
        stored = t.tile(&stored, rows, cols);
    }
    if plan.negated_exp {
        stored.iter_mut().for_each(|v| *v = -v.exp());
    }
    if plan.minus_one {
        stored.iter_mut().for_each(|v| *v += 1.0);
    }
    let ty = layout(&plan.gguf_name, &shape, id.layer(), spec.num_hidden_layers);
    let (data, mut decoded) = encode(&stored, ty);
    if plan.minus_one {
        decoded.iter_mut().for_each(|v| *v -= 1.0);
    }
    if plan.negated_exp {
        decoded.iter_mut().for_each(|v| *v = (-*v).ln());
    }
    if let Some(t) = plan.tiled_heads {
        decoded = t.untile(&decoded, rows, cols);
    }
    let tensor = RawTensor {
        name: plan.gguf_name,
        type_id: ty.id(),
        shape,
        data,
    };
    (tensor, decoded)
}

/// The `{arch}.*` keys llama.cpp's converter writes for `spec` (and Phi-3's LongRoPE factor
/// tensors).
fn architecture_meta(w: &mut GgufWriter, spec: &hf2coreml::arch::ModelSpec, arch: &str) {
    let phi3 = arch == "phi3";
    let key = |k: &str| format!("{arch}.{k}");
    let u = |v: usize| Meta::U32(v as u32);
    w.meta("general.architecture", Meta::Str(arch.into()))
        .meta(&key("block_count"), u(spec.num_hidden_layers))
        .meta(&key("context_length"), u(spec.max_position_embeddings))
        .meta(&key("embedding_length"), u(spec.hidden_size))
        .meta(&key("feed_forward_length"), u(spec.intermediate_size))
        .meta(&key("attention.head_count"), u(spec.num_attention_heads))
        .meta(&key("attention.head_count_kv"), u(spec.num_key_value_heads))
        .meta(&key("rope.freq_base"), Meta::F32(spec.rope_theta as f32))
        .meta(
            &key("attention.layer_norm_rms_epsilon"),
            Meta::F32(spec.rms_norm_eps as f32),
        );
    // llama.cpp writes the key/value lengths whenever config.json names a head_dim (Qwen3's
    // always does).
    if matches!(arch, "qwen3" | "gemma3" | "qwen35")
        || spec.head_dim * spec.num_attention_heads != spec.hidden_size
    {
        w.meta(&key("attention.key_length"), u(spec.head_dim))
            .meta(&key("attention.value_length"), u(spec.head_dim));
    }
    if let Some(window) = spec.gemma.as_ref().and(spec.sliding_window) {
        w.meta(&key("attention.sliding_window"), u(window));
    }
    if matches!(arch, "phi3" | "smollm3") {
        w.meta(&key("rope.dimension_count"), u(spec.rotary_dim()));
    }
    if arch == "smollm3" {
        let every_fourth: Vec<usize> = (3..spec.num_hidden_layers).step_by(4).collect();
        assert_eq!(
            spec.no_rope_layers, every_fourth,
            "a smollm3 GGUF holds no NoPE key: llama.cpp fixes every fourth block"
        );
    }
    hybrid_meta(w, spec, arch);
    if phi3 {
        // Phi-4 is told apart by a window of 0.
        w.meta(
            &key("attention.sliding_window"),
            u(spec.sliding_window.unwrap_or(0)),
        );
    }
    if let hf2coreml::arch::RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_position_embeddings,
        attention_factor,
    } = &spec.rope_scaling
    {
        w.meta(
            &key("rope.scaling.original_context_length"),
            u(*original_max_position_embeddings),
        )
        .meta(
            &key("rope.scaling.attn_factor"),
            Meta::F32(*attention_factor as f32),
        );
        for (name, f) in [
            ("rope_factors_long.weight", long_factor),
            ("rope_factors_short.weight", short_factor),
        ] {
            let values: Vec<f32> = f.iter().map(|&x| x as f32).collect();
            let (data, _) = encode(&values, FixtureType::F32);
            w.tensor(RawTensor {
                name: name.into(),
                type_id: FixtureType::F32.id(),
                shape: vec![values.len()],
                data,
            });
        }
    }
}

/// The keys `LFM2Model` and `Qwen3_5TextModel` write beyond the shared ones: LFM2's per-block
/// KV heads (0 for a convolution) and taps; Qwen3.5's RoPE dimensions and sections, DeltaNet
/// sizes (`ssm.*`) and the attention interval (always 4: transformers' config.json does not
/// keep `full_attention_interval`).
fn hybrid_meta(w: &mut GgufWriter, spec: &hf2coreml::arch::ModelSpec, arch: &str) {
    let key = |k: &str| format!("{arch}.{k}");
    let u = |v: usize| Meta::U32(v as u32);
    if let Some(conv) = spec.short_conv.as_ref().filter(|_| arch == "lfm2") {
        let kv: Vec<i32> = (0..spec.num_hidden_layers)
            .map(|l| match conv.layers.contains(&l) {
                true => 0,
                false => spec.num_key_value_heads as i32,
            })
            .collect();
        w.meta(&key("attention.head_count_kv"), Meta::I32Array(kv))
            .meta(&key("vocab_size"), u(spec.vocab_size))
            .meta(&key("shortconv.l_cache"), u(conv.kernel));
    }
    if let Some(g) = spec.gated_delta.as_ref().filter(|_| arch == "qwen35") {
        let rot = spec.rotary_dim();
        let mut sections: Vec<i32> = crate::mrope_section(rot / 2)
            .into_iter()
            .map(|n| n as i32)
            .collect();
        sections.push(0);
        w.meta(&key("rope.dimension_count"), u(rot))
            .meta(&key("rope.dimension_sections"), Meta::I32Array(sections))
            .meta(&key("ssm.conv_kernel"), u(g.kernel))
            .meta(&key("ssm.state_size"), u(g.key_dim))
            .meta(&key("ssm.group_count"), u(g.key_heads))
            .meta(&key("ssm.time_step_rank"), u(g.value_heads))
            .meta(&key("ssm.inner_size"), u(g.value_width()))
            .meta(&key("full_attention_interval"), u(4));
    }
}

/// `src` re-quantized tensor by tensor: every metadata entry copied, each tensor dequantized
/// and encoded as `layout(name, shape, layer, layers)` picks (vectors stay as they are stored
/// when `layout` says F32). For measuring what a K-quant source costs (docs/quality.md).
pub fn requantize(
    src: &mut hf2coreml::checkpoint::gguf::GgufFile,
    layout: impl Fn(&str, &[usize], Option<usize>, usize) -> FixtureType,
) -> Result<GgufWriter, hf2coreml::checkpoint::gguf::GgufError> {
    let mut w = GgufWriter::default();
    let mut keys: Vec<&String> = src.metadata().keys().collect();
    keys.sort();
    for k in keys {
        w.meta(k, Meta::Value(src.metadata()[k].clone()));
    }
    w.remove_meta("general.alignment");
    let arch = src
        .get_str("general.architecture")?
        .unwrap_or("llama")
        .to_string();
    let layers = src.get_uint(&format!("{arch}.block_count"))?.unwrap_or(0) as usize;
    let tensors = src.tensors().to_vec();
    for t in &tensors {
        let values = src.read_f32(t)?;
        let layer =
            hf2coreml::checkpoint::gguf::tensor_map::tensor_id(&t.name).and_then(|i| i.layer());
        let ty = layout(&t.name, &t.shape, layer, layers);
        let (data, _) = encode(&values, ty);
        w.tensor(RawTensor {
            name: t.name.clone(),
            type_id: ty.id(),
            shape: t.shape.clone(),
            data,
        });
    }
    Ok(w)
}

/// A `Q6_K`-style layout: every matrix q6_K (q8_0 where rows are not a multiple of 256),
/// vectors f32.
pub fn q6_k_type(_: &str, shape: &[usize], _: Option<usize>, _: usize) -> FixtureType {
    match shape {
        [_, row] if row % 256 == 0 => FixtureType::Q6K,
        [_, _] => FixtureType::Q8_0,
        _ => FixtureType::F32,
    }
}

/// A tiny checkpoint wide enough for 256-element K-quant rows, with an intermediate size (384)
/// that is not, so ffn_down falls back as Qwen2.5-0.5B's do; the fixtures' byte-level
/// vocabulary. Weights small and logits mildly peaked: with sharper logits, 4-bit source error
/// alone (no calibration can undo it) costs a random model KL ~1.
pub fn kquant_model(model: crate::TinyModel) -> crate::TinyModel {
    // Gemma 3's sixth block is its first global one, SmolLM3's fourth its first without RoPE;
    // LFM2's four blocks alternate convolution and attention, Qwen3.5's fourth attends.
    let layers = match model.architecture {
        hf2coreml::arch::Architecture::Gemma3 => 6,
        hf2coreml::arch::Architecture::SmolLM3
        | hf2coreml::arch::Architecture::Lfm2
        | hf2coreml::arch::Architecture::Qwen3_5 => 4,
        _ => 3,
    };
    // transformers reads LFM2 and Qwen3.5 files through a reader without q5_0 ("holds tensors
    // of ggml type 6, which is not supported yet"): their feed-forward rows are 256-multiples,
    // so no tensor falls back to it.
    let intermediate = match model.architecture {
        hf2coreml::arch::Architecture::Lfm2 | hf2coreml::arch::Architecture::Qwen3_5 => 512,
        _ => 384,
    };
    crate::TinyModel {
        hidden: 256,
        intermediate,
        layers,
        vocab: TinyGguf::llama().tokens().len(),
        logit_gain: 1.5,
        scale: 0.04,
        ..model
    }
}

/// [`kquant_model`] of `model` written as a checkpoint into `dir`, and its `Q4_K_M` GGUF as
/// llama.cpp lays one out ([`q4_k_m_type`]). Deterministic: the same bytes every run.
pub fn q4_k_m_fixture(model: crate::TinyModel, dir: &Path) -> std::io::Result<BuiltGguf> {
    kquant_model(model).write(dir)?;
    let ckpt = hf2coreml::checkpoint::Checkpoint::open(dir).map_err(std::io::Error::other)?;
    Ok(from_checkpoint(&ckpt, q4_k_m_type))
}

/// The SentencePiece pieces of the fixtures beyond the specials and the 256 byte pieces, best
/// first: words and their parts, then the single characters they are merged from (last, with
/// the lowest scores, as a SentencePiece BPE vocabulary lists them).
const SPM_PIECES: [&str; 24] = [
    "▁t", "he", "▁the", "in", "▁in", "▁a", "at", "▁c", "▁cat", "er", "▁H", "ll", "llo", "▁w", "or",
    "12", "123", "▁▁", "▁", "e", "l", "o", "r", "w",
];
const SPM_CHARS: &str = "abcdhinstH0123456789.!-";
/// Gemma's user-defined pieces (token type 4), as its files list them before the learned
/// pieces: runs of newlines and tabs, runs of spaces spelled with real spaces (which
/// transformers respells with `▁`, so they are not added tokens), and HTML tags.
const GEMMA_USER_DEFINED: [&str; 10] = [
    "\n", "\n\n", "  ", "   ", "\t", "\t\t", "<h1>", "</h1>", "<table>", "<br>",
];

/// A SentencePiece vocabulary as llama.cpp writes Llama 2's (`tokenizer.ggml.model = llama`):
/// `<unk>`, `<s>`, `</s>`, the 256 `<0xNN>` byte pieces, then [`SPM_PIECES`] and single
/// characters, each with its score and token type (2 unknown, 3 control, 6 byte, 1 normal).
/// `gemma`: Gemma's specials first (`<pad>`, `<eos>`, `<bos>`, `<unk>`, `<mask>`, the turn
/// markers) and its user-defined pieces ([`GEMMA_USER_DEFINED`]) after the byte pieces.
pub fn spm_vocabulary(gemma: bool) -> Vec<(String, f32, i32)> {
    let specials: &[(&str, i32)] = match gemma {
        false => &[("<unk>", 2), ("<s>", 3), ("</s>", 3)],
        true => &[
            ("<pad>", 3),
            ("<eos>", 3),
            ("<bos>", 3),
            ("<unk>", 2),
            ("<mask>", 3),
            ("<start_of_turn>", 3),
            ("<end_of_turn>", 3),
        ],
    };
    let mut v: Vec<(String, f32, i32)> = specials
        .iter()
        .map(|(t, ty)| (t.to_string(), 0.0, *ty))
        .collect();
    v.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    if gemma {
        v.extend(GEMMA_USER_DEFINED.iter().map(|t| (t.to_string(), 0.0, 4)));
    }
    let pieces = SPM_PIECES
        .iter()
        .map(|p| p.to_string())
        .chain(SPM_CHARS.chars().map(String::from))
        .collect::<Vec<_>>();
    let mut seen = std::collections::BTreeSet::new();
    for (i, p) in pieces.into_iter().enumerate() {
        if seen.insert(p.clone()) {
            v.push((p, -(i as f32), 1));
        }
    }
    v
}

/// Replace `w`'s tokenizer with [`spm_vocabulary`]: no merges, no pre-tokenizer; Llama's with
/// BOS added by llama.cpp's default (the flag absent), Gemma's with its flags as its files
/// set them (BOS added, no prefix space).
pub fn sentencepiece_meta(w: &mut GgufWriter, gemma: bool) {
    use candle_core::quantized::gguf_file::Value as V;
    w.metadata.retain(|(k, _)| !k.starts_with("tokenizer."));
    let vocab = spm_vocabulary(gemma);
    let scores = vocab.iter().map(|(_, s, _)| V::F32(*s)).collect();
    let (bos, eos, unk) = if gemma { (2, 1, 3) } else { (1, 2, 0) };
    w.meta("tokenizer.ggml.model", Meta::Str("llama".into()))
        .meta(
            "tokenizer.ggml.tokens",
            Meta::StrArray(vocab.iter().map(|(t, _, _)| t.clone()).collect()),
        )
        .meta("tokenizer.ggml.scores", Meta::Value(V::Array(scores)))
        .meta(
            "tokenizer.ggml.token_type",
            Meta::I32Array(vocab.iter().map(|(_, _, ty)| *ty).collect()),
        )
        .meta("tokenizer.ggml.bos_token_id", Meta::U32(bos))
        .meta("tokenizer.ggml.eos_token_id", Meta::U32(eos))
        .meta("tokenizer.ggml.unknown_token_id", Meta::U32(unk));
    if gemma {
        w.meta("tokenizer.ggml.padding_token_id", Meta::U32(0))
            .meta("tokenizer.ggml.add_bos_token", Meta::Bool(true))
            .meta("tokenizer.ggml.add_space_prefix", Meta::Bool(false));
    }
}

/// [`q4_k_m_fixture`] with a SentencePiece vocabulary (Gemma's for a Gemma model): the model's
/// vocabulary is sized to it.
pub fn q4_k_m_spm_fixture(model: crate::TinyModel, dir: &Path) -> std::io::Result<BuiltGguf> {
    let gemma = model.architecture == hf2coreml::arch::Architecture::Gemma3;
    let vocab = spm_vocabulary(gemma);
    let model = crate::TinyModel {
        vocab: vocab.len(),
        ..kquant_model(model)
    };
    model.write(dir)?;
    let ckpt = hf2coreml::checkpoint::Checkpoint::open(dir).map_err(std::io::Error::other)?;
    let mut built = from_checkpoint(&ckpt, q4_k_m_type);
    sentencepiece_meta(&mut built.writer, gemma);
    built.tokens = vocab.into_iter().map(|(t, _, _)| t).collect();
    Ok(built)
}
