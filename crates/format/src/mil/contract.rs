//! The package contract (docs/design.md, "The package contract"): what a package's inputs and
//! outputs mean. The emitter writes it as JSON into
//! `user_defined_metadata["hf2coreml.contract"]`; the runner and `validate` read it back.
//! Plain data, shared by both sides so they cannot drift apart.

use serde::{Deserialize, Serialize};

/// The metadata key holding the contract JSON.
pub const METADATA_KEY: &str = "hf2coreml.contract";

/// Contract version 2: iOS17, one decode/chunk step, caches passed in and out, the logits in
/// parts of at most [`MAX_LOGITS_WIDTH`] (version 1: one `logits` output of width V).
pub const CONTRACT_VERSION: u32 = 2;

/// The OS a package is built for: its opset, specificationVersion and the weight formats it may
/// use. iOS17 is the default and the compatibility floor; iOS18 adds grouped LUTs (one table
/// per group of output channels), per-channel scales after a LUT and 3-bit indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    #[default]
    Ios17,
    Ios18,
    /// Apple's Core AI (iOS / macOS 27): an `.aimodel` asset instead of a Core ML package, with
    /// every weight form iOS18 has (grouped LUTs of 1-8 bits, per-row scales).
    CoreAi,
}

impl Target {
    /// `ios17`, `ios18` or `coreai`, as flags, recipes and the contract spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Target::Ios17 => "ios17",
            Target::Ios18 => "ios18",
            Target::CoreAi => "coreai",
        }
    }

    /// The flag or recipe spelling.
    pub fn parse(s: &str) -> Option<Target> {
        match s {
            "ios17" => Some(Target::Ios17),
            "ios18" => Some(Target::Ios18),
            "coreai" => Some(Target::CoreAi),
            _ => None,
        }
    }

    /// Whether the target stores grouped LUTs (one table per group of output channels),
    /// per-row scales after a LUT and 3-bit indices.
    pub fn grouped_luts(self) -> bool {
        matches!(self, Target::Ios18 | Target::CoreAi)
    }

    /// Whether the output is a Core AI asset (`.aimodel`) rather than a Core ML package.
    pub fn is_coreai(self) -> bool {
        self == Target::CoreAi
    }

    /// The file extension of what the target writes.
    pub fn extension(self) -> &'static str {
        if self.is_coreai() {
            "aimodel"
        } else {
            "mlpackage"
        }
    }

    /// Model.specificationVersion of its packages (docs/reference/mlpackage-format.md).
    pub fn spec_version(self) -> i32 {
        match self {
            Target::Ios17 => 8,
            Target::Ios18 => 9,
            // A Core AI asset is no Core ML model: it has no specification version.
            Target::CoreAi => 0,
        }
    }

    /// The function opset (`CoreML7`, `CoreML8`).
    pub fn opset(self) -> &'static str {
        match self {
            Target::Ios17 => "CoreML7",
            Target::Ios18 => "CoreML8",
            Target::CoreAi => "CoreAI",
        }
    }

    /// The target a package declares by its specificationVersion, if it is one of ours.
    pub fn from_spec_version(v: i32) -> Option<Target> {
        [Target::Ios17, Target::Ios18]
            .into_iter()
            .find(|t| t.spec_version() == v)
    }
}

/// How the graph lays out its hidden state (docs/design.md, "The Neural Engine layout"). The
/// package's inputs and outputs are the same in both: only what is inside the program differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// (B, S, C): `linear` projections, attention over all heads at once.
    #[default]
    Default,
    /// (B, C, 1, S): 1×1 `conv` projections, norms over the channel axis, attention one head
    /// at a time, as Apple's Neural Engine rules describe.
    Ane,
}

impl Layout {
    /// `default` or `ane`, as flags, recipes and the contract spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Layout::Default => "default",
            Layout::Ane => "ane",
        }
    }

    /// The flag or recipe spelling.
    pub fn parse(s: &str) -> Option<Layout> {
        match s {
            "default" => Some(Layout::Default),
            "ane" => Some(Layout::Ane),
            _ => None,
        }
    }

    /// The default layout (not recorded, so packages made before layouts keep their bytes).
    pub fn is_default(&self) -> bool {
        *self == Layout::Default
    }
}

/// How the key/value cache crosses the package boundary (docs/design.md, "Stateful KV cache").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCache {
    /// `key_cache`/`value_cache` inputs, `key_update`/`value_update` outputs: the host keeps
    /// the cache and writes the new rows (every target; the default).
    #[default]
    Io,
    /// iOS18: one Core ML state, [`KV_STATE`], holding every layer's keys then values; the
    /// program reads it, writes the new rows at `position` and stores it back.
    State,
}

impl KvCache {
    /// `io` or `state`, as flags, recipes and the contract spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            KvCache::Io => "io",
            KvCache::State => "state",
        }
    }

    /// The flag or recipe spelling.
    pub fn parse(s: &str) -> Option<KvCache> {
        match s {
            "io" => Some(KvCache::Io),
            "state" => Some(KvCache::State),
            _ => None,
        }
    }

    /// The default (not recorded, so io packages keep their bytes).
    pub fn is_io(&self) -> bool {
        *self == KvCache::Io
    }
}

/// Which logits a multifunction package's `prefill` function returns (`--prefill-logits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillLogits {
    /// The last position's row only, [1, 1, w] a part: the one a host samples from. The rows
    /// before it would cost the lm_head over every position of the chunk and be thrown away.
    #[default]
    Last,
    /// Every position's row, [1, P, w] a part: for diagnosis (`run --logits-out` through
    /// prefill).
    All,
}

impl PrefillLogits {
    /// `last` or `all`, as flags and recipes spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            PrefillLogits::Last => "last",
            PrefillLogits::All => "all",
        }
    }

    /// The flag or recipe spelling.
    pub fn parse(s: &str) -> Option<PrefillLogits> {
        match s {
            "last" => Some(PrefillLogits::Last),
            "all" => Some(PrefillLogits::All),
            _ => None,
        }
    }
}

/// The name of the one state of a `--kv-cache state` package.
pub const KV_STATE: &str = "kv_cache";

/// State dimensions the Neural Engine takes are multiples of this (coremltools #2631).
pub const STATE_ALIGN: usize = 32;

/// The shape of [`KV_STATE`]: [2·L, Hkv, S rounded up to a multiple of [`STATE_ALIGN`], D];
/// layer l's keys at index l, its values at L + l. Rows from S on are never written and always
/// masked (a step at `position` attends to rows below it, and `position + Q <= S`).
pub fn kv_state_shape(s: usize, l: usize, hkv: usize, d: usize) -> Vec<usize> {
    vec![2 * l, hkv, s.next_multiple_of(STATE_ALIGN), d]
}

/// The Neural Engine compiler's largest last axis (W ≤ 16384, docs/design.md "Neural Engine
/// readiness"): a logits part is never wider.
pub const MAX_LOGITS_WIDTH: usize = 16_384;

/// The widths of the logits parts for a vocabulary of `v`: ⌈V / 16384⌉ parts, all of width
/// ⌈V / parts⌉ but the last, which takes the rest. SmolLM2's 49,152 → 3 × 16,384.
pub fn logits_widths(v: usize) -> Vec<usize> {
    let parts = v.div_ceil(MAX_LOGITS_WIDTH).max(1);
    let w = v.div_ceil(parts);
    (0..parts).map(|i| w.min(v.saturating_sub(i * w))).collect()
}

/// The output name of logits part `i` of `parts`: `logits` when there is one, else
/// `logits_0`, `logits_1`, ...
pub fn logits_name(i: usize, parts: usize) -> String {
    if parts == 1 {
        LOGITS.to_string()
    } else {
        format!("{LOGITS}_{i}")
    }
}

pub const INPUT_IDS: &str = "input_ids";
pub const POSITION: &str = "position";
pub const KEY_CACHE: &str = "key_cache";
pub const VALUE_CACHE: &str = "value_cache";
pub const LOGITS: &str = "logits";
pub const KEY_UPDATE: &str = "key_update";
pub const VALUE_UPDATE: &str = "value_update";
/// A hybrid package's count of real tokens in `input_ids` (Q > 1 only): the rest is padding,
/// which must not reach a recurrent state.
pub const VALID_LEN: &str = "valid_len";
/// The short-convolution blocks' states, [Lc, W, C].
pub const CONV_STATE: &str = "conv_state";
/// The same states after the step's real tokens.
pub const CONV_STATE_UPDATE: &str = "conv_state_update";
/// The Gated DeltaNet blocks' states, [Ld, value heads, key_dim, value_dim].
pub const DELTA_STATE: &str = "delta_state";
/// The same states after the step's real tokens.
pub const DELTA_STATE_UPDATE: &str = "delta_state_update";
/// Gemma 4: the per-layer table's rows of the step's tokens, [1, Q, L·P], which the host
/// gathers from the table file beside the package ([`PerLayerTable`]).
pub const PER_LAYER_ROWS: &str = "per_layer_rows";

/// The per-layer table's file beside package `X.mlpackage` (or `X.aimodel`):
/// `X.per_layer.bin`, named after the package as its other sidecar files are.
pub fn per_layer_file(package: &std::path::Path) -> std::path::PathBuf {
    let stem = package
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    package.with_file_name(format!("{stem}.{PER_LAYER_FILE_SUFFIX}"))
}

/// What [`per_layer_file`] appends to the package's stem.
pub const PER_LAYER_FILE_SUFFIX: &str = "per_layer.bin";

/// Gemma 4's per-layer embedding table, kept out of the package (docs/contract.md, "The
/// per-layer table"): a file beside it ([`per_layer_file`]) of `rows` rows of `layers · width`
/// values, row t holding token t's per-layer input of every block (block l at `l · width`).
/// The host reads the rows of a step's tokens and passes them as [`PER_LAYER_ROWS`]; the file
/// is memory-mapped, so only the rows of tokens seen are read.
///
/// `fp16` rows are little-endian fp16 values. A `lutN` file (N bits, 1 to 8) starts with one
/// LUT per block (`layers` × 2^N fp16 entries, block l's at `l · 2^N`), then the rows as LUT
/// indices, each row packed on its own as the package's palettized weights are: an LSB-first
/// bit stream of ⌈L·P·N/8⌉ bytes (at 4 bits, the even value in the low four bits).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerLayerTable {
    /// `fp16` or `lutN` (N bits, 1 to 8): how each value is stored.
    pub dtype: String,
    /// Rows: the per-layer vocabulary (token ids at or past it have no row).
    pub rows: usize,
    /// L: the blocks, each taking `width` values of a row.
    pub layers: usize,
    /// P: each block's share of a row.
    pub width: usize,
    /// sha256 of the file, hex.
    pub sha256: String,
}

/// The per-layer table's dtype when its values are LUT indices of `nbits` bits.
pub fn per_layer_lut_dtype(nbits: u8) -> String {
    format!("lut{nbits}")
}

impl PerLayerTable {
    /// The values of one row, L·P.
    pub fn row_len(&self) -> usize {
        self.layers.saturating_mul(self.width)
    }

    /// The bits of a LUT index, or `None` for fp16 values.
    pub fn lut_bits(&self) -> Option<u8> {
        let bits: u8 = self.dtype.strip_prefix("lut")?.parse().ok()?;
        (1..=8).contains(&bits).then_some(bits)
    }

    /// Bytes of the LUTs at the file's start (0 for fp16 rows).
    pub fn luts_bytes(&self) -> u64 {
        self.lut_bits()
            .map_or(0, |n| (self.layers as u64).saturating_mul(2u64 << n))
    }

    /// Bytes of one row in the file.
    pub fn row_bytes(&self) -> u64 {
        let values = self.row_len() as u64;
        match self.lut_bits() {
            Some(n) => values.saturating_mul(n as u64).div_ceil(8),
            None => values.saturating_mul(2),
        }
    }

    /// The file's size as the contract declares it (saturating: a foreign contract's numbers
    /// may be past any file).
    pub fn file_bytes(&self) -> u64 {
        (self.rows as u64)
            .saturating_mul(self.row_bytes())
            .saturating_add(self.luts_bytes())
    }

    /// Whether the declared table is one this runner reads: a known dtype and rows of
    /// non-zero width.
    pub fn check(&self) -> Result<(), String> {
        if self.dtype != "fp16" && self.lut_bits().is_none() {
            return Err(format!(
                "per_layer: dtype `{}`; the table is stored as fp16 or lut1 to lut8",
                self.dtype
            ));
        }
        if self.rows == 0 || self.row_len() == 0 {
            return Err("per_layer: a table without rows or of width zero".into());
        }
        Ok(())
    }

    /// Add its input at Q tokens, [`PER_LAYER_ROWS`] [1, Q, L·P], right after `input_ids`.
    pub fn add_input(&self, q: usize, float: &str, inputs: &mut Vec<IoSpec>) {
        let at = inputs
            .iter()
            .position(|i| i.name == INPUT_IDS)
            .map_or(0, |i| i + 1);
        let spec = IoSpec {
            name: PER_LAYER_ROWS.into(),
            dtype: float.into(),
            shape: vec![1, q, self.row_len()],
        };
        inputs.insert(at, spec);
    }
}

/// The state a hybrid model's blocks carry beside the attention blocks' KV rows
/// (docs/contract.md, "Hybrid packages"). `num_layers` then counts the attention blocks only:
/// the caches hold their rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recurrent {
    /// Decoder blocks in all (attention and recurrent) the package runs.
    pub blocks: usize,
    /// The blocks that attend, in order: slot i of the caches is block `attention_layers[i]`.
    pub attention_layers: Vec<usize>,
    /// The states of the blocks that convolve (LFM2's conv blocks, or the convolution in
    /// front of each Gated DeltaNet), if it has any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv: Option<ConvState>,
    /// The Gated DeltaNet blocks' states, if it has any: the same blocks as `conv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<DeltaState>,
}

/// The Gated DeltaNet blocks' state: per block and value head, the matrix S [key_dim,
/// value_dim] the delta rule updates, [Ld, Hv, Dk, Dv].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaState {
    /// The blocks, in order: slot i of the state is block `layers[i]`.
    pub layers: Vec<usize>,
    /// Hv: value heads.
    pub heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

/// The short-convolution blocks' state: the last W = K − 1 inputs of each block's depthwise
/// convolution, oldest first, [Lc, W, C].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConvState {
    /// The blocks, in order: slot i of the state is block `layers[i]`.
    pub layers: Vec<usize>,
    /// W: the inputs each block keeps.
    pub width: usize,
    /// C: its channels.
    pub channels: usize,
}

/// One tensor of a hybrid step's recurrent state: the input it is passed as, the output its
/// new value comes back as, its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateTensor {
    pub input: &'static str,
    pub output: &'static str,
    pub shape: Vec<usize>,
}

impl StateTensor {
    /// Its values (saturating: a foreign contract's shape may be past any memory).
    pub fn len(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .unwrap_or(usize::MAX)
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Recurrent {
    /// The tensors of its state, in the order a host keeps them one after the other: the
    /// conv state, then the DeltaNet state.
    pub fn tensors(&self) -> Vec<StateTensor> {
        let conv = self.conv_shape().map(|shape| StateTensor {
            input: CONV_STATE,
            output: CONV_STATE_UPDATE,
            shape,
        });
        let delta = self.delta_shape().map(|shape| StateTensor {
            input: DELTA_STATE,
            output: DELTA_STATE_UPDATE,
            shape,
        });
        conv.into_iter().chain(delta).collect()
    }

    /// The conv state's shape [Lc, W, C], if there is one.
    pub fn conv_shape(&self) -> Option<Vec<usize>> {
        self.conv
            .as_ref()
            .map(|c| vec![c.layers.len(), c.width, c.channels])
    }

    /// The DeltaNet state's shape [Ld, Hv, Dk, Dv], if there is one.
    pub fn delta_shape(&self) -> Option<Vec<usize>> {
        self.delta
            .as_ref()
            .map(|d| vec![d.layers.len(), d.heads, d.key_dim, d.value_dim])
    }

    /// Values in all the recurrent state holds (the host's copy: the conv state, then the
    /// DeltaNet state); `usize::MAX` for a foreign contract's shapes past any memory.
    pub fn len(&self) -> usize {
        self.tensors()
            .iter()
            .try_fold(0usize, |sum, t| {
                let n = t.shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b))?;
                sum.checked_add(n)
            })
            .unwrap_or(usize::MAX)
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it describes `num_layers` attention blocks among `blocks`: every block
    /// attends or convolves, once, in order (a foreign file's state is sliced by these).
    pub fn check(&self, num_layers: usize) -> Result<(), String> {
        let conv = self.conv.as_ref().map_or(&[][..], |c| &c.layers[..]);
        let mut kinds = vec![0u8; self.blocks];
        for &l in self.attention_layers.iter().chain(conv) {
            match kinds.get_mut(l) {
                Some(k) if *k == 0 => *k = 1,
                _ => {
                    return Err(format!(
                        "recurrent: block {l} is listed twice or is not one of {} blocks",
                        self.blocks
                    ))
                }
            }
        }
        let sorted = |v: &[usize]| v.windows(2).all(|w| w[0] < w[1]);
        if kinds.contains(&0) || !sorted(&self.attention_layers) || !sorted(conv) {
            return Err(format!(
                "recurrent: the attention and conv blocks do not list each of {} blocks once, \
                 in order",
                self.blocks
            ));
        }
        if self.attention_layers.len() != num_layers {
            return Err(format!(
                "recurrent: {} attention blocks, the caches hold {num_layers}",
                self.attention_layers.len()
            ));
        }
        if let Some(c) = &self.conv {
            if c.width == 0 || c.channels == 0 {
                return Err("recurrent: a conv state of zero width or channels".into());
            }
        }
        if let Some(d) = &self.delta {
            if d.layers != conv {
                return Err(
                    "recurrent: the DeltaNet blocks are not the blocks that convolve".into(),
                );
            }
            if d.heads == 0 || d.key_dim == 0 || d.value_dim == 0 {
                return Err("recurrent: a DeltaNet state of zero heads or size".into());
            }
        }
        Ok(())
    }

    /// The cache slots and conv-state slots of blocks `layers`: the attention blocks before
    /// `layers.start` to those before `layers.end`, and the same for the conv blocks.
    pub fn slots(
        &self,
        layers: &std::ops::Range<usize>,
    ) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let before = |v: &[usize], at: usize| v.iter().filter(|&&l| l < at).count();
        let conv = self.conv.as_ref().map_or(&[][..], |c| &c.layers[..]);
        let a = &self.attention_layers;
        (
            before(a, layers.start)..before(a, layers.end),
            before(conv, layers.start)..before(conv, layers.end),
        )
    }

    /// The state blocks `layers` carry (a chain part's): their conv and DeltaNet slots, no
    /// cache slot (the part's caches are counted apart).
    pub fn part(&self, layers: &std::ops::Range<usize>) -> Recurrent {
        let (_, slots) = self.slots(layers);
        Recurrent {
            blocks: layers.len(),
            attention_layers: Vec::new(),
            conv: self.conv.as_ref().map(|c| ConvState {
                layers: c.layers[slots.clone()].to_vec(),
                ..c.clone()
            }),
            delta: self.delta.as_ref().map(|d| DeltaState {
                layers: d.layers[slots].to_vec(),
                ..d.clone()
            }),
        }
    }

    /// Add its inputs and outputs to a step's at Q tokens: `valid_len` after `position`
    /// (Q > 1), the state after the caches, its update after theirs; or, given `states` (a
    /// `--kv-cache state` package), the state tensors as Core ML states there.
    pub fn add_io(
        &self,
        q: usize,
        float: &str,
        (inputs, outputs): (&mut Vec<IoSpec>, &mut Vec<IoSpec>),
        mut states: Option<&mut Vec<IoSpec>>,
    ) {
        let io = |name: &str, dtype: &str, shape: Vec<usize>| IoSpec {
            name: name.into(),
            dtype: dtype.into(),
            shape,
        };
        if q > 1 {
            let at = inputs
                .iter()
                .position(|i| i.name == POSITION)
                .map_or(inputs.len(), |i| i + 1);
            inputs.insert(at, io(VALID_LEN, "int32", vec![1]));
        }
        for t in self.tensors() {
            match states.as_deref_mut() {
                Some(states) => states.push(io(t.input, float, t.shape)),
                None => {
                    inputs.push(io(t.input, float, t.shape.clone()));
                    outputs.push(io(t.output, float, t.shape));
                }
            }
        }
    }
}

/// Name, dtype and shape of one input or output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoSpec {
    pub name: String,
    /// `int32` or `fp16` (or `fp32` for a `--compute-precision fp32` package).
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// Where the package came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Source {
    pub architecture: String,
    /// File name → sha256 hex of the checkpoint files (config.json, safetensors, tokenizer).
    pub files: std::collections::BTreeMap<String, String>,
}

/// The contract JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contract {
    pub version: u32,
    /// The OS the package is built for (absent in packages from before iOS18 support: iOS17).
    #[serde(default)]
    pub target: Target,
    /// The graph's layout (absent: the default layout; the I/O is the same in both).
    #[serde(default, skip_serializing_if = "Layout::is_default")]
    pub layout: Layout,
    /// How the cache is passed (absent: `io`, inputs and outputs).
    #[serde(default, skip_serializing_if = "KvCache::is_io")]
    pub kv_cache: KvCache,
    /// The states a `kv_cache = "state"` package declares (name, dtype, shape).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub states: Vec<IoSpec>,
    /// S: max_sequence_length; cache rows.
    pub max_seq_len: usize,
    /// Q: tokens per step.
    pub query_len: usize,
    /// L
    pub num_layers: usize,
    /// Hkv
    pub num_kv_heads: usize,
    /// D
    pub head_dim: usize,
    /// V
    pub vocab_size: usize,
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Rope settings as applied (theta, scaling), for apps that want to check.
    pub rope: serde_json::Value,
    /// The recipe actually applied (per-tensor decisions or the resolved rules).
    pub recipe: serde_json::Value,
    /// fp16 range safety: the scales folded into the weights (docs/design.md, "fp16 range safety").
    pub scaling: serde_json::Value,
    /// `fp16` or `fp32`: the precision the program computes in.
    pub compute_precision: String,
    pub source: Source,
    pub tool: String,
    pub tool_version: String,
    /// A multifunction package's functions (iOS18 `--prefill-len`), each with its own Q and
    /// I/O; absent: one function, `main`. The fields above describe the default function,
    /// [`DECODE`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub functions: Vec<FunctionSpec>,
    /// A hybrid model's recurrent state beside the caches (absent: every block attends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recurrent: Option<Recurrent>,
    /// Gemma 4's per-layer table, in a file beside the package (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_layer: Option<PerLayerTable>,
}

/// The function of a multifunction package that processes the prompt, Q tokens a call.
pub const PREFILL: &str = "prefill";
/// The function that generates, one token a call: the package's default function.
pub const DECODE: &str = "decode";
/// `--prefill-len`'s default when targeting iOS18 (Apple's Core AI exports prefill in chunks
/// of 64).
pub const DEFAULT_PREFILL_LEN: usize = 64;

/// One function of a multifunction package: its name, Q and I/O (the contract's I/O at that Q).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionSpec {
    pub name: String,
    pub query_len: usize,
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
}

/// `--prefill-len` as resolved for a target and decode length: an explicit value, else
/// [`DEFAULT_PREFILL_LEN`] (at most S) for iOS18 with Q = 1, else 0 (one function).
pub fn resolve_prefill_len(
    explicit: Option<usize>,
    target: Target,
    query_len: usize,
    max_seq_len: usize,
) -> usize {
    match explicit {
        Some(q) => q,
        None if target == Target::Ios18 && query_len == 1 => {
            let q = DEFAULT_PREFILL_LEN.min(max_seq_len);
            if q > 1 {
                q
            } else {
                0
            }
        }
        None => 0,
    }
}

impl Contract {
    /// The contract's inputs and outputs for these dimensions (the KV cache passed as I/O).
    pub fn io(
        s: usize,
        q: usize,
        l: usize,
        hkv: usize,
        d: usize,
        v: usize,
        float: &str,
    ) -> (Vec<IoSpec>, Vec<IoSpec>) {
        let io = |name: &str, dtype: &str, shape: Vec<usize>| IoSpec {
            name: name.into(),
            dtype: dtype.into(),
            shape,
        };
        (
            vec![
                io(INPUT_IDS, "int32", vec![1, q]),
                io(POSITION, "int32", vec![1]),
                io(KEY_CACHE, float, vec![l, hkv, s, d]),
                io(VALUE_CACHE, float, vec![l, hkv, s, d]),
            ],
            logits_parts(v)
                .into_iter()
                .map(|(name, w)| io(&name, float, vec![1, q, w]))
                .chain([
                    io(KEY_UPDATE, float, vec![l, hkv, q, d]),
                    io(VALUE_UPDATE, float, vec![l, hkv, q, d]),
                ])
                .collect(),
        )
    }

    /// The inputs, outputs and states of a `--kv-cache state` package: `input_ids` and
    /// `position` in, the logits parts out, one state [`KV_STATE`] ([`kv_state_shape`]).
    pub fn state_io(
        s: usize,
        q: usize,
        l: usize,
        hkv: usize,
        d: usize,
        v: usize,
        float: &str,
    ) -> (Vec<IoSpec>, Vec<IoSpec>, Vec<IoSpec>) {
        let (inputs, outputs) = Self::io(s, q, l, hkv, d, v, float);
        let keep = |specs: Vec<IoSpec>, drop: [&str; 2]| -> Vec<IoSpec> {
            specs
                .into_iter()
                .filter(|i| !drop.contains(&i.name.as_str()))
                .collect()
        };
        let state = IoSpec {
            name: KV_STATE.into(),
            dtype: float.into(),
            shape: kv_state_shape(s, l, hkv, d),
        };
        (
            keep(inputs, [KEY_CACHE, VALUE_CACHE]),
            keep(outputs, [KEY_UPDATE, VALUE_UPDATE]),
            vec![state],
        )
    }

    /// This contract's inputs, outputs and states as its dimensions and cache mode give them.
    pub fn expected_io(&self, float: &str) -> (Vec<IoSpec>, Vec<IoSpec>, Vec<IoSpec>) {
        let (s, q, l, hkv, d, v) = (
            self.max_seq_len,
            self.query_len,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
        );
        let (mut i, mut o, mut st) = match self.kv_cache {
            KvCache::Io => {
                let (i, o) = Self::io(s, q, l, hkv, d, v, float);
                (i, o, Vec::new())
            }
            KvCache::State => Self::state_io(s, q, l, hkv, d, v, float),
        };
        if let Some(r) = &self.recurrent {
            let states = (self.kv_cache == KvCache::State).then_some(&mut st);
            r.add_io(q, float, (&mut i, &mut o), states);
        }
        if let Some(t) = &self.per_layer {
            t.add_input(q, float, &mut i);
        }
        (i, o, st)
    }

    /// Decoder blocks in all: the attention blocks, and a hybrid model's others (where
    /// blocks and cache slots are one to one, or the recurrent state lists them).
    pub fn blocks(&self) -> usize {
        self.recurrent
            .as_ref()
            .map_or(self.num_layers, |r| r.blocks)
    }

    /// The values of the recurrent state a host keeps between steps (0 without one).
    pub fn recurrent_len(&self) -> usize {
        self.recurrent.as_ref().map_or(0, Recurrent::len)
    }

    /// The names of the package's functions: `main` alone, or each of [`Contract::functions`].
    pub fn function_names(&self) -> Vec<&str> {
        if self.functions.is_empty() {
            vec!["main"]
        } else {
            self.functions.iter().map(|f| f.name.as_str()).collect()
        }
    }

    /// The contract as function `name` follows it: Q and I/O are that function's (the contract
    /// itself for `main` of a single-function package). `None`: no such function.
    pub fn for_function(&self, name: &str) -> Option<Contract> {
        if self.functions.is_empty() {
            return (name == "main").then(|| self.clone());
        }
        let f = self.functions.iter().find(|f| f.name == name)?;
        Some(Contract {
            query_len: f.query_len,
            inputs: f.inputs.clone(),
            outputs: f.outputs.clone(),
            functions: Vec::new(),
            ..self.clone()
        })
    }

    /// How many positions' logits a step returns: the rows of the declared logits outputs
    /// (Q, or 1 for a `prefill` function that returns the last row only).
    pub fn logits_rows(&self) -> usize {
        let logits = self.logits_outputs();
        self.outputs
            .iter()
            .find(|o| logits.first().is_some_and(|(name, _)| *name == o.name))
            .and_then(|o| o.shape.get(1).copied())
            .unwrap_or(self.query_len)
    }

    /// The logits outputs in vocabulary order, with their widths; the host concatenates them
    /// along the last axis.
    pub fn logits_outputs(&self) -> Vec<(String, usize)> {
        if self.version < 2 {
            vec![(LOGITS.to_string(), self.vocab_size)]
        } else {
            logits_parts(self.vocab_size)
        }
    }
}

fn logits_parts(v: usize) -> Vec<(String, usize)> {
    let widths = logits_widths(v);
    let n = widths.len();
    widths
        .into_iter()
        .enumerate()
        .map(|(i, w)| (logits_name(i, n), w))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_len_defaults_to_64_for_ios18_one_token_steps_only() {
        let r = resolve_prefill_len;
        assert_eq!(r(None, Target::Ios18, 1, 512), 64);
        assert_eq!(r(None, Target::Ios18, 1, 32), 32);
        assert_eq!(r(None, Target::Ios18, 1, 1), 0);
        assert_eq!(r(None, Target::Ios18, 4, 512), 0);
        assert_eq!(r(None, Target::Ios17, 1, 512), 0);
        assert_eq!(r(Some(0), Target::Ios18, 1, 512), 0);
        assert_eq!(r(Some(16), Target::Ios17, 1, 512), 16);
    }

    #[test]
    fn logits_parts_cover_the_vocabulary_within_the_limit() {
        assert_eq!(logits_widths(49_152), vec![16_384; 3]);
        assert_eq!(logits_widths(16_384), vec![16_384]);
        assert_eq!(logits_widths(300), vec![300]);
        for v in [1, 16_385, 32_000, 128_256, 151_936] {
            let w = logits_widths(v);
            assert_eq!(w.iter().sum::<usize>(), v, "{v}");
            assert!(
                w.iter().all(|&x| x > 0 && x <= MAX_LOGITS_WIDTH),
                "{v}: {w:?}"
            );
        }
        assert_eq!(logits_widths(151_936).len(), 10);
        assert_eq!(logits_name(0, 1), "logits");
        assert_eq!(logits_name(2, 3), "logits_2");
    }

    #[test]
    fn a_recurrent_state_lists_every_block_once_and_slots_follow_the_kinds() {
        let r = Recurrent {
            blocks: 5,
            attention_layers: vec![1, 4],
            conv: Some(ConvState {
                layers: vec![0, 2, 3],
                width: 2,
                channels: 8,
            }),
            delta: None,
        };
        assert_eq!(r.check(2), Ok(()));
        assert_eq!(r.conv_shape(), Some(vec![3, 2, 8]));
        assert_eq!(r.len(), 48);
        // Blocks 2..4 convolve: no cache slot, conv slots 1..3.
        assert_eq!(r.slots(&(2..4)), (1..1, 1..3));
        assert_eq!(r.slots(&(0..5)), (0..2, 0..3));
        assert_eq!(r.slots(&(4..5)), (1..2, 3..3));
        assert!(r.check(3).unwrap_err().contains("the caches hold 3"));
        let twice = Recurrent {
            attention_layers: vec![1, 2],
            ..r.clone()
        };
        assert!(twice.check(2).unwrap_err().contains("block 2"));
        let unsorted = Recurrent {
            attention_layers: vec![4, 1],
            ..r.clone()
        };
        assert!(unsorted.check(2).is_err());
        let missing = Recurrent {
            blocks: 6,
            ..r.clone()
        };
        assert!(missing.check(2).is_err());
        // Q > 1 adds `valid_len` after `position`; the state follows the caches.
        let (mut i, mut o) = Contract::io(16, 4, 2, 1, 8, 32, "fp16");
        r.add_io(4, "fp16", (&mut i, &mut o), None);
        let names = |v: &[IoSpec]| v.iter().map(|x| x.name.clone()).collect::<Vec<_>>();
        assert_eq!(
            names(&i),
            [
                "input_ids",
                "position",
                "valid_len",
                "key_cache",
                "value_cache",
                "conv_state"
            ]
        );
        assert_eq!(
            names(&o),
            ["logits", "key_update", "value_update", "conv_state_update"]
        );
    }

    #[test]
    fn state_io_drops_the_cache_features_and_pads_the_rows() {
        let (i, o, st) = Contract::state_io(100, 1, 3, 2, 64, 300, "fp16");
        let names = |v: &[IoSpec]| v.iter().map(|x| x.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&i), ["input_ids", "position"]);
        assert_eq!(names(&o), ["logits"]);
        assert_eq!(st[0].name, KV_STATE);
        assert_eq!(st[0].shape, vec![6, 2, 128, 64]);
        assert_eq!(kv_state_shape(64, 1, 1, 8)[2], 64);
        assert_eq!(KvCache::parse("state"), Some(KvCache::State));
        assert_eq!(KvCache::parse("States"), None);
    }
}
