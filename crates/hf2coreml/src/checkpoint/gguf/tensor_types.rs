//! The tensor types a GGUF import dequantizes, and llama.cpp's names for every type id.

use super::dequant::GgmlType;

/// Tensor types the importer dequantizes.
pub const SUPPORTED_TYPES: [GgmlType; 15] = GgmlType::ALL;

/// The supported types as a list for messages: `F32, F16, BF16, Q4_0, ...`.
pub fn supported_types_list() -> String {
    SUPPORTED_TYPES
        .iter()
        .map(|t| type_name(t.id()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// llama.cpp's name for a tensor type id (`type 99` when it has none).
pub fn type_name(id: u32) -> String {
    let name = match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("type {id}"),
    };
    name.to_string()
}
