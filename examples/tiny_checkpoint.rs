//! Write a random tiny Llama checkpoint (GQA, tied embeddings) to the directory given.
//! Used by `make demo` before a real model is at hand, and handy for trying the commands.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: tiny_checkpoint OUT_DIR")?;
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    hf2coreml::testing::TinyModel::llama().write(&dir)?;
    println!("wrote a tiny Llama checkpoint to {}", dir.display());
    Ok(())
}
