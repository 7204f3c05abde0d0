//! What the fuzz targets (fuzz/, `make fuzz`) do with one input, here so that the normal test
//! suite replays every input that ever crashed a target (tests/fuzz_regressions.rs) through
//! exactly the same code. Each function feeds hostile bytes to a reader and walks whatever it
//! accepts; returning at all is the property under test (errors are expected, panics, hangs and
//! huge allocations are bugs).

use std::path::Path;

use crate::arch::ModelSpec;
use crate::checkpoint::gguf::{self, GgufFile, LlamaHParams};
use crate::checkpoint::{parse_safetensors, Checkpoint};
use crate::mlpackage::MlPackage;
use crate::runtime::interp::{Options, Program};
use crate::testing::mlpackage as fixture;

/// Tensors larger than this are not dequantized by the GGUF target (the reader's bounds are
/// what is under test, not candle's dequantization speed).
const MAX_FUZZ_TENSOR_BYTES: u64 = 1 << 20;

/// Split `data` into a length-prefixed head (u16 little-endian length) and the rest.
fn split_prefixed(data: &[u8]) -> (&[u8], &[u8]) {
    if data.len() < 2 {
        return (data, &[]);
    }
    let n = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    (&data[2..2 + n], &data[2 + n..])
}

/// Build a checkpoint input: config.json text and a safetensors file.
pub fn checkpoint_input(config: &str, safetensors: &[u8]) -> Vec<u8> {
    let n = config.len().min(u16::MAX as usize);
    let mut v = (n as u16).to_le_bytes().to_vec();
    v.extend_from_slice(&config.as_bytes()[..n]);
    v.extend_from_slice(safetensors);
    v
}

/// Checkpoint target: `data` is config.json (u16-length-prefixed) then a model.safetensors.
/// Both are parsed from memory, then written into `scratch` (a directory, reused) and opened as
/// a checkpoint: expected tensors checked, every weight scanned for NaN/Inf and converted.
pub fn checkpoint(data: &[u8], scratch: &Path) {
    let (config, weights) = split_prefixed(data);
    let config = String::from_utf8_lossy(config);
    let _ = ModelSpec::from_config_str(&config);
    let _ = parse_safetensors(Path::new("fuzz.safetensors"), weights);
    if std::fs::create_dir_all(scratch).is_err()
        || std::fs::write(scratch.join("config.json"), config.as_bytes()).is_err()
        || std::fs::write(scratch.join("model.safetensors"), weights).is_err()
    {
        return;
    }
    let Ok(ckpt) = Checkpoint::open(scratch) else {
        return;
    };
    let _ = ckpt.check_finite();
    for slot in ckpt.slots() {
        if let Ok(t) = ckpt.tensor(&slot.name) {
            let _ = t.to_f16();
        }
    }
}

/// GGUF target: `data` is a GGUF file. The header is read from memory, then the llama
/// hyperparameters, the tokenizer and the tensor plan, and every small tensor is dequantized.
pub fn gguf(data: &[u8]) {
    let Ok(mut g) = GgufFile::from_bytes(Path::new("fuzz.gguf"), data.to_vec()) else {
        return;
    };
    let tensors = g.tensors().to_vec();
    for t in tensors
        .iter()
        .filter(|t| t.n_bytes <= MAX_FUZZ_TENSOR_BYTES)
    {
        let _ = g.read_f32(t);
    }
    let _ = gguf::tokenizer::build(&g);
    if let Ok(hp) = LlamaHParams::from_gguf(&g) {
        let _ = gguf::plan_tensors(&g, &hp);
    }
}

/// Build an mlpackage input: model.mlmodel bytes then weight.bin bytes.
pub fn mlpackage_input(model: &[u8], weights: &[u8]) -> Vec<u8> {
    let mut v = (model.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(model);
    v.extend_from_slice(weights);
    v
}

/// .mlpackage target: `data` is model.mlmodel (u32-length-prefixed) then weight.bin, written
/// under `scratch` (a directory, reused) with the standard Manifest.json. The package is
/// opened, its description and main function read, and its program compiled (every constant
/// decoded, every argument resolved).
pub fn mlpackage(data: &[u8], scratch: &Path) {
    let (model, weights) = if data.len() < 4 {
        (data, &[][..])
    } else {
        let n =
            (u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize).min(data.len() - 4);
        (&data[4..4 + n], &data[4 + n..])
    };
    let dir = scratch.join("fuzz.mlpackage");
    if fixture::write_package(&dir, fixture::MANIFEST, model, weights).is_err() {
        return;
    }
    let Ok(pkg) = MlPackage::open(&dir) else {
        return;
    };
    let _ = pkg.description();
    let _ = pkg.main_function();
    let _ = Program::load(&pkg, Options::default());
}

/// Write seed corpora for the three targets into `out/{checkpoint,gguf,mlpackage}/`, built from
/// the in-code fixtures: small checkpoints of each architecture, GGUF files of each supported
/// matrix type, the fixture program.
pub fn write_seeds(out: &Path) -> std::io::Result<usize> {
    use crate::testing::gguf::{FixtureType, TinyGguf};
    use crate::testing::TinyModel;
    use prost::Message;

    let mut n = 0;
    let mut write = |target: &str, name: String, bytes: &[u8]| -> std::io::Result<()> {
        let dir = out.join(target);
        std::fs::create_dir_all(&dir)?;
        n += 1;
        std::fs::write(dir.join(name), bytes)
    };
    // One layer and a small vocabulary keep each seed a few kB.
    for (i, m) in [TinyModel::llama(), TinyModel::qwen2(), TinyModel::mistral()]
        .into_iter()
        .enumerate()
    {
        let m = TinyModel {
            layers: 1,
            hidden: 16,
            intermediate: 32,
            heads: 2,
            kv_heads: 1,
            vocab: 8,
            head_dim: m.head_dim.map(|_| 8),
            shards: 1,
            ..m
        };
        let dir = tempfile::tempdir()?;
        m.write(dir.path())?;
        let st = std::fs::read(dir.path().join("model.safetensors"))?;
        let config = m.config_json().to_string();
        write(
            "checkpoint",
            format!("seed-{i}"),
            &checkpoint_input(&config, &st),
        )?;
    }
    for (i, ty) in [
        FixtureType::Q4_1,
        FixtureType::Q4_0,
        FixtureType::Q8_0,
        FixtureType::F16,
    ]
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
        write("gguf", format!("seed-{i}"), &g.build().writer.to_bytes())?;
    }
    let (model, weights) = fixture::tiny_program();
    write(
        "mlpackage",
        "seed-0".into(),
        &mlpackage_input(&model.encode_to_vec(), &weights),
    )?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::gguf::TinyGguf;
    use crate::testing::TinyModel;
    use prost::Message;

    #[test]
    fn valid_inputs_go_all_the_way() {
        let scratch = tempfile::tempdir().unwrap();
        let m = TinyModel::llama();
        let dir = m.write_temp().unwrap();
        let input = checkpoint_input(
            &m.config_json().to_string(),
            &std::fs::read(dir.path().join("model.safetensors")).unwrap(),
        );
        checkpoint(&input, scratch.path());
        assert!(Checkpoint::open(scratch.path()).is_ok());

        gguf(&TinyGguf::llama().build().writer.to_bytes());

        let (model, weights) = fixture::tiny_program();
        mlpackage(
            &mlpackage_input(&model.encode_to_vec(), &weights),
            scratch.path(),
        );
        let pkg = MlPackage::open(&scratch.path().join("fuzz.mlpackage")).unwrap();
        assert!(Program::load(&pkg, Options::default()).is_ok());
    }

    #[test]
    fn seeds_are_accepted_by_their_readers() {
        let out = tempfile::tempdir().unwrap();
        assert_eq!(write_seeds(out.path()).unwrap(), 8);
        let scratch = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(out.path().join("checkpoint")).unwrap() {
            let data = std::fs::read(e.unwrap().path()).unwrap();
            let (config, weights) = split_prefixed(&data);
            let spec = ModelSpec::from_config_str(std::str::from_utf8(config).unwrap());
            assert!(spec.is_ok(), "{spec:?}");
            assert!(parse_safetensors(Path::new("seed"), weights).is_ok());
            checkpoint(&data, scratch.path());
            assert!(Checkpoint::open(scratch.path()).is_ok());
        }
        for e in std::fs::read_dir(out.path().join("gguf")).unwrap() {
            let data = std::fs::read(e.unwrap().path()).unwrap();
            let g = GgufFile::from_bytes(Path::new("seed"), data).unwrap();
            assert!(LlamaHParams::from_gguf(&g).is_ok());
        }
    }
}
