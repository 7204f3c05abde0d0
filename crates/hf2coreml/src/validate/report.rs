//! The validation report: serializable for `--json`, rendered as a table on a terminal.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::crosscheck::CrossCheck;
use super::gates::{Gate, GateResult};
use super::metrics::{LogitComparison, WeightError};
use crate::lint::LintReport;
use crate::util::{fmt_bytes, fmt_count};

/// One line of the contract check (`validate` (a)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContractItem {
    pub what: String,
    pub expected: String,
    pub found: String,
    pub ok: bool,
}

/// The largest |value| an op kind reached in the package run, and any inf/NaN it produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActivationRange {
    pub op_kind: String,
    pub max_abs: f64,
    pub nonfinite: u64,
    /// The name of the first op of this kind that produced inf/NaN.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_nonfinite_op: Option<String>,
}

/// Everything `validate` found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationReport {
    pub package: String,
    pub checkpoint: String,
    /// Which reference computed the expected logits (e.g. "candle-transformers llama").
    pub reference: String,
    /// What executed the package when it is not hf2coreml's MIL interpreter (Apple's Core AI
    /// runtime for an `.aimodel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    pub text: String,
    pub contract: Vec<ContractItem>,
    pub weights: Vec<WeightError>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behaviour: Option<LogitComparison>,
    pub activations: Vec<ActivationRange>,
    pub gates: Vec<GateResult>,
    /// Neural Engine readiness (`hf2coreml lint`): reported, not gated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lint: Option<LintReport>,
    /// The same program on Apple's Core AI runtime (`--cross-check coreai`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross_check: Option<CrossCheck>,
}

impl ValidationReport {
    pub fn new(package: &str, checkpoint: &str, reference: &str, text: &str) -> Self {
        ValidationReport {
            package: package.to_string(),
            checkpoint: checkpoint.to_string(),
            reference: reference.to_string(),
            runtime: None,
            text: text.to_string(),
            contract: Vec::new(),
            weights: Vec::new(),
            behaviour: None,
            activations: Vec::new(),
            gates: Vec::new(),
            lint: None,
            cross_check: None,
        }
    }

    /// Set the behaviour comparison and evaluate `gates` on it.
    pub fn set_behaviour(&mut self, comparison: LogitComparison, gates: &[Gate]) {
        self.gates = gates.iter().map(|g| g.evaluate(&comparison)).collect();
        self.behaviour = Some(comparison);
    }

    /// The package produced inf or NaN somewhere: it fails whatever its logits say.
    pub fn overflowed(&self) -> bool {
        self.activations.iter().any(|a| a.nonfinite > 0)
            || self
                .behaviour
                .as_ref()
                .is_some_and(|b| b.nonfinite_rows > 0)
    }

    pub fn contract_ok(&self) -> bool {
        self.contract.iter().all(|c| c.ok)
    }

    pub fn gates_ok(&self) -> bool {
        self.gates.iter().all(|g| g.passed)
    }

    /// The cross-check, when asked for, found the two runtimes in agreement.
    pub fn cross_check_ok(&self) -> bool {
        self.cross_check.as_ref().is_none_or(|x| x.passed)
    }

    /// Every check passed: contract, no inf/NaN, every gate, the cross-check when asked for.
    pub fn passed(&self) -> bool {
        self.contract_ok() && !self.overflowed() && self.gates_ok() && self.cross_check_ok()
    }

    /// The human-readable report.
    pub fn render_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "package    {}", self.package);
        let _ = writeln!(s, "checkpoint {} ({})", self.checkpoint, self.reference);
        let _ = writeln!(s, "text       {}", self.text);
        if !self.contract.is_empty() {
            let bad: Vec<&ContractItem> = self.contract.iter().filter(|c| !c.ok).collect();
            let _ = writeln!(
                s,
                "\ncontract   {} of {} checks pass",
                self.contract.len() - bad.len(),
                self.contract.len()
            );
            for c in bad {
                let _ = writeln!(
                    s,
                    "  FAIL {}: expected {}, found {}",
                    c.what, c.expected, c.found
                );
            }
        }
        if !self.weights.is_empty() {
            let n = self.weights.len();
            let mean = self
                .weights
                .iter()
                .map(|w| finite_or(w.snr_db, 200.0))
                .sum::<f64>()
                / n as f64;
            let _ = writeln!(s, "\nweights    {n} tensors, mean SNR {}", db(mean));
            let mut worst: Vec<&WeightError> = self.weights.iter().collect();
            worst.sort_by(|a, b| a.snr_db.total_cmp(&b.snr_db));
            let name_w = worst
                .iter()
                .take(5)
                .map(|w| w.tensor.len())
                .max()
                .unwrap_or(6)
                .max(6);
            let _ = writeln!(
                s,
                "  {:<name_w$}  {:>9}  {:>11}",
                "lowest", "SNR", "max |err|"
            );
            for w in worst.iter().take(5) {
                let _ = writeln!(
                    s,
                    "  {:<name_w$}  {:>9}  {:>11.3e}",
                    w.tensor,
                    db(w.snr_db),
                    w.max_abs_error
                );
            }
        }
        if let Some(b) = &self.behaviour {
            let _ = writeln!(s, "\nbehaviour  {} positions", b.positions);
            let rows = [
                ("KL mean", format!("{:.3e}", b.kl_mean)),
                (
                    "KL max",
                    format!("{:.3e} (position {})", b.kl_max, b.kl_argmax),
                ),
                ("top-1 agreement", format!("{:.4}", b.top1)),
                ("top-5 overlap", format!("{:.4}", b.top5)),
                (
                    "perplexity",
                    format!(
                        "{:.3} reference, {:.3} package (ratio {:.4})",
                        b.ppl_reference, b.ppl_package, b.ppl_ratio
                    ),
                ),
                ("max |Δlogit|", format!("{:.4}", b.max_abs_dlogit)),
            ];
            for (k, v) in rows {
                let _ = writeln!(s, "  {k:<16} {v}");
            }
        }
        if !self.activations.is_empty() {
            let _ = writeln!(s, "\nactivations (largest |value| per op kind)");
            for a in &self.activations {
                let flag = if a.nonfinite > 0 {
                    format!(
                        "  {} inf/NaN{}",
                        a.nonfinite,
                        a.first_nonfinite_op
                            .as_deref()
                            .map(|o| format!(", first at {o}"))
                            .unwrap_or_default()
                    )
                } else {
                    String::new()
                };
                let _ = writeln!(s, "  {:<26} {:>12.4e}{flag}", a.op_kind, a.max_abs);
            }
        }
        if let Some(l) = &self.lint {
            let _ = writeln!(
                s,
                "\nneural engine  {} of {} ops and {} of {} of weights stay; {} error, {} \
                 fallback, {} cost finding(s) (`hf2coreml lint` lists them; not gated)",
                fmt_count(l.summary.ops_on_neural_engine as u64),
                fmt_count(l.summary.ops as u64),
                fmt_bytes(l.summary.weight_bytes_on_neural_engine),
                fmt_bytes(l.summary.weight_bytes),
                l.counts.error,
                l.counts.fallback,
                l.counts.cost
            );
        }
        if !self.gates.is_empty() {
            let _ = writeln!(s, "\ngates");
            for g in &self.gates {
                let _ = writeln!(
                    s,
                    "  {} {:<20} value {:.4e}",
                    if g.passed { "pass" } else { "FAIL" },
                    g.gate,
                    g.value
                );
            }
        }
        if let Some(x) = &self.cross_check {
            render_cross_check(&mut s, x);
        }
        let verdict = if self.passed() {
            "PASSED".to_string()
        } else {
            let mut why = Vec::new();
            if !self.contract_ok() {
                why.push("contract");
            }
            if self.overflowed() {
                why.push("inf/NaN in the package");
            }
            if !self.gates_ok() {
                why.push("gates");
            }
            if !self.cross_check_ok() {
                why.push("cross-check");
            }
            format!("FAILED ({})", why.join(", "))
        };
        let _ = writeln!(s, "\n{verdict}");
        s
    }
}

fn render_cross_check(s: &mut String, x: &CrossCheck) {
    let _ = writeln!(
        s,
        "\ncross-check  {}, function `{}`, {} positions: {}",
        x.runtime,
        x.function,
        x.positions,
        if x.passed { "agree" } else { "DISAGREE" }
    );
    let row = |s: &mut String, what: &str, a: &super::crosscheck::Agreement| {
        let _ = writeln!(
            s,
            "  {what:<26} KL mean {:.3e}  KL max {:.3e}  top-1 {:.4}  max |Δlogit| {:.4}",
            a.kl_mean, a.kl_max, a.top1, a.max_abs_dlogit
        );
    };
    row(s, "interpreter vs reference", &x.interpreter_vs_reference);
    row(s, "Core AI vs reference", &x.coreai_vs_reference);
    row(s, "Core AI vs interpreter", &x.coreai_vs_interpreter);
    let _ = writeln!(
        s,
        "  top-1 over the {} decisive positions (margin above twice the row's RMS Δlogit): {:.4}",
        x.decisive_positions, x.decisive_top1
    );
    let _ = writeln!(
        s,
        "  agreement needs KL(Core AI ‖ interpreter) mean <= {:.0e} and decisive top-1 >= {}",
        x.max_kl, x.min_top1
    );
    let p = &x.probe;
    let _ = writeln!(
        s,
        "  position {}: {} values compared op by op ({} left out), {} beyond fp16 rounding \
         (relative RMS > {:.0e})",
        p.position, p.compared, p.skipped, p.beyond_count, p.tolerance
    );
    let line = |s: &mut String, d: &super::crosscheck::OpDifference| {
        let _ = writeln!(
            s,
            "    #{:<5} {:<16} {:<40} rel {:.2e}  max |Δ| {:.3e} at {}: {} vs {}",
            d.index, d.op, d.output, d.rel_rms, d.max_abs, d.at, d.interpreter, d.coreai
        );
    };
    if !p.beyond.is_empty() {
        let _ = writeln!(
            s,
            "  first ops beyond (op index, op, value, interpreter vs Core AI):"
        );
        for d in &p.beyond {
            line(s, d);
        }
    }
    if let Some(d) = p.largest.first() {
        let _ = writeln!(s, "  largest difference:");
        line(s, d);
    }
}

fn finite_or(v: f64, cap: f64) -> f64 {
    if v.is_finite() {
        v
    } else if v > 0.0 {
        cap
    } else {
        -cap
    }
}

fn db(v: f64) -> String {
    if v == f64::INFINITY {
        "exact".to_string()
    } else {
        format!("{v:.1} dB")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::gates::{default_gates, RecipeKind};
    use crate::validate::metrics::compare_logits;

    fn comparison(noise: f32) -> LogitComparison {
        let reference: Vec<Vec<f32>> = (0..8)
            .map(|t| {
                (0..16)
                    .map(|v| ((t * 5 + v * 3) % 13) as f32 * 0.5)
                    .collect()
            })
            .collect();
        let package: Vec<Vec<f32>> = reference
            .iter()
            .map(|r| {
                r.iter()
                    .enumerate()
                    .map(|(i, v)| v + noise * ((i % 3) as f32 - 1.0))
                    .collect()
            })
            .collect();
        compare_logits(&reference, &package, &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap()
    }

    #[test]
    fn report_passes_and_fails_on_gates() {
        let mut r = ValidationReport::new("a.mlpackage", "ckpt", "plain", "eval.txt");
        r.set_behaviour(comparison(0.0), &default_gates(RecipeKind::Fp16));
        assert!(r.passed());
        let table = r.render_table();
        assert!(
            table.contains("PASSED") && table.contains("kl_mean<=0.01"),
            "{table}"
        );

        let mut r = ValidationReport::new("a.mlpackage", "ckpt", "plain", "eval.txt");
        r.set_behaviour(comparison(3.0), &default_gates(RecipeKind::Fp16));
        assert!(!r.passed());
        assert!(r.render_table().contains("FAILED (gates)"));
    }

    #[test]
    fn overflow_fails_whatever_the_logits() {
        let mut r = ValidationReport::new("a.mlpackage", "ckpt", "plain", "eval.txt");
        r.set_behaviour(comparison(0.0), &default_gates(RecipeKind::Bits4));
        r.activations.push(ActivationRange {
            op_kind: "rms_norm_square".into(),
            max_abs: f64::INFINITY,
            nonfinite: 3,
            first_nonfinite_op: Some("layers_11_mul_3".into()),
        });
        assert!(r.gates_ok() && !r.passed());
        let t = r.render_table();
        assert!(
            t.contains("inf/NaN") && t.contains("layers_11_mul_3"),
            "{t}"
        );
    }

    #[test]
    fn json_round_trip() {
        let mut r = ValidationReport::new("a.mlpackage", "ckpt", "plain", "eval.txt");
        r.set_behaviour(comparison(0.1), &default_gates(RecipeKind::Bits8));
        r.weights
            .push(WeightError::measure("w", &[1.0, 2.0], &[1.0, 2.1]));
        r.contract.push(ContractItem {
            what: "specificationVersion".into(),
            expected: "8".into(),
            found: "8".into(),
            ok: true,
        });
        let json = serde_json::to_string(&r).unwrap();
        let back: ValidationReport = serde_json::from_str(&json).unwrap();
        // serde_json's float parsing may land 1 ulp away; everything else is exact.
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        assert_eq!(back.contract, r.contract);
        assert_eq!(back.passed(), r.passed());
        let (bb, rb) = (
            back.behaviour.as_ref().unwrap(),
            r.behaviour.as_ref().unwrap(),
        );
        assert!(close(bb.kl_mean, rb.kl_mean) && close(bb.top1, rb.top1));
        assert_eq!(bb.kl.len(), rb.kl.len());
        assert!(close(back.weights[0].snr_db, r.weights[0].snr_db));
        let gates = |x: &ValidationReport| -> Vec<(String, bool)> {
            x.gates.iter().map(|g| (g.gate.clone(), g.passed)).collect()
        };
        assert_eq!(gates(&back), gates(&r));
    }
}
