//! Host-side cost of one generated token, outside the model: writing key/value updates into
//! the static cache, recording nothing, and sampling over the vocabulary. Uses SmolLM2-135M's
//! dimensions (L 30, Hkv 3, D 64, V 49,152) at S 512 with a model that returns fixed outputs,
//! so the numbers are the loop's own overhead to set against the interpreter's step time.
//!
//! cargo bench --bench generate_overhead

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use half::f16;
use hf2coreml::mil::contract::{Contract, Source, CONTRACT_VERSION};
use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::sampling::{Sampler, SamplingParams};
use hf2coreml::runtime::{StepModel, StepOutput};

const S: usize = 512;
const L: usize = 30;
const HKV: usize = 3;
const D: usize = 64;
const V: usize = 49_152;

struct FixedModel {
    contract: Contract,
    logits: Vec<f32>,
    update: Vec<f16>,
}

impl FixedModel {
    fn new() -> Self {
        let (inputs, outputs) = Contract::io(S, 1, L, HKV, D, V, "fp16");
        let contract = Contract {
            version: CONTRACT_VERSION,
            target: Default::default(),
            layout: Default::default(),
            kv_cache: Default::default(),
            states: Vec::new(),
            functions: Vec::new(),
            recurrent: None,
            per_layer: None,
            max_seq_len: S,
            query_len: 1,
            num_layers: L,
            num_kv_heads: HKV,
            head_dim: D,
            vocab_size: V,
            inputs,
            outputs,
            bos_token_id: None,
            eos_token_ids: vec![],
            rope: serde_json::Value::Null,
            recipe: serde_json::Value::Null,
            scaling: serde_json::Value::Null,
            compute_precision: "fp16".into(),
            source: Source::default(),
            tool: "bench".into(),
            tool_version: "0".into(),
        };
        // A realistic logit spread: a few strong candidates over a long tail.
        let logits = (0..V)
            .map(|i| ((i * 2_654_435_761usize) % 1000) as f32 / 100.0 - 5.0)
            .collect();
        FixedModel {
            contract,
            logits,
            update: vec![f16::from_f32(0.5); L * HKV * D],
        }
    }
}

impl StepModel for FixedModel {
    fn contract(&self) -> &Contract {
        &self.contract
    }
    fn step(
        &mut self,
        _input_ids: &[i32],
        _position: usize,
        _key_cache: &[f16],
        _value_cache: &[f16],
    ) -> Result<StepOutput, hf2coreml::runtime::RuntimeError> {
        Ok(StepOutput {
            logits: self.logits.clone(),
            key_update: self.update.clone(),
            value_update: self.update.clone(),
            recurrent: Vec::new(),
        })
    }
}

fn bench(c: &mut Criterion) {
    let model = FixedModel::new();
    let logits = model.logits.clone();
    let mut group = c.benchmark_group("per_token");
    for (name, params) in [
        ("greedy", SamplingParams::greedy()),
        (
            "top_p_0.9",
            SamplingParams {
                temperature: 0.8,
                top_k: None,
                top_p: Some(0.9),
                seed: 1,
            },
        ),
        (
            "top_k_40",
            SamplingParams {
                temperature: 0.8,
                top_k: Some(40),
                top_p: None,
                seed: 1,
            },
        ),
    ] {
        let mut sampler = Sampler::new(params).expect("valid params");
        group.bench_function(format!("sample_{name}"), |b| {
            b.iter(|| sampler.sample(&logits).expect("finite"))
        });
    }
    // 64 tokens through the whole loop (step outputs cloned, cache writes, greedy sampling).
    let mut generator = Generator::new(model).expect("valid contract");
    let opts = GenerateOptions {
        max_new_tokens: 64,
        ..GenerateOptions::default()
    };
    group.bench_function("loop_64_tokens_greedy", |b| {
        b.iter_batched(
            || vec![1u32; 8],
            |prompt| {
                generator
                    .generate(&prompt, &opts, &mut |_| Ok(()))
                    .expect("fits")
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
