//! The KV-cache file (`run --save-cache` / `--load-cache`): the valid rows of a [`Generator`]'s
//! static cache, so a conversation resumes exactly where it stopped (docs/contract.md, "The
//! KV-cache file").
//!
//! ## Format, version 1 (all integers little-endian)
//! | bytes | field |
//! |---|---|
//! | 8 | magic `HF2CMKV\n` |
//! | 4 | version, u32 = 1 |
//! | 32 | sha256 of the package's contract JSON ([`contract_hash`]) |
//! | 4 × 4 | L, Hkv, S, D: the cache's dimensions (must equal the contract's) |
//! | 4 | P, the position: rows held (P ≤ T) |
//! | 4 | T, the token count (T ≤ S): ids of positions `0..T`; those past P have no rows yet |
//! | 4 | C, the byte length of the conversation (at most 16 MiB) |
//! | 4 × T | the token ids, u32 |
//! | C | the conversation: UTF-8 JSON (`[{"role", "content"}, ...]`), empty outside `--chat` |
//! | 2 × L·Hkv·P·D | keys, fp16, [L, Hkv, P, D] row-major: only the valid rows |
//! | 2 × L·Hkv·P·D | values, the same |
//! | 2 × R | version 2 only: a hybrid package's recurrent state after the P positions, fp16, R = the contract's recurrent values |
//! | 32 | sha256 of every byte before it |
//!
//! A hybrid package's file is version 2, every other package's version 1.
//!
//! Reading checks the magic, the version and every declared size against the file's length
//! before allocating, then the checksum, then the contract hash and dimensions against the
//! package's.

use std::io::Read;
use std::path::{Path, PathBuf};

use half::f16;
use sha2::{Digest, Sha256};

use super::generate::Generator;
use super::StepModel;
use crate::mil::contract::Contract;

pub const MAGIC: &[u8; 8] = b"HF2CMKV\n";
/// The version of a file without a recurrent state.
pub const VERSION: u32 = 1;
/// The version of a hybrid package's file: the recurrent state follows the values.
pub const VERSION_RECURRENT: u32 = 2;
/// Bytes before the token ids.
const HEADER: usize = 8 + 4 + 32 + 4 * 7;
/// Largest conversation stored.
pub const MAX_CONVERSATION_BYTES: u32 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum KvFileError {
    #[error("cannot read the KV-cache file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the KV-cache file {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a KV-cache file: {detail}")]
    Invalid { path: PathBuf, detail: String },
    #[error(
        "{path} was saved by a different package (contract hash {found}, this package's is \
         {expected}): a cache only resumes the package that wrote it"
    )]
    OtherPackage {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error("{path}: the cache does not fit the package: {detail}")]
    Mismatch { path: PathBuf, detail: String },
}

/// The sha256 of the contract as JSON: what identifies the package a cache belongs to.
pub fn contract_hash(contract: &Contract) -> [u8; 32] {
    let json = serde_json::to_vec(contract).unwrap_or_default();
    Sha256::digest(&json).into()
}

/// A saved cache.
#[derive(Debug, Clone, PartialEq)]
pub struct KvFile {
    pub contract_hash: [u8; 32],
    /// [L, Hkv, S, D].
    pub shape: [usize; 4],
    /// Rows held.
    pub position: usize,
    /// The ids of positions `0..tokens.len()`; rows exist for the first `position`.
    pub tokens: Vec<u32>,
    /// The chat so far as JSON, or empty.
    pub conversation: String,
    /// [L, Hkv, P, D] each.
    pub keys: Vec<f16>,
    pub values: Vec<f16>,
    /// A hybrid package's recurrent state after the `position` rows (empty otherwise).
    pub recurrent: Vec<f16>,
}

impl KvFile {
    /// The generator's valid rows; `tokens` extends its cached tokens (the last sampled token,
    /// never fed back, has no row yet).
    pub fn from_generator<M: StepModel>(
        g: &Generator<M>,
        tokens: &[u32],
        conversation: String,
    ) -> Result<Self, super::generate::GenerateError> {
        let (keys, values) = g.valid_rows()?;
        let cached = g.cached_tokens();
        let tokens = if tokens.starts_with(cached) {
            tokens.to_vec()
        } else {
            cached.to_vec()
        };
        Ok(KvFile {
            contract_hash: contract_hash(g.model().contract()),
            shape: g.cache_shape(),
            position: cached.len(),
            tokens,
            conversation,
            keys,
            values,
            recurrent: g.recurrent_values()?,
        })
    }

    /// Put the rows back into `g` (after [`check`](Self::check)).
    pub fn restore<M: StepModel>(
        &self,
        g: &mut Generator<M>,
    ) -> Result<(), super::generate::GenerateError> {
        let tokens = &self.tokens[..self.position];
        g.restore(tokens, &self.keys, &self.values, &self.recurrent)
    }

    /// Refuse a cache another package wrote.
    pub fn check(&self, path: &Path, contract: &Contract) -> Result<(), KvFileError> {
        let expected = contract_hash(contract);
        if self.contract_hash != expected {
            return Err(KvFileError::OtherPackage {
                path: path.into(),
                found: hex(&self.contract_hash),
                expected: hex(&expected),
            });
        }
        let c = contract;
        let want = [c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim];
        if self.shape != want {
            return Err(KvFileError::Mismatch {
                path: path.into(),
                detail: format!("cache [L, Hkv, S, D] {:?}, package {want:?}", self.shape),
            });
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let rows = self.keys.len() + self.values.len() + self.recurrent.len();
        let mut out = Vec::with_capacity(HEADER + 4 * self.tokens.len() + 2 * rows + 32);
        out.extend_from_slice(MAGIC);
        let version = if self.recurrent.is_empty() {
            VERSION
        } else {
            VERSION_RECURRENT
        };
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&self.contract_hash);
        let [l, h, s, d] = self.shape;
        let conv = self.conversation.as_bytes();
        for n in [l, h, s, d, self.position, self.tokens.len(), conv.len()] {
            out.extend_from_slice(&(n as u32).to_le_bytes());
        }
        for t in &self.tokens {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out.extend_from_slice(conv);
        for x in self.keys.iter().chain(&self.values).chain(&self.recurrent) {
            out.extend_from_slice(&x.to_bits().to_le_bytes());
        }
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        out
    }

    /// Write atomically (a temp file beside `path`, then a rename).
    pub fn save(&self, path: &Path) -> Result<(), KvFileError> {
        crate::fsutil::atomic_write(path, &self.to_bytes()).map_err(|source| KvFileError::Write {
            path: path.into(),
            source,
        })
    }

    /// Read and check a file against `contract` (see the module docs for the order of checks).
    pub fn load(path: &Path, contract: &Contract) -> Result<Self, KvFileError> {
        let read = |source| KvFileError::Read {
            path: path.into(),
            source,
        };
        let mut f = crate::fsutil::open_input(path).map_err(read)?;
        let len = f.metadata().map_err(read)?.len();
        let mut header = [0u8; HEADER];
        if len < HEADER as u64 {
            return Err(invalid(
                path,
                format!("{len} bytes is shorter than the header"),
            ));
        }
        f.read_exact(&mut header).map_err(read)?;
        let layout = Layout::parse(path, &header, len, contract)?;
        let mut rest = Vec::with_capacity(layout.total - HEADER);
        f.take((layout.total - HEADER) as u64)
            .read_to_end(&mut rest)
            .map_err(read)?;
        if rest.len() != layout.total - HEADER {
            return Err(invalid(path, "the file changed while being read".into()));
        }
        let mut bytes = header.to_vec();
        bytes.extend_from_slice(&rest);
        drop(rest);
        let file = layout.decode(path, &bytes)?;
        file.check(path, contract)?;
        Ok(file)
    }
}

fn invalid(path: &Path, detail: String) -> KvFileError {
    KvFileError::Invalid {
        path: path.into(),
        detail,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The sizes a header declares, checked against the file's length and the package.
struct Layout {
    shape: [usize; 4],
    position: usize,
    tokens: usize,
    conversation: usize,
    /// L·Hkv·P·D: values in each of keys and values.
    rows: usize,
    /// R: the recurrent state's values.
    recurrent: usize,
    total: usize,
}

impl Layout {
    fn parse(path: &Path, h: &[u8], len: u64, c: &Contract) -> Result<Self, KvFileError> {
        if &h[..8] != MAGIC {
            return Err(invalid(path, "no HF2CMKV magic".into()));
        }
        let version = u32_at(h, 8);
        // R is the contract's (its program declares the state's shape): a file of the package
        // holds exactly that many values.
        let recurrent = c.recurrent_len();
        let expected = if recurrent == 0 {
            VERSION
        } else {
            VERSION_RECURRENT
        };
        if version != expected {
            return Err(invalid(
                path,
                format!(
                    "format version {version}; this build reads version {VERSION} (and \
                     {VERSION_RECURRENT} for a hybrid package's state), and this package's \
                     files are version {expected}"
                ),
            ));
        }
        let n = |i: usize| u32_at(h, 44 + 4 * i) as usize;
        let shape = [n(0), n(1), n(2), n(3)];
        let (position, tokens, conversation) = (n(4), n(5), n(6));
        let want = [c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim];
        if shape != want {
            return Err(KvFileError::Mismatch {
                path: path.into(),
                detail: format!("cache [L, Hkv, S, D] {shape:?}, package {want:?}"),
            });
        }
        if position > tokens || tokens > c.max_seq_len {
            return Err(KvFileError::Mismatch {
                path: path.into(),
                detail: format!(
                    "position {position} and {tokens} tokens: both must be at most \
                     max_seq_len {}, the position at most the tokens",
                    c.max_seq_len
                ),
            });
        }
        if conversation > MAX_CONVERSATION_BYTES as usize {
            return Err(invalid(path, format!("a {conversation}-byte conversation")));
        }
        // Bounded by the contract's dimensions, so no overflow: S·L·Hkv·D is the cache's size.
        let rows = shape[0] * shape[1] * position * shape[3];
        let total = HEADER + 4 * tokens + conversation + 4 * rows + 2 * recurrent + 32;
        if len != total as u64 {
            return Err(invalid(
                path,
                format!("{len} bytes; the header declares {total}"),
            ));
        }
        Ok(Layout {
            shape,
            position,
            tokens,
            conversation,
            rows,
            recurrent,
            total,
        })
    }

    fn decode(&self, path: &Path, b: &[u8]) -> Result<KvFile, KvFileError> {
        let (body, sum) = b.split_at(self.total - 32);
        if Sha256::digest(body).as_slice() != sum {
            return Err(invalid(path, "the sha256 checksum does not match".into()));
        }
        let mut at = HEADER;
        let tokens = (0..self.tokens).map(|i| u32_at(b, at + 4 * i)).collect();
        at += 4 * self.tokens;
        let conversation = std::str::from_utf8(&b[at..at + self.conversation])
            .map_err(|_| invalid(path, "the conversation is not UTF-8".into()))?
            .to_string();
        at += self.conversation;
        let halves = |from: usize, n: usize| -> Vec<f16> {
            b[from..from + 2 * n]
                .chunks_exact(2)
                .map(|x| f16::from_bits(u16::from_le_bytes([x[0], x[1]])))
                .collect()
        };
        let mut hash = [0u8; 32];
        hash.copy_from_slice(&b[12..44]);
        let (keys, values) = (halves(at, self.rows), halves(at + 2 * self.rows, self.rows));
        let recurrent = halves(at + 4 * self.rows, self.recurrent);
        self.finite(path, "keys", &keys)?;
        self.finite(path, "values", &values)?;
        if let Some(x) = recurrent.iter().find(|x| !x.is_finite()) {
            return Err(invalid(
                path,
                format!("the recurrent state holds {x} (a package computes a finite state)"),
            ));
        }
        Ok(KvFile {
            contract_hash: hash,
            shape: self.shape,
            position: self.position,
            tokens,
            conversation,
            keys,
            values,
            recurrent,
        })
    }

    /// A package computes finite rows (the runner stops at the first non-finite value), so a
    /// NaN or an infinity in a file was not written by one: refused here, naming the file,
    /// rather than met later as the model's own failure.
    fn finite(&self, path: &Path, what: &str, rows: &[f16]) -> Result<(), KvFileError> {
        let Some(i) = rows.iter().position(|x| !x.is_finite()) else {
            return Ok(());
        };
        let [_, heads, _, d] = self.shape;
        let per_layer = heads * self.position * d;
        let (layer, head, position) = (
            i / per_layer,
            i % per_layer / (self.position * d),
            i % (self.position * d) / d,
        );
        Err(invalid(
            path,
            format!(
                "the {what} hold {} at layer {layer}, KV head {head}, position {position} \
                 (a package computes finite rows)",
                rows[i]
            ),
        ))
    }
}
