//! `--layout ane` for the hybrids (LFM2's short convolutions, Qwen3.5's Gated DeltaNets and
//! gated attention with (1 + w) norms), for partial RoPE (Qwen3.5, Phi-4-mini) and for Gemma 3
//! (sliding blocks with their own RoPE and window, ranged sandwich norms, a scaled embedding,
//! the multimodal checkpoint's text decoder), on the
//! fixtures transformers wrote: each converted in both layouts, stepped over the same tokens
//! (the recurrent states carried by the runner), the ane package's logits against the default
//! package's and transformers', its states against the default package's; a chunked package
//! whose prompt is no multiple of Q, and a chain, each against the one-token package.

use std::path::Path;

use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::generate::Generator;
use hf2coreml::runtime::interp::Package;

use super::hf::{expected, fixture, largest, max_diff, prompt_logits, validate};
use crate::convert::ane_layout::check_ane_package;
use crate::support::logits::agreement;
use crate::support::{convert, needs};

/// Convert `arch`'s fixture in fp16 in `layout` at context `s` with `flags`.
fn fp16(arch: &str, out: &Path, layout: &str, s: usize, flags: &[&str]) {
    convert(fixture(arch), out)
        .args(["--max-seq-len", &s.to_string(), "--keep-fp16", "*"])
        .args(["--layout", layout])
        .args(flags)
        .ok();
}

/// Both layouts over transformers' tokens: the same logits within a few fp16 steps (q·kᵀ sums
/// per head in the ane layout, per group of query rows in the default one, and a score's last
/// bit is carried to the logits; every other op computes the same bits in both layouts), the
/// same recurrent state after the prompt within 1%, and the ane package within the fp16 bound
/// of transformers' logits.
#[test]
fn hybrids_partial_rope_and_gemma3_convert_in_the_ane_layout() {
    needs!(Python);
    for (arch, max_rms) in [
        ("lfm2", 0.01),
        ("lfm2_untied", 0.01),
        ("qwen3_5", 0.01),
        ("phi3_partial", 0.01),
        ("gemma3", 0.01),
        ("gemma3_big", 0.01),
        ("gemma3_vl", 0.01),
        ("gemma4", 0.01),
        ("gemma4_kv", 0.01),
        ("gemma4_vl", 0.01),
    ] {
        let want = expected(&fixture(arch));
        let s = want.tokens.len().next_multiple_of(64);
        let out = tempfile::tempdir().unwrap();
        let mut got = Vec::new();
        for layout in ["default", "ane"] {
            let pkg = out.path().join(format!("{layout}.mlpackage"));
            fp16(arch, &pkg, layout, s, &[]);
            let mut g = Generator::new(Package::load(&pkg, Default::default()).unwrap()).unwrap();
            let (rows, _) = prompt_logits(&mut g, &want.tokens, false);
            got.push((rows, g.recurrent_state().to_vec()));
        }
        let dir = out.path();
        check_ane_package(&dir.join("ane.mlpackage"), &dir.join("default.mlpackage"));
        let ((d, ds), (a, st)) = (&got[0], &got[1]);
        let worst = max_diff(a, d);
        let same = (a.iter().flatten().zip(d.iter().flatten()))
            .filter(|(x, y)| x.to_bits() == y.to_bits())
            .count() as f64
            / d.iter().flatten().count() as f64;
        let state_gap = (st.iter().zip(ds))
            .map(|(x, y)| (x.to_f32() - y.to_f32()).abs())
            .fold(0f32, f32::max);
        let (rms, top1) = agreement(a, &want.logits);
        eprintln!(
            "{arch}: layouts differ by {worst:e} at most ({same:.3} of logits the same bits), \
             states by {state_gap:e}; ane against transformers: relative RMS {rms:e}, top-1 \
             {top1}"
        );
        // A few fp16 steps at the largest logit (2^-10 of it each).
        let tol = 4.0 * largest(d) / 1024.0;
        assert!(worst <= tol, "{arch}: logits differ by {worst}");
        let top = ds.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        assert_eq!(st.len(), ds.len());
        assert!(
            state_gap <= 0.01 * top.max(1e-3),
            "{arch}: {state_gap} of {top}"
        );
        assert!(rms <= max_rms && top1 >= 0.99, "{arch}: {rms} {top1}");
    }
}

/// The ane layout's prefill function (8 tokens a call, the chunk's last real row found by
/// `valid_len`, padding that leaves the states alone) beside decode passes validate, and a
/// prompt of no multiple of 8 tokens then greedy tokens give what the one-function ane package
/// gives (Gemma 3's past its window); a chain of
/// ane parts (each with its own blocks' states) computes what the one package computes, bit
/// for bit.
#[test]
fn ane_prefill_and_chains_match_one_package() {
    use hf2coreml::runtime::generate::GenerateOptions;
    needs!(Python);
    for (arch, part_limit) in [
        ("lfm2", "1250KB"),
        ("qwen3_5", "1300KB"),
        ("gemma3", "1250KB"),
        ("gemma4", "1450KB"),
    ] {
        let dir = fixture(arch);
        let want = expected(&dir);
        let out = tempfile::tempdir().unwrap();
        let (two, one, chain) = (
            out.path().join("two.mlpackage"),
            out.path().join("one.mlpackage"),
            out.path().join("chain.mlpackage"),
        );
        let ios18 = ["--target", "ios18", "--prefill-len", "8"];
        fp16(arch, &two, "ane", 64, &ios18);
        fp16(arch, &one, "ane", 64, &[]);
        let limit = ["--max-package-size", part_limit];
        fp16(arch, &chain, "ane", 64, &limit);
        let (code, report, err) = validate(&two, &dir, 64);
        assert_eq!(code, Some(0), "{arch}: {err}\n{report:#}");
        let parts = hf2coreml::mil::chain_file::ChainFile::read(&chain)
            .unwrap()
            .parts;
        assert!(parts.len() >= 2, "{arch}: {} parts", parts.len());
        let opts = GenerateOptions {
            max_new_tokens: 6,
            stop_at_eos: false,
            ..Default::default()
        };
        // No multiple of 8 (Gemma 3's fixture has 40 tokens: 37 of them).
        let prompt = &want.tokens[..want.tokens.len().min(48) - 3];
        let load = |pkg: &Path| Generator::new(Saved::load(pkg, Default::default()).unwrap());
        let mut gens = Vec::new();
        for pkg in [&two, &one] {
            let gen = load(pkg).unwrap().generate(prompt, &opts, &mut |_| Ok(()));
            gens.push(gen.unwrap());
        }
        let calls = prompt.len().div_ceil(8);
        assert_eq!(gens[0].timing.prefill_calls, calls, "{arch}");
        assert_eq!(gens[0].tokens, gens[1].tokens, "{arch}: prefill");
        let mut logits = Vec::new();
        for pkg in [&one, &chain] {
            let mut g = load(pkg).unwrap();
            let (rows, _) = prompt_logits(&mut g, prompt, false);
            logits.push((rows, g.recurrent_state().to_vec()));
        }
        assert!(
            logits[0] == logits[1],
            "{arch}: the chain's logits and state"
        );
    }
}
