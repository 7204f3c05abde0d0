//! The K-quant GGUF fixtures (byte-level and SentencePiece vocabularies) against transformers'
//! own GGUF reader: each file is rebuilt here
//! byte for byte as `cargo run -p hf2coreml-tools --bin gguf_fixture ARCH` writes it, and
//! python/testgen/gguf_transformers.py recorded what transformers makes of that file
//! (tests/fixtures/gguf/ARCH-Q4_K_M.json). The import must hold the weights transformers
//! reads (fp16-rounded, hash for hash), tokenize as transformers does, and its fp16 package
//! must compute transformers' logits.

use std::path::{Path, PathBuf};

use half::f16;
use hf2coreml::checkpoint::gguf::{self, ImportOptions};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::Reference;
use hf2coreml::progress::Silent;
use hf2coreml::runtime::interp::{Options, Package};
use hf2coreml::runtime::StepModel;
use hf2coreml_testkit::gguf::{q4_k_m_fixture, q4_k_m_spm_fixture, BuiltGguf};
use hf2coreml_testkit::TinyModel;

use crate::support::convert;
use crate::support::need::{available, Need};

fn recorded(arch: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/gguf/{arch}-Q4_K_M.json"));
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn sha256(bytes: &[u8]) -> String {
    hf2coreml::util::sha256_hex(bytes)
}

/// The fixture file and its import, beside the checkpoint it was made from.
struct Imported {
    _work: tempfile::TempDir,
    dir: PathBuf,
    want: serde_json::Value,
}

/// How a fixture is made from a tiny model (`q4_k_m_fixture` or `q4_k_m_spm_fixture`).
type Make = fn(TinyModel, &Path) -> std::io::Result<BuiltGguf>;

fn import(arch: &str, model: TinyModel, make: Make) -> Imported {
    let want = recorded(arch);
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let built = make(model, &src).unwrap();
    let file = work.path().join(format!("{arch}-Q4_K_M.gguf"));
    built.writer.write(&file).unwrap();
    assert_eq!(
        sha256(&std::fs::read(&file).unwrap()),
        want["gguf_sha256"].as_str().unwrap(),
        "the {arch} fixture changed: rerun python/testgen/gguf_transformers.py on \
         `cargo run -p hf2coreml-tools --bin gguf_fixture {arch} tests/fixtures/gguf/{arch}-Q4_K_M.gguf`"
    );
    let dir = work.path().join("imported");
    gguf::import(&file, &dir, &ImportOptions::default(), &Silent).unwrap();
    Imported {
        _work: work,
        dir,
        want,
    }
}

/// Every tensor transformers holds is the imported one, rounded to fp16 bit for bit (a tied
/// lm_head is the embedding); nothing is imported that transformers does not hold.
fn same_weights(m: &Imported) {
    let ckpt = Checkpoint::open(&m.dir).unwrap();
    let hashes = m.want["tensors"].as_object().unwrap();
    // Phi-3's fused tensors are read as their parts: stacked again, they are what
    // transformers holds.
    let fused = hf2coreml::arch::fused_tensors(ckpt.spec());
    // LFM2's names as transformers has them (`feed_forward.w1`) and as the pipeline knows
    // them (`mlp.gate_proj`).
    let architecture = ckpt.spec().architecture;
    let f16_of = |name: &str| -> Vec<f16> {
        let name = hf2coreml::arch::canonical_name(architecture, name);
        let name = name.as_str();
        if let Some(f) = fused.iter().find(|f| f.name == name) {
            return f
                .parts
                .iter()
                .flat_map(|(id, _)| ckpt.tensor(&id.hf_name()).unwrap().to_f16())
                .collect();
        }
        match ckpt.tensor(name) {
            Ok(t) => t.to_f16(),
            Err(_) if name == "lm_head.weight" && ckpt.spec().tie_word_embeddings => {
                ckpt.tensor("model.embed_tokens.weight").unwrap().to_f16()
            }
            Err(e) => panic!("{name}: {e}"),
        }
    };
    for (name, hash) in hashes {
        let bytes: Vec<u8> = f16_of(name).iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(&sha256(&bytes), hash.as_str().unwrap(), "{name}");
    }
    for name in ckpt.tensor_names() {
        let stored_as = fused
            .iter()
            .find(|f| f.parts.iter().any(|(id, _)| id.hf_name() == name))
            .map_or(name, |f| f.name.as_str());
        let stored_as = hf2coreml::arch::stored_name(architecture, stored_as);
        assert!(
            hashes.contains_key(&stored_as),
            "{name} is not in transformers' model"
        );
    }
}

/// transformers' ids of the recorded texts from the imported tokenizer.json: without special
/// tokens, with them (BOS/EOS as the file asks), a text spelling the specials, runs of
/// whitespace beside HTML tags (Gemma's user-defined pieces); and the ids decoded back to text.
fn same_ids(m: &Imported) {
    let tok = tokenizers::Tokenizer::from_file(m.dir.join("tokenizer.json")).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        let v = m.want[key].as_array().unwrap();
        v.iter().map(|v| v.as_u64().unwrap() as u32).collect()
    };
    let text = m.want["text"].as_str().unwrap();
    let specials = m.want["specials"].as_str().unwrap();
    let whitespace = m.want["whitespace"].as_str().unwrap();
    for (t, add, key) in [
        (text, false, "ids"),
        (text, true, "ids_with_specials"),
        (specials, false, "specials_ids"),
        (whitespace, false, "whitespace_ids"),
    ] {
        let got = tok.encode(t, add).unwrap().get_ids().to_vec();
        assert_eq!(got, ids(key), "{key}: ids of {t:?}");
    }
    for (key, decoded) in [("ids", "decoded"), ("whitespace_ids", "whitespace_decoded")] {
        let got = tok.decode(&ids(key), false).unwrap();
        assert_eq!(got, m.want[decoded].as_str().unwrap(), "{key} decoded");
    }
}

fn logits(m: &Imported) -> (Vec<u32>, Vec<Vec<f32>>) {
    use crate::support::json;
    (json::ids(&m.want["tokens"]), json::rows(&m.want["logits"]))
}

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// transformers' float32 logits of the GGUF's weights (rounded to fp16, as the import holds
/// them) against the import's float reference (within 1e-4 of the largest logit, as the
/// architectures' fixtures hold it), then its fp16 package stepped by the interpreter (KL within
/// fp16 rounding, the same argmax).
fn same_logits(m: &Imported) {
    let (tokens, want) = logits(m);
    let ckpt = Checkpoint::open(&m.dir).unwrap();
    let reference = Reference::load(&ckpt).unwrap().logits_all(&tokens).unwrap();
    let worst = (0..tokens.len())
        .map(|i| max_diff(&reference[i], &want[i]))
        .fold(0f32, f32::max);
    let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!("reference vs transformers: max |Δlogit| {worst} (largest |logit| {scale})");
    assert!(worst <= 1e-4 * scale, "reference: max |Δlogit| {worst}");

    let work = tempfile::tempdir().unwrap();
    let pkg = work.path().join("m.mlpackage");
    let s = 32usize;
    convert(&m.dir, &pkg)
        .args(["--max-seq-len", &s.to_string(), "--keep-fp16", "*", "-q"])
        .ok();
    let package = Package::load(&pkg, Options::default()).unwrap();
    let v = package.contract().vocab_size;
    let rows = package_logits(package, &tokens);
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    let (mut worst, mut kl) = (0f32, 0f64);
    for (p, row) in rows.iter().enumerate() {
        let got = &row[..v];
        worst = worst.max(max_diff(got, &want[p]));
        kl += kl_divergence(&want[p], got);
        assert_eq!(argmax(got), argmax(&want[p]), "argmax at position {p}");
    }
    let kl = kl / tokens.len() as f64;
    eprintln!("fp16 package vs transformers: KL {kl:e}, max |Δlogit| {worst}");
    assert!(kl <= PACKAGE_KL_TOL, "package: KL {kl}");
}

/// Every position's logits of `tokens` fed one by one to `package` by the generator, which
/// carries the KV cache and a hybrid model's recurrent state.
fn package_logits(package: Package, tokens: &[u32]) -> Vec<Vec<f32>> {
    use hf2coreml::runtime::generate::{GenerateOptions, Generator};
    let mut g = Generator::new(package).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 0,
        record_logits: true,
        ..Default::default()
    };
    let gen = g.generate(tokens, &opts, &mut |_| Ok(())).unwrap();
    let rows = gen.logits.unwrap();
    assert_eq!(rows.rows(), tokens.len());
    (0..rows.rows())
        .map(|t| rows.row(t).unwrap().to_vec())
        .collect()
}

/// Mean KL(transformers ‖ fp16 package) allowed. Measured over the 24 positions: 5e-7 - 2.3e-6
/// for the attention-only fixtures (gemma3 the largest, max |Δlogit| 0.010), 2.2e-6 for lfm2
/// and 1.5e-5 for qwen3_5 (max |Δlogit| 0.027: its DeltaNet state is carried in fp16); a wrong
/// op or a misread hyperparameter lands above 1e-2.
const PACKAGE_KL_TOL: f64 = 1e-4;

/// KL(p ‖ q) of the softmaxes of two logit rows.
fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let log_softmax = |x: &[f32]| -> Vec<f64> {
        let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let z = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        x.iter().map(|&v| v as f64 - m - z).collect()
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

fn check(arch: &str, model: TinyModel, make: Make) {
    let m = import(arch, model, make);
    same_weights(&m);
    same_ids(&m);
    if available(&[Need::Python]) {
        same_logits(&m);
    }
}

#[test]
fn qwen3_gguf_imports_as_transformers_reads_it() {
    check("qwen3", TinyModel::qwen3(), q4_k_m_fixture);
}

#[test]
fn llama_gguf_imports_as_transformers_reads_it() {
    check("llama", TinyModel::llama(), q4_k_m_fixture);
}

#[test]
fn qwen2_gguf_imports_as_transformers_reads_it() {
    check("qwen2", TinyModel::qwen2(), q4_k_m_fixture);
}

/// Llama 2 and Mistral files: a SentencePiece vocabulary (scores, byte pieces, no merges).
#[test]
fn llama_sentencepiece_gguf_imports_as_transformers_reads_it() {
    check("llama-spm", TinyModel::llama(), q4_k_m_spm_fixture);
}

/// Phi-3: q/k/v and gate/up stored fused (`attn_qkv`, `ffn_up`), kept fused as transformers
/// keeps them (`qkv_proj`, `gate_up_proj`). (transformers drops partial rotary and LongRoPE
/// from phi3 files: those are held to transformers through tests/it/gguf/roundtrip.rs.)
#[test]
fn phi3_gguf_imports_as_transformers_reads_it() {
    check("phi3", TinyModel::phi3(), q4_k_m_fixture);
}

/// LFM2: convolution blocks (per-block KV heads of 0) between attention blocks, the final
/// norm as `token_embd_norm`, the taps squeezed to [C, K], the feed-forward width already
/// adjusted; transformers' names (`feed_forward.w1`, `conv.conv`, ...).
#[test]
fn lfm2_gguf_imports_as_transformers_reads_it() {
    check("lfm2", TinyModel::lfm2(), q4_k_m_fixture);
}

/// Qwen3.5: Gated DeltaNet blocks with 2 key heads of 3 value heads each (the value heads
/// stored tiled, an order that is not its own inverse), `ssm_a` as −exp(A_log), norms as 1 + w
/// but the gated output norm, taps squeezed; the attention block fourth, as
/// `full_attention_interval` says.
#[test]
fn qwen3_5_gguf_imports_as_transformers_reads_it() {
    check("qwen3_5", TinyModel::qwen3_5(), q4_k_m_fixture);
}

/// Gemma 3: four norms a block stored as 1 + w, windowed blocks with a global sixth, Gemma's
/// SentencePiece vocabulary (pieces ranked by position, whitespace pieces spelled with spaces).
#[test]
fn gemma3_gguf_imports_as_transformers_reads_it() {
    check("gemma3", TinyModel::gemma3(), q4_k_m_spm_fixture);
}
