//! Seed corpora for the fuzz targets, built from the project's in-code fixtures:
//! `seeds OUT_DIR` writes OUT_DIR/{checkpoint,gguf,mlpackage}/seed-*.

use std::path::Path;

use hf2coreml::checkpoint::gguf::fixture::{FixtureType, TinyGguf};
use hf2coreml::fuzzing::{checkpoint_input, mlpackage_input};
use hf2coreml::mlpackage::fixture;
use hf2coreml::testing::TinyModel;
use prost::Message;

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args()
        .nth(1)
        .ok_or("usage: seeds OUT_DIR")?;
    let out = Path::new(&out);

    // Checkpoints: the three fixture architectures, shrunk to one layer and a small vocabulary
    // so a seed is a few kB.
    for (i, m) in [TinyModel::llama(), TinyModel::qwen2(), TinyModel::mistral()]
        .into_iter()
        .enumerate()
    {
        let m = TinyModel {
            layers: 1,
            hidden: 16,
            intermediate: 32,
            vocab: 8,
            head_dim: m.head_dim.map(|_| 8),
            shards: 1,
            ..m
        };
        let dir = m.write_temp()?;
        let st = std::fs::read(dir.path().join("model.safetensors"))?;
        let input = checkpoint_input(&m.config_json().to_string(), &st);
        write(&out.join("checkpoint"), &format!("seed-{i}"), &input)?;
    }

    // GGUF: the importer's fixture, with each supported matrix type.
    for (i, ty) in [FixtureType::Q4_1, FixtureType::Q4_0, FixtureType::Q8_0, FixtureType::F16]
        .into_iter()
        .enumerate()
    {
        let g = TinyGguf {
            layers: 1,
            hidden: 32,
            intermediate: 64,
            matrix_type: ty,
            ..TinyGguf::llama()
        };
        write(&out.join("gguf"), &format!("seed-{i}"), &g.build().writer.to_bytes())?;
    }

    // .mlpackage: the fixture program.
    let (model, weights) = fixture::tiny_program();
    write(
        &out.join("mlpackage"),
        "seed-0",
        &mlpackage_input(&model.encode_to_vec(), &weights),
    )?;
    Ok(())
}
