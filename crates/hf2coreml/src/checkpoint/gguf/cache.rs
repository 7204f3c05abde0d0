//! The model cache: GGUF files imported once, kept as checkpoints keyed by the file's content
//! hash, so converting the same file again starts at once.
//!
//! `$HF2COREML_CACHE/imported/<sha256>` (default `$XDG_CACHE_HOME/hf2coreml`, else
//! `~/.cache/hf2coreml`). An entry is built under a temporary name and renamed into place
//! ([`super::import`]), so an existing entry is a complete one.

use std::path::{Path, PathBuf};

use super::{import, GgufError, ImportOptions};
use crate::progress::Progress;

/// The cache root: `$HF2COREML_CACHE`, `$XDG_CACHE_HOME/hf2coreml` or `~/.cache/hf2coreml`.
pub fn cache_root() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(p) = var("HF2COREML_CACHE") {
        return p;
    }
    if let Some(p) = var("XDG_CACHE_HOME") {
        return p.join("hf2coreml");
    }
    var("HOME")
        .unwrap_or_else(std::env::temp_dir)
        .join(".cache/hf2coreml")
}

/// Where the checkpoint imported from a file with content hash `sha256` lives.
pub fn entry_for(sha256: &str) -> PathBuf {
    cache_root().join("imported").join(sha256)
}

/// An imported checkpoint from the cache.
#[derive(Debug, Clone)]
pub struct Cached {
    pub dir: PathBuf,
    pub sha256: String,
    /// True when the entry existed already (no import ran).
    pub reused: bool,
}

/// The checkpoint imported from `src`: the cached one when its content was imported before,
/// else imported now into the cache.
pub fn import_cached(src: &Path, progress: &dyn Progress) -> Result<Cached, GgufError> {
    let sha256 = crate::fsutil::sha256_file(src).map_err(|source| GgufError::Io {
        path: src.to_path_buf(),
        source,
    })?;
    let dir = entry_for(&sha256);
    if dir.join("config.json").is_file() {
        return Ok(Cached {
            dir,
            sha256,
            reused: true,
        });
    }
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|source| GgufError::Io {
            path: parent.to_path_buf(),
            source,
        })?;
    }
    match import(src, &dir, &ImportOptions { force: false }, progress) {
        Ok(_) => {}
        // Another process finished the same import first: its entry is complete.
        Err(GgufError::OutputExists { .. }) if dir.join("config.json").is_file() => {}
        Err(e) => return Err(e),
    }
    Ok(Cached {
        dir,
        sha256,
        reused: false,
    })
}
