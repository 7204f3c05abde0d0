//! Issue 24: does a LUT per group of rows (iOS18 grouped palettization) lower a projection's
//! output error against one LUT per tensor, fitted the same way? Palettizes a few real
//! projections of a checkpoint with each method and prints the relative output error
//! tr(ΔW·H·ΔWᵀ)/tr(W·H·Wᵀ) on the calibration text's float activations (H = XᵀX), inputs
//! rotated as `rotate = true` does (W·Q against QᵀHQ). Layer by layer, not the model.
//!
//! cargo run --release --example group_error -- MODEL_DIR [LAYER...]
//! CALIB_TOKENS=N: calibrate on the first N tokens of fixtures/calibration.txt (default all).

use std::path::Path;

use candle_core::{Device, Tensor};
use hf2coreml::arch::Role;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::calibrate::{calibrate, CalibrationOptions, GramSelection};
use hf2coreml::quant::calibrated::{quantize_linear, relative_output_error, LinearMethod};
use hf2coreml::quant::sequential::rotation_transpose;

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
        .encode(include_str!("../fixtures/calibration.txt"), false)
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
    print!("| projection |");
    methods.iter().for_each(|(n, _)| print!(" {n} |"));
    println!();
    println!("|---|{}", "---|".repeat(methods.len()));
    for &l in &layers {
        for role in roles {
            let slot = ckpt
                .slots()
                .into_iter()
                .find(|s| s.layer == Some(l) && s.role == role)
                .unwrap();
            let (rows, cols) = (slot.shape[0], slot.shape[1]);
            let w = ckpt.tensor(&slot.name).unwrap().to_f32();
            let gram = &stats.input(l, role).unwrap().gram.as_ref().unwrap().sum;
            let (wq, hq) = rotate(&w, rows, cols, gram);
            print!("| {} |", slot.name);
            for (_, m) in &methods {
                let q = quantize_linear(&wq, rows, cols, Some(&hq), m).unwrap();
                let e = relative_output_error(&wq, &q.dequantize(), rows, cols, &hq);
                print!(" {e:.5} |");
            }
            println!();
        }
    }
}
