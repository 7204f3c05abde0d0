//! Cleanup when the process is interrupted: directories removed on SIGINT/SIGTERM/SIGHUP before
//! the process exits with 128 + the signal, and what runs killed outright (SIGKILL) left behind
//! removed by the next run. Scratch directories are registered here.

use std::path::{Path, PathBuf};

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

/// Held while outputs are renamed into place ([`commit_lock`]), and by the interrupt cleanup
/// from the signal until the process exits: a signal never lands between two renames of one
/// commit (a `--force` commit moves the old output aside, then the new one in: the cleanup
/// would otherwise remove the new one with the old one aside), and no commit starts once a
/// signal came.
static COMMITTING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The lock to hold while renaming finished outputs into place; an error once the process is
/// being interrupted (the output must not appear then).
pub fn commit_lock() -> std::io::Result<std::sync::MutexGuard<'static, ()>> {
    let guard = COMMITTING.lock().unwrap_or_else(|p| p.into_inner());
    if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "interrupted: the output was not put in place",
        ));
    }
    Ok(guard)
}

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

/// Remove this process's partial outputs `prefix*.partial` in `parent` on interruption, from
/// before the directory is created on.
pub(super) fn register_partials(parent: &Path, prefix: &str) {
    PARTIALS_ON_INTERRUPT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((parent.to_path_buf(), prefix.to_string()));
}

/// Delete `dir` (recursively) if the process gets SIGINT, SIGTERM or SIGHUP before
/// [`keep_on_interrupt`] is called for it; the process then exits with 128 + the signal.
/// Without this, Ctrl-C kills the process on the spot (the embedded Python installs no
/// handler) and leaves temp directories for the next run to clean. SIGKILL cannot be caught:
/// [`super::AtomicDir::new`] and [`scratch_dir`] remove what such runs leave.
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
/// (calibration, palettization) never checks: Ctrl-C would go unheard until the stage ends.
pub fn handle_interrupts() {
    #[cfg(unix)]
    signals::install();
}

/// While a [`CtrlC`] guard lives, SIGINT is counted here instead of ending the process.
static CATCH_CTRL_C: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// SIGINTs counted while caught, and how many of them were taken ([`take_ctrl_c`]).
static CTRL_C_PRESSES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static CTRL_C_TAKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Ctrl-C for an interactive session: while the guard lives, SIGINT does not end the process
/// but is counted, for the session to stop what it is doing ([`ctrl_c_pending`]); SIGTERM and
/// SIGHUP still end it with the usual cleanup.
#[derive(Debug)]
pub struct CtrlC(());

impl CtrlC {
    pub fn catch() -> Self {
        #[cfg(unix)]
        signals::install();
        take_ctrl_c();
        CATCH_CTRL_C.store(true, std::sync::atomic::Ordering::SeqCst);
        CtrlC(())
    }
}

impl Drop for CtrlC {
    fn drop(&mut self) {
        CATCH_CTRL_C.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether Ctrl-C was pressed (while caught) and not yet taken.
pub fn ctrl_c_pending() -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    CTRL_C_PRESSES.load(SeqCst) != CTRL_C_TAKEN.load(SeqCst)
}

/// Take the pending presses: how many there were.
pub fn take_ctrl_c() -> u64 {
    use std::sync::atomic::Ordering::SeqCst;
    let presses = CTRL_C_PRESSES.load(SeqCst);
    presses - CTRL_C_TAKEN.swap(presses, SeqCst)
}

/// The error [`CtrlCStdin`] reads end with when Ctrl-C is pressed.
#[derive(Debug, thiserror::Error)]
#[error("interrupted (Ctrl-C)")]
pub struct CtrlCPressed;

/// Whether `e` is a read that Ctrl-C ended.
pub fn is_ctrl_c(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<CtrlCPressed>())
}

/// Standard input read so that a Ctrl-C caught by [`CtrlC`] ends a read that is waiting for
/// input: `read` waits in poll(2) for input or a press, and a press is an error
/// ([`is_ctrl_c`]; not `Interrupted`, which readers retry). Unbuffered: wrap it in a
/// `BufReader`, and read stdin through nothing else meanwhile.
#[derive(Debug, Default)]
pub struct CtrlCStdin;

impl std::io::Read for CtrlCStdin {
    #[cfg(unix)]
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if ctrl_c_pending() {
                return Err(std::io::Error::other(CtrlCPressed));
            }
            let mut fd = libc::pollfd {
                fd: libc::STDIN_FILENO,
                events: libc::POLLIN,
                revents: 0,
            };
            // A press lands as EINTR, or within the 100 ms the wait is cut into.
            // SAFETY: one pollfd, valid for the call.
            let ready = unsafe { libc::poll(&mut fd, 1, 100) };
            if ready == 0
                || (ready < 0
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR))
            {
                continue;
            }
            if ready < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: reading at most buf.len() bytes into buf.
            let n = unsafe { libc::read(libc::STDIN_FILENO, buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }

    #[cfg(not(unix))]
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::io::stdin().read(buf)
    }
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
                    loop {
                        // SAFETY: reading one byte into a live stack variable from our pipe.
                        let n = unsafe { libc::read(read_fd, (&mut b as *mut u8).cast(), 1) };
                        if n != 1 {
                            return;
                        }
                        let caught = b as libc::c_int == libc::SIGINT
                            && super::CATCH_CTRL_C.load(Ordering::SeqCst);
                        if !caught {
                            break;
                        }
                        super::CTRL_C_PRESSES.fetch_add(1, Ordering::SeqCst);
                    }
                    super::INTERRUPTED.store(true, Ordering::SeqCst);
                    // Wait for a commit under way to finish, and keep any other from starting
                    // until the process is gone.
                    let _commits = super::COMMITTING.lock().unwrap_or_else(|p| p.into_inner());
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
                            // A partial file (a staged sidecar) or a directory.
                            let _ = match d.symlink_metadata() {
                                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&d),
                                _ => std::fs::remove_file(&d),
                            };
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
pub(super) fn remove_stale_partials(parent: &Path, name: &str) {
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
            // A file too: `check_writable`'s probe (PID 0) outlives a run killed while it
            // exists.
            let path = e.path();
            let _ = match path.symlink_metadata() {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
                _ => std::fs::remove_file(&path),
            };
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
