//! `inspect ASSET.aimodel`: what a Core AI asset (or each part of a chain of them) declares, as Apple's runtime loads it: its
//! functions with their inputs, outputs and states, the metadata Core AI and hf2coreml wrote,
//! the contract, and its bytes by file.

use std::path::Path;

use anyhow::Context;
use hf2coreml::aimodel::{self, Session};
use hf2coreml::mil::chain_file::ChainFile;
use hf2coreml::pyenv::PythonEnv;
use hf2coreml::util::fmt_bytes;

use crate::printer::escape_controls as esc;

#[derive(Debug, serde::Serialize)]
struct AssetSummary {
    path: String,
    producer: Option<String>,
    functions: Vec<aimodel::FunctionDesc>,
    /// File name → bytes (`*.mlirb` holds a function's program and its weights).
    files: Vec<(String, u64)>,
    total_bytes: u64,
    user_defined: std::collections::BTreeMap<String, String>,
}

pub fn run(path: &Path, json: bool) -> anyhow::Result<()> {
    let env = PythonEnv::discover(None).map_err(hf2coreml::emit::EmitError::from)?;
    let s = summarize(path, &env)?;
    if json {
        return super::print_json(&s);
    }
    print_asset(&s);
    Ok(())
}

/// `inspect CHAIN --json` of a chain of assets: the chain file and each part's summary.
#[derive(serde::Serialize)]
struct AssetChainSummary {
    schema: &'static str,
    path: String,
    chain: ChainFile,
    parts: Vec<AssetSummary>,
}

/// A chain of Core AI parts: the chain, then each part as Apple's runtime loads it.
pub fn run_chain(path: &Path, chain: ChainFile, json: bool) -> anyhow::Result<()> {
    let env = PythonEnv::discover(None).map_err(hf2coreml::emit::EmitError::from)?;
    let parts = chain
        .parts
        .iter()
        .map(|part| summarize(&ChainFile::part_path(path, part), &env))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if json {
        return super::print_json(&AssetChainSummary {
            schema: hf2coreml::mlpackage::summary::SCHEMA,
            path: path.display().to_string(),
            chain,
            parts,
        });
    }
    println!(
        "{}  a chain of {} Core AI assets ({})",
        path.display(),
        parts.len(),
        fmt_bytes(parts.iter().map(|p| p.total_bytes).sum())
    );
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
        print_asset(s);
    }
    Ok(())
}

fn summarize(path: &Path, env: &PythonEnv) -> anyhow::Result<AssetSummary> {
    if !aimodel::is_aimodel(path) {
        anyhow::bail!("{}: not a Core AI asset", path.display());
    }
    // The session checks the asset's files (regular, its own, the bytecode's hash) before
    // anything else is read from them.
    let session = Session::open(env, path)?;
    let meta = aimodel::read_metadata(path)?;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
        let entry = entry?;
        let md = std::fs::symlink_metadata(entry.path())?;
        if md.is_file() {
            files.push((entry.file_name().to_string_lossy().into_owned(), md.len()));
        }
    }
    files.sort();
    let functions = session.functions()?;
    Ok(AssetSummary {
        path: path.display().to_string(),
        producer: meta.producer,
        functions,
        total_bytes: files.iter().map(|f| f.1).sum(),
        files,
        user_defined: meta.user_defined,
    })
}

/// Everything printed from the asset's own files goes through [`escape_controls`]: metadata a
/// stranger wrote must not drive the terminal.
fn print_asset(s: &AssetSummary) {
    println!("Core AI asset  {}", esc(&s.path));
    if let Some(p) = &s.producer {
        println!("  producer     {}", esc(p));
    }
    for f in &s.functions {
        println!("  function `{}`", esc(&f.name));
        for i in &f.inputs {
            println!(
                "    input    {:<14} {} {:?}",
                esc(&i.name),
                esc(&i.dtype),
                i.shape
            );
        }
        for o in &f.outputs {
            println!("    output   {}", esc(o));
        }
        for st in &f.states {
            println!("    state    {}", esc(st));
        }
    }
    for (name, bytes) in &s.files {
        println!("  {:<13} {}", esc(name), fmt_bytes(*bytes));
    }
    println!("  total         {}", fmt_bytes(s.total_bytes));
    for (k, v) in &s.user_defined {
        if k == hf2coreml::mil::contract::METADATA_KEY {
            let c: serde_json::Value = serde_json::from_str(v).unwrap_or_default();
            println!(
                "  contract     {}",
                esc(&format!(
                    "v{} target {} S={} Q={} layers {} vocab {}",
                    c["version"],
                    c["target"],
                    c["max_seq_len"],
                    c["query_len"],
                    c["num_layers"],
                    c["vocab_size"]
                ))
            );
            if let Some(line) = super::per_layer_line::per_layer_line(&c, Path::new(&s.path)) {
                println!("  per-layer    {}", esc(&line));
            }
        } else if k == hf2coreml::mil::chain_file::PART_METADATA_KEY {
            // The part's description repeats the chain's contract: its place is enough here.
            let d: serde_json::Value = serde_json::from_str(v).unwrap_or_default();
            println!(
                "  chain part   {} of {}, layers {}..{}",
                d["index"].as_u64().map_or(0, |i| i + 1),
                d["count"],
                d["layers"]["start"],
                d["layers"]["end"]
            );
        } else {
            println!("  {:<12} {}", esc(k), esc(v));
        }
    }
}
