//! hf2coreml: Hugging Face causal LMs → iOS17 Core ML ML Programs with palettized weights,
//! a fixed max_sequence_length and a static KV cache, validated on any machine.
//!
//! The module tree is the pipeline (see DESIGN.md):
//! checkpoint → arch → quant → graph → emit → mlpackage → runtime → reference → validate.

pub mod arch;
pub mod batch;
pub mod budget;
pub mod checkpoint;
pub mod contract;
pub mod emit;
pub mod error;
pub mod fuzzing;
pub mod graph;
pub mod mlpackage;
pub mod quant;
pub mod reference;
pub mod runtime;
pub mod testing;
pub mod util;
pub mod validate;

/// The tool's version, recorded in every package it writes.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
