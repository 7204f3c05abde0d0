//! Outputs: a conversion never writes under a file, over an existing output without
//! `--force`, inside or over its own input, to a path that is not UTF-8, or twice to one
//! package named two ways; nothing is left behind. (Killed runs: `interrupts`.)

use std::ffi::OsString;
use std::path::{Path, PathBuf};

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
        hf2coreml::testing::gguf::TinyGguf::llama()
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
