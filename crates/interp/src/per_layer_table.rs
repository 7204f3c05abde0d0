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
    /// The bits of a LUT index, for a `lut*` table (its LUTs are read from the map).
    lut_bits: Option<u8>,
    width: usize,
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
                "{len} bytes; the contract declares {} rows of {} {} values ({} bytes)",
                t.rows,
                t.row_len(),
                t.dtype,
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
            lut_bits: t.lut_bits(),
            width: t.width,
        })
    }

    /// The rows of `input_ids`, [Q, L·P] as the [`contract::PER_LAYER_ROWS`] input holds them
    /// (a padded position's row too: any id the table has).
    pub fn gather(&self, input_ids: &[i32]) -> Result<Vec<f16>, RuntimeError> {
        let mut out = Vec::with_capacity(input_ids.len() * self.row_len);
        // Past the LUTs (`layers` × 2^bits fp16), rows of packed indices; or fp16 rows.
        let (start, bytes) = match self.lut_bits {
            Some(n) => (
                (self.row_len / self.width) << n,
                (self.row_len * n as usize).div_ceil(8),
            ),
            None => (0, self.row_len * 2),
        };
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
            let at = start * 2 + row * bytes;
            let raw = &self.map[at..at + bytes];
            let value = |at: usize| f16::from_le_bytes([self.map[2 * at], self.map[2 * at + 1]]);
            match self.lut_bits {
                None => out.extend(
                    raw.chunks_exact(2)
                        .map(|b| f16::from_le_bytes([b[0], b[1]])),
                ),
                Some(n) => {
                    let indices = hf2coreml_numerics::pack::unpack_indices(raw, n, self.row_len);
                    out.extend(
                        (indices.iter().enumerate())
                            .map(|(i, &x)| value(((i / self.width) << n) + x as usize)),
                    );
                }
            }
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
            ..t.clone()
        })
        .is_err());

        // lut4: block l's LUT holds 10·l + i at i; row r's values are indices r, r+1, r+2, r+3.
        let t4 = PerLayerTable {
            dtype: "lut4".into(),
            ..t
        };
        let mut file: Vec<u8> = (0..2)
            .flat_map(|l| (0..16).map(move |i| f16::from_f32((10 * l + i) as f32)))
            .flat_map(|v| v.to_le_bytes())
            .collect();
        for r in 0..3u8 {
            file.extend([r | (r + 1) << 4, (r + 2) | (r + 3) << 4]);
        }
        std::fs::write(dir.path().join("m.per_layer.bin"), &file[..69]).unwrap();
        let short = open(&t4).unwrap_err().to_string();
        assert!(
            short.contains("69 bytes") && short.contains("(70 bytes)"),
            "{short}"
        );
        std::fs::write(dir.path().join("m.per_layer.bin"), &file).unwrap();
        let got: Vec<f32> = open(&t4)
            .unwrap()
            .gather(&[2, 0])
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_eq!(got, [2.0, 3.0, 14.0, 15.0, 0.0, 1.0, 12.0, 13.0]);

        // Foreign contracts: bits outside 1 to 8 are no dtype, and sizes past any file are
        // refused against the file's length before anything is mapped or allocated.
        for dtype in ["lut0", "lut9", "lut", "lut-4"] {
            let bad = PerLayerTable {
                dtype: dtype.into(),
                ..t4.clone()
            };
            assert!(
                open(&bad).unwrap_err().to_string().contains("dtype"),
                "{dtype}"
            );
        }
        let huge = PerLayerTable {
            layers: usize::MAX / 2,
            rows: usize::MAX,
            ..t4
        };
        let err = open(&huge).unwrap_err().to_string();
        assert!(err.contains("70 bytes"), "{err}");
    }
}
