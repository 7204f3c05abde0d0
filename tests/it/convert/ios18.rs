//! `--target ios18` end to end on the tiny Llama: the shipped `ios18-4bit` recipe (calibrated,
//! one LUT per 8/16 rows, per-row scales) and data-free grouped 3-bit LUTs convert to iOS18
//! packages (specificationVersion 9, opset CoreML8, grouped `constexpr_lut_to_dense` with uintN
//! indices, `constexpr_blockwise_shift_scale`) that `validate` reads and runs; a corrupted
//! grouped LUT fails validation; iOS17 refuses what it cannot store, with exit 2.

use std::path::Path;

use hf2coreml::mil::DType;
use hf2coreml::mlpackage::proto::binding::Binding;
use hf2coreml::mlpackage::proto::value::Value as ValueKind;
use hf2coreml::mlpackage::{tensor_type, MlPackage};
use hf2coreml::runtime::StepModel;
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, Cli};

/// Validate with a KL gate: the tiny model's near-uniform next-token distributions make top-1
/// agreement measure ties (0.84 here at KL 0.03), so the default top-1 gate is replaced.
fn validate(pkg: &Path, dir: &Path) -> (Option<i32>, serde_json::Value, String) {
    let o = Cli::new()
        .arg("validate")
        .arg(pkg)
        .arg("--against")
        .arg(dir)
        .args(["--gate", "kl_mean<=0.05"])
        .arg("--json")
        .output();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let report = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {stderr}"));
    (o.status.code(), report, stderr)
}

/// `run PKG --logits-out` with the weights read in place (the default) and with
/// `--dense-weights`: the same logits file, byte for byte.
fn assert_packed_matches_dense(pkg: &Path, dir: &Path) {
    let logits = |flags: &[&str], name: &str| {
        let file = dir.join(name);
        let o = Cli::new()
            .arg("run")
            .arg(pkg)
            .args([
                "--prompt-ids",
                "1,2,3,4,5",
                "--max-new-tokens",
                "4",
                "--ignore-eos",
            ])
            .arg("--logits-out")
            .arg(&file)
            .args(flags)
            .output();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read(&file).unwrap()
    };
    let packed = logits(&[], "packed.npy");
    assert!(packed.len() > 128, "a logits file");
    assert!(
        packed == logits(&["--dense-weights"], "dense.npy"),
        "{}: packed and dense weights give different logits",
        pkg.display()
    );
}

fn write_recipe(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

/// The grouped LUT ops of a package: (indices dtype, indices shape, LUT shape, LUT offset).
fn grouped_luts(pkg: &Path) -> Vec<(DType, Vec<usize>, Vec<usize>, u64)> {
    let p = MlPackage::open(pkg).unwrap();
    assert_eq!(
        p.spec_version(),
        9,
        "iOS18 packages are specificationVersion 9"
    );
    let main = p.main_function().unwrap();
    assert_eq!(main.opset, "CoreML8");
    let value = |op: &hf2coreml::mlpackage::proto::Operation, key: &str| match &op.inputs[key]
        .arguments[0]
        .binding
    {
        Some(Binding::Value(v)) => v.clone(),
        other => panic!("`{key}` is not a value: {other:?}"),
    };
    main.block
        .operations
        .iter()
        .filter(|op| op.r#type == "constexpr_lut_to_dense")
        .map(|op| {
            let (idx, lut) = (value(op, "indices"), value(op, "lut"));
            let it = tensor_type(idx.r#type.as_ref(), "indices").unwrap();
            let lt = tensor_type(lut.r#type.as_ref(), "lut").unwrap();
            let offset = match lut.value {
                Some(ValueKind::BlobFileValue(b)) => b.offset,
                other => panic!("LUT not in weight.bin: {other:?}"),
            };
            (it.dtype, it.shape, lt.shape, offset)
        })
        .collect()
}

#[test]
fn ios18_grouped_packages_validate_and_ios17_refuses_them() {
    needs!(Python);
    let model = TinyModel {
        logit_gain: 4.0,
        ..TinyModel::llama()
    };
    let dir = model.write_temp().unwrap();
    let out = tempfile::tempdir().unwrap();

    // The shipped recipe, with 8-row groups (the tiny model's k/v have 32 rows).
    let text = hf2coreml::quant::recipe::BUILTIN_RECIPES
        .iter()
        .find(|(n, _)| *n == "ios18-4bit")
        .unwrap()
        .1
        .replace("group_size = 16", "group_size = 8");
    let recipe = write_recipe(out.path(), "g8.toml", &text);
    let pkg = out.path().join("g8.mlpackage");
    let o = convert(dir.path(), &pkg)
        .args(["--max-seq-len", "256"])
        .args(["--recipe", &recipe])
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let luts = grouped_luts(&pkg);
    assert_eq!(luts.len(), 2 * 7, "one grouped LUT per projection");
    for (dtype, idx, lut, _) in &luts {
        assert_eq!(*dtype, DType::U4);
        assert_eq!(lut, &vec![idx[0] / 8, 1, 16, 1], "one table per 8 rows");
    }
    let p = MlPackage::open(&pkg).unwrap();
    let scales = p
        .main_function()
        .unwrap()
        .block
        .operations
        .iter()
        .filter(|op| op.r#type == "constexpr_blockwise_shift_scale")
        .count();
    assert_eq!(scales, 2 * 7, "one per-row scale per projection");
    assert_packed_matches_dense(&pkg, out.path());
    let (code, report, err) = validate(&pkg, dir.path());
    assert_eq!(code, Some(0), "{err}\n{report:#}");
    assert!(report["behaviour"]["kl_mean"].as_f64().unwrap() < 0.05);
    let c = report["contract"].as_array().unwrap();
    assert!(c.iter().all(|i| i["ok"] == true), "{report:#}");
    let contract = hf2coreml::runtime::interp::Package::load(&pkg, Default::default())
        .unwrap()
        .contract()
        .clone();
    assert_eq!(contract.target, hf2coreml::mil::contract::Target::Ios18);

    // A grouped table's entry flipped: validation fails.
    let (_, _, lut_shape, offset) = luts[0].clone();
    let wb = pkg.join("Data/com.apple.CoreML/weights/weight.bin");
    let mut bytes = std::fs::read(&wb).unwrap();
    let last = offset as usize + 64 + 2 * (lut_shape[2] - 1);
    let v = half::f16::from_le_bytes([bytes[last], bytes[last + 1]]);
    bytes[last..last + 2].copy_from_slice(&(-v * half::f16::from_f32(64.0)).to_le_bytes());
    std::fs::write(&wb, &bytes).unwrap();
    let (code, report, err) = validate(&pkg, dir.path());
    assert_eq!(
        code,
        Some(1),
        "a flipped LUT entry must fail: {err}\n{report:#}"
    );

    // Data-free grouped 3-bit: uint3 indices, tables per 16 rows, contract checks pass.
    let grouped =
        "{ palettize = { nbits = 3, granularity = \"per_grouped_channel\", group_size = 16 } }";
    let roles: String = ["q", "k", "v", "o", "gate", "up", "down"]
        .iter()
        .map(|r| format!("{r} = {grouped}\n"))
        .collect();
    let text = format!("default = \"fp16\"\n[roles]\n{roles}");
    let recipe = write_recipe(out.path(), "df3.toml", &text);
    let df3 = out.path().join("df3.mlpackage");
    let o = convert(dir.path(), &df3)
        .args(["--max-seq-len", "256"])
        .args(["--recipe", &recipe, "--target", "ios18"])
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (dtype, idx, lut, _) in grouped_luts(&df3) {
        assert_eq!(dtype, DType::U3);
        assert_eq!(lut, vec![idx[0] / 16, 1, 8, 1]);
    }
    assert_packed_matches_dense(&df3, out.path());
    let (_, report, err) = validate(&df3, dir.path());
    eprintln!("data-free 3-bit g16: kl {}", report["behaviour"]["kl_mean"]);
    let c = report["contract"].as_array().expect(&err);
    assert!(c.iter().all(|i| i["ok"] == true), "{report:#}");
    assert!(report["behaviour"]["kl_mean"].as_f64().unwrap() < 0.5);

    // iOS17 cannot store them: refused before any work, exit 2, naming the fix.
    for flags in [
        vec!["--recipe", recipe.as_str()],
        vec!["--nbits", "3"],
        vec!["--recipe", "ios18-4bit", "--target", "ios17"],
    ] {
        let refused = out.path().join("refused.mlpackage");
        let o = convert(dir.path(), &refused)
            .args(["--max-seq-len", "256"])
            .args(&flags)
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains("ios18"), "{flags:?}: {err}");
        assert!(!refused.exists());
    }
}
