//! The whole `convert` pipeline as a library call: read → (palettize) → build → serialize, with
//! sidecar files and a summary. The command only parses flags and prints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use sha2::{Digest, Sha256};
use thiserror::Error;

use super::weights::WeightStream;
use crate::arch::ModelSpec;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::emit::{EmitError, EmitReport, Metadata, PythonEnv};
use crate::fsutil::{atomic_write, read_input};
use crate::graph::decoder::{self, StepOptions};
use crate::graph::scaling::{ActivationRanges, Scaling};
use crate::graph::{Graph, GraphError, Weight};
use crate::mil::contract::{self, Contract, Source, Target};
use crate::mil::DType;
use crate::model::calibrate::{self, ActivationStats, CalibrationOptions};
use crate::model::ReferenceError;
use crate::progress::Progress;
use crate::quant::{self, QuantError};
use crate::runtime::chat::MAX_CONFIG_BYTES;
use crate::runtime::text::MAX_TOKENIZER_BYTES;

/// Precision the program computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputePrecision {
    /// fp16 everywhere (Neural Engine, GPU and CPU).
    Fp16,
    /// fp32 program (CPU/GPU only on device): for diagnosis and models that cannot be kept in
    /// fp16 range.
    Fp32,
}

impl ComputePrecision {
    pub fn as_str(self) -> &'static str {
        match self {
            ComputePrecision::Fp16 => "fp16",
            ComputePrecision::Fp32 => "fp32",
        }
    }

    pub(super) fn dtype(self) -> DType {
        match self {
            ComputePrecision::Fp16 => DType::F16,
            ComputePrecision::Fp32 => DType::F32,
        }
    }
}

/// Everything a conversion needs besides the checkpoint's weights.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    pub checkpoint: PathBuf,
    /// The package path, ending in `.mlpackage`.
    pub output: PathBuf,
    pub max_seq_len: usize,
    pub query_len: usize,
    pub precision: ComputePrecision,
    /// Activation ranges for fp16 range safety; `None` means no scaling (recorded as such).
    pub ranges: Option<ActivationRanges>,
    pub force: bool,
    pub python_env: PythonEnv,
    /// What the package is made from, recorded in `X.report.json` (see [`Inputs`]).
    pub inputs: Option<Inputs>,
    /// Split into a chain of packages of at most this many bytes each when the model does not
    /// fit in one (docs/design.md, "Chained packages"); `None`: always one package.
    pub max_package_size: Option<u64>,
    /// The OS the package is built for.
    pub target: Target,
    /// The graph's layout (`--layout`, the recipe's `layout`).
    pub layout: contract::Layout,
    /// How the cache is passed (`--kv-cache`, the recipe's `kv_cache`).
    pub kv_cache: contract::KvCache,
    /// Q of a `prefill` function beside the `decode` one (iOS18 `--prefill-len`); 0: one
    /// function, `main`.
    pub prefill_len: usize,
}

impl ConvertOptions {
    /// The graph builder's options for these settings and the chosen residual scaling (one
    /// package and every part of a chain are built with the same).
    pub(super) fn step_options(&self, scaling: &Scaling) -> StepOptions {
        StepOptions {
            max_seq_len: self.max_seq_len,
            query_len: self.query_len,
            float: self.precision.dtype(),
            scaling: scaling.clone(),
            target: self.target,
            layout: self.layout,
            kv_cache: self.kv_cache,
        }
    }
}

/// Everything a package is made from, and a fingerprint of it: `batch` skips an export whose
/// package records the same fingerprint. The output path, `--force` and the Python
/// environment are not inputs (they do not change the bytes written).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Inputs {
    /// sha256 over the other fields.
    pub fingerprint: String,
    pub tool_version: String,
    /// sha256 of each source file (config, tokenizer, weights; or the .gguf), by file name.
    pub sources: BTreeMap<String, String>,
    /// The applied recipe, as TOML.
    pub recipe: String,
    /// sha256 of the calibration text, when the recipe calibrates.
    pub calibration: Option<String>,
    /// Shape, precision, range scaling and budget settings.
    pub settings: BTreeMap<String, serde_json::Value>,
}

impl Inputs {
    pub fn new(
        sources: BTreeMap<String, String>,
        recipe: String,
        calibration: Option<String>,
        settings: BTreeMap<String, serde_json::Value>,
    ) -> Self {
        let tool_version = crate::VERSION.to_string();
        let canonical = serde_json::json!({
            "tool_version": tool_version,
            "sources": sources,
            "recipe": recipe,
            "calibration": calibration,
            "settings": settings,
        });
        let fingerprint = sha256_hex(canonical.to_string().as_bytes());
        Inputs {
            fingerprint,
            tool_version,
            sources,
            recipe,
            calibration,
            settings,
        }
    }

    /// The inputs recorded in a package's `X.report.json`, if it has a readable one.
    pub fn recorded(package: &Path) -> Option<Inputs> {
        let report = Outputs::for_package(package).ok()?.report;
        let text = std::fs::read_to_string(report).ok()?;
        let value: serde_json::Value = serde_json::from_str(&text).ok()?;
        serde_json::from_value(value.get("inputs")?.clone()).ok()
    }
}

/// The checkpoint a package's report (`X.report.json` beside `X.mlpackage`) says it was
/// converted from, if the report exists and says so.
pub fn recorded_source(package: &Path) -> Option<PathBuf> {
    let report = crate::runtime::text::beside_package(package, "report.json");
    let text = crate::fsutil::read_input_text(&report, 64 << 20).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    value.get("source")?.as_str().map(PathBuf::from)
}

/// sha256 of bytes, as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Errors of the pipeline, each naming what it was working on.
#[derive(Debug, Error)]
pub enum ConvertError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error("building the graph: {0}")]
    Graph(#[from] GraphError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("output {0} must end in .mlpackage")]
    OutputName(PathBuf),
    #[error("output {} is not valid UTF-8: coremltools cannot write it; choose a UTF-8 name", .0.display())]
    OutputNotUtf8(PathBuf),
    #[error("{0} already exists (use --force to replace it)")]
    Exists(PathBuf),
    #[error("contract JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("palettizing: {0}")]
    Quant(#[from] QuantError),
    #[error("measuring activation ranges: {0}")]
    Calibration(#[from] ReferenceError),
    #[error("{path}: cannot tokenize the calibration text: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error(
        "tensor `{tensor}`: {granularity} palettization cannot be stored: LUT groups must run \
         along the output channels (axis 0) and divide them"
    )]
    Granularity { tensor: String, granularity: String },
    #[error("{}: cannot split into packages: {source}", .path.display())]
    Chain {
        path: PathBuf,
        #[source]
        source: crate::budget::chain::ChainError,
    },
    /// A prefill function was asked for a model that needs a chain of packages.
    #[error(
        "the model needs a chain of {parts} packages under the package size limit, and chains \
         are built with one function per part: use --prefill-len 0, or a larger \
         --max-package-size to keep one package with prefill and decode functions"
    )]
    PrefillChain { parts: usize },
    /// The recipe asks for what its target cannot store (grouped or 3-bit LUTs on iOS17).
    #[error("{0} (use --target ios18, or target = \"ios18\" in the recipe)")]
    Target(String),
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ConvertError + '_ {
    move |source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Time spent per stage, in seconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageTimes {
    pub read: f64,
    /// Measuring activation ranges on the calibration text (fp16 range safety).
    pub ranges: f64,
    pub palettize: f64,
    pub build: f64,
    pub serialize: f64,
    pub total: f64,
}

/// The files a conversion writes.
#[derive(Debug, Clone, Serialize)]
pub struct Outputs {
    pub package: PathBuf,
    pub tokenizer: Option<PathBuf>,
    /// The checkpoint's tokenizer_config.json (chat template, special tokens), for `run --chat`.
    pub tokenizer_config: Option<PathBuf>,
    pub report: PathBuf,
}

impl Outputs {
    /// `X.mlpackage` → `X.tokenizer.json`, `X.tokenizer_config.json`, `X.report.json`.
    pub fn for_package(package: &Path) -> Result<Self, ConvertError> {
        // coremltools takes the path as text: a path that is not UTF-8 is refused here,
        // before anything is written (issue 27, item 14).
        if package.to_str().is_none() {
            return Err(ConvertError::OutputNotUtf8(package.to_path_buf()));
        }
        let name = package
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some(stem) = name.strip_suffix(".mlpackage").filter(|s| !s.is_empty()) else {
            return Err(ConvertError::OutputName(package.to_path_buf()));
        };
        let side = |suffix: &str| package.with_file_name(format!("{stem}.{suffix}"));
        Ok(Outputs {
            package: package.to_path_buf(),
            tokenizer: Some(side("tokenizer.json")),
            tokenizer_config: Some(side("tokenizer_config.json")),
            report: side("report.json"),
        })
    }
}

/// What `convert` reports (also written as `X.report.json`).
#[derive(Debug, Clone, Serialize)]
pub struct ConvertSummary {
    pub outputs: Outputs,
    pub contract: Contract,
    /// Bytes of the package on disk.
    pub package_bytes: u64,
    /// Bytes of weight.bin.
    pub weight_bin_bytes: u64,
    /// Bytes the graph's constants take (what the budget's weights term predicts).
    pub predicted_weight_bytes: u64,
    pub parameters: u64,
    /// weight.bin bits per checkpoint parameter.
    pub bits_per_weight: f64,
    pub times: StageTimes,
    pub emit: EmitReport,
    /// Per-tensor storage: checkpoint tensor → `fp16` or `lut<n>`.
    pub tensors: BTreeMap<String, String>,
    /// The palettizer's per-tensor report (sizes, MSE, SNR).
    pub palettize: Option<quant::Report>,
    /// What the package was made from (absent when the caller did not say).
    pub inputs: Option<Inputs>,
    /// The checkpoint directory converted (absolute): `validate PKG` without `--against`
    /// validates against it while its files still hash as the contract records.
    pub source: PathBuf,
    /// The chain's description when the model was split into several packages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<crate::mil::chain::ChainFile>,
}

/// The names of the files whose hashes identify the source checkpoint.
const HASHED_FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

pub fn sha256_file(path: &Path) -> Result<String, ConvertError> {
    crate::fsutil::sha256_file(path).map_err(io_err(path))
}

/// sha256 of config, tokenizer and weight files, by file name.
pub fn source_hashes(ckpt: &Checkpoint) -> Result<BTreeMap<String, String>, ConvertError> {
    let mut out = BTreeMap::new();
    let mut paths: Vec<PathBuf> = HASHED_FILES
        .iter()
        .map(|f| ckpt.dir().join(f))
        .filter(|p| p.is_file())
        .collect();
    paths.extend(ckpt.files().map(Path::to_path_buf));
    for p in paths {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.insert(name, sha256_file(&p)?);
    }
    Ok(out)
}

/// The contract for a checkpoint and options.
pub fn contract_for(
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    scaling: &Scaling,
    recipe: serde_json::Value,
    files: BTreeMap<String, String>,
) -> Result<Contract, ConvertError> {
    let spec = ckpt.spec();
    let dims = (
        opts.max_seq_len,
        opts.query_len,
        spec.num_hidden_layers,
        spec.num_key_value_heads,
        spec.head_dim,
        spec.vocab_size,
    );
    let (s, q, l, hkv, d, v) = dims;
    let precision = opts.precision.as_str();
    let (inputs, outputs, states) = match opts.kv_cache {
        contract::KvCache::Io => {
            let (i, o) = Contract::io(s, q, l, hkv, d, v, precision);
            (i, o, Vec::new())
        }
        contract::KvCache::State => Contract::state_io(s, q, l, hkv, d, v, precision),
    };
    Ok(Contract {
        version: contract::CONTRACT_VERSION,
        target: opts.target,
        layout: opts.layout,
        kv_cache: opts.kv_cache,
        states,
        max_seq_len: opts.max_seq_len,
        query_len: opts.query_len,
        num_layers: spec.num_hidden_layers,
        num_kv_heads: spec.num_key_value_heads,
        head_dim: spec.head_dim,
        vocab_size: spec.vocab_size,
        inputs,
        outputs,
        bos_token_id: spec.bos_token_id,
        eos_token_ids: spec.eos_token_ids.clone(),
        rope: serde_json::json!({
            "theta": spec.rope_theta,
            "scaling": spec.rope_scaling,
            "layout": "rotate_half",
        }),
        recipe,
        scaling: serde_json::to_value(scaling)?,
        compute_precision: opts.precision.as_str().to_string(),
        source: Source {
            architecture: spec.architecture.hf_name().to_string(),
            files,
        },
        tool: "hf2coreml".to_string(),
        tool_version: crate::VERSION.to_string(),
        functions: function_specs(opts, spec),
    })
}

/// The functions a multifunction package declares: `prefill` then `decode`, each with its Q
/// and I/O; none for one function.
fn function_specs(opts: &ConvertOptions, spec: &ModelSpec) -> Vec<contract::FunctionSpec> {
    if opts.prefill_len == 0 {
        return Vec::new();
    }
    [
        (contract::PREFILL, opts.prefill_len),
        (contract::DECODE, opts.query_len),
    ]
    .into_iter()
    .map(|(name, q)| {
        // A stateful package's functions declare the one state the contract lists.
        let dims = (
            opts.max_seq_len,
            q,
            spec.num_hidden_layers,
            spec.num_key_value_heads,
            spec.head_dim,
            spec.vocab_size,
        );
        let (s, q, l, hkv, d, v) = dims;
        let precision = opts.precision.as_str();
        let (inputs, outputs) = match opts.kv_cache {
            contract::KvCache::Io => Contract::io(s, q, l, hkv, d, v, precision),
            contract::KvCache::State => {
                let (i, o, _) = Contract::state_io(s, q, l, hkv, d, v, precision);
                (i, o)
            }
        };
        contract::FunctionSpec {
            name: name.to_string(),
            query_len: q,
            inputs,
            outputs,
        }
    })
    .collect()
}

/// The residual scale for these options: none for fp32 programs or without measurements.
pub fn scaling_for(precision: ComputePrecision, ranges: Option<&ActivationRanges>) -> Scaling {
    match (precision, ranges) {
        (ComputePrecision::Fp32, _) => Scaling::identity("fp32 program: no range scaling needed"),
        (ComputePrecision::Fp16, Some(r)) => Scaling::choose(r),
        (ComputePrecision::Fp16, None) => {
            Scaling::identity("no activation ranges measured: residual stream not scaled")
        }
    }
}

/// The calibration text shipped with the tool (also used by `reference` tests).
pub const CALIBRATION_TEXT: &str = include_str!("../../fixtures/calibration.txt");

/// Token ids of the calibration text: through the checkpoint's tokenizer.json when it has one;
/// otherwise (test fixtures) its bytes modulo the vocabulary, which still drives every layer
/// with varied tokens. The second value says which.
pub fn calibration_tokens(ckpt: &Checkpoint) -> Result<(Vec<u32>, String), ConvertError> {
    text_tokens(ckpt, CALIBRATION_TEXT, "calibration.txt")
}

/// How a text tokenized without a tokenizer is described: one token per byte.
pub const BYTE_TOKENS: &str = "byte tokens";

/// Token ids of any text, as [`calibration_tokens`] does it; `label` names the text.
pub fn text_tokens(
    ckpt: &Checkpoint,
    text: &str,
    label: &str,
) -> Result<(Vec<u32>, String), ConvertError> {
    let path = ckpt.dir().join("tokenizer.json");
    if path.is_file() {
        let tok =
            crate::runtime::text::load_tokenizer(&path).map_err(|e| ConvertError::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let enc = tok
            .encode(text, false)
            .map_err(|e| ConvertError::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let ids = enc.get_ids().to_vec();
        let n = ids.len();
        return Ok((ids, format!("{label}, {n} tokens (tokenizer.json)")));
    }
    let v = ckpt.spec().vocab_size as u32;
    let ids: Vec<u32> = text.bytes().map(|b| b as u32 % v).collect();
    let n = ids.len();
    Ok((
        ids,
        format!("{label}, {n} {BYTE_TOKENS} (no tokenizer.json)"),
    ))
}

/// Per-site residual maxima from calibration statistics.
pub fn ranges_from_stats(stats: &ActivationStats, source: String) -> ActivationRanges {
    let mut residual_max_abs = vec![stats.embedding_max_abs];
    residual_max_abs.extend(stats.layers.iter().map(|l| {
        l.max_abs_residual_after_attention
            .max(l.max_abs_residual_after_mlp)
    }));
    residual_max_abs.push(stats.final_norm_max_abs);
    ActivationRanges {
        residual_max_abs,
        source,
    }
}

/// Calibration tokens used for range measurement: one 512-token segment. Massive activations
/// appear within the first tokens of a sequence, and SQUARE_HEADROOM covers inputs larger than
/// measured; a second segment would double the cost of this stage for little new information.
pub const CALIBRATION_TOKENS: usize = 512;

/// Run the float reference over the calibration text and collect residual-stream ranges.
pub fn measure_ranges(ckpt: &Checkpoint) -> Result<ActivationRanges, ConvertError> {
    let (mut tokens, source) = calibration_tokens(ckpt)?;
    tokens.truncate(CALIBRATION_TOKENS);
    let source = format!("{source}, first {} used", tokens.len());
    let stats = calibrate::calibrate(ckpt, &tokens, &CalibrationOptions::default())?;
    crate::fsutil::release_free_memory();
    Ok(ranges_from_stats(&stats, source))
}

pub use crate::fsutil::dir_bytes;

/// weight.bin inside a package.
pub fn weight_bin(package: &Path) -> PathBuf {
    package.join("Data/com.apple.CoreML/weights/weight.bin")
}

/// Run the conversion. `weights` reads and palettizes each checkpoint tensor when a package
/// needs it (a chain takes them part by part); `recipe` is the applied recipe as recorded in
/// the contract.
pub fn convert(
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    mut weights: WeightStream<'_>,
    recipe: serde_json::Value,
    mut times: StageTimes,
    progress: &dyn Progress,
) -> Result<ConvertSummary, ConvertError> {
    let start = Instant::now();
    let outputs = Outputs::for_package(&opts.output)?;
    if opts.output.exists() && !opts.force {
        return Err(ConvertError::Exists(opts.output.clone()));
    }
    let spec = ckpt.spec().clone();
    let parameters: u64 = ckpt.slots().iter().map(|s| s.numel() as u64).sum();
    if let Some(limit) = opts.max_package_size {
        let plan = super::chain::plan(ckpt, opts, &weights, limit)?;
        if !plan.is_single() {
            // Refused before anything is built: a chain of stateful parts is not supported.
            crate::graph::decoder::check_kv_cache(opts.kv_cache, opts.target, opts.layout, false)?;
            if opts.prefill_len > 0 {
                return Err(ConvertError::PrefillChain {
                    parts: plan.parts.len(),
                });
            }
            let job = super::chain::ChainJob {
                plan,
                parameters,
                recipe,
            };
            return super::chain::convert_chain(ckpt, opts, weights, job, times, progress);
        }
    }
    // One package: it is under the size limit, so all its weights are held at once.
    progress.begin(
        "palettize",
        weights.report().totals.palettized_tensors as u64,
    );
    let taken = weights.take_all();
    progress.end();
    let taken = taken?;
    let streamed = weights.finish();
    times.palettize = streamed.secs;
    let (tensors, palettize) = (streamed.labels, Some(streamed.report));

    let t = Instant::now();
    let scaling = scaling_for(opts.precision, opts.ranges.as_ref());
    let step = opts.step_options(&scaling);
    let graphs = build_functions(&spec, taken, &step, opts.prefill_len)?;
    let predicted_weight_bytes = graphs[0].1.const_bytes();
    let files = source_hashes(ckpt)?;
    let contract = contract_for(ckpt, opts, &scaling, recipe, files)?;
    let model_name = ckpt
        .dir()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let meta = Metadata::for_contract(&contract, &model_name)?;
    times.build = t.elapsed().as_secs_f64();

    let t = Instant::now();
    progress.begin("serialize", 1);
    progress.working_on("coremltools");
    let emit = match graphs.len() {
        1 => {
            let (_, graph) = graphs.into_iter().next().expect("one graph");
            crate::emit::emit(graph, &meta, &opts.python_env, &opts.output, opts.force)
        }
        _ => crate::emit::emit_functions(
            graphs,
            contract::DECODE,
            &meta,
            &opts.python_env,
            &opts.output,
            opts.force,
        ),
    };
    if emit.is_ok() {
        progress.advance(1);
    }
    progress.end();
    let emit = emit?;
    times.serialize = t.elapsed().as_secs_f64();

    let mut outputs = outputs;
    write_sidecars(ckpt, &mut outputs)?;
    let package_bytes = dir_bytes(&outputs.package).map_err(io_err(&outputs.package))?;
    let wb = weight_bin(&outputs.package);
    let weight_bin_bytes = std::fs::metadata(&wb).map_err(io_err(&wb))?.len();
    times.total = times.read + times.ranges + streamed.fit_secs + start.elapsed().as_secs_f64();
    let summary = ConvertSummary {
        outputs,
        contract,
        package_bytes,
        weight_bin_bytes,
        predicted_weight_bytes,
        parameters,
        bits_per_weight: weight_bin_bytes as f64 * 8.0 / parameters.max(1) as f64,
        times,
        emit,
        tensors,
        palettize,
        inputs: opts.inputs.clone(),
        source: std::path::absolute(ckpt.dir()).unwrap_or_else(|_| ckpt.dir().to_path_buf()),
        chain: None,
    };
    write_report(&summary)?;
    Ok(summary)
}

/// The program's functions: `main` alone, or with `prefill_len` > 0 `prefill` (Q =
/// `prefill_len`) and `decode` (Q = `step.query_len`), built from the same weights. The decode
/// graph is built from a copy of them, so they are held twice while the graphs are built;
/// the emitter hands every constant the two share to coremltools once.
fn build_functions(
    spec: &ModelSpec,
    weights: BTreeMap<String, Weight>,
    step: &StepOptions,
    prefill_len: usize,
) -> Result<Vec<(String, Graph)>, ConvertError> {
    if prefill_len == 0 {
        return Ok(vec![(
            "main".to_string(),
            decoder::build(spec, weights, step)?,
        )]);
    }
    let decode = decoder::build(spec, weights.clone(), step)?;
    let prefill_step = StepOptions {
        query_len: prefill_len,
        ..step.clone()
    };
    let prefill = decoder::build(spec, weights, &prefill_step)?;
    Ok(vec![
        (contract::PREFILL.to_string(), prefill),
        (contract::DECODE.to_string(), decode),
    ])
}

/// The tokenizer and its config beside the package, each written atomically after the package;
/// `outputs` loses the ones the checkpoint does not have.
pub(super) fn write_sidecars(ckpt: &Checkpoint, outputs: &mut Outputs) -> Result<(), ConvertError> {
    let tokenizer_src = ckpt.dir().join("tokenizer.json");
    if tokenizer_src.is_file() {
        let dest = outputs.tokenizer.clone().unwrap_or_default();
        let bytes =
            read_input(&tokenizer_src, MAX_TOKENIZER_BYTES).map_err(io_err(&tokenizer_src))?;
        atomic_write(&dest, &bytes).map_err(io_err(&dest))?;
    } else {
        outputs.tokenizer = None;
    }
    let config_src = ckpt.dir().join("tokenizer_config.json");
    match outputs.tokenizer_config.clone() {
        Some(dest) if config_src.is_file() => {
            let bytes = read_input(&config_src, MAX_CONFIG_BYTES).map_err(io_err(&config_src))?;
            atomic_write(&dest, &bytes).map_err(io_err(&dest))?;
        }
        _ => outputs.tokenizer_config = None,
    }
    Ok(())
}

/// `X.report.json`: the summary without the stage times.
pub(super) fn write_report(summary: &ConvertSummary) -> Result<(), ConvertError> {
    // The file holds what the package is, not how long it took: the same inputs write the
    // same bytes. Stage times are in the returned summary (`convert --json`).
    let mut recorded = serde_json::to_value(summary)?;
    if let Some(map) = recorded.as_object_mut() {
        map.remove("times");
    }
    let json = serde_json::to_vec_pretty(&recorded)?;
    atomic_write(&summary.outputs.report, &json).map_err(io_err(&summary.outputs.report))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecar_names() {
        let o = Outputs::for_package(Path::new("out/smol.mlpackage")).unwrap();
        assert_eq!(o.report, Path::new("out/smol.report.json"));
        assert_eq!(
            o.tokenizer.as_deref(),
            Some(Path::new("out/smol.tokenizer.json"))
        );
        assert!(Outputs::for_package(Path::new("out/smol")).is_err());
        assert!(Outputs::for_package(Path::new(".mlpackage")).is_err());
    }

    #[test]
    fn fp32_and_unmeasured_programs_are_not_scaled() {
        let r = ActivationRanges {
            residual_max_abs: vec![24_900.0],
            source: "t".into(),
        };
        assert!(scaling_for(ComputePrecision::Fp32, Some(&r)).is_identity());
        assert!(scaling_for(ComputePrecision::Fp16, None).is_identity());
        assert_eq!(
            scaling_for(ComputePrecision::Fp16, Some(&r)).residual_scale,
            1.0 / 128.0
        );
    }
}
