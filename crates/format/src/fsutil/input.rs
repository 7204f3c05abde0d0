//! Input files: only regular files are opened, and reads stop at a limit, so a path that came
//! from input (a FIFO, a device, a huge file) can neither block nor exhaust memory.

use std::path::Path;

/// Open `path` for reading only if it is a regular file (symlinks followed). A FIFO would
/// block the open until a writer comes, and /dev/zero or a terminal never ends: a path that
/// came from input is never one of those. The file type is checked before opening and again
/// on the open handle.
pub fn open_input(path: &Path) -> std::io::Result<std::fs::File> {
    let not_regular = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, device or directory is never read)",
        )
    };
    if !std::fs::metadata(path)?.is_file() {
        return Err(not_regular());
    }
    let f = std::fs::File::open(path)?;
    if !f.metadata()?.is_file() {
        return Err(not_regular());
    }
    Ok(f)
}

/// The bytes of the regular file `path`, refused when larger than `limit` (checked before
/// reading, and the read itself stops at `limit + 1` bytes should the file grow).
pub fn read_input(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let f = open_input(path)?;
    let len = f.metadata()?.len();
    let too_big = |n: u64| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{n} bytes exceeds the {limit}-byte limit for this file"),
        )
    };
    if len > limit {
        return Err(too_big(len));
    }
    let mut out = Vec::with_capacity(len as usize);
    f.take(limit + 1).read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(too_big(out.len() as u64));
    }
    Ok(out)
}

/// [`read_input`] as UTF-8 text.
pub fn read_input_text(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_input(path, limit)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// sha256 of a file's contents (a regular file, see [`open_input`]), as lowercase hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = open_input(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_regular_files_read_within_their_limit() {
        let root = tempfile::tempdir().unwrap();
        let f = root.path().join("f");
        std::fs::write(&f, b"hello").unwrap();
        assert_eq!(read_input(&f, 5).unwrap(), b"hello");
        assert!(read_input(&f, 4).is_err());
        assert!(read_input(root.path(), 1 << 20).is_err());
        #[cfg(unix)]
        {
            assert!(read_input(Path::new("/dev/zero"), 1 << 20).is_err());
            let fifo = root.path().join("fifo");
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: a valid path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            // Refused at once (opening a FIFO would block until a writer comes).
            let err = open_input(&fifo).unwrap_err();
            assert!(err.to_string().contains("not a regular file"), "{err}");
        }
    }
}
