//! What the graph builder, the coremltools bridge and the package reader share: the MIL
//! operations ([`ops::Op`]) and the package contract (inputs, outputs, metadata).

pub mod contract;
pub mod ops;

pub use ops::Op;
