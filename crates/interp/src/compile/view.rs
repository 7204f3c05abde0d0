//! A compiled program as it runs, read-only: what another backend needs to replay exactly what
//! the interpreter computes (validate's cross-check lifts it into a graph for Apple's runtime).

use std::collections::HashMap;
use std::sync::Arc;

use super::instr::Instr;
use crate::exec::packed::Packed;
use crate::exec::tensor::Tensor;
use crate::mlpackage::TensorTypeInfo;

/// A [`Program`](super::Program)'s compiled form, borrowed: values are slots, constants are
/// the values the interpreter runs with, and weights left in the weight file stay packed.
#[derive(Clone, Copy)]
pub struct ProgramView<'p> {
    /// Declared inputs: name, slot, type.
    pub inputs: &'p [(String, usize, TensorTypeInfo)],
    /// Declared states: name, slot, type.
    pub states: &'p [(String, usize, TensorTypeInfo)],
    /// The instructions in the order they run.
    pub instrs: &'p [Instr],
    /// Declared outputs: name, slot.
    pub outputs: &'p [(String, usize)],
    /// Constants decoded at load, by slot.
    pub consts: &'p [(usize, Arc<Tensor>)],
    /// Weights read from the weight file at each call, by slot.
    pub packed: &'p HashMap<usize, Arc<Packed>>,
    /// The slot of each named constant.
    pub const_names: &'p HashMap<String, usize>,
}
