//! Reading saved .mlpackage directories in pure Rust (docs/reference/mlpackage-format.md):
//! Manifest.json → the root model, model.mlmodel as hand-written prost messages ([`proto`]),
//! weight.bin blob storage v2 ([`blob`]). Everything a malformed package can say is checked and
//! reported as a [`PackageError`] naming the file; nothing here panics on bad input.

pub mod blob;
mod package_error;
pub mod proto;
pub mod summary;
pub mod wire;

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use half::{bf16, f16};
use prost::Message;

use crate::mil::DType;
pub use blob::{BlobFile, BlobRecord, BlobWriter};
pub use package_error::PackageError;

/// The weight-file prefix meaning "the folder that holds model.mlmodel".
pub const MODEL_PATH_PREFIX: &str = "@model_path/";

/// Largest Manifest.json we read (coremltools writes a few hundred bytes).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// Largest model.mlmodel we read into memory. The program text of a 70B model is a few MB;
/// weights live in weight.bin, which is mapped, not read.
pub const MAX_MODEL_BYTES: u64 = 256 << 20;
/// Highest tensor rank a type may declare (Core ML allows 5; MIL has no higher use).
pub const MAX_RANK: usize = 16;

/// Why stored bytes or an immediate value do not decode as the tensor they are declared to be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("strings cannot be stored in raw bytes")]
    StringsInRawBytes,
    #[error("element count overflows")]
    CountOverflow,
    #[error("{len} bytes of data for {count} {} elements (need {needed})", .dtype.name())]
    WrongLength {
        len: usize,
        count: usize,
        dtype: DType,
        needed: usize,
    },
    /// Too few bytes for the sub-byte elements (`int4`, `sub-byte`).
    #[error("truncated {0} data")]
    Truncated(&'static str),
    #[error("empty tensor value")]
    EmptyTensorValue,
    #[error("{storage} storage does not fit dtype {}", .dtype.name())]
    StorageMismatch { storage: &'static str, dtype: DType },
}

/// Element values of a decoded constant. Floats of every width are widened to f32 (f16 and
/// bf16 are exact in f32; an fp64 constant is rounded), integers to i64.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    Float(Vec<f32>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
    Str(Vec<String>),
}

impl Values {
    pub fn len(&self) -> usize {
        match self {
            Values::Float(v) => v.len(),
            Values::Int(v) => v.len(),
            Values::Bool(v) => v.len(),
            Values::Str(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A decoded constant: declared dtype, shape and values.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub values: Values,
}

/// Dtype and fixed shape of a tensor type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorTypeInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// Element count of `shape`, checked.
pub fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// The tensor type in a ValueType, requiring fixed dimensions.
pub fn tensor_type(
    vt: Option<&proto::ValueType>,
    what: &str,
) -> Result<TensorTypeInfo, PackageError> {
    let err = |msg: String| PackageError::Value {
        what: what.to_string(),
        msg,
    };
    let tt = match vt.and_then(|v| v.r#type.as_ref()) {
        Some(proto::value_type::Type::TensorType(t)) => t,
        Some(other) => return Err(err(format!("expected a tensor type, found {other:?}"))),
        None => return Err(err("missing type".into())),
    };
    let dtype = DType::from_mil(tt.data_type)
        .ok_or_else(|| err(format!("unknown data type {}", tt.data_type)))?;
    let mut shape = Vec::with_capacity(tt.dimensions.len());
    for d in &tt.dimensions {
        match &d.dimension {
            Some(proto::dimension::Dimension::Constant(c)) => shape.push(
                usize::try_from(c.size)
                    .map_err(|_| err(format!("dimension {} too large", c.size)))?,
            ),
            _ => return Err(err("flexible (unknown) dimensions are not supported".into())),
        }
    }
    if shape.len() > MAX_RANK {
        return Err(err(format!(
            "rank {} exceeds the limit of {MAX_RANK}",
            shape.len()
        )));
    }
    if tt.rank >= 0 && tt.rank as usize != shape.len() {
        return Err(err(format!(
            "rank {} but {} dimensions",
            tt.rank,
            shape.len()
        )));
    }
    element_count(&shape).ok_or_else(|| err(format!("shape {shape:?} overflows")))?;
    Ok(TensorTypeInfo { dtype, shape })
}

/// Unpack `count` elements of `nbits` each from an LSB-first bit stream.
pub fn unpack_bits(data: &[u8], nbits: u32, count: usize) -> Option<Vec<u32>> {
    if nbits == 0 || nbits > 32 {
        return None;
    }
    let needed = count.checked_mul(nbits as usize)?.div_ceil(8);
    if data.len() < needed {
        return None;
    }
    if nbits == 8 {
        return Some(data[..count].iter().map(|&b| b as u32).collect());
    }
    let mask = if nbits == 32 {
        u32::MAX
    } else {
        (1u32 << nbits) - 1
    };
    let mut out = Vec::with_capacity(count);
    let mut bit = 0usize;
    for _ in 0..count {
        let byte = bit / 8;
        let shift = bit % 8;
        // Gather up to 5 bytes: enough for any nbits <= 32 at any shift.
        let mut window = 0u64;
        for k in 0..5 {
            if let Some(&b) = data.get(byte + k) {
                window |= (b as u64) << (8 * k);
            }
        }
        out.push(((window >> shift) as u32) & mask);
        bit += nbits as usize;
    }
    Some(out)
}

/// Pack values (each < 2^nbits) into an LSB-first bit stream; the inverse of [`unpack_bits`].
pub fn pack_bits(values: &[u32], nbits: u32) -> Vec<u8> {
    let mut out = vec![0u8; (values.len() * nbits as usize).div_ceil(8)];
    let mut bit = 0usize;
    for &v in values {
        for k in 0..nbits as usize {
            if (v >> k) & 1 == 1 {
                out[(bit + k) / 8] |= 1 << ((bit + k) % 8);
            }
        }
        bit += nbits as usize;
    }
    out
}

/// Decode raw little-endian storage of `count` elements of `dtype`.
pub fn decode_raw(dtype: DType, data: &[u8], count: usize) -> Result<Values, DecodeError> {
    let bits = dtype.bits();
    if bits == 0 {
        return Err(DecodeError::StringsInRawBytes);
    }
    let needed = count
        .checked_mul(bits as usize)
        .map(|b| b.div_ceil(8))
        .ok_or(DecodeError::CountOverflow)?;
    if bits >= 8 && data.len() != needed || bits < 8 && data.len() < needed {
        return Err(DecodeError::WrongLength {
            len: data.len(),
            count,
            dtype,
            needed,
        });
    }
    let chunks = |n: usize| data[..needed].chunks_exact(n);
    Ok(match dtype {
        DType::F16 => Values::Float(
            chunks(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        DType::BF16 => Values::Float(
            chunks(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        DType::F32 => Values::Float(
            chunks(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        DType::F64 => Values::Float(
            chunks(8)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(c);
                    f64::from_le_bytes(w) as f32
                })
                .collect(),
        ),
        DType::Bool => Values::Bool(data[..needed].iter().map(|&b| b != 0).collect()),
        DType::U8 => Values::Int(data[..needed].iter().map(|&b| b as i64).collect()),
        DType::I8 => Values::Int(data[..needed].iter().map(|&b| b as i8 as i64).collect()),
        DType::I16 => Values::Int(
            chunks(2)
                .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
                .collect(),
        ),
        DType::U16 => Values::Int(
            chunks(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
                .collect(),
        ),
        DType::I32 => Values::Int(
            chunks(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect(),
        ),
        DType::U32 => Values::Int(
            chunks(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect(),
        ),
        DType::I64 | DType::U64 => Values::Int(
            chunks(8)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(c);
                    i64::from_le_bytes(w)
                })
                .collect(),
        ),
        DType::I4 => {
            let raw = unpack_bits(data, 4, count).ok_or(DecodeError::Truncated("int4"))?;
            // Sign-extend the nibble.
            Values::Int(raw.into_iter().map(|v| ((v as i64) << 60) >> 60).collect())
        }
        DType::U1 | DType::U2 | DType::U3 | DType::U4 | DType::U6 => {
            let raw = unpack_bits(data, bits, count).ok_or(DecodeError::Truncated("sub-byte"))?;
            Values::Int(raw.into_iter().map(|v| v as i64).collect())
        }
        DType::Str => unreachable!("bits() == 0 returned above"),
    })
}

/// Manifest.json.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    #[serde(default)]
    file_format_version: String,
    item_info_entries: HashMap<String, ManifestItem>,
    root_model_identifier: String,
}

#[derive(Debug, Clone, serde::Deserialize)]
struct ManifestItem {
    path: String,
}

/// One input or output of the model description.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FeatureInfo {
    pub name: String,
    /// `fp16`, `fp32`, `fp64`, `int32`, `int8`; or `state`/`other` for non-array features.
    pub dtype: String,
    pub shape: Vec<i64>,
}

/// The model description: inputs, outputs, states, metadata.
#[derive(Debug, Clone, Default)]
pub struct Description {
    pub inputs: Vec<FeatureInfo>,
    pub outputs: Vec<FeatureInfo>,
    pub states: Vec<FeatureInfo>,
    pub short_description: String,
    pub version: String,
    pub author: String,
    pub license: String,
    pub user_defined: HashMap<String, String>,
    /// A multifunction model's functions with their own features, in declared order (empty for
    /// a single-function model); `inputs`/`outputs`/`states` are then the default function's.
    pub functions: Vec<FunctionFeatures>,
    /// The function run when an app names none (`defaultFunctionName`; empty: `main`).
    pub default_function: String,
}

/// One function's declared features (ModelDescription.functions).
#[derive(Debug, Clone, Default)]
pub struct FunctionFeatures {
    pub name: String,
    pub inputs: Vec<FeatureInfo>,
    pub outputs: Vec<FeatureInfo>,
    pub states: Vec<FeatureInfo>,
}

fn array_dtype_name(code: i32) -> &'static str {
    match code {
        65552 => "fp16",
        65568 => "fp32",
        65600 => "fp64",
        131104 => "int32",
        131080 => "int8",
        _ => "unknown",
    }
}

fn feature_info(f: &proto::FeatureDescription) -> FeatureInfo {
    let ft = f.r#type.as_ref();
    let array = ft.and_then(|t| {
        t.multi_array_type
            .as_ref()
            .or(t.state_type.as_ref().and_then(|s| s.array_type.as_ref()))
    });
    match array {
        Some(a) => FeatureInfo {
            name: f.name.clone(),
            dtype: array_dtype_name(a.data_type).to_string(),
            shape: a.shape.clone(),
        },
        None => FeatureInfo {
            name: f.name.clone(),
            dtype: "other".into(),
            shape: Vec::new(),
        },
    }
}

/// An opened package.
#[derive(Debug)]
pub struct MlPackage {
    root: PathBuf,
    model_path: PathBuf,
    model: proto::Model,
    blobs: Mutex<HashMap<PathBuf, Arc<BlobFile>>>,
}

/// One function of the program (`main`, or a multifunction model's `prefill`/`decode`).
#[derive(Debug, Clone, Copy)]
pub struct MainFunction<'a> {
    pub name: &'a str,
    pub opset: &'a str,
    pub inputs: &'a [proto::NamedValueType],
    pub block: &'a proto::Block,
}

impl MlPackage {
    /// Open `path` (the .mlpackage directory): read the manifest and parse the root model.
    /// Weight files are opened on first use.
    pub fn open(path: &Path) -> Result<Self, PackageError> {
        let manifest_path = path.join("Manifest.json");
        let bad = |msg: String| PackageError::Manifest {
            path: manifest_path.clone(),
            msg,
        };
        if !path.is_dir() {
            return Err(PackageError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not a .mlpackage directory",
                ),
            });
        }
        let text = read_limited(&manifest_path, MAX_MANIFEST_BYTES)?;
        let text = String::from_utf8(text).map_err(|_| bad("not UTF-8 text".into()))?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let _ = &manifest.file_format_version;
        let item = manifest
            .item_info_entries
            .get(&manifest.root_model_identifier)
            .ok_or_else(|| {
                bad(format!(
                    "rootModelIdentifier {:?} has no itemInfoEntries entry",
                    manifest.root_model_identifier
                ))
            })?;
        let rel = safe_relative(&item.path).ok_or_else(|| {
            bad(format!(
                "root model path {:?} escapes the package",
                item.path
            ))
        })?;
        let model_path = path.join("Data").join(rel);
        if !resolves_inside(path, &model_path) {
            return Err(bad(format!(
                "root model path {:?} resolves (through a symlink) outside the package",
                item.path
            )));
        }
        let bytes = read_limited(&model_path, MAX_MODEL_BYTES)?;
        if let Err(e) = wire::check_decoded_size(&bytes, wire::MAX_DECODED_BYTES) {
            // Malformed bytes get prost's own error, from the prefix the walk accepted (its
            // decoded size is within the limit).
            if let wire::WireError::Malformed(at) = e {
                let prefix = &bytes[..(at + 1).min(bytes.len())];
                if let Err(source) = proto::Model::decode(prefix) {
                    return Err(PackageError::Protobuf {
                        path: model_path,
                        source,
                    });
                }
            }
            return Err(PackageError::Model {
                path: model_path,
                msg: format!("not a valid Core ML model protobuf: {e}"),
            });
        }
        let model =
            proto::Model::decode(bytes.as_slice()).map_err(|source| PackageError::Protobuf {
                path: model_path.clone(),
                source,
            })?;
        // An empty file decodes as a default message: say what it is instead of describing it.
        if model.specification_version <= 0 || model.ml_program.is_none() {
            return Err(PackageError::Model {
                path: model_path,
                msg: format!(
                    "holds no ML program (specification version {}, {} bytes): an empty or \
                     truncated file, or a model of another kind",
                    model.specification_version,
                    bytes.len()
                ),
            });
        }
        Ok(MlPackage {
            root: path.to_path_buf(),
            model_path,
            model,
            blobs: Mutex::new(HashMap::new()),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The root model file (…/Data/com.apple.CoreML/model.mlmodel).
    pub fn model_path(&self) -> &Path {
        &self.model_path
    }

    /// The folder `@model_path` refers to.
    pub fn model_dir(&self) -> &Path {
        self.model_path.parent().unwrap_or(Path::new("."))
    }

    /// The parsed protobuf.
    pub fn model(&self) -> &proto::Model {
        &self.model
    }

    pub fn spec_version(&self) -> i32 {
        self.model.specification_version
    }

    pub fn description(&self) -> Description {
        let Some(d) = self.model.description.as_ref() else {
            return Description::default();
        };
        let md = d.metadata.clone().unwrap_or_default();
        let functions: Vec<FunctionFeatures> = d
            .functions
            .iter()
            .map(|f| FunctionFeatures {
                name: f.name.clone(),
                inputs: f.input.iter().map(feature_info).collect(),
                outputs: f.output.iter().map(feature_info).collect(),
                states: f.state.iter().map(feature_info).collect(),
            })
            .collect();
        // A multifunction model declares its features per function: the top-level lists are
        // the default function's, as an app that names no function sees them.
        let default = functions
            .iter()
            .find(|f| f.name == d.default_function_name && d.input.is_empty());
        let features = |own: &[proto::FeatureDescription],
                        of: fn(&FunctionFeatures) -> &Vec<FeatureInfo>| {
            match default {
                Some(f) => of(f).clone(),
                None => own.iter().map(feature_info).collect(),
            }
        };
        Description {
            inputs: features(&d.input, |f| &f.inputs),
            outputs: features(&d.output, |f| &f.outputs),
            states: features(&d.state, |f| &f.states),
            functions,
            default_function: d.default_function_name.clone(),
            short_description: md.short_description,
            version: md.version_string,
            author: md.author,
            license: md.license,
            user_defined: md.user_defined,
        }
    }

    fn model_err(&self, msg: impl Into<String>) -> PackageError {
        PackageError::Model {
            path: self.model_path.clone(),
            msg: msg.into(),
        }
    }

    /// The ML Program, or an error if the model is another kind.
    pub fn program(&self) -> Result<&proto::Program, PackageError> {
        self.model
            .ml_program
            .as_ref()
            .ok_or_else(|| self.model_err("not an ML Program (no mlProgram field)"))
    }

    /// The function an app runs when it names none: `main`, or for a multifunction model the
    /// description's `defaultFunctionName`; with its opset and the block for that opset.
    pub fn main_function(&self) -> Result<MainFunction<'_>, PackageError> {
        let program = self.program()?;
        if program.functions.contains_key("main") {
            return self.function("main");
        }
        let default = self
            .model
            .description
            .as_ref()
            .map(|d| d.default_function_name.as_str())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                self.model_err("the program has no `main` function and names no default function")
            })?;
        self.function(default)
    }

    /// The program's function names, sorted.
    pub fn function_names(&self) -> Result<Vec<&str>, PackageError> {
        let mut names: Vec<&str> = self
            .program()?
            .functions
            .keys()
            .map(String::as_str)
            .collect();
        names.sort_unstable();
        Ok(names)
    }

    /// The function `name` with its opset and the block specialized for that opset.
    pub fn function(&self, name: &str) -> Result<MainFunction<'_>, PackageError> {
        let (name, f) = self
            .program()?
            .functions
            .get_key_value(name)
            .ok_or_else(|| self.model_err(format!("the program has no `{name}` function")))?;
        let block = f.block_specializations.get(&f.opset).ok_or_else(|| {
            self.model_err(format!(
                "function `{name}` has no block for its opset {:?}",
                f.opset
            ))
        })?;
        Ok(MainFunction {
            name,
            opset: &f.opset,
            inputs: &f.inputs,
            block,
        })
    }

    /// Resolve a blob `fileName` to a path inside the package, refusing anything that escapes.
    pub fn blob_path(&self, file_name: &str) -> Result<PathBuf, PackageError> {
        let rel = file_name
            .strip_prefix(MODEL_PATH_PREFIX)
            .unwrap_or(file_name);
        let rel = safe_relative(rel).ok_or_else(|| PackageError::EscapingFile {
            path: self.model_path.clone(),
            file_name: file_name.to_string(),
        })?;
        let path = self.model_dir().join(rel);
        if !resolves_inside(&self.root, &path) {
            return Err(PackageError::EscapingFile {
                path: self.model_path.clone(),
                file_name: file_name.to_string(),
            });
        }
        Ok(path)
    }

    /// The weight file `file_name`, opened once and shared.
    pub fn blob_file(&self, file_name: &str) -> Result<Arc<BlobFile>, PackageError> {
        let path = self.blob_path(file_name)?;
        let mut files = self.blobs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = files.get(&path) {
            return Ok(f.clone());
        }
        let f = Arc::new(BlobFile::open(&path)?);
        files.insert(path, f.clone());
        Ok(f)
    }

    /// Decode a constant value (immediate or blob); `what` names it in errors.
    pub fn value(&self, v: &proto::Value, what: &str) -> Result<TensorData, PackageError> {
        let ty = tensor_type(v.r#type.as_ref(), what)?;
        let count = element_count(&ty.shape).unwrap_or(0);
        let err = |msg: String| PackageError::Value {
            what: what.to_string(),
            msg,
        };
        let values = match &v.value {
            Some(proto::value::Value::BlobFileValue(b)) => {
                let file = self.blob_file(&b.file_name)?;
                let rec = file.record(b.offset)?;
                if rec.dtype != ty.dtype {
                    return Err(PackageError::Blob {
                        path: file.path().to_path_buf(),
                        offset: b.offset,
                        msg: format!(
                            "blob holds {} but {what} is declared {}",
                            rec.dtype.name(),
                            ty.dtype.name()
                        ),
                    });
                }
                decode_raw(ty.dtype, rec.data, count).map_err(|msg| PackageError::Blob {
                    path: file.path().to_path_buf(),
                    offset: b.offset,
                    msg: format!("{what}: {msg}"),
                })?
            }
            Some(proto::value::Value::ImmediateValue(iv)) => match &iv.value {
                Some(proto::immediate_value::Value::Tensor(t)) => {
                    immediate_tensor(t, ty.dtype, count).map_err(|e| err(e.to_string()))?
                }
                Some(_) => return Err(err("tuple/list/dictionary values are not tensors".into())),
                None => return Err(err("empty immediate value".into())),
            },
            None => return Err(err("value has neither immediate data nor a blob".into())),
        };
        if values.len() != count {
            return Err(err(format!(
                "{} values for shape {:?}",
                values.len(),
                ty.shape
            )));
        }
        Ok(TensorData {
            dtype: ty.dtype,
            shape: ty.shape,
            values,
        })
    }
}

fn immediate_tensor(
    t: &proto::TensorValue,
    dtype: DType,
    count: usize,
) -> Result<Values, DecodeError> {
    use proto::tensor_value::Value as V;
    let v = t.value.as_ref().ok_or(DecodeError::EmptyTensorValue)?;
    let mismatch = || DecodeError::StorageMismatch {
        storage: kind(v),
        dtype,
    };
    Ok(match v {
        V::Floats(f) if dtype.is_float() => Values::Float(f.values.clone()),
        V::Doubles(f) if dtype.is_float() => {
            Values::Float(f.values.iter().map(|&x| x as f32).collect())
        }
        V::Ints(i) if dtype.is_int() => Values::Int(i.values.iter().map(|&x| x as i64).collect()),
        V::LongInts(i) if dtype.is_int() => Values::Int(i.values.clone()),
        V::Bools(b) if dtype == DType::Bool => Values::Bool(b.values.clone()),
        V::Strings(s) if dtype == DType::Str => Values::Str(s.values.clone()),
        V::Bytes(b) if dtype != DType::Str => decode_raw(dtype, &b.values, count)?,
        _ => return Err(mismatch()),
    })
}

fn kind(v: &proto::tensor_value::Value) -> &'static str {
    use proto::tensor_value::Value as V;
    match v {
        V::Floats(_) => "floats",
        V::Ints(_) => "ints",
        V::Bools(_) => "bools",
        V::Strings(_) => "strings",
        V::LongInts(_) => "longInts",
        V::Doubles(_) => "doubles",
        V::Bytes(_) => "bytes",
    }
}

/// False when `path` exists and, symlinks resolved, lies outside `root`. coremltools never
/// writes symlinks; one pointing out of the package would make us read files it does not own.
/// A missing file passes here and fails when opened, with its own message.
fn resolves_inside(root: &Path, path: &Path) -> bool {
    match (root.canonicalize(), path.canonicalize()) {
        (Ok(r), Ok(p)) => p.starts_with(r),
        _ => true,
    }
}

/// The contents of a regular file no larger than `limit`, refused before reading otherwise.
fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, PackageError> {
    crate::fsutil::read_input(path, limit).map_err(|source| PackageError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `rel` as a relative path with only normal components, or None if it is absolute or
/// climbs out with `..`.
fn safe_relative(rel: &str) -> Option<PathBuf> {
    let p = Path::new(rel);
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    if out.as_os_str().is_empty() {
        return None;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bits_round_trip(nbits in prop::sample::select(vec![1u32, 2, 3, 4, 6, 8]),
                           seed in prop::collection::vec(any::<u32>(), 0..200)) {
            let values: Vec<u32> = seed.iter().map(|v| v & ((1 << nbits) - 1)).collect();
            let packed = pack_bits(&values, nbits);
            prop_assert_eq!(packed.len(), (values.len() * nbits as usize).div_ceil(8));
            prop_assert_eq!(unpack_bits(&packed, nbits, values.len()), Some(values));
        }
    }

    #[test]
    fn four_bit_is_low_nibble_first() {
        assert_eq!(unpack_bits(&[0x21, 0x43], 4, 4), Some(vec![1, 2, 3, 4]));
    }

    #[test]
    fn int4_sign_extends() {
        let v = decode_raw(DType::I4, &[0xF8], 2);
        assert_eq!(v, Ok(Values::Int(vec![-8, -1])));
    }

    #[test]
    fn escaping_paths_are_refused() {
        assert!(safe_relative("../x").is_none());
        assert!(safe_relative("/etc/passwd").is_none());
        assert!(safe_relative("weights/../../x").is_none());
        assert_eq!(
            safe_relative("weights/weight.bin"),
            Some(PathBuf::from("weights/weight.bin"))
        );
    }
}
