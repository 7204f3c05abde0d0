//! `hf2coreml run`'s flags.

use std::path::PathBuf;

use super::args::ComputeArg;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The .mlpackage to run, a chain of packages (the directory `convert` wrote), or a Core AI
    /// .aimodel or chain of them (run by Apple's runtime from the Python environment).
    pub package: PathBuf,
    /// Text to continue (tokenized with the package's tokenizer).
    #[arg(
        long,
        required_unless_present_any = ["prompt_ids", "chat"],
        conflicts_with = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Token ids to continue, comma-separated, e.g. `1,2,3` (no tokenizer needed).
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Chat through the checkpoint's chat template: with --prompt, one user message; without,
    /// an interactive session reading stdin line by line (`/reset`, `/exit`).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: bool,
    /// The system message a --chat conversation starts with.
    #[arg(long, requires = "chat", value_name = "TEXT")]
    pub system: Option<String>,
    /// Continue from a KV cache saved by --save-cache (the same package only): the prompt, or
    /// the chat, carries on after it.
    #[arg(long, value_name = "FILE")]
    pub load_cache: Option<PathBuf>,
    /// Save the KV cache's valid rows at the end (docs/contract.md, "The KV-cache file").
    #[arg(long, value_name = "FILE")]
    pub save_cache: Option<PathBuf>,
    /// Tokens to generate; 0 processes the prompt only.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities sum to p.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Random seed for sampling (the same seed gives the same text).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// tokenizer.json [default: X.tokenizer.json beside X.mlpackage].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// tokenizer_config.json holding the chat template [default: beside the tokenizer].
    #[arg(long)]
    pub tokenizer_config: Option<PathBuf>,
    /// Float precision of the CPU interpreter.
    #[arg(long, value_enum, default_value_t = ComputeArg::Fp16)]
    pub compute: ComputeArg,
    /// Decode every weight when the package loads instead of reading packed weights in place
    /// from the memory-mapped weight files (the same results, bit for bit; more memory).
    #[arg(long)]
    pub dense_weights: bool,
    /// Write the logits of every processed position as float32 [T, V] .npy.
    #[arg(long, value_name = "FILE.npy")]
    pub logits_out: Option<PathBuf>,
    /// Print one JSON object at the end (prompt and generated ids, text, stop reason, timing)
    /// instead of streaming the text.
    #[arg(long)]
    pub json: bool,
}
