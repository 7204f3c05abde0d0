//! How long library work reports its progress, and what it has to say on the way. The library
//! calls a [`Progress`]; the binary's printer draws it (bars on a terminal, nothing elsewhere;
//! notes and details as `--quiet` / `--verbose` say) and tests pass [`Silent`].

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
    /// A note worth showing by default (what was chosen, what is happening); a quiet
    /// implementation drops it.
    fn note(&self, _message: &str) {}
    /// A detail worth showing only to who asked for details (`--verbose`).
    fn detail(&self, _message: &str) {}
}

/// Shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl Progress for Silent {}
