//! phi3, smollm3, lfm2 and qwen35 GGUF files, checked end to end against transformers: each
//! tiny HF fixture (tests/fixtures/hf/ARCH, with transformers' logits in reference.json;
//! smollm3_nope4 has the real models' NoPE pattern, the one a GGUF can hold) is written as a
//! GGUF laid out as llama.cpp's converter writes the architecture (`Phi3MiniModel`: q/k/v and
//! gate/up fused, `rope.dimension_count` for partial rotary, LongRoPE's factors as two f32
//! tensors and its original context and attention factor as keys; `SmolLM3Model`: llama's q/k
//! permutation, no key for the NoPE blocks, which llama.cpp fixes at every fourth; `LFM2Model`
//! and `Qwen3_5TextModel`: src/checkpoint/gguf/hybrid.rs), in f32 so nothing is lost, then
//! imported; the import's float reference must compute transformers' logits for the original
//! checkpoint. (transformers cannot read the phi3 and smollm3 files back itself: it drops
//! partial rotary and LongRoPE from phi3 files and refuses smollm3 ones; the lfm2 and qwen35
//! files are also read by transformers, in tests/it/gguf/transformers.rs.)

use std::path::Path;

use hf2coreml::arch::RopeScaling;
use hf2coreml::checkpoint::gguf::{self, ImportOptions};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::Reference;
use hf2coreml::progress::Silent;
use hf2coreml_testkit::gguf::{from_checkpoint, FixtureType};

/// transformers' logits in the fixture's reference.json, with the tokens they are for: every
/// position of its tokens, and (LongRoPE) of the prefix within the original context, where
/// the short factors apply.
fn reference_json(dir: &Path) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let tokens = crate::support::json::ids(&j["tokens"]);
    ["logits", "prefix_logits"]
        .iter()
        .filter_map(|key| j.get(*key))
        .map(|rows| {
            let rows = crate::support::json::rows(rows);
            (tokens[..rows.len()].to_vec(), rows)
        })
        .collect()
}

fn round_trip(fixture: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(fixture);
    let original = Checkpoint::open(&src).unwrap();
    let built = from_checkpoint(&original, |_, _, _, _| FixtureType::F32);
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join(format!("{fixture}.gguf"));
    built.writer.write(&file).unwrap();
    let dir = work.path().join("imported");
    gguf::import(&file, &dir, &ImportOptions::default(), &Silent).unwrap();
    let imported = Checkpoint::open(&dir).unwrap();
    assert_eq!(
        imported.spec().architecture,
        original.spec().architecture,
        "{fixture}"
    );
    // Everything that shapes the computation comes back (the import writes fp16 weights and
    // its own dtype, vocabulary ids and context).
    // (LongRoPE's factors and attention factor as the f32 values a GGUF holds.)
    let (a, b) = (original.spec(), imported.spec());
    let as_f32 = |r: &RopeScaling| match r.clone() {
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => RopeScaling::LongRope {
            short_factor: short_factor.iter().map(|&x| x as f32 as f64).collect(),
            long_factor: long_factor.iter().map(|&x| x as f32 as f64).collect(),
            original_max_position_embeddings,
            // A GGUF float key is read as the shortest decimal of its f32.
            attention_factor: (attention_factor as f32).to_string().parse().unwrap(),
        },
        other => other,
    };
    assert_eq!(
        (
            a.rotary_dim(),
            as_f32(&a.rope_scaling),
            &a.no_rope_layers,
            a.head_dim
        ),
        (
            b.rotary_dim(),
            b.rope_scaling.clone(),
            &b.no_rope_layers,
            b.head_dim
        ),
        "{fixture}"
    );
    for (name, (shape, values)) in &built.expected {
        let t = imported.tensor(name).unwrap();
        assert_eq!(t.shape.to_vec(), *shape, "{fixture}: {name}");
        let back = t.to_f32();
        let fp16 = |v: f32| half::f16::from_f32(v).to_f32();
        assert!(
            back.iter().zip(values).all(|(x, y)| *x == fp16(*y)),
            "{fixture}: {name} differs from what was written"
        );
    }
    let mut reference = Reference::load(&imported).unwrap();
    for (tokens, want) in reference_json(&src) {
        let got = reference.logits_all(&tokens).unwrap();
        let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .flat_map(|(g, w)| g.iter().zip(w).map(|(x, y)| (x - y).abs()))
            .fold(0f32, f32::max);
        eprintln!(
            "{fixture}, {} tokens: imported reference vs transformers: max |Δlogit| {worst:.2e} \
             of {scale:.1}",
            tokens.len()
        );
        // The fixture's weights are fp16-exact, so the import's fp16 loses nothing: only the
        // reference's own f32 rounding differs.
        assert!(worst <= 1e-4 * scale, "{fixture}: max |Δlogit| {worst}");
    }
}

#[test]
fn phi3_imports_its_fused_projections() {
    round_trip("phi3");
}

#[test]
fn phi3_imports_partial_rotary_embeddings() {
    round_trip("phi3_partial");
}

#[test]
fn phi3_imports_longrope() {
    round_trip("phi3_longrope");
}

#[test]
fn smollm3_imports_its_nope_blocks() {
    round_trip("smollm3_nope4");
}

/// LFM2 (transformers' fixture: convolution blocks 0, 2 and 3, the feed-forward width
/// adjusted from 128 to 96, tied) as `LFM2Model` writes it.
#[test]
fn lfm2_imports_its_convolution_blocks() {
    round_trip("lfm2");
}

/// Qwen3.5 (transformers' fixture) as `Qwen3_5TextModel` writes it. Its attention block is the
/// third while the file says every fourth (`full_attention_interval`, which config.json does
/// not keep, so llama.cpp's converter always writes 4): the import takes the block kinds from
/// the tensors, and computes transformers' logits.
#[test]
fn qwen3_5_imports_block_kinds_from_its_tensors() {
    round_trip("qwen3_5");
}
