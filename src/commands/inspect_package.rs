//! `inspect PKG`: what a saved package (or each part of a chain) declares: functions, inputs,
//! outputs, states, metadata, the contract, ops by kind and weight bytes by storage kind; and
//! the kernels `run` would execute it with on this machine.

use std::path::Path;

use anyhow::Context;
use hf2coreml::mil::chain_file::{is_chain, ChainFile};
use hf2coreml::mlpackage::summary::{self, PackageSummary};
use hf2coreml::mlpackage::FeatureInfo;
use hf2coreml::runtime::interp::kernels::Avx2Lookup;
use hf2coreml::util::{fmt_bytes, fmt_count, isa};

use super::per_layer_line::per_layer_line;

/// `inspect CHAIN --json`: the chain file and each part's summary.
#[derive(serde::Serialize)]
struct ChainSummary {
    schema: &'static str,
    path: String,
    chain: ChainFile,
    parts: Vec<PackageSummary>,
    runner: Runner,
}

/// `inspect PKG --json`: the package's summary and what `run` would execute it with here.
#[derive(serde::Serialize)]
struct WithRunner {
    #[serde(flatten)]
    summary: PackageSummary,
    runner: Runner,
}

/// The interpreter's kernels on this machine: the level `run` uses and the CPU's best.
#[derive(serde::Serialize)]
struct Runner {
    kernels: &'static str,
    cpu_best: &'static str,
    /// How AVX2 looks 4-bit weights up on this CPU (`planes` or `halves`; absent at the other
    /// levels).
    #[serde(skip_serializing_if = "Option::is_none")]
    lookup4: Option<&'static str>,
}

impl Runner {
    fn here() -> Self {
        Runner {
            kernels: isa::selected().name(),
            cpu_best: isa::detected().name(),
            lookup4: Avx2Lookup::at(isa::selected()).map(Avx2Lookup::name),
        }
    }

    fn print(&self) {
        let cap = match std::env::var(isa::ENV) {
            Ok(v) if !v.trim().is_empty() => format!(", capped by {}={v}", isa::ENV),
            _ => String::new(),
        };
        let lookup = self
            .lookup4
            .map_or(String::new(), |l| format!(", 4-bit lookups: {l}"));
        println!(
            "  runner      kernels {}{lookup} on this CPU (its best: {}{cap})",
            self.kernels, self.cpu_best
        );
    }
}

pub fn run(path: &Path, json: bool) -> anyhow::Result<()> {
    let read = |p: &Path| {
        summary::summarize(p).with_context(|| format!("cannot read package {}", p.display()))
    };
    if !is_chain(path) {
        let s = read(path)?;
        return if json {
            super::print_json(&WithRunner {
                summary: s,
                runner: Runner::here(),
            })
        } else {
            print_package(&s);
            Runner::here().print();
            Ok(())
        };
    }
    let chain = ChainFile::read(path)?;
    let parts = chain
        .parts
        .iter()
        .map(|part| read(&ChainFile::part_path(path, part)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if json {
        return super::print_json(&ChainSummary {
            schema: summary::SCHEMA,
            path: path.display().to_string(),
            chain,
            parts,
            runner: Runner::here(),
        });
    }
    println!(
        "{}  a chain of {} packages ({})",
        path.display(),
        parts.len(),
        fmt_bytes(parts.iter().map(|p| p.package_bytes).sum())
    );
    let contract = serde_json::to_value(&chain.contract).unwrap_or_default();
    if let Some(line) = per_layer_line(&contract, path) {
        println!("  per-layer   {line}");
    }
    for (part, s) in chain.parts.iter().zip(&parts) {
        println!();
        println!(
            "part {}: layers {}..{}{}{}",
            part.path,
            part.layers.start,
            part.layers.end,
            if part.embedding { ", embedding" } else { "" },
            if part.head { ", lm_head" } else { "" }
        );
        print_package(s);
    }
    println!();
    Runner::here().print();
    Ok(())
}

fn print_package(s: &PackageSummary) {
    println!(
        "{}  ML package, specification {} ({}), {} on disk",
        s.path,
        s.spec_version,
        match s.spec_version {
            8 => "iOS17",
            9 => "iOS18",
            _ => "other",
        },
        fmt_bytes(s.package_bytes)
    );
    let features = |title: &str, f: &[FeatureInfo]| {
        for (i, x) in f.iter().enumerate() {
            let head = if i == 0 { title } else { "" };
            println!("  {head:<9} {:<24} {}{:?}", x.name, x.dtype, x.shape);
        }
    };
    features("inputs", &s.inputs);
    features("outputs", &s.outputs);
    features("states", &s.states);
    let m = &s.metadata;
    for (k, v) in [
        ("description", &m.short_description),
        ("version", &m.version),
        ("author", &m.author),
        ("license", &m.license),
    ] {
        if !v.is_empty() {
            println!("  {k:<11} {v}");
        }
    }
    for k in m.user_defined.keys() {
        println!("  metadata    {k} ({} bytes)", m.user_defined[k].len());
    }
    if let Some(c) = &s.contract {
        print_contract(c);
        if let Some(line) = per_layer_line(c, std::path::Path::new(&s.path)) {
            println!("  per-layer   {line}");
        }
    }
    for f in &s.functions {
        println!(
            "  function    {} (opset {}): {} ops",
            f.name,
            f.opset,
            fmt_count(f.ops as u64)
        );
        let mut kinds: Vec<_> = f.ops_by_type.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
        println!("              {}", kinds.join(", "));
    }
    println!(
        "  weights     {} in weight files",
        fmt_bytes(s.weight_bytes)
    );
    for w in &s.weights {
        println!(
            "              {:<34} {:>6} constants {:>12}",
            w.kind,
            w.constants,
            fmt_bytes(w.bytes)
        );
    }
}

/// The contract's dimensions in one line, when they are there (any version).
fn print_contract(c: &serde_json::Value) {
    let n = |k: &str| c.get(k).map_or("?".to_string(), |v| v.to_string());
    println!(
        "  contract    v{}, target {}, S={} Q={}, {} layers, {} kv heads × {}, vocab {}",
        n("version"),
        c.get("target").and_then(|t| t.as_str()).unwrap_or("ios17"),
        n("max_seq_len"),
        n("query_len"),
        n("num_layers"),
        n("num_kv_heads"),
        n("head_dim"),
        n("vocab_size"),
    );
    // A hybrid package: which blocks the caches hold, and the state beside them.
    if let Some(r) = c.get("recurrent") {
        let list = |v: Option<&serde_json::Value>| {
            v.and_then(|v| v.as_array()).map_or(String::new(), |a| {
                a.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            })
        };
        let conv = r.get("conv");
        println!(
            "  recurrent   {} blocks: attention [{}] in the caches; conv [{}] in conv_state \
             (the last {} inputs of {} channels)",
            n2(r, "blocks"),
            list(r.get("attention_layers")),
            list(conv.and_then(|c| c.get("layers"))),
            conv.map_or("?".into(), |c| n2(c, "width")),
            conv.map_or("?".into(), |c| n2(c, "channels")),
        );
    }
}

/// A JSON field as text, `?` when absent.
fn n2(v: &serde_json::Value, k: &str) -> String {
    v.get(k).map_or("?".to_string(), |x| x.to_string())
}
