//! Palettizing whole checkpoints, recipe files, and the `palettize` command.

use std::path::Path;

use half::f16;
use hf2coreml::arch::Role;
use hf2coreml::budget;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::mil::DType;
use hf2coreml::quant::{self, Decision, QuantError, Recipe};
use hf2coreml_testkit::{Blob, TinyModel};

use crate::support::cli;

fn no_progress(_: &quant::TensorReport) {}

#[test]
fn default_recipe_palettizes_projections_and_sizes_match_storage() {
    for model in [TinyModel::llama(), TinyModel::qwen2(), TinyModel::mistral()] {
        let dir = model.write_temp().unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let recipe = Recipe::default();
        let out = quant::palettize_checkpoint(&ckpt, &recipe, &no_progress).unwrap();
        assert_eq!(out.tensors.len(), ckpt.slots().len());
        assert_eq!(out.report.tensors.len(), out.tensors.len());
        for (t, line) in out.tensors.iter().zip(&out.report.tensors) {
            assert_eq!(t.slot.name, line.name);
            assert_eq!(
                t.palettized.is_some(),
                t.slot.role.is_projection(),
                "{}",
                t.slot.name
            );
            assert_eq!(
                line.bytes_after,
                recipe.storage(&t.slot).bytes(t.slot.numel())
            );
            let Some(p) = &t.palettized else {
                assert!(line.mse.is_none());
                continue;
            };
            // The report's sizes are the bytes a package stores: packed indices + one LUT.
            let stored = p.packed_indices.len() + p.luts.iter().map(|l| l.len() * 2).sum::<usize>();
            assert_eq!(stored as u64, line.bytes_after);
            // The reported MSE is the error of lut[indices] against the f16 source.
            let src = ckpt.tensor(&t.slot.name).unwrap().to_f16();
            let deq = p.dequantize();
            let mse = src
                .iter()
                .zip(&deq)
                .map(|(a, b)| (a.to_f64() - b.to_f64()).powi(2))
                .sum::<f64>()
                / src.len() as f64;
            assert!((mse - p.mse).abs() <= 1e-12 * mse);
            assert_eq!(line.mse, Some(p.mse));
            // Random Gaussian weights at 4 bits: about 20 dB; far below means a broken fit.
            assert!(p.snr_db > 15.0, "{}: {}", t.slot.name, p.snr_db);
        }
        let tot = &out.report.totals;
        assert_eq!(
            tot.bytes_after,
            budget::weights_bytes(&ckpt.slots(), |s| recipe.storage(s))
        );
        assert!(tot.min_snr_db.unwrap() <= tot.mean_snr_db.unwrap());
        assert!(tot.bits_per_weight > 4.0 && tot.bits_per_weight < 16.0);
    }
}

#[test]
fn keep_everything_fp16_palettizes_nothing() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let recipe = Recipe::default().keep_fp16("*").unwrap();
    let out = quant::palettize_checkpoint(&ckpt, &recipe, &no_progress).unwrap();
    assert!(out.tensors.iter().all(|t| t.palettized.is_none()));
    assert_eq!(out.report.totals.palettized_tensors, 0);
    assert!(out.report.totals.min_snr_db.is_none());
}

#[test]
fn progress_reports_every_palettized_tensor() {
    let dir = TinyModel::qwen2().write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let seen = std::sync::Mutex::new(Vec::new());
    let out = quant::palettize_checkpoint(&ckpt, &Recipe::default(), &|l| {
        seen.lock().unwrap().push(l.name.clone())
    })
    .unwrap();
    let mut seen = seen.into_inner().unwrap();
    seen.sort();
    let mut want: Vec<String> = out
        .tensors
        .iter()
        .filter(|t| t.palettized.is_some())
        .map(|t| t.slot.name.clone())
        .collect();
    want.sort();
    assert_eq!(seen, want);
}

#[test]
fn non_finite_weights_are_errors_naming_the_tensor() {
    let model = TinyModel {
        dtype: DType::F32,
        ..TinyModel::llama()
    };
    let dir = model.write_temp().unwrap();
    let bad = "model.layers.1.mlp.up_proj.weight";
    rewrite_with(dir.path(), bad, 1e6); // beyond the f16 range: Inf once stored as f16
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = quant::palettize_checkpoint(&ckpt, &Recipe::default(), &no_progress).unwrap_err();
    assert!(matches!(err, QuantError::Tensor { ref tensor, .. } if tensor == bad));
    assert!(err.to_string().contains(bad), "{err}");
}

/// Rewrite an f32 single-file checkpoint with element 5 of `name` set to `value`.
fn rewrite_with(dir: &Path, name: &str, value: f32) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut blobs = Vec::new();
    for (n, view) in st.tensors() {
        let mut vals: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if n == name {
            vals[5] = value;
        }
        blobs.push((
            n.clone(),
            Blob::new(DType::F32, view.shape().to_vec(), &vals),
        ));
    }
    safetensors::serialize_to_file(blobs, None, &path).unwrap();
}

#[test]
fn every_shipped_recipe_parses_and_names_roles_it_knows() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/recipes");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let r = Recipe::from_file(&p).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(r.origin(), p.display().to_string());
            n += 1;
        }
    }
    assert!(n >= 3);
}

#[test]
fn recipe_file_errors_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("mine.toml");
    std::fs::write(&p, "[roles]\nq = { palettize = { nbits = 4, bits = 2 } }\n").unwrap();
    let e = Recipe::from_file(&p).unwrap_err().to_string();
    assert!(e.contains("mine.toml") && e.contains("bits"), "{e}");
    let missing = tmp.path().join("absent.toml");
    let e = Recipe::from_file(&missing).unwrap_err().to_string();
    assert!(e.contains("absent.toml"), "{e}");
}

#[test]
fn recipe_resolution_on_real_slot_names() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("r.toml");
    std::fs::write(
        &p,
        r#"
default = "fp16"
[roles]
down = { palettize = { nbits = 2 } }
up = { palettize = { nbits = 4 } }
[[tensors]]
glob = "model.layers.0.mlp.*"
decision = { palettize = { nbits = 8 } }
"#,
    )
    .unwrap();
    let r = Recipe::from_file(&p).unwrap();
    let spec = TinyModel::llama().spec();
    for slot in hf2coreml::arch::expected_tensors(&spec) {
        let want = match (slot.layer, slot.role) {
            (Some(0), Role::Gate | Role::Up | Role::Down) => Some(8),
            (_, Role::Down) => Some(2),
            (_, Role::Up) => Some(4),
            _ => None,
        };
        assert_eq!(r.decide(&slot).nbits(), want, "{}", slot.name);
    }
    let r = r.with_nbits(6).unwrap();
    for slot in hf2coreml::arch::expected_tensors(&spec) {
        assert!(matches!(
            r.decide(&slot),
            Decision::Fp16 | Decision::Palettize { nbits: 6, .. }
        ));
    }
}

#[test]
fn palettize_command_prints_the_report_and_writes_json() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let json = dir.path().join("report.json");
    let out = cli(&["palettize"])
        .arg(dir.path())
        .args([
            "--nbits",
            "6",
            "--keep-fp16",
            "*.down_proj.weight",
            "--json",
        ])
        .arg(&json)
        .output();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n = TinyModel::llama().spec().num_hidden_layers;
    let total = hf2coreml::arch::expected_tensors(&TinyModel::llama().spec()).len();
    assert!(
        stdout.contains(&format!("[ 1/{total}] model.embed_tokens.weight")),
        "{stdout}"
    );
    assert!(stdout.contains("bits per weight"), "{stdout}");
    assert!(stdout.contains("SNR: mean"), "{stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), total);
    let lut6 = tensors.iter().filter(|t| t["decision"] == "lut6").count();
    assert_eq!(lut6, n * 6); // q k v o gate up; down kept fp16
    for t in tensors {
        for key in ["name", "shape", "decision", "nbits", "mse", "snr_db"] {
            assert!(t.get(key).is_some(), "{key} missing in {t}");
        }
    }
}

#[test]
fn palettize_command_rejects_bad_flags_with_exit_2() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let out = cli(&["palettize"])
        .arg(dir.path())
        .args(["--nbits", "5"])
        .output();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nbits 5"));
}

#[test]
fn budget_and_inspect_size_weights_with_the_recipe() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let weights = |extra: &[&str]| -> u64 {
        let out = cli(&["budget"])
            .arg(dir.path())
            .args(["--memory-limit", "8GiB", "--json"])
            .args(extra)
            .output();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["weights_bytes"].as_u64().unwrap()
    };
    let default = weights(&[]);
    let two = weights(&["--nbits", "2"]);
    let fp16 = weights(&["--keep-fp16", "*"]);
    let spec = TinyModel::llama().spec();
    let slots = hf2coreml::arch::expected_tensors(&spec);
    assert_eq!(
        fp16,
        budget::weights_bytes(&slots, |_| hf2coreml::quant::Storage::Fp16)
    );
    // The default recipe is calibrated: its side constants (row scales, rotations) count too.
    assert_eq!(default, Recipe::default().weights_bytes(&slots));
    assert!(default > budget::weights_bytes(&slots, |s| Recipe::default().storage(s)));
    assert!(two < default && default < fp16);

    let out = cli(&["inspect"])
        .arg(dir.path())
        .args(["--json", "--nbits", "8"])
        .output();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let eight = Recipe::default().with_nbits(8).unwrap();
    assert_eq!(
        v["recipe_bytes"].as_u64().unwrap(),
        eight.weights_bytes(&slots)
    );
}

#[test]
fn f16_source_values_survive_exactly_when_few() {
    // A tensor with ≤ 16 distinct values is stored exactly at 4 bits.
    let vals: Vec<f16> = (0..64)
        .map(|i| f16::from_f32((i % 7) as f32 * 0.125))
        .collect();
    let p = quant::palettize_f16(&vals, 4, None).unwrap();
    assert_eq!(p.dequantize(), vals);
}
