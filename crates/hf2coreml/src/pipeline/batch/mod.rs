//! `batch`: a file of exports (models × lengths × recipes × devices), expanded ([`file`]), run
//! through the same [`Job`](super::job::Job) as `convert` with a validation cache ([`runner`]),
//! and reported ([`batch_report`]).

pub mod batch_report;
pub mod file;
pub mod runner;

pub use batch_report::{
    render_list, render_summary, BatchReport, Counts, ExportReport, Seconds, Status, Validation,
    REPORT_SCHEMA,
};
pub use file::{
    BatchError, BatchFile, Export, FillError, RecipeSource, Shard, ValidateSpec, MAX_EXPORTS,
};
pub use runner::{bounded_jobs, BatchSettings, ExportError};
