//! The chain description (docs/design.md, "Chained packages"): a model too large for one
//! package is a directory at the output path holding [`CHAIN_FILE`] and the parts, each a
//! complete package. The converter writes it; the runner, `validate`, `lint` and `inspect` read
//! it. Plain data with its own checks, shared by both sides.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::contract::{self, Contract, IoSpec};

/// The `format` field of a chain file this version writes and reads.
pub const CHAIN_FORMAT: &str = "hf2coreml.chain/1";

/// The chain file's name inside the chain directory.
pub const CHAIN_FILE: &str = "chain.json";

/// The hidden state between parts: [1, Q, hidden] in the compute precision, times the residual
/// scale α (the stream as one package carries it between blocks). A part returns it as
/// `hidden_out`; the next takes it as `hidden_in` (one program cannot name an input and an
/// output alike).
pub const HIDDEN_IN: &str = "hidden_in";
pub const HIDDEN_OUT: &str = "hidden_out";

/// Gemma 4's per-layer inputs of every block, [1, Q, L·P] in the compute precision: the first
/// part computes them from the tokens (and the per-layer table's rows) and returns them as
/// `per_layer_out`; every later part with blocks takes them as `per_layer_in`.
pub const PER_LAYER_IN: &str = "per_layer_in";
pub const PER_LAYER_OUT: &str = "per_layer_out";

/// The metadata key of a part's description (a part has no `hf2coreml.contract`: it is not a
/// model on its own).
pub const PART_METADATA_KEY: &str = "hf2coreml.chain_part";

/// A chain file is a few KiB per part; this bounds a hostile one.
const MAX_CHAIN_FILE_BYTES: u64 = 16 << 20;

/// The whole chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainFile {
    /// [`CHAIN_FORMAT`].
    pub format: String,
    /// The contract of the model as one package would declare it: dimensions, token ids, RoPE,
    /// the applied recipe, the range scaling. Its I/O is what the chain as a whole computes.
    pub contract: Contract,
    /// α: the hidden state passed between parts is the residual stream times α. The runner
    /// passes it on unchanged; only the head's final norm removes it, as in one package.
    pub residual_scale: f64,
    pub hidden_size: usize,
    /// The parts in the order they run.
    pub parts: Vec<ChainPart>,
}

/// One package of the chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainPart {
    /// The package directory, relative to the chain directory (a plain file name).
    pub path: String,
    /// The decoder blocks it runs; its caches hold these layers only.
    pub layers: Range<usize>,
    /// The cache slots its blocks keep rows in, when they are not its blocks one to one
    /// (Gemma 4: a full block fills several slots, a block that shares none); absent: `layers`
    /// (or a hybrid model's attention blocks among them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<Range<usize>>,
    /// It takes `input_ids` (else `hidden`).
    pub embedding: bool,
    /// It returns the logits (else `hidden`).
    pub head: bool,
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
    /// sha256 of the package's files (`model.mlmodel`, `weight.bin`), or of a Core AI part's
    /// (`metadata.json`, `main.mlirb`, `main.hash`), by name ([`ChainFile::part_file`]).
    pub sha256: BTreeMap<String, String>,
    /// Bytes of the package on disk.
    pub bytes: u64,
}

/// Why a chain file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ChainFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a chain file: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// Whether `path` is a chain directory (holds a [`CHAIN_FILE`]).
/// (any file of that name: one that is not a regular file is the chain's error to report, not
/// a reason to read the directory as a package).
pub fn is_chain(path: &Path) -> bool {
    path.is_dir() && std::fs::symlink_metadata(path.join(CHAIN_FILE)).is_ok()
}

/// Refuse `path` when it is a symlink: a chain's files and parts are its own, and one that
/// links out would run what the chain does not hold.
fn refuse_symlink(path: &Path, what: &str) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(format!(
            "{}: {what} is a symlink; a chain's files and parts are its own",
            path.display()
        )),
        _ => Ok(()),
    }
}

/// The file of a Core ML part whose hash is checked at load.
const PACKAGE_PROGRAM_FILE: &str = "model.mlmodel";
/// The file of a Core AI part whose hash is checked at load (its bytecode holds its weights).
const ASSET_PROGRAM_FILE: &str = "metadata.json";

impl ChainPart {
    /// A Core AI asset (`part-N.aimodel`, a chain converted with `--target coreai`), not an
    /// ML package.
    pub fn is_asset(&self) -> bool {
        self.path.ends_with(".aimodel")
    }

    /// The cache slots its blocks keep rows in ([`ChainPart::slots`], else its layers).
    pub fn cache_slots(&self) -> Range<usize> {
        self.slots.clone().unwrap_or_else(|| self.layers.clone())
    }

    /// The inputs and outputs of a part running `layers` whose rows are in cache `slots`
    /// (of a model without a recurrent state), first and/or last as said.
    pub fn io(
        c: &Contract,
        hidden_size: usize,
        (layers, slots): (&Range<usize>, &Range<usize>),
        embedding: bool,
        head: bool,
        float: &str,
    ) -> (Vec<IoSpec>, Vec<IoSpec>) {
        // A hybrid model's part holds its own attention blocks' rows and its own conv blocks'
        // state.
        let (cache_layers, conv_layers) = match &c.recurrent {
            Some(r) => {
                let (a, v) = r.slots(layers);
                (a.len(), v.len())
            }
            None => (slots.len(), 0),
        };
        let (mut all_in, mut all_out) = Contract::io(
            c.max_seq_len,
            c.query_len,
            cache_layers,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size,
            float,
        );
        if let (Some(r), true) = (&c.recurrent, conv_layers > 0) {
            r.part(layers)
                .add_io(c.query_len, float, (&mut all_in, &mut all_out), None);
        }
        let hidden = |name: &str| IoSpec {
            name: name.to_string(),
            dtype: float.to_string(),
            shape: vec![1, c.query_len, hidden_size],
        };
        let has_layers = !layers.is_empty();
        let mut inputs: Vec<IoSpec> = Vec::new();
        if !embedding {
            inputs.push(hidden(HIDDEN_IN));
        }
        let caches = [
            contract::KEY_CACHE,
            contract::VALUE_CACHE,
            contract::KEY_UPDATE,
            contract::VALUE_UPDATE,
        ];
        for i in all_in {
            let keep = match i.name.as_str() {
                contract::INPUT_IDS => embedding,
                n if caches.contains(&n) => cache_layers > 0,
                _ => has_layers,
            };
            if keep {
                inputs.push(i);
            }
        }
        let mut outputs: Vec<IoSpec> = Vec::new();
        if !head {
            outputs.push(hidden(HIDDEN_OUT));
        }
        for o in all_out {
            let keep = match o.name.as_str() {
                n if caches.contains(&n) => cache_layers > 0,
                contract::CONV_STATE_UPDATE | contract::DELTA_STATE_UPDATE => true,
                _ => head,
            };
            if keep {
                outputs.push(o);
            }
        }
        // `input_ids` comes first in a first part, as in one package.
        if embedding {
            inputs.sort_by_key(|i| i.name != contract::INPUT_IDS);
        }
        // Gemma 4: the first part takes the per-layer table's rows and hands the per-layer
        // inputs it computes to the later parts.
        if let Some(t) = &c.per_layer {
            let per_layer = |name: &str| IoSpec {
                name: name.to_string(),
                dtype: float.to_string(),
                shape: vec![1, c.query_len, t.row_len()],
            };
            if embedding {
                t.add_input(c.query_len, float, &mut inputs);
                if !head && has_layers {
                    outputs.insert(1, per_layer(PER_LAYER_OUT));
                }
            } else if has_layers {
                inputs.insert(1, per_layer(PER_LAYER_IN));
            }
        }
        (inputs, outputs)
    }
}

impl ChainFile {
    /// Read and check `dir/chain.json`.
    pub fn read(dir: &Path) -> Result<Self, ChainFileError> {
        let path = dir.join(CHAIN_FILE);
        refuse_symlink(&path, "the chain file").map_err(|message| ChainFileError::Invalid {
            path: path.clone(),
            message,
        })?;
        let text =
            crate::fsutil::read_input_text(&path, MAX_CHAIN_FILE_BYTES).map_err(|source| {
                ChainFileError::Io {
                    path: path.clone(),
                    source,
                }
            })?;
        let invalid = |message: String| ChainFileError::Invalid {
            path: path.clone(),
            message,
        };
        let chain: ChainFile = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        chain.check().map_err(invalid)?;
        chain.check_programs(dir).map_err(invalid)?;
        Ok(chain)
    }

    /// Each part's program is the one the chain recorded (the sha256 of its `model.mlmodel`,
    /// or of a Core AI part's `metadata.json`, which names its index and layers: a few MB to
    /// hash; the weights are `validate`'s to hash): a part copied over another, or replaced, is
    /// refused at load, not found by its wrong results.
    fn check_programs(&self, dir: &Path) -> Result<(), String> {
        for (i, p) in self.parts.iter().enumerate() {
            let root = Self::part_path(dir, p);
            refuse_symlink(&root, &format!("part {i}"))?;
            if !root.is_dir() {
                return Err(format!(
                    "part {i}: {} is not a directory (the part is missing or damaged)",
                    root.display()
                ));
            }
            let (file, what) = if p.is_asset() {
                (ASSET_PROGRAM_FILE, "the one")
            } else {
                (PACKAGE_PROGRAM_FILE, "the program")
            };
            let Some(recorded) = p.sha256.get(file) else {
                continue;
            };
            let model = Self::part_file(dir, p, file)?;
            let found = crate::fsutil::sha256_file(&model)
                .map_err(|e| format!("part {i}: {}: {e}", model.display()))?;
            if &found != recorded {
                return Err(format!(
                    "part {i} ({}): its {file} is not {what} the chain recorded \
                     (sha256 {found}, recorded {recorded}): the part was replaced or damaged",
                    p.path
                ));
            }
        }
        Ok(())
    }

    /// The file a part's `sha256` entry names: a package's `model.mlmodel` and `weight.bin`
    /// inside `Data/com.apple.CoreML`, a Core AI part's files at its top. A name that is not a
    /// plain file name is refused (the chain file is input).
    pub fn part_file(dir: &Path, part: &ChainPart, name: &str) -> Result<PathBuf, String> {
        let plain = !name.is_empty()
            && Path::new(name)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
            && !name.contains(['/', '\\']);
        if !plain {
            return Err(format!(
                "{}: hashed file `{name}` is not a name inside the part",
                part.path
            ));
        }
        let root = Self::part_path(dir, part);
        Ok(match (part.is_asset(), name) {
            (true, _) => root.join(name),
            (false, "weight.bin") => root.join("Data/com.apple.CoreML/weights/weight.bin"),
            (false, other) => root.join("Data/com.apple.CoreML").join(other),
        })
    }

    /// The parts cover the model's layers once, in order; the first embeds, the last computes
    /// the logits; every path is a plain name inside the chain directory.
    pub fn check(&self) -> Result<(), String> {
        if self.format != CHAIN_FORMAT {
            return Err(format!(
                "format `{}`, this version reads `{CHAIN_FORMAT}`",
                self.format
            ));
        }
        let n = self.parts.len();
        if n == 0 {
            return Err("no parts".into());
        }
        let mut next = 0;
        let mut next_slot = 0;
        let with_slots = self.parts.iter().filter(|p| p.slots.is_some()).count();
        if with_slots != 0 && (with_slots != n || self.contract.recurrent.is_some()) {
            return Err(
                "cache slots are given for some parts only, or beside a recurrent \
                        state"
                    .into(),
            );
        }
        for (i, p) in self.parts.iter().enumerate() {
            if p.embedding != (i == 0) || p.head != (i + 1 == n) {
                return Err(format!(
                    "part {i}: only the first part embeds and only the last computes logits"
                ));
            }
            if p.layers.start != next || p.layers.end < p.layers.start {
                return Err(format!(
                    "part {i}: layers {:?} do not follow layer {next}",
                    p.layers
                ));
            }
            next = p.layers.end;
            if let Some(s) = &p.slots {
                if s.start != next_slot || s.end < s.start {
                    return Err(format!(
                        "part {i}: cache slots {s:?} do not follow slot {next_slot}"
                    ));
                }
                next_slot = s.end;
            }
            if p.is_asset() != self.contract.target.is_coreai() {
                return Err(format!(
                    "part {i}: `{}` for target `{}` (Core AI parts are `.aimodel` assets, \
                     the others ML packages)",
                    p.path,
                    self.contract.target.as_str()
                ));
            }
            if let Some(j) = self.parts[..i].iter().position(|q| q.path == p.path) {
                return Err(format!(
                    "parts {j} and {i} are both `{}`: one package cannot run two layer ranges",
                    p.path
                ));
            }
            let plain = Path::new(&p.path)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !plain || p.path.is_empty() || p.path.contains('/') || p.path.contains('\\') {
                return Err(format!(
                    "part {i}: path `{}` is not a name inside the chain",
                    p.path
                ));
            }
        }
        if let Some(r) = &self.contract.recurrent {
            r.check(self.contract.num_layers)?;
        }
        // With cache slots given, L counts slots, not blocks: the slots are checked instead.
        if with_slots == 0 && next != self.contract.blocks() {
            return Err(format!(
                "the parts run {next} layers, the model has {}",
                self.contract.blocks()
            ));
        }
        if let Some(t) = self
            .contract
            .per_layer
            .as_ref()
            .filter(|t| t.layers != next)
        {
            return Err(format!(
                "the parts run {next} layers, the per-layer table has {}",
                t.layers
            ));
        }
        if with_slots == n && next_slot != self.contract.num_layers {
            return Err(format!(
                "the parts keep {next_slot} cache slots, the caches have {}",
                self.contract.num_layers
            ));
        }
        Ok(())
    }

    /// A part's package directory.
    pub fn part_path(dir: &Path, part: &ChainPart) -> PathBuf {
        dir.join(&part.path)
    }
}
