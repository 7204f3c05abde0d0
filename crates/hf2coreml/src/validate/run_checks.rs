//! `validate`: the checks in order (the contract, the reference's and the package's logits,
//! the weights, the gates, the lint) and the report they make. The checks themselves are in
//! the leaf files beside this one.

use std::path::Path;

use super::contract_items::{
    check_chain, check_contract, check_hashes, check_source, per_layer_items,
};
use super::gates::{default_gates, RecipeKind};
use super::metrics::compare_logits;
use super::report::{ActivationRange, ValidationReport};
use super::scoring::{reference_logits, score_tokens_keeping, text_tokens};
use super::weight_scores::check_weights;
use crate::checkpoint::Checkpoint;
use crate::mil::chain_file::ChainFile;
use crate::mlpackage::MlPackage;
use crate::progress::Progress;
use crate::runtime::chain_runner::Saved;
use crate::runtime::interp::Compute;

pub use super::validate_error::{ValidateError, ValidateOptions, EVALUATION_TEXT};

/// Run every check; the report says what passed.
pub fn validate(
    pkg_path: &Path,
    ckpt: &Checkpoint,
    opts: &ValidateOptions,
) -> Result<ValidationReport, ValidateError> {
    validate_with_progress(pkg_path, ckpt, opts, &crate::progress::Silent)
}

/// [`validate`], reporting its long stages to `progress`: the reference's logits ("reference",
/// one step) and the package's over the text ("score", one step per token).
pub fn validate_with_progress(
    pkg_path: &Path,
    ckpt: &Checkpoint,
    opts: &ValidateOptions,
    progress: &dyn Progress,
) -> Result<ValidationReport, ValidateError> {
    let package = Saved::load(pkg_path, opts.interp)?;
    if opts.cross_check {
        super::crosscheck::check_request(&package, opts.interp.compute == Compute::F32)?;
    }
    let on_apples_runtime = match &package {
        Saved::CoreAi(_) => true,
        Saved::Chain(ch) => ch.is_coreai(),
        Saved::Package(_) => false,
    };
    if on_apples_runtime {
        return super::asset::validate_asset(pkg_path, &package, ckpt, opts, progress);
    }
    let raws = match &package {
        Saved::Package(_) => vec![MlPackage::open(pkg_path)?],
        Saved::CoreAi(_) => unreachable!("validated above"),
        Saved::Chain(ch) => ch
            .chain()
            .parts
            .iter()
            .map(|p| MlPackage::open(&ChainFile::part_path(pkg_path, p)))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let c = package.contract().clone();
    check_source(&c, ckpt, pkg_path)?;
    let tokens = text_tokens(&c, opts)?;
    let (backend, expected) = reference_logits(ckpt, &tokens, opts.reference_budget, progress)?;
    let mut report = ValidationReport::new(
        &pkg_path.display().to_string(),
        &ckpt.dir().display().to_string(),
        &backend,
        opts.text_name,
    );
    report.contract = match &package {
        Saved::Package(_) => {
            let mut items = check_contract(&raws[0], &c, ckpt);
            items.extend(per_layer_items(pkg_path, &c, ckpt));
            items.extend(super::functions::check_functions(&raws[0], &c));
            items
        }
        Saved::Chain(ch) => {
            let mut items = check_chain(ch.chain(), &raws, ckpt);
            items.extend(per_layer_items(pkg_path, &c, ckpt));
            items.extend(check_hashes(pkg_path, ch.chain()));
            items
        }
        Saved::CoreAi(_) => unreachable!("validated above"),
    };
    report.lint = Some(crate::lint::lint_saved(
        pkg_path,
        &crate::lint::Policy::default(),
    )?);
    let programs = package.programs();
    let (weights, min_bits) = check_weights(&raws, ckpt, &programs)?;
    report.weights = weights;

    let keep = super::functions::prefill_positions(&package, tokens.len());
    let (got, stats, cache) = score_tokens_keeping(&package, &tokens, progress, keep)?;
    let comparison = compare_logits(&expected, &got, &tokens)?;
    report.contract.extend(super::functions::check_prefill(
        &package, &tokens, &got, &cache,
    )?);
    report.activations = stats
        .ops
        .iter()
        .map(|(kind, s)| ActivationRange {
            op_kind: kind.clone(),
            max_abs: s.max_abs as f64,
            nonfinite: s.non_finite,
            first_nonfinite_op: None,
        })
        .collect();
    let gates = if opts.gates.is_empty() {
        default_gates(RecipeKind::of_package(min_bits, &c))
    } else {
        opts.gates.clone()
    };
    report.set_behaviour(comparison, &gates);
    if opts.cross_check {
        report.cross_check = Some(super::crosscheck::cross_check(
            &package, &tokens, &expected, &got, progress,
        )?);
    }
    Ok(report)
}
