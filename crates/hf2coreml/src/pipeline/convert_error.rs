//! What stops a conversion once it has its settings: [`ConvertError`], each variant naming
//! what it was working on.

use std::path::{Path, PathBuf};

use thiserror::Error;

use super::texts::TextError;
use crate::checkpoint::CheckpointError;
use crate::emit::EmitError;
use crate::graph::GraphError;
use crate::model::ReferenceError;
use crate::quant::QuantError;

/// Errors of the pipeline, each naming what it was working on.
#[derive(Debug, Error)]
pub enum ConvertError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error("building the graph: {0}")]
    Graph(#[from] GraphError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("output {0} must end in .mlpackage (.aimodel for --target coreai)")]
    OutputName(PathBuf),
    #[error("output {} must end in .{ext} for target {target}", .output.display())]
    OutputExtension {
        output: PathBuf,
        target: &'static str,
        ext: &'static str,
    },
    /// A setting the Core AI backend does not build (refused before any work).
    #[error("--target coreai {0}")]
    CoreAi(String),
    #[error("output {} is not valid UTF-8: coremltools cannot write it; choose a UTF-8 name", .0.display())]
    OutputNotUtf8(PathBuf),
    #[error(
        "input {} is not valid UTF-8: the report records the checkpoint's path as text; \
         rename it, or link it under a UTF-8 name",
        .0.display()
    )]
    SourceNotUtf8(PathBuf),
    #[error("{0} already exists (use --force to replace it)")]
    Exists(PathBuf),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("palettizing: {0}")]
    Quant(#[from] QuantError),
    #[error("measuring activation ranges: {0}")]
    Calibration(#[from] ReferenceError),
    /// The calibration text could not be tokenized.
    #[error(transparent)]
    Text(#[from] TextError),
    #[error(
        "tensor `{tensor}`: {granularity} palettization cannot be stored: LUT groups must run \
         along the output channels (axis 0) and divide them"
    )]
    Granularity { tensor: String, granularity: String },
    #[error("{}: cannot split into packages: {source}", .path.display())]
    Chain {
        path: PathBuf,
        #[source]
        source: crate::budget::split::ChainError,
    },
    /// A prefill function was asked for a model that needs a chain of packages.
    #[error(
        "the model needs a chain of {parts} packages under the package size limit, and chains \
         are built with one function per part: use --prefill-len 0, or a larger \
         --max-package-size to keep one package with prefill and decode functions"
    )]
    PrefillChain { parts: usize },
    /// The recipe asks for what its target cannot store (grouped or 3-bit LUTs on iOS17).
    #[error("{0} (use --target ios18, or target = \"ios18\" in the recipe)")]
    Target(String),
    /// The blocks keep state the contract's one stacked KV cache cannot hold.
    #[error("{0}")]
    State(String),
}

/// An I/O error about `path`, as a [`ConvertError`].
pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ConvertError + '_ {
    move |source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    }
}
