//! What a budget is planned from (a checkpoint, a GGUF header, or a config.json alone: a plan
//! needs shapes, never weights), and `budget --suggest`: the least-compressed shipped recipe
//! that fits.

use std::path::Path;

use serde::Serialize;

use super::{compute, BudgetError, Limit};
use crate::arch::{package_tensors, ModelSpec, TensorSlot};
use crate::checkpoint::gguf::{self, header::HeaderInfo};
use crate::checkpoint::{has_weight_files, Checkpoint};
use crate::quant::recipe::{RecipeFile, BUILTIN_RECIPES};
use crate::quant::Recipe;

/// Where a plan's shapes come from.
#[derive(Debug, Clone)]
pub enum PlanSource {
    /// A checkpoint directory, its tensors' presence and shapes checked.
    Checkpoint,
    /// A config.json (or a directory holding only one): the architecture's tensors sized from
    /// the configuration. Big models' configurations are a few KiB.
    Config,
    /// A GGUF file's header.
    Gguf(Box<HeaderInfo>),
}

/// A model's spec and tensor slots, ready to be budgeted.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub spec: ModelSpec,
    pub slots: Vec<TensorSlot>,
    pub source: PlanSource,
}

impl PlanInput {
    /// A plan from a spec alone (what a config.json describes).
    pub fn from_spec(spec: ModelSpec) -> Self {
        PlanInput {
            slots: package_tensors(&spec),
            spec,
            source: PlanSource::Config,
        }
    }

    /// A `.gguf` file (header only), a `config.json` file, a directory with a config.json and
    /// no weight files, or a checkpoint directory.
    pub fn open(path: &Path) -> Result<Self, BudgetError> {
        let resolved =
            crate::checkpoint::resolve_source(path).map_err(|source| BudgetError::Checkpoint {
                path: path.to_path_buf(),
                source,
            })?;
        let path = resolved.as_path();
        if gguf::is_gguf_file(path) {
            let info = gguf::header::read_header(path).map_err(|source| BudgetError::Gguf {
                path: path.to_path_buf(),
                source,
            })?;
            return Ok(PlanInput {
                slots: package_tensors(&info.spec),
                spec: info.spec.clone(),
                source: PlanSource::Gguf(Box::new(info)),
            });
        }
        let checkpoint_err = |source| BudgetError::Checkpoint {
            path: path.to_path_buf(),
            source,
        };
        // A .json file is a configuration (the safetensors index aside); any other file is
        // for the checkpoint reader (a weight file stands for its directory).
        let is_config_file = path.is_file()
            && path.extension().is_some_and(|e| e == "json")
            && !path.to_string_lossy().ends_with(".safetensors.index.json");
        let config = if is_config_file {
            Some(path.to_path_buf())
        } else if path.is_dir() && !has_weight_files(path) && path.join("config.json").is_file() {
            Some(path.join("config.json"))
        } else {
            None
        };
        if let Some(config) = config {
            let spec = ModelSpec::from_config_file(&config).map_err(checkpoint_err)?;
            return Ok(Self::from_spec(spec));
        }
        let ckpt = Checkpoint::open(path).map_err(checkpoint_err)?;
        Ok(PlanInput {
            spec: ckpt.spec().clone(),
            slots: ckpt.package_slots(),
            source: PlanSource::Checkpoint,
        })
    }

    /// Bytes of the weights under `recipe`.
    pub fn weights_bytes(&self, recipe: &Recipe) -> u64 {
        recipe.weights_bytes(&self.slots)
    }
}

/// One shipped recipe, sized for the model.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub recipe: String,
    pub weights_bytes: u64,
    /// Whether the plan fits at the requested S, in memory and in packages.
    pub fits: bool,
    pub max_seq_len_that_fits: usize,
    /// The packages `convert` would write under the package size limit; 0 when no split at
    /// block boundaries fits (a table alone is over the limit).
    pub packages: usize,
}

/// `budget --suggest`.
#[derive(Debug, Clone, Serialize)]
pub struct Suggestion {
    /// The S the candidates were checked at.
    pub max_seq_len: usize,
    /// The least-compressed shipped recipe that fits at S, if one does.
    pub recipe: Option<String>,
    /// The largest S that fits under that recipe (or, when none fits at S, under the most
    /// compressed one; 0 when nothing fits at all).
    pub max_seq_len_that_fits: usize,
    /// Every shipped recipe, least compressed (most weight bytes) first; equal sizes keep the
    /// shipped order, which lists calibrated recipes before data-free ones.
    pub candidates: Vec<Candidate>,
}

/// Size the model under every shipped recipe and pick the least compressed that fits at
/// `max_seq_len`: fewer bits cost quality, so the most bytes that fit are the best plan.
pub fn suggest(
    input: &PlanInput,
    max_seq_len: usize,
    query_len: usize,
    limit: &Limit,
    package_limit: u64,
) -> Result<Suggestion, BudgetError> {
    let per_part = super::split::part_overhead_bytes(&input.spec, max_seq_len);
    let mut candidates = Vec::with_capacity(BUILTIN_RECIPES.len());
    for (name, text) in BUILTIN_RECIPES {
        let file = RecipeFile::parse(text, &format!("configs/recipes/{name}.toml (built in)"))
            .map_err(BudgetError::Recipe)?;
        // The plan is for the default target (iOS17): recipes for newer OSes are not offered.
        if file.package.target != crate::mil::contract::Target::Ios17 {
            continue;
        }
        let recipe = file.recipe;
        let weights = input.weights_bytes(&recipe);
        // A built-in recipe stores the per-layer table as the file holds it.
        let bits = crate::arch::per_layer_slot(&input.spec)
            .and_then(|slot| recipe.per_layer_bits(&slot).ok().flatten());
        let b = compute(&input.spec, weights, (max_seq_len, query_len), bits, limit);
        let units = super::split::ModelBytes::measure(&input.spec, &input.slots, per_part, |s| {
            recipe.storage(s).bytes(s.numel())
        });
        let packages = super::split::plan(&units, package_limit).map_or(0, |p| p.parts.len());
        candidates.push(Candidate {
            recipe: name.to_string(),
            weights_bytes: weights,
            fits: b.fits && packages > 0,
            max_seq_len_that_fits: b.max_seq_len_that_fits,
            packages,
        });
    }
    // Stable: equal sizes keep the shipped order.
    candidates.sort_by_key(|c| std::cmp::Reverse(c.weights_bytes));
    let fitting = candidates.iter().find(|c| c.fits);
    let chosen = fitting.or(candidates.last());
    Ok(Suggestion {
        max_seq_len,
        recipe: fitting.map(|c| c.recipe.clone()),
        max_seq_len_that_fits: chosen.map_or(0, |c| c.max_seq_len_that_fits),
        candidates,
    })
}
