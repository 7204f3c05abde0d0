//! Compiling a function into a [`Program`]: names become slots, constants are decoded (or left
//! packed) once, and every instruction records which values die after it. What a compiled
//! program exposes besides running it: its declared inputs, states and outputs.

use std::collections::HashMap;
use std::sync::Arc;

use super::limits::Limits;
use super::loader::Loader;
use super::{effective_dtype, Options, RuntimeError, States, Tensor};
use super::{liveness, packed, state, weights};
use crate::mil::{DType, Op};
use crate::mlpackage::{self, proto, MlPackage, TensorTypeInfo};

/// An instruction's argument: a value computed at run time (by slot) or a constant given inline.
#[derive(Debug, Clone)]
pub(super) enum Arg {
    Slot(usize),
    Const(Arc<Tensor>),
}

/// An instruction's operation, resolved once when the program loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum OpKind {
    Known(Op),
    /// A name the interpreter does not implement: the program loads, running it fails with
    /// [`RuntimeError::UnsupportedOp`].
    Unknown(String),
}

impl OpKind {
    pub(super) fn parse(name: &str) -> Self {
        Op::from_name(name).map_or_else(|| OpKind::Unknown(name.to_string()), OpKind::Known)
    }

    /// The MIL name, for errors and statistics.
    pub(super) fn name(&self) -> &str {
        match self {
            OpKind::Known(op) => op.as_str(),
            OpKind::Unknown(name) => name,
        }
    }

    pub(super) fn is(&self, ops: &[Op]) -> bool {
        matches!(self, OpKind::Known(op) if ops.contains(op))
    }
}

/// One operation of a compiled program, its arguments and outputs resolved to slots.
#[derive(Debug)]
pub(super) struct Instr {
    pub(super) op: OpKind,
    pub(super) inputs: Vec<(String, Vec<Arg>)>,
    pub(super) outputs: Vec<(usize, TensorTypeInfo)>,
    pub(super) out_names: Vec<String>,
    /// Slots whose last use is this instruction.
    pub(super) frees: Vec<usize>,
    /// A `slice_update` of a state's value that may write into the state's storage: the
    /// state's slot (see [`state`]).
    pub(super) in_place: Option<usize>,
}

/// A compiled `main` function.
#[derive(Debug)]
pub struct Program {
    pub(super) options: Options,
    pub(super) n_slots: usize,
    pub(super) consts: Vec<(usize, Arc<Tensor>)>,
    /// Weights left in the weight file, by slot: only `linear`, `conv` and `gather` read them.
    pub(super) packed: HashMap<usize, Arc<packed::Packed>>,
    /// The slots of the kept constants, by name (validate reads weights back through them).
    pub(super) const_names: HashMap<String, usize>,
    pub(super) inputs: Vec<(String, usize, TensorTypeInfo)>,
    /// Core ML states (iOS18): name, slot, the wrapped tensor type.
    pub(super) states: Vec<(String, usize, TensorTypeInfo)>,
    pub(super) instrs: Vec<Instr>,
    pub(super) outputs: Vec<(String, usize)>,
    pub(super) opset: String,
    pub(super) limits: Limits,
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

impl Program {
    /// Compile the `main` function of `pkg`, decoding every constant and constexpr weight.
    /// Every declared type, and the sum of the values live at once, is checked against
    /// [`Limits::for_package`] before anything of that size is allocated.
    pub fn load(pkg: &MlPackage, options: Options) -> Result<Self, RuntimeError> {
        Self::load_with(pkg, options, Limits::for_package(pkg.model_dir()))
    }

    /// [`Program::load`] under explicit limits.
    pub fn load_with(
        pkg: &MlPackage,
        options: Options,
        limits: Limits,
    ) -> Result<Self, RuntimeError> {
        Self::compile(pkg, pkg.main_function()?, options, limits)
    }

    /// Compile the function `name` of `pkg` (a multifunction package's `prefill` or
    /// `decode`), under the same limits as [`Program::load`].
    pub fn load_function(
        pkg: &MlPackage,
        name: &str,
        options: Options,
    ) -> Result<Self, RuntimeError> {
        let limits = Limits::for_package(pkg.model_dir());
        Self::compile(pkg, pkg.function(name)?, options, limits)
    }

    fn compile(
        pkg: &MlPackage,
        main: mlpackage::MainFunction<'_>,
        options: Options,
        limits: Limits,
    ) -> Result<Self, RuntimeError> {
        let mut ld = Loader {
            pkg,
            options,
            limits,
            slots: HashMap::new(),
            const_bytes: 0,
            const_cache: HashMap::new(),
            constants: HashMap::new(),
            packed: Vec::new(),
            packed_names: HashMap::new(),
        };
        let mut inputs = Vec::new();
        let mut states = Vec::new();
        for i in main.inputs {
            let (vt, list) = match state_wrapped(i.r#type.as_ref()) {
                Some(w) => (Some(w), &mut states),
                None => (i.r#type.as_ref(), &mut inputs),
            };
            let ty = ld.declared(vt, &format!("input `{}`", i.name))?;
            let s = ld.slot(&i.name);
            list.push((i.name.clone(), s, ty));
        }
        let mut consts = Vec::new();
        let mut instrs = Vec::new();
        for op in &main.block.operations {
            if let Some(c) = ld.instr(op, &mut instrs)? {
                consts.push(c);
            }
        }
        let mut outputs = Vec::new();
        for name in &main.block.outputs {
            let s = *ld.slots.get(name).ok_or_else(|| {
                RuntimeError::Program(format!("block output `{name}` is never defined"))
            })?;
            outputs.push((name.clone(), s));
        }
        let n_slots = ld.slots.len();
        let packed = weights::settle_packed(&mut ld, &instrs, &outputs, &mut consts)?;
        let const_bytes = ld.const_bytes;
        weights::drop_unread_constants(&mut consts, &instrs, &outputs);
        // States stay live across the whole call, like the outputs.
        let kept: Vec<(String, usize)> = outputs
            .iter()
            .cloned()
            .chain(states.iter().map(|(n, s, _)| (n.clone(), *s)))
            .collect();
        liveness::schedule_frees(&mut instrs, &kept, &consts);
        let state_slots: Vec<usize> = states.iter().map(|(_, s, _)| *s).collect();
        state::in_place_updates(&mut instrs, &state_slots);
        let live_in: Vec<_> = inputs.iter().chain(&states).cloned().collect();
        let peak = liveness::peak_live_bytes(&live_in, &instrs, const_bytes);
        limits.check_peak(peak).map_err(|msg| RuntimeError::Limit {
            what: format!("{}", pkg.model_path().display()),
            msg,
        })?;
        weights::store_linear_weights_half(&mut consts, &instrs);
        let kept: std::collections::HashSet<usize> = consts
            .iter()
            .map(|(s, _)| *s)
            .chain(packed.keys().copied())
            .collect();
        let const_names = ld
            .slots
            .iter()
            .filter(|(_, s)| kept.contains(s))
            .map(|(n, s)| (n.clone(), *s))
            .collect();
        Ok(Program {
            options,
            n_slots,
            consts,
            packed,
            const_names,
            inputs,
            states,
            instrs,
            outputs,
            opset: main.opset.to_string(),
            limits,
        })
    }

    /// How many weights are left packed in the weight files (read in place, not held).
    pub fn packed_weights(&self) -> usize {
        self.packed.len()
    }

    /// The limits this program was loaded under.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The function's opset (`CoreML7` for iOS17).
    pub fn opset(&self) -> &str {
        &self.opset
    }

    /// Declared inputs: name, dtype and shape.
    pub fn inputs(&self) -> impl Iterator<Item = (&str, &TensorTypeInfo)> {
        self.inputs.iter().map(|(n, _, t)| (n.as_str(), t))
    }

    /// Declared states (iOS18): name, dtype and shape of the tensor each wraps.
    pub fn states(&self) -> impl Iterator<Item = (&str, &TensorTypeInfo)> {
        self.states.iter().map(|(n, _, t)| (n.as_str(), t))
    }

    /// Fresh values for this program's states: zeros, as Core ML's `makeState()` gives.
    pub fn new_states(&self) -> States {
        let float = effective_dtype(DType::F16, self.options);
        States::zeros(&self.states, float)
    }

    /// Output names in order.
    pub fn output_names(&self) -> impl Iterator<Item = &str> {
        self.outputs.iter().map(|(n, _)| n.as_str())
    }
}

/// The tensor type a state type wraps, if `vt` is a state type.
fn state_wrapped(vt: Option<&proto::ValueType>) -> Option<&proto::ValueType> {
    match vt?.r#type.as_ref()? {
        proto::value_type::Type::StateType(s) => s.wrapped_type.as_ref(),
        _ => None,
    }
}
