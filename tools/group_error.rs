//! Does a LUT per group of rows (iOS18 grouped palettization) lower a projection's
//! output error against one LUT per tensor, fitted the same way? Palettizes a few real
//! projections of a checkpoint with each method and prints the relative output error
//! tr(ΔW·H·ΔWᵀ)/tr(W·H·Wᵀ) on the calibration text's float activations (H = XᵀX), inputs
//! rotated as `rotate = true` does (W·Q against QᵀHQ). Layer by layer, not the model.
//!
//! cargo run --release -p hf2coreml-tools --bin group_error -- MODEL_DIR [LAYER...]
//! CALIB_TOKENS=N: calibrate on the first N tokens of assets/calibration.txt (default all).
//! VECTOR=1: instead, iOS18's vector LUTs against scalar ones at the same bits per weight: one
//! table of 2-vectors (pairs of neighbouring input channels) per tensor, 256 entries (8-bit
//! indices: 4 bits per weight) or 64 (3 bits), fitted by k-means weighted by E[x²] per channel
//! on the max-normalised rows, assigned nearest or with GPTQ's error feedback taken a pair of
//! columns at a time (the 2×2 block of the inverse Hessian's factor as the metric).

use std::path::Path;

use candle_core::{Device, Tensor};
use hf2coreml::arch::Role;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::calibrate::{calibrate, ActivationStats, CalibrationOptions, GramSelection};
use hf2coreml::quant::calibrate::{quantize_linear, relative_output_error, LinearMethod};
use hf2coreml::quant::linalg::inverse_upper_factor;
use hf2coreml::quant::rotation::rotation_transpose;
use rayon::prelude::*;

/// W·Q and QᵀHQ for the rotation of `cols` input channels (Qᵀ from `rotation_transpose`).
fn rotate(w: &[f32], rows: usize, cols: usize, gram: &[f64]) -> (Vec<f32>, Vec<f64>) {
    let dev = Device::Cpu;
    let qt = Tensor::from_vec(rotation_transpose(cols), (cols, cols), &dev).unwrap();
    let q = qt.t().unwrap().contiguous().unwrap();
    let wt = Tensor::from_vec(w.to_vec(), (rows, cols), &dev).unwrap();
    let wq = wt
        .matmul(&q)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let (q64, qt64) = (
        q.to_dtype(candle_core::DType::F64).unwrap(),
        qt.to_dtype(candle_core::DType::F64).unwrap(),
    );
    let h = Tensor::from_vec(gram.to_vec(), (cols, cols), &dev).unwrap();
    let hq = qt64.matmul(&h).unwrap().matmul(&q64).unwrap();
    (wq, hq.flatten_all().unwrap().to_vec1().unwrap())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = Path::new(&args[0]);
    let layers: Vec<usize> = match args.len() {
        1 => vec![0, 5, 11],
        _ => args[1..].iter().map(|a| a.parse().unwrap()).collect(),
    };
    let ckpt = Checkpoint::open(dir).unwrap();
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let mut calib = tok
        .encode(include_str!("../assets/calibration.txt"), false)
        .unwrap()
        .get_ids()
        .to_vec();
    if let Ok(n) = std::env::var("CALIB_TOKENS") {
        calib.truncate(n.parse().unwrap());
    }
    let roles = [Role::Q, Role::O, Role::Gate, Role::Down];
    let options = CalibrationOptions {
        gram: GramSelection::Roles(roles.to_vec()),
        ..Default::default()
    };
    let stats = calibrate(&ckpt, &calib, &options).unwrap();
    eprintln!("calibration: {} tokens", calib.len());
    if std::env::var_os("VECTOR").is_some() {
        return vector_table(&ckpt, &stats, &layers, &roles);
    }
    let base = LinearMethod::calibrated(4);
    let methods: Vec<(&str, LinearMethod)> = vec![
        (
            "tensor, nearest",
            LinearMethod {
                gptq: false,
                ..base
            },
        ),
        (
            "g16, nearest",
            LinearMethod {
                gptq: false,
                group_size: 16,
                ..base
            },
        ),
        ("tensor, gptq", base),
        (
            "g32, gptq",
            LinearMethod {
                group_size: 32,
                ..base
            },
        ),
        (
            "g16, gptq",
            LinearMethod {
                group_size: 16,
                ..base
            },
        ),
        (
            "g8, gptq",
            LinearMethod {
                group_size: 8,
                ..base
            },
        ),
        (
            "tensor, no rs, gptq",
            LinearMethod {
                row_scale: false,
                ..base
            },
        ),
        (
            "g16, no rs, gptq",
            LinearMethod {
                row_scale: false,
                group_size: 16,
                ..base
            },
        ),
        (
            "g8, no rs, gptq",
            LinearMethod {
                row_scale: false,
                group_size: 8,
                ..base
            },
        ),
    ];
    header(methods.iter().map(|(n, _)| *n));
    for (name, rows, cols, wq, hq) in projections(&ckpt, &stats, &layers, &roles) {
        print!("| {name} |");
        for (_, m) in &methods {
            let q = quantize_linear(&wq, rows, cols, Some(&hq), m).unwrap();
            let e = relative_output_error(&wq, &q.dequantize(), rows, cols, &hq);
            print!(" {e:.5} |");
        }
        println!();
    }
}

/// A markdown table's first two lines.
fn header<'a>(columns: impl Iterator<Item = &'a str>) {
    let columns: Vec<&str> = columns.collect();
    print!("| projection |");
    columns.iter().for_each(|n| print!(" {n} |"));
    println!();
    println!("|---|{}", "---|".repeat(columns.len()));
}

/// Each projection of `roles` in `layers`: its name, rows, columns, rotated weight W·Q and
/// rotated Gram matrix QᵀHQ.
fn projections<'a>(
    ckpt: &'a Checkpoint,
    stats: &'a ActivationStats,
    layers: &'a [usize],
    roles: &'a [Role],
) -> impl Iterator<Item = (String, usize, usize, Vec<f32>, Vec<f64>)> + 'a {
    layers.iter().flat_map(move |&l| {
        roles.iter().map(move |&role| {
            let slot = ckpt
                .slots()
                .into_iter()
                .find(|s| s.layer == Some(l) && s.role == role)
                .unwrap();
            let (rows, cols) = (slot.shape[0], slot.shape[1]);
            let w = ckpt.tensor(&slot.name).unwrap().to_f32();
            let gram = &stats.input(l, role).unwrap().gram.as_ref().unwrap().sum;
            let (wq, hq) = rotate(&w, rows, cols, gram);
            (slot.name.clone(), rows, cols, wq, hq)
        })
    })
}

/// The VECTOR=1 table: scalar and 2-vector tables at 4 and 3 bits per weight.
fn vector_table(ckpt: &Checkpoint, stats: &ActivationStats, layers: &[usize], roles: &[Role]) {
    let scalar = |nbits: u8, act_order: bool| LinearMethod {
        act_order,
        ..LinearMethod::calibrated(nbits)
    };
    let heads = [
        "4-bit scalar, nearest",
        "4-bit scalar, GPTQ",
        "4-bit scalar, GPTQ, act order",
        "2-vector ×256, nearest",
        "2-vector ×256, GPTQ",
        "3-bit scalar, GPTQ, act order",
        "2-vector ×64, GPTQ",
    ];
    header(heads.into_iter());
    for (name, rows, cols, wq, hq) in projections(ckpt, stats, layers, roles) {
        let err = |d: &[f32]| relative_output_error(&wq, d, rows, cols, &hq);
        let sc = |m: LinearMethod| {
            err(&quantize_linear(&wq, rows, cols, Some(&hq), &m)
                .unwrap()
                .dequantize())
        };
        let row = [
            sc(LinearMethod {
                gptq: false,
                ..scalar(4, false)
            }),
            sc(scalar(4, false)),
            sc(scalar(4, true)),
            err(&vector_quantize(&wq, rows, cols, &hq, 256, false)),
            err(&vector_quantize(&wq, rows, cols, &hq, 256, true)),
            sc(scalar(3, true)),
            err(&vector_quantize(&wq, rows, cols, &hq, 64, true)),
        ];
        print!("| {name} |");
        row.iter().for_each(|e| print!(" {e:.5} |"));
        println!();
    }
}

/// `w` [rows, cols] through one table of `entries` 2-vectors (pairs of columns 2j, 2j+1) on
/// rows normalised by their largest |w|, dequantized. The table: k-means with each coordinate
/// weighted by its channel's E[x²] (H's diagonal), started from the product of a scalar
/// k-means table with itself. `gptq`: pairs are assigned in column order under the metric of
/// the 2×2 block of the damped inverse Hessian's factor, and the error fed forward.
fn vector_quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    h: &[f64],
    entries: usize,
    gptq: bool,
) -> Vec<f32> {
    let scale: Vec<f64> = (0..rows)
        .map(|r| {
            let m = w[r * cols..(r + 1) * cols]
                .iter()
                .fold(0f32, |a, &x| a.max(x.abs()));
            if m > 0.0 {
                m as f64
            } else {
                1.0
            }
        })
        .collect();
    let diag: Vec<f64> = (0..cols).map(|j| h[j * cols + j].max(1e-12)).collect();
    // The points (normalised pairs) and their per-coordinate weights.
    let pairs = cols / 2;
    let points: Vec<[f64; 2]> = (0..rows * pairs)
        .map(|i| {
            let (r, p) = (i / pairs, i % pairs);
            let v = |c: usize| w[r * cols + c] as f64 / scale[r];
            [v(2 * p), v(2 * p + 1)]
        })
        .collect();
    let weight = |i: usize| {
        let (r, p) = (i / pairs, i % pairs);
        let s2 = scale[r] * scale[r];
        [diag[2 * p] * s2, diag[2 * p + 1] * s2]
    };
    let side = (entries as f64).sqrt().round() as usize;
    // A scalar weighted k-means of every coordinate, `side` levels.
    let mut levels: Vec<f64> = (0..side)
        .map(|k| -1.0 + (2 * k + 1) as f64 / side as f64)
        .collect();
    for _ in 0..30 {
        let mut acc = vec![(0.0f64, 0.0f64); side];
        for (i, p) in points.iter().enumerate() {
            let wt = weight(i);
            for d in 0..2 {
                let k = nearest1(&levels, p[d]);
                acc[k].0 += wt[d] * p[d];
                acc[k].1 += wt[d];
            }
        }
        for (l, (a, b)) in levels.iter_mut().zip(&acc) {
            if *b > 0.0 {
                *l = a / b;
            }
        }
    }
    let mut table: Vec<[f64; 2]> = (0..side * side)
        .map(|k| [levels[k / side], levels[k % side]])
        .collect();
    // Lloyd in 2-D on the weighted metric.
    for _ in 0..25 {
        let assign: Vec<usize> = points
            .par_iter()
            .enumerate()
            .map(|(i, p)| nearest2(&table, p, weight(i)))
            .collect();
        let mut acc = vec![[0.0f64; 4]; table.len()];
        for (i, &k) in assign.iter().enumerate() {
            let (p, wt) = (points[i], weight(i));
            acc[k][0] += wt[0] * p[0];
            acc[k][1] += wt[0];
            acc[k][2] += wt[1] * p[1];
            acc[k][3] += wt[1];
        }
        for (c, a) in table.iter_mut().zip(&acc) {
            if a[1] > 0.0 {
                c[0] = a[0] / a[1];
            }
            if a[3] > 0.0 {
                c[1] = a[2] / a[3];
            }
        }
    }
    let mut out = vec![0f32; rows * cols];
    if !gptq {
        for (i, p) in points.iter().enumerate() {
            let k = nearest2(&table, p, weight(i));
            let (r, q) = (i / pairs, i % pairs);
            out[r * cols + 2 * q] = (table[k][0] * scale[r]) as f32;
            out[r * cols + 2 * q + 1] = (table[k][1] * scale[r]) as f32;
        }
        return out;
    }
    // GPTQ over pairs: H⁻¹ = UᵀU (damped as the shipped GPTQ damps, 0.01 of the mean diagonal).
    let mean = diag.iter().sum::<f64>() / cols as f64;
    let mut hd = h.to_vec();
    for j in 0..cols {
        hd[j * cols + j] = hd[j * cols + j].max(0.0) + 0.01 * mean;
    }
    let u = inverse_upper_factor(&hd, cols).expect("positive definite");
    out.par_chunks_mut(cols).enumerate().for_each(|(r, o)| {
        let mut x: Vec<f64> = w[r * cols..(r + 1) * cols]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let s = scale[r];
        for q in 0..pairs {
            let (j0, j1) = (2 * q, 2 * q + 1);
            let (u00, u01, u11) = (u[j0 * cols + j0], u[j0 * cols + j1], u[j1 * cols + j1]);
            // E = δ·U_BB⁻¹, the error GPTQ feeds forward; ‖E‖² is what quantizing δ costs.
            let e_of = |d0: f64, d1: f64| [d0 / u00, -d0 * u01 / (u00 * u11) + d1 / u11];
            let (mut best, mut best_e) = (f64::INFINITY, [0.0; 2]);
            let mut pick = 0;
            for (k, c) in table.iter().enumerate() {
                let e = e_of(x[j0] - c[0] * s, x[j1] - c[1] * s);
                let cost = e[0] * e[0] + e[1] * e[1];
                if cost < best {
                    (best, best_e, pick) = (cost, e, k);
                }
            }
            o[j0] = (table[pick][0] * s) as f32;
            o[j1] = (table[pick][1] * s) as f32;
            for c in j1 + 1..cols {
                x[c] -= best_e[0] * u[j0 * cols + c] + best_e[1] * u[j1 * cols + c];
            }
        }
    });
    out
}

fn nearest1(levels: &[f64], x: f64) -> usize {
    (0..levels.len())
        .min_by(|&a, &b| (levels[a] - x).abs().total_cmp(&(levels[b] - x).abs()))
        .unwrap_or(0)
}

fn nearest2(table: &[[f64; 2]], p: &[f64; 2], wt: [f64; 2]) -> usize {
    let mut best = (f64::INFINITY, 0);
    for (k, c) in table.iter().enumerate() {
        let d = wt[0] * (p[0] - c[0]).powi(2) + wt[1] * (p[1] - c[1]).powi(2);
        if d < best.0 {
            best = (d, k);
        }
    }
    best.1
}
