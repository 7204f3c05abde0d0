//! The float32 reference: a forward pass straight from the checkpoint, independent of our
//! graph builder, that validation compares packages against.
//!
//! The default backend is candle-transformers' own model code (llama, mistral, qwen2), loaded
//! through a VarBuilder over the checkpoint's memory-mapped safetensors. Where candle cannot
//! express a checkpoint exactly, [`Reference::load`] falls back to our own small f32
//! implementation ([`PlainModel`]) and says why ([`Reference::fallback_reason`]):
//! - Llama and Qwen2 in candle derive head_dim as hidden/heads: an explicit, different
//!   `head_dim` needs the fallback;
//! - candle's Llama knows llama3 rope scaling but not linear; its Mistral and Qwen2 know none;
//! - candle's Mistral loads `lm_head.weight` unconditionally (no tied embeddings) and has no
//!   attention biases; its Qwen2 always has them and Llama never does.
//!
//! Sliding-window attention (Mistral, Qwen2 with `use_sliding_window`) is not modelled by
//! either backend: a sequence longer than the window is refused rather than computed wrongly.
//! Gemma 3's sliding blocks are: the plain backend builds their banded masks.

pub mod calibrate;
mod delta;
mod gemma4;
pub mod layerwise;
pub mod plain;
mod primitives;
mod reference_error;

pub use calibrate::{
    calibrate, ActivationStats, CalibrationOptions, Gram, GramSelection, InputSite, LayerStats,
    OpKind, F16_MAX,
};
pub use plain::PlainModel;
pub use reference_error::ReferenceError;

use candle_core::{DType, Device, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, mistral, qwen2};

use crate::arch::{Architecture, ModelSpec, RopeScaling};
use crate::checkpoint::Checkpoint;
use reference_error::{check_tokens, ctx};

/// Which implementation computes the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    CandleLlama,
    CandleMistral,
    CandleQwen2,
    /// Our own f32 implementation ([`PlainModel`]).
    Plain,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::CandleLlama => "candle-transformers llama",
            BackendKind::CandleMistral => "candle-transformers mistral",
            BackendKind::CandleQwen2 => "candle-transformers qwen2",
            BackendKind::Plain => "hf2coreml plain f32",
        }
    }
}

/// Which backend [`Reference::load_with`] should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// candle-transformers when it can express the checkpoint, else the plain implementation.
    Auto,
    /// Always the plain implementation.
    Plain,
}

enum Backend {
    Llama {
        model: llama::Llama,
        config: llama::Config,
        cache: llama::Cache,
    },
    Mistral(mistral::Model),
    Qwen2 {
        model: qwen2::Model,
        lm_head: candle_nn::Linear,
    },
    Plain(Box<PlainModel>),
}

/// A float32 forward pass of a checkpoint with a KV cache.
pub struct Reference {
    spec: ModelSpec,
    backend: Backend,
    kind: BackendKind,
    fallback_reason: Option<String>,
    /// Tokens processed since the last restart (the KV cache length).
    cached: usize,
}

impl std::fmt::Debug for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reference")
            .field("backend", &self.kind)
            .field("cached", &self.cached)
            .finish()
    }
}

/// Why candle-transformers cannot compute this checkpoint exactly, if it cannot.
pub fn candle_limitation(spec: &ModelSpec) -> Option<String> {
    let derived_head_dim = spec.hidden_size / spec.num_attention_heads;
    let explicit_head_dim = !spec.hidden_size.is_multiple_of(spec.num_attention_heads)
        || spec.head_dim != derived_head_dim;
    match spec.architecture {
        Architecture::Llama => {
            if explicit_head_dim {
                return Some(format!(
                    "candle's llama derives head_dim = hidden/heads = {derived_head_dim}, the config says {}",
                    spec.head_dim
                ));
            }
            if matches!(spec.rope_scaling, RopeScaling::Linear { .. }) {
                return Some("candle's llama has no linear rope scaling".into());
            }
            if spec.attention_bias {
                return Some("candle's llama has no attention biases".into());
            }
        }
        Architecture::Mistral => {
            if spec.tie_word_embeddings {
                return Some("candle's mistral has no tied embeddings".into());
            }
            if spec.rope_scaling != RopeScaling::None {
                return Some("candle's mistral has no rope scaling".into());
            }
            if spec.attention_bias {
                return Some("candle's mistral has no attention biases".into());
            }
        }
        Architecture::Qwen3 => {
            return Some(
                "candle's qwen3 is not wired here: the plain forward pass computes it".into(),
            )
        }
        Architecture::Gemma3 => {
            return Some(
                "candle's gemma3 is not wired here: the plain forward pass computes it (with the \
                 sliding blocks' banded masks)"
                    .into(),
            )
        }
        Architecture::SmolLM3 => {
            return Some("candle-transformers has no SmolLM3 (NoPE blocks)".into())
        }
        Architecture::Lfm2 => {
            return Some(
                "candle's lfm2 is not wired here: the plain forward pass computes it (with its \
                 conv blocks' state)"
                    .into(),
            )
        }
        Architecture::Qwen3_5 => {
            return Some(
                "candle-transformers has no Qwen3.5 (Gated DeltaNet): the plain forward pass \
                 computes it"
                    .into(),
            )
        }
        Architecture::Gemma4 => {
            return Some(
                "candle-transformers has no Gemma 4 (per-layer inputs, KV sharing): the plain \
                 forward pass computes it"
                    .into(),
            )
        }
        Architecture::Phi3 => {
            return Some(
                "candle's phi3 reads the fused tensors the checkpoint splits at load: the plain \
                 forward pass computes it"
                    .into(),
            )
        }
        Architecture::Qwen2 => {
            if explicit_head_dim {
                return Some(format!(
                    "candle's qwen2 derives head_dim = hidden/heads = {derived_head_dim}, the config says {}",
                    spec.head_dim
                ));
            }
            if spec.rope_scaling != RopeScaling::None {
                return Some("candle's qwen2 has no rope scaling".into());
            }
            if !spec.attention_bias {
                return Some("candle's qwen2 always loads q/k/v biases".into());
            }
        }
    }
    None
}

/// A VarBuilder backend over our already validated, memory-mapped checkpoint: tensors are
/// widened to the requested dtype from the mapped bytes, and names the checkpoint lacks are
/// candle's `CannotFindTensor` (naming the tensor).
struct CheckpointBackend<'a> {
    ckpt: &'a Checkpoint,
}

impl SimpleBackend for CheckpointBackend<'_> {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("tensor `{name}`"),
                expected: s,
                got: t.shape().clone(),
            });
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let view = self
            .ckpt
            .tensor(name)
            .map_err(|_| candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            })?;
        Tensor::from_vec(view.to_f32(), view.shape, dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.ckpt.contains(name)
    }
}

impl Reference {
    /// Load the checkpoint with candle-transformers where it can express it, else with the
    /// plain implementation.
    pub fn load(ckpt: &Checkpoint) -> Result<Self, ReferenceError> {
        Self::load_with(ckpt, BackendChoice::Auto)
    }

    pub fn load_with(ckpt: &Checkpoint, choice: BackendChoice) -> Result<Self, ReferenceError> {
        let spec = ckpt.spec().clone();
        let limitation = candle_limitation(&spec);
        let (backend, kind, fallback_reason) = match (choice, limitation) {
            (BackendChoice::Plain, _) => (
                Backend::Plain(Box::new(PlainModel::load(ckpt)?)),
                BackendKind::Plain,
                Some("plain backend requested".to_string()),
            ),
            (BackendChoice::Auto, Some(why)) => (
                Backend::Plain(Box::new(PlainModel::load(ckpt)?)),
                BackendKind::Plain,
                Some(why),
            ),
            (BackendChoice::Auto, None) => {
                let (b, k) = load_candle(ckpt, &spec)?;
                (b, k, None)
            }
        };
        Ok(Reference {
            spec,
            backend,
            kind,
            fallback_reason,
            cached: 0,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn backend(&self) -> BackendKind {
        self.kind
    }

    /// Why the plain implementation is used instead of candle-transformers, if it is.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Tokens in the KV cache: the position the next [`Reference::step`] must start at.
    pub fn position(&self) -> usize {
        self.cached
    }

    /// Forget the KV cache.
    pub fn reset(&mut self) -> Result<(), ReferenceError> {
        match &mut self.backend {
            Backend::Llama { config, cache, .. } => {
                *cache = ctx(
                    llama::Cache::new(true, DType::F32, config, &Device::Cpu),
                    "rope tables",
                )?;
            }
            Backend::Mistral(m) => m.clear_kv_cache(),
            Backend::Qwen2 { model, .. } => model.clear_kv_cache(),
            Backend::Plain(p) => p.clear_cache(),
        }
        self.cached = 0;
        Ok(())
    }

    fn check_tokens(&self, tokens: &[u32], start: usize) -> Result<(), ReferenceError> {
        check_tokens(&self.spec, tokens, start)
    }

    /// Process `tokens` at positions `position ..`, continuing the KV cache (or restarting it
    /// when `position` is 0), and return the next-token logits after the last of them.
    pub fn step(&mut self, tokens: &[u32], position: usize) -> Result<Vec<f32>, ReferenceError> {
        if position == 0 {
            self.reset()?;
        } else if position != self.cached {
            return Err(ReferenceError::Position {
                expected: self.cached,
                got: position,
            });
        }
        self.check_tokens(tokens, position)?;
        let logits = self.forward_last(tokens, position)?;
        self.cached += tokens.len();
        Ok(logits)
    }

    fn forward_last(
        &mut self,
        tokens: &[u32],
        position: usize,
    ) -> Result<Vec<f32>, ReferenceError> {
        let dev = Device::Cpu;
        let input = || -> candle_core::Result<Tensor> {
            Tensor::from_slice(tokens, (1, tokens.len()), &dev)
        };
        let r = (|| -> candle_core::Result<Vec<f32>> {
            match &mut self.backend {
                Backend::Llama { model, cache, .. } => model
                    .forward(&input()?, position, cache)?
                    .flatten_all()?
                    .to_vec1(),
                Backend::Mistral(m) => m.forward(&input()?, position)?.flatten_all()?.to_vec1(),
                Backend::Qwen2 { model, lm_head } => {
                    let h = model.forward(&input()?, position, None)?;
                    let last = h.narrow(1, tokens.len() - 1, 1)?;
                    candle_nn::Module::forward(lm_head, &last)?
                        .flatten_all()?
                        .to_vec1()
                }
                Backend::Plain(p) => {
                    let h = p.hidden(tokens, true, &mut plain::Blind)?;
                    plain::last_row(&p.logits(&h.narrow(0, tokens.len() - 1, 1)?)?)
                }
            }
        })();
        ctx(r, "step")
    }

    /// Logits [T][V] at every position of `tokens` (a fresh sequence from position 0). The
    /// KV cache afterwards holds `tokens`, so generation can continue with `step`.
    ///
    /// candle's llama and mistral return only the last position's logits, so for them this
    /// feeds the tokens one at a time through their KV cache; qwen2 and the plain backend
    /// compute the whole sequence in one pass. For long texts (validation's ~1,000 tokens)
    /// load with [`BackendChoice::Plain`]: one batched pass instead of T decode steps, and
    /// tests hold it to candle's logits (tiny models to 1e-4; SmolLM2 to KL < 1e-6).
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, ReferenceError> {
        self.reset()?;
        self.check_tokens(tokens, 0)?;
        let whole = match &mut self.backend {
            Backend::Qwen2 { model, lm_head } => Some((|| -> candle_core::Result<_> {
                let input = Tensor::from_slice(tokens, (1, tokens.len()), &Device::Cpu)?;
                let h = model.forward(&input, 0, None)?;
                candle_nn::Module::forward(lm_head, &h)?
                    .squeeze(0)?
                    .to_vec2::<f32>()
            })()),
            Backend::Plain(p) => Some((|| -> candle_core::Result<_> {
                let h = p.hidden(tokens, true, &mut plain::Blind)?;
                p.logits(&h)?.to_vec2::<f32>()
            })()),
            Backend::Llama { .. } | Backend::Mistral(_) => None,
        };
        let rows = match whole {
            Some(r) => ctx(r, "logits_all")?,
            None => {
                let mut rows = Vec::with_capacity(tokens.len());
                for (i, &tok) in tokens.iter().enumerate() {
                    rows.push(self.forward_last(&[tok], i)?);
                    self.cached = i + 1;
                }
                rows
            }
        };
        self.cached = tokens.len();
        Ok(rows)
    }

    /// Greedy decoding: the tokens generated after `prompt` (at most `max_new`), stopping
    /// before the first token in `eos` (which is not returned).
    pub fn greedy_generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        eos: &[u32],
    ) -> Result<Vec<u32>, ReferenceError> {
        let mut out = Vec::new();
        if max_new == 0 {
            return Ok(out);
        }
        let mut logits = self.step(prompt, 0)?;
        loop {
            let next = argmax(&logits);
            if eos.contains(&next) {
                break;
            }
            out.push(next);
            if out.len() >= max_new {
                break;
            }
            let pos = self.cached;
            logits = self.step(&[next], pos)?;
        }
        Ok(out)
    }
}

/// Index of the largest value (the first on ties; NaN never wins).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] || row[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

fn load_candle(
    ckpt: &Checkpoint,
    spec: &ModelSpec,
) -> Result<(Backend, BackendKind), ReferenceError> {
    let vb = VarBuilder::from_backend(
        Box::new(CheckpointBackend { ckpt }),
        DType::F32,
        Device::Cpu,
    );
    match spec.architecture {
        Architecture::Qwen3
        | Architecture::SmolLM3
        | Architecture::Phi3
        | Architecture::Gemma3
        | Architecture::Lfm2
        | Architecture::Qwen3_5
        | Architecture::Gemma4 => Err(ReferenceError::candle(
            "loading",
            candle_core::Error::Msg(candle_limitation(spec).unwrap_or_default()),
        )),
        Architecture::Llama => {
            let rope_scaling = match spec.rope_scaling {
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => Some(llama::Llama3RopeConfig {
                    factor: factor as f32,
                    low_freq_factor: low_freq_factor as f32,
                    high_freq_factor: high_freq_factor as f32,
                    original_max_position_embeddings,
                    rope_type: llama::Llama3RopeType::Llama3,
                }),
                _ => None,
            };
            let config = llama::Config {
                hidden_size: spec.hidden_size,
                intermediate_size: spec.intermediate_size,
                vocab_size: spec.vocab_size,
                num_hidden_layers: spec.num_hidden_layers,
                num_attention_heads: spec.num_attention_heads,
                num_key_value_heads: spec.num_key_value_heads,
                use_flash_attn: false,
                rms_norm_eps: spec.rms_norm_eps,
                rope_theta: spec.rope_theta as f32,
                bos_token_id: spec.bos_token_id,
                eos_token_id: None,
                rope_scaling,
                max_position_embeddings: spec.max_position_embeddings,
                tie_word_embeddings: spec.tie_word_embeddings,
            };
            // candle's Llama::load unwraps per-block errors; Checkpoint::open has already
            // checked every tensor's presence and shape against this same spec, and
            // candle_limitation excluded the head_dim case where candle expects other shapes.
            let model = ctx(llama::Llama::load(vb, &config), "loading llama")?;
            let cache = ctx(
                llama::Cache::new(true, DType::F32, &config, &Device::Cpu),
                "rope tables",
            )?;
            Ok((
                Backend::Llama {
                    model,
                    config,
                    cache,
                },
                BackendKind::CandleLlama,
            ))
        }
        Architecture::Mistral => {
            let config = mistral::Config {
                vocab_size: spec.vocab_size,
                hidden_size: spec.hidden_size,
                intermediate_size: spec.intermediate_size,
                num_hidden_layers: spec.num_hidden_layers,
                num_attention_heads: spec.num_attention_heads,
                head_dim: Some(spec.head_dim),
                num_key_value_heads: spec.num_key_value_heads,
                hidden_act: candle_nn::Activation::Silu,
                max_position_embeddings: spec.max_position_embeddings,
                rms_norm_eps: spec.rms_norm_eps,
                rope_theta: spec.rope_theta,
                // Windowing is refused in check_tokens instead (see the module docs).
                sliding_window: None,
                use_flash_attn: false,
            };
            let model = ctx(mistral::Model::new(&config, vb), "loading mistral")?;
            Ok((Backend::Mistral(model), BackendKind::CandleMistral))
        }
        Architecture::Qwen2 => {
            let config = qwen2::Config {
                vocab_size: spec.vocab_size,
                hidden_size: spec.hidden_size,
                intermediate_size: spec.intermediate_size,
                num_hidden_layers: spec.num_hidden_layers,
                num_attention_heads: spec.num_attention_heads,
                num_key_value_heads: spec.num_key_value_heads,
                max_position_embeddings: spec.max_position_embeddings,
                // candle's qwen2 masks `j + sliding_window < i`; a window past any position
                // disables it (windowing is refused in check_tokens instead).
                sliding_window: usize::MAX / 4,
                max_window_layers: spec.num_hidden_layers,
                tie_word_embeddings: spec.tie_word_embeddings,
                rope_theta: spec.rope_theta,
                rms_norm_eps: spec.rms_norm_eps,
                use_sliding_window: false,
                hidden_act: candle_nn::Activation::Silu,
            };
            let model = ctx(qwen2::Model::new(&config, vb.clone()), "loading qwen2")?;
            let head_name = crate::arch::TensorId::head(spec).hf_name();
            let w = ctx(
                vb.get((spec.vocab_size, spec.hidden_size), &head_name),
                "loading lm_head",
            )?;
            Ok((
                Backend::Qwen2 {
                    model,
                    lm_head: candle_nn::Linear::new(w, None),
                },
                BackendKind::CandleQwen2,
            ))
        }
    }
}
