//! K-quant GGUF files as llama.cpp lays out a `Q4_K_M` (q4_K matrices, q6_K for `output` and
//! the `use_more_bits` layers' attn_v/ffn_down, f32 vectors, q5_0/q8_0 where rows are not a
//! multiple of 256), made from a tiny llama, qwen2, qwen3, gemma3, phi3 and smollm3 checkpoint: they import to
//! the values the fixture's own quantizer decodes to (q/k un-permuted for llama and smollm3), convert
//! straight from the .gguf (the second time from the model cache), and the package passes
//! `validate` against the checkpoint the file was made from.

use std::path::Path;

use hf2coreml::checkpoint::gguf::{self, GgufError, ImportOptions};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::progress::Silent;
use hf2coreml_testkit::gguf::{q4_k_m_fixture, q4_k_m_spm_fixture, BuiltGguf, TinyGguf};
use hf2coreml_testkit::TinyModel;

use crate::support::{convert, needs, Cli};

fn types_of(path: &Path) -> Vec<String> {
    let g = gguf::GgufFile::open(path).unwrap();
    let mut t: Vec<String> = g.tensors().iter().map(|t| t.type_name()).collect();
    t.sort();
    t.dedup();
    t
}

/// The imported safetensors hold exactly the fixture's decoded values (fp16-rounded).
fn check_import(gguf_path: &Path, built: &BuiltGguf) {
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("ckpt");
    gguf::import(gguf_path, &dest, &ImportOptions::default(), &Silent).unwrap();
    let ckpt = Checkpoint::open(&dest).unwrap();
    for (name, (shape, values)) in &built.expected {
        let t = ckpt.tensor(name).unwrap();
        assert_eq!(t.shape, shape.as_slice(), "{name}");
        let got = t.to_f32();
        for (i, (g, w)) in got.iter().zip(values).enumerate() {
            let w16 = half::f16::from_f32(*w).to_f32();
            assert!(g.to_bits() == w16.to_bits(), "{name}[{i}]: {g} vs {w16}");
        }
    }
}

fn check(model: TinyModel) {
    check_with(model, q4_k_m_fixture, "calibrated-4bit")
}

/// A fixture made by `make`, converted with `recipe` (a 4-bit one gets the re-quantizing note).
fn check_with(
    model: TinyModel,
    make: fn(TinyModel, &Path) -> std::io::Result<BuiltGguf>,
    recipe: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let built = make(model, dir.path()).unwrap();
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("tiny-Q4_K_M.gguf");
    built.writer.write(&file).unwrap();
    let types = types_of(&file);
    for t in ["F32", "Q4_K", "Q6_K", "Q5_0", "Q8_0"] {
        assert!(types.contains(&t.to_string()), "{t} missing from {types:?}");
    }
    check_import(&file, &built);

    let cache = work.path().join("cache");
    let pkg = work.path().join("tiny.mlpackage");
    let from_gguf = |pkg: &Path, recipe: &str| {
        let o = convert(&file, pkg)
            .args(["--max-seq-len", "256", "--recipe", recipe])
            .cache(&cache)
            .output();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "convert failed:\n{err}");
        err
    };
    let first = from_gguf(&pkg, recipe);
    assert!(first.contains("imported"), "{first}");
    assert_eq!(
        first.contains("re-quantizes"),
        recipe.contains("4bit"),
        "a 4-bit recipe on a Q4_K source gets the note, no other: {first}"
    );
    // The second conversion shows the import reused: a recipe without calibration is enough.
    let second = from_gguf(&work.path().join("again.mlpackage"), "data-free-4bit");
    assert!(second.contains("reusing"), "second convert: {second}");
    assert_eq!(
        std::fs::read_dir(cache.join("imported")).unwrap().count(),
        1
    );

    let o = Cli::new()
        .arg("validate")
        .arg(&pkg)
        .arg("--against")
        .arg(dir.path())
        // The 4-bit KL and perplexity gates; top-1 is left out: on a random model's
        // near-uniform logits it measures ties, not the package.
        .args(["--gate", "kl_mean<=0.2", "--gate", "ppl_ratio<=1.25"])
        .cache(&cache)
        .python()
        .output();
    assert!(
        o.status.success(),
        "validate against the source checkpoint:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn llama_q4_k_m_imports_converts_and_validates() {
    needs!(Python);
    check(TinyModel::llama());
}

#[test]
fn qwen2_q4_k_m_imports_converts_and_validates() {
    needs!(Python);
    check(TinyModel::qwen2());
}

#[test]
fn qwen3_q4_k_m_imports_converts_and_validates() {
    needs!(Python);
    check(TinyModel::qwen3());
}

#[test]
fn phi3_q4_k_m_imports_converts_and_validates() {
    needs!(Python);
    check(TinyModel::phi3());
}

#[test]
fn smollm3_q4_k_m_imports_converts_and_validates() {
    needs!(Python);
    let spec = hf2coreml_testkit::gguf::kquant_model(TinyModel::smollm3()).spec();
    assert_eq!(
        spec.no_rope_layers,
        [3],
        "the fixture has a block without RoPE"
    );
    check(TinyModel::smollm3());
}

#[test]
fn gemma3_q4_k_m_imports_converts_and_validates() {
    needs!(Python);
    check_with(TinyModel::gemma3(), q4_k_m_spm_fixture, "calibrated-4bit");
}

#[test]
fn overlapping_tensors_are_refused() {
    let mut w = TinyGguf::llama().build().writer;
    w.same_offset = Some(0);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("overlap.gguf");
    w.write(&file).unwrap();
    match gguf::GgufFile::open(&file) {
        Err(GgufError::Tensor { message, .. }) => assert!(message.contains("overlap"), "{message}"),
        other => panic!("expected an overlap error, got {other:?}"),
    }
    let o = Cli::new()
        .arg("inspect")
        .arg(&file)
        .cache(dir.path().join("cache"))
        .output();
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("overlap"));
}
