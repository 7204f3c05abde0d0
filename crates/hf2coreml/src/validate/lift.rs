//! A compiled [`Program`](crate::runtime::interp::Program) lifted back into hf2coreml's graph
//! IR, so that another backend can replay exactly what a saved package computes: the
//! cross-check hands it to Apple's Core AI runtime. Op types and arguments are the saved
//! program's; constants are the values the interpreter runs with, and weights still packed in
//! the weight file keep their tables and indices (the other runtime decodes them itself).
//!
//! The graph spells small constant arguments inline, as the builders do (`axes`, `perm`,
//! `epsilon`, a scalar operand); tensors stay named constants.

use std::collections::{BTreeMap, HashMap, HashSet};

use half::f16;

use crate::graph::{self, Const, ConstData, Graph, Input, Operation};
use crate::mil::contract::Target;
use crate::mil::{DType, Op};
use crate::mlpackage::TensorTypeInfo;
use crate::quant::GroupedLut;
use crate::runtime::interp::packed::{Form, Packed};
use crate::runtime::interp::tensor::{Data, Tensor};
use crate::runtime::interp::{Arg, Instr, OpKind, Program, ProgramView, RuntimeError};

/// Arguments that carry tensors: a constant bound to one stays a named constant (a scalar is
/// spelled inline, which the elementwise ops take as well).
const DATA_ARGS: &[&str] = &[
    "x", "y", "a", "b", "cond", "weight", "bias", "indices", "values",
];

/// Arguments coremltools may write with their MIL default, which the graph IR leaves out.
fn is_default(op: Op, key: &str, t: &Tensor) -> bool {
    let all = |want: i64| t.as_i64().iter().all(|&v| v == want);
    let no = || t.as_bool().iter().all(|&b| !b);
    match (op, key) {
        (Op::SliceByIndex, "begin_mask" | "end_mask" | "squeeze_mask") => no(),
        (Op::Gather, "batch_dims") => all(0),
        (Op::Gather, "validate_indices") => no(),
        (Op::Concat, "interleave") => no(),
        _ => false,
    }
}

/// A lifted program: the graph, and the declared type of every value an op produces (in
/// program order), which a probe of intermediate values asks for.
#[derive(Debug)]
pub struct Lifted {
    pub graph: Graph,
    pub values: Vec<(String, TensorTypeInfo)>,
}

fn lift_err(msg: String) -> RuntimeError {
    RuntimeError::Program(format!("lifting the program into a graph: {msg}"))
}

/// A float constant as fp16, refused when a value is not one (an fp32 program from elsewhere).
fn half_values(t: &Tensor, what: &str) -> Result<Vec<f16>, RuntimeError> {
    match &t.data {
        Data::Half(v) => Ok(v.clone()),
        Data::F(v) => v
            .iter()
            .map(|&x| {
                let h = f16::from_f32(x);
                (h.to_f32() == x || x.is_nan())
                    .then_some(h)
                    .ok_or_else(|| lift_err(format!("{what} holds {x}, which fp16 cannot hold")))
            })
            .collect(),
        _ => Err(lift_err(format!("{what} is not a float tensor"))),
    }
}

fn const_data(t: &Tensor, what: &str) -> Result<ConstData, RuntimeError> {
    match &t.data {
        Data::F(_) | Data::Half(_) => Ok(ConstData::F16(half_values(t, what)?)),
        Data::I(v) => v
            .iter()
            .map(|&x| i32::try_from(x))
            .collect::<Result<Vec<_>, _>>()
            .map(ConstData::I32)
            .map_err(|_| lift_err(format!("{what} holds an integer beyond int32"))),
        Data::B(_) => Err(lift_err(format!("{what} is a bool tensor constant"))),
    }
}

/// A weight left packed, as the graph's grouped LUT (the table values the file holds, the
/// indices as the file packs them) or dense fp16.
fn packed_data(p: &Packed, what: &str) -> Result<ConstData, RuntimeError> {
    let bytes = p
        .blob()
        .map_err(|e| lift_err(format!("{what}: {e}")))?
        .to_vec();
    match &p.form {
        Form::Half => Ok(ConstData::F16(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        )),
        Form::Lut(l) => {
            let as_half = |v: &[f32], part: &str| {
                half_values(
                    &Tensor::f32(vec![v.len()], v.to_vec()),
                    &format!("{what} {part}"),
                )
            };
            let row_scale = match &l.scale {
                None => None,
                Some(s) => {
                    if s.iter().any(|&(_, offset)| offset != 0.0) {
                        return Err(lift_err(format!(
                            "{what} shifts its table by an offset, which the graph IR cannot spell"
                        )));
                    }
                    let scales: Vec<f32> = s.iter().map(|&(scale, _)| scale).collect();
                    Some(as_half(&scales, "scales")?)
                }
            };
            let numel = p.rows() * p.cols();
            let mut packed = bytes;
            packed.truncate((numel * l.nbits as usize).div_ceil(8));
            Ok(ConstData::GroupedLut(GroupedLut {
                nbits: l.nbits as u8,
                group_rows: l.rows_per_table,
                luts: as_half(&l.tables, "table")?,
                packed,
                row_scale,
            }))
        }
    }
}

/// A scalar constant inline: int, float or bool.
fn scalar(t: &Tensor) -> Option<graph::Arg> {
    if t.len() != 1 {
        return None;
    }
    Some(match &t.data {
        Data::F(v) => graph::Arg::Float(v[0] as f64),
        Data::Half(v) => graph::Arg::Float(v[0].to_f64()),
        Data::I(v) => graph::Arg::Int(v[0]),
        Data::B(v) => graph::Arg::Bool(v[0]),
    })
}

/// The program as a graph (see the module docs). Refused: states, ops the interpreter
/// does not know, and constants the graph IR cannot spell, each by name.
pub fn lift(program: &Program) -> Result<Lifted, RuntimeError> {
    let program = program.view();
    if let Some((name, _, _)) = program.states.first() {
        return Err(lift_err(format!(
            "state `{name}`: only programs whose caches are inputs and outputs can be lifted"
        )));
    }
    let float = if program.inputs.iter().any(|(_, _, t)| t.dtype == DType::F32) {
        DType::F32
    } else {
        DType::F16
    };
    let mut l = Lifter::new(program);
    let inputs = program
        .inputs
        .iter()
        .map(|(name, s, ty)| {
            l.names.insert(*s, name.clone());
            Input {
                name: name.clone(),
                dtype: ty.dtype,
                shape: ty.shape.clone(),
                state: false,
            }
        })
        .collect();
    let mut ops = Vec::new();
    let mut values = Vec::new();
    for ins in program.instrs {
        let op = match &ins.op {
            OpKind::Known(op) => *op,
            OpKind::Unknown(name) => {
                return Err(RuntimeError::UnsupportedOp {
                    op_type: name.clone(),
                    output: ins.out_names.first().cloned().unwrap_or_default(),
                })
            }
        };
        let args = l.args(op, ins)?;
        for ((s, ty), name) in ins.outputs.iter().zip(&ins.out_names) {
            l.names.insert(*s, name.clone());
            values.push((name.clone(), ty.clone()));
        }
        ops.push(Operation {
            op,
            outputs: ins.out_names.clone(),
            args,
        });
    }
    let graph = Graph {
        inputs,
        consts: l.consts_out,
        ops,
        outputs: program.outputs.iter().map(|(n, _)| n.clone()).collect(),
        float,
        target: Target::CoreAi,
    };
    graph
        .validate()
        .map_err(|e| lift_err(format!("the lifted graph does not hang together: {e}")))?;
    Ok(Lifted { graph, values })
}

/// What a lift keeps while it walks the program: a name for every slot, the constants the
/// graph declares so far.
struct Lifter<'p> {
    program: ProgramView<'p>,
    names: HashMap<usize, String>,
    consts: HashMap<usize, &'p Tensor>,
    taken: HashSet<String>,
    consts_out: Vec<Const>,
    declared: HashSet<usize>,
    fresh: usize,
}

impl<'p> Lifter<'p> {
    fn new(program: ProgramView<'p>) -> Self {
        let names: HashMap<usize, String> = program
            .const_names
            .iter()
            .map(|(n, s)| (*s, n.clone()))
            .collect();
        let mut taken: HashSet<String> = names.values().cloned().collect();
        taken.extend(program.inputs.iter().map(|(n, _, _)| n.clone()));
        for ins in program.instrs {
            taken.extend(ins.out_names.iter().cloned());
        }
        Lifter {
            program,
            names,
            consts: program
                .consts
                .iter()
                .map(|(s, t)| (*s, t.as_ref()))
                .collect(),
            taken,
            consts_out: Vec::new(),
            declared: HashSet::new(),
            fresh: 0,
        }
    }

    fn fresh_name(&mut self) -> String {
        loop {
            let name = format!("lifted_const_{}", self.fresh);
            self.fresh += 1;
            if self.taken.insert(name.clone()) {
                return name;
            }
        }
    }

    /// The graph's arguments of one instruction.
    fn args(&mut self, op: Op, ins: &Instr) -> Result<BTreeMap<String, graph::Arg>, RuntimeError> {
        let what = |key: &str| {
            format!(
                "argument `{key}` of `{}` ({})",
                ins.out_names.first().map_or("", String::as_str),
                op.as_str()
            )
        };
        let mut args = BTreeMap::new();
        for (key, bound) in &ins.inputs {
            let data = DATA_ARGS.contains(&key.as_str());
            if let [b] = bound.as_slice() {
                let t = match b {
                    Arg::Slot(s) => self.consts.get(s).copied(),
                    Arg::Const(t) => Some(t.as_ref()),
                };
                if let Some(t) = t {
                    if is_default(op, key, t) {
                        continue;
                    }
                    let inline = if t.rank() == 0 || (!data && t.len() == 1 && is_axis(key)) {
                        Some(scalar(t))
                    } else if !data {
                        Some(ints(t))
                    } else {
                        None
                    };
                    if let Some(a) = inline {
                        let a = a.ok_or_else(|| {
                            lift_err(format!("{} cannot be spelled inline", what(key)))
                        })?;
                        args.insert(key.clone(), a);
                        continue;
                    }
                }
            }
            let mut vars = Vec::new();
            for b in bound {
                vars.push(self.named(b, &what(key))?);
            }
            let a = if op == Op::Concat && key == "values" {
                graph::Arg::Vars(vars)
            } else if let [v] = vars.as_slice() {
                graph::Arg::Var(v.clone())
            } else {
                return Err(lift_err(format!(
                    "{} binds {} values",
                    what(key),
                    vars.len()
                )));
            };
            args.insert(key.clone(), a);
        }
        Ok(args)
    }

    /// The name of a tensor an argument binds: an input, an earlier result, or a constant or
    /// packed weight, declared in the graph the first time it is named.
    fn named(&mut self, b: &Arg, what: &str) -> Result<String, RuntimeError> {
        let s = match b {
            Arg::Const(t) => {
                // An inline tensor bound to a data argument becomes a constant of its own.
                let name = self.fresh_name();
                self.consts_out.push(Const {
                    name: name.clone(),
                    shape: t.shape.clone(),
                    data: const_data(t, what)?,
                    source: None,
                });
                return Ok(name);
            }
            Arg::Slot(s) => *s,
        };
        if !self.declared.contains(&s) {
            let data = if let Some(t) = self.consts.get(&s) {
                Some((t.shape.clone(), const_data(t, what)?))
            } else if let Some(p) = self.program.packed.get(&s) {
                Some((p.shape.clone(), packed_data(p, what)?))
            } else {
                None
            };
            if let Some((shape, data)) = data {
                let name = match self.names.get(&s) {
                    Some(n) => n.clone(),
                    None => {
                        let n = self.fresh_name();
                        self.names.insert(s, n.clone());
                        n
                    }
                };
                self.consts_out.push(Const {
                    name,
                    shape,
                    data,
                    source: None,
                });
                self.declared.insert(s);
            }
        }
        self.names
            .get(&s)
            .cloned()
            .ok_or_else(|| lift_err(format!("{what} names a value with no name")))
    }
}

/// Arguments that name one axis or count (`axis`, `num_splits`): a one-element list is that
/// number.
fn is_axis(key: &str) -> bool {
    matches!(key, "axis" | "num_splits")
}

fn ints(t: &Tensor) -> Option<graph::Arg> {
    matches!(t.data, Data::I(_)).then(|| graph::Arg::Ints(t.as_i64().into_owned()))
}
