//! Compilation, above the kernels of `exec`: a saved function turned into a [`Program`] that
//! runs on them, and what a caller asks of one.
//!
//! One idea per file, each importing only the ones before it: [`surface`] holds what every
//! caller sees (errors, options, statistics); [`instr`] the compiled form (instructions, their
//! arguments); [`loader`] the state of a program while it compiles, which only it writes;
//! [`constexpr`] evaluates the weight ops at load and [`packing`] recognises the weights that
//! stay packed in the weight file; [`translate`] turns one operation into a constant or an
//! instruction; [`weights`] settles which weights stay packed, fp16 or are dropped;
//! [`liveness`] when each value is freed and which state updates are made in place;
//! [`consts`] reads constants back by name; [`view`] shows a compiled program as it runs;
//! [`program`] is the [`Program`] itself, compiled and run.

pub(super) mod constexpr;
mod consts;
mod instr;
mod liveness;
mod loader;
mod packing;
mod program;
mod surface;
mod translate;
mod view;
mod weights;

pub use consts::ConstantReader;
pub use instr::{Arg, Instr, OpKind};
pub use program::Program;
pub use surface::{Compute, OpStat, Options, RuntimeError, Stats};
pub use view::ProgramView;
