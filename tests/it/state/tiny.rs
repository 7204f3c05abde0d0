//! `--kv-cache state` end to end on the tiny Llama: the stateful package (iOS18, one state
//! `kv_cache` [2·L, Hkv, S', D] with S' = S rounded up to 32, no cache inputs or outputs) gives
//! the io package's logits, bit for bit, at every position of a prompt and a greedy
//! continuation, for Q = 1 and Q = 3; its state holds the io host cache's rows exactly (so
//! `--save-cache`/`--load-cache` move them); `validate` passes; `run` prints the io package's
//! tokens; and what a stateful package cannot be is refused with exit 2.

use std::path::{Path, PathBuf};

use hf2coreml::mil::contract::{KvCache, KV_STATE};
use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::interp::Package;
use hf2coreml::runtime::sampling::SamplingParams;
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, Cli};

/// Not a multiple of 32: the state's rows are padded to 64.
const S: usize = 40;

/// `convert` at S; the package once it is written.
fn converted(dir: &Path, out: &Path, flags: &[&str]) -> PathBuf {
    convert(dir, out)
        .args(["--max-seq-len", &S.to_string()])
        .args(flags)
        .ok();
    out.to_path_buf()
}

/// Every weight fp16: the io and state packages then hold the same weights by construction.
fn fp16_recipe(dir: &Path) -> String {
    let p = dir.join("fp16.toml");
    std::fs::write(&p, "default = \"fp16\"\n").unwrap();
    p.display().to_string()
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_at_eos: false,
        record_logits: true,
    }
}

const PROMPT: [u32; 11] = [1, 17, 5, 90, 42, 3, 25, 8, 8, 71, 12];

/// The valid cache rows: keys and values.
type Rows = (Vec<half::f16>, Vec<half::f16>);

/// Prompt + 12 greedy tokens through a generator; (tokens, logits of every position, the
/// valid cache rows).
fn generate(pkg: &Path) -> (Vec<u32>, Vec<f32>, Rows) {
    let mut g = Generator::new(Package::load(pkg, Default::default()).unwrap()).unwrap();
    let out = g.generate(&PROMPT, &greedy(12), &mut |_| Ok(())).unwrap();
    let rows = g.valid_rows().unwrap();
    (out.tokens, out.logits.unwrap().data, rows)
}

#[test]
fn stateful_packages_compute_what_io_packages_compute() {
    needs!(Python);
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let spec = model.spec();
    let recipe = fp16_recipe(tmp.path());
    for q in ["1", "3"] {
        let flags = ["--target", "ios18", "--recipe", &recipe, "--query-len", q];
        let io = converted(
            dir.path(),
            &tmp.path().join(format!("io{q}.mlpackage")),
            &flags,
        );
        let st_flags = [&flags[..], &["--kv-cache", "state"]].concat();
        let st = converted(
            dir.path(),
            &tmp.path().join(format!("st{q}.mlpackage")),
            &st_flags,
        );

        let pkg = Package::load(&st, Default::default()).unwrap();
        let c = hf2coreml::runtime::StepModel::contract(&pkg);
        assert_eq!(c.kv_cache, KvCache::State);
        // iOS18 with Q = 1 has a prefill function by default: the stateful one shares the state.
        assert_eq!(pkg.prefill_len().is_some(), q == "1", "Q = {q}");
        let shape = vec![
            2 * spec.num_hidden_layers,
            spec.num_key_value_heads,
            64,
            spec.head_dim,
        ];
        assert_eq!(c.states.len(), 1);
        assert_eq!(
            (c.states[0].name.as_str(), &c.states[0].shape),
            (KV_STATE, &shape)
        );
        let declared: Vec<_> = pkg
            .program()
            .states()
            .map(|(n, t)| (n, t.shape.clone()))
            .collect();
        assert_eq!(declared, [(KV_STATE, shape.clone())]);
        let d = pkg.description();
        assert_eq!(d.states.len(), 1, "the model description lists the state");
        let names: Vec<&str> = d.inputs.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["input_ids", "position"]);
        assert_eq!(d.outputs.len(), 1, "the logits only");
        let ops: Vec<&str> = pkg_ops(&st);
        for op in ["read_state", "slice_update", "write_state"] {
            assert_eq!(
                ops.iter().filter(|o| **o == op).count(),
                1,
                "{op} in {ops:?}"
            );
        }

        let (io_tokens, io_logits, io_rows) = generate(&io);
        let (st_tokens, st_logits, st_rows) = generate(&st);
        assert_eq!(io_logits.len(), (PROMPT.len() + 11) * spec.vocab_size);
        // The same ops in the same order: the padded rows add exact zeros (masked scores are
        // -30,000 below the row's maximum, whose exponential is 0 in fp16 and f32).
        assert!(
            io_logits
                .iter()
                .zip(&st_logits)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "Q = {q}: logits differ"
        );
        assert_eq!(io_tokens, st_tokens);
        assert_eq!(
            io_rows, st_rows,
            "Q = {q}: the state holds the io cache's rows"
        );
    }
}

fn pkg_ops(pkg: &Path) -> Vec<&'static str> {
    let p = hf2coreml::mlpackage::MlPackage::open(pkg).unwrap();
    let main = p.main_function().unwrap();
    main.block
        .operations
        .iter()
        .map(|o| &*o.r#type.clone().leak())
        .collect()
}

#[test]
fn restored_state_rows_continue_like_the_io_cache() {
    needs!(Python);
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let recipe = fp16_recipe(tmp.path());
    let flags = [
        "--target",
        "ios18",
        "--recipe",
        &recipe,
        "--kv-cache",
        "state",
    ];
    let st = converted(dir.path(), &tmp.path().join("st.mlpackage"), &flags);
    let load = || Generator::new(Package::load(&st, Default::default()).unwrap()).unwrap();
    let mut a = load();
    let first = a.generate(&PROMPT, &greedy(4), &mut |_| Ok(())).unwrap();
    let cached = a.cached_tokens().to_vec();
    let (keys, values) = a.valid_rows().unwrap();
    let whole = [&PROMPT[..], &first.tokens[..], &[7, 9]].concat();
    let straight = a.extend(&whole, &greedy(6), &mut |_| Ok(())).unwrap();
    // A fresh package (zero state) given the saved rows continues the same way.
    let mut b = load();
    b.restore(&cached, &keys, &values, &[]).unwrap();
    let resumed = b.extend(&whole, &greedy(6), &mut |_| Ok(())).unwrap();
    assert_eq!(resumed.timing.prompt_tokens, whole.len() - cached.len());
    assert_eq!(resumed.tokens, straight.tokens);
    assert_eq!(resumed.logits, straight.logits);
}

#[test]
fn validate_and_run_take_a_stateful_package() {
    needs!(Python);
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let recipe = fp16_recipe(tmp.path());
    let base = ["--target", "ios18", "--recipe", &recipe];
    let io = converted(dir.path(), &tmp.path().join("io.mlpackage"), &base);
    let st_flags = [&base[..], &["--kv-cache", "state"]].concat();
    let st = converted(dir.path(), &tmp.path().join("st.mlpackage"), &st_flags);
    let v = Cli::new()
        .arg("validate")
        .arg(&st)
        .arg("--against")
        .arg(dir.path())
        .arg("--json")
        .output();
    let stderr = String::from_utf8_lossy(&v.stderr);
    assert_eq!(v.status.code(), Some(0), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&v.stdout).unwrap();
    let items = report["contract"].as_array().expect("contract items");
    let state_item = items
        .iter()
        .find(|i| i["what"].as_str() == Some("state `kv_cache`"))
        .unwrap_or_else(|| panic!("no state check in {items:?}"));
    assert_eq!(state_item["ok"], true, "{state_item}");
    // lint: the tiny model's head_dim 16 is not a multiple of 32 (its rows are padded to 64).
    let lint = |pkg: &Path| -> Vec<String> {
        let o = Cli::new().arg("lint").arg(pkg).arg("--json").output();
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let f = r["findings"].as_array().unwrap();
        f.iter()
            .map(|x| format!("{} {}", x["rule"], x["detail"]))
            .collect()
    };
    let st_lint = lint(&st);
    let dims: Vec<_> = st_lint
        .iter()
        .filter(|f| f.contains("state-dims"))
        .collect();
    assert_eq!(dims.len(), 1, "{st_lint:?}");
    assert!(dims[0].contains("64, 16"), "{dims:?}");
    assert!(!lint(&io).iter().any(|f| f.contains("state-")));
    let run = |pkg: &Path, extra: &[&str]| {
        let o = Cli::new()
            .arg("run")
            .arg(pkg)
            .args([
                "--prompt-ids",
                "1,17,5,90,42",
                "--max-new-tokens",
                "8",
                "--ignore-eos",
            ])
            .args(extra)
            .output();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(run(&io, &[]), run(&st, &[]));
    // --save-cache from the stateful package, --load-cache into it.
    let cache = tmp.path().join("c.kv");
    run(&st, &["--save-cache", cache.to_str().unwrap()]);
    let o = Cli::new()
        .arg("run")
        .arg(&st)
        .args([
            "--load-cache",
            cache.to_str().unwrap(),
            "--prompt-ids",
            "3,4",
            "--max-new-tokens",
            "2",
        ])
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn what_a_stateful_package_cannot_be_is_refused() {
    needs!(Python);
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.mlpackage");
    let recipe = tmp.path().join("r.toml");
    std::fs::write(&recipe, "kv_cache = \"states\"\ndefault = \"fp16\"\n").unwrap();
    let fp16 = fp16_recipe(tmp.path());
    let cases: [(&[&str], &str); 4] = [
        (&["--kv-cache", "state"], "needs --target ios18"),
        (
            &[
                "--target",
                "ios18",
                "--kv-cache",
                "state",
                "--layout",
                "ane",
            ],
            "drop --layout ane",
        ),
        (
            &[
                "--target",
                "ios18",
                "--kv-cache",
                "state",
                "--recipe",
                &fp16,
                "--max-package-size",
                "1200000",
            ],
            "chain of stateful parts",
        ),
        (&["--recipe", recipe.to_str().unwrap()], "kv_cache must be"),
    ];
    for (flags, says) in cases {
        let o = convert(dir.path(), &out)
            .args(["--max-seq-len", &S.to_string()])
            .args(flags)
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(!out.exists(), "{flags:?} left an output");
    }
}
