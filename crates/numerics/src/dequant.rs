//! ggml tensor types: their block layouts, and dequantization of the common ones.
//!
//! Every formula follows ggml's reference dequantizers (`ggml-quants.c`, `dequantize_row_*`)
//! in the order gguf-py evaluates them in f32 (the scale products first, then the value), so
//! the results agree with gguf-py bit for bit (tests/it/gguf/dequant.rs checks every type).

use half::f16;

/// Elements per K-quant super-block.
const QK_K: usize = 256;

/// IQ4_NL's and IQ4_XS's non-linear 4-bit grid (ggml `kvalues_iq4nl`).
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// A tensor type the importer dequantizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

impl GgmlType {
    /// Every dequantized type, in the order messages list them.
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
    ];

    /// ggml's type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ4XS => 23,
            GgmlType::BF16 => 30,
        }
    }

    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        let (e, b) = block_layout(self.id()).unwrap_or((1, 4));
        (e as usize, b as usize)
    }

    /// Dequantize whole blocks of this type into `out` (appended). `bytes.len()` must be a
    /// multiple of the block size (the reader checks every tensor's size against its shape).
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        let (elems, size) = self.block();
        out.reserve(bytes.len() / size * elems);
        let each: fn(&[u8], &mut Vec<f32>) = match self {
            GgmlType::F32 => |b, o| o.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            GgmlType::F16 => |b, o| o.push(half_at(b, 0)),
            GgmlType::BF16 => |b, o| o.push(f32::from_bits(u32::from(u16_at(b, 0)) << 16)),
            GgmlType::Q4_0 => q4_0,
            GgmlType::Q4_1 => q4_1,
            GgmlType::Q5_0 => q5_0,
            GgmlType::Q5_1 => q5_1,
            GgmlType::Q8_0 => q8_0,
            GgmlType::Q2K => q2_k,
            GgmlType::Q3K => q3_k,
            GgmlType::Q4K => q4_k,
            GgmlType::Q5K => q5_k,
            GgmlType::Q6K => q6_k,
            GgmlType::IQ4NL => iq4_nl,
            GgmlType::IQ4XS => iq4_xs,
        };
        for block in bytes.chunks_exact(size) {
            each(block, out);
        }
    }
}

/// (elements per block, bytes per block) of any ggml type id llama.cpp writes, dequantized
/// here or not (for sizes and bits per weight); `None` for ids ggml does not define.
pub fn block_layout(id: u32) -> Option<(u64, u64)> {
    Some(match id {
        0 => (1, 4),        // F32
        1 | 30 => (1, 2),   // F16, BF16
        2 | 20 => (32, 18), // Q4_0, IQ4_NL
        3 => (32, 20),      // Q4_1
        6 => (32, 22),      // Q5_0
        7 => (32, 24),      // Q5_1
        8 => (32, 34),      // Q8_0
        9 => (32, 36),      // Q8_1
        10 => (256, 84),    // Q2_K
        11 => (256, 110),   // Q3_K
        12 => (256, 144),   // Q4_K
        13 => (256, 176),   // Q5_K
        14 => (256, 210),   // Q6_K
        15 => (256, 292),   // Q8_K
        16 => (256, 66),    // IQ2_XXS
        17 => (256, 74),    // IQ2_XS
        18 => (256, 98),    // IQ3_XXS
        19 => (256, 50),    // IQ1_S
        21 => (256, 110),   // IQ3_S
        22 => (256, 82),    // IQ2_S
        23 => (256, 136),   // IQ4_XS
        24 => (1, 1),       // I8
        25 => (1, 2),       // I16
        26 => (1, 4),       // I32
        27 | 28 => (1, 8),  // I64, F64
        29 => (256, 56),    // IQ1_M
        34 => (256, 54),    // TQ1_0
        35 => (256, 66),    // TQ2_0
        39 => (32, 17),     // MXFP4
        _ => return None,
    })
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16_at(b, i)).to_f32()
}

/// The 32 4-bit values of a 16-byte run: low nibbles are elements 0-15, high ones 16-31.
fn nibbles(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for (i, &b) in qs[..16].iter().enumerate() {
        q[i] = b & 0x0F;
        q[i + 16] = b >> 4;
    }
    q
}

/// Q5's 32 values: nibbles plus a fifth bit from the u32 `qh`.
fn five_bits(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = nibbles(qs);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((h >> j) & 1) as u8) << 4;
    }
    q
}

fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    out.extend(nibbles(&b[2..]).map(|q| d * (q as i8 - 8) as f32));
}

fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    out.extend(nibbles(&b[4..]).map(|q| d * q as f32 + m));
}

fn q5_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    out.extend(five_bits(&b[2..6], &b[6..]).map(|q| d * (q as i8 - 16) as f32));
}

fn q5_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    out.extend(five_bits(&b[4..8], &b[8..]).map(|q| d * q as f32 + m));
}

fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
}

/// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
fn q2_k(b: &[u8], out: &mut Vec<f32>) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    for e in 0..QK_K {
        // Element 128h + 32s + l holds bits 2s..2s+2 of qs[32h + l].
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let q = (qs[32 * h + l] >> (2 * s)) & 3;
        let sc = scales[e / 16];
        let dl = d * (sc & 0xF) as f32;
        let ml = dmin * (sc >> 4) as f32;
        out.push(dl * q as f32 - ml);
    }
}

/// Q3_K: hmask[32], qs[64], scales[12] (16 6-bit scales, minus 32), d.
fn q3_k(b: &[u8], out: &mut Vec<f32>) {
    let (hmask, qs, sc) = (&b[..32], &b[32..96], &b[96..108]);
    let d = half_at(b, 108);
    let scale = |j: usize| {
        let low = (sc[j % 8] >> (4 * (j / 8))) & 0x0F;
        let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 0x03;
        ((low | (high << 4)) as i8 - 32) as f32
    };
    for e in 0..QK_K {
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i8;
        // The offset of 4 applies when the high bit is 0.
        let high_clear = ((hmask[l] >> (e / 32)) & 1) ^ 1;
        let q = low - ((high_clear << 2) as i8);
        out.push(d * scale(e / 16) * q as f32);
    }
}

/// `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of Q4_K/Q5_K.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K/Q5_K: d, dmin, scales[12], then (Q5_K) qh[32], then qs[128].
fn k4_k5(b: &[u8], qh: Option<&[u8]>, qs: &[u8], out: &mut Vec<f32>) {
    let (d, dmin, scales) = (half_at(b, 0), half_at(b, 2), &b[4..16]);
    for e in 0..QK_K {
        // Element 64c + 32h + l is nibble h of qs[32c + l].
        let (c, h, l) = (e / 64, (e % 64) / 32, e % 32);
        let mut q = (qs[32 * c + l] >> (4 * h)) & 0x0F;
        if let Some(qh) = qh {
            q |= ((qh[l] >> (e / 32)) & 1) << 4;
        }
        let (sc, m) = scale_min_k4(e / 32, scales);
        let dl = d * sc as f32;
        let ml = dmin * m as f32;
        out.push(dl * q as f32 - ml);
    }
}

fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    k4_k5(b, None, &b[16..144], out);
}

fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    k4_k5(b, Some(&b[16..48]), &b[48..176], out);
}

/// Q6_K: ql[128], qh[64], scales[16] int8, d.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    for e in 0..QK_K {
        // Half h of 128: low 4 bits from ql[64h + i] (nibble i / 64), high 2 bits from
        // qh[32h + l] (bits 2k..2k+2 for element 32k + l of the half).
        let (h, i) = (e / 128, e % 128);
        let low = (ql[64 * h + i % 64] >> (4 * (i / 64))) & 0x0F;
        let high = (qh[32 * h + i % 32] >> (2 * (i / 32))) & 0x03;
        let q = (low | (high << 4)) as i8 - 32;
        let dl = d * scales[e / 16] as i8 as f32;
        out.push(dl * q as f32);
    }
}

fn iq4_nl(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    out.extend(nibbles(&b[2..]).map(|q| d * KVALUES_IQ4NL[q as usize] as f32));
}

/// IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; 8 sub-blocks of 32.
fn iq4_xs(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    let scales_h = u16_at(b, 2);
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for j in 0..8 {
        let low = (scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
        let high = ((scales_h >> (2 * j)) & 3) as u8;
        let dl = d * ((low | (high << 4)) as i8 - 32) as f32;
        out.extend(nibbles(&qs[16 * j..]).map(|q| dl * KVALUES_IQ4NL[q as usize] as f32));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_its_id_and_layout() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            let (e, b) = t.block();
            let mut out = Vec::new();
            t.dequantize(&vec![0u8; 2 * b], &mut out);
            assert_eq!(out.len(), 2 * e, "{t:?}");
            assert!(out.iter().all(|v| *v == 0.0), "{t:?}: zero bytes are zeros");
        }
    }

    #[test]
    fn scale_min_k4_reads_the_high_bits() {
        // Sub-block 4: scale from q[8] low nibble and q[0]'s top bits, min from q[8] high
        // nibble and q[4]'s top bits.
        let mut q = [0u8; 12];
        q[0] = 0b1100_0000;
        q[4] = 0b0100_0000;
        q[8] = 0x5A;
        assert_eq!(scale_min_k4(4, &q), (0x0A | (3 << 4), 0x05 | (1 << 4)));
        assert_eq!(scale_min_k4(0, &q), (0, 0));
    }
}
