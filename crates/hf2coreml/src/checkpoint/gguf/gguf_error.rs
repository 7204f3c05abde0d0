//! Everything that can be wrong with a GGUF import, and the architectures it knows.

use std::path::PathBuf;

use thiserror::Error;

use super::tensor_types::supported_types_list;

/// Architectures (`general.architecture`) the importer understands.
pub const SUPPORTED_ARCHITECTURES: [&str; 8] = [
    "llama", "qwen2", "qwen3", "gemma3", "phi3", "smollm3", "lfm2", "qwen35",
];

/// Everything that can be wrong with a GGUF import. Every variant names the file.
#[derive(Debug, Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a readable GGUF file: {message}")]
    Malformed { path: PathBuf, message: String },
    #[error(
        "{path}: truncated: tensor `{tensor}` needs bytes {start}..{end} but the file has {file_size} bytes"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_size: u64,
    },
    #[error("{path}: metadata `{key}`: {message}")]
    Metadata {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("{path}: architecture `{arch}` is not supported (supported: {})", SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture { path: PathBuf, arch: String },
    /// llama.cpp's multimodal projector file (`mmproj-*.gguf`), which ships beside a
    /// multimodal model's text GGUF.
    #[error(
        "{path}: a multimodal projector (`mmproj`, architecture `clip`): it holds the vision or \
         audio tower, not the text model; import the text model's GGUF beside it, which is what \
         hf2coreml converts"
    )]
    Projector { path: PathBuf },
    #[error(
        "{path}: tensor `{tensor}` has type {dtype}; supported: {}",
        supported_types_list()
    )]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{path}: cannot rebuild tokenizer {what} (supported: {supported})")]
    UnsupportedTokenizer {
        path: PathBuf,
        what: String,
        supported: String,
    },
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("{path} already exists (use --force to replace it)")]
    OutputExists { path: PathBuf },
}
