//! The line `inspect` prints for a Gemma 4 package's or asset's per-layer table.

use hf2coreml::util::fmt_bytes;

/// Gemma 4's per-layer table as the contract declares it, and whether its file is beside the
/// package; `None` when the contract declares none.
pub(super) fn per_layer_line(c: &serde_json::Value, package: &std::path::Path) -> Option<String> {
    let t = c.get("per_layer")?;
    let n = |k: &str| t.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
    let (rows, layers, width) = (n("rows"), n("layers"), n("width"));
    let bytes = rows
        .saturating_mul(layers)
        .saturating_mul(width)
        .saturating_mul(2);
    let file = hf2coreml::mil::contract::per_layer_file(package);
    let name = file.file_name().unwrap_or_default().to_string_lossy();
    let state = match std::fs::metadata(&file) {
        Ok(m) if m.is_file() && m.len() == bytes => "beside the package",
        Ok(_) => "beside the package, NOT of the declared size",
        Err(_) => "MISSING (it ships beside the package)",
    };
    Some(format!(
        "{name}: {rows} rows × {layers} blocks × {width} fp16 ({}), {state}; the host gathers \
         each token's row into `per_layer_rows`",
        fmt_bytes(bytes)
    ))
}
