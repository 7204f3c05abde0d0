//! Outputs: checked before any work (writable, not over the input), written atomically (a
//! file by rename, a directory built under a temporary name and renamed into place), with the
//! permissions any file the user creates gets.

use std::path::{Path, PathBuf};

use super::interrupt::{
    keep_on_interrupt, register_partials, remove_on_interrupt, remove_stale_partials,
};
use super::{file_name, parent_dir};

/// Write `bytes` to `dest`. A new name or a regular file (or a symlink to one, replaced where
/// it points) is written atomically: a temp file beside it, then a rename. A FIFO or a
/// character device (`/dev/null`, a terminal, a pipe another process reads) is what it is for
/// to be written to: it is opened and written in place, never renamed over. Anything else (a
/// directory, a block device, a socket, a dangling symlink) is refused.
pub fn atomic_write(dest: &Path, bytes: &[u8]) -> std::io::Result<()> {
    match file_target(dest)? {
        FileTarget::InPlace => {
            let mut f = std::fs::OpenOptions::new().write(true).open(dest)?;
            std::io::Write::write_all(&mut f, bytes)?;
            std::io::Write::flush(&mut f)
        }
        FileTarget::Replace(path) => {
            let mut tmp = temp_file_beside(&path)?;
            std::io::Write::write_all(&mut tmp, bytes)?;
            tmp.as_file().sync_all()?;
            tmp.persist(&path).map_err(|e| e.error)?;
            Ok(())
        }
    }
}

/// Check, before any work, that [`atomic_write`] could write `dest`: refused when it is
/// something never written over, and when a file must be created where none can be.
pub fn check_file_output(dest: &Path) -> std::io::Result<()> {
    match file_target(dest)? {
        FileTarget::InPlace => Ok(()),
        FileTarget::Replace(path) => check_writable(&path),
    }
}

/// A temp file in `dest`'s directory, named after it and this process
/// (`.NAME.PID.*.partial`), with an output's permissions: removed on interruption as a
/// partial directory is (a sidecar may be gigabytes, written for minutes), and what a killed
/// run left is removed first.
pub(super) fn temp_file_beside(dest: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let parent = parent_dir(dest);
    remove_stale_partials(parent, &file_name(dest));
    let prefix = format!(".{}.{}.", file_name(dest), std::process::id());
    register_partials(parent, &prefix);
    tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".partial")
        .permissions(output_permissions(0o666))
        .tempfile_in(parent)
}

/// How a file output reaches `dest`.
#[derive(Debug, PartialEq)]
enum FileTarget {
    /// Renamed into place at this path (`dest`, or the regular file a symlink names).
    Replace(PathBuf),
    /// Opened and written (a FIFO or a character device).
    InPlace,
}

fn file_target(dest: &Path) -> std::io::Result<FileTarget> {
    use std::os::unix::fs::FileTypeExt;
    let link = match std::fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(FileTarget::Replace(dest.to_path_buf()))
        }
        other => other?,
    };
    // The kernel follows the link (`/dev/stdout` → `/proc/self/fd/1` → a pipe).
    let meta = match std::fs::metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(not_replaced(dest, "a symlink to nothing"));
        }
        other => other?,
    };
    let t = meta.file_type();
    if t.is_file() {
        let path = if link.file_type().is_symlink() {
            std::fs::canonicalize(dest)?
        } else {
            dest.to_path_buf()
        };
        Ok(FileTarget::Replace(path))
    } else if t.is_fifo() || t.is_char_device() {
        Ok(FileTarget::InPlace)
    } else {
        Err(not_replaced(dest, kind_of(&meta)))
    }
}

/// What a non-regular file is, for a message.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_symlink() {
        "a symlink"
    } else {
        "not a regular file"
    }
}

fn not_replaced(dest: &Path, what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!(
            "{} exists and is {what}: not written over (choose another name)",
            dest.display()
        ),
    )
}

/// An error unless whatever exists at `dest` is something an output may replace with
/// `--force`: a directory or regular file when `dir` (a package), a regular file otherwise.
/// Symlinks, devices, FIFOs and sockets are never replaced.
pub fn check_replaceable(dest: &Path, dir: bool) -> std::io::Result<()> {
    let meta = match std::fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        other => other?,
    };
    let t = meta.file_type();
    if t.is_file() || (dir && t.is_dir()) {
        Ok(())
    } else {
        Err(not_replaced(dest, kind_of(&meta)))
    }
}

/// The bytes an unprivileged writer may still put on the file system holding `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let st = statvfs(path)?;
    // The field types differ by platform (u32 on some 32-bit ones).
    #[allow(clippy::useless_conversion)]
    Ok(u64::from(st.f_bavail).saturating_mul(u64::from(st.f_frsize)))
}

/// The longest file name the file system holding `path` takes.
fn name_max(path: &Path) -> std::io::Result<usize> {
    #[allow(clippy::useless_conversion)]
    Ok(u64::from(statvfs(path)?.f_namemax) as usize)
}

fn statvfs(path: &Path) -> std::io::Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs is plain data, filled by the call for a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// An output's mode before the umask: outputs get what any file the user creates gets
/// (tempfile's own default, 0600 / 0700, would hide a package from the rest of a team).
fn output_permissions(mode: u32) -> std::fs::Permissions {
    std::os::unix::fs::PermissionsExt::from_mode(mode)
}

/// `path` made absolute with every symlink and `..` resolved, whether or not it exists: the
/// existing part is canonicalized, the rest applied lexically. Two spellings of one place
/// (`o/./x/../a`, a symlinked folder) give the same result.
pub fn resolved(path: &Path) -> std::io::Result<PathBuf> {
    use std::path::Component;
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let mut out = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => {
                out.push(other);
                if let Ok(real) = out.canonicalize() {
                    out = real;
                }
            }
        }
    }
    Ok(out)
}

/// An error when `output` is `input`, contains it or lies inside it:
/// writing it, or replacing it with `--force`, would destroy the input.
pub fn refuse_output_over_input(input: &Path, output: &Path) -> std::io::Result<()> {
    let (i, o) = (resolved(input)?, resolved(output)?);
    if i.starts_with(&o) || o.starts_with(&i) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "the output {} would overlap the input {} (it is, contains or lies inside \
                 it): choose an output elsewhere",
                output.display(),
                input.display()
            ),
        ));
    }
    Ok(())
}

/// How much longer than an output's name the longest name written beside it is
/// (`.NAME.PID.XXXXXX.partial`, the PID at most 7 digits).
const PROBE_EXTRA: usize = 24;

/// Check, without leaving anything behind, that `dest` could be created: its nearest existing
/// ancestor is a directory we can create files in. Lets a command refuse an unwritable output
/// before minutes of work instead of after.
pub fn check_writable(dest: &Path) -> std::io::Result<()> {
    let mut dir = parent_dir(dest);
    while !dir.exists() {
        dir = parent_dir(dir);
        if dir == Path::new(".") && !dir.exists() {
            break;
        }
    }
    if !dir.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "cannot create {}: {} is not a directory",
                dest.display(),
                dir.display()
            ),
        ));
    }
    let name = file_name(dest);
    if name_max(dir).is_ok_and(|max| name.len() + PROBE_EXTRA > max) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "cannot create {}: the name is too long for the file system (the temporary \
                 names written beside it are {PROBE_EXTRA} bytes longer): choose a shorter one",
                dest.display()
            ),
        ));
    }
    // Named as long as the longest name written beside `dest` (a partial directory,
    // `.NAME.PID.XXXXXX.partial`), so a name too long for the file system fails here.
    tempfile::Builder::new()
        .prefix(&format!(".{name}.0000000."))
        .suffix(".partial")
        .tempfile_in(dir)
        .map(drop)
        .map_err(|e| {
            let why = format!("{} is not writable ({e})", dir.display());
            std::io::Error::new(e.kind(), format!("cannot create {}: {why}", dest.display()))
        })
}

/// An output directory built under a temporary name beside its destination and renamed into
/// place by [`AtomicDir::commit`]. Dropped without commit (error, panic), it is removed, so a
/// failed run never leaves a partial output under the destination's name.
#[derive(Debug)]
pub struct AtomicDir {
    tmp: Option<tempfile::TempDir>,
    dest: PathBuf,
    force: bool,
}

impl AtomicDir {
    /// Start building `dest`. Fails if `dest` exists and `force` is false.
    pub fn new(dest: &Path, force: bool) -> std::io::Result<Self> {
        if dest.symlink_metadata().is_ok() && !force {
            return Err(already_exists(dest, "use --force to replace it"));
        }
        check_replaceable(dest, true)?;
        let parent = parent_dir(dest);
        std::fs::create_dir_all(parent)?;
        remove_stale_partials(parent, &file_name(dest));
        let prefix = format!(".{}.{}.", file_name(dest), std::process::id());
        register_partials(parent, &prefix);
        let tmp = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".partial")
            .permissions(output_permissions(0o777))
            .tempdir_in(parent)?;
        remove_on_interrupt(tmp.path());
        Ok(AtomicDir {
            tmp: Some(tmp),
            dest: dest.to_path_buf(),
            force,
        })
    }

    /// Where to write the contents.
    pub fn path(&self) -> &Path {
        self.tmp.as_ref().expect("not committed").path()
    }

    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Move the finished directory into place. Without `force` the rename never replaces
    /// anything: when another run created `dest` meanwhile (two converts to one output), it
    /// fails with `AlreadyExists` and this run's directory is removed; the first one to
    /// finish wins. With `force` an existing `dest` is replaced.
    pub fn commit(self) -> std::io::Result<PathBuf> {
        let _lock = super::interrupt::commit_lock()?;
        self.commit_locked()
    }

    /// [`AtomicDir::commit`] with [`super::interrupt::commit_lock`] already held.
    pub(super) fn commit_locked(mut self) -> std::io::Result<PathBuf> {
        if !self.force {
            let tmp = self.tmp.as_ref().expect("commit once");
            rename_no_replace(tmp.path(), &self.dest).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    already_exists(&self.dest, "another run created it meanwhile")
                } else {
                    e
                }
            })?;
            let tmp = self.tmp.take().expect("commit once");
            keep_on_interrupt(tmp.path());
            let _ = tmp.keep();
            return Ok(self.dest.clone());
        }
        let tmp = self.tmp.take().expect("commit once");
        keep_on_interrupt(tmp.path());
        let tmp_path = tmp.keep();
        if self.dest.exists() {
            // Move the old output aside first so there is no moment without a complete one
            // under the destination's name for longer than two renames.
            let trash = parent_dir(&self.dest).join(format!(
                ".{}.old-{}",
                file_name(&self.dest),
                std::process::id()
            ));
            std::fs::rename(&self.dest, &trash)?;
            std::fs::rename(&tmp_path, &self.dest)?;
            if trash.is_dir() {
                std::fs::remove_dir_all(&trash)?;
            } else {
                std::fs::remove_file(&trash)?;
            }
        } else {
            std::fs::rename(&tmp_path, &self.dest)?;
        }
        Ok(self.dest.clone())
    }
}

fn already_exists(dest: &Path, why: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        format!("{} already exists ({why})", dest.display()),
    )
}

/// Rename `from` to `to`, failing with `AlreadyExists` if `to` exists, atomically
/// (renameat2 with RENAME_NOREPLACE on Linux). Elsewhere, or on a file system without it,
/// a hard check just before the rename.
fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_bytes())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        };
        let (f, t) = (c(from)?, c(to)?);
        // SAFETY: both are valid NUL-terminated paths that outlive the call.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                f.as_ptr(),
                libc::AT_FDCWD,
                t.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) && e.raw_os_error() != Some(libc::ENOSYS) {
            return Err(e);
        }
    }
    if to.symlink_metadata().is_ok() {
        return Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists));
    }
    std::fs::rename(from, to)
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        // The TempDir field removes the directory right after this.
        if let Some(t) = &self.tmp {
            keep_on_interrupt(t.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_follow_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        // Read the umask (setting it is the only way; restored at once).
        let umask = unsafe {
            let old = libc::umask(0o022);
            libc::umask(old);
            old as u32
        };
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("x.json");
        atomic_write(&file, b"{}").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&file), 0o666 & !umask);
        let dest = root.path().join("m.mlpackage");
        AtomicDir::new(&dest, false).unwrap().commit().unwrap();
        assert_eq!(mode(&dest), 0o777 & !umask);
    }

    #[test]
    fn stale_partials_of_dead_processes_are_removed() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("m.mlpackage");
        // PIDs above the kernel's pid_max (4,194,304 at most) never exist.
        let dead = root.path().join(".m.mlpackage.4999999.abc.partial");
        let mine = root
            .path()
            .join(format!(".m.mlpackage.{}.abc.partial", std::process::id()));
        let other = root.path().join(".n.mlpackage.4999999.abc.partial");
        for d in [&dead, &mine, &other] {
            std::fs::create_dir(d).unwrap();
        }
        // The writability probe of a run killed while it existed: a file, PID 0.
        let probe = root.path().join(".m.mlpackage.0000000.abc.partial");
        std::fs::write(&probe, b"").unwrap();
        let a = AtomicDir::new(&dest, false).unwrap();
        assert!(!dead.exists() || !Path::new("/proc/self").exists());
        assert!(!probe.exists() || !Path::new("/proc/self").exists());
        assert!(mine.exists() && other.exists());
        assert!(a.path().exists());
    }

    #[test]
    fn atomic_dir_commits_or_vanishes() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("out.mlpackage");
        {
            let d = AtomicDir::new(&dest, false).unwrap();
            std::fs::write(d.path().join("x"), b"1").unwrap();
            // dropped without commit
        }
        assert!(!dest.exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
        let d = AtomicDir::new(&dest, false).unwrap();
        std::fs::write(d.path().join("x"), b"1").unwrap();
        d.commit().unwrap();
        assert!(dest.join("x").is_file());
        assert!(AtomicDir::new(&dest, false).is_err());
        let d = AtomicDir::new(&dest, true).unwrap();
        std::fs::write(d.path().join("y"), b"2").unwrap();
        d.commit().unwrap();
        assert!(dest.join("y").is_file() && !dest.join("x").exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }

    #[test]
    fn of_two_runs_to_one_output_without_force_the_first_to_finish_wins() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("out.mlpackage");
        let a = AtomicDir::new(&dest, false).unwrap();
        let b = AtomicDir::new(&dest, false).unwrap();
        std::fs::write(a.path().join("a"), b"1").unwrap();
        std::fs::write(b.path().join("b"), b"2").unwrap();
        a.commit().unwrap();
        let err = b.commit().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists, "{err}");
        assert!(dest.join("a").is_file() && !dest.join("b").exists());
        // The loser's partial directory is gone.
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }
}
