use std::path::PathBuf;

use anyhow::Context;
use hf2coreml::checkpoint::gguf::{self, ImportOptions};
use hf2coreml::util::{fmt_bytes, fmt_count};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The GGUF file (llama architecture; F32, F16, BF16, Q8_0, Q4_0 or Q4_1 tensors).
    pub file: PathBuf,
    /// Output checkpoint directory (config.json, model.safetensors, tokenizer files).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Replace the output directory if it exists.
    #[arg(long)]
    pub force: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    hf2coreml::fsutil::refuse_output_over_input(&args.file, &args.output)?;
    let opts = ImportOptions { force: args.force };
    let r = gguf::import(
        &args.file,
        &args.output,
        &opts,
        &crate::printer::Bars::default(),
    )
    .with_context(|| format!("cannot import {}", args.file.display()))?;
    if args.json {
        return super::print_json(&r);
    }
    let types: Vec<String> = r
        .tensor_types
        .iter()
        .map(|(t, n)| format!("{n} × {t}"))
        .collect();
    println!("imported {} → {}", r.source.display(), r.output.display());
    println!(
        "  {}  {} layers  hidden {}  heads {}/{}  vocab {}{}",
        r.hparams.architecture().hf_name(),
        r.hparams.layers,
        r.hparams.hidden,
        r.hparams.heads,
        r.hparams.kv_heads,
        fmt_count(r.hparams.vocab as u64),
        if r.hparams.tied {
            "  (tied embeddings)"
        } else {
            ""
        }
    );
    println!(
        "  parameters   {} in {} tensors ({})",
        fmt_count(r.parameters),
        r.tensors,
        types.join(", ")
    );
    println!(
        "  weights      model.safetensors, fp16, {}",
        fmt_bytes(r.safetensors_bytes)
    );
    let tokens = fmt_count(r.tokenizer_vocab as u64);
    match r.pre_tokenizer.strip_prefix("sentencepiece ") {
        Some(flavour) => println!("  tokenizer    SentencePiece {flavour}, {tokens} tokens"),
        None => println!(
            "  tokenizer    byte-level BPE, {tokens} tokens, pre-tokenizer `{}`",
            r.pre_tokenizer
        ),
    }
    Ok(())
}
