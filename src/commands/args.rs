//! The flags several commands share: the recipe flags (`palettize`, `inspect`, `budget`,
//! `convert`), the package options' values and the interpreter's precision (`run`,
//! `validate`).

use std::path::PathBuf;

use hf2coreml::mil::contract::{Layout, Target};
use hf2coreml::quant::recipe::RecipeFile;
use hf2coreml::quant::Recipe;

/// The recipe flags shared by `palettize`, `inspect`, `budget` and `convert`.
#[derive(Debug, Clone, Default, PartialEq, clap::Args)]
pub struct RecipeArgs {
    /// The name of a shipped recipe (`hf2coreml recipes` lists them) or a recipe file (TOML).
    #[arg(long, value_name = "NAME|FILE")]
    pub recipe: Option<PathBuf>,
    /// Bit width of every palettized tensor (1, 2, 3, 4, 6 or 8; 3 needs --target ios18),
    /// overriding the recipe.
    #[arg(long, value_name = "N")]
    pub nbits: Option<u8>,
    /// Keep tensors whose name matches GLOB in fp16 (repeatable; `*` keeps everything).
    #[arg(long = "keep-fp16", value_name = "GLOB")]
    pub keep_fp16: Vec<String>,
    /// Calibration text (UTF-8) for calibrated palettization: the reference forward pass runs
    /// over it once and the palettized projections are fitted to their real inputs. Turns
    /// calibration on (with the recipe's [calibration] settings, or all methods) and defaults
    /// to the shipped assets/calibration.txt when the recipe calibrates.
    #[arg(long, value_name = "FILE", conflicts_with = "data_free")]
    pub calibration: Option<PathBuf>,
    /// Palettize from the weights alone, ignoring the recipe's [calibration] table.
    #[arg(long)]
    pub data_free: bool,
    /// Mixed precision (calibrated): 4, 6 or 8 bits per projection, chosen from measured
    /// sensitivity, averaging at most B bits per palettized weight (LUTs and scales counted).
    #[arg(long, value_name = "B", conflicts_with_all = ["data_free", "nbits"])]
    pub target_bpw: Option<f64>,
    /// The OS the package is built for, overriding the recipe's `target` (default ios17).
    /// ios18 stores grouped LUTs (calibration.group_size, granularity = "per_grouped_channel"),
    /// per-channel scales and 3-bit tables as single constexpr ops; ios17 refuses them.
    #[arg(long, value_enum, value_name = "OS")]
    pub target: Option<TargetArg>,
}

/// `--layout`: the graph's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LayoutArg {
    Default,
    Ane,
}

impl From<LayoutArg> for Layout {
    fn from(l: LayoutArg) -> Self {
        match l {
            LayoutArg::Default => Layout::Default,
            LayoutArg::Ane => Layout::Ane,
        }
    }
}

/// `--target`: the deployment target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TargetArg {
    Ios17,
    Ios18,
    /// Apple's Core AI (iOS / macOS 27): writes OUT.aimodel.
    #[value(name = "coreai")]
    CoreAi,
}

impl From<TargetArg> for Target {
    fn from(t: TargetArg) -> Self {
        match t {
            TargetArg::Ios17 => Target::Ios17,
            TargetArg::Ios18 => Target::Ios18,
            TargetArg::CoreAi => Target::CoreAi,
        }
    }
}

impl RecipeArgs {
    /// The recipe (the file's, or the default) with the flags applied.
    pub fn load(&self) -> anyhow::Result<Recipe> {
        Ok(self.load_file()?.recipe)
    }

    /// The recipe file (or the default) with the flags applied: its recipe, and its package
    /// options with `--target`.
    pub fn load_file(&self) -> anyhow::Result<RecipeFile> {
        let RecipeFile {
            recipe,
            mut package,
        } = match &self.recipe {
            Some(p) => RecipeFile::from_file_or_name(p)?,
            None => RecipeFile::default(),
        };
        if let Some(t) = self.target {
            package.target = t.into();
        }
        Ok(RecipeFile {
            recipe: self.apply(recipe)?,
            package,
        })
    }

    /// `base` with the calibration and bit-width flags applied.
    fn apply(&self, base: Recipe) -> anyhow::Result<Recipe> {
        let base = if self.data_free {
            base.with_calibration(None)
        } else if (self.calibration.is_some() || self.target_bpw.is_some())
            && base.calibration().is_none()
        {
            base.with_calibration(Some(Default::default()))
        } else {
            base
        };
        // An explicit bit width wins over a recipe's mixed-precision target.
        let base = match (self.nbits, base.calibration().copied()) {
            (Some(_), Some(mut c)) if c.target_bpw.is_some() => {
                c.target_bpw = None;
                base.with_calibration(Some(c))
            }
            _ => base,
        };
        let base = match (self.target_bpw, base.calibration().copied()) {
            (Some(b), Some(mut c)) => {
                if !(b.is_finite() && (4.0..=8.5).contains(&b)) {
                    anyhow::bail!("--target-bpw {b}: choose a value between 4 and 8.5");
                }
                c.target_bpw = Some(b);
                base.with_calibration(Some(c))
            }
            _ => base,
        };
        Ok(base.with_overrides(self.nbits, &self.keep_fp16)?)
    }
}

/// `--kv-cache`: how the cache is passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheArg {
    Io,
    State,
}

/// `--prefill-logits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefillLogitsArg {
    Last,
    All,
}

impl From<PrefillLogitsArg> for hf2coreml::mil::contract::PrefillLogits {
    fn from(p: PrefillLogitsArg) -> Self {
        match p {
            PrefillLogitsArg::Last => Self::Last,
            PrefillLogitsArg::All => Self::All,
        }
    }
}

impl From<KvCacheArg> for hf2coreml::mil::contract::KvCache {
    fn from(k: KvCacheArg) -> Self {
        match k {
            KvCacheArg::Io => Self::Io,
            KvCacheArg::State => Self::State,
        }
    }
}

/// `--compute` of `run` and `validate`: the CPU interpreter's float precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ComputeArg {
    /// Round every op to the dtype the program declares, as the device does.
    Fp16,
    /// Keep every float in f32 (debugging: separates range problems from logic errors).
    F32,
}

impl From<ComputeArg> for hf2coreml::runtime::interp::Compute {
    fn from(c: ComputeArg) -> Self {
        match c {
            ComputeArg::Fp16 => Self::Declared,
            ComputeArg::F32 => Self::F32,
        }
    }
}
