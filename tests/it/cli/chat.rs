//! `run --chat` as a session and the KV-cache file, through the CLI
//! on a tiny model converted in the test (a byte-level tokenizer and a ChatML template beside
//! it): a piped session streams one reply per line, `/reset` and `/exit` work, a full context
//! ends the session with a message (exit 0); one package and its chain chat alike; a cache saved
//! by one run and loaded by the next gives the logits of the uninterrupted run bit for bit; a
//! damaged or foreign cache file is refused (exit 2).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::OnceLock;

use hf2coreml::runtime::kvfile::{KvFile, MAGIC};
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, stderr, toy, Cli};

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Byte ids plus `<|im_start|>`, `<|im_end|>`; four blocks so a chain splits it.
fn model() -> TinyModel {
    TinyModel {
        vocab: 258,
        layers: 4,
        logit_gain: 4.0,
        ..TinyModel::llama()
    }
}

struct Fixture {
    _root: tempfile::TempDir,
    one: PathBuf,
    chain: PathBuf,
    /// The same model at another max_seq_len: another contract.
    other: PathBuf,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let src = model().write_temp().unwrap();
        std::fs::write(
            src.path().join("tokenizer.json"),
            toy::byte_tokenizer_json(),
        )
        .unwrap();
        let config = serde_json::json!({"chat_template": CHATML, "eos_token": "<|im_end|>"});
        std::fs::write(src.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let root = tempfile::tempdir().unwrap();
        let one = root.path().join("one.mlpackage");
        let chain = root.path().join("chain.mlpackage");
        let other = root.path().join("other.mlpackage");
        convert(src.path(), &one)
            .args(["--keep-fp16", "*", "-q"])
            .args(["--max-seq-len", "96"])
            .ok();
        convert(src.path(), &chain)
            .args(["--keep-fp16", "*", "-q"])
            .args(["--max-seq-len", "96", "--max-package-size", "1200000"])
            .ok();
        convert(src.path(), &other)
            .args(["--keep-fp16", "*", "-q"])
            .args(["--max-seq-len", "80"])
            .ok();
        Fixture {
            _root: root,
            one,
            chain,
            other,
        }
    })
}

fn run(pkg: &Path, args: &[&str], stdin: &str) -> Output {
    let mut child = Cli::new()
        .arg("run")
        .arg(pkg)
        .args(args)
        .command()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// The "prompt: N tokens" figure of each turn's report line.
fn prompt_tokens(err: &str) -> Vec<usize> {
    err.lines()
        .filter_map(|l| l.strip_prefix("prompt: "))
        .map(|l| l.split(' ').next().unwrap().parse().unwrap())
        .collect()
}

const CHAT: &[&str] = &["--chat", "--max-new-tokens", "6", "--ignore-eos"];

#[test]
fn a_piped_session_replies_per_line_and_feeds_only_the_new_turn() {
    needs!(Python);
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kv.bin");
    let args = [CHAT, &["--save-cache", cache.to_str().unwrap()]].concat();
    let o = run(&f.one, &args, "hi\n\nhow are you\n/exit\nnever read\n");
    let out = ok(&o);
    let err = stderr(&o);
    let fed = prompt_tokens(&err);
    assert_eq!(fed.len(), 2, "two turns: {err}");
    // Turn 1: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n".
    assert_eq!(fed[0], 1 + 4 + 1 + 2 + 1 + 1 + 1 + 9 + 1, "{err}");
    // The cache at exit: turn 2's whole prompt and its reply but the last token.
    let saved = std::fs::read(&cache).unwrap();
    let tokens = u32::from_le_bytes(saved[64..68].try_into().unwrap()) as usize;
    let turn2 = tokens - 5;
    assert!(
        fed[1] <= turn2 - fed[0],
        "turn 2 fed {} of its {turn2} tokens: {err}",
        fed[1]
    );

    // The end of input ends the session as /exit does.
    let eof = run(&f.one, CHAT, "hi\nhow are you\n");
    assert_eq!(ok(&eof), out);

    // /reset forgets the conversation: the turn after it is the first turn again.
    let reset = run(&f.one, CHAT, "how are you\n/reset\nhow are you\n");
    let text = ok(&reset);
    let (a, b) = text.split_at(text.len() / 2);
    assert!(a == b && a.ends_with('\n'), "{text:?}");
    let fed = prompt_tokens(&stderr(&reset));
    assert_eq!(fed.len(), 2);
    assert_eq!(fed[0], fed[1]);
}

#[test]
fn a_chain_chats_as_its_package_does() {
    needs!(Python);
    let f = fixture();
    let input = "hi\nhow are you\n";
    let a = run(&f.one, CHAT, input);
    let b = run(&f.chain, CHAT, input);
    assert_eq!(prompt_tokens(&stderr(&a)).len(), 2);
    assert_eq!(ok(&a), ok(&b));
}

#[test]
fn a_full_context_ends_the_session_with_a_message() {
    needs!(Python);
    let f = fixture();
    // 96 positions: the second long turn does not fit.
    let long = "x".repeat(40);
    let o = run(&f.one, CHAT, &format!("{long}\n{long}\nnever answered\n"));
    let out = ok(&o);
    let err = stderr(&o);
    assert!(err.contains("the context is full (96 tokens"), "{err}");
    assert!(out.ends_with('\n'), "{out:?}");
    assert_eq!(prompt_tokens(&err).len(), 1, "one turn answered: {err}");
}

/// Float32 rows of a --logits-out file (the data after the 64-byte-aligned header).
fn npy_rows(path: &Path) -> Vec<u8> {
    let b = std::fs::read(path).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hlen..].to_vec()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_str(&ok(o)).unwrap()
}

fn ids(v: &serde_json::Value, key: &str) -> Vec<u64> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn csv(ids: &[u64]) -> String {
    ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

const A: &str = "72,101,108,108,111,44,32";
const B: &str = "119,111,114,108,100";
const GEN: &[&str] = &["--max-new-tokens", "5", "--ignore-eos", "--json"];

#[test]
fn a_resumed_run_gives_the_uninterrupted_logits_bit_for_bit() {
    needs!(Python);
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kv.bin");
    let c = cache.to_str().unwrap();
    let first = json(&run(
        &f.one,
        &[&["--prompt-ids", A, "--save-cache", c][..], GEN].concat(),
        "",
    ));
    let kv = std::fs::read(&cache).unwrap();
    assert_eq!(&kv[..8], MAGIC);

    let resumed_npy = dir.path().join("resumed.npy");
    let resumed = json(&run(
        &f.one,
        &[
            &["--prompt-ids", B, "--load-cache", c, "--logits-out"][..],
            &[resumed_npy.to_str().unwrap()],
            GEN,
        ]
        .concat(),
        "",
    ));
    // The uninterrupted run: A, what the first run generated, then B.
    let whole = [ids(&first, "prompt_ids"), ids(&first, "generated_ids")].concat();
    let b: Vec<u64> = B.split(',').map(|x| x.parse().unwrap()).collect();
    let whole = [whole, b].concat();
    assert_eq!(ids(&resumed, "prompt_ids"), whole);
    let whole_npy = dir.path().join("whole.npy");
    let straight = json(&run(
        &f.one,
        &[
            &["--prompt-ids", &csv(&whole), "--logits-out"][..],
            &[whole_npy.to_str().unwrap()],
            GEN,
        ]
        .concat(),
        "",
    ));
    assert_eq!(
        ids(&resumed, "generated_ids"),
        ids(&straight, "generated_ids")
    );
    // The resumed run computed only the positions past the cache (the first run's last token
    // had no row yet): the same rows as the tail of the uninterrupted run's, bit for bit.
    let resumed_rows = npy_rows(&resumed_npy);
    let whole_rows = npy_rows(&whole_npy);
    let v = 258 * 4;
    let fed = 5 + 1;
    assert_eq!(resumed_rows.len(), (fed + 4) * v);
    assert!(resumed_rows[..] == whole_rows[whole_rows.len() - resumed_rows.len()..]);
}

#[test]
fn a_chat_saved_at_exit_resumes_where_it_stopped() {
    needs!(Python);
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("chat.kv");
    let c = cache.to_str().unwrap();
    let whole = ok(&run(&f.one, CHAT, "hi\nhow are you\n"));
    let first = ok(&run(&f.one, &[CHAT, &["--save-cache", c]].concat(), "hi\n"));
    let o = run(
        &f.one,
        &[CHAT, &["--load-cache", c]].concat(),
        "how are you\n",
    );
    let second = ok(&o);
    assert_eq!(format!("{first}{second}"), whole);
    // Only the new turn was fed: the restored rows were not recomputed.
    let whole_fed = prompt_tokens(&stderr(&run(&f.one, CHAT, "hi\nhow are you\n")));
    assert_eq!(prompt_tokens(&stderr(&o)), whole_fed[1..]);
}

#[test]
fn damaged_or_foreign_cache_files_are_refused() {
    needs!(Python);
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kv.bin");
    let c = cache.to_str().unwrap();
    ok(&run(
        &f.one,
        &[
            "--prompt-ids",
            A,
            "--save-cache",
            c,
            "--max-new-tokens",
            "2",
        ],
        "",
    ));
    let good = std::fs::read(&cache).unwrap();
    let contract =
        hf2coreml::runtime::chain_runner::Saved::load(&f.one, Default::default()).unwrap();
    let kv = KvFile::load(&cache, contract.contract()).unwrap();
    assert_eq!(kv.tokens.len(), 7 + 2);
    assert_eq!(kv.position, 7 + 1);
    // The hash an app computes: sha256 of the contract metadata string as the package stores it.
    let pkg = hf2coreml::mlpackage::MlPackage::open(&f.one).unwrap();
    let stored = &pkg.description().user_defined[hf2coreml::mil::contract::METADATA_KEY];
    let digest: [u8; 32] = {
        use sha2::Digest;
        sha2::Sha256::digest(stored.as_bytes()).into()
    };
    assert_eq!(kv.contract_hash, digest);

    let refused = |bytes: &[u8], pkg: &Path, what: &str| {
        let bad = dir.path().join("bad.bin");
        std::fs::write(&bad, bytes).unwrap();
        let o = run(
            pkg,
            &["--prompt-ids", B, "--load-cache", bad.to_str().unwrap()],
            "",
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{what}: {err}");
        assert!(
            err.contains(what) && err.contains("bad.bin"),
            "{what}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    };
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 1;
    refused(&flipped, &f.one, "checksum");
    refused(&good[..good.len() - 1], &f.one, "the header declares");
    refused(&good[..20], &f.one, "shorter than the header");
    let mut magic = good.clone();
    magic[0] = b'X';
    refused(&magic, &f.one, "magic");
    let mut version = good.clone();
    version[8] = 2;
    refused(&version, &f.one, "version 2");
    // A position past the tokens, declared in an otherwise well-formed header.
    let mut position = good.clone();
    position[60] = 200;
    refused(&position, &f.one, "position 200");
    // Another package: its contract differs (max_seq_len 80).
    refused(&good, &f.other, "does not fit the package");
    // The same dimensions but another contract: only the hash tells.
    let mut other_hash = good.clone();
    other_hash[12] ^= 0xff;
    let n = other_hash.len() - 32;
    let sum = {
        use sha2::Digest;
        sha2::Sha256::digest(&other_hash[..n])
    };
    other_hash[n..].copy_from_slice(&sum);
    refused(&other_hash, &f.one, "different package");

    // A chat resumes only a chat's cache; a session cannot honour --json or --logits-out.
    let o = run(&f.one, &["--chat", "--load-cache", c], "hi\n");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("saved without --chat"),
        "{}",
        stderr(&o)
    );
    for flag in [&["--json"][..], &["--logits-out", "x.npy"]] {
        let o = run(&f.one, &[&["--chat"][..], flag].concat(), "hi\n");
        assert_eq!(o.status.code(), Some(2), "{flag:?}");
        assert!(stderr(&o).contains("need --prompt"), "{}", stderr(&o));
    }
}

/// A line longer than the context can hold is refused as it is read: 12 MB on one line, and
/// `/dev/zero` as stdin (a line that never ends), end the session with exit 2 and the reason,
/// in bounded memory: the address space is capped at 1 GiB, under which an unbounded line
/// buffer would abort, and the same cap lets an ordinary session through.
#[test]
fn a_line_longer_than_the_context_is_refused_as_it_is_read() {
    use std::os::unix::process::CommandExt;
    needs!(Python);
    let f = fixture();
    let session = |stdin: Stdio, feed: Option<Vec<u8>>| {
        let mut cmd = Cli::new().arg("run").arg(&f.one).args(CHAT).command();
        cmd.stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                let cap = libc::rlimit {
                    rlim_cur: 1 << 30,
                    rlim_max: 1 << 30,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &cap) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        if let Some(bytes) = feed {
            let mut pipe = child.stdin.take().unwrap();
            // The child may stop reading (and close the pipe) before the end.
            std::thread::spawn(move || drop(pipe.write_all(&bytes)));
        }
        child.wait_with_output().unwrap()
    };
    let fine = session(Stdio::piped(), Some(b"hello\n".to_vec()));
    ok(&fine);
    let mut long = vec![b'a'; 12 << 20];
    long.push(b'\n');
    for (what, o) in [
        ("a 12 MB line", session(Stdio::piped(), Some(long))),
        (
            "/dev/zero",
            session(std::fs::File::open("/dev/zero").unwrap().into(), None),
        ),
    ] {
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{what}: {err}");
        assert!(
            err.contains("cannot fit in the context (96 tokens)"),
            "{what}: {err}"
        );
    }
}

/// Streamed text to a full stdout ends the run as any unwritable result does: exit 3, one line.
#[test]
fn a_streamed_reply_to_a_full_stdout_is_exit_3_and_one_line() {
    needs!(Python);
    let f = fixture();
    let o = Cli::new()
        .arg("run")
        .arg(&f.one)
        .args(["--prompt", "hi", "--max-new-tokens", "4", "-q"])
        .command()
        .stdout(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        )
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: cannot write the results"), "{err}");
}

/// Cache files no chat with this package could have written are refused naming the file,
/// before their conversation is rendered or tokenized: a NaN key row, 300,000 empty
/// messages (more than the context's positions), one 15 MB message (more text than 96 tokens
/// spell), the last two under the 1 GiB address-space cap the long-line test uses.
#[test]
fn cache_files_no_chat_could_write_are_refused_naming_the_file() {
    use std::os::unix::process::CommandExt;
    needs!(Python);
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("chat.kv");
    let c = cache.to_str().unwrap();
    ok(&run(&f.one, &[CHAT, &["--save-cache", c]].concat(), "hi\n"));
    let pkg = hf2coreml::runtime::chain_runner::Saved::load(&f.one, Default::default()).unwrap();
    let good = KvFile::load(&cache, pkg.contract()).unwrap();
    let bad = dir.path().join("bad.kv");
    let refused = |kv: &KvFile, needle: &str| {
        kv.save(&bad).unwrap();
        let mut cmd = Cli::new()
            .arg("run")
            .arg(&f.one)
            .args(CHAT)
            .args(["--load-cache", bad.to_str().unwrap()])
            .command();
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                let cap = libc::rlimit {
                    rlim_cur: 1 << 30,
                    rlim_max: 1 << 30,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &cap) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let o = cmd.output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{needle}: {err}");
        assert!(
            err.contains(needle) && err.contains("bad.kv"),
            "{needle}: {err}"
        );
        assert!(!err.contains("template"), "{needle}: {err}");
    };
    let mut nan = good.clone();
    let at = nan.keys.len() / 2;
    nan.keys[at] = half::f16::NAN;
    refused(&nan, "the keys hold NaN at layer");
    let mut inf = good.clone();
    inf.values[0] = half::f16::NEG_INFINITY;
    refused(
        &inf,
        "the values hold -inf at layer 0, KV head 0, position 0",
    );
    let mut many = good.clone();
    let empty = serde_json::json!({"role": "user", "content": ""});
    many.conversation = serde_json::to_string(&vec![empty; 300_000]).unwrap();
    refused(&many, "holds 300000 messages");
    let mut long = good.clone();
    let message = serde_json::json!({"role": "user", "content": "x".repeat(15 << 20)});
    long.conversation = serde_json::to_string(&[message]).unwrap();
    refused(&long, "more than 96 tokens can spell");
}

/// A session on a real terminal (a pty the test holds the other side of), as a user drives it.
struct Terminal {
    master: std::fs::File,
    child: std::process::Child,
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Terminal {
    fn open(pkg: &Path, args: &[&str]) -> Self {
        use std::os::fd::FromRawFd;
        use std::os::unix::process::CommandExt;
        // SAFETY: the standard pty sequence; every call's result is checked.
        let (master, slave) = unsafe {
            let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
            assert!(m >= 0, "posix_openpt: {}", std::io::Error::last_os_error());
            assert_eq!(libc::grantpt(m), 0);
            assert_eq!(libc::unlockpt(m), 0);
            let mut name = [0 as libc::c_char; 128];
            assert_eq!(libc::ptsname_r(m, name.as_mut_ptr(), name.len()), 0);
            let s = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY);
            assert!(s >= 0, "open the pty: {}", std::io::Error::last_os_error());
            (std::fs::File::from_raw_fd(m), std::fs::File::from_raw_fd(s))
        };
        let mut cmd = Cli::new().arg("run").arg(pkg).args(args).command();
        cmd.stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave);
        // SAFETY: setsid and ioctl are async-signal-safe: the child leads a session whose
        // controlling terminal is the pty, so Ctrl-C typed there signals it.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (mut reader, sink) = (master.try_clone().unwrap(), seen.clone());
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 4096];
            // Reading the master side fails with EIO once the child is gone.
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Terminal {
            master,
            child,
            seen,
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }

    /// Wait until the terminal has shown `needle` `times` times in all.
    fn wait_for(&self, needle: &str, times: usize) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while self.text().matches(needle).count() < times {
            assert!(
                std::time::Instant::now() < deadline,
                "waited for {needle:?} ×{times}; the terminal shows:\n{}",
                self.text()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Wait until the session's main thread is blocked writing to stdout (Linux's
    /// /proc/PID/syscall: the syscall number, then its arguments; fd 1 first).
    fn wait_writing_stdout(&self) {
        #[cfg(target_arch = "x86_64")]
        const WRITE: &str = "1 0x1 ";
        #[cfg(not(target_arch = "x86_64"))]
        const WRITE: &str = "64 0x1 ";
        let path = format!("/proc/{}/syscall", self.child.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            match std::fs::read_to_string(&path) {
                Ok(s) if s.starts_with(WRITE) => return,
                Ok(_) => {}
                // Not readable here: give the reply time to reach its first write.
                Err(_) => return std::thread::sleep(std::time::Duration::from_secs(2)),
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the reply never started writing; the terminal shows:\n{}",
                self.text()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    fn type_(&mut self, bytes: &[u8]) {
        self.master.write_all(bytes).unwrap();
    }

    fn exit_code(mut self) -> Option<i32> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                self.child.kill().ok();
                panic!("the session did not end; it shows:\n{}", self.text());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// Ctrl-C during a reply stops the reply and returns to the prompt (the reply so far kept in
/// the conversation and the cache); Ctrl-C again at the prompt ends the session, which saves
/// the cache on its way out. The reply is held mid-way by the terminal's own flow control: the
/// test types XOFF (Ctrl-S) before the message, so the reply's first write waits until the
/// Ctrl-C (which restarts output) has been typed.
#[test]
fn ctrl_c_in_a_terminal_stops_the_reply_then_ends_the_chat() {
    needs!(Python);
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("chat.kv");
    let args = [
        "--chat",
        "--ignore-eos",
        "--max-new-tokens",
        "60",
        "--save-cache",
        cache.to_str().unwrap(),
    ];
    let mut t = Terminal::open(&f.one, &args);
    t.wait_for("> ", 1);
    t.type_(b"\x13hi\n");
    t.wait_writing_stdout();
    t.type_(b"\x03");
    t.wait_for("reply stopped (Ctrl-C)", 1);
    t.wait_for("> ", 2);
    t.type_(b"\x03");
    let code = t.exit_code();
    assert_eq!(code, Some(0));
    let pkg = hf2coreml::runtime::chain_runner::Saved::load(&f.one, Default::default()).unwrap();
    let kv = KvFile::load(&cache, pkg.contract()).unwrap();
    let messages: Vec<serde_json::Value> = serde_json::from_str(&kv.conversation).unwrap();
    assert_eq!(messages.len(), 2, "{}", kv.conversation);
    assert_eq!(messages[0]["content"], "hi");
    // Stopped: the reply so far is the assistant's message, and the cache holds the turn and
    // that reply (but its last token, never fed), fewer than the 60 tokens asked for.
    assert_eq!(messages[1]["role"], "assistant");
    let reply = messages[1]["content"].as_str().unwrap();
    let fed = 1 + 4 + 1 + 2 + 1 + 1 + 1 + 9 + 1;
    assert!(
        kv.tokens.len() < fed + 59,
        "{} tokens: {reply:?}",
        kv.tokens.len()
    );
    assert!(kv.tokens.len() >= fed, "{} tokens", kv.tokens.len());
}

/// Ctrl-C at the prompt says how to end the chat and keeps it going; Ctrl-D ends it.
#[test]
fn ctrl_c_at_the_prompt_keeps_the_chat_and_ctrl_d_ends_it() {
    needs!(Python);
    let f = fixture();
    let mut t = Terminal::open(&f.one, &["--chat", "--max-new-tokens", "3", "--ignore-eos"]);
    t.wait_for("> ", 1);
    t.type_(b"\x03");
    t.wait_for("Ctrl-C again, or Ctrl-D, ends the chat", 1);
    t.wait_for("> ", 2);
    t.type_(b"hi\n");
    t.wait_for("prompt: ", 1);
    t.wait_for("> ", 3);
    t.type_(b"\x04");
    assert_eq!(t.exit_code(), Some(0));
}
