//! `validate PKG --against DIR`: read the saved package (never the graph we meant to build),
//! check its contract, compare its weights with the checkpoint, run it on the CPU over a text
//! and compare its logits with the float reference, apply the gates.

use std::path::{Path, PathBuf};

use half::f16;

use super::gates::{default_gates, Gate, RecipeKind};
use super::metrics::MetricError;
use super::metrics::{compare_logits, ErrorSum, WeightError};
use super::report::{ActivationRange, ContractItem, ValidationReport};
use crate::checkpoint::CheckpointError;
use crate::checkpoint::{Checkpoint, TensorView};
use crate::mil::chain::{ChainFile, ChainPart};
use crate::mil::contract::{self, Contract};
use crate::mlpackage::PackageError;
use crate::mlpackage::{MlPackage, Values};
use crate::model::layerwise::{logits_layerwise, ReferencePath, LAYERWISE_BACKEND};
use crate::model::Reference;
use crate::model::ReferenceError;
use crate::progress::Progress;
use crate::runtime::chain::Saved;
use crate::runtime::generate::GenerateError;
use crate::runtime::generate::{GenerateOptions, Generator};
use crate::runtime::interp::{Compute, Options, Stats};
use crate::runtime::{RuntimeError, StepModel, StepOutput};

/// Why validation could not run to a verdict (a failed gate is not an error: it is in the
/// report).
#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    #[error(
        "the float reference of {} computes {what} at every position: a package cannot be \
         judged against it (check the checkpoint's config and weights)",
        .checkpoint.display()
    )]
    DegenerateReference {
        checkpoint: PathBuf,
        what: &'static str,
    },
    #[error(transparent)]
    Package(#[from] PackageError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Metric(#[from] MetricError),
    #[error(transparent)]
    Lint(#[from] crate::lint::LintError),
    #[error(
        "{package} was not converted from {checkpoint}: the package's dimensions differ from \
         the checkpoint's ({differ})"
    )]
    NotFromCheckpoint {
        package: std::path::PathBuf,
        checkpoint: std::path::PathBuf,
        differ: String,
    },
    /// Fewer than two positions to score: says which bound cut them.
    #[error("{0}")]
    TextTooShort(String),
    /// `--cross-check` refused, or the cross-check could not run.
    #[error("cross-check: {0}")]
    CrossCheck(String),
    #[error(transparent)]
    Emit(#[from] crate::emit::EmitError),
    #[error("the generator recorded no logits")]
    NoLogits,
    #[error("package weight `{package}` has {got} elements, checkpoint tensor `{tensor}` has {expected}")]
    WeightSize {
        package: String,
        tensor: String,
        got: usize,
        expected: usize,
    },
}

/// The evaluation passage shipped with the tool (distinct from the calibration text).
pub const EVALUATION_TEXT: &str = include_str!("../../assets/evaluation.txt");

/// What to validate against.
pub struct ValidateOptions<'a> {
    /// The evaluation text as token ids (without BOS: the contract's BOS is added here).
    pub tokens: &'a [u32],
    /// What the tokens are, for the report (file name and how it was tokenized).
    pub text_name: &'a str,
    /// Explicit gates; empty → the defaults for the package's recipe kind.
    pub gates: Vec<Gate>,
    pub interp: Options,
    /// Evaluate at most this many tokens (also capped by the package's S).
    pub max_tokens: Option<usize>,
    /// f32 weights above which the reference runs block by block
    /// ([`crate::model::layerwise::REFERENCE_BUDGET`] by default; 0: always).
    pub reference_budget: u64,
    /// Also run the package's program on Apple's Core AI runtime and compare
    /// ([`super::crosscheck`]).
    pub cross_check: bool,
}

/// A package (or chain) step that also collects range statistics.
struct Instrumented<'p> {
    pkg: &'p Saved,
    stats: Stats,
    progress: &'p dyn Progress,
    /// Text tokens not scored yet: each step scores up to Q of them.
    unscored: usize,
}

impl StepModel for Instrumented<'_> {
    fn contract(&self) -> &Contract {
        self.pkg.contract()
    }
    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        let out = self.pkg.step_with_stats(
            input_ids,
            position,
            key_cache,
            value_cache,
            Some(&mut self.stats),
        )?;
        let scored = input_ids.len().min(self.unscored);
        self.unscored -= scored;
        self.progress.advance(scored as u64);
        Ok(out)
    }
    fn state_rows(&self, rows: usize) -> Result<(Vec<f16>, Vec<f16>), RuntimeError> {
        self.pkg.state_rows(rows)
    }
}

/// Refuse a checkpoint the package was not converted from, before anything is compared: its
/// dimensions differ from the ones the contract records. (A re-saved or imported config with
/// the same model passes; weights that differ are what the gates measure.)
pub(super) fn check_source(
    c: &Contract,
    ckpt: &Checkpoint,
    pkg: &Path,
) -> Result<(), ValidateError> {
    let spec = ckpt.spec();
    let pairs = [
        ("layers", c.num_layers, spec.num_hidden_layers),
        ("kv heads", c.num_kv_heads, spec.num_key_value_heads),
        ("head_dim", c.head_dim, spec.head_dim),
        ("vocab", c.vocab_size, spec.vocab_size),
    ];
    let differ: Vec<String> = pairs
        .iter()
        .filter(|(_, a, b)| a != b)
        .map(|(k, a, b)| format!("{k} {a} vs {b}"))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(ValidateError::NotFromCheckpoint {
        package: pkg.to_path_buf(),
        checkpoint: ckpt.dir().to_path_buf(),
        differ: differ.join(", "),
    })
}

/// Run every check; the report says what passed.
pub fn validate(
    pkg_path: &Path,
    ckpt: &Checkpoint,
    opts: &ValidateOptions,
) -> Result<ValidationReport, ValidateError> {
    validate_with_progress(pkg_path, ckpt, opts, &crate::progress::Silent)
}

/// [`validate`], reporting its long stages to `progress`: the reference's logits ("reference",
/// one step) and the package's over the text ("score", one step per token).
pub fn validate_with_progress(
    pkg_path: &Path,
    ckpt: &Checkpoint,
    opts: &ValidateOptions,
    progress: &dyn Progress,
) -> Result<ValidationReport, ValidateError> {
    let package = Saved::load(pkg_path, opts.interp)?;
    if opts.cross_check {
        super::crosscheck::check_request(&package, opts.interp.compute == Compute::F32)?;
    }
    let on_apples_runtime = match &package {
        Saved::CoreAi(_) => true,
        Saved::Chain(ch) => ch.is_coreai(),
        Saved::Package(_) => false,
    };
    if on_apples_runtime {
        return super::coreai::validate_asset(pkg_path, &package, ckpt, opts, progress);
    }
    let raws = match &package {
        Saved::Package(_) => vec![MlPackage::open(pkg_path)?],
        Saved::CoreAi(_) => unreachable!("validated above"),
        Saved::Chain(ch) => ch
            .chain()
            .parts
            .iter()
            .map(|p| MlPackage::open(&ChainFile::part_path(pkg_path, p)))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let c = package.contract().clone();
    check_source(&c, ckpt, pkg_path)?;
    let tokens = text_tokens(&c, opts)?;
    let (backend, expected) = reference_logits(ckpt, &tokens, opts.reference_budget, progress)?;
    let mut report = ValidationReport::new(
        &pkg_path.display().to_string(),
        &ckpt.dir().display().to_string(),
        &backend,
        opts.text_name,
    );
    report.contract = match &package {
        Saved::Package(_) => {
            let mut items = check_contract(&raws[0], &c, ckpt);
            items.extend(super::functions::check_functions(&raws[0], &c));
            items
        }
        Saved::Chain(ch) => {
            let mut items = check_chain(ch.chain(), &raws, ckpt);
            items.extend(check_hashes(pkg_path, ch.chain()));
            items
        }
        Saved::CoreAi(_) => unreachable!("validated above"),
    };
    report.lint = Some(crate::lint::lint_saved(
        pkg_path,
        &crate::lint::Policy::default(),
    )?);
    let programs = package.programs();
    let (weights, min_bits) = check_weights(&raws, ckpt, &programs)?;
    report.weights = weights;

    let keep = super::functions::prefill_positions(&package, tokens.len());
    let (got, stats, cache) = score_tokens_keeping(&package, &tokens, progress, keep)?;
    let comparison = compare_logits(&expected, &got, &tokens)?;
    report.contract.extend(super::functions::check_prefill(
        &package, &tokens, &got, &cache,
    )?);
    report.activations = stats
        .ops
        .iter()
        .map(|(kind, s)| ActivationRange {
            op_kind: kind.clone(),
            max_abs: s.max_abs as f64,
            nonfinite: s.non_finite,
            first_nonfinite_op: None,
        })
        .collect();
    let gates = if opts.gates.is_empty() {
        default_gates(RecipeKind::from_min_bits(min_bits))
    } else {
        opts.gates.clone()
    };
    report.set_behaviour(comparison, &gates);
    if opts.cross_check {
        report.cross_check = Some(super::crosscheck::cross_check(
            &package, &tokens, &expected, &got, progress,
        )?);
    }
    Ok(report)
}

/// The package's logits at every position of `tokens` (one step per token, or per Q of them),
/// and the range statistics its steps collected.
pub(super) fn score_tokens(
    package: &Saved,
    tokens: &[u32],
    progress: &dyn Progress,
) -> Result<(Vec<Vec<f32>>, Stats), ValidateError> {
    let (got, stats, _) = score_tokens_keeping(package, tokens, progress, 0)?;
    Ok((got, stats))
}

/// The keys and values of a model's first positions: [L, Hkv, P, D] each.
pub(super) type CacheRows = (Vec<f16>, Vec<f16>);

/// [`score_tokens`], also keeping the cache rows of the first `keep` positions as the
/// default function wrote them (what `prefill` must write too).
pub(super) fn score_tokens_keeping(
    package: &Saved,
    tokens: &[u32],
    progress: &dyn Progress,
    keep: usize,
) -> Result<(Vec<Vec<f32>>, Stats, CacheRows), ValidateError> {
    let mut gen = Generator::new(Instrumented {
        pkg: package,
        stats: Stats::default(),
        progress,
        unscored: tokens.len(),
    })?;
    progress.begin("score", tokens.len() as u64);
    progress.working_on("tokens through the package");
    let out = gen.generate(
        tokens,
        &GenerateOptions {
            max_new_tokens: 0,
            record_logits: true,
            ..GenerateOptions::default()
        },
        &mut |_| Ok(()),
    );
    progress.end();
    let rows = out?.logits.ok_or(ValidateError::NoLogits)?;
    let got: Vec<Vec<f32>> = (0..rows.rows())
        .filter_map(|t| rows.row(t).map(|r| r.to_vec()))
        .collect();
    let kept = match keep.min(tokens.len()) {
        0 => (Vec::new(), Vec::new()),
        keep => {
            let (k, v) = gen.valid_rows()?;
            let d = package.contract().head_dim;
            let first = |x: Vec<f16>| -> Vec<f16> {
                x.chunks_exact(tokens.len() * d)
                    .flat_map(|block| &block[..keep * d])
                    .copied()
                    .collect()
            };
            (first(k), first(v))
        }
    };
    Ok((got, gen.into_model().stats, kept))
}

/// The evaluation tokens: BOS (when the contract has one), then the text, at most
/// `max_tokens` and the package's S.
pub(super) fn text_tokens(c: &Contract, opts: &ValidateOptions) -> Result<Vec<u32>, ValidateError> {
    let mut tokens: Vec<u32> = opts.tokens.to_vec();
    if let Some(bos) = c.bos_token_id {
        tokens.insert(0, bos);
    }
    let cap = opts.max_tokens.unwrap_or(usize::MAX).min(c.max_seq_len);
    let why = if tokens.len() < 2 {
        format!(
            "the evaluation text has {} token(s) (with BOS): at least 2 are needed",
            tokens.len()
        )
    } else if cap < 2 && opts.max_tokens.is_some_and(|m| m < c.max_seq_len) {
        format!("--max-tokens {cap} leaves fewer than 2 positions to score: give at least 2",)
    } else if cap < 2 {
        format!(
            "the package holds {} position(s) (max_seq_len): at least 2 are needed to score \
             a next token",
            c.max_seq_len
        )
    } else {
        tokens.truncate(cap);
        return Ok(tokens);
    };
    Err(ValidateError::TextTooShort(why))
}

/// The float reference's logits at every position of `tokens`, and what computed them (refused
/// when they say nothing: the same value for every token at every position, or a non-finite
/// one, as a config whose constants overflow gives; a package built from it would agree): the
/// whole model in f32 (candle-transformers where it can express the checkpoint) while its f32
/// weights fit `budget`, else block by block, one block's weights alive
/// ([`logits_layerwise`]). The reference is dropped on return, before the package runs, so
/// the two peaks do not add.
pub(super) fn reference_logits(
    ckpt: &Checkpoint,
    tokens: &[u32],
    budget: u64,
    progress: &dyn Progress,
) -> Result<(String, Vec<Vec<f32>>), ValidateError> {
    match ReferencePath::choose(ckpt, budget) {
        ReferencePath::Whole => {
            let mut reference = Reference::load(ckpt)?;
            progress.begin("reference", 1);
            progress.working_on(&format!("{} tokens", tokens.len()));
            let expected = reference.logits_all(tokens);
            if expected.is_ok() {
                progress.advance(1);
            }
            progress.end();
            Ok((reference.backend().as_str().to_string(), expected?))
        }
        ReferencePath::Layerwise => {
            progress.begin("reference", ckpt.spec().num_hidden_layers as u64);
            progress.working_on(&format!("{} tokens, block by block", tokens.len()));
            let expected = logits_layerwise(ckpt, tokens, &mut |_| progress.advance(1));
            progress.end();
            Ok((LAYERWISE_BACKEND.to_string(), expected?))
        }
    }
    .and_then(|(backend, rows)| match degenerate(&rows) {
        None => Ok((backend, rows)),
        Some(what) => Err(ValidateError::DegenerateReference {
            checkpoint: ckpt.dir().to_path_buf(),
            what,
        }),
    })
}

/// What makes reference logits say nothing, if anything does.
fn degenerate(rows: &[Vec<f32>]) -> Option<&'static str> {
    let flat = |r: &Vec<f32>| r.iter().all(|&x| x == r[0]);
    if rows.iter().flatten().any(|x| !x.is_finite()) {
        Some("a non-finite logit")
    } else if !rows.is_empty() && rows.iter().all(flat) {
        Some("one value for every token")
    } else {
        None
    }
}

pub(super) fn item(what: &str, expected: impl ToString, found: impl ToString) -> ContractItem {
    let (expected, found) = (expected.to_string(), found.to_string());
    ContractItem {
        ok: expected == found,
        what: what.to_string(),
        expected,
        found,
    }
}

/// (a): spec version, contract dimensions against the checkpoint, I/O names, dtypes, shapes.
fn check_contract(pkg: &MlPackage, c: &Contract, ckpt: &Checkpoint) -> Vec<ContractItem> {
    let spec = ckpt.spec();
    let mut items = vec![
        item(
            &format!("specificationVersion ({})", c.target.as_str()),
            c.target.spec_version(),
            pkg.spec_version(),
        ),
        item("contract version", contract::CONTRACT_VERSION, c.version),
        item("layers", spec.num_hidden_layers, c.num_layers),
        item("kv heads", spec.num_key_value_heads, c.num_kv_heads),
        item("head_dim", spec.head_dim, c.head_dim),
        item("vocab", spec.vocab_size, c.vocab_size),
    ];
    let float = if c.compute_precision == "fp32" {
        "fp32"
    } else {
        "fp16"
    };
    // An io package has the cache inputs and update outputs; a stateful one (`kv_cache =
    // "state"`) has neither, and its one state instead.
    let (inputs, outputs, states) = c.expected_io(float);
    let desc = pkg.description();
    for (kind, want, have) in [
        ("input", inputs, &desc.inputs),
        ("output", outputs, &desc.outputs),
        ("state", states, &desc.states),
    ] {
        let count = want.len();
        for w in want {
            let found = have.iter().find(|f| f.name == w.name);
            let shape = |s: &[i64]| format!("{s:?}");
            let want_shape: Vec<i64> = w.shape.iter().map(|&d| d as i64).collect();
            items.push(match found {
                Some(f) => item(
                    &format!("{kind} `{}`", w.name),
                    format!("{} {}", w.dtype, shape(&want_shape)),
                    format!("{} {}", f.dtype, shape(&f.shape)),
                ),
                None => item(&format!("{kind} `{}`", w.name), "present", "missing"),
            });
        }
        items.push(item(&format!("{kind} count"), count, have.len()));
    }
    items.push(item(
        "every shape fixed",
        true,
        desc.inputs
            .iter()
            .chain(&desc.outputs)
            .all(|f| !f.shape.is_empty() && f.shape.iter().all(|&d| d > 0)),
    ));
    items
}

/// (a) for a chain: the chain's contract against the checkpoint, then each part's spec
/// version and I/O against the chain file's description of it.
fn check_chain(chain: &ChainFile, pkgs: &[MlPackage], ckpt: &Checkpoint) -> Vec<ContractItem> {
    let mut items = chain_items(chain, ckpt);
    for (part, pkg) in chain.parts.iter().zip(pkgs) {
        items.extend(check_part(part, pkg, &chain.contract, chain.hidden_size));
    }
    items
}

/// The chain's contract and shape against the checkpoint.
pub(super) fn chain_items(chain: &ChainFile, ckpt: &Checkpoint) -> Vec<ContractItem> {
    let spec = ckpt.spec();
    let c = &chain.contract;
    vec![
        item("contract version", contract::CONTRACT_VERSION, c.version),
        item("layers", spec.num_hidden_layers, c.num_layers),
        item("kv heads", spec.num_key_value_heads, c.num_kv_heads),
        item("head_dim", spec.head_dim, c.head_dim),
        item("vocab", spec.vocab_size, c.vocab_size),
        item("hidden size", spec.hidden_size, chain.hidden_size),
        item(
            "residual scale",
            c.scaling
                .get("residual_scale")
                .and_then(|v| v.as_f64())
                .unwrap_or(f64::NAN),
            chain.residual_scale,
        ),
    ]
}

/// Each part's files hash as the chain file recorded: the parts are the ones converted together.
pub(super) fn check_hashes(dir: &Path, chain: &ChainFile) -> Vec<ContractItem> {
    let mut items = Vec::new();
    for part in &chain.parts {
        for (file, want) in &part.sha256 {
            let found = match ChainFile::part_file(dir, part, file) {
                Ok(path) => {
                    crate::fsutil::sha256_file(&path).unwrap_or_else(|e| format!("unreadable: {e}"))
                }
                Err(e) => e,
            };
            items.push(item(
                &format!("{}: sha256 of {file}", part.path),
                want,
                found,
            ));
        }
    }
    items
}

/// The inputs and outputs a part of `c` running its layers has, and whether the chain file
/// gives it those (pushed to `items`).
pub(super) fn part_io(
    part: &ChainPart,
    c: &Contract,
    hidden: usize,
    items: &mut Vec<ContractItem>,
) -> (Vec<contract::IoSpec>, Vec<contract::IoSpec>) {
    let p = &part.path;
    let (inputs, outputs) = ChainPart::io(
        c,
        hidden,
        &part.layers,
        part.embedding,
        part.head,
        &c.compute_precision,
    );
    items.push(item(
        &format!("{p}: inputs as the chain says"),
        true,
        inputs == part.inputs,
    ));
    items.push(item(
        &format!("{p}: outputs as the chain says"),
        true,
        outputs == part.outputs,
    ));
    (inputs, outputs)
}

/// One part's spec version and I/O names, dtypes and shapes.
fn check_part(part: &ChainPart, pkg: &MlPackage, c: &Contract, hidden: usize) -> Vec<ContractItem> {
    let p = &part.path;
    let mut items = vec![item(
        &format!("{p}: specificationVersion ({})", c.target.as_str()),
        c.target.spec_version(),
        pkg.spec_version(),
    )];
    let (inputs, outputs) = part_io(part, c, hidden, &mut items);
    let desc = pkg.description();
    for (kind, want, have) in [
        ("input", inputs, &desc.inputs),
        ("output", outputs, &desc.outputs),
    ] {
        for w in &want {
            let want_shape: Vec<i64> = w.shape.iter().map(|&d| d as i64).collect();
            let found = have.iter().find(|f| f.name == w.name);
            items.push(match found {
                Some(f) => item(
                    &format!("{p}: {kind} `{}`", w.name),
                    format!("{} {want_shape:?}", w.dtype),
                    format!("{} {:?}", f.dtype, f.shape),
                ),
                None => item(&format!("{p}: {kind} `{}`", w.name), "present", "missing"),
            });
        }
        items.push(item(&format!("{p}: {kind} count"), want.len(), have.len()));
    }
    items
}

/// (b): every checkpoint tensor decoded from the package. Scales folded in by the converter
/// are factored out (the best least-squares scale: one per tensor for fp16 range safety, one
/// per input column for calibrated projections, whose input-channel scales live in the
/// preceding norm or projection), so SNR measures rounding and palettization only. A calibrated
/// projection is stored as row groups `NAME_g0, NAME_g1, ..` (or `NAME`) times `NAME_row_scale`.
/// Returns the fewest bits any palettized weight has.
fn check_weights(
    pkgs: &[MlPackage],
    ckpt: &Checkpoint,
    programs: &[&crate::runtime::interp::Program],
) -> Result<(Vec<WeightError>, Option<u32>), ValidateError> {
    let mains = pkgs
        .iter()
        .map(|p| p.main_function().map(|m| (p, m)))
        .collect::<Result<Vec<_>, _>>()?;
    // A chain's parts hold different weights (a tied table twice: the first copy is checked).
    // The part holding `name`, by index (its program decodes iOS18 weights), and the op.
    let find_at = |name: &str| {
        mains.iter().enumerate().find_map(|(at, (_, main))| {
            main.block
                .operations
                .iter()
                .find(|op| op.outputs.first().is_some_and(|o| o.name == name))
                .map(|op| (at, op))
        })
    };
    let find_in = |name: &str| find_at(name).map(|(at, op)| (mains[at].0, op));
    let find = |name: &str| find_in(name).map(|(_, op)| op);
    let mut out = Vec::new();
    let mut min_bits: Option<u32> = None;
    for slot in ckpt.slots() {
        let name = crate::arch::mil_name(&slot.name);
        let cols = slot.shape.get(1).copied().unwrap_or(1).max(1);
        let parts: Vec<(String, usize)> = if find(&name).is_some() {
            vec![(name.clone(), slot.numel())]
        } else {
            let mut v = Vec::new();
            while let Some(op) = find(&format!("{name}_g{}", v.len())) {
                let n: usize = op
                    .outputs
                    .first()
                    .and_then(|o| crate::mlpackage::tensor_type(o.r#type.as_ref(), &name).ok())
                    .map_or(0, |t| t.shape.iter().product());
                v.push((format!("{name}_g{}", v.len()), n));
            }
            v
        };
        if parts.is_empty() {
            continue;
        }
        // The decoded weight, as segments in row order, read a piece at a time: an 8B's fp16
        // embedding is 2.1 GB in f32, and nothing here holds a whole tensor in f32.
        let mut segments: Vec<Segment> = Vec::new();
        let mut scaled18 = false;
        for (part, numel) in &parts {
            let Some((at, op)) = find_at(part) else {
                continue;
            };
            let pkg = &pkgs[at];
            let reader = programs.get(at).and_then(|p| p.constant_reader(part));
            if let Some(bits) = ios18_weight(op) {
                // iOS18 constexpr ops (grouped LUTs, per-row scales): read back as the
                // interpreter decodes them.
                let Some(reader) = reader else {
                    continue;
                };
                segments.push(Segment::Reader(reader));
                // A scale op reads the LUT op the bridge names `<part>_lut`.
                let bits = bits.or_else(|| {
                    find(&format!("{part}_lut")).and_then(|o| ios18_weight(o).flatten())
                });
                min_bits = bits.map_or(min_bits, |b| Some(min_bits.map_or(b, |m| m.min(b))));
                scaled18 |= op.r#type == "constexpr_blockwise_shift_scale";
                continue;
            }
            match op.r#type.as_str() {
                "const" => {
                    let Some(v) = op.attributes.get("val") else {
                        continue;
                    };
                    segments.push(match reader {
                        Some(r) => Segment::Reader(r),
                        None => Segment::Owned(floats(pkg.value(v, part)?.values)),
                    });
                }
                "constexpr_lut_to_dense" => {
                    let (Some(lut), Some(idx)) =
                        (op.attributes.get("lut"), op.attributes.get("indices"))
                    else {
                        continue;
                    };
                    let lut = floats(pkg.value(lut, part)?.values);
                    let nbits = lut.len().trailing_zeros();
                    min_bits = Some(min_bits.map_or(nbits, |m: u32| m.min(nbits)));
                    if let Some(r) = reader {
                        segments.push(Segment::Reader(r));
                        continue;
                    }
                    let idx = pkg.value(idx, part)?;
                    let bytes: Vec<u8> = match idx.values {
                        Values::Int(v) => v.iter().map(|&x| x as u8).collect(),
                        _ => continue,
                    };
                    segments.push(Segment::Owned(
                        crate::quant::pack::unpack_indices(&bytes, nbits as u8, *numel)
                            .into_iter()
                            .map(|i| lut.get(i as usize).copied().unwrap_or(f32::NAN))
                            .collect(),
                    ));
                }
                _ => continue,
            }
        }
        let scale_name = format!("{name}_row_scale");
        let calibrated = parts.len() > 1 || find(&scale_name).is_some() || scaled18;
        let row_scale = match find_in(&scale_name) {
            Some((pkg, op)) => match op.attributes.get("val") {
                Some(v) => Some(floats(pkg.value(v, &scale_name)?.values)),
                None => None,
            },
            None => None,
        };
        let decoded = Decoded {
            segments,
            row_scale,
            cols,
        };
        // The checkpoint's tensor is widened to f32 a piece at a time too ([`in_pieces`]).
        let original = ckpt.tensor(&slot.name)?;
        if decoded.numel() != original.numel() {
            return Err(ValidateError::WeightSize {
                package: name.to_string(),
                tensor: slot.name.clone(),
                got: decoded.numel(),
                expected: original.numel(),
            });
        }
        // Scales folded in by the converter: one per input column of a calibrated projection.
        let k = if calibrated { cols } else { 1 };
        out.push(score(&decoded, &original, k)?.finish(&slot.name));
    }
    Ok((out, min_bits))
}

/// For an iOS18 constexpr weight (operands as inputs, not attributes): `Some(bits)`, the
/// LUT index width when the op (or the LUT a scale op reads) says it.
fn ios18_weight(op: &crate::mlpackage::proto::Operation) -> Option<Option<u32>> {
    use crate::mlpackage::proto;
    let index_bits = |op: &proto::Operation| -> Option<u32> {
        let ty = op.inputs.get("indices")?.arguments.first()?;
        let Some(proto::binding::Binding::Value(v)) = &ty.binding else {
            return None;
        };
        let t = crate::mlpackage::tensor_type(v.r#type.as_ref(), "indices").ok()?;
        Some(t.dtype.bits())
    };
    match op.r#type.as_str() {
        "constexpr_lut_to_dense" if op.inputs.contains_key("indices") => Some(index_bits(op)),
        "constexpr_blockwise_shift_scale" => Some(None),
        _ => None,
    }
}

/// The error sums of `decoded` against `original`, with the scales the converter folded in
/// factored out first: one least-squares scale for each of `k` column classes (element i's is
/// i mod k: every input column of a calibrated projection, or one for the tensor).
fn score(decoded: &Decoded, original: &TensorView, k: usize) -> Result<ErrorSum, ValidateError> {
    let (mut dot, mut norm) = (vec![0.0f64; k], vec![0.0f64; k]);
    let mut buf = Vec::new();
    in_pieces(original, |at, w| {
        decoded.read(at, w.len(), &mut buf)?;
        for (i, (a, b)) in buf.iter().zip(w).enumerate() {
            let j = (at + i) % k;
            dot[j] += *a as f64 * *b as f64;
            norm[j] += (*a as f64).powi(2);
        }
        Ok::<_, ValidateError>(())
    })?;
    let factors: Vec<f64> = dot
        .iter()
        .zip(&norm)
        .map(|(d, n)| if *n > 0.0 { d / n } else { 1.0 })
        .collect();
    let mut sum = ErrorSum::default();
    in_pieces(original, |at, w| {
        decoded.read(at, w.len(), &mut buf)?;
        for (i, a) in buf.iter_mut().enumerate() {
            *a = (*a as f64 * factors[(at + i) % k]) as f32;
        }
        sum.add(w, &buf);
        Ok::<_, ValidateError>(())
    })?;
    Ok(sum)
}

/// Elements of a checkpoint tensor widened to f32 at a time by [`in_pieces`] (16 MiB).
const PIECE: usize = 1 << 22;

/// `f(offset, values)` over `view`'s elements in f32, in order, [`PIECE`] at a time.
fn in_pieces<E>(
    view: &TensorView,
    mut f: impl FnMut(usize, &[f32]) -> Result<(), E>,
) -> Result<(), E> {
    let n = view.numel();
    let width = view.data.len() / n.max(1);
    for at in (0..n).step_by(PIECE) {
        let len = PIECE.min(n - at);
        let shape = [len];
        let piece = TensorView {
            name: view.name,
            dtype: view.dtype,
            shape: &shape,
            data: &view.data[at * width..(at + len) * width],
        };
        f(at, &piece.to_f32())?;
    }
    Ok(())
}

/// One run of a weight's decoded values: read from a program, or decoded here.
enum Segment<'a> {
    Reader(crate::runtime::interp::ConstantReader<'a>),
    Owned(Vec<f32>),
}

impl Segment<'_> {
    fn numel(&self) -> usize {
        match self {
            Segment::Reader(r) => r.numel(),
            Segment::Owned(v) => v.len(),
        }
    }
}

/// A weight as the package stores it: its segments in row order, times its row scales.
struct Decoded<'a> {
    segments: Vec<Segment<'a>>,
    row_scale: Option<Vec<f32>>,
    cols: usize,
}

impl Decoded<'_> {
    fn numel(&self) -> usize {
        self.segments.iter().map(Segment::numel).sum()
    }

    /// Elements `at..at + len` into `out` (cleared first), row scales applied.
    fn read(&self, at: usize, len: usize, out: &mut Vec<f32>) -> Result<(), ValidateError> {
        out.clear();
        let (end, mut start) = (at + len, 0);
        let mut piece = Vec::new();
        for seg in &self.segments {
            let n = seg.numel();
            let (lo, hi) = (at.max(start), end.min(start + n));
            if lo < hi {
                match seg {
                    Segment::Reader(r) => {
                        r.read(lo - start, hi - lo, &mut piece)?;
                        out.extend_from_slice(&piece);
                    }
                    Segment::Owned(v) => out.extend_from_slice(&v[lo - start..hi - start]),
                }
            }
            start += n;
        }
        if let Some(s) = &self.row_scale {
            for (i, x) in out.iter_mut().enumerate() {
                *x *= s.get((at + i) / self.cols).copied().unwrap_or(f32::NAN);
            }
        }
        Ok(())
    }
}

fn floats(v: Values) -> Vec<f32> {
    match v {
        Values::Float(f) => f,
        Values::Int(i) => i.into_iter().map(|x| x as f32).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_that_say_nothing_are_named() {
        let varied = vec![vec![0.0, 1.0], vec![2.0, 2.0]];
        assert_eq!(degenerate(&varied), None);
        let flat = vec![vec![0.0, 0.0], vec![3.0, 3.0]];
        assert_eq!(degenerate(&flat), Some("one value for every token"));
        let nan = vec![vec![0.0, f32::NAN]];
        assert_eq!(degenerate(&nan), Some("a non-finite logit"));
        let inf = vec![vec![f32::INFINITY, 1.0]];
        assert_eq!(degenerate(&inf), Some("a non-finite logit"));
    }
}
