//! Orchestration: the library's own API for what the commands do. Typed settings in, results
//! out, progress and notes through [`crate::progress::Progress`]; no argument parsing and no
//! printing.

pub mod batch;
pub mod chain;
pub mod convert;
pub mod inspect;
pub mod job;
pub mod weights;
