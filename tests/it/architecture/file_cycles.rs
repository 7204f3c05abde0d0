//! No import circle between files: in every crate of the workspace, a file that imports another
//! is never imported back by it, directly or through others. An entry file sits on top of the
//! files it uses, helpers are leaves, and a folder's `mod.rs` is not a helper library its
//! children call back into.
//!
//! A file's imports are the paths its code names (test code inside `#[cfg(test)]` excepted):
//! `use` trees and paths in expressions and types that start at `crate::`, `super::`, `self::`
//! or at a module of the crate. A path is resolved to the deepest file it reaches; when it names
//! an item a file re-exports, to the file the item comes from. A re-export of a file's own
//! descendants (`pub use child::Item` in a `mod.rs`) is that module's surface, not an import,
//! unless the file's own code uses the item.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::{root, rust_files};

/// A module path inside a crate: `["graph", "decoder"]` for `graph/decoder/mod.rs`.
type ModPath = Vec<String>;

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

/// The tokens of `code` that matter to paths: identifiers, `::` and punctuation; strings,
/// characters, lifetimes and comments are dropped.
fn tokens(code: &str) -> Vec<Tok> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < c.len() && !(c[i] == '*' && c[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if ch == 'r' && matches!(c.get(i + 1), Some('"') | Some('#')) {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if c.get(j) != Some(&'"') {
                out.push(Tok::Ident("r".into()));
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (0..hashes).all(|h| c.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
        } else if ch == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if ch == '\'' {
            // 'x', '\n' and '\u{…}' are characters; 'a (no closing quote) is a lifetime.
            if c.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            // b"…" and b'…' are byte strings and bytes: the quote is read next.
            if word != "b" || !matches!(c.get(i), Some('"') | Some('\'')) {
                out.push(Tok::Ident(word));
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                i += 1;
            }
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// The leaf paths of the use tree starting at `toks[*at]`, each with the name it binds
/// (`as` alias, or its last segment; `self` binds the prefix's).
fn use_tree(toks: &[Tok], at: &mut usize, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) {
    let mut path = prefix.to_vec();
    loop {
        match toks.get(*at) {
            Some(Tok::Ident(w)) if w == "self" && toks.get(*at + 1) != Some(&Tok::PathSep) => {
                // `{self, …}` names the prefix itself.
                *at += 1;
                let name = path.last().cloned().unwrap_or_default();
                out.push((path.clone(), alias(toks, at).unwrap_or(name)));
                return;
            }
            Some(Tok::Ident(w)) => {
                path.push(w.clone());
                *at += 1;
                if toks.get(*at) == Some(&Tok::PathSep) {
                    *at += 1;
                    continue;
                }
                let name = alias(toks, at).unwrap_or_else(|| w.clone());
                out.push((path, name));
                return;
            }
            Some(Tok::Punct('{')) => {
                *at += 1;
                while !matches!(toks.get(*at), None | Some(Tok::Punct('}'))) {
                    use_tree(toks, at, &path, out);
                    if toks.get(*at) == Some(&Tok::Punct(',')) {
                        *at += 1;
                    }
                }
                *at += 1;
                return;
            }
            // `*` and anything unexpected: nothing bound by name.
            _ => {
                *at += 1;
                return;
            }
        }
    }
}

fn alias(toks: &[Tok], at: &mut usize) -> Option<String> {
    if toks.get(*at) == Some(&Tok::Ident("as".into())) {
        if let Some(Tok::Ident(a)) = toks.get(*at + 1) {
            *at += 2;
            return Some(a.clone());
        }
    }
    None
}

/// One path the code names: its segments, the module it is written in (inline modules
/// included), whether it is a `pub` re-export, and the name a `use` binds.
struct Named {
    segments: Vec<String>,
    scope: ModPath,
    reexport: bool,
    binds: Option<String>,
}

/// Every path of `code`, written in file module `module`, and every identifier its code uses
/// outside `use` declarations.
fn named_paths(code: &str, module: &ModPath) -> (Vec<Named>, BTreeSet<String>) {
    let toks = tokens(code);
    let mut out = Vec::new();
    let mut used = BTreeSet::new();
    // Inline modules open at a brace depth: (name, depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    let scope = |inline: &[(String, usize)]| -> ModPath {
        let mut s = module.clone();
        s.extend(inline.iter().map(|(n, _)| n.clone()));
        s
    };
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct('{'))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth + 1));
                }
            }
            Tok::Ident(w) if w == "use" => {
                let reexport = is_pub_before(&toks, i);
                let mut at = i + 1;
                let mut leaves = Vec::new();
                use_tree(&toks, &mut at, &[], &mut leaves);
                for (segments, name) in leaves {
                    out.push(Named {
                        segments,
                        scope: scope(&inline),
                        reexport,
                        binds: Some(name),
                    });
                }
                i = at;
                continue;
            }
            Tok::Ident(first) if i == 0 || toks[i - 1] != Tok::PathSep => {
                used.insert(first.clone());
                let mut segments = vec![first.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::PathSep) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(w)) => segments.push(w.clone()),
                        _ => break,
                    }
                    j += 2;
                }
                if segments.len() > 1 {
                    out.push(Named {
                        segments,
                        scope: scope(&inline),
                        reexport: false,
                        binds: None,
                    });
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    (out, used)
}

/// Whether the `use` at `toks[at]` is preceded by `pub` or `pub(…)`.
fn is_pub_before(toks: &[Tok], at: usize) -> bool {
    match at.checked_sub(1).map(|p| &toks[p]) {
        Some(Tok::Ident(w)) => w == "pub",
        Some(Tok::Punct(')')) => {
            let open = toks[..at].iter().rposition(|t| *t == Tok::Punct('('));
            open.is_some_and(|o| o > 0 && toks[o - 1] == Tok::Ident("pub".into()))
        }
        _ => false,
    }
}

/// The files of one crate and the paths each names.
struct Crate {
    files: BTreeMap<ModPath, PathBuf>,
    paths: BTreeMap<ModPath, Vec<Named>>,
    /// File module → the identifiers its code uses outside `use` declarations.
    used: BTreeMap<ModPath, BTreeSet<String>>,
    /// File module → name → the absolute path it re-exports (`None`: another crate's item).
    reexports: BTreeMap<ModPath, BTreeMap<String, Option<Vec<String>>>>,
}

impl Crate {
    fn read(src: &Path) -> Crate {
        let mut list = Vec::new();
        rust_files(src, &mut list);
        let mut files = BTreeMap::new();
        for path in list {
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut m: ModPath = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                m.pop();
            }
            files.insert(m, path);
        }
        let mut krate = Crate {
            files,
            paths: BTreeMap::new(),
            used: BTreeMap::new(),
            reexports: BTreeMap::new(),
        };
        for (m, path) in &krate.files {
            let text = std::fs::read_to_string(path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let (paths, used) = named_paths(code, m);
            krate.paths.insert(m.clone(), paths);
            krate.used.insert(m.clone(), used);
        }
        for (m, named) in &krate.paths {
            for n in named.iter().filter(|n| n.reexport && n.scope == *m) {
                if let Some(name) = &n.binds {
                    let abs = krate.absolute(&n.segments, &n.scope);
                    krate
                        .reexports
                        .entry(m.clone())
                        .or_default()
                        .insert(name.clone(), abs);
                }
            }
        }
        krate
    }

    /// `segments` written in `scope` as a path from the crate root; `None` for a path that
    /// starts outside the crate (another crate, a local item, a type's associated item).
    fn absolute(&self, segments: &[String], scope: &ModPath) -> Option<Vec<String>> {
        let mut base = scope.clone();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &rest[1..];
            }
            Some("self") => rest = &rest[1..],
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
            }
            Some(first) => {
                let mut child = scope.clone();
                child.push(first.to_string());
                if !self.files.contains_key(&child) {
                    return None;
                }
            }
            None => return None,
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The file an absolute path reaches, through re-exports; `None` for another crate's item
    /// a file re-exports (`pub use hf2coreml_numerics::dequant`).
    fn file_of(&self, path: &[String], hops: usize) -> Option<ModPath> {
        let n = (0..=path.len())
            .rev()
            .find(|&n| self.files.contains_key(&path[..n]))?;
        let file = path[..n].to_vec();
        if hops < 8 {
            match path
                .get(n)
                .and_then(|item| self.reexports.get(&file)?.get(item))
            {
                Some(None) => return None,
                Some(Some(target)) if target.as_slice() != path => {
                    return self.file_of(target, hops + 1).or(Some(file));
                }
                _ => {}
            }
        }
        Some(file)
    }

    /// File → the files it imports.
    fn edges(&self) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
        let mut out: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
        for (m, named) in &self.paths {
            let entry = out.entry(m.clone()).or_default();
            for n in named {
                let Some(abs) = self.absolute(&n.segments, &n.scope) else {
                    continue;
                };
                let Some(to) = self.file_of(&abs, 0) else {
                    continue;
                };
                // Re-exporting a descendant's item is the module's surface, unless the file's
                // own code uses it.
                let used_here = n.binds.as_ref().is_some_and(|b| self.used[m].contains(b));
                let own_surface =
                    n.reexport && abs.starts_with(m) && abs.len() > m.len() && !used_here;
                if to != *m && !own_surface {
                    entry.insert(to);
                }
            }
        }
        out
    }
}

/// The circles of `edges`: each strongly connected component of more than one file.
fn circles(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    // Kosaraju: finish order on the graph, then components on the reversed graph.
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for start in edges.keys() {
        if seen.contains(start) {
            continue;
        }
        let mut stack = vec![(start.clone(), false)];
        while let Some((v, done)) = stack.pop() {
            if done {
                order.push(v);
                continue;
            }
            if !seen.insert(v.clone()) {
                continue;
            }
            stack.push((v.clone(), true));
            for w in edges.get(&v).into_iter().flatten() {
                if !seen.contains(w) {
                    stack.push((w.clone(), false));
                }
            }
        }
    }
    let mut reversed: BTreeMap<&ModPath, Vec<&ModPath>> = BTreeMap::new();
    for (v, ws) in edges {
        for w in ws {
            reversed.entry(w).or_default().push(v);
        }
    }
    let mut assigned = BTreeSet::new();
    let mut out = Vec::new();
    for v in order.iter().rev() {
        if assigned.contains(v) {
            continue;
        }
        let mut component = Vec::new();
        let mut stack = vec![v];
        assigned.insert(v.clone());
        while let Some(x) = stack.pop() {
            component.push(x.clone());
            for w in reversed.get(x).into_iter().flatten() {
                if assigned.insert((*w).clone()) {
                    stack.push(w);
                }
            }
        }
        if component.len() > 1 {
            component.sort();
            out.push(component);
        }
    }
    out
}

fn show(m: &ModPath) -> String {
    if m.is_empty() {
        "the crate root".into()
    } else {
        m.join("/")
    }
}

#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    let mut problems = Vec::new();
    for src in [
        "crates/format/src",
        "crates/interp/src",
        "crates/hf2coreml/src",
        "crates/numerics/src",
        "crates/testkit/src",
        "src",
    ] {
        let krate = Crate::read(&root().join(src));
        let edges = krate.edges();
        for circle in circles(&edges) {
            let members: BTreeSet<&ModPath> = circle.iter().collect();
            let lines: Vec<String> = circle
                .iter()
                .map(|m| {
                    let to: Vec<String> = edges[m]
                        .iter()
                        .filter(|t| members.contains(t))
                        .map(show)
                        .collect();
                    format!("    {} → {}", show(m), to.join(", "))
                })
                .collect();
            problems.push(format!(
                "{src}: a circle of {} files\n{}",
                circle.len(),
                lines.join("\n")
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn paths_are_read_as_the_compiler_reads_them() {
    let m: ModPath = vec!["a".into(), "b".into()];
    let code = "use super::{c::{self, D as E}, f::*};\n\
                pub use g::H;\n\
                mod inner { fn x() { super::super::k::f(\"crate::not::a::path\"); } }\n\
                fn y<'a>(c: &'a char) { let _ = 'x'; crate::p::q(); }";
    let (named, used) = named_paths(code, &m);
    assert!(used.contains("char") && used.contains("y") && !used.contains("D"));
    let got: Vec<(String, String, bool, Option<String>)> = named
        .iter()
        .map(|n| {
            (
                n.segments.join("::"),
                n.scope.join("/"),
                n.reexport,
                n.binds.clone(),
            )
        })
        .collect();
    let s = |x: &str| x.to_string();
    assert_eq!(
        got,
        [
            (s("super::c"), s("a/b"), false, Some(s("c"))),
            (s("super::c::D"), s("a/b"), false, Some(s("E"))),
            (s("g::H"), s("a/b"), true, Some(s("H"))),
            (s("super::super::k::f"), s("a/b/inner"), false, None),
            (s("crate::p::q"), s("a/b"), false, None),
        ]
    );
    let mut edges = BTreeMap::new();
    let v = |p: &[&str]| -> ModPath { p.iter().map(|x| x.to_string()).collect() };
    edges.insert(v(&["a"]), BTreeSet::from([v(&["b"])]));
    edges.insert(v(&["b"]), BTreeSet::from([v(&["c"])]));
    edges.insert(v(&["c"]), BTreeSet::from([v(&["a"])]));
    edges.insert(v(&["d"]), BTreeSet::from([v(&["a"])]));
    assert_eq!(circles(&edges), [vec![v(&["a"]), v(&["b"]), v(&["c"])]]);
}
