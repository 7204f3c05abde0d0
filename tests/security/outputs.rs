//! Outputs: a conversion never writes under a file, over an existing output without
//! `--force`, inside or over its own input, to a path that is not UTF-8, or twice to one
//! package named two ways; nothing is left behind. (Killed runs: `interrupts`.)

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use hf2coreml_testkit::TinyModel;

use super::{checkpoint, expect, expect_bad, os, tiny_checkpoint, Scratch};

#[test]
fn output_under_a_regular_file() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    std::fs::write(s.path().join("blocker"), "a file, not a directory").unwrap();
    let pkg = s.path().join("blocker/m.mlpackage");
    expect_bad(
        &s,
        &[
            "convert".as_ref(),
            ckpt.as_os_str(),
            "-o".as_ref(),
            pkg.as_os_str(),
            "--recipe".as_ref(),
            "data-free-4bit".as_ref(),
        ],
        &["blocker", "not a directory"],
    );
}

#[test]
fn output_that_already_exists() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let pkg = s.path().join("m.mlpackage");
    std::fs::create_dir(&pkg).unwrap();
    std::fs::write(pkg.join("keep"), "the user's file").unwrap();
    expect_bad(
        &s,
        &[
            "convert".as_ref(),
            ckpt.as_os_str(),
            "-o".as_ref(),
            pkg.as_os_str(),
        ],
        &["m.mlpackage", "already exists", "--force"],
    );
    assert_eq!(
        std::fs::read_to_string(pkg.join("keep")).unwrap(),
        "the user's file"
    );
}

/// A user's own file where a sidecar would go (report, tokenizer files) is an existing output:
/// refused without `--force` before any work, the file untouched.
#[test]
fn sidecars_that_already_exist() {
    for sidecar in [
        "m.report.json",
        "m.tokenizer.json",
        "m.tokenizer_config.json",
    ] {
        let s = Scratch::new();
        let ckpt = checkpoint(&s);
        let mine = s.path().join(sidecar);
        std::fs::write(&mine, "the user's file").unwrap();
        let pkg = s.path().join("m.mlpackage");
        expect_bad(
            &s,
            &[
                "convert".as_ref(),
                ckpt.as_os_str(),
                "-o".as_ref(),
                pkg.as_os_str(),
            ],
            &[sidecar, "already exists", "--force"],
        );
        assert_eq!(std::fs::read_to_string(&mine).unwrap(), "the user's file");
        assert!(!pkg.exists(), "{sidecar}");
    }
}

/// Names and contents of every file under `dir`.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let bytes = std::fs::read(&p).unwrap();
                v.push((p, bytes));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn an_output_that_is_contains_or_lies_inside_the_input_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let before = snapshot(&ckpt);
    let inside = ckpt.join("m.mlpackage");
    let dotted = root.path().join("ckpt/../ckpt/x.mlpackage");
    for out in [&ckpt, &inside, &dotted, &root.path().to_path_buf()] {
        expect(
            root.path(),
            &[
                os("convert"),
                ckpt.as_os_str(),
                os("-o"),
                out.as_os_str(),
                os("--force"),
                os("--dry-run"),
            ],
            2,
            &["would overlap the input"],
        );
    }
    assert_eq!(snapshot(&ckpt), before, "the input changed");
}

#[test]
fn import_gguf_into_its_own_folder_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let g = root.path().join("g");
    std::fs::create_dir(&g).unwrap();
    let file = g.join("m.gguf");
    std::fs::write(
        &file,
        hf2coreml_testkit::gguf::TinyGguf::llama()
            .build()
            .writer
            .to_bytes(),
    )
    .unwrap();
    let before = snapshot(&g);
    expect(
        root.path(),
        &[
            os("import-gguf"),
            file.as_os_str(),
            os("-o"),
            g.as_os_str(),
            os("--force"),
        ],
        2,
        &["would overlap the input"],
    );
    assert_eq!(snapshot(&g), before);
}

#[cfg(unix)]
#[test]
fn a_non_utf8_output_is_refused_before_anything_is_written() {
    use std::os::unix::ffi::OsStringExt;
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let mut name = b"out-\xff".to_vec();
    name.extend_from_slice(b".mlpackage");
    let out = root.path().join(OsString::from_vec(name));
    expect(
        root.path(),
        &[
            os("convert"),
            ckpt.as_os_str(),
            os("-o"),
            out.as_os_str(),
            os("--recipe"),
            os("data-free-4bit"),
        ],
        2,
        &["not valid UTF-8"],
    );
}

#[cfg(unix)]
#[test]
fn batch_outputs_naming_one_package_two_ways_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let o = root.path().join("o");
    std::fs::create_dir_all(o.join("x")).unwrap();
    std::os::unix::fs::symlink(&o, root.path().join("link")).unwrap();
    for (a, b) in [
        ("o/a.mlpackage", "o/./x/../a.mlpackage"),
        ("o/a.mlpackage", "link/a.mlpackage"),
    ] {
        let file = root.path().join("batch.toml");
        std::fs::write(
            &file,
            format!(
                "[[export]]\nname = \"one\"\nmodel = \"{}\"\noutput = \"{a}\"\n\n\
                 [[export]]\nname = \"two\"\nmodel = \"{}\"\noutput = \"{b}\"\n",
                ckpt.display(),
                ckpt.display()
            ),
        )
        .unwrap();
        expect(
            root.path(),
            &[os("batch"), file.as_os_str(), os("--list")],
            2,
            &["two exports write"],
        );
        std::fs::remove_file(&file).unwrap();
    }
}

/// A file output (`palettize --json`, `batch --json`, `run --logits-out`, `run --save-cache`)
/// whose name exists and is not a regular file: a FIFO or a character device is written in
/// place, a symlink to a file writes the file, and a directory, socket or dangling symlink is
/// refused before any work. Nothing is ever renamed over.
#[cfg(unix)]
#[test]
fn file_outputs_never_rename_over_what_is_not_a_regular_file() {
    use std::os::unix::fs::FileTypeExt;
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let palettize = |dest: &Path, code: i32, needles: &[&str]| {
        expect(
            s.path(),
            &[
                os("palettize"),
                ckpt.as_os_str(),
                os("--recipe"),
                os("data-free-4bit"),
                os("--json"),
                dest.as_os_str(),
            ],
            code,
            needles,
        )
    };
    let dir = s.path().join("a-directory");
    std::fs::create_dir(&dir).unwrap();
    palettize(
        &dir,
        2,
        &["a-directory", "is a directory", "not written over"],
    );
    assert!(dir.is_dir());
    let socket = s.path().join("a-socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    palettize(&socket, 2, &["a-socket", "is a socket"]);
    let dangling = s.path().join("dangling");
    std::os::unix::fs::symlink(s.path().join("nowhere"), &dangling).unwrap();
    palettize(&dangling, 2, &["dangling", "a symlink to nothing"]);
    assert!(!s.path().join("nowhere").exists());

    // Written in place: the character device stays one.
    palettize(Path::new("/dev/null"), 0, &[]);
    let null = std::fs::metadata("/dev/null").unwrap();
    assert!(null.file_type().is_char_device());
    // A FIFO: its reader gets the report, and it is still a FIFO.
    let fifo = s.path().join("a-fifo");
    super::mkfifo(&fifo);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    palettize(&fifo, 0, &[]);
    let got: serde_json::Value = serde_json::from_str(&reader.join().unwrap()).unwrap();
    assert!(got.get("totals").is_some(), "{got}");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    // A symlink to a regular file: the file is replaced, the link stays.
    let target = s.path().join("target.json");
    std::fs::write(&target, "old").unwrap();
    let link = s.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    palettize(&link, 0, &[]);
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(std::fs::read_to_string(&target).unwrap().contains("totals"));

    // The other file outputs refuse a directory before any work: `run` before loading the
    // package, `batch` before the first export.
    for flag in ["--logits-out", "--save-cache"] {
        expect(
            s.path(),
            &[
                os("run"),
                s.path().join("absent.mlpackage").as_os_str(),
                os("--prompt-ids"),
                os("1,2"),
                os(flag),
                dir.as_os_str(),
            ],
            2,
            &["a-directory", "is a directory"],
        );
    }
    let file = s.path().join("batch.toml");
    std::fs::write(
        &file,
        format!(
            "[[export]]\nname = \"one\"\nmodel = \"{}\"\noutput = \"{}\"\n",
            ckpt.display(),
            s.out().join("m.mlpackage").display()
        ),
    )
    .unwrap();
    expect(
        s.path(),
        &[os("batch"), file.as_os_str(), os("--json"), dir.as_os_str()],
        2,
        &["a-directory", "is a directory"],
    );
    assert!(!s.out().exists());
}

/// With `--force`, a package name or sidecar that is a FIFO, a symlink or (for a sidecar) a
/// directory is still not replaced: refused before any work, left as it was.
#[cfg(unix)]
#[test]
fn force_replaces_only_packages_and_regular_files() {
    use std::os::unix::fs::FileTypeExt;
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let convert = |pkg: &Path, needles: &[&str]| {
        expect(
            s.path(),
            &[
                os("convert"),
                ckpt.as_os_str(),
                os("-o"),
                pkg.as_os_str(),
                os("--force"),
            ],
            2,
            needles,
        );
    };
    let fifo = s.path().join("f.mlpackage");
    super::mkfifo(&fifo);
    convert(&fifo, &["f.mlpackage", "is a FIFO", "not written over"]);
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    let elsewhere = s.path().join("elsewhere.mlpackage");
    std::fs::create_dir(&elsewhere).unwrap();
    let link = s.path().join("l.mlpackage");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    convert(&link, &["l.mlpackage", "is a symlink"]);
    let side = s.path().join("m.report.json");
    std::fs::create_dir(&side).unwrap();
    convert(
        &s.path().join("m.mlpackage"),
        &["m.report.json", "is a directory"],
    );
    assert!(side.is_dir());
}

/// An input whose path is not UTF-8 cannot be recorded in the report: refused before any
/// work, nothing written (it once ran the whole conversion and left a package without one).
#[cfg(unix)]
#[test]
fn a_non_utf8_input_is_refused_before_anything_is_written() {
    use std::os::unix::ffi::OsStringExt;
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let odd = root.path().join(OsString::from_vec(b"ckpt-\xff".to_vec()));
    std::fs::rename(&ckpt, &odd).unwrap();
    let out = root.path().join("m.mlpackage");
    expect(
        root.path(),
        &[os("convert"), odd.as_os_str(), os("-o"), out.as_os_str()],
        2,
        &["not valid UTF-8", "rename it"],
    );
}

/// One export writing the package another export reads as its checkpoint is refused when the
/// file is read (`--list` included), before `--force --keep-going` could replace that input.
#[test]
fn an_export_over_another_exports_model_is_refused_at_list_time() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let m3 = root.path().join("m3.mlpackage");
    std::fs::create_dir(&m3).unwrap();
    TinyModel::llama().write(&m3).unwrap();
    let before = snapshot(&m3);
    let file = root.path().join("batch.toml");
    std::fs::write(
        &file,
        format!(
            "[[export]]\nname = \"a\"\nmodel = \"{}\"\noutput = \"{}\"\n\n\
             [[export]]\nname = \"b\"\nmodel = \"{}\"\noutput = \"{}\"\n",
            ckpt.display(),
            m3.display(),
            m3.display(),
            root.path().join("b.mlpackage").display()
        ),
    )
    .unwrap();
    for extra in [&["--list"][..], &["--force", "--keep-going"][..]] {
        let mut args = vec![os("batch"), file.as_os_str()];
        args.extend(extra.iter().map(|a| os(a)));
        expect(
            root.path(),
            &args,
            2,
            &["export `a` writes", "would overlap the model", "export `b`"],
        );
    }
    assert_eq!(snapshot(&m3), before, "b's input changed");
}

/// An output name the file system cannot take, with the names written beside it (the
/// sidecars, the partial directory), is refused before any work.
#[test]
fn an_output_name_too_long_for_the_file_system_is_refused_before_work() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    for stem in [240, 225] {
        let pkg = s.path().join(format!("{}.mlpackage", "a".repeat(stem)));
        expect_bad(
            &s,
            &[os("convert"), ckpt.as_os_str(), os("-o"), pkg.as_os_str()],
            &["the name is too long for the file system"],
        );
    }
}
