use super::*;

/// Exact in f32 whatever the summation order: small integers.
fn data(n: usize) -> (Vec<f32>, Vec<f16>) {
    let x: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let w: Vec<f16> = (0..n)
        .map(|i| f16::from_f32(((i * 5) % 13) as f32 - 6.0))
        .collect();
    (x, w)
}

/// The levels this CPU has. Each one it lacks is named on the test run's stderr (written
/// past the harness's capture, so a passing run shows it too, once per process): skipped,
/// never silently.
fn levels() -> Vec<Isa> {
    static NAMED: std::sync::Once = std::sync::Once::new();
    NAMED.call_once(|| {
        use std::io::Write;
        for level in Isa::ALL.into_iter().filter(|l| !l.available()) {
            let _ = writeln!(
                std::io::stderr(),
                "kernels: this CPU lacks {level} (best {}): its variants are skipped",
                isa::detected()
            );
        }
    });
    Isa::ALL.into_iter().filter(|l| l.available()).collect()
}

/// The vector levels' dot product in portable code: four accumulators of 8 lanes over
/// blocks of 32, fused multiply-adds, then 8 at a time into the first, AVX2's horizontal sum
/// (lanes i and i + 4, then (0 + 2) + (1 + 3)) and the unfused scalar tail.
fn vector_order(x: &[f32], w: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            for (l, a) in acc.iter_mut().enumerate() {
                *a = x[i + 8 * k + l].mul_add(w[i + 8 * k + l], *a);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        for (l, a) in acc[0].iter_mut().enumerate() {
            *a = x[i + l].mul_add(w[i + l], *a);
        }
        i += 8;
    }
    let v: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let mut sum = lanes_sum(v);
    while i < n {
        sum += x[i] * w[i];
        i += 1;
    }
    sum
}

/// AVX2's horizontal sum of 8 lanes: lanes i and i + 4, then (0 + 2) + (1 + 3).
fn lanes_sum(v: [f32; 8]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Every vector level sums in [`vector_order`], bit for bit, on values that round; the
/// blocked product's tiles in 8 lanes, reduced the same way.
#[test]
fn every_vector_level_sums_in_one_order() {
    for n in [0, 1, 7, 8, 9, 31, 32, 33, 40, 63, 64, 65, 575, 1537] {
        let x: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 3.1).collect();
        let h: Vec<f16> = (0..n)
            .map(|i| f16::from_f32(((i as f32) * 0.11).cos()))
            .collect();
        let w: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        let want = vector_order(&x, &w).to_bits();
        let body = n / 8 * 8;
        let mut lanes = [0f32; 8];
        for i in 0..body {
            lanes[i % 8] = x[i].mul_add(w[i], lanes[i % 8]);
        }
        let mut tile_want = lanes_sum(lanes);
        for i in body..n {
            tile_want += x[i] * w[i];
        }
        for level in levels().into_iter().filter(|&l| l != Isa::Scalar) {
            assert_eq!(
                dot_at(level, &x, &w).to_bits(),
                want,
                "dot at {level}, n={n}"
            );
            let got = dot_f16_at(level, &x, &h).to_bits();
            assert_eq!(got, want, "dot_f16 at {level}, n={n}");
            let mut tile = [0f32; 2];
            gemm_nt_at(level, &x, 1, &w, 1, n, &mut tile[..1]);
            gemm_nt_f16_at(level, &x, 1, &h, 1, n, &mut tile[1..]);
            for (k, t) in tile.iter().enumerate() {
                assert_eq!(
                    t.to_bits(),
                    tile_want.to_bits(),
                    "tile {k} at {level}, n={n}"
                );
            }
        }
    }
}

#[test]
fn kernels_agree_with_the_definition_at_every_length() {
    for n in [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 576, 1537] {
        let (x, w) = data(n);
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let want: f32 = x.iter().zip(&wf).map(|(a, b)| a * b).sum();
        assert_eq!(dot(&x, &wf), want, "dot n={n}");
        assert_eq!(dot_f16(&x, &w), want, "dot_f16 n={n}");
        for level in levels() {
            assert_eq!(dot_at(level, &x, &wf), want, "dot at {level}, n={n}");
            assert_eq!(dot_f16_at(level, &x, &w), want, "dot_f16 at {level}, n={n}");
        }
        assert_eq!(dot_portable(&x, &wf), want, "portable n={n}");
        assert_eq!(dot_f16_portable(&x, &w), want, "portable f16 n={n}");
    }
}

#[test]
fn scans_find_the_largest_finite_magnitude_and_count_the_rest() {
    for n in [0, 1, 7, 8, 9, 16, 17, 100] {
        let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - 40.0) * 0.5).collect();
        let want = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert_eq!(scan_f32(&v), (want, 0), "n={n}");
        assert_eq!(scan_f32_lanes(&v), (want, 0), "n={n}");
        #[cfg(target_arch = "x86_64")]
        if levels().contains(&Isa::Avx2) {
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            // SAFETY: the CPU has AVX2 (checked above).
            let (a, b) = unsafe { (x86::scan_f32(&v), x86::scan_f16(&h)) };
            assert_eq!((a, b), ((want, 0), (want, 0)), "AVX2 scans, n={n}");
        }
        let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        assert_eq!(scan_f16(&h), (want, 0), "n={n}");
        assert_eq!(scan_f16_lanes(&h), (want, 0), "n={n}");
        if n > 3 {
            v[1] = f32::INFINITY;
            v[n - 1] = f32::NAN;
            v[2] = -1e30;
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let (m, bad) = scan_f32(&v);
            assert_eq!((m, bad), (1e30, 2), "n={n}");
            // -1e30 overflows fp16 to -inf.
            assert_eq!(scan_f16(&h).1, 3, "n={n}");
            assert_eq!(scan_f16(&h), scan_f16_lanes(&h), "n={n}");
        }
    }
}

/// Indices spread over the whole table, packed as Core ML packs them.
fn packed_indices(n: usize, nbits: u32) -> (Vec<u32>, Vec<u8>) {
    let idx: Vec<u32> = (0..n)
        .map(|i| ((i * 37 + i / 3 + i * i) % (1 << nbits)) as u32)
        .collect();
    let small: Vec<u8> = idx.iter().map(|&i| i as u8).collect();
    let bytes = crate::pack::pack_indices(&small, nbits as u8);
    (idx, bytes)
}

fn table16() -> Table<f16> {
    let mut t = [f16::ZERO; 256];
    for (i, v) in t.iter_mut().enumerate() {
        // Distinct bit patterns in both bytes: a swapped or shifted byte shows.
        *v = f16::from_f32((i as f32 - 100.3) * 1.37);
    }
    t
}

#[test]
fn unpacking_reads_every_bit_width_at_every_offset() {
    let t = table16();
    let tf: Table<f32> = t.map(|v| v.to_f32());
    for nbits in 1..=8 {
        let (idx, bytes) = packed_indices(203, nbits);
        for e0 in [0, 1, 3, 7, 8, 13] {
            for n in [0, 1, 5, 8, 31, 32, 33, 64, 65, 190 - e0] {
                let want: Vec<f16> = idx[e0..e0 + n].iter().map(|&i| t[i as usize]).collect();
                let mut got = vec![f16::ZERO; n];
                unpack(&bytes, e0, nbits, &t, &mut got);
                assert_eq!(got, want, "portable, {nbits} bits, e0={e0}, n={n}");
                unpack_f16(&bytes, e0, nbits, &t, &mut got);
                assert_eq!(got, want, "unpack_f16, {nbits} bits, e0={e0}, n={n}");
                let mut full = vec![0f32; n];
                unpack(&bytes, e0, nbits, &tf, &mut full);
                let wf: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
                assert_eq!(full, wf, "f32 entries, {nbits} bits, e0={e0}, n={n}");
            }
        }
    }
}

/// An x of n values and `dot_f16` of it with the row of n decoded from element e0 on: x
/// is not exact in f32, so a different summation order would show in the bits.
fn decoded_dot(bytes: &[u8], e0: usize, nbits: u32, t: &Table<f16>, n: usize) -> (Vec<f32>, f32) {
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1013) as f32 / 97.1 - 5.0)
        .collect();
    let mut w = vec![f16::ZERO; n];
    unpack(bytes, e0, nbits, t, &mut w);
    let want = dot_f16(&x, &w);
    (x, want)
}

#[test]
fn dot_over_a_lut_row_gives_the_bits_of_dot_over_the_decoded_row() {
    let t = table16();
    for nbits in 1..=8 {
        let (_, bytes) = packed_indices(1200, nbits);
        for e0 in [0, 1, 2, 8, 64] {
            for n in [0, 1, 7, 8, 31, 32, 33, 40, 63, 64, 65, 575, 1100] {
                let (x, want) = decoded_dot(&bytes, e0, nbits, &t, n);
                let lut = LutTable::new(&t, 1 << nbits);
                let got = dot_lut_f16(&x, &bytes, e0, nbits, &lut, &mut Vec::new());
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{nbits} bits, e0={e0}, n={n}"
                );
            }
        }
    }
}

#[test]
fn every_level_looks_up_the_bits_of_the_portable_lookup() {
    let t = table16();
    for nbits in [2, 4, 6, 8] {
        let (_, bytes) = packed_indices(1000, nbits);
        for level in levels() {
            for e0 in [0, 1, 2, 31, 32, 33] {
                for n in [0, 1, 31, 32, 33, 63, 64, 65, 96, 900] {
                    let (mut a, mut b) = (vec![f16::ZERO; n], vec![f16::ONE; n]);
                    unpack(&bytes, e0, nbits, &t, &mut a);
                    unpack_f16_at(level, &bytes, e0, nbits, &t, &mut b);
                    assert_eq!(a, b, "{level}, {nbits} bits, e0={e0}, n={n}");
                }
            }
        }
    }
}

/// The LUT product at each level against that level's `dot_f16` over the decoded row (not
/// exact in f32: a different summation order shows), and the x86 levels against each other.
#[test]
fn every_level_multiplies_a_lut_row_as_its_dense_product_does() {
    let t = table16();
    for nbits in [3, 4, 6] {
        let (_, bytes) = packed_indices(1300, nbits);
        for e0 in [0, 1, 2, 8, 64] {
            for n in [0, 1, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 575, 1100] {
                let (x, _) = decoded_dot(&bytes, e0, nbits, &t, n);
                let mut w = vec![f16::ZERO; n];
                unpack(&bytes, e0, nbits, &t, &mut w);
                let mut got = Vec::new();
                let prepared = LutTable::new(&t, 1 << nbits);
                for level in levels() {
                    let want = dot_f16_at(level, &x, &w);
                    let mut row = Vec::new();
                    let lut = dot_lut_f16_at(level, &x, &bytes, e0, nbits, &prepared, &mut row);
                    let what = format!("{level}, {nbits} bits, e0={e0}, n={n}");
                    assert_eq!(lut.to_bits(), want.to_bits(), "{what}");
                    got.push((level, lut));
                }
                // AVX2, AVX-512 and NEON keep the same accumulators.
                let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
                let vector = vector_order(&x, &wide).to_bits();
                for (level, v) in got.iter().filter(|(l, _)| *l != Isa::Scalar) {
                    assert_eq!(v.to_bits(), vector, "{level}, {nbits} bits, e0={e0}, n={n}");
                }
            }
        }
    }
}

/// Entries whose widening is unusual: signed zeros, subnormals, the extremes.
fn special_table() -> Table<f16> {
    let mut t = [f16::ZERO; 256];
    let special = [
        f16::ZERO,
        f16::NEG_ZERO,
        f16::from_bits(0x0001),
        f16::from_bits(0x83ff),
        f16::MIN_POSITIVE,
        f16::MAX,
        f16::MIN,
        f16::from_f32(-1.0),
    ];
    for (k, v) in t[..64].iter_mut().enumerate() {
        *v = special[k % 8];
    }
    t[9] = f16::from_f32(3.0e-5);
    t[41] = f16::from_f32(-7.5e-6);
    t
}

/// Entries whose widening is unusual (signed zeros, subnormals, the extremes): the byte
/// tables and the widened table hold exactly what `dot_f16` widens.
#[test]
fn every_level_reads_signed_zeros_subnormals_and_extremes_exactly() {
    let t = special_table();
    for nbits in [4, 6] {
        let (_, bytes) = packed_indices(700, nbits);
        let x: Vec<f32> = (0..600).map(|i| ((i * 31) % 17) as f32 - 8.5).collect();
        let mut w = vec![f16::ZERO; 600];
        unpack(&bytes, 0, nbits, &t, &mut w);
        let prepared = LutTable::new(&t, 1 << nbits);
        for level in levels() {
            let want = dot_f16_at(level, &x, &w);
            let got = dot_lut_f16_at(level, &x, &bytes, 0, nbits, &prepared, &mut Vec::new());
            assert_eq!(got.to_bits(), want.to_bits(), "{level}, {nbits} bits");
        }
    }
}

/// Rows that end where the packed data ends: the vector loops stop before a load would
/// pass the last byte, and the tail (up to 37 values for 6-bit rows) sums as `dot_f16`.
#[test]
fn rows_ending_at_the_end_of_the_data_multiply_as_their_dense_product() {
    let t = table16();
    for nbits in [4, 6] {
        for e0 in [0, 4, 8, 64] {
            for n in [32, 36, 60, 64, 68, 92, 96, 100, 124, 128, 1024, 1028] {
                let (_, bytes) = packed_indices(e0 + n, nbits);
                let (x, _) = decoded_dot(&bytes, e0, nbits, &t, n);
                let mut w = vec![f16::ZERO; n];
                unpack(&bytes, e0, nbits, &t, &mut w);
                let prepared = LutTable::new(&t, 1 << nbits);
                for level in levels() {
                    let want = dot_f16_at(level, &x, &w);
                    let got =
                        dot_lut_f16_at(level, &x, &bytes, e0, nbits, &prepared, &mut Vec::new());
                    let what = format!("{level}, {nbits} bits, e0={e0}, n={n}");
                    assert_eq!(got.to_bits(), want.to_bits(), "{what}");
                }
            }
        }
    }
}

#[test]
fn the_blocked_product_is_every_dot_product_at_every_shape() {
    for k in [0, 1, 7, 8, 9, 17, 64, 70] {
        for rows in [1, 2, 3, 4, 5, 8, 9] {
            for wrows in [1, 2, 3, 5] {
                let x: Vec<f32> = (0..rows * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
                let w: Vec<f32> = (0..wrows * k)
                    .map(|i| ((i * 5) % 13) as f32 - 6.0)
                    .collect();
                let want: Vec<f32> = (0..wrows)
                    .flat_map(|o| {
                        let (x, w) = (&x, &w);
                        (0..rows)
                            .map(move |r| (0..k).map(|i| x[r * k + i] * w[o * k + i]).sum::<f32>())
                    })
                    .collect();
                for level in levels() {
                    let mut got = vec![f32::NAN; rows * wrows];
                    gemm_nt_at(level, &x, rows, &w, wrows, k, &mut got);
                    assert_eq!(got, want, "{level} k={k} rows={rows} wrows={wrows}");
                    let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
                    let mut got = vec![f32::NAN; rows * wrows];
                    gemm_nt_f16_at(level, &x, rows, &h, wrows, k, &mut got);
                    assert_eq!(got, want, "{level} fp16 k={k} rows={rows} wrows={wrows}");
                }
                let mut got = vec![f32::NAN; rows * wrows];
                gemm_nt(&x, rows, &w, wrows, k, &mut got);
                assert_eq!(got, want, "k={k} rows={rows} wrows={wrows}");
                let mut port = vec![f32::NAN; rows * wrows];
                gemm_nt_portable(&x, rows, &w, wrows, k, &mut port, |v| v);
                assert_eq!(port, want, "portable k={k} rows={rows} wrows={wrows}");
                let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
                let mut half = vec![f32::NAN; rows * wrows];
                gemm_nt_f16(&x, rows, &h, wrows, k, &mut half);
                assert_eq!(half, want, "fp16 k={k} rows={rows} wrows={wrows}");
                let mut port = vec![f32::NAN; rows * wrows];
                gemm_nt_portable(&x, rows, &h, wrows, k, &mut port, f16::to_f32);
                assert_eq!(port, want, "portable fp16 k={k} rows={rows} wrows={wrows}");
            }
        }
    }
}

#[test]
fn the_blocked_product_rounds_like_a_dot_product() {
    // Not small integers: the sums round, and agree with dot's to f32 rounding.
    let (rows, wrows, k) = (6, 3, 1000);
    let x: Vec<f32> = (0..rows * k).map(|i| ((i as f32) * 0.37).sin()).collect();
    let w: Vec<f32> = (0..wrows * k).map(|i| ((i as f32) * 0.11).cos()).collect();
    let mut got = vec![0f32; rows * wrows];
    gemm_nt(&x, rows, &w, wrows, k, &mut got);
    for o in 0..wrows {
        for r in 0..rows {
            let exact: f64 = (0..k)
                .map(|i| x[r * k + i] as f64 * w[o * k + i] as f64)
                .sum();
            let g = got[o * rows + r] as f64;
            assert!((g - exact).abs() < 1e-4, "{g} vs {exact}");
            let d = dot(&x[r * k..(r + 1) * k], &w[o * k..(o + 1) * k]) as f64;
            assert!((g - d).abs() < 1e-4, "{g} vs dot {d}");
        }
    }
    // fp16 weights: the same product as their exact f32 widening.
    let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wide: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
    let (mut a, mut b) = (vec![0f32; rows * wrows], vec![0f32; rows * wrows]);
    gemm_nt_f16(&x, rows, &h, wrows, k, &mut a);
    gemm_nt(&x, rows, &wide, wrows, k, &mut b);
    assert_eq!(a, b);
}

#[test]
fn uneven_lengths_use_the_common_prefix() {
    let (x, w) = data(40);
    let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    assert_eq!(dot(&x[..33], &wf), dot(&x[..33], &wf[..33]));
    assert_eq!(dot_f16(&x, &w[..17]), dot_f16(&x[..17], &w[..17]));
}

/// Both AVX2 lookups give the bits of the AVX2 `dot_f16` over the decoded row.
#[test]
fn both_avx2_lookups_give_the_same_bits() {
    if !levels().contains(&Isa::Avx2) {
        return;
    }
    for t in [table16(), special_table()] {
        let (_, bytes) = packed_indices(1300, 4);
        let prepared = LutTable::new(&t, 16);
        for e0 in [0, 2, 8, 64] {
            for n in [0, 1, 31, 32, 33, 64, 65, 575, 1100] {
                let (x, _) = decoded_dot(&bytes, e0, 4, &t, n);
                let mut w = vec![f16::ZERO; n];
                unpack(&bytes, e0, 4, &t, &mut w);
                let want = dot_f16_at(Isa::Avx2, &x, &w).to_bits();
                for lookup in Avx2Lookup::ALL {
                    let got = dot_lut4_avx2(lookup, &x, &bytes, e0, &prepared).to_bits();
                    assert_eq!(got, want, "{lookup:?}, e0={e0}, n={n}");
                }
            }
        }
    }
}
