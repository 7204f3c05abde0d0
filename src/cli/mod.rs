//! Command-line types. Each verb's arguments live beside its implementation in `commands/`.

use clap::{CommandFactory, Parser, Subcommand};

use crate::commands;

pub mod completions;

/// Turn Hugging Face causal language models into Core ML packages (iOS17, iOS18) and Core AI
/// assets, and prove them right.
#[derive(Debug, Parser)]
#[command(name = "hf2coreml", version, about, long_about = None)]
pub struct Cli {
    /// Print only results (stdout) and errors: no progress bars or notes.
    #[arg(long, short, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Print details on stderr: what was chosen and why, stage by stage.
    #[arg(long, short, global = true)]
    pub verbose: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Describe a checkpoint (architecture, parameters, tensors by role, sizes under the recipe),
    /// a GGUF file's header, or a saved package, chain or Core AI asset.
    Inspect(commands::inspect::Args),
    /// List the shipped recipes: what each stores, what it is for, what it was measured to give.
    Recipes(commands::recipes::Args),
    /// Check a plan against a device's app memory limit (exit 1 when it does not fit).
    Budget(commands::budget::Args),
    /// Convert a checkpoint to a Core ML package (iOS17 by default, or iOS18) or a Core AI asset
    /// (fixed max_seq_len, static KV cache).
    Convert(commands::convert::Args),
    /// Palettize a checkpoint's weights under a recipe and report sizes and errors (writes no package).
    Palettize(commands::palettize::Args),
    /// Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory.
    ImportGguf(commands::import_gguf::Args),
    /// Generate text from a package (the CPU's MIL interpreter) or a Core AI asset (Apple's
    /// runtime): stream it, report tokens/s.
    Run(commands::run_args::Args),
    /// Check a saved package against its checkpoint: contract, weights, logits, fp16 ranges, gates.
    Validate(commands::validate::Args),
    /// Check any ML Program package against the Neural Engine's rules (exit 1 on an error or fallback).
    Lint(commands::lint::Args),
    /// Run the exports of a batch file (models × lengths × recipes × devices), for CI.
    Batch(commands::batch::Args),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(completions::Args),
    /// Print the man page (roff) to stdout, or write one page per command to a directory.
    Man(completions::ManArgs),
}

impl Command {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            Command::Inspect(a) => commands::inspect::run(a),
            Command::Recipes(a) => commands::recipes::run(a),
            Command::Budget(a) => commands::budget::run(a),
            Command::Convert(a) => commands::convert::run(a),
            Command::Palettize(a) => commands::palettize::run(a),
            Command::ImportGguf(a) => commands::import_gguf::run(a),
            Command::Run(a) => commands::run::run(a),
            Command::Validate(a) => commands::validate::run(a),
            Command::Lint(a) => commands::lint::run(a),
            Command::Batch(a) => commands::batch::run(a),
            Command::Completions(a) => completions::run(a, Cli::command()),
            Command::Man(a) => completions::man(a, Cli::command()),
        }
    }
}
