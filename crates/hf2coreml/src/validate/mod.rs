//! Validation: how closely a package follows its checkpoint. The metrics and gates here are
//! pure functions over logits and weights; the `validate` command feeds them the package run
//! by the interpreter and the [`crate::model`] forward pass; [`crosscheck`] sets Apple's Core AI
//! runtime beside the interpreter on the same program.

mod asset;
mod contract_items;
pub mod crosscheck;
pub mod functions;
pub mod gates;
mod lift;
pub mod metrics;
pub mod report;
pub mod run_checks;
mod scoring;
mod validate_error;
mod weight_scores;

pub use gates::{default_gates, Cmp, Gate, GateError, GateResult, Metric, RecipeKind};
pub use metrics::{
    compare_logits, kl_divergence, log_softmax, max_abs_diff, perplexity, top_k, top_k_overlap,
    LogitComparison, MetricError, WeightError,
};
pub use report::{ActivationRange, ContractItem, ValidationReport};
