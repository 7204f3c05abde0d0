//! Small ML Program packages built in code (prost-encoded model.mlmodel, blob storage v2
//! weight.bin), for tests and fuzzing seeds: a valid program to start from, and the pieces to
//! build broken ones. No package lives in git.

use std::collections::HashMap;
use std::path::Path;

use half::f16;
use prost::Message;

use hf2coreml::mil::DType;
use hf2coreml::mlpackage::{pack_bits, proto, BlobWriter};

/// The blob file name coremltools writes.
pub const WEIGHTS: &str = "@model_path/weights/weight.bin";

/// The Manifest.json coremltools writes, with the root model at the usual place.
pub const MANIFEST: &str = r#"{"fileFormatVersion":"1.0.0","itemInfoEntries":{"A1":{"author":"com.apple.CoreML","description":"CoreML Model Specification","name":"model.mlmodel","path":"com.apple.CoreML/model.mlmodel"}},"rootModelIdentifier":"A1"}"#;

/// A tensor ValueType with fixed dimensions.
pub fn value_type(dtype: DType, shape: &[usize]) -> proto::ValueType {
    proto::ValueType {
        r#type: Some(proto::value_type::Type::TensorType(proto::TensorType {
            data_type: dtype.mil_code(),
            rank: shape.len() as i64,
            dimensions: shape
                .iter()
                .map(|&d| proto::Dimension {
                    dimension: Some(proto::dimension::Dimension::Constant(
                        proto::ConstantDimension { size: d as u64 },
                    )),
                })
                .collect(),
        })),
    }
}

/// A value stored in `file` at metadata-record `offset`.
pub fn blob_value(dtype: DType, shape: &[usize], file: &str, offset: u64) -> proto::Value {
    proto::Value {
        doc_string: String::new(),
        r#type: Some(value_type(dtype, shape)),
        value: Some(proto::value::Value::BlobFileValue(proto::BlobFileValue {
            file_name: file.into(),
            offset,
        })),
    }
}

/// An immediate tensor value held as raw bytes.
pub fn bytes_value(dtype: DType, shape: &[usize], bytes: Vec<u8>) -> proto::Value {
    proto::Value {
        doc_string: String::new(),
        r#type: Some(value_type(dtype, shape)),
        value: Some(proto::value::Value::ImmediateValue(proto::ImmediateValue {
            value: Some(proto::immediate_value::Value::Tensor(proto::TensorValue {
                value: Some(proto::tensor_value::Value::Bytes(proto::RepeatedBytes {
                    values: bytes,
                })),
            })),
        })),
    }
}

/// `name = const(val)`.
pub fn const_op(name: &str, val: proto::Value) -> proto::Operation {
    let ty = val.r#type.clone();
    proto::Operation {
        r#type: "const".into(),
        inputs: HashMap::new(),
        outputs: vec![proto::NamedValueType {
            name: name.into(),
            r#type: ty,
        }],
        blocks: vec![],
        attributes: HashMap::from([("val".to_string(), val)]),
    }
}

/// `output = op_type(key = name, ...)` with one output of `dtype[shape]`; every input is bound
/// by name.
pub fn op(
    op_type: &str,
    inputs: &[(&str, &str)],
    output: &str,
    dtype: DType,
    shape: &[usize],
) -> proto::Operation {
    proto::Operation {
        r#type: op_type.into(),
        inputs: inputs
            .iter()
            .map(|(k, n)| {
                (
                    k.to_string(),
                    proto::Argument {
                        arguments: vec![proto::Binding {
                            binding: Some(proto::binding::Binding::Name(n.to_string())),
                        }],
                    },
                )
            })
            .collect(),
        outputs: vec![proto::NamedValueType {
            name: output.into(),
            r#type: Some(value_type(dtype, shape)),
        }],
        blocks: vec![],
        attributes: HashMap::new(),
    }
}

/// An iOS17 ML Program model whose `main` takes `inputs` and runs `ops`.
pub fn model(
    inputs: Vec<(&str, DType, Vec<usize>)>,
    ops: Vec<proto::Operation>,
    outputs: Vec<String>,
) -> proto::Model {
    let inputs: Vec<proto::NamedValueType> = inputs
        .into_iter()
        .map(|(n, d, s)| proto::NamedValueType {
            name: n.into(),
            r#type: Some(value_type(d, &s)),
        })
        .collect();
    let block = proto::Block {
        inputs: vec![],
        outputs,
        operations: ops,
        attributes: HashMap::new(),
    };
    let main = proto::Function {
        inputs,
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
                author: "hf2coreml fixture".into(),
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

/// A small valid program: `y = linear(x, W, b)` with `x: fp16[1, 8]`, `W: fp16[4, 8]` a
/// 4-bit `constexpr_lut_to_dense` over weight.bin, `b` a const in weight.bin. Returns the
/// model and the weight.bin bytes.
pub fn tiny_program() -> (proto::Model, Vec<u8>) {
    let mut w = BlobWriter::new();
    let indices: Vec<u32> = (0..32).map(|i| (i * 7) % 16).collect();
    let idx_off = w.push(DType::U8, &pack_bits(&indices, 4));
    let lut: Vec<u8> = (0..16)
        .flat_map(|i| f16::from_f32(i as f32 / 8.0 - 1.0).to_le_bytes())
        .collect();
    let lut_off = w.push(DType::F16, &lut);
    let bias: Vec<u8> = (0..4)
        .flat_map(|i| f16::from_f32(i as f32 * 0.25).to_le_bytes())
        .collect();
    let bias_off = w.push(DType::F16, &bias);
    let shape: Vec<u8> = [4u32, 8].iter().flat_map(|d| d.to_le_bytes()).collect();
    let lut_op = proto::Operation {
        r#type: "constexpr_lut_to_dense".into(),
        inputs: HashMap::new(),
        outputs: vec![proto::NamedValueType {
            name: "W".into(),
            r#type: Some(value_type(DType::F16, &[4, 8])),
        }],
        blocks: vec![],
        attributes: HashMap::from([
            (
                "indices".to_string(),
                blob_value(DType::U8, &[16], WEIGHTS, idx_off),
            ),
            (
                "lut".to_string(),
                blob_value(DType::F16, &[16], WEIGHTS, lut_off),
            ),
            ("shape".to_string(), bytes_value(DType::U32, &[2], shape)),
        ]),
    };
    let m = model(
        vec![("x", DType::F16, vec![1, 8])],
        vec![
            lut_op,
            const_op("b", blob_value(DType::F16, &[4], WEIGHTS, bias_off)),
            op(
                "linear",
                &[("x", "x"), ("weight", "W"), ("bias", "b")],
                "y",
                DType::F16,
                &[1, 4],
            ),
        ],
        vec!["y".into()],
    );
    (m, w.finish())
}

/// Write a package directory at `dir` (created if missing) from its three files.
pub fn write_package(
    dir: &Path,
    manifest: &str,
    model_bytes: &[u8],
    weights: &[u8],
) -> std::io::Result<()> {
    let data = dir.join("Data/com.apple.CoreML");
    std::fs::create_dir_all(data.join("weights"))?;
    std::fs::write(dir.join("Manifest.json"), manifest)?;
    std::fs::write(data.join("model.mlmodel"), model_bytes)?;
    std::fs::write(data.join("weights/weight.bin"), weights)
}

/// Write `model` and `weights` as a package with the standard manifest.
pub fn write_model(dir: &Path, model: &proto::Model, weights: &[u8]) -> std::io::Result<()> {
    write_package(dir, MANIFEST, &model.encode_to_vec(), weights)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hf2coreml::mlpackage::MlPackage;
    use hf2coreml::runtime::interp::{Options, Program, Tensor};

    #[test]
    fn tiny_program_loads_and_runs() {
        let dir = tempfile::tempdir().unwrap();
        let pkg_dir = dir.path().join("t.mlpackage");
        let (m, w) = tiny_program();
        write_model(&pkg_dir, &m, &w).unwrap();
        let pkg = MlPackage::open(&pkg_dir).unwrap();
        let prog = Program::load(&pkg, Options::default()).unwrap();
        let x = Tensor::f32(vec![1, 8], vec![1.0; 8]);
        let out = prog.run(vec![("x", x)], None).unwrap();
        assert_eq!(out["y"].shape, vec![1, 4]);
    }
}
