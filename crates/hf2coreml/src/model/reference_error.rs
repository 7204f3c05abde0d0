//! What can go wrong in the reference forward pass ([`ReferenceError`], which every file of the
//! reference returns), the checks of the tokens a call is given ([`check_tokens`],
//! [`check_vocabulary`]), and candle's errors given their context ([`ctx`]).

use thiserror::Error;

use crate::arch::ModelSpec;
use crate::checkpoint::CheckpointError;

/// What can go wrong in the reference forward pass.
#[derive(Debug, Error)]
pub enum ReferenceError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("reference forward pass, {context}: {source}")]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },
    #[error("token id {token} at index {index} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab: usize,
    },
    #[error(
        "step at position {got}, but the reference holds {expected} tokens; a step must continue \
         where the last one ended, or restart at 0"
    )]
    Position { expected: usize, got: usize },
    #[error("{len} tokens exceed the model's context of {max} (max_position_embeddings)")]
    ContextTooLong { len: usize, max: usize },
    #[error(
        "{len} tokens exceed the sliding window of {window}: the reference does not implement \
         windowed attention"
    )]
    SlidingWindow { len: usize, window: usize },
    #[error("no tokens given")]
    Empty,
}

impl ReferenceError {
    pub(crate) fn candle(context: impl Into<String>, source: candle_core::Error) -> Self {
        ReferenceError::Candle {
            context: context.into(),
            source,
        }
    }
}

/// `r` with candle's error given `context`.
pub(super) fn ctx<T>(r: candle_core::Result<T>, context: &str) -> Result<T, ReferenceError> {
    r.map_err(|e| ReferenceError::candle(context, e))
}

/// `tokens` at positions `start ..` are ones the reference can compute: not empty, in the
/// vocabulary, within the context and any sliding window it does not model.
pub(super) fn check_tokens(
    spec: &ModelSpec,
    tokens: &[u32],
    start: usize,
) -> Result<(), ReferenceError> {
    check_vocabulary(spec, tokens)?;
    let len = start + tokens.len();
    if len > spec.max_position_embeddings {
        return Err(ReferenceError::ContextTooLong {
            len,
            max: spec.max_position_embeddings,
        });
    }
    if let Some(window) = spec.unbuilt_window() {
        if len > window {
            return Err(ReferenceError::SlidingWindow { len, window });
        }
    }
    Ok(())
}

/// `tokens` is not empty and every token is in the vocabulary (calibration's check: its text
/// is cut into segments, so the context is not the whole list's length).
pub(super) fn check_vocabulary(spec: &ModelSpec, tokens: &[u32]) -> Result<(), ReferenceError> {
    if tokens.is_empty() {
        return Err(ReferenceError::Empty);
    }
    match tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= spec.vocab_size)
    {
        Some((index, &token)) => Err(ReferenceError::TokenOutOfRange {
            token,
            index,
            vocab: spec.vocab_size,
        }),
        None => Ok(()),
    }
}
