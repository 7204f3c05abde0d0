//! The test binaries are the ones Cargo.toml lists (`autotests = false`): tests/it and the few
//! tests that need a process of their own. A new tests/*.rs or tests/*/main.rs that is not
//! listed would never be built, so it fails here instead of passing unnoticed.

use std::collections::BTreeSet;
use std::path::Path;

#[test]
fn every_test_binary_is_listed_in_cargo_toml() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let listed: BTreeSet<String> = manifest["test"]
        .as_array()
        .expect("[[test]] entries")
        .iter()
        .map(|t| t["path"].as_str().unwrap().to_string())
        .collect();
    // What Cargo's automatic discovery would have built: tests/*.rs and tests/*/main.rs.
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(root.join("tests")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.extension().is_some_and(|e| e == "rs") {
            found.insert(format!("tests/{name}"));
        } else if path.join("main.rs").is_file() {
            found.insert(format!("tests/{name}/main.rs"));
        }
    }
    assert_eq!(
        found, listed,
        "tests/ against Cargo.toml's [[test]] entries"
    );
    assert!(listed.contains("tests/it/main.rs"));
}
