//! Package metadata: author, description, version, input/output descriptions and the contract
//! JSON under [`contract::METADATA_KEY`].

use std::collections::BTreeMap;

use serde::Serialize;

use crate::mil::chain_file;
use crate::mil::contract::{self, Contract};

/// What the bridge writes into the model description.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metadata {
    pub author: String,
    pub short_description: String,
    pub version: String,
    pub license: String,
    /// `user_defined_metadata`; holds the contract JSON.
    pub user_defined: BTreeMap<String, String>,
    pub input_descriptions: BTreeMap<String, String>,
    pub output_descriptions: BTreeMap<String, String>,
}

/// Key holding the tool that wrote the package.
pub const TOOL_KEY: &str = "hf2coreml.tool";

impl Metadata {
    /// The metadata of a package of contract `c` (the contract's version is in it).
    pub fn for_contract(c: &Contract, model_name: &str) -> Result<Self, serde_json::Error> {
        let s = c.max_seq_len;
        let q = c.query_len;
        let mut user_defined = BTreeMap::new();
        user_defined.insert(
            contract::METADATA_KEY.to_string(),
            serde_json::to_string(c)?,
        );
        user_defined.insert(
            TOOL_KEY.to_string(),
            format!("{} {}", c.tool, c.tool_version),
        );
        let d = |k: &str, v: String| (k.to_string(), v);
        let mut input_descriptions = BTreeMap::from([
            d(
                contract::INPUT_IDS,
                format!("int32 [1, {q}]: token ids at positions p .. p+{q}-1"),
            ),
            d(
                contract::POSITION,
                format!("int32 [1]: p, the position of input_ids[0, 0]; p + {q} <= {s}"),
            ),
            d(
                contract::KEY_CACHE,
                format!("[L, Hkv, {s}, D] keys after RoPE; rows [0, p) valid, later rows ignored"),
            ),
            d(
                contract::VALUE_CACHE,
                format!("[L, Hkv, {s}, D] values; rows [0, p) valid, later rows ignored"),
            ),
        ]);
        let parts = c.logits_outputs();
        let n = parts.len();
        let mut first = 0;
        let mut output_descriptions: BTreeMap<String, String> = parts
            .into_iter()
            .map(|(name, w)| {
                let text = if n == 1 {
                    format!("[1, {q}, V] next-token logits for each query position")
                } else {
                    format!(
                        "[1, {q}, {w}] next-token logits of tokens {first} .. {}: concatenate \
                         the {n} logits parts along the last axis",
                        first + w - 1
                    )
                };
                first += w;
                (name, text)
            })
            .collect();
        output_descriptions.extend([
            d(
                contract::KEY_UPDATE,
                format!("[L, Hkv, {q}, D] new key rows; write them to key_cache[:, :, p:p+{q}]"),
            ),
            d(
                contract::VALUE_UPDATE,
                format!(
                    "[L, Hkv, {q}, D] new value rows; write them to value_cache[:, :, p:p+{q}]"
                ),
            ),
        ]);
        if c.kv_cache == contract::KvCache::State {
            // The cache is the state `kv_cache`: no cache inputs or update outputs to describe.
            for k in [contract::KEY_CACHE, contract::VALUE_CACHE] {
                input_descriptions.remove(k);
            }
            for k in [contract::KEY_UPDATE, contract::VALUE_UPDATE] {
                output_descriptions.remove(k);
            }
        }
        Ok(Metadata {
            author: format!("{} {}", c.tool, c.tool_version),
            short_description: format!(
                "{model_name} ({}): one decode step, static KV cache of {s} tokens, {q} token(s) \
                 per step, {} compute (hf2coreml contract v{})",
                c.source.architecture, c.compute_precision, c.version
            ),
            version: c.tool_version.clone(),
            license: String::new(),
            user_defined,
            input_descriptions,
            output_descriptions,
        })
    }
}

impl Metadata {
    /// Metadata of one part of a chain (docs/design.md, "Chained packages"): the part's own
    /// description under [`chain_file::PART_METADATA_KEY`] (index, layers, I/O and the model's
    /// contract) instead of a contract, and descriptions of the inputs and outputs it has.
    pub fn for_part(
        c: &Contract,
        part: &chain_file::ChainPart,
        index: usize,
        count: usize,
        model_name: &str,
    ) -> Result<Self, serde_json::Error> {
        let mut m = Self::for_contract(c, model_name)?;
        m.user_defined.remove(contract::METADATA_KEY);
        let described = serde_json::json!({
            "format": chain_file::CHAIN_FORMAT,
            "index": index,
            "count": count,
            "layers": part.layers,
            "embedding": part.embedding,
            "head": part.head,
            "inputs": part.inputs,
            "outputs": part.outputs,
            "contract": c,
        });
        m.user_defined.insert(
            chain_file::PART_METADATA_KEY.to_string(),
            serde_json::to_string(&described)?,
        );
        let hidden = format!(
            "[1, {}, hidden] the residual stream times the residual scale, passed between parts",
            c.query_len
        );
        let keep = |io: &[contract::IoSpec], d: &mut BTreeMap<String, String>| {
            d.retain(|k, _| io.iter().any(|x| &x.name == k));
            for name in [chain_file::HIDDEN_IN, chain_file::HIDDEN_OUT] {
                if io.iter().any(|x| x.name == name) {
                    d.insert(name.to_string(), hidden.clone());
                }
            }
        };
        keep(&part.inputs, &mut m.input_descriptions);
        keep(&part.outputs, &mut m.output_descriptions);
        m.short_description = format!(
            "{model_name}: part {} of {count} of a chained model, layers {:?} ({})",
            index + 1,
            part.layers,
            m.short_description
        );
        Ok(m)
    }
}
