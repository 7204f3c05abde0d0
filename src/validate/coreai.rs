//! `validate` of an `.aimodel`: the same contract, reference and gates as for a package, with
//! the logits produced by Apple's Core AI runtime. The asset's bytecode is compiled by that
//! runtime, not read by hf2coreml: its weights are judged by the logits they produce, and the
//! report says so.

use std::path::Path;

use super::gates::{default_gates, RecipeKind};
use super::metrics::compare_logits;
use super::report::{ContractItem, ValidationReport};
use super::run::{
    check_source, item, reference_logits, score_tokens, text_tokens, ValidateError, ValidateOptions,
};
use crate::checkpoint::Checkpoint;
use crate::mil::contract::{self, Contract};
use crate::progress::Progress;
use crate::runtime::chain::Saved;
use crate::runtime::coreai::{CoreAiModel, FUNCTION};

/// Validate the asset `model` (loaded as `package`) against `ckpt`.
pub(super) fn validate_asset(
    path: &Path,
    model: &CoreAiModel,
    package: &Saved,
    ckpt: &Checkpoint,
    opts: &ValidateOptions,
    progress: &dyn Progress,
) -> Result<ValidationReport, ValidateError> {
    let c = model.contract().clone();
    check_source(&c, ckpt, path)?;
    let tokens = text_tokens(&c, opts)?;
    let (backend, expected) = reference_logits(ckpt, &tokens, opts.reference_budget, progress)?;
    let mut report = ValidationReport::new(
        &path.display().to_string(),
        &ckpt.dir().display().to_string(),
        &backend,
        opts.text_name,
    );
    report.runtime = Some(package.runtime_name().to_string());
    report.contract = check_asset(model, &c, ckpt)?;
    let (got, _stats) = score_tokens(package, &tokens, progress)?;
    let comparison = compare_logits(&expected, &got, &tokens)?;
    let gates = if opts.gates.is_empty() {
        default_gates(RecipeKind::from_min_bits(model.min_bits()))
    } else {
        opts.gates.clone()
    };
    report.set_behaviour(comparison, &gates);
    Ok(report)
}

/// The contract against the checkpoint, and the asset's `main` as Apple's runtime describes
/// it against the contract's inputs and outputs.
fn check_asset(
    model: &CoreAiModel,
    c: &Contract,
    ckpt: &Checkpoint,
) -> Result<Vec<ContractItem>, ValidateError> {
    let spec = ckpt.spec();
    let mut items = vec![
        item("target", "coreai", c.target.as_str()),
        item("contract version", contract::CONTRACT_VERSION, c.version),
        item("layers", spec.num_hidden_layers, c.num_layers),
        item("kv heads", spec.num_key_value_heads, c.num_kv_heads),
        item("head_dim", spec.head_dim, c.head_dim),
        item("vocab", spec.vocab_size, c.vocab_size),
    ];
    let functions = model.functions()?;
    items.push(item(
        "functions",
        FUNCTION,
        functions
            .iter()
            .map(|f| f.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    ));
    if let Some(main) = functions.iter().find(|f| f.name == FUNCTION) {
        for w in &c.inputs {
            let found = main.inputs.iter().find(|i| i.name == w.name);
            items.push(match found {
                Some(f) => item(
                    &format!("input `{}`", w.name),
                    format!("{:?}", w.shape),
                    format!("{:?}", f.shape),
                ),
                None => item(&format!("input `{}`", w.name), "present", "missing"),
            });
        }
        for w in &c.outputs {
            let present = main.outputs.contains(&w.name);
            items.push(item(
                &format!("output `{}`", w.name),
                "present",
                if present { "present" } else { "missing" },
            ));
        }
        items.push(item("input count", c.inputs.len(), main.inputs.len()));
        items.push(item("output count", c.outputs.len(), main.outputs.len()));
    }
    items.push(ContractItem {
        what: "weights".into(),
        expected: "decoded and compared with the checkpoint".into(),
        found: "compiled by Apple's runtime, not read back: judged by the logits".into(),
        ok: true,
    });
    Ok(items)
}
