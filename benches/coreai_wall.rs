//! What the wall around Apple's runtime costs per step: Core AI assets run in a child process
//! (src/aimodel/worker.rs), so each step's inputs (the whole static KV cache) cross a pipe to
//! it and its outputs cross back. The worker times the runtime's own call; the rest of a step's
//! wall time is the wall's. Printed: per-step wall time, the runtime's share, the overhead in
//! ms and as a fraction of the step, and what loading the asset (spawn, imports, compile)
//! costs.
//!
//! The asset: `HF2COREML_BENCH_ASSET`, or SmolLM2-135M (HF2COREML_MODEL_DIR, default
//! ~/.cache/hf2coreml/smollm2-135m-instruct) converted here with data-free 4-bit at S 512
//! (two 5.6 MiB caches in, their updates out, per step), or the tiny test model when the real
//! one is absent.
//!
//! Run: `cargo bench --bench coreai_wall` (needs the Python environment: `make setup`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use half::f16;
use hf2coreml::aimodel::{Session, Tensor};
use hf2coreml::pyenv::PythonEnv;

const STEPS: usize = 24;

fn asset(scratch: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("HF2COREML_BENCH_ASSET") {
        return PathBuf::from(p);
    }
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let model = std::env::var_os("HF2COREML_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/hf2coreml/smollm2-135m-instruct"));
    let (src, s) = if model.join("config.json").is_file() {
        (model, "512")
    } else {
        eprintln!("the real model is absent: the tiny test model stands in");
        let dir = scratch.join("tiny");
        std::fs::create_dir_all(&dir).unwrap();
        hf2coreml_testkit::TinyModel::llama().write(&dir).unwrap();
        (dir, "64")
    };
    let out = scratch.join("bench.aimodel");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_hf2coreml"))
        .args([
            "convert".as_ref(),
            src.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
        ])
        .args([
            "--target",
            "coreai",
            "--recipe",
            "data-free-4bit",
            "--max-seq-len",
            s,
        ])
        .args(["--quiet"])
        .status()
        .expect("run hf2coreml convert");
    assert!(status.success(), "convert failed");
    out
}

fn zeros(shape: &[usize], dtype: &str) -> Tensor {
    let n = shape.iter().product();
    match dtype {
        "int32" => Tensor::I32(vec![0; n], shape.to_vec()),
        "float32" => Tensor::F32(vec![0.0; n], shape.to_vec()),
        _ => Tensor::F16(vec![f16::ZERO; n], shape.to_vec()),
    }
}

fn main() {
    let scratch = tempfile::tempdir().unwrap();
    let path = asset(scratch.path());
    let env = PythonEnv::discover(None).expect("the Python environment (make setup)");
    let started = Instant::now();
    let session = Session::open(&env, &path).expect("load the asset");
    let functions = session.functions().expect("describe");
    let open = started.elapsed();
    let main = functions
        .iter()
        .find(|f| f.name == "main")
        .expect("a `main` function");
    let inputs: Vec<(String, Tensor)> = main
        .inputs
        .iter()
        .map(|i| (i.name.clone(), zeros(&i.shape, &i.dtype)))
        .collect();
    let in_bytes: usize = inputs
        .iter()
        .map(|(_, t)| {
            t.shape().iter().product::<usize>() * if matches!(t, Tensor::F16(..)) { 2 } else { 4 }
        })
        .sum();
    // One warm-up step (the runtime compiles lazily), then the measured ones.
    session.call("main", inputs.clone()).expect("warm-up step");
    let (mut wall, mut inside, mut out_bytes) = (Duration::ZERO, Duration::ZERO, 0usize);
    for _ in 0..STEPS {
        let t = Instant::now();
        let (out, runtime) = session.call_timed("main", inputs.clone()).expect("step");
        wall += t.elapsed();
        inside += runtime;
        out_bytes = out
            .values()
            .map(|t| {
                t.shape().iter().product::<usize>()
                    * if matches!(t, Tensor::F16(..)) { 2 } else { 4 }
            })
            .sum();
    }
    let per = |d: Duration| d.as_secs_f64() * 1e3 / STEPS as f64;
    let overhead = per(wall) - per(inside);
    println!("asset {}", path.display());
    println!(
        "  load (spawn, imports, runtime load)  {:.0} ms",
        open.as_secs_f64() * 1e3
    );
    println!(
        "  per step over {STEPS}: wall {:.2} ms, runtime {:.2} ms, wall overhead {:.2} ms ({:.1}% of the step)",
        per(wall),
        per(inside),
        overhead,
        100.0 * overhead / per(wall)
    );
    println!(
        "  crossing per step: {:.2} MiB in, {:.2} MiB out",
        in_bytes as f64 / (1 << 20) as f64,
        out_bytes as f64 / (1 << 20) as f64
    );
}
