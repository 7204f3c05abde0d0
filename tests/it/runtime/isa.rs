//! `HF2COREML_ISA` through the CLI: `run --json` and `inspect` name the kernels' level, every
//! level this CPU has gives the same logits to rounding, and a value naming no level is refused
//! before any work. Levels the CPU lacks are skipped with a message on stderr.

use std::io::Write;
use std::path::Path;

use hf2coreml::runtime::interp::kernels::Avx2Lookup;
use hf2coreml::util::isa::{self, Isa};
use hf2coreml_testkit::{TinyModel, FP16_LOGIT_TOL};

use crate::support::{convert, needs, Cli};

fn run_json(pkg: &Path, npy: &Path, cap: &str) -> serde_json::Value {
    let r = Cli::new()
        .env(isa::ENV, cap)
        .arg("run")
        .arg(pkg)
        .args(["--prompt-ids", "3,10,17", "--max-new-tokens", "3"])
        .args(["--json", "--ignore-eos", "--logits-out"])
        .arg(npy)
        .output();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    serde_json::from_slice(&r.stdout).unwrap()
}

/// The float32 values of a `.npy` `run --logits-out` wrote (little-endian, after its header).
fn npy_values(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn every_level_runs_a_packed_model_and_says_so() {
    needs!(Python);
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    // 4-bit LUTs: the weights the per-level LUT kernels read.
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "16", "--recipe", "data-free-4bit", "-q"])
        .ok();
    let mut logits: Vec<(Isa, Vec<f32>)> = Vec::new();
    for level in Isa::ALL {
        if !level.available() {
            let _ = writeln!(
                std::io::stderr(),
                "run: this CPU lacks {level} (best {}): that level is skipped",
                isa::detected()
            );
            continue;
        }
        let npy = root.path().join(format!("{level}.npy"));
        let run = run_json(&pkg, &npy, level.name());
        assert_eq!(run["kernels"], level.name(), "{run}");
        let lookup = Avx2Lookup::at(level).map(Avx2Lookup::name);
        assert_eq!(run["kernel_lookup4"].as_str(), lookup, "{run}");
        logits.push((level, npy_values(&npy)));

        let out = Cli::new()
            .env(isa::ENV, level.name())
            .args(["inspect", "--json"])
            .arg(&pkg)
            .ok();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["runner"]["kernels"], level.name(), "{v:#}");
        assert_eq!(v["runner"]["cpu_best"], isa::detected().name(), "{v:#}");
        assert_eq!(v["runner"]["lookup4"].as_str(), lookup, "{v:#}");
    }
    // The levels differ in summation order only.
    let (first, base) = &logits[0];
    for (level, got) in &logits[1..] {
        assert_eq!(got.len(), base.len());
        let worst = got
            .iter()
            .zip(base)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < FP16_LOGIT_TOL, "{level} against {first}: {worst}");
    }

    let text = Cli::new()
        .env(isa::ENV, "scalar")
        .arg("inspect")
        .arg(&pkg)
        .ok();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("runner      kernels scalar") && text.contains("HF2COREML_ISA=scalar"),
        "{text}"
    );
}

#[test]
fn a_value_naming_no_level_is_refused_before_any_work() {
    let out = Cli::new()
        .env(isa::ENV, "sse9")
        .args(["run", "missing.mlpackage", "--prompt-ids", "1"])
        .output();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("HF2COREML_ISA=\"sse9\"")
            && (err.contains("avx512, avx2, scalar") || err.contains("neon, scalar")),
        "{err}"
    );
    assert!(!err.contains("missing.mlpackage"), "{err}");
    // A level of the other architecture is refused the same way, naming this one.
    let other = if cfg!(target_arch = "aarch64") {
        "avx2"
    } else {
        "neon"
    };
    let out = Cli::new()
        .env(isa::ENV, other)
        .args(["run", "missing.mlpackage", "--prompt-ids", "1"])
        .output();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let arch = format!("{} CPU", std::env::consts::ARCH);
    assert!(err.contains(other) && err.contains(&arch), "{err}");
}
