//! Progress on a terminal, through a pseudo-terminal: during calibration
//! the "calibrate" bar advances block by block, shows the elapsed time and an ETA, and ends at
//! 100%; the "palettize" bar ends at 100%; `-v` logs each calibrated block. `palettize` and
//! `convert` draw the same stages (one library `Progress`); `validate` counts the tokens it
//! scores.

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::Stdio;

use hf2coreml_testkit::TinyModel;

use crate::support::{cli, needs};

const BLOCKS: usize = 6;

/// Run the binary with stderr on a pseudo-terminal (120 × 40); returns what the terminal
/// received and whether the command succeeded.
fn on_terminal(args: &[&str], dir: &Path) -> (String, bool) {
    on_terminal_with(args, dir, &[])
}

fn on_terminal_with(args: &[&str], dir: &Path, env: &[(&str, &Path)]) -> (String, bool) {
    let (mut master, mut slave) = (0, 0);
    let size = libc::winsize {
        ws_row: 40,
        ws_col: 120,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two descriptors we then own; the name and termios are not asked.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    assert_eq!(rc, 0, "openpty failed");
    // Close-on-exec at once: the reader below ends when the last copy of the slave closes, and
    // other tests of this binary spawn children all the time; a copy inherited by one of them
    // would hold this terminal open until that child exits. (Our own child gets the slave as
    // its stderr, a duplicate that exec keeps.)
    for fd in [master, slave] {
        // SAFETY: fcntl on descriptors we own.
        assert_eq!(
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) },
            0
        );
    }
    // SAFETY: both descriptors were just opened and are owned nowhere else.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    // The shared environment has neither CI nor NO_COLOR: the terminal alone decides.
    let mut run = cli(args).current_dir(dir).env("TERM", "xterm").python();
    for (key, value) in env {
        run = run.env(key, value);
    }
    let mut child = run
        .command()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(slave))
        .spawn()
        .unwrap();
    let reader = std::thread::spawn(move || {
        let mut file = std::fs::File::from(master);
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // Linux answers EIO once the last slave descriptor is closed: the end.
        while let Ok(n) = file.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        out
    });
    let ok = child.wait().unwrap().success();
    let out = reader.join().unwrap();
    (String::from_utf8_lossy(&out).into_owned(), ok)
}

/// The text without ANSI escape sequences, cut into the states drawn (at `\r` and newlines).
fn frames(raw: &str) -> Vec<String> {
    let mut plain = String::new();
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // Parameters, then one final byte in @..~.
                for d in chars.by_ref() {
                    if ('@'..='~').contains(&d) {
                        break;
                    }
                }
            }
            continue;
        }
        plain.push(c);
    }
    plain
        .split(['\r', '\n'])
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The positions a stage's bar showed, in order ("calibrate [==>  ] 3/6 ...").
fn positions(frames: &[String], stage: &str) -> Vec<(usize, usize)> {
    frames
        .iter()
        .filter(|f| f.starts_with(&format!("{stage} [")))
        .filter_map(|f| {
            let after = f.split(']').nth(1)?.trim();
            let (k, n) = after.split(' ').next()?.split_once('/')?;
            Some((k.parse().ok()?, n.parse().ok()?))
        })
        .collect()
}

fn model() -> tempfile::TempDir {
    TinyModel {
        layers: BLOCKS,
        vocab: 258,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap()
}

fn check_stages(raw: &str) {
    let f = frames(raw);
    // convert's range measurement is a one-step stage also labelled "calibrate": the
    // blocks' stage is the one of BLOCKS steps.
    let cal: Vec<(usize, usize)> = positions(&f, "calibrate")
        .into_iter()
        .filter(|&(_, n)| n == BLOCKS)
        .collect();
    assert!(
        !cal.is_empty(),
        "no calibrate bar of {BLOCKS} blocks: {f:#?}"
    );
    // Every block drawn, in order, from the first to the last: the bar moves and ends at 100%.
    // (0/N shows only if the ticker draws before the first block is done.)
    let mut seen: Vec<usize> = cal.iter().map(|&(k, _)| k).filter(|&k| k > 0).collect();
    seen.dedup();
    assert_eq!(
        seen,
        (1..=BLOCKS).collect::<Vec<_>>(),
        "calibrate bar positions {cal:?}\n{f:#?}"
    );
    let last = f
        .iter()
        .rfind(|s| s.starts_with("calibrate [") && s.contains(&format!("/{BLOCKS} ")))
        .unwrap();
    assert!(last.contains("(eta "), "{last}");
    assert!(last.contains("s (eta"), "elapsed time shown: {last}");
    let pal = positions(&f, "palettize");
    let &(k, n) = pal.last().expect("a palettize bar");
    assert_eq!(k, n, "{pal:?}");
    assert!(n > 0);
}

#[test]
fn palettize_draws_calibration_block_by_block_to_100_percent() {
    needs!(Python);
    let src = model();
    let (raw, ok) = on_terminal(
        &["palettize", src.path().to_str().unwrap(), "-v"],
        src.path(),
    );
    assert!(ok, "{raw}");
    check_stages(&raw);
    // -v: one line per block between "calibrating on" and the report.
    let f = frames(&raw);
    let logged: Vec<&String> = f
        .iter()
        .filter(|s| s.starts_with("calibrated block"))
        .collect();
    assert_eq!(logged.len(), BLOCKS, "{f:#?}");
    assert!(logged[BLOCKS - 1].starts_with(&format!("calibrated block {BLOCKS}/{BLOCKS} (")));
}

#[test]
fn convert_draws_calibration_block_by_block_to_100_percent() {
    needs!(Python);
    let src = model();
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("m.mlpackage");
    let (raw, ok) = on_terminal(
        &[
            "convert",
            src.path().to_str().unwrap(),
            "-o",
            pkg.to_str().unwrap(),
            "--max-seq-len",
            "32",
        ],
        out.path(),
    );
    assert!(ok, "{raw}");
    check_stages(&raw);
    let f = frames(&raw);
    let ser = positions(&f, "serialize");
    assert_eq!(ser.last(), Some(&(1, 1)), "{f:#?}");

    // validate: the tokens scored, one by one (Q = 1), to all of them.
    let (raw, _) = on_terminal(
        &[
            "validate",
            pkg.to_str().unwrap(),
            "--against",
            src.path().to_str().unwrap(),
            "--max-tokens",
            "24",
        ],
        out.path(),
    );
    let f = frames(&raw);
    let mut score: Vec<usize> = positions(&f, "score").iter().map(|p| p.0).collect();
    score.dedup();
    assert_eq!(score.last(), Some(&24), "{f:#?}");
    assert!(score.len() > 12, "the bar moves token by token: {score:?}");
    assert_eq!(positions(&f, "reference").last(), Some(&(1, 1)), "{f:#?}");
}

#[test]
fn a_gguf_import_bar_finishes_whether_imported_or_cached() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("tiny.gguf");
    hf2coreml_testkit::gguf::TinyGguf::llama()
        .build()
        .writer
        .write(&src)
        .unwrap();
    let cache = root.path().join("cache");
    let convert = |name: &str| {
        let pkg = root.path().join(name);
        let args = [
            "convert",
            src.to_str().unwrap(),
            "-o",
            pkg.to_str().unwrap(),
            "--max-seq-len",
            "16",
            "--keep-fp16",
            "*",
        ];
        let (raw, ok) = on_terminal_with(&args, root.path(), &[("HF2COREML_CACHE", &cache)]);
        assert!(ok, "{raw}");
        frames(&raw)
    };
    // First: the per-tensor import stage, to 100%.
    let f = convert("a.mlpackage");
    let &(k, n) = positions(&f, "importing").last().expect("an importing bar");
    assert!(k == n && n > 1, "{f:#?}");
    // Then from the cache: the one-step stage, to 100%.
    let f = convert("b.mlpackage");
    assert!(positions(&f, "importing").is_empty(), "{f:#?}");
    assert_eq!(positions(&f, "import").last(), Some(&(1, 1)), "{f:#?}");
}
