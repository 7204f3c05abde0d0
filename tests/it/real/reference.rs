//! The reference on the real model (SmolLM2-135M-Instruct imported from its GGUF by
//! `make model`; HF2COREML_MODEL_DIR points elsewhere if wanted).

use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::{
    calibrate, BackendChoice, BackendKind, CalibrationOptions, OpKind, Reference,
};

use crate::support::needs;

fn open_model() -> (Checkpoint, tokenizers::Tokenizer) {
    let dir = hf2coreml_testkit::model_dir();
    let ckpt = Checkpoint::open(&dir).unwrap_or_else(|e| {
        panic!(
            "the real model is needed at {} (run `make model`): {e}",
            dir.display()
        )
    });
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join("tokenizer.json").display()));
    (ckpt, tok)
}

fn encode(tok: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).unwrap().get_ids().to_vec()
}

#[test]
fn greedy_answer_names_paris() {
    needs!(Model);
    let (ckpt, tok) = open_model();
    let mut r = Reference::load(&ckpt).unwrap();
    assert_eq!(r.backend(), BackendKind::CandleLlama);
    let prompt = encode(
        &tok,
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    );
    // ChatML special tokens must be single ids, or the prompt is not what the model was
    // trained on.
    assert_eq!(prompt[0], 1, "<|im_start|> is id 1");
    let eos = ckpt.spec().eos_token_ids.clone();
    let out = r.greedy_generate(&prompt, 24, &eos).unwrap();
    let answer = tok.decode(&out, true).unwrap();
    assert!(answer.contains("Paris"), "answer: {answer:?}");
}

#[test]
fn calibration_shows_massive_activations() {
    needs!(Model);
    let (ckpt, tok) = open_model();
    let text = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/assets/calibration.txt"
    ));
    // Two segments: the massive activations build up within each segment's first tokens
    // (docs/reference/real-model.md), so more segments only repeat them.
    let mut tokens = encode(&tok, text);
    tokens.truncate(2 * CalibrationOptions::default().segment_len);
    let stats = calibrate(&ckpt, &tokens, &CalibrationOptions::default()).unwrap();
    let max = stats.max_abs_residual();
    eprintln!(
        "calibration: {} tokens in {} segments; max |residual| {max:.1}, max mean(x²) {:.4e}, \
         suggested α (margin 1) {}",
        stats.tokens,
        stats.segments,
        stats.max_mean_square_residual(),
        stats.residual_scale_for_fp16(1.0)
    );
    for l in &stats.layers {
        eprintln!(
            "  block {:2}: |residual| after attention {:9.1}, after mlp {:9.1}",
            l.layer, l.max_abs_residual_after_attention, l.max_abs_residual_after_mlp
        );
    }
    for (kind, v) in stats.max_abs_by_kind() {
        eprintln!("  {:<26} {v:.4e}", kind.as_str());
    }
    // docs/reference/real-model.md: ~24,900 from block 11 on; anything in the 10^4 range is the phenomenon.
    assert!((1e4..1e5).contains(&max), "max |residual| {max}");
    // The first blocks are still small (~39 after block 0).
    assert!(stats.layers[0].max_abs_residual_after_mlp < 1e3);
    // Naive fp16 overflows: x² inside the RMSNorm passes fp16's max.
    assert!(stats.max_abs(OpKind::RmsNormSquare) > 65504.0);
    // The residual scale docs/design.md records (1/128) is what the stats suggest with no margin.
    let alpha = stats.residual_scale_for_fp16(1.0);
    assert!((alpha * max).powi(2) <= 65504.0);
    assert!(alpha <= 1.0 / 128.0, "alpha {alpha}");
}

#[test]
fn candle_and_plain_agree_on_the_real_model() {
    needs!(Model);
    let (ckpt, tok) = open_model();
    let tokens = encode(&tok, "The old railway line closed in the spring of 1968.");
    let a = Reference::load(&ckpt).unwrap().logits_all(&tokens).unwrap();
    let b = Reference::load_with(&ckpt, BackendChoice::Plain)
        .unwrap()
        .logits_all(&tokens)
        .unwrap();
    let cmp = hf2coreml::validate::compare_logits(&a, &b, &tokens).unwrap();
    // Two f32 implementations of the same model: only summation order differs, amplified by
    // the massive activations (|x| ~ 2.5e4, f32 ulp there ~2e-3).
    const KL_F32: f64 = 1e-6;
    assert!(cmp.kl_max < KL_F32, "{cmp:?}");
    assert_eq!(cmp.top1, 1.0);
}

#[test]
fn fixture_texts_have_their_intended_lengths() {
    needs!(Model);
    let (_, tok) = open_model();
    let calibration = encode(
        &tok,
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/assets/calibration.txt"
        )),
    )
    .len();
    let evaluation = encode(
        &tok,
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/assets/evaluation.txt"
        )),
    )
    .len();
    eprintln!("calibration.txt {calibration} tokens, evaluation.txt {evaluation} tokens");
    // Calibrated palettization fits 2k-wide Hessians on it: thousands of tokens.
    assert!((4000..=6000).contains(&calibration), "{calibration}");
    assert!((900..=1300).contains(&evaluation), "{evaluation}");
}

#[test]
fn layerwise_reference_agrees_on_the_real_model() {
    needs!(Model);
    // Validation's bounded reference (block by block, lm_head in vocabulary slices) against
    // the whole model loaded at once: the plain backend (the same arithmetic) to f32 rounding,
    // candle (another implementation) as closely as the plain backend itself agrees with it.
    let (ckpt, tok) = open_model();
    let tokens = encode(
        &tok,
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/assets/evaluation_code.txt"
        )),
    );
    let tokens = &tokens[..tokens.len().min(160)];
    let got = hf2coreml::model::layerwise::logits_layerwise(&ckpt, tokens, &mut |_| {}).unwrap();
    let plain = Reference::load_with(&ckpt, BackendChoice::Plain)
        .unwrap()
        .logits_all(tokens)
        .unwrap();
    let d = plain
        .iter()
        .flatten()
        .zip(got.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    // |logit| ~ 20-40: a few f32 ulps after the massive activations (|x| ~ 2.5e4).
    assert!(d < 1e-2, "layerwise vs plain: max |Δlogit| {d}");
    let candle = Reference::load(&ckpt).unwrap().logits_all(tokens).unwrap();
    let cmp = hf2coreml::validate::compare_logits(&candle, &got, tokens).unwrap();
    eprintln!(
        "layerwise vs plain: max |Δlogit| {d}; vs candle: KL max {:e}, max |Δlogit| {}",
        cmp.kl_max, cmp.max_abs_dlogit
    );
    assert!(cmp.kl_max < 1e-6, "{cmp:?}");
    assert_eq!(cmp.top1, 1.0);
}
