//! Config fields and tensors hf2coreml does not compute are refused, never ignored:
//! `inspect`, `convert` and `validate --against` exit 2 naming the field or the
//! tensor, and say what is supported.

use std::path::Path;
use std::process::Output;

use hf2coreml::mil::DType;
use hf2coreml_testkit::{Blob, TinyModel};

use crate::support::{assert_refused, hf2coreml};

/// A tiny Llama whose config.json has `edit` applied.
fn with_config(
    edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>),
) -> tempfile::TempDir {
    let m = TinyModel::llama();
    let dir = m.write_temp().unwrap();
    let mut c = m.config_json();
    edit(c.as_object_mut().unwrap());
    std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
    dir
}

fn inspect(dir: &Path) -> Output {
    hf2coreml(&["inspect", dir.to_str().unwrap()])
}

#[test]
fn fields_that_change_the_math_are_refused() {
    use serde_json::json;
    let cases = [
        ("hidden_act", json!("gelu"), "silu"),
        ("hidden_act", json!("gelu_pytorch_tanh"), "silu"),
        ("mlp_bias", json!(true), "false or absent"),
        ("attention_bias", json!(true), "Qwen2ForCausalLM"),
        ("attn_logit_softcapping", json!(50.0), "absent or null"),
        ("final_logit_softcapping", json!(30.0), "absent or null"),
        ("num_local_experts", json!(8), "dense MLP"),
        ("num_experts", json!(64), "dense MLP"),
        ("partial_rotary_factor", json!(0.75), "1 or absent"),
        ("no_rope_layers", json!([1, 1, 1, 0]), "SmolLM3ForCausalLM"),
        ("query_pre_attn_scalar", json!(256), "absent or null"),
        (
            "layer_types",
            json!(["full_attention", "chunked_attention"]),
            "sliding_attention",
        ),
    ];
    for (key, value, supported) in cases {
        let dir = with_config(|c| {
            c.insert(key.into(), value.clone());
        });
        assert_refused(&inspect(dir.path()), &[key, supported]);
    }
    let rope = with_config(|c| {
        c.insert(
            "rope_scaling".into(),
            json!({"rope_type": "longrope", "factor": 4.0}),
        );
    });
    assert_refused(
        &inspect(rope.path()),
        &["rope_scaling", "longrope", "llama3"],
    );
}

/// A copy of the transformers-written Phi-3 fixture with `edit` applied to its config.json.
fn phi3_with(
    fixture: &str,
    edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>),
) -> tempfile::TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(fixture);
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(c.as_object_mut().unwrap());
    std::fs::write(&path, c.to_string()).unwrap();
    dir
}

/// Phi-3: what the converter does not compute exits 2 naming the field; the fused tensors are
/// checked as stored (a `qkv_proj` whose rows do not match the heads is refused by name).
#[test]
fn phi3_variants_not_computed_are_refused() {
    use serde_json::json;
    let ok = phi3_with("phi3_partial", |_| {});
    assert!(inspect(ok.path()).status.success());
    // LongRoPE factors that do not cover the rotated pairs (transformers 4 names them in
    // `rope_scaling`).
    let longrope = phi3_with("phi3", |c| {
        c.remove("rope_parameters");
        c.insert(
            "rope_scaling".into(),
            json!({"type": "longrope", "short_factor": vec![1.0; 3], "long_factor": vec![2.0; 8]}),
        );
    });
    assert_refused(
        &inspect(longrope.path()),
        &["rope_scaling.short_factor", "8 positive numbers"],
    );
    // A package's RoPE tables are fixed: LongRoPE's long factors (past the original context of
    // 128 tokens) cannot be switched to, so a longer context is refused before any work.
    let lr = phi3_with("phi3_longrope", |_| {});
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("m.mlpackage");
    let convert = hf2coreml(&[
        "convert",
        lr.path().to_str().unwrap(),
        "-o",
        pkg.to_str().unwrap(),
        "--max-seq-len",
        "256",
    ]);
    assert_refused(&convert, &["rope_scaling", "longrope", "--max-seq-len 128"]);
    assert!(!pkg.exists());
    // `budget` offers no context a package cannot have.
    let b = hf2coreml(&[
        "budget",
        lr.path().to_str().unwrap(),
        "--device",
        "iphone-15",
        "--max-seq-len",
        "64",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&b.stdout).unwrap();
    assert_eq!(v["max_seq_len_that_fits"], 128, "{v}");
    // A rotary width transformers would round to an odd number of dimensions.
    let odd = phi3_with("phi3_partial", |c| {
        c["rope_parameters"]["partial_rotary_factor"] = json!(0.35);
        c.remove("partial_rotary_factor");
    });
    assert_refused(&inspect(odd.path()), &["partial_rotary_factor", "even"]);
    // More heads than the stored qkv_proj holds rows for.
    let heads = phi3_with("phi3", |c| {
        c.insert("num_key_value_heads".into(), json!(4));
    });
    assert_refused(
        &inspect(heads.path()),
        &["model.layers.0.self_attn.qkv_proj.weight", "192"],
    );
}

#[test]
fn fields_at_their_neutral_values_are_accepted() {
    use serde_json::json;
    let dir = with_config(|c| {
        for (k, v) in [
            ("hidden_act", json!("silu")),
            ("mlp_bias", json!(false)),
            ("attention_bias", json!(false)),
            ("attn_logit_softcapping", json!(null)),
            ("num_local_experts", json!(0)),
            ("partial_rotary_factor", json!(1.0)),
            ("pretraining_tp", json!(1)),
            ("layer_types", json!(["full_attention", "full_attention"])),
            ("sliding_window", json!(4096)),
        ] {
            c.insert(k.into(), v);
        }
    });
    let out = inspect(dir.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `mlp_bias` left out of the config but the biases stored: converting without them would be a
/// different model, so the checkpoint is refused by every command that reads it.
#[test]
fn stored_tensors_the_architecture_does_not_use_are_refused() {
    let m = TinyModel::llama();
    let dir = m.write_temp().unwrap();
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Blob)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let values: Vec<f32> = v
                .data()
                .chunks(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            (name, Blob::new(DType::BF16, v.shape().to_vec(), &values))
        })
        .collect();
    let bias = "model.layers.1.mlp.down_proj.bias";
    tensors.push((bias.into(), Blob::new(DType::BF16, vec![64], &[0.5; 64])));
    // A rotary buffer is recomputed from the config: allowed.
    let inv = "model.layers.0.self_attn.rotary_emb.inv_freq";
    tensors.push((inv.into(), Blob::new(DType::F32, vec![8], &[1.0; 8])));
    safetensors::serialize_to_file(tensors, None, &file).unwrap();

    assert_refused(&inspect(dir.path()), &[bias, "LlamaForCausalLM"]);
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("m.mlpackage");
    let convert = hf2coreml(&[
        "convert",
        dir.path().to_str().unwrap(),
        "-o",
        pkg.to_str().unwrap(),
        "--max-seq-len",
        "32",
    ]);
    assert_refused(&convert, &[bias]);
    assert!(!pkg.exists(), "nothing is written");
}

/// The graph has no windowed mask: a package whose context outgrows the window is refused
/// before any work, naming the field and the largest context that is exact.
#[test]
fn a_context_beyond_the_sliding_window_is_refused() {
    let dir = with_config(|c| {
        c.insert("sliding_window".into(), 16.into());
    });
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("m.mlpackage");
    let convert = |s: &str| {
        hf2coreml(&[
            "convert",
            dir.path().to_str().unwrap(),
            "-o",
            pkg.to_str().unwrap(),
            "--max-seq-len",
            s,
            "--query-len",
            "1",
        ])
    };
    assert_refused(&convert("32"), &["sliding_window", "--max-seq-len 16"]);
    assert!(!pkg.exists());
}
