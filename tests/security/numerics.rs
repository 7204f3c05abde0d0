//! Configs and GGUF files that parse but compute nothing: RoPE bases and scalings whose
//! float32 frequencies or angles (as transformers forms them) overflow or vanish, attention
//! scales fp16 cannot hold, special token ids that do not fit. Each is refused before any
//! work (exit 2), naming the file and the field (the GGUF key or tensor it came from), and
//! leaves nothing behind.

use std::path::Path;

use hf2coreml_testkit::gguf::{self as fixture, Meta, TinyGguf};
use hf2coreml_testkit::TinyModel;
use serde_json::json;

use super::{convert_refused, expect_bad, write_model, Scratch};

/// `convert` of `model` with `edit` applied to its config.json: refused naming config.json and
/// every needle.
fn config_refused(
    model: TinyModel,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    needles: &[&str],
) {
    let s = Scratch::new();
    let dir = write_model(&s, model);
    let path = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(c.as_object_mut().unwrap());
    std::fs::write(&path, c.to_string()).unwrap();
    let mut all = vec!["config.json"];
    all.extend_from_slice(needles);
    convert_refused(&s, &dir, &all);
}

#[test]
fn rope_bases_that_compute_nothing() {
    for (theta, says) in [
        (
            json!(1e-300),
            "`rope_theta` (1e-300) must be greater than 1",
        ),
        (json!(0.5), "`rope_theta` (0.5) must be greater than 1"),
        (json!(1.0), "`rope_theta` (1) must be greater than 1"),
        (json!(1e39), "`rope_theta` (1e39) overflows float32"),
        (json!(3.5e38), "`rope_theta` (3.5e38) overflows float32"),
    ] {
        config_refused(
            TinyModel::llama(),
            |c| drop(c.insert("rope_theta".into(), theta)),
            &[says],
        );
    }
    // transformers 5's nested base, named as written.
    config_refused(
        TinyModel::qwen3(),
        |c| c["rope_parameters"]["rope_theta"] = json!(1e-300),
        &["`rope_parameters.rope_theta` (1e-300)"],
    );
    config_refused(
        TinyModel::qwen3(),
        |c| c["rope_parameters"]["rope_theta"] = json!("1e6"),
        &["`rope_parameters.rope_theta` (\"1e6\") must be a number"],
    );
}

#[test]
fn rope_scalings_whose_angles_overflow_or_vanish() {
    let linear = |factor: f64| json!({"type": "linear", "factor": factor});
    let llama3 = |factor: f64, low: f64, high: f64, original: serde_json::Value| {
        json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": original})
    };
    for (scaling, theta, says) in [
        (
            linear(1e-38),
            1e4,
            "`rope_scaling.factor` makes pair 0's RoPE frequency 1e38, whose angle",
        ),
        (
            linear(1e-36),
            1e4,
            "overflows from position 341 on, within the context of 2048",
        ),
        (
            linear(1e39),
            1e4,
            "`rope_scaling.factor` (1e39) overflows float32",
        ),
        (linear(3e38), 3e38, "makes pair 2's RoPE frequency 0"),
        (
            llama3(1e-38, 1.0, 4.0, json!(1024)),
            5e5,
            "`rope_scaling.factor` makes pair",
        ),
        (
            llama3(8.0, 4.0, 1.0, json!(1024)),
            5e5,
            "`rope_scaling.high_freq_factor` (1) must be greater than low_freq_factor (4)",
        ),
        (
            llama3(8.0, 1.0, 4.0, json!(1e300)),
            5e5,
            "`original_max_position_embeddings`, an integer",
        ),
        (
            llama3(8.0, 1.0, 4.0, json!(0)),
            5e5,
            "`original_max_position_embeddings`, an integer",
        ),
        (
            json!({"type": "dynamic", "factor": 1e-38}),
            1e4,
            "unsupported `rope_scaling` type `dynamic`",
        ),
        (
            json!({"rope_type": "yarn", "factor": 1e-38}),
            1e4,
            "unsupported `rope_scaling` type `yarn`",
        ),
    ] {
        config_refused(
            TinyModel::llama(),
            |c| {
                c.insert("rope_scaling".into(), scaling);
                c.insert("rope_theta".into(), json!(theta));
            },
            &[says],
        );
    }
    // The same scaling is fine where the context keeps its angles finite (2 positions).
    let s = Scratch::new();
    let fine = TinyModel {
        rope_scaling: Some(linear(1e-38)),
        context: 2,
        ..TinyModel::llama()
    };
    let dir = write_model(&s, fine);
    let o = crate::support::hf2coreml(&["inspect", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn longrope_factors_that_compute_nothing() {
    // A valid LongRoPE config (transformers 5 nests it in `rope_parameters`), one factor then
    // set to what computes nothing.
    let phi3 = TinyModel {
        rope_scaling: Some(json!({"type": "longrope", "short_factor": vec![1.0; 8],
            "long_factor": vec![2.0; 8], "original_max_position_embeddings": 256})),
        context: 1024,
        ..TinyModel::phi3()
    };
    for (list, i, value, says) in [
        (
            "short_factor",
            0,
            1e-38,
            "`rope_parameters.short_factor[0]` makes pair 0's RoPE frequency 1e38",
        ),
        (
            "short_factor",
            5,
            1e-38,
            "`rope_parameters.short_factor[5]` makes pair 5's RoPE frequency inf",
        ),
        (
            "long_factor",
            3,
            1e-38,
            "`rope_parameters.long_factor[3]` makes pair 3's RoPE frequency inf",
        ),
        (
            "short_factor",
            7,
            1e39,
            "`rope_parameters.short_factor[7]` (1e39) overflows float32",
        ),
    ] {
        config_refused(
            phi3.clone(),
            |c| c["rope_parameters"][list][i] = json!(value),
            &[says],
        );
    }
}

#[test]
fn gemma_scales_and_local_bases_that_compute_nothing() {
    for (scalar, says) in [
        (
            1e-30,
            "`query_pre_attn_scalar` (1e-30) gives the attention scale 1e15",
        ),
        (
            1e-12,
            "`query_pre_attn_scalar` (1e-12) gives the attention scale 1000000",
        ),
        (
            1e10,
            "`query_pre_attn_scalar` (1e10) gives the attention scale 1e-5",
        ),
    ] {
        config_refused(
            TinyModel::gemma3(),
            |c| drop(c.insert("query_pre_attn_scalar".into(), json!(scalar))),
            &[says, "fp16"],
        );
    }
    config_refused(
        TinyModel::gemma3(),
        |c| c["rope_parameters"]["sliding_attention"]["rope_theta"] = json!(1e-300),
        &["`rope_parameters.sliding_attention.rope_theta` (1e-300)"],
    );
    config_refused(
        TinyModel::gemma3(),
        |c| c["rope_parameters"]["full_attention"]["rope_theta"] = json!(1e39),
        &["`rope_parameters.full_attention.rope_theta` (1e39) overflows"],
    );
    // Softcapping is not computed: any value is refused by name, however small.
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        config_refused(
            TinyModel::gemma3(),
            |c| drop(c.insert(key.into(), json!(1e-38))),
            &[key, "absent or null"],
        );
    }
}

#[test]
fn other_numbers_that_compute_nothing() {
    for (key, value, says) in [
        ("rms_norm_eps", json!(1e300), "rms_norm_eps"),
        ("rms_norm_eps", json!(-1e-6), "rms_norm_eps (-1e-6) must be"),
        (
            "partial_rotary_factor",
            json!(1e-300),
            "`partial_rotary_factor` (1e-300)",
        ),
        (
            "partial_rotary_factor",
            json!(1e300),
            "`partial_rotary_factor`",
        ),
    ] {
        config_refused(
            TinyModel::phi3(),
            |c| drop(c.insert(key.into(), value)),
            &[says],
        );
    }
}

#[test]
fn special_token_ids_that_do_not_fit() {
    for (key, value, says) in [
        (
            "eos_token_id",
            json!([2, 1u64 << 40]),
            "`eos_token_id[1]` (1099511627776) is outside the vocabulary",
        ),
        (
            "eos_token_id",
            json!([2, -1]),
            "`eos_token_id[1]` (-1) must be a token id",
        ),
        // 2^32 would wrap to token 0.
        (
            "bos_token_id",
            json!(1u64 << 32),
            "`bos_token_id` (4294967296) is outside",
        ),
        (
            "eos_token_id",
            json!(2.5),
            "`eos_token_id` (2.5) must be a token id",
        ),
        (
            "eos_token_id",
            json!(["2"]),
            "`eos_token_id[0]` (\"2\") must be a token id",
        ),
        (
            "eos_token_id",
            json!(1e20),
            "`eos_token_id` (1e+20) must be a token id",
        ),
    ] {
        config_refused(
            TinyModel::llama(),
            |c| drop(c.insert(key.into(), value)),
            &[says],
        );
    }
}

/// `import-gguf` of `w` (written to `s/m.gguf`): refused naming the file and every needle.
fn import_refused(s: &Scratch, w: &fixture::GgufWriter, needles: &[&str]) {
    let p = s.path().join("m.gguf");
    w.write(&p).unwrap();
    let dest = s.out().join("ckpt");
    let mut all = vec!["m.gguf"];
    all.extend_from_slice(needles);
    expect_bad(
        s,
        &[
            "import-gguf".as_ref(),
            p.as_os_str(),
            "-o".as_ref(),
            dest.as_os_str(),
        ],
        &all,
    );
}

#[test]
fn gguf_rope_keys_that_compute_nothing() {
    use candle_core::quantized::gguf_file::Value;
    let base = TinyGguf::llama().build().writer;
    for (edits, says) in [
        (
            vec![("llama.rope.freq_base", Meta::F32(1e-38))],
            "metadata `llama.rope.freq_base`",
        ),
        (
            vec![("llama.rope.freq_base", Meta::Value(Value::F64(1e-300)))],
            "metadata `llama.rope.freq_base`",
        ),
        (
            vec![
                ("llama.rope.scaling.type", Meta::Str("linear".into())),
                ("llama.rope.scaling.factor", Meta::F32(1e-38)),
            ],
            "metadata `llama.rope.scaling.factor`",
        ),
    ] {
        let s = Scratch::new();
        let mut w = base.clone();
        for (k, v) in edits {
            w.meta(k, v);
        }
        import_refused(&s, &w, &[says, "rope_"]);
    }

    // A special token id wider than 32 bits: refused by the header summary and the import,
    // never dropped or wrapped to token 0.
    let s = Scratch::new();
    let mut w = base.clone();
    w.meta(
        "tokenizer.ggml.eos_token_id",
        Meta::Value(Value::U64(1 << 32)),
    );
    import_refused(&s, &w, &["tokenizer.ggml.eos_token_id", "4294967296"]);
    let p = s.path().join("m.gguf");
    super::expect(
        s.path(),
        &["inspect".as_ref(), p.as_os_str()],
        2,
        &[
            "m.gguf",
            "tokenizer.ggml.eos_token_id",
            "does not fit 32 bits",
        ],
    );

    // Phi-3's LongRoPE factors are tensors: the one holding 1e-38 is named.
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    let ckpt = hf2coreml::checkpoint::Checkpoint::open(fixtures.join("phi3_longrope")).unwrap();
    let mut w = fixture::from_checkpoint(&ckpt, |_, _, _, _| fixture::FixtureType::F32).writer;
    let t = w
        .tensors
        .iter_mut()
        .find(|t| t.name == "rope_factors_short.weight")
        .unwrap();
    t.data[..4].copy_from_slice(&1e-38f32.to_le_bytes());
    let s = Scratch::new();
    import_refused(
        &s,
        &w,
        &[
            "rope_factors_short.weight",
            "`rope_scaling.short_factor[0]`",
        ],
    );
    // `convert` of the same file names the GGUF too, not the imported copy.
    let p = s.path().join("m.gguf");
    convert_refused(&s, &p, &["m.gguf", "rope_factors_short.weight"]);
}
