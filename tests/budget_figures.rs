//! `budget`'s figures, each computed by hand from the tiny llama's shapes and the device table:
//! the weights per storage, the KV cache, one step's working set, the runtime allowance, the
//! safety margin, the limit with and without the increased-memory-limit entitlement, and the
//! largest S that fits (found by bisection in the product, by algebra here).

use std::path::Path;
use std::process::Command;

use hf2coreml::testing::TinyModel;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_hf2coreml");

// TinyModel::llama(): 2 layers, hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, vocab 96,
// tied embeddings.
const L: u64 = 2;
const HIDDEN: u64 = 64;
const INTER: u64 = 128;
const HEADS: u64 = 4;
const KV_HEADS: u64 = 2;
const HEAD_DIM: u64 = 16;
const VOCAB: u64 = 96;

/// Elements of the seven projections of one layer.
const PROJ_PER_LAYER: u64 = HIDDEN * HEADS * HEAD_DIM       // q
    + 2 * HIDDEN * KV_HEADS * HEAD_DIM                       // k, v
    + HEADS * HEAD_DIM * HIDDEN                              // o
    + 3 * HIDDEN * INTER; // gate, up, down
/// Elements kept fp16 by every shipped recipe: the (tied) embedding and the norms.
const FP16_ELEMENTS: u64 = VOCAB * HIDDEN + L * 2 * HIDDEN + HIDDEN;

fn budget(dir: &Path, args: &[&str]) -> (Option<i32>, Value) {
    let out = Command::new(BIN)
        .arg("budget")
        .arg(dir)
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stderr));
    });
    (out.status.code(), json)
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no `{key}` in {v:#}"))
}

/// KV cache: keys and values, every layer and KV head, S rows of fp16.
fn kv(s: u64) -> u64 {
    2 * L * KV_HEADS * HEAD_DIM * s * 2
}

/// One decode step (Q = 1): fp16 logits, the cache updates, attention scores and probabilities
/// over S + 1 positions for every head, one layer's keys and values with the new row, and the
/// hidden-state temporaries (4 × hidden, 3 × intermediate).
fn working_set(s: u64) -> u64 {
    let logits = VOCAB * 2;
    let updates = 2 * L * KV_HEADS * HEAD_DIM * 2;
    let scores = 2 * HEADS * (s + 1) * 2;
    let layer_kv = 2 * HEADS * (s + 1) * HEAD_DIM * 2;
    let hidden = (4 * HIDDEN + 3 * INTER) * 2;
    logits + updates + scores + layer_kv + hidden
}

#[test]
fn figures_match_the_hand_computation_on_a_device() {
    let dir = TinyModel {
        context: 2048,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let gib = 1u64 << 30;
    let overhead = 150 << 20;

    // Everything fp16.
    let (code, b) = budget(dir.path(), &["--device", "iphone-15", "--keep-fp16", "*"]);
    assert_eq!(code, Some(0), "{b:#}");
    let weights = (L * PROJ_PER_LAYER + FP16_ELEMENTS) * 2;
    assert_eq!(u(&b, "weights_bytes"), weights);
    assert_eq!(u(&b, "kv_cache_bytes"), kv(512));
    assert_eq!(u(&b, "working_set_bytes"), working_set(512));
    assert_eq!(u(&b, "runtime_overhead_bytes"), overhead);
    let total = weights + kv(512) + working_set(512) + overhead;
    assert_eq!(u(&b, "total_bytes"), total);
    // iPhone 15: 3.0 GiB, of which 10% is never planned into.
    assert_eq!(u(&b, "limit_bytes"), 3 * gib);
    let usable = (3 * gib) * 9 / 10;
    assert_eq!(u(&b, "usable_bytes"), usable);
    assert_eq!(
        b["headroom_bytes"].as_i64().unwrap(),
        usable as i64 - total as i64
    );
    assert_eq!(b["fits"], true);

    // Data-free 4-bit: every projection 4 bits per weight plus a 16-entry fp16 LUT each.
    let (_, b4) = budget(
        dir.path(),
        &["--device", "iphone-15", "--recipe", "data-free-4bit"],
    );
    let weights4 = L * (PROJ_PER_LAYER * 4 / 8 + 7 * 16 * 2) + FP16_ELEMENTS * 2;
    assert_eq!(u(&b4, "weights_bytes"), weights4);

    // The entitlement's limit: 4.0 GiB on this device.
    let (_, bi) = budget(
        dir.path(),
        &[
            "--device",
            "iphone-15",
            "--keep-fp16",
            "*",
            "--increased-memory-limit",
        ],
    );
    assert_eq!(u(&bi, "limit_bytes"), 4 * gib);
    assert_eq!(u(&bi, "usable_bytes"), 4 * gib * 9 / 10);
    assert_eq!(bi["increased_memory_limit"], true);
}

#[test]
fn the_largest_s_that_fits_is_exact_at_the_edge() {
    let dir = TinyModel {
        context: 2048,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let weights = (L * PROJ_PER_LAYER + FP16_ELEMENTS) * 2;
    // A device whose usable memory (90% of its limit, no runtime allowance) holds S = 1000 with
    // 100 bytes to spare and not S = 1001: total(S) grows by 528 bytes per position here.
    let total = |s: u64| weights + kv(s) + working_set(s);
    assert!(total(1001) - total(1000) > 100);
    let usable = total(1000) + 100;
    // floor(0.9 × limit) steps by 0 or 1, so some limit gives exactly `usable`.
    let limit = (usable..)
        .find(|&l| (l as f64 * 0.9) as u64 == usable)
        .unwrap();
    let table = dir.path().join("devices.toml");
    std::fs::write(
        &table,
        format!(
            "[defaults]\nsafety_margin = 0.1\nruntime_overhead = \"0\"\n\n\
             [devices.tight]\nname = \"tight\"\nram = \"1 GiB\"\napp_limit = \"{limit}\"\n\
             app_limit_increased = \"{limit}\"\n"
        ),
    )
    .unwrap();
    let args = |s: &'static str| {
        [
            "--devices",
            table.to_str().unwrap(),
            "--device",
            "tight",
            "--keep-fp16",
            "*",
            "--max-seq-len",
            s,
        ]
        .map(str::to_string)
    };
    let run = |s: &'static str| {
        let a = args(s);
        budget(
            dir.path(),
            &a.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    };
    let (code, b) = run("1000");
    assert_eq!(code, Some(0), "{b:#}");
    assert_eq!(u(&b, "usable_bytes"), usable);
    assert_eq!(u(&b, "total_bytes"), total(1000));
    assert_eq!(u(&b, "max_seq_len_that_fits"), 1000);
    assert_eq!(b["headroom_bytes"].as_i64().unwrap(), 100);
    let (code, b) = run("1001");
    assert_eq!(code, Some(1), "one position more does not fit: {b:#}");
    assert_eq!(b["fits"], false);
    assert_eq!(u(&b, "max_seq_len_that_fits"), 1000);
}

#[test]
fn no_s_beyond_the_models_context() {
    let dir = TinyModel {
        context: 256,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let (code, b) = budget(
        dir.path(),
        &["--device", "iphone-15", "--max-seq-len", "256"],
    );
    assert_eq!(code, Some(0), "{b:#}");
    // Memory would hold a million positions; the model was trained on 256.
    assert_eq!(u(&b, "max_seq_len_that_fits"), 256);
    let o = Command::new(BIN)
        .arg("budget")
        .arg(dir.path())
        .args(["--device", "iphone-15", "--max-seq-len", "257"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("max_position_embeddings") && err.contains("256"),
        "{err}"
    );
}
