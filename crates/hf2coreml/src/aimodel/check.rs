//! An asset is input like any file: what can be checked is checked before Apple's runtime
//! sees it. Every entry of the asset directory is a regular file of its own (a symlink would
//! hand the runtime a file the asset does not own, a FIFO would block its read), the bytecode
//! is not empty and matches the sha256 its `.hash` file carries (Core AI writes one beside
//! each `.mlirb`), and the metadata is bounded. What passes can still crash the runtime; that
//! is the worker's wall to hold (`worker.rs`).

use std::path::Path;

use super::{AimodelError, METADATA_FILE};

/// Core AI writes three files (`main.mlirb`, `main.hash`, `metadata.json`); a directory with
/// many more entries is not an asset, and listing it is bounded work.
const MAX_ENTRIES: usize = 64;
/// The length of a `.hash` file: a raw sha256.
const HASH_BYTES: usize = 32;

/// One function bytecode file of an asset, checked against its hash.
#[derive(Debug, Clone)]
pub struct Bytecode {
    /// The file name (`main.mlirb`).
    pub name: String,
    pub bytes: u64,
    /// Its sha256 as lowercase hex (equal to the `.hash` file beside it).
    pub sha256: String,
}

/// What the checks of an asset's files found.
#[derive(Debug, Clone)]
pub struct CheckedAsset {
    pub bytecode: Vec<Bytecode>,
}

impl CheckedAsset {
    /// The bytecode's total size: what the runtime maps and compiles.
    pub fn bytecode_bytes(&self) -> u64 {
        self.bytecode.iter().map(|b| b.bytes).sum()
    }

    /// The sha256 of the bytecode file `name`, as checked.
    pub fn sha256_of(&self, name: &str) -> Option<&str> {
        self.bytecode
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.sha256.as_str())
    }
}

/// Check the files of the asset at `path` (see the module doc).
pub fn check_asset(path: &Path) -> Result<CheckedAsset, AimodelError> {
    let err = |msg: String| AimodelError::asset(path, msg);
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_dir() {
        return Err(err("not a directory (an .aimodel asset is one)".into()));
    }
    let mut names = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| err(e.to_string()))? {
        let entry = entry.map_err(|e| err(e.to_string()))?;
        if names.len() == MAX_ENTRIES {
            return Err(err(format!(
                "more than {MAX_ENTRIES} entries: not an asset Core AI wrote"
            )));
        }
        let file = entry.path();
        let kind = std::fs::symlink_metadata(&file)
            .map_err(|e| AimodelError::asset(&file, e.to_string()))?
            .file_type();
        if kind.is_symlink() {
            return Err(AimodelError::asset(
                &file,
                "a symlink: an asset's files are its own, and Apple's runtime would follow it",
            ));
        }
        if !kind.is_file() {
            return Err(AimodelError::asset(
                &file,
                "not a regular file (a directory, FIFO or device has no place in an asset)",
            ));
        }
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    if !names.iter().any(|n| n == METADATA_FILE) {
        return Err(AimodelError::asset(
            &path.join(METADATA_FILE),
            "missing: Core AI writes it beside the bytecode",
        ));
    }
    names.sort();
    let mut bytecode = Vec::new();
    for name in names.iter().filter(|n| n.ends_with(".mlirb")) {
        bytecode.push(check_bytecode(path, name)?);
    }
    if bytecode.is_empty() {
        return Err(AimodelError::asset(
            &path.join("main.mlirb"),
            "missing: the asset holds no function bytecode (`*.mlirb`)",
        ));
    }
    Ok(CheckedAsset { bytecode })
}

/// One `.mlirb` file: not empty, and hashing to what its `.hash` file says.
fn check_bytecode(dir: &Path, name: &str) -> Result<Bytecode, AimodelError> {
    let file = dir.join(name);
    let hash_file = dir.join(format!("{}.hash", name.trim_end_matches(".mlirb")));
    let bytes = std::fs::symlink_metadata(&file)
        .map_err(|e| AimodelError::asset(&file, e.to_string()))?
        .len();
    if bytes == 0 {
        return Err(AimodelError::asset(&file, "empty"));
    }
    let recorded = crate::fsutil::read_input(&hash_file, HASH_BYTES as u64).map_err(|e| {
        let why = if e.kind() == std::io::ErrorKind::NotFound {
            "missing: Core AI writes the bytecode's sha256 beside it".to_string()
        } else {
            e.to_string()
        };
        AimodelError::asset(&hash_file, why)
    })?;
    if recorded.len() != HASH_BYTES {
        return Err(AimodelError::asset(
            &hash_file,
            format!("{} bytes, a sha256 is {HASH_BYTES}", recorded.len()),
        ));
    }
    let recorded: String = recorded.iter().map(|b| format!("{b:02x}")).collect();
    let sha256 =
        crate::fsutil::sha256_file(&file).map_err(|e| AimodelError::asset(&file, e.to_string()))?;
    if sha256 != recorded {
        return Err(AimodelError::asset(
            &file,
            format!(
                "its sha256 is {sha256}, the asset's {} records {recorded}: the bytecode was \
                 damaged or replaced",
                hash_file.file_name().unwrap_or_default().to_string_lossy()
            ),
        ));
    }
    Ok(Bytecode {
        name: name.to_string(),
        bytes,
        sha256,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn asset(dir: &Path, bytecode: &[u8]) -> std::path::PathBuf {
        let a = dir.join("m.aimodel");
        std::fs::create_dir(&a).unwrap();
        std::fs::write(a.join("main.mlirb"), bytecode).unwrap();
        std::fs::write(a.join("main.hash"), Sha256::digest(bytecode)).unwrap();
        std::fs::write(a.join(METADATA_FILE), "{}").unwrap();
        a
    }

    fn msg(r: Result<CheckedAsset, AimodelError>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn a_whole_asset_passes_with_its_hash() {
        let d = tempfile::tempdir().unwrap();
        let a = asset(d.path(), b"bytecode");
        let c = check_asset(&a).unwrap();
        assert_eq!(c.bytecode_bytes(), 8);
        assert_eq!(
            c.sha256_of("main.mlirb").unwrap(),
            crate::util::sha256_hex(b"bytecode")
        );
    }

    #[test]
    fn damaged_missing_and_foreign_files_are_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let a = asset(d.path(), b"bytecode");
        std::fs::write(a.join("main.mlirb"), b"bytecodf").unwrap();
        assert!(msg(check_asset(&a)).contains("damaged or replaced"));
        std::fs::write(a.join("main.mlirb"), b"").unwrap();
        assert!(msg(check_asset(&a)).ends_with("main.mlirb: empty"));
        std::fs::remove_file(a.join("main.mlirb")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", a.join("main.mlirb")).unwrap();
        assert!(msg(check_asset(&a)).contains("a symlink"));
        std::fs::remove_file(a.join("main.mlirb")).unwrap();
        assert!(msg(check_asset(&a)).contains("main.mlirb: missing"));
        std::fs::write(a.join("main.mlirb"), b"bytecode").unwrap();
        std::fs::write(a.join("main.hash"), b"short").unwrap();
        assert!(msg(check_asset(&a)).contains("5 bytes, a sha256 is 32"));
        std::fs::remove_file(a.join("main.hash")).unwrap();
        assert!(msg(check_asset(&a)).contains("main.hash: missing"));
        std::fs::remove_file(a.join(METADATA_FILE)).unwrap();
        assert!(msg(check_asset(&a)).contains("metadata.json: missing"));
        std::fs::create_dir(a.join(METADATA_FILE)).unwrap();
        assert!(msg(check_asset(&a)).contains("not a regular file"));
    }
}
