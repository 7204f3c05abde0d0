//! weight.bin, MIL blob storage version 2 (docs/reference/mlpackage-format.md, "weight.bin").
//! The file is memory-mapped and borrowed; every offset and size is checked arithmetic against
//! the file length.

use std::path::{Path, PathBuf};

use super::package_error::PackageError;
use crate::mil::DType;

/// Blob storage format version this reader understands.
pub const BLOB_VERSION: u32 = 2;
/// Marks the start of every blob metadata record.
pub const BLOB_SENTINEL: u32 = 0xDEAD_BEEF;
/// Size of the file header and of each metadata record.
pub const RECORD_SIZE: usize = 64;

/// Blob dtype codes of the storage format (not the MIL DataType numbers).
pub fn dtype_from_blob_code(code: u32) -> Option<DType> {
    Some(match code {
        1 => DType::F16,
        2 => DType::F32,
        3 => DType::U8,
        4 => DType::I8,
        5 => DType::BF16,
        6 => DType::I16,
        7 => DType::U16,
        8 => DType::I4,
        9 => DType::U1,
        10 => DType::U2,
        11 => DType::U4,
        12 => DType::U3,
        13 => DType::U6,
        14 => DType::I32,
        15 => DType::U32,
        _ => return None,
    })
}

/// The inverse of [`dtype_from_blob_code`], for writers (tests build blob files with it).
pub fn blob_code(dtype: DType) -> Option<u32> {
    (1..=15).find(|&c| dtype_from_blob_code(c) == Some(dtype))
}

/// One memory-mapped weight file.
#[derive(Debug)]
pub struct BlobFile {
    path: PathBuf,
    map: memmap2::Mmap,
    count: u32,
}

/// One blob's record: its dtype and its data bytes.
#[derive(Debug, Clone, Copy)]
pub struct BlobRecord<'a> {
    pub dtype: DType,
    pub data: &'a [u8],
}

impl BlobFile {
    pub fn open(path: &Path) -> Result<Self, PackageError> {
        let file = crate::fsutil::open_input(path).map_err(|source| PackageError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the map is read-only and the package is not expected to change while it is
        // read; a concurrent truncation is outside what any reader can defend against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| PackageError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |msg: String| PackageError::Blob {
            path: path.to_path_buf(),
            offset: 0,
            msg,
        };
        if map.len() < RECORD_SIZE {
            return Err(bad(format!(
                "{} bytes is shorter than the {RECORD_SIZE}-byte header",
                map.len()
            )));
        }
        let count = read_u32(&map, 0);
        let version = read_u32(&map, 4);
        if version != BLOB_VERSION {
            return Err(bad(format!(
                "blob storage version {version}, expected {BLOB_VERSION}"
            )));
        }
        Ok(BlobFile {
            path: path.to_path_buf(),
            map,
            count,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The blob count the header declares.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The blob whose metadata record starts at `offset` (a `BlobFileValue.offset`).
    pub fn record(&self, offset: u64) -> Result<BlobRecord<'_>, PackageError> {
        let bad = |msg: String| PackageError::Blob {
            path: self.path.clone(),
            offset,
            msg,
        };
        let len = self.map.len() as u64;
        let start = usize::try_from(offset)
            .ok()
            .filter(|_| {
                offset
                    .checked_add(RECORD_SIZE as u64)
                    .is_some_and(|e| e <= len)
            })
            .ok_or_else(|| bad(format!("record past the end of the {len}-byte file")))?;
        if start < RECORD_SIZE {
            return Err(bad("record overlaps the file header".into()));
        }
        let sentinel = read_u32(&self.map, start);
        if sentinel != BLOB_SENTINEL {
            return Err(bad(format!(
                "sentinel {sentinel:#010x}, expected {BLOB_SENTINEL:#010x}"
            )));
        }
        let code = read_u32(&self.map, start + 4);
        let dtype =
            dtype_from_blob_code(code).ok_or_else(|| bad(format!("unknown blob dtype {code}")))?;
        let size = read_u64(&self.map, start + 8);
        let data_offset = read_u64(&self.map, start + 16);
        if data_offset < offset + RECORD_SIZE as u64 {
            return Err(bad(format!(
                "data offset {data_offset} inside its own metadata record"
            )));
        }
        let end = data_offset
            .checked_add(size)
            .filter(|&e| e <= len)
            .ok_or_else(|| {
                bad(format!(
                    "data [{data_offset}, +{size}) past the end of the {len}-byte file"
                ))
            })?;
        // Both fit in the mapped length, which is a usize.
        let data = &self.map[data_offset as usize..end as usize];
        Ok(BlobRecord { dtype, data })
    }
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Builds a blob storage v2 file in memory: the layout coremltools writes (64-byte header,
/// 64-aligned records, data right after each record). Used by tests and fixtures.
#[derive(Debug, Default)]
pub struct BlobWriter {
    bytes: Vec<u8>,
    count: u32,
}

impl BlobWriter {
    pub fn new() -> Self {
        let mut bytes = vec![0u8; RECORD_SIZE];
        bytes[4..8].copy_from_slice(&BLOB_VERSION.to_le_bytes());
        BlobWriter { bytes, count: 0 }
    }

    /// Append a blob of raw `data` with storage dtype `dtype`; returns its offset.
    pub fn push(&mut self, dtype: DType, data: &[u8]) -> u64 {
        while !self.bytes.len().is_multiple_of(RECORD_SIZE) {
            self.bytes.push(0);
        }
        let offset = self.bytes.len() as u64;
        let code = blob_code(dtype).unwrap_or(0);
        let mut rec = [0u8; RECORD_SIZE];
        rec[0..4].copy_from_slice(&BLOB_SENTINEL.to_le_bytes());
        rec[4..8].copy_from_slice(&code.to_le_bytes());
        rec[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        rec[16..24].copy_from_slice(&(offset + RECORD_SIZE as u64).to_le_bytes());
        self.bytes.extend_from_slice(&rec);
        self.bytes.extend_from_slice(data);
        self.count += 1;
        self.bytes[0..4].copy_from_slice(&self.count.to_le_bytes());
        offset
    }

    pub fn finish(self) -> Vec<u8> {
        self.bytes
    }
}
