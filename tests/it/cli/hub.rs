//! Hub ids resolved offline in a Hub cache laid out as huggingface_hub writes it (`refs/`,
//! `snapshots/` of symlinks into `blobs/`), built here: `inspect`, `budget`, `convert`,
//! `validate --against` and `batch` take `ORG/NAME[@REV]`; a missing id or shard is refused
//! naming where it was looked for.

use std::path::{Path, PathBuf};

use hf2coreml_testkit::TinyModel;

use crate::support::{assert_refused, cli, needs, Cli};

const COMMIT: &str = "3f2c1a0e9b8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b";

/// Move every file of `src` into `root`'s `models--ORG--NAME`: the bytes in blobs/, the
/// snapshot of `COMMIT` as symlinks to them, `refs/main` naming it.
fn cache_model(root: &Path, org: &str, name: &str, src: &Path) -> PathBuf {
    let repo = root.join(format!("models--{org}--{name}"));
    let snap = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    for (i, e) in std::fs::read_dir(src).unwrap().enumerate() {
        let e = e.unwrap();
        let blob = format!("{i:040x}");
        std::fs::copy(e.path(), repo.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(e.file_name()))
            .unwrap();
    }
    snap
}

/// The binary with only `hub` as a Hub cache (HOME moved away from the machine's).
fn in_hub(hub: &Path, args: &[&str]) -> Cli {
    cli(args)
        .env("HF_HUB_CACHE", hub)
        .env("HOME", hub.join("no-home"))
        .env_remove("HF_HOME")
        .env_remove("XDG_CACHE_HOME")
}

#[test]
fn inspect_and_budget_read_a_hub_id_from_the_cache() {
    let src = TinyModel::qwen2().write_temp().unwrap();
    let hub = tempfile::tempdir().unwrap();
    let snap = cache_model(hub.path(), "Org", "Tiny-0.5B", src.path());
    let by_dir = cli(&["inspect", snap.to_str().unwrap(), "--json"]).ok();
    for id in [
        "Org/Tiny-0.5B",
        "Org/Tiny-0.5B@main",
        &format!("Org/Tiny-0.5B@{COMMIT}"),
    ] {
        let by_id = in_hub(hub.path(), &["inspect", id, "--json"]).ok();
        assert_eq!(by_id.stdout, by_dir.stdout, "{id}");
    }
    let budget = [
        "budget",
        "Org/Tiny-0.5B",
        "--device",
        "iphone-15-pro",
        "--json",
    ];
    in_hub(hub.path(), &budget).ok();

    // A shard the index names whose blob never arrived: refused, the shard named.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let shard = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap();
    let shard = shard.as_str().unwrap();
    let blob = std::fs::read_link(snap.join(shard)).unwrap();
    std::fs::remove_file(snap.join(&blob)).unwrap();
    let out = in_hub(hub.path(), &["inspect", "Org/Tiny-0.5B"]).output();
    assert_refused(&out, &[shard, "missing"]);
}

#[test]
fn an_id_not_in_the_cache_names_every_place_looked() {
    let hub = tempfile::tempdir().unwrap();
    let src = TinyModel::llama().write_temp().unwrap();
    cache_model(hub.path(), "Org", "Tiny", src.path());
    let home = hub.path().join("no-home");
    let out = in_hub(hub.path(), &["inspect", "Org/Absent"]).output();
    assert_refused(
        &out,
        &[
            "not in the local Hub cache",
            &hub.path().join("models--Org--Absent").display().to_string(),
            &home.join(".cache/huggingface/hub").display().to_string(),
            "hf download Org/Absent",
        ],
    );
    // A revision with no ref lists the snapshots there are, and how to fetch it.
    let out = in_hub(
        hub.path(),
        &["budget", "Org/Tiny@v2", "--device", "iphone-15-pro"],
    )
    .output();
    assert_refused(
        &out,
        &["no refs/v2", COMMIT, "hf download Org/Tiny --revision v2"],
    );
}

#[test]
fn convert_validate_and_batch_take_a_hub_id() {
    needs!(Python);
    let src = TinyModel::llama().write_temp().unwrap();
    let hub = tempfile::tempdir().unwrap();
    cache_model(hub.path(), "Org", "Tiny-1.5B", src.path());
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("t.mlpackage");
    let convert = ["convert", "Org/Tiny-1.5B", "-o", pkg.to_str().unwrap()];
    in_hub(hub.path(), &convert)
        .python()
        .args(["--max-seq-len", "16", "--keep-fp16", "*", "-q"])
        .ok();
    // validate finds the checkpoint by the id the report recorded, and by --against.
    let p = pkg.to_str().unwrap();
    for args in [
        vec!["validate", p, "--max-tokens", "4", "-q"],
        vec![
            "validate",
            p,
            "--against",
            "Org/Tiny-1.5B",
            "--max-tokens",
            "4",
            "-q",
        ],
    ] {
        in_hub(hub.path(), &args).ok();
    }
    // batch: the id expands `{model}` to the model's name, not the snapshot's commit.
    let batch = out.path().join("b.toml");
    std::fs::write(
        &batch,
        "[[export]]\nmodel = \"Org/Tiny-1.5B\"\noutput = \"out/{model}.mlpackage\"\n\
         recipe = { default = \"fp16\" }\nmax_seq_len = 16\n",
    )
    .unwrap();
    in_hub(hub.path(), &["batch", batch.to_str().unwrap(), "-q"])
        .python()
        .ok();
    assert!(out
        .path()
        .join("out/Tiny-1.5B.mlpackage/Manifest.json")
        .is_file());
}
