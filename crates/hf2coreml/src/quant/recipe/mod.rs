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
//!
//! A recipe file may also set the package's options (`target`, `layout`, `kv_cache`,
//! `prefill_len`): they are not quantization, and [`RecipeFile`] keeps them apart from the
//! [`Recipe`] as [`PackageOptions`]. The file's reader is in `parse.rs`, the `[calibration]`
//! table in `calibration.rs`.

mod builtin_recipes;
mod calibration;
mod parse;
mod recipe_error;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use globset::{Glob, GlobMatcher};
use serde::Serialize;

use super::kmeans::check_nbits;
use super::{Granularity, QuantError};
use crate::arch::{Role, TensorSlot};
use crate::mil::contract::Target;
use crate::mil::PackageOptions;

pub use crate::mil::package_options::MAX_PREFILL_LEN;
pub use builtin_recipes::{BUILTIN_RECIPES, DEFAULT_RECIPE};
pub use calibration::{Calibration, DEFAULT_ALLOCATION_ROWS};
pub use recipe_error::RecipeError;

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

const DEFAULT_ORIGIN: &str = "configs/recipes/default.toml (built in)";

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

/// A parsed recipe plus command-line overrides.
#[derive(Debug, Clone)]
pub struct Recipe {
    origin: String,
    default: Decision,
    roles: BTreeMap<Role, Decision>,
    names: Vec<NameRule>,
    nbits_override: Option<u8>,
    calibration: Option<Calibration>,
}

/// A recipe file as written: its recipe, and the package options it may set beside it.
#[derive(Debug, Clone)]
pub struct RecipeFile {
    pub recipe: Recipe,
    pub package: PackageOptions,
}

impl Default for RecipeFile {
    /// The embedded default (`configs/recipes/default.toml`): decoder projections 6-bit,
    /// calibrated; everything else fp16.
    fn default() -> Self {
        match RecipeFile::parse(DEFAULT_RECIPE, DEFAULT_ORIGIN) {
            Ok(r) => r,
            // A unit test parses the embedded file; reaching this is a build defect.
            Err(e) => panic!("embedded default recipe is invalid: {e}"),
        }
    }
}

impl RecipeFile {
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

    /// Read a recipe file (a regular file of at most 1 MiB).
    pub fn from_file(path: &Path) -> Result<Self, QuantError> {
        let text =
            crate::fsutil::read_input_text(path, 1 << 20).map_err(|e| QuantError::Recipe {
                path: path.to_path_buf(),
                error: RecipeError::Read(e.to_string()),
            })?;
        Self::parse(&text, &path.display().to_string())
    }
}

impl Default for Recipe {
    /// The embedded default recipe (see [`RecipeFile::default`]).
    fn default() -> Self {
        RecipeFile::default().recipe
    }
}

impl Recipe {
    /// The recipe of a shipped recipe file, by name (its package options: [`RecipeFile::builtin`]).
    pub fn builtin(name: &str) -> Option<Result<Self, QuantError>> {
        RecipeFile::builtin(name).map(|r| r.map(|f| f.recipe))
    }

    /// The recipe of a recipe file, or of a built-in recipe when no such file exists (its
    /// package options: [`RecipeFile::from_file_or_name`]).
    pub fn from_file_or_name(arg: &Path) -> Result<Self, QuantError> {
        RecipeFile::from_file_or_name(arg).map(|f| f.recipe)
    }

    /// The recipe of a recipe file (its package options: [`RecipeFile::from_file`]).
    pub fn from_file(path: &Path) -> Result<Self, QuantError> {
        RecipeFile::from_file(path).map(|f| f.recipe)
    }

    /// The recipe of recipe text; `origin` names it in errors (its package options:
    /// [`RecipeFile::parse`]).
    pub fn parse(text: &str, origin: &str) -> Result<Self, QuantError> {
        RecipeFile::parse(text, origin).map(|f| f.recipe)
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

    /// What this recipe asks for that `target` cannot store, if anything: iOS17 has one LUT
    /// per tensor (no channel groups) of 1, 2, 4, 6 or 8 bits.
    pub fn target_conflict(&self, target: Target, slots: &[TensorSlot]) -> Option<String> {
        if target != Target::Ios17 {
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

    /// How Gemma 4's per-layer table (`slot`, role `per_layer_embedding`, a file beside the
    /// package) is stored: `Ok(None)` as fp16 rows, `Ok(Some(bits))` as LUT indices with one
    /// LUT per block; a grouped decision (one LUT per G rows), which the file does not hold,
    /// is returned as the error.
    pub fn per_layer_bits(&self, slot: &TensorSlot) -> Result<Option<u8>, Decision> {
        match self.decide(slot) {
            Decision::Fp16 => Ok(None),
            Decision::Palettize {
                nbits,
                granularity: Granularity::PerTensor,
            } => Ok(Some(nbits)),
            other => Err(other),
        }
    }

    /// The decision for one tensor: name rule > role rule > default, then `--nbits`.
    pub fn decide(&self, slot: &TensorSlot) -> Decision {
        let d = self
            .names
            .iter()
            .find(|r| r.matcher.is_match(&slot.name))
            .map(|r| r.decision)
            .or_else(|| self.roles.get(&slot.role).copied())
            // LFM2's conv in_proj and a DeltaNet's in_proj_qkv and in_proj_z read the block
            // input as q/k/v do: a recipe that names no `conv_in` or `output_gate` treats
            // them as it treats `q`; Gemma 4's per-layer input projections, a gated
            // feed-forward of their own, as it treats the MLP's `up`.
            .or_else(|| match slot.role {
                Role::ConvIn | Role::OutputGate => self.roles.get(&Role::Q).copied(),
                Role::PerLayer => self.roles.get(&Role::Up).copied(),
                _ => None,
            })
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

    /// The recipe file this recipe and `package` make, with the overrides folded in: TOML that
    /// parses back to the same decisions and options (recorded in packages and reports).
    pub fn to_toml(&self, package: &PackageOptions) -> String {
        let fold = |d: Decision| match (d, self.nbits_override) {
            (Decision::Palettize { granularity, .. }, Some(nbits)) => {
                Decision::Palettize { nbits, granularity }
            }
            _ => d,
        };
        let mut out = package.to_toml();
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
        let f = RecipeFile::parse("target = \"ios18\"\nprefill_len = 32\n", "r").unwrap();
        assert_eq!(f.package.prefill_len, Some(32));
        let back = RecipeFile::parse(&f.recipe.to_toml(&f.package), "x").unwrap();
        assert_eq!(back.package.prefill_len, Some(32));
        let default = RecipeFile::default();
        assert_eq!(default.package.prefill_len, None);
        assert!(!default
            .recipe
            .to_toml(&default.package)
            .contains("prefill_len"));
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
        let f =
            RecipeFile::parse(&format!("target = \"ios18\"\n[roles]\nq = {grouped}"), "r").unwrap();
        let (r, target) = (&f.recipe, f.package.target);
        let s = [slot("model.layers.0.self_attn.q_proj.weight", Role::Q)];
        assert_eq!(target, Target::Ios18);
        assert_eq!(r.target_conflict(target, &s), None);
        let toml = r.to_toml(&f.package);
        assert!(toml.starts_with("target = \"ios18\"\ndefault = "), "{toml}");
        assert_eq!(
            RecipeFile::parse(&toml, "x").unwrap().package.target,
            Target::Ios18
        );
        let e = r.target_conflict(Target::Ios17, &s).unwrap();
        assert!(e.contains("3-bit") && e.contains("ios18"), "{e}");
        let g4 = grouped.replace("nbits = 3", "nbits = 4");
        let f = RecipeFile::parse(&format!("[roles]\nq = {g4}"), "r").unwrap();
        assert_eq!(f.package.target, Target::Ios17);
        assert!(f
            .recipe
            .target_conflict(f.package.target, &s)
            .unwrap()
            .contains("per_grouped_channel"));
        let text = "[roles]\nq = { palettize = { nbits = 4 } }\n[calibration]\ngroup_size = 16";
        let r = Recipe::parse(text, "r").unwrap();
        assert_eq!(r.calibration().unwrap().group_size, 16);
        assert_eq!(r.calibration().unwrap().method(4).group_size, 16);
        assert!(r
            .target_conflict(Target::Ios17, &s)
            .unwrap()
            .contains("group_size"));
        assert!(r
            .to_toml(&PackageOptions::default())
            .contains("group_size = 16"));
        assert_eq!(r.target_conflict(Target::Ios18, &s), None);
        assert!(Recipe::parse("target = \"ios19\"", "r").is_err());
        assert!(Recipe::parse("[calibration]\ngroup_size = 0", "r").is_err());
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
        let back = Recipe::parse(&r.to_toml(&PackageOptions::default()), "round-trip").unwrap();
        for role in Role::ALL {
            for name in ["model.layers.1.mlp.up_proj.weight", "model.layers.2.x"] {
                let s = slot(name, role);
                assert_eq!(r.decide(&s), back.decide(&s), "{name} {role}");
            }
        }
    }
}
