//! Running packages on the CPU: the MIL interpreter (`interp`, the `hf2coreml-interp` crate),
//! and the token loop with a preallocated static KV cache, sampling and chat templates on top
//! of any [`StepModel`].

pub use hf2coreml_interp as interp;
pub use hf2coreml_interp::per_layer_table;
pub use hf2coreml_interp::{RuntimeError, StepModel, StepOutput};

pub mod chain_runner;
pub mod chat;
pub mod coreai_model;
pub mod generate;
pub mod kvfile;
pub mod sampling;
pub mod text;
