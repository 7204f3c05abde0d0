//! The MIL interpreter: runs the `main` function of a saved ML Program on the CPU (or, for a
//! multifunction package, each function by name: [`Package`] picks one per call).
//!
//! At load the program is compiled once: names become slots, `const` values and constexpr
//! weights (`constexpr_lut_to_dense`) are decoded to f32 and shared, except the weights that
//! stay packed in the memory-mapped weight file ([`packed`]), and the last use of every
//! intermediate is recorded so it is freed as soon as possible. Each op's result is checked
//! against the shape the program declares and rounded to the declared dtype (fp16 stays fp16
//! and overflows to inf, as on device), unless [`Compute::F32`] is chosen.
//!
//! Two layers, as folders, and the package step on top; each imports only what is below it:
//! - `exec/`, execution: tensors ([`tensor`]), the op kernels ([`ops`], over the numerics
//!   crate's [`kernels`]) and the table that picks one per op, the packed-weight kernels
//!   ([`packed`]), the values of Core ML states ([`States`]) and `slice_update`, large copies
//!   across the thread pool (`bulk`), and the resource limits ([`limits`]). It knows no
//!   program.
//! - `compile/`, compilation: a saved function turned into a [`Program`] (the loader, the
//!   constexpr weight ops evaluated at load, which weights stay packed, when each value is
//!   freed) and everything done with one: running it over `exec`'s kernels, its constants read
//!   back by name ([`ConstantReader`]), its compiled form as it runs ([`ProgramView`], what
//!   validate's cross-check lifts into a graph); and what every caller sees: [`RuntimeError`],
//!   [`Options`], [`Stats`].
//! - `package.rs`, on top: a saved package that follows the contract ([`Package`]), its
//!   functions and contract, one step of it (stateful or not) and the rows of its state; with
//!   [`StepModel`], the step every runner of the contract takes, and Gemma 4's per-layer table
//!   beside a package ([`per_layer_table`]).
//!
//! The formats it reads (`mil`, `mlpackage`) and the foundations (`error`, `fsutil`) are the
//! `hf2coreml-format` crate's.

use hf2coreml_format::{error, fsutil, mil, mlpackage};

// Lowest layer first: a module imports only modules declared above it (docs/architecture.md;
// rustfmt sorts modules between comments, hence one each).
// Execution: it knows no program.
mod exec;
// Compilation, over the kernels of `exec`.
mod compile;
// The contract's step and Gemma 4's per-layer table.
pub mod per_layer_table;
mod step;
// The package step, on top.
mod package;

pub use compile::{
    Arg, Compute, ConstantReader, Instr, OpKind, OpStat, Options, Program, ProgramView,
    RuntimeError, Stats,
};
pub use exec::states::States;
pub use exec::tensor::{Data, Tensor};
pub use exec::{bulk, kernels, limits, ops, packed, tensor};
pub use package::{check_step, concat_rows, split_state, state_tensors, Function, Package};
pub use step::{StepModel, StepOutput};
