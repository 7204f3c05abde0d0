//! One conversion as `convert` and `batch` run it: check the settings, open the checkpoint
//! (importing a GGUF file first), plan it against a device, prepare the weights and convert.
//! Typed settings in, a [`ConvertSummary`] out; notes and details go to a [`Progress`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use thiserror::Error;

use super::convert_error::{io_err, ConvertError};
use super::convert_summary::{ConvertSummary, Inputs, StageTimes};
use super::options::{ComputePrecision, ConvertOptions};
use super::package_files::{source_hashes, Outputs};
use super::texts::{self, TextError};
use super::weight_stream::WeightStream;
use crate::arch::ModelSpec;
use crate::budget::{self, Budget, BudgetError, Devices, Limit};
use crate::checkpoint::gguf::{self, GgufError};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::emit::{EmitError, PythonEnv};
use crate::error::{CheckFailed, ExitCode};
use crate::graph::scaling::ActivationRanges;
use crate::mil::PackageOptions;
use crate::progress::Progress;
use crate::quant::{self, QuantError, Recipe};
use crate::util::{fmt_bytes, fmt_count, sha256_hex};

/// A plan's shape that no package can have.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ShapeError {
    #[error("--max-seq-len and --query-len must be at least 1")]
    Zero,
    #[error(
        "--max-seq-len {max_seq_len} exceeds the limit of {}",
        budget::MAX_SEQ_CAP
    )]
    TooLong { max_seq_len: usize },
    #[error("--query-len ({query_len}) cannot exceed --max-seq-len ({max_seq_len})")]
    QueryTooLong {
        query_len: usize,
        max_seq_len: usize,
    },
    #[error(
        "--max-seq-len {max_seq_len} exceeds the model's context of {context} positions \
         (max_position_embeddings in config.json): it was never trained on positions beyond it; \
         use --max-seq-len {context} or less"
    )]
    BeyondContext { max_seq_len: usize, context: usize },
    #[error(
        "--prefill-len {prefill_len}: a package with prefill and decode functions needs \
         --target ios18 or coreai (an iOS17 package has one function); drop --prefill-len or \
         target ios18"
    )]
    PrefillNeedsIos18 { prefill_len: usize },
    #[error(
        "--prefill-len {prefill_len} builds a decode function of one token: --query-len must \
         be 1 (it is {query_len}); use --prefill-len 0 for one function of {query_len} tokens"
    )]
    PrefillWithQuery {
        prefill_len: usize,
        query_len: usize,
    },
    #[error(
        "--prefill-logits (or the recipe's prefill_logits) says which rows a prefill function \
         returns, and this package has none (--prefill-len 0, or a target other than ios18)"
    )]
    PrefillLogitsWithoutPrefill,
    #[error(
        "--prefill-len {prefill_len}: the prefill function needs 2 to --max-seq-len \
         ({max_seq_len}) tokens a call (0: no prefill function)"
    )]
    PrefillLength {
        prefill_len: usize,
        max_seq_len: usize,
    },
}

/// The prefill function's Q for these settings (0: one function), or why it cannot be built:
/// an explicit length needs iOS18, a decode function of one token, and 2 <= Q <= S.
pub fn check_prefill(
    target: crate::mil::contract::Target,
    explicit: Option<usize>,
    query_len: usize,
    max_seq_len: usize,
) -> Result<usize, ShapeError> {
    use crate::mil::contract::{resolve_prefill_len, Target};
    let q = resolve_prefill_len(explicit, target, query_len, max_seq_len);
    if q == 0 {
        return Ok(0);
    }
    if !matches!(target, Target::Ios18 | Target::CoreAi) {
        return Err(ShapeError::PrefillNeedsIos18 { prefill_len: q });
    }
    if query_len != 1 {
        return Err(ShapeError::PrefillWithQuery {
            prefill_len: q,
            query_len,
        });
    }
    if q < 2 || q > max_seq_len {
        return Err(ShapeError::PrefillLength {
            prefill_len: q,
            max_seq_len,
        });
    }
    Ok(q)
}

/// Refuse what a recipe asks of a model that the conversion would not do: a per-layer table
/// (Gemma 4's, beside the package) palettized otherwise than [`per_layer_bits`] writes it,
/// and the calibration its blocks cannot run (AWQ's search and the mixed-precision allocation
/// run one block on its own, which a Gemma 4 block, with its per-layer input and the keys and
/// values it shares, is not).
fn check_recipe(spec: &ModelSpec, recipe: &Recipe) -> Result<(), ConvertError> {
    per_layer_bits(spec, recipe)?;
    let Some(c) = recipe.calibration() else {
        return Ok(());
    };
    let what = match (c.awq, c.target_bpw.is_some()) {
        (true, _) => "awq",
        (false, true) => "target_bpw (--target-bpw)",
        (false, false) => return Ok(()),
    };
    match spec.gemma4 {
        Some(_) => Err(crate::graph::GraphError::Unsupported(format!(
            "{} is calibrated block by block with each block's per-layer input and shared \
             keys and values, which the recipe's `{what}` does not carry: drop it",
            spec.architecture
        ))
        .into()),
        None => Ok(()),
    }
}

/// How the recipe stores Gemma 4's per-layer table beside the package (docs/contract.md, "The
/// per-layer table"): `None` for fp16 rows, or the bits of its LUT indices (one LUT per
/// block's columns, fitted to the table's values). A grouped palettization is refused.
pub fn per_layer_bits(spec: &ModelSpec, recipe: &Recipe) -> Result<Option<u8>, ConvertError> {
    let Some(slot) = crate::arch::per_layer_slot(spec) else {
        return Ok(None);
    };
    recipe.per_layer_bits(&slot).map_err(|other| {
        ConvertError::State(format!(
            "the recipe stores `{}` (role `per_layer_embedding`) as {other}: the per-layer \
             table beside the package is fp16 or palettized with one LUT per block, not in \
             groups of rows (docs/contract.md, \"The per-layer table\")",
            slot.name
        ))
    })
}

/// A max_sequence_length within the model's trained context.
pub fn check_context(spec: &ModelSpec, max_seq_len: usize) -> Result<(), ShapeError> {
    let context = spec.max_position_embeddings;
    if max_seq_len > context {
        return Err(ShapeError::BeyondContext {
            max_seq_len,
            context,
        });
    }
    Ok(())
}

/// The fixed shape of a plan: S and Q at least 1, S within the budget's cap, Q at most S.
pub fn check_shape(max_seq_len: usize, query_len: usize) -> Result<(), ShapeError> {
    if max_seq_len == 0 || query_len == 0 {
        return Err(ShapeError::Zero);
    }
    if max_seq_len > budget::MAX_SEQ_CAP {
        return Err(ShapeError::TooLong { max_seq_len });
    }
    if query_len > max_seq_len {
        return Err(ShapeError::QueryTooLong {
            query_len,
            max_seq_len,
        });
    }
    Ok(())
}

/// Why a job stopped. The texts are the ones the command prints; [`JobError::exit_code`] says
/// which exit code the error calls for.
#[derive(Debug, Error)]
pub enum JobError {
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error(transparent)]
    Convert(#[from] ConvertError),
    /// The output's place cannot be written.
    #[error(transparent)]
    Unwritable(std::io::Error),
    #[error("cannot import {}", path.display())]
    Import {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    #[error("cannot read checkpoint {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: CheckpointError,
    },
    /// NaN or Inf weights.
    #[error("cannot convert {}", path.display())]
    NotFinite {
        path: PathBuf,
        #[source]
        source: CheckpointError,
    },
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The plan does not fit its device (exit 1).
    #[error(transparent)]
    OverBudget(CheckFailed),
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not an activation-ranges JSON", path.display())]
    Ranges {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// The calibration text cannot be read or is too short.
    #[error(transparent)]
    Text(#[from] TextError),
}

impl JobError {
    /// The exit code this error calls for: 1 for a plan over budget, else what the markers in
    /// its causes say ([`crate::error::exit_code_of`]).
    pub fn exit_code(&self) -> ExitCode {
        match self {
            JobError::OverBudget(_) => ExitCode::CheckFailed,
            other => crate::error::exit_code_of(other),
        }
    }
}

/// One conversion, as `convert` and `batch` run it: the source, the output, the settings.
#[derive(Debug, Clone)]
pub struct Job {
    /// Checkpoint directory or .gguf file.
    pub source: PathBuf,
    pub output: PathBuf,
    pub max_seq_len: usize,
    pub query_len: usize,
    /// The recipe with every flag applied.
    pub recipe: Recipe,
    /// How the package is built: the recipe file's options with every flag applied.
    pub package: PackageOptions,
    /// Calibration text (default: the shipped one), used when the recipe calibrates.
    pub calibration: Option<PathBuf>,
    pub compute_precision: ComputePrecision,
    pub activation_ranges: Option<PathBuf>,
    pub no_range_scaling: bool,
    pub device: Option<String>,
    pub increased_memory_limit: bool,
    pub allow_over_budget: bool,
    /// Largest package in bytes before the model is split into a chain; `None`: the device
    /// profile's, or [`budget::DEFAULT_MAX_PACKAGE_BYTES`] without a device.
    pub max_package_size: Option<u64>,
    pub force: bool,
    pub python_env: Option<PathBuf>,
}

/// A job's checkpoint, opened (a GGUF source from the model cache).
pub struct Opened {
    pub ckpt: Checkpoint,
}

/// What a job will produce and whether it fits its device.
#[derive(Debug, Clone)]
pub struct Plan {
    pub predicted_weight_bytes: u64,
    pub budget: Option<Budget>,
}

/// sha256 of an input file, as a [`ConvertError`] naming it when it cannot be read.
fn hash_file(path: &Path) -> Result<String, ConvertError> {
    crate::fsutil::sha256_file(path).map_err(io_err(path))
}

fn open_checkpoint(dir: &Path, named: &Path) -> Result<Checkpoint, JobError> {
    Checkpoint::open(dir).map_err(|source| JobError::Open {
        path: named.to_path_buf(),
        source,
    })
}

/// What the target writes must be what the output's name says, and the Core AI backend passes
/// the caches as inputs and outputs: anything else is refused here, before any work.
fn check_target_output(p: &PackageOptions, output: &Path) -> Result<(), ConvertError> {
    let ext = p.target.extension();
    let named = output
        .file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with(&format!(".{ext}")));
    if !named {
        return Err(ConvertError::OutputExtension {
            output: output.to_path_buf(),
            target: p.target.as_str(),
            ext,
        });
    }
    if !p.target.is_coreai() {
        return Ok(());
    }
    if !p.kv_cache.is_io() {
        return Err(ConvertError::CoreAi(
            "passes the KV cache as inputs and outputs: Core AI's stateful form (handles) is \
             not authored by this backend (drop --kv-cache state)"
                .into(),
        ));
    }
    Ok(())
}

impl Job {
    /// Checks that need no input file: the shape, the output name, a writable output place.
    pub fn check(&self) -> Result<(), JobError> {
        check_shape(self.max_seq_len, self.query_len)?;
        let p = &self.package;
        crate::graph::decoder::check_kv_cache(p.kv_cache, p.target, p.layout, true)
            .map_err(ConvertError::Graph)?;
        self.prefill_logits()?;
        crate::fsutil::refuse_output_over_input(&self.source, &self.output)
            .map_err(JobError::Unwritable)?;
        check_target_output(p, &self.output)?;
        let source = std::path::absolute(&self.source).unwrap_or_else(|_| self.source.clone());
        if source.to_str().is_none() {
            return Err(ConvertError::SourceNotUtf8(self.source.clone()).into());
        }
        // Refuse an output that cannot be written before minutes of work, not after: the
        // package and each sidecar (their names are longer).
        let o = Outputs::for_package(&self.output)?;
        let sides = [
            o.tokenizer.as_ref(),
            o.tokenizer_config.as_ref(),
            Some(&o.report),
            o.per_layer.as_ref(),
        ];
        std::iter::once(&o.package)
            .chain(sides.into_iter().flatten())
            .try_for_each(|p| crate::fsutil::check_writable(p))
            .map_err(JobError::Unwritable)?;
        Ok(())
    }

    /// Without `force`, an existing package or any of its sidecars (the tokenizer files, the
    /// report, a per-layer table) is refused: they are one output, and a user's own file beside
    /// a new package is not ours to replace. With it, only what an output may replace is (a
    /// package's directory, regular files): never a symlink, device, FIFO or socket.
    pub fn refuse_existing(&self) -> Result<(), JobError> {
        let o = Outputs::for_package(&self.output)?;
        if self.force {
            let sides = [
                o.tokenizer.as_ref(),
                o.tokenizer_config.as_ref(),
                Some(&o.report),
                o.per_layer.as_ref(),
            ];
            let replaceable = crate::fsutil::check_replaceable(&o.package, true).and_then(|()| {
                sides
                    .into_iter()
                    .flatten()
                    .try_for_each(|p| crate::fsutil::check_replaceable(p, false))
            });
            return replaceable.map_err(JobError::Unwritable);
        }
        let files = [
            Some(&o.package),
            o.tokenizer.as_ref(),
            o.tokenizer_config.as_ref(),
            o.per_layer.as_ref(),
        ];
        let taken = files
            .into_iter()
            .flatten()
            .chain([&o.report])
            .find(|p| std::fs::symlink_metadata(p).is_ok());
        match taken {
            Some(p) => Err(ConvertError::Exists(p.clone()).into()),
            None => Ok(()),
        }
    }

    /// The prefill function's Q (0: one function), see [`check_prefill`].
    pub fn prefill_len(&self) -> Result<usize, ShapeError> {
        check_prefill(
            self.package.target,
            self.package.prefill_len,
            self.query_len,
            self.max_seq_len,
        )
    }

    /// The rows the prefill function returns: the recipe's or flag's choice, else the last
    /// one. A choice for a package without a prefill function is refused, not ignored.
    pub fn prefill_logits(&self) -> Result<crate::mil::contract::PrefillLogits, ShapeError> {
        match (self.package.prefill_logits, self.prefill_len()?) {
            (Some(_), 0) => Err(ShapeError::PrefillLogitsWithoutPrefill),
            (p, _) => Ok(p.unwrap_or_default()),
        }
    }

    fn is_gguf(&self) -> bool {
        self.source.is_file() && gguf::is_gguf_file(&self.source)
    }

    /// Open the checkpoint. A GGUF file is imported into the model cache keyed by its content
    /// hash (or found there from an earlier run); a note says which, and warns when the
    /// recipe re-quantizes projections the file already stores in as few bits.
    pub fn open(&self, progress: &dyn Progress) -> Result<Opened, JobError> {
        if !self.is_gguf() {
            let ckpt = open_checkpoint(&self.source, &self.source)?;
            return Ok(Opened { ckpt });
        }
        let import_err = |source| JobError::Import {
            path: self.source.clone(),
            source,
        };
        let header = gguf::header::read_header(&self.source).map_err(import_err)?;
        progress.begin("import", 1);
        progress.working_on("GGUF → checkpoint");
        let done = gguf::cache::import_cached(&self.source, progress);
        // A cached import has no stage of its own: this one finishes (a fresh import's
        // per-tensor stage replaced it).
        if done.is_ok() {
            progress.advance(1);
        }
        progress.end();
        let cached = done.map_err(import_err)?;
        let floor = match &header.projection_type {
            Some((ty, bits)) => {
                format!("; projections {ty} at {bits:.2}, the source's error floor")
            }
            None => String::new(),
        };
        progress.note(&format!(
            "{} {} ({:.2} bits/weight{floor}) {} {}",
            if cached.reused { "reusing" } else { "imported" },
            self.source.display(),
            header.bits_per_weight,
            if cached.reused { "from" } else { "into" },
            cached.dir.display()
        ));
        let ckpt = open_checkpoint(&cached.dir, &self.source)?;
        if let Some(note) =
            super::inspect::requantization_note(&header, &ckpt.slots(), &self.recipe)
        {
            progress.note(&note);
        }
        Ok(Opened { ckpt })
    }

    /// Predicted weights and, with a device, the budget; refuses (exit 1) a plan that does not
    /// fit unless over-budget plans are allowed.
    pub fn plan(&self, ckpt: &Checkpoint) -> Result<Plan, JobError> {
        let spec = ckpt.spec();
        check_context(spec, self.max_seq_len)?;
        crate::graph::decoder::check_spec(spec, self.max_seq_len).map_err(ConvertError::from)?;
        check_recipe(spec, &self.recipe)?;
        let per_layer_bits = per_layer_bits(spec, &self.recipe)?;
        let predicted = self.recipe.weights_bytes(&ckpt.package_slots());
        self.check_split(ckpt)?;
        let budget = match &self.device {
            Some(id) => {
                let devices = Devices::builtin();
                let limit = Limit::for_device(devices.get(id)?, self.increased_memory_limit);
                let shape = (self.max_seq_len, self.query_len);
                let b = budget::compute(spec, predicted, shape, per_layer_bits, &limit);
                if !b.fits && !self.allow_over_budget {
                    return Err(JobError::OverBudget(CheckFailed(format!(
                        "the plan needs {} on {id} but only {} is usable (largest max_seq_len \
                         that fits: {}); use a smaller --max-seq-len, or --allow-over-budget",
                        fmt_bytes(b.total_bytes),
                        fmt_bytes(b.usable_bytes),
                        fmt_count(b.max_seq_len_that_fits as u64)
                    ))));
                }
                Some(b)
            }
            None => None,
        };
        Ok(Plan {
            predicted_weight_bytes: predicted,
            budget,
        })
    }

    /// Refuse, before any expensive stage, a model the chain planner cannot split under the
    /// package limit (a unit larger than the limit): the recipe predicts every tensor's
    /// stored bytes, the same figures the planner splits after palettizing.
    fn check_split(&self, ckpt: &Checkpoint) -> Result<(), JobError> {
        let spec = ckpt.spec();
        let per_part = budget::split::part_overhead_bytes(spec, self.max_seq_len);
        let bytes =
            budget::split::ModelBytes::measure(spec, &ckpt.package_slots(), per_part, |s| {
                self.recipe.storage(s).bytes(s.numel())
            });
        budget::split::plan(&bytes, self.package_limit()?).map_err(|source| {
            ConvertError::Chain {
                path: self.output.clone(),
                source,
            }
        })?;
        Ok(())
    }

    /// What the package will be made from: hashes of the source files and of the calibration
    /// text, the applied recipe and the settings.
    pub fn inputs(&self) -> Result<Inputs, JobError> {
        let sources = if self.is_gguf() {
            let name = self
                .source
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            BTreeMap::from([(name, hash_file(&self.source)?)])
        } else {
            let ckpt = open_checkpoint(&self.source, &self.source)?;
            source_hashes(&ckpt)?
        };
        let calibration = match (&self.calibration, self.recipe.calibration()) {
            (_, None) => None,
            (Some(p), Some(_)) => Some(hash_file(p)?),
            (None, Some(_)) => Some(sha256_hex(texts::CALIBRATION_TEXT.as_bytes())),
        };
        let ranges = match (&self.activation_ranges, self.no_range_scaling) {
            (_, true) => serde_json::json!("off"),
            (Some(p), false) => serde_json::json!(hash_file(p)?),
            (None, false) => serde_json::json!("measured"),
        };
        let mut settings = BTreeMap::from([
            ("max_seq_len".into(), serde_json::json!(self.max_seq_len)),
            ("query_len".into(), serde_json::json!(self.query_len)),
            (
                "compute_precision".into(),
                serde_json::json!(self.compute_precision.as_str()),
            ),
            ("range_scaling".into(), ranges),
            ("device".into(), serde_json::json!(self.device)),
            (
                "increased_memory_limit".into(),
                serde_json::json!(self.increased_memory_limit),
            ),
            (
                "allow_over_budget".into(),
                serde_json::json!(self.allow_over_budget),
            ),
        ]);
        // Recorded only when given, so packages made before chains keep their fingerprint.
        if let Some(b) = self.max_package_size {
            settings.insert("max_package_size".into(), serde_json::json!(b));
        }
        Ok(Inputs::new(
            sources,
            self.recipe.to_toml(&self.package),
            calibration,
            settings,
        ))
    }

    /// The Python environment the serializer runs in, its packages imported.
    fn python(&self) -> Result<PythonEnv, JobError> {
        let env = PythonEnv::discover(self.python_env.as_deref())
            .map_err(crate::emit::EmitError::from)?;
        crate::emit::check_environment(&env)?;
        Ok(env)
    }

    /// Open, plan and convert.
    pub fn run(&self, progress: &dyn Progress) -> Result<ConvertSummary, JobError> {
        // Before the sources are hashed (minutes at 8B): a missing environment fails at once.
        self.python()?;
        let inputs = self.inputs()?;
        let opened = self.open(progress)?;
        self.convert(&opened, inputs, progress)
    }

    /// Convert an opened checkpoint (the plan is checked again first).
    pub fn convert(
        &self,
        opened: &Opened,
        inputs: Inputs,
        progress: &dyn Progress,
    ) -> Result<ConvertSummary, JobError> {
        let start = Instant::now();
        self.check()?;
        self.refuse_existing()?;
        let ckpt = &opened.ckpt;
        self.plan(ckpt)?;
        if let Some(conflict) = self
            .recipe
            .target_conflict(self.package.target, &ckpt.package_slots())
        {
            return Err(ConvertError::Target(conflict).into());
        }
        // NaN/Inf weights would poison every output; refuse them before any work.
        ckpt.check_finite().map_err(|source| JobError::NotFinite {
            path: self.source.clone(),
            source,
        })?;
        let given = self.given_ranges()?;
        // Find Python before the expensive stages so a missing environment fails fast.
        let python_env = self.python()?;
        progress.detail(&format!(
            "python environment: {}",
            python_env.root.display()
        ));

        let mut times = StageTimes {
            read: start.elapsed().as_secs_f64(),
            ..StageTimes::default()
        };
        let ranges = self.ranges(ckpt, given, &mut times, progress)?;
        // Each palettized tensor, as it is done (from worker threads).
        let tensor_done = |line: &quant::TensorReport| {
            progress.working_on(&line.name);
            progress.advance(1);
        };
        let weights = self.weights(ckpt, progress, &tensor_done)?;
        let applied = serde_json::json!({
            "origin": self.recipe.origin(),
            "toml": self.recipe.to_toml(&self.package),
            "tensors": weights
                .report()
                .tensors
                .iter()
                .map(|l| (l.name.clone(), l.decision.to_string()))
                .collect::<BTreeMap<_, _>>(),
        });
        let opts = ConvertOptions {
            checkpoint: self.source.clone(),
            output: self.output.clone(),
            max_seq_len: self.max_seq_len,
            query_len: self.query_len,
            precision: self.compute_precision,
            ranges,
            force: self.force,
            python_env,
            // A GGUF's contract hashes what its checkpoint lists, not the one file.
            source_hashes: (!self.is_gguf()).then(|| inputs.sources.clone()),
            inputs: Some(inputs),
            max_package_size: Some(self.package_limit()?),
            target: self.package.target,
            layout: self.package.layout,
            kv_cache: self.package.kv_cache,
            prefill_len: self.prefill_len()?,
            prefill_logits: self.prefill_logits()?,
            per_layer_bits: per_layer_bits(ckpt.spec(), &self.recipe)?,
        };
        Ok(super::convert::convert(
            ckpt, &opts, weights, applied, times, progress,
        )?)
    }

    /// The largest package before splitting: `--max-package-size`, else the device's, else
    /// [`budget::DEFAULT_MAX_PACKAGE_BYTES`].
    pub fn package_limit(&self) -> Result<u64, JobError> {
        if let Some(b) = self.max_package_size {
            return Ok(b);
        }
        Ok(match &self.device {
            Some(id) => Devices::builtin().get(id)?.max_package_size_bytes,
            None => budget::DEFAULT_MAX_PACKAGE_BYTES,
        })
    }

    /// The activation ranges of `--activation-ranges`, read.
    fn given_ranges(&self) -> Result<Option<ActivationRanges>, JobError> {
        let Some(p) = &self.activation_ranges else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(p).map_err(|source| JobError::Read {
            path: p.clone(),
            source,
        })?;
        let ranges = serde_json::from_str(&text).map_err(|source| JobError::Ranges {
            path: p.clone(),
            source,
        })?;
        Ok(Some(ranges))
    }

    /// The ranges the residual scale is chosen from: measured on the calibration text for an
    /// fp16 program without given ones, none without range scaling.
    fn ranges(
        &self,
        ckpt: &Checkpoint,
        given: Option<ActivationRanges>,
        times: &mut StageTimes,
        progress: &dyn Progress,
    ) -> Result<Option<ActivationRanges>, JobError> {
        let measure = self.compute_precision == ComputePrecision::Fp16
            && !self.no_range_scaling
            && given.is_none();
        if !measure {
            return Ok(if self.no_range_scaling { None } else { given });
        }
        let t = Instant::now();
        progress.begin("ranges", 1);
        progress.working_on("reference forward pass on calibration text");
        let r = super::ranges::measure_ranges(ckpt);
        if r.is_ok() {
            progress.advance(1);
        }
        progress.end();
        let r = r?;
        times.ranges = t.elapsed().as_secs_f64();
        progress.detail(&format!(
            "activation ranges: residual max |x| {:.0} ({}), {:.1} s",
            r.residual_max_abs.iter().fold(0.0f32, |a, &b| a.max(b)),
            r.source,
            times.ranges
        ));
        Ok(Some(r))
    }

    /// The weights, to be read and palettized package by package; a calibrated recipe fits
    /// its projections here, block by block, with a bar over the blocks.
    fn weights<'a>(
        &self,
        ckpt: &'a Checkpoint,
        progress: &dyn Progress,
        tensor_done: &'a (dyn Fn(&quant::TensorReport) + Sync),
    ) -> Result<WeightStream<'a>, JobError> {
        let (tokens, source) =
            texts::calibration_tokens(self.calibration.as_deref(), &self.recipe, ckpt)?;
        match &source {
            // Byte tokens are not what the model reads: say so by default, on one line.
            Some(source) if source.contains(texts::BYTE_TOKENS) => progress.note(&format!(
                "calibrating on {source}: without a tokenizer the statistics come from raw \
                 bytes, not the model's tokens; add tokenizer.json for a faithful calibration"
            )),
            Some(source) => progress.detail(&format!("calibrating on {source}")),
            None => {}
        }
        let t = Instant::now();
        // Fitted projections wait beside the destination, on the disk the package goes to.
        let spill = match self.output.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let stream = super::weight_stream::calibrated_stream(
            ckpt,
            &self.recipe,
            &tokens,
            Some(spill),
            progress,
            tensor_done,
        )?;
        if !tokens.is_empty() && self.recipe.calibrates(&ckpt.slots()) {
            progress.detail(&format!(
                "fitted the calibrated projections in {:.1} s",
                t.elapsed().as_secs_f64()
            ));
        }
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::EnvironmentError;

    #[test]
    fn exit_codes_follow_the_markers() {
        let over = JobError::OverBudget(CheckFailed("over".into()));
        assert_eq!(over.exit_code(), ExitCode::CheckFailed);
        let env = JobError::Emit(EmitError::Environment(EnvironmentError {
            message: "no python".into(),
            fix: "make setup".into(),
        }));
        assert_eq!(env.exit_code(), ExitCode::Environment);
        assert_eq!(env.to_string(), "Python environment unusable");
        let missing = JobError::Read {
            path: "x.json".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(missing.exit_code(), ExitCode::BadInput);
    }
}
