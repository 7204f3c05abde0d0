//! SmolLM2-135M-Instruct (from `make model`) forced into a chain of two packages by
//! `--max-package-size` passes `validate`'s default gates for its recipe, as one package does
//! (real::validate), and `lint` finds nothing that fails. The recipe is data-free 8-bit: what
//! the chain adds (the split, the hidden state between parts, the hashes) does not depend on
//! calibration, which would cost the test minutes more.

use hf2coreml::mil::chain_file::ChainFile;

use crate::support::{convert, needs, Cli};

/// The 8-bit package is ~160 MB (8-bit projections, a 57 MB fp16 tied table); split, the table
/// is stored by the first and the last part, 220 MB in all: 120 MB makes two parts of 110 MB.
const LIMIT: &str = "120MB";

#[test]
fn smollm2_as_two_packages_passes_the_default_gates() {
    needs!(Model, Python);
    let model = hf2coreml_testkit::model_dir();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("smol.mlpackage");
    convert(&model, &pkg)
        .args(["--max-seq-len", "96", "--max-package-size", LIMIT, "-q"])
        .args(["--recipe", "data-free-4bit", "--nbits", "8"])
        .ok();
    let chain = ChainFile::read(&pkg).unwrap();
    assert_eq!(chain.parts.len(), 2, "{chain:#?}");
    assert!(chain.parts.iter().all(|p| p.bytes <= 120_000_000));
    assert_eq!(chain.residual_scale, 1.0 / 128.0);

    let v = Cli::new()
        .args(["validate", pkg.to_str().unwrap(), "--against"])
        .arg(&model)
        .args(["--max-tokens", "64", "--json"])
        .output();
    let report: serde_json::Value = serde_json::from_slice(&v.stdout).unwrap_or_default();
    assert_eq!(
        v.status.code(),
        Some(0),
        "{}\n{report:#}",
        String::from_utf8_lossy(&v.stderr)
    );
    assert!(report["gates"].as_array().is_some_and(|g| !g.is_empty()));
    let l = Cli::new().arg("lint").arg(&pkg).output();
    assert_eq!(
        l.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&l.stdout)
    );
}
