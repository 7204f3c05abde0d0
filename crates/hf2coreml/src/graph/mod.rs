//! The decoder-step graph: MIL-shaped operations over named values.
//!
//! A [`Graph`] is what the emitter hands to coremltools: typed inputs, constants (dense or
//! palettized), a list of operations in program order, and the names of the outputs. Op types
//! ([`crate::mil::Op`]), element types ([`crate::mil::DType`]) and argument names are the iOS17
//! MIL ones (docs/reference/mil-ops.md), so the bridge can call the MIL builder without
//! translating anything; the JSON it reads spells them by their MIL names.
//!
//! Builders live in submodules: [`decoder`] (Llama, Mistral, Qwen2, Qwen3, Phi-3/Phi-4-mini,
//! Gemma 3, SmolLM3), with [`rope`] tables and [`scaling`] (fp16 range safety) as inputs. They
//! take [`Weight`]s: dense fp16, or the [`QuantizedWeight`] the quantizer produced.

pub mod decoder;
pub mod rope;
pub mod scaling;

use std::collections::{BTreeMap, HashSet};

use half::f16;
use serde::Serialize;
use thiserror::Error;

use crate::mil::contract::Target;
use crate::mil::{DType, Op};
use crate::quant::{GroupedLut, PackedLut, QuantizedWeight, IOS17_NBITS};

/// Serialize a [`DType`] by its MIL name (`fp16`, `int32`, `bool`), as the bridge reads it.
fn dtype_name<S: serde::Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

/// Serialize an [`Op`] by its MIL name, which the bridge calls as `mb.<name>`.
fn op_name<S: serde::Serializer>(op: &Op, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(op.as_str())
}

/// A graph input.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Input {
    pub name: String,
    #[serde(serialize_with = "dtype_name")]
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// A Core ML state (iOS18) rather than a tensor input: read with `read_state`, written
    /// with `coreml_update_state`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub state: bool,
}

/// A weight as a builder takes it: dense fp16 values, or quantized as a package stores it.
#[derive(Debug, Clone, PartialEq)]
pub enum Weight {
    Dense(Vec<f16>),
    Quantized(QuantizedWeight),
}

impl Weight {
    /// How the report names this storage: `fp16`, or see [`QuantizedWeight::label`].
    pub fn label(&self) -> String {
        match self {
            Weight::Dense(_) => "fp16".to_string(),
            Weight::Quantized(q) => q.label(),
        }
    }
}

/// The values of a constant. Float constants are stored in fp16 (the precision a package
/// ships); an fp32 program widens them when it is serialized.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstData {
    F16(Vec<f16>),
    I32(Vec<i32>),
    /// A palettized weight: `out = lut[indices].reshape(shape)` (iOS17
    /// `constexpr_lut_to_dense`, one LUT per constant).
    Lut(PackedLut),
    /// iOS18: one LUT per group of rows, then an optional per-row scale, all constexpr.
    GroupedLut(GroupedLut),
}

impl ConstData {
    fn kind(&self) -> &'static str {
        match self {
            ConstData::F16(_) => "f16",
            ConstData::I32(_) => "i32",
            ConstData::Lut(_) | ConstData::GroupedLut(_) => "lut",
        }
    }
}

/// A named constant. Weights are named after their checkpoint tensor via [`crate::arch::mil_name`].
#[derive(Debug, Clone, PartialEq)]
pub struct Const {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: ConstData,
    /// The checkpoint tensor it came from, if any.
    pub source: Option<String>,
}

impl Const {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An operation argument.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Arg {
    /// A named value (input, constant or an earlier op's output).
    Var(String),
    /// A list of named values (`concat`'s `values`).
    Vars(Vec<String>),
    Int(i64),
    Ints(Vec<i64>),
    /// A float scalar in the graph's float type.
    Float(f64),
    Bool(bool),
}

/// One MIL operation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Operation {
    /// The MIL op type, e.g. [`Op::Linear`].
    #[serde(serialize_with = "op_name")]
    pub op: Op,
    /// Output names; most ops have one, `split` has several.
    pub outputs: Vec<String>,
    pub args: BTreeMap<String, Arg>,
}

/// A whole program: one function, `main`.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    pub inputs: Vec<Input>,
    pub consts: Vec<Const>,
    pub ops: Vec<Operation>,
    pub outputs: Vec<String>,
    /// The float type every float value computes in.
    pub float: DType,
    /// The OS the program is built for (its opset and the LUT forms it may use).
    pub target: Target,
}

/// The op list and I/O as they cross to Python (constants travel separately, as arrays).
#[derive(Debug, Serialize)]
pub struct GraphDescription<'a> {
    pub inputs: &'a [Input],
    /// Constant names in creation order, with their kind (`f16`, `i32`, `lut`) and shape.
    pub consts: Vec<ConstDescription<'a>>,
    pub ops: &'a [Operation],
    pub outputs: &'a [String],
    #[serde(serialize_with = "dtype_name")]
    pub float: DType,
    pub target: Target,
}

#[derive(Debug, Serialize)]
pub struct ConstDescription<'a> {
    pub name: &'a str,
    pub kind: &'static str,
    pub shape: &'a [usize],
    pub nbits: Option<u8>,
}

/// A graph that does not hang together.
#[derive(Debug, Error, PartialEq)]
pub enum GraphError {
    #[error("value `{0}` is defined twice")]
    Duplicate(String),
    #[error("op {index} (`{op}`) reads `{name}`, which is not defined before it")]
    Undefined { index: usize, op: Op, name: String },
    #[error("output `{0}` is never produced")]
    MissingOutput(String),
    #[error("constant `{name}` holds {found} values, its shape {shape:?} needs {expected}")]
    ConstSize {
        name: String,
        shape: Vec<usize>,
        expected: usize,
        found: usize,
    },
    #[error("constant `{name}`: {message}")]
    BadLut { name: String, message: String },
    #[error("model does not fit the builder: {0}")]
    Unsupported(String),
}

impl Graph {
    /// Check that every name is defined once, before use, that outputs exist, and that each
    /// constant's data matches its shape.
    pub fn validate(&self) -> Result<(), GraphError> {
        let mut defined: HashSet<&str> = HashSet::new();
        for i in &self.inputs {
            if !defined.insert(&i.name) {
                return Err(GraphError::Duplicate(i.name.clone()));
            }
        }
        for c in &self.consts {
            if !defined.insert(&c.name) {
                return Err(GraphError::Duplicate(c.name.clone()));
            }
            check_const(c, self.target)?;
        }
        for (index, op) in self.ops.iter().enumerate() {
            for arg in op.args.values() {
                let names: &[String] = match arg {
                    Arg::Var(n) => std::slice::from_ref(n),
                    Arg::Vars(ns) => ns,
                    _ => &[],
                };
                for n in names {
                    if !defined.contains(n.as_str()) {
                        return Err(GraphError::Undefined {
                            index,
                            op: op.op,
                            name: n.clone(),
                        });
                    }
                }
            }
            for o in &op.outputs {
                if !defined.insert(o) {
                    return Err(GraphError::Duplicate(o.clone()));
                }
            }
        }
        for o in &self.outputs {
            if !defined.contains(o.as_str()) {
                return Err(GraphError::MissingOutput(o.clone()));
            }
        }
        Ok(())
    }

    /// The serializable description the bridge reads.
    pub fn description(&self) -> GraphDescription<'_> {
        GraphDescription {
            inputs: &self.inputs,
            consts: self
                .consts
                .iter()
                .map(|c| ConstDescription {
                    name: &c.name,
                    kind: c.data.kind(),
                    shape: &c.shape,
                    nbits: match &c.data {
                        ConstData::Lut(p) => Some(p.nbits),
                        ConstData::GroupedLut(g) => Some(g.nbits),
                        _ => None,
                    },
                })
                .collect(),
            ops: &self.ops,
            outputs: &self.outputs,
            float: self.float,
            target: self.target,
        }
    }

    /// Number of ops of one type.
    pub fn count_ops(&self, op: Op) -> usize {
        self.ops.iter().filter(|o| o.op == op).count()
    }

    /// The fewest index bits of any palettized constant; `None` when none is palettized.
    pub fn min_lut_bits(&self) -> Option<u32> {
        self.consts
            .iter()
            .filter_map(|c| match &c.data {
                ConstData::Lut(p) => Some(p.nbits as u32),
                ConstData::GroupedLut(g) => Some(g.nbits as u32),
                _ => None,
            })
            .min()
    }

    /// Bytes the constants take when stored (fp16 values, packed indices + LUTs, int32).
    pub fn const_bytes(&self) -> u64 {
        self.consts
            .iter()
            .map(|c| match &c.data {
                ConstData::F16(v) => 2 * v.len() as u64,
                ConstData::I32(v) => 4 * v.len() as u64,
                ConstData::Lut(p) => p.bytes(),
                ConstData::GroupedLut(g) => g.bytes(),
            })
            .sum()
    }
}

fn check_const(c: &Const, target: Target) -> Result<(), GraphError> {
    let bad = |message: String| GraphError::BadLut {
        name: c.name.clone(),
        message,
    };
    match (&c.data, target) {
        (ConstData::GroupedLut(_), Target::Ios17) => {
            return Err(bad(
                "grouped LUTs and per-channel scales need target ios18".into()
            ))
        }
        (ConstData::Lut(p), Target::Ios17) if !IOS17_NBITS.contains(&p.nbits) => {
            return Err(bad(format!("{}-bit LUTs need target ios18", p.nbits)))
        }
        (ConstData::GroupedLut(g), _) => return g.check(&c.shape).map_err(bad),
        _ => {}
    }
    let expected = c.numel();
    let size_err = |found: usize| GraphError::ConstSize {
        name: c.name.clone(),
        shape: c.shape.clone(),
        expected,
        found,
    };
    match &c.data {
        ConstData::F16(v) if v.len() != expected => Err(size_err(v.len())),
        ConstData::I32(v) if v.len() != expected => Err(size_err(v.len())),
        ConstData::Lut(p) => p.check(expected).map_err(|message| GraphError::BadLut {
            name: c.name.clone(),
            message,
        }),
        _ => Ok(()),
    }
}

/// Appends ops with fresh, readable names.
#[derive(Debug)]
pub struct Builder {
    graph: Graph,
    used: HashSet<String>,
}

impl Builder {
    pub fn new(float: DType) -> Self {
        Builder {
            graph: Graph {
                inputs: Vec::new(),
                consts: Vec::new(),
                ops: Vec::new(),
                outputs: Vec::new(),
                float,
                target: Target::Ios17,
            },
            used: HashSet::new(),
        }
    }

    pub fn float(&self) -> DType {
        self.graph.float
    }

    /// Build for `target` (iOS17 unless set).
    pub fn set_target(&mut self, target: Target) {
        self.graph.target = target;
    }

    pub fn target(&self) -> Target {
        self.graph.target
    }

    fn claim(&mut self, name: &str) -> String {
        if self.used.insert(name.to_string()) {
            return name.to_string();
        }
        let mut i = 1;
        loop {
            let n = format!("{name}_{i}");
            if self.used.insert(n.clone()) {
                return n;
            }
            i += 1;
        }
    }

    pub fn input(&mut self, name: &str, dtype: DType, shape: Vec<usize>) -> String {
        let name = self.claim(name);
        self.graph.inputs.push(Input {
            name: name.clone(),
            dtype,
            shape,
            state: false,
        });
        name
    }

    /// A state input (iOS18): the program reads it with [`Op::ReadState`] and stores a new value
    /// with [`Op::CoremlUpdateState`].
    pub fn state_input(&mut self, name: &str, dtype: DType, shape: Vec<usize>) -> String {
        let name = self.input(name, dtype, shape);
        if let Some(i) = self.graph.inputs.last_mut() {
            i.state = true;
        }
        name
    }

    pub fn constant(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        data: ConstData,
        source: Option<String>,
    ) -> String {
        let name = self.claim(name);
        self.graph.consts.push(Const {
            name: name.clone(),
            shape,
            data,
            source,
        });
        name
    }

    /// Give constant `name` the shape `to(its shape)`, with the same number of elements (a
    /// projection's [out, in] weight as a 1×1 conv's [out, in, 1, 1]: no stored value moves).
    /// Returns the new shape.
    pub fn reshape_const(
        &mut self,
        name: &str,
        to: impl FnOnce(&[usize]) -> Vec<usize>,
    ) -> Result<Vec<usize>, GraphError> {
        let c = self
            .graph
            .consts
            .iter_mut()
            .find(|c| c.name == name)
            .ok_or_else(|| GraphError::MissingOutput(name.to_string()))?;
        let shape = to(&c.shape);
        if shape.iter().product::<usize>() != c.numel() {
            return Err(GraphError::Unsupported(format!(
                "constant `{name}` {:?} cannot be laid out as {shape:?}",
                c.shape
            )));
        }
        c.shape = shape.clone();
        Ok(shape)
    }

    /// Append `op` with one output named `name` (made unique); returns the output name.
    pub fn op(&mut self, op: Op, name: &str, args: Vec<(&str, Arg)>) -> String {
        let out = self.claim(name);
        self.graph.ops.push(Operation {
            op,
            outputs: vec![out.clone()],
            args: args.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        });
        out
    }

    /// Append an op with several outputs (`split`).
    pub fn op_multi(&mut self, op: Op, names: &[&str], args: Vec<(&str, Arg)>) -> Vec<String> {
        let outs: Vec<String> = names.iter().map(|n| self.claim(n)).collect();
        self.graph.ops.push(Operation {
            op,
            outputs: outs.clone(),
            args: args.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        });
        outs
    }

    pub fn finish(mut self, outputs: Vec<String>) -> Result<Graph, GraphError> {
        self.graph.outputs = outputs;
        self.graph.validate()?;
        Ok(self.graph)
    }
}

/// Shorthand for a variable argument.
pub fn var(name: &str) -> Arg {
    Arg::Var(name.to_string())
}

/// Shorthand for an int-list argument.
pub fn ints(values: &[i64]) -> Arg {
    Arg::Ints(values.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Builder {
        let mut b = Builder::new(DType::F16);
        b.input("x", DType::F16, vec![1, 4]);
        b.constant(
            "w",
            vec![4, 4],
            ConstData::F16(vec![f16::ONE; 16]),
            Some("w.weight".into()),
        );
        b
    }

    #[test]
    fn names_resolve_in_order() {
        let mut b = tiny();
        let y = b.op(Op::Linear, "y", vec![("x", var("x")), ("weight", var("w"))]);
        let y2 = b.op(Op::Linear, "y", vec![("x", var(&y)), ("weight", var("w"))]);
        assert_eq!(y2, "y_1");
        let g = b.finish(vec![y2]).unwrap();
        assert_eq!(g.count_ops(Op::Linear), 2);
        assert_eq!(g.const_bytes(), 32);
    }

    #[test]
    fn use_before_definition_is_caught() {
        let mut b = tiny();
        b.op(Op::Add, "y", vec![("x", var("x")), ("y", var("later"))]);
        let err = b.finish(vec!["y".into()]).unwrap_err();
        assert!(matches!(err, GraphError::Undefined { ref name, .. } if name == "later"));
    }

    #[test]
    fn missing_output_is_caught() {
        let b = tiny();
        assert_eq!(
            b.finish(vec!["nope".into()]).unwrap_err(),
            GraphError::MissingOutput("nope".into())
        );
    }

    #[test]
    fn lut_sizes_are_checked() {
        let mut b = Builder::new(DType::F16);
        b.constant(
            "p",
            vec![3, 3],
            ConstData::Lut(PackedLut {
                nbits: 4,
                lut: vec![f16::ZERO; 16],
                packed: vec![0; 4],
            }),
            None,
        );
        // 9 elements at 4 bits need 5 bytes.
        assert!(matches!(
            b.finish(vec!["p".into()]).unwrap_err(),
            GraphError::BadLut { .. }
        ));
        let mut b = Builder::new(DType::F16);
        b.constant(
            "p",
            vec![3, 3],
            ConstData::Lut(PackedLut {
                nbits: 3,
                lut: vec![f16::ZERO; 8],
                packed: vec![0; 4],
            }),
            None,
        );
        // 3-bit tables are iOS18's.
        assert!(b.finish(vec!["p".into()]).is_err());
    }

    #[test]
    fn grouped_luts_need_ios18_and_matching_sizes() {
        let grouped = |target: Target, rows: usize| {
            let mut b = Builder::new(DType::F16);
            b.set_target(target);
            b.constant(
                "g",
                vec![rows, 2],
                ConstData::GroupedLut(GroupedLut {
                    nbits: 1,
                    group_rows: 2,
                    luts: vec![f16::ZERO; 4],
                    packed: vec![0; 1],
                    row_scale: Some(vec![f16::ONE; rows]),
                }),
                None,
            );
            b.finish(vec!["g".into()])
        };
        let g = grouped(Target::Ios18, 4).unwrap();
        assert_eq!(g.const_bytes(), 1 + 8 + 8);
        assert_eq!(g.description().consts[0].nbits, Some(1));
        assert!(matches!(
            grouped(Target::Ios17, 4).unwrap_err(),
            GraphError::BadLut { ref message, .. } if message.contains("ios18")
        ));
        assert!(
            grouped(Target::Ios18, 3).is_err(),
            "2 tables of 2 rows for 3 rows"
        );
    }

    #[test]
    fn dense_sizes_are_checked() {
        let mut b = Builder::new(DType::F16);
        b.constant("c", vec![2, 3], ConstData::I32(vec![0; 5]), None);
        assert!(matches!(
            b.finish(vec!["c".into()]).unwrap_err(),
            GraphError::ConstSize {
                expected: 6,
                found: 5,
                ..
            }
        ));
    }
}
