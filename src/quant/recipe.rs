//! Recipes: which tensors to palettize, and how.
//!
//! A recipe is a TOML file (`configs/recipes/*.toml`; `default.toml` is embedded):
//!
//! ```toml
//! default = "fp16"                      # anything no rule below matches
//!
//! [roles]                               # by arch::Role name
//! q = { palettize = { nbits = 4 } }     # granularity defaults to "per_tensor"
//! embedding = "fp16"
//!
//! [[tensors]]                           # by tensor-name glob; the first match wins
//! glob = "model.layers.0.*"
//! decision = "fp16"
//! ```
//!
//! Resolution: tensor-name rule > role rule > default. Command-line flags override the file:
//! `--keep-fp16 GLOB` rules come before every file rule, `--nbits N` replaces the bit width of
//! every palettize decision. Unknown keys, roles and values are errors naming the file.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use globset::{Glob, GlobMatcher};
use serde::Serialize;

use super::kmeans::check_nbits;
use super::{Granularity, QuantError, SUPPORTED_NBITS};
use crate::arch::{Role, TensorSlot};
use crate::mil::contract::{KvCache, Layout, Target};

/// What is wrong with a recipe: the message after `{origin}: ` in [`QuantError::Recipe`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("{0}")]
    Read(String),
    /// The text is not TOML.
    #[error("{0}")]
    Syntax(String),
    /// A palettize decision asks for a bit width iOS17 has no LUT for.
    #[error("{at}.nbits = {nbits}: supported are {list}", list = SUPPORTED_NBITS.map(|n| n.to_string()).join(", "))]
    UnsupportedNbits { at: String, nbits: i64 },
    /// A tensor-name pattern that is not a glob.
    #[error("{}invalid glob `{glob}`: {message}", .at.as_ref().map_or(String::new(), |a| format!("{a}: ")))]
    Glob {
        at: Option<String>,
        glob: String,
        message: String,
    },
    /// Any other key or value the format does not allow.
    #[error("{0}")]
    Invalid(String),
    /// Neither a file nor the name of a shipped recipe.
    #[error(
        "no such file, and not a shipped recipe{}; shipped: {} (`hf2coreml recipes` describes them)",
        .nearest.as_ref().map_or(String::new(), |n| format!(" (did you mean `{n}`?)")),
        BUILTIN_RECIPES.map(|(n, _)| n).join(", ")
    )]
    UnknownName { nearest: Option<String> },
}

impl From<String> for RecipeError {
    fn from(message: String) -> Self {
        RecipeError::Invalid(message)
    }
}

impl From<&str> for RecipeError {
    fn from(message: &str) -> Self {
        RecipeError::Invalid(message.to_string())
    }
}

/// How one tensor is stored in the package, for sizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    Fp16,
    /// A palettized tensor: `nbits` indices plus `luts` fp16 tables of 2^nbits entries.
    Lut {
        nbits: u8,
        luts: usize,
    },
}

impl Storage {
    /// Bytes this tensor takes in weight.bin.
    pub fn bytes(self, numel: usize) -> u64 {
        match self {
            Storage::Fp16 => numel as u64 * 2,
            Storage::Lut { nbits, luts } => {
                (numel as u64 * nbits as u64).div_ceil(8) + luts as u64 * (1u64 << nbits) * 2
            }
        }
    }
}

/// The embedded default recipe.
pub const DEFAULT_RECIPE: &str = include_str!("../../configs/recipes/default.toml");
const DEFAULT_ORIGIN: &str = "configs/recipes/default.toml (built in)";

/// Recipes shipped in configs/recipes/, usable by name (`--recipe NAME`).
pub const BUILTIN_RECIPES: [(&str, &str); 7] = [
    ("default", DEFAULT_RECIPE),
    (
        "calibrated-4bit",
        include_str!("../../configs/recipes/calibrated-4bit.toml"),
    ),
    (
        "data-free-4bit",
        include_str!("../../configs/recipes/data-free-4bit.toml"),
    ),
    (
        "quality",
        include_str!("../../configs/recipes/quality.toml"),
    ),
    (
        "compact",
        include_str!("../../configs/recipes/compact.toml"),
    ),
    (
        "large-model",
        include_str!("../../configs/recipes/large-model.toml"),
    ),
    (
        "ios18-4bit",
        include_str!("../../configs/recipes/ios18-4bit.toml"),
    ),
];

/// What happens to one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decision {
    Fp16,
    Palettize { nbits: u8, granularity: Granularity },
}

impl Decision {
    /// How the tensor is stored, for sizing (budget, inspect, dry runs).
    pub fn storage(&self, shape: &[usize]) -> Storage {
        match *self {
            Decision::Fp16 => Storage::Fp16,
            Decision::Palettize { nbits, granularity } => Storage::Lut {
                nbits,
                luts: granularity.num_luts(shape),
            },
        }
    }

    pub fn nbits(&self) -> Option<u8> {
        match self {
            Decision::Fp16 => None,
            Decision::Palettize { nbits, .. } => Some(*nbits),
        }
    }

    /// The TOML inline form, as a recipe file would write it.
    fn to_toml(self) -> String {
        match self {
            Decision::Fp16 => "\"fp16\"".into(),
            Decision::Palettize { nbits, granularity } => match granularity {
                Granularity::PerTensor => format!("{{ palettize = {{ nbits = {nbits} }} }}"),
                Granularity::PerGroupedChannel { group_size, axis } => format!(
                    "{{ palettize = {{ nbits = {nbits}, granularity = \"per_grouped_channel\", \
                     group_size = {group_size}, axis = {axis} }} }}"
                ),
            },
        }
    }
}

impl fmt::Display for Decision {
    /// `fp16`, `lut4`, `lut4/g16@0` (grouped: group size and axis).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Fp16 => f.write_str("fp16"),
            Decision::Palettize { nbits, granularity } => match granularity {
                Granularity::PerTensor => write!(f, "lut{nbits}"),
                Granularity::PerGroupedChannel { group_size, axis } => {
                    write!(f, "lut{nbits}/g{group_size}@{axis}")
                }
            },
        }
    }
}

#[derive(Debug, Clone)]
struct NameRule {
    glob: String,
    matcher: GlobMatcher,
    decision: Decision,
}

/// A parsed recipe plus command-line overrides.
#[derive(Debug, Clone)]
pub struct Recipe {
    origin: String,
    default: Decision,
    roles: BTreeMap<Role, Decision>,
    names: Vec<NameRule>,
    nbits_override: Option<u8>,
    calibration: Option<Calibration>,
    /// `target = "ios17" | "ios18"` (`--target` overrides it).
    target: Target,
    /// `layout = "default" | "ane"` (`--layout` overrides it).
    layout: Layout,
    /// `kv_cache = "io" | "state"` (`--kv-cache` overrides it).
    kv_cache: KvCache,
    /// `prefill_len = Q` (`--prefill-len` overrides it): a `prefill` function of Q tokens
    /// beside `decode` (iOS18); `None`: the target's default, 0: one function.
    prefill_len: Option<usize>,
}

/// The largest `prefill_len` a recipe may ask for (the package's S bounds it too).
pub const MAX_PREFILL_LEN: usize = 65_536;

/// The `[calibration]` table: palettized projections are fitted to what they compute on
/// calibration text (issue 7; see [`super::calibrate`]). Absent = data-free palettization.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Calibration {
    /// Per-output-row fp16 scale, one `mul` after the linear.
    pub row_scale: bool,
    /// k-means points weighted by E[x²] of their input channel.
    pub weighted: bool,
    /// GPTQ error feedback when choosing indices.
    pub gptq: bool,
    /// GPTQ columns in order of decreasing E[x²].
    pub act_order: bool,
    /// AWQ-style input-channel scales folded into the preceding norm/projection.
    pub awq: bool,
    /// Contiguous row groups per projection, each with its own LUT.
    pub row_groups: usize,
    /// iOS18: rows per LUT group (0 = use `row_groups`); groups of equal size in row order
    /// are stored as one grouped LUT.
    pub group_size: usize,
    /// Rotate each projection's input channels (see `LinearMethod::rotate`): the graph
    /// rotates each projection input once (signs, Hadamard blocks, a mix across blocks).
    pub rotate: bool,
    /// GPTQ Hessian damping relative to its mean diagonal.
    pub damp: f64,
    /// Mixed precision: 4/6/8 bits per row of each projection so they average at most this.
    pub target_bpw: Option<f64>,
    /// Mixed precision hands out bits by chunks of this many rows of a projection (its rows
    /// ranked by the error 6 bits would remove); 0: whole projections.
    pub allocation_rows: usize,
    /// Calibrate on at most this many tokens of the text (the first ones): calibration time
    /// grows linearly with them. `None`: all of it.
    pub tokens: Option<usize>,
}

/// Rows per unit of the mixed-precision allocation: whole projections. Chunks of rows lower
/// KL a little on SmolLM2 at 4.5 bits per weight but not top-1, and cost each mixed
/// projection a linear per width and a gather on device (README, "Mixed precision by rows").
pub const DEFAULT_ALLOCATION_ROWS: usize = 0;

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            row_scale: true,
            weighted: true,
            gptq: true,
            act_order: true,
            // Measured on SmolLM2: no gain once GPTQ and row scales are on (README table).
            awq: false,
            row_groups: 1,
            group_size: 0,
            rotate: false,
            damp: 0.01,
            target_bpw: None,
            allocation_rows: DEFAULT_ALLOCATION_ROWS,
            tokens: None,
        }
    }
}

impl Calibration {
    /// The per-layer method for a projection palettized at `nbits`.
    pub fn method(&self, nbits: u8) -> super::calibrate::LinearMethod {
        super::calibrate::LinearMethod {
            nbits,
            row_scale: self.row_scale,
            weighted: self.weighted,
            gptq: self.gptq,
            act_order: self.act_order,
            damp: self.damp,
            row_groups: self.row_groups,
            group_size: self.group_size,
            rotate: self.rotate,
        }
    }

    fn parse(value: &toml::Value) -> Result<Self, RecipeError> {
        let t = value
            .as_table()
            .ok_or("`calibration` must be a table ([calibration])")?;
        let mut c = Calibration::default();
        for (k, v) in t {
            let flag = |v: &toml::Value| {
                v.as_bool()
                    .ok_or_else(|| format!("calibration.{k} must be true or false"))
            };
            match k.as_str() {
                "row_scale" => c.row_scale = flag(v)?,
                "weighted" => c.weighted = flag(v)?,
                "gptq" => c.gptq = flag(v)?,
                "act_order" => c.act_order = flag(v)?,
                "awq" => c.awq = flag(v)?,
                "rotate" => c.rotate = flag(v)?,
                "row_groups" => {
                    c.row_groups = v
                        .as_integer()
                        .filter(|&g| (1..=256).contains(&g))
                        .ok_or("calibration.row_groups must be an integer in 1..=256")?
                        as usize
                }
                "group_size" => {
                    c.group_size = v
                        .as_integer()
                        .filter(|&g| (1..=4096).contains(&g))
                        .ok_or("calibration.group_size must be an integer in 1..=4096")?
                        as usize
                }
                "target_bpw" => {
                    c.target_bpw = Some(
                        v.as_float()
                            .or_else(|| v.as_integer().map(|i| i as f64))
                            .filter(|b| b.is_finite() && (4.0..=8.5).contains(b))
                            .ok_or("calibration.target_bpw must be a number in 4..=8.5")?,
                    )
                }
                "allocation_rows" => {
                    c.allocation_rows = v
                        .as_integer()
                        .filter(|&r| (0..=65_536).contains(&r))
                        .ok_or("calibration.allocation_rows must be an integer in 0..=65536")?
                        as usize
                }
                "tokens" => {
                    c.tokens = Some(
                        v.as_integer()
                            .filter(|&t| t >= 256)
                            .ok_or("calibration.tokens must be an integer of at least 256")?
                            as usize,
                    )
                }
                "damp" => {
                    c.damp = v
                        .as_float()
                        .filter(|d| d.is_finite() && *d > 0.0 && *d <= 1.0)
                        .ok_or("calibration.damp must be a float in (0, 1]")?
                }
                other => {
                    return Err(RecipeError::Invalid(format!(
                        "calibration: unknown key `{other}` (expected row_scale, weighted, \
                         gptq, act_order, awq, rotate, row_groups, group_size, damp, target_bpw, \
                         allocation_rows, tokens)"
                    )))
                }
            }
        }
        Ok(c)
    }

    fn to_toml(self) -> String {
        let target = self
            .target_bpw
            .map_or(String::new(), |b| format!("target_bpw = {b}\n"))
            + &self
                .tokens
                .map_or(String::new(), |t| format!("tokens = {t}\n"))
            + if self.rotate { "rotate = true\n" } else { "" }
            + &if self.group_size > 0 {
                format!("group_size = {}\n", self.group_size)
            } else {
                String::new()
            }
            + &if self.allocation_rows != DEFAULT_ALLOCATION_ROWS {
                format!("allocation_rows = {}\n", self.allocation_rows)
            } else {
                String::new()
            };
        format!(
            "\n[calibration]\nrow_scale = {}\nweighted = {}\ngptq = {}\nact_order = {}\n\
             awq = {}\nrow_groups = {}\ndamp = {}\n",
            self.row_scale,
            self.weighted,
            self.gptq,
            self.act_order,
            self.awq,
            self.row_groups,
            self.damp
        ) + &target
    }
}

impl Default for Recipe {
    /// The embedded default: decoder projections 4-bit per tensor, everything else fp16.
    fn default() -> Self {
        match Recipe::parse(DEFAULT_RECIPE, DEFAULT_ORIGIN) {
            Ok(r) => r,
            // A unit test parses the embedded file; reaching this is a build defect.
            Err(e) => panic!("embedded default recipe is invalid: {e}"),
        }
    }
}

impl Recipe {
    /// A recipe shipped with the tool, by name (see [`BUILTIN_RECIPES`]).
    pub fn builtin(name: &str) -> Option<Result<Self, QuantError>> {
        BUILTIN_RECIPES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(n, text)| Self::parse(text, &format!("configs/recipes/{n}.toml (built in)")))
    }

    /// A recipe file, or a built-in recipe's name when no such file exists.
    pub fn from_file_or_name(arg: &Path) -> Result<Self, QuantError> {
        if !arg.exists() {
            if let Some(r) = arg.to_str().and_then(Self::builtin) {
                return r;
            }
            let name = arg.file_stem().and_then(|n| n.to_str()).unwrap_or_default();
            let nearest = crate::util::nearest_name(name, BUILTIN_RECIPES.map(|(n, _)| n));
            return Err(QuantError::Recipe {
                path: arg.to_path_buf(),
                error: RecipeError::UnknownName {
                    nearest: nearest.map(str::to_string),
                },
            });
        }
        Self::from_file(arg)
    }

    /// What a recipe's text says about itself: its leading comment's first paragraph, joined
    /// into one line, without its `Measured:` line.
    pub fn about(text: &str) -> String {
        Self::header(text)
            .filter(|l| !l.starts_with("Measured:"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The `Measured:` line of a recipe's leading comment (quality on a real model), if any.
    pub fn measured(text: &str) -> Option<String> {
        Self::header(text)
            .find_map(|l| l.strip_prefix("Measured:"))
            .map(|m| m.trim().to_string())
    }

    /// The first paragraph of the leading comment, line by line, trimmed.
    fn header(text: &str) -> impl Iterator<Item = &str> {
        text.lines()
            .map_while(|l| l.strip_prefix('#'))
            .map(str::trim)
            .take_while(|l| !l.is_empty())
    }

    /// Read a recipe file (a regular file of at most 1 MiB).
    pub fn from_file(path: &Path) -> Result<Self, QuantError> {
        let text =
            crate::fsutil::read_input_text(path, 1 << 20).map_err(|e| QuantError::Recipe {
                path: path.to_path_buf(),
                error: RecipeError::Read(e.to_string()),
            })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parse recipe text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, QuantError> {
        let err = |error: RecipeError| QuantError::Recipe {
            path: PathBuf::from(origin),
            error,
        };
        let table: toml::Table =
            toml::from_str(text).map_err(|e| err(RecipeError::Syntax(e.to_string())))?;
        let mut recipe = Recipe {
            origin: origin.to_string(),
            default: Decision::Fp16,
            roles: BTreeMap::new(),
            names: Vec::new(),
            nbits_override: None,
            calibration: None,
            target: Target::Ios17,
            layout: Layout::Default,
            kv_cache: KvCache::Io,
            prefill_len: None,
        };
        for (key, value) in &table {
            match key.as_str() {
                "default" => recipe.default = parse_decision(value, "default").map_err(err)?,
                "roles" => {
                    let roles = value
                        .as_table()
                        .ok_or_else(|| err("`roles` must be a table".into()))?;
                    for (name, v) in roles {
                        let role = Role::parse(name).ok_or_else(|| {
                            err(RecipeError::Invalid(format!(
                                "roles.{name}: unknown role (known: {})",
                                Role::ALL.map(|r| r.as_str()).join(", ")
                            )))
                        })?;
                        let d = parse_decision(v, &format!("roles.{name}")).map_err(err)?;
                        recipe.roles.insert(role, d);
                    }
                }
                "tensors" => {
                    let rules = value.as_array().ok_or_else(|| {
                        err("`tensors` must be an array of tables ([[tensors]])".into())
                    })?;
                    for (i, rule) in rules.iter().enumerate() {
                        let at = format!("tensors[{i}]");
                        let t = rule.as_table().ok_or_else(|| {
                            err(RecipeError::Invalid(format!("{at} must be a table")))
                        })?;
                        let mut glob = None;
                        let mut decision = None;
                        for (k, v) in t {
                            match k.as_str() {
                                "glob" => {
                                    glob =
                                        Some(v.as_str().map(str::to_string).ok_or_else(|| {
                                            err(RecipeError::Invalid(format!(
                                                "{at}.glob must be a string"
                                            )))
                                        })?)
                                }
                                "decision" => {
                                    decision = Some(
                                        parse_decision(v, &format!("{at}.decision"))
                                            .map_err(err)?,
                                    )
                                }
                                other => {
                                    return Err(err(RecipeError::Invalid(format!(
                                        "{at}: unknown key `{other}` (expected glob, decision)"
                                    ))))
                                }
                            }
                        }
                        let glob = glob.ok_or_else(|| {
                            err(RecipeError::Invalid(format!("{at}: missing `glob`")))
                        })?;
                        let decision = decision.ok_or_else(|| {
                            err(RecipeError::Invalid(format!("{at}: missing `decision`")))
                        })?;
                        recipe
                            .names
                            .push(NameRule::new(&glob, decision, Some(&at)).map_err(err)?);
                    }
                }
                "calibration" => recipe.calibration = Some(Calibration::parse(value).map_err(err)?),
                "target" => {
                    recipe.target = value.as_str().and_then(Target::parse).ok_or_else(|| {
                        err(RecipeError::Invalid(
                            "target must be \"ios17\" or \"ios18\"".into(),
                        ))
                    })?
                }
                "layout" => {
                    recipe.layout = value.as_str().and_then(Layout::parse).ok_or_else(|| {
                        err(RecipeError::Invalid(
                            "layout must be \"default\" or \"ane\"".into(),
                        ))
                    })?
                }
                "kv_cache" => {
                    recipe.kv_cache = value.as_str().and_then(KvCache::parse).ok_or_else(|| {
                        err(RecipeError::Invalid(
                            "kv_cache must be \"io\" or \"state\"".into(),
                        ))
                    })?
                }
                "prefill_len" => {
                    let q = value
                        .as_integer()
                        .and_then(|q| usize::try_from(q).ok())
                        .filter(|&q| q <= MAX_PREFILL_LEN)
                        .ok_or_else(|| {
                            err(RecipeError::Invalid(format!(
                                "prefill_len must be an integer in 0..={MAX_PREFILL_LEN}"
                            )))
                        })?;
                    recipe.prefill_len = Some(q);
                }
                other => {
                    return Err(err(RecipeError::Invalid(format!(
                        "unknown key `{other}` (expected target, layout, kv_cache, prefill_len, default, \
                         roles, tensors, calibration)"
                    ))))
                }
            }
        }
        Ok(recipe)
    }

    /// `--nbits N`: every palettize decision uses `nbits`.
    pub fn with_nbits(mut self, nbits: u8) -> Result<Self, QuantError> {
        check_nbits(nbits)?;
        self.nbits_override = Some(nbits);
        Ok(self)
    }

    /// `--keep-fp16 GLOB`: tensors matching `glob` stay fp16, whatever the file says.
    pub fn keep_fp16(mut self, glob: &str) -> Result<Self, QuantError> {
        let rule =
            NameRule::new(glob, Decision::Fp16, None).map_err(|error| QuantError::Recipe {
                path: PathBuf::from("--keep-fp16"),
                error,
            })?;
        // Command-line rules sit before the file's rules; their relative order is irrelevant
        // because they all say fp16.
        self.names.insert(0, rule);
        Ok(self)
    }

    /// Apply the common flags in one go.
    pub fn with_overrides(
        mut self,
        nbits: Option<u8>,
        keep_fp16: &[String],
    ) -> Result<Self, QuantError> {
        if let Some(n) = nbits {
            self = self.with_nbits(n)?;
        }
        for g in keep_fp16 {
            self = self.keep_fp16(g)?;
        }
        Ok(self)
    }

    /// The `[calibration]` table, if the recipe calibrates.
    pub fn calibration(&self) -> Option<&Calibration> {
        self.calibration.as_ref()
    }

    /// Whether this recipe fits any of `slots` on calibration data: it has `[calibration]` and
    /// palettizes at least one projection per tensor.
    pub fn calibrates(&self, slots: &[TensorSlot]) -> bool {
        self.calibration.is_some()
            && slots.iter().any(|s| {
                s.role.is_projection()
                    && matches!(
                        self.decide(s),
                        Decision::Palettize {
                            granularity: Granularity::PerTensor,
                            ..
                        }
                    )
            })
    }

    /// Calibrate (or not) regardless of the file.
    pub fn with_calibration(mut self, calibration: Option<Calibration>) -> Self {
        self.calibration = calibration;
        self
    }

    /// The OS the recipe builds for.
    pub fn target(&self) -> Target {
        self.target
    }

    /// The recipe building for `target` instead (`--target`).
    pub fn with_target(mut self, target: Target) -> Self {
        self.target = target;
        self
    }

    /// The graph layout the recipe builds.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The recipe building `layout` instead (`--layout`).
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// How the packages this recipe builds pass their cache.
    pub fn kv_cache(&self) -> KvCache {
        self.kv_cache
    }

    /// The recipe passing the cache as `kv_cache` instead (`--kv-cache`).
    pub fn with_kv_cache(mut self, kv_cache: KvCache) -> Self {
        self.kv_cache = kv_cache;
        self
    }

    /// The `prefill_len` asked for (`None`: the target's default, see
    /// [`crate::mil::contract::resolve_prefill_len`]).
    pub fn prefill_len(&self) -> Option<usize> {
        self.prefill_len
    }

    /// The recipe asking for a `prefill` function of `q` tokens (`--prefill-len`).
    pub fn with_prefill_len(mut self, q: usize) -> Self {
        self.prefill_len = Some(q);
        self
    }

    /// What this recipe asks for that its target cannot store, if anything: iOS17 has one LUT
    /// per tensor (no channel groups) of 1, 2, 4, 6 or 8 bits.
    pub fn target_conflict(&self, slots: &[TensorSlot]) -> Option<String> {
        if self.target != Target::Ios17 {
            return None;
        }
        if self.calibration.is_some_and(|c| c.group_size > 0) {
            return Some("calibration.group_size (grouped LUTs) needs target ios18".into());
        }
        slots.iter().find_map(|s| match self.decide(s) {
            Decision::Palettize { nbits, .. } if !super::IOS17_NBITS.contains(&nbits) => Some(
                format!("tensor `{}`: {nbits}-bit LUTs need target ios18", s.name),
            ),
            Decision::Palettize { granularity, .. } if granularity != Granularity::PerTensor => {
                Some(format!(
                    "tensor `{}`: {granularity} LUTs need target ios18; iOS17 packages take \
                     one LUT per tensor",
                    s.name
                ))
            }
            _ => None,
        })
    }

    /// Where the recipe came from (a path, or the built-in default).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The decision for one tensor: name rule > role rule > default, then `--nbits`.
    pub fn decide(&self, slot: &TensorSlot) -> Decision {
        let d = self
            .names
            .iter()
            .find(|r| r.matcher.is_match(&slot.name))
            .map(|r| r.decision)
            .or_else(|| self.roles.get(&slot.role).copied())
            .unwrap_or(self.default);
        match (d, self.nbits_override) {
            (Decision::Palettize { granularity, .. }, Some(nbits)) => {
                Decision::Palettize { nbits, granularity }
            }
            _ => d,
        }
    }

    /// One line on how the tensors that decide size are stored, e.g. "projections 6-bit LUT,
    /// embedding fp16, lm_head fp16, calibrated" (block 1 stands for the projections: recipes
    /// may treat the first block differently).
    pub fn summary(&self) -> String {
        use crate::arch::{LayerTensor, TensorId};
        let show = |id: TensorId| {
            let slot = TensorSlot {
                name: id.hf_name(),
                shape: vec![64, 64],
                role: id.role(),
                layer: id.layer(),
            };
            match self.decide(&slot) {
                Decision::Fp16 => "fp16".to_string(),
                Decision::Palettize { nbits, .. } => format!("{nbits}-bit LUT"),
            }
        };
        let how = match self.calibration() {
            Some(c) if c.target_bpw.is_some() => "calibrated, mixed 4/6/8 bits",
            Some(_) => "calibrated",
            None => "data-free",
        };
        format!(
            "projections {}, embedding {}, lm_head {}, {how}",
            show(TensorId::Layer(1, LayerTensor::Q)),
            show(TensorId::Embedding),
            show(TensorId::LmHead),
        )
    }

    /// Bytes of weight.bin under this recipe: every tensor's storage, plus what calibration
    /// adds beside the tensors (row scales, the LUTs of row groups, the input rotations'
    /// constants). Mixed precision's split projections are not known before calibration runs.
    pub fn weights_bytes(&self, slots: &[TensorSlot]) -> u64 {
        let tensors: u64 = slots.iter().map(|s| self.storage(s).bytes(s.numel())).sum();
        tensors + self.calibration_bytes(slots)
    }

    /// What calibration stores beside the palettized projections, in bytes (fp16 values).
    fn calibration_bytes(&self, slots: &[TensorSlot]) -> u64 {
        let Some(c) = &self.calibration else {
            return 0;
        };
        let mut values = 0u64;
        let mut widths = std::collections::BTreeSet::new();
        for slot in slots.iter().filter(|s| s.role.is_projection()) {
            let Decision::Palettize { nbits, .. } = self.decide(slot) else {
                continue;
            };
            let (rows, cols) = (slot.shape[0] as u64, slot.shape[1] as u64);
            if c.row_scale {
                values += rows;
            }
            values += (c.row_groups.max(1) as u64 - 1) * (1u64 << nbits);
            widths.insert(cols as usize);
        }
        if c.rotate {
            values += widths
                .into_iter()
                .map(super::rotation::Rotation::constant_values)
                .sum::<u64>();
        }
        values * 2
    }

    /// Storage of one tensor under this recipe (plug into `budget::weights_bytes`).
    pub fn storage(&self, slot: &TensorSlot) -> Storage {
        self.decide(slot).storage(&slot.shape)
    }

    /// The recipe with overrides folded in, as a TOML file that parses back to the same
    /// decisions (recorded in packages and reports).
    pub fn to_toml(&self) -> String {
        let fold = |d: Decision| match (d, self.nbits_override) {
            (Decision::Palettize { granularity, .. }, Some(nbits)) => {
                Decision::Palettize { nbits, granularity }
            }
            _ => d,
        };
        let mut out = match self.target {
            Target::Ios17 => String::new(),
            t => format!("target = \"{}\"\n", t.as_str()),
        };
        // Written only when not the default, so recipes from before layouts keep their text.
        if self.layout != Layout::Default {
            out.push_str(&format!("layout = \"{}\"\n", self.layout.as_str()));
        }
        if self.kv_cache != KvCache::Io {
            out.push_str(&format!("kv_cache = \"{}\"\n", self.kv_cache.as_str()));
        }
        if let Some(q) = self.prefill_len {
            out.push_str(&format!("prefill_len = {q}\n"));
        }
        out.push_str(&format!(
            "default = {}\n\n[roles]\n",
            fold(self.default).to_toml()
        ));
        for (role, d) in &self.roles {
            out.push_str(&format!("{} = {}\n", role.as_str(), fold(*d).to_toml()));
        }
        for r in &self.names {
            out.push_str(&format!(
                "\n[[tensors]]\nglob = {}\ndecision = {}\n",
                toml::Value::String(r.glob.clone()),
                fold(r.decision).to_toml()
            ));
        }
        if let Some(c) = self.calibration {
            out.push_str(&c.to_toml());
        }
        out
    }
}

impl NameRule {
    /// `at` places the rule in the file, if it comes from one.
    fn new(glob: &str, decision: Decision, at: Option<&str>) -> Result<Self, RecipeError> {
        let matcher = Glob::new(glob)
            .map_err(|e| RecipeError::Glob {
                at: at.map(str::to_string),
                glob: glob.to_string(),
                message: e.to_string(),
            })?
            .compile_matcher();
        Ok(NameRule {
            glob: glob.to_string(),
            matcher,
            decision,
        })
    }
}

fn parse_decision(v: &toml::Value, at: &str) -> Result<Decision, RecipeError> {
    let expected = "expected \"fp16\" or { palettize = { nbits = N } }";
    match v {
        toml::Value::String(s) if s == "fp16" => Ok(Decision::Fp16),
        toml::Value::String(s) => Err(RecipeError::Invalid(format!(
            "{at}: unknown decision `{s}` ({expected})"
        ))),
        toml::Value::Table(t) => {
            let mut it = t.iter();
            let (Some((k, p)), None) = (it.next(), it.next()) else {
                return Err(RecipeError::Invalid(format!("{at}: {expected}")));
            };
            if k != "palettize" {
                return Err(RecipeError::Invalid(format!(
                    "{at}: unknown key `{k}` ({expected})"
                )));
            }
            let p = p
                .as_table()
                .ok_or_else(|| format!("{at}.palettize must be a table"))?;
            parse_palettize(p, &format!("{at}.palettize"))
        }
        _ => Err(RecipeError::Invalid(format!("{at}: {expected}"))),
    }
}

fn parse_palettize(t: &toml::Table, at: &str) -> Result<Decision, RecipeError> {
    let int = |k: &str, v: &toml::Value| -> Result<i64, String> {
        v.as_integer()
            .ok_or_else(|| format!("{at}.{k} must be an integer"))
    };
    let mut nbits = None;
    let mut gran = "per_tensor".to_string();
    let mut group_size = None;
    let mut axis = None;
    for (k, v) in t {
        match k.as_str() {
            "nbits" => nbits = Some(int(k, v)?),
            "granularity" => {
                gran = v
                    .as_str()
                    .ok_or_else(|| format!("{at}.granularity must be a string"))?
                    .to_string()
            }
            "group_size" => group_size = Some(int(k, v)?),
            "axis" => axis = Some(int(k, v)?),
            other => {
                return Err(RecipeError::Invalid(format!(
                    "{at}: unknown key `{other}` (expected nbits, granularity, group_size, axis)"
                )))
            }
        }
    }
    let nbits = nbits.ok_or_else(|| format!("{at}: missing `nbits`"))?;
    let nbits = u8::try_from(nbits)
        .ok()
        .filter(|n| check_nbits(*n).is_ok())
        .ok_or_else(|| RecipeError::UnsupportedNbits {
            at: at.to_string(),
            nbits,
        })?;
    let granularity = match gran.as_str() {
        "per_tensor" => {
            if group_size.is_some() || axis.is_some() {
                return Err(RecipeError::Invalid(format!(
                    "{at}: group_size and axis only apply to granularity = \"per_grouped_channel\""
                )));
            }
            Granularity::PerTensor
        }
        "per_grouped_channel" => {
            let group_size = group_size
                .ok_or_else(|| format!("{at}: per_grouped_channel needs `group_size`"))?;
            let group_size = usize::try_from(group_size)
                .ok()
                .filter(|g| *g >= 1)
                .ok_or_else(|| format!("{at}.group_size must be at least 1"))?;
            let axis = usize::try_from(axis.unwrap_or(0))
                .ok()
                .filter(|a| *a <= 1)
                .ok_or_else(|| format!("{at}.axis must be 0 (output channels) or 1"))?;
            Granularity::PerGroupedChannel { group_size, axis }
        }
        other => {
            return Err(RecipeError::Invalid(format!(
                "{at}.granularity: unknown `{other}` (expected per_tensor, per_grouped_channel)"
            )))
        }
    };
    Ok(Decision::Palettize { nbits, granularity })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(name: &str, role: Role) -> TensorSlot {
        TensorSlot {
            name: name.into(),
            shape: vec![64, 32],
            role,
            layer: Some(0),
        }
    }

    #[test]
    fn builtin_recipes_parse() {
        for (name, _) in BUILTIN_RECIPES {
            Recipe::builtin(name).unwrap().unwrap();
        }
        assert!(Recipe::builtin("nope").is_none());
    }

    #[test]
    fn builtin_recipes_describe_themselves() {
        // `hf2coreml recipes` prints these: every shipped recipe says what it does and what
        // it was measured to give.
        for (name, text) in BUILTIN_RECIPES {
            let about = Recipe::about(text);
            assert!(about.len() > 40, "{name}: {about:?}");
            assert!(!about.contains("Measured:"), "{name}");
            let measured = Recipe::measured(text).unwrap_or_default();
            assert!(measured.contains("SmolLM2"), "{name}: {measured:?}");
        }
    }

    #[test]
    fn a_misspelt_recipe_name_gets_the_nearest_shipped_one() {
        let err = Recipe::from_file_or_name(Path::new("defualt")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("did you mean `default`?"), "{msg}");
        assert!(msg.contains("calibrated-4bit, data-free-4bit"), "{msg}");
        let err = Recipe::from_file_or_name(Path::new("/nonexistent/mine.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("/nonexistent/mine.toml: no such file"),
            "{msg}"
        );
        assert!(!msg.contains("did you mean"), "{msg}");
    }

    #[test]
    fn default_recipe_palettizes_projections_only() {
        let r = Recipe::default();
        assert!(r.calibration().is_some(), "the default recipe calibrates");
        for role in Role::ALL {
            let d = r.decide(&slot("x", role));
            if role.is_projection() {
                assert_eq!(d.nbits(), Some(6), "{role}");
            } else {
                assert_eq!(d, Decision::Fp16, "{role}");
            }
        }
    }

    #[test]
    fn name_beats_role_beats_default() {
        let r = Recipe::parse(
            r#"
            default = { palettize = { nbits = 8 } }
            [roles]
            q = { palettize = { nbits = 2 } }
            [[tensors]]
            glob = "model.layers.0.*"
            decision = "fp16"
            [[tensors]]
            glob = "*.q_proj.weight"
            decision = { palettize = { nbits = 6 } }
            "#,
            "t.toml",
        )
        .unwrap();
        let d = |n: &str, role| r.decide(&slot(n, role));
        assert_eq!(
            d("model.layers.0.self_attn.q_proj.weight", Role::Q),
            Decision::Fp16
        );
        assert_eq!(
            d("model.layers.1.self_attn.q_proj.weight", Role::Q).nbits(),
            Some(6)
        );
        assert_eq!(
            d("model.layers.1.self_attn.q_norm", Role::Q).nbits(),
            Some(2)
        );
        assert_eq!(
            d("model.layers.1.mlp.up_proj.weight", Role::Up).nbits(),
            Some(8)
        );
    }

    #[test]
    fn flags_override_the_file() {
        let r = Recipe::default()
            .with_overrides(Some(6), &["*.down_proj.weight".to_string()])
            .unwrap();
        assert_eq!(
            r.decide(&slot("model.layers.3.mlp.up_proj.weight", Role::Up))
                .nbits(),
            Some(6)
        );
        assert_eq!(
            r.decide(&slot("model.layers.3.mlp.down_proj.weight", Role::Down)),
            Decision::Fp16
        );
        let all = Recipe::default().keep_fp16("*").unwrap();
        assert!(Role::ALL
            .iter()
            .all(|&role| all.decide(&slot("a.b", role)) == Decision::Fp16));
        assert!(Recipe::default().with_nbits(5).is_err());
        assert!(Recipe::default().keep_fp16("a[").is_err());
    }

    #[test]
    fn prefill_len_key_round_trips_and_refuses_nonsense() {
        let r = Recipe::parse("target = \"ios18\"\nprefill_len = 32\n", "r").unwrap();
        assert_eq!(r.prefill_len(), Some(32));
        let back = Recipe::parse(&r.to_toml(), "x").unwrap();
        assert_eq!(back.prefill_len(), Some(32));
        assert_eq!(Recipe::default().prefill_len(), None);
        assert!(!Recipe::default().to_toml().contains("prefill_len"));
        assert_eq!(Recipe::default().with_prefill_len(0).prefill_len(), Some(0));
        for bad in [
            "prefill_len = -1",
            "prefill_len = \"64\"",
            "prefill_len = 1e9",
        ] {
            assert!(Recipe::parse(bad, "r").is_err(), "{bad}");
        }
    }

    #[test]
    fn target_key_and_what_ios17_refuses() {
        let grouped = "{ palettize = { nbits = 3, granularity = \"per_grouped_channel\", \
                       group_size = 8 } }";
        let r = Recipe::parse(&format!("target = \"ios18\"\n[roles]\nq = {grouped}"), "r").unwrap();
        let s = [slot("model.layers.0.self_attn.q_proj.weight", Role::Q)];
        assert_eq!(r.target(), Target::Ios18);
        assert_eq!(r.target_conflict(&s), None);
        assert!(r.to_toml().starts_with("target = \"ios18\"\n"));
        assert_eq!(
            Recipe::parse(&r.to_toml(), "x").unwrap().target(),
            Target::Ios18
        );
        let e = r
            .clone()
            .with_target(Target::Ios17)
            .target_conflict(&s)
            .unwrap();
        assert!(e.contains("3-bit") && e.contains("ios18"), "{e}");
        let g4 = grouped.replace("nbits = 3", "nbits = 4");
        let r = Recipe::parse(&format!("[roles]\nq = {g4}"), "r").unwrap();
        assert_eq!(r.target(), Target::Ios17);
        assert!(r
            .target_conflict(&s)
            .unwrap()
            .contains("per_grouped_channel"));
        let text = "[roles]\nq = { palettize = { nbits = 4 } }\n[calibration]\ngroup_size = 16";
        let r = Recipe::parse(text, "r").unwrap();
        assert_eq!(r.calibration().unwrap().group_size, 16);
        assert_eq!(r.calibration().unwrap().method(4).group_size, 16);
        assert!(r.target_conflict(&s).unwrap().contains("group_size"));
        assert!(r.to_toml().contains("group_size = 16"));
        assert_eq!(r.with_target(Target::Ios18).target_conflict(&s), None);
        assert!(Recipe::parse("target = \"ios19\"", "r").is_err());
        assert!(Recipe::parse("[calibration]\ngroup_size = 0", "r").is_err());
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let cases = [
            ("defualt = \"fp16\"", "defualt"),
            ("[roles]\nqq = \"fp16\"", "qq"),
            ("[roles]\nq = \"int8\"", "int8"),
            ("[roles]\nq = { palettize = { nbits = 5 } }", "nbits = 5"),
            ("[roles]\nq = { palettize = { nbit = 4 } }", "nbit"),
            ("[roles]\nq = { palettise = { nbits = 4 } }", "palettise"),
            (
                "[[tensors]]\nglob = \"*\"\ndecision = \"fp16\"\nwhy = 1",
                "why",
            ),
            ("[[tensors]]\nglob = \"*\"", "decision"),
            ("[[tensors]]\nglob = \"a[\"\ndecision = \"fp16\"", "a["),
            (
                "[roles]\nq = { palettize = { nbits = 4, granularity = \"per_block\" } }",
                "per_block",
            ),
            (
                "[roles]\nq = { palettize = { nbits = 4, group_size = 8 } }",
                "group_size",
            ),
            ("default = [", "recipe.toml"),
        ];
        for (text, needle) in cases {
            let e = Recipe::parse(text, "recipe.toml").unwrap_err().to_string();
            assert!(e.starts_with("recipe.toml"), "{e}");
            assert!(e.contains(needle), "`{needle}` not in: {e}");
        }
    }

    #[test]
    fn errors_are_typed_where_a_caller_may_react() {
        let recipe_error = |text: &str| match Recipe::parse(text, "r.toml") {
            Err(QuantError::Recipe { error, .. }) => error,
            other => panic!("{other:?}"),
        };
        let e = recipe_error("default = { palettize = { nbits = 5 } }");
        assert_eq!(
            e,
            RecipeError::UnsupportedNbits {
                at: "default.palettize".into(),
                nbits: 5
            }
        );
        assert_eq!(
            e.to_string(),
            "default.palettize.nbits = 5: supported are 1, 2, 3, 4, 6, 8"
        );
        let e = recipe_error("[[tensors]]\nglob = \"a[\"\ndecision = \"fp16\"");
        assert!(
            matches!(&e, RecipeError::Glob { glob, .. } if glob == "a["),
            "{e:?}"
        );
        assert!(
            e.to_string().starts_with("tensors[0]: invalid glob `a[`: "),
            "{e}"
        );
        let Err(QuantError::Recipe { error, path }) = Recipe::default().keep_fp16("a[") else {
            panic!("`a[` is not a glob")
        };
        assert_eq!(path, PathBuf::from("--keep-fp16"));
        assert!(
            error.to_string().starts_with("invalid glob `a[`: "),
            "{error}"
        );
        assert!(matches!(
            recipe_error("default = ["),
            RecipeError::Syntax(_)
        ));
    }

    #[test]
    fn grouped_granularity_parses_and_sizes() {
        let r = Recipe::parse(
            "[roles]\nup = { palettize = { nbits = 4, granularity = \"per_grouped_channel\", group_size = 16 } }",
            "g.toml",
        )
        .unwrap();
        let s = slot("u", Role::Up);
        let d = r.decide(&s);
        assert_eq!(
            d,
            Decision::Palettize {
                nbits: 4,
                granularity: Granularity::PerGroupedChannel {
                    group_size: 16,
                    axis: 0
                }
            }
        );
        assert_eq!(d.to_string(), "lut4/g16@0");
        assert_eq!(d.storage(&s.shape), Storage::Lut { nbits: 4, luts: 4 });
    }

    #[test]
    fn to_toml_round_trips_decisions() {
        let r = Recipe::default()
            .with_overrides(Some(2), &["model.layers.1.*".to_string()])
            .unwrap();
        let back = Recipe::parse(&r.to_toml(), "round-trip").unwrap();
        for role in Role::ALL {
            for name in ["model.layers.1.mlp.up_proj.weight", "model.layers.2.x"] {
                let s = slot(name, role);
                assert_eq!(r.decide(&s), back.decide(&s), "{name} {role}");
            }
        }
    }

    #[test]
    fn allocation_rows_parses_round_trips_and_is_checked() {
        let text = "default = \"fp16\"\n[calibration]\ntarget_bpw = 4.5\nallocation_rows = 16\n";
        let r = Recipe::parse(text, "t").unwrap();
        let c = r.calibration().unwrap();
        assert_eq!((c.allocation_rows, c.target_bpw), (16, Some(4.5)));
        let back = Recipe::parse(&r.to_toml(), "round-trip").unwrap();
        assert_eq!(back.calibration(), r.calibration());
        let plain = Recipe::parse("default = \"fp16\"\n[calibration]\n", "t").unwrap();
        assert_eq!(plain.calibration().unwrap().allocation_rows, 0);
        let bad = Recipe::parse(
            "default = \"fp16\"\n[calibration]\nallocation_rows = -1\n",
            "t",
        );
        assert!(bad.unwrap_err().to_string().contains("allocation_rows"));
    }
}
