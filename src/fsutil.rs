//! Files and the process: atomic outputs, temp directories beside a destination, scratch
//! directories, their removal on SIGINT/SIGTERM/SIGHUP, and handing freed memory back.

use std::path::{Path, PathBuf};

/// Write `bytes` to `dest` atomically: a temp file beside it, then a rename.
pub fn atomic_write(dest: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let parent = parent_dir(dest);
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{}.", file_name(dest)))
        .suffix(".tmp")
        .permissions(output_permissions(0o666))
        .tempfile_in(parent)?;
    std::io::Write::write_all(&mut tmp, bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(dest).map_err(|e| e.error)?;
    Ok(())
}

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

/// An output's mode before the umask: outputs get what any file the user creates gets
/// (tempfile's own default, 0600 / 0700, would hide a package from the rest of a team).
fn output_permissions(mode: u32) -> std::fs::Permissions {
    std::os::unix::fs::PermissionsExt::from_mode(mode)
}

/// Open `path` for reading only if it is a regular file (symlinks followed). A FIFO would
/// block the open until a writer comes, and /dev/zero or a terminal never ends: a path that
/// came from input is never one of those (issue 27, item 6). The file type is checked before
/// opening and again on the open handle.
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

/// An error when `output` is `input`, contains it or lies inside it (issue 27, item 9):
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
    tempfile::Builder::new()
        .prefix(&format!(".{}.probe", file_name(dest)))
        .tempfile_in(dir)
        .map(drop)
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "cannot create {}: {} is not writable ({e})",
                    dest.display(),
                    dir.display()
                ),
            )
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
        let parent = parent_dir(dest);
        std::fs::create_dir_all(parent)?;
        remove_stale_partials(parent, &file_name(dest));
        let prefix = format!(".{}.{}.", file_name(dest), std::process::id());
        PARTIALS_ON_INTERRUPT
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((parent.to_path_buf(), prefix.clone()));
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
    /// finish wins (issue 27, item 8). With `force` an existing `dest` is replaced.
    pub fn commit(mut self) -> std::io::Result<PathBuf> {
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

/// Directories to delete if the process is interrupted (SIGINT, SIGTERM, SIGHUP).
static ON_INTERRUPT: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// (folder, prefix): entries of the folder named `prefix*.partial` are this process's own
/// partial outputs (the prefix holds the PID), removed on interruption too. Registered before
/// the directory exists, so a signal between its creation and [`remove_on_interrupt`] finds it.
static PARTIALS_ON_INTERRUPT: std::sync::Mutex<Vec<(PathBuf, String)>> =
    std::sync::Mutex::new(Vec::new());

/// Set by the interrupt cleanup before it removes anything: the process is ending with
/// 128 + the signal, whatever the main thread meets meanwhile.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Called by the binary before it exits: when an interruption is being handled (the main
/// thread may have failed only because its output directory was just removed), wait for the
/// cleanup to end the process with 128 + the signal instead of exiting with another code.
pub fn wait_if_interrupted() {
    if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_secs(5));
    }
}

/// Everything to remove on interruption: the registered directories and the partial outputs
/// their patterns match now.
fn interrupt_targets() -> Vec<PathBuf> {
    let mut dirs = ON_INTERRUPT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let patterns = PARTIALS_ON_INTERRUPT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    for (parent, prefix) in patterns {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && name.ends_with(".partial") {
                dirs.push(e.path());
            }
        }
    }
    dirs
}

/// Delete `dir` (recursively) if the process gets SIGINT, SIGTERM or SIGHUP before
/// [`keep_on_interrupt`] is called for it; the process then exits with 128 + the signal.
/// Without this, Ctrl-C kills the process on the spot (the embedded Python installs no
/// handler) and leaves temp directories for the next run to clean. SIGKILL cannot be caught:
/// [`AtomicDir::new`] removes what such runs leave.
pub fn remove_on_interrupt(dir: &Path) {
    #[cfg(unix)]
    signals::install();
    ON_INTERRUPT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(dir.to_path_buf());
}

/// Handle SIGINT, SIGTERM and SIGHUP from now on: remove the registered directories and exit
/// with 128 + the signal (130 for Ctrl-C) within a moment, whatever stage is running. The
/// binary calls this first thing, before any Python exists: an embedded Python that finds
/// SIGINT at its default installs its own handler, which only sets a flag that Rust code
/// (calibration, palettization) never checks, so Ctrl-C went unheard for minutes (issue 27,
/// item 16).
pub fn handle_interrupts() {
    #[cfg(unix)]
    signals::install();
}

/// Put this module's handlers back after foreign code (Python, a library it imports) may
/// have replaced them. Does nothing before [`handle_interrupts`].
pub fn reassert_interrupt_handlers() {
    #[cfg(unix)]
    signals::reassert();
}

/// Stop deleting `dir` on interruption (it was committed or removed).
pub fn keep_on_interrupt(dir: &Path) {
    ON_INTERRUPT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|d| d != dir);
}

#[cfg(unix)]
mod signals {
    use std::sync::atomic::{AtomicI32, Ordering};
    use std::sync::Once;

    /// Write end of the self-pipe the handler signals through (-1: not installed).
    static PIPE: AtomicI32 = AtomicI32::new(-1);
    static INSTALL: Once = Once::new();

    /// Only async-signal-safe work here: one write(2) of the signal number.
    extern "C" fn on_signal(sig: libc::c_int) {
        let fd = PIPE.load(Ordering::Relaxed);
        if fd >= 0 {
            let b = sig as u8;
            // SAFETY: writing one byte from a live stack variable to a pipe we own.
            unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
        }
    }

    /// A thread waits on the pipe; on a signal it removes the registered directories and
    /// exits without unwinding (the main thread may be inside Python).
    pub(super) fn install() {
        INSTALL.call_once(|| {
            let mut fds = [0 as libc::c_int; 2];
            // SAFETY: pipe(2) fills the two-element array.
            if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
                return;
            }
            let read_fd = fds[0];
            PIPE.store(fds[1], Ordering::Relaxed);
            let spawned = std::thread::Builder::new()
                .name("interrupt-cleanup".into())
                .spawn(move || {
                    let mut b = 0u8;
                    // SAFETY: reading one byte into a live stack variable from our pipe.
                    let n = unsafe { libc::read(read_fd, (&mut b as *mut u8).cast(), 1) };
                    if n != 1 {
                        return;
                    }
                    super::INTERRUPTED.store(true, Ordering::SeqCst);
                    // The main thread keeps running meanwhile and may still be writing into a
                    // directory, even recreating one just removed (a writer's makedirs): look
                    // again for 100 ms, until nothing is left.
                    let mut quiet = 0;
                    for _ in 0..40 {
                        let dirs: Vec<_> = super::interrupt_targets()
                            .into_iter()
                            .filter(|d| d.exists())
                            .collect();
                        quiet = if dirs.is_empty() { quiet + 1 } else { 0 };
                        if quiet > 20 {
                            break;
                        }
                        for d in dirs {
                            let _ = std::fs::remove_dir_all(&d);
                        }
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                    // SAFETY: _exit(2) ends the process without running destructors or
                    // atexit handlers, which could block on locks the main thread holds.
                    unsafe { libc::_exit(128 + b as libc::c_int) };
                });
            if spawned.is_err() {
                return;
            }
            set_handlers();
        });
    }

    fn set_handlers() {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: on_signal only performs an async-signal-safe write(2).
            unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
        }
    }

    pub(super) fn reassert() {
        if PIPE.load(Ordering::Relaxed) >= 0 {
            set_handlers();
        }
    }
}

/// Remove `.NAME.PID.*.partial` directories that a killed run (SIGKILL, power loss: no chance
/// to clean up) left beside `NAME`, when process PID no longer exists. Where process liveness
/// cannot be checked (no /proc), nothing is removed. Best effort: errors are ignored.
fn remove_stale_partials(parent: &Path, name: &str) {
    remove_stale(parent, &format!(".{name}."), '.', ".partial");
}

/// Remove the directories in `parent` named `{prefix}{PID}{sep}…{suffix}` whose process PID
/// is gone (see [`remove_stale_partials`]).
fn remove_stale(parent: &Path, prefix: &str, sep: char, suffix: &str) {
    let proc_root = Path::new("/proc");
    if !proc_root.join("self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let fname = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = fname.strip_prefix(prefix) else {
            continue;
        };
        if !rest.ends_with(suffix) {
            continue;
        }
        let Some(pid) = rest.split(sep).next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !proc_root.join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A scratch directory in the system temp dir, `hf2coreml-KIND-PID-XXXXXX`, removed when
/// dropped and on SIGINT/SIGTERM/SIGHUP. Scratch directories of the same kind that a killed
/// process (SIGKILL) left behind are removed first: a GGUF import's is a whole checkpoint.
pub fn scratch_dir(kind: &str) -> std::io::Result<tempfile::TempDir> {
    let prefix = format!("hf2coreml-{kind}-");
    remove_stale(&std::env::temp_dir(), &prefix, '-', "");
    let dir = tempfile::Builder::new()
        .prefix(&format!("{prefix}{}-", std::process::id()))
        .tempdir()?;
    remove_on_interrupt(dir.path());
    Ok(dir)
}

fn parent_dir(p: &Path) -> &Path {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into())
}

/// Give the memory the allocator holds but no longer uses back to the system.
///
/// glibc keeps freed blocks below its (self-raising) mmap threshold in its heaps, one heap per
/// thread that allocated, and returns only the top of each. A stage that churns through
/// tensors of a few MiB (a forward pass over calibration text) leaves tens of MiB there that
/// the next stage, holding every palettized weight, would otherwise add to. Called between
/// stages; elsewhere it does nothing.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heaps; it is thread-safe and has no
    // preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
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
    fn scratch_dirs_of_dead_processes_are_removed() {
        // A kind of its own, so parallel tests and other runs never meet this one's dirs.
        let kind = format!("unittest{}", std::process::id());
        let tmp = std::env::temp_dir();
        // PIDs above the kernel's pid_max (4,194,304 at most) never exist; PID 1 always does.
        let dead = tmp.join(format!("hf2coreml-{kind}-4999999-abc"));
        let alive = tmp.join(format!("hf2coreml-{kind}-1-abc"));
        std::fs::create_dir_all(dead.join("model")).unwrap();
        std::fs::create_dir_all(&alive).unwrap();
        let scratch = scratch_dir(&kind).unwrap();
        let name = scratch
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(name.starts_with(&format!("hf2coreml-{kind}-{}-", std::process::id())));
        assert!(!dead.exists(), "a dead process's scratch dir survived");
        assert!(alive.exists(), "a live process's scratch dir was removed");
        // Our own scratch dir is never taken for stale.
        let again = scratch_dir(&kind).unwrap();
        assert!(scratch.path().exists());
        let (first, second) = (scratch.path().to_path_buf(), again.path().to_path_buf());
        drop(scratch);
        drop(again);
        assert!(!first.exists() && !second.exists());
        std::fs::remove_dir_all(&alive).unwrap();
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
        let a = AtomicDir::new(&dest, false).unwrap();
        assert!(!dead.exists() || !Path::new("/proc/self").exists());
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
