//! Reading a GGUF's metadata keys: a positive dimension that must or may be present, the
//! special token ids, an error naming the key; and the `partial_rotary_factor` a rotated
//! dimension count is written as.

use super::gguf_error::GgufError;
use super::reader::GgufFile;

/// The special token ids config.json names.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
}

impl SpecialIds {
    /// The ids `tokenizer.ggml.*_token_id` declare (against the vocabulary: the tokenizer and
    /// config.json check them). An id wider than 32 bits is refused, never dropped.
    pub fn from_metadata(g: &GgufFile) -> Result<Self, GgufError> {
        let id = |k: &str| -> Result<Option<u32>, GgufError> {
            g.get_uint(k)?
                .map(|v| {
                    u32::try_from(v)
                        .map_err(|_| meta_err(g, k, format!("token id {v} does not fit 32 bits")))
                })
                .transpose()
        };
        Ok(SpecialIds {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
        })
    }
}

/// An error about metadata `key` of `g`.
pub(super) fn meta_err(g: &GgufFile, key: &str, message: String) -> GgufError {
    GgufError::Metadata {
        path: g.path().to_path_buf(),
        key: key.to_string(),
        message,
    }
}

/// A positive integer `key` that may be absent.
pub(super) fn optional_dim(g: &GgufFile, key: &str) -> Result<Option<usize>, GgufError> {
    match g.get_uint(key)? {
        None => Ok(None),
        Some(0) => Err(meta_err(g, key, "must be positive".into())),
        Some(v) => usize::try_from(v)
            .map(Some)
            .map_err(|_| meta_err(g, key, format!("{v} is too large"))),
    }
}

/// A positive integer `key` that must be present.
pub(super) fn required_dim(g: &GgufFile, key: &str) -> Result<usize, GgufError> {
    match g.get_uint(key)? {
        None => Err(meta_err(g, key, "missing".into())),
        Some(0) => Err(meta_err(g, key, "must be positive".into())),
        Some(v) => usize::try_from(v).map_err(|_| meta_err(g, key, format!("{v} is too large"))),
    }
}

/// The `partial_rotary_factor` that readers turn back into `rot` rotated dimensions: they
/// take `int(head_dim × factor)`, and rot / head_dim rounded to f64 can land a hair below, which
/// truncates to rot − 1 (6 of 47); the next f64 up then gives rot.
pub(super) fn rotary_factor(rot: usize, head_dim: usize) -> f64 {
    let f = rot as f64 / head_dim as f64;
    if (head_dim as f64 * f) as usize == rot {
        f
    } else {
        // The next f64 above a positive finite value (`f64::next_up` needs a newer Rust).
        f64::from_bits(f.to_bits() + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::rotary_factor;

    #[test]
    fn rotary_factor_gives_back_the_rotated_count() {
        for head_dim in 2..=1024usize {
            for rot in (2..head_dim).step_by(2) {
                let f = rotary_factor(rot, head_dim);
                assert_eq!((head_dim as f64 * f) as usize, rot, "{rot} of {head_dim}");
            }
        }
        assert_eq!(rotary_factor(96, 128), 0.75);
    }
}
