//! The LUT widths Core ML's `constexpr_lut_to_dense` accepts, which palettization and packing
//! are held to.

/// LUT sizes a `constexpr_lut_to_dense` accepts: iOS17's [`IOS17_NBITS`] plus iOS18's 3 bits.
pub const SUPPORTED_NBITS: [u8; 6] = [1, 2, 3, 4, 6, 8];

/// LUT sizes the iOS17 `constexpr_lut_to_dense` accepts (3-bit tables need iOS18).
pub const IOS17_NBITS: [u8; 5] = [1, 2, 4, 6, 8];

/// The supported widths as prose: `1, 2, 3, 4, 6 or 8`.
pub fn nbits_list() -> String {
    let n: Vec<String> = SUPPORTED_NBITS.iter().map(|b| b.to_string()).collect();
    match n.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => n.join(""),
    }
}
