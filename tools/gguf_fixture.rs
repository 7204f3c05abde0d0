//! Write the K-quant GGUF fixture of one architecture (`gguf_fixture ARCH OUT.gguf`, ARCH one
//! of llama, llama-spm (a SentencePiece vocabulary), qwen2, qwen3, gemma3, phi3, lfm2, qwen3_5)
//! exactly as
//! tests/it/gguf/transformers.rs builds it, for python/testgen/gguf_transformers.py to read
//! with transformers.

use hf2coreml_testkit::gguf::{q4_k_m_fixture, q4_k_m_spm_fixture};
use hf2coreml_testkit::TinyModel;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, arch, output] = args.as_slice() else {
        return Err(
            "usage: gguf_fixture llama|llama-spm|qwen2|qwen3|gemma3|phi3|lfm2|qwen3_5 OUT.gguf"
                .into(),
        );
    };
    let dir = tempfile::tempdir()?;
    let built = match arch.as_str() {
        "llama" => q4_k_m_fixture(TinyModel::llama(), dir.path())?,
        "llama-spm" => q4_k_m_spm_fixture(TinyModel::llama(), dir.path())?,
        "qwen2" => q4_k_m_fixture(TinyModel::qwen2(), dir.path())?,
        "qwen3" => q4_k_m_fixture(TinyModel::qwen3(), dir.path())?,
        "gemma3" => q4_k_m_spm_fixture(TinyModel::gemma3(), dir.path())?,
        "phi3" => q4_k_m_fixture(TinyModel::phi3(), dir.path())?,
        "lfm2" => q4_k_m_fixture(TinyModel::lfm2(), dir.path())?,
        "qwen3_5" => q4_k_m_fixture(TinyModel::qwen3_5(), dir.path())?,
        other => {
            let known = "llama, llama-spm, qwen2, qwen3, gemma3, phi3, lfm2, qwen3_5";
            return Err(format!("unknown architecture {other} ({known})").into());
        }
    };
    built.writer.write(std::path::Path::new(output))?;
    println!("wrote {output}");
    Ok(())
}
