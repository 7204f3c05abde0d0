//! What a conversion reports and records: [`ConvertSummary`] (written as `X.report.json`
//! beside the package, without the stage times), and [`Inputs`], what the package is made
//! from, which `batch` compares to skip an up-to-date export.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::convert_error::ConvertError;
use super::package_files::Outputs;
use crate::emit::EmitReport;
use crate::mil::contract::Contract;
use crate::quant;

/// Time spent per stage, in seconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageTimes {
    pub read: f64,
    /// Measuring activation ranges on the calibration text (fp16 range safety).
    pub ranges: f64,
    pub palettize: f64,
    pub build: f64,
    pub serialize: f64,
    pub total: f64,
}

/// What `convert` reports (also written as `X.report.json`).
#[derive(Debug, Clone, Serialize)]
pub struct ConvertSummary {
    pub outputs: Outputs,
    pub contract: Contract,
    /// Bytes of the package on disk.
    pub package_bytes: u64,
    /// Bytes of weight.bin.
    pub weight_bin_bytes: u64,
    /// Bytes the graph's constants take (what the budget's weights term predicts).
    pub predicted_weight_bytes: u64,
    pub parameters: u64,
    /// weight.bin bits per checkpoint parameter.
    pub bits_per_weight: f64,
    pub times: StageTimes,
    pub emit: EmitReport,
    /// Per-tensor storage: checkpoint tensor → `fp16` or `lut<n>`.
    pub tensors: BTreeMap<String, String>,
    /// The palettizer's per-tensor report (sizes, MSE, SNR).
    pub palettize: Option<quant::Report>,
    /// What the package was made from (absent when the caller did not say).
    pub inputs: Option<Inputs>,
    /// The checkpoint directory converted (absolute): `validate PKG` without `--against`
    /// validates against it while its files still hash as the contract records.
    pub source: PathBuf,
    /// The chain's description when the model was split into several packages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<crate::mil::chain_file::ChainFile>,
    /// What a multimodal checkpoint holds beside its text decoder, left out unread.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<super::inspect::DroppedPart>,
}

/// Everything a package is made from, and a fingerprint of it: `batch` skips an export whose
/// package records the same fingerprint. The output path, `--force` and the Python
/// environment are not inputs (they do not change the bytes written).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Inputs {
    /// sha256 over the other fields.
    pub fingerprint: String,
    pub tool_version: String,
    /// sha256 of each source file (config, tokenizer, weights; or the .gguf), by file name.
    pub sources: BTreeMap<String, String>,
    /// The applied recipe, as TOML.
    pub recipe: String,
    /// sha256 of the calibration text, when the recipe calibrates.
    pub calibration: Option<String>,
    /// Shape, precision, range scaling and budget settings.
    pub settings: BTreeMap<String, serde_json::Value>,
}

impl Inputs {
    pub fn new(
        sources: BTreeMap<String, String>,
        recipe: String,
        calibration: Option<String>,
        settings: BTreeMap<String, serde_json::Value>,
    ) -> Self {
        let tool_version = crate::VERSION.to_string();
        let canonical = serde_json::json!({
            "tool_version": tool_version,
            "sources": sources,
            "recipe": recipe,
            "calibration": calibration,
            "settings": settings,
        });
        let fingerprint = crate::util::sha256_hex(canonical.to_string().as_bytes());
        Inputs {
            fingerprint,
            tool_version,
            sources,
            recipe,
            calibration,
            settings,
        }
    }

    /// The inputs recorded in a package's `X.report.json`, if it has a readable one.
    pub fn recorded(package: &Path) -> Option<Inputs> {
        let report = Outputs::for_package(package).ok()?.report;
        let text = std::fs::read_to_string(report).ok()?;
        let value: serde_json::Value = serde_json::from_str(&text).ok()?;
        serde_json::from_value(value.get("inputs")?.clone()).ok()
    }
}

/// The checkpoint a package's report (`X.report.json` beside `X.mlpackage`) says it was
/// converted from, if the report exists and says so.
pub fn recorded_source(package: &Path) -> Option<PathBuf> {
    let report = crate::runtime::text::beside_package(package, "report.json");
    let text = crate::fsutil::read_input_text(&report, 64 << 20).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    value.get("source")?.as_str().map(PathBuf::from)
}

/// `X.report.json`: the summary without the stage times.
pub(super) fn report_bytes(summary: &ConvertSummary) -> Result<Vec<u8>, ConvertError> {
    // The file holds what the package is, not how long it took: the same inputs write the
    // same bytes. Stage times are in the returned summary (`convert --json`).
    let mut recorded = serde_json::to_value(summary)?;
    if let Some(map) = recorded.as_object_mut() {
        map.remove("times");
    }
    Ok(serde_json::to_vec_pretty(&recorded)?)
}
