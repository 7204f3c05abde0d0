//! Sub-byte index packing exactly as docs/reference/mlpackage-format.md specifies for
//! `constexpr_lut_to_dense` and blob storage: one continuous LSB-first bit stream,
//! `ceil(n·nbits/8)` bytes. Element k occupies bits `k·nbits .. (k+1)·nbits` of the stream, bit
//! b of the stream being bit `b % 8` of byte `b / 8`; 4-bit element 2k is the low nibble of
//! byte k; 6-bit elements straddle bytes.

use crate::NumericsError;

/// Bytes that `n` indices of `nbits` take.
pub fn packed_len(n: usize, nbits: u8) -> usize {
    (n * nbits as usize).div_ceil(8)
}

/// Pack `indices` (each `< 2^nbits`) into an LSB-first bit stream.
///
/// # Panics
/// If `nbits` is not in 1..=8 (a programming error: recipes validate nbits first). Bits of an
/// index above `nbits` are dropped.
pub fn pack_indices(indices: &[u8], nbits: u8) -> Vec<u8> {
    assert!((1..=8).contains(&nbits), "nbits {nbits} is not in 1..=8");
    let mask = ((1u16 << nbits) - 1) as u8;
    match nbits {
        8 => indices.to_vec(),
        4 => indices
            .chunks(2)
            .map(|c| (c[0] & 0xF) | (c.get(1).map_or(0, |h| h & 0xF) << 4))
            .collect(),
        _ => {
            let mut out = Vec::with_capacity(packed_len(indices.len(), nbits));
            let mut acc: u32 = 0;
            let mut bits: u32 = 0;
            for &i in indices {
                acc |= ((i & mask) as u32) << bits;
                bits += nbits as u32;
                while bits >= 8 {
                    out.push(acc as u8);
                    acc >>= 8;
                    bits -= 8;
                }
            }
            if bits > 0 {
                out.push(acc as u8);
            }
            out
        }
    }
}

/// Unpack `n` indices of `nbits` from an LSB-first bit stream.
///
/// # Panics
/// If `nbits` is not in 1..=8 or `packed` is shorter than [`packed_len`]`(n, nbits)`. Use
/// [`try_unpack_indices`] on data read from a file.
pub fn unpack_indices(packed: &[u8], nbits: u8, n: usize) -> Vec<u8> {
    match try_unpack_indices(packed, nbits, n) {
        Ok(v) => v,
        Err(e) => panic!("unpack_indices: {e}"),
    }
}

/// [`unpack_indices`] for untrusted input: a wrong `nbits` or a short buffer is an error.
/// Trailing bytes beyond the stream are ignored (blob records are padded).
pub fn try_unpack_indices(packed: &[u8], nbits: u8, n: usize) -> Result<Vec<u8>, NumericsError> {
    if !(1..=8).contains(&nbits) {
        return Err(NumericsError::UnsupportedNbits { nbits });
    }
    let need = packed_len(n, nbits);
    if packed.len() < need {
        return Err(NumericsError::ShortPacked {
            n,
            nbits,
            need,
            have: packed.len(),
        });
    }
    let mask = ((1u16 << nbits) - 1) as u32;
    Ok(match nbits {
        8 => packed[..n].to_vec(),
        4 => {
            let mut out = Vec::with_capacity(n);
            for &b in &packed[..need] {
                out.push(b & 0xF);
                out.push(b >> 4);
            }
            out.truncate(n);
            out
        }
        _ => {
            let mut out = Vec::with_capacity(n);
            let mut acc: u32 = 0;
            let mut bits: u32 = 0;
            let mut bytes = packed.iter();
            while out.len() < n {
                if bits < nbits as u32 {
                    // need <= packed.len() guarantees a byte is there while elements remain.
                    let Some(&b) = bytes.next() else { break };
                    acc |= (b as u32) << bits;
                    bits += 8;
                }
                while bits >= nbits as u32 && out.len() < n {
                    out.push((acc & mask) as u8);
                    acc >>= nbits;
                    bits -= nbits as u32;
                }
            }
            out
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bit_is_low_nibble_first() {
        assert_eq!(pack_indices(&[1, 2, 3], 4), vec![0x21, 0x03]);
        assert_eq!(unpack_indices(&[0x21, 0x03], 4, 3), vec![1, 2, 3]);
    }

    #[test]
    fn six_bit_crosses_bytes() {
        // 0b000001, 0b111111, 0b000010, 0b101010 → stream bits LSB-first.
        let packed = pack_indices(&[1, 63, 2, 42], 6);
        assert_eq!(packed.len(), 3);
        // byte0 = idx0 (bits 0-5) | low 2 bits of idx1 (bits 6-7)
        assert_eq!(packed[0], 1 | (0b11 << 6));
        // byte1 = high 4 bits of idx1 | low 4 bits of idx2
        assert_eq!(packed[1], 0b1111 | (0b0010 << 4));
        // byte2 = high 2 bits of idx2 | idx3 << 2
        assert_eq!(packed[2], (42 << 2));
        assert_eq!(unpack_indices(&packed, 6, 4), vec![1, 63, 2, 42]);
    }

    #[test]
    fn one_and_two_bit() {
        assert_eq!(
            pack_indices(&[1, 0, 1, 1, 0, 0, 0, 1, 1], 1),
            vec![0x8D, 0x01]
        );
        assert_eq!(pack_indices(&[3, 0, 1, 2, 1], 2), vec![0b10_01_00_11, 0b01]);
    }

    #[test]
    fn short_buffers_are_errors() {
        assert!(try_unpack_indices(&[0xFF], 4, 3).is_err());
        assert!(try_unpack_indices(&[0xFF], 5 + 4, 1).is_err());
        assert_eq!(
            try_unpack_indices(&[0xFF, 0x0F, 0xAA], 4, 3).unwrap(),
            vec![15, 15, 15]
        );
    }

    #[test]
    fn three_bit_stream_by_hand() {
        // Element k at bits 3k..3k+3: Σ v_k·8^k = 0x88E1DD for these eight values.
        let idx = [5, 3, 7, 0, 6, 1, 2, 4];
        assert_eq!(pack_indices(&idx, 3), vec![0xDD, 0xE1, 0x88]);
        assert_eq!(unpack_indices(&[0xDD, 0xE1, 0x88], 3, 8), idx.to_vec());
    }

    #[test]
    fn unpack_stops_at_n_with_bits_left_over() {
        // One byte holds four 2-bit and eight 1-bit indices: asking for fewer returns exactly
        // that many, the low bits first.
        assert_eq!(unpack_indices(&[0b1110_0110], 2, 1), vec![0b10]);
        assert_eq!(unpack_indices(&[0b1110_0110], 2, 3), vec![0b10, 0b01, 0b10]);
        assert_eq!(
            unpack_indices(&[0x8D, 0x01], 1, 9),
            vec![1, 0, 1, 1, 0, 0, 0, 1, 1]
        );
        assert_eq!(unpack_indices(&[0xAB, 0xCD], 8, 1), vec![0xAB]);
    }
}
