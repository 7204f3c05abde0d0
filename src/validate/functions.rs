//! `validate` on a multifunction package (iOS18 `--prefill-len`): every function the contract
//! lists is declared as the contract says, and the `prefill` function computes what the
//! `decode` function computes on the same tokens.

use half::f16;

use super::metrics::{kl_divergence, max_abs_diff};
use super::report::ContractItem;
use super::run::ValidateError;
use crate::mil::contract::{self, Contract};
use crate::mlpackage::{FeatureInfo, MlPackage};
use crate::runtime::chain::Saved;
use crate::runtime::generate::{GenerateOptions, Generator};
use crate::runtime::{RuntimeError, StepModel, StepOutput};

/// The largest mean KL(decode ‖ prefill) over the compared positions, the bound for "the same
/// logits, fp16 rounding aside". Both functions run the same ops on the same weights; only the
/// attention's reduction order over masked rows differs, so fp16 rounding is all that separates
/// them.
pub const PREFILL_KL_TOL: f64 = 1e-3;

fn item(what: String, expected: String, found: String, ok: bool) -> ContractItem {
    ContractItem {
        what,
        expected,
        found,
        ok,
    }
}

/// Each function's declared inputs and outputs against the contract's entry for it, and the
/// default function (`decode`, whose Q and I/O the contract's own fields describe).
pub fn check_functions(pkg: &MlPackage, c: &Contract) -> Vec<ContractItem> {
    if c.functions.is_empty() {
        return Vec::new();
    }
    let desc = pkg.description();
    let mut items = vec![item(
        "default function".into(),
        contract::DECODE.into(),
        desc.default_function.clone(),
        desc.default_function == contract::DECODE,
    )];
    let declared: Vec<&str> = pkg.function_names().unwrap_or_default();
    let mut listed = c.function_names();
    listed.sort_unstable();
    items.push(item(
        "program functions".into(),
        format!("{listed:?}"),
        format!("{declared:?}"),
        declared == listed,
    ));
    for f in &c.functions {
        let have = desc.functions.iter().find(|d| d.name == f.name);
        let (inputs, outputs) = match have {
            Some(d) => (d.inputs.as_slice(), d.outputs.as_slice()),
            None => (&[][..], &[][..]),
        };
        for (kind, want, have) in [
            ("input", &f.inputs, inputs),
            ("output", &f.outputs, outputs),
        ] {
            items.extend(features(&f.name, kind, want, have));
        }
    }
    items
}

/// One function's features of one kind: each wanted name, dtype and shape, and the count.
fn features(
    function: &str,
    kind: &str,
    want: &[contract::IoSpec],
    have: &[FeatureInfo],
) -> Vec<ContractItem> {
    let mut items: Vec<ContractItem> = want
        .iter()
        .map(|w| {
            let expected = format!(
                "{} {:?}",
                w.dtype,
                w.shape.iter().map(|&d| d as i64).collect::<Vec<_>>()
            );
            let found = have
                .iter()
                .find(|f| f.name == w.name)
                .map_or("missing".to_string(), |f| {
                    format!("{} {:?}", f.dtype, f.shape)
                });
            let ok = expected == found;
            item(
                format!("{function}: {kind} `{}`", w.name),
                expected,
                found,
                ok,
            )
        })
        .collect();
    items.push(item(
        format!("{function}: {kind} count"),
        want.len().to_string(),
        have.len().to_string(),
        want.len() == have.len(),
    ));
    items
}

/// A package run through a reference, so a [`Generator`] can borrow it.
struct Borrowed<'a>(&'a Saved);

impl StepModel for Borrowed<'_> {
    fn contract(&self) -> &Contract {
        self.0.contract()
    }
    fn prefill_len(&self) -> Option<usize> {
        self.0.prefill_len()
    }
    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        self.0
            .step_with_stats(input_ids, position, key_cache, value_cache, None)
    }
}

/// Run the first tokens through `prefill` (a full chunk and a padded one when the text allows)
/// and compare their logits with `decoded`, the decode function's rows for the same tokens.
/// Nothing to check without a prefill function.
pub fn check_prefill(
    package: &Saved,
    tokens: &[u32],
    decoded: &[Vec<f32>],
) -> Result<Vec<ContractItem>, ValidateError> {
    let Some(p) = package.prefill_len() else {
        return Ok(Vec::new());
    };
    let n = tokens.len().min(decoded.len()).min(p + p / 2 + 1);
    let mut gen = Generator::new(Borrowed(package))?;
    let out = gen.generate(
        &tokens[..n],
        &GenerateOptions {
            max_new_tokens: 0,
            record_logits: true,
            ..GenerateOptions::default()
        },
        &mut |_| Ok(()),
    )?;
    let rows = out.logits.ok_or(ValidateError::NoLogits)?;
    let (mut kl, mut diff) = (0.0, 0.0f64);
    for (t, want) in decoded.iter().enumerate().take(n) {
        let got = rows.row(t).ok_or(ValidateError::NoLogits)?;
        kl += kl_divergence(want, got)?;
        diff = diff.max(max_abs_diff(want, got));
    }
    let kl = kl / n.max(1) as f64;
    Ok(vec![item(
        format!(
            "prefill (Q={p}) agrees with decode: mean KL over {n} tokens, {} calls",
            out.timing.prefill_calls
        ),
        format!("<= {PREFILL_KL_TOL:e}"),
        format!("{kl:.2e} (max |Δlogit| {diff:.4})"),
        kl <= PREFILL_KL_TOL,
    )])
}
