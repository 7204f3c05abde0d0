//! Why validation could not run to a verdict, and what it validates against: the errors, the
//! options and the shipped evaluation text.

use std::path::PathBuf;

use super::gates::Gate;
use super::metrics::MetricError;
use crate::checkpoint::CheckpointError;
use crate::mlpackage::PackageError;
use crate::model::ReferenceError;
use crate::runtime::generate::GenerateError;
use crate::runtime::interp::Options;
use crate::runtime::RuntimeError;

/// Why validation could not run to a verdict (a failed gate is not an error: it is in the
/// report).
#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    #[error(
        "the float reference of {} computes {what} at every position: a package cannot be \
         judged against it (check the checkpoint's config and weights)",
        .checkpoint.display()
    )]
    DegenerateReference {
        checkpoint: PathBuf,
        what: &'static str,
    },
    #[error(transparent)]
    Package(#[from] PackageError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Metric(#[from] MetricError),
    #[error(transparent)]
    Lint(#[from] crate::lint::LintError),
    #[error(
        "{package} was not converted from {checkpoint}: the package's dimensions differ from \
         the checkpoint's ({differ})"
    )]
    NotFromCheckpoint {
        package: std::path::PathBuf,
        checkpoint: std::path::PathBuf,
        differ: String,
    },
    /// Fewer than two positions to score: says which bound cut them.
    #[error("{0}")]
    TextTooShort(String),
    /// `--cross-check` refused, or the cross-check could not run.
    #[error("cross-check: {0}")]
    CrossCheck(String),
    #[error(transparent)]
    Emit(#[from] crate::emit::EmitError),
    #[error("the generator recorded no logits")]
    NoLogits,
    #[error("package weight `{package}` has {got} elements, checkpoint tensor `{tensor}` has {expected}")]
    WeightSize {
        package: String,
        tensor: String,
        got: usize,
        expected: usize,
    },
}

/// The evaluation passage shipped with the tool (distinct from the calibration text).
pub const EVALUATION_TEXT: &str = include_str!("../../../../assets/evaluation.txt");

/// What to validate against.
pub struct ValidateOptions<'a> {
    /// The evaluation text as token ids (without BOS: the contract's BOS is added here).
    pub tokens: &'a [u32],
    /// What the tokens are, for the report (file name and how it was tokenized).
    pub text_name: &'a str,
    /// Explicit gates; empty → the defaults for the package's recipe kind.
    pub gates: Vec<Gate>,
    pub interp: Options,
    /// Evaluate at most this many tokens (also capped by the package's S).
    pub max_tokens: Option<usize>,
    /// f32 weights above which the reference runs block by block
    /// ([`crate::model::layerwise::REFERENCE_BUDGET`] by default; 0: always).
    pub reference_budget: u64,
    /// Also run the package's program on Apple's Core AI runtime and compare
    /// ([`super::crosscheck`]).
    pub cross_check: bool,
}
