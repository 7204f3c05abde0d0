//! hf2coreml: Hugging Face causal LMs → Core ML ML Programs (iOS17, iOS18) and Core AI assets
//! with palettized weights, a fixed max_sequence_length and a static KV cache, validated on any
//! machine.
//!
//! The module tree is the pipeline, and data flows one way:
//! checkpoint → model → quant → graph → emit → mlpackage → runtime → validate, with
//! `pipeline` orchestrating them for the commands. What each module may import is stated once,
//! in docs/architecture.md.

// Foundations: they import no other module of the library. The exit classes and the file
// handling are the format crate's, re-exported where they belong.
pub use hf2coreml_format::error;
pub use hf2coreml_format::fsutil;
pub mod progress;
pub mod util;

// The rest, lowest layer first: a module imports only modules declared above it (the table in
// docs/architecture.md says which; tests/it/architecture checks both). rustfmt sorts modules
// between comments, hence one each.
// The embedded Python the bridges run in.
pub mod pyenv;
// What builder, bridge and reader share: element types, ops, the contract (the format
// crate's).
pub use hf2coreml_format::mil;
// Architectures, tensor roles and names.
pub mod arch;
// Reading checkpoints: safetensors, config.json, GGUF.
pub mod checkpoint;
// The float reference.
pub mod model;
// Palettization and recipes.
pub mod quant;
// The memory model and the split planner, beside the pipeline.
pub mod budget;
// The decoder-step graph.
pub mod graph;
// `.aimodel` assets read back, checked and run by Apple's Core AI runtime (in a child process).
pub mod aimodel;
// Serialization through coremltools and coreai-core.
pub mod emit;
// Reading packages back (the format crate's).
pub use hf2coreml_format::mlpackage;
// Neural Engine readiness of a saved package.
pub mod lint;
// The interpreter (the interp crate's) and generation.
pub mod runtime;
// Checking a package against its checkpoint.
pub mod validate;
// Orchestration for the commands.
pub mod pipeline;

/// The tool's version, recorded in every package it writes.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
