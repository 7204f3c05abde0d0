//! hf2coreml: Hugging Face causal LMs → iOS17 Core ML ML Programs with palettized weights,
//! a fixed max_sequence_length and a static KV cache, validated on any machine.
//!
//! The module tree is the pipeline, and data flows one way (docs/architecture.md):
//! checkpoint → model → quant → graph → emit → mlpackage → runtime → validate, with
//! `pipeline` orchestrating them for the commands.

// Foundations: used by every layer, importing none of them.
pub mod error;
pub mod fsutil;
pub mod progress;
pub mod util;

// The pipeline, lowest layer first.
pub mod arch;
pub mod budget;
pub mod checkpoint;
pub mod emit;
pub mod graph;
pub mod lint;
pub mod mil;
pub mod mlpackage;
pub mod model;
pub mod pipeline;
pub mod quant;
pub mod runtime;
pub mod validate;

#[cfg(any(test, feature = "test-support"))]
pub mod testing;

/// The tool's version, recorded in every package it writes.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
