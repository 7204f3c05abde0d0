//! Calibrated palettization end to end on tiny checkpoints: the package computes
//! exactly what the calibrated weights say (row groups, row scales and AWQ folds survive
//! emission), calibration beats data-free palettization on the same model, and a target bpw
//! is honoured.

use std::path::{Path, PathBuf};

use half::f16;
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::plain::PlainModel;
use hf2coreml::model::Reference;
use hf2coreml::pipeline::texts;
use hf2coreml::quant::calibrate::{
    quantize_checkpoint, CalibratedWeights, LinearMethod, SequentialOptions,
};
use hf2coreml::runtime::interp::{Options, Package};
use hf2coreml::runtime::StepModel;
use hf2coreml::validate::metrics::compare_logits;
use hf2coreml_testkit::TinyModel;

use hf2coreml_testkit::FP16_LOGIT_TOL;

use crate::support::{convert, needs, Cli};

fn recipe(dir: &Path, calibration: &str) -> PathBuf {
    let path = dir.join("recipe.toml");
    let text = format!(
        "default = \"fp16\"\n[roles]\nq = {{ palettize = {{ nbits = 4 }} }}\n\
         k = {{ palettize = {{ nbits = 4 }} }}\nv = {{ palettize = {{ nbits = 4 }} }}\n\
         o = {{ palettize = {{ nbits = 4 }} }}\ngate = {{ palettize = {{ nbits = 4 }} }}\n\
         up = {{ palettize = {{ nbits = 4 }} }}\ndown = {{ palettize = {{ nbits = 4 }} }}\n\
         {calibration}"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Logits of a package over `tokens`, one token per step, with host-side cache writes.
fn package_logits(pkg: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut package = Package::load(pkg, Options::default()).unwrap();
    let c = package.contract().clone();
    let (l, hkv, d, v, s) = (
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.max_seq_len,
    );
    let mut kc = vec![f16::ZERO; l * hkv * s * d];
    let mut vc = kc.clone();
    let mut rows = Vec::new();
    for (p, &t) in tokens.iter().enumerate() {
        let out = package.step(&[t as i32], p, &kc, &vc).unwrap();
        for li in 0..l {
            for h in 0..hkv {
                let src = (li * hkv + h) * d;
                let dst = ((li * hkv + h) * s + p) * d;
                kc[dst..dst + d].copy_from_slice(&out.key_update[src..src + d]);
                vc[dst..dst + d].copy_from_slice(&out.value_update[src..src + d]);
            }
        }
        rows.push(out.logits[..v].to_vec());
    }
    rows
}

/// The checkpoint calibrated in the float model with `method` on every projection.
fn every_projection(
    ckpt: &Checkpoint,
    calib: &[u32],
    method: LinearMethod,
    options: &SequentialOptions,
) -> (CalibratedWeights, PlainModel) {
    quantize_checkpoint(
        ckpt,
        calib,
        &|slot| slot.role.is_projection().then_some(method),
        options,
        &|_, _| {},
    )
    .unwrap()
}

/// The package's logits equal the simulated calibrated model's, to fp16 accuracy.
fn assert_package_matches(pkg: &Path, simulated: &mut PlainModel, toks: &[u32]) {
    let want: Vec<Vec<f32>> = simulated.logits_fresh(toks).unwrap().to_vec2().unwrap();
    let got = package_logits(pkg, toks);
    let worst = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("package vs simulated calibrated model: max |Δlogit| {worst}");
    assert!(worst < FP16_LOGIT_TOL, "max |Δlogit| {worst}");
}

fn tokens(vocab: usize) -> Vec<u32> {
    (0..12u32).map(|i| (i * 7 + 3) % vocab as u32).collect()
}

/// The package holds what the calibration computed: its logits equal the calibrated weights'
/// logits in the float model (row groups + row scales + AWQ folds), to fp16 accuracy.
fn emitted_matches_calibrated_weights(model: TinyModel) {
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let cal = "[calibration]\nawq = true\nrow_groups = 2\n";
    let pkg = root.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "16", "--recipe"])
        .arg(recipe(root.path(), cal))
        .ok();

    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let (calib, _) = texts::shipped_calibration_tokens(&ckpt).unwrap();
    let method = LinearMethod {
        row_groups: 2,
        ..LinearMethod::calibrated(4)
    };
    let (weights, mut simulated) = every_projection(
        &ckpt,
        &calib,
        method,
        &SequentialOptions {
            awq: true,
            ..Default::default()
        },
    );
    assert_eq!(weights.linears.len(), 7 * model.layers);
    assert!(weights.linears.values().all(|q| q.groups.len() == 2));

    let toks = tokens(model.vocab);
    assert_package_matches(&pkg, &mut simulated, &toks);

    // The package's row groups and row scales are visible by name.
    let spec = std::fs::read(pkg.join("Data/com.apple.CoreML/model.mlmodel")).unwrap();
    let text = String::from_utf8_lossy(&spec);
    assert!(text.contains("model_layers_0_self_attn_q_proj_weight_g1"));
    assert!(text.contains("model_layers_0_mlp_down_proj_weight_row_scale"));
}

#[test]
fn llama_calibrated_package_matches_its_weights() {
    needs!(Python);
    emitted_matches_calibrated_weights(TinyModel::llama());
}

#[test]
fn qwen2_calibrated_package_matches_its_weights() {
    needs!(Python);
    // q/k/v biases: the bias is added after the row scale.
    emitted_matches_calibrated_weights(TinyModel::qwen2());
}

/// Mixed precision by rows (`target_bpw` with `allocation_rows`): a projection's rows at 4, 6
/// and 8 bits are separate groups, not contiguous, put back in row order by a `gather`; the
/// package computes what the calibrated weights say (Qwen2: the biases come after the gather
/// and the row scale).
#[test]
fn mixed_rows_package_matches_its_weights() {
    needs!(Python);
    let model = TinyModel::qwen2();
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let cal = "[calibration]\ntarget_bpw = 5\nallocation_rows = 8\n";
    let pkg = root.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "16", "--recipe"])
        .arg(recipe(root.path(), cal))
        .ok();

    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let (calib, _) = texts::shipped_calibration_tokens(&ckpt).unwrap();
    let (weights, mut simulated) = every_projection(
        &ckpt,
        &calib,
        LinearMethod::calibrated(4),
        &SequentialOptions {
            target_bpw: Some(5.0),
            chunk_rows: 8,
            ..Default::default()
        },
    );
    // Some projection mixes widths over rows that are not one contiguous run per width.
    let scattered = weights
        .linears
        .values()
        .filter(|q| q.rows_by_nbits().len() > 1)
        .filter(|q| {
            let order: Vec<usize> = q.groups.iter().flat_map(|g| g.rows.clone()).collect();
            order.iter().enumerate().any(|(i, &r)| i != r)
        })
        .count();
    assert!(scattered > 0, "no projection mixes widths across its rows");
    let (spent, numel) = weights
        .allocation
        .iter()
        .fold((0.0, 0), |(b, n), c| (b + c.spent, n + c.numel));
    assert!(spent / numel as f64 <= 5.0);
    for c in &weights.allocation {
        let q = &weights.linears[&c.tensor];
        let rows: Vec<usize> = q.rows_by_nbits().iter().map(|&(_, n)| n).collect();
        let want: Vec<usize> = c.rows.iter().copied().filter(|&n| n > 0).collect();
        assert_eq!(rows, want, "{}", c.tensor);
    }

    let toks = tokens(model.vocab);
    assert_package_matches(&pkg, &mut simulated, &toks);
    let spec = std::fs::read(pkg.join("Data/com.apple.CoreML/model.mlmodel")).unwrap();
    assert!(String::from_utf8_lossy(&spec).contains("_restore"));
}

/// Rotated inputs (`rotate = true`): the package stores W·Q and feeds it x·Q through the
/// factored rotation (signs, Hadamard blocks, a mix across blocks), its constants shared by
/// every projection of a width; its logits equal the simulated rotated model's.
#[test]
fn rotated_package_matches_its_weights() {
    needs!(Python);
    // 96 = 3 blocks of 32: the mix across blocks runs too.
    let qwen2 = TinyModel {
        intermediate: 96,
        ..TinyModel::qwen2()
    };
    for model in [TinyModel::llama(), qwen2] {
        let dir = model.write_temp().unwrap();
        let root = tempfile::tempdir().unwrap();
        let pkg = root.path().join("m.mlpackage");
        convert(dir.path(), &pkg)
            .args(["--max-seq-len", "16", "--recipe"])
            .arg(recipe(root.path(), "[calibration]\nrotate = true\n"))
            .ok();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let (calib, _) = texts::shipped_calibration_tokens(&ckpt).unwrap();
        let method = LinearMethod {
            rotate: true,
            ..LinearMethod::calibrated(4)
        };
        let (weights, mut simulated) =
            every_projection(&ckpt, &calib, method, &SequentialOptions::default());
        assert!(weights.linears.values().all(|q| q.rotated));
        assert_package_matches(&pkg, &mut simulated, &tokens(model.vocab));
        // One set of rotation constants per input width, shared by every projection.
        let spec = std::fs::read(pkg.join("Data/com.apple.CoreML/model.mlmodel")).unwrap();
        let text = String::from_utf8_lossy(&spec);
        for width in [model.hidden, model.intermediate] {
            for part in ["signs", "hadamard"] {
                let name = format!("input_rotation_{width}_{part}");
                assert!(text.contains(&name), "{name}");
            }
        }
        let mixed = |w: usize| text.contains(&format!("input_rotation_{w}_mix"));
        assert_eq!(mixed(model.intermediate), model.intermediate == 96);
        // q/k/v rotate their shared input once, gate/up likewise: four rotations per block.
        for (site, present) in [
            ("q", true),
            ("k", false),
            ("v", false),
            ("attn_out", true),
            ("gate", true),
            ("up", false),
            ("mlp_out", true),
        ] {
            let name = format!("layers_0_{site}_input_rotated");
            assert_eq!(text.contains(&name), present, "{name}");
        }
    }
}

/// AWQ folds into v_proj and up_proj rows even when the recipe keeps those fp16: the package
/// must carry the folded fp16 weights.
/// Mean KL(p‖q) over rows, computed here from the softmaxes (independent of `validate`).
fn mean_kl(p_logits: &[Vec<f32>], q_logits: &[Vec<f32>]) -> f64 {
    let softmax = |r: &[f32]| {
        let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let e: Vec<f64> = r.iter().map(|&x| (x as f64 - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|x| x / z).collect::<Vec<f64>>()
    };
    let kls: Vec<f64> = p_logits
        .iter()
        .zip(q_logits)
        .map(|(a, b)| {
            let (p, q) = (softmax(a), softmax(b));
            p.iter().zip(&q).map(|(p, q)| p * (p / q).ln()).sum::<f64>()
        })
        .collect();
    kls.iter().sum::<f64>() / kls.len() as f64
}

/// AWQ's fold (input scales divided into the previous norm or projection, multiplied into the
/// palettized weight) is an identity of the float model: at 8 bits, where palettization itself
/// costs almost nothing, the package computes what the float checkpoint computes. Measured:
/// mean KL 1.2e-4 (8-bit LUTs and fp16 rounding); the bound is 8× that.
const AWQ_8BIT_MAX_KL: f64 = 1e-3;

#[test]
fn awq_at_8_bits_keeps_the_float_model() {
    needs!(Python);
    let model = TinyModel {
        logit_gain: 4.0,
        ..TinyModel::llama()
    };
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let recipe = root.path().join("r.toml");
    std::fs::write(
        &recipe,
        "default = \"fp16\"\n[roles]\nq = { palettize = { nbits = 8 } }\n\
         o = { palettize = { nbits = 8 } }\ndown = { palettize = { nbits = 8 } }\n\
         [calibration]\nawq = true\n",
    )
    .unwrap();
    let pkg = root.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "16", "--recipe"])
        .arg(&recipe)
        .ok();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let (calib, _) = texts::shipped_calibration_tokens(&ckpt).unwrap();
    let (weights, _) = quantize_checkpoint(
        &ckpt,
        &calib,
        &|slot| {
            use hf2coreml::arch::Role;
            matches!(slot.role, Role::Q | Role::O | Role::Down)
                .then_some(LinearMethod::calibrated(8))
        },
        &SequentialOptions {
            awq: true,
            ..Default::default()
        },
        &|_, _| {},
    )
    .unwrap();
    assert!(
        weights.awq.iter().any(|a| a.exponent > 0.0),
        "AWQ must scale something for this test to mean anything: {:?}",
        weights.awq
    );
    let toks = tokens(model.vocab);
    let float = Reference::load(&ckpt).unwrap().logits_all(&toks).unwrap();
    let kl = mean_kl(&float, &package_logits(&pkg, &toks));
    eprintln!("AWQ at 8 bits vs the float model: mean KL {kl}");
    assert!(kl < AWQ_8BIT_MAX_KL, "mean KL {kl}");
}

#[test]
fn awq_folds_reach_projections_kept_fp16() {
    needs!(Python);
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let recipe = root.path().join("r.toml");
    std::fs::write(
        &recipe,
        "default = \"fp16\"\n[roles]\nq = { palettize = { nbits = 4 } }\n\
         o = { palettize = { nbits = 4 } }\ndown = { palettize = { nbits = 4 } }\n\
         [calibration]\nawq = true\n",
    )
    .unwrap();
    let pkg = root.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "16", "--recipe"])
        .arg(&recipe)
        .ok();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let (calib, _) = texts::shipped_calibration_tokens(&ckpt).unwrap();
    let palettized = |r: hf2coreml::arch::Role| {
        use hf2coreml::arch::Role;
        matches!(r, Role::Q | Role::O | Role::Down)
    };
    let (weights, mut simulated) = quantize_checkpoint(
        &ckpt,
        &calib,
        &|slot| palettized(slot.role).then_some(LinearMethod::calibrated(4)),
        &SequentialOptions {
            awq: true,
            ..Default::default()
        },
        &|_, _| {},
    )
    .unwrap();
    assert!(
        weights.awq.iter().any(|a| a.exponent > 0.0),
        "{:?}",
        weights.awq
    );
    let toks = tokens(model.vocab);
    assert_package_matches(&pkg, &mut simulated, &toks);
}

#[test]
fn calibration_beats_data_free_at_the_same_bits() {
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let toks = tokens(model.vocab);
    let reference = Reference::load(&ckpt).unwrap().logits_all(&toks).unwrap();
    let (calib, _) = texts::shipped_calibration_tokens(&ckpt).unwrap();
    let kl = |method: LinearMethod| {
        let (_, mut m) = every_projection(&ckpt, &calib, method, &SequentialOptions::default());
        let rows: Vec<Vec<f32>> = m.logits_fresh(&toks).unwrap().to_vec2().unwrap();
        compare_logits(&reference, &rows, &toks).unwrap().kl_mean
    };
    // 2 bits so the tiny model's error is far above fp noise. Random weights and inputs have
    // no outlier channels, so the margin is modest here (on SmolLM2: KL 8.5 → 0.19 at 4 bits).
    let free = kl(LinearMethod::data_free(2));
    let calibrated = kl(LinearMethod::calibrated(2));
    assert!(
        calibrated < free,
        "calibrated KL {calibrated} vs data-free {free}"
    );
    // Sanity: the float model through the same path is the reference.
    let mut float = PlainModel::load(&ckpt).unwrap();
    let rows: Vec<Vec<f32>> = float.logits_fresh(&toks).unwrap().to_vec2().unwrap();
    assert!(compare_logits(&reference, &rows, &toks).unwrap().kl_mean < 1e-6);
}

#[test]
fn target_bpw_mixes_bit_widths_within_budget() {
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let report = root.path().join("report.json");
    let o = Cli::new()
        .arg("palettize")
        .arg(dir.path())
        .arg("--recipe")
        .arg(recipe(root.path(), "[calibration]\n"))
        .args(["--target-bpw", "5.5", "--json"])
        .arg(&report)
        .output();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let lines = r["tensors"].as_array().unwrap();
    let (mut bits, mut numel) = (0.0f64, 0.0f64);
    let mut widths = std::collections::BTreeSet::new();
    for l in lines {
        let Some(nbits) = l["nbits"].as_u64() else {
            continue;
        };
        assert_eq!(l["decision"].as_str().unwrap(), format!("lut{nbits}"));
        widths.insert(nbits);
        let n: u64 = l["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        bits += l["bytes_after"].as_u64().unwrap() as f64 * 8.0;
        numel += n as f64;
    }
    assert!(bits / numel <= 5.5, "{} bits per weight", bits / numel);
    assert!(!widths.is_empty());
    // The report says what the allocation chose and why: every projection with its measured
    // errors, most sensitive first, and the widths and bits it adds up to.
    let m = &r["mixed_precision"];
    assert_eq!(m["target_bpw"].as_f64(), Some(5.5));
    let achieved = m["achieved_bpw"].as_f64().unwrap();
    assert!(
        (achieved - bits / numel).abs() < 0.05 && achieved <= 5.5,
        "achieved {achieved}, report lines {}",
        bits / numel
    );
    let chosen = m["tensors"].as_array().unwrap();
    let palettized: Vec<_> = lines.iter().filter(|l| l["nbits"].is_u64()).collect();
    assert_eq!(chosen.len(), palettized.len());
    let counted: u64 = m["count_by_nbits"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(counted as usize, chosen.len());
    // Rows of every width the budget allows: 4 and more.
    let rows = m["rows_by_nbits"].as_object().unwrap();
    let wide = rows.iter().filter(|(_, n)| n.as_u64().unwrap() > 0).count();
    assert!(wide > 1, "one bit width only: {rows:?}");
    let errors: Vec<f64> = chosen
        .iter()
        .map(|c| c["error"][0].as_f64().unwrap())
        .collect();
    assert!(errors.windows(2).all(|w| w[0] >= w[1]), "{errors:?}");
    for c in chosen {
        let line = palettized
            .iter()
            .find(|l| l["name"] == c["tensor"])
            .unwrap_or_else(|| panic!("{} is not in the report", c["tensor"]));
        assert_eq!(line["nbits"], c["nbits"]);
        let r: Vec<u64> = c["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let rows = line["shape"][0].as_u64().unwrap();
        assert_eq!(r.iter().sum::<u64>(), rows, "{}", c["tensor"]);
        // The line's width is its widest rows'.
        let widest = [4, 6, 8][r.iter().rposition(|&n| n > 0).unwrap()];
        assert_eq!(line["nbits"].as_u64(), Some(widest));
        let e = c["error"].as_array().unwrap();
        assert!(e[0].as_f64() >= e[1].as_f64() && e[1].as_f64() >= e[2].as_f64());
    }
    assert!(String::from_utf8_lossy(&o.stdout).contains("mixed precision: target 5.50"));
    // Bad targets are refused with exit 2.
    let o = Cli::new()
        .arg("palettize")
        .arg(dir.path())
        .args(["--target-bpw", "3"])
        .output();
    assert_eq!(o.status.code(), Some(2));
}
