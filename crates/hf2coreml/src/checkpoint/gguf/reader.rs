//! An opened GGUF file: metadata, a validated tensor table, and dequantized reads.
//!
//! The header is parsed here rather than by candle's `gguf_file::Content::read`, which panics
//! on `general.alignment = 0` and rejects a whole file for one unknown tensor type without
//! naming the tensor. Every length, count, shape and offset is checked arithmetic bounded by
//! the file size before anything is allocated or read; tensors may not share bytes.
//! [`super::dequant`] dequantizes the tensor data.

use std::collections::HashMap;
use std::io::{BufReader, Cursor, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;

use super::dequant::{block_layout, GgmlType};
use super::gguf_error::GgufError;
use super::tensor_types::type_name;

/// GGUF's default tensor data alignment.
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's limit on tensor rank.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this do not occur in real files; the cap bounds recursion.
const MAX_VALUE_DEPTH: usize = 4;
/// Metadata array elements allowed in one file. A parsed value takes ~32 bytes however few
/// it took on disk, so a file-size bound alone would let a 100 MB array of u8 cost 3 GB.
/// Real vocabularies are well under a million entries (plus as many merges and types).
const MAX_ARRAY_ELEMENTS: u64 = 1 << 24;
/// Tensors allowed in one file; real models have a few thousand. Bounds the tensor table,
/// which is allocated up front from the declared count.
const MAX_TENSORS: u64 = 1 << 20;

/// One tensor of the file, with its shape already in row-major (Hugging Face) order.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// ggml type id.
    pub type_id: u32,
    /// The type, when it is one we dequantize.
    pub dtype: Option<GgmlType>,
    /// Row-major shape: GGUF lists dims fastest-first, this is that list reversed.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub start: u64,
    /// Data size (0 when the type is unsupported and its size unknown).
    pub n_bytes: u64,
}

impl GgufTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn type_name(&self) -> String {
        type_name(self.type_id)
    }
}

/// Where a GGUF file's bytes come from: the file itself, or memory (fuzzing, tests).
trait Source: Read + Seek + Send + std::fmt::Debug {}
impl<T: Read + Seek + Send + std::fmt::Debug> Source for T {}

type SourceReader = BufReader<Box<dyn Source>>;

/// A GGUF file whose header has been read and checked.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    reader: SourceReader,
    file_size: u64,
    version: u32,
    metadata: HashMap<String, Value>,
    /// In file order.
    tensors: Vec<GgufTensor>,
    /// Where the last tensor's data ends (beyond `file_size` in a truncated file).
    data_end: u64,
    /// Keys holding a string that is not UTF-8 (kept with U+FFFD in its place), with the
    /// byte offset of the first such string.
    not_utf8: HashMap<String, u64>,
}

/// A bounds-checked little-endian reader over the header.
struct Header<'a> {
    r: &'a mut SourceReader,
    pos: u64,
    size: u64,
    /// Array elements still allowed (see [`MAX_ARRAY_ELEMENTS`]).
    elements_left: u64,
    path: &'a Path,
    /// See [`GgufFile::not_utf8`].
    not_utf8: HashMap<String, u64>,
}

impl Header<'_> {
    fn malformed(&self, message: String) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            message,
        }
    }

    fn need(&self, n: u64, what: &str) -> Result<(), GgufError> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(self.malformed(format!(
                "file ends inside the header ({what} needs {n} bytes at offset {}, file has {})",
                self.pos, self.size
            ))),
        }
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>, GgufError> {
        self.need(n, what)?;
        let mut buf = vec![0u8; n as usize];
        self.r
            .read_exact(&mut buf)
            .map_err(|source| GgufError::Io {
                path: self.path.to_path_buf(),
                source,
            })?;
        self.pos += n;
        Ok(buf)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let v = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let at = self.pos;
        let b = self.bytes(n, what)?;
        // Converters occasionally write invalid UTF-8 in names or descriptions; keep going,
        // and remember where, for the readers to whom the text is data (the vocabulary).
        match String::from_utf8(b) {
            Ok(s) => Ok(s),
            Err(e) => {
                self.not_utf8.entry(what.to_string()).or_insert(at);
                Ok(String::from_utf8_lossy(e.as_bytes()).into_owned())
            }
        }
    }

    fn value(&mut self, ty: u32, depth: usize, key: &str) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(key)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.malformed(format!("metadata `{key}`: bool byte {b}"))),
            },
            8 => Value::String(self.string(key)?),
            9 => {
                if depth >= MAX_VALUE_DEPTH {
                    return Err(self.malformed(format!("metadata `{key}`: arrays nested too deep")));
                }
                let elem = self.u32(key)?;
                let n = self.u64(key)?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10 | 11 | 12 => 8,
                    9 => 12,
                    other => {
                        return Err(self.malformed(format!(
                            "metadata `{key}`: unknown array element type {other}"
                        )))
                    }
                };
                // Refuse a count the rest of the file cannot hold before allocating for it.
                self.need(n.saturating_mul(min), key)?;
                self.elements_left = self.elements_left.checked_sub(n).ok_or_else(|| {
                    self.malformed(format!(
                        "metadata `{key}`: arrays hold more than {MAX_ARRAY_ELEMENTS} elements in all"
                    ))
                })?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1, key)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(key)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => {
                return Err(self.malformed(format!("metadata `{key}`: unknown value type {other}")))
            }
        })
    }
}

impl GgufFile {
    /// Read the header and check every tensor's shape and byte range.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = crate::fsutil::open_input(path).map_err(io_err)?;
        let file_size = file.metadata().map_err(io_err)?.len();
        Self::from_source(path, Box::new(file), file_size, false)
    }

    /// Read the header only, accepting a file whose tensor data is incomplete (the first
    /// part of a download): [`GgufFile::truncated_at`] says where it stops. Every shape and
    /// offset is still checked; no tensor data is read.
    pub fn open_header(path: &Path) -> Result<Self, GgufError> {
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = crate::fsutil::open_input(path).map_err(io_err)?;
        let file_size = file.metadata().map_err(io_err)?.len();
        Self::from_source(path, Box::new(file), file_size, true)
    }

    /// Read a GGUF held in memory; `path` only names it in errors. The same checks as
    /// [`GgufFile::open`] (this is the fuzzing entry point).
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, GgufError> {
        let size = bytes.len() as u64;
        Self::from_source(path, Box::new(Cursor::new(bytes)), size, false)
    }

    fn from_source(
        path: &Path,
        source: Box<dyn Source>,
        file_size: u64,
        header_only: bool,
    ) -> Result<Self, GgufError> {
        let mut reader = BufReader::new(source);
        let mut h = Header {
            r: &mut reader,
            pos: 0,
            size: file_size,
            elements_left: MAX_ARRAY_ELEMENTS,
            path,
            not_utf8: HashMap::new(),
        };
        let magic = h.array::<4>("the magic number")?;
        if &magic != b"GGUF" {
            return Err(h.malformed(format!("magic bytes {magic:02x?} are not `GGUF`")));
        }
        let version = h.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(h.malformed(format!("GGUF version {version} (supported: 2, 3)")));
        }
        let n_tensors = h.u64("the tensor count")?;
        let n_kv = h.u64("the metadata count")?;
        if n_tensors > MAX_TENSORS {
            return Err(h.malformed(format!(
                "{n_tensors} tensors declared (at most {MAX_TENSORS} are accepted)"
            )));
        }
        // Each entry takes at least a length prefix and a type: refuse impossible counts early.
        h.need(
            n_kv.saturating_mul(13)
                .saturating_add(n_tensors.saturating_mul(24)),
            "the declared entries",
        )?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = h.string("a metadata key")?;
            let ty = h.u32(&key)?;
            let value = h.value(ty, 0, &key)?;
            // gguf-py refuses a repeated key; taking either value would be a guess.
            if metadata.contains_key(&key) {
                return Err(h.malformed(format!("metadata key `{key}` appears twice")));
            }
            metadata.insert(key, value);
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = h.string("a tensor name")?;
            let n_dims = h.u32(&name)?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::Tensor {
                    path: path.to_path_buf(),
                    tensor: name,
                    message: format!("{n_dims} dimensions (ggml allows at most {MAX_DIMS})"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(h.u64(&name)?);
            }
            let ty = h.u32(&name)?;
            let offset = h.u64(&name)?;
            infos.push((name, dims, ty, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match as_uint(v) {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Metadata {
                        path: path.to_path_buf(),
                        key: "general.alignment".into(),
                        message: format!("{} is not a positive power of two", describe(v)),
                    })
                }
            },
        };
        let data_start = h
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| h.malformed("header size overflows".into()))?;

        let not_utf8 = std::mem::take(&mut h.not_utf8);
        let tensors = tensor_table(path, infos, data_start, file_size, header_only)?;
        let data_end = tensors
            .iter()
            .map(|t| t.start + t.n_bytes)
            .max()
            .unwrap_or(data_start);
        Ok(GgufFile {
            path: path.to_path_buf(),
            reader,
            file_size,
            version,
            metadata,
            tensors,
            data_end,
            not_utf8,
        })
    }

    /// When metadata `key` holds a string that is not UTF-8 (read with U+FFFD in place of
    /// the bad bytes): the byte offset of the first such string.
    pub fn not_utf8(&self, key: &str) -> Option<u64> {
        self.not_utf8.get(key).copied()
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// The file size when the tensor data runs past the end of the file (only a file opened
    /// with [`GgufFile::open_header`] can be), else `None`.
    pub fn truncated_at(&self) -> Option<u64> {
        (self.data_end > self.file_size).then_some(self.file_size)
    }

    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    fn meta_err(&self, key: &str, message: String) -> GgufError {
        GgufError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            message,
        }
    }

    /// A string value, `None` when absent.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.meta_err(key, format!("expected a string, found {}", kind(v)))),
        }
    }

    /// A non-negative integer of any width, `None` when absent.
    pub fn get_uint(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => as_uint(v).map(Some).ok_or_else(|| {
                self.meta_err(
                    key,
                    format!("expected a non-negative integer, found {}", describe(v)),
                )
            }),
        }
    }

    /// A float (f32 values are widened by their shortest decimal form, so 1e-5f32 becomes
    /// 1e-5 rather than 9.99999974e-6), `None` when absent.
    pub fn get_float(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(format!("{x}").parse::<f64>().unwrap_or(*x as f64))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => match as_uint(v) {
                Some(n) => Ok(Some(n as f64)),
                None => {
                    Err(self.meta_err(key, format!("expected a number, found {}", describe(v))))
                }
            },
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.meta_err(key, format!("expected a bool, found {}", describe(v)))),
        }
    }

    /// An array whose every element `one` reads (`None` → the element's error names what was
    /// expected), `None` when the key is absent.
    fn get_array<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        one: impl Fn(&'a Value) -> Option<T>,
        describe_elem: impl Fn(&Value) -> String,
    ) -> Result<Option<Vec<T>>, GgufError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    one(v).ok_or_else(|| {
                        let found = describe_elem(v);
                        self.meta_err(key, format!("element {i} is {found}, expected {expected}"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(self.meta_err(key, format!("expected an array, found {}", kind(v)))),
        }
    }

    /// An array of strings, `None` when absent.
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        fn one(v: &Value) -> Option<&str> {
            match v {
                Value::String(s) => Some(s.as_str()),
                _ => None,
            }
        }
        self.get_array(key, "a string", one, |v| kind(v).to_string())
    }

    /// An array of f32 values (SentencePiece scores), `None` when absent.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        let one = |v: &Value| match v {
            Value::F32(x) => Some(*x),
            _ => None,
        };
        self.get_array(key, "an f32", one, |v| kind(v).to_string())
    }

    /// An array of integers (any width, signed values must be non-negative), `None` when absent.
    pub fn get_uint_array(&self, key: &str) -> Result<Option<Vec<u64>>, GgufError> {
        self.get_array(key, "a non-negative integer", as_uint, describe)
    }

    /// The tensor's values as f32, in row-major order.
    pub fn read_f32(&mut self, tensor: &GgufTensor) -> Result<Vec<f32>, GgufError> {
        let Some(dtype) = tensor.dtype else {
            return Err(GgufError::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: tensor.name.clone(),
                dtype: tensor.type_name(),
            });
        };
        let n = usize::try_from(tensor.n_bytes).map_err(|_| GgufError::Tensor {
            path: self.path.clone(),
            tensor: tensor.name.clone(),
            message: format!("{} bytes do not fit in memory", tensor.n_bytes),
        })?;
        let mut bytes = vec![0u8; n];
        let io_err = |source| GgufError::Io {
            path: self.path.clone(),
            source,
        };
        self.reader
            .seek(SeekFrom::Start(tensor.start))
            .map_err(io_err)?;
        self.reader.read_exact(&mut bytes).map_err(|source| {
            if source.kind() == std::io::ErrorKind::UnexpectedEof {
                // The file shrank after the header was checked, or was opened header-only.
                GgufError::Truncated {
                    path: self.path.clone(),
                    tensor: tensor.name.clone(),
                    start: tensor.start,
                    end: tensor.start + tensor.n_bytes,
                    file_size: self.file_size,
                }
            } else {
                GgufError::Io {
                    path: self.path.clone(),
                    source,
                }
            }
        })?;
        let mut values = Vec::new();
        dtype.dequantize(&bytes, &mut values);
        Ok(values)
    }
}

/// A tensor's declared name, dims (fastest first), type id and data offset.
type TensorInfo = (String, Vec<u64>, u32, u64);

/// Check every tensor's shape, size and byte range, refuse tensors whose data overlap, and
/// return the table in file order. `header_only` accepts data running past the file's end.
fn tensor_table(
    path: &Path,
    infos: Vec<TensorInfo>,
    data_start: u64,
    file_size: u64,
    header_only: bool,
) -> Result<Vec<GgufTensor>, GgufError> {
    let mut tensors = Vec::with_capacity(infos.len());
    let mut seen = std::collections::HashSet::new();
    for (name, dims, ty, offset) in infos {
        let bad = |message: String| GgufError::Tensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            message,
        };
        if !seen.insert(name.clone()) {
            return Err(bad("appears twice".into()));
        }
        let numel = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|n| usize::try_from(*n).is_ok())
            .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
        let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
        let n_bytes = match block_layout(ty) {
            Some((block, block_bytes)) => {
                // ggml quantizes rows: the row length must be whole blocks.
                let row = dims.first().copied().unwrap_or(1);
                if row % block != 0 {
                    return Err(bad(format!(
                        "rows of {row} elements are not a whole number of {block}-element {} blocks",
                        type_name(ty)
                    )));
                }
                (numel / block)
                    .checked_mul(block_bytes)
                    .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?
            }
            // Rejected by the importer with the tensor's name; its size is unknown here.
            None => 0,
        };
        let start = data_start
            .checked_add(offset)
            .ok_or_else(|| bad(format!("offset {offset} overflows")))?;
        let end = start
            .checked_add(n_bytes)
            .ok_or_else(|| bad(format!("offset {offset} overflows")))?;
        if end > file_size && !header_only {
            return Err(GgufError::Truncated {
                path: path.to_path_buf(),
                tensor: name,
                start,
                end,
                file_size,
            });
        }
        tensors.push(GgufTensor {
            name,
            type_id: ty,
            dtype: GgmlType::from_id(ty),
            shape,
            start,
            n_bytes,
        });
    }
    tensors.sort_by_key(|t| t.start);
    refuse_overlaps(path, &tensors)?;
    Ok(tensors)
}

/// Tensors (sorted by start) whose data share bytes: a file crafted so one block of data
/// stands for many tensors.
fn refuse_overlaps(path: &Path, sorted: &[GgufTensor]) -> Result<(), GgufError> {
    let mut prev: Option<&GgufTensor> = None;
    for t in sorted.iter().filter(|t| t.n_bytes > 0) {
        if let Some(p) = prev {
            if p.start + p.n_bytes > t.start {
                return Err(GgufError::Tensor {
                    path: path.to_path_buf(),
                    tensor: t.name.clone(),
                    message: format!(
                        "its data (bytes {}..{}) overlap those of `{}` (bytes {}..{})",
                        t.start,
                        t.start + t.n_bytes,
                        p.name,
                        p.start,
                        p.start + p.n_bytes
                    ),
                });
            }
        }
        prev = Some(t);
    }
    Ok(())
}

fn as_uint(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::U8(_) => "u8",
        Value::I8(_) => "i8",
        Value::U16(_) => "u16",
        Value::I16(_) => "i16",
        Value::U32(_) => "u32",
        Value::I32(_) => "i32",
        Value::U64(_) => "u64",
        Value::I64(_) => "i64",
        Value::F32(_) => "f32",
        Value::F64(_) => "f64",
        Value::Bool(_) => "bool",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
    }
}

/// A short description of a value for messages (scalars shown, containers summarized).
fn describe(v: &Value) -> String {
    match v {
        Value::U8(x) => format!("u8 {x}"),
        Value::I8(x) => format!("i8 {x}"),
        Value::U16(x) => format!("u16 {x}"),
        Value::I16(x) => format!("i16 {x}"),
        Value::U32(x) => format!("u32 {x}"),
        Value::I32(x) => format!("i32 {x}"),
        Value::U64(x) => format!("u64 {x}"),
        Value::I64(x) => format!("i64 {x}"),
        Value::F32(x) => format!("f32 {x}"),
        Value::F64(x) => format!("f64 {x}"),
        Value::Bool(x) => format!("bool {x}"),
        Value::String(s) => format!("string {:?}", s.chars().take(40).collect::<String>()),
        Value::Array(a) => format!("an array of {}", a.len()),
    }
}
