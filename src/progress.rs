//! How long library work reports its progress. The library calls a [`Progress`]; the binary's
//! printer draws it (bars on a terminal, nothing elsewhere) and tests pass [`Silent`].

/// Receives the stages of a long operation. Every method has a default that does nothing, so
/// an implementation takes only what it shows.
pub trait Progress: Sync {
    /// A stage of `total` steps begins (`label` is a short noun: "importing", "serialize").
    fn begin(&self, _label: &str, _total: u64) {}
    /// What the current stage works on now (a tensor's name, a tool's).
    fn working_on(&self, _what: &str) {}
    /// `steps` more steps of the current stage are done.
    fn advance(&self, _steps: u64) {}
    /// The current stage is over.
    fn end(&self) {}
}

/// Shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl Progress for Silent {}
