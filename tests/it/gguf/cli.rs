//! `hf2coreml import-gguf` as a user runs it: exit codes, messages, and no partial output.

use std::path::Path;

use hf2coreml_testkit::gguf::{Meta, TinyGguf};

use crate::support::{convert, hf2coreml, needs, Cli};

fn import_args<'a>(src: &'a Path, dest: &'a Path) -> Vec<&'a std::ffi::OsStr> {
    vec![
        "import-gguf".as_ref(),
        src.as_os_str(),
        "-o".as_ref(),
        dest.as_os_str(),
    ]
}

#[test]
fn import_then_refuse_existing_output_then_force() {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("tiny.gguf");
    TinyGguf::llama().build().writer.write(&src).unwrap();
    let dest = root.path().join("ckpt");

    let out = hf2coreml(&import_args(&src, &dest));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("parameters") && stdout.contains("smollm"),
        "{stdout}"
    );

    let out = hf2coreml(&import_args(&src, &dest));
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("already exists") && stderr.contains("--force"),
        "{stderr}"
    );

    let mut args = import_args(&src, &dest);
    args.push("--force".as_ref());
    let out = hf2coreml(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = hf2coreml(&["inspect".as_ref(), dest.as_os_str()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_input_exits_2_with_the_reason_and_no_output() {
    let root = tempfile::tempdir().unwrap();
    let mut w = TinyGguf::llama().build().writer;
    w.meta("general.architecture", Meta::Str("rwkv6".into()));
    let src = root.path().join("rwkv.gguf");
    w.write(&src).unwrap();
    let dest = root.path().join("ckpt");
    let out = hf2coreml(&import_args(&src, &dest));
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rwkv6") && stderr.contains("rwkv.gguf"),
        "{stderr}"
    );
    assert!(!dest.exists());
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);

    // A multimodal model's projector file, beside its text GGUF: named for what it is.
    let mut w = TinyGguf::llama().build().writer;
    w.meta("general.architecture", Meta::Str("clip".into()));
    let src = root.path().join("mmproj-tiny-f16.gguf");
    w.write(&src).unwrap();
    let out = hf2coreml(&import_args(&src, &dest));
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("multimodal projector") && stderr.contains("text model's GGUF"),
        "{stderr}"
    );
    assert!(!dest.exists());
    std::fs::remove_file(&src).unwrap();

    let missing = root.path().join("nope.gguf");
    let out = hf2coreml(&import_args(&missing, &dest));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope.gguf"));
}

#[test]
fn json_report_counts_every_parameter() {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("tiny.gguf");
    let built = TinyGguf::llama().build();
    built.writer.write(&src).unwrap();
    let dest = root.path().join("ckpt");
    let mut args = import_args(&src, &dest);
    args.push("--json".as_ref());
    let out = hf2coreml(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let want: usize = built.expected.values().map(|(_, v)| v.len()).sum();
    assert_eq!(report["parameters"].as_u64(), Some(want as u64));
    assert_eq!(
        report["tensors"].as_u64(),
        Some(built.expected.len() as u64)
    );
    assert_eq!(report["pre_tokenizer"], "smollm");
    assert_eq!(report["tensor_types"]["Q4_1"].as_u64(), Some(14));
}

#[test]
fn convert_takes_a_gguf_file_directly() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("tiny.gguf");
    TinyGguf::llama().build().writer.write(&src).unwrap();
    let pkg = root.path().join("tiny.mlpackage");
    let out = convert(&src, &pkg)
        .args(["--max-seq-len", "16", "--keep-fp16", "*", "--json"])
        .cache(root.path().join("cache"))
        .output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(pkg.join("Manifest.json").is_file());
    // The imported tokenizer travels with the package.
    assert!(root.path().join("tiny.tokenizer.json").is_file());
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["contract"]["num_layers"], 2, "{summary:#}");
    // The import went into the model cache, keyed by the file's sha256.
    let entries: Vec<_> = std::fs::read_dir(root.path().join("cache/imported"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0].len(), 64, "{entries:?}");
    // `validate --against FILE.gguf` reads the file as convert did: its import, reused.
    let v = Cli::new()
        .args([
            "validate",
            pkg.to_str().unwrap(),
            "--against",
            src.to_str().unwrap(),
        ])
        .cache(root.path().join("cache"))
        .output();
    let err = String::from_utf8_lossy(&v.stderr);
    assert!(v.status.success(), "{err}");
    assert!(err.contains("reusing"), "{err}");
}

/// The LFM2 and Qwen3.5 fixtures' GGUF files (tests/it/gguf/transformers.rs) through the
/// commands that read a GGUF without importing it: `inspect` names the architecture and the
/// block kinds, `budget` plans from the header.
#[test]
fn hybrid_ggufs_are_inspected_and_budgeted() {
    use hf2coreml_testkit::gguf::q4_k_m_fixture;
    use hf2coreml_testkit::TinyModel;
    for (model, name) in [
        (TinyModel::lfm2(), "Lfm2ForCausalLM"),
        (TinyModel::qwen3_5(), "Qwen3_5ForCausalLM"),
    ] {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("m.gguf");
        let built = q4_k_m_fixture(model, root.path()).unwrap();
        built.writer.write(&file).unwrap();
        let out = hf2coreml(&["inspect".as_ref(), file.as_os_str()]);
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {err}");
        assert!(text.contains(name) && text.contains("Q4_K"), "{text}");
        let out = hf2coreml(&[
            "budget".as_ref(),
            file.as_os_str(),
            "--device".as_ref(),
            "iphone-17-pro".as_ref(),
            "--json".as_ref(),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(matches!(out.status.code(), Some(0) | Some(1)), "{err}");
        let b: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(b["weights_bytes"].as_f64().unwrap() > 0.0, "{b:#}");
    }
}

/// A Qwen3.5 GGUF whose `ssm.*` keys contradict each other or are missing, and a `qwen35moe`
/// file, are refused before any output (exit 2), naming the file and the key; so is an LFM2
/// file whose per-block KV heads do not cover its blocks.
#[test]
fn inconsistent_hybrid_ggufs_exit_2_naming_the_key() {
    use hf2coreml_testkit::gguf::{q4_k_m_fixture, GgufWriter};
    use hf2coreml_testkit::TinyModel;
    let root = tempfile::tempdir().unwrap();
    let (q, l) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let qwen = q4_k_m_fixture(TinyModel::qwen3_5(), q.path())
        .unwrap()
        .writer;
    let lfm2 = q4_k_m_fixture(TinyModel::lfm2(), l.path()).unwrap().writer;
    type Edit = fn(&mut GgufWriter);
    let cases: [(&GgufWriter, Edit, &str); 6] = [
        (
            &qwen,
            |w| {
                w.meta("qwen35.ssm.time_step_rank", Meta::U32(5));
            },
            "`qwen35.ssm.time_step_rank`: 5 value heads are not a multiple of the 2 key heads",
        ),
        (
            &qwen,
            |w| {
                w.remove_meta("qwen35.ssm.state_size");
            },
            "`qwen35.ssm.state_size`: missing",
        ),
        (
            &qwen,
            |w| {
                w.meta("qwen35.ssm.inner_size", Meta::U32(770));
            },
            "`qwen35.ssm.inner_size`",
        ),
        (
            &qwen,
            |w| {
                w.meta("qwen35.nextn_predict_layers", Meta::U32(4));
            },
            "`qwen35.nextn_predict_layers`",
        ),
        (
            &qwen,
            |w| {
                w.meta("general.architecture", Meta::Str("qwen35moe".into()));
            },
            "architecture `qwen35moe` is not supported",
        ),
        (
            &lfm2,
            |w| {
                w.meta(
                    "lfm2.attention.head_count_kv",
                    Meta::I32Array(vec![0, 2, 0]),
                );
            },
            "`lfm2.attention.head_count_kv`: 3 entries for 4 blocks",
        ),
    ];
    for (i, (base, edit, want)) in cases.into_iter().enumerate() {
        let mut w = base.clone();
        edit(&mut w);
        let file = root.path().join(format!("bad{i}.gguf"));
        w.write(&file).unwrap();
        let dest = root.path().join(format!("out{i}"));
        for args in [
            import_args(&file, &dest),
            vec!["inspect".as_ref(), file.as_os_str()],
        ] {
            let out = hf2coreml(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{want}: {err}");
            assert!(
                err.contains(want) && err.contains(&*file.to_string_lossy()),
                "{want}: {err}"
            );
        }
        assert!(!dest.exists(), "{want}: no partial output");
    }
}
