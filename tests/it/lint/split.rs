//! Packages that pass the Neural Engine lint by construction: a tiny model with a vocabulary
//! wider than 16,384 (tied, and untied; fp16 and palettized) gets its logits in parts, the
//! package validates against the float reference (so the split lm_head and the embedding
//! gathered from the parts compute what the checkpoint does), and `lint` finds no error- or
//! fallback-level rule broken.

use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, Cli};

/// Three parts: ⌈32,773 / 16,384⌉ = 3 of width 10,925, the last 10,923.
const VOCAB: usize = 32_773;

fn wide(model: TinyModel) -> TinyModel {
    TinyModel {
        vocab: VOCAB,
        hidden: 32,
        intermediate: 64,
        logit_gain: 4.0,
        ..model
    }
}

fn json(cli: Cli) -> (Option<i32>, serde_json::Value) {
    let o = cli.output();
    let v = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!("no JSON ({e}): {}", String::from_utf8_lossy(&o.stderr));
    });
    (o.status.code(), v)
}

fn check(model: TinyModel, flags: &[&str]) {
    let dir = model.write_temp().unwrap();
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("wide.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "64", "--query-len", "2"])
        .args(flags)
        .ok();

    let (code, lint) = json(Cli::new().arg("lint").arg(&pkg).arg("--json"));
    assert_eq!(code, Some(0), "{lint:#}");
    assert_eq!(lint["counts"]["error"], 0);
    assert_eq!(lint["counts"]["fallback"], 0);

    let (code, report) = json(
        Cli::new()
            .arg("validate")
            .arg(&pkg)
            .arg("--against")
            .arg(dir.path())
            .args(["--max-tokens", "48", "--json"]),
    );
    assert_eq!(code, Some(0), "{report:#}");
    let outputs: Vec<(String, u64)> = report["contract"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["what"].as_str().unwrap().starts_with("output `logits"))
        .map(|c| {
            assert_eq!(c["ok"], true, "{c}");
            let w = c["found"].as_str().unwrap();
            let width = w.trim_end_matches(']').rsplit(", ").next().unwrap();
            (
                c["what"].as_str().unwrap().to_string(),
                width.parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        outputs,
        [
            ("output `logits_0`".to_string(), 10_925),
            ("output `logits_1`".to_string(), 10_925),
            ("output `logits_2`".to_string(), 10_923),
        ]
    );
    assert_eq!(report["lint"]["counts"]["error"], 0);
}

#[test]
fn tied_fp16_logits_in_parts_validate_and_lint_clean() {
    needs!(Python);
    check(wide(TinyModel::llama()), &["--keep-fp16", "*"]);
}

#[test]
fn untied_palettized_lm_head_is_cut_into_parts_that_share_its_lut() {
    needs!(Python);
    // Untied: the embedding stays one (palettized) constant, the lm_head is cut into parts.
    check(
        wide(TinyModel::qwen2()),
        &["--recipe", "compact", "--nbits", "8"],
    );
}

#[test]
fn tied_palettized_table_is_cut_into_parts_that_share_its_lut() {
    needs!(Python);
    check(
        wide(TinyModel::llama()),
        &["--recipe", "compact", "--nbits", "8"],
    );
}
