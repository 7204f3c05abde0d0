//! Core AI assets and chains from someone else: every file the asset or chain holds is checked
//! before Apple's runtime sees it (regular files of its own, the bytecode against the hash it
//! carries, a chain's parts against what the chain recorded), and what passes the checks but
//! still breaks the runtime (truncated or corrupt bytecode whose hash was rewritten to match)
//! is stopped at the wall: the runtime runs in a child process, and its abort is exit 2 with
//! the asset named, never a signal of hf2coreml's own, and its temporary files are gone.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{mkfifo, os, run_bin_env, tiny_checkpoint, Outcome, MAX_RSS_BYTES};
use crate::support::{cli, copy_dir, needs};

/// `convert CKPT -o root/NAME --target TARGET --max-seq-len 16 EXTRA...`, which must succeed.
fn convert_into(root: &Path, ckpt: &Path, name: &str, target: &str, extra: &[&str]) -> PathBuf {
    let out = root.join(name);
    cli(&[
        os("convert"),
        ckpt.as_os_str(),
        os("-o"),
        out.as_os_str(),
        os("--target"),
        os(target),
        os("--max-seq-len"),
        os("16"),
    ])
    .args(extra)
    .python()
    .ok();
    out
}

/// The tiny checkpoint in `root/ckpt`, written on first use.
fn ckpt(root: &Path) -> PathBuf {
    let ckpt = root.join("ckpt");
    if !ckpt.exists() {
        tiny_checkpoint(root);
    }
    ckpt
}

/// A tiny 4-bit asset converted from the tiny checkpoint, with `extra` flags.
fn convert_asset(root: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let flags: Vec<&str> = ["--recipe", "data-free-4bit"]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    convert_into(root, &ckpt(root), name, "coreai", &flags)
}

/// Rewrite `main.hash` to match the bytecode as it is now: the damage then reaches the runtime.
fn rehash(asset: &Path) {
    let bytes = std::fs::read(asset.join("main.mlirb")).unwrap();
    std::fs::write(asset.join("main.hash"), Sha256::digest(&bytes)).unwrap();
}

/// Run `args` with a temporary directory of its own; expect exit 2, no panic, bounded memory and
/// time, every needle in stderr, and the temporary directory left empty.
fn refused(root: &Path, args: &[&OsStr], needles: &[&str]) -> Outcome {
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let o = run_bin_env(args, None, &[("TMPDIR", tmp.as_os_str())]);
    assert_eq!(o.code, Some(2), "{args:?}\nstderr: {}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    for n in needles {
        assert!(
            o.stderr.contains(n),
            "{args:?}: `{n}` not in stderr:\n{}",
            o.stderr
        );
    }
    assert!(
        o.max_rss < MAX_RSS_BYTES,
        "peak RSS {} MiB",
        o.max_rss >> 20
    );
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{args:?} left {left:?}");
    o
}

/// `inspect`, `run` and `validate --against` of `asset`, each refused with the needles.
fn every_command_refuses(root: &Path, asset: &Path, needles: &[&str]) {
    let ckpt = root.join("ckpt");
    let commands: [Vec<&OsStr>; 3] = [
        vec![os("inspect"), asset.as_os_str()],
        vec![
            os("run"),
            asset.as_os_str(),
            os("--prompt-ids"),
            os("1,2"),
            os("--max-new-tokens"),
            os("2"),
        ],
        vec![
            os("validate"),
            asset.as_os_str(),
            os("--against"),
            ckpt.as_os_str(),
            os("--max-tokens"),
            os("4"),
        ],
    ];
    for args in commands {
        refused(root, &args, needles);
    }
}

/// A fresh copy of the good asset, damaged by `damage`.
fn damaged(root: &Path, good: &Path, name: &str, damage: impl FnOnce(&Path)) -> PathBuf {
    let a = root.join(name);
    copy_dir(good, &a);
    damage(&a);
    a
}

#[test]
fn damaged_bytecode_that_still_hashes_right_is_stopped_at_the_wall() {
    needs!(Python);
    let s = tempfile::tempdir().unwrap();
    let root = s.path();
    let good = convert_asset(root, "good.aimodel", &[]);
    let bytecode = std::fs::read(good.join("main.mlirb")).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("cut", bytecode[..bytecode.len() / 2].to_vec()),
        ("cut-early", bytecode[..64].to_vec()),
        (
            "noise",
            (0..4096u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
                .collect(),
        ),
        ("flipped", {
            let mut b = bytecode.clone();
            for i in (16..b.len().min(4096)).step_by(97) {
                b[i] ^= 0xff;
            }
            b
        }),
    ];
    for (name, bytes) in cases {
        let a = damaged(root, &good, &format!("{name}.aimodel"), |a| {
            std::fs::write(a.join("main.mlirb"), &bytes).unwrap();
            rehash(a);
        });
        every_command_refuses(
            root,
            &a,
            &[&format!("{name}.aimodel"), "Apple's Core AI runtime failed"],
        );
    }
}

#[test]
fn asset_files_are_checked_before_the_runtime_sees_them() {
    needs!(Python);
    let s = tempfile::tempdir().unwrap();
    let root = s.path();
    let good = convert_asset(root, "good.aimodel", &[]);
    type Damage = Box<dyn Fn(&Path)>;
    let link = |target: &'static str, file: &'static str| -> Damage {
        Box::new(move |a: &Path| {
            std::fs::remove_file(a.join(file)).unwrap();
            std::os::unix::fs::symlink(target, a.join(file)).unwrap();
        })
    };
    let cases: Vec<(&str, Damage, &[&str])> = vec![
        (
            "empty",
            Box::new(|a: &Path| {
                std::fs::write(a.join("main.mlirb"), b"").unwrap();
                rehash(a);
            }),
            &["main.mlirb: empty"],
        ),
        (
            "cut-unhashed",
            Box::new(|a: &Path| {
                let b = std::fs::read(a.join("main.mlirb")).unwrap();
                std::fs::write(a.join("main.mlirb"), &b[..b.len() - 1]).unwrap();
            }),
            &["main.mlirb: its sha256", "damaged or replaced"],
        ),
        (
            "link-passwd",
            link("/etc/passwd", "main.mlirb"),
            &["main.mlirb: a symlink"],
        ),
        (
            "link-zero",
            link("/dev/zero", "main.mlirb"),
            &["main.mlirb: a symlink"],
        ),
        (
            "link-meta",
            link("/etc/hostname", "metadata.json"),
            &["metadata.json: a symlink"],
        ),
        (
            "fifo",
            Box::new(|a: &Path| {
                std::fs::remove_file(a.join("main.mlirb")).unwrap();
                mkfifo(&a.join("main.mlirb"));
            }),
            &["main.mlirb: not a regular file"],
        ),
        (
            "fifo-meta",
            Box::new(|a: &Path| {
                std::fs::remove_file(a.join("metadata.json")).unwrap();
                mkfifo(&a.join("metadata.json"));
            }),
            &["metadata.json", "not a regular file"],
        ),
        (
            "no-meta",
            Box::new(|a: &Path| std::fs::remove_file(a.join("metadata.json")).unwrap()),
            &["metadata.json"],
        ),
        (
            "no-hash",
            Box::new(|a: &Path| std::fs::remove_file(a.join("main.hash")).unwrap()),
            &["main.hash: missing"],
        ),
        (
            "short-hash",
            Box::new(|a: &Path| std::fs::write(a.join("main.hash"), b"0123").unwrap()),
            &["main.hash: 4 bytes, a sha256 is 32"],
        ),
        (
            "no-bytecode",
            Box::new(|a: &Path| std::fs::remove_file(a.join("main.mlirb")).unwrap()),
            &["main.mlirb: missing"],
        ),
        (
            "subdir",
            Box::new(|a: &Path| std::fs::create_dir(a.join("extra")).unwrap()),
            &["extra: not a regular file"],
        ),
    ];
    for (name, damage, needles) in cases {
        let a = damaged(root, &good, &format!("{name}.aimodel"), damage);
        every_command_refuses(root, &a, needles);
    }
    // A missing asset is reported as one, not as a package without its manifest.
    let missing = root.join("missing.aimodel");
    let o = refused(
        root,
        &[os("run"), missing.as_os_str(), os("--prompt-ids"), os("1")],
        &["missing.aimodel"],
    );
    assert!(!o.stderr.contains("Manifest.json"), "{}", o.stderr);
}

#[test]
fn a_huge_sparse_bytecode_is_hashed_in_bounded_memory_and_refused() {
    needs!(Python);
    let s = tempfile::tempdir().unwrap();
    let root = s.path();
    let good = convert_asset(root, "good.aimodel", &[]);
    let a = damaged(root, &good, "sparse.aimodel", |a| {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(a.join("main.mlirb"))
            .unwrap();
        f.set_len(4 << 30).unwrap();
    });
    let o = refused(
        root,
        &[os("inspect"), a.as_os_str()],
        &["main.mlirb: its sha256", "damaged or replaced"],
    );
    // Hashing streams the file: memory stays flat, and time is linear in the size (4 GiB of
    // holes hash in seconds).
    assert!(o.max_rss < 256 << 20, "peak RSS {} MiB", o.max_rss >> 20);
    assert!(o.elapsed.as_secs() < 60, "{:?}", o.elapsed);
}

#[test]
fn validate_without_against_finds_the_checkpoint_in_the_assets_report() {
    needs!(Python);
    let s = tempfile::tempdir().unwrap();
    let root = s.path();
    let good = convert_asset(root, "good.aimodel", &["--keep-fp16", "*"]);
    let o = cli(&[
        os("validate"),
        good.as_os_str(),
        os("--max-tokens"),
        os("4"),
    ])
    .python()
    .output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("Manifest.json"), "{err}");
    assert!(err.contains("recorded in the package's report"), "{err}");
}

#[test]
fn inspect_escapes_control_characters_from_the_assets_metadata() {
    needs!(Python);
    let s = tempfile::tempdir().unwrap();
    let root = s.path();
    let good = convert_asset(root, "good.aimodel", &[]);
    let meta = good.join("metadata.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta).unwrap()).unwrap();
    v["producer"] = "evil\u{1b}[2J\u{7}".into();
    v["userDefined"]["note\u{1b}]0;title\u{7}"] = "\u{202e}reversed\u{1b}[31m".into();
    std::fs::write(&meta, serde_json::to_string(&v).unwrap()).unwrap();
    let o = cli(&[os("inspect"), good.as_os_str()]).python().ok();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains('\u{1b}') && !out.contains('\u{7}') && !out.contains('\u{202e}'));
    assert!(out.contains("evil\\u{1b}[2J\\u{7}"), "{out}");
    assert!(out.contains("\\u{202e}reversed"), "{out}");
}

/// A chain of tiny fp16 assets or packages, made under a tiny package-size limit.
const CHAIN_FLAGS: [&str; 4] = ["--keep-fp16", "*", "--max-package-size", "1200000"];

fn convert_chain(root: &Path, name: &str, target: &str) -> PathBuf {
    let out = convert_into(root, &ckpt(root), name, target, &CHAIN_FLAGS);
    assert!(out.join("chain.json").is_file(), "{name}: not a chain");
    out
}

fn chain_parts(chain: &Path) -> Vec<PathBuf> {
    let c = hf2coreml::mil::chain_file::ChainFile::read(chain).unwrap();
    assert!(c.parts.len() >= 2, "{c:#?}");
    c.parts
        .iter()
        .map(|p| hf2coreml::mil::chain_file::ChainFile::part_path(chain, p))
        .collect()
}

#[test]
fn chains_refuse_links_out_and_parts_from_other_conversions() {
    needs!(Python);
    let s = tempfile::tempdir().unwrap();
    let root = s.path();
    for (target, ext) in [("coreai", "aimodel"), ("ios17", "mlpackage")] {
        let good = convert_chain(root, &format!("good-{target}.{ext}"), target);
        let elsewhere = root.join(format!("elsewhere-{target}"));
        std::fs::create_dir(&elsewhere).unwrap();

        // A part directory that is a symlink to a copy outside the chain.
        let c = root.join(format!("part-link-{target}.{ext}"));
        copy_dir(&good, &c);
        let part = chain_parts(&c)[1].clone();
        let outside = elsewhere.join(part.file_name().unwrap());
        std::fs::rename(&part, &outside).unwrap();
        std::os::unix::fs::symlink(&outside, &part).unwrap();
        refused(
            root,
            &[os("run"), c.as_os_str(), os("--prompt-ids"), os("1")],
            &["is a symlink", "a chain's files and parts are its own"],
        );

        // chain.json a symlink to a copy outside the chain.
        let c = root.join(format!("file-link-{target}.{ext}"));
        copy_dir(&good, &c);
        let outside = elsewhere.join("chain.json");
        std::fs::rename(c.join("chain.json"), &outside).unwrap();
        std::os::unix::fs::symlink(&outside, c.join("chain.json")).unwrap();
        for cmd in ["inspect", "run"] {
            refused(
                root,
                &[os(cmd), c.as_os_str(), os("--prompt-ids"), os("1")]
                    [..if cmd == "run" { 4 } else { 2 }],
                &["chain.json", "is a symlink"],
            );
        }

        // chain.json a FIFO: reported as the chain's file, never waited on.
        let c = root.join(format!("file-fifo-{target}.{ext}"));
        copy_dir(&good, &c);
        std::fs::remove_file(c.join("chain.json")).unwrap();
        mkfifo(&c.join("chain.json"));
        refused(
            root,
            &[os("run"), c.as_os_str(), os("--prompt-ids"), os("1")],
            &["chain.json", "not a regular file"],
        );
    }

    // A Core AI part whose bytecode (and its own hash) comes from another conversion of the
    // same shapes, its metadata kept: the chain recorded other bytecode.
    let good = root.join("good-coreai.aimodel");
    let other = {
        let ckpt2 = root.join("ckpt2");
        std::fs::create_dir(&ckpt2).unwrap();
        let mut m = hf2coreml_testkit::TinyModel::llama();
        m.seed = m.seed.wrapping_add(1);
        m.write(&ckpt2).unwrap();
        convert_into(root, &ckpt2, "other.aimodel", "coreai", &CHAIN_FLAGS)
    };
    let c = root.join("swapped.aimodel");
    copy_dir(&good, &c);
    let (mine, theirs) = (chain_parts(&c)[0].clone(), chain_parts(&other)[0].clone());
    for f in ["main.mlirb", "main.hash"] {
        std::fs::copy(theirs.join(f), mine.join(f)).unwrap();
    }
    refused(
        root,
        &[os("run"), c.as_os_str(), os("--prompt-ids"), os("1")],
        &["main.mlirb is not the one the chain recorded"],
    );
}

/// A hybrid model's chain (LFM2: conv and attention blocks) whose chain.json lists blocks that
/// do not describe the model, a block twice, one past the last, the attention blocks
/// miscounted, is refused with exit 2 naming `recurrent` before any part runs (the runner
/// slices the caches and the conv state by those lists); a KV-cache file of a hybrid package
/// cut short (its state missing) is refused naming its length.
#[test]
fn hybrid_chains_and_cache_files_that_do_not_describe_the_model() {
    needs!(Python);
    let s = tempfile::tempdir().unwrap();
    let root = s.path();
    let lfm2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/lfm2");
    let flags = ["--keep-fp16", "*", "--max-package-size", "1250KB"];
    let good = convert_into(root, &lfm2, "good.mlpackage", "ios17", &flags);
    assert!(chain_parts(&good).len() >= 2);
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("twice", |r| {
            r["attention_layers"] = serde_json::json!([1, 1])
        }),
        ("past the last", |r| {
            r["attention_layers"] = serde_json::json!([1, 9])
        }),
        ("miscounted", |r| {
            r["attention_layers"] = serde_json::json!([1]);
            r["conv"]["layers"] = serde_json::json!([0, 2, 3, 4]);
        }),
    ];
    for (what, edit) in edits {
        let c = root.join(format!("{}.mlpackage", what.replace(' ', "-")));
        copy_dir(&good, &c);
        let file = c.join("chain.json");
        let mut j: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        edit(&mut j["contract"]["recurrent"]);
        std::fs::write(&file, serde_json::to_vec(&j).unwrap()).unwrap();
        refused(
            root,
            &[os("run"), c.as_os_str(), os("--prompt-ids"), os("1,2,3")],
            &["chain.json", "recurrent"],
        );
    }

    let pkg = convert_into(root, &lfm2, "one.mlpackage", "ios17", &["--keep-fp16", "*"]);
    let kv = root.join("one.kv");
    cli(&[os("run"), pkg.as_os_str(), os("--prompt-ids"), os("1,2,3")])
        .args(["--max-new-tokens", "2", "--save-cache"])
        .arg(&kv)
        .ok();
    let bytes = std::fs::read(&kv).unwrap();
    let cut = root.join("cut.kv");
    // The state (3 conv blocks × 2 inputs × 64 channels, fp16) sits before the checksum.
    std::fs::write(&cut, &bytes[..bytes.len() - 32 - 2 * 3 * 2 * 64]).unwrap();
    refused(
        root,
        &[
            os("run"),
            pkg.as_os_str(),
            os("--prompt-ids"),
            os("1,2,3,4"),
            os("--load-cache"),
            cut.as_os_str(),
        ],
        &["cut.kv", "the header declares"],
    );
}
