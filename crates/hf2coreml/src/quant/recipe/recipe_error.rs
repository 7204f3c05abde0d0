//! What is wrong with a recipe.

use super::builtin_recipes::BUILTIN_RECIPES;
use crate::quant::SUPPORTED_NBITS;

/// What is wrong with a recipe: the message after `{origin}: ` in [`QuantError::Recipe`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("{0}")]
    Read(String),
    /// The text is not TOML.
    #[error("{0}")]
    Syntax(String),
    /// A palettize decision asks for a bit width iOS17 has no LUT for.
    #[error("{at}.nbits = {nbits}: supported are {list}", list = SUPPORTED_NBITS.map(|n| n.to_string()).join(", "))]
    UnsupportedNbits { at: String, nbits: i64 },
    /// A tensor-name pattern that is not a glob.
    #[error("{}invalid glob `{glob}`: {message}", .at.as_ref().map_or(String::new(), |a| format!("{a}: ")))]
    Glob {
        at: Option<String>,
        glob: String,
        message: String,
    },
    /// Any other key or value the format does not allow.
    #[error("{0}")]
    Invalid(String),
    /// Neither a file nor the name of a shipped recipe.
    #[error(
        "no such file, and not a shipped recipe{}; shipped: {} (`hf2coreml recipes` describes them)",
        .nearest.as_ref().map_or(String::new(), |n| format!(" (did you mean `{n}`?)")),
        BUILTIN_RECIPES.map(|(n, _)| n).join(", ")
    )]
    UnknownName { nearest: Option<String> },
}

impl From<String> for RecipeError {
    fn from(message: String) -> Self {
        RecipeError::Invalid(message)
    }
}

impl From<&str> for RecipeError {
    fn from(message: &str) -> Self {
        RecipeError::Invalid(message.to_string())
    }
}
