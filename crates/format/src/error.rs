//! Exit codes and the error classes the binary maps onto them (docs/design.md, "Errors and
//! exit codes").
//!
//! Library modules keep their own thiserror enums. Two marker types here let any layer say
//! "this is not bad input": [`CheckFailed`] (exit 1) and [`EnvironmentError`] (exit 3). Everything
//! else that reaches `main` as an error is bad input or configuration (exit 2).

use std::fmt;

/// Process exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCode {
    Success = 0,
    /// A check or quality gate failed (budget does not fit, validation gate failed).
    CheckFailed = 1,
    /// Bad input or configuration.
    BadInput = 2,
    /// Environment problem: Python, coremltools or the platform is missing.
    Environment = 3,
}

/// A check or gate that failed; the command already printed its report.
#[derive(Debug, Clone)]
pub struct CheckFailed(pub String);

impl fmt::Display for CheckFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for CheckFailed {}

/// The machine lacks something the command needs; `fix` is the command that fixes it.
#[derive(Debug, Clone)]
pub struct EnvironmentError {
    pub message: String,
    pub fix: String,
}

impl fmt::Display for EnvironmentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}
impl std::error::Error for EnvironmentError {}

/// An error and its causes, outermost first (the chain `main` prints).
pub fn causes<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(err), |e| e.source())
}

/// The exit code the markers among an error's causes call for: the first [`EnvironmentError`]
/// (exit 3) or [`CheckFailed`] (exit 1) found, else bad input (exit 2). An error type that
/// hides a marker behind its own text (a transparent wrapper) says so with an `exit_code`
/// method of its own.
pub fn exit_code_of(err: &(dyn std::error::Error + 'static)) -> ExitCode {
    for cause in causes(err) {
        if cause.is::<EnvironmentError>() {
            return ExitCode::Environment;
        }
        if cause.is::<CheckFailed>() {
            return ExitCode::CheckFailed;
        }
    }
    ExitCode::BadInput
}
