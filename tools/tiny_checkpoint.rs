//! Write a random tiny checkpoint (GQA, tied embeddings) to the directory given: a Llama, or
//! the Qwen2 or Mistral fixture when named. Used by `make demo` before a real model is at hand,
//! and handy for trying the commands.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: tiny_checkpoint OUT_DIR [llama|qwen2|mistral]";
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().ok_or(usage)?);
    let model = match args.next().as_deref() {
        None | Some("llama") => hf2coreml_testkit::TinyModel::llama(),
        Some("qwen2") => hf2coreml_testkit::TinyModel::qwen2(),
        Some("mistral") => hf2coreml_testkit::TinyModel::mistral(),
        Some(_) => return Err(usage.into()),
    };
    std::fs::create_dir_all(&dir)?;
    model.write(&dir)?;
    println!(
        "wrote a tiny {} checkpoint to {}",
        model.architecture.model_type(),
        dir.display()
    );
    Ok(())
}
