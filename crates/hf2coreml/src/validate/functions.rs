//! `validate` on a multifunction package (iOS18 `--prefill-len`): every function the contract
//! lists is declared as the contract says, and the `prefill` function computes what the
//! `decode` function computes on the same tokens.

use half::f16;

use super::metrics::{kl_divergence, max_abs_diff};
use super::report::ContractItem;
use super::validate_error::ValidateError;
use crate::mil::contract::{self, Contract};
use crate::mlpackage::{FeatureInfo, MlPackage};
use crate::runtime::chain_runner::Saved;
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
    fn prefill_last_row_only(&self) -> bool {
        self.0.prefill_last_row_only()
    }
    fn state_rows(&self, rows: usize) -> Result<(Vec<f16>, Vec<f16>), RuntimeError> {
        self.0.state_rows(rows)
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
    fn step_recurrent(
        &mut self,
        input_ids: &[i32],
        valid: usize,
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
        recurrent: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        let caches = (key_cache, value_cache);
        self.0
            .step_full(input_ids, position, caches, Some((valid, recurrent)), None)
    }
}

/// How many leading positions [`check_prefill`] runs through `prefill`: a full chunk and a
/// second one (slid back, or padded) when the text allows; 0 without a prefill function.
pub fn prefill_positions(package: &Saved, tokens: usize) -> usize {
    package
        .prefill_len()
        .map_or(0, |p| tokens.min(p + p / 2 + 1))
}

/// The largest relative RMS difference between the cache rows `prefill` writes and those
/// `decode` writes for the same tokens: both round each row to fp16 from sums taken in another
/// order, which moves a value by a few fp16 steps at most (2^-10 relative each).
pub const PREFILL_CACHE_TOL: f64 = 1e-2;

/// Run the first tokens through `prefill` and compare with `decoded` and `decode_cache`, the
/// decode function's logits rows and cache rows (the first [`prefill_positions`]) for the same
/// tokens. A prefill function that returns every row is compared row by row; one that returns
/// its last row only is compared where a prompt would end: after one full chunk, and after a
/// second call that ends on the last token. The cache rows both write are compared too.
/// Nothing to check without a prefill function.
pub fn check_prefill(
    package: &Saved,
    tokens: &[u32],
    decoded: &[Vec<f32>],
    decode_cache: &(Vec<f16>, Vec<f16>),
) -> Result<Vec<ContractItem>, ValidateError> {
    let Some(p) = package.prefill_len() else {
        return Ok(Vec::new());
    };
    let n = prefill_positions(package, tokens.len()).min(decoded.len());
    let mut gen = Generator::new(Borrowed(package))?;
    let last_only = package.prefill_last_row_only();
    let (mut kl, mut diff, mut compared, mut calls) = (0.0, 0.0f64, 0usize, 0usize);
    let mut compare = |want: &[f32], got: &[f32]| -> Result<(), ValidateError> {
        kl += kl_divergence(want, got)?;
        diff = diff.max(max_abs_diff(want, got));
        compared += 1;
        Ok(())
    };
    // The prompts: every row of one run over n tokens, or the last rows of a run over one
    // chunk and a run over n (the longer run last: its cache rows are compared below).
    let ends: Vec<usize> = if last_only {
        let mut e = vec![p.min(n), n];
        e.dedup();
        e
    } else {
        vec![n]
    };
    for &end in &ends {
        let out = gen.generate(
            &tokens[..end],
            &GenerateOptions {
                max_new_tokens: 0,
                record_logits: !last_only,
                ..GenerateOptions::default()
            },
            &mut |_| Ok(()),
        )?;
        calls += out.timing.prefill_calls;
        match out.logits {
            Some(rows) => {
                for (t, want) in decoded.iter().enumerate().take(end) {
                    compare(want, rows.row(t).ok_or(ValidateError::NoLogits)?)?;
                }
            }
            None => compare(&decoded[end - 1], gen.last_logits())?,
        }
    }
    let kl = kl / compared.max(1) as f64;
    let rows = if last_only {
        format!("the last row of {ends:?} tokens")
    } else {
        format!("{n} tokens")
    };
    let mut items = vec![item(
        format!("prefill (Q={p}) agrees with decode: mean KL over {rows}, {calls} calls"),
        format!("<= {PREFILL_KL_TOL:e}"),
        format!("{kl:.2e} (max |Δlogit| {diff:.4})"),
        kl <= PREFILL_KL_TOL,
    )];
    let (keys, values) = gen.valid_rows()?;
    let rel = relative_rms(&keys, &decode_cache.0).max(relative_rms(&values, &decode_cache.1));
    items.push(item(
        format!(
            "prefill (Q={p}) writes the cache rows decode writes: relative RMS over {n} positions"
        ),
        format!("<= {PREFILL_CACHE_TOL:e}"),
        format!("{rel:.2e}"),
        rel <= PREFILL_CACHE_TOL,
    ));
    Ok(items)
}

/// ‖a − b‖ / ‖b‖ over two fp16 arrays; infinite when their lengths differ, `b` is all zero
/// while `a` is not, or either holds a non-finite value.
fn relative_rms(a: &[f16], b: &[f16]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.to_f64(), y.to_f64());
        num += (x - y) * (x - y);
        den += y * y;
    }
    let rel = if num == 0.0 { 0.0 } else { (num / den).sqrt() };
    // A non-finite value (a NaN row, or zeros against values) fails the check.
    if rel.is_finite() {
        rel
    } else {
        f64::INFINITY
    }
}
