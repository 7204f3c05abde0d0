//! `hf2coreml batch` end to end on tiny checkpoints: good, broken and failing exports, exit
//! codes with and without --keep-going, shards, up-to-date skipping, the shipped example, and
//! snapshots of the text and JSON formats.

use std::path::{Path, PathBuf};
use std::process::Output;

use hf2coreml_testkit::TinyModel;
use serde_json::Value;

use crate::support::{cli, needs};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// Run the binary in `dir` with the Python environment (stderr is not a terminal).
fn batch_in(dir: &Path, args: &[&str]) -> Output {
    cli(args).current_dir(dir).python().output()
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A tiny Llama whose next-token distributions are peaked (see `TinyModel::logit_gain`), so
/// that top-1 agreement measures the package rather than ties.
fn tiny(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    let model = TinyModel {
        logit_gain: 4.0,
        ..TinyModel::llama()
    };
    std::fs::create_dir_all(&dir).unwrap();
    model.write(&dir).expect("write fixture");
    dir
}

/// Good, failing and broken exports, in this order:
/// 1 good (fp16, validated), 2 gate fails (impossible gate), 3 invalid (no model),
/// 4 invalid (unknown device), 5 good (8-bit, not validated).
const MIXED: &str = r#"
[defaults]
model = "tiny"
max_seq_len = 32

[[export]]
name = "good-fp16"
output = "out/good-fp16.mlpackage"
recipe = { default = "fp16" }
validate = { max_tokens = 24 }

[[export]]
name = "strict"
output = "out/strict.mlpackage"
recipe = { default = "fp16", roles = { q = { palettize = { nbits = 8 } } } }
validate = { gates = ["kl_mean<1e-12"], max_tokens = 24 }

[[export]]
name = "no-model"
model = "missing"
output = "out/no-model.mlpackage"

[[export]]
name = "bad-device"
output = "out/bad-device.mlpackage"
device = "iphone-1"
max_package_size = "1GiB"

[[export]]
name = "good-8bit"
output = "out/good-8bit.mlpackage"
recipe = { default = "fp16", roles = { q = { palettize = { nbits = 8 } }, down = { palettize = { nbits = 8 } } } }
"#;

fn setup(batch: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    tiny(root.path(), "tiny");
    std::fs::write(root.path().join("batch.toml"), batch).unwrap();
    root
}

fn report(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn statuses(r: &Value) -> Vec<(String, String)> {
    r["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_string(),
                e["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Nothing of a failed export is left: no package, no sidecar, no partial directory.
fn assert_nothing_for(out: &Path, name: &str) {
    for e in std::fs::read_dir(out).unwrap() {
        let f = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            !f.starts_with(&format!("{name}.")) && !f.starts_with(&format!(".{name}.")),
            "{f} left behind for {name}"
        );
    }
}

#[test]
fn mixed_batch_reports_each_export_and_exits_with_the_worst() {
    needs!(Python);
    let root = setup(MIXED);
    let dir = root.path();
    let o = batch_in(
        dir,
        &["batch", "batch.toml", "--keep-going", "--json", "r.json"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let r = report(&dir.join("r.json"));
    assert_eq!(r["schema"], "hf2coreml.batch-report/1");
    assert_eq!(
        statuses(&r),
        [
            ("good-fp16", "converted"),
            ("strict", "failed"),
            ("no-model", "invalid"),
            ("bad-device", "invalid"),
            ("good-8bit", "converted"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    assert_eq!(r["exit_code"], 2);
    let e = &r["exports"];
    assert_eq!(e[0]["validation"]["passed"], true);
    assert!(e[0]["validation"]["kl_mean"].as_f64().unwrap() < 1e-3);
    assert_eq!(e[1]["exit_code"], 1);
    assert_eq!(e[1]["validation"]["gates"][0]["passed"], false);
    assert!(e[2]["error"].as_str().unwrap().contains("missing"));
    assert!(e[3]["error"].as_str().unwrap().contains("iphone-1"));
    assert!(e[4]["validation"].is_null() && e[4]["package_bytes"].as_u64().unwrap() > 0);
    let out = dir.join("out");
    for good in ["good-fp16", "good-8bit", "strict"] {
        assert!(out
            .join(format!("{good}.mlpackage/Manifest.json"))
            .is_file());
    }
    assert!(out.join("good-fp16.validation.json").is_file());
    for broken in ["no-model", "bad-device"] {
        assert_nothing_for(&out, broken);
    }
    // The summary is on stdout, progress on stderr; nothing else is printed.
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("5 exports: 2 converted, 1 failed, 2 invalid · exit 2"));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("[5/5] good-8bit converted"), "{stderr}");

    // A gate failure alone exits 1.
    let o = batch_in(
        dir,
        &[
            "batch",
            "batch.toml",
            "--only",
            "strict",
            "--only",
            "good-fp16",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

#[test]
fn without_keep_going_the_first_failure_stops_the_batch() {
    needs!(Python);
    let root = setup(MIXED);
    let dir = root.path();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "r.json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r = report(&dir.join("r.json"));
    let s: Vec<String> = statuses(&r).into_iter().map(|(_, s)| s).collect();
    assert_eq!(s, ["converted", "failed", "not-run", "not-run", "not-run"]);
    assert!(!dir.join("out/good-8bit.mlpackage").exists());
}

#[test]
fn a_second_run_skips_up_to_date_exports_and_rebuilds_changed_ones() {
    needs!(Python);
    let batch = r#"
[[export]]
model = "tiny"
output = "out/m-s{max_seq_len}.mlpackage"
max_seq_len = [16, 24]
recipe = { default = "fp16" }
validate = { max_tokens = 12 }
"#;
    let root = setup(batch);
    let dir = root.path();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "a.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let pkg = dir.join("out/m-s16.mlpackage/Data/com.apple.CoreML/weights/weight.bin");
    let mtime = std::fs::metadata(&pkg).unwrap().modified().unwrap();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "b.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let b = report(&dir.join("b.json"));
    assert!(statuses(&b).iter().all(|(_, s)| s == "up-to-date"), "{b}");
    assert_eq!(b["exports"][0]["validation"]["reused"], true);
    assert_eq!(std::fs::metadata(&pkg).unwrap().modified().unwrap(), mtime);
    let a = report(&dir.join("a.json"));
    assert_eq!(
        a["exports"][0]["fingerprint"],
        b["exports"][0]["fingerprint"]
    );

    // A changed recipe is a changed input: rebuilt in place, without --force.
    std::fs::write(
        dir.join("batch.toml"),
        batch.replace(
            r#"recipe = { default = "fp16" }"#,
            r#"recipe = { default = "fp16", roles = { up = { palettize = { nbits = 8 } } } }"#,
        ),
    )
    .unwrap();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "c.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let c = report(&dir.join("c.json"));
    assert!(statuses(&c).iter().all(|(_, s)| s == "converted"), "{c}");
    assert_eq!(c["exports"][0]["validation"]["reused"], false);
    // --force rebuilds even what is up to date.
    let o = batch_in(
        dir,
        &[
            "batch",
            "batch.toml",
            "--force",
            "--only",
            "m-s16",
            "--json",
            "-",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let d: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        statuses(&d),
        [("m-s16".to_string(), "converted".to_string())]
    );
}

#[test]
fn an_output_hf2coreml_did_not_write_is_not_replaced() {
    needs!(Python);
    let root = setup(
        "[[export]]\nmodel = \"tiny\"\noutput = \"out/x.mlpackage\"\nrecipe = { default = \"fp16\" }\n",
    );
    let dir = root.path();
    std::fs::create_dir_all(dir.join("out/x.mlpackage")).unwrap();
    std::fs::write(dir.join("out/x.mlpackage/precious"), b"keep").unwrap();
    let o = batch_in(dir, &["batch", "batch.toml"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("was not written by hf2coreml"));
    assert!(dir.join("out/x.mlpackage/precious").is_file());
}

#[test]
fn shards_list_every_export_exactly_once() {
    needs!(Python);
    let root = setup(
        r#"
[[export]]
model = "tiny"
output = "out/m-s{max_seq_len}-q{query_len}-{device}.mlpackage"
max_seq_len = [16, 32, 64]
query_len = [1, 4]
device = ["iphone-15", "iphone-16-pro"]
"#,
    );
    let dir = root.path();
    let all = batch_in(dir, &["batch", "batch.toml", "--list", "--json"]);
    assert!(all.status.success(), "{}", text(&all));
    let all: Value = serde_json::from_slice(&all.stdout).unwrap();
    let all: Vec<String> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(all.len(), 12);
    let mut seen = Vec::new();
    for i in 1..=5 {
        let o = batch_in(
            dir,
            &[
                "batch",
                "batch.toml",
                "--list",
                "--json",
                "--shard",
                &format!("{i}/5"),
            ],
        );
        assert!(o.status.success(), "{}", text(&o));
        // One line of JSON: what a CI step writes to $GITHUB_OUTPUT.
        assert_eq!(o.stdout.iter().filter(|&&b| b == b'\n').count(), 1);
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        seen.extend(
            v.as_array()
                .unwrap()
                .iter()
                .map(|e| e["name"].as_str().unwrap().to_string()),
        );
    }
    seen.sort();
    let mut expected = all.clone();
    expected.sort();
    assert_eq!(seen, expected);
    let o = batch_in(dir, &["batch", "batch.toml", "--list", "--shard", "6/5"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn bad_batch_files_name_the_line_and_run_nothing() {
    needs!(Python);
    let cases = [
        ("[[export]]\nmodel = \"tiny\"\noutput = \"o.mlpackage\"\nmax_sqe_len = 3\n", "line 4"),
        ("[[export]]\nmodel = \"tiny\"\noutput = \"o.mlpackage\"\nmax_seq_len = -1\n", "batch.toml:4: max_seq_len"),
        ("[[export]]\nmodel = \"tiny\"\noutput = \"o-{size}.mlpackage\"\n", "batch.toml:3: output: unknown placeholder"),
        ("[defaults]\nmodel = \"tiny\"\n", "no [[export]] entries"),
        ("[[export]]\nmodel = \"tiny\"\noutput = \"o.mlpackage\"\nmax_seq_len = [16, 32]\n", "two exports write"),
        ("[[export]]\nmodel = \"tiny\"\noutput = \"o.mlpackage\"\nvalidate = { gates = [\"top1>>1\"] }\n", "batch.toml:4: validate.gates"),
        ("[[export]\nmodel = \"tiny\"\n", "line 1"),
    ];
    for (batch, expected) in cases {
        let root = setup(batch);
        let o = batch_in(root.path(), &["batch", "batch.toml"]);
        assert_eq!(o.status.code(), Some(2), "{batch}\n{}", text(&o));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            stderr.contains(expected),
            "{batch}\nwanted `{expected}` in:\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!root.path().join("o.mlpackage").exists());
    }
}

/// The shipped example, run as a CI job would, against a tiny model in place of SmolLM2.
#[test]
fn the_shipped_example_runs_against_a_tiny_model() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let model = tiny(root.path(), "smollm2-stand-in");
    let example = Path::new(REPO).join("configs/batch/smollm2.toml");
    std::fs::copy(&example, root.path().join("smollm2.toml")).unwrap();
    let run = |args: &[&str]| {
        cli(args)
            .current_dir(root.path())
            .python()
            .env("HF2COREML_MODEL_DIR", &model)
            .output()
    };
    let o = run(&["batch", "smollm2.toml", "--list", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let list: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 8);
    let o = run(&[
        "batch",
        "smollm2.toml",
        "--jobs",
        "2",
        "--json",
        "report.json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&root.path().join("report.json"));
    assert_eq!(r["counts"]["converted"], 8);
    for e in r["exports"].as_array().unwrap() {
        assert_eq!(e["validation"]["passed"], true, "{e}");
        assert!(root.path().join(e["output"].as_str().unwrap()).is_dir());
    }
}

// ---- snapshots of the output formats ----

/// Compare `actual` with tests/snapshots/NAME; `UPDATE_SNAPSHOTS=1` rewrites the file.
fn snapshot(name: &str, actual: &str) {
    let path = Path::new(REPO).join("tests/snapshots").join(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "{} is missing (UPDATE_SNAPSHOTS=1 writes it)",
            path.display()
        )
    });
    assert_eq!(
        actual, expected,
        "{name} changed; if on purpose, rerun with UPDATE_SNAPSHOTS=1 and review the diff"
    );
}

/// Times vary from run to run; sizes do not (the packages are byte-identical).
fn normalize_text(s: &str) -> String {
    s.lines().map(normalize_time).collect::<Vec<_>>().join("\n") + "\n"
}

/// `... 2.9 s` and `... (2.9 s)` → `... T s`, `... (T s)`.
fn normalize_time(line: &str) -> String {
    for suffix in [" s)", " s"] {
        if let Some(head) = line.strip_suffix(suffix) {
            let start = head
                .rfind(|c: char| !(c.is_ascii_digit() || c == '.'))
                .map_or(0, |i| i + 1);
            if start < head.len() {
                return format!("{}T{suffix}", &head[..start]);
            }
        }
    }
    line.to_string()
}

fn normalize_json(mut v: Value) -> Value {
    if let Some(exports) = v["exports"].as_array_mut() {
        for e in exports {
            for k in ["convert", "validate", "total"] {
                if e["seconds"][k].is_number() {
                    e["seconds"][k] = Value::from("T");
                }
            }
            // The fingerprint includes the tool version.
            if e["fingerprint"].is_string() {
                e["fingerprint"] = Value::from("F");
            }
            // Metrics come from float reductions whose last bits may differ between CPUs;
            // the tests above check their values.
            if let Some(v) = e["validation"].as_object_mut() {
                for k in ["kl_mean", "kl_max", "top1", "top5", "ppl_ratio"] {
                    v.insert(k.into(), Value::from("M"));
                }
                if let Some(gates) = v.get_mut("gates").and_then(Value::as_array_mut) {
                    for g in gates {
                        g["value"] = Value::from("M");
                    }
                }
            }
        }
    }
    if v["tool_version"].is_string() {
        v["tool_version"] = Value::from("V");
    }
    v
}

#[test]
fn output_formats_are_pinned() {
    needs!(Python);
    let root = setup(MIXED);
    let dir = root.path();
    // A CI matrix is never built from an export whose model is missing: --list refuses it.
    let o = batch_in(dir, &["batch", "batch.toml", "--list"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("batch.toml:1") && err.contains("`no-model`") && err.contains("missing"),
        "{err}"
    );
    let mut list = vec!["batch", "batch.toml", "--list"];
    for name in ["good-fp16", "strict", "bad-device", "good-8bit"] {
        list.extend(["--only", name]);
    }
    let o = batch_in(dir, &list);
    assert!(o.status.success(), "{}", text(&o));
    snapshot("batch_list.txt", &String::from_utf8_lossy(&o.stdout));
    let o = batch_in(
        dir,
        &[
            "batch",
            "batch.toml",
            "--list",
            "--json",
            "--only",
            "good-fp16",
        ],
    );
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    snapshot(
        "batch_list.json",
        &(serde_json::to_string_pretty(&v).unwrap() + "\n"),
    );
    let o = batch_in(
        dir,
        &["batch", "batch.toml", "--keep-going", "--json", "r.json"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    snapshot(
        "batch_summary.txt",
        &normalize_text(&String::from_utf8_lossy(&o.stdout)),
    );
    snapshot(
        "batch_stderr.txt",
        &normalize_text(&String::from_utf8_lossy(&o.stderr)),
    );
    let r = normalize_json(report(&dir.join("r.json")));
    snapshot(
        "batch_report.json",
        &(serde_json::to_string_pretty(&r).unwrap() + "\n"),
    );
}

/// A .gguf model converts, validates against its own import, and is skipped by a rerun (its
/// fingerprint hashes the .gguf itself).
#[test]
fn a_gguf_model_exports_and_is_skipped_when_up_to_date() {
    needs!(Python);
    use hf2coreml_testkit::gguf::TinyGguf;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    TinyGguf::llama()
        .build()
        .writer
        .write(&dir.join("tiny.gguf"))
        .unwrap();
    std::fs::write(
        dir.join("batch.toml"),
        "[[export]]\nmodel = \"tiny.gguf\"\noutput = \"out/{model}.mlpackage\"\n\
         max_seq_len = 16\nrecipe = { default = \"fp16\" }\nvalidate = { max_tokens = 12 }\n",
    )
    .unwrap();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "-"]);
    assert!(o.status.success(), "{}", text(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        statuses(&r),
        [("tiny".to_string(), "converted".to_string())]
    );
    assert_eq!(r["exports"][0]["validation"]["passed"], true);
    assert!(dir.join("out/tiny.tokenizer.json").is_file());
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "-"]);
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        statuses(&r),
        [("tiny".to_string(), "up-to-date".to_string())]
    );
}

#[test]
fn changed_checkpoint_bytes_or_calibration_text_rebuild() {
    needs!(Python);
    let batch = r#"
[[export]]
model = "tiny"
output = "out/m.mlpackage"
max_seq_len = 16
recipe = "calibrated-4bit"
calibration = "calib.txt"
"#;
    let root = setup(batch);
    let dir = root.path();
    std::fs::write(dir.join("calib.txt"), "one calibration text ".repeat(30)).unwrap();
    let run = |json: &str| {
        let o = batch_in(dir, &["batch", "batch.toml", "--json", json]);
        assert!(o.status.success(), "{}", text(&o));
        let r = report(&dir.join(json));
        (
            statuses(&r)[0].1.clone(),
            r["exports"][0]["fingerprint"].clone(),
        )
    };
    let (first, fp1) = run("a.json");
    assert_eq!(first, "converted");
    assert_eq!(run("b.json").0, "up-to-date");

    // The same file names and sizes, other bytes: a checkpoint written with another seed.
    TinyModel {
        logit_gain: 4.0,
        seed: 99,
        ..TinyModel::llama()
    }
    .write(&dir.join("tiny"))
    .unwrap();
    let (status, fp2) = run("c.json");
    assert_eq!(status, "converted", "new checkpoint bytes rebuild");
    assert_ne!(fp1, fp2);
    assert_eq!(run("d.json").0, "up-to-date");

    // Another calibration text.
    std::fs::write(
        dir.join("calib.txt"),
        "another calibration text ".repeat(30),
    )
    .unwrap();
    let (status, fp3) = run("e.json");
    assert_eq!(status, "converted", "a new calibration text rebuilds");
    assert_ne!(fp2, fp3);
}

#[test]
fn exports_that_write_the_same_package_convert_it_once() {
    needs!(Python);
    // The two iPhones share the 1 GB package limit: their packages are the same bytes, and
    // the second is a copy. The Mac's 2 GiB limit could split differently: it converts.
    let root = setup(
        r#"
[[export]]
model = "tiny"
output = "out/m-{device}.mlpackage"
max_seq_len = 32
recipe = { default = "fp16" }
device = ["iphone-15", "iphone-16-pro", "mac-m1-16gb"]
"#,
    );
    let dir = root.path();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "r.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&dir.join("r.json"));
    let exports = r["exports"].as_array().unwrap();
    let copied: Vec<&Value> = exports.iter().map(|e| &e["copied_from"]).collect();
    assert!(copied[0].is_null() && copied[2].is_null(), "{r:#}");
    assert_eq!(copied[1], &exports[0]["name"], "{r:#}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("copied from"));
    let weights = |d: &str| {
        std::fs::read(dir.join(format!(
            "out/m-{d}.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
        )))
        .unwrap()
    };
    assert_eq!(weights("iphone-15"), weights("iphone-16-pro"));
    // The copy records its own inputs: a second run finds every package up to date.
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "r2.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&dir.join("r2.json"));
    assert_eq!(r["counts"]["up_to_date"], 3, "{r:#}");
}

/// A recipe's `layout` reaches the package through batch: the ane export's
/// contract records it, the default one's records nothing, and a bad layout names its line.
#[test]
fn batch_recipes_carry_the_layout() {
    needs!(Python);
    use hf2coreml::mil::contract::Layout;
    use hf2coreml::runtime::interp::{Options, Package};
    use hf2coreml::runtime::StepModel;
    let root = setup(
        "[defaults]\nmodel = \"tiny\"\nmax_seq_len = 16\n\n[[export]]\nname = \"{recipe}\"\n\
         output = \"out/{recipe}.mlpackage\"\nrecipe = [{ name = \"ane\", layout = \"ane\", \
         default = \"fp16\" }, { name = \"plain\", default = \"fp16\" }]\n",
    );
    let dir = root.path();
    let o = batch_in(dir, &["batch", "batch.toml"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    for (name, layout) in [("ane", Layout::Ane), ("plain", Layout::Default)] {
        let p = Package::load(
            &dir.join(format!("out/{name}.mlpackage")),
            Options::default(),
        );
        assert_eq!(p.unwrap().contract().layout, layout, "{name}");
    }
    std::fs::write(
        dir.join("bad.toml"),
        "[[export]]\nmodel = \"tiny\"\noutput = \"out/b.mlpackage\"\n\
         recipe = { layout = \"tpu\", default = \"fp16\" }\n",
    )
    .unwrap();
    let o = batch_in(dir, &["batch", "bad.toml"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("layout"), "{}", text(&o));
}

/// `target = "coreai"` in a batch recipe: the export is an `.aimodel`, named after it,
/// validated on Apple's runtime, and up to date on a second run.
#[test]
fn a_core_ai_export_converts_validates_and_is_up_to_date_on_a_second_run() {
    needs!(Python);
    let batch = r#"
[[export]]
model = "tiny"
output = "out/ai.aimodel"
max_seq_len = 16
recipe = { default = "fp16", target = "coreai" }
validate = { max_tokens = 12 }
"#;
    let root = setup(batch);
    let dir = root.path();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "a.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let a = report(&dir.join("a.json"));
    assert_eq!(statuses(&a), [("ai".to_string(), "converted".to_string())]);
    assert!(dir.join("out/ai.aimodel/metadata.json").is_file());
    assert!(dir.join("out/ai.report.json").is_file());
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "b.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let b = report(&dir.join("b.json"));
    assert_eq!(statuses(&b), [("ai".to_string(), "up-to-date".to_string())]);
}

/// `max_package_size` splits an export into a chain as `--max-package-size` does: validated
/// part by part, up to date on a second run, and rebuilt as one package when the limit grows.
#[test]
fn max_package_size_makes_a_chain_that_is_up_to_date_on_a_second_run() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let model = TinyModel {
        layers: 4,
        logit_gain: 4.0,
        ..TinyModel::llama()
    };
    std::fs::create_dir_all(dir.join("tiny4")).unwrap();
    model.write(&dir.join("tiny4")).unwrap();
    // A block of the tiny model is about 74 kB beside each part's 1 MiB allowance: 3+ parts.
    let batch = |limit: &str| {
        format!(
            "[[export]]\nmodel = \"tiny4\"\noutput = \"out/c.mlpackage\"\nmax_seq_len = 16\n\
             recipe = {{ default = \"fp16\" }}\nmax_package_size = {limit}\n\
             validate = {{ max_tokens = 12 }}\n"
        )
    };
    std::fs::write(dir.join("batch.toml"), batch("1200000")).unwrap();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "a.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let a = report(&dir.join("a.json"));
    assert_eq!(statuses(&a), [("c".to_string(), "converted".to_string())]);
    assert_eq!(a["exports"][0]["max_package_size"], 1_200_000);
    assert_eq!(a["exports"][0]["validation"]["passed"], true);
    let chain = dir.join("out/c.mlpackage");
    assert!(chain.join("chain.json").is_file(), "not a chain");
    let parts = std::fs::read_dir(&chain)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().join("Manifest.json").is_file())
        .count();
    assert!(parts >= 3, "{parts} parts");

    let o = batch_in(dir, &["batch", "batch.toml", "--json", "b.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let b = report(&dir.join("b.json"));
    assert_eq!(statuses(&b), [("c".to_string(), "up-to-date".to_string())]);

    std::fs::write(dir.join("batch.toml"), batch("\"1GiB\"")).unwrap();
    let o = batch_in(dir, &["batch", "batch.toml", "--json", "c.json"]);
    assert!(o.status.success(), "{}", text(&o));
    let c = report(&dir.join("c.json"));
    assert_eq!(statuses(&c), [("c".to_string(), "converted".to_string())]);
    assert_eq!(c["exports"][0]["max_package_size"], 1u64 << 30);
    assert!(chain.join("Manifest.json").is_file(), "not one package");
    assert!(!chain.join("chain.json").exists());

    for (bad, why) in [
        ("0", "at least 1 byte"),
        ("\"9 parsecs\"", "parsecs"),
        ("true", "byte count"),
    ] {
        std::fs::write(dir.join("bad.toml"), batch(bad)).unwrap();
        let o = batch_in(dir, &["batch", "bad.toml"]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("bad.toml:6"), "{}", text(&o));
        assert!(text(&o).contains(why), "{}", text(&o));
    }
}
