//! Issue 27, round two of hostile inputs, through the binary. Every case runs under a
//! timeout with its peak memory measured (wait4's ru_maxrss of that one child): it must exit
//! with the documented code, never panic, abort or hang, stay under 1 GiB, and leave nothing
//! behind. The hostile inputs are built in code.

mod common;

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hf2coreml::mil::contract;
use hf2coreml::mil::DType;
use hf2coreml::mlpackage::proto;
use hf2coreml::testing::mlpackage as fixture;
use hf2coreml::testing::TinyModel;

/// Every case finishes well within this (the slowest, a tiny conversion, takes seconds).
const TIMEOUT: Duration = Duration::from_secs(120);
/// The acceptance bound on peak RSS for packages whose files total under 300 MB.
const MAX_RSS_BYTES: u64 = 1 << 30;

struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    max_rss: u64,
    elapsed: Duration,
}

/// Run the binary with `args` (stdout to `stdout` if given), under [`TIMEOUT`], measuring
/// the child's own peak RSS with wait4.
fn run_bin(args: &[&OsStr], stdout: Option<std::fs::File>) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (dir.path().join("out"), dir.path().join("err"));
    let out_file = match stdout {
        Some(f) => f,
        None => std::fs::File::create(&out_path).unwrap(),
    };
    let started = Instant::now();
    // Reaped by wait4 below (which also gives its peak RSS), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_hf2coreml"))
        .args(args)
        .env("CI", "1")
        .stdin(Stdio::null())
        .stdout(out_file)
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let (status, usage) = loop {
        let mut status = 0;
        // SAFETY: rusage is plain data; wait4 fills it for our own child.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break (status, usage);
        }
        if started.elapsed() > TIMEOUT {
            // SAFETY: our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{args:?} hung: killed after {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Outcome {
        code,
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap(),
        max_rss: usage.ru_maxrss as u64 * 1024,
        elapsed: started.elapsed(),
    }
}

/// Top-level names in `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Expect `code`, every needle in stderr, no panic, bounded memory, and `root` unchanged.
fn expect(root: &Path, args: &[&OsStr], code: i32, needles: &[&str]) -> Outcome {
    let before = entries(root);
    let o = run_bin(args, None);
    assert_eq!(
        o.code,
        Some(code),
        "{args:?}\nstdout: {}\nstderr: {}",
        o.stdout,
        o.stderr
    );
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    for n in needles {
        assert!(o.stderr.contains(n), "`{n}` not in stderr:\n{}", o.stderr);
    }
    assert!(
        o.max_rss < MAX_RSS_BYTES,
        "peak RSS {} MiB",
        o.max_rss >> 20
    );
    assert_eq!(entries(root), before, "left behind; stderr:\n{}", o.stderr);
    o
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

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
    let c = common::contract(contract_s, 1, 8, vec![]);
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

// ---- special files ------------------------------------------------------------------------

#[cfg(unix)]
fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

#[cfg(unix)]
#[test]
fn a_fifo_weight_file_is_refused_at_once() {
    let root = tempfile::tempdir().unwrap();
    let (mut m, w) = fixture::tiny_program();
    let c = common::contract(16, 1, 8, vec![]);
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

// ---- outputs ------------------------------------------------------------------------------

fn tiny_checkpoint(root: &Path) -> PathBuf {
    let ckpt = root.join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    TinyModel::llama().write(&ckpt).unwrap();
    ckpt
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

// ---- stdout and the terminal ----------------------------------------------------------------

#[cfg(target_os = "linux")]
#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let cases: Vec<Vec<&OsStr>> = vec![
        vec![os("inspect"), ckpt.as_os_str()],
        vec![os("inspect"), ckpt.as_os_str(), os("--json")],
        vec![os("completions"), os("bash")],
        vec![
            os("budget"),
            ckpt.as_os_str(),
            os("--device"),
            os("iphone-15"),
        ],
    ];
    for args in cases {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let o = run_bin(&args, Some(full));
        assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
        assert!(
            o.code == Some(3) || o.code == Some(2),
            "{args:?}: exit {:?}\n{}",
            o.code,
            o.stderr
        );
        assert!(o.stderr.contains("No space left"), "{args:?}: {}", o.stderr);
    }
}

#[test]
fn control_bytes_from_config_json_are_escaped() {
    let root = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(root.path());
    let cfg = ckpt.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    json["architectures"] = serde_json::json!(["\u{1b}[31mEvil\u{7}\u{202e}Model"]);
    std::fs::write(&cfg, json.to_string()).unwrap();
    let o = expect(root.path(), &[os("inspect"), ckpt.as_os_str()], 2, &[]);
    for raw in ['\u{1b}', '\u{7}', '\u{202e}'] {
        assert!(!o.stderr.contains(raw), "raw {raw:?} in {:?}", o.stderr);
    }
    assert!(o.stderr.contains("\\u{1b}[31mEvil"), "{}", o.stderr);
}

#[cfg(unix)]
#[test]
fn a_fifo_gguf_or_device_table_is_refused_at_once() {
    let root = tempfile::tempdir().unwrap();
    let fifo = root.path().join("m.gguf");
    mkfifo(&fifo);
    let out = root.path().join("ckpt");
    let o = expect(
        root.path(),
        &[
            os("import-gguf"),
            fifo.as_os_str(),
            os("-o"),
            out.as_os_str(),
        ],
        2,
        &["m.gguf", "not a regular file"],
    );
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);
    let o = expect(
        root.path(),
        &[os("inspect"), fifo.as_os_str()],
        2,
        &["m.gguf"],
    );
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);

    let ckpt = root.path().join("tiny");
    std::fs::create_dir(&ckpt).unwrap();
    TinyModel::llama().write(&ckpt).unwrap();
    let table = root.path().join("devices.toml");
    mkfifo(&table);
    let o = expect(
        root.path(),
        &[
            os("budget"),
            ckpt.as_os_str(),
            os("--devices"),
            table.as_os_str(),
            os("--device"),
            os("x"),
        ],
        2,
        &["devices.toml", "not a regular file"],
    );
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);
}
