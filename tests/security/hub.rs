//! Broken Hub caches, through `inspect ORG/NAME`: a `refs/main` that is a FIFO, a device, a
//! directory, empty, a path or too long; snapshots and repositories that are symlink loops or
//! files; a cache with 30,000 snapshots. Each is exit 2 at once with a message naming the
//! path and what it is (never "no refs/main" or "absent" for a file that is there), of a few
//! lines however large the cache.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{expect_cli, mkfifo, Outcome, Scratch};
use crate::support::cli;

const COMMIT: &str = "3f2c1a0e9b8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b";
const ID: &str = "Org/Tiny";

/// `root/hub/models--Org--Tiny` with `refs/` and `snapshots/COMMIT/` (empty: these cases stop
/// before any file of the snapshot is read).
fn repo(root: &Path) -> PathBuf {
    let repo = root.join("hub").join("models--Org--Tiny");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots").join(COMMIT)).unwrap();
    repo
}

/// `inspect id` with `root/hub` as the only Hub cache: exit 2, every needle in stderr, within
/// seconds, and a message of bounded length.
fn refused(root: &Path, id: &str, needles: &[&str]) -> Outcome {
    let hub = root.join("hub");
    let command = cli(&["inspect", id])
        .env("HF_HUB_CACHE", &hub)
        .env("HOME", hub.join("no-home"))
        .env_remove("HF_HOME")
        .env_remove("XDG_CACHE_HOME");
    let o = expect_cli(root, command, &format!("inspect {id}"), 2, needles);
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);
    assert!(
        o.stderr.len() < 2048,
        "{} bytes:\n{}",
        o.stderr.len(),
        o.stderr
    );
    assert!(!o.stderr.contains("no refs/main"), "{}", o.stderr);
    o
}

#[test]
fn a_ref_that_is_no_regular_file_is_named_as_what_it_is() {
    let s = Scratch::new();
    let refs = repo(s.path()).join("refs");
    let main = refs.join("main");
    mkfifo(&main);
    refused(s.path(), ID, &["refs/main (a FIFO, not a regular file"]);
    std::fs::remove_file(&main).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &main).unwrap();
    refused(s.path(), ID, &["refs/main (a character device"]);
    std::fs::remove_file(&main).unwrap();
    std::fs::create_dir(&main).unwrap();
    refused(
        s.path(),
        ID,
        &["refs/main (a directory, not a regular file"],
    );
    std::fs::remove_dir(&main).unwrap();
    std::os::unix::fs::symlink("main", &main).unwrap();
    refused(s.path(), ID, &["refs/main (a symlink loop)"]);
    // A tag under refs/ whose folder is a file.
    std::fs::write(refs.join("tags"), b"").unwrap();
    refused(
        s.path(),
        "Org/Tiny@tags/v1",
        &["refs/tags/v1 (cannot be looked at"],
    );
}

#[test]
fn a_ref_holding_no_commit_says_what_it_holds() {
    let s = Scratch::new();
    let main = repo(s.path()).join("refs").join("main");
    for (content, says) in [
        ("", "refs/main (empty"),
        ("  \n", "refs/main (empty"),
        ("../../../../etc", "holds `../../../../etc`, a path"),
        ("..", "holds `..`, a path"),
        (&format!("snapshots/{COMMIT}"), "a path"),
        ("hello", "holds `hello`, not a commit (40 hex digits)"),
        (&COMMIT[..39], "not a commit"),
        ("\u{1b}[31mred", "holds `\\u{1b}[31mred`, not a commit"),
    ] {
        std::fs::write(&main, content).unwrap();
        let o = refused(s.path(), ID, &[says]);
        assert!(!o.stderr.contains('\u{1b}'), "{}", o.stderr);
    }
    std::fs::write(&main, "a".repeat(1 << 20)).unwrap();
    refused(s.path(), ID, &["refs/main", "exceeds the 256-byte limit"]);
    std::fs::write(&main, [0xff, 0xfe, 0x00]).unwrap();
    refused(s.path(), ID, &["refs/main", "not UTF-8"]);
}

#[test]
fn snapshots_and_repositories_that_are_no_directories() {
    let s = Scratch::new();
    let repo = repo(s.path());
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    let snap = repo.join("snapshots").join(COMMIT);
    std::fs::remove_dir(&snap).unwrap();
    std::os::unix::fs::symlink(COMMIT, &snap).unwrap();
    let loop_ = format!("{COMMIT} (a symlink loop)");
    refused(s.path(), ID, &[&loop_]);
    refused(s.path(), &format!("{ID}@{COMMIT}"), &[&loop_]);
    std::fs::remove_file(&snap).unwrap();
    std::fs::write(&snap, b"").unwrap();
    refused(
        s.path(),
        ID,
        &[&format!("{COMMIT} (a regular file, not a directory)")],
    );
    // A dangling link is a snapshot that never arrived: absent, as before.
    std::fs::remove_file(&snap).unwrap();
    std::os::unix::fs::symlink("../blobs/gone", &snap).unwrap();
    refused(s.path(), ID, &["the commit its ref names is absent"]);
    let snapshots = repo.join("snapshots");
    std::fs::remove_file(&snap).unwrap();
    std::fs::remove_dir(&snapshots).unwrap();
    mkfifo(&snapshots);
    refused(s.path(), ID, &["snapshots (a FIFO, not a directory)"]);
    std::fs::remove_file(&snapshots).unwrap();
    std::fs::remove_dir_all(&repo).unwrap();
    std::os::unix::fs::symlink("models--Org--Tiny", &repo).unwrap();
    refused(s.path(), ID, &["models--Org--Tiny (a symlink loop)"]);
}

#[test]
fn thirty_thousand_snapshots_make_a_message_of_a_few_lines() {
    let s = Scratch::new();
    let repo = repo(s.path());
    let snapshots = repo.join("snapshots");
    for i in 0..30_000u32 {
        std::fs::create_dir(snapshots.join(format!("{i:040x}"))).unwrap();
    }
    // No refs/v2: the snapshots are listed, the first five and a count.
    let o = refused(
        s.path(),
        "Org/Tiny@v2",
        &[
            "no refs/v2",
            &format!("snapshots: {:040x}, {:040x}", 0, 1),
            "and 29996 more",
            "name one with @COMMIT",
        ],
    );
    assert!(!o.stderr.contains(&format!("{:040x}", 5)), "{}", o.stderr);
}
