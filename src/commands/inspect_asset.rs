//! `inspect ASSET.aimodel`: what a Core AI asset declares, as Apple's runtime loads it: its
//! functions with their inputs, outputs and states, the metadata Core AI and hf2coreml wrote,
//! the contract, and its bytes by file.

use std::path::Path;

use anyhow::Context;
use hf2coreml::aimodel::{self, Session};
use hf2coreml::pyenv::PythonEnv;
use hf2coreml::util::fmt_bytes;

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
    let meta = aimodel::read_metadata(path)?;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
        let entry = entry?;
        let md = entry.metadata()?;
        if md.is_file() {
            files.push((entry.file_name().to_string_lossy().into_owned(), md.len()));
        }
    }
    files.sort();
    let env = PythonEnv::discover(None).map_err(hf2coreml::emit::EmitError::from)?;
    let functions = Session::open(&env, path)?.functions()?;
    let s = AssetSummary {
        path: path.display().to_string(),
        producer: meta.producer,
        functions,
        total_bytes: files.iter().map(|f| f.1).sum(),
        files,
        user_defined: meta.user_defined,
    };
    if json {
        return super::print_json(&s);
    }
    println!("Core AI asset  {}", s.path);
    if let Some(p) = &s.producer {
        println!("  producer     {p}");
    }
    for f in &s.functions {
        println!("  function `{}`", f.name);
        for i in &f.inputs {
            println!("    input    {:<14} {} {:?}", i.name, i.dtype, i.shape);
        }
        for o in &f.outputs {
            println!("    output   {o}");
        }
        for st in &f.states {
            println!("    state    {st}");
        }
    }
    for (name, bytes) in &s.files {
        println!("  {:<13} {}", name, fmt_bytes(*bytes));
    }
    println!("  total         {}", fmt_bytes(s.total_bytes));
    for (k, v) in &s.user_defined {
        if k == hf2coreml::mil::contract::METADATA_KEY {
            let c: serde_json::Value = serde_json::from_str(v).unwrap_or_default();
            println!(
                "  contract     v{} target {} S={} Q={} layers {} vocab {}",
                c["version"],
                c["target"],
                c["max_seq_len"],
                c["query_len"],
                c["num_layers"],
                c["vocab_size"]
            );
        } else {
            println!("  {k:<12} {v}");
        }
    }
    Ok(())
}
