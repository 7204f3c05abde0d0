//! `inspect` and `budget` through the binary: checkpoints of every architecture and config
//! flavour, and every kind of bad input (exit 2, a message naming the file, never a panic).

use std::path::Path;
use std::process::Output;

use hf2coreml::arch::Architecture;
use hf2coreml::mil::DType;
use hf2coreml_testkit::TinyModel;

use crate::support::{assert_refused, cli, hf2coreml, stderr};

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "exit {:?}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

fn inspect_json(dir: &Path) -> serde_json::Value {
    json(&hf2coreml(&["inspect", dir.to_str().unwrap(), "--json"]))
}

#[test]
fn inspect_llama_gqa_tied() {
    let m = TinyModel::llama();
    let dir = m.write_temp().unwrap();
    let j = inspect_json(dir.path());
    assert_eq!(j["architecture"], "LlamaForCausalLM");
    assert_eq!(j["layers"], 2);
    assert_eq!(j["hidden_size"], 64);
    assert_eq!(j["num_attention_heads"], 4);
    assert_eq!(j["num_key_value_heads"], 2);
    assert_eq!(j["head_dim"], 16);
    assert_eq!(j["vocab_size"], 96);
    assert_eq!(j["tie_word_embeddings"], true);
    assert_eq!(j["dtype"], "bf16");
    // Tied: the embedding is counted once and there is no lm_head tensor.
    let per_layer = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64;
    let expected = 96 * 64 + 2 * per_layer + 64;
    assert_eq!(j["parameters"], expected);
    let lm_head = j["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["role"] == "lm_head")
        .unwrap();
    assert_eq!(lm_head["tensors"], 0);
    assert_eq!(j["fp16_bytes"], expected * 2);
    assert!(j["default_recipe_bytes"].as_u64().unwrap() < expected * 2);
}

#[test]
fn inspect_qwen2_sharded_with_biases() {
    let m = TinyModel::qwen2();
    let dir = m.write_temp().unwrap();
    assert!(dir.path().join("model.safetensors.index.json").is_file());
    let j = inspect_json(dir.path());
    assert_eq!(j["architecture"], "Qwen2ForCausalLM");
    assert_eq!(j["attention_bias"], true);
    assert_eq!(j["tie_word_embeddings"], false);
    assert_eq!(j["dtype"], "f16");
    let attention = j["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["role"] == "attention")
        .unwrap();
    // q, k, v, o weights + q, k, v biases, per layer.
    assert_eq!(attention["tensors"], 2 * 7);
}

#[test]
fn inspect_mistral_f32_explicit_head_dim() {
    let m = TinyModel::mistral();
    let dir = m.write_temp().unwrap();
    let j = inspect_json(dir.path());
    assert_eq!(j["architecture"], "MistralForCausalLM");
    assert_eq!(
        j["head_dim"], 24,
        "explicit head_dim overrides hidden/heads"
    );
    assert_eq!(j["dtype"], "f32");
}

#[test]
fn transformers4_and_5_configs_agree() {
    for arch in [TinyModel::llama(), TinyModel::qwen2()] {
        let scaling = serde_json::json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128});
        let v4 = TinyModel {
            rope_scaling: Some(scaling.clone()),
            ..arch.clone()
        };
        let v5 = TinyModel {
            transformers5: true,
            rope_scaling: Some(scaling),
            ..arch
        };
        let d4 = v4.write_temp().unwrap();
        let d5 = v5.write_temp().unwrap();
        let text5 = std::fs::read_to_string(d5.path().join("config.json")).unwrap();
        assert!(text5.contains("rope_parameters") && !text5.contains("torch_dtype"));
        let mut j4 = inspect_json(d4.path());
        let mut j5 = inspect_json(d5.path());
        for j in [&mut j4, &mut j5] {
            j.as_object_mut().unwrap().remove("path");
            j.as_object_mut().unwrap().remove("checkpoint_bytes");
        }
        assert_eq!(j4, j5);
        assert_eq!(j4["rope_scaling"]["type"], "llama3");
    }
}

#[test]
fn inspect_text_report_has_the_role_table() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let out = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "LlamaForCausalLM",
        "attention",
        "mlp",
        "norms",
        "default recipe",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
}

/// SmolLM2-135M's attention shape (30 layers, 3 kv heads, head_dim 64) with everything else
/// shrunk so the fixture stays small.
fn smollm_shaped() -> TinyModel {
    TinyModel {
        layers: 30,
        hidden: 32,
        intermediate: 32,
        heads: 9,
        kv_heads: 3,
        head_dim: Some(64),
        vocab: 64,
        dtype: DType::F16,
        context: 8192,
        ..TinyModel::llama()
    }
}

#[test]
fn budget_smollm_shaped_kv_cache() {
    let dir = smollm_shaped().write_temp().unwrap();
    let j = json(&hf2coreml(&[
        "budget",
        dir.path().to_str().unwrap(),
        "--device",
        "iphone-15",
        "--max-seq-len",
        "2048",
        "--json",
    ]));
    assert_eq!(j["kv_cache_bytes"], 47_185_920u64);
    for key in [
        "weights_bytes",
        "working_set_bytes",
        "total_bytes",
        "limit_bytes",
        "fits",
        "max_seq_len_that_fits",
    ] {
        assert!(j.get(key).is_some(), "missing {key}");
    }
    assert_eq!(j["fits"], true);
    assert!(j["max_seq_len_that_fits"].as_u64().unwrap() > 2048);
}

#[test]
fn budget_exit_codes() {
    let dir = smollm_shaped().write_temp().unwrap();
    let d = dir.path().to_str().unwrap();
    // An explicit limit is planned with the device table's default allowances: 10% of 40 MB
    // and 150 MiB for the runtime leave nothing for the model.
    let out = hf2coreml(&["budget", d, "--memory-limit", "40MB", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["runtime_overhead_bytes"], 150 << 20);
    assert_eq!(j["usable_bytes"], 36_000_000);
    assert_eq!(j["max_seq_len_that_fits"], 0);
    // Without them, 40 MB cannot hold the 47 MB cache of 2048 rows.
    let bare = ["--safety-margin", "0", "--runtime-overhead", "0"];
    let out = hf2coreml(
        &[
            &["budget", d, "--memory-limit", "40MB"][..],
            &bare,
            &["--max-seq-len", "2048", "--json"],
        ]
        .concat(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["fits"], false);
    let fit = j["max_seq_len_that_fits"].as_u64().unwrap();
    assert!(fit > 0 && fit < 2048);
    // The largest S reported is exactly the boundary.
    let at = |s: u64| {
        let s = s.to_string();
        hf2coreml(
            &[
                &["budget", d, "--memory-limit", "40MB", "--max-seq-len", &s][..],
                &bare,
            ]
            .concat(),
        )
        .status
        .code()
    };
    assert_eq!(at(fit), Some(0));
    assert_eq!(at(fit + 1), Some(1));
    assert_refused(
        &hf2coreml(&["budget", d, "--device", "nokia-3310", "--max-seq-len", "16"]),
        &["nokia-3310"],
    );
    assert_refused(
        &hf2coreml(&[
            "budget",
            d,
            "--memory-limit",
            "1GB",
            "--safety-margin",
            "1.5",
        ]),
        &["1.5"],
    );
}

#[test]
fn budget_lists_devices() {
    let out = hf2coreml(&["budget", "--list-devices"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for id in [
        "iphone-15",
        "iphone-15-pro",
        "iphone-16",
        "iphone-16-pro",
        "iphone-17-pro",
        "mac-m1-16gb",
    ] {
        assert!(text.contains(id), "{id} missing");
    }
}

#[test]
fn budget_devices_file_override() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let devices = dir.path().join("devices.toml");
    std::fs::write(
        &devices,
        "[devices.watch]\nname = 'A watch'\nram = '1 GiB'\napp_limit = '10 KiB'\napp_limit_increased = '200 KiB'\n",
    )
    .unwrap();
    let d = dir.path().to_str().unwrap();
    let dev = devices.to_str().unwrap();
    let out = hf2coreml(&[
        "budget",
        d,
        "--devices",
        dev,
        "--device",
        "watch",
        "--max-seq-len",
        "64",
    ]);
    assert_eq!(out.status.code(), Some(1), "tiny limit: does not fit");
    std::fs::write(
        &devices,
        "[devices.watch]\nname = 'x'\nram = 'lots'\napp_limit='1'\napp_limit_increased='1'\n",
    )
    .unwrap();
    assert_refused(
        &hf2coreml(&["budget", d, "--devices", dev, "--device", "watch"]),
        &["devices.toml"],
    );
}

// ---- bad input ---------------------------------------------------------------------------

#[test]
fn missing_directory_and_config() {
    let empty = tempfile::tempdir().unwrap();
    assert_refused(
        &hf2coreml(&["inspect", empty.path().to_str().unwrap()]),
        &["no config.json"],
    );
    assert_refused(
        &hf2coreml(&["inspect", "/nonexistent/model"]),
        &["/nonexistent/model"],
    );
}

#[test]
fn pickle_only_is_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"not really").unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        TinyModel::llama().config_json().to_string(),
    )
    .unwrap();
    let out = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert_refused(&out, &["pytorch_model.bin"]);
    let err = stderr(&out);
    assert!(err.contains("arbitrary code"), "{err}");
    assert!(
        err.contains("hint:") && err.contains("safetensors"),
        "{err}"
    );
}

#[test]
fn unknown_architecture() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let cfg = dir.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("LlamaForCausalLM", "GPTNeoXForCausalLM")).unwrap();
    let out = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert_refused(&out, &["GPTNeoXForCausalLM"]);
    assert_refused(&out, &["config.json"]);
}

#[test]
fn inconsistent_config() {
    for (key, value, needle) in [
        ("num_key_value_heads", 3, "does not divide"),
        ("num_attention_heads", 5, "does not divide hidden_size"),
    ] {
        let dir = TinyModel::llama().write_temp().unwrap();
        let cfg = dir.path().join("config.json");
        let mut j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        j[key] = value.into();
        if key == "num_attention_heads" {
            j["num_key_value_heads"] = 5.into();
        }
        std::fs::write(&cfg, j.to_string()).unwrap();
        let out = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
        assert_refused(&out, &[needle]);
        assert_refused(&out, &["config.json"]);
    }
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    assert_refused(
        &hf2coreml(&["inspect", dir.path().to_str().unwrap()]),
        &["model.safetensors"],
    );
    // A header length pointing past the end of the file.
    let mut corrupt = bytes.clone();
    corrupt[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&file, &corrupt).unwrap();
    assert_refused(
        &hf2coreml(&["inspect", dir.path().to_str().unwrap()]),
        &["invalid safetensors"],
    );
    std::fs::write(&file, b"").unwrap();
    assert_refused(
        &hf2coreml(&["inspect", dir.path().to_str().unwrap()]),
        &["model.safetensors"],
    );
}

#[test]
fn missing_shard() {
    let dir = TinyModel::qwen2().write_temp().unwrap();
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let out = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert_refused(&out, &["model-00002-of-00002.safetensors"]);
    assert_refused(&out, &["model.safetensors.index.json"]);
}

#[test]
fn missing_tensor_and_wrong_shape() {
    // A checkpoint whose config claims more layers than its weights hold.
    let dir = TinyModel::llama().write_temp().unwrap();
    let cfg = dir.path().join("config.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    j["num_hidden_layers"] = 3.into();
    std::fs::write(&cfg, j.to_string()).unwrap();
    assert_refused(
        &hf2coreml(&["inspect", dir.path().to_str().unwrap()]),
        &["model.layers.2.input_layernorm.weight"],
    );
    // A config whose intermediate size disagrees with the weights.
    j["num_hidden_layers"] = 2.into();
    j["intermediate_size"] = 100.into();
    std::fs::write(&cfg, j.to_string()).unwrap();
    let out = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert_refused(&out, &["model.layers.0.mlp.gate_proj.weight"]);
    assert_refused(&out, &["[100, 64]"]);
    assert_refused(&out, &["[128, 64]"]);
}

#[test]
fn unsupported_dtype_names_tensor() {
    use safetensors::{serialize_to_file, tensor::TensorView, Dtype};
    let dir = TinyModel::llama().write_temp().unwrap();
    let data = vec![0u8; 8 * 4];
    let view = TensorView::new(Dtype::I64, vec![4], &data).unwrap();
    // Replace the weights with a single int64 tensor: the dtype check comes first.
    serialize_to_file(
        vec![("model.embed_tokens.weight", view)],
        None,
        &dir.path().join("model.safetensors"),
    )
    .unwrap();
    let out = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert_refused(&out, &["model.embed_tokens.weight"]);
    assert_refused(&out, &["I64"]);
}

#[test]
fn fixture_architectures_round_trip() {
    for m in [TinyModel::llama(), TinyModel::qwen2(), TinyModel::mistral()] {
        let dir = m.write_temp().unwrap();
        let ckpt = hf2coreml::checkpoint::Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ckpt.spec(), &m.spec());
        let expect_arch = m.architecture;
        assert!(Architecture::ALL.contains(&expect_arch));
        // Values survive the dtype round trip within the dtype's precision.
        let t = ckpt.tensor("model.norm.weight").unwrap();
        assert_eq!(t.shape, &[m.hidden]);
        assert!(t.to_f32().iter().all(|v| (0.3..1.7).contains(v)));
    }
}

#[test]
fn checkpoint_paths_as_users_type_them() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let want = inspect_json(dir.path());
    // A file of the checkpoint stands for its directory.
    for file in ["model.safetensors", "config.json"] {
        let got = inspect_json(&dir.path().join(file));
        assert_eq!(got["parameters"], want["parameters"], "{file}");
    }
    // A Hub id that no Hub cache holds is named as one, with what to do (cli::hub).
    let out = cli(&["inspect", "HuggingFaceTB/SmolLM2-135M-Instruct"])
        .env("HF_HUB_CACHE", dir.path())
        .env("HOME", dir.path())
        .output();
    assert_refused(&out, &["not in the local Hub cache", "hf download"]);
    // Another file is not a checkpoint, and the message says what is.
    let other = dir.path().join("notes.txt");
    std::fs::write(&other, "x").unwrap();
    let out = hf2coreml(&[
        "budget",
        other.to_str().unwrap(),
        "--device",
        "iphone-15-pro",
    ]);
    assert_refused(&out, &["a file, not a checkpoint"]);
}

#[test]
fn a_misspelt_recipe_suggests_the_shipped_one() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = hf2coreml(&["inspect", d, "--recipe", "defualt"]);
    assert_refused(&out, &["did you mean `default`?"]);
    assert_refused(&out, &["hf2coreml recipes"]);
    // `recipes` lists every shipped recipe with what it stores and what it measured.
    let out = hf2coreml(&["recipes", "--json"]);
    let v = json(&out);
    assert_eq!(v["schema"], "hf2coreml.recipes/1");
    let names: Vec<&str> = v["recipes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    for (name, _) in hf2coreml::quant::recipe::BUILTIN_RECIPES {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    let default = &v["recipes"][0];
    assert_eq!(default["name"], "default");
    assert!(default["storage"]
        .as_str()
        .unwrap()
        .starts_with("projections 6-bit LUT"));
    // inspect describes the default recipe as it is (calibrated 6-bit), not as it was.
    let out = hf2coreml(&["inspect", d]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("default recipe") && text.contains("projections 6-bit LUT"),
        "{text}"
    );
}
