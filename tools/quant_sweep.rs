//! Method exploration for calibrated palettization: quantize the checkpoint with
//! several methods in the float model and compare each against the float reference on the
//! evaluation text, without building packages.
//!
//! cargo run -p hf2coreml-tools --bin quant_sweep -- MODEL_DIR [METHOD...]
//! METHOD: comma-separated flags: nbits=N, rs (row scale), w (E[x²] weights), gptq, ao (act
//! order), g=G (row groups), rot (input rotation), awq, nots (fit to float block
//! activations), damp=D, bpw=B (layersens: rank by the layer's own output error; klsens: by
//! the model's KL), chunk=R (allocate by R rows), seg=N (calibration segment length), ROLE=N
//! (e.g. down=6: that role at N bits), from=L:N (blocks L.. at N bits). Example:
//! `nbits=4,rs,w,gptq,ao,rot,bpw=4.5`.
//! CALIB_FILE=PATH calibrates on another text, CALIB_TOKENS=N on its first N tokens;
//! EVAL_FILE=PATH evaluates on another text (its first 1,024 tokens; the calibration text
//! itself shows how much a method overfits). MARGINS=1 prints how close to a tie the reference
//! was where the top-1 choices differ; HALVES=1 prints positions < 512 and ≥ 512 apart.

use std::path::Path;
use std::time::Instant;

use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::plain::PlainModel;
use hf2coreml::quant::calibrate::{
    quantize_checkpoint, LinearMethod, Sensitivity, SequentialOptions,
};
use hf2coreml::validate::metrics::compare_logits;

fn rows(t: &candle_core::Tensor) -> Vec<Vec<f32>> {
    t.to_vec2().unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = Path::new(&args[0]);
    let ckpt = Checkpoint::open(dir).unwrap();
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let enc = |t: &str| tok.encode(t, false).unwrap().get_ids().to_vec();
    // CALIB_FILE: calibrate on another text (a diagnostic: how much do the methods depend on
    // the calibration data?).
    let mut calib = match std::env::var("CALIB_FILE") {
        Ok(f) => enc(&std::fs::read_to_string(f).unwrap()),
        Err(_) => enc(include_str!("../assets/calibration.txt")),
    };
    if let Ok(n) = std::env::var("CALIB_TOKENS") {
        calib.truncate(n.parse().unwrap());
    }
    // EVAL_FILE: evaluate on another text (e.g. the calibration text: does a method overfit?).
    let mut eval = match std::env::var("EVAL_FILE") {
        Ok(f) => enc(&std::fs::read_to_string(f).unwrap()),
        Err(_) => enc(include_str!("../assets/evaluation.txt")),
    };
    eval.truncate(1024);
    eprintln!(
        "calibration {} tokens, evaluation {} tokens",
        calib.len(),
        eval.len()
    );
    let mut reference = PlainModel::load(&ckpt).unwrap();
    let ref_logits = rows(&reference.logits_fresh(&eval).unwrap());
    drop(reference);
    println!("| method | top1 | kl_mean | kl_max | ppl_ratio | secs |");
    println!("|---|---|---|---|---|---|");
    for spec in &args[1..] {
        let mut m = LinearMethod::data_free(4);
        let mut opts = SequentialOptions {
            awq: false,
            ..Default::default()
        };
        // ROLE=N (e.g. down=6): that role at N bits; from=L:N: blocks L.. at N bits.
        let mut role_bits: Vec<(String, u8)> = Vec::new();
        let mut from_block: Option<(usize, u8)> = None;
        for f in spec.split(',') {
            match f {
                "rs" => m.row_scale = true,
                "w" => m.weighted = true,
                "gptq" => m.gptq = true,
                "ao" => m.act_order = true,
                "rot" => m.rotate = true,
                "awq" => opts.awq = true,
                "nots" => opts.true_sequential = false,
                "layersens" => opts.sensitivity = Sensitivity::LayerOutput,
                "klsens" => opts.sensitivity = Sensitivity::ModelKl,
                _ if f.starts_with("nbits=") => m.nbits = f[6..].parse().unwrap(),
                _ if f.starts_with("g=") => m.row_groups = f[2..].parse().unwrap(),
                _ if f.starts_with("damp=") => m.damp = f[5..].parse().unwrap(),
                _ if f.starts_with("bpw=") => opts.target_bpw = Some(f[4..].parse().unwrap()),
                _ if f.starts_with("chunk=") => opts.chunk_rows = f[6..].parse().unwrap(),
                _ if f.starts_with("seg=") => opts.segment_len = f[4..].parse().unwrap(),
                _ if f.starts_with("from=") => {
                    let (l, n) = f[5..].split_once(':').unwrap();
                    from_block = Some((l.parse().unwrap(), n.parse().unwrap()));
                }
                _ if f.contains('=') => {
                    let (r, n) = f.split_once('=').unwrap();
                    role_bits.push((r.to_string(), n.parse().unwrap()));
                }
                _ => panic!("unknown flag {f}"),
            }
        }
        let t0 = Instant::now();
        let (w, mut model) = quantize_checkpoint(
            &ckpt,
            &calib,
            &|slot| {
                let mut m = slot.role.is_projection().then_some(m)?;
                if let Some((_, n)) = role_bits.iter().find(|(r, _)| *r == slot.role.to_string()) {
                    m.nbits = *n;
                }
                if let (Some((from, n)), Some(l)) = (from_block, slot.layer) {
                    if l >= from {
                        m.nbits = n;
                    }
                }
                Some(m)
            },
            &opts,
            &|l, n| eprint!("\r{spec}: block {l}/{n} {:.1}s", t0.elapsed().as_secs_f64()),
        )
        .unwrap();
        let secs = t0.elapsed().as_secs_f64();
        eprintln!();
        let q = rows(&model.logits_fresh(&eval).unwrap());
        let c = compare_logits(&ref_logits, &q, &eval).unwrap();
        println!(
            "| {spec} | {:.3} | {:.3} | {:.2} | {:.3} | {:.1} |",
            c.top1, c.kl_mean, c.kl_max, c.ppl_ratio, secs
        );
        if std::env::var("HALVES").is_ok() {
            // Early and late positions apart (calibration segments are 512 tokens long).
            let h = q.len().min(512);
            for (name, a, b) in [("< 512", 0, h), (">= 512", h, q.len())] {
                if b > a + 1 {
                    let c = compare_logits(&ref_logits[a..b], &q[a..b], &eval[a..b]).unwrap();
                    eprintln!("positions {name}: top-1 {:.3}, KL {:.3}", c.top1, c.kl_mean);
                }
            }
        }
        if std::env::var("MARGINS").is_ok() {
            // How close to a tie the reference was where the top-1 choices differ: its
            // log-probability gap between its own top-1 and the quantized model's top-1.
            let argmax = |r: &[f32]| {
                r.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(0, |(i, _)| i)
            };
            let mut gaps = Vec::new();
            let mut all = Vec::new();
            for (r, qr) in ref_logits.iter().zip(&q) {
                let (a, b) = (argmax(r), argmax(qr));
                let mut sorted = r.clone();
                sorted.sort_by(|x, y| y.total_cmp(x));
                all.push(sorted[0] - sorted[1]);
                if a != b {
                    gaps.push(r[a] - r[b]);
                }
            }
            let frac = |v: &[f32], t: f32| {
                v.iter().filter(|&&g| g < t).count() as f64 / v.len().max(1) as f64
            };
            for t in [0.25f32, 0.5, 1.0, 2.0] {
                eprintln!(
                    "reference gap < {t}: {:.2} of the {} disagreements, {:.2} of all {} positions",
                    frac(&gaps, t),
                    gaps.len(),
                    frac(&all, t),
                    all.len()
                );
            }
        }
        if opts.target_bpw.is_some() {
            let mut rows = [0usize; 3];
            for c in &w.allocation {
                (0..3).for_each(|k| rows[k] += c.rows[k]);
            }
            let spent: f64 = w.allocation.iter().map(|c| c.spent).sum();
            let numel: usize = w.allocation.iter().map(|c| c.numel).sum();
            eprintln!(
                "rows at 4/6/8 bits: {rows:?}, {:.3} bits/weight",
                spent / numel as f64
            );
            for c in w.allocation.iter().filter(|c| c.nbits > 4) {
                eprintln!("  {} -> rows {:?} (errors {:?})", c.tensor, c.rows, c.error);
            }
        }
        if opts.awq {
            let a: Vec<String> = w.awq.iter().map(|a| format!("{}", a.exponent)).collect();
            eprintln!("awq exponents: {}", a.join(" "));
        }
    }
}
