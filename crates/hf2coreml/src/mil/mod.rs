//! What the graph builder, the coremltools bridge and the package reader share: the MIL
//! element types ([`DType`]) and operations ([`Op`]), the package contract (inputs, outputs,
//! metadata) and the options a package is built with ([`PackageOptions`]).

pub mod chain_file;
pub mod contract;
pub mod dtype;
pub mod ops;
pub mod package;

pub use dtype::DType;
pub use ops::Op;
pub use package::PackageOptions;
