//! Orchestration: the library's own API for what the commands do. Typed settings in, results
//! out, progress and notes through [`crate::progress::Progress`]; no argument parsing and no
//! printing.
//!
//! Each file imports only those listed before it: `texts` (the calibration and evaluation
//! texts), `inspect` (a checkpoint's summary), `convert_error`, `package_files` (sidecars and
//! hashes), `convert_summary` (the report and the recorded inputs), `options`,
//! `declared_contract`, `ranges` (fp16 range safety), `weight_stream` (what a package stores),
//! `asset_emit` (graphs as a Core AI asset), `convert_chain`, `convert`, `job` (one conversion
//! as the commands run it), `batch`.

mod asset_emit;
pub mod batch;
pub mod convert;
pub mod convert_chain;
pub mod convert_error;
pub mod convert_summary;
pub mod declared_contract;
pub mod inspect;
pub mod job;
pub mod options;
pub mod package_files;
pub mod ranges;
pub mod texts;
pub mod weight_stream;
