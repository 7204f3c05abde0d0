//! Hostile and broken .mlpackage directories, through `run`: Manifest.json, the protobuf,
//! weight.bin and its blob records, the program (undefined values, cycles, declared sizes and
//! shapes that would allocate without bound), the contract, and special files in place of the
//! package's files or the tokenizer beside it. Every case exits 2 naming the file and the
//! problem, within its time and memory bounds (see the parent module).

use std::path::{Path, PathBuf};
use std::time::Duration;

use hf2coreml::mil::contract;
use hf2coreml::mil::DType;
use hf2coreml::mlpackage::blob::{BLOB_SENTINEL, RECORD_SIZE};
use hf2coreml::mlpackage::{proto, BlobWriter};
use hf2coreml_testkit::mlpackage as fixture;

use super::{expect, mkfifo, os, Scratch};
use crate::support::{assert_refused, hf2coreml, toy};

// ---- packages: declared sizes, contract, protobuf ----------------------------------------

/// A program with the contract's four inputs ([L=2, Hkv=2, S=`s`, D=3] caches, Q=1), the
/// given ops and outputs, and a contract claiming max_seq_len `contract_s`.
fn contract_package(
    root: &Path,
    s: usize,
    contract_s: usize,
    ops: Vec<proto::Operation>,
    outputs: Vec<String>,
) -> PathBuf {
    let cache = vec![2, 2, s, 3];
    let mut m = fixture::model(
        vec![
            (contract::INPUT_IDS, DType::I32, vec![1, 1]),
            (contract::POSITION, DType::I32, vec![1]),
            (contract::KEY_CACHE, DType::F16, cache.clone()),
            (contract::VALUE_CACHE, DType::F16, cache),
        ],
        ops,
        outputs,
    );
    let c = toy::contract(contract_s, 1, 8, vec![]);
    m.description
        .as_mut()
        .unwrap()
        .metadata
        .as_mut()
        .unwrap()
        .user_defined
        .insert(
            contract::METADATA_KEY.into(),
            serde_json::to_string(&c).unwrap(),
        );
    let dir = root.join("m.mlpackage");
    fixture::write_model(&dir, &m, &hf2coreml::mlpackage::BlobWriter::new().finish()).unwrap();
    dir
}

fn run_package(root: &Path, pkg: &Path, needles: &[&str]) {
    expect(
        root,
        &[
            os("run"),
            pkg.as_os_str(),
            os("--prompt-ids"),
            os("1"),
            os("--max-new-tokens"),
            os("1"),
        ],
        2,
        needles,
    );
}

fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

#[test]
fn contract_max_seq_len_above_the_program_is_refused_before_allocating() {
    for s in [1usize << 28, 1 << 40] {
        let root = tempfile::tempdir().unwrap();
        let pkg = contract_package(root.path(), 16, s, vec![], vec![]);
        run_package(
            root.path(),
            &pkg,
            &[
                "contract",
                "key_cache",
                "the program declares [2, 2, 16, 3]",
            ],
        );
    }
}

#[test]
fn a_program_declaring_a_huge_cache_is_refused_at_load() {
    let root = tempfile::tempdir().unwrap();
    let pkg = contract_package(root.path(), 1 << 28, 1 << 28, vec![], vec![]);
    run_package(
        root.path(),
        &pkg,
        &["input `key_cache`", "limit for one tensor"],
    );
}

#[test]
fn fill_of_a_huge_declared_shape_is_refused_at_load() {
    let root = tempfile::tempdir().unwrap();
    let shape = fixture::bytes_value(
        DType::I32,
        &[2],
        le_bytes(&[1i32 << 20, 1 << 20], i32::to_le_bytes),
    );
    let ops = vec![
        fixture::const_op("shape", shape),
        fixture::op(
            "fill",
            &[("shape", "shape")],
            "big",
            DType::F32,
            &[1 << 20, 1 << 20],
        ),
    ];
    let pkg = contract_package(root.path(), 16, 16, ops, vec!["big".into()]);
    run_package(root.path(), &pkg, &["`big`", "limit for one tensor"]);
}

#[test]
fn tile_with_huge_reps_is_refused_before_allocating() {
    let root = tempfile::tempdir().unwrap();
    let reps = fixture::bytes_value(
        DType::I32,
        &[2],
        le_bytes(&[1i32, 1 << 30], i32::to_le_bytes),
    );
    let ops = vec![
        fixture::const_op("reps", reps),
        fixture::op(
            "tile",
            &[("x", contract::INPUT_IDS), ("reps", "reps")],
            "tiled",
            DType::I32,
            &[1, 1],
        ),
    ];
    let pkg = contract_package(root.path(), 16, 16, ops, vec!["tiled".into()]);
    run_package(root.path(), &pkg, &["tile", "refused before allocating"]);
}

#[test]
fn range_1d_to_1e30_is_refused_before_allocating() {
    let root = tempfile::tempdir().unwrap();
    let scalar = |v: f32| fixture::bytes_value(DType::F32, &[], v.to_le_bytes().to_vec());
    let ops = vec![
        fixture::const_op("start", scalar(0.0)),
        fixture::const_op("end", scalar(1e30)),
        fixture::const_op("step", scalar(1.0)),
        fixture::op(
            "range_1d",
            &[("start", "start"), ("end", "end"), ("step", "step")],
            "r",
            DType::F32,
            &[8],
        ),
    ];
    let pkg = contract_package(root.path(), 16, 16, ops, vec!["r".into()]);
    run_package(
        root.path(),
        &pkg,
        &["range_1d", "refused before allocating"],
    );
}

#[test]
fn many_constants_together_are_refused_when_their_sum_passes_the_limit() {
    // Each 96 MiB constant fits the per-tensor limit; five of them do not fit together.
    let root = tempfile::tempdir().unwrap();
    let n = 24usize << 20; // f32 elements: 96 MiB each
    let shape = fixture::bytes_value(DType::I32, &[1], le_bytes(&[n as i32], i32::to_le_bytes));
    let mut ops = vec![fixture::const_op("shape", shape)];
    let mut outs = vec![];
    for i in 0..8 {
        let name = format!("f{i}");
        ops.push(fixture::op(
            "fill",
            &[("shape", "shape")],
            &name,
            DType::F32,
            &[n],
        ));
        outs.push(name);
    }
    let pkg = contract_package(root.path(), 16, 16, ops, outs);
    run_package(root.path(), &pkg, &["live at once", "limit"]);
}

#[test]
fn a_protobuf_of_millions_of_empty_entries_is_refused_in_bounded_memory() {
    let root = tempfile::tempdir().unwrap();
    let (m, w) = fixture::tiny_program();
    let dir = root.path().join("m.mlpackage");
    fixture::write_model(&dir, &m, &w).unwrap();
    // Append a Program (field 502) whose one function's block holds 10 million empty
    // operations: 20 MB on disk, ~2 GB decoded.
    let n = 10_000_000usize;
    let mut block = Vec::with_capacity(2 * n);
    for _ in 0..n {
        block.extend_from_slice(&[0x1a, 0x00]);
    }
    let msg = |tag: &[u8], body: &[u8]| {
        let mut v = tag.to_vec();
        let mut len = body.len();
        while len >= 0x80 {
            v.push((len as u8 & 0x7f) | 0x80);
            len >>= 7;
        }
        v.push(len as u8);
        v.extend_from_slice(body);
        v
    };
    let entry = [&[0x0a, 0x01, b'x'][..], &msg(&[0x12], &block)].concat();
    let function = msg(&[0x1a], &entry);
    let fentry = [&[0x0a, 0x04][..], b"main", &msg(&[0x12], &function)].concat();
    let program = msg(&[0x12], &fentry);
    let model_file = dir.join("Data/com.apple.CoreML/model.mlmodel");
    let mut bytes = std::fs::read(&model_file).unwrap();
    bytes.extend_from_slice(&msg(&[0xb2, 0x1f], &program));
    std::fs::write(&model_file, &bytes).unwrap();
    let o = expect(
        root.path(),
        &[os("run"), dir.as_os_str(), os("--prompt-ids"), os("1")],
        2,
        &["model.mlmodel", "more than", "bytes of memory"],
    );
    assert!(o.max_rss < 256 << 20, "peak RSS {} MiB", o.max_rss >> 20);
}

#[cfg(unix)]
#[test]
fn a_fifo_weight_file_is_refused_at_once() {
    let root = tempfile::tempdir().unwrap();
    let (mut m, w) = fixture::tiny_program();
    let c = toy::contract(16, 1, 8, vec![]);
    let md = m.description.as_mut().unwrap().metadata.as_mut().unwrap();
    md.user_defined.insert(
        contract::METADATA_KEY.into(),
        serde_json::to_string(&c).unwrap(),
    );
    let dir = root.path().join("m.mlpackage");
    fixture::write_model(&dir, &m, &w).unwrap();
    let wb = dir.join("Data/com.apple.CoreML/weights/weight.bin");
    std::fs::remove_file(&wb).unwrap();
    mkfifo(&wb);
    let o = expect(
        root.path(),
        &[os("run"), dir.as_os_str(), os("--prompt-ids"), os("1")],
        2,
        &["weight.bin", "not a regular file"],
    );
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);
}

#[cfg(unix)]
#[test]
fn a_fifo_or_dev_zero_tokenizer_beside_the_package_is_refused_at_once() {
    for special in ["fifo", "/dev/zero"] {
        let root = tempfile::tempdir().unwrap();
        let pkg = contract_package(root.path(), 16, 16, vec![], vec![]);
        let tok = root.path().join("m.tokenizer.json");
        if special == "fifo" {
            mkfifo(&tok);
        } else {
            std::os::unix::fs::symlink(special, &tok).unwrap();
        }
        let o = expect(
            root.path(),
            &[os("run"), pkg.as_os_str(), os("--prompt"), os("hi")],
            2,
            &["m.tokenizer.json", "not a regular file"],
        );
        assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);
    }
}

// ---- .mlpackage files: Manifest, protobuf, weight.bin, the program ----------------------

/// The fixture program with an hf2coreml contract in its metadata, so that `run` gets as far
/// as compiling the program.
fn contract_model(model: &mut proto::Model) {
    let c = toy::contract(16, 1, 8, vec![]);
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
    run_package(s.path(), &pkg, &["Manifest.json", "No such file"]);
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
    run_package(
        s.path(),
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
    run_package(s.path(), &pkg, &["Manifest.json", "not UTF-8"]);
}

#[test]
fn package_manifest_points_outside() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    let manifest = fixture::MANIFEST.replace("com.apple.CoreML/model.mlmodel", "../../secret");
    std::fs::write(pkg.join("Manifest.json"), manifest).unwrap();
    run_package(s.path(), &pkg, &["Manifest.json", "escapes the package"]);
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
    run_package(s.path(), &pkg, &["Manifest.json", "outside the package"]);
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
    run_package(s.path(), &pkg, &["model.mlmodel", "escapes the package"]);
}

#[test]
fn package_truncated_protobuf() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    let bytes = std::fs::read(model_file(&pkg)).unwrap();
    std::fs::write(model_file(&pkg), &bytes[..bytes.len() / 2]).unwrap();
    run_package(
        s.path(),
        &pkg,
        &["model.mlmodel", "not a valid Core ML model protobuf"],
    );
}

/// An empty model.mlmodel decodes as a default protobuf: every reader refuses it by name
/// instead of describing "specification 0, weights 0 B".
#[test]
fn package_with_an_empty_model_file() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w);
    std::fs::write(model_file(&pkg), b"").unwrap();
    run_package(s.path(), &pkg, &["model.mlmodel", "holds no ML program"]);
    for verb in ["inspect", "lint"] {
        expect(
            s.path(),
            &[os(verb), pkg.as_os_str()],
            2,
            &["model.mlmodel", "holds no ML program"],
        );
    }
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
    run_package(s.path(), &pkg, &["weight.bin", "past the end"]);
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
    run_package(s.path(), &pkg, &["weight.bin", "sentinel 0xcafef00d"]);
}

#[test]
fn package_blob_size_overflows() {
    let s = Scratch::new();
    let (m, mut w) = fixture::tiny_program();
    let at = FIRST_RECORD + 8;
    w[at..at + 8].copy_from_slice(&(u64::MAX - 16).to_le_bytes());
    let pkg = write_pkg(&s, &m, &w);
    run_package(s.path(), &pkg, &["weight.bin", "past the end"]);
}

#[test]
fn package_weight_file_truncated_to_its_header() {
    let s = Scratch::new();
    let (m, w) = fixture::tiny_program();
    let pkg = write_pkg(&s, &m, &w[..RECORD_SIZE]);
    run_package(s.path(), &pkg, &["weight.bin", "record past the end"]);
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
    run_package(
        s.path(),
        &pkg,
        &["m.mlpackage", "`ghost`", "not defined before"],
    );
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
    run_package(
        s.path(),
        &pkg,
        &["m.mlpackage", "`b2`", "not defined before"],
    );
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
    run_package(s.path(), &pkg, &["weight.bin", "blob holds bf16"]);
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
    run_package(
        s.path(),
        &pkg,
        &["m.mlpackage", "rank 40 exceeds the limit"],
    );
}

#[test]
fn manifest_over_1_mib_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    std::fs::create_dir_all(pkg.join("Data/com.apple.CoreML")).unwrap();
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(1 << 20));
    std::fs::write(pkg.join("Manifest.json"), big).unwrap();
    let o = hf2coreml(&["run", pkg.to_str().unwrap(), "--prompt-ids", "1"]);
    assert_refused(&o, &["Manifest.json"]);
}
