//! A package and its sidecar files (tokenizer, report) as one output: the package is built in
//! an [`AtomicDir`], the files in temp files beside their names, and [`Staged::commit`] places
//! them together. A run that fails before the commit leaves none of them; one that fails while
//! placing them takes back what it placed.

use std::path::{Path, PathBuf};

use super::output::{check_replaceable, temp_file_beside, AtomicDir};

#[derive(Debug)]
pub struct Staged {
    dir: AtomicDir,
    files: Vec<(tempfile::NamedTempFile, PathBuf)>,
    /// Sidecars of an earlier output that this one has none of (`--force` only).
    stale: Vec<PathBuf>,
    force: bool,
}

impl Staged {
    /// Start building the package `dest`; see [`AtomicDir::new`].
    pub fn new(dest: &Path, force: bool) -> std::io::Result<Self> {
        Ok(Staged {
            dir: AtomicDir::new(dest, force)?,
            files: Vec::new(),
            stale: Vec::new(),
            force,
        })
    }

    /// Where to write the package's contents.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Stage `bytes` for the file `dest`, placed at commit. An existing `dest` is refused
    /// without `force`, and with it unless it is a regular file.
    pub fn add_file(&mut self, dest: &Path, bytes: &[u8]) -> std::io::Result<()> {
        self.add_file_with(dest, |w| w.write_all(bytes))
    }

    /// Stage the file `dest` as `write` writes it (streamed: a file larger than memory), as
    /// [`Staged::add_file`] stages bytes.
    pub fn add_file_with(
        &mut self,
        dest: &Path,
        write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if !self.force && dest.symlink_metadata().is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!(
                    "{} already exists (use --force to replace it)",
                    dest.display()
                ),
            ));
        }
        check_replaceable(dest, false)?;
        let mut tmp = temp_file_beside(dest)?;
        {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, tmp.as_file_mut());
            write(&mut w)?;
            std::io::Write::flush(&mut w)?;
        }
        tmp.as_file().sync_all()?;
        self.files.push((tmp, dest.to_path_buf()));
        Ok(())
    }

    /// A sidecar name this output does not use (a Gemma 4 table beside a model without one):
    /// with `force`, an existing regular file of that name is removed at commit, so that the
    /// output is the new model's files only; without it the name must be free already.
    pub fn remove_at_commit(&mut self, dest: &Path) -> std::io::Result<()> {
        if self.force && dest.symlink_metadata().is_ok() {
            check_replaceable(dest, false)?;
            self.stale.push(dest.to_path_buf());
        }
        Ok(())
    }

    /// Place the package, then each file, then remove the stale ones. Without `force` nothing is replaced: a name taken
    /// meanwhile fails the commit. Should a file fail to take its place, the package and the
    /// files already placed are removed again, and the error names the file.
    pub fn commit(self) -> std::io::Result<PathBuf> {
        let Staged {
            dir,
            files,
            stale,
            force,
        } = self;
        // One commit: an interrupt waits until the package and its files are all in place.
        let _lock = super::interrupt::commit_lock()?;
        let package = dir.commit_locked()?;
        let mut placed: Vec<PathBuf> = Vec::new();
        for (tmp, dest) in files {
            let r = if force {
                check_replaceable(&dest, false)
                    .and_then(|()| tmp.persist(&dest).map_err(|e| e.error))
            } else {
                tmp.persist_noclobber(&dest).map_err(|e| e.error)
            };
            if let Err(e) = r {
                let _ = std::fs::remove_dir_all(&package);
                for p in &placed {
                    let _ = std::fs::remove_file(p);
                }
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("placing {}: {e}", dest.display()),
                ));
            }
            placed.push(dest);
        }
        for p in stale {
            match std::fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("removing the earlier {}: {e}", p.display()),
                    ))
                }
                _ => {}
            }
        }
        Ok(package)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_package_and_its_files_appear_together() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("m.mlpackage");
        let side = root.path().join("m.report.json");
        let mut s = Staged::new(&dest, false).unwrap();
        std::fs::write(s.path().join("x"), b"1").unwrap();
        s.add_file(&side, b"{}").unwrap();
        assert!(!dest.exists() && !side.exists());
        s.commit().unwrap();
        assert!(dest.join("x").is_file());
        assert_eq!(std::fs::read(&side).unwrap(), b"{}");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_stale_sidecar_goes_with_force_only() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("m.mlpackage");
        let stale = root.path().join("m.per_layer.bin");
        std::fs::write(&stale, b"old").unwrap();
        let mut s = Staged::new(&dest, false).unwrap();
        s.remove_at_commit(&stale).unwrap();
        s.commit().unwrap();
        assert!(stale.exists(), "kept without force");
        let mut s = Staged::new(&dest, true).unwrap();
        s.remove_at_commit(&stale).unwrap();
        s.commit().unwrap();
        assert!(dest.is_dir() && !stale.exists());
        // Not a regular file: refused, even with force.
        std::fs::create_dir(&stale).unwrap();
        let mut s = Staged::new(&dest, true).unwrap();
        assert!(s.remove_at_commit(&stale).is_err());
    }

    #[test]
    fn dropped_before_commit_nothing_is_left() {
        let root = tempfile::tempdir().unwrap();
        {
            let mut s = Staged::new(&root.path().join("m.mlpackage"), false).unwrap();
            s.add_file(&root.path().join("m.report.json"), b"{}")
                .unwrap();
        }
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_file_that_cannot_take_its_place_takes_the_package_back() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("m.mlpackage");
        let (a, b) = (root.path().join("m.a.json"), root.path().join("m.b.json"));
        let mut s = Staged::new(&dest, false).unwrap();
        s.add_file(&a, b"1").unwrap();
        s.add_file(&b, b"2").unwrap();
        // Another process takes the second name before the commit.
        std::fs::write(&b, b"theirs").unwrap();
        let err = s.commit().unwrap_err();
        assert!(err.to_string().contains("m.b.json"), "{err}");
        assert!(!dest.exists() && !a.exists());
        assert_eq!(std::fs::read(&b).unwrap(), b"theirs");
    }

    #[test]
    fn with_force_only_regular_files_are_replaced() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("m.mlpackage");
        let side = root.path().join("m.report.json");
        std::fs::create_dir(&side).unwrap();
        let mut s = Staged::new(&dest, true).unwrap();
        let err = s.add_file(&side, b"{}").unwrap_err();
        assert!(err.to_string().contains("is a directory"), "{err}");
        std::fs::remove_dir(&side).unwrap();
        std::fs::write(&side, b"old").unwrap();
        s.add_file(&side, b"new").unwrap();
        s.commit().unwrap();
        assert_eq!(std::fs::read(&side).unwrap(), b"new");
    }
}
