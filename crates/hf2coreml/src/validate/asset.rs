//! `validate` of an `.aimodel` (or a chain of them): the same contract, reference and gates as for a package, with
//! the logits produced by Apple's Core AI runtime. The asset's bytecode is compiled by that
//! runtime, not read by hf2coreml: its weights are judged by the logits they produce, and the
//! report says so.

use std::path::Path;

use super::contract_items::{
    chain_items, check_hashes, check_source, item, part_io, per_layer_items,
};
use super::gates::{default_gates, RecipeKind};
use super::metrics::compare_logits;
use super::report::{ContractItem, ValidationReport};
use super::scoring::{reference_logits, score_tokens_keeping, text_tokens};
use super::validate_error::{ValidateError, ValidateOptions};
use crate::checkpoint::Checkpoint;
use crate::mil::contract::{self, Contract};
use crate::progress::Progress;
use crate::runtime::chain_runner::{Chain, Saved};
use crate::runtime::coreai_model::{CoreAiModel, FUNCTION};
use crate::runtime::RuntimeError;

/// Validate `package`, an asset or a chain of assets at `path`, against `ckpt`.
pub(super) fn validate_asset(
    path: &Path,
    package: &Saved,
    ckpt: &Checkpoint,
    opts: &ValidateOptions,
    progress: &dyn Progress,
) -> Result<ValidationReport, ValidateError> {
    let c = package.contract().clone();
    check_source(&c, ckpt, path)?;
    let (items, min_bits) = match package {
        Saved::CoreAi(model) => (check_asset(model, &c, ckpt)?, model.min_bits()),
        Saved::Chain(chain) => (
            check_asset_chain(path, chain, ckpt)?,
            chain.asset_min_bits()?,
        ),
        Saved::Package(_) => {
            return Err(ValidateError::Runtime(RuntimeError::Program(
                "an ML package runs on the interpreter, not Apple's runtime".into(),
            )))
        }
    };
    let tokens = text_tokens(&c, opts)?;
    let (backend, expected) = reference_logits(ckpt, &tokens, opts.reference_budget, progress)?;
    let mut report = ValidationReport::new(
        &path.display().to_string(),
        &ckpt.dir().display().to_string(),
        &backend,
        opts.text_name,
    );
    report.runtime = Some(package.runtime_name().to_string());
    report.contract = items;
    let keep = super::functions::prefill_positions(package, tokens.len());
    let (got, _stats, cache) = score_tokens_keeping(package, &tokens, progress, keep)?;
    let comparison = compare_logits(&expected, &got, &tokens)?;
    report.contract.extend(super::functions::check_prefill(
        package, &tokens, &got, &cache,
    )?);
    let gates = if opts.gates.is_empty() {
        default_gates(RecipeKind::of_package(min_bits, &c))
    } else {
        opts.gates.clone()
    };
    report.set_behaviour(comparison, &gates);
    Ok(report)
}

/// The contract against the checkpoint, and each of the asset's functions (`main`, or
/// `prefill` and `decode`) as Apple's runtime describes it against the contract's inputs and
/// outputs for that function.
fn check_asset(
    model: &CoreAiModel,
    c: &Contract,
    ckpt: &Checkpoint,
) -> Result<Vec<ContractItem>, ValidateError> {
    let spec = ckpt.spec();
    let mut items = vec![
        item("target", "coreai", c.target.as_str()),
        item("contract version", contract::CONTRACT_VERSION, c.version),
        item("layers", spec.cache_layers(), c.num_layers),
        item("kv heads", spec.num_key_value_heads, c.num_kv_heads),
        item("head_dim", spec.head_dim, c.head_dim),
        item("vocab", spec.vocab_size, c.vocab_size),
    ];
    items.extend(per_layer_items(model.path(), c, ckpt));
    let functions = model.functions()?;
    let mut wanted = c.function_names();
    wanted.sort_unstable();
    let mut declared: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
    declared.sort_unstable();
    items.push(item("functions", wanted.join(", "), declared.join(", ")));
    // One function: its items read as before (`input `x``); several: prefixed by the function.
    let several = wanted.len() > 1;
    for name in wanted {
        let (Some(f), Some(fc)) = (
            functions.iter().find(|f| f.name == name),
            c.for_function(name),
        ) else {
            continue;
        };
        let what = |s: String| {
            if several {
                format!("{name}: {s}")
            } else {
                s
            }
        };
        for w in &fc.inputs {
            let found = f.inputs.iter().find(|i| i.name == w.name);
            items.push(match found {
                Some(got) => item(
                    &what(format!("input `{}`", w.name)),
                    format!("{:?}", w.shape),
                    format!("{:?}", got.shape),
                ),
                None => item(&what(format!("input `{}`", w.name)), "present", "missing"),
            });
        }
        for w in &fc.outputs {
            let present = f.outputs.contains(&w.name);
            items.push(item(
                &what(format!("output `{}`", w.name)),
                "present",
                if present { "present" } else { "missing" },
            ));
        }
        items.push(item(
            &what("input count".into()),
            fc.inputs.len(),
            f.inputs.len(),
        ));
        items.push(item(
            &what("output count".into()),
            fc.outputs.len(),
            f.outputs.len(),
        ));
    }
    items.push(weights_item());
    Ok(items)
}

/// What `validate` says of an asset's weights.
fn weights_item() -> ContractItem {
    ContractItem {
        what: "weights".into(),
        expected: "decoded and compared with the checkpoint".into(),
        found: "compiled by Apple's runtime, not read back: judged by the logits".into(),
        ok: true,
    }
}

/// A chain of assets: the chain's contract against the checkpoint, each part's `main` function
/// as Apple's runtime describes it against the inputs and outputs the chain file gives it, and
/// each part's files against the hashes the chain recorded.
fn check_asset_chain(
    path: &Path,
    chain: &Chain,
    ckpt: &Checkpoint,
) -> Result<Vec<ContractItem>, ValidateError> {
    let file = chain.chain();
    let c = &file.contract;
    let mut items = vec![item("target", "coreai", c.target.as_str())];
    items.extend(chain_items(file, ckpt));
    items.extend(per_layer_items(path, c, ckpt));
    for (part, functions) in file.parts.iter().zip(chain.asset_functions()?) {
        let p = &part.path;
        let (inputs, outputs) = part_io(part, c, file.hidden_size, &mut items);
        let names: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
        items.push(item(&format!("{p}: functions"), FUNCTION, names.join(", ")));
        let Some(f) = functions.iter().find(|f| f.name == FUNCTION) else {
            continue;
        };
        for w in &inputs {
            let found = f.inputs.iter().find(|i| i.name == w.name);
            items.push(match found {
                Some(got) => item(
                    &format!("{p}: input `{}`", w.name),
                    format!("{:?}", w.shape),
                    format!("{:?}", got.shape),
                ),
                None => item(&format!("{p}: input `{}`", w.name), "present", "missing"),
            });
        }
        for w in &outputs {
            let present = f.outputs.contains(&w.name);
            items.push(item(
                &format!("{p}: output `{}`", w.name),
                "present",
                if present { "present" } else { "missing" },
            ));
        }
        items.push(item(
            &format!("{p}: input count"),
            inputs.len(),
            f.inputs.len(),
        ));
        items.push(item(
            &format!("{p}: output count"),
            outputs.len(),
            f.outputs.len(),
        ));
    }
    items.extend(check_hashes(path, file));
    items.push(weights_item());
    Ok(items)
}
