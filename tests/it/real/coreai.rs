//! SmolLM2-135M-Instruct on Apple's Core AI runtime: the cross-check of the interpreter against
//! Apple's runtime on the fp16 package, and (`make test-big`: each converts with the default
//! recipe, whose calibration takes minutes on two cores) the default recipe as an `.aimodel`
//! through `validate` and the cross-check of its package. Apple's Linux runtime computes fp16
//! slowly (about a second or more a step for this model), so these run over a few positions;
//! the figures over 256-512 positions are in docs/quality.md, from the commands given there.

use crate::support::{convert, needs, Cli};

/// Positions each test scores on Apple's runtime.
const POSITIONS: &str = "8";
const MAX_SEQ_LEN: &str = "64";

fn report(cmd: Cli) -> serde_json::Value {
    let o = cmd.output();
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "no report ({e}), exit {:?}: {}",
            o.status.code(),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

#[test]
#[ignore = "big: the default recipe's calibration on SmolLM2 (make test-big)"]
fn the_default_recipe_as_an_asset_passes_validate_on_apples_runtime() {
    needs!(Model, Python);
    let model = hf2coreml_testkit::model_dir();
    let root = tempfile::tempdir().unwrap();
    let asset = root.path().join("smol.aimodel");
    convert(&model, &asset)
        .args(["--max-seq-len", MAX_SEQ_LEN, "--target", "coreai"])
        .ok();
    let r = report(
        Cli::new()
            .args(["validate", asset.to_str().unwrap(), "--against"])
            .arg(&model)
            .args(["--max-tokens", POSITIONS, "--json"]),
    );
    assert_eq!(r["runtime"], "Apple Core AI runtime (coreai-core)");
    assert_eq!(r["passed"], true, "{r:#}");
    let b = &r["behaviour"];
    eprintln!(
        "default recipe on Core AI over {POSITIONS} positions: KL {}, top-1 {}",
        b["kl_mean"], b["top1"]
    );
}

#[test]
fn apples_runtime_and_the_interpreter_agree_on_smollm2() {
    agree_on_smollm2("fp16", &["--keep-fp16", "*"]);
}

#[test]
#[ignore = "big: the default recipe's calibration on SmolLM2 (make test-big)"]
fn apples_runtime_and_the_interpreter_agree_on_the_default_recipe() {
    agree_on_smollm2("default", &[]);
}

/// The cross-check of the package converted with `flags` against Apple's runtime: the two
/// agree to fp16 rounding and no op's values differ beyond it.
fn agree_on_smollm2(name: &str, flags: &[&str]) {
    needs!(Model, Python);
    let model = hf2coreml_testkit::model_dir();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join(format!("{name}.mlpackage"));
    convert(&model, &pkg)
        .args(["--max-seq-len", MAX_SEQ_LEN])
        .args(flags)
        .ok();
    let r = report(
        Cli::new()
            .args(["validate", pkg.to_str().unwrap(), "--against"])
            .arg(&model)
            .args([
                "--max-tokens",
                POSITIONS,
                "--cross-check",
                "coreai",
                "--json",
            ]),
    );
    let x = &r["cross_check"];
    let between = &x["coreai_vs_interpreter"];
    eprintln!(
        "{name}: KL(Core AI ‖ interpreter) {}, top-1 {}, probe: {} values, {} beyond",
        between["kl_mean"], between["top1"], x["probe"]["compared"], x["probe"]["beyond_count"]
    );
    assert!(
        between["kl_mean"].as_f64().unwrap() <= 1e-3,
        "{name}: {x:#}"
    );
    assert!(between["top1"].as_f64().unwrap() >= 0.99, "{name}: {x:#}");
    assert_eq!(x["probe"]["beyond_count"], 0, "{name}: {x:#}");
    assert!(
        x["probe"]["compared"].as_u64().unwrap() > 1000,
        "{name}: {x:#}"
    );
    assert_eq!(r["passed"], true, "{name}: {r:#}");
}
