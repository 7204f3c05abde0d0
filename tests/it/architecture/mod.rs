//! The layout is the architecture: `docs/architecture.md` lists, for every top-level module of
//! the library (`crates/hf2coreml/src/`) and of the binary (`src/`), the modules it may import.
//! This test reads that table and the sources, and fails on any import the table does not allow
//! (code inside `#[cfg(test)]` excepted), on a module the table does not know, on a crate that
//! depends on what it should not, and on a function longer than 150 lines.

mod crates;
mod file_cycles;
mod test_targets;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const FOUNDATIONS: [&str; 4] = ["error", "fsutil", "progress", "util"];
const BINARY: [&str; 4] = ["main", "cli", "commands", "printer"];
/// The longest function the sources may hold.
const MAX_FN_LINES: usize = 150;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The crates whose modules docs/architecture.md's tables list, each by the folder of its
/// `lib.rs` (the binary's `src/` last).
const TABLED: [&str; 4] = [
    "crates/format/src",
    "crates/interp/src",
    "crates/hf2coreml/src",
    "src",
];

/// Every Rust file of the tabled crates, each with the folder its module names are relative to.
fn sources() -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for dir in TABLED.map(|d| root().join(d)) {
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        out.extend(files.into_iter().map(|f| (dir.clone(), f)));
    }
    out
}

/// Module → the modules it may import, from the tables of docs/architecture.md. For binary
/// modules, "the library" is implied: they reach it through `hf2coreml::`, which is not checked.
fn allowed() -> BTreeMap<String, BTreeSet<String>> {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let mut out = BTreeMap::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | `module` | owns | may import |
        if cells.len() != 5 || !cells[1].starts_with('`') {
            continue;
        }
        let module = cells[1].trim_matches('`').to_string();
        let mut may = BTreeSet::new();
        for item in cells[3].split(',').map(str::trim) {
            if item == "foundations" {
                may.extend(FOUNDATIONS.iter().map(|s| s.to_string()));
            } else if item.starts_with('`') {
                may.insert(item.trim_matches('`').to_string());
            }
        }
        out.insert(module, may);
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's code without its `#[cfg(test)]` module (by convention the file's tail) and
/// without comments.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Top-level module of a file under src/ (`graph/decoder/mod.rs` → `graph`).
fn module_of(src: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Every `crate::NAME` in `code`.
fn crate_refs(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `hf2coreml_crate::`, not ours
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // `crate::VERSION` and other items of the crate root are not modules.
        if name.starts_with(|c: char| c.is_ascii_lowercase()) {
            out.insert(name);
        }
    }
    out
}

#[test]
fn modules_import_only_what_docs_architecture_allows() {
    let allowed = allowed();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for (src, path) in &sources() {
        let module = module_of(src, path);
        if module == "lib" {
            continue;
        }
        seen.insert(module.clone());
        let Some(may) = allowed.get(&module) else {
            problems.push(format!(
                "{}: module `{module}` is not in docs/architecture.md",
                path.display()
            ));
            continue;
        };
        let is_bin = BINARY.contains(&module.as_str());
        for name in crate_refs(&code(path)) {
            if name == module {
                continue;
            }
            // In the binary, `crate::` is the binary: `crate::exit_code_for` is main's.
            let target = if is_bin && !BINARY.contains(&name.as_str()) {
                "main".to_string()
            } else {
                name
            };
            if target != module && !may.contains(&target) {
                problems.push(format!(
                    "{}: `{module}` imports `{target}`, which docs/architecture.md does not allow",
                    path.display()
                ));
            }
        }
    }
    for module in allowed.keys() {
        if !seen.contains(module) {
            problems.push(format!(
                "docs/architecture.md lists `{module}`, which the sources do not have"
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

/// The modules a crate's `lib.rs` declares, in order: `mod NAME;` (public or not), and the
/// modules it takes from another crate of ours (`pub use hf2coreml_format::mil;`, `use
/// hf2coreml_format::{error, mil};`), which count as declared where the `use` stands.
fn declared_order(lib_rs: &Path) -> Vec<String> {
    let lib = std::fs::read_to_string(lib_rs).unwrap();
    let mut out = Vec::new();
    for line in lib.lines().map(str::trim) {
        let line = line.strip_prefix("pub ").unwrap_or(line);
        if let Some(m) = line.strip_prefix("mod ") {
            out.push(m.trim_end_matches(';').to_string());
        } else if let Some(rest) = line.strip_prefix("use hf2coreml_") {
            let Some((_, names)) = rest.split_once("::") else {
                continue;
            };
            let names = names
                .trim_end_matches(';')
                .trim_matches(|c| c == '{' || c == '}');
            out.extend(names.split(',').map(|n| n.trim().to_string()));
        }
    }
    out
}

#[test]
fn each_lib_rs_declares_every_module_after_what_it_may_import() {
    let allowed = allowed();
    let mut problems = Vec::new();
    for dir in &TABLED[..3] {
        let lib_rs = root().join(dir).join("lib.rs");
        let order = declared_order(&lib_rs);
        let place = |m: &str| order.iter().position(|o| o == m);
        for (i, module) in order.iter().enumerate() {
            let Some(may) = allowed.get(module) else {
                problems.push(format!(
                    "{dir}/lib.rs declares `{module}`, which the tables lack"
                ));
                continue;
            };
            for import in may {
                match place(import) {
                    Some(j) if j < i => {}
                    _ => problems.push(format!(
                        "`{module}` may import `{import}`, which {dir}/lib.rs does not declare above it"
                    )),
                }
            }
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_table_forbids_what_it_should() {
    // The test above is only as good as its reading of the table: check a few rows.
    let allowed = allowed();
    assert!(allowed["runtime"].contains("mlpackage"));
    // Validation reads only the saved package: runtime never reaches the graph or emit.
    assert!(!allowed["runtime"].contains("emit"));
    assert!(!allowed["runtime"].contains("graph"));
    assert!(!allowed["package"].contains("graph"));
    assert_eq!(
        allowed["exec"],
        BTreeSet::from(["mil".into(), "mlpackage".into()])
    );
    assert!(!allowed["mlpackage"].contains("emit"));
    assert!(!allowed["checkpoint"].contains("quant"));
    assert!(allowed["quant"].contains("util"));
    assert!(allowed["error"].is_empty());
    assert!(!allowed["commands"].contains("cli"));
    assert_eq!(allowed.len(), 28, "{:?}", allowed.keys());
    assert!(!allowed["aimodel"].contains("emit"));
    let refs = crate_refs(
        "use crate::graph::Graph; x = hf2coreml_crate::y; crate::quant::f(crate::VERSION)",
    );
    assert_eq!(refs, BTreeSet::from(["graph".into(), "quant".into()]));
}

/// `(name, first line, length)` of every function in `text` longer than `max` lines, for
/// rustfmt-formatted code: a body ends at the first `}` at the indentation of its `fn`.
fn long_functions(text: &str, max: usize) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let sig = [
            "pub fn ",
            "fn ",
            "pub(crate) fn ",
            "pub(super) fn ",
            "const fn ",
        ]
        .iter()
        .find_map(|p| trimmed.strip_prefix(p));
        if let Some(sig) = sig {
            let name: String = sig
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let mut j = i;
            while j < lines.len() && !lines[j].trim_end().ends_with('{') {
                if lines[j].trim_end().ends_with(';') {
                    break; // a declaration without a body
                }
                j += 1;
            }
            if j < lines.len() && lines[j].trim_end().ends_with('{') {
                let close = format!("{indent}}}");
                let end = (j + 1..lines.len())
                    .find(|&k| lines[k] == close)
                    .unwrap_or(lines.len() - 1);
                let len = end - i + 1;
                if len > max {
                    out.push((name, i + 1, len));
                }
                i = end;
            }
        }
        i += 1;
    }
    out
}

#[test]
fn no_function_is_longer_than_150_lines() {
    let mut problems = Vec::new();
    let mut numerics = Vec::new();
    rust_files(&root().join("crates/numerics/src"), &mut numerics);
    rust_files(&root().join("crates/testkit/src"), &mut numerics);
    let paths = sources().into_iter().map(|(_, p)| p).chain(numerics);
    for path in paths {
        let text = std::fs::read_to_string(&path).unwrap();
        for (name, line, len) in long_functions(&text, MAX_FN_LINES) {
            problems.push(format!(
                "{}:{line}: fn {name} is {len} lines",
                path.display()
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn long_functions_are_found() {
    let body = "    let x = 1;\n".repeat(5);
    let text = format!("fn short() {{\n{body}}}\n\nimpl A {{\n    pub fn long(\n        a: u8,\n    ) -> u8 {{\n    {body}    }}\n}}\n");
    assert_eq!(long_functions(&text, 8), vec![("long".to_string(), 10, 9)]);
    assert!(long_functions(&text, 20).is_empty());
}

/// A file is named for its one idea: no two files of a crate share a basename but `mod.rs`
/// (and a crate's `lib.rs`/`main.rs`), so a name found in a trace or a diff names one file.
#[test]
fn no_two_files_of_a_crate_share_a_name() {
    let mut problems = Vec::new();
    for dir in TABLED
        .iter()
        .chain(&["crates/numerics/src", "crates/testkit/src"])
    {
        let mut files = Vec::new();
        rust_files(&root().join(dir), &mut files);
        let mut seen: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
        for f in files {
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            if !["mod.rs", "lib.rs", "main.rs"].contains(&name.as_str()) {
                seen.entry(name).or_default().push(f);
            }
        }
        for (name, paths) in seen.into_iter().filter(|(_, p)| p.len() > 1) {
            problems.push(format!("{dir}: {name} at {paths:?}"));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}
