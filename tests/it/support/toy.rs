//! Shared fixtures for the generation tests: a strict toy [`StepModel`] whose output depends
//! on every visible cache row (so a cache bug changes the text), its independent reference,
//! and a byte-level BPE tokenizer built in code.
#![allow(dead_code)]

use half::f16;
use hf2coreml::mil::contract::{Contract, Source, CONTRACT_VERSION};
use hf2coreml::runtime::{RuntimeError, StepModel, StepOutput};

/// Toy dynamics. Token t at position j with running sums (c, w) over earlier positions:
/// key k_j = (t + c) mod KEY_MOD, value v_j = (3t + j) mod VALUE_MOD, and the predicted next
/// token is (t + c' + w') mod V where c', w' include position j itself. Small integers are
/// exact in fp16, so "the same" means bit-identical.
pub const KEY_MOD: u32 = 13;
pub const VALUE_MOD: u32 = 11;

pub fn contract(s: usize, q: usize, v: usize, eos: Vec<u32>) -> Contract {
    let (l, hkv, d) = (2, 2, 3);
    let (inputs, outputs) = Contract::io(s, q, l, hkv, d, v, "fp16");
    Contract {
        version: CONTRACT_VERSION,
        target: Default::default(),
        layout: Default::default(),
        kv_cache: Default::default(),
        states: Vec::new(),
        max_seq_len: s,
        query_len: q,
        num_layers: l,
        num_kv_heads: hkv,
        head_dim: d,
        vocab_size: v,
        inputs,
        outputs,
        bos_token_id: None,
        eos_token_ids: eos,
        rope: serde_json::Value::Null,
        recipe: serde_json::Value::Null,
        scaling: serde_json::Value::Null,
        compute_precision: "fp16".into(),
        source: Source::default(),
        tool: "test".into(),
        tool_version: "0".into(),
        functions: Vec::new(),
        recurrent: None,
        per_layer: None,
    }
}

/// The element (l, h, d) of a key or value row whose base value is `base`.
fn element(base: u32, l: usize, h: usize, d: usize) -> f16 {
    f16::from_f32(((base as usize + l + 2 * h + 3 * d) % 17) as f32)
}

/// Logits for "the next token is `target`": a unique maximum, then a smooth tail so that
/// temperature sampling has several live candidates.
pub fn logits_for(target: u32, v: usize) -> Vec<f32> {
    (0..v)
        .map(|i| {
            let dist = (i + v - target as usize) % v;
            -(dist as f32) * 0.75
        })
        .collect()
}

/// The toy's next-token target at every position of `seq`, computed directly.
pub fn reference_targets(seq: &[u32], v: usize) -> Vec<u32> {
    let (mut c, mut w) = (0u32, 0u32);
    seq.iter()
        .enumerate()
        .map(|(j, &t)| {
            let k = (t + c) % KEY_MOD;
            let val = (3 * t + j as u32) % VALUE_MOD;
            c += k;
            w += val;
            (t + c + w) % v as u32
        })
        .collect()
}

/// Greedy continuation of `prompt` by `n` tokens.
pub fn reference_greedy(prompt: &[u32], n: usize, v: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = *reference_targets(&seq, v).last().expect("non-empty");
        out.push(next);
        seq.push(next);
    }
    out
}

/// A contract-v1 model that checks how it is driven: exactly Q ids, `position + Q <= S`, and
/// every cache row below `position` bit-identical to the row it last returned for that
/// position (a row it never returned is a failure too).
pub struct ToyModel {
    pub contract: Contract,
    /// Per position: the key and value rows last returned, [L * Hkv * D] each.
    written: Vec<Option<(Vec<f16>, Vec<f16>)>>,
    /// (position, ids) of every call.
    pub calls: Vec<(usize, Vec<i32>)>,
    /// Fail (with an error) on this call index.
    pub fail_on_call: Option<usize>,
    /// Return this many logits instead of Q * V.
    pub wrong_logits_len: Option<usize>,
}

impl ToyModel {
    pub fn new(contract: Contract) -> Self {
        let s = contract.max_seq_len;
        ToyModel {
            contract,
            written: vec![None; s],
            calls: Vec::new(),
            fail_on_call: None,
            wrong_logits_len: None,
        }
    }

    fn lhd(&self) -> (usize, usize, usize) {
        let c = &self.contract;
        (c.num_layers, c.num_kv_heads, c.head_dim)
    }

    fn cache_row(&self, cache: &[f16], pos: usize) -> Vec<f16> {
        let (l, hkv, d) = self.lhd();
        let s = self.contract.max_seq_len;
        let mut row = Vec::with_capacity(l * hkv * d);
        for lh in 0..l * hkv {
            let at = (lh * s + pos) * d;
            row.extend_from_slice(&cache[at..at + d]);
        }
        row
    }

    fn make_row(&self, base: u32) -> Vec<f16> {
        let (l, hkv, d) = self.lhd();
        let mut row = Vec::with_capacity(l * hkv * d);
        for li in 0..l {
            for h in 0..hkv {
                for di in 0..d {
                    row.push(element(base, li, h, di));
                }
            }
        }
        row
    }
}

impl StepModel for ToyModel {
    fn contract(&self) -> &Contract {
        &self.contract
    }

    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        let (l, hkv, d) = self.lhd();
        let (s, q, v) = (
            self.contract.max_seq_len,
            self.contract.query_len,
            self.contract.vocab_size,
        );
        let call = self.calls.len();
        self.calls.push((position, input_ids.to_vec()));
        if self.fail_on_call == Some(call) {
            return Err(RuntimeError::Program(format!(
                "planned failure on call {call}"
            )));
        }
        assert_eq!(
            input_ids.len(),
            q,
            "step got {} ids, Q = {q}",
            input_ids.len()
        );
        assert!(position + q <= s, "step at {position} + Q {q} passes S {s}");
        assert_eq!(key_cache.len(), l * hkv * s * d);
        assert_eq!(value_cache.len(), l * hkv * s * d);
        // Strictness: the visible cache is exactly what this model produced.
        let (mut c, mut w) = (0u32, 0u32);
        for p in 0..position {
            let (k_row, v_row) = self.written[p].as_ref().unwrap_or_else(|| {
                panic!("cache row {p} is visible at {position} but was never written")
            });
            assert_eq!(
                &self.cache_row(key_cache, p),
                k_row,
                "key row {p} differs at step {position}"
            );
            assert_eq!(
                &self.cache_row(value_cache, p),
                v_row,
                "value row {p} differs at step {position}"
            );
            // Read the state back from the cache itself (element (0, 0, 0) is the base).
            c += key_cache[p * d].to_f32() as u32;
            w += value_cache[p * d].to_f32() as u32;
        }
        let mut logits = Vec::with_capacity(q * v);
        let mut k_rows = Vec::with_capacity(q);
        let mut v_rows = Vec::with_capacity(q);
        for (i, &id) in input_ids.iter().enumerate() {
            assert!(id >= 0 && (id as usize) < v, "id {id} outside V {v}");
            let t = id as u32;
            let j = (position + i) as u32;
            let k = (t + c) % KEY_MOD;
            let val = (3 * t + j) % VALUE_MOD;
            // Element (0,0,0) must carry the base exactly: (base + 0) % 17 == base for base < 13.
            c += k;
            w += val;
            logits.extend(logits_for((t + c + w) % v as u32, v));
            k_rows.push(self.make_row(k));
            v_rows.push(self.make_row(val));
        }
        // [L, Hkv, Q, D] from per-position [L*Hkv, D] rows.
        let mut key_update = Vec::with_capacity(l * hkv * q * d);
        let mut value_update = Vec::with_capacity(l * hkv * q * d);
        for lh in 0..l * hkv {
            for i in 0..q {
                key_update.extend_from_slice(&k_rows[i][lh * d..(lh + 1) * d]);
                value_update.extend_from_slice(&v_rows[i][lh * d..(lh + 1) * d]);
            }
        }
        for i in 0..q {
            self.written[position + i] = Some((k_rows[i].clone(), v_rows[i].clone()));
        }
        if let Some(n) = self.wrong_logits_len {
            logits.resize(n, 0.0);
        }
        Ok(StepOutput {
            logits,
            key_update,
            value_update,
            recurrent: Vec::new(),
        })
    }
}

/// GPT-2's byte → printable character table.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(chars) {
        table[*b as usize] = char::from_u32(c).expect("valid char");
    }
    table
}

/// A byte-level BPE tokenizer with no merges: id = byte value, plus `<|im_start|>` (256) and
/// `<|im_end|>` (257) as special tokens. Every multi-byte character spans several tokens.
pub fn byte_tokenizer_json() -> String {
    let table = byte_chars();
    let vocab: serde_json::Map<String, serde_json::Value> = table
        .iter()
        .enumerate()
        .map(|(b, c)| (c.to_string(), serde_json::Value::from(b)))
        .chain([
            ("<|im_start|>".to_string(), 256.into()),
            ("<|im_end|>".to_string(), 257.into()),
        ])
        .collect();
    let added = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [added(256, "<|im_start|>"), added(257, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": []}
    })
    .to_string()
}

pub fn byte_tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_bytes(byte_tokenizer_json().as_bytes()).expect("fixture tokenizer")
}
