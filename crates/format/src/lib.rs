//! hf2coreml's formats and the foundations under them: what the library, the interpreter and
//! the binary all read or write the same way.
//!
//! - [`error`]: the exit classes the binary maps to codes.
//! - [`fsutil`]: outputs written atomically beside their destination, input files read within
//!   a limit, scratch directories removed on a signal.
//! - [`mil`]: the MIL vocabulary (element types, operations), the package contract, the chain
//!   file and a package's build options.
//! - [`mlpackage`]: a saved `.mlpackage` read back (Manifest, the protobuf subset, weight.bin).
//!
//! What each module may import is stated in docs/architecture.md.

// Foundations: they import nothing of ours.
pub mod error;
pub mod fsutil;

// The formats, lowest layer first: a module imports only modules declared above it. rustfmt
// sorts modules between comments, hence one each.
// Element types, ops, the contract, the chain file.
pub mod mil;
// Reading packages back.
pub mod mlpackage;
