//! Batch files whose exports would damage each other: two outputs sharing the sidecars beside
//! them (`o/x.mlpackage` and `o/x.aimodel` share `o/x.report.json`), one output inside
//! another's package or under its sidecar, names one file on a case-insensitive file system.
//! Refused by `--list` and by a run alike (exit 2, both exports named, nothing written),
//! however the paths are spelled and whichever shard runs.

use std::path::Path;

use super::{expect, os, tiny_checkpoint};

/// A batch file in `root` with exports `a` and `b` of the tiny checkpoint writing `a_out` and
/// `b_out` (relative to `root`).
fn batch_file(root: &Path, a_out: &str, b_out: &str) -> std::path::PathBuf {
    let file = root.join("batch.toml");
    std::fs::write(
        &file,
        format!(
            "[defaults]\nmodel = \"ckpt\"\nrecipe = \"data-free-4bit\"\n\n\
             [[export]]\nname = \"a\"\noutput = \"{a_out}\"\n\n\
             [[export]]\nname = \"b\"\noutput = \"{b_out}\"\n"
        ),
    )
    .unwrap();
    file
}

/// `--list`, a run, and a run of the second shard: each exit 2 with every needle, nothing
/// written.
fn refused_everywhere(root: &Path, file: &Path, needles: &[&str]) {
    for extra in [
        &["--list"][..],
        &["--list", "--json"][..],
        &["--force", "--keep-going"][..],
        &["--shard", "2/2"][..],
    ] {
        let mut args = vec![os("batch"), file.as_os_str()];
        args.extend(extra.iter().map(|a| os(a)));
        let o = expect(root, &args, 2, needles);
        assert!(o.stdout.is_empty(), "{extra:?}: {}", o.stdout);
    }
}

#[test]
fn a_package_and_an_asset_of_one_stem_share_their_sidecars() {
    let root = tempfile::tempdir().unwrap();
    tiny_checkpoint(root.path());
    std::fs::create_dir(root.path().join("o")).unwrap();
    let o = root.path().join("o");
    for (a, b) in [
        ("o/x.mlpackage", "o/x.aimodel"),
        ("o/x.aimodel", "o/./x.mlpackage"),
    ] {
        let file = batch_file(root.path(), a, b);
        refused_everywhere(
            root.path(),
            &file,
            &[
                "batch.toml:",
                "exports `a` (line 5) and `b` (line 9) both write",
                &o.join("x.tokenizer.json").display().to_string(),
                "one would replace the other's",
            ],
        );
        std::fs::remove_file(&file).unwrap();
    }
}

#[cfg(unix)]
#[test]
fn a_package_inside_another_or_named_apart_by_case_only() {
    let root = tempfile::tempdir().unwrap();
    tiny_checkpoint(root.path());
    let o = root.path().join("o");
    std::fs::create_dir(&o).unwrap();
    std::os::unix::fs::symlink(&o, root.path().join("link")).unwrap();
    let inside = |outer: &str| format!("inside {}", o.join(outer).display());
    for (a, b, needles) in [
        (
            "o/x.mlpackage",
            "o/x.mlpackage/y.mlpackage",
            vec![
                "export `b` (line 9) writes".to_string(),
                inside("x.mlpackage"),
            ],
        ),
        // The same, spelled through a link to the folder.
        (
            "link/x.mlpackage",
            "o/x.mlpackage/Data/y.mlpackage",
            vec![
                "export `b` (line 9) writes".to_string(),
                inside("x.mlpackage"),
            ],
        ),
        // Under a sidecar file: "File name too long" or "Not a directory" at run time.
        (
            "o/x.mlpackage",
            "o/x.report.json/y.mlpackage",
            vec![
                inside("x.report.json"),
                format!(
                    "a sidecar of {}",
                    root.path().join("o/x.mlpackage").display()
                ),
            ],
        ),
        (
            "o/Model.mlpackage",
            "o/model.mlpackage",
            vec![
                "exports `a` (line 5) and `b` (line 9)".to_string(),
                "differ only in case".to_string(),
            ],
        ),
    ] {
        let file = batch_file(root.path(), a, b);
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        refused_everywhere(root.path(), &file, &needles);
        std::fs::remove_file(&file).unwrap();
    }
    // Apart by more than a shared prefix: listed.
    let file = batch_file(root.path(), "o/x.mlpackage", "o/x.mlpackage2.mlpackage");
    expect(
        root.path(),
        &[os("batch"), file.as_os_str(), os("--list")],
        0,
        &[],
    );
}
