//! The token loop against a strict toy model: cache handling, chunking with padding and
//! sliding, stop conditions, context limits, recorded logits, seeded sampling, errors.

use hf2coreml::runtime::generate::{
    GenerateError, GenerateOptions, Generation, Generator, StopReason,
};
use hf2coreml::runtime::sampling::{argmax, SamplingParams};
use proptest::prelude::*;

use crate::support::toy::{contract, reference_greedy, reference_targets, ToyModel};

const V: usize = 23;

fn generator(s: usize, q: usize, eos: Vec<u32>) -> Generator<ToyModel> {
    Generator::new(ToyModel::new(contract(s, q, V, eos))).unwrap()
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_at_eos: true,
        record_logits: true,
    }
}

fn run(
    g: &mut Generator<ToyModel>,
    prompt: &[u32],
    opts: &GenerateOptions,
) -> (Result<Generation, GenerateError>, Vec<u32>) {
    let mut streamed = Vec::new();
    let r = g.generate(prompt, opts, &mut |t| {
        streamed.push(t);
        Ok(())
    });
    (r, streamed)
}

/// Every recorded row must be the toy's logits for the right target, in position order.
fn check_logits(gen: &Generation) {
    let seq: Vec<u32> = gen.prompt.iter().chain(&gen.tokens).copied().collect();
    let processed = gen.prompt.len() + gen.tokens.len().saturating_sub(1);
    let targets = reference_targets(&seq[..processed], V);
    let rows = gen.logits.as_ref().expect("recorded");
    assert_eq!(rows.rows(), processed);
    for (t, &target) in targets.iter().enumerate() {
        assert_eq!(argmax(rows.row(t).unwrap()), target, "logits row {t}");
    }
}

#[test]
fn greedy_generation_matches_the_reference_for_every_query_length() {
    let prompt = [3, 1, 4, 1, 5, 9, 2];
    for q in [1, 2, 3, 4, 7, 8] {
        let mut g = generator(24, q, vec![]);
        let (r, streamed) = run(&mut g, &prompt, &greedy(10));
        let gen = r.unwrap();
        assert_eq!(gen.tokens, reference_greedy(&prompt, 10, V), "Q = {q}");
        assert_eq!(streamed, gen.tokens);
        assert_eq!(gen.stop, StopReason::MaxNewTokens);
        check_logits(&gen);
    }
}

#[test]
fn model_calls_follow_the_chunk_plan() {
    // Q = 4, prompt of 6: calls at 0 (4 real) and 4 (2 real + 2 pad); then one call per
    // generated token fed back, at its own position (padded).
    let mut g = generator(32, 4, vec![]);
    let (r, _) = run(&mut g, &[1, 2, 3, 4, 5, 6], &greedy(3));
    let gen = r.unwrap();
    let calls = &g.model().calls;
    let positions: Vec<usize> = calls.iter().map(|c| c.0).collect();
    assert_eq!(positions, vec![0, 4, 6, 7]);
    // Padding uses the pad id (no eos in this contract: 0).
    assert_eq!(calls[1].1, vec![5, 6, 0, 0]);
    assert_eq!(calls[2].1[0] as u32, gen.tokens[0]);
    assert_eq!(gen.timing.model_calls, 4);
    assert_eq!(gen.timing.prompt_tokens, 6);
    assert_eq!(gen.timing.decode_tokens, 2);
}

#[test]
fn the_context_fills_exactly_to_s_and_the_chunk_slides_back() {
    // S = 12, Q = 5, prompt 9: the last decode calls cannot start at their own position
    // (p + 5 > 12), so they start at 7 and recompute rows already in the cache.
    let (s, q) = (12, 5);
    let prompt: Vec<u32> = (0..9).map(|i| (i * 5 + 2) % V as u32).collect();
    let mut g = generator(s, q, vec![]);
    // 9 prompt + 4 generated: the 4th is sampled from position 11's logits, never fed back.
    let (r, _) = run(&mut g, &prompt, &greedy(4));
    let gen = r.unwrap();
    assert_eq!(gen.tokens, reference_greedy(&prompt, 4, V));
    check_logits(&gen);
    assert!(g.model().calls.iter().all(|c| c.0 + q <= s));
    assert_eq!(g.model().calls.last().unwrap().0, s - q);
}

#[test]
fn asking_past_the_context_is_a_typed_error_that_keeps_the_text() {
    let s = 10;
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
    let mut g = generator(s, 1, vec![]);
    let (r, streamed) = run(&mut g, &prompt, &greedy(5));
    match r {
        Err(GenerateError::ContextFull {
            max_seq_len,
            partial,
        }) => {
            assert_eq!(max_seq_len, s);
            // Positions 8 and 9 fit; the third sampled token would need position 10.
            assert_eq!(partial.tokens, reference_greedy(&prompt, 3, V));
            assert_eq!(streamed, partial.tokens);
        }
        other => panic!("expected ContextFull, got {other:?}"),
    }
    let msg = GenerateError::PromptTooLong {
        prompt_len: 11,
        max_seq_len: 10,
    }
    .to_string();
    assert!(msg.contains("11") && msg.contains("10"));
    let (r, _) = run(&mut g, &[1; 11], &greedy(1));
    assert!(matches!(r, Err(GenerateError::PromptTooLong { .. })));
}

#[test]
fn eos_stops_generation_and_is_reported() {
    let prompt = [3, 1, 4];
    let expected = reference_greedy(&prompt, 12, V);
    // Make the fourth generated token the eos id (first occurrence in the continuation).
    let eos = expected[3];
    let first = expected.iter().position(|&t| t == eos).unwrap();
    let mut g = generator(32, 2, vec![eos]);
    let (r, streamed) = run(&mut g, &prompt, &greedy(12));
    let gen = r.unwrap();
    assert_eq!(gen.stop, StopReason::Eos(eos));
    assert_eq!(gen.tokens, expected[..=first].to_vec());
    assert_eq!(streamed, gen.tokens);
    check_logits(&gen);

    let keep_going = GenerateOptions {
        stop_at_eos: false,
        ..greedy(12)
    };
    let (r, _) = run(&mut g, &prompt, &keep_going);
    assert_eq!(r.unwrap().tokens, expected);
}

#[test]
fn zero_new_tokens_processes_the_prompt_only() {
    let prompt = [5, 6, 7, 8, 9];
    let mut g = generator(16, 2, vec![]);
    let (r, streamed) = run(&mut g, &prompt, &greedy(0));
    let gen = r.unwrap();
    assert!(gen.tokens.is_empty() && streamed.is_empty());
    assert_eq!(gen.logits.as_ref().unwrap().rows(), prompt.len());
    check_logits(&gen);
    assert_eq!(gen.timing.decode_tokens, 0);
}

#[test]
fn caches_are_allocated_once_and_reused_across_calls() {
    let mut g = generator(16, 3, vec![]);
    let (k, v) = (g.key_cache().as_ptr(), g.value_cache().as_ptr());
    assert_eq!(g.key_cache().len(), 2 * 2 * 16 * 3);
    for prompt in [&[1u32, 2, 3][..], &[9, 8, 7, 6, 5, 4, 3][..], &[4][..]] {
        let (r, _) = run(&mut g, prompt, &greedy(6));
        assert_eq!(r.unwrap().tokens, reference_greedy(prompt, 6, V));
        assert_eq!(g.key_cache().as_ptr(), k);
        assert_eq!(g.value_cache().as_ptr(), v);
    }
}

/// `extend` continues from the cached tokens (every Q, including a chunk that slides back at
/// the end of the context), a diverging sequence recomputes from where it diverges, and rows
/// moved to another generator with `valid_rows`/`restore` continue the same way: the text and
/// logits of one `generate` over the whole sequence.
#[test]
fn extend_and_restore_continue_the_cached_sequence() {
    let first = [3u32, 1, 4, 1, 5];
    for q in [1, 2, 3, 4] {
        let mut g = generator(24, q, vec![]);
        let (r, _) = run(&mut g, &first, &greedy(4));
        let one = r.unwrap();
        // The last sampled token has no row yet.
        let cached = [&first[..], &one.tokens[..3]].concat();
        assert_eq!(g.cached_tokens(), &cached[..], "Q = {q}");
        let whole = [&first[..], &one.tokens[..], &[9, 2, 6]].concat();
        let (keys, values) = g.valid_rows().unwrap();
        let two = g.extend(&whole, &greedy(8), &mut |_| Ok(())).unwrap();
        assert_eq!(two.timing.prompt_tokens, whole.len() - cached.len());
        assert_eq!(two.tokens, reference_greedy(&whole, 8, V), "Q = {q}");
        let rows = two.logits.as_ref().unwrap();
        assert_eq!(rows.rows(), whole.len() - cached.len() + 7);

        // Rows moved into fresh (zeroed) caches: the model only sees what `restore` wrote.
        let mut first_gen = generator(24, q, vec![]);
        run(&mut first_gen, &first, &greedy(4)).0.unwrap();
        let mut other = Generator::new(first_gen.into_model()).unwrap();
        other.restore(&cached, &keys, &values, &[]).unwrap();
        let again = other.extend(&whole, &greedy(8), &mut |_| Ok(())).unwrap();
        assert_eq!(again.tokens, two.tokens);
        assert_eq!(again.logits, two.logits);
        // Restored rows must fit the cache.
        assert!(other.restore(&cached, &keys[1..], &values, &[]).is_err());

        // A sequence that diverges at position 2 recomputes from there.
        let fork = [3u32, 1, 7, 7];
        let three = g.extend(&fork, &greedy(3), &mut |_| Ok(())).unwrap();
        assert_eq!(three.timing.prompt_tokens, 2);
        assert_eq!(three.tokens, reference_greedy(&fork, 3, V));
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let prompt = [2, 7, 1, 8];
    let opts = |seed| GenerateOptions {
        max_new_tokens: 16,
        sampling: SamplingParams {
            temperature: 1.5,
            top_k: Some(5),
            top_p: Some(0.95),
            seed,
        },
        stop_at_eos: true,
        record_logits: false,
    };
    let mut g = generator(32, 1, vec![]);
    let a = run(&mut g, &prompt, &opts(7)).0.unwrap().tokens;
    let b = run(&mut g, &prompt, &opts(7)).0.unwrap().tokens;
    let c = run(&mut g, &prompt, &opts(8)).0.unwrap().tokens;
    assert_eq!(a, b);
    assert_ne!(a, c);
    // With temperature the toy's smooth tail is live, so sampling is not just greedy.
    assert_ne!(a, reference_greedy(&prompt, 16, V));
}

#[test]
fn bad_prompts_and_bad_models_are_errors_not_panics() {
    let mut g = generator(16, 2, vec![]);
    assert!(matches!(
        run(&mut g, &[], &greedy(1)).0,
        Err(GenerateError::EmptyPrompt)
    ));
    assert!(matches!(
        run(&mut g, &[1, V as u32], &greedy(1)).0,
        Err(GenerateError::TokenOutOfRange { index: 1, .. })
    ));

    let mut failing = ToyModel::new(contract(16, 1, V, vec![]));
    failing.fail_on_call = Some(2);
    let mut g = Generator::new(failing).unwrap();
    match run(&mut g, &[1, 2, 3, 4], &greedy(1)).0 {
        Err(e @ GenerateError::Step { position: 2, .. }) => {
            let chain = format!("{:?}", anyhow::Error::from(e));
            assert!(chain.contains("planned failure"), "{chain}");
        }
        other => panic!("expected a step error at 2, got {other:?}"),
    }

    let mut short = ToyModel::new(contract(16, 1, V, vec![]));
    short.wrong_logits_len = Some(V - 1);
    let mut g = Generator::new(short).unwrap();
    assert!(matches!(
        run(&mut g, &[1], &greedy(1)).0,
        Err(GenerateError::BadStepOutput { what: "logits", .. })
    ));

    assert!(matches!(
        Generator::new(ToyModel::new(contract(4, 5, V, vec![]))),
        Err(GenerateError::BadContract(_))
    ));
    assert!(matches!(
        Generator::new(ToyModel::new(contract(8, 1, V, vec![V as u32]))),
        Err(GenerateError::BadContract(_))
    ));
}

#[test]
fn a_failing_output_stops_generation() {
    let mut g = generator(16, 1, vec![]);
    let r = g.generate(&[1, 2], &greedy(5), &mut |_| {
        Err(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "closed",
        ))
    });
    assert!(matches!(r, Err(GenerateError::Output(_))));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any S, Q, prompt and length: the text and every recorded logits row match the
    /// reference, or the run ends with ContextFull exactly when it must.
    #[test]
    fn any_shape_matches_the_reference(
        s in 1usize..20,
        q_frac in 0.0f64..1.0,
        prompt in proptest::collection::vec(0u32..V as u32, 1..20),
        n in 0usize..20,
    ) {
        let q = 1 + ((s - 1) as f64 * q_frac) as usize;
        let mut g = generator(s, q, vec![]);
        let (r, streamed) = run(&mut g, &prompt, &greedy(n));
        if prompt.len() > s {
            prop_assert!(matches!(r, Err(GenerateError::PromptTooLong { .. })), "{:?}", r);
            return Ok(());
        }
        // Tokens that can be sampled: one per position up to S (the last one is not fed back).
        let room = s + 1 - prompt.len();
        match r {
            Ok(gen) => {
                prop_assert!(n <= room);
                prop_assert_eq!(&gen.tokens, &reference_greedy(&prompt, n, V));
                prop_assert_eq!(&streamed, &gen.tokens);
                check_logits(&gen);
            }
            Err(GenerateError::ContextFull { partial, .. }) => {
                prop_assert!(n > room);
                prop_assert_eq!(&partial.tokens, &reference_greedy(&prompt, room, V));
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}
