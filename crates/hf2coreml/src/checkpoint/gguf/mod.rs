//! GGUF (llama.cpp) files → Hugging Face checkpoints.
//!
//! [`import`] reads a `llama`, `qwen2`, `qwen3`, `gemma3`, `phi3`, `smollm3`, `lfm2` or `qwen35`
//! GGUF ([`hybrid`]: the last two's own keys, names and transforms), dequantizes
//! every tensor (the legacy, K and IQ4 quant types: [`dequant`]) into an fp16
//! `model.safetensors` with llama.cpp's q/k row permutation undone where its converter applied
//! it (llama and smollm3), and writes
//! config.json, generation_config.json and a tokenizer rebuilt from the GGUF vocabulary. Everything about the input is checked before the output directory is created,
//! and the output appears under its name only when complete ([`AtomicDir`]).

pub mod cache;
pub use hf2coreml_numerics::dequant;
mod gguf_error;
pub mod header;
mod hparams;
pub mod hybrid;
mod metadata_keys;
pub mod reader;
pub mod spm;
pub mod tensor_map;
mod tensor_types;
pub mod tokenizer;

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use gguf_error::{GgufError, SUPPORTED_ARCHITECTURES};
pub use hparams::{architecture, GgufHParams, LongRope, ROPE_FACTORS};
pub use hybrid::Hybrid;
pub use metadata_keys::SpecialIds;
pub use reader::{GgufFile, GgufTensor};
pub use tensor_map::{hf_tensor_name, permute_rows, unpermute_rows, TensorPlan};
pub use tensor_types::{supported_types_list, type_name, SUPPORTED_TYPES};
pub use tokenizer::{GgufTokenizer, SUPPORTED_PRE};

use hparams::TRANSFORMERS_VERSION;

use crate::fsutil::AtomicDir;
use crate::progress::Progress;

/// Check that the file holds exactly the tensors `hp` implies, with the right shapes and
/// dequantizable types.
pub fn plan_tensors(g: &GgufFile, hp: &GgufHParams) -> Result<Vec<TensorPlan>, GgufError> {
    let plan = plan_tensors_unchecked(g, hp)?;
    for p in &plan {
        let Some(t) = g.tensor(&p.gguf_name) else {
            continue;
        };
        if t.dtype.is_none() {
            return Err(GgufError::UnsupportedTensorType {
                path: g.path().to_path_buf(),
                tensor: t.name.clone(),
                dtype: t.type_name(),
            });
        }
    }
    Ok(plan)
}

/// [`plan_tensors`] without the type check (what a header-only summary needs).
pub fn plan_tensors_unchecked(
    g: &GgufFile,
    hp: &GgufHParams,
) -> Result<Vec<TensorPlan>, GgufError> {
    // A hybrid's tensors are the ones its config.json describes (block kinds, DeltaNet sizes).
    let plan = match &hp.hybrid {
        Some(_) => hybrid::expected(&hp.spec(g)?),
        None => hp.expected(),
    };
    for p in &plan {
        let t = g.tensor(&p.gguf_name).ok_or_else(|| GgufError::Tensor {
            path: g.path().to_path_buf(),
            tensor: p.gguf_name.clone(),
            message: "missing".into(),
        })?;
        if t.shape != p.gguf_shape() {
            return Err(GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: p.gguf_name.clone(),
                message: format!("shape {:?}, expected {:?}", t.shape, p.gguf_shape()),
            });
        }
    }
    let extra: Vec<&str> = g
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !plan.iter().any(|p| p.gguf_name == *n))
        .filter(|n| hp.long_rope.is_none() || !ROPE_FACTORS.contains(n))
        .filter(|n| !hparams::is_mtp_tensor(hp, n))
        .collect();
    if let Some(first) = extra.first() {
        let message = if *first == "rope_freqs.weight" {
            "per-frequency rope factors (Llama 3.1 style) are not supported".to_string()
        } else {
            format!(
                "not part of a {}-layer {} ({} unexpected tensor(s): {})",
                hp.layers,
                hp.arch,
                extra.len(),
                extra.iter().take(5).copied().collect::<Vec<_>>().join(", ")
            )
        };
        return Err(GgufError::Tensor {
            path: g.path().to_path_buf(),
            tensor: first.to_string(),
            message,
        });
    }
    Ok(plan)
}

/// True when `path` is a file starting with the GGUF magic (for commands that accept either
/// a checkpoint directory or a GGUF file).
pub fn is_gguf_file(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    crate::fsutil::open_input(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Options of [`import`].
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// Replace an existing output directory.
    pub force: bool,
}

/// What [`import`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ImportReport {
    pub source: PathBuf,
    pub output: PathBuf,
    pub hparams: GgufHParams,
    pub parameters: u64,
    pub tensors: usize,
    /// GGUF tensor type → number of tensors of that type.
    pub tensor_types: BTreeMap<String, usize>,
    pub pre_tokenizer: String,
    pub tokenizer_vocab: usize,
    pub safetensors_bytes: u64,
}

/// Import the GGUF at `src` as a Hugging Face checkpoint directory `dest`.
pub fn import(
    src: &Path,
    dest: &Path,
    opts: &ImportOptions,
    progress: &dyn Progress,
) -> Result<ImportReport, GgufError> {
    let mut g = GgufFile::open(src)?;
    let mut hp = GgufHParams::from_gguf(&g)?;
    hp.read_rope_factors(&mut g)?;
    let plan = plan_tensors(&g, &hp)?;
    let tok = tokenizer::build(&g)?;
    if tok.vocab_size > hp.vocab {
        return Err(GgufError::Tokenizer {
            path: src.to_path_buf(),
            message: format!(
                "{} tokens but the embedding has only {} rows",
                tok.vocab_size, hp.vocab
            ),
        });
    }
    // The config.json written below is read back as any checkpoint's is: a value that makes
    // no model (a RoPE factor whose angles overflow, ...) is refused here, naming its key.
    let config = hp.config_json(tok.special_ids());
    hp.spec_of(&g, &config)?;

    let out = AtomicDir::new(dest, opts.force).map_err(|source| {
        if source.kind() == std::io::ErrorKind::AlreadyExists {
            GgufError::OutputExists {
                path: dest.to_path_buf(),
            }
        } else {
            GgufError::Io {
                path: dest.to_path_buf(),
                source,
            }
        }
    })?;
    let dir = out.path().to_path_buf();
    let st_path = dir.join("model.safetensors");
    let (parameters, tensor_types, safetensors_bytes) = write_weights(
        &mut g,
        &plan,
        &st_path,
        &dest.join("model.safetensors"),
        progress,
    )?;

    let json = |v: &serde_json::Value| {
        let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
        s.push('\n');
        s
    };
    let files = [
        ("config.json", json(&config)),
        ("generation_config.json", json(&generation_config(&tok))),
        ("tokenizer_config.json", json(&tok.config_json(hp.context))),
        (
            "special_tokens_map.json",
            json(&tok.special_tokens_map_json()),
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.join(name), text).map_err(|source| GgufError::Io {
            path: dest.join(name),
            source,
        })?;
    }
    let tok_path = dir.join("tokenizer.json");
    tok.tokenizer
        .save(&tok_path, false)
        .map_err(|e| GgufError::Tokenizer {
            path: dest.join("tokenizer.json"),
            message: format!("cannot write: {e}"),
        })?;
    let output = out.commit().map_err(|source| GgufError::Io {
        path: dest.to_path_buf(),
        source,
    })?;
    Ok(ImportReport {
        source: src.to_path_buf(),
        output,
        parameters,
        tensors: plan.len(),
        tensor_types,
        pre_tokenizer: tok.pre.clone(),
        tokenizer_vocab: tok.vocab_size,
        safetensors_bytes,
        hparams: hp,
    })
}

fn generation_config(tok: &GgufTokenizer) -> serde_json::Value {
    let id = |t: &Option<(u32, String)>| t.as_ref().map(|(i, _)| *i);
    serde_json::json!({
        "bos_token_id": id(&tok.bos),
        "eos_token_id": id(&tok.eos),
        "pad_token_id": id(&tok.pad),
        "transformers_version": TRANSFORMERS_VERSION,
    })
}

/// Stream every planned tensor, dequantized and in fp16, into one safetensors file.
/// Returns (parameters, tensor types seen, bytes written).
fn write_weights(
    g: &mut GgufFile,
    plan: &[TensorPlan],
    path: &Path,
    shown_as: &Path,
    progress: &dyn Progress,
) -> Result<(u64, BTreeMap<String, usize>, u64), GgufError> {
    let io_err = |source| GgufError::Io {
        path: shown_as.to_path_buf(),
        source,
    };
    let entries: Vec<(&str, &[usize])> = plan
        .iter()
        .map(|p| (p.hf_name.as_str(), p.shape.as_slice()))
        .collect();
    let header = tensor_map::safetensors_header(&entries);
    let file = std::fs::File::create(path).map_err(io_err)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&header).map_err(io_err)?;
    let mut written = header.len() as u64;
    let mut parameters = 0u64;
    let mut types = BTreeMap::new();
    progress.begin("importing", plan.len() as u64);
    for p in plan {
        let t = g
            .tensor(&p.gguf_name)
            .cloned()
            .ok_or_else(|| GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: p.gguf_name.clone(),
                message: "missing".into(),
            })?;
        progress.working_on(&p.gguf_name);
        *types.entry(t.type_name()).or_insert(0) += 1;
        let stored = g.read_f32(&t)?;
        let values = transform(g, p, stored)?;
        let bytes = tensor_map::to_f16_bytes(&values).map_err(|i| GgufError::Tensor {
            path: g.path().to_path_buf(),
            tensor: p.gguf_name.clone(),
            message: format!(
                "element {i} ({}) is outside the fp16 range",
                values.get(i).copied().unwrap_or(f32::NAN)
            ),
        })?;
        w.write_all(&bytes).map_err(io_err)?;
        written += bytes.len() as u64;
        parameters += values.len() as u64;
        progress.advance(1);
    }
    progress.end();
    let file = w.into_inner().map_err(|e| io_err(e.into_error()))?;
    file.sync_all().map_err(io_err)?;
    Ok((parameters, types, written))
}

/// `values` (a tensor as stored) in the Hugging Face layout: llama.cpp's converter's transforms
/// undone.
fn transform(g: &GgufFile, p: &TensorPlan, mut values: Vec<f32>) -> Result<Vec<f32>, GgufError> {
    if let Some(heads) = p.unpermute_heads {
        values = unpermute_rows(&values, p.shape[0], p.shape[1], heads);
    }
    if p.minus_one {
        values.iter_mut().for_each(|v| *v -= 1.0);
    }
    if p.negated_exp {
        if let Some(i) = values.iter().position(|v| !(*v < 0.0 && v.is_finite())) {
            return Err(GgufError::Tensor {
                path: g.path().to_path_buf(),
                tensor: p.gguf_name.clone(),
                message: format!(
                    "element {i} ({}) is not a negative number: the file stores A = −exp(A_log)",
                    values[i]
                ),
            });
        }
        values.iter_mut().for_each(|v| *v = (-*v).ln());
    }
    if let Some(tiled) = &p.tiled_heads {
        // The plan's shapes were checked against the file: the axis holds every value head.
        let shape = p.gguf_shape();
        let rows = shape.first().copied().unwrap_or(1);
        let cols = shape.iter().skip(1).product::<usize>();
        values = tiled.untile(&values, rows, cols);
    }
    Ok(values)
}
