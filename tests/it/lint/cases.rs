//! `hf2coreml lint` against packages coremltools itself builds (python/testgen/lint_cases.py):
//! for every rule a package that breaks it and one that does not, a package that breaks
//! several at once, the size rules on sparse files, the policy flags and bad input.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::support::{copy_dir, needs, Cli};

/// Every case, generated once per test binary by the venv with coremltools.
fn cases_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let py = hf2coreml_testkit::python_env().join("bin/python");
        let dir = tempfile::tempdir().expect("temp dir");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/testgen/lint_cases.py");
        let out = Command::new(py)
            .arg(&script)
            .arg(dir.path())
            .output()
            .expect("run python");
        assert!(
            out.status.success(),
            "lint_cases.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
    .path()
}

fn case(name: &str) -> PathBuf {
    cases_dir().join(format!("{name}.mlpackage"))
}

/// `lint PKG --json ARGS`: exit code and the report.
fn lint(pkg: &Path, args: &[&str]) -> (Option<i32>, Value) {
    let out = Cli::new()
        .arg("lint")
        .arg(pkg)
        .arg("--json")
        .args(args)
        .output();
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON from lint {}: {}",
            pkg.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), json)
}

fn rules_found(report: &Value) -> Vec<String> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["rule"].as_str().unwrap().to_string())
        .collect()
}

/// `NAME_bad` has a finding of `rule` and exits as its severity says; `NAME_ok` has none.
fn pair(name: &str, rule: &str) {
    let severity = hf2coreml::lint::rule(rule).unwrap().severity.as_str();
    let (code, bad) = lint(&case(&format!("{name}_bad")), &[]);
    let found: Vec<&Value> = bad["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["rule"] == rule)
        .collect();
    assert!(
        !found.is_empty(),
        "{name}_bad: no `{rule}` finding\n{bad:#}"
    );
    for f in &found {
        assert_eq!(f["severity"], severity);
        for key in ["op_type", "value", "detail", "why", "fix", "source"] {
            assert!(!f[key].as_str().unwrap().is_empty(), "{key} empty: {f}");
        }
    }
    let blocking = severity != "cost";
    assert_eq!(code, Some(i32::from(blocking)), "{name}_bad\n{bad:#}");
    if !blocking {
        let (code, _) = lint(&case(&format!("{name}_bad")), &["--deny", "cost"]);
        assert_eq!(code, Some(1), "{name}_bad with --deny cost");
    }
    let (_, ok) = lint(&case(&format!("{name}_ok")), &[]);
    assert!(
        !rules_found(&ok).contains(&rule.to_string()),
        "{name}_ok has a `{rule}` finding\n{ok:#}"
    );
}

#[test]
fn rank() {
    needs!(Python);
    pair("rank", "rank");
}

#[test]
fn fp32() {
    needs!(Python);
    pair("fp32", "fp32");
}

#[test]
fn dimension_range() {
    needs!(Python);
    pair("dimension_range", "dimension-range");
    let (code, ok) = lint(&case("dimension_range_ok"), &[]);
    assert_eq!(code, Some(0), "16384 wide is inside the range\n{ok:#}");
}

#[test]
fn narrow_last_axis() {
    needs!(Python);
    pair("narrow_last_axis", "narrow-last-axis");
}

#[test]
fn dynamic_shape() {
    needs!(Python);
    pair("dynamic_shape", "dynamic-shape");
}

#[test]
fn neg_inf() {
    needs!(Python);
    pair("neg_inf", "neg-inf");
}

#[test]
fn gather_nd() {
    needs!(Python);
    pair("gather_nd", "gather-nd");
}

#[test]
fn fused_sdpa() {
    needs!(Python);
    pair("fused_sdpa", "fused-sdpa");
}

#[test]
fn decomposed_norm() {
    needs!(Python);
    pair("decomposed_norm", "decomposed-norm");
}

#[test]
fn int_compute() {
    needs!(Python);
    pair("int_compute", "int-compute");
}

#[test]
fn several_rules_at_once_are_each_reported_and_the_policy_decides_the_exit() {
    needs!(Python);
    let pkg = case("several_bad");
    let (code, r) = lint(&pkg, &[]);
    let found = rules_found(&r);
    for rule in ["fp32", "neg-inf", "dimension-range", "narrow-last-axis"] {
        assert!(
            found.contains(&rule.to_string()),
            "{rule} missing: {found:?}"
        );
    }
    assert_eq!(code, Some(1));
    assert_eq!(r["schema"], "hf2coreml.lint/1");
    assert_eq!(r["passed"], false);
    assert!(r["counts"]["error"].as_u64().unwrap() >= 2);
    assert!(r["summary"]["ops_on_neural_engine"].as_u64() < r["summary"]["ops"].as_u64());
    // Allowing the blocking rules leaves the cost finding: exit 0, unless cost is denied.
    let allow = [
        "--allow",
        "fp32",
        "--allow",
        "neg-inf",
        "--allow",
        "dimension-range",
    ];
    let (code, r) = lint(&pkg, &allow);
    assert_eq!(code, Some(0), "{r:#}");
    assert_eq!(rules_found(&r), vec!["narrow-last-axis".to_string(); 2]);
    assert_eq!(r["summary"]["ops_on_neural_engine"], r["summary"]["ops"]);
    let denied: Vec<&str> = allow.iter().copied().chain(["--deny", "cost"]).collect();
    assert_eq!(lint(&pkg, &denied).0, Some(1));
}

/// A copy of a clean case with an extra sparse file of `len` bytes named `name`.
fn with_sparse_file(name: &str, len: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let pkg = dir.path().join("big.mlpackage");
    copy_dir(&case("fp32_ok"), &pkg);
    let f = std::fs::File::create(pkg.join("Data/com.apple.CoreML/weights").join(name)).unwrap();
    f.set_len(len).unwrap();
    dir
}

#[test]
fn package_and_weight_file_sizes() {
    needs!(Python);
    let (code, r) = lint(&case("fp32_ok"), &[]);
    assert_eq!(code, Some(0), "{r:#}");
    let found = rules_found(&r);
    assert!(!found.iter().any(|f| f.contains("size")), "{found:?}");

    let big = with_sparse_file("extra.dat", 1_100_000_000);
    let (code, r) = lint(&big.path().join("big.mlpackage"), &[]);
    assert_eq!(rules_found(&r), ["ios-model-size"], "{r:#}");
    assert_eq!(code, Some(1));
    assert_eq!(r["summary"]["ops_on_neural_engine"], 0);

    let huge = with_sparse_file("weight2.bin", (1 << 31) + 1);
    let (code, r) = lint(&huge.path().join("big.mlpackage"), &[]);
    let found = rules_found(&r);
    assert!(found.contains(&"weight-file-size".to_string()), "{found:?}");
    assert_eq!(code, Some(1));
}

#[test]
fn text_report_names_rule_op_why_fix_and_source() {
    needs!(Python);
    let out = Cli::new()
        .arg("lint")
        .arg(case("dimension_range_bad"))
        .output();
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "error",
        "dimension-range",
        "linear `logits`",
        "W = 16385",
        "why:",
        "fix:",
        "source:",
        "ops and",
    ] {
        assert!(text.contains(want), "{want} missing:\n{text}");
    }
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn bad_input_exits_2() {
    needs!(Python);
    let dir = tempfile::tempdir().unwrap();
    let out = Cli::new().arg("lint").arg(dir.path()).output();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Manifest.json"));
    let out = Cli::new()
        .arg("lint")
        .arg(case("fp32_ok"))
        .args(["--allow", "no-such-rule"])
        .output();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-rule"));
}
