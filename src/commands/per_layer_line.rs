//! The line `inspect` prints for a Gemma 4 package's or asset's per-layer table.

use hf2coreml::util::fmt_bytes;

/// Gemma 4's per-layer table as the contract declares it, and whether its file is beside the
/// package; `None` when the contract declares none.
pub(super) fn per_layer_line(c: &serde_json::Value, package: &std::path::Path) -> Option<String> {
    let t = c.get("per_layer")?;
    let file = hf2coreml::mil::contract::per_layer_file(package);
    let name = file.file_name().unwrap_or_default().to_string_lossy();
    let t: hf2coreml::mil::contract::PerLayerTable = match serde_json::from_value(t.clone()) {
        Ok(t) => t,
        Err(e) => {
            return Some(format!(
                "{name}: the contract's per_layer is unreadable ({e})"
            ))
        }
    };
    let bytes = t.file_bytes();
    let state = match std::fs::metadata(&file) {
        Ok(m) if m.is_file() && m.len() == bytes => "beside the package",
        Ok(_) => "beside the package, NOT of the declared size",
        Err(_) => "MISSING (it ships beside the package)",
    };
    Some(format!(
        "{name}: {} rows × {} blocks × {} {} ({}), {state}; the host gathers each token's row \
         into `per_layer_rows`",
        t.rows,
        t.layers,
        t.width,
        t.dtype,
        fmt_bytes(bytes)
    ))
}
