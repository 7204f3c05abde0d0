//! What the fuzz targets (fuzz/, `make fuzz`) do with one input, here so that the normal test
//! suite replays every input that ever crashed a target (tests/it/fuzz/mod.rs) through
//! exactly the same code. Each function feeds hostile bytes to a reader and walks whatever it
//! accepts; returning at all is the property under test (errors are expected, panics, hangs and
//! huge allocations are bugs). Each returns whether the input was accepted all the way, so the
//! regression test can also check that every valid seed still is.

use std::path::Path;

use crate::mlpackage as fixture;
use hf2coreml::arch::ModelSpec;
use hf2coreml::checkpoint::gguf::{self, GgufFile, GgufHParams};
use hf2coreml::checkpoint::{parse_safetensors, Checkpoint};
use hf2coreml::mlpackage::MlPackage;
use hf2coreml::runtime::interp::{Options, Program};

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
pub fn checkpoint(data: &[u8], scratch: &Path) -> bool {
    let (config, weights) = split_prefixed(data);
    let config = String::from_utf8_lossy(config);
    let mut ok = ModelSpec::from_config_str(&config).is_ok();
    ok &= parse_safetensors(Path::new("fuzz.safetensors"), weights).is_ok();
    if std::fs::create_dir_all(scratch).is_err()
        || std::fs::write(scratch.join("config.json"), config.as_bytes()).is_err()
        || std::fs::write(scratch.join("model.safetensors"), weights).is_err()
    {
        return false;
    }
    let Ok(ckpt) = Checkpoint::open(scratch) else {
        return false;
    };
    ok &= ckpt.check_finite().is_ok();
    for slot in ckpt.slots() {
        ok &= ckpt
            .tensor(&slot.name)
            .is_ok_and(|t| t.to_f16().len() == slot.numel());
    }
    ok
}

/// GGUF target: `data` is a GGUF file. The header is read from memory, then the llama
/// hyperparameters, the tokenizer and the tensor plan, and every small tensor is dequantized.
pub fn gguf(data: &[u8]) -> bool {
    let Ok(mut g) = GgufFile::from_bytes(Path::new("fuzz.gguf"), data.to_vec()) else {
        return false;
    };
    let mut ok = true;
    let tensors = g.tensors().to_vec();
    for t in tensors
        .iter()
        .filter(|t| t.n_bytes <= MAX_FUZZ_TENSOR_BYTES)
    {
        ok &= g.read_f32(t).is_ok();
    }
    ok &= gguf::tokenizer::build(&g).is_ok();
    match GgufHParams::from_gguf(&g) {
        Ok(hp) => ok && gguf::plan_tensors(&g, &hp).is_ok(),
        Err(_) => false,
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
pub fn mlpackage(data: &[u8], scratch: &Path) -> bool {
    let Some(pkg) = open_package(data, scratch) else {
        return false;
    };
    let described = !pkg.description().inputs.is_empty() || pkg.model().description.is_some();
    pkg.main_function().is_ok() && Program::load(&pkg, Options::default()).is_ok() && described
}

/// Split an mlpackage input, write it under `scratch` and open it.
fn open_package(data: &[u8], scratch: &Path) -> Option<MlPackage> {
    let (model, weights) = if data.len() < 4 {
        (data, &[][..])
    } else {
        let n =
            (u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize).min(data.len() - 4);
        (&data[4..4 + n], &data[4 + n..])
    };
    let dir = scratch.join("fuzz.mlpackage");
    fixture::write_package(&dir, fixture::MANIFEST, model, weights).ok()?;
    MlPackage::open(&dir).ok()
}

/// Interpreter target: `data` is an mlpackage input (as for [`mlpackage`]). The program is
/// loaded under small limits (64 MiB for everything live) and run once on inputs of its
/// declared shapes (zeros): the loader's and the kernels' checks are under test, including
/// the refusal of ops whose computed size disagrees with the declared one.
pub fn interp(data: &[u8], scratch: &Path) -> bool {
    use hf2coreml::runtime::interp::limits::Limits;
    use hf2coreml::runtime::interp::{Data, Tensor};
    let Some(pkg) = open_package(data, scratch) else {
        return false;
    };
    let limits = Limits::new(0, 256 << 20);
    let Ok(prog) = Program::load_with(&pkg, Options::default(), limits) else {
        return false;
    };
    let inputs: Vec<(&str, Tensor)> = prog
        .inputs()
        .map(|(name, ty)| {
            let n = ty.shape.iter().product::<usize>();
            let data = if ty.dtype.is_float() {
                Data::F(vec![0.0; n])
            } else {
                Data::I(vec![0; n])
            };
            (name, Tensor::new(ty.dtype, ty.shape.clone(), data))
        })
        .collect();
    prog.run(inputs, None).is_ok()
}

/// Batch-file target: `data` is the text of a batch file (lossily UTF-8). It is parsed and
/// expanded, every export described and its recipe resolved (built-in and inline recipes;
/// recipe files are not read), and the selection by shard and name run.
pub fn batch(data: &[u8]) -> bool {
    use hf2coreml::pipeline::batch::BatchFile;
    let text = String::from_utf8_lossy(data);
    let Ok(file) = BatchFile::parse(Path::new("/fuzz/batch.toml"), &text) else {
        return false;
    };
    let mut ok = true;
    for e in &file.exports {
        ok &= !e.recipe.describe().is_empty();
        if !matches!(e.recipe, hf2coreml::pipeline::batch::RecipeSource::File(_)) {
            ok &= e.recipe.load().is_ok();
        }
    }
    ok
}

/// Write seed corpora for the three targets into `out/{checkpoint,gguf,mlpackage}/`, built from
/// the in-code fixtures: small checkpoints of each architecture, GGUF files of each supported
/// matrix type, the fixture program.
pub fn write_seeds(out: &Path) -> std::io::Result<usize> {
    use crate::gguf::{FixtureType, TinyGguf};
    use crate::TinyModel;
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
    let program = mlpackage_input(&model.encode_to_vec(), &weights);
    write("mlpackage", "seed-0".into(), &program)?;
    write("interp", "seed-0".into(), &program)?;
    for (i, text) in BATCH_SEEDS.iter().enumerate() {
        write("batch", format!("seed-{i}"), text.as_bytes())?;
    }
    Ok(n)
}

/// Batch files the batch target starts from: the documented forms (docs/commands.md: axes,
/// defaults, inline recipes, templates).
pub const BATCH_SEEDS: [&str; 2] = [
    "[[export]]\nmodel = \"m\"\noutput = \"out/{model}-{max_seq_len}.mlpackage\"\nmax_seq_len = [512, 2048]\n",
    "[[export]]\nmodel = \"m\"\noutput = \"o-{recipe}.mlpackage\"\nrecipe = [{ name = \"fp16\", default = \"fp16\" }, { default = { palettize = { nbits = 8 } } }]\n",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::TinyGguf;
    use crate::TinyModel;
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
        assert!(checkpoint(&input, scratch.path()));
        assert!(Checkpoint::open(scratch.path()).is_ok());

        assert!(gguf(&TinyGguf::llama().build().writer.to_bytes()));

        let (model, weights) = fixture::tiny_program();
        assert!(mlpackage(
            &mlpackage_input(&model.encode_to_vec(), &weights),
            scratch.path(),
        ));
        let pkg = MlPackage::open(&scratch.path().join("fuzz.mlpackage")).unwrap();
        assert!(Program::load(&pkg, Options::default()).is_ok());
    }

    #[test]
    fn seeds_are_accepted_by_their_readers() {
        let out = tempfile::tempdir().unwrap();
        assert_eq!(write_seeds(out.path()).unwrap(), 11);
        let scratch = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(out.path().join("checkpoint")).unwrap() {
            let data = std::fs::read(e.unwrap().path()).unwrap();
            let (config, weights) = split_prefixed(&data);
            let spec = ModelSpec::from_config_str(std::str::from_utf8(config).unwrap());
            assert!(spec.is_ok(), "{spec:?}");
            assert!(parse_safetensors(Path::new("seed"), weights).is_ok());
            assert!(checkpoint(&data, scratch.path()));
            assert!(Checkpoint::open(scratch.path()).is_ok());
        }
        for e in std::fs::read_dir(out.path().join("gguf")).unwrap() {
            let data = std::fs::read(e.unwrap().path()).unwrap();
            let g = GgufFile::from_bytes(Path::new("seed"), data).unwrap();
            assert!(GgufHParams::from_gguf(&g).is_ok());
        }
        for target in ["interp", "batch"] {
            for e in std::fs::read_dir(out.path().join(target)).unwrap() {
                let data = std::fs::read(e.unwrap().path()).unwrap();
                let ok = match target {
                    "interp" => interp(&data, scratch.path()),
                    _ => batch(&data),
                };
                assert!(ok, "{target} seed refused");
            }
        }
    }
}
