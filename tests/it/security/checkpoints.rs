//! Hostile and broken inputs, through the binary, for every reader: safetensors files and shard
//! indexes, config.json, weights, GGUF files, .mlpackage directories (Manifest, protobuf,
//! weight.bin, the program), recipes and output paths. Every case must exit 2 with a message
//! naming the file and the problem, never panic, and leave no output behind.
//!
//! Cases already covered elsewhere are not repeated: tests/cli_checkpoint.rs (missing config,
//! pickle-only, unknown architecture, heads not dividing, truncated file, missing shard,
//! missing tensor, wrong shape, unsupported dtype), tests/mlpackage_reader.rs (library-level
//! package errors), tests/gguf_import.rs and tests/gguf_cli.rs (GGUF metadata and tensors).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use half::bf16;
use hf2coreml::mil::contract;
use hf2coreml::mil::DType;
use hf2coreml::mlpackage::blob::{BLOB_SENTINEL, RECORD_SIZE};
use hf2coreml::mlpackage::{proto, BlobWriter};
use hf2coreml::testing::gguf::{Meta, TinyGguf};
use hf2coreml::testing::mlpackage as fixture;
use hf2coreml::testing::TinyModel;

/// A scratch root: inputs are created in it, outputs are aimed at `root/out/...`, and afterwards
/// nothing but the inputs may remain.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn out(&self) -> PathBuf {
        self.path().join("out")
    }

    /// Top-level names in the root.
    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

fn hf2coreml(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf2coreml"))
        .args(args)
        .env("CI", "1")
        .output()
        .unwrap()
}

/// Run `args`, expect exit 2 and every needle in stderr (the file and the problem), no panic,
/// and the root holding exactly what it held before.
fn expect_bad(s: &Scratch, args: &[&std::ffi::OsStr], needles: &[&str]) {
    let before = s.entries();
    let out = hf2coreml(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "args {args:?}\nstdout: {}\nstderr: {stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "`{n}` not in stderr:\n{stderr}");
    }
    assert_eq!(s.entries(), before, "output left behind; stderr:\n{stderr}");
    assert!(!s.out().exists());
}

// ---- checkpoints, through `convert` (which would write out/m.mlpackage) ------------------

fn convert(s: &Scratch, ckpt: &Path, needles: &[&str]) {
    let pkg = s.out().join("m.mlpackage");
    expect_bad(
        s,
        &[
            "convert".as_ref(),
            ckpt.as_os_str(),
            "-o".as_ref(),
            pkg.as_os_str(),
            "--recipe".as_ref(),
            "data-free-4bit".as_ref(),
        ],
        needles,
    );
}

/// The tiny llama checkpoint in `s/ckpt`.
fn checkpoint(s: &Scratch) -> PathBuf {
    write_model(s, TinyModel::llama())
}

fn write_model(s: &Scratch, m: TinyModel) -> PathBuf {
    let dir = s.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    m.write(&dir).unwrap();
    dir
}

/// Split a safetensors file into its header JSON and data section.
fn split_safetensors(bytes: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
        bytes[8 + n..].to_vec(),
    )
}

fn join_safetensors(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let h = header.to_string().into_bytes();
    let mut v = (h.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&h);
    v.extend_from_slice(data);
    v
}

/// Rewrite the checkpoint's model.safetensors header with `edit`.
fn edit_header(ckpt: &Path, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<u8>)) {
    let file = ckpt.join("model.safetensors");
    let (mut header, mut data) = split_safetensors(&std::fs::read(&file).unwrap());
    edit(&mut header, &mut data);
    std::fs::write(&file, join_safetensors(&header, &data)).unwrap();
}

fn edit_config(ckpt: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let file = ckpt.join("config.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    edit(&mut j);
    std::fs::write(&file, j.to_string()).unwrap();
}

#[test]
fn safetensors_header_length_past_the_end_of_the_file() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let file = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let past = bytes.len() as u64 + 10;
    bytes[..8].copy_from_slice(&past.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    convert(&s, &ckpt, &["model.safetensors", "runs past the end"]);
}

#[test]
fn safetensors_header_length_absurd() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let file = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    convert(
        &s,
        &ckpt,
        &["model.safetensors", "exceeds the 16777216-byte limit"],
    );
}

#[test]
fn safetensors_header_not_json() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    let file = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8..16].copy_from_slice(b"<html>  ");
    std::fs::write(&file, &bytes).unwrap();
    convert(&s, &ckpt, &["model.safetensors", "invalid JSON in header"]);
}

#[test]
fn safetensors_overlapping_offsets() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, _| {
        // Two 64-element bf16 norms: point the second at the first one's bytes.
        let a = h["model.norm.weight"]["data_offsets"].clone();
        h["model.layers.0.input_layernorm.weight"]["data_offsets"] = a;
    });
    convert(&s, &ckpt, &["model.safetensors", "overlap"]);
}

#[test]
fn safetensors_offsets_out_of_range() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, data| {
        let len = data.len() as u64;
        h["model.norm.weight"]["data_offsets"] = serde_json::json!([len + 1000, len + 1128]);
    });
    convert(
        &s,
        &ckpt,
        &["model.safetensors", "model.norm.weight", "past the"],
    );
}

#[test]
fn safetensors_shape_and_byte_count_disagree() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, _| {
        h["model.norm.weight"]["shape"] = serde_json::json!([65]);
    });
    convert(
        &s,
        &ckpt,
        &["model.safetensors", "model.norm.weight", "needs 130 bytes"],
    );
}

#[test]
fn shard_index_not_json() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": ",
    )
    .unwrap();
    convert(&s, &dir, &["model.safetensors.index.json", "EOF"]);
}

#[test]
fn shard_index_names_a_file_outside_the_checkpoint() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    let idx = dir.join("model.safetensors.index.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    j["weight_map"]["model.norm.weight"] = "../../etc/passwd".into();
    std::fs::write(&idx, j.to_string()).unwrap();
    convert(
        &s,
        &dir,
        &["model.safetensors.index.json", "not a plain file name"],
    );
}

/// The Safety section's cap of 2^20 tensors per checkpoint. One file cannot reach it (its
/// header is capped at 16 MiB, about 270,000 tensors), so it is reached across shards: four
/// more shards of 262,145 empty tensors each, listed in the index, are refused by the count,
/// naming the shard where it was passed.
#[test]
fn more_tensors_than_the_cap_across_shards() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    let idx = dir.join("model.safetensors.index.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    let per_shard = (1usize << 20) / 4 + 1;
    for n in 0..4 {
        let mut header = String::from("{");
        for i in 0..per_shard {
            if i > 0 {
                header.push(',');
            }
            header.push_str(&format!(
                r#""x{n}_{i}":{{"dtype":"F16","shape":[0],"data_offsets":[0,0]}}"#
            ));
        }
        header.push('}');
        let name = format!("extra-{n}.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(dir.join(&name), bytes).unwrap();
        j["weight_map"][format!("x{n}_0")] = name.into();
    }
    std::fs::write(&idx, j.to_string()).unwrap();
    convert(&s, &dir, &["extra-", "more than 1048576 tensors in all"]);
}

#[test]
fn a_tensor_in_two_shards() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::qwen2());
    // Copy one tensor of shard 1 into shard 2 as well.
    let f1 = dir.join("model-00001-of-00002.safetensors");
    let f2 = dir.join("model-00002-of-00002.safetensors");
    let (h1, d1) = split_safetensors(&std::fs::read(&f1).unwrap());
    let (mut h2, mut d2) = split_safetensors(&std::fs::read(&f2).unwrap());
    let (name, info) = h1
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v.clone()))
        .unwrap();
    let off = info["data_offsets"].as_array().unwrap();
    let (a, b) = (off[0].as_u64().unwrap(), off[1].as_u64().unwrap());
    let start = d2.len() as u64;
    d2.extend_from_slice(&d1[a as usize..b as usize]);
    let mut copy = info.clone();
    copy["data_offsets"] = serde_json::json!([start, start + (b - a)]);
    h2[&name] = copy;
    std::fs::write(&f2, join_safetensors(&h2, &d2)).unwrap();
    convert(
        &s,
        &dir,
        &[
            &name,
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "both",
        ],
    );
}

#[test]
fn config_not_json() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    std::fs::write(ckpt.join("config.json"), "architectures: [Llama]").unwrap();
    convert(&s, &ckpt, &["config.json", "not valid config JSON"]);
}

#[test]
fn config_missing_field() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| {
        j.as_object_mut().unwrap().remove("hidden_size");
    });
    convert(&s, &ckpt, &["config.json", "missing `hidden_size`"]);
}

#[test]
fn config_zero_size() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["num_hidden_layers"] = 0.into());
    convert(
        &s,
        &ckpt,
        &["config.json", "`num_hidden_layers` must be positive"],
    );
}

#[test]
fn config_negative_size() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["vocab_size"] = (-96).into());
    convert(&s, &ckpt, &["config.json", "-96"]);
}

#[test]
fn config_absurd_size() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["hidden_size"] = 1_000_000_000_000u64.into());
    convert(&s, &ckpt, &["config.json", "exceeds the limit"]);
}

#[test]
fn config_odd_head_dim() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| j["head_dim"] = 15.into());
    convert(&s, &ckpt, &["config.json", "must be even"]);
}

#[test]
fn config_rope_scaling_factor_negative() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_config(&ckpt, |j| {
        j["rope_scaling"] = serde_json::json!({"type": "linear", "factor": -2.0})
    });
    convert(
        &s,
        &ckpt,
        &["config.json", "`factor` (-2) must be a positive"],
    );
}

#[test]
fn nan_weight_in_bf16() {
    let s = Scratch::new();
    let ckpt = checkpoint(&s);
    edit_header(&ckpt, |h, data| {
        let start = h["model.norm.weight"]["data_offsets"][0].as_u64().unwrap() as usize;
        let at = start + 2 * 5;
        data[at..at + 2].copy_from_slice(&bf16::NAN.to_le_bytes());
    });
    convert(
        &s,
        &ckpt,
        &["model.safetensors", "model.norm.weight", "NaN at element 5"],
    );
}

#[test]
fn infinite_weight_in_f32() {
    let s = Scratch::new();
    let dir = write_model(&s, TinyModel::mistral());
    edit_header(&dir, |h, data| {
        let name = "model.layers.1.mlp.down_proj.weight";
        let start = h[name]["data_offsets"][0].as_u64().unwrap() as usize;
        data[start..start + 4].copy_from_slice(&f32::NEG_INFINITY.to_le_bytes());
    });
    convert(
        &s,
        &dir,
        &[
            "model.safetensors",
            "model.layers.1.mlp.down_proj.weight",
            "-inf at element 0",
        ],
    );
}

// ---- recipes and output paths ------------------------------------------------------------

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

// ---- GGUF files, through `import-gguf` (which would write out/ckpt) ----------------------

fn import(s: &Scratch, gguf: &Path, needles: &[&str]) {
    let dest = s.out().join("ckpt");
    expect_bad(
        s,
        &[
            "import-gguf".as_ref(),
            gguf.as_os_str(),
            "-o".as_ref(),
            dest.as_os_str(),
        ],
        needles,
    );
}

fn gguf_bytes() -> Vec<u8> {
    TinyGguf::llama().build().writer.to_bytes()
}

fn write_gguf(s: &Scratch, bytes: &[u8]) -> PathBuf {
    let p = s.path().join("m.gguf");
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn gguf_truncated_inside_the_header() {
    let s = Scratch::new();
    let bytes = gguf_bytes();
    let p = write_gguf(&s, &bytes[..200]);
    import(&s, &p, &["m.gguf", "file ends inside the header"]);
}

#[test]
fn gguf_truncated_inside_the_tensor_data() {
    let s = Scratch::new();
    let bytes = gguf_bytes();
    let p = write_gguf(&s, &bytes[..bytes.len() - 10]);
    import(&s, &p, &["m.gguf", "truncated", "needs bytes"]);
}

#[test]
fn gguf_bad_magic() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "are not `GGUF`"]);
}

#[test]
fn gguf_unsupported_version() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "GGUF version 1"]);
}

#[test]
fn gguf_huge_tensor_count() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "tensors declared"]);
}

#[test]
fn gguf_huge_metadata_count() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "the declared entries"]);
}

#[test]
fn gguf_unknown_metadata_value_type() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    // The first key follows the 24-byte preamble: u64 length, the key, then its u32 type.
    let key_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    let at = 32 + key_len;
    bytes[at..at + 4].copy_from_slice(&77u32.to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "unknown value type 77"]);
}

#[test]
fn gguf_unknown_tensor_type_through_convert() {
    let s = Scratch::new();
    let mut w = TinyGguf::llama().build().writer;
    let name = "blk.0.ffn_down.weight";
    let t = w.tensors.iter_mut().find(|t| t.name == name).unwrap();
    t.type_id = 99;
    let p = s.path().join("m.gguf");
    w.write(&p).unwrap();
    convert(&s, &p, &["m.gguf", name, "type 99"]);
}

#[test]
fn gguf_too_many_dimensions() {
    let s = Scratch::new();
    let mut w = TinyGguf::llama().build().writer;
    w.meta("general.alignment", Meta::U32(32));
    let name = "output_norm.weight";
    let t = w.tensors.iter_mut().find(|t| t.name == name).unwrap();
    t.shape = vec![2, 2, 2, 2, 4];
    let p = write_gguf(&s, &w.to_bytes());
    import(&s, &p, &["m.gguf", name, "5 dimensions"]);
}

// ---- .mlpackage directories, through `run` -----------------------------------------------

/// The fixture program with an hf2coreml contract in its metadata, so that `run` gets as far
/// as compiling the program.
fn contract_model(model: &mut proto::Model) {
    let c = common::contract(16, 1, 8, vec![]);
    let md = model
        .description
        .as_mut()
        .unwrap()
        .metadata
        .get_or_insert_with(Default::default);
    md.user_defined.insert(
        contract::METADATA_KEY.to_string(),
        serde_json::to_string(&c).unwrap(),
    );
}

fn write_pkg(s: &Scratch, model: &proto::Model, weights: &[u8]) -> PathBuf {
    let mut model = model.clone();
    contract_model(&mut model);
    let dir = s.path().join("m.mlpackage");
    fixture::write_model(&dir, &model, weights).unwrap();
    dir
}

fn run(s: &Scratch, pkg: &Path, needles: &[&str]) {
    expect_bad(
        s,
        &[
            "run".as_ref(),
            pkg.as_os_str(),
            "--prompt-ids".as_ref(),
            "1".as_ref(),
            "--max-new-tokens".as_ref(),
            "1".as_ref(),
        ],
        needles,
    );
}

fn model_file(pkg: &Path) -> PathBuf {
    pkg.join("Data/com.apple.CoreML/model.mlmodel")
}

fn weight_file(pkg: &Path) -> PathBuf {
    pkg.join("Data/com.apple.CoreML/weights/weight.bin")
}

/// Offset of the first blob record in the fixture's weight.bin.
const FIRST_RECORD: usize = RECORD_SIZE;

#[test]
fn package_without_manifest() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    std::fs::remove_file(pkg.join("Manifest.json")).unwrap();
    run(&s, &pkg, &["Manifest.json", "No such file"]);
}

/// The Safety section's cap on model.mlmodel (256 MiB): a (sparse) file one byte over it is
/// refused by its size, naming the file, before anything is read or allocated.
#[test]
fn package_model_over_the_size_cap() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(model_file(&pkg))
        .unwrap();
    f.set_len(hf2coreml::mlpackage::MAX_MODEL_BYTES + 1)
        .unwrap();
    assert_eq!(hf2coreml::mlpackage::MAX_MODEL_BYTES, 256 << 20);
    run(
        &s,
        &pkg,
        &[
            "model.mlmodel",
            "268435457 bytes exceeds the 268435456-byte limit",
        ],
    );
}

#[test]
fn package_manifest_not_json() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    std::fs::write(pkg.join("Manifest.json"), [0xff, 0xfe, b'{']).unwrap();
    run(&s, &pkg, &["Manifest.json", "not UTF-8"]);
}

#[test]
fn package_manifest_points_outside() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    let manifest = fixture::MANIFEST.replace("com.apple.CoreML/model.mlmodel", "../../secret");
    std::fs::write(pkg.join("Manifest.json"), manifest).unwrap();
    run(&s, &pkg, &["Manifest.json", "escapes the package"]);
}

#[cfg(unix)]
#[test]
fn package_model_is_a_symlink_out_of_the_package() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    let outside = s.path().join("elsewhere.mlmodel");
    std::fs::rename(model_file(&pkg), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, model_file(&pkg)).unwrap();
    run(&s, &pkg, &["Manifest.json", "outside the package"]);
}

#[cfg(unix)]
#[test]
fn package_weight_file_is_a_symlink_out_of_the_package() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    let outside = s.path().join("elsewhere.bin");
    std::fs::rename(weight_file(&pkg), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, weight_file(&pkg)).unwrap();
    run(&s, &pkg, &["model.mlmodel", "escapes the package"]);
}

#[test]
fn package_truncated_protobuf() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    let bytes = std::fs::read(model_file(&pkg)).unwrap();
    std::fs::write(model_file(&pkg), &bytes[..bytes.len() / 2]).unwrap();
    run(
        &s,
        &pkg,
        &["model.mlmodel", "not a valid Core ML model protobuf"],
    );
}

#[test]
fn package_blob_offset_past_the_end() {
    let s = Scratch::new();
    let (mut m, w) = fixture::tiny_program();
    let ops = &mut main_block(&mut m).operations;
    let b = ops.iter_mut().find(|o| o.r#type == "const").unwrap();
    if let Some(proto::value::Value::BlobFileValue(bv)) =
        &mut b.attributes.get_mut("val").unwrap().value
    {
        bv.offset = 1 << 40;
    }
    let pkg = write_pkg(&s, &m, &w);
    run(&s, &pkg, &["weight.bin", "past the end"]);
}

#[test]
fn package_blob_wrong_sentinel() {
    let s = Scratch::new();
    let (m, mut w) = fixture::tiny_program();
    assert_eq!(
        u32::from_le_bytes(w[FIRST_RECORD..FIRST_RECORD + 4].try_into().unwrap()),
        BLOB_SENTINEL
    );
    w[FIRST_RECORD..FIRST_RECORD + 4].copy_from_slice(&0xCAFE_F00Du32.to_le_bytes());
    let pkg = write_pkg(&s, &m, &w);
    run(&s, &pkg, &["weight.bin", "sentinel 0xcafef00d"]);
}

#[test]
fn package_blob_size_overflows() {
    let s = Scratch::new();
    let (m, mut w) = fixture::tiny_program();
    let at = FIRST_RECORD + 8;
    w[at..at + 8].copy_from_slice(&(u64::MAX - 16).to_le_bytes());
    let pkg = write_pkg(&s, &m, &w);
    run(&s, &pkg, &["weight.bin", "past the end"]);
}

#[test]
fn package_weight_file_truncated_to_its_header() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w[..RECORD_SIZE]);
    run(&s, &pkg, &["weight.bin", "record past the end"]);
}

fn main_block(m: &mut proto::Model) -> &mut proto::Block {
    m.ml_program
        .as_mut()
        .unwrap()
        .functions
        .get_mut("main")
        .unwrap()
        .block_specializations
        .get_mut("CoreML7")
        .unwrap()
}

#[test]
fn package_op_references_an_undefined_value() {
    let s = Scratch::new();
    let (mut m, w) = fixture::tiny_program();
    let linear = main_block(&mut m)
        .operations
        .iter_mut()
        .find(|o| o.r#type == "linear")
        .unwrap();
    linear.inputs.get_mut("bias").unwrap().arguments[0].binding =
        Some(proto::binding::Binding::Name("ghost".into()));
    let pkg = write_pkg(&s, &m, &w);
    run(&s, &pkg, &["m.mlpackage", "`ghost`", "not defined before"]);
}

#[test]
fn package_ops_form_a_cycle() {
    let s = Scratch::new();
    let (mut m, w) = fixture::tiny_program();
    let block = main_block(&mut m);
    // a = add(x, b); b = add(a, x): each needs the other first.
    block.operations.push(fixture::op(
        "add",
        &[("x", "x"), ("y", "b2")],
        "a2",
        DType::F16,
        &[1, 8],
    ));
    block.operations.push(fixture::op(
        "add",
        &[("x", "a2"), ("y", "x")],
        "b2",
        DType::F16,
        &[1, 8],
    ));
    block.outputs.push("b2".into());
    let pkg = write_pkg(&s, &m, &w);
    run(&s, &pkg, &["m.mlpackage", "`b2`", "not defined before"]);
}

#[test]
fn package_blob_dtype_disagrees_with_the_declared_type() {
    let s = Scratch::new();
    let (m, _) = fixture::tiny_program();
    // Same layout, but the bias blob written as bf16 where the program declares fp16.
    let mut w = BlobWriter::new();
    let indices: Vec<u32> = (0..32).map(|i| (i * 7) % 16).collect();
    w.push(DType::U8, &hf2coreml::mlpackage::pack_bits(&indices, 4));
    w.push(DType::F16, &[0u8; 32]);
    w.push(DType::BF16, &[0u8; 8]);
    let pkg = write_pkg(&s, &m, &w.finish());
    run(&s, &pkg, &["weight.bin", "blob holds bf16"]);
}

#[test]
fn package_huge_declared_rank() {
    let s = Scratch::new();
    let (mut m, w) = fixture::tiny_program();
    let f = m
        .ml_program
        .as_mut()
        .unwrap()
        .functions
        .get_mut("main")
        .unwrap();
    f.inputs[0].r#type = Some(fixture::value_type(DType::F16, &[1; 40]));
    let pkg = write_pkg(&s, &m, &w);
    run(&s, &pkg, &["m.mlpackage", "rank 40 exceeds the limit"]);
}

// ---- command-line sizes ------------------------------------------------------------------

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
