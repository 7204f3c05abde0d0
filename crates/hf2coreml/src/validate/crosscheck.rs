//! `validate PKG --cross-check coreai`: the saved package's program, as hf2coreml's MIL
//! interpreter runs it, lifted into the graph IR ([`lift`](super::lift)) and replayed on Apple's
//! Core AI runtime in a scratch directory. Of a multifunction package the default function,
//! `decode`, is lifted: it is what `validate` scores, and `prefill` is held to it by the
//! functions check. Both runtimes score the same evaluation tokens; the
//! report sets their agreement beside each one's agreement with the float reference.
//!
//! Apple's runtime computes the program with the interpreter's arithmetic: every op in fp32,
//! each float result rounded to fp16 ([`Arithmetic::RoundEachOp`]). Its Linux CPU kernels would
//! otherwise accumulate fp16 matmuls in fp16 (4,096 ones sum to 2,048): that is not the
//! interpreter's arithmetic, and its error (KL 4e-3 from the reference on SmolLM2, ten times the
//! interpreter's) would hide the interpreter's own under the runtime's.
//!
//! Where the two disagree most, one step is probed: the same inputs (the interpreter's cache
//! at that position) go to both, and every intermediate value the program computes is
//! compared, so a disagreement is pinned to the first op whose outputs differ beyond what fp16
//! rounding explains.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use half::f16;
use serde::{Deserialize, Serialize};

use super::metrics::{compare_logits, LogitComparison};
use super::scoring::score_tokens;
use super::validate_error::ValidateError;
use crate::aimodel::{self, Session};
use crate::emit::coreai::{emit_coreai, Arithmetic};
use crate::emit::Metadata;
use crate::mil::contract::{self, Contract, IoSpec, Target};
use crate::progress::Progress;
use crate::pyenv::{PyEnvError, PythonEnv};
use crate::runtime::chain_runner::Saved;
use crate::runtime::coreai_model::{CoreAiModel, FUNCTION};
use crate::runtime::generate::{GenerateOptions, Generator};
use crate::runtime::interp::{Program, RuntimeError, Tensor};
use crate::runtime::{StepModel, StepOutput};

/// The runtimes agree when KL(Core AI ‖ interpreter), averaged over the positions, is at most
/// this...
pub const MAX_KL: f64 = 1e-3;
/// ...and their next-token choices agree at least this often where the choice is decisive:
/// a position whose interpreter top-2 margin is within twice the row's RMS logit difference
/// between the runtimes (the noise of two logits) is a tie either runtime may break (random
/// test models have many).
pub const MIN_TOP1: f64 = 0.99;
/// An op's output differs beyond fp16 rounding when its relative RMS difference exceeds this
/// and its largest difference is more than one fp16 step at the output's largest magnitude
/// (a value of subnormals a step apart is rounding, however large relative to it).
/// One fp16 rounding is 2^-11 relative; differences that entered upstream and were carried
/// along stay near that, reordered sums over thousands of terms reach a few times 1e-3.
pub const OP_REL_RMS: f64 = 1e-2;
/// ...on top of this many times what the op's inputs carry in (the sum of their relative RMS
/// differences): a product adds its factors' relative differences (a square doubles its
/// input's), and a sum of correlated terms can double them again. An op is judged on what it
/// adds, not on what it was given: a residual stream a few thousandths apart after thirty
/// blocks is more than a hundredth apart once squared for its norm, with no op at fault.
pub const CARRY: f64 = 2.0;
/// Intermediate values larger than this (elements) are left out of the probe.
pub const PROBE_MAX_ELEMENTS: usize = 1 << 20;
/// Ops listed in the report: the first beyond tolerance, and the largest differences.
const LISTED: usize = 8;

/// How one pair of logit sequences agrees.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Agreement {
    pub kl_mean: f64,
    pub kl_max: f64,
    pub top1: f64,
    pub top5: f64,
    pub max_abs_dlogit: f64,
}

impl From<&LogitComparison> for Agreement {
    fn from(c: &LogitComparison) -> Self {
        Agreement {
            kl_mean: c.kl_mean,
            kl_max: c.kl_max,
            top1: c.top1,
            top5: c.top5,
            max_abs_dlogit: c.max_abs_dlogit,
        }
    }
}

/// One intermediate value compared between the two runtimes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpDifference {
    /// The op's position in the program.
    pub index: usize,
    pub op: String,
    pub output: String,
    /// ‖ours − Core AI‖ / ‖ours‖.
    pub rel_rms: f64,
    /// One fp16 step at the largest |value| the interpreter produced.
    pub fp16_step: f64,
    pub max_abs: f64,
    /// Where the largest difference is (flat index), and the two values there.
    pub at: usize,
    pub interpreter: f32,
    pub coreai: f32,
}

/// The probe of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// The position probed (where the two runtimes' KL is largest).
    pub position: usize,
    pub compared: usize,
    /// Values left out: larger than [`PROBE_MAX_ELEMENTS`], or not floats.
    pub skipped: usize,
    pub tolerance: f64,
    /// Every value beyond tolerance, in program order (at most [`LISTED`]); the first is
    /// where the disagreement starts.
    pub beyond: Vec<OpDifference>,
    /// How many values are beyond tolerance in all.
    pub beyond_count: usize,
    /// The largest differences, largest first.
    pub largest: Vec<OpDifference>,
}

/// What the cross-check found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CrossCheck {
    pub runtime: String,
    /// The function replayed: `main`, or a multifunction package's `decode`.
    #[serde(default)]
    pub function: String,
    pub positions: usize,
    pub interpreter_vs_reference: Agreement,
    pub coreai_vs_reference: Agreement,
    /// KL(Core AI ‖ interpreter): Core AI's distribution taken as the expected one.
    pub coreai_vs_interpreter: Agreement,
    /// Positions whose top-1 is decisive (see [`MIN_TOP1`]), and the agreement over them.
    pub decisive_positions: usize,
    pub decisive_top1: f64,
    pub max_kl: f64,
    pub min_top1: f64,
    pub passed: bool,
    pub probe: Probe,
}

fn env_err(e: PyEnvError) -> ValidateError {
    match e {
        PyEnvError::Environment(e) => ValidateError::Runtime(RuntimeError::Environment(e)),
        other => ValidateError::CrossCheck(other.to_string()),
    }
}

/// Refuse what cannot be cross-checked before any work: a chain, an asset, a package with
/// states, a hybrid package, f32 compute.
pub(super) fn check_request(package: &Saved, f32_compute: bool) -> Result<(), ValidateError> {
    let refuse = |why: &str| Err(ValidateError::CrossCheck(why.to_string()));
    let c = package.contract();
    match package {
        Saved::Chain(c) if c.is_coreai() => {
            refuse("a chain of .aimodel parts already runs on Apple's runtime: give a package")
        }
        Saved::Chain(_) => refuse("a chain is cross-checked one part at a time: give a package"),
        Saved::CoreAi(_) => refuse("an .aimodel already runs on Apple's runtime: give the package"),
        Saved::Package(_) if !c.kv_cache.is_io() => refuse(
            "the cross-check replays a function whose caches are inputs and outputs; this \
             package keeps its cache in a state",
        ),
        Saved::Package(_) if c.recurrent.is_some() => refuse(
            "the cross-check replays one step from its caches alone; this hybrid package's \
             steps also carry a recurrent state",
        ),
        Saved::Package(_) if f32_compute => {
            refuse("the cross-check compares the program as declared (fp16): drop --compute f32")
        }
        Saved::Package(_) => Ok(()),
    }
}

/// Run the cross-check of `package` (accepted by [`check_request`]) on `tokens`, given the
/// reference's logits and the interpreter's.
pub(super) fn cross_check(
    package: &Saved,
    tokens: &[u32],
    reference: &[Vec<f32>],
    ours: &[Vec<f32>],
    progress: &dyn Progress,
) -> Result<CrossCheck, ValidateError> {
    let Saved::Package(pkg) = package else {
        return Err(ValidateError::CrossCheck("not a package".into()));
    };
    let program = pkg.program();
    let c = package.contract();
    progress.working_on("lifting the program for Apple's Core AI runtime");
    let lifted = super::lift::lift(program)?;
    let env = PythonEnv::discover(None).map_err(env_err)?;
    let scratch = crate::fsutil::scratch_dir("cross-check")
        .map_err(|e| ValidateError::CrossCheck(format!("a scratch directory: {e}")))?;
    let mut asset_contract = c.clone();
    asset_contract.target = Target::CoreAi;
    // The asset holds the one function lifted; the contract's own fields describe it.
    asset_contract.functions.clear();
    let function = if c.functions.is_empty() {
        "main"
    } else {
        contract::DECODE
    }
    .to_string();
    let meta = Metadata::for_contract(&asset_contract, "cross-check")
        .map_err(|e| ValidateError::CrossCheck(e.to_string()))?;

    progress.working_on("building the program with coreai-core");
    let main = scratch.path().join("main.aimodel");
    std::fs::create_dir(&main)
        .map_err(|e| ValidateError::CrossCheck(format!("{}: {e}", main.display())))?;
    let built = emit_coreai(
        lifted.graph.clone(),
        &c.outputs,
        &meta,
        &env,
        &main,
        Arithmetic::RoundEachOp,
    )?;
    let runtime = format!(
        "Apple Core AI runtime (coreai-core {}), each op in fp32 rounded to fp16",
        built.coreai_version
    );
    let saved = Saved::CoreAi(Box::new(CoreAiModel::load(&main)?));
    let (theirs, _) = score_tokens(&saved, tokens, progress)?;
    drop(saved);

    let ours_ref = compare_logits(reference, ours, tokens)?;
    let theirs_ref = compare_logits(reference, &theirs, tokens)?;
    let between = compare_logits(&theirs, ours, tokens)?;
    let (decisive_positions, decisive_top1) = decisive_top1(ours, &theirs);
    let passed = between.kl_mean <= MAX_KL && decisive_top1 >= MIN_TOP1;

    progress.working_on("probing every op at the position they disagree most");
    let position = between.kl_argmax;
    let probe = probe(
        program,
        package,
        c,
        &lifted,
        tokens,
        position,
        &meta,
        &env,
        &scratch.path().join("probe.aimodel"),
    )?;
    Ok(CrossCheck {
        runtime,
        function,
        positions: between.positions,
        interpreter_vs_reference: (&ours_ref).into(),
        coreai_vs_reference: (&theirs_ref).into(),
        coreai_vs_interpreter: (&between).into(),
        decisive_positions,
        decisive_top1,
        max_kl: MAX_KL,
        min_top1: MIN_TOP1,
        passed,
        probe,
    })
}

/// Top-1 agreement over the positions where the interpreter's choice is decisive: its margin
/// over the runner-up exceeds twice the RMS of the row's logit differences between the two
/// runtimes. (positions, agreement); no decisive position counts as agreement.
fn decisive_top1(ours: &[Vec<f32>], theirs: &[Vec<f32>]) -> (usize, f64) {
    let (mut n, mut agree) = (0usize, 0usize);
    for (a, b) in ours.iter().zip(theirs) {
        let sq: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
            .sum();
        let noise = 2.0 * (sq / a.len().max(1) as f64).sqrt();
        let (mut best, mut second) = ((0usize, f32::NEG_INFINITY), f32::NEG_INFINITY);
        for (i, &x) in a.iter().enumerate() {
            if x > best.1 {
                second = best.1;
                best = (i, x);
            } else if x > second {
                second = x;
            }
        }
        if f64::from(best.1 - second) <= noise {
            continue;
        }
        n += 1;
        let theirs_best = b
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |m, (i, &x)| {
                if x > m.1 {
                    (i, x)
                } else {
                    m
                }
            })
            .0;
        agree += usize::from(theirs_best == best.0);
    }
    (n, if n == 0 { 1.0 } else { agree as f64 / n as f64 })
}

/// The step inputs for the call that computes `position`'s logits.
struct StepInputs {
    input_ids: Vec<i32>,
    position: usize,
    key_cache: Vec<f16>,
    value_cache: Vec<f16>,
}

/// Steps the package and keeps the inputs of the call covering one position.
struct Capture<'a> {
    package: &'a Saved,
    at: usize,
    got: Option<StepInputs>,
}

impl StepModel for Capture<'_> {
    fn contract(&self) -> &Contract {
        self.package.contract()
    }

    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        if (position..position + input_ids.len()).contains(&self.at) {
            self.got = Some(StepInputs {
                input_ids: input_ids.to_vec(),
                position,
                key_cache: key_cache.to_vec(),
                value_cache: value_cache.to_vec(),
            });
        }
        self.package
            .step_with_stats(input_ids, position, key_cache, value_cache, None)
    }
}

/// A tensor's shape and fp16 values.
type Rows = (Vec<usize>, Vec<f16>);

/// Gemma 4: the per-layer table's rows of a step's tokens as the host passes them, with their
/// shape; `None` for a package without a table.
fn per_layer_rows(package: &Saved, input_ids: &[i32]) -> Result<Option<Rows>, ValidateError> {
    let table = match package {
        Saved::Package(p) => p.per_layer_table(),
        _ => None,
    };
    let Some(t) = table else {
        return Ok(None);
    };
    let shape = vec![1, input_ids.len(), t.row_len()];
    Ok(Some((shape, t.gather(input_ids)?)))
}

fn spec(name: &str, t: &crate::mlpackage::TensorTypeInfo) -> IoSpec {
    IoSpec {
        name: name.to_string(),
        dtype: t.dtype.name().to_string(),
        shape: t.shape.clone(),
    }
}

#[allow(clippy::too_many_arguments)]
fn probe(
    program: &Program,
    package: &Saved,
    c: &Contract,
    lifted: &super::lift::Lifted,
    tokens: &[u32],
    position: usize,
    meta: &Metadata,
    env: &PythonEnv,
    dest: &Path,
) -> Result<Probe, ValidateError> {
    let step = step_inputs(package, tokens, position)?;
    // Every float value of moderate size, as an extra output of the probe program.
    let outputs: HashSet<&str> = lifted.graph.outputs.iter().map(String::as_str).collect();
    let mut specs: Vec<IoSpec> = c.outputs.clone();
    let mut probed: Vec<(usize, String)> = Vec::new();
    let mut skipped = 0;
    let mut graph = lifted.graph.clone();
    let op_of = producers(&graph);
    for (name, ty) in &lifted.values {
        let numel: usize = ty.shape.iter().product();
        if !ty.dtype.is_float() || numel > PROBE_MAX_ELEMENTS || numel == 0 {
            skipped += 1;
            continue;
        }
        if !outputs.contains(name.as_str()) {
            graph.outputs.push(name.clone());
            specs.push(spec(name, ty));
        }
        probed.push((op_of.get(name).map_or(0, |(i, _)| *i), name.clone()));
    }
    std::fs::create_dir(dest)
        .map_err(|e| ValidateError::CrossCheck(format!("{}: {e}", dest.display())))?;
    emit_coreai(graph, &specs, meta, env, dest, Arithmetic::RoundEachOp)?;
    let session = Session::open(env, dest).map_err(|e| ValidateError::CrossCheck(e.to_string()))?;
    let cache_shape = vec![c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim];
    let fp32 = |name: &str| c.inputs.iter().any(|i| i.name == name && i.dtype == "fp32");
    let float = |name: &str, v: &[f16], shape: &[usize]| {
        if fp32(name) {
            aimodel::Tensor::F32(v.iter().map(|x| x.to_f32()).collect(), shape.to_vec())
        } else {
            aimodel::Tensor::F16(v.to_vec(), shape.to_vec())
        }
    };
    let pos = i32::try_from(step.position)
        .map_err(|_| ValidateError::CrossCheck("position beyond int32".into()))?;
    let per_layer = per_layer_rows(package, &step.input_ids)?;
    let mut sent = vec![
        (
            contract::INPUT_IDS.to_string(),
            aimodel::Tensor::I32(step.input_ids.clone(), vec![1, c.query_len]),
        ),
        (
            contract::POSITION.to_string(),
            aimodel::Tensor::I32(vec![pos], vec![1]),
        ),
        (
            contract::KEY_CACHE.to_string(),
            float(contract::KEY_CACHE, &step.key_cache, &cache_shape),
        ),
        (
            contract::VALUE_CACHE.to_string(),
            float(contract::VALUE_CACHE, &step.value_cache, &cache_shape),
        ),
    ];
    if let Some((shape, rows)) = &per_layer {
        let rows = float(contract::PER_LAYER_ROWS, rows, shape);
        sent.push((contract::PER_LAYER_ROWS.to_string(), rows));
    }
    let theirs = session
        .call(FUNCTION, sent)
        .map_err(|e| ValidateError::CrossCheck(e.to_string()))?;
    drop(session);

    let wanted: HashSet<&str> = probed.iter().map(|(_, n)| n.as_str()).collect();
    let mut ours: HashMap<String, Vec<f32>> = HashMap::new();
    let mut given = vec![
        (
            contract::INPUT_IDS,
            Tensor::i32(vec![1, c.query_len], &step.input_ids),
        ),
        (contract::POSITION, Tensor::i32(vec![1], &[pos])),
        (
            contract::KEY_CACHE,
            Tensor::f16(cache_shape.clone(), step.key_cache),
        ),
        (
            contract::VALUE_CACHE,
            Tensor::f16(cache_shape.clone(), step.value_cache),
        ),
    ];
    if let Some((shape, rows)) = per_layer {
        given.push((contract::PER_LAYER_ROWS, Tensor::f16(shape, rows)));
    }
    program.run_traced(given, &mut |name, t| {
        if wanted.contains(name) {
            ours.insert(name.to_string(), t.as_f32().into_owned());
        }
    })?;

    let mut diffs = Vec::new();
    for (index, name) in &probed {
        let (Some(a), Some(b)) = (ours.get(name), theirs.get(name)) else {
            return Err(ValidateError::CrossCheck(format!(
                "the probe returned no value `{name}`"
            )));
        };
        let b = b.to_f32();
        if a.len() != b.len() {
            return Err(ValidateError::CrossCheck(format!(
                "`{name}`: {} values from the interpreter, {} from Core AI",
                a.len(),
                b.len()
            )));
        }
        let op = op_of.get(name).map_or("?", |(_, o)| o.as_str());
        diffs.push(difference(*index, op, name, a, &b));
    }
    let reads = inputs(&lifted.graph);
    let rel: HashMap<&str, f64> = diffs
        .iter()
        .map(|d| (d.output.as_str(), d.rel_rms))
        .collect();
    let beyond_all: Vec<&OpDifference> = diffs
        .iter()
        .filter(|d| is_beyond(d, &rel, &reads))
        .collect();
    let beyond = beyond_all
        .iter()
        .take(LISTED)
        .map(|d| (*d).clone())
        .collect();
    let mut largest = diffs.clone();
    largest.sort_by(|a, b| b.rel_rms.total_cmp(&a.rel_rms));
    largest.truncate(LISTED);
    Ok(Probe {
        position,
        compared: diffs.len(),
        skipped,
        tolerance: OP_REL_RMS,
        beyond_count: beyond_all.len(),
        beyond,
        largest,
    })
}

/// The interpreter's inputs for the step that computes `position`'s logits.
fn step_inputs(
    package: &Saved,
    tokens: &[u32],
    position: usize,
) -> Result<StepInputs, ValidateError> {
    let mut gen = Generator::new(Capture {
        package,
        at: position,
        got: None,
    })?;
    gen.generate(
        &tokens[..=position],
        &GenerateOptions {
            max_new_tokens: 0,
            ..GenerateOptions::default()
        },
        &mut |_| Ok(()),
    )?;
    gen.into_model()
        .got
        .ok_or_else(|| ValidateError::CrossCheck(format!("no step computed position {position}")))
}

/// Each value's producing op: its index in the program and its MIL name.
fn producers(graph: &crate::graph::Graph) -> HashMap<String, (usize, String)> {
    graph
        .ops
        .iter()
        .enumerate()
        .flat_map(|(i, o)| {
            o.outputs
                .iter()
                .map(move |n| (n.clone(), (i, o.op.as_str().to_string())))
        })
        .collect()
}

/// The values each op output's op reads, by output name.
fn inputs(graph: &crate::graph::Graph) -> HashMap<String, Vec<String>> {
    use crate::graph::Arg;
    let mut out = HashMap::new();
    for o in &graph.ops {
        let read: Vec<String> = o
            .args
            .values()
            .flat_map(|a| match a {
                Arg::Var(n) => vec![n.clone()],
                Arg::Vars(ns) => ns.clone(),
                _ => Vec::new(),
            })
            .collect();
        for n in &o.outputs {
            out.insert(n.clone(), read.clone());
        }
    }
    out
}

/// Whether `d` differs beyond fp16 rounding on top of what its op's probed inputs carry in
/// ([`OP_REL_RMS`], [`CARRY`]); an input that was not probed (a constant, an input both runs
/// share, a value too large to probe) carries nothing.
fn is_beyond(
    d: &OpDifference,
    rel: &HashMap<&str, f64>,
    reads: &HashMap<String, Vec<String>>,
) -> bool {
    let carried: f64 = reads.get(&d.output).map_or(0.0, |names| {
        names.iter().filter_map(|n| rel.get(n.as_str())).sum()
    });
    d.rel_rms > OP_REL_RMS + CARRY * carried && d.max_abs > d.fp16_step
}

/// Relative RMS and largest absolute difference of two runs of one value. A value that is
/// non-finite in one run and not the other counts as infinitely different.
fn difference(index: usize, op: &str, output: &str, a: &[f32], b: &[f32]) -> OpDifference {
    let (mut num, mut den, mut max_abs, mut at) = (0f64, 0f64, 0f64, 0usize);
    let mut scale = 0f32;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let d = if x.is_finite() && y.is_finite() {
            (x as f64 - y as f64).abs()
        } else if x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()) {
            0.0
        } else {
            f64::INFINITY
        };
        if x.is_finite() {
            den += (x as f64) * (x as f64);
            scale = scale.max(x.abs());
        }
        num += d * d;
        if d > max_abs {
            max_abs = d;
            at = i;
        }
    }
    let rel_rms = if num == 0.0 {
        0.0
    } else {
        (num / den.max(f64::MIN_POSITIVE)).sqrt()
    };
    OpDifference {
        index,
        op: op.to_string(),
        output: output.to_string(),
        rel_rms,
        fp16_step: fp16_step(scale),
        max_abs,
        at,
        interpreter: a.get(at).copied().unwrap_or(0.0),
        coreai: b.get(at).copied().unwrap_or(0.0),
    }
}

/// The spacing of fp16 values at magnitude `x`: 2^-24 among subnormals, else 2^(e-10).
fn fp16_step(x: f32) -> f64 {
    const MIN_NORMAL: f32 = 6.103_515_6e-5;
    if x < MIN_NORMAL {
        return 2f64.powi(-24);
    }
    2f64.powi(x.log2().floor() as i32 - 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_op_is_judged_on_what_it_adds_to_what_its_inputs_carry() {
        let diff = |output: &str, rel_rms: f64| OpDifference {
            index: 0,
            op: "mul".into(),
            output: output.into(),
            rel_rms,
            fp16_step: 1e-3,
            max_abs: 1.0,
            at: 0,
            interpreter: 0.0,
            coreai: 0.0,
        };
        let reads: HashMap<String, Vec<String>> = [
            ("sq", vec!["x", "x"]),
            ("y", vec!["x", "w"]),
            ("z", vec!["w"]),
        ]
        .into_iter()
        .map(|(o, i)| (o.to_string(), i.into_iter().map(String::from).collect()))
        .collect();
        let rel: HashMap<&str, f64> = [("x", 0.008)].into_iter().collect();
        // A square of a value 0.008 apart is 0.016 apart: carried, not added.
        assert!(!is_beyond(&diff("sq", 0.016), &rel, &reads));
        // Far past what x carries in: the op's own.
        assert!(is_beyond(&diff("y", 0.05), &rel, &reads));
        // Nothing carried in (a constant): the bare tolerance.
        assert!(is_beyond(&diff("z", 0.011), &rel, &reads));
        assert!(!is_beyond(&diff("z", 0.009), &rel, &reads));
        // Within one fp16 step: rounding, however large relative to the value.
        let tiny = OpDifference {
            max_abs: 1e-4,
            ..diff("z", 0.5)
        };
        assert!(!is_beyond(&tiny, &rel, &reads));
    }

    #[test]
    fn differences_are_relative_and_name_the_largest() {
        let d = difference(3, "mul", "x", &[1.0, 2.0, -4.0], &[1.0, 2.5, -4.0]);
        assert_eq!((d.at, d.interpreter, d.coreai), (1, 2.0, 2.5));
        assert!((d.max_abs - 0.5).abs() < 1e-12);
        assert!((d.rel_rms - 0.5 / 21f64.sqrt()).abs() < 1e-12);
        assert_eq!(difference(0, "add", "y", &[1.0], &[1.0]).rel_rms, 0.0);
    }

    #[test]
    fn a_flip_within_the_rows_noise_is_a_tie_and_one_beyond_it_is_not() {
        // Every logit moved by ±0.06 (noise 0.12); row 0 has margin 0.05 and flips (a tie),
        // row 1 agrees, row 2 flips with margin 3 (decisive).
        let row = |top: &[f32]| {
            let mut r = vec![0f32; 20];
            r[..top.len()].copy_from_slice(top);
            r
        };
        let noisy = |r: Vec<f32>| -> Vec<f32> {
            r.iter()
                .enumerate()
                .map(|(i, x)| x + if i % 2 == 0 { 0.06 } else { -0.06 })
                .collect()
        };
        let ours = vec![row(&[1.0, 1.05]), row(&[2.0]), row(&[3.0])];
        let mut theirs: Vec<Vec<f32>> = ours.iter().cloned().map(noisy).collect();
        theirs[2][0] = 0.0;
        theirs[2][1] = 3.5;
        let (n, top1) = decisive_top1(&ours, &theirs);
        assert_eq!(n, 2);
        assert!((top1 - 0.5).abs() < 1e-12);
    }

    #[test]
    fn fp16_steps() {
        assert_eq!(fp16_step(1.0), 2f64.powi(-10));
        assert_eq!(fp16_step(1.5), 2f64.powi(-10));
        assert_eq!(fp16_step(2.0), 2f64.powi(-9));
        assert_eq!(fp16_step(2.3e-6), 2f64.powi(-24));
    }

    #[test]
    fn a_value_non_finite_in_one_run_only_is_beyond_any_tolerance() {
        let d = difference(0, "exp", "e", &[1.0, f32::INFINITY], &[1.0, 3.0]);
        assert!(d.rel_rms.is_infinite() && d.at == 1);
        let same = difference(0, "exp", "e", &[1.0, f32::INFINITY], &[1.0, f32::INFINITY]);
        assert_eq!(same.rel_rms, 0.0);
    }
}
