use std::path::PathBuf;

use anyhow::Context;
use hf2coreml::error::CheckFailed;
use hf2coreml::lint::{lint_saved, LintReport, Policy};
use hf2coreml::util::{fmt_bytes, fmt_count};

/// Severities `--deny` can add to the failing ones (error and fallback always fail).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DenyArg {
    /// Cost-level findings (padding, extra ops) fail too.
    Cost,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The .mlpackage to check (any ML Program package, not only hf2coreml's), or a chain of
    /// packages (each part checked on its own).
    pub package: PathBuf,
    /// Make cost-level findings fail as well.
    #[arg(long, value_enum)]
    pub deny: Vec<DenyArg>,
    /// Drop the findings of this rule (repeatable; `lint --json` lists rule ids).
    #[arg(long = "allow", value_name = "RULE")]
    pub allow: Vec<String>,
    /// Print the report as JSON (schema `hf2coreml.lint/1`).
    #[arg(long)]
    pub json: bool,
}

/// How many values of one rule the text report names before "+N more".
const SHOWN: usize = 3;

pub fn run(args: Args) -> anyhow::Result<()> {
    let policy = Policy {
        deny_cost: args.deny.contains(&DenyArg::Cost),
        allow: args.allow.clone(),
    };
    let report = lint_saved(&args.package, &policy)
        .with_context(|| format!("cannot lint {}", args.package.display()))?;
    if args.json {
        super::print_json(&report)?;
    } else {
        print!("{}", render(&report));
    }
    if !report.passed {
        return Err(CheckFailed(format!(
            "{} is not Neural Engine ready: {} error, {} fallback, {} cost finding(s)",
            args.package.display(),
            report.counts.error,
            report.counts.fallback,
            report.counts.cost
        ))
        .into());
    }
    Ok(())
}

/// One block per rule broken: severity, rule, count, the first values, why, fix, source.
pub fn render(r: &LintReport) -> String {
    let mut out = format!("{}\n", r.package);
    for (rule, found) in r.by_rule() {
        let names: Vec<String> = found
            .iter()
            .take(SHOWN)
            .map(|f| format!("{} `{}` {}", f.op_type, f.value, f.detail))
            .collect();
        let more = found.len().saturating_sub(SHOWN);
        out += &format!(
            "{:<8} {} ×{}\n  {}{}\n  why: {}\n  fix: {}\n  source: {}\n",
            rule.severity.as_str(),
            rule.id,
            found.len(),
            names.join("\n  "),
            if more > 0 {
                format!("\n  (+{more} more)")
            } else {
                String::new()
            },
            rule.why,
            rule.fix,
            rule.source
        );
    }
    out + &summary_line(r)
}

/// `N of M ops and X of Y of weights stay on the Neural Engine; ...`.
pub fn summary_line(r: &LintReport) -> String {
    let s = &r.summary;
    format!(
        "{} of {} ops and {} of {} of weights stay on the Neural Engine · package {} · \
         {} error, {} fallback, {} cost · {}\n",
        fmt_count(s.ops_on_neural_engine as u64),
        fmt_count(s.ops as u64),
        fmt_bytes(s.weight_bytes_on_neural_engine),
        fmt_bytes(s.weight_bytes),
        fmt_bytes(s.package_bytes),
        r.counts.error,
        r.counts.fallback,
        r.counts.cost,
        if r.passed { "passed" } else { "FAILED" }
    )
}
