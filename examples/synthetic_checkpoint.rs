//! Write a random Llama checkpoint of a chosen size (bf16, GQA 4:1, tied embeddings) for
//! resource measurements (benches/peak_rss.sh):
//! `synthetic_checkpoint OUT_DIR LAYERS HIDDEN INTERMEDIATE VOCAB`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, layers, hidden, intermediate, vocab] = args.as_slice() else {
        return Err("usage: synthetic_checkpoint OUT_DIR LAYERS HIDDEN INTERMEDIATE VOCAB".into());
    };
    let hidden: usize = hidden.parse()?;
    // 64-wide heads, four query heads per key/value head, as in most current Llamas.
    let heads = hidden / 64;
    let m = hf2coreml::testing::TinyModel {
        layers: layers.parse()?,
        hidden,
        intermediate: intermediate.parse()?,
        heads,
        kv_heads: (heads / 4).max(1),
        vocab: vocab.parse()?,
        scale: 0.02,
        ..hf2coreml::testing::TinyModel::llama()
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    m.write(&dir)?;
    let bytes: u64 = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!("wrote {} ({bytes} bytes)", dir.display());
    Ok(())
}
