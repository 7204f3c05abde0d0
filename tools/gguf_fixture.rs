//! Write the K-quant GGUF fixture of one architecture (`gguf_fixture ARCH OUT.gguf`, ARCH one
//! of llama, qwen2, qwen3) exactly as tests/it/gguf/transformers.rs builds it, for
//! python/testgen/gguf_transformers.py to read with transformers.

use hf2coreml::testing::gguf::q4_k_m_fixture;
use hf2coreml::testing::TinyModel;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, arch, output] = args.as_slice() else {
        return Err("usage: gguf_fixture llama|qwen2|qwen3 OUT.gguf".into());
    };
    let model = match arch.as_str() {
        "llama" => TinyModel::llama(),
        "qwen2" => TinyModel::qwen2(),
        "qwen3" => TinyModel::qwen3(),
        other => return Err(format!("unknown architecture {other} (llama, qwen2, qwen3)").into()),
    };
    let dir = tempfile::tempdir()?;
    let built = q4_k_m_fixture(model, dir.path())?;
    built.writer.write(std::path::Path::new(output))?;
    println!("wrote {output}");
    Ok(())
}
