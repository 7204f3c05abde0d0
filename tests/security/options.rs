//! What a run is given besides the model: recipe files, the calibration text and sizes on
//! the command line. Bad ones exit 2 naming the problem, at once, with nothing written.

use std::path::Path;
use std::time::Duration;

use hf2coreml_testkit::TinyModel;

use super::{checkpoint, expect, expect_bad, os, Scratch};

fn convert_with(s: &Scratch, ckpt: &Path, extra: &[&std::ffi::OsStr], needles: &[&str]) {
    let pkg = s.out().join("m.mlpackage");
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "convert".as_ref(),
        ckpt.as_os_str(),
        "-o".as_ref(),
        pkg.as_os_str(),
    ];
    args.extend_from_slice(extra);
    expect_bad(s, &args, needles);
}

#[test]
fn recipe_with_an_unknown_key() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let recipe = s.path().join("r.toml");
    std::fs::write(&recipe, "default = \"fp16\"\npalettise = true\n").unwrap();
    convert_with(
        &s,
        &ckpt,
        &["--recipe".as_ref(), recipe.as_os_str()],
        &["r.toml", "unknown key `palettise`"],
    );
}

#[test]
fn recipe_with_an_impossible_bit_width() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let recipe = s.path().join("r.toml");
    std::fs::write(&recipe, "default = { palettize = { nbits = 5 } }\n").unwrap();
    convert_with(
        &s,
        &ckpt,
        &["--recipe".as_ref(), recipe.as_os_str()],
        &["r.toml", "5"],
    );
}

#[cfg(unix)]
#[test]
fn calibration_from_dev_zero_is_refused_at_once() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = root.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    TinyModel::llama().write(&ckpt).unwrap();
    let out = root.path().join("out").join("m.mlpackage");
    let o = expect(
        root.path(),
        &[
            os("convert"),
            ckpt.as_os_str(),
            os("-o"),
            out.as_os_str(),
            os("--calibration"),
            os("/dev/zero"),
        ],
        2,
        &["/dev/zero", "not a regular file"],
    );
    assert!(o.elapsed < Duration::from_secs(60), "{:?}", o.elapsed);
}

#[test]
fn absurd_max_seq_len_for_budget() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    expect_bad(
        &s,
        &[
            "budget".as_ref(),
            ckpt.as_os_str(),
            "--device".as_ref(),
            "iphone-15".as_ref(),
            "--max-seq-len".as_ref(),
            "18446744073709551615".as_ref(),
        ],
        &["--max-seq-len 18446744073709551615", "exceeds the limit"],
    );
}

#[test]
fn absurd_max_seq_len_for_convert() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    convert_with(
        &s,
        &ckpt,
        &[
            "--device".as_ref(),
            "iphone-15".as_ref(),
            "--max-seq-len".as_ref(),
            "4611686018427387904".as_ref(),
            "--dry-run".as_ref(),
        ],
        &["--max-seq-len 4611686018427387904", "exceeds the limit"],
    );
}
