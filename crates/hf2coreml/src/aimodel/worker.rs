//! Apple's runtime behind a wall: a child process (the environment's Python running the bridge's
//! `serve`) loads the asset and runs its functions, so whatever the runtime does to a bad
//! bytecode file (abort, fault, allocate without end, never answer) ends the child, not the
//! command. The child runs with bounded address space, no core file, its own temporary
//! directory (removed with the worker, where the runtime unpacks an asset) and dies with its
//! parent; each request has a deadline.
//!
//! The protocol is the bridge's (`python/hf2coreml_coreai.py`, `serve`): a frame is a
//! little-endian u32 length, a JSON header, then the raw bytes of the tensors the header lists.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use half::f16;

use super::{AimodelError, Tensor, BRIDGE};
use crate::pyenv::{PyEnvError, PythonEnv};

/// The largest reply header read (a function list or a step's output names: kilobytes).
const MAX_HEADER_BYTES: u32 = 16 << 20;
/// Address space the runtime may take beyond twice the bytecode it maps and compiles: the
/// Python interpreter, numpy, the runtime's libraries and thread stacks (a SmolLM2 session
/// reserves about 1.5 GiB) and the largest step's tensors.
const ADDRESS_SPACE_BASE: u64 = 6 << 30;
/// How long the runtime may take to load an asset, beyond a second per 64 MiB of bytecode.
const LOAD_TIMEOUT: Duration = Duration::from_secs(300);
/// How long one request may take: a step of a large fp16 asset runs minutes on the Linux
/// runtime (docs/targets.md), never an hour.
const CALL_TIMEOUT: Duration = Duration::from_secs(3600);
/// How much of the child's log a failure quotes (its last lines).
const LOG_TAIL_BYTES: u64 = 2048;

/// The child process and its pipes.
pub(super) struct Worker {
    asset: PathBuf,
    child: Child,
    to: Option<ChildStdin>,
    from: ChildStdout,
    log: PathBuf,
    /// The child's temporary directory (and its log), removed when the worker is dropped.
    scratch: Option<tempfile::TempDir>,
}

/// A reply: its header and tensors.
pub(super) type Reply = (serde_json::Value, Vec<(String, Tensor)>);

impl Worker {
    /// Start the child for the asset at `asset`, `bytecode_bytes` of bytecode.
    pub fn spawn(env: &PythonEnv, asset: &Path, bytecode_bytes: u64) -> Result<Self, AimodelError> {
        let python = ["bin/python3", "bin/python"]
            .iter()
            .map(|p| env.root.join(p))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                AimodelError::Python(PyEnvError::env(format!(
                    "{} has no bin/python3: Apple's runtime runs in a process of the \
                     environment's own Python",
                    env.root.display()
                )))
            })?;
        let io = |e: std::io::Error| AimodelError::Runtime {
            path: asset.to_path_buf(),
            stage: "starting its process".into(),
            message: e.to_string(),
        };
        let scratch = crate::fsutil::scratch_dir("coreai").map_err(io)?;
        let log = scratch.path().join("runtime.log");
        let limit = bytecode_bytes
            .saturating_mul(2)
            .saturating_add(ADDRESS_SPACE_BASE);
        let source = format!("{}\nserve()\n", BRIDGE.source);
        let mut cmd = Command::new(python);
        cmd.arg("-I")
            .arg("-c")
            .arg(source)
            .env("TMPDIR", scratch.path())
            // glibc reserves an arena of address space per thread and core; a few are enough
            // for one request at a time, and keep the address-space limit about memory.
            .env("MALLOC_ARENA_MAX", "4")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).map_err(io)?);
        limit_child(&mut cmd, limit);
        let mut child = cmd.spawn().map_err(io)?;
        let (to, from) = match (child.stdin.take(), child.stdout.take()) {
            (Some(to), Some(from)) => (to, from),
            _ => unreachable!("both pipes were asked for"),
        };
        set_nonblocking(to.as_raw_fd()).map_err(io)?;
        set_nonblocking(from.as_raw_fd()).map_err(io)?;
        Ok(Worker {
            asset: asset.to_path_buf(),
            child,
            to: Some(to),
            from,
            log,
            scratch: Some(scratch),
        })
    }

    /// The deadline of loading `bytecode_bytes` of bytecode.
    pub fn load_timeout(bytecode_bytes: u64) -> Duration {
        LOAD_TIMEOUT + Duration::from_secs(bytecode_bytes >> 26)
    }

    /// The deadline of any other request.
    pub fn call_timeout() -> Duration {
        CALL_TIMEOUT
    }

    /// Send one request and wait for its reply, within `timeout`. A reply with `ok: false`
    /// is the runtime's error; a child that dies or does not answer in time is killed and
    /// reported with the end of its log.
    pub fn request(
        &mut self,
        stage: &str,
        mut header: serde_json::Value,
        tensors: &[(String, Tensor)],
        timeout: Duration,
    ) -> Result<Reply, AimodelError> {
        let deadline = Instant::now() + timeout;
        header["tensors"] = tensors
            .iter()
            .map(|(name, t)| {
                serde_json::json!({"name": name, "dtype": dtype_name(t), "shape": t.shape()})
            })
            .collect();
        let sent = self.send(&header, tensors, deadline);
        let reply = sent.and_then(|()| self.receive(deadline));
        match reply {
            Ok((h, t)) if h.get("ok") == Some(&serde_json::Value::Bool(true)) => Ok((h, t)),
            Ok((h, _)) => Err(self.failed(
                stage,
                h.get("error")
                    .and_then(|e| e.as_str())
                    .unwrap_or("the runtime failed without a message")
                    .to_string(),
            )),
            Err(Failure::TimedOut) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(self.failed(
                    stage,
                    format!(
                        "no answer within {} s: the runtime's process was stopped",
                        timeout.as_secs()
                    ),
                ))
            }
            Err(Failure::Io(e)) => {
                let status = self.reap();
                // A pipe that ended says nothing the exit status does not.
                let detail = match e.kind() {
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe => {
                        String::new()
                    }
                    _ => format!(" ({e})"),
                };
                Err(self.failed(stage, format!("{status}{detail}")))
            }
        }
    }

    fn failed(&self, stage: &str, message: String) -> AimodelError {
        let tail = log_tail(&self.log);
        AimodelError::Runtime {
            path: self.asset.clone(),
            stage: stage.into(),
            message: if tail.is_empty() {
                message
            } else {
                format!("{message}\n--- runtime output (last lines) ---\n{tail}")
            },
        }
    }

    /// How the child ended, once its pipe broke (waited for briefly, then killed).
    fn reap(&mut self) -> String {
        let until = Instant::now() + Duration::from_secs(5);
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = self.child.kill();
                    break self.child.wait().ok();
                }
            }
        };
        describe_exit(status)
    }

    fn send(
        &mut self,
        header: &serde_json::Value,
        tensors: &[(String, Tensor)],
        deadline: Instant,
    ) -> Result<(), Failure> {
        let to = self.to.as_mut().ok_or(Failure::Io(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "the worker was closed",
        )))?;
        let body = serde_json::to_vec(header).map_err(|e| Failure::Io(e.into()))?;
        write_all(to, &(body.len() as u32).to_le_bytes(), deadline)?;
        write_all(to, &body, deadline)?;
        for (_, t) in tensors {
            write_all(to, &tensor_bytes(t), deadline)?;
        }
        Ok(())
    }

    fn receive(&mut self, deadline: Instant) -> Result<Reply, Failure> {
        let mut len = [0u8; 4];
        read_exact(&mut self.from, &mut len, deadline)?;
        let len = u32::from_le_bytes(len);
        if len > MAX_HEADER_BYTES {
            return Err(invalid(format!("a reply header of {len} bytes")));
        }
        let mut body = vec![0u8; len as usize];
        read_exact(&mut self.from, &mut body, deadline)?;
        let header: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| invalid(format!("reply: {e}")))?;
        let specs: Vec<TensorSpec> =
            serde_json::from_value(header.get("tensors").cloned().unwrap_or_default())
                .map_err(|e| invalid(format!("reply tensors: {e}")))?;
        let mut tensors = Vec::with_capacity(specs.len());
        for spec in specs {
            let t = read_tensor(&mut self.from, &spec, deadline)?;
            tensors.push((spec.name, t));
        }
        Ok((header, tensors))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing its stdin ends the child's loop; one that does not end soon is killed.
        self.to = None;
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        if let Some(s) = self.scratch.take() {
            let _ = s.close();
        }
    }
}

#[derive(serde::Deserialize)]
struct TensorSpec {
    name: String,
    dtype: String,
    shape: Vec<usize>,
}

enum Failure {
    Io(std::io::Error),
    TimedOut,
}

fn invalid(msg: String) -> Failure {
    Failure::Io(std::io::Error::new(std::io::ErrorKind::InvalidData, msg))
}

fn dtype_name(t: &Tensor) -> &'static str {
    match t {
        Tensor::F16(..) => "float16",
        Tensor::F32(..) => "float32",
        Tensor::I32(..) => "int32",
    }
}

/// A tensor's values as the bytes the child reads (little-endian, C order).
fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    match t {
        Tensor::F16(v, _) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Tensor::F32(v, _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Tensor::I32(v, _) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// The largest tensor a reply may carry: what the child's address space could hold.
const MAX_REPLY_TENSOR_BYTES: u64 = 16 << 30;

fn read_tensor(
    from: &mut ChildStdout,
    spec: &TensorSpec,
    deadline: Instant,
) -> Result<Tensor, Failure> {
    let width = match spec.dtype.as_str() {
        "float16" => 2,
        "float32" | "int32" => 4,
        other => return Err(invalid(format!("output `{}` of dtype {other}", spec.name))),
    };
    let count = spec
        .shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
        .filter(|&n| n.saturating_mul(width) <= MAX_REPLY_TENSOR_BYTES)
        .ok_or_else(|| invalid(format!("output `{}` of shape {:?}", spec.name, spec.shape)))?
        as usize;
    let mut bytes = vec![0u8; count * width as usize];
    read_exact(from, &mut bytes, deadline)?;
    let shape = spec.shape.clone();
    Ok(match width {
        2 => Tensor::F16(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            shape,
        ),
        _ if spec.dtype == "float32" => Tensor::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            shape,
        ),
        _ => Tensor::I32(
            bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            shape,
        ),
    })
}

/// Wait until `fd` is ready for `events` or the deadline passes.
fn wait_ready(fd: i32, events: i16, deadline: Instant) -> Result<(), Failure> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::TimedOut);
        }
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        let ms = left.as_millis().min(60_000) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms.max(1)) };
        if r > 0 {
            return Ok(());
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Failure::Io(e));
            }
        }
    }
}

fn write_all(to: &mut ChildStdin, mut bytes: &[u8], deadline: Instant) -> Result<(), Failure> {
    while !bytes.is_empty() {
        match to.write(bytes) {
            Ok(0) => return Err(Failure::Io(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_ready(to.as_raw_fd(), libc::POLLOUT, deadline)?
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Failure::Io(e)),
        }
    }
    Ok(())
}

fn read_exact(
    from: &mut ChildStdout,
    mut buf: &mut [u8],
    deadline: Instant,
) -> Result<(), Failure> {
    while !buf.is_empty() {
        match from.read(buf) {
            Ok(0) => {
                return Err(Failure::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "its output ended",
                )))
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_ready(from.as_raw_fd(), libc::POLLIN, deadline)?
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Failure::Io(e)),
        }
    }
    Ok(())
}

fn set_nonblocking(fd: i32) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor this process owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The child's limits, set between fork and exec: address space, no core file (an abort in
/// the runtime must not write one the size of the asset), and death with its parent (a
/// killed hf2coreml leaves no runtime behind).
fn limit_child(cmd: &mut Command, address_space: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe system calls run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let set = |what, n: u64| {
                let l = libc::rlimit {
                    rlim_cur: n as libc::rlim_t,
                    rlim_max: n as libc::rlim_t,
                };
                libc::setrlimit(what, &l)
            };
            if set(libc::RLIMIT_AS, address_space) != 0 || set(libc::RLIMIT_CORE, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            #[cfg(target_os = "linux")]
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// How a child ended, in words ("killed by signal 6 (SIGABRT)").
fn describe_exit(status: Option<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (_, Some(sig)) => {
                let name = match sig {
                    libc::SIGABRT => " (SIGABRT: the runtime aborted)",
                    libc::SIGSEGV => " (SIGSEGV: the runtime faulted)",
                    libc::SIGBUS => " (SIGBUS: a mapped file changed or was cut short)",
                    libc::SIGKILL => " (SIGKILL: out of memory or killed)",
                    _ => "",
                };
                format!("the runtime's process was killed by signal {sig}{name}")
            }
            (Some(code), _) => format!("the runtime's process exited with status {code}"),
            _ => "the runtime's process ended".into(),
        },
        None => "the runtime's process ended".into(),
    }
}

/// The last lines of the child's log, printable and bounded.
fn log_tail(log: &Path) -> String {
    let Ok(mut f) = std::fs::File::open(log) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    use std::io::Seek;
    let _ = f.seek(std::io::SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut buf = Vec::new();
    let _ = f.take(LOG_TAIL_BYTES).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let text: String = text
        .chars()
        .map(|c| if c.is_control() && c != '\n' { '?' } else { c })
        .collect();
    text.trim().to_string()
}
