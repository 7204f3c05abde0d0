//! The memory model (docs/design.md, "Memory model") and device profiles.
//!
//! total = weights + KV cache + one step's working set + runtime overhead, checked against the
//! device's app memory limit less a safety margin. Everything but the KV cache and the
//! attention scores is independent of S, so the largest S that fits is found by bisection.

pub mod split;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::arch::ModelSpec;
use crate::arch::TensorSlot;
use crate::quant::Storage;

mod plan;
pub use plan::{suggest, Candidate, PlanInput, PlanSource, Suggestion};

/// The embedded device table (configs/devices.toml).
pub const DEFAULT_DEVICES: &str = include_str!("../../../../configs/devices.toml");

/// Bytes per element of the fp16 caches and activations of an iOS17 package.
const FP16_BYTES: u64 = 2;

#[derive(Debug, Error)]
pub enum BudgetError {
    #[error("{path}: {message}")]
    Devices { path: PathBuf, message: String },
    #[error("unknown device `{name}` (known: {known})")]
    UnknownDevice { name: String, known: String },
    /// A checkpoint directory or a config.json that cannot be planned from.
    #[error("cannot read the model at {}", path.display())]
    Checkpoint {
        path: PathBuf,
        #[source]
        source: crate::checkpoint::CheckpointError,
    },
    #[error("cannot read GGUF header {}", path.display())]
    Gguf {
        path: PathBuf,
        #[source]
        source: crate::checkpoint::gguf::GgufError,
    },
    #[error(transparent)]
    Recipe(crate::quant::QuantError),
}

/// One device profile.
#[derive(Debug, Clone, Serialize)]
pub struct Device {
    pub id: String,
    pub name: String,
    pub ram_bytes: u64,
    pub app_limit_bytes: u64,
    pub app_limit_increased_bytes: u64,
    pub safety_margin: f64,
    pub runtime_overhead_bytes: u64,
    /// The largest package `convert` writes for this device before splitting into a chain.
    pub max_package_size_bytes: u64,
}

/// The largest package when no device is named: the iPhone Neural Engine's 1 GB (10^9 bytes,
/// the reading the lint uses: docs/design.md "Neural Engine readiness"), so a conversion runs
/// on the Neural Engine wherever it is deployed.
pub const DEFAULT_MAX_PACKAGE_BYTES: u64 = 1_000_000_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevices {
    defaults: Option<RawDefaults>,
    devices: BTreeMap<String, RawDevice>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDefaults {
    safety_margin: Option<f64>,
    runtime_overhead: Option<String>,
    max_package_size: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: String,
    ram: String,
    app_limit: String,
    app_limit_increased: String,
    safety_margin: Option<f64>,
    runtime_overhead: Option<String>,
    max_package_size: Option<String>,
}

/// A size that [`parse_size`] cannot read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SizeError {
    #[error("`{0}` is not a size (e.g. 3.5 GiB, 500 MB, 1073741824)")]
    NotANumber(String),
    #[error("unknown size unit `{unit}` in `{text}`")]
    UnknownUnit { unit: String, text: String },
    #[error("`{0}` is not a size")]
    OutOfRange(String),
    #[error("`{0}` is beyond the largest size hf2coreml plans with (8 PiB)")]
    TooLarge(String),
    #[error("`{0}`: a package size must be at least 1 byte")]
    EmptyPackage(String),
}

/// A package size limit (`--max-package-size`, a batch export's `max_package_size`): a
/// byte count from 1 byte to [`MAX_SIZE`].
pub fn package_size(bytes: u64, text: &str) -> Result<u64, SizeError> {
    match bytes {
        0 => Err(SizeError::EmptyPackage(text.to_string())),
        b if b > MAX_SIZE => Err(SizeError::TooLarge(text.to_string())),
        b => Ok(b),
    }
}

/// The largest size a flag may give: 2^53 bytes (8 PiB), below which every byte count is
/// exact in the f64 arithmetic of the plans and their differences fit an i64.
pub const MAX_SIZE: u64 = 1 << 53;

/// Parse a size such as `3.0 GiB`, `150 MiB`, `6GB` or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| SizeError::NotANumber(s.to_string()))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(SizeError::UnknownUnit {
                unit: other.to_string(),
                text: s.to_string(),
            })
        }
    };
    if !(num.is_finite() && num >= 0.0) {
        return Err(SizeError::OutOfRange(s.to_string()));
    }
    let bytes = (num * mult).round();
    if bytes > MAX_SIZE as f64 {
        return Err(SizeError::TooLarge(s.to_string()));
    }
    Ok(bytes as u64)
}

/// The device table.
#[derive(Debug, Clone)]
pub struct Devices {
    pub devices: Vec<Device>,
    /// The table's `[defaults]`: what an explicit `--memory-limit` is planned with too.
    pub defaults: Allowances,
}

/// What a plan reserves besides the model: a fraction of the limit and the runtime's bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allowances {
    pub safety_margin: f64,
    pub runtime_overhead_bytes: u64,
}

impl Allowances {
    /// Nothing reserved: the limit is what the model may use.
    pub const NONE: Allowances = Allowances {
        safety_margin: 0.0,
        runtime_overhead_bytes: 0,
    };
}

impl Devices {
    /// The embedded table.
    pub fn builtin() -> Self {
        Self::parse(DEFAULT_DEVICES, Path::new("configs/devices.toml"))
            .expect("embedded devices.toml is valid")
    }

    /// `--devices FILE`.
    pub fn from_file(path: &Path) -> Result<Self, BudgetError> {
        // A device table is a few KiB; 1 MiB bounds a hostile one (and a FIFO is refused).
        let text =
            crate::fsutil::read_input_text(path, 1 << 20).map_err(|e| BudgetError::Devices {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self, BudgetError> {
        let err = |message: String| BudgetError::Devices {
            path: path.to_path_buf(),
            message,
        };
        let raw: RawDevices = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        let def_margin = raw
            .defaults
            .as_ref()
            .and_then(|d| d.safety_margin)
            .unwrap_or(0.1);
        let def_overhead = match raw
            .defaults
            .as_ref()
            .and_then(|d| d.runtime_overhead.clone())
        {
            Some(s) => parse_size(&s).map_err(|e| err(e.to_string()))?,
            None => 0,
        };
        let def_package = match raw
            .defaults
            .as_ref()
            .and_then(|d| d.max_package_size.clone())
        {
            Some(s) => parse_size(&s).map_err(|e| err(e.to_string()))?,
            None => DEFAULT_MAX_PACKAGE_BYTES,
        };
        if !(0.0..1.0).contains(&def_margin) {
            return Err(err("defaults: safety_margin must be in [0, 1)".into()));
        }
        let defaults = Allowances {
            safety_margin: def_margin,
            runtime_overhead_bytes: def_overhead,
        };
        let mut devices = Vec::new();
        for (id, d) in raw.devices {
            let size = |s: &str| parse_size(s).map_err(|m| err(format!("device `{id}`: {m}")));
            let margin = d.safety_margin.unwrap_or(def_margin);
            if !(0.0..1.0).contains(&margin) {
                return Err(err(format!(
                    "device `{id}`: safety_margin must be in [0, 1)"
                )));
            }
            devices.push(Device {
                name: d.name,
                ram_bytes: size(&d.ram)?,
                app_limit_bytes: size(&d.app_limit)?,
                app_limit_increased_bytes: size(&d.app_limit_increased)?,
                safety_margin: margin,
                runtime_overhead_bytes: match &d.runtime_overhead {
                    Some(s) => size(s)?,
                    None => def_overhead,
                },
                max_package_size_bytes: match &d.max_package_size {
                    Some(s) => size(s)?,
                    None => def_package,
                },
                id,
            });
        }
        Ok(Devices { devices, defaults })
    }

    pub fn get(&self, id: &str) -> Result<&Device, BudgetError> {
        self.devices
            .iter()
            .find(|d| d.id == id)
            .ok_or_else(|| BudgetError::UnknownDevice {
                name: id.to_string(),
                known: self
                    .devices
                    .iter()
                    .map(|d| d.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// Bytes of all weights when each slot is stored as `storage` says. Tied embeddings are one
/// tensor in the slot list, so they are counted once.
pub fn weights_bytes(slots: &[TensorSlot], storage: impl Fn(&TensorSlot) -> Storage) -> u64 {
    slots.iter().map(|s| storage(s).bytes(s.numel())).sum()
}

/// What the budget is checked against.
#[derive(Debug, Clone, Serialize)]
pub struct Limit {
    /// Device id, or `None` for an explicit `--memory-limit`.
    pub device: Option<String>,
    pub limit_bytes: u64,
    pub safety_margin: f64,
    pub runtime_overhead_bytes: u64,
    pub increased_memory_limit: bool,
}

impl Limit {
    pub fn for_device(d: &Device, increased: bool) -> Self {
        Limit {
            device: Some(d.id.clone()),
            limit_bytes: if increased {
                d.app_limit_increased_bytes
            } else {
                d.app_limit_bytes
            },
            safety_margin: d.safety_margin,
            runtime_overhead_bytes: d.runtime_overhead_bytes,
            increased_memory_limit: increased,
        }
    }

    /// An explicit limit, planned with the same allowances a device gets (the table's
    /// `[defaults]`, unless the caller overrides them).
    pub fn explicit(bytes: u64, allowances: Allowances) -> Self {
        Limit {
            device: None,
            limit_bytes: bytes,
            safety_margin: allowances.safety_margin,
            runtime_overhead_bytes: allowances.runtime_overhead_bytes,
            increased_memory_limit: false,
        }
    }

    /// The bytes a plan may use: the limit less the safety margin.
    pub fn usable_bytes(&self) -> u64 {
        (self.limit_bytes as f64 * (1.0 - self.safety_margin)) as u64
    }
}

/// The budget report (`budget --json`).
#[derive(Debug, Clone, Serialize)]
pub struct Budget {
    pub max_seq_len: usize,
    pub query_len: usize,
    pub weights_bytes: u64,
    /// Gemma 4's per-layer table: a file the app memory-maps beside the package. Clean
    /// file-backed pages are not part of an app's memory footprint, so it is not in
    /// `total_bytes`; the rows a step reads are in the working set.
    #[serde(skip_serializing_if = "is_zero")]
    pub mapped_bytes: u64,
    /// How that table stores its values: the bits of its LUT indices, absent for fp16.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_layer_bits: Option<u8>,
    pub kv_cache_bytes: u64,
    pub working_set_bytes: u64,
    pub runtime_overhead_bytes: u64,
    pub total_bytes: u64,
    pub limit_bytes: u64,
    pub usable_bytes: u64,
    pub safety_margin: f64,
    pub device: Option<String>,
    pub increased_memory_limit: bool,
    pub fits: bool,
    /// The largest S for which the plan fits (0 if none does), capped at [`MAX_SEQ_CAP`] and
    /// at the longest context a package of the model computes ([`ModelSpec::package_context`]).
    pub max_seq_len_that_fits: usize,
    pub headroom_bytes: i64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Largest S the bisection considers.
pub const MAX_SEQ_CAP: usize = 1 << 20;

/// The state the blocks keep at context length S ([`ModelSpec::state_bytes`]): for
/// attention, 2 × L × Hkv × D × S × 2 bytes.
pub fn kv_cache_bytes(spec: &ModelSpec, max_seq_len: usize) -> u64 {
    spec.state_bytes(max_seq_len)
}

/// One step's transient memory: logits, cache updates, one layer's attention scores (and their
/// softmax), the hidden and MLP activations, and the layer's K/V (cache slice + new rows
/// concatenated) the attention reads.
pub fn working_set_bytes(spec: &ModelSpec, max_seq_len: usize, query_len: usize) -> u64 {
    let q = query_len as u64;
    let s = max_seq_len as u64;
    let logits = q * spec.vocab_size as u64 * FP16_BYTES;
    let updates = 2
        * spec.num_hidden_layers as u64
        * spec.num_key_value_heads as u64
        * q
        * spec.head_dim as u64
        * FP16_BYTES;
    // scores and softmax(scores) live at the same time.
    let scores = 2 * spec.num_attention_heads as u64 * q * (s + q) * FP16_BYTES;
    // one layer's keys and values over S+Q rows, expanded to the query heads for GQA.
    let layer_kv =
        2 * spec.num_attention_heads as u64 * (s + q) * spec.head_dim as u64 * FP16_BYTES;
    let hidden = q * (4 * spec.hidden_size as u64 + 3 * spec.intermediate_size as u64) * FP16_BYTES;
    // Gemma 4: the per-layer table's rows of the step's tokens, gathered by the host.
    let per_layer_rows =
        q * spec.num_hidden_layers as u64 * spec.per_layer_input() as u64 * FP16_BYTES;
    logits + updates + scores + layer_kv + hidden + per_layer_rows
}

/// Compute the budget of a plan whose per-layer table (Gemma 4's) is stored with
/// `per_layer_bits` ([`ModelSpec::per_layer_table_bytes`]).
pub fn compute(
    spec: &ModelSpec,
    weights_bytes: u64,
    (max_seq_len, query_len): (usize, usize),
    per_layer_bits: Option<u8>,
    limit: &Limit,
) -> Budget {
    let total_at = |s: usize| {
        weights_bytes
            + kv_cache_bytes(spec, s)
            + working_set_bytes(spec, s, query_len)
            + limit.runtime_overhead_bytes
    };
    let usable = limit.usable_bytes();
    let total = total_at(max_seq_len);
    // total_at is increasing in S: bisect for the largest S with total_at(S) <= usable.
    let fits_at = |s: usize| total_at(s) <= usable;
    // Never beyond the model's trained context (positions past it are not a model), nor
    // LongRoPE's original one (a package's tables hold the short factors).
    let cap = MAX_SEQ_CAP.min(spec.package_context()).max(1);
    let max_fit = if !fits_at(1) {
        0
    } else {
        let (mut lo, mut hi) = (1usize, cap);
        if fits_at(hi) {
            hi
        } else {
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if fits_at(mid) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            lo
        }
    };
    Budget {
        max_seq_len,
        query_len,
        weights_bytes,
        mapped_bytes: spec.per_layer_table_bytes(per_layer_bits),
        per_layer_bits,
        kv_cache_bytes: kv_cache_bytes(spec, max_seq_len),
        working_set_bytes: working_set_bytes(spec, max_seq_len, query_len),
        runtime_overhead_bytes: limit.runtime_overhead_bytes,
        total_bytes: total,
        limit_bytes: limit.limit_bytes,
        usable_bytes: usable,
        safety_margin: limit.safety_margin,
        device: limit.device.clone(),
        increased_memory_limit: limit.increased_memory_limit,
        fits: total <= usable,
        max_seq_len_that_fits: max_fit,
        headroom_bytes: usable as i64 - total as i64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::expected_tensors;
    use crate::quant::Recipe;

    fn default_storage(slot: &TensorSlot) -> Storage {
        Recipe::default().storage(slot)
    }

    fn smollm() -> ModelSpec {
        ModelSpec::from_config_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
            "num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,"vocab_size":49152,
            "tie_word_embeddings":true,"max_position_embeddings":8192}"#,
        )
        .unwrap()
    }

    #[test]
    fn smollm_kv_cache_at_2048() {
        assert_eq!(kv_cache_bytes(&smollm(), 2048), 47_185_920);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("3 GiB").unwrap(), 3 << 30);
        assert_eq!(parse_size("150MiB").unwrap(), 150 << 20);
        assert_eq!(parse_size("6 GB").unwrap(), 6_000_000_000);
        assert_eq!(parse_size("1024").unwrap(), 1024);
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("lots").is_err());
        // Beyond what the plans compute with: refused, not saturated.
        assert_eq!(parse_size(&MAX_SIZE.to_string()).unwrap(), MAX_SIZE);
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(SizeError::TooLarge(_))
        ));
        assert!(matches!(
            parse_size("9000000 GiB"),
            Err(SizeError::TooLarge(_))
        ));
    }

    #[test]
    fn builtin_devices_load_and_are_ordered_sensibly() {
        let d = Devices::builtin();
        for id in [
            "iphone-15",
            "iphone-15-pro",
            "iphone-16",
            "iphone-16-pro",
            "iphone-17-pro",
            "mac-m1-16gb",
        ] {
            let dev = d.get(id).unwrap();
            assert!(dev.app_limit_bytes <= dev.app_limit_increased_bytes);
            assert!(dev.app_limit_increased_bytes < dev.ram_bytes);
        }
        assert!(d.get("iphone-3g").is_err());
    }

    #[test]
    fn unknown_device_keys_are_errors() {
        let text = "[devices.x]\nname='x'\nram='1 GiB'\napp_limit='1'\napp_limit_increased='1'\nram_gb=3\n";
        assert!(Devices::parse(text, Path::new("d.toml")).is_err());
    }

    #[test]
    fn an_explicit_limit_keeps_the_tables_allowances() {
        let d = Devices::builtin();
        assert_eq!(d.defaults.safety_margin, 0.10);
        assert_eq!(d.defaults.runtime_overhead_bytes, 150 << 20);
        let spec = smollm();
        let w = weights_bytes(&expected_tensors(&spec), default_storage);
        let limit = Limit::explicit(400 << 20, d.defaults);
        assert_eq!(limit.usable_bytes(), ((400u64 << 20) as f64 * 0.9) as u64);
        let b = compute(&spec, w, (512, 1), None, &limit);
        assert_eq!(b.runtime_overhead_bytes, 150 << 20);
        let bare = compute(
            &spec,
            w,
            (512, 1),
            None,
            &Limit::explicit(400 << 20, Allowances::NONE),
        );
        assert!(bare.max_seq_len_that_fits > b.max_seq_len_that_fits);
        assert!(b.max_seq_len_that_fits > 512, "{b:?}");
        let bad = "[defaults]\nsafety_margin = 1.5\n";
        assert!(Devices::parse(bad, Path::new("d.toml")).is_err());
    }

    #[test]
    fn max_fit_is_the_boundary() {
        let spec = smollm();
        let w = weights_bytes(&expected_tensors(&spec), default_storage);
        let limit = Limit::explicit(w + (100 << 20), Allowances::NONE);
        let b = compute(&spec, w, (512, 1), None, &limit);
        assert!(b.fits);
        let s = b.max_seq_len_that_fits;
        assert!(s > 512);
        assert!(compute(&spec, w, (s, 1), None, &limit).fits);
        assert!(!compute(&spec, w, (s + 1, 1), None, &limit).fits);
        // Memory for far more than the context still stops at the context.
        let roomy = Limit::explicit(w + (8 << 30), Allowances::NONE);
        assert_eq!(
            compute(&spec, w, (512, 1), None, &roomy).max_seq_len_that_fits,
            8192
        );
        let tiny = Limit::explicit(w / 2, Allowances::NONE);
        let b = compute(&spec, w, (512, 1), None, &tiny);
        assert!(!b.fits);
        assert_eq!(b.max_seq_len_that_fits, 0);
    }

    #[test]
    fn default_recipe_weights_count_tied_embedding_once() {
        let spec = smollm();
        let slots = expected_tensors(&spec);
        let fp16 = weights_bytes(&slots, |_| Storage::Fp16);
        assert_eq!(fp16, 134_515_008 * 2);
        // The default recipe: projections 6-bit (one 64-entry fp16 LUT each), the rest fp16.
        let q = weights_bytes(&slots, default_storage);
        let proj: u64 = slots
            .iter()
            .filter(|s| s.role.is_projection())
            .map(|s| s.numel() as u64)
            .sum();
        let luts = 7 * 30 * 64 * 2;
        assert_eq!(q, proj * 6 / 8 + luts + (134_515_008 - proj) * 2);
    }
}
