//! Every input that ever crashed a fuzz target (tests/fuzz/TARGET/*, copied from
//! fuzz/artifacts/ by whoever fixed the crash), replayed through the same function the target
//! runs (hf2coreml::testing::fuzz), plus the seed corpora. Returning is the property: a panic here is
//! a reader bug that came back.

use std::path::{Path, PathBuf};

use hf2coreml::testing::fuzz;

const TARGETS: [&str; 3] = ["checkpoint", "gguf", "mlpackage"];

fn replay(target: &str, data: &[u8], scratch: &Path) {
    match target {
        "checkpoint" => fuzz::checkpoint(data, scratch),
        "gguf" => fuzz::gguf(data),
        "mlpackage" => fuzz::mlpackage(data, scratch),
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
fn crash_inputs_and_seeds_are_handled() {
    let seeds = tempfile::tempdir().unwrap();
    fuzz::write_seeds(seeds.path()).unwrap();
    let regressions = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz");
    let mut replayed = 0;
    for target in TARGETS {
        let scratch = tempfile::tempdir().unwrap();
        for file in inputs(&regressions.join(target))
            .into_iter()
            .chain(inputs(&seeds.path().join(target)))
        {
            let data = std::fs::read(&file).unwrap();
            eprintln!("{target}: {}", file.display());
            replay(target, &data, scratch.path());
            replayed += 1;
        }
    }
    assert!(replayed >= 8, "only {replayed} inputs replayed");
}
