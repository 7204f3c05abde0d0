//! Directory trees: their size and a plain copy.

use std::path::Path;

/// Size of a directory tree in bytes (symlinks are not followed).
pub fn dir_bytes(path: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(path)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// Copy the tree `from` into the existing directory `to` (regular files and directories; a
/// symlink is refused: packages hold none).
pub fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let t = entry.file_type()?;
        let dest = to.join(entry.file_name());
        if t.is_dir() {
            std::fs::create_dir(&dest)?;
            copy_tree(&entry.path(), &dest)?;
        } else if t.is_file() {
            std::fs::copy(entry.path(), &dest)?;
        } else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{}: not a file or directory", entry.path().display()),
            ));
        }
    }
    Ok(())
}
