//! Reading Hugging Face checkpoints: a directory with config.json and either one
//! model.safetensors or shards listed in model.safetensors.index.json.
//!
//! Files are memory-mapped; a tensor is a borrowed byte slice of the map, converted only when a
//! caller asks for values. Headers are validated by the safetensors crate (offsets, sizes,
//! overlaps) before any tensor is touched.

mod config;
pub mod gguf;
pub mod summary;

pub use config::{Architecture, ModelSpec, RopeScaling};

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use thiserror::Error;

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
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error(
        "{path}: only pickle checkpoints found ({files}); refusing to load them because unpickling runs arbitrary code"
    )]
    PickleOnly { path: PathBuf, files: String },
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
    #[error("{path}: tensor `{tensor}` has dtype {dtype}; supported: BF16, F16, F32")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
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

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        }
    }
}

/// A tensor borrowed from a memory-mapped file.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Values as f32 (exact for every supported dtype).
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
        }
    }

    /// Values as f16, the precision a package stores (bf16 and f32 round to nearest).
    pub fn to_f16(&self) -> Vec<f16> {
        match self.dtype {
            DType::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect(),
            _ => self.to_f32().into_iter().map(f16::from_f32).collect(),
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

impl Checkpoint {
    /// Open `dir`, parse config.json, map the weights and check every expected tensor's
    /// presence, shape and dtype.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(CheckpointError::Io {
                path: dir.clone(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory"),
            });
        }
        let config_path = dir.join("config.json");
        let has_safetensors = dir.join(SINGLE_FILE).is_file() || dir.join(INDEX_FILE).is_file();
        if !has_safetensors {
            let pickles = pickle_files(&dir);
            if !pickles.is_empty() {
                return Err(CheckpointError::PickleOnly {
                    path: dir,
                    files: pickles.join(", "),
                });
            }
        }
        if !config_path.is_file() {
            return Err(CheckpointError::MissingConfig { path: dir });
        }
        let spec = ModelSpec::from_config_file(&config_path)?;
        let shard_names = shard_list(&dir)?;
        let mut files = Vec::with_capacity(shard_names.len());
        let mut tensors = BTreeMap::new();
        for (file_idx, shard) in shard_names.iter().enumerate() {
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(CheckpointError::MissingShard {
                    path: dir.join(INDEX_FILE),
                    shard: shard.clone(),
                });
            }
            let file = File::open(&path).map_err(|source| CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the map is read-only; a checkpoint changed underneath us while we run
            // is outside what any reader can defend against (same stance as safetensors).
            let map = unsafe { Mmap::map(&file) }.map_err(|source| CheckpointError::Io {
                path: path.clone(),
                source,
            })?;
            let st = SafeTensors::deserialize(&map).map_err(|e| CheckpointError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let dtype = match view.dtype() {
                    Dtype::BF16 => DType::BF16,
                    Dtype::F16 => DType::F16,
                    Dtype::F32 => DType::F32,
                    other => {
                        return Err(CheckpointError::UnsupportedDtype {
                            path: path.clone(),
                            tensor: name,
                            dtype: format!("{other:?}"),
                        })
                    }
                };
                let start = view.data().as_ptr() as usize - base;
                let end = start + view.data().len();
                tensors.insert(
                    name,
                    TensorEntry {
                        file: file_idx,
                        dtype,
                        shape: view.shape().to_vec(),
                        start,
                        end,
                    },
                );
            }
            files.push(MappedFile { path, map });
        }
        let ckpt = Checkpoint {
            dir,
            spec,
            files,
            tensors,
        };
        ckpt.check_expected()?;
        Ok(ckpt)
    }

    fn check_expected(&self) -> Result<(), CheckpointError> {
        for slot in arch::expected_tensors(&self.spec) {
            let Some(entry) = self.tensors.get(&slot.name) else {
                return Err(CheckpointError::MissingTensor {
                    path: self.dir.clone(),
                    tensor: slot.name,
                });
            };
            if entry.shape != slot.shape {
                return Err(CheckpointError::WrongShape {
                    path: self.files[entry.file].path.clone(),
                    tensor: slot.name,
                    expected: slot.shape,
                    found: entry.shape.clone(),
                });
            }
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The safetensors files backing this checkpoint.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// The architecture's tensors, in model order (see [`arch::expected_tensors`]).
    pub fn slots(&self) -> Vec<TensorSlot> {
        arch::expected_tensors(&self.spec)
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

    /// The dtype most weights are stored in (by element count).
    pub fn storage_dtype(&self) -> DType {
        let mut counts: HashMap<&'static str, (DType, usize)> = HashMap::new();
        for e in self.tensors.values() {
            let n: usize = e.shape.iter().product();
            counts.entry(e.dtype.as_str()).or_insert((e.dtype, 0)).1 += n;
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
    if index_path.is_file() {
        let text = std::fs::read_to_string(&index_path).map_err(|source| CheckpointError::Io {
            path: index_path.clone(),
            source,
        })?;
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
    if dir.join(SINGLE_FILE).is_file() {
        return Ok(vec![SINGLE_FILE.to_string()]);
    }
    Err(CheckpointError::NoWeights {
        path: dir.to_path_buf(),
    })
}
