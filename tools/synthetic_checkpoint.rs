//! Write a random checkpoint for resource measurements (benches/peak_rss.sh, big_model.sh):
//!
//! - `synthetic_checkpoint OUT_DIR LAYERS HIDDEN INTERMEDIATE VOCAB`: a Llama of a chosen
//!   size (bf16, GQA 4:1, tied embeddings), one file.
//! - `synthetic_checkpoint OUT_DIR --preset NAME`: the published shapes of a real model
//!   (`llama-3.2-1b`, `llama-3.2-3b`, `llama-3.1-8b`, `qwen2.5-7b`, `qwen3-4b`, `mistral-7b`, and the
//!   hybrids `qwen3.5-0.8b`, `qwen3.5-4b`, `lfm2-1.2b`, and `gemma-4-e2b`: their text
//!   decoders) as the Hub ships them: bf16 safetensors in shards of at most 5 GB with `model.safetensors.index.json`
//!   (`--config-only`: config.json alone, which `budget` plans from).
//!   Random weights: they measure memory, time and structure, not quality. The shards are
//!   streamed tensor by tensor in 4 MiB chunks, so an 8B (16 GB on disk) is written in a few
//!   MiB of memory.

use std::io::Write;
use std::path::Path;

use hf2coreml::arch::{expected_tensors, ModelSpec, Role, TensorSlot};
use hf2coreml::util::SplitMix64;

/// Hugging Face's default shard size.
const SHARD_BYTES: u64 = 5_000_000_000;

/// Elements generated per write.
const CHUNK: usize = 2 << 20;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [dir, flag, name] if flag == "--preset" => {
            let config = preset(name)?;
            write_preset(Path::new(dir), &config)
        }
        // The config alone: what `budget` plans from without weights.
        [dir, flag, name, only] if flag == "--preset" && only == "--config-only" => {
            let text = serde_json::to_string_pretty(&preset(name)?)?;
            hf2coreml::arch::ModelSpec::from_config_str(&text)?;
            std::fs::create_dir_all(dir)?;
            std::fs::write(Path::new(dir).join("config.json"), text)?;
            Ok(())
        }
        [dir, layers, hidden, intermediate, vocab] => {
            sized(dir, layers, hidden, intermediate, vocab)
        }
        _ => Err(
            "usage: synthetic_checkpoint OUT_DIR LAYERS HIDDEN INTERMEDIATE VOCAB\n       \
                  synthetic_checkpoint OUT_DIR --preset llama-3.2-1b|llama-3.2-3b|llama-3.1-8b|\
                  qwen2.5-7b|qwen3-4b|mistral-7b|qwen3.5-0.8b|qwen3.5-4b|lfm2-1.2b|gemma-4-e2b [--config-only]"
                .into(),
        ),
    }
}

/// The positional form: a tied Llama of the given size.
fn sized(
    dir: &str,
    layers: &str,
    hidden: &str,
    intermediate: &str,
    vocab: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let hidden: usize = hidden.parse()?;
    // 64-wide heads, four query heads per key/value head, as in most current Llamas.
    let heads = hidden / 64;
    let m = hf2coreml_testkit::TinyModel {
        layers: layers.parse()?,
        hidden,
        intermediate: intermediate.parse()?,
        heads,
        kv_heads: (heads / 4).max(1),
        vocab: vocab.parse()?,
        scale: 0.02,
        ..hf2coreml_testkit::TinyModel::llama()
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    m.write(&dir)?;
    report(&dir)
}

fn report(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let bytes: u64 = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!("wrote {} ({bytes} bytes)", dir.display());
    Ok(())
}

/// config.json of a preset, with the shapes from each model's published config.json.
fn preset(name: &str) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    if let Some(config) = hybrid_preset(name) {
        return Ok(config);
    }
    let llama3_rope = |factor: f64| {
        serde_json::json!({
            "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
        })
    };
    // (architecture, model_type, vocab, hidden, intermediate, layers, heads, kv heads,
    //  head_dim, tied, rope_theta, rope_scaling, max_position_embeddings, rms eps, bos, eos)
    let c = match name {
        "llama-3.2-1b" => (
            "LlamaForCausalLM",
            "llama",
            128_256,
            2048,
            8192,
            16,
            32,
            8,
            64,
            true,
            500_000.0,
            llama3_rope(32.0),
            131_072,
            1e-5,
            128_000,
            128_001,
        ),
        "llama-3.2-3b" => (
            "LlamaForCausalLM",
            "llama",
            128_256,
            3072,
            8192,
            28,
            24,
            8,
            128,
            true,
            500_000.0,
            llama3_rope(32.0),
            131_072,
            1e-5,
            128_000,
            128_001,
        ),
        "llama-3.1-8b" => (
            "LlamaForCausalLM",
            "llama",
            128_256,
            4096,
            14_336,
            32,
            32,
            8,
            128,
            false,
            500_000.0,
            llama3_rope(8.0),
            131_072,
            1e-5,
            128_000,
            128_001,
        ),
        // Qwen2's q/k/v biases come with the architecture.
        "qwen2.5-7b" => (
            "Qwen2ForCausalLM",
            "qwen2",
            152_064,
            3584,
            18_944,
            28,
            28,
            4,
            128,
            false,
            1_000_000.0,
            serde_json::Value::Null,
            32_768,
            1e-6,
            151_643,
            151_643,
        ),
        // Qwen3 4B: all attention at Qwen3.5-4B's width (per-head q/k norms come with the
        // architecture), tied.
        "qwen3-4b" => (
            "Qwen3ForCausalLM",
            "qwen3",
            151_936,
            2560,
            9728,
            36,
            32,
            8,
            128,
            true,
            1_000_000.0,
            serde_json::Value::Null,
            40_960,
            1e-6,
            151_643,
            151_645,
        ),
        // Mistral 7B v0.3.
        "mistral-7b" => (
            "MistralForCausalLM",
            "mistral",
            32_768,
            4096,
            14_336,
            32,
            32,
            8,
            128,
            false,
            1_000_000.0,
            serde_json::Value::Null,
            32_768,
            1e-5,
            1,
            2,
        ),
        other => return Err(format!("unknown preset `{other}`").into()),
    };
    let (arch, ty, vocab, hidden, inter, layers, heads, kv, hd, tied, theta, scaling, ctx, eps) = (
        c.0, c.1, c.2, c.3, c.4, c.5, c.6, c.7, c.8, c.9, c.10, c.11, c.12, c.13,
    );
    Ok(serde_json::json!({
        "architectures": [arch], "model_type": ty, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "tie_word_embeddings": tied,
        "rope_theta": theta, "rope_scaling": scaling, "max_position_embeddings": ctx,
        "rms_norm_eps": eps, "bos_token_id": c.14, "eos_token_id": c.15, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }))
}

/// Write config.json, the shards and the index, one tensor at a time.
fn write_preset(dir: &Path, config: &serde_json::Value) -> Result<(), Box<dyn std::error::Error>> {
    let text = serde_json::to_string_pretty(config)?;
    let spec = ModelSpec::from_config_str(&text)?;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), &text)?;
    let slots = expected_tensors(&spec);
    let mut shards: Vec<Vec<&TensorSlot>> = vec![Vec::new()];
    let mut size = 0u64;
    for s in &slots {
        let b = s.numel() as u64 * 2;
        if size + b > SHARD_BYTES && !shards.last().is_some_and(Vec::is_empty) {
            shards.push(Vec::new());
            size = 0;
        }
        size += b;
        shards.last_mut().expect("one shard").push(s);
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut rng = SplitMix64(0x5EED);
    for (i, shard) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        for s in shard {
            weight_map.insert(s.name.clone(), name.clone().into());
        }
        write_shard(&dir.join(&name), shard, &mut rng)?;
        eprintln!("{name}: {} tensors", shard.len());
    }
    let total: u64 = slots.iter().map(|s| s.numel() as u64 * 2).sum();
    let index = serde_json::json!({
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    report(dir)
}

/// One safetensors file of bf16 tensors, streamed.
fn write_shard(
    path: &Path,
    slots: &[&TensorSlot],
    rng: &mut SplitMix64,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    for s in slots {
        let end = offset + s.numel() as u64 * 2;
        header.insert(
            s.name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": s.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut h = serde_json::to_string(&header)?.into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let tmp = path.with_extension("partial");
    let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&tmp)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK * 2);
    for s in slots {
        // Norm weights near 1 (as trained models have them); everything else small and random.
        let (base, spread) = match s.role {
            Role::Norm => (1.0f32, 0.05f32),
            _ => (0.0, 0.035),
        };
        let mut left = s.numel();
        while left > 0 {
            let k = left.min(CHUNK);
            buf.clear();
            for _ in 0..k {
                let v = base + spread * (2.0 * rng.uniform() - 1.0);
                buf.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
            }
            f.write_all(&buf)?;
            left -= k;
        }
    }
    f.flush()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The hybrids' published text configs: Qwen3.5 0.8B and 4B (their `text_config`, tied,
/// DeltaNets in three blocks of every four) and LFM2 1.2B (conv blocks but six; its
/// feed-forward width 12288 becomes 8192 by LFM2's rule).
fn hybrid_preset(name: &str) -> Option<serde_json::Value> {
    let qwen = |hidden: usize, inter: usize, layers: usize, heads: usize, kv: usize, vh: usize| {
        let types: Vec<&str> = (0..layers)
            .map(|l| {
                if (l + 1) % 4 == 0 {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        serde_json::json!({
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "vocab_size": 248_320, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 256, "layer_types": types,
            "linear_num_key_heads": 16, "linear_num_value_heads": vh,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "attn_output_gate": true,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                "mrope_interleaved": true},
            "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
            "max_position_embeddings": 262_144, "eos_token_id": 248_044,
            "hidden_act": "silu", "torch_dtype": "bfloat16",
        })
    };
    Some(match name {
        "qwen3.5-0.8b" => qwen(1024, 3584, 24, 8, 2, 16),
        "qwen3.5-4b" => qwen(2560, 9216, 32, 16, 4, 32),
        "lfm2-1.2b" => serde_json::json!({
            "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
            "vocab_size": 65_536, "hidden_size": 2048, "block_ff_dim": 12_288,
            "block_auto_adjust_ff_dim": true, "block_ffn_dim_multiplier": 1.0,
            "block_multiple_of": 256, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "full_attn_idxs": [2, 5, 8, 10, 12, 14],
            "conv_L_cache": 3, "conv_bias": false, "norm_eps": 1e-5, "rope_theta": 1_000_000.0,
            "max_position_embeddings": 128_000, "bos_token_id": 1, "eos_token_id": 7,
            "torch_dtype": "bfloat16",
        }),
        // Gemma 4 E2B's text decoder (docs/reference/gemma4.md §5): full attention every
        // fifth block with its own head size, the last 20 blocks reading blocks 13 and 14's
        // caches with double-wide MLPs, per-layer inputs 256 wide.
        "gemma-4-e2b" => {
            let types: Vec<&str> = (0..35)
                .map(|l| match (l + 1) % 5 {
                    0 => "full_attention",
                    _ => "sliding_attention",
                })
                .collect();
            serde_json::json!({
                "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
                "vocab_size": 262_144, "hidden_size": 1536, "intermediate_size": 6144,
                "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1,
                "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": null,
                "attention_k_eq_v": false, "layer_types": types, "sliding_window": 512,
                "num_kv_shared_layers": 20, "use_double_wide_mlp": true,
                "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {"rope_type": "proportional",
                        "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}},
                "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 131_072, "tie_word_embeddings": true,
                "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
                "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16",
            })
        }
        _ => return None,
    })
}
