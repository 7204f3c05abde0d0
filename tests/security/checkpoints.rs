//! Hostile and broken checkpoints, through the binary: safetensors files and shard indexes,
//! config.json, weights, and checkpoints in a format that is never opened (pickles). Every
//! case exits 2 with a message naming the file and the problem, never panics, and leaves no
//! output behind.
//!
//! Cases covered in tests/it are not repeated: cli::checkpoint (missing config, pickle-only,
//! unknown architecture, heads not dividing, truncated file, missing shard, missing tensor,
//! wrong shape, unsupported dtype), mlpackage (library-level package errors), gguf::import and
//! gguf::cli (GGUF metadata and tensors).

use std::path::Path;

use half::bf16;
use hf2coreml_testkit::TinyModel;

use super::{checkpoint, convert_refused, write_model, Scratch};
use crate::support::{assert_refused, hf2coreml};

/// Split a safetensors file into its header JSON and data section.
fn split_safetensors(bytes: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
        bytes[8 + n..].to_vec(),
    )
}

fn join_safetensors(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let h = header.to_string().into_bytes();
    let mut v = (h.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&h);
    v.extend_from_slice(data);
    v
}

/// Rewrite the checkpoint's model.safetensors header with `edit`.
fn edit_header(ckpt: &Path, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<u8>)) {
    let file = ckpt.join("model.safetensors");
    let (mut header, mut data) = split_safetensors(&std::fs::read(&file).unwrap());
    edit(&mut header, &mut data);
    std::fs::write(&file, join_safetensors(&header, &data)).unwrap();
}

fn edit_config(ckpt: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let file = ckpt.join("config.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    edit(&mut j);
    std::fs::write(&file, j.to_string()).unwrap();
}

#[test]
fn safetensors_header_length_past_the_end_of_the_file() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let file = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let past = bytes.len() as u64 + 10;
    bytes[..8].copy_from_slice(&past.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    convert_refused(&s, &ckpt, &["model.safetensors", "runs past the end"]);
}

#[test]
fn safetensors_header_length_absurd() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let file = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    convert_refused(
        &s,
        &ckpt,
        &["model.safetensors", "exceeds the 16777216-byte limit"],
    );
}

#[test]
fn safetensors_header_not_json() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let file = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8..16].copy_from_slice(b"<html>  ");
    std::fs::write(&file, &bytes).unwrap();
    convert_refused(&s, &ckpt, &["model.safetensors", "invalid JSON in header"]);
}

#[test]
fn safetensors_overlapping_offsets() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, _| {
        // Two 64-element bf16 norms: point the second at the first one's bytes.
        let a = h["model.norm.weight"]["data_offsets"].clone();
        h["model.layers.0.input_layernorm.weight"]["data_offsets"] = a;
    });
    convert_refused(&s, &ckpt, &["model.safetensors", "overlap"]);
}

#[test]
fn safetensors_offsets_out_of_range() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, data| {
        let len = data.len() as u64;
        h["model.norm.weight"]["data_offsets"] = serde_json::json!([len + 1000, len + 1128]);
    });
    convert_refused(
        &s,
        &ckpt,
        &["model.safetensors", "model.norm.weight", "past the"],
    );
}

#[test]
fn safetensors_shape_and_byte_count_disagree() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, _| {
        h["model.norm.weight"]["shape"] = serde_json::json!([65]);
    });
    convert_refused(
        &s,
        &ckpt,
        &["model.safetensors", "model.norm.weight", "needs 130 bytes"],
    );
}

#[test]
fn shard_index_not_json() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": ",
    )
    .unwrap();
    convert_refused(&s, &dir, &["model.safetensors.index.json", "EOF"]);
}

#[test]
fn shard_index_names_a_file_outside_the_checkpoint() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    let idx = dir.join("model.safetensors.index.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    j["weight_map"]["model.norm.weight"] = "../../etc/passwd".into();
    std::fs::write(&idx, j.to_string()).unwrap();
    convert_refused(
        &s,
        &dir,
        &["model.safetensors.index.json", "not a plain file name"],
    );
}

/// The Safety section's cap of 2^20 tensors per checkpoint. One file cannot reach it (its
/// header is capped at 16 MiB, about 270,000 tensors), so it is reached across shards: four
/// more shards of 262,145 empty tensors each, listed in the index, are refused by the count,
/// naming the shard where it was passed.
#[test]
fn more_tensors_than_the_cap_across_shards() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    let idx = dir.join("model.safetensors.index.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    let per_shard = (1usize << 20) / 4 + 1;
    for n in 0..4 {
        let mut header = String::from("{");
        for i in 0..per_shard {
            if i > 0 {
                header.push(',');
            }
            header.push_str(&format!(
                r#""x{n}_{i}":{{"dtype":"F16","shape":[0],"data_offsets":[0,0]}}"#
            ));
        }
        header.push('}');
        let name = format!("extra-{n}.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(dir.join(&name), bytes).unwrap();
        j["weight_map"][format!("x{n}_0")] = name.into();
    }
    std::fs::write(&idx, j.to_string()).unwrap();
    convert_refused(&s, &dir, &["extra-", "more than 1048576 tensors in all"]);
}

#[test]
fn a_tensor_in_two_shards() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    // Copy one tensor of shard 1 into shard 2 as well.
    let f1 = dir.join("model-00001-of-00002.safetensors");
    let f2 = dir.join("model-00002-of-00002.safetensors");
    let (h1, d1) = split_safetensors(&std::fs::read(&f1).unwrap());
    let (mut h2, mut d2) = split_safetensors(&std::fs::read(&f2).unwrap());
    let (name, info) = h1
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v.clone()))
        .unwrap();
    let off = info["data_offsets"].as_array().unwrap();
    let (a, b) = (off[0].as_u64().unwrap(), off[1].as_u64().unwrap());
    let start = d2.len() as u64;
    d2.extend_from_slice(&d1[a as usize..b as usize]);
    let mut copy = info.clone();
    copy["data_offsets"] = serde_json::json!([start, start + (b - a)]);
    h2[&name] = copy;
    std::fs::write(&f2, join_safetensors(&h2, &d2)).unwrap();
    convert_refused(
        &s,
        &dir,
        &[
            &name,
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "both",
        ],
    );
}

#[test]
fn config_not_json() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    std::fs::write(ckpt.join("config.json"), "architectures: [Llama]").unwrap();
    convert_refused(&s, &ckpt, &["config.json", "not valid config JSON"]);
}

#[test]
fn config_missing_field() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| {
        j.as_object_mut().unwrap().remove("hidden_size");
    });
    convert_refused(&s, &ckpt, &["config.json", "missing `hidden_size`"]);
}

#[test]
fn config_zero_size() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["num_hidden_layers"] = 0.into());
    convert_refused(
        &s,
        &ckpt,
        &["config.json", "`num_hidden_layers` must be positive"],
    );
}

#[test]
fn config_negative_size() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["vocab_size"] = (-96).into());
    convert_refused(&s, &ckpt, &["config.json", "-96"]);
}

#[test]
fn config_absurd_size() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["hidden_size"] = 1_000_000_000_000u64.into());
    convert_refused(&s, &ckpt, &["config.json", "exceeds the limit"]);
}

#[test]
fn config_odd_head_dim() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["head_dim"] = 15.into());
    convert_refused(&s, &ckpt, &["config.json", "must be even"]);
}

#[test]
fn config_rope_scaling_factor_negative() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| {
        j["rope_scaling"] = serde_json::json!({"type": "linear", "factor": -2.0})
    });
    convert_refused(
        &s,
        &ckpt,
        &["config.json", "`factor` (-2) must be a positive"],
    );
}

#[test]
fn nan_weight_in_bf16() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, data| {
        let start = h["model.norm.weight"]["data_offsets"][0].as_u64().unwrap() as usize;
        let at = start + 2 * 5;
        data[at..at + 2].copy_from_slice(&bf16::NAN.to_le_bytes());
    });
    convert_refused(
        &s,
        &ckpt,
        &["model.safetensors", "model.norm.weight", "NaN at element 5"],
    );
}

#[test]
fn infinite_weight_in_f32() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::mistral());
    edit_header(&dir, |h, data| {
        let name = "model.layers.1.mlp.down_proj.weight";
        let start = h[name]["data_offsets"][0].as_u64().unwrap() as usize;
        data[start..start + 4].copy_from_slice(&f32::NEG_INFINITY.to_le_bytes());
    });
    convert_refused(
        &s,
        &dir,
        &[
            "model.safetensors",
            "model.layers.1.mlp.down_proj.weight",
            "-inf at element 0",
        ],
    );
}

#[test]
fn pickle_only_checkpoints_are_refused_unopened() {
    for file in ["pytorch_model.bin", "model.pt", "model.pth", "model.ckpt"] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            TinyModel::llama().config_json().to_string(),
        )
        .unwrap();
        // Not a pickle at all: a loader that opened it would fail differently.
        std::fs::write(dir.path().join(file), b"not a pickle").unwrap();
        let d = dir.path().to_str().unwrap();
        assert_refused(&hf2coreml(&["inspect", d]), &[file, "pickle"]);
        assert_refused(
            &hf2coreml(&["budget", d, "--device", "iphone-15"]),
            &[file, "pickle"],
        );
        let elsewhere = tempfile::tempdir().unwrap();
        let out = elsewhere.path().join("o.mlpackage");
        let o = hf2coreml(&["convert", d, "-o", out.to_str().unwrap()]);
        assert_refused(&o, &[file, "pickle"]);
        assert!(!out.exists());
    }
}

#[test]
fn config_json_over_1_mib_is_refused() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let mut config = TinyModel::llama().config_json();
    // Valid JSON, one byte over the cap.
    let pad = (1usize << 20) - config.to_string().len() + 1 - ",\"pad\":\"\"".len();
    config["pad"] = "x".repeat(pad).into();
    let text = config.to_string();
    assert_eq!(text.len(), (1 << 20) + 1);
    std::fs::write(dir.path().join("config.json"), text).unwrap();
    let o = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    assert_refused(&o, &["config.json", "too large"]);
    // At the cap exactly it is read (and the unknown field is then judged on its own).
    let mut config = TinyModel::llama().config_json();
    config["pad"] = "x".repeat(pad - 1).into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let o = hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("larger than") && !err.contains("too large"),
        "{err}"
    );
}

/// A tied model may store `lm_head.weight` as a copy of the embedding (transformers ignores
/// it); a stored head that differs is a model that was untied, refused rather than dropped.
#[test]
fn a_stored_lm_head_that_differs_from_the_tied_embedding_is_refused() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let copy_embedding = |h: &mut serde_json::Value, data: &mut Vec<u8>| {
        let e = h["model.embed_tokens.weight"].clone();
        let [a, b] = [0, 1].map(|i| e["data_offsets"][i].as_u64().unwrap() as usize);
        let start = data.len();
        data.extend_from_within(a..b);
        let mut head = e.clone();
        head["data_offsets"] = serde_json::json!([start, start + b - a]);
        h["lm_head.weight"] = head;
    };
    edit_header(&ckpt, copy_embedding);
    let o = hf2coreml(&[std::ffi::OsStr::new("inspect"), ckpt.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    edit_header(&ckpt, |h, data| {
        let at = h["lm_head.weight"]["data_offsets"][0].as_u64().unwrap() as usize;
        data[at] ^= 1;
    });
    convert_refused(
        &s,
        &ckpt,
        &[
            "model.safetensors",
            "`lm_head.weight` differs from `model.embed_tokens.weight`",
            "tie_word_embeddings",
        ],
    );
}
