//! Reader tests on packages built here in Rust (prost-encoded model.mlmodel, a blob storage v2
//! weight.bin): every blob dtype decodes to what was written, and malformed packages are
//! refused with an error naming the file, never a panic.

mod wire;

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use hf2coreml::mil::DType;
use hf2coreml::mlpackage::{pack_bits, proto, BlobWriter, MlPackage, PackageError, Values};
use hf2coreml_testkit::mlpackage::{self as fixture, blob_value, const_op, value_type};
use proptest::prelude::*;
use prost::Message;

const WEIGHTS: &str = "@model_path/weights/weight.bin";

fn write_package(dir: &Path, model_bytes: &[u8], weights: &[u8]) {
    fixture::write_package(dir, fixture::MANIFEST, model_bytes, weights).unwrap();
}

fn model(ops: Vec<proto::Operation>, outputs: Vec<String>) -> proto::Model {
    let block = proto::Block {
        inputs: vec![],
        outputs,
        operations: ops,
        attributes: HashMap::new(),
    };
    let main = proto::Function {
        inputs: vec![],
        opset: "CoreML7".into(),
        block_specializations: HashMap::from([("CoreML7".to_string(), block)]),
        attributes: HashMap::new(),
    };
    proto::Model {
        specification_version: 8,
        description: Some(proto::ModelDescription {
            input: vec![],
            output: vec![],
            state: vec![],
            metadata: Some(proto::Metadata {
                author: "test".into(),
                user_defined: HashMap::from([("k".to_string(), "v".to_string())]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ml_program: Some(proto::Program {
            version: 1,
            functions: HashMap::from([("main".to_string(), main)]),
            doc_string: String::new(),
            attributes: HashMap::new(),
        }),
    }
}

/// Raw little-endian storage for `values` of `dtype` (sub-byte: LSB-first packing).
fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let mut out = Vec::new();
    match dtype {
        DType::F16 => values
            .iter()
            .for_each(|&v| out.extend(f16::from_f64(v).to_le_bytes())),
        DType::BF16 => values
            .iter()
            .for_each(|&v| out.extend(bf16::from_f64(v).to_le_bytes())),
        DType::F32 => values
            .iter()
            .for_each(|&v| out.extend((v as f32).to_le_bytes())),
        DType::U8 => values.iter().for_each(|&v| out.push(v as u8)),
        DType::I8 => values.iter().for_each(|&v| out.push(v as i8 as u8)),
        DType::I16 => values
            .iter()
            .for_each(|&v| out.extend((v as i16).to_le_bytes())),
        DType::U16 => values
            .iter()
            .for_each(|&v| out.extend((v as u16).to_le_bytes())),
        DType::I32 => values
            .iter()
            .for_each(|&v| out.extend((v as i32).to_le_bytes())),
        DType::U32 => values
            .iter()
            .for_each(|&v| out.extend((v as u32).to_le_bytes())),
        DType::I4 => {
            let raw: Vec<u32> = values.iter().map(|&v| (v as i32 as u32) & 0xF).collect();
            out = pack_bits(&raw, 4);
        }
        d => {
            let raw: Vec<u32> = values.iter().map(|&v| v as u32).collect();
            out = pack_bits(&raw, d.bits());
        }
    }
    out
}

/// Every blob dtype the format defines, with values in its range.
fn all_dtype_values() -> Vec<(DType, Vec<f64>)> {
    let n = 13; // odd on purpose: sub-byte streams end mid-byte
    let ramp = |lo: f64, hi: f64| -> Vec<f64> {
        (0..n)
            .map(|i| (lo + (hi - lo) * i as f64 / (n - 1) as f64).round())
            .collect()
    };
    vec![
        (DType::F16, (0..n).map(|i| i as f64 * 0.5 - 3.0).collect()),
        (DType::BF16, (0..n).map(|i| i as f64 * 0.25 - 1.0).collect()),
        (
            DType::F32,
            (0..n).map(|i| i as f64 * 0.125 - 0.75).collect(),
        ),
        (DType::U8, ramp(0.0, 255.0)),
        (DType::I8, ramp(-128.0, 127.0)),
        (DType::I16, ramp(-32768.0, 32767.0)),
        (DType::U16, ramp(0.0, 65535.0)),
        (DType::I32, ramp(-2e9, 2e9)),
        (DType::U32, ramp(0.0, 4e9)),
        (DType::I4, ramp(-8.0, 7.0)),
        (DType::U1, ramp(0.0, 1.0)),
        (DType::U2, ramp(0.0, 3.0)),
        (DType::U3, ramp(0.0, 7.0)),
        (DType::U4, ramp(0.0, 15.0)),
        (DType::U6, ramp(0.0, 63.0)),
    ]
}

fn values_as_f64(v: &Values) -> Vec<f64> {
    match v {
        Values::Float(f) => f.iter().map(|&x| x as f64).collect(),
        Values::Int(i) => i.iter().map(|&x| x as f64).collect(),
        other => panic!("unexpected values {other:?}"),
    }
}

#[test]
fn every_blob_dtype_round_trips() {
    let mut w = BlobWriter::new();
    let mut ops = Vec::new();
    let cases = all_dtype_values();
    for (dtype, vals) in &cases {
        let off = w.push(*dtype, &encode(*dtype, vals));
        ops.push(const_op(
            &format!("c_{}", dtype.name()),
            blob_value(*dtype, &[vals.len()], WEIGHTS, off),
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let m = model(ops, vec!["c_fp16".into()]);
    write_package(dir.path(), &m.encode_to_vec(), &w.finish());

    let pkg = MlPackage::open(dir.path()).unwrap();
    assert_eq!(pkg.spec_version(), 8);
    let main = pkg.main_function().unwrap();
    assert_eq!(main.opset, "CoreML7");
    let desc = pkg.description();
    assert_eq!(desc.author, "test");
    assert_eq!(desc.user_defined.get("k").map(String::as_str), Some("v"));
    for (op, (dtype, vals)) in main.block.operations.iter().zip(&cases) {
        let t = pkg
            .value(&op.attributes["val"], &op.outputs[0].name)
            .unwrap();
        assert_eq!(t.dtype, *dtype);
        assert_eq!(t.shape, vec![vals.len()]);
        let got = values_as_f64(&t.values);
        for (g, e) in got.iter().zip(vals) {
            // The float test values are exact in every float width (bf16 keeps 8 bits).
            assert_eq!(g, e, "{}", dtype.name());
        }
    }
}

#[test]
fn immediate_values_decode() {
    let imm = |dtype: DType, shape: &[usize], tv: proto::tensor_value::Value| proto::Value {
        doc_string: String::new(),
        r#type: Some(value_type(dtype, shape)),
        value: Some(proto::value::Value::ImmediateValue(proto::ImmediateValue {
            value: Some(proto::immediate_value::Value::Tensor(proto::TensorValue {
                value: Some(tv),
            })),
        })),
    };
    let half_bytes: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let m = model(vec![], vec![]);
    write_package(dir.path(), &m.encode_to_vec(), &BlobWriter::new().finish());
    let pkg = MlPackage::open(dir.path()).unwrap();
    use proto::tensor_value::Value as V;
    let h = pkg
        .value(
            &imm(
                DType::F16,
                &[2],
                V::Bytes(proto::RepeatedBytes { values: half_bytes }),
            ),
            "h",
        )
        .unwrap();
    assert_eq!(h.values, Values::Float(vec![1.5, -2.0]));
    let i = pkg
        .value(
            &imm(
                DType::I16,
                &[3],
                V::Ints(proto::RepeatedInts {
                    values: vec![-1, 2, 300],
                }),
            ),
            "i",
        )
        .unwrap();
    assert_eq!(i.values, Values::Int(vec![-1, 2, 300]));
    let s = pkg
        .value(
            &imm(
                DType::I32,
                &[],
                V::Ints(proto::RepeatedInts { values: vec![7] }),
            ),
            "s",
        )
        .unwrap();
    assert_eq!((s.shape.len(), s.values), (0, Values::Int(vec![7])));
    let wrong = pkg.value(
        &imm(
            DType::F32,
            &[3],
            V::Floats(proto::RepeatedFloats { values: vec![1.0] }),
        ),
        "short",
    );
    assert!(
        matches!(wrong, Err(PackageError::Value { .. })),
        "{wrong:?}"
    );
}

/// A one-constant package whose weight file the test can then damage.
fn one_blob_package(dir: &Path, file: &str, offset_shift: u64) -> (Vec<u8>, proto::Model) {
    let mut w = BlobWriter::new();
    let off = w.push(DType::F16, &encode(DType::F16, &[1.0; 20]));
    let m = model(
        vec![const_op(
            "w",
            blob_value(DType::F16, &[20], file, off + offset_shift),
        )],
        vec!["w".into()],
    );
    let bytes = w.finish();
    write_package(dir, &m.encode_to_vec(), &bytes);
    (bytes, m)
}

fn read_const(dir: &Path) -> Result<(), PackageError> {
    let pkg = MlPackage::open(dir)?;
    let main = pkg.main_function()?;
    let op = &main.block.operations[0];
    pkg.value(&op.attributes["val"], "w").map(|_| ())
}

#[test]
fn truncated_protobuf_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = one_blob_package(dir.path(), WEIGHTS, 0);
    let bytes = m.encode_to_vec();
    let path = dir.path().join("Data/com.apple.CoreML/model.mlmodel");
    std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    let err = MlPackage::open(dir.path()).unwrap_err();
    assert!(matches!(err, PackageError::Protobuf { .. }), "{err}");
    assert!(err.to_string().contains("model.mlmodel"), "{err}");
}

#[test]
fn bad_sentinel_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut bytes, _) = one_blob_package(dir.path(), WEIGHTS, 0);
    bytes[64] ^= 0xFF;
    std::fs::write(
        dir.path().join("Data/com.apple.CoreML/weights/weight.bin"),
        &bytes,
    )
    .unwrap();
    let err = read_const(dir.path()).unwrap_err();
    assert!(err.to_string().contains("sentinel"), "{err}");
    assert!(err.to_string().contains("weight.bin"), "{err}");
}

#[test]
fn offset_past_the_end_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    one_blob_package(dir.path(), WEIGHTS, 1 << 40);
    let err = read_const(dir.path()).unwrap_err();
    assert!(matches!(err, PackageError::Blob { .. }), "{err}");
    assert!(err.to_string().contains("past the end"), "{err}");
}

#[test]
fn data_size_past_the_end_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut bytes, _) = one_blob_package(dir.path(), WEIGHTS, 0);
    bytes[64 + 8..64 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(
        dir.path().join("Data/com.apple.CoreML/weights/weight.bin"),
        &bytes,
    )
    .unwrap();
    let err = read_const(dir.path()).unwrap_err();
    assert!(err.to_string().contains("past the end"), "{err}");
}

#[test]
fn truncated_weight_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (bytes, _) = one_blob_package(dir.path(), WEIGHTS, 0);
    std::fs::write(
        dir.path().join("Data/com.apple.CoreML/weights/weight.bin"),
        &bytes[..bytes.len() - 3],
    )
    .unwrap();
    let err = read_const(dir.path()).unwrap_err();
    assert!(matches!(err, PackageError::Blob { .. }), "{err}");
}

#[test]
fn escaping_file_names_are_refused() {
    for name in [
        "@model_path/../../../etc/passwd",
        "/etc/passwd",
        "@model_path/weights/../../x.bin",
    ] {
        let dir = tempfile::tempdir().unwrap();
        one_blob_package(dir.path(), name, 0);
        let err = read_const(dir.path()).unwrap_err();
        assert!(
            matches!(err, PackageError::EscapingFile { .. }),
            "{name}: {err}"
        );
    }
}

#[test]
fn bad_manifests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    one_blob_package(dir.path(), WEIGHTS, 0);
    let manifest = dir.path().join("Manifest.json");
    for text in [
        "{",
        r#"{"itemInfoEntries":{},"rootModelIdentifier":"A1"}"#,
        r#"{"itemInfoEntries":{"A1":{"path":"../../x"}},"rootModelIdentifier":"A1"}"#,
    ] {
        std::fs::write(&manifest, text).unwrap();
        let err = MlPackage::open(dir.path()).unwrap_err();
        assert!(matches!(err, PackageError::Manifest { .. }), "{err}");
        assert!(err.to_string().contains("Manifest.json"), "{err}");
    }
    std::fs::remove_file(&manifest).unwrap();
    assert!(matches!(
        MlPackage::open(dir.path()),
        Err(PackageError::Io { .. })
    ));
}

#[test]
fn wrong_blob_version_and_dtype_mismatch_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut bytes, _) = one_blob_package(dir.path(), WEIGHTS, 0);
    let path = dir.path().join("Data/com.apple.CoreML/weights/weight.bin");
    bytes[4] = 3;
    std::fs::write(&path, &bytes).unwrap();
    assert!(read_const(dir.path())
        .unwrap_err()
        .to_string()
        .contains("version"));
    bytes[4] = 2;
    bytes[64 + 4] = 2; // declared f32 in the record, f16 in the program
    std::fs::write(&path, &bytes).unwrap();
    assert!(read_const(dir.path())
        .unwrap_err()
        .to_string()
        .contains("declared"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random garbage in every file of a package: an error or a value, never a panic.
    #[test]
    fn garbage_never_panics(model_bytes in prop::collection::vec(any::<u8>(), 0..300),
                            flip in 0usize..200, byte in any::<u8>()) {
        let dir = tempfile::tempdir().unwrap();
        let (mut weights, m) = one_blob_package(dir.path(), WEIGHTS, 0);
        let n = weights.len();
        weights[flip % n] = byte;
        let data = dir.path().join("Data/com.apple.CoreML");
        std::fs::write(data.join("weights/weight.bin"), &weights).unwrap();
        let _ = read_const(dir.path());
        let mut good = m.encode_to_vec();
        good.extend_from_slice(&model_bytes);
        std::fs::write(data.join("model.mlmodel"), &model_bytes).unwrap();
        let _ = read_const(dir.path());
        std::fs::write(data.join("model.mlmodel"), &good).unwrap();
        let _ = read_const(dir.path());
    }

    /// f32 blobs of any length and content read back bit for bit.
    #[test]
    fn f32_blobs_round_trip(vals in prop::collection::vec(-1e30f32..1e30, 1..100)) {
        let dir = tempfile::tempdir().unwrap();
        let mut w = BlobWriter::new();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let off = w.push(DType::F32, &bytes);
        let m = model(vec![const_op("w", blob_value(DType::F32, &[vals.len()], WEIGHTS, off))], vec!["w".into()]);
        write_package(dir.path(), &m.encode_to_vec(), &w.finish());
        let pkg = MlPackage::open(dir.path()).unwrap();
        let op = &pkg.main_function().unwrap().block.operations[0];
        let t = pkg.value(&op.attributes["val"], "w").unwrap();
        prop_assert_eq!(t.values, Values::Float(vals));
    }
}
