//! Killing `convert` part-way (SIGINT, SIGKILL) at several points of a run: the destination is
//! either untouched or, if the run had already finished, complete; SIGINT leaves nothing
//! behind, SIGKILL only hidden temp directories that are never named like a package; a rerun
//! succeeds and clears the stale ones.
#![cfg(unix)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hf2coreml::mlpackage::MlPackage;
use hf2coreml::runtime::interp::{Options, Program};
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs};

fn convert_cmd(ckpt: &Path, dest: &Path) -> Command {
    let mut c = convert(ckpt, dest)
        .args([
            "--max-seq-len",
            "16",
            "--recipe",
            "data-free-4bit",
            "--force",
        ])
        .command();
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    hf2coreml_testkit::files_under(dir).unwrap()
}

/// The package opens and its program compiles (every weight decoded).
fn assert_complete_package(pkg: &Path) {
    let p = MlPackage::open(pkg).unwrap_or_else(|e| panic!("{}: {e}", pkg.display()));
    Program::load(&p, Options::default()).unwrap();
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Names in `dir` other than the package and its sidecars: what killed runs left behind.
fn leftovers(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with("m."))
        .collect();
    v.sort();
    v
}

/// When to send the signal.
#[derive(Debug, Clone, Copy)]
enum Point {
    /// This long after the start (reading, calibrating, palettizing, importing Python).
    After(Duration),
    /// This long after the hidden temp package directory appeared (Python is importing
    /// coremltools, building the program or saving it).
    PartialFor(Duration),
}

fn partials(out: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(out)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.to_string_lossy().ends_with(".partial"))
                .collect()
        })
        .unwrap_or_default()
}

/// Start a conversion and signal it at `point`. Returns whether it was killed (false: it
/// finished before the point was reached). A run stopped by SIGINT must exit with 130.
fn convert_and_kill(ckpt: &Path, dest: &Path, point: Point, sig: &str) -> bool {
    let out = dest.parent().unwrap();
    let before = partials(out);
    let mut child = convert_cmd(ckpt, dest).spawn().unwrap();
    let start = Instant::now();
    let mut partial_seen: Option<Instant> = None;
    let mut reached = |out: &Path| match point {
        Point::After(d) => start.elapsed() >= d,
        Point::PartialFor(d) => {
            if partial_seen.is_none() && partials(out).iter().any(|p| !before.contains(p)) {
                partial_seen = Some(Instant::now());
            }
            partial_seen.is_some_and(|t| t.elapsed() >= d)
        }
    };
    let deadline = start + Duration::from_secs(120);
    loop {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        if reached(out) {
            break;
        }
        assert!(Instant::now() < deadline, "{point:?} never reached");
        std::thread::sleep(Duration::from_millis(2));
    }
    signal(&child, sig);
    let status = child.wait().unwrap();
    if sig == "-INT" {
        // SIGINT is caught: the run removes its own temp directory before exiting.
        let fresh: Vec<PathBuf> = partials(out)
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect();
        assert!(fresh.is_empty(), "SIGINT at {point:?} left {fresh:?}");
        if !status.success() {
            assert_eq!(status.code(), Some(130), "SIGINT at {point:?}: {status:?}");
        }
    }
    !status.success()
}

#[test]
fn killed_conversions_leave_the_destination_untouched_and_a_rerun_succeeds() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let ckpt = root.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    TinyModel::llama().write(&ckpt).unwrap();
    let out = root.path().join("out");
    let dest = out.join("m.mlpackage");

    // A first run killed while building: no destination appears.
    if convert_and_kill(&ckpt, &dest, Point::PartialFor(Duration::ZERO), "-INT") {
        assert!(!dest.exists(), "a killed first run left {}", dest.display());
    }

    let o = convert_cmd(&ckpt, &dest).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_complete_package(&dest);
    // A clean build made in this test (packages embed the conversion date): every run that
    // completes below must produce exactly these bytes.
    let clean = tree(&dest);
    assert!(!clean.is_empty());
    // The "old" output a killed run must not damage: the package plus a marker file.
    std::fs::write(dest.join("OLD"), "from an earlier run").unwrap();
    let mut old = tree(&dest);

    let (mut killed, mut interrupted) = (0, 0);
    let points = [
        (Point::After(Duration::from_millis(30)), "-KILL"),
        (Point::After(Duration::from_millis(400)), "-INT"),
        (Point::PartialFor(Duration::ZERO), "-KILL"),
        (Point::PartialFor(Duration::from_millis(500)), "-INT"),
        (Point::PartialFor(Duration::from_millis(900)), "-KILL"),
    ];
    for (point, sig) in points {
        let was_killed = convert_and_kill(&ckpt, &dest, point, sig);
        eprintln!("{sig} at {point:?}: killed {was_killed}");
        if was_killed {
            killed += 1;
            interrupted += usize::from(sig == "-INT");
            let now = tree(&dest);
            if now == clean {
                // The signal came after the new package was renamed into place (the commit
                // is atomic: the interrupt waits for it): the whole new package, never part.
                std::fs::write(dest.join("OLD"), "from an earlier run").unwrap();
                old = tree(&dest);
            } else {
                let changed: Vec<&PathBuf> = now
                    .keys()
                    .chain(old.keys())
                    .filter(|k| now.get(*k) != old.get(*k))
                    .collect();
                assert!(
                    changed.is_empty(),
                    "{sig} at {point:?} changed the destination: {changed:?}"
                );
            }
        } else {
            // The run won the race: the destination is the new package, byte for byte the
            // clean build.
            assert!(!dest.join("OLD").exists());
            assert_complete_package(&dest);
            assert!(
                tree(&dest) == clean,
                "a completed run differs from the clean build"
            );
            std::fs::write(dest.join("OLD"), "from an earlier run").unwrap();
            old = tree(&dest);
        }
        // Whatever a killed run left is hidden and never named like a package.
        for name in leftovers(&out) {
            assert!(
                name.starts_with(".m.") && !name.ends_with(".mlpackage"),
                "unexpected {name} in {}",
                out.display()
            );
        }
    }
    // On a quiet machine a tiny conversion's emit stage is shorter than the later points, so
    // those runs may finish first (and are then checked as complete packages above). The
    // first points land inside every run: 30 ms after the start, and the moment the partial
    // directory appears.
    assert!(
        killed >= 2,
        "only {killed} of 5 runs were killed before finishing"
    );
    // SIGINT really reached a run (the SIGKILLs alone would satisfy the count above): 400 ms
    // after the start lands before Python is imported on any machine.
    assert!(interrupted >= 1, "no SIGINT landed inside a run");

    // A rerun succeeds, replaces the old package and clears the killed runs' temp directories.
    let o = convert_cmd(&ckpt, &dest).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!dest.join("OLD").exists());
    assert_complete_package(&dest);
    assert!(
        tree(&dest) == clean,
        "the rerun differs from the clean build"
    );
    let left = partials(&out);
    assert!(left.is_empty(), "stale temp directories remain: {left:?}");
}

/// Ctrl-C while the default (calibrated) recipe is calibrating: the run stops within a second,
/// exits 130 and leaves nothing behind (Python's own handler would swallow it until
/// coremltools ran, a minute later).
#[test]
fn sigint_during_calibration_stops_the_run_within_a_second() {
    needs!(Python);
    let root = tempfile::tempdir().unwrap();
    let ckpt = root.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    // Wide enough that calibration takes seconds, not milliseconds.
    TinyModel {
        layers: 8,
        hidden: 256,
        intermediate: 768,
        heads: 4,
        kv_heads: 2,
        vocab: 512,
        ..TinyModel::llama()
    }
    .write(&ckpt)
    .unwrap();
    let out = root.path().join("out");
    let dest = out.join("m.mlpackage");
    let log = root.path().join("stderr");
    let mut cmd = convert(&ckpt, &dest)
        .args(["--max-seq-len", "16", "--recipe", "default", "--verbose"])
        .command();
    cmd.stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("calibrating on") {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "finished before calibrating:\n{text}"
        );
        assert!(
            Instant::now() < deadline,
            "calibration never started:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Well inside the stage.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        child.try_wait().unwrap().is_none(),
        "finished during the wait"
    );
    signal(&child, "-INT");
    let sent = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "SIGINT ignored for 10 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = sent.elapsed();
    assert_eq!(
        status.code(),
        Some(130),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    // One second, plus slack for a machine shared with parallel builds.
    assert!(took < Duration::from_millis(1500), "stopped after {took:?}");
    assert!(!dest.exists());
    let left: Vec<_> = std::fs::read_dir(&out)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}
