//! What the graph builder, the coremltools bridge and the package reader share: the MIL
//! element types ([`DType`]) and operations ([`Op`]) and the package contract (inputs, outputs, metadata).

pub mod chain;
pub mod contract;
pub mod dtype;
pub mod ops;

pub use dtype::DType;
pub use ops::Op;
