//! Every input that ever crashed a fuzz target (tests/fuzz/TARGET/*, copied from
//! fuzz/artifacts/ by whoever fixed the crash), replayed through the same function the target
//! runs (hf2coreml::testing::fuzz), plus the seed corpora. Returning is the property for the
//! crash inputs (a panic here is a reader bug that came back); every seed is a valid input and
//! must be accepted all the way, so a reader that refused everything would fail here.

use std::path::{Path, PathBuf};

use hf2coreml::testing::fuzz;

const TARGETS: [&str; 5] = ["checkpoint", "gguf", "mlpackage", "interp", "batch"];

/// Whether the target accepted `data` all the way.
fn replay(target: &str, data: &[u8], scratch: &Path) -> bool {
    match target {
        "checkpoint" => fuzz::checkpoint(data, scratch),
        "gguf" => fuzz::gguf(data),
        "mlpackage" => fuzz::mlpackage(data, scratch),
        "interp" => fuzz::interp(data, scratch),
        "batch" => fuzz::batch(data),
        other => panic!("unknown fuzz target {other}"),
    }
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn crash_inputs_are_handled() {
    let regressions = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz");
    let mut replayed = 0;
    for target in TARGETS {
        let scratch = tempfile::tempdir().unwrap();
        for file in inputs(&regressions.join(target)) {
            let data = std::fs::read(&file).unwrap();
            eprintln!(
                "{target}: {} -> accepted {}",
                file.display(),
                replay(target, &data, scratch.path())
            );
            replayed += 1;
        }
    }
    // tests/fuzz/ holds at least the README there and one input per target that ever crashed.
    assert!(regressions.join("README.md").is_file());
    eprintln!("{replayed} crash inputs replayed");
}

#[test]
fn every_seed_is_accepted_by_its_target() {
    let seeds = tempfile::tempdir().unwrap();
    let n = fuzz::write_seeds(seeds.path()).unwrap();
    let mut replayed = 0;
    for target in TARGETS {
        let scratch = tempfile::tempdir().unwrap();
        for file in inputs(&seeds.path().join(target)) {
            let data = std::fs::read(&file).unwrap();
            assert!(
                replay(target, &data, scratch.path()),
                "{target}: valid seed {} refused",
                file.display()
            );
            replayed += 1;
        }
    }
    assert_eq!(replayed, n);
    assert!(replayed >= 11, "only {replayed} seeds");
}
