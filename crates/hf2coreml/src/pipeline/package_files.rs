//! The files a conversion writes and hashes: the package's sidecar names (`X.tokenizer.json`,
//! `X.tokenizer_config.json`, `X.report.json`, `batch`'s `X.validation.json`), the sidecars
//! themselves, and the sha256 of the source files and of a package's program and weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;

use super::convert_error::{io_err, ConvertError};
use crate::arch::TensorId;
use crate::checkpoint::Checkpoint;
use crate::fsutil::{read_input, sha256_file, Staged};
use crate::mil::contract;
use crate::runtime::chat::MAX_CONFIG_BYTES;
use crate::runtime::text::MAX_TOKENIZER_BYTES;

/// The files a conversion writes.
#[derive(Debug, Clone, Serialize)]
pub struct Outputs {
    pub package: PathBuf,
    pub tokenizer: Option<PathBuf>,
    /// The checkpoint's tokenizer_config.json (chat template, special tokens), for `run --chat`.
    pub tokenizer_config: Option<PathBuf>,
    pub report: PathBuf,
    /// Gemma 4's per-layer table (`X.per_layer.bin`), for a model that has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_layer: Option<PathBuf>,
}

impl Outputs {
    /// `X.mlpackage` (or a Core AI asset, `X.aimodel`) → `X.tokenizer.json`,
    /// `X.tokenizer_config.json`, `X.report.json`.
    pub fn for_package(package: &Path) -> Result<Self, ConvertError> {
        // coremltools takes the path as text: a path that is not UTF-8 is refused here,
        // before anything is written.
        if package.to_str().is_none() {
            return Err(ConvertError::OutputNotUtf8(package.to_path_buf()));
        }
        let name = package
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stem = name
            .strip_suffix(".mlpackage")
            .or_else(|| name.strip_suffix(".aimodel"));
        let Some(stem) = stem.filter(|s| !s.is_empty()) else {
            return Err(ConvertError::OutputName(package.to_path_buf()));
        };
        let side = |suffix: &str| package.with_file_name(format!("{stem}.{suffix}"));
        Ok(Outputs {
            package: package.to_path_buf(),
            tokenizer: Some(side("tokenizer.json")),
            tokenizer_config: Some(side("tokenizer_config.json")),
            report: side("report.json"),
            per_layer: Some(side(contract::PER_LAYER_FILE_SUFFIX)),
        })
    }
}

/// The per-layer table's rows encoded at once before they are written in order.
const ROWS_AT_ONCE: usize = 2048;

/// Gemma 4's per-layer table, staged beside the package in the form the contract describes
/// ([`contract::PerLayerTable`]): row by row from the mapped checkpoint, rounded to fp16 and
/// hashed on the way, so the table is never held in memory. With `bits`, each block's columns
/// get a LUT of 2^bits entries fitted exactly to their values (counted in a first pass over
/// the rows) and the rows are written as LUT indices in a second. Both passes take the rows
/// a few thousand at a time on every core. `outputs` loses the file when the model has no
/// table, and a file of that name an earlier output left goes at commit.
pub(super) fn stage_per_layer_table(
    ckpt: &Checkpoint,
    bits: Option<u8>,
    outputs: &mut Outputs,
    staged: &mut Staged,
) -> Result<Option<contract::PerLayerTable>, ConvertError> {
    use sha2::{Digest, Sha256};
    let spec = ckpt.spec();
    let (Some(dest), Some(g)) = (
        outputs.per_layer.clone(),
        spec.gemma4.as_ref().filter(|g| g.per_layer_input > 0),
    ) else {
        // A table an earlier model left under this name is not this output's (removed with
        // --force, whose check already found it a regular file).
        if let Some(stale) = outputs.per_layer.take() {
            staged.remove_at_commit(&stale).map_err(io_err(&stale))?;
        }
        return Ok(None);
    };
    let name = TensorId::PerLayerEmbedding.hf_name();
    let table = ckpt.tensor(&name)?;
    let (rows, layers, width) = (g.per_layer_vocab, spec.num_hidden_layers, g.per_layer_input);
    if table.shape != [rows, layers * width] {
        return Err(ConvertError::State(format!(
            "`{name}` is {:?}; the config makes it [{rows}, {}]",
            table.shape,
            layers * width
        )));
    }
    let row = |r: usize| table.row(r).expect("a row of the checked shape").to_f16();
    let luts = match bits {
        Some(n) => Some(per_layer_luts(&name, n, (rows, layers, width), &row)?),
        None => None,
    };
    // One row as the file stores it.
    let encode = |r: usize| -> Vec<u8> {
        let values = row(r);
        match (&luts, bits) {
            (Some(luts), Some(n)) => {
                let indices: Vec<u8> = (values.iter().enumerate())
                    .map(|(i, &v)| luts[i / width].index(v))
                    .collect();
                crate::quant::pack_indices(&indices, n)
            }
            _ => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    };
    let mut hash = Sha256::new();
    staged
        .add_file_with(&dest, |w| {
            let mut put = |bytes: &[u8]| {
                hash.update(bytes);
                w.write_all(bytes)
            };
            if let Some(luts) = &luts {
                let head: Vec<u8> = luts
                    .iter()
                    .flat_map(|t| t.lut.iter().flat_map(|x| x.to_le_bytes()))
                    .collect();
                put(&head)?;
            }
            for start in (0..rows).step_by(ROWS_AT_ONCE) {
                let end = (start + ROWS_AT_ONCE).min(rows);
                let encoded: Vec<Vec<u8>> = (start..end).into_par_iter().map(encode).collect();
                for bytes in &encoded {
                    put(bytes)?;
                }
            }
            Ok(())
        })
        .map_err(io_err(&dest))?;
    Ok(Some(contract::PerLayerTable {
        dtype: bits.map_or("fp16".into(), contract::per_layer_lut_dtype),
        rows,
        layers,
        width,
        sha256: hash.finalize().iter().map(|b| format!("{b:02x}")).collect(),
    }))
}

/// One LUT of 2^`bits` entries per block's `width` columns of the per-layer table, fitted
/// exactly to the fp16 values of every row (counted row by row: the table is never held).
fn per_layer_luts(
    name: &str,
    bits: u8,
    (rows, layers, width): (usize, usize, usize),
    row: &(dyn Fn(usize) -> Vec<half::f16> + Sync),
) -> Result<Vec<crate::quant::kmeans::LutTable>, ConvertError> {
    use crate::quant::kmeans::F16Counts;
    // A count per block per thread (512 KiB each), merged.
    let threads = rayon::current_num_threads().clamp(1, rows.max(1));
    let counted: Vec<Vec<F16Counts>> = (0..threads)
        .into_par_iter()
        .map(|t| {
            let mut counts = vec![F16Counts::default(); layers];
            for r in (t * rows / threads)..((t + 1) * rows / threads) {
                let values = row(r);
                for (c, block) in counts.iter_mut().zip(values.chunks_exact(width)) {
                    c.add(block);
                }
            }
            counts
        })
        .collect();
    let mut counted = counted.into_iter();
    let mut counts = counted.next().unwrap_or_default();
    for other in counted {
        for (c, o) in counts.iter_mut().zip(&other) {
            c.merge(o);
        }
    }
    counts
        .iter()
        .map(|c| c.fit(bits))
        .collect::<Result<_, _>>()
        .map_err(|e| ConvertError::State(format!("`{name}`: {e}")))
}

/// The tokenizer and its config, staged to be placed beside the package with it; `outputs`
/// loses the ones the checkpoint does not have.
pub(super) fn stage_sidecars(
    ckpt: &Checkpoint,
    outputs: &mut Outputs,
    staged: &mut Staged,
) -> Result<(), ConvertError> {
    let tokenizer_src = ckpt.dir().join("tokenizer.json");
    if tokenizer_src.is_file() {
        let dest = outputs.tokenizer.clone().unwrap_or_default();
        let bytes =
            read_input(&tokenizer_src, MAX_TOKENIZER_BYTES).map_err(io_err(&tokenizer_src))?;
        staged.add_file(&dest, &bytes).map_err(io_err(&dest))?;
    } else {
        outputs.tokenizer = None;
    }
    let config_src = ckpt.dir().join("tokenizer_config.json");
    match outputs.tokenizer_config.clone() {
        Some(dest) if config_src.is_file() => {
            let bytes = read_input(&config_src, MAX_CONFIG_BYTES).map_err(io_err(&config_src))?;
            staged.add_file(&dest, &bytes).map_err(io_err(&dest))?;
        }
        _ => outputs.tokenizer_config = None,
    }
    Ok(())
}

/// The bytes of an `.aimodel`'s function bytecode (`*.mlirb`), where Core AI keeps the
/// weights: what weight.bin is to a package.
pub fn asset_weight_bytes(asset: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(asset)? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|x| x == "mlirb") {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

/// `X.mlpackage` → `X.validation.json`: where `batch` keeps a package's validation record.
pub fn validation_path(package: &Path) -> PathBuf {
    let name = package
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".mlpackage").unwrap_or(&name);
    package.with_file_name(format!("{stem}.validation.json"))
}

/// weight.bin inside a package.
pub fn weight_bin(package: &Path) -> PathBuf {
    package.join("Data/com.apple.CoreML/weights/weight.bin")
}

/// The names of the files whose hashes identify the source checkpoint.
const HASHED_FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

/// sha256 of config, tokenizer and weight files, by file name.
pub fn source_hashes(ckpt: &Checkpoint) -> Result<BTreeMap<String, String>, ConvertError> {
    let mut out = BTreeMap::new();
    let mut paths: Vec<PathBuf> = HASHED_FILES
        .iter()
        .map(|f| ckpt.dir().join(f))
        .filter(|p| p.is_file())
        .collect();
    paths.extend(ckpt.files().map(Path::to_path_buf));
    for p in paths {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.insert(name, sha256_file(&p).map_err(io_err(&p))?);
    }
    Ok(out)
}

/// sha256 of a package's program and weights (a chain part's entry in `chain.json`).
pub(super) fn package_hashes(package: &Path) -> Result<BTreeMap<String, String>, ConvertError> {
    let model = package.join("Data/com.apple.CoreML/model.mlmodel");
    let weights = weight_bin(package);
    let mut out = BTreeMap::new();
    out.insert(
        "model.mlmodel".into(),
        sha256_file(&model).map_err(io_err(&model))?,
    );
    if weights.is_file() {
        let hash = sha256_file(&weights).map_err(io_err(&weights))?;
        out.insert("weight.bin".into(), hash);
    }
    Ok(out)
}

/// sha256 of every file of a Core AI asset (`metadata.json`, each function's `.mlirb` and
/// `.hash`), by name: a chain part's entry in `chain.json`.
pub(super) fn asset_hashes(asset: &Path) -> Result<BTreeMap<String, String>, ConvertError> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(asset).map_err(io_err(asset))? {
        let path = entry.map_err(io_err(asset))?.path();
        if path.is_file() {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.insert(name, sha256_file(&path).map_err(io_err(&path))?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecar_names() {
        let o = Outputs::for_package(Path::new("out/smol.mlpackage")).unwrap();
        assert_eq!(o.report, Path::new("out/smol.report.json"));
        assert_eq!(
            o.tokenizer.as_deref(),
            Some(Path::new("out/smol.tokenizer.json"))
        );
        assert!(Outputs::for_package(Path::new("out/smol")).is_err());
        assert!(Outputs::for_package(Path::new(".mlpackage")).is_err());
    }
}
