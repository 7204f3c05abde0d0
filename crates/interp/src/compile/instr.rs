//! The compiled form a program runs in: instructions ([`Instr`]) whose operations are resolved
//! once ([`OpKind`]) and whose arguments are slots or inline constants ([`Arg`]), and the op
//! sets the loader and the run loop treat alike.

use std::sync::Arc;

use crate::exec::tensor::Tensor;
use crate::mil::Op;
use crate::mlpackage::TensorTypeInfo;

/// An instruction's argument: a value computed at run time (by slot) or a constant given inline.
#[derive(Debug, Clone)]
pub enum Arg {
    Slot(usize),
    Const(Arc<Tensor>),
}

/// An instruction's operation, resolved once when the program loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpKind {
    Known(Op),
    /// A name the interpreter does not implement: the program loads, running it fails with
    /// [`RuntimeError::UnsupportedOp`](super::surface::RuntimeError::UnsupportedOp).
    Unknown(String),
}

impl OpKind {
    pub(crate) fn parse(name: &str) -> Self {
        Op::from_name(name).map_or_else(|| OpKind::Unknown(name.to_string()), OpKind::Known)
    }

    /// The MIL name, for errors and statistics.
    pub fn name(&self) -> &str {
        match self {
            OpKind::Known(op) => op.as_str(),
            OpKind::Unknown(name) => name,
        }
    }

    pub fn is(&self, ops: &[Op]) -> bool {
        matches!(self, OpKind::Known(op) if ops.contains(op))
    }
}

/// One operation of a compiled program, its arguments and outputs resolved to slots.
#[derive(Debug)]
pub struct Instr {
    pub op: OpKind,
    /// Each argument's name and what is bound to it.
    pub inputs: Vec<(String, Vec<Arg>)>,
    /// The slots the results go to, with their declared types.
    pub outputs: Vec<(usize, TensorTypeInfo)>,
    pub out_names: Vec<String>,
    /// Slots whose last use is this instruction.
    pub(super) frees: Vec<usize>,
    /// A `slice_update` of a state's value that may write into the state's storage: the
    /// state's slot (see [`in_place_updates`](super::liveness::in_place_updates)).
    pub(super) in_place: Option<usize>,
}

/// Ops that only move elements: their results need no rounding when the dtype is unchanged.
pub(super) const LAYOUT_OPS: &[Op] = &[
    Op::Reshape,
    Op::ExpandDims,
    Op::Squeeze,
    Op::Identity,
    Op::Transpose,
    Op::Concat,
    Op::Split,
    Op::SliceByIndex,
    Op::SliceBySize,
    Op::Tile,
    Op::Gather,
    Op::SliceUpdate,
];

/// Ops that give their input a new shape without touching its elements.
pub(super) const RESHAPE_OPS: &[Op] = &[Op::Reshape, Op::ExpandDims, Op::Squeeze, Op::Identity];

/// Ops whose value is computed once at load.
pub(super) const CONSTEXPR: &[Op] = &[
    Op::Const,
    Op::ConstexprLutToDense,
    Op::ConstexprBlockwiseShiftScale,
];
