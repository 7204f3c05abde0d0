//! The contract a package declares for a checkpoint and the conversion's options (one package
//! and every part of a chain record the same).

use std::collections::BTreeMap;

use super::convert_error::ConvertError;
use super::options::ConvertOptions;
use crate::arch::ModelSpec;
use crate::checkpoint::Checkpoint;
use crate::graph::scaling::Scaling;
use crate::mil::contract::{self, Contract, Source};

/// The contract for a checkpoint and options; `per_layer` is the per-layer table written
/// beside the package, for a model that has one.
pub fn contract_for(
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    scaling: &Scaling,
    (recipe, files): (serde_json::Value, BTreeMap<String, String>),
    per_layer: Option<contract::PerLayerTable>,
) -> Result<Contract, ConvertError> {
    let spec = ckpt.spec();
    // The cache's dimensions are what the blocks keep (arch::layers), stacked over them.
    let (hkv, d) = spec.stacked_kv().ok_or_else(|| {
        ConvertError::State(
            "the blocks keep state of different kinds or shapes, which one stacked KV cache \
             [L, Hkv, S, D] cannot hold"
                .into(),
        )
    })?;
    // A hybrid model's caches hold its attention blocks' rows; the rest is recurrent state.
    let recurrent = spec.recurrent_state(0..spec.num_hidden_layers);
    let l = spec.cache_layers();
    let dims = (opts.max_seq_len, opts.query_len, l, hkv, d, spec.vocab_size);
    let (s, q, l, hkv, d, v) = dims;
    let precision = opts.precision.as_str();
    let (mut inputs, mut outputs, mut states) = match opts.kv_cache {
        contract::KvCache::Io => {
            let (i, o) = Contract::io(s, q, l, hkv, d, v, precision);
            (i, o, Vec::new())
        }
        contract::KvCache::State => Contract::state_io(s, q, l, hkv, d, v, precision),
    };
    if let Some(r) = &recurrent {
        let sink = (opts.kv_cache == contract::KvCache::State).then_some(&mut states);
        r.add_io(q, precision, (&mut inputs, &mut outputs), sink);
    }
    if let Some(t) = &per_layer {
        t.add_input(q, precision, &mut inputs);
    }
    Ok(Contract {
        version: contract::CONTRACT_VERSION,
        target: opts.target,
        layout: opts.layout,
        kv_cache: opts.kv_cache,
        states,
        max_seq_len: opts.max_seq_len,
        query_len: opts.query_len,
        num_layers: l,
        num_kv_heads: hkv,
        head_dim: d,
        vocab_size: spec.vocab_size,
        inputs,
        outputs,
        bos_token_id: spec.bos_token_id,
        eos_token_ids: spec.eos_token_ids.clone(),
        rope: serde_json::json!({
            "theta": spec.rope_theta,
            "scaling": spec.rope_scaling,
            "layout": "rotate_half",
        }),
        recipe,
        scaling: serde_json::to_value(scaling)?,
        compute_precision: opts.precision.as_str().to_string(),
        source: Source {
            architecture: spec.architecture.hf_name().to_string(),
            files,
        },
        tool: "hf2coreml".to_string(),
        tool_version: crate::VERSION.to_string(),
        functions: function_specs(opts, spec, per_layer.as_ref()),
        recurrent,
        per_layer,
    })
}

/// The functions a multifunction package declares: `prefill` then `decode`, each with its Q
/// and I/O; none for one function.
fn function_specs(
    opts: &ConvertOptions,
    spec: &ModelSpec,
    per_layer: Option<&contract::PerLayerTable>,
) -> Vec<contract::FunctionSpec> {
    if opts.prefill_len == 0 {
        return Vec::new();
    }
    [
        (contract::PREFILL, opts.prefill_len),
        (contract::DECODE, opts.query_len),
    ]
    .into_iter()
    .map(|(name, q)| {
        // A stateful package's functions declare the one state the contract lists.
        let dims = (
            opts.max_seq_len,
            q,
            spec.cache_layers(),
            spec.num_key_value_heads,
            spec.head_dim,
            spec.vocab_size,
        );
        let (s, q, l, hkv, d, v) = dims;
        let precision = opts.precision.as_str();
        let (mut inputs, mut outputs) = match opts.kv_cache {
            contract::KvCache::Io => Contract::io(s, q, l, hkv, d, v, precision),
            contract::KvCache::State => {
                let (i, o, _) = Contract::state_io(s, q, l, hkv, d, v, precision);
                (i, o)
            }
        };
        if let Some(r) = spec.recurrent_state(0..spec.num_hidden_layers) {
            // A stateful package's functions share its states, listed once in the contract.
            let mut shared = Vec::new();
            let sink = (opts.kv_cache == contract::KvCache::State).then_some(&mut shared);
            r.add_io(q, precision, (&mut inputs, &mut outputs), sink);
        }
        if let Some(t) = per_layer {
            t.add_input(q, precision, &mut inputs);
        }
        if name == contract::PREFILL && opts.prefill_logits == contract::PrefillLogits::Last {
            let n = contract::logits_widths(v).len();
            let logits: Vec<String> = (0..n).map(|i| contract::logits_name(i, n)).collect();
            for o in outputs.iter_mut().filter(|o| logits.contains(&o.name)) {
                o.shape[1] = 1;
            }
        }
        contract::FunctionSpec {
            name: name.to_string(),
            query_len: q,
            inputs,
            outputs,
        }
    })
    .collect()
}
