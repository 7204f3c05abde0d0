//! Orchestration: the library's own API for what the commands do. Typed settings in, results
//! out; no argument parsing and no printing.

pub mod batch;
pub mod convert;
pub mod inspect;
pub mod weights;
