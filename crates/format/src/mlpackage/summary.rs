//! What a saved package declares, for `inspect PKG`: its functions with their inputs, outputs
//! and ops by kind, the model description (features, states, metadata), the hf2coreml contract
//! when there is one, and the weight bytes by how they are stored. Any ML Program package, ours
//! or anyone's; nothing is executed and no weight is decoded (only the blob headers are read,
//! each checked as the interpreter checks it).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::{proto, FeatureInfo, MlPackage, PackageError};
use crate::mil::contract;
use crate::mil::DType;

/// The JSON schema `inspect PKG --json` prints.
pub const SCHEMA: &str = "hf2coreml.package/1";

#[derive(Debug, Clone, Serialize)]
pub struct PackageSummary {
    pub schema: &'static str,
    pub path: String,
    /// Core ML specification version (8: iOS17, 9: iOS18).
    pub spec_version: i32,
    /// Bytes of every file in the package.
    pub package_bytes: u64,
    pub inputs: Vec<FeatureInfo>,
    pub outputs: Vec<FeatureInfo>,
    pub states: Vec<FeatureInfo>,
    pub metadata: Metadata,
    /// The hf2coreml contract (`hf2coreml.contract` metadata) as recorded, if any.
    pub contract: Option<serde_json::Value>,
    /// The program's functions, by name; empty for a model that is not an ML Program.
    pub functions: Vec<FunctionSummary>,
    /// Weight-file bytes by how they are stored, largest first.
    pub weights: Vec<WeightKind>,
    /// Bytes the constants hold in weight files.
    pub weight_bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Metadata {
    pub short_description: String,
    pub version: String,
    pub author: String,
    pub license: String,
    /// User-defined entries, the contract's among them.
    pub user_defined: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionSummary {
    pub name: String,
    pub opset: String,
    /// `name: dtype[shape]` of each input, as the function declares it.
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    /// Ops, nested blocks included (constants too).
    pub ops: usize,
    pub ops_by_type: BTreeMap<String, usize>,
}

/// Constants of one storage kind: `const fp16`, `constexpr_lut_to_dense 4-bit`, ...
#[derive(Debug, Clone, Serialize)]
pub struct WeightKind {
    pub kind: String,
    pub constants: usize,
    pub bytes: u64,
}

/// Summarize the package at `path`.
pub fn summarize(path: &Path) -> Result<PackageSummary, PackageError> {
    let pkg = MlPackage::open(path)?;
    let d = pkg.description();
    let contract = d
        .user_defined
        .get(contract::METADATA_KEY)
        .and_then(|s| serde_json::from_str(s).ok());
    let mut functions = Vec::new();
    let mut kinds: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    if let Some(program) = pkg.model().ml_program.as_ref() {
        for (name, f) in &program.functions {
            let Some(block) = f.block_specializations.get(&f.opset) else {
                continue;
            };
            let mut ops = Vec::new();
            flatten(block, &mut ops);
            let mut ops_by_type = BTreeMap::new();
            for op in &ops {
                *ops_by_type.entry(op.r#type.clone()).or_insert(0) += 1;
                if let Some((kind, bytes)) = stored(&pkg, op, &mut seen)? {
                    let e = kinds.entry(kind).or_insert((0, 0));
                    e.0 += 1;
                    e.1 += bytes;
                }
            }
            functions.push(FunctionSummary {
                name: name.clone(),
                opset: f.opset.clone(),
                inputs: f
                    .inputs
                    .iter()
                    .map(|i| format!("{}: {}", i.name, type_text(i.r#type.as_ref())))
                    .collect(),
                outputs: block.outputs.clone(),
                ops: ops.len(),
                ops_by_type,
            });
        }
    }
    let mut weights: Vec<WeightKind> = kinds
        .into_iter()
        .map(|(kind, (constants, bytes))| WeightKind {
            kind,
            constants,
            bytes,
        })
        .collect();
    weights.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.kind.cmp(&b.kind)));
    Ok(PackageSummary {
        schema: SCHEMA,
        path: path.display().to_string(),
        spec_version: pkg.spec_version(),
        package_bytes: crate::fsutil::dir_bytes(path).map_err(|source| PackageError::Io {
            path: path.to_path_buf(),
            source,
        })?,
        weight_bytes: weights.iter().map(|w| w.bytes).sum(),
        inputs: d.inputs,
        outputs: d.outputs,
        states: d.states,
        metadata: Metadata {
            short_description: d.short_description,
            version: d.version,
            author: d.author,
            license: d.license,
            user_defined: d.user_defined.into_iter().collect(),
        },
        contract,
        functions,
        weights,
    })
}

/// Every op of `block`, nested blocks included, in program order (the lint walks them too).
pub fn flatten<'a>(block: &'a proto::Block, out: &mut Vec<&'a proto::Operation>) {
    for op in &block.operations {
        out.push(op);
        for b in &op.blocks {
            flatten(b, out);
        }
    }
}

/// A constant op's storage kind and the bytes it keeps in weight files; `None` for other ops.
/// The storage kind and blob bytes of a constant op; `None` for other ops and for an op whose
/// blobs were all counted already (`seen`: a multifunction package's functions point to the
/// same blobs, stored once).
fn stored(
    pkg: &MlPackage,
    op: &proto::Operation,
    seen: &mut std::collections::HashSet<(String, u64)>,
) -> Result<Option<(String, u64)>, PackageError> {
    let kind = match op.r#type.as_str() {
        "const" => {
            let dtype = op
                .outputs
                .first()
                .and_then(|o| tensor_dims(o.r#type.as_ref()))
                .map_or("?", |(d, _)| d.name());
            format!("const {dtype}")
        }
        "constexpr_lut_to_dense" => match lut_bits(op) {
            Some(n) => format!("constexpr_lut_to_dense {n}-bit"),
            None => "constexpr_lut_to_dense".to_string(),
        },
        t if t.starts_with("constexpr_") => t.to_string(),
        _ => return Ok(None),
    };
    let immediates = op
        .inputs
        .values()
        .flat_map(|a| &a.arguments)
        .filter_map(|b| match &b.binding {
            Some(proto::binding::Binding::Value(v)) => Some(v),
            _ => None,
        });
    let (mut bytes, mut blobs, mut new) = (0u64, 0, 0);
    for v in op.attributes.values().chain(immediates) {
        if let Some(proto::value::Value::BlobFileValue(b)) = &v.value {
            blobs += 1;
            if seen.insert((b.file_name.clone(), b.offset)) {
                new += 1;
                let file = pkg.blob_file(&b.file_name)?;
                bytes += file.record(b.offset)?.data.len() as u64;
            }
        }
    }
    if blobs > 0 && new == 0 {
        return Ok(None);
    }
    Ok(Some((kind, bytes)))
}

/// The table size of a LUT op as bits per index: the LUT's entry axis is its only one in the
/// iOS17 form (`[2^n]`) and its second-to-last in the iOS18 form (`[..., 2^n, vector]`).
fn lut_bits(op: &proto::Operation) -> Option<u32> {
    let lut = op.attributes.get("lut").or_else(|| {
        op.inputs
            .get("lut")?
            .arguments
            .iter()
            .find_map(|b| match &b.binding {
                Some(proto::binding::Binding::Value(v)) => Some(v),
                _ => None,
            })
    })?;
    let (_, dims) = tensor_dims(lut.r#type.as_ref())?;
    let entries = match dims.len() {
        0 => return None,
        1 => dims[0],
        n => dims[n - 2],
    }?;
    (entries.is_power_of_two() && entries > 1).then(|| entries.trailing_zeros())
}

/// A tensor type's dtype and dimensions (`None` for a flexible one).
fn tensor_dims(vt: Option<&proto::ValueType>) -> Option<(DType, Vec<Option<u64>>)> {
    let Some(proto::value_type::Type::TensorType(t)) = vt.and_then(|v| v.r#type.as_ref()) else {
        return None;
    };
    let dims = t
        .dimensions
        .iter()
        .map(|d| match &d.dimension {
            Some(proto::dimension::Dimension::Constant(c)) => Some(c.size),
            _ => None,
        })
        .collect();
    Some((DType::from_mil(t.data_type)?, dims))
}

/// `fp16[1, 512]`, `?` for a flexible dimension; `other` for a non-tensor type.
fn type_text(vt: Option<&proto::ValueType>) -> String {
    match tensor_dims(vt) {
        Some((dtype, dims)) => {
            let d: Vec<String> = dims
                .iter()
                .map(|d| d.map_or("?".to_string(), |v| v.to_string()))
                .collect();
            format!("{}[{}]", dtype.name(), d.join(", "))
        }
        None => "other".to_string(),
    }
}
