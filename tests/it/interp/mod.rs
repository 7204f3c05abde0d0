//! The MIL interpreter: programs coremltools built and saved (every op of a decode step, LUT
//! weights), a decode step through `StepModel`, and the packages `convert` writes.

mod cases;
mod emitted;
mod step;
