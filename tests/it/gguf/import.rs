//! GGUF import on tiny files written by the test itself: every supported tensor type
//! dequantizes to exactly the values ggml's formulas give, q/k rows come back in Hugging Face
//! order, the tokenizer matches the vocabulary, and bad input is a typed error with no output.

use std::path::Path;

use half::f16;
use hf2coreml::arch::Architecture;
use hf2coreml::checkpoint::gguf::{import, is_gguf_file, GgufError, GgufFile, ImportOptions};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml_testkit::gguf::{
    self as fixture, FixtureType, GgufWriter, Meta, RawTensor, TinyGguf,
};
use proptest::prelude::*;

fn import_fixture(
    w: &GgufWriter,
    force: bool,
) -> (tempfile::TempDir, Result<std::path::PathBuf, GgufError>) {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("model.gguf");
    w.write(&src).unwrap();
    let dest = root.path().join("out");
    let r = import(
        &src,
        &dest,
        &ImportOptions { force },
        &hf2coreml::progress::Silent,
    )
    .map(|r| r.output);
    (root, r)
}

/// Only the source file (and a finished output, if any) may remain beside the output.
fn assert_no_partial_output(root: &Path) {
    let names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec!["model.gguf".to_string()],
        "left behind: {names:?}"
    );
}

fn check_values(fixture: &TinyGguf) {
    let built = fixture.build();
    let (_root, out) = import_fixture(&built.writer, false);
    let out = out.unwrap();
    let ckpt = Checkpoint::open(&out).unwrap();
    let names: Vec<&str> = ckpt.tensor_names().collect();
    assert_eq!(names.len(), built.expected.len(), "tensor count");
    for (name, (shape, values)) in &built.expected {
        let t = ckpt.tensor(name).unwrap();
        assert_eq!(t.shape, shape.as_slice(), "{name}");
        let got = t.to_f16();
        // The importer rounds ggml's dequantized f32 to fp16 once; the fixture's decoder uses
        // the same f32 formulas, so the results agree bit for bit.
        let want: Vec<f16> = values.iter().map(|v| f16::from_f32(*v)).collect();
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!(
                "{name} ({:?}): element {i} is {} but ggml's formula gives {}",
                fixture.matrix_type, got[i], want[i]
            );
        }
    }
}

#[test]
fn every_supported_tensor_type_imports_exactly() {
    use FixtureType::*;
    for (matrix, embedding, norm) in [
        (Q4_1, Q8_0, F32),
        (Q4_0, Q4_0, F16),
        (Q8_0, F16, BF16),
        (F32, F32, F32),
        (F16, BF16, F16),
        (BF16, Q4_1, F32),
    ] {
        let fixture = TinyGguf {
            matrix_type: matrix,
            embedding_type: embedding,
            norm_type: norm,
            ..TinyGguf::llama()
        };
        check_values(&fixture);
    }
}

#[test]
fn untied_model_keeps_lm_head() {
    let fixture = TinyGguf {
        tied: false,
        seed: 11,
        ..TinyGguf::llama()
    };
    check_values(&fixture);
    let (_root, out) = import_fixture(&fixture.build().writer, false);
    let ckpt = Checkpoint::open(out.unwrap()).unwrap();
    assert!(!ckpt.spec().tie_word_embeddings);
    assert!(ckpt.contains("lm_head.weight"));
}

#[test]
fn config_carries_the_hyperparameters() {
    let fixture = TinyGguf::llama();
    let (_root, out) = import_fixture(&fixture.build().writer, false);
    let out = out.unwrap();
    let spec = Checkpoint::open(&out).unwrap().spec().clone();
    assert_eq!(spec.architecture, Architecture::Llama);
    assert_eq!(spec.num_hidden_layers, 2);
    assert_eq!(spec.hidden_size, 64);
    assert_eq!(spec.intermediate_size, 96);
    assert_eq!((spec.num_attention_heads, spec.num_key_value_heads), (4, 2));
    assert_eq!(spec.head_dim, 16);
    assert_eq!(spec.vocab_size, fixture.tokens().len());
    assert!(spec.tie_word_embeddings);
    assert_eq!(spec.rope_theta, 100_000.0);
    // Stored as f32 in the GGUF; written as the decimal the converter started from.
    assert_eq!(spec.rms_norm_eps, 1e-5);
    assert_eq!(spec.max_position_embeddings, 256);
    assert_eq!(spec.bos_token_id, Some(1));
    assert_eq!(spec.eos_token_ids, vec![2]);
    assert_eq!(spec.dtype.as_deref(), Some("float16"));

    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["pad_token"], "<|im_end|>");
    assert_eq!(tc["unk_token"], "<|endoftext|>");
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    assert_eq!(tc["added_tokens_decoder"]["1"]["content"], "<|im_start|>");
    assert_eq!(tc["added_tokens_decoder"]["1"]["special"], true);
    let gc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(gc["eos_token_id"], 2);
}

/// Ids in the fixture vocabulary: 0..3 control tokens, then byte `b` at `3 + b`, then merges.
fn byte_id(b: u8) -> u32 {
    3 + b as u32
}
const ID_HE: u32 = 260;
const ID_IN: u32 = 262;
const ID_12: u32 = 264;

fn encode(dir: &Path, text: &str, add_special: bool) -> (tokenizers::Tokenizer, Vec<u32>) {
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let ids = tok.encode(text, add_special).unwrap().get_ids().to_vec();
    (tok, ids)
}

#[test]
fn smollm_tokenizer_splits_digits_and_keeps_specials() {
    let (_root, out) = import_fixture(&TinyGguf::llama().build().writer, false);
    let out = out.unwrap();
    let text = "<|im_start|>the 12 in<|im_end|>";
    let (tok, ids) = encode(&out, text, true);
    // "the" → t + he (no Ġ before it); " " stays alone because the digits are split off first;
    // "12" is two tokens even though the merge "1 2" exists; " in" → Ġ + in.
    let want = vec![
        1,
        byte_id(b't'),
        ID_HE,
        byte_id(b' '),
        byte_id(b'1'),
        byte_id(b'2'),
        byte_id(b' '),
        ID_IN,
        2,
    ];
    assert_eq!(ids, want);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(tok.decode(&ids, true).unwrap(), "the 12 in");
}

#[test]
fn gpt2_tokenizer_merges_digits() {
    let fixture = TinyGguf {
        pre: "gpt2".into(),
        ..TinyGguf::llama()
    };
    let (_root, out) = import_fixture(&fixture.build().writer, false);
    let (tok, ids) = encode(&out.unwrap(), "the 12 in", true);
    assert_eq!(
        ids,
        vec![
            byte_id(b't'),
            ID_HE,
            byte_id(b' '),
            ID_12,
            byte_id(b' '),
            ID_IN
        ]
    );
    assert_eq!(tok.decode(&ids, false).unwrap(), "the 12 in");
}

#[test]
fn llama_bpe_tokenizer_adds_bos_when_asked() {
    let fixture = TinyGguf {
        pre: "llama-bpe".into(),
        ..TinyGguf::llama()
    };
    let mut built = fixture.build();
    built
        .writer
        .meta("tokenizer.ggml.add_bos_token", Meta::Bool(true));
    let (_root, out) = import_fixture(&built.writer, false);
    let out = out.unwrap();
    let (tok, ids) = encode(&out, "the 1234", true);
    // Llama 3 groups digits by three: "123" then "4"; the merge "1 2" applies inside "123".
    assert_eq!(
        ids,
        vec![
            1,
            byte_id(b't'),
            ID_HE,
            byte_id(b' '),
            ID_12,
            byte_id(b'3'),
            byte_id(b'4')
        ]
    );
    assert_eq!(tok.decode(&ids, true).unwrap(), "the 1234");
}

#[test]
fn accents_and_unicode_round_trip_through_bytes() {
    let (_root, out) = import_fixture(&TinyGguf::llama().build().writer, false);
    let text = "café déjà vu — 東京";
    let (tok, ids) = encode(&out.unwrap(), text, false);
    // Without merges for these, every UTF-8 byte is one token.
    let non_ascii_pieces = text.len();
    assert!(ids.len() <= non_ascii_pieces);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

fn expect_err(w: &GgufWriter) -> GgufError {
    let (root, r) = import_fixture(w, false);
    let err = r.expect_err("import should fail");
    assert_no_partial_output(root.path());
    let msg = err.to_string();
    assert!(
        msg.contains("model.gguf"),
        "error does not name the file: {msg}"
    );
    err
}

#[test]
fn truncated_files_are_typed_errors() {
    let bytes = TinyGguf::llama().build().writer.to_bytes();
    for cut in [3, 20, 200, bytes.len() / 3, bytes.len() - 1] {
        let root = tempfile::tempdir().unwrap();
        let src = root.path().join("model.gguf");
        std::fs::write(&src, &bytes[..cut]).unwrap();
        let err = import(
            &src,
            &root.path().join("out"),
            &ImportOptions::default(),
            &hf2coreml::progress::Silent,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                GgufError::Truncated { .. } | GgufError::Malformed { .. }
            ),
            "cut at {cut}: {err}"
        );
        assert_no_partial_output(root.path());
    }
    // Cut inside the last tensor's data: the error names that tensor.
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("model.gguf");
    std::fs::write(&src, &bytes[..bytes.len() - 40]).unwrap();
    let err = import(
        &src,
        &root.path().join("out"),
        &ImportOptions::default(),
        &hf2coreml::progress::Silent,
    )
    .unwrap_err();
    assert!(
        matches!(&err, GgufError::Truncated { tensor, .. } if tensor == "output_norm.weight"),
        "{err}"
    );
}

/// gguf-py refuses a file that repeats a metadata key; so does the reader, naming the key
/// (a repeated `block_count` is not blamed on the tensors it leaves unexplained).
#[test]
fn a_repeated_metadata_key_is_refused_by_name() {
    for key in ["llama.rope.freq_base", "llama.block_count"] {
        let mut w = TinyGguf::llama().build().writer;
        let (_, value) = w.metadata.iter().find(|(k, _)| k == key).unwrap().clone();
        w.metadata.push((key.to_string(), value));
        let err = expect_err(&w);
        assert!(
            matches!(&err, GgufError::Malformed { message, .. }
                if message == &format!("metadata key `{key}` appears twice")),
            "{key}: {err}"
        );
    }
}

#[test]
fn unknown_architecture_is_named() {
    let mut w = TinyGguf::llama().build().writer;
    w.meta("general.architecture", Meta::Str("falcon".into()));
    let err = expect_err(&w);
    assert!(
        matches!(&err, GgufError::UnsupportedArchitecture { arch, .. } if arch == "falcon"),
        "{err}"
    );
    assert!(err.to_string().contains("supported: llama"));
}

#[test]
fn unsupported_tensor_type_lists_the_supported_ones() {
    let mut w = TinyGguf::llama().build().writer;
    let t = w
        .tensors
        .iter()
        .find(|t| t.name == "blk.1.ffn_up.weight")
        .unwrap()
        .clone();
    let n: usize = t.shape.iter().product();
    // MXFP4: 17-byte blocks of 32 values, a type ggml defines and we do not dequantize.
    w.tensor(RawTensor {
        type_id: 39,
        data: vec![0u8; n / 32 * 17],
        ..t
    });
    let err = expect_err(&w);
    let msg = err.to_string();
    assert!(
        matches!(&err, GgufError::UnsupportedTensorType { tensor, dtype, .. }
        if tensor == "blk.1.ffn_up.weight" && dtype == "MXFP4"),
        "{msg}"
    );
    assert!(
        msg.contains("F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"),
        "{msg}"
    );
}

#[test]
fn unknown_type_id_is_an_error_not_a_panic() {
    let mut w = TinyGguf::llama().build().writer;
    let t = w
        .tensors
        .iter()
        .find(|t| t.name == "blk.0.attn_v.weight")
        .unwrap()
        .clone();
    w.tensor(RawTensor { type_id: 99, ..t });
    let err = expect_err(&w);
    assert!(err.to_string().contains("99"), "{err}");
}

#[test]
fn unknown_pre_tokenizer_is_named() {
    let mut w = TinyGguf::llama().build().writer;
    w.meta("tokenizer.ggml.pre", Meta::Str("falcon".into()));
    let err = expect_err(&w);
    let msg = err.to_string();
    assert!(
        matches!(err, GgufError::UnsupportedTokenizer { .. }),
        "{msg}"
    );
    assert!(
        msg.contains("`falcon`")
            && msg.contains("smollm, llama-bpe, lfm2, qwen2, deepseek-r1-qwen, qwen35, gpt2"),
        "{msg}"
    );
}

#[test]
fn missing_pre_tokenizer_is_refused_not_guessed() {
    let mut w = TinyGguf::llama().build().writer;
    w.remove_meta("tokenizer.ggml.pre");
    let err = expect_err(&w);
    assert!(
        matches!(err, GgufError::UnsupportedTokenizer { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("tokenizer.ggml.pre"), "{err}");
}

#[test]
fn eos_is_appended_when_the_gguf_asks() {
    let mut built = TinyGguf::llama().build();
    built
        .writer
        .meta("tokenizer.ggml.add_bos_token", Meta::Bool(true))
        .meta("tokenizer.ggml.add_eos_token", Meta::Bool(true));
    let (_root, out) = import_fixture(&built.writer, false);
    let out = out.unwrap();
    let (_, ids) = encode(&out, "in", true);
    assert_eq!(ids, vec![1, ID_IN, 2]);
    let (_, ids) = encode(&out, "in", false);
    assert_eq!(ids, vec![ID_IN]);
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        (tc["add_bos_token"].as_bool(), tc["add_eos_token"].as_bool()),
        (Some(true), Some(true))
    );
}

#[test]
fn unknown_tokenizer_models_and_incomplete_sentencepiece_are_refused() {
    let mut w = TinyGguf::llama().build().writer;
    w.meta("tokenizer.ggml.model", Meta::Str("bert".into()));
    let err = expect_err(&w);
    assert!(
        matches!(err, GgufError::UnsupportedTokenizer { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("`bert`"), "{err}");
    // A SentencePiece vocabulary without merges needs its scores to recover them.
    let mut w = TinyGguf::llama().build().writer;
    fixture::sentencepiece_meta(&mut w, false);
    let vocab = fixture::spm_vocabulary(false).len();
    let tokens: Vec<String> = (0..vocab).map(|i| format!("t{i}")).collect();
    w.remove_meta("tokenizer.ggml.scores");
    w.meta("tokenizer.ggml.tokens", Meta::StrArray(tokens));
    let err = expect_err(&w);
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");
}

#[test]
fn missing_extra_and_misshapen_tensors_are_named() {
    let base = TinyGguf::llama().build().writer;
    let mut w = base.clone();
    w.tensors.retain(|t| t.name != "blk.1.attn_k.weight");
    let err = expect_err(&w);
    assert!(
        matches!(&err, GgufError::Tensor { tensor, .. } if tensor == "blk.1.attn_k.weight"),
        "{err}"
    );

    let mut w = base.clone();
    w.tensor(RawTensor {
        name: "rope_freqs.weight".into(),
        type_id: 0,
        shape: vec![8],
        data: vec![0u8; 32],
    });
    let err = expect_err(&w);
    assert!(err.to_string().contains("rope_freqs.weight"), "{err}");

    let mut w = base;
    w.tensor(RawTensor {
        name: "blk.0.attn_norm.weight".into(),
        type_id: 0,
        shape: vec![32],
        data: vec![0u8; 128],
    });
    let err = expect_err(&w);
    assert!(
        err.to_string().contains("blk.0.attn_norm.weight") && err.to_string().contains("[32]"),
        "{err}"
    );
}

#[test]
fn an_inconsistent_qwen3_file_names_the_key_or_tensor() {
    let src = tempfile::tempdir().unwrap();
    let base = fixture::q4_k_m_fixture(hf2coreml_testkit::TinyModel::qwen3(), src.path())
        .unwrap()
        .writer;
    let mut w = base.clone();
    w.tensors.retain(|t| t.name != "blk.2.attn_k_norm.weight");
    let err = expect_err(&w);
    assert!(
        err.to_string().contains("blk.2.attn_k_norm.weight"),
        "{err}"
    );
    // Without its key length, head_dim would be hidden / heads: the value length disagrees,
    // and without either, q's rows are named, not reshaped into a guess.
    let mut w = base.clone();
    w.remove_meta("qwen3.attention.key_length");
    let err = expect_err(&w);
    assert!(
        err.to_string().contains("qwen3.attention.value_length"),
        "{err}"
    );
    w.remove_meta("qwen3.attention.value_length");
    let err = expect_err(&w);
    assert!(err.to_string().contains("blk.0.attn_q.weight"), "{err}");
    // A qwen2 file carrying q/k norms is not silently a Qwen2 without them.
    let mut w = base;
    w.meta("general.architecture", Meta::Str("qwen2".into()));
    for (k, _) in w.metadata.iter_mut() {
        if let Some(rest) = k.strip_prefix("qwen3.") {
            *k = format!("qwen2.{rest}");
        }
    }
    let err = expect_err(&w);
    assert!(err.to_string().contains("attn_q"), "{err}");
}

#[test]
fn an_inconsistent_phi3_file_names_the_key_or_tensor() {
    let src = hf2coreml_testkit::TinyModel::phi3();
    let dir = tempfile::tempdir().unwrap();
    let fixture_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    let longrope =
        hf2coreml::checkpoint::Checkpoint::open(fixture_dir.join("phi3_longrope")).unwrap();
    let base = fixture::from_checkpoint(&longrope, |_, _, _, _| fixture::FixtureType::F32).writer;
    // LongRoPE needs both factor tensors, one factor per rotated pair, and its original context.
    let mut w = base.clone();
    w.tensors.retain(|t| t.name != "rope_factors_short.weight");
    let err = expect_err(&w).to_string();
    assert!(
        err.contains("rope_factors_short.weight") && err.contains("both"),
        "{err}"
    );
    let mut w = base.clone();
    for t in w
        .tensors
        .iter_mut()
        .filter(|t| t.name == "rope_factors_long.weight")
    {
        t.shape = vec![5];
        t.data.truncate(20);
    }
    let err = expect_err(&w).to_string();
    assert!(
        err.contains("rope_factors_long.weight") && err.contains("[6]"),
        "{err}"
    );
    let mut w = base.clone();
    w.remove_meta("phi3.rope.scaling.original_context_length");
    let err = expect_err(&w).to_string();
    assert!(
        err.contains("phi3.rope.scaling.original_context_length"),
        "{err}"
    );
    let mut w = base.clone();
    w.meta("phi3.rope.scaling.attn_factor", Meta::F32(-1.0));
    let err = expect_err(&w).to_string();
    assert!(err.contains("phi3.rope.scaling.attn_factor"), "{err}");
    // Partial rotary is Phi-3's and Qwen3.5's only; a fused tensor missing is named.
    let mut w = base;
    w.meta("phi3.rope.dimension_count", Meta::U32(7));
    let err = expect_err(&w).to_string();
    assert!(err.contains("phi3.rope.dimension_count"), "{err}");
    let mut w = fixture::q4_k_m_fixture(src, dir.path()).unwrap().writer;
    w.tensors.retain(|t| t.name != "blk.1.attn_qkv.weight");
    let err = expect_err(&w).to_string();
    assert!(err.contains("blk.1.attn_qkv.weight"), "{err}");
    let mut w = fixture::q4_k_m_fixture(hf2coreml_testkit::TinyModel::qwen3(), dir.path())
        .unwrap()
        .writer;
    w.meta("qwen3.rope.dimension_count", Meta::U32(16));
    let err = expect_err(&w).to_string();
    assert!(err.contains("supported for phi3 and qwen35 only"), "{err}");
}

#[test]
fn an_inconsistent_gemma3_file_names_the_key_or_tensor() {
    let src = tempfile::tempdir().unwrap();
    let base = fixture::q4_k_m_spm_fixture(hf2coreml_testkit::TinyModel::gemma3(), src.path())
        .unwrap()
        .writer;
    // The window is in every Gemma 3 file and nothing fixes it: refused, not guessed.
    let mut w = base.clone();
    w.remove_meta("gemma3.attention.sliding_window");
    let err = expect_err(&w);
    assert!(
        err.to_string().contains("gemma3.attention.sliding_window"),
        "{err}"
    );
    let mut w = base;
    w.tensors.retain(|t| t.name != "blk.5.post_ffw_norm.weight");
    let err = expect_err(&w);
    assert!(
        err.to_string().contains("blk.5.post_ffw_norm.weight"),
        "{err}"
    );
    // Scores that are not numbers cannot rank Llama's pieces (Gemma's go by position).
    let mut w = fixture::q4_k_m_spm_fixture(hf2coreml_testkit::TinyModel::llama(), src.path())
        .unwrap()
        .writer;
    let n = fixture::spm_vocabulary(false).len();
    w.meta(
        "tokenizer.ggml.scores",
        Meta::StrArray((0..n).map(|i| i.to_string()).collect()),
    );
    let err = expect_err(&w);
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");
}

#[test]
fn bad_hyperparameters_are_named() {
    let base = TinyGguf::llama().build().writer;
    for (key, value, needle) in [
        (
            "llama.attention.head_count_kv",
            Meta::U32(3),
            "does not divide",
        ),
        ("llama.block_count", Meta::U32(0), "positive"),
        ("llama.embedding_length", Meta::Str("64".into()), "integer"),
        ("llama.rope.dimension_count", Meta::U32(8), "partial rotary"),
        ("llama.rope.scaling.type", Meta::Str("yarn".into()), "yarn"),
        (
            "tokenizer.ggml.eos_token_id",
            Meta::U32(100_000),
            "outside the vocabulary",
        ),
        ("general.alignment", Meta::U32(0), "alignment"),
    ] {
        let mut w = base.clone();
        w.meta(key, value);
        let err = expect_err(&w);
        let msg = err.to_string();
        assert!(msg.contains(needle), "{key}: {msg}");
    }
    let mut w = base;
    w.remove_meta("llama.attention.layer_norm_rms_epsilon");
    assert!(expect_err(&w)
        .to_string()
        .contains("layer_norm_rms_epsilon"));
}

#[test]
fn huge_metadata_arrays_are_refused_before_parsing() {
    let mut w = TinyGguf::llama().build().writer;
    w.meta("general.blob", Meta::U8Array(vec![0; (1 << 24) + 1]));
    let err = expect_err(&w);
    assert!(matches!(err, GgufError::Malformed { .. }), "{err}");
    assert!(err.to_string().contains("general.blob"), "{err}");
}

#[test]
fn gguf_files_are_recognised_by_magic() {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("model.gguf");
    TinyGguf::llama().build().writer.write(&src).unwrap();
    assert!(is_gguf_file(&src));
    let other = root.path().join("config.json");
    std::fs::write(&other, b"{}").unwrap();
    assert!(!is_gguf_file(&other));
    assert!(!is_gguf_file(root.path()));
    assert!(!is_gguf_file(&root.path().join("absent.gguf")));
}

#[test]
fn existing_output_needs_force() {
    let w = TinyGguf::llama().build().writer;
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("model.gguf");
    w.write(&src).unwrap();
    let dest = root.path().join("out");
    std::fs::create_dir(&dest).unwrap();
    std::fs::write(dest.join("keep.txt"), b"mine").unwrap();
    let err = import(
        &src,
        &dest,
        &ImportOptions { force: false },
        &hf2coreml::progress::Silent,
    )
    .unwrap_err();
    assert!(matches!(err, GgufError::OutputExists { .. }), "{err}");
    assert!(
        dest.join("keep.txt").is_file(),
        "refused import must not touch the output"
    );
    import(
        &src,
        &dest,
        &ImportOptions { force: true },
        &hf2coreml::progress::Silent,
    )
    .unwrap();
    assert!(!dest.join("keep.txt").exists());
    Checkpoint::open(&dest).unwrap();
    assert_eq!(
        std::fs::read_dir(root.path()).unwrap().count(),
        2,
        "no temp dirs left"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Corrupting any bytes of a valid file gives an import or a typed error, never a panic,
    /// and never a partial output directory.
    #[test]
    fn corrupted_files_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let mut bytes = TinyGguf::llama().build().writer.to_bytes();
        let len = bytes.len();
        for (at, value) in &edits {
            bytes[at.index(len)] = *value;
        }
        let root = tempfile::tempdir().unwrap();
        let src = root.path().join("model.gguf");
        std::fs::write(&src, &bytes).unwrap();
        let dest = root.path().join("out");
        match import(&src, &dest, &ImportOptions::default(), &hf2coreml::progress::Silent) {
            Ok(_) => prop_assert!(dest.join("config.json").is_file()),
            Err(_) => {
                let left = std::fs::read_dir(root.path()).unwrap().count();
                prop_assert_eq!(left, 1);
            }
        }
    }
}

fn read_back(ty: FixtureType, values: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (data, decoded) = fixture::encode(values, ty);
    let mut w = GgufWriter::default();
    w.tensor(RawTensor {
        name: "t".into(),
        type_id: ty.id(),
        shape: vec![values.len() / 32, 32],
        data,
    });
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("t.gguf");
    w.write(&src).unwrap();
    let mut g = GgufFile::open(&src).unwrap();
    let t = g.tensor("t").unwrap().clone();
    (g.read_f32(&t).unwrap(), decoded)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// candle's dequantization (what the importer uses) agrees bit for bit with ggml's
    /// reference formulas, including constant blocks (zero scale) and wide ranges.
    #[test]
    fn block_dequantization_matches_ggml_formulas(
        blocks in 1usize..4,
        scale in prop::sample::select(vec![0.0f32, 1e-3, 1.0, 300.0]),
        seed in any::<u64>(),
        ty in prop::sample::select(vec![FixtureType::Q4_0, FixtureType::Q4_1, FixtureType::Q8_0,
                                         FixtureType::F16, FixtureType::BF16, FixtureType::F32]),
    ) {
        let mut rng = hf2coreml_testkit::SplitMix64(seed);
        let values: Vec<f32> = (0..blocks * 32).map(|_| scale * rng.normal()).collect();
        let (got, want) = read_back(ty, &values);
        prop_assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            prop_assert_eq!(g.to_bits(), w.to_bits(), "{:?} element {}: {} vs {}", ty, i, g, w);
        }
    }
}

/// A Qwen3.5 file with an MTP block (`nextn_predict_layers`, counted in `block_count`, its
/// tensors `blk.{n}.*` after the decoder's) imports as the decoder alone, every weight as the
/// writer made it; a block holding neither kind's tensors is refused naming it.
#[test]
fn qwen3_5_mtp_blocks_are_left_out_and_block_kinds_come_from_the_tensors() {
    let src = tempfile::tempdir().unwrap();
    let built =
        fixture::q4_k_m_fixture(hf2coreml_testkit::TinyModel::qwen3_5(), src.path()).unwrap();
    let mut w = built.writer.clone();
    w.meta("qwen35.block_count", Meta::U32(5))
        .meta("qwen35.nextn_predict_layers", Meta::U32(1));
    for name in ["blk.4.nextn.eh_proj.weight", "blk.4.attn_norm.weight"] {
        let (data, _) = fixture::encode(&[0.5; 4], FixtureType::F32);
        w.tensor(RawTensor {
            name: name.into(),
            type_id: FixtureType::F32.id(),
            shape: vec![4],
            data,
        });
    }
    let (_root, out) = import_fixture(&w, false);
    let ckpt = Checkpoint::open(out.unwrap()).unwrap();
    assert_eq!(ckpt.spec().num_hidden_layers, 4);
    assert_eq!(ckpt.spec().gated_delta.as_ref().unwrap().layers, [0, 1, 2]);
    for (name, (shape, values)) in &built.expected {
        let t = ckpt.tensor(name).unwrap();
        assert_eq!(t.shape.to_vec(), *shape, "{name}");
        let want: Vec<f32> = values.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(t.to_f32(), want, "{name}");
    }
    let mut w = built.writer;
    w.tensors.retain(|t| t.name != "blk.1.ssm_a");
    let err = expect_err(&w).to_string();
    assert!(
        err.contains("blk.1.attn_q.weight") && err.contains("neither"),
        "{err}"
    );
}
