//! Reading Hugging Face checkpoints: a directory with config.json and either one
//! model.safetensors or shards listed in model.safetensors.index.json.
//!
//! Files are memory-mapped; a tensor is a borrowed byte slice of the map, converted only when a
//! caller asks for values. Headers are validated by the safetensors crate (offsets, sizes,
//! overlaps) before any tensor is touched.

mod config;
pub mod gguf;
pub mod hub;

pub use config::ConfigError;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use thiserror::Error;

use crate::arch::ModelSpec;
use crate::arch::{self, TensorSlot};

/// Everything that can be wrong with a checkpoint directory. Every variant names the file.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a checkpoint directory (no config.json)")]
    MissingConfig { path: PathBuf },
    #[error(
        "{id}: no such file or directory, and as a Hugging Face Hub id not in the local Hub \
         cache (looked in {looked}); hf2coreml never downloads: fetch it first (e.g. \
         `{fetch}`) and give the id again, or a directory"
    )]
    HubId {
        id: String,
        looked: String,
        fetch: String,
    },
    #[error(
        "{path}: a file, not a checkpoint: give the directory that holds config.json and the \
         *.safetensors files, or a .gguf file"
    )]
    NotACheckpointFile { path: PathBuf },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error(
        "{path}: only pickle checkpoints found ({files}); refusing to load them because unpickling runs arbitrary code"
    )]
    PickleOnly { path: PathBuf, files: String },
    #[error(
        "{path}: holds both {one} and {other}: which one is the model is ambiguous; move the \
         one that is not aside"
    )]
    Ambiguous {
        path: PathBuf,
        one: &'static str,
        other: &'static str,
    },
    #[error("{path}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights { path: PathBuf },
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: invalid shard index: {message}")]
    Index { path: PathBuf, message: String },
    #[error("{path}: shard `{shard}` named by the index is missing")]
    MissingShard { path: PathBuf, shard: String },
    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    WrongShape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error(
        "{path}: tensor `{tensor}` is not part of {architecture} as config.json describes it; \
         refusing to convert without it (a config field hf2coreml does not know may need it)"
    )]
    UnusedTensor {
        path: PathBuf,
        tensor: String,
        architecture: String,
    },
    #[error(
        "{path}: `lm_head.weight` differs from `{embedding}`, but config.json ties them \
         (tie_word_embeddings is true, so transformers would use the embedding and ignore it); \
         set tie_word_embeddings to false to convert with this lm_head, or remove it"
    )]
    TiedLmHeadDiffers { path: PathBuf, embedding: String },
    #[error("{path}: tensor `{tensor}` has dtype {dtype}; supported: BF16, F16, F32")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{path}: tensor `{tensor}` holds {value} at element {index}; weights must be finite")]
    NonFinite {
        path: PathBuf,
        tensor: String,
        index: usize,
        value: f32,
    },
}

impl CheckpointError {
    /// What the user can do about it, when there is something useful to say.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            CheckpointError::PickleOnly { .. } => Some(
                "convert it to safetensors first, e.g. with transformers: \
                 AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)",
            ),
            CheckpointError::MissingConfig { .. } | CheckpointError::NoWeights { .. } => Some(
                "point hf2coreml at a Hugging Face model directory (config.json + *.safetensors), \
                 or import a GGUF file with `hf2coreml import-gguf`",
            ),
            _ => None,
        }
    }
}

// A stored tensor's element type is a [`DType`]: `BF16`, `F16` or `F32`, the only ones
// [`parse_safetensors`] accepts.
use crate::mil::DType;

/// The message for a view whose dtype no safetensors checkpoint of ours holds.
fn not_a_checkpoint_dtype(dtype: DType) -> ! {
    panic!(
        "a checkpoint tensor is bf16, f16 or f32, not {}",
        dtype.short_name()
    )
}

/// A tensor borrowed from a memory-mapped file.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Row `i` of a tensor of rank ≥ 2 (its first axis), as a view of rank one less.
    pub fn row(&self, i: usize) -> Option<TensorView<'a>> {
        let (&rows, rest) = self.shape.split_first()?;
        if i >= rows || rest.is_empty() {
            return None;
        }
        let len = self.data.len() / rows;
        Some(TensorView {
            name: self.name,
            dtype: self.dtype,
            shape: rest,
            data: self.data.get(i * len..(i + 1) * len)?,
        })
    }

    /// Values as f32 (exact for every supported dtype).
    ///
    /// # Panics
    /// If the view's dtype is not bf16, f16 or f32 (no checkpoint yields such a view).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => not_a_checkpoint_dtype(other),
        }
    }

    /// The first NaN or infinite element and its value, found on the raw bits (no conversion).
    ///
    /// # Panics
    /// If the view's dtype is not bf16, f16 or f32 (no checkpoint yields such a view).
    pub fn first_non_finite(&self) -> Option<(usize, f32)> {
        let t = self;
        match t.dtype {
            DType::BF16 => t
                .data
                .chunks_exact(2)
                .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7F80 == 0x7F80)
                .map(|i| {
                    let b = &t.data[2 * i..2 * i + 2];
                    (i, bf16::from_le_bytes([b[0], b[1]]).to_f32())
                }),
            DType::F16 => t
                .data
                .chunks_exact(2)
                .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7C00 == 0x7C00)
                .map(|i| {
                    let b = &t.data[2 * i..2 * i + 2];
                    (i, f16::from_le_bytes([b[0], b[1]]).to_f32())
                }),
            DType::F32 => t
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .enumerate()
                .find(|(_, v)| !v.is_finite()),
            other => not_a_checkpoint_dtype(other),
        }
    }

    /// Values as f16, the precision a package stores (bf16 and f32 round to nearest).
    ///
    /// # Panics
    /// If the view's dtype is not bf16, f16 or f32 (no checkpoint yields such a view).
    pub fn to_f16(&self) -> Vec<f16> {
        match self.dtype {
            DType::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect(),
            // Element by element: no f32 copy of the whole tensor on the way.
            DType::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| f16::from_f32(bf16::from_le_bytes([b[0], b[1]]).to_f32()))
                .collect(),
            DType::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
            other => not_a_checkpoint_dtype(other),
        }
    }
}

struct TensorEntry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute byte range in the mapped file.
    start: usize,
    end: usize,
}

struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

/// An opened, validated checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    spec: ModelSpec,
    files: Vec<MappedFile>,
    tensors: BTreeMap<String, TensorEntry>,
    /// A multimodal checkpoint's towers and projectors, skipped unread.
    dropped: Dropped,
}

/// What a conversion of a multimodal checkpoint leaves out: the tensors of each part other
/// than the text decoder (the vision tower, the projector), by prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dropped {
    /// (prefix, tensors, parameters, bytes), in prefix order.
    pub parts: Vec<(String, usize, u64, u64)>,
}

/// The name prefixes of a multimodal class's text decoder (renamed to a text model's) and of
/// its other parts (skipped): transformers 5 writes `language_model.model.*`, the Hub's
/// converted checkpoints `model.language_model.*`.
const TEXT_PREFIXES: [(&str, &str); 3] = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
];
const OTHER_PREFIXES: [&str; 9] = [
    "model.vision_tower.",
    // Gemma 4's audio tower and the projections of both towers into the text stream.
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
    // Qwen3.5's vision tower and its multi-token prediction block (a draft head the causal
    // model does not run).
    "model.visual.",
    "mtp.",
];

/// A multimodal checkpoint's tensor name as the text model's, or `None` for a tower's
/// (returned as its prefix).
fn text_name(name: &str) -> Result<String, &'static str> {
    if let Some(p) = OTHER_PREFIXES.iter().find(|p| name.starts_with(*p)) {
        return Err(p);
    }
    for (from, to) in TEXT_PREFIXES {
        if let Some(rest) = name.strip_prefix(from) {
            return Ok(format!("{to}{rest}"));
        }
    }
    Ok(name.to_string())
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("architecture", &self.spec.architecture)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

/// Largest safetensors JSON header we parse. Real headers take ~100 bytes per tensor (a
/// 400B-parameter checkpoint's largest shard header is well under 1 MiB); the safetensors
/// crate's own cap (100 MB) would let a hostile file make us build a ~1 GB JSON tree.
pub const MAX_HEADER_BYTES: u64 = 16 << 20;
/// Largest shard index (model.safetensors.index.json) we read: one line per tensor.
pub const MAX_INDEX_BYTES: u64 = 16 << 20;
/// Largest config.json we read.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Most tensors in one checkpoint (all shards); real ones have a few thousand.
pub const MAX_TENSORS: usize = 1 << 20;
/// Highest tensor rank we accept; the architectures we convert use 1 and 2.
pub const MAX_RANK: usize = 8;

/// One tensor of a safetensors file, as its header describes it (checked against the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte range of the data in the file.
    pub start: usize,
    pub end: usize,
}

/// Parse and check the header of a safetensors file held in `bytes` (the whole file):
/// header length within [`MAX_HEADER_BYTES`] and the file, valid JSON, every tensor's dtype
/// supported, its shape's byte count equal to its data range, the ranges in bounds, not
/// overlapping and covering the data section. `path` names the file in errors; nothing is read
/// from it. Entries come in header order.
pub fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<Vec<HeaderEntry>, CheckpointError> {
    let bad = |message: String| CheckpointError::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let Some(len_bytes) = bytes.first_chunk::<8>() else {
        return Err(bad(format!(
            "{} bytes is shorter than the 8-byte header length",
            bytes.len()
        )));
    };
    let header_len = u64::from_le_bytes(*len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    if header_len > bytes.len() as u64 - 8 {
        return Err(bad(format!(
            "header length {header_len} runs past the end of the {}-byte file",
            bytes.len()
        )));
    }
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        let header = &bytes[8..8 + header_len as usize];
        bad(
            diagnose_header(header, bytes.len() - 8 - header_len as usize)
                .unwrap_or_else(|| e.to_string()),
        )
    })?;
    if st.len() > MAX_TENSORS {
        return Err(bad(format!(
            "{} tensors (at most {MAX_TENSORS} are accepted)",
            st.len()
        )));
    }
    let base = bytes.as_ptr() as usize;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            Dtype::F32 => DType::F32,
            other => {
                return Err(CheckpointError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        if view.shape().len() > MAX_RANK {
            return Err(bad(format!(
                "tensor `{name}` has rank {} (at most {MAX_RANK})",
                view.shape().len()
            )));
        }
        // The crate checked that the shape's byte count equals the data range and that the
        // range lies inside `bytes`; the range is recovered as offsets into it.
        let start = view.data().as_ptr() as usize - base;
        out.push(HeaderEntry {
            name: name.to_string(),
            dtype,
            shape: view.shape().to_vec(),
            start,
            end: start + view.data().len(),
        });
    }
    Ok(out)
}

/// Which tensor a header the safetensors crate refused is wrong about, when the crate's message
/// does not say (a byte-count mismatch, a range past the data or overlapping another).
fn diagnose_header(header: &[u8], data_len: usize) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(header).ok()?;
    let mut ranges: Vec<(u64, u64, &str)> = Vec::new();
    for (name, info) in v.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info.get("dtype")?.as_str()?;
        let shape: Vec<u64> = info
            .get("shape")?
            .as_array()?
            .iter()
            .map(|d| d.as_u64())
            .collect::<Option<_>>()?;
        let offs = info.get("data_offsets")?.as_array()?;
        let (start, end) = (offs.first()?.as_u64()?, offs.get(1)?.as_u64()?);
        let elem: u64 = match dtype {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" | "U32" => 4,
            "F16" | "BF16" | "I16" | "U16" => 2,
            "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
            _ => return None,
        };
        let needed = shape
            .iter()
            .try_fold(elem, |acc, &d| acc.checked_mul(d))
            .map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
        if end < start || end - start != needed.parse::<u64>().unwrap_or(u64::MAX) {
            return Some(format!(
                "tensor `{name}`: {dtype} {shape:?} needs {needed} bytes but data_offsets \
                 [{start}, {end}] span {}",
                end.saturating_sub(start)
            ));
        }
        if end > data_len as u64 {
            return Some(format!(
                "tensor `{name}`: data_offsets [{start}, {end}] run past the {data_len}-byte \
                 data section"
            ));
        }
        ranges.push((start, end, name));
    }
    ranges.sort();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Some(format!(
                "tensors `{}` [{}, {}] and `{}` [{}, {}] overlap",
                w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
            ));
        }
    }
    None
}

/// Read a small text file, refusing one larger than `limit` before reading it.
/// Whether anything is at `path`: a file the reader then opens, and whatever else is there
/// (a directory, a device, a symlink loop, a name that cannot be looked at) so that opening it
/// says what it is, instead of reporting it missing. A symlink to nothing (a Hub snapshot
/// whose blob never arrived) is missing.
fn present(path: &Path) -> bool {
    let absent = |e: std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => !std::fs::metadata(path).is_err_and(absent),
        Ok(_) => true,
        Err(e) => !absent(e),
    }
}

fn read_text_limited(path: &Path, limit: u64, what: &str) -> Result<String, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > limit {
        return Err(CheckpointError::Config {
            path: path.to_path_buf(),
            message: format!("{len} bytes is too large for {what} (limit {limit})"),
        });
    }
    crate::fsutil::read_input_text(path, limit).map_err(io)
}

/// The checkpoint directory `path` names: the directory itself, or the directory holding a
/// file of the checkpoint (`model.safetensors`, a shard, the index or config.json), as users
/// tab-complete to them.
fn checkpoint_dir(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.is_file() {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let of_checkpoint =
            name.ends_with(".safetensors") || name == INDEX_FILE || name == "config.json";
        return match path.parent() {
            Some(parent) if of_checkpoint => Ok(match parent.as_os_str().is_empty() {
                true => PathBuf::from("."),
                false => parent.to_path_buf(),
            }),
            _ => Err(CheckpointError::NotACheckpointFile {
                path: path.to_path_buf(),
            }),
        };
    }
    if let Some(dir) = hub_snapshot(path)? {
        return checkpoint_dir(&dir);
    }
    Err(CheckpointError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory"),
    })
}

/// The local Hub cache's snapshot for `path` when it is no path of this machine and is spelled
/// as a Hub id (`ORG/NAME[@REV]`); `None` when it is not spelled as one.
fn hub_snapshot(path: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let Some(id) = path.to_str() else {
        return Ok(None);
    };
    let org_exists = id
        .split_once('/')
        .is_some_and(|(org, _)| Path::new(org).exists());
    if path.exists() || org_exists {
        return Ok(None);
    }
    match hub::resolve_in(&hub::cache_roots(), id) {
        None => Ok(None),
        Some(Ok(dir)) => Ok(Some(dir)),
        Some(Err(misses)) => Err(CheckpointError::HubId {
            id: id.to_string(),
            fetch: hub::download_command(id),
            looked: match misses.is_empty() {
                true => "no cache: neither HF_HUB_CACHE, HF_HOME nor HOME is set".into(),
                false => misses
                    .iter()
                    .map(|m| m.to_string())
                    .collect::<Vec<_>>()
                    .join("; "),
            },
        }),
    }
}

/// `path`, or the snapshot directory of the local Hub cache it names as a Hub id: for readers
/// that look at the path before opening a [`Checkpoint`] (a config-only directory, a GGUF).
pub fn resolve_source(path: &Path) -> Result<PathBuf, CheckpointError> {
    Ok(hub_snapshot(path)?.unwrap_or_else(|| path.to_path_buf()))
}

impl Dropped {
    fn add(&mut self, prefix: &str, shape: &[usize], bytes: u64) {
        let params = shape.iter().map(|&d| d as u64).product::<u64>();
        match self.parts.iter_mut().find(|p| p.0 == prefix) {
            Some(p) => {
                p.1 += 1;
                p.2 += params;
                p.3 += bytes;
            }
            None => {
                self.parts.push((prefix.to_string(), 1, params, bytes));
                self.parts.sort();
            }
        }
    }
}

impl Checkpoint {
    /// Open `dir`, parse config.json, map the weights and check every expected tensor's
    /// presence, shape and dtype.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = checkpoint_dir(dir.as_ref())?;
        let config_path = dir.join("config.json");
        let has_safetensors = present(&dir.join(SINGLE_FILE)) || present(&dir.join(INDEX_FILE));
        if !has_safetensors {
            let pickles = pickle_files(&dir);
            if !pickles.is_empty() {
                return Err(CheckpointError::PickleOnly {
                    path: dir,
                    files: pickles.join(", "),
                });
            }
        }
        if !present(&config_path) {
            return Err(CheckpointError::MissingConfig { path: dir });
        }
        let spec = ModelSpec::from_config_file(&config_path)?;
        let shard_names = shard_list(&dir)?;
        let mut files = Vec::with_capacity(shard_names.len());
        let mut tensors = BTreeMap::new();
        let mut dropped = Dropped::default();
        for (file_idx, shard) in shard_names.iter().enumerate() {
            let path = dir.join(shard);
            if !present(&path) {
                return Err(CheckpointError::MissingShard {
                    path: dir.join(INDEX_FILE),
                    shard: shard.clone(),
                });
            }
            let file = crate::fsutil::open_input(&path).map_err(|source| CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the map is read-only; a checkpoint changed underneath us while we run
            // is outside what any reader can defend against (same stance as safetensors).
            let map = unsafe { Mmap::map(&file) }.map_err(|source| CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
            for mut e in parse_safetensors(&path, &map)? {
                if spec.text_of.is_some() {
                    match text_name(&e.name) {
                        Ok(name) => e.name = name,
                        Err(prefix) => {
                            dropped.add(prefix, &e.shape, (e.end - e.start) as u64);
                            continue;
                        }
                    }
                }
                e.name = arch::canonical_name(spec.architecture, &e.name);
                if tensors.len() >= MAX_TENSORS {
                    return Err(CheckpointError::Safetensors {
                        path: path.clone(),
                        message: format!(
                            "the checkpoint holds more than {MAX_TENSORS} tensors in all"
                        ),
                    });
                }
                let entry = TensorEntry {
                    file: file_idx,
                    dtype: e.dtype,
                    shape: e.shape,
                    start: e.start,
                    end: e.end,
                };
                if let Some(prev) = tensors.insert(e.name.clone(), entry) {
                    return Err(CheckpointError::Index {
                        path: dir.join(INDEX_FILE),
                        message: format!(
                            "tensor `{}` is stored in both {} and {}",
                            e.name, shard_names[prev.file], shard
                        ),
                    });
                }
            }
            files.push(MappedFile { path, map });
        }
        split_fused(&spec, &dir, &files, &mut tensors)?;
        let ckpt = Checkpoint {
            dir,
            spec,
            files,
            tensors,
            dropped,
        };
        ckpt.check_expected()?;
        Ok(ckpt)
    }

    fn check_expected(&self) -> Result<(), CheckpointError> {
        let stored = |name: &str| arch::stored_name(self.spec.architecture, name);
        for slot in arch::expected_tensors(&self.spec) {
            let Some(entry) = self.tensors.get(&slot.name) else {
                return Err(CheckpointError::MissingTensor {
                    path: self.dir.clone(),
                    tensor: stored(&slot.name),
                });
            };
            if entry.shape != slot.shape {
                return Err(CheckpointError::WrongShape {
                    path: self.files[entry.file].path.clone(),
                    tensor: stored(&slot.name),
                    expected: slot.shape,
                    found: entry.shape.clone(),
                });
            }
        }
        self.check_unused()
    }

    /// Refuse a stored tensor the architecture does not use (a bias, a norm, an expert):
    /// dropping it would convert a different model. Rotary buffers (`rotary_emb.inv_freq`,
    /// recomputed from the config) and a tied model's stored `lm_head.weight` (transformers
    /// replaces it by the embedding) are the exceptions.
    fn check_unused(&self) -> Result<(), CheckpointError> {
        let expected: std::collections::HashSet<String> = arch::expected_tensors(&self.spec)
            .into_iter()
            .map(|s| s.name)
            .collect();
        let ignorable = |name: &str| {
            name.ends_with("rotary_emb.inv_freq")
                || (self.spec.tie_word_embeddings && name == arch::TensorId::LmHead.hf_name())
                || arch::unread_tensor(&self.spec, name)
        };
        match self
            .tensors
            .iter()
            .find(|(name, _)| !expected.contains(*name) && !ignorable(name))
        {
            Some((name, entry)) => Err(CheckpointError::UnusedTensor {
                path: self.files[entry.file].path.clone(),
                tensor: arch::stored_name(self.spec.architecture, name),
                architecture: self.spec.architecture.hf_name().into(),
            }),
            None => self.check_tied_lm_head(),
        }
    }

    /// A tied model's stored `lm_head.weight` must be the embedding itself: one that differs
    /// is a model that was untied and would silently lose its own head.
    fn check_tied_lm_head(&self) -> Result<(), CheckpointError> {
        let head = arch::TensorId::LmHead.hf_name();
        let embedding = arch::TensorId::Embedding.hf_name();
        if !self.spec.tie_word_embeddings || !self.tensors.contains_key(&head) {
            return Ok(());
        }
        let (h, e) = (self.tensor(&head)?, self.tensor(&embedding)?);
        if h.dtype == e.dtype && h.shape == e.shape && h.data == e.data {
            return Ok(());
        }
        Err(CheckpointError::TiedLmHeadDiffers {
            path: self.files[self.tensors[&head].file].path.clone(),
            embedding,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The parts of a multimodal checkpoint a conversion leaves out (empty otherwise).
    pub fn dropped(&self) -> &Dropped {
        &self.dropped
    }

    /// The safetensors files backing this checkpoint.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// The architecture's tensors, in model order (see [`arch::expected_tensors`]).
    pub fn slots(&self) -> Vec<TensorSlot> {
        arch::expected_tensors(&self.spec)
    }

    /// The tensors a package stores, in model order: all but Gemma 4's per-layer table, which
    /// is written beside the package (docs/contract.md, "The per-layer table").
    pub fn package_slots(&self) -> Vec<TensorSlot> {
        arch::package_tensors(&self.spec)
    }

    /// Names of every tensor stored (including any the architecture does not use).
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Borrow a tensor.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let (key, entry) =
            self.tensors
                .get_key_value(name)
                .ok_or_else(|| CheckpointError::MissingTensor {
                    path: self.dir.clone(),
                    tensor: name.to_string(),
                })?;
        Ok(TensorView {
            name: key,
            dtype: entry.dtype,
            shape: &entry.shape,
            data: &self.files[entry.file].map[entry.start..entry.end],
        })
    }

    /// Check that every tensor the architecture uses holds only finite values (NaN or ±Inf
    /// would poison every output of the converted model). Reads all weights once.
    pub fn check_finite(&self) -> Result<(), CheckpointError> {
        for slot in self.slots() {
            let t = self.tensor(&slot.name)?;
            if let Some((index, value)) = t.first_non_finite() {
                return Err(CheckpointError::NonFinite {
                    path: self.files[self.tensors[&slot.name].file].path.clone(),
                    tensor: slot.name,
                    index,
                    value,
                });
            }
        }
        Ok(())
    }

    /// The dtype most weights are stored in (by element count).
    pub fn storage_dtype(&self) -> DType {
        let mut counts: HashMap<&'static str, (DType, usize)> = HashMap::new();
        for e in self.tensors.values() {
            let n: usize = e.shape.iter().product();
            counts.entry(e.dtype.short_name()).or_insert((e.dtype, 0)).1 += n;
        }
        counts
            .into_values()
            .max_by_key(|(_, n)| *n)
            .map(|(d, _)| d)
            .unwrap_or(DType::F32)
    }

    /// Total bytes of the safetensors files.
    pub fn file_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.map.len() as u64).sum()
    }
}

/// Replace each fused tensor of the architecture (Phi-3's `qkv_proj`, `gate_up_proj`) by
/// entries for its parts under their own names: row blocks of a row-major tensor are byte
/// ranges of it, so nothing is copied. A fused tensor missing or of the wrong shape, or a part
/// also stored on its own, is refused.
fn split_fused(
    spec: &ModelSpec,
    dir: &Path,
    files: &[MappedFile],
    tensors: &mut BTreeMap<String, TensorEntry>,
) -> Result<(), CheckpointError> {
    for fused in arch::fused_tensors(spec) {
        let Some(entry) = tensors.remove(&fused.name) else {
            return Err(CheckpointError::MissingTensor {
                path: dir.to_path_buf(),
                tensor: fused.name,
            });
        };
        let path = || files[entry.file].path.clone();
        if entry.shape != fused.shape() {
            return Err(CheckpointError::WrongShape {
                path: path(),
                tensor: fused.name.clone(),
                expected: fused.shape(),
                found: entry.shape.clone(),
            });
        }
        let row_bytes = entry.dtype.size_bytes() * fused.cols;
        let mut start = entry.start;
        for (id, rows) in &fused.parts {
            let name = id.hf_name();
            if tensors.contains_key(&name) {
                return Err(CheckpointError::Safetensors {
                    path: path(),
                    message: format!("`{name}` is stored both alone and inside `{}`", fused.name),
                });
            }
            let end = start + rows * row_bytes;
            let part = TensorEntry {
                file: entry.file,
                dtype: entry.dtype,
                shape: vec![*rows, fused.cols],
                start,
                end,
            };
            tensors.insert(name, part);
            start = end;
        }
    }
    Ok(())
}

/// Whether `dir` holds any weight file (safetensors, or pickles `open` refuses): a directory
/// with a config.json and none is a configuration alone, which `budget` can plan from.
pub fn has_weight_files(dir: &Path) -> bool {
    present(&dir.join(SINGLE_FILE))
        || present(&dir.join(INDEX_FILE))
        || !pickle_files(dir).is_empty()
}

fn pickle_files(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.ends_with(".bin") && n.starts_with("pytorch_model")
                || n.ends_with(".pt")
                || n.ends_with(".pth")
                || n.ends_with(".ckpt")
        })
        .collect();
    out.sort();
    out
}

/// The safetensors files to map: the index's shards (sorted, deduplicated) or the single file.
fn shard_list(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    let index_path = dir.join(INDEX_FILE);
    if present(&index_path) {
        let single = dir.join(SINGLE_FILE);
        if present(&single) {
            return Err(CheckpointError::Ambiguous {
                path: dir.to_path_buf(),
                one: SINGLE_FILE,
                other: INDEX_FILE,
            });
        }
        let text = read_text_limited(&index_path, MAX_INDEX_BYTES, "a shard index")?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| CheckpointError::Index {
                path: index_path.clone(),
                message: e.to_string(),
            })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| CheckpointError::Index {
                path: index_path.clone(),
                message: "no `weight_map` object".into(),
            })?;
        let mut shards: Vec<String> = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| CheckpointError::Index {
                path: index_path.clone(),
                message: format!("`{tensor}` maps to a non-string"),
            })?;
            // A shard name is a plain file name inside the checkpoint; anything else could
            // read files outside it.
            if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
                return Err(CheckpointError::Index {
                    path: index_path.clone(),
                    message: format!("shard name `{file}` is not a plain file name"),
                });
            }
            if !shards.iter().any(|s| s == file) {
                shards.push(file.to_string());
            }
        }
        if shards.is_empty() {
            return Err(CheckpointError::Index {
                path: index_path,
                message: "`weight_map` is empty".into(),
            });
        }
        shards.sort();
        return Ok(shards);
    }
    if present(&dir.join(SINGLE_FILE)) {
        return Ok(vec![SINGLE_FILE.to_string()]);
    }
    Err(CheckpointError::NoWeights {
        path: dir.to_path_buf(),
    })
}

/// A checkpoint transformers wrote (`tests/fixtures/hf/NAME`, by python/testgen/hf_models.py),
/// for the unit tests that need a whole model on disk. The integration tests build theirs with
/// the test kit, which depends on this library and so cannot serve its own unit tests.
#[cfg(test)]
pub(crate) fn transformers_fixture(name: &str) -> Checkpoint {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name);
    Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}
