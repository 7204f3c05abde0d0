//! Convert options the README promises, through the CLI on the tiny llama: `--calibration FILE`
//! calibrates on that file (its hash is recorded, and another text gives other weights), and
//! the `compact` recipe palettizes the embedding too, and `large-model` stores the embedding and
//! lm_head as 8-bit LUTs that the reader decodes and the interpreter runs.

use std::path::Path;
use std::process::Command;

use hf2coreml::mil::contract::{self, Contract};
use hf2coreml::mlpackage::MlPackage;
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, Cli};

/// Every conversion here: a short context, quiet.
const FLAGS: [&str; 3] = ["--max-seq-len", "32", "-q"];

fn weights(pkg: &Path) -> Vec<u8> {
    std::fs::read(pkg.join("Data/com.apple.CoreML/weights/weight.bin")).unwrap()
}

/// The recorded inputs of `X.mlpackage`: `X.report.json`'s `inputs`.
fn inputs(pkg: &Path) -> serde_json::Value {
    let report = pkg.with_extension("report.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    v["inputs"].clone()
}

#[test]
fn calibration_file_is_the_text_calibrated_on() {
    needs!(Python);
    let dir = TinyModel::llama().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let text = root.path().join("mine.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let mine = root.path().join("mine.mlpackage");
    convert(dir.path(), &mine)
        .args(FLAGS)
        .args([
            "--recipe",
            "calibrated-4bit",
            "--calibration",
            text.to_str().unwrap(),
        ])
        .ok();
    // coreutils' sha256sum as the witness of the recorded hash.
    let sum = Command::new("sha256sum").arg(&text).output().unwrap();
    let sum = String::from_utf8(sum.stdout).unwrap();
    let hash = sum.split_whitespace().next().unwrap().to_string();
    assert_eq!(hash.len(), 64);
    assert_eq!(inputs(&mine)["calibration"], hash.as_str());

    let shipped = root.path().join("shipped.mlpackage");
    convert(dir.path(), &shipped)
        .args(FLAGS)
        .args(["--recipe", "calibrated-4bit"])
        .ok();
    assert_ne!(inputs(&shipped)["calibration"], hash.as_str());
    assert_ne!(
        weights(&mine),
        weights(&shipped),
        "another calibration text fits other weights"
    );

    // A calibration file that does not exist is bad input, and nothing is written.
    let missing = root.path().join("missing.mlpackage");
    let o = convert(dir.path(), &missing)
        .args(FLAGS)
        .args([
            "--recipe",
            "calibrated-4bit",
            "--calibration",
            "/nonexistent/text.txt",
        ])
        .output();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!missing.exists());
}

#[test]
fn compact_recipe_palettizes_the_embedding() {
    needs!(Python);
    let dir = TinyModel::llama().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("compact.mlpackage");
    convert(dir.path(), &pkg)
        .args(FLAGS)
        .args(["--recipe", "compact"])
        .ok();
    let p = MlPackage::open(&pkg).unwrap();
    let c: Contract =
        serde_json::from_str(&p.description().user_defined[contract::METADATA_KEY]).unwrap();
    let tensors = &c.recipe["tensors"];
    assert_eq!(tensors["model.embed_tokens.weight"], "lut6", "{tensors:#}");
    assert_eq!(tensors["model.layers.0.mlp.down_proj.weight"], "lut4");
    assert_eq!(tensors["model.norm.weight"], "fp16");

    let fp16 = root.path().join("fp16.mlpackage");
    convert(dir.path(), &fp16)
        .args(FLAGS)
        .args(["--keep-fp16", "*"])
        .ok();
    assert!(weights(&pkg).len() * 3 < weights(&fp16).len());
}

/// The op that produces constant `name` in the package's main function.
fn producer(p: &MlPackage, name: &str) -> String {
    let main = p.main_function().unwrap();
    main.block
        .operations
        .iter()
        .find(|op| op.outputs.first().is_some_and(|o| o.name == name))
        .unwrap_or_else(|| panic!("no constant `{name}`"))
        .r#type
        .clone()
}

#[test]
fn large_model_recipe_stores_the_embedding_and_lm_head_palettized() {
    needs!(Python);
    // Tied (one table: the embedding is the lm_head) and untied (two tables).
    for (model, tables) in [
        (TinyModel::llama(), &["model.embed_tokens.weight"][..]),
        (
            TinyModel::qwen2(),
            &["model.embed_tokens.weight", "lm_head.weight"][..],
        ),
    ] {
        let dir = model.write_temp().unwrap();
        let root = tempfile::tempdir().unwrap();
        let pkg = root.path().join("large.mlpackage");
        convert(dir.path(), &pkg)
            .args(FLAGS)
            .args(["--recipe", "large-model"])
            .ok();
        let p = MlPackage::open(&pkg).unwrap();
        let c: Contract =
            serde_json::from_str(&p.description().user_defined[contract::METADATA_KEY]).unwrap();
        let decided = &c.recipe["tensors"];
        assert_eq!(decided["model.layers.0.mlp.down_proj.weight"], "lut4");
        for t in tables {
            assert_eq!(decided[*t], "lut8", "{decided:#}");
            let cname = hf2coreml::arch::mil_name(t);
            assert_eq!(producer(&p, &cname), "constexpr_lut_to_dense", "{t}");
        }
        // validate decodes each table from weight.bin (an 8-bit LUT: close, not exact) and the
        // interpreter runs the package; a random tiny model's gates at 4 bits are not the point.
        let o = Cli::new()
            .arg("validate")
            .arg(&pkg)
            .arg("--against")
            .arg(dir.path())
            .args(["--max-tokens", "24", "--json"])
            .output();
        let report: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)));
        let contract = report["contract"].as_array().unwrap();
        assert!(contract.iter().all(|c| c["ok"] == true), "{contract:#?}");
        for t in tables {
            let w = report["weights"]
                .as_array()
                .unwrap()
                .iter()
                .find(|w| w["tensor"] == *t)
                .unwrap_or_else(|| panic!("{t} not checked"));
            let snr = w["snr_db"].as_f64().unwrap_or(f64::INFINITY);
            assert!((30.0..80.0).contains(&snr), "{w}");
        }
        assert!(report["behaviour"]["kl_mean"].as_f64().unwrap().is_finite());
        let lint = Cli::new().arg("lint").arg(&pkg).output();
        assert_eq!(
            lint.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&lint.stdout)
        );
    }
}

#[test]
fn the_wrote_list_names_every_side_file() {
    needs!(Python);
    let dir = TinyModel::llama().write_temp().unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{{ messages[0]['content'] }}"}"#,
    )
    .unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    let o = Cli::new()
        .arg("convert")
        .arg(dir.path())
        .arg("-o")
        .arg(&pkg)
        .args(["--max-seq-len", "16", "--keep-fp16", "*"])
        .python()
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    for side in ["m.mlpackage", "m.tokenizer_config.json", "m.report.json"] {
        assert!(root.path().join(side).exists(), "{side}");
        assert!(out.contains(side), "`{side}` not listed in:\n{out}");
    }
}

#[test]
fn max_seq_len_beyond_the_context_is_refused() {
    needs!(Python);
    let dir = TinyModel {
        context: 256,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    for extra in [&[][..], &["--dry-run"][..]] {
        let o = Cli::new()
            .arg("convert")
            .arg(dir.path())
            .arg("-o")
            .arg(&pkg)
            .args(["--max-seq-len", "257", "--keep-fp16", "*"])
            .args(extra)
            .python()
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(
            err.contains("max_position_embeddings") && err.contains("256"),
            "{err}"
        );
        assert!(!pkg.exists());
    }
}

/// `convert --dry-run --json`'s predicted weight bytes for `recipe`, and weight.bin's size
/// after the conversion.
fn predicted_and_actual(dir: &Path, root: &Path, recipe: &str) -> (i64, i64) {
    let pkg = root.join(format!("{recipe}.mlpackage"));
    let o = convert(dir, &pkg)
        .args(FLAGS)
        .args(["--recipe", recipe, "--dry-run", "--json"])
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let predicted = plan["predicted_weight_bytes"].as_i64().unwrap();
    convert(dir, &pkg)
        .args(FLAGS)
        .args(["--recipe", recipe])
        .ok();
    (predicted, weights(&pkg).len() as i64)
}

#[test]
fn predicted_size_counts_what_calibration_stores() {
    needs!(Python);
    // Calibrated recipes store row scales and rotation constants beside the palettized
    // tensors; the prediction (inspect, budget, --dry-run) must count them. Everything else a
    // package stores (RoPE tables, alignment) is the same for both recipes, so the two
    // predictions must miss by the same amount, up to blob alignment (64 B per constant).
    let model = TinyModel {
        hidden: 128,
        intermediate: 256,
        ..TinyModel::llama()
    };
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let (p_free, a_free) = predicted_and_actual(dir.path(), root.path(), "data-free-4bit");
    let (p_cal, a_cal) = predicted_and_actual(dir.path(), root.path(), "calibrated-4bit");
    assert!(
        a_cal > a_free,
        "calibration stores more: {a_cal} vs {a_free}"
    );
    let (miss_free, miss_cal) = (a_free - p_free, a_cal - p_cal);
    // 2 blocks × 7 projections × (row scales) + 3 rotation constants per width, 64 B each.
    let alignment = 64 * (2 * 7 + 3 * 2);
    assert!(
        (miss_cal - miss_free).abs() <= alignment,
        "data-free misses by {miss_free} B, calibrated by {miss_cal} B"
    );
}

#[test]
fn a_missing_python_environment_is_reported_by_the_dry_run_with_a_fix() {
    needs!(Python);
    // Outside a checkout (no ./.venv) and with no environment named: the dry run still prints
    // the plan, then fails as the conversion would (exit 3), and the hint says what to
    // install, where hf2coreml looks and how to point it elsewhere.
    let dir = TinyModel::llama().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let o = Cli::new()
        .current_dir(root.path())
        .arg("convert")
        .arg(dir.path())
        .args(["-o", "out.mlpackage", "--max-seq-len", "32", "--dry-run"])
        .env_remove("HF2COREML_PYTHON_ENV")
        .env_remove("VIRTUAL_ENV")
        .output();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(3), "{out}\n{err}");
    assert!(
        out.contains("Plan:") && out.contains("python env    unusable"),
        "{out}"
    );
    for needle in [
        "pip install coremltools==9.0 numpy==",
        "-m venv ENV",
        "HF2COREML_PYTHON_ENV=ENV",
        "./.venv",
    ] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    assert!(!root.path().join("out.mlpackage").exists());
    // With the environment named, the same dry run passes and names it.
    let o = convert(dir.path(), root.path().join("out.mlpackage"))
        .args(FLAGS)
        .args(["--dry-run"])
        .output();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("(coremltools 9.0)"), "{out}");
}

#[test]
fn calibrating_without_a_tokenizer_says_so_on_one_line() {
    needs!(Python);
    // The tiny checkpoint has no tokenizer.json: calibration reads the text's bytes as tokens.
    let dir = TinyModel::llama().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let out = Cli::new()
        .arg("convert")
        .arg(dir.path())
        .arg("-o")
        .arg(root.path().join("m.mlpackage"))
        .args(["--max-seq-len", "32", "--recipe", "calibrated-4bit"])
        .python()
        .output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("byte tokens"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("add tokenizer.json"), "{stderr}");
}
