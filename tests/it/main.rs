//! The integration tests: one test binary, a module per area, linked once. `support` holds
//! what they share (the binary's environment, prerequisites, a toy model).
//!
//! Run one area with `cargo test --test it -- convert::`, one test by name with
//! `cargo test --test it -- NAME`. Tests that need the Python environment or the real model
//! start with `needs!(...)`: `make test` provides both and fails a test whose prerequisite is
//! missing; a plain `cargo test` without them skips those tests and says so in one line.
//!
//! proptest keeps the failing cases it finds beside this crate's root, in
//! tests/proptest-regressions/<module path>.txt: commit them, they are replayed first.
//!
//! Two test binaries stand beside this one, each saying why at its top: tests/security (hostile
//! inputs, whose children's peak memory is measured with wait4, which counts the spawning
//! process's own size) and tests/chat_template_files.rs (it changes the working directory).

mod support;

mod arch;
mod architecture;
mod batch;
mod chain;
mod cli;
mod convert;
mod coreai;
mod crosscheck;
mod fuzz;
mod gguf;
mod graph;
mod interp;
mod lint;
mod mlpackage;
mod quant;
mod real;
mod reference;
mod runtime;
mod state;
mod validate;
