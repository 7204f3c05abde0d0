//! Gemma 4's per-layer table beside a package (docs/contract.md, "The per-layer table"): the
//! file the contract declares, checked against it before anything is mapped, and
//! the rows of a step's tokens gathered as an app gathers them, for the
//! [`contract::PER_LAYER_ROWS`] input.

use std::path::{Path, PathBuf};

use half::f16;

use crate::compile::RuntimeError;
use crate::mil::contract::{self, Contract, PerLayerTable};

/// The table, memory-mapped: only the rows of tokens a step takes are read.
#[derive(Debug)]
pub struct PerLayerRows {
    path: PathBuf,
    map: memmap2::Mmap,
    rows: usize,
    row_len: usize,
}

impl PerLayerRows {
    /// The table a contract declares (`c.per_layer`), beside `package` (a package or an
    /// asset: [`contract::per_layer_file`]); `None` when it declares none. A file that
    /// is missing, not a regular file or not of the declared size is refused before it is
    /// mapped.
    pub fn open(package: &Path, c: &Contract) -> Result<Option<Self>, RuntimeError> {
        c.per_layer
            .as_ref()
            .map(|t| Self::open_table(package, t))
            .transpose()
    }

    fn open_table(package: &Path, t: &PerLayerTable) -> Result<Self, RuntimeError> {
        t.check().map_err(|msg| RuntimeError::Contract {
            path: package.display().to_string(),
            msg,
        })?;
        let path = contract::per_layer_file(package);
        let bad = |msg: String| RuntimeError::Contract {
            path: path.display().to_string(),
            msg,
        };
        let file = crate::fsutil::open_input(&path).map_err(|e| {
            bad(format!(
                "the per-layer table the package's contract names: {e} (it is written beside \
                 the package, and ships with it)"
            ))
        })?;
        let len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
        if len != t.file_bytes() {
            return Err(bad(format!(
                "{len} bytes; the contract declares {} rows of {} fp16 values ({} bytes)",
                t.rows,
                t.row_len(),
                t.file_bytes()
            )));
        }
        // SAFETY: the map is read-only; a table changed underneath us while we run is outside
        // what any reader can defend against (as for the checkpoint and weight.bin).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(e.to_string()))?;
        Ok(PerLayerRows {
            path,
            map,
            rows: t.rows,
            row_len: t.row_len(),
        })
    }

    /// The rows of `input_ids`, [Q, L·P] as the [`contract::PER_LAYER_ROWS`] input holds them
    /// (a padded position's row too: any id the table has).
    pub fn gather(&self, input_ids: &[i32]) -> Result<Vec<f16>, RuntimeError> {
        let mut out = Vec::with_capacity(input_ids.len() * self.row_len);
        let bytes = self.row_len * 2;
        for &id in input_ids {
            let row = usize::try_from(id)
                .ok()
                .filter(|&r| r < self.rows)
                .ok_or_else(|| RuntimeError::Input {
                    name: contract::INPUT_IDS.into(),
                    msg: format!(
                        "token {id} has no row in the per-layer table ({} rows)",
                        self.rows
                    ),
                })?;
            let at = row * bytes;
            let raw = &self.map[at..at + bytes];
            out.extend(
                raw.chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]])),
            );
        }
        Ok(out)
    }

    /// The values of one row, L·P.
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_read_from_the_file_and_bad_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path().join("m.mlpackage");
        let t = PerLayerTable {
            dtype: "fp16".into(),
            rows: 3,
            layers: 2,
            width: 2,
            sha256: String::new(),
        };
        let open = |t: &PerLayerTable| PerLayerRows::open_table(&pkg, t);
        let missing = open(&t).unwrap_err().to_string();
        assert!(missing.contains("m.per_layer.bin"), "{missing}");
        let values: Vec<f16> = (0..12).map(|i| f16::from_f32(i as f32)).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("m.per_layer.bin"), &bytes[..22]).unwrap();
        let short = open(&t).unwrap_err().to_string();
        assert!(short.contains("22 bytes"), "{short}");
        std::fs::write(dir.path().join("m.per_layer.bin"), &bytes).unwrap();
        let rows = open(&t).unwrap();
        assert_eq!(
            rows.gather(&[2, 0]).unwrap(),
            [&values[8..], &values[..4]].concat()
        );
        assert!(rows.gather(&[3]).is_err() && rows.gather(&[-1]).is_err());
        assert!(open(&PerLayerTable {
            dtype: "int8".into(),
            ..t
        })
        .is_err());
    }
}
