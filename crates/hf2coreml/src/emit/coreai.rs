//! Graph → `coreai-core` → `.aimodel`: the same graph the coremltools bridge serializes, replayed
//! on Apple's Core AI authoring API (`python/hf2coreml_coreai.py`) and saved as the asset
//! directory Core AI writes, into a directory the caller owns, as a package is.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pyo3::prelude::*;

use super::{consts_to_python, python_err, EmitError, Metadata};
use crate::graph::Graph;
use crate::mil::contract::{IoSpec, Target};
use crate::mil::Op;
use crate::pyenv::{self, PythonEnv, PYTHON_HOLDS_STDERR};

/// The MIL ops the Core AI bridge translates (`_Ops` in python/hf2coreml_coreai.py). A graph
/// with any other op is refused by name before anything is handed to Python.
pub const COREAI_OPS: &[Op] = &[
    Op::Const,
    Op::Add,
    Op::Sub,
    Op::Mul,
    Op::RealDiv,
    Op::Maximum,
    Op::Minimum,
    Op::Greater,
    Op::Less,
    Op::GreaterEqual,
    Op::LessEqual,
    Op::LogicalAnd,
    Op::LogicalOr,
    Op::LogicalNot,
    Op::Select,
    Op::Clip,
    Op::Rsqrt,
    Op::Sqrt,
    Op::Exp,
    Op::Log,
    Op::Tanh,
    Op::Silu,
    Op::Sigmoid,
    Op::Relu,
    Op::Abs,
    Op::Identity,
    Op::ReduceMean,
    Op::ReduceMax,
    Op::ReduceSum,
    Op::Softmax,
    Op::Reshape,
    Op::ExpandDims,
    Op::Squeeze,
    Op::Transpose,
    Op::Concat,
    Op::Split,
    Op::SliceByIndex,
    Op::Tile,
    Op::Gather,
    Op::Matmul,
    Op::Linear,
    Op::Conv,
];

/// The first op of `graph` the Core AI bridge cannot express, if any.
pub fn unsupported_op(graph: &Graph) -> Option<Op> {
    graph
        .ops
        .iter()
        .map(|o| o.op)
        .find(|op| !COREAI_OPS.contains(op))
}

/// What a finished Core AI emit reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CoreAiReport {
    pub asset: PathBuf,
    pub coreai_version: String,
    /// Core AI ops in the saved program, by name.
    pub op_counts: BTreeMap<String, usize>,
    pub python_env: PythonEnv,
}

/// How the Core AI program computes an fp16 graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arithmetic {
    /// In the graph's float type, as Apple's runtime chooses (what ships).
    Native,
    /// Every op in fp32, each float result rounded to fp16, behind the same fp16 interface: the
    /// semantics of hf2coreml's interpreter, for the cross-check (Apple's Linux CPU runtime
    /// accumulates fp16 matmuls in fp16: docs/reference/coreai.md).
    RoundEachOp,
}

/// Serialize `graph` (whose outputs are `outputs`, as the contract declares them) as an
/// `.aimodel`'s contents in `into`, an empty directory.
pub fn emit_coreai(
    graph: Graph,
    outputs: &[IoSpec],
    meta: &Metadata,
    env: &PythonEnv,
    into: &Path,
    arithmetic: Arithmetic,
) -> Result<CoreAiReport, EmitError> {
    graph.validate()?;
    if let Some(op) = unsupported_op(&graph) {
        return Err(EmitError::Unsupported {
            target: Target::CoreAi,
            op: op.as_str().to_string(),
        });
    }
    let mut desc = serde_json::to_value(graph.description())
        .map_err(|e| EmitError::Protocol(e.to_string()))?;
    desc["output_specs"] =
        serde_json::to_value(outputs).map_err(|e| EmitError::Protocol(e.to_string()))?;
    desc["round_each_op"] = (arithmetic == Arithmetic::RoundEachOp).into();
    save(desc.to_string(), graph.consts, meta, env, into)
}

/// Serialize one asset with a function per `(name, graph, outputs)` (a multifunction asset:
/// `prefill` and `decode`), in native arithmetic. Each constant the functions share crosses to
/// Python once; Core AI stores equal constants once in the saved program (checked on
/// coreai-core 1.0.0b3: two functions over one 2 MB weight save 2 MB).
pub fn emit_coreai_functions(
    functions: Vec<(String, Graph, Vec<IoSpec>)>,
    meta: &Metadata,
    env: &PythonEnv,
    into: &Path,
) -> Result<CoreAiReport, EmitError> {
    let mut outputs = Vec::with_capacity(functions.len());
    let mut graphs = Vec::with_capacity(functions.len());
    for (name, graph, outs) in functions {
        if let Some(op) = unsupported_op(&graph) {
            return Err(EmitError::Unsupported {
                target: Target::CoreAi,
                op: op.as_str().to_string(),
            });
        }
        outputs.push(outs);
        graphs.push((name, graph));
    }
    let default = graphs.last().map(|(n, _)| n.clone()).unwrap_or_default();
    let described = super::multifunction::describe(graphs, &default)?;
    let mut desc: serde_json::Value =
        serde_json::from_str(&described.desc).map_err(|e| EmitError::Protocol(e.to_string()))?;
    let list = desc["functions"]
        .as_array_mut()
        .ok_or_else(|| EmitError::Protocol("a description without functions".into()))?;
    for (f, outs) in list.iter_mut().zip(&outputs) {
        f["graph"]["output_specs"] =
            serde_json::to_value(outs).map_err(|e| EmitError::Protocol(e.to_string()))?;
    }
    save(desc.to_string(), described.consts, meta, env, into)
}

/// Hand the description and its constants to the bridge, which builds and saves the asset into
/// `into`.
fn save(
    desc: String,
    consts: Vec<crate::graph::Const>,
    meta: &Metadata,
    env: &PythonEnv,
    into: &Path,
) -> Result<CoreAiReport, EmitError> {
    let meta_json = serde_json::to_string(meta).map_err(|e| EmitError::Protocol(e.to_string()))?;
    let work = into.to_path_buf();
    let (env_owned, work_py) = (env.clone(), work.clone());
    let (version, counts) = pyenv::on_python_thread(move || {
        Python::initialize();
        let _quiet = PYTHON_HOLDS_STDERR
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Python::attach(
            |py| -> Result<(String, BTreeMap<String, usize>), EmitError> {
                let bridge = pyenv::load_bridge(py, &env_owned, crate::aimodel::BRIDGE)?;
                let to_py = |e: PyErr| python_err(py, "handing weights to Python", e);
                // Core AI reads every LUT form as iOS18 spells it (indices, table, row scale),
                // the indices as the packed bit stream.
                let (dense, luts) = consts_to_python(py, consts, Target::CoreAi).map_err(to_py)?;
                let work = work_py.to_string_lossy().into_owned();
                let res = bridge
                    .call_method1("emit", (desc, dense, luts, meta_json, work))
                    .map_err(
                        |e| match python_err(py, "building and saving the program", e) {
                            EmitError::Python { stage, message } => {
                                EmitError::CoreAi { stage, message }
                            }
                            other => other,
                        },
                    )?;
                let get = |k: &str| {
                    res.get_item(k)
                        .map_err(|e| EmitError::Protocol(format!("missing `{k}`: {e}")))
                };
                let version: String = get("coreai_version")?
                    .extract()
                    .map_err(|e: PyErr| EmitError::Protocol(e.to_string()))?;
                let counts: BTreeMap<String, usize> = get("op_counts")?
                    .extract()
                    .map_err(|e: PyErr| EmitError::Protocol(e.to_string()))?;
                drop(res);
                py.import("gc")
                    .and_then(|gc| gc.call_method0("collect"))
                    .map_err(|e| python_err(py, "freeing the program", e))?;
                Ok((version, counts))
            },
        )
    })
    .map_err(|e| e.or_disk_full(&work))?;
    // Core AI saves to a path ending in .aimodel; lift its contents into `into`.
    let saved = work.join("model.aimodel");
    let entries = std::fs::read_dir(&saved).map_err(|e| EmitError::io(&saved, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| EmitError::io(&saved, e))?;
        let to = work.join(entry.file_name());
        std::fs::rename(entry.path(), &to).map_err(|e| EmitError::io(&to, e))?;
    }
    std::fs::remove_dir(&saved).map_err(|e| EmitError::io(&saved, e))?;
    Ok(CoreAiReport {
        asset: work,
        coreai_version: version,
        op_counts: counts,
        python_env: env.clone(),
    })
}
