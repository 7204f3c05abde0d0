//! `make bench-palettize`: our palettizer against coremltools' k-means on the real SmolLM2-135M
//! projections (HF2COREML_MODEL_DIR, default ~/.cache/hf2coreml/smollm2-135m-instruct), in the
//! same run. Prints total seconds each, the ratio, and per-tensor MSE ratios ours/theirs.
//!
//! Environment:
//! - HF2COREML_BENCH_PYTHON: a Python with coremltools, kmeans1d and scikit-learn (the
//!   Makefile builds one); default `$HF2COREML_PYTHON_ENV/bin/python`, else `python3`.
//! - HF2COREML_BENCH_SKLEARN=1: also run coremltools' scikit-learn path (float32 input), slow.
//! - HF2COREML_BENCH_SYNTHETIC=1: use a random checkpoint of SmolLM2's shapes when the real one
//!   is not imported yet (says so loudly; numbers are then not the ones to report).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use half::f16;
use hf2coreml::arch::Architecture;
use hf2coreml::arch::TensorSlot;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::mil::DType;
use hf2coreml::quant::{self, Decision, Recipe};
use hf2coreml_testkit::TinyModel;
use rayon::prelude::*;

/// The bar for "no worse": ours/theirs MSE at most this (f16 LUT rounding only).
const MSE_RATIO_BAR: f64 = 1.0001;
/// Timing repetitions for our side (it is fast; take the best to skip cold caches and the
/// moments a shared machine's other jobs take a core).
const OUR_REPEATS: usize = 5;

struct Tensor {
    slot: TensorSlot,
    values: Vec<f16>,
}

fn main() -> anyhow::Result<()> {
    let synthetic = std::env::var_os("HF2COREML_BENCH_SYNTHETIC").is_some_and(|v| v == "1");
    let model_dir = std::env::var_os("HF2COREML_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/hf2coreml/smollm2-135m-instruct")
        });
    let _tmp_model;
    let dir: PathBuf = if model_dir.join("config.json").is_file() {
        model_dir
    } else if synthetic {
        eprintln!(
            "!! {} not found: benchmarking a SYNTHETIC checkpoint with SmolLM2-135M shapes",
            model_dir.display()
        );
        let t = smollm_shaped().write_temp()?;
        let p = t.path().to_path_buf();
        _tmp_model = t;
        p
    } else {
        anyhow::bail!(
            "{} is not an imported checkpoint: run `make model` (or set HF2COREML_MODEL_DIR, \
             or HF2COREML_BENCH_SYNTHETIC=1 for a stand-in)",
            model_dir.display()
        );
    };
    let ckpt = Checkpoint::open(&dir)?;
    let recipe = Recipe::default();
    let tensors: Vec<Tensor> = ckpt
        .slots()
        .into_iter()
        .filter(|s| matches!(recipe.decide(s), Decision::Palettize { .. }))
        .map(|slot| {
            let values = ckpt.tensor(&slot.name)?.to_f16();
            Ok(Tensor { slot, values })
        })
        .collect::<anyhow::Result<_>>()?;
    let elements: usize = tensors.iter().map(|t| t.values.len()).sum();
    println!(
        "{}: {} tensors palettized to 4 bits, {} weights",
        dir.display(),
        tensors.len(),
        elements
    );

    // Ours: the same work coremltools' function does (LUT + indices), across tensors.
    let run = |ts: &[Tensor]| -> anyhow::Result<Vec<quant::LutFit>> {
        Ok(ts
            .par_iter()
            .map(|t| quant::palettize_f16(&t.values, 4, None))
            .collect::<Result<_, _>>()?)
    };
    let mut best_par = f64::INFINITY;
    let mut ours = Vec::new();
    for _ in 0..OUR_REPEATS {
        let t0 = Instant::now();
        ours = run(&tensors)?;
        best_par = best_par.min(t0.elapsed().as_secs_f64());
    }
    let single = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let mut best_single = f64::INFINITY;
    for _ in 0..OUR_REPEATS {
        let t0 = Instant::now();
        single.install(|| run(&tensors))?;
        best_single = best_single.min(t0.elapsed().as_secs_f64());
    }

    let work = tempfile::tempdir()?;
    dump(work.path(), &tensors)?;
    let python = python();
    let mut modes = vec!["f16"];
    if std::env::var_os("HF2COREML_BENCH_SKLEARN").is_some_and(|v| v == "1") {
        modes.push("f32");
    }
    println!(
        "ours: {best_par:.3} s on {} threads, {best_single:.3} s on 1 thread (best of {OUR_REPEATS})",
        rayon::current_num_threads()
    );
    for mode in modes {
        let out = work.path().join(format!("coremltools-{mode}.json"));
        eprintln!(
            "running coremltools ({mode} input) with {}",
            python.display()
        );
        let status = Command::new(&python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/bench_kmeans.py"))
            .arg(work.path())
            .args(["--nbits", "4", "--dtype", mode, "--out"])
            .arg(&out)
            .status()?;
        anyhow::ensure!(status.success(), "bench_kmeans.py failed ({status})");
        let theirs: serde_json::Value = serde_json::from_slice(&std::fs::read(&out)?)?;
        report(mode, &tensors, &ours, best_par, best_single, &theirs)?;
    }
    Ok(())
}

fn report(
    mode: &str,
    tensors: &[Tensor],
    ours: &[quant::LutFit],
    best_par: f64,
    best_single: f64,
    theirs: &serde_json::Value,
) -> anyhow::Result<()> {
    let total = theirs["total_seconds"]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("no total_seconds"))?;
    let rows = theirs["tensors"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no tensors"))?;
    anyhow::ensure!(rows.len() == tensors.len(), "tensor count mismatch");
    let path = if mode == "f16" {
        "fp16 input: kmeans1d path"
    } else {
        "fp32 input: scikit-learn path"
    };
    println!("\ncoremltools _get_kmeans_lookup_table_and_weight(4, w), {path}");
    println!("  coremltools total  {total:9.3} s");
    println!(
        "  ours (parallel)    {best_par:9.3} s   {:7.1}× faster",
        total / best_par
    );
    println!(
        "  ours (1 thread)    {best_single:9.3} s   {:7.1}× faster",
        total / best_single
    );
    for (key, label) in [
        (
            "mse_fp16_lut",
            "their LUT rounded to fp16 (what a package stores)",
        ),
        ("mse_float_lut", "their float64 LUT"),
    ] {
        let mut ratios = Vec::with_capacity(rows.len());
        for ((t, o), r) in tensors.iter().zip(ours).zip(rows) {
            anyhow::ensure!(r["name"] == t.slot.name.as_str(), "order mismatch");
            let m = r[key].as_f64().ok_or_else(|| anyhow::anyhow!("no {key}"))?;
            ratios.push((o.mse / m.max(f64::MIN_POSITIVE), t.slot.name.as_str()));
        }
        let (max, worst) = ratios
            .iter()
            .copied()
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap_or((f64::NAN, ""));
        let mean = ratios.iter().map(|r| r.0).sum::<f64>() / ratios.len().max(1) as f64;
        let over = ratios.iter().filter(|r| r.0 > MSE_RATIO_BAR).count();
        println!(
            "  MSE ours/theirs vs {label}: max {max:.6} ({worst}), mean {mean:.6}, {over} tensors above {MSE_RATIO_BAR}"
        );
    }
    Ok(())
}

fn dump(dir: &Path, tensors: &[Tensor]) -> anyhow::Result<()> {
    let mut manifest = Vec::new();
    let mut bytes = Vec::new();
    let mut offset = 0usize;
    for t in tensors {
        manifest.push(serde_json::json!({
            "name": t.slot.name, "shape": t.slot.shape, "offset": offset, "numel": t.values.len(),
        }));
        offset += t.values.len();
        bytes.extend(t.values.iter().flat_map(|v| v.to_le_bytes()));
    }
    std::fs::write(dir.join("tensors.f16"), bytes)?;
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec(&serde_json::Value::Array(manifest))?,
    )?;
    Ok(())
}

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("HF2COREML_BENCH_PYTHON") {
        return PathBuf::from(p);
    }
    if let Some(env) = std::env::var_os("HF2COREML_PYTHON_ENV") {
        return PathBuf::from(env).join("bin/python");
    }
    PathBuf::from("python3")
}

/// SmolLM2-135M's shapes with random weights (only for HF2COREML_BENCH_SYNTHETIC=1).
fn smollm_shaped() -> TinyModel {
    TinyModel {
        architecture: Architecture::Llama,
        layers: 30,
        hidden: 576,
        intermediate: 1536,
        heads: 9,
        kv_heads: 3,
        head_dim: None,
        vocab: 256,
        tied: true,
        dtype: DType::BF16,
        shards: 1,
        transformers5: false,
        rope_scaling: None,
        rope_theta: 100_000.0,
        seed: 42,
        scale: 0.05,
        ..TinyModel::llama()
    }
}
