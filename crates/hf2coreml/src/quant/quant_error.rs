//! What can go wrong palettizing: the numerics' refusals, a recipe, a tensor, calibration.

use std::path::PathBuf;

use thiserror::Error;

use super::recipe::RecipeError;
use super::NumericsError;
use crate::checkpoint::CheckpointError;

#[derive(Debug, Error)]
pub enum QuantError {
    #[error(transparent)]
    Numerics(#[from] NumericsError),
    #[error("granularity {granularity} does not fit shape {shape:?}: {message}")]
    Granularity {
        granularity: String,
        shape: Vec<usize>,
        message: String,
    },
    #[error("{path}: {error}")]
    Recipe { path: PathBuf, error: RecipeError },
    #[error("tensor `{tensor}`: {source}")]
    Tensor {
        tensor: String,
        #[source]
        source: Box<QuantError>,
    },
    #[error("calibration: {message}")]
    Calibration { message: String },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

impl QuantError {
    pub(super) fn in_tensor(self, name: &str) -> Self {
        QuantError::Tensor {
            tensor: name.to_string(),
            source: Box::new(self),
        }
    }
}
