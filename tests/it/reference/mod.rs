//! The reference forward pass on tiny generated checkpoints, held against a naive f32 forward
//! written here with plain loops (slow, obviously correct, shares no code with the crate).

use hf2coreml::arch::Role;
use hf2coreml::arch::{ModelSpec, RopeScaling};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::layerwise::{
    f32_weight_bytes, logits_layerwise, logits_layerwise_sliced, ReferencePath, REFERENCE_BUDGET,
};
use hf2coreml::model::{
    argmax, calibrate, ActivationStats, BackendChoice, BackendKind, CalibrationOptions,
    GramSelection, Reference, ReferenceError,
};
use hf2coreml_testkit::TinyModel;

/// Both sides compute in f32 with different summation orders over at most a few hundred
/// terms of size ~1: differences are ~1e-6; a real mistake (wrong rope, head mapping, norm)
/// is ≥ 1e-2.
const TOL: f32 = 1e-4;

const TOKENS: [u32; 11] = [1, 17, 42, 5, 95, 3, 60, 60, 7, 88, 2];

struct Naive {
    spec: ModelSpec,
    ckpt: Checkpoint,
}

/// What the naive forward measures besides logits, to check calibration against.
#[derive(Default)]
struct NaiveProbe {
    residual_after_attention: Vec<f32>,
    residual_after_mlp: Vec<f32>,
    /// Σ over tokens of x² per channel of layer 0's q/k/v input and down input.
    qkv_in_sq: Vec<f64>,
    down_in_sq: Vec<f64>,
}

impl Naive {
    fn open(dir: &std::path::Path) -> Self {
        let ckpt = Checkpoint::open(dir).unwrap();
        Naive {
            spec: ckpt.spec().clone(),
            ckpt,
        }
    }

    fn w(&self, name: &str) -> Vec<f32> {
        self.ckpt.tensor(name).unwrap().to_f32()
    }

    fn inv_freq(&self) -> Vec<f64> {
        let d = self.spec.head_dim;
        (0..d / 2)
            .map(|i| {
                let f = self.spec.rope_theta.powf(-(2.0 * i as f64) / d as f64);
                match self.spec.rope_scaling {
                    RopeScaling::None => f,
                    RopeScaling::Linear { factor } => f / factor,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor: lo,
                        high_freq_factor: hi,
                        original_max_position_embeddings: old,
                    } => {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let old = old as f64;
                        if wavelen < old / hi {
                            f
                        } else if wavelen > old / lo {
                            f / factor
                        } else {
                            let s = (old / wavelen - lo) / (hi - lo);
                            (1.0 - s) * f / factor + s * f
                        }
                    }
                    // Phi-3's LongRoPE: held against transformers in tests/arch_hf.rs.
                    RopeScaling::LongRope { .. } => panic!("no tiny fixture here has LongRoPE"),
                }
            })
            .collect()
    }

    fn logits(&self, tokens: &[u32], probe: &mut NaiveProbe) -> Vec<Vec<f32>> {
        let s = &self.spec;
        let (h, hq, hkv, d) = (
            s.hidden_size,
            s.num_attention_heads,
            s.num_key_value_heads,
            s.head_dim,
        );
        let eps = s.rms_norm_eps as f32;
        let norm = |x: &[f32], w: &[f32]| -> Vec<f32> {
            let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
            let r = 1.0 / (ms + eps).sqrt();
            x.iter().zip(w).map(|(v, w)| v * r * w).collect()
        };
        let matvec = |w: &[f32], x: &[f32]| -> Vec<f32> {
            w.chunks(x.len())
                .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
                .collect()
        };
        let inv_freq = self.inv_freq();
        let rope = |x: &mut [f32], pos: usize| {
            for head in x.chunks_mut(d) {
                for i in 0..d / 2 {
                    let angle = pos as f32 * inv_freq[i] as f32;
                    let (a, b) = (head[i], head[i + d / 2]);
                    head[i] = a * angle.cos() - b * angle.sin();
                    head[i + d / 2] = b * angle.cos() + a * angle.sin();
                }
            }
        };
        let embed = self.w("model.embed_tokens.weight");
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec())
            .collect();
        probe.qkv_in_sq = vec![0.0; h];
        probe.down_in_sq = vec![0.0; s.intermediate_size];
        for l in 0..s.num_hidden_layers {
            let p = |n: &str| self.w(&format!("model.layers.{l}.{n}"));
            let (wq, wk, wv, wo) = (
                p("self_attn.q_proj.weight"),
                p("self_attn.k_proj.weight"),
                p("self_attn.v_proj.weight"),
                p("self_attn.o_proj.weight"),
            );
            let bias = |n: &str| {
                if s.attention_bias {
                    p(n)
                } else {
                    Vec::new()
                }
            };
            let (bq, bk, bv) = (
                bias("self_attn.q_proj.bias"),
                bias("self_attn.k_proj.bias"),
                bias("self_attn.v_proj.bias"),
            );
            let add = |mut y: Vec<f32>, b: &[f32]| {
                for (y, b) in y.iter_mut().zip(b) {
                    *y += b;
                }
                y
            };
            let (n1, n2) = (
                p("input_layernorm.weight"),
                p("post_attention_layernorm.weight"),
            );
            let (wg, wu, wd) = (
                p("mlp.gate_proj.weight"),
                p("mlp.up_proj.weight"),
                p("mlp.down_proj.weight"),
            );
            let mut keys = Vec::new();
            let mut values = Vec::new();
            let mut max_attn = 0.0f32;
            let mut max_mlp = 0.0f32;
            for (pos, x) in xs.iter_mut().enumerate() {
                let y = norm(x, &n1);
                if l == 0 {
                    for (acc, v) in probe.qkv_in_sq.iter_mut().zip(&y) {
                        *acc += (v * v) as f64;
                    }
                }
                let mut q = add(matvec(&wq, &y), &bq);
                let mut k = add(matvec(&wk, &y), &bk);
                let v = add(matvec(&wv, &y), &bv);
                rope(&mut q, pos);
                rope(&mut k, pos);
                keys.push(k);
                values.push(v);
                let mut attn = vec![0.0f32; hq * d];
                for head in 0..hq {
                    let kvh = head / (hq / hkv);
                    let qh = &q[head * d..(head + 1) * d];
                    let scores: Vec<f32> = keys
                        .iter()
                        .map(|k| {
                            qh.iter()
                                .zip(&k[kvh * d..(kvh + 1) * d])
                                .map(|(a, b)| a * b)
                                .sum::<f32>()
                                / (d as f32).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f32 = e.iter().sum();
                    for (j, v) in values.iter().enumerate() {
                        for i in 0..d {
                            attn[head * d + i] += e[j] / z * v[kvh * d + i];
                        }
                    }
                }
                for (x, o) in x.iter_mut().zip(matvec(&wo, &attn)) {
                    *x += o;
                }
                max_attn = x.iter().fold(max_attn, |m, v| m.max(v.abs()));
                let y = norm(x, &n2);
                let g = matvec(&wg, &y);
                let u = matvec(&wu, &y);
                let act: Vec<f32> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                if l == 0 {
                    for (acc, v) in probe.down_in_sq.iter_mut().zip(&act) {
                        *acc += (v * v) as f64;
                    }
                }
                for (x, o) in x.iter_mut().zip(matvec(&wd, &act)) {
                    *x += o;
                }
                max_mlp = x.iter().fold(max_mlp, |m, v| m.max(v.abs()));
            }
            probe.residual_after_attention.push(max_attn);
            probe.residual_after_mlp.push(max_mlp);
        }
        let nf = self.w("model.norm.weight");
        let head = if s.tie_word_embeddings {
            embed.clone()
        } else {
            self.w("lm_head.weight")
        };
        xs.iter().map(|x| matvec(&head, &norm(x, &nf))).collect()
    }
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

fn check_against_naive(model: TinyModel, expected: BackendKind) {
    let dir = model.write_temp().unwrap();
    let naive = Naive::open(dir.path());
    let want = naive.logits(&TOKENS, &mut NaiveProbe::default());
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let mut auto = Reference::load(&ckpt).unwrap();
    assert_eq!(auto.backend(), expected, "{:?}", auto.fallback_reason());
    let got = auto.logits_all(&TOKENS).unwrap();
    let d = max_diff(&want, &got);
    assert!(d < TOL, "{expected:?}: max |Δ| {d}");
    let mut plain = Reference::load_with(&ckpt, BackendChoice::Plain).unwrap();
    let d = max_diff(&want, &plain.logits_all(&TOKENS).unwrap());
    assert!(d < TOL, "plain: max |Δ| {d}");
    // The fixture is not degenerate: logits vary across the vocabulary.
    let spread = want[3].iter().cloned().fold(f32::MIN, f32::max)
        - want[3].iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 100.0 * TOL, "spread {spread}");
}

#[test]
fn llama_matches_naive() {
    check_against_naive(TinyModel::llama(), BackendKind::CandleLlama);
}

#[test]
fn qwen2_matches_naive() {
    check_against_naive(TinyModel::qwen2(), BackendKind::CandleQwen2);
}

#[test]
fn mistral_matches_naive() {
    check_against_naive(TinyModel::mistral(), BackendKind::CandleMistral);
}

#[test]
fn llama_with_explicit_head_dim_falls_back_and_matches() {
    let model = TinyModel {
        head_dim: Some(24),
        ..TinyModel::llama()
    };
    check_against_naive(model.clone(), BackendKind::Plain);
    let dir = model.write_temp().unwrap();
    let r = Reference::load(&Checkpoint::open(dir.path()).unwrap()).unwrap();
    assert!(r.fallback_reason().unwrap().contains("head_dim"));
}

#[test]
fn qwen2_tied_and_transformers5_config() {
    check_against_naive(
        TinyModel {
            tied: true,
            transformers5: true,
            ..TinyModel::qwen2()
        },
        BackendKind::CandleQwen2,
    );
}

#[test]
fn rope_scaling_is_applied() {
    let linear = TinyModel {
        rope_scaling: Some(serde_json::json!({"type": "linear", "factor": 4.0})),
        rope_theta: 100.0,
        ..TinyModel::llama()
    };
    check_against_naive(linear.clone(), BackendKind::Plain);
    let llama3 = TinyModel {
        rope_scaling: Some(serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
        rope_theta: 100.0,
        ..TinyModel::llama()
    };
    check_against_naive(llama3.clone(), BackendKind::CandleLlama);
    // Scaling changes the answer: the comparison above is not blind to it.
    let plain_logits = |m: TinyModel| {
        let dir = m.write_temp().unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        Reference::load(&ckpt).unwrap().logits_all(&TOKENS).unwrap()
    };
    let unscaled = plain_logits(TinyModel {
        rope_theta: 100.0,
        ..TinyModel::llama()
    });
    assert!(max_diff(&unscaled, &plain_logits(linear)) > 100.0 * TOL);
    assert!(max_diff(&unscaled, &plain_logits(llama3)) > 100.0 * TOL);
}

#[test]
fn incremental_steps_equal_logits_all() {
    for (model, choice) in [
        (TinyModel::llama(), BackendChoice::Auto),
        (TinyModel::qwen2(), BackendChoice::Auto),
        (TinyModel::mistral(), BackendChoice::Auto),
        (TinyModel::llama(), BackendChoice::Plain),
    ] {
        let dir = model.write_temp().unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let mut r = Reference::load_with(&ckpt, choice).unwrap();
        let all = r.logits_all(&TOKENS).unwrap();
        // A 4-token prompt chunk, single tokens, then a 3-token chunk at an offset.
        let mut rows = vec![r.step(&TOKENS[..4], 0).unwrap()];
        for (i, &t) in TOKENS.iter().enumerate().take(8).skip(4) {
            rows.push(r.step(&[t], i).unwrap());
        }
        rows.push(r.step(&TOKENS[8..], 8).unwrap());
        assert_eq!(r.position(), TOKENS.len());
        let want: Vec<Vec<f32>> = [3, 4, 5, 6, 7, 10]
            .iter()
            .map(|&i| all[i].clone())
            .collect();
        let d = max_diff(&want, &rows);
        assert!(d < TOL, "{:?}: max |Δ| {d}", r.backend());
    }
}

#[test]
fn greedy_generation_follows_argmax() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let mut r = Reference::load(&ckpt).unwrap();
    let prompt = [1u32, 30, 31];
    let out = r.greedy_generate(&prompt, 6, &[]).unwrap();
    assert_eq!(out.len(), 6);
    let mut seq = prompt.to_vec();
    seq.extend(&out[..5]);
    let all = r.logits_all(&seq).unwrap();
    for (i, &tok) in out.iter().enumerate() {
        assert_eq!(argmax(&all[prompt.len() - 1 + i]), tok, "token {i}");
    }
    // Stopping at an eos token: it is not returned. (Random tiny models repeat themselves,
    // so stop at the first token that has not appeared before.)
    assert!(r.greedy_generate(&prompt, 6, &[out[0]]).unwrap().is_empty());
    if let Some(k) = (1..out.len()).find(|&i| !out[..i].contains(&out[i])) {
        let stop = r.greedy_generate(&prompt, 6, &[out[k]]).unwrap();
        assert_eq!(stop, out[..k].to_vec());
    }
    assert!(r.greedy_generate(&prompt, 0, &[]).unwrap().is_empty());
}

#[test]
fn bad_calls_are_typed_errors() {
    let dir = TinyModel {
        context: 256,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let mut r = Reference::load(&ckpt).unwrap();
    assert!(matches!(r.step(&[], 0), Err(ReferenceError::Empty)));
    assert!(matches!(
        r.step(&[1, 500], 0),
        Err(ReferenceError::TokenOutOfRange {
            token: 500,
            index: 1,
            ..
        })
    ));
    r.step(&[1, 2], 0).unwrap();
    assert!(matches!(
        r.step(&[3], 5),
        Err(ReferenceError::Position {
            expected: 2,
            got: 5
        })
    ));
    // The fixture's max_position_embeddings is 256.
    let long = vec![3u32; 257];
    assert!(matches!(
        r.logits_all(&long),
        Err(ReferenceError::ContextTooLong { len: 257, max: 256 })
    ));
}

#[test]
fn calibration_matches_naive_measurements() {
    for model in [TinyModel::llama(), TinyModel::qwen2(), TinyModel::mistral()] {
        let dir = model.write_temp().unwrap();
        let naive = Naive::open(dir.path());
        let mut probe = NaiveProbe::default();
        naive.logits(&TOKENS, &mut probe);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let options = CalibrationOptions {
            segment_len: 64,
            gram: GramSelection::Roles(vec![Role::Q]),
        };
        let stats = calibrate(&ckpt, &TOKENS, &options).unwrap();
        assert_eq!(stats.tokens, TOKENS.len());
        assert_eq!(stats.segments, 1);
        assert_eq!(stats.layers.len(), model.layers);
        for (l, layer) in stats.layers.iter().enumerate() {
            let close = |a: f32, b: f32| (a - b).abs() <= TOL * (1.0 + b.abs());
            assert!(close(
                layer.max_abs_residual_after_attention,
                probe.residual_after_attention[l]
            ));
            assert!(close(
                layer.max_abs_residual_after_mlp,
                probe.residual_after_mlp[l]
            ));
        }
        let n = TOKENS.len() as f64;
        let q_in = stats.input_mean_square(0, Role::Q).unwrap();
        assert_eq!(q_in.len(), model.hidden);
        for (got, want) in q_in.iter().zip(&probe.qkv_in_sq) {
            assert!((*got as f64 - want / n).abs() < 1e-4 * (1.0 + want / n));
        }
        let down_in = stats.input_mean_square(0, Role::Down).unwrap();
        assert_eq!(down_in.len(), model.intermediate);
        for (got, want) in down_in.iter().zip(&probe.down_in_sq) {
            assert!((*got as f64 - want / n).abs() < 1e-4 * (1.0 + want / n));
        }
        // q, k and v read the same input; the Gram matrix was asked for through q only.
        let site = stats.input(0, Role::K).unwrap();
        let gram = site.gram.as_ref().unwrap();
        assert_eq!(gram.count, TOKENS.len() as u64);
        let mean = gram.mean();
        for (c, ms) in site.mean_square.iter().enumerate() {
            assert!((mean[c * gram.dim + c] - *ms as f64).abs() < 1e-4 * (1.0 + *ms as f64));
        }
        assert!(stats.input(0, Role::Gate).unwrap().gram.is_none());
        // The summary accessors agree with the per-layer numbers.
        let max_res = probe
            .residual_after_attention
            .iter()
            .chain(&probe.residual_after_mlp)
            .fold(0.0f32, |m, v| m.max(*v));
        assert!(stats.max_abs_residual() >= max_res * (1.0 - TOL));
        assert!(stats.max_mean_square_residual() > 0.0);
        assert!(stats.max_abs_by_kind().values().all(|v| *v > 0.0));
        let json = serde_json::to_string(&stats).unwrap();
        let back: ActivationStats = serde_json::from_str(&json).unwrap();
        // serde_json's float parsing may be 1 ulp off; structure and values must survive.
        assert_eq!(back.layers.len(), stats.layers.len());
        assert_eq!(back.tokens, stats.tokens);
        let (a, b) = (
            back.input_mean_square(1, Role::Up).unwrap(),
            stats.input_mean_square(1, Role::Up).unwrap(),
        );
        assert!(a
            .iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-6 * y.abs()));
        assert!((back.max_abs_residual() - stats.max_abs_residual()).abs() < 1e-6);
    }
}

#[test]
fn calibration_segments_restart_sequences() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 7 % 90) as u32 + 3).collect();
    let opts = |segment_len| CalibrationOptions {
        segment_len,
        gram: GramSelection::None,
    };
    let stats = calibrate(&ckpt, &tokens, &opts(16)).unwrap();
    // 16 + 16 + 8: the 8-token tail is half a segment, so it stays its own segment.
    assert_eq!(stats.segments, 3);
    assert_eq!(stats.tokens, 40);
    // A 2-token tail (under a quarter segment) joins the previous segment.
    let stats = calibrate(&ckpt, &tokens[..34], &opts(16)).unwrap();
    assert_eq!(stats.segments, 2);
    // Segments that are whole sequences give the same numbers as calibrating them alone.
    let a = calibrate(&ckpt, &tokens[..16], &opts(16)).unwrap();
    let b = calibrate(&ckpt, &tokens[16..32], &opts(16)).unwrap();
    let both = calibrate(&ckpt, &tokens[..32], &opts(16)).unwrap();
    let want = a.max_abs_residual().max(b.max_abs_residual());
    assert!((both.max_abs_residual() - want).abs() <= TOL * want);
    assert!(matches!(
        calibrate(&ckpt, &[], &opts(16)),
        Err(ReferenceError::Empty)
    ));
}

#[test]
fn fp16_residual_scale_keeps_squares_in_range() {
    let dir = TinyModel {
        scale: 2.0,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let stats = calibrate(&ckpt, &TOKENS, &CalibrationOptions::default()).unwrap();
    for margin in [1.0f32, 2.0, 8.0] {
        let alpha = stats.residual_scale_for_fp16(margin);
        let m = stats.max_abs_residual();
        assert!((alpha * m).powi(2) * margin <= 65504.0, "margin {margin}");
        // The largest such power of two: doubling it would break the bound (unless α = 1).
        assert!(alpha == 1.0 || (2.0 * alpha * m).powi(2) * margin > 65504.0);
        assert_eq!(alpha.log2().fract(), 0.0);
    }
}

/// Validation's bounded reference: block by block over the whole sequence, the
/// lm_head a slice of the vocabulary at a time, equals the whole model's forward pass (the
/// plain backend's, the same code loaded at once) to f32 rounding and candle's to TOL.
fn check_layerwise(model: TinyModel) {
    let dir = model.write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let mut blocks = Vec::new();
    let got = logits_layerwise(&ckpt, &TOKENS, &mut |l| blocks.push(l)).unwrap();
    let layers = ckpt.spec().num_hidden_layers;
    assert_eq!(
        blocks,
        (0..layers).collect::<Vec<_>>(),
        "one call per block"
    );
    // The lm_head in slices of 7 rows (the last one shorter): the same logits.
    let rows7 = 7 * 4 * ckpt.spec().hidden_size;
    assert_ne!(ckpt.spec().vocab_size % 7, 0);
    let sliced = logits_layerwise_sliced(&ckpt, &TOKENS, rows7, &mut |_| {}).unwrap();
    // (the product's blocking differs with the slice's width: f32 rounding, not more)
    let d = max_diff(&sliced, &got);
    assert!(d < 1e-5, "lm_head in 7-row slices: max |Δ| {d}");
    assert_eq!(got.len(), TOKENS.len());
    assert!(got.iter().all(|r| r.len() == ckpt.spec().vocab_size));
    let mut plain = Reference::load_with(&ckpt, BackendChoice::Plain).unwrap();
    let d = max_diff(&plain.logits_all(&TOKENS).unwrap(), &got);
    assert!(d < 1e-5, "layerwise vs plain: max |Δ| {d}");
    let d = max_diff(
        &Reference::load(&ckpt).unwrap().logits_all(&TOKENS).unwrap(),
        &got,
    );
    assert!(d < TOL, "layerwise vs auto: max |Δ| {d}");
    let naive = Naive::open(dir.path()).logits(&TOKENS, &mut NaiveProbe::default());
    let d = max_diff(&naive, &got);
    assert!(d < TOL, "layerwise vs naive: max |Δ| {d}");
}

#[test]
fn layerwise_reference_equals_the_whole_model() {
    check_layerwise(TinyModel::llama());
    check_layerwise(TinyModel::qwen2());
    check_layerwise(TinyModel::mistral());
    check_layerwise(TinyModel {
        tied: true,
        ..TinyModel::qwen2()
    });
}

#[test]
fn layerwise_reference_refuses_what_the_whole_one_refuses() {
    let dir = TinyModel::llama().write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let vocab = ckpt.spec().vocab_size as u32;
    let err = logits_layerwise(&ckpt, &[1, vocab], &mut |_| {}).unwrap_err();
    assert!(
        matches!(err, ReferenceError::TokenOutOfRange { index: 1, .. }),
        "{err}"
    );
    let err = logits_layerwise(&ckpt, &[], &mut |_| {}).unwrap_err();
    assert!(matches!(err, ReferenceError::Empty), "{err}");
    // The calibration pass checks the same vocabulary.
    let opts = CalibrationOptions::default();
    let err = calibrate(&ckpt, &[1, 2, vocab], &opts).unwrap_err();
    assert!(
        matches!(err, ReferenceError::TokenOutOfRange { index: 2, .. }),
        "{err}"
    );
    let err = calibrate(&ckpt, &[], &opts).unwrap_err();
    assert!(matches!(err, ReferenceError::Empty), "{err}");
}

#[test]
fn reference_path_follows_the_f32_weight_budget() {
    let model = TinyModel::llama();
    let dir = model.write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    // Every stored element in f32, counted from the files' headers here.
    let elements: usize = ckpt
        .tensor_names()
        .map(|n| ckpt.tensor(n).unwrap().numel())
        .sum();
    let bytes = f32_weight_bytes(&ckpt);
    assert_eq!(bytes, 4 * elements as u64);
    assert!(bytes > 0);
    assert_eq!(ReferencePath::choose(&ckpt, bytes), ReferencePath::Whole);
    assert_eq!(
        ReferencePath::choose(&ckpt, bytes - 1),
        ReferencePath::Layerwise
    );
    assert_eq!(ReferencePath::choose(&ckpt, 0), ReferencePath::Layerwise);
    assert_eq!(
        ReferencePath::choose(&ckpt, REFERENCE_BUDGET),
        ReferencePath::Whole
    );
}
