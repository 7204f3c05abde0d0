//! The crates of the workspace and what each may depend on (docs/architecture.md, "Crates"):
//! the library never reaches for the command line's crates or the test kit, the test kit serves
//! only tests and tools, and the development tools stay out of what `cargo test` builds.

use std::path::Path;

fn manifest(rel: &str) -> toml::Table {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .parse()
        .unwrap()
}

fn names(table: &toml::Table, section: &str) -> Vec<String> {
    table
        .get(section)
        .and_then(|d| d.as_table())
        .map(|d| d.keys().cloned().collect())
        .unwrap_or_default()
}

#[test]
fn the_library_depends_on_no_command_line_crate() {
    let lib = manifest("crates/hf2coreml/Cargo.toml");
    let deps = names(&lib, "dependencies");
    for cli_only in [
        "anyhow",
        "clap",
        "clap_complete",
        "clap_mangen",
        "indicatif",
    ] {
        assert!(
            !deps.iter().any(|d| d == cli_only),
            "the library depends on {cli_only}, which only the binary may use"
        );
    }
    // Its unit tests compile beside it only while nothing it depends on for tests depends on
    // it (a dev-dependency on itself would make them wait for the whole library).
    let dev = names(&lib, "dev-dependencies");
    assert!(!dev.iter().any(|d| d.starts_with("hf2coreml")), "{dev:?}");
}

#[test]
fn the_numerics_depend_on_no_crate_of_the_workspace() {
    let numerics = manifest("crates/numerics/Cargo.toml");
    for section in ["dependencies", "dev-dependencies"] {
        let deps = names(&numerics, section);
        assert!(!deps.iter().any(|d| d.starts_with("hf2coreml")), "{deps:?}");
    }
    let lib = names(&manifest("crates/hf2coreml/Cargo.toml"), "dependencies");
    assert!(lib.iter().any(|d| d == "hf2coreml-numerics"), "{lib:?}");
}

/// The format crate is the bottom of ours and the interpreter sits on it and the numerics
/// alone: neither can reach the library, Python or the builders.
#[test]
fn the_format_and_the_interpreter_sit_below_the_library() {
    let ours = |rel: &str, section: &str| -> Vec<String> {
        names(&manifest(rel), section)
            .into_iter()
            .filter(|d| d.starts_with("hf2coreml"))
            .collect()
    };
    for section in ["dependencies", "dev-dependencies"] {
        assert!(ours("crates/format/Cargo.toml", section).is_empty());
        for dep in ours("crates/interp/Cargo.toml", section) {
            assert!(
                ["hf2coreml-format", "hf2coreml-numerics"].contains(&dep.as_str()),
                "the interpreter depends on {dep}"
            );
        }
    }
    let lib = ours("crates/hf2coreml/Cargo.toml", "dependencies");
    for dep in ["hf2coreml-format", "hf2coreml-interp"] {
        assert!(lib.iter().any(|d| d == dep), "{lib:?}");
    }
    for krate in ["crates/format/Cargo.toml", "crates/interp/Cargo.toml"] {
        let deps = names(&manifest(krate), "dependencies");
        for heavy in ["pyo3", "candle-core", "tokenizers"] {
            assert!(
                !deps.iter().any(|d| d == heavy),
                "{krate} depends on {heavy}"
            );
        }
    }
}

#[test]
fn cargo_test_builds_the_library_and_the_command_line_not_the_tools() {
    let root = manifest("Cargo.toml");
    let ws = root["workspace"].as_table().unwrap();
    let list = |key: &str| -> Vec<&str> {
        ws[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap())
            .collect()
    };
    assert_eq!(
        list("members"),
        [
            ".",
            "crates/format",
            "crates/hf2coreml",
            "crates/interp",
            "crates/numerics",
            "crates/testkit",
            "tools"
        ]
    );
    assert_eq!(
        list("default-members"),
        [
            ".",
            "crates/format",
            "crates/hf2coreml",
            "crates/interp",
            "crates/numerics",
            "crates/testkit"
        ]
    );
    let cli = names(&root, "dependencies");
    assert!(cli.iter().any(|d| d == "hf2coreml"), "{cli:?}");
    let tools = names(&manifest("tools/Cargo.toml"), "dependencies");
    assert!(tools.iter().any(|d| d == "hf2coreml"), "{tools:?}");
}

#[test]
fn the_test_kit_serves_tests_and_tools_only() {
    let kit = manifest("crates/testkit/Cargo.toml");
    let deps = names(&kit, "dependencies");
    assert!(deps.iter().any(|d| d == "hf2coreml"), "{deps:?}");
    assert!(
        !deps.iter().any(|d| d.starts_with("hf2coreml-")),
        "the test kit builds on the library alone: {deps:?}"
    );
    for (manifest_path, section) in [
        ("Cargo.toml", "dependencies"),
        ("crates/hf2coreml/Cargo.toml", "dependencies"),
        ("crates/numerics/Cargo.toml", "dependencies"),
        ("crates/format/Cargo.toml", "dependencies"),
        ("crates/interp/Cargo.toml", "dependencies"),
    ] {
        let deps = names(&manifest(manifest_path), section);
        assert!(
            !deps.iter().any(|d| d == "hf2coreml-testkit"),
            "{manifest_path} [{section}] depends on the test kit"
        );
    }
    let dev = names(&manifest("Cargo.toml"), "dev-dependencies");
    assert!(dev.iter().any(|d| d == "hf2coreml-testkit"), "{dev:?}");
}
