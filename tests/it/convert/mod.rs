//! `convert` on tiny generated checkpoints: the package's contract and weights, its options,
//! what it computes against the float reference, the Neural Engine layout, fp16 range scaling,
//! iOS18 grouped LUTs and multifunction packages, a job's plan, and the memory it (and
//! `validate`) needs.

mod agreement;
pub(crate) mod ane_layout;
mod ios18;
mod job;
mod memory;
mod multifunction;
mod options;
mod range_scaling;
mod tiny;
