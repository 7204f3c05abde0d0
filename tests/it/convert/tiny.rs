//! `hf2coreml convert` end to end on tiny generated checkpoints of each architecture; the
//! packages are read back with coremltools' own loader (python/inspect_package.py).

use std::path::Path;
use std::process::{Command, Output};

use hf2coreml::arch::{expected_tensors, mil_name, Role};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::mil::contract::{self, Contract};
use hf2coreml::quant::{self, Recipe};
use hf2coreml_testkit::python_env;
use hf2coreml_testkit::TinyModel;
use serde_json::Value;

use crate::support::{convert, needs, Cli};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// Write `model` to a temporary checkpoint and convert it at S = 32.
fn convert_model(model: &TinyModel, out: &Path, extra: &[&str]) -> (tempfile::TempDir, Output) {
    let dir = model.write_temp().expect("write fixture");
    let o = convert(dir.path(), out)
        .args(["--max-seq-len", "32"])
        .args(extra)
        .output();
    (dir, o)
}

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn inspect(pkg: &Path) -> Value {
    let o = Command::new(python_env().join("bin/python"))
        .arg(Path::new(REPO).join("python/inspect_package.py"))
        .arg(pkg)
        .output()
        .expect("run inspect_package.py");
    ok(&o);
    serde_json::from_slice(&o.stdout).expect("inspect_package prints JSON")
}

fn feature(v: &Value, side: &str, name: &str) -> (String, Vec<u64>) {
    let f = v[side]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("{side} `{name}` missing"));
    (
        f["dtype"].as_str().unwrap().to_string(),
        f["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect(),
    )
}

/// Checks every package must pass, whatever the architecture.
fn check_contract(model: &TinyModel, pkg: &Path, s: u64, q: u64, float: &str) -> Value {
    let v = inspect(pkg);
    let spec = model.spec();
    assert_eq!(v["specification_version"], 8);
    assert_eq!(v["opset"], "CoreML7");
    let (l, hkv, d, vocab) = (
        spec.num_hidden_layers as u64,
        spec.num_key_value_heads as u64,
        spec.head_dim as u64,
        spec.vocab_size as u64,
    );
    let names = |side: &str| -> Vec<String> {
        v[side]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        names("inputs"),
        [
            contract::INPUT_IDS,
            contract::POSITION,
            contract::KEY_CACHE,
            contract::VALUE_CACHE
        ]
    );
    assert_eq!(
        names("outputs"),
        [
            contract::LOGITS,
            contract::KEY_UPDATE,
            contract::VALUE_UPDATE
        ]
    );
    assert_eq!(
        feature(&v, "inputs", "input_ids"),
        ("INT32".into(), vec![1, q])
    );
    assert_eq!(feature(&v, "inputs", "position"), ("INT32".into(), vec![1]));
    for c in ["key_cache", "value_cache"] {
        assert_eq!(feature(&v, "inputs", c), (float.into(), vec![l, hkv, s, d]));
    }
    assert_eq!(
        feature(&v, "outputs", "logits"),
        (float.into(), vec![1, q, vocab])
    );
    for c in ["key_update", "value_update"] {
        assert_eq!(
            feature(&v, "outputs", c),
            (float.into(), vec![l, hkv, q, d])
        );
    }
    let md = &v["metadata"];
    assert!(md["author"].as_str().unwrap().starts_with("hf2coreml"));
    assert!(!md["short_description"].as_str().unwrap().is_empty());
    let c: Contract = serde_json::from_str(
        md["user_defined"][contract::METADATA_KEY]
            .as_str()
            .expect("contract metadata"),
    )
    .expect("contract parses");
    assert_eq!(c.version, contract::CONTRACT_VERSION);
    assert_eq!(
        (
            c.max_seq_len,
            c.query_len,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size
        ),
        (
            s as usize,
            q as usize,
            l as usize,
            hkv as usize,
            d as usize,
            vocab as usize
        )
    );
    assert_eq!(c.source.architecture, spec.architecture.hf_name());
    assert!(c.source.files.contains_key("config.json"));
    assert!(c.source.files.values().all(|h| h.len() == 64));
    assert_eq!(c.compute_precision, float_name(float));
    v
}

fn float_name(coreml: &str) -> &'static str {
    if coreml == "FLOAT16" {
        "fp16"
    } else {
        "fp32"
    }
}

/// Every checkpoint tensor is a const (or constexpr) op named after it, stored as fp16.
fn check_weight_names(model: &TinyModel, v: &Value) {
    for slot in expected_tensors(&model.spec()) {
        let name = mil_name(&slot.name);
        let c = v["consts"].get(&name).or_else(|| v["luts"].get(&name));
        // Tensors under 10 elements are immediate values and have no blob; the tiny models'
        // smallest tensors are the norms (hidden = 64), so every weight has one.
        let c = c.unwrap_or_else(|| panic!("no weight op named {name}"));
        if let Some(dt) = c.get("dtype") {
            assert_eq!(dt, 10, "{name} must be fp16 (DataType FLOAT16 = 10)");
        }
    }
}

#[test]
fn llama_tied_gqa_all_fp16() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("tiny.mlpackage");
    let model = TinyModel::llama();
    let (_dir, o) = convert_model(&model, &pkg, &["--keep-fp16", "*"]);
    ok(&o);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    // coremltools' import noise never reaches the terminal.
    for noise in ["Failed to load", "scikit-learn", "Running MIL"] {
        assert!(
            !stdout.contains(noise) && !stderr.contains(noise),
            "{noise}"
        );
    }
    assert!(stdout.contains("bits/weight"), "summary missing:\n{stdout}");
    let v = check_contract(&model, &pkg, 32, 1, "FLOAT16");
    check_weight_names(&model, &v);
    assert_eq!(v["op_counts"].get("constexpr_lut_to_dense"), None);
    // Tied: one embedding const serves the gather and the lm_head; no lm_head const.
    assert!(v["consts"].get("lm_head_weight").is_none());
    let spec = model.spec();
    let embed_bytes = (spec.vocab_size * spec.hidden_size * 2) as u64;
    let all_weights: u64 = expected_tensors(&spec)
        .iter()
        .map(|s| s.numel() as u64 * 2)
        .sum();
    let wb = v["weight_bin_bytes"].as_u64().unwrap();
    assert!(
        wb >= all_weights && wb < all_weights + embed_bytes,
        "weight.bin {wb} B: weights {all_weights} B, a second embedding would add {embed_bytes} B"
    );
    // Sidecars: the report always; no tokenizer.json in the fixture, so none beside it.
    let report: Value =
        serde_json::from_slice(&std::fs::read(root.path().join("tiny.report.json")).unwrap())
            .unwrap();
    assert_eq!(report["tensors"]["model.embed_tokens.weight"], "fp16");
    assert!(!root.path().join("tiny.tokenizer.json").exists());
    // Nothing else left beside the outputs (no partial directories).
    let mut names: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["tiny.mlpackage", "tiny.report.json"]);
}

#[test]
fn qwen2_biases_untied_sharded_with_tokenizer() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("q.mlpackage");
    let model = TinyModel::qwen2();
    let dir = model.write_temp().unwrap();
    let tok = r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}}"#;
    std::fs::write(dir.path().join("tokenizer.json"), tok).unwrap();
    let o = convert(dir.path(), &pkg)
        .args([
            "--max-seq-len",
            "24",
            "--query-len",
            "4",
            // The one-word tokenizer cannot tokenize calibration text: palettize data-free.
            "--recipe",
            "data-free-4bit",
        ])
        .output();
    ok(&o);
    let v = check_contract(&model, &pkg, 24, 4, "FLOAT16");
    check_weight_names(&model, &v);
    assert!(v["consts"].get("lm_head_weight").is_some());
    assert!(v["consts"]
        .get("model_layers_1_self_attn_k_proj_bias")
        .is_some());
    assert_eq!(
        std::fs::read_to_string(root.path().join("q.tokenizer.json")).unwrap(),
        tok
    );
    let c: Contract = serde_json::from_str(
        v["metadata"]["user_defined"][contract::METADATA_KEY]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(c.source.files.contains_key("tokenizer.json"));
    assert!(c
        .source
        .files
        .contains_key("model-00001-of-00002.safetensors"));
}

#[test]
fn mistral_explicit_head_dim_fp32() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    let model = TinyModel::mistral();
    let (_dir, o) = convert_model(
        &model,
        &pkg,
        &["--compute-precision", "fp32", "--keep-fp16", "*"],
    );
    ok(&o);
    let v = check_contract(&model, &pkg, 32, 1, "FLOAT32");
    assert_eq!(model.spec().head_dim, 24);
    for slot in expected_tensors(&model.spec()) {
        if slot.role == Role::Embedding || slot.role == Role::LmHead {
            // fp32 program: the float constants are fp32 (DataType FLOAT32 = 11).
            assert_eq!(v["consts"][mil_name(&slot.name)]["dtype"], 11);
        }
    }
}

#[test]
fn same_inputs_give_a_byte_identical_package() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let mut packages = Vec::new();
    for name in ["a.mlpackage", "b.mlpackage"] {
        let pkg = root.path().join(name);
        ok(&convert(dir.path(), &pkg)
            .args(["--max-seq-len", "16"])
            .output());
        packages.push(hf2coreml_testkit::files_under(&pkg).unwrap());
    }
    // The report records what the package is, not how long it took: only the paths differ.
    let report = |name: &str| -> Value {
        let mut v: Value =
            serde_json::from_slice(&std::fs::read(root.path().join(name)).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("outputs");
        v["emit"].as_object_mut().unwrap().remove("package");
        v
    };
    assert_eq!(report("a.report.json"), report("b.report.json"));
    // Manifest.json, model.mlmodel (protobuf maps) and weight.bin: nothing random, nothing
    // in hash order.
    assert_eq!(packages[0].len(), 3, "{:?}", packages[0].keys());
    for (path, bytes) in &packages[0] {
        assert!(
            packages[1].get(path) == Some(bytes),
            "{} differs between two runs",
            path.display()
        );
    }
}

#[test]
fn existing_output_needs_force() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("x.mlpackage");
    std::fs::create_dir(&pkg).unwrap();
    std::fs::write(pkg.join("keep"), b"old").unwrap();
    let model = TinyModel::llama();
    let (_dir, o) = convert_model(&model, &pkg, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--force"));
    assert!(pkg.join("keep").exists());
    let (_dir, o) = convert_model(&model, &pkg, &["--force"]);
    ok(&o);
    assert!(!pkg.join("keep").exists());
    assert!(pkg.join("Manifest.json").is_file());
}

#[test]
fn missing_python_environment_exits_3_and_says_make_setup() {
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("x.mlpackage");
    let dir = TinyModel::llama().write_temp().unwrap();
    let o = Cli::new()
        .args([
            "convert",
            dir.path().to_str().unwrap(),
            "-o",
            pkg.to_str().unwrap(),
        ])
        .env("HF2COREML_PYTHON_ENV", root.path().join("no-such-venv"))
        .env_remove("VIRTUAL_ENV")
        .output();
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("make setup"));
    // A directory that exists but holds no coremltools.
    let empty = root.path().join("empty-venv");
    std::fs::create_dir_all(empty.join("lib")).unwrap();
    let o = Cli::new()
        .args([
            "convert",
            dir.path().to_str().unwrap(),
            "-o",
            pkg.to_str().unwrap(),
            "--python-env",
            empty.to_str().unwrap(),
        ])
        .output();
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!pkg.exists());
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
}

#[test]
fn over_budget_plan_is_refused_unless_allowed() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("x.mlpackage");
    // 8 layers × 4 kv heads × 64 × 2 B × 2 caches = 8 KiB per cache row: 10^6 rows (under
    // the 2^20 cap on S) is 8 GB, more than an iPhone 15 lets an app have.
    let dir = TinyModel {
        layers: 8,
        hidden: 256,
        heads: 4,
        kv_heads: 4,
        // A context as long as the plan: the budget, not the context, is what refuses it.
        context: 1 << 20,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let args = |extra: &'static str| {
        let mut a = vec![
            "convert".to_string(),
            dir.path().to_string_lossy().into_owned(),
            "-o".into(),
            pkg.to_string_lossy().into_owned(),
            "--max-seq-len".into(),
            "1000000".into(),
            "--device".into(),
            "iphone-15".into(),
            "--dry-run".into(),
        ];
        if !extra.is_empty() {
            a.push(extra.into());
        }
        a
    };
    // A plan that does not fit is a failed check (exit 1), not bad input.
    let o = Cli::new().args(args("")).python().output();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--allow-over-budget"));
    let o = Cli::new()
        .args(args("--allow-over-budget"))
        .python()
        .output();
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stdout).contains("over budget"));
    assert!(!pkg.exists());
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn data_free_luts_in_weight_bin_equal_the_palettizer() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("p.mlpackage");
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    ok(&convert(dir.path(), &pkg)
        .args(["--max-seq-len", "32", "--recipe", "data-free-4bit"])
        .output());
    let v = check_contract(&model, &pkg, 32, 1, "FLOAT16");
    check_weight_names(&model, &v);
    let spec = model.spec();
    let c: Contract = serde_json::from_str(
        v["metadata"]["user_defined"][contract::METADATA_KEY]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    // Random tiny weights keep the residual small: no scale, so LUTs are stored as fitted.
    assert_eq!(c.scaling["residual_scale"], 1.0);
    assert_eq!(
        c.recipe["tensors"]["model.layers.0.mlp.down_proj.weight"],
        "lut4"
    );
    assert_eq!(c.recipe["tensors"]["model.embed_tokens.weight"], "fp16");
    // Every decoder projection 4-bit, embedding and norms fp16.
    assert_eq!(
        v["op_counts"]["constexpr_lut_to_dense"],
        7 * spec.num_hidden_layers as u64
    );
    assert_eq!(v["consts"]["model_embed_tokens_weight"]["dtype"], 10);
    // What weight.bin holds is exactly what the palettizer produced (it is deterministic).
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let recipe = Recipe::builtin("data-free-4bit").unwrap().unwrap();
    let out = quant::palettize_checkpoint(&ckpt, &recipe, &|_| {}).unwrap();
    let mut checked = 0;
    for t in &out.tensors {
        let Some(p) = &t.palettized else { continue };
        let l = &v["luts"][mil_name(&t.slot.name)];
        let lut: Vec<u8> = p.lut().iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(l["lut"]["hex"], hex(&lut), "{} LUT", t.slot.name);
        assert_eq!(
            l["indices"]["hex"],
            hex(&p.packed_indices),
            "{} indices",
            t.slot.name
        );
        checked += 1;
    }
    assert_eq!(checked, 7 * spec.num_hidden_layers);
    let report: Value =
        serde_json::from_slice(&std::fs::read(root.path().join("p.report.json")).unwrap()).unwrap();
    assert!(report["bits_per_weight"].as_f64().unwrap() < 16.0);
    assert!(!report["palettize"]["tensors"]
        .as_array()
        .unwrap()
        .is_empty());
}
