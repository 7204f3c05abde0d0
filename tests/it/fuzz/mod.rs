//! Every input that ever crashed a fuzz target (tests/fuzz/TARGET/*, copied from
//! fuzz/artifacts/ by whoever fixed the crash), replayed through the same function the target
//! runs (hf2coreml_testkit::fuzz), plus the seed corpora. Returning is the property for the
//! crash inputs (a panic here is a reader bug that came back); every seed is a valid input and
//! must be accepted all the way, so a reader that refused everything would fail here.

use std::path::{Path, PathBuf};

use hf2coreml_testkit::fuzz;

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

/// A short mutation campaign on stable Rust, in `make test`'s budget (the long one is `make
/// fuzz`, with cargo-fuzz's coverage guidance): every seed, mutated the ways that break
/// readers (a flipped bit, a byte set to an extreme, a cut, a repeated or inserted run, a
/// little-endian length overwritten with a huge one), replayed through its target. A panic is
/// a failure; refusing the input is what most mutations should get.
#[test]
fn a_short_mutation_campaign_panics_nowhere() {
    const PER_SEED: usize = 2000;
    let seeds = tempfile::tempdir().unwrap();
    fuzz::write_seeds(seeds.path()).unwrap();
    let mut rng = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move |n: usize| {
        // xorshift64*: a fixed sequence, so a failure replays.
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        (rng.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1) as u64) as usize
    };
    let started = std::time::Instant::now();
    let (mut runs, mut accepted) = (0, 0);
    for target in TARGETS {
        let scratch = tempfile::tempdir().unwrap();
        for file in inputs(&seeds.path().join(target)) {
            let seed = std::fs::read(&file).unwrap();
            for _ in 0..PER_SEED {
                let mut data = seed.clone();
                let at = next(data.len());
                match next(6) {
                    0 if !data.is_empty() => data[at] ^= 1 << next(8),
                    1 if !data.is_empty() => data[at] = [0, 0xFF, 0x7F, 0x80][next(4)],
                    2 => data.truncate(at),
                    3 => {
                        let len = next(64).min(data.len() - at);
                        let run = data[at..at + len].to_vec();
                        data.splice(
                            at..at,
                            run.iter().cycle().take(len * (1 + next(4))).copied(),
                        );
                    }
                    4 => {
                        let len = 1 + next(16);
                        data.splice(at..at, (0..len).map(|_| next(256) as u8));
                    }
                    _ if data.len() >= at + 8 => {
                        let huge = [u64::MAX, 1 << 40, u32::MAX as u64, 1 << 31][next(4)];
                        data[at..at + 8].copy_from_slice(&huge.to_le_bytes());
                    }
                    _ => data.push(next(256) as u8),
                }
                let ok = std::panic::catch_unwind(|| replay(target, &data, scratch.path()));
                match ok {
                    Ok(a) => accepted += usize::from(a),
                    Err(_) => {
                        let out = std::env::temp_dir().join(format!("fuzz-{target}-{runs}"));
                        std::fs::write(&out, &data).unwrap();
                        panic!(
                            "{target}: a mutation of {} panicked; input saved to {}",
                            file.display(),
                            out.display()
                        );
                    }
                }
                runs += 1;
            }
        }
    }
    eprintln!(
        "{runs} mutated inputs in {:.1} s, {accepted} accepted",
        started.elapsed().as_secs_f64()
    );
    assert!(runs >= 11 * PER_SEED);
}
