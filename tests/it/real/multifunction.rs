//! SmolLM2-135M-Instruct (from `make model`) as one iOS18 package with `prefill` (16 tokens a
//! call) and `decode`: greedy generation with the prompt through `prefill` gives the same text
//! as the same package driven through `decode` alone, token for token.

use half::f16;
use hf2coreml::mil::contract::Contract;
use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::interp::Package;
use hf2coreml::runtime::{RuntimeError, StepModel, StepOutput};
use hf2coreml_testkit::model_dir;

use crate::support::{convert, needs};

/// The package through its default function only: no prefill function is offered.
struct DecodeOnly(Package);

impl StepModel for DecodeOnly {
    fn contract(&self) -> &Contract {
        self.0.contract()
    }
    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        self.0.step(input_ids, position, key_cache, value_cache)
    }
}

#[test]
fn smollm2_prefill_and_decode_generate_what_decode_alone_generates() {
    needs!(Model, Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("smol18.mlpackage");
    // Given ranges (a residual scale of 1/8) instead of measuring them: the test stays short.
    let ranges = root.path().join("ranges.json");
    let maxima = vec![1000; 32];
    std::fs::write(
        &ranges,
        serde_json::json!({"residual_max_abs": maxima, "source": "test"}).to_string(),
    )
    .unwrap();
    convert(model_dir(), &pkg)
        .args([
            "--target",
            "ios18",
            "--prefill-len",
            "16",
            "--max-seq-len",
            "64",
        ])
        .args(["--keep-fp16", "*", "-q"])
        .arg("--activation-ranges")
        .arg(&ranges)
        .ok();
    let tok = hf2coreml::runtime::text::load_tokenizer(&root.path().join("smol18.tokenizer.json"))
        .unwrap();
    // 21 tokens or so: a full chunk of 16 and a padded one.
    let text =
        "The three primary colors are red, yellow and blue. Mixing red and blue gives purple, \
                and mixing yellow and blue gives";
    let prompt = tok.encode(text, false).unwrap().get_ids().to_vec();
    assert!(prompt.len() > 16 && prompt.len() < 32, "{}", prompt.len());
    let opts = GenerateOptions {
        max_new_tokens: 12,
        stop_at_eos: false,
        ..GenerateOptions::default()
    };
    let load = || Package::load(&pkg, Default::default()).unwrap();
    let mut both = Generator::new(load()).unwrap();
    let a = both.generate(&prompt, &opts, &mut |_| Ok(())).unwrap();
    let mut decode = Generator::new(DecodeOnly(load())).unwrap();
    let b = decode.generate(&prompt, &opts, &mut |_| Ok(())).unwrap();
    let words = |ids: &[u32]| tok.decode(ids, false).unwrap();
    eprintln!(
        "prefill+decode: {:?} ({} prefill calls, {:.2} s to the first token)\n\
         decode only:    {:?} ({:.2} s)",
        words(&a.tokens),
        a.timing.prefill_calls,
        a.timing.prompt_time.as_secs_f64(),
        words(&b.tokens),
        b.timing.prompt_time.as_secs_f64()
    );
    assert_eq!(a.timing.prefill_calls, 2);
    assert_eq!(b.timing.prefill_calls, 0);
    assert_eq!(a.tokens, b.tokens);
}
