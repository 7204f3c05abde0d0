//! Interpreter tests against programs built and saved by coremltools itself
//! (python/testgen/mil_cases.py, DEFAULT pass pipeline) with numpy results computed in the same
//! script: every op of a Llama decode step, fp16 rounding and overflow, the int16/uint16 gather
//! path, and LUT weights for nbits 1, 2, 4, 6, 8.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use half::f16;
use hf2coreml::mil::DType;
use hf2coreml::mlpackage::{proto, MlPackage};
use hf2coreml::runtime::interp::{Compute, Data, Options, Program, RuntimeError, Stats, Tensor};
use prost::Message;
use serde_json::Value;

use crate::support::{copy_dir, needs};

/// All cases, generated once per test binary by the venv with coremltools (every test here
/// starts with `needs!(Python)`).
fn cases_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let py = hf2coreml_testkit::python_env().join("bin/python");
        let dir = tempfile::tempdir().expect("temp dir");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/testgen/mil_cases.py");
        let out = std::process::Command::new(py)
            .arg(&script)
            .arg(dir.path())
            .output()
            .expect("run python");
        assert!(
            out.status.success(),
            "mil_cases.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
    .path()
}

fn parse_f(v: &Value) -> f32 {
    match v {
        Value::String(s) if s == "inf" => f32::INFINITY,
        Value::String(s) if s == "-inf" => f32::NEG_INFINITY,
        Value::String(_) => f32::NAN,
        Value::Bool(b) => *b as u8 as f32,
        other => other.as_f64().expect("number") as f32,
    }
}

fn tensor(j: &Value) -> Tensor {
    let shape: Vec<usize> = j["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let data = j["data"].as_array().unwrap();
    match j["dtype"].as_str().unwrap() {
        "fp16" => Tensor::f16(
            shape,
            data.iter().map(|v| f16::from_f32(parse_f(v))).collect(),
        ),
        "fp32" => Tensor::f32(shape, data.iter().map(parse_f).collect()),
        "int32" => Tensor::new(
            DType::I32,
            shape,
            Data::I(data.iter().map(|v| v.as_i64().unwrap()).collect()),
        ),
        "bool" => Tensor::new(
            DType::Bool,
            shape,
            Data::B(data.iter().map(|v| v.as_bool().unwrap()).collect()),
        ),
        other => panic!("dtype {other}"),
    }
}

struct Case {
    program: Program,
    inputs: Vec<(String, Tensor)>,
    outputs: Vec<(String, Tensor)>,
    rtol: f32,
    atol: f32,
}

fn load_case(name: &str, options: Options) -> Case {
    let dir = cases_dir().join(name);
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).unwrap()).unwrap();
    let pkg = MlPackage::open(&dir.join("model.mlpackage")).unwrap();
    let program = Program::load(&pkg, options).unwrap();
    let obj = |k: &str| -> Vec<(String, Tensor)> {
        doc[k]
            .as_object()
            .unwrap()
            .iter()
            .map(|(n, t)| (n.clone(), tensor(t)))
            .collect()
    };
    Case {
        program,
        inputs: obj("inputs"),
        outputs: obj("outputs"),
        rtol: doc["rtol"].as_f64().unwrap() as f32,
        atol: doc["atol"].as_f64().unwrap() as f32,
    }
}

fn run(case: &Case, stats: Option<&mut Stats>) -> HashMap<String, Tensor> {
    let inputs = case
        .inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    case.program.run(inputs, stats).unwrap()
}

fn check(name: &str) {
    let case = load_case(name, Options::default());
    let got = run(&case, None);
    for (oname, exp) in &case.outputs {
        let g = got
            .get(oname)
            .unwrap_or_else(|| panic!("{name}: no output {oname}"));
        assert_eq!(g.shape, exp.shape, "{name}/{oname} shape");
        assert_eq!(
            g.dtype.is_float(),
            exp.dtype.is_float(),
            "{name}/{oname} kind"
        );
        if exp.dtype.is_float() {
            // The program's declared dtype is kept: fp16 in, fp16 out.
            assert_eq!(g.dtype, exp.dtype, "{name}/{oname} dtype");
            let (gv, ev) = (g.as_f32(), exp.as_f32());
            for (i, (&a, &b)) in gv.iter().zip(ev.iter()).enumerate() {
                let ok = if b.is_finite() {
                    (a - b).abs() <= case.atol + case.rtol * b.abs()
                } else {
                    a == b || (a.is_nan() && b.is_nan())
                };
                assert!(ok, "{name}/{oname}[{i}]: got {a}, numpy {b}");
            }
        } else {
            assert_eq!(g.as_i64(), exp.as_i64(), "{name}/{oname}");
        }
    }
}

#[test]
fn elementwise() {
    needs!(Python);
    check("elementwise");
}

#[test]
fn reductions() {
    needs!(Python);
    check("reductions");
}

#[test]
fn shapes() {
    needs!(Python);
    check("shapes");
}

#[test]
fn matmul_linear() {
    needs!(Python);
    check("matmul_linear");
}

#[test]
fn conv_1x1() {
    needs!(Python);
    check("conv");
}

/// A conv other than 1×1 / unit stride is refused with a message naming what is missing,
/// never computed wrong.
#[test]
fn conv_other_than_1x1_is_refused() {
    needs!(Python);
    let case = load_case("conv_3x3", Options::default());
    let inputs = case
        .inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    let err = case.program.run(inputs, None).unwrap_err().to_string();
    assert!(err.contains("only 1×1 kernels"), "{err}");
}

#[test]
fn compare_select() {
    needs!(Python);
    check("compare_select");
}

#[test]
fn gather_fp32() {
    needs!(Python);
    check("gather_fp32");
}

#[test]
fn fp16_rounding() {
    needs!(Python);
    check("fp16_rounding");
}

#[test]
fn fp16_gather_int16() {
    needs!(Python);
    check("fp16_gather_int16");
    // The saved program really takes the int16/uint16 path this test is about.
    let dir = cases_dir();
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("fp16_gather_int16/case.json")).unwrap(),
    )
    .unwrap();
    let ops: Vec<&str> = doc["ops"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.as_str())
        .collect();
    for op in ["cast", "greater_equal", "select", "gather"] {
        assert!(ops.contains(&op), "{op} missing from {ops:?}");
    }
}

#[test]
fn lut_weights_all_nbits() {
    needs!(Python);
    for n in [1, 2, 4, 6, 8] {
        check(&format!("lut{n}"));
    }
}

/// Weights palettized by coremltools' own `palettize_weights` for iOS18 (per_grouped_channel,
/// with and without `enable_per_channel_scale`, 1 to 8 bits including 3): the interpreter
/// reads the sub-byte indices, grouped LUTs and chained blockwise scales and matches the
/// output computed with coremltools' dequantization (`decompress_weights`).
#[test]
fn ios18_palettized_weights_match_coremltools() {
    needs!(Python);
    for n in [1, 2, 3, 4, 6, 8] {
        check(&format!("pal18_n{n}_g4_pcs"));
    }
    check("pal18_n4_g8");
    check("pal18_n3_g16");
    let case = load_case("pal18_n3_g4_pcs", Options::default());
    assert_eq!(case.program.opset(), "CoreML8");
}

#[test]
fn fp16_overflow_is_inf_and_recorded() {
    needs!(Python);
    check("fp16_overflow");
    let case = load_case("fp16_overflow", Options::default());
    let mut stats = Stats::default();
    run(&case, Some(&mut stats));
    assert!(stats.any_non_finite());
    assert!(stats.ops["mul"].non_finite > 0, "{stats:?}");
    // 300 * 0.5 is the largest finite value any mul produced.
    assert_eq!(stats.ops["mul"].max_abs, 10000.0);
}

#[test]
fn compute_f32_keeps_range() {
    needs!(Python);
    let case = load_case(
        "fp16_overflow",
        Options {
            compute: Compute::F32,
            ..Options::default()
        },
    );
    let got = run(&case, None);
    let sq = got["o_sq"].as_f32();
    assert_eq!(sq[1], 90000.0);
    assert_eq!(got["o_sq"].dtype, DType::F32);
}

#[test]
fn unsupported_op_is_named() {
    needs!(Python);
    let dir = cases_dir();
    let src = dir.join("elementwise/model.mlpackage");
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("m.mlpackage");
    copy_dir(&src, &dst);
    let model_path = dst.join("Data/com.apple.CoreML/model.mlmodel");
    let mut model = proto::Model::decode(std::fs::read(&model_path).unwrap().as_slice()).unwrap();
    let f = model
        .ml_program
        .as_mut()
        .unwrap()
        .functions
        .get_mut("main")
        .unwrap();
    let block = f.block_specializations.values_mut().next().unwrap();
    let op = block
        .operations
        .iter_mut()
        .find(|o| o.r#type == "sin")
        .unwrap();
    op.r#type = "frobnicate".into();
    let out_name = op.outputs[0].name.clone();
    std::fs::write(&model_path, model.encode_to_vec()).unwrap();
    let pkg = MlPackage::open(&dst).unwrap();
    let program = Program::load(&pkg, Options::default()).unwrap();
    let case = load_case("elementwise", Options::default());
    let inputs = case
        .inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    match program.run(inputs, None) {
        Err(RuntimeError::UnsupportedOp { op_type, output }) => {
            assert_eq!(op_type, "frobnicate");
            assert_eq!(output, out_name);
        }
        other => panic!("expected UnsupportedOp, got {other:?}"),
    }
}

#[test]
fn wrong_inputs_are_errors() {
    needs!(Python);
    let case = load_case("elementwise", Options::default());
    let mut inputs: Vec<(&str, Tensor)> = case
        .inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    inputs[0].1.shape = vec![inputs[0].1.len()];
    assert!(matches!(
        case.program.run(inputs, None),
        Err(RuntimeError::Input { .. })
    ));
    assert!(matches!(
        case.program.run(vec![], None),
        Err(RuntimeError::Input { .. })
    ));
}

#[test]
fn attention_fp16() {
    needs!(Python);
    check("attention_fp16");
}
