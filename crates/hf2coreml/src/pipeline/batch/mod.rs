//! `batch`: a file of exports (models × lengths × recipes × devices), expanded ([`file`]), run
//! through the same [`Job`](super::job::Job) as `convert` with a validation cache ([`run`]),
//! and reported ([`report`]).

pub mod file;
pub mod report;
pub mod run;

pub use file::{
    BatchError, BatchFile, Export, FillError, RecipeSource, Shard, ValidateSpec, MAX_EXPORTS,
};
pub use report::{
    render_list, render_summary, BatchReport, Counts, ExportReport, Seconds, Status, Validation,
    REPORT_SCHEMA,
};
pub use run::{bounded_jobs, BatchSettings, ExportError};
