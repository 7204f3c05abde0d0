//! What the graph builder, the coremltools bridge and the package reader share: the MIL
//! element types ([`DType`]) and operations ([`Op`]), the package contract (inputs, outputs,
//! metadata) and the options a package is built with ([`PackageOptions`]).

pub mod chain_file;
pub mod contract;
pub mod dtype;
pub mod op;
pub mod package_options;

pub use dtype::DType;
pub use op::Op;
pub use package_options::PackageOptions;
