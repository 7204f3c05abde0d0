//! The texts a conversion and a validation read: the shipped calibration and evaluation texts
//! or the user's, and their token ids (through the checkpoint's tokenizer, else its bytes).

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::checkpoint::Checkpoint;
use crate::quant::Recipe;

/// The calibration text shipped with the tool (also used by `reference` tests).
pub const CALIBRATION_TEXT: &str = include_str!("../../../../assets/calibration.txt");

/// The name the shipped evaluation text goes by in reports.
pub const EVALUATION_NAME: &str = "assets/evaluation.txt";

/// How a text tokenized without a tokenizer is described: one token per byte.
pub const BYTE_TOKENS: &str = "byte tokens";

/// Largest `--calibration` or evaluation text read (calibration uses a few thousand tokens).
const MAX_TEXT_BYTES: u64 = 64 << 20;

/// Below this the input statistics of a 2k-wide projection are mostly noise.
pub const MIN_CALIBRATION_TOKENS: usize = 256;

/// Why a text could not be read or tokenized.
#[derive(Debug, Error)]
pub enum TextError {
    #[error("{path}: cannot tokenize the calibration text: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("cannot read calibration text {}", path.display())]
    Calibration {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the calibration text has {tokens} tokens; calibrated palettization needs at least \
         {} (a few pages of varied text)",
        MIN_CALIBRATION_TOKENS
    )]
    TooFewTokens { tokens: usize },
}

/// Token ids of any text: through the checkpoint's tokenizer.json when it has one; otherwise
/// (test fixtures) its bytes modulo the vocabulary, which still drives every layer with varied
/// tokens. The second value describes them, starting with `label`, the text's name.
pub fn text_tokens(
    ckpt: &Checkpoint,
    text: &str,
    label: &str,
) -> Result<(Vec<u32>, String), TextError> {
    let path = ckpt.dir().join("tokenizer.json");
    if path.is_file() {
        let tok =
            crate::runtime::text::load_tokenizer(&path).map_err(|e| TextError::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let enc = tok.encode(text, false).map_err(|e| TextError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let ids = enc.get_ids().to_vec();
        let n = ids.len();
        return Ok((ids, format!("{label}, {n} tokens (tokenizer.json)")));
    }
    let v = ckpt.spec().vocab_size as u32;
    let ids: Vec<u32> = text.bytes().map(|b| b as u32 % v).collect();
    let n = ids.len();
    Ok((
        ids,
        format!("{label}, {n} {BYTE_TOKENS} (no tokenizer.json)"),
    ))
}

/// Token ids of the shipped calibration text (see [`text_tokens`]): what activation ranges are
/// measured on.
pub fn shipped_calibration_tokens(ckpt: &Checkpoint) -> Result<(Vec<u32>, String), TextError> {
    text_tokens(ckpt, CALIBRATION_TEXT, "calibration.txt")
}

/// Calibration token ids for `recipe` (empty when it does not calibrate): the `calibration`
/// file or the shipped text, through the checkpoint's tokenizer, capped at the recipe's
/// `[calibration] tokens`. The second value names the text, when there is one.
pub fn calibration_tokens(
    calibration: Option<&Path>,
    recipe: &Recipe,
    ckpt: &Checkpoint,
) -> Result<(Vec<u32>, Option<String>), TextError> {
    if !recipe.calibrates(&ckpt.slots()) {
        return Ok((Vec::new(), None));
    }
    let (ids, source) = match calibration {
        Some(path) => {
            let text = crate::fsutil::read_input_text(path, MAX_TEXT_BYTES).map_err(|source| {
                TextError::Calibration {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
            let label = path.display().to_string();
            text_tokens(ckpt, &text, &label)?
        }
        None => shipped_calibration_tokens(ckpt)?,
    };
    let (ids, source) = match recipe.calibration().and_then(|c| c.tokens) {
        Some(cap) if ids.len() > cap => {
            (ids[..cap].to_vec(), format!("{source}, first {cap} used"))
        }
        _ => (ids, source),
    };
    if ids.len() < MIN_CALIBRATION_TOKENS {
        return Err(TextError::TooFewTokens { tokens: ids.len() });
    }
    Ok((ids, Some(source)))
}

/// The evaluation text `validate` reads (the shipped passage by default) and its name.
pub fn evaluation_text(path: Option<&Path>) -> Result<(String, String), TextError> {
    Ok(match path {
        Some(p) => (
            crate::fsutil::read_input_text(p, MAX_TEXT_BYTES).map_err(|source| {
                TextError::Read {
                    path: p.to_path_buf(),
                    source,
                }
            })?,
            p.display().to_string(),
        ),
        None => (
            crate::validate::run_checks::EVALUATION_TEXT.to_string(),
            EVALUATION_NAME.to_string(),
        ),
    })
}
