//! Our own float32 decoder forward pass on candle tensors: the fallback for what
//! candle-transformers cannot express (explicit head_dim on Llama/Qwen2, linear rope scaling,
//! tied Mistral embeddings) and the instrumented forward behind calibration.
//!
//! Written from the Hugging Face modelling code's definitions, deliberately sharing nothing
//! with `src/graph/` (so the reference can catch the graph builder's mistakes) nor with
//! candle-transformers (so tests can hold the two references against each other).

use candle_core::{DType, Device, IndexOp, Tensor, D};

use super::primitives::{gelu_tanh, load, rms_norm};
use super::reference_error::ReferenceError;
use crate::arch::{self, LayerTensor, Role, TensorId};
use crate::arch::{ModelSpec, RopeScaling};
use crate::checkpoint::Checkpoint;

/// A point in the forward pass where the instrumented forward shows a tensor to an
/// [`Observer`]. Shapes are given with T = tokens of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Point {
    /// [T, H] the embedding rows.
    Embedding,
    /// [T, H] the input of an RMSNorm (the residual stream); `layer: None` is the final norm.
    NormInput,
    /// [T, H] the normalised, weighted output of the input_layernorm: the q/k/v input.
    AttentionInput,
    Q,
    K,
    V,
    /// [Hq, T, Tk] scaled q·k before the mask; masked entries are zeroed so they never count.
    Scores,
    /// [T, Hq·D] the attention output before o_proj: the o_proj input.
    OInput,
    O,
    ResidualAfterAttention,
    /// [T, H] the gate/up input.
    MlpInput,
    Gate,
    Up,
    /// [T, I] silu(gate)·up: the down_proj input.
    SiluUp,
    Down,
    ResidualAfterMlp,
}

/// Sees intermediate tensors of the plain forward pass.
pub(crate) trait Observer {
    fn observe(
        &mut self,
        layer: Option<usize>,
        point: Point,
        x: &Tensor,
    ) -> candle_core::Result<()>;

    /// Whether `observe` looks at `point` at all (intermediates only an observer needs, such
    /// as the masked attention scores, are computed only when it does).
    fn wants(&self, _point: Point) -> bool {
        true
    }
}

/// The observer that looks at nothing.
pub(crate) struct Blind;

impl Observer for Blind {
    fn observe(&mut self, _: Option<usize>, _: Point, _: &Tensor) -> candle_core::Result<()> {
        Ok(())
    }

    fn wants(&self, _: Point) -> bool {
        false
    }
}

struct Layer {
    input_norm: Tensor,
    mixer: Mixer,
    /// The mixer's output projection: o_proj, or a conv block's out_proj.
    o: Tensor,
    /// A conv block's out_proj bias (`conv_bias`).
    o_bias: Option<Tensor>,
    /// Gemma's norm of the attention output (`post_attention_layernorm`).
    attn_out_norm: Option<Tensor>,
    /// The MLP's input norm (`LayerTensor::mlp_norm`).
    post_norm: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    /// Gemma's norm of the MLP output (`post_feedforward_layernorm`).
    mlp_out_norm: Option<Tensor>,
    /// Gemma 4's per-layer input sub-block.
    per_layer: Option<super::gemma4::PerLayerBlock>,
    /// Gemma 4's `layer_scalar`: the block's output times it.
    scalar: Option<f64>,
}

/// What a block computes between its input norm and its output projection.
enum Mixer {
    Attention(AttentionWeights),
    ShortConv(ConvWeights),
    GatedDelta(super::delta::DeltaWeights),
}

struct AttentionWeights {
    q: Tensor,
    /// `None` in a block that reads another's keys and values (Gemma 4's KV sharing).
    k: Option<Tensor>,
    /// `None` there too, and where the values are the raw key projection (Gemma 4's
    /// `attention_k_eq_v` full blocks).
    v: Option<Tensor>,
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    /// Qwen3's, Gemma's and LFM2's per-head norms on q and k, [D].
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// Gemma 4: the values pass an RMSNorm without weight.
    v_norm: bool,
}

/// LFM2's conv block before out_proj.
struct ConvWeights {
    /// [3H, H]: B, C and x.
    in_proj: Tensor,
    in_bias: Option<Tensor>,
    /// The depthwise taps [K, H], oldest input first.
    taps: Tensor,
    taps_bias: Option<Tensor>,
}

/// The plain f32 model with its own growing KV cache (and conv blocks' states).
///
/// [`PlainModel::load`] holds every weight; [`PlainModel::streaming`] holds only the final
/// norm and lets a layer-by-layer caller bring one block in at a time
/// ([`PlainModel::fetch_layer`], [`PlainModel::release_layer`]) and read embedding rows
/// straight from the checkpoint ([`embed_rows`]): calibration of a model of any size then
/// needs one f32 block in memory, not the whole model.
pub struct PlainModel {
    spec: ModelSpec,
    device: Device,
    /// `None` when streaming.
    embed: Option<Tensor>,
    /// `None`: not in memory (a streaming model between fetch and release).
    layers: Vec<Option<Layer>>,
    norm: Tensor,
    /// `None` when streaming.
    lm_head: Option<Tensor>,
    streaming: bool,
    /// Per layer: keys (after rope) and values, [Hkv, cached, D].
    cache: Vec<Option<(Tensor, Tensor)>>,
    /// Per layer, during one call: the keys and values it attended over, which a block
    /// sharing its cache reads (Gemma 4).
    pass_kv: Vec<Option<(Tensor, Tensor)>>,
    /// Gemma 4's per-layer input weights (`None` when streaming or without them).
    per_layer: Option<super::gemma4::PerLayerInput>,
    /// Per conv block: its last K − 1 conv inputs [K − 1, H], oldest first (`None`: zeros).
    conv_state: Vec<Option<Tensor>>,
    /// Per Gated DeltaNet block: its conv inputs and state (`None`: zeros).
    delta_state: Vec<Option<super::delta::DeltaCarry>>,
    cached: usize,
}

/// An RMSNorm weight as the norm multiplies by: w, or Gemma's 1 + w (in f32, as transformers).
fn load_norm(ckpt: &Checkpoint, name: &str, device: &Device) -> Result<Tensor, ReferenceError> {
    let w = load(ckpt, name, device)?;
    let offset = ckpt.spec().norm_offset() as f64;
    if offset == 0.0 {
        return Ok(w);
    }
    (w + offset).map_err(|e| ReferenceError::candle(format!("loading `{name}`"), e))
}

/// Block `l`'s weights in f32 (norms as they multiply: Gemma's 1 + w).
fn load_layer(ckpt: &Checkpoint, l: usize, device: &Device) -> Result<Layer, ReferenceError> {
    let get = |t: LayerTensor| load(ckpt, &arch::tensor_name(l, t), device);
    let norm = |t: LayerTensor| load_norm(ckpt, &arch::tensor_name(l, t), device);
    let optional = |t: LayerTensor, present: bool| -> Result<Option<Tensor>, _> {
        present.then(|| get(t)).transpose()
    };
    let optional_norm = |t: LayerTensor, present: bool| -> Result<Option<Tensor>, _> {
        present.then(|| norm(t)).transpose()
    };
    let spec = ckpt.spec();
    let bias = |t: LayerTensor| optional(t, spec.attention_bias);
    let qk_norm = |t: LayerTensor| optional_norm(t, spec.qk_norm);
    let gemma = spec.gemma.is_some();
    let held = |t: LayerTensor| optional(t, t.present(spec, l));
    let (mixer, o, o_bias) = match spec.layer(l) {
        arch::LayerKind::Attention(_) => (
            Mixer::Attention(AttentionWeights {
                q: get(LayerTensor::Q)?,
                k: held(LayerTensor::K)?,
                v: held(LayerTensor::V)?,
                q_bias: bias(LayerTensor::QBias)?,
                k_bias: bias(LayerTensor::KBias)?,
                v_bias: bias(LayerTensor::VBias)?,
                q_norm: qk_norm(LayerTensor::QNorm)?,
                k_norm: optional_norm(LayerTensor::KNorm, LayerTensor::KNorm.present(spec, l))?,
                v_norm: spec.gemma4.is_some(),
            }),
            get(LayerTensor::O)?,
            None,
        ),
        arch::LayerKind::ShortConv(c) => {
            let name = arch::tensor_name(l, LayerTensor::Conv);
            // [H, 1, K] → [K, H]: tap j of every channel in one row.
            let taps = get(LayerTensor::Conv)?
                .reshape((c.channels, c.kernel))
                .and_then(|t| t.t()?.contiguous())
                .map_err(|e| ReferenceError::candle(format!("loading `{name}`"), e))?;
            (
                Mixer::ShortConv(ConvWeights {
                    in_proj: get(LayerTensor::ConvIn)?,
                    in_bias: optional(LayerTensor::ConvInBias, c.bias)?,
                    taps,
                    taps_bias: optional(LayerTensor::ConvBias, c.bias)?,
                }),
                get(LayerTensor::ConvOut)?,
                optional(LayerTensor::ConvOutBias, c.bias)?,
            )
        }
        arch::LayerKind::GatedDelta(g) => {
            let err = |t: LayerTensor| {
                let name = arch::tensor_name(l, t);
                move |e| ReferenceError::candle(format!("loading `{name}`"), e)
            };
            let taps = get(LayerTensor::DeltaConv)?
                .reshape((g.conv_channels(), g.kernel))
                .and_then(|t| t.t()?.contiguous())
                .map_err(err(LayerTensor::DeltaConv))?;
            let vector = |t: LayerTensor| -> Result<Vec<f32>, ReferenceError> {
                get(t)?
                    .flatten_all()
                    .and_then(|x| x.to_vec1())
                    .map_err(err(t))
            };
            let neg_a = vector(LayerTensor::DeltaALog)?
                .into_iter()
                .map(|x| -x.exp())
                .collect();
            (
                Mixer::GatedDelta(super::delta::DeltaWeights {
                    shape: g,
                    qkv: get(LayerTensor::DeltaQkv)?,
                    z: get(LayerTensor::DeltaZ)?,
                    b: get(LayerTensor::DeltaB)?,
                    a: get(LayerTensor::DeltaA)?,
                    taps,
                    neg_a,
                    dt_bias: vector(LayerTensor::DeltaDtBias)?,
                    norm: vector(LayerTensor::DeltaNorm)?,
                    eps: spec.rms_norm_eps,
                }),
                get(LayerTensor::DeltaOut)?,
                None,
            )
        }
    };
    Ok(Layer {
        input_norm: norm(LayerTensor::InputNorm)?,
        mixer,
        o,
        o_bias,
        attn_out_norm: optional_norm(LayerTensor::PostNorm, gemma)?,
        post_norm: norm(LayerTensor::mlp_norm(spec))?,
        gate: get(LayerTensor::Gate)?,
        up: get(LayerTensor::Up)?,
        down: get(LayerTensor::Down)?,
        mlp_out_norm: optional_norm(LayerTensor::PostFfnNorm, gemma)?,
        per_layer: super::gemma4::PerLayerBlock::load(ckpt, l, device)?,
        scalar: match LayerTensor::LayerScalar.present(spec, l) {
            true => {
                let name = arch::tensor_name(l, LayerTensor::LayerScalar);
                let v = ckpt.tensor(&name)?.to_f32();
                Some(f64::from(v[0]))
            }
            false => None,
        },
    })
}

fn loaded(layers: &[Option<Layer>], l: usize) -> candle_core::Result<&Layer> {
    layers
        .get(l)
        .and_then(Option::as_ref)
        .ok_or_else(|| candle_core::Error::Msg(format!("block {l} is not in memory")))
}

/// The embedding rows [T, H] of `tokens` in f32 (times Gemma's embedding scale), read from the
/// checkpoint (one row at a time, never the whole table).
pub(crate) fn embed_rows(ckpt: &Checkpoint, tokens: &[u32]) -> Result<Tensor, ReferenceError> {
    let name = TensorId::Embedding.hf_name();
    let table = ckpt.tensor(&name)?;
    let hidden = ckpt.spec().hidden_size;
    let mut values = Vec::with_capacity(tokens.len() * hidden);
    for &t in tokens {
        let row = table.row(t as usize).ok_or_else(|| {
            ReferenceError::candle(
                format!("reading `{name}`"),
                candle_core::Error::Msg(format!("token {t} has no embedding row")),
            )
        })?;
        values.extend(row.to_f32());
    }
    let scale = ckpt.spec().embedding_scale() as f32;
    if scale != 1.0 {
        values.iter_mut().for_each(|v| *v *= scale);
    }
    Tensor::from_vec(values, (tokens.len(), hidden), &Device::Cpu)
        .map_err(|e| ReferenceError::candle(format!("reading `{name}`"), e))
}

/// Rotary inverse frequencies, one per rotated pair of head dimensions, with the config's
/// scaling, for a sequence of `seq_len` tokens so far (LongRoPE's long factors apply once it
/// outgrows the original context, as transformers' `dynamic_rope_update` switches them).
/// Computed in f64 and rounded once: HF computes them in f32, the difference is far below the
/// tolerances anyone compares references with.
/// Base `theta` and `scaling` are the block's (Gemma's sliding blocks have their own).
fn frequencies(spec: &ModelSpec, theta: f64, scaling: &RopeScaling, seq_len: usize) -> Vec<f32> {
    // Partial RoPE (Phi-4-mini): the exponents run over the rotated dimensions only.
    let d = spec.rotary_dim() as f64;
    let base: Vec<f64> = (0..spec.rotary_dim() / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d))
        .collect();
    let scaled: Vec<f64> = match *scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        RopeScaling::LongRope {
            ref short_factor,
            ref long_factor,
            original_max_position_embeddings,
            ..
        } => {
            let ext = if seq_len > original_max_position_embeddings {
                long_factor
            } else {
                short_factor
            };
            base.iter().zip(ext).map(|(f, e)| f / e).collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

impl PlainModel {
    pub fn load(ckpt: &Checkpoint) -> Result<Self, ReferenceError> {
        let device = Device::Cpu;
        let spec = ckpt.spec();
        let embed = load(ckpt, &TensorId::Embedding.hf_name(), &device)?;
        let layers = (0..spec.num_hidden_layers)
            .map(|l| load_layer(ckpt, l, &device).map(Some))
            .collect::<Result<_, _>>()?;
        let lm_head = if spec.tie_word_embeddings {
            embed.clone()
        } else {
            load(ckpt, &TensorId::LmHead.hf_name(), &device)?
        };
        let mut model = Self::assemble(ckpt, Some(embed), layers, Some(lm_head), false)?;
        model.per_layer = super::gemma4::PerLayerInput::load(ckpt, &device)?;
        Ok(model)
    }

    /// A model with no block, embedding or lm_head in memory (see the type's documentation).
    pub fn streaming(ckpt: &Checkpoint) -> Result<Self, ReferenceError> {
        let layers = (0..ckpt.spec().num_hidden_layers).map(|_| None).collect();
        Self::assemble(ckpt, None, layers, None, true)
    }

    fn assemble(
        ckpt: &Checkpoint,
        embed: Option<Tensor>,
        layers: Vec<Option<Layer>>,
        lm_head: Option<Tensor>,
        streaming: bool,
    ) -> Result<Self, ReferenceError> {
        let spec = ckpt.spec().clone();
        honoured(&spec);
        let device = Device::Cpu;
        Ok(PlainModel {
            cache: vec![None; spec.num_hidden_layers],
            pass_kv: vec![None; spec.num_hidden_layers],
            per_layer: None,
            conv_state: vec![None; spec.num_hidden_layers],
            delta_state: vec![None; spec.num_hidden_layers],
            cached: 0,
            norm: load_norm(ckpt, &TensorId::FinalNorm.hf_name(), &device)?,
            spec,
            device,
            embed,
            layers,
            lm_head,
            streaming,
        })
    }

    /// Bring block `l` into memory from `ckpt` (nothing to do if it is there).
    pub(crate) fn fetch_layer(
        &mut self,
        ckpt: &Checkpoint,
        l: usize,
    ) -> Result<(), ReferenceError> {
        if self.layers.get(l).is_some_and(|w| w.is_none()) {
            self.layers[l] = Some(load_layer(ckpt, l, &self.device)?);
        }
        Ok(())
    }

    /// Bring the lm_head (the embedding when tied) into memory: what [`PlainModel::head`]
    /// multiplies by (nothing to do if it is there).
    pub(crate) fn fetch_head(&mut self, ckpt: &Checkpoint) -> Result<(), ReferenceError> {
        if self.lm_head.is_none() {
            let name = TensorId::head(&self.spec).hf_name();
            self.lm_head = Some(load(ckpt, &name, &self.device)?);
        }
        Ok(())
    }

    /// Drop the lm_head of a streaming model (a loaded model keeps it).
    pub(crate) fn release_head(&mut self) {
        if self.streaming {
            self.lm_head = None;
        }
    }

    /// Drop block `l` of a streaming model (a loaded model keeps its blocks).
    pub(crate) fn release_layer(&mut self, l: usize) {
        if self.streaming {
            if let Some(w) = self.layers.get_mut(l) {
                *w = None;
            }
        }
    }

    /// Bring Gemma 4's per-layer input weights into memory, with the table's rows of `tokens`
    /// only (nothing to do for a model without them): what the segments of those tokens read.
    pub(crate) fn fetch_per_layer(
        &mut self,
        ckpt: &Checkpoint,
        tokens: &[u32],
    ) -> Result<(), ReferenceError> {
        self.per_layer = super::gemma4::PerLayerInput::load_rows(ckpt, tokens, &self.device)?;
        Ok(())
    }

    /// The segment of calibration tokens `tokens` whose embedded rows are `embedded`.
    pub(crate) fn segment(
        &self,
        tokens: &[u32],
        embedded: &Tensor,
    ) -> candle_core::Result<Segment> {
        Ok(Segment {
            per_layer: self.per_layer_inputs(tokens, embedded)?,
            kv: Vec::new(),
        })
    }

    /// Block `l` on x [T, H] of calibration segment `seg` (a fresh sequence, positions 0..T):
    /// [`block`](Self::block) for a block that reads from outside itself too.
    pub(crate) fn block_in(
        &mut self,
        l: usize,
        x: &Tensor,
        seg: &mut Segment,
        obs: &mut dyn Observer,
    ) -> candle_core::Result<Tensor> {
        let t = x.dim(0)?;
        let tables = self.rope_tables(0, t)?;
        let (cos, sin) = tables.layer(&self.spec, l);
        let (cos, sin) = (cos.clone(), sin.clone());
        let input = seg.per_layer.as_ref().map(|p| p.get(l)).transpose()?;
        // The segment's kept keys and values stand in for this call's.
        seg.kv.resize(self.spec.num_hidden_layers, None);
        std::mem::swap(&mut self.pass_kv, &mut seg.kv);
        let out = self.layer(l, x, (&cos, &sin), input.as_ref(), false, obs);
        std::mem::swap(&mut self.pass_kv, &mut seg.kv);
        out
    }

    /// Block `l`'s weights, or an error naming it when a streaming model has not fetched it.
    fn weights(&self, l: usize) -> candle_core::Result<&Layer> {
        loaded(&self.layers, l)
    }

    fn resident<'a, T>(t: &'a Option<T>, what: &str) -> candle_core::Result<&'a T> {
        t.as_ref()
            .ok_or_else(|| candle_core::Error::Msg(format!("a streaming model holds no {what}")))
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Tokens held in the KV cache.
    pub fn cached(&self) -> usize {
        self.cached
    }

    pub fn clear_cache(&mut self) {
        self.cache.iter_mut().for_each(|c| *c = None);
        self.conv_state.iter_mut().for_each(|c| *c = None);
        self.delta_state.iter_mut().for_each(|c| *c = None);
        self.cached = 0;
    }

    /// Final-norm hidden states [T, H] for `tokens` at positions `cached .. cached + T`,
    /// appending to the KV cache when `use_cache`; every intermediate is shown to `obs`.
    pub(crate) fn hidden(
        &mut self,
        tokens: &[u32],
        use_cache: bool,
        obs: &mut dyn Observer,
    ) -> candle_core::Result<Tensor> {
        let t = tokens.len();
        let position = if use_cache { self.cached } else { 0 };
        let mut x = self.embed(tokens)?;
        obs.observe(None, Point::Embedding, &x)?;
        let per_layer = self.per_layer_inputs(tokens, &x)?;
        let tables = self.rope_tables(position, t)?;
        for l in 0..self.layers.len() {
            let (cos, sin) = tables.layer(&self.spec, l);
            let input = per_layer.as_ref().map(|p| p.get(l)).transpose()?;
            x = self.layer(l, &x, (cos, sin), input.as_ref(), use_cache, obs)?;
        }
        self.pass_kv.iter_mut().for_each(|kv| *kv = None);
        obs.observe(None, Point::NormInput, &x)?;
        if use_cache {
            self.cached += t;
        }
        rms_norm(&x, &self.norm, self.spec.rms_norm_eps)
    }

    /// The final RMSNorm of the last block's output [T, H].
    pub(crate) fn final_norm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        rms_norm(x, &self.norm, self.spec.rms_norm_eps)
    }

    /// Logits [T, V] from the last block's output [T, H] (the final RMSNorm, then lm_head).
    pub(crate) fn head(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.logits(&rms_norm(x, &self.norm, self.spec.rms_norm_eps)?)
    }

    /// Logits [T, V] from final hidden states [T, H] (soft-capped where the model caps them).
    pub(crate) fn logits(&self, hidden: &Tensor) -> candle_core::Result<Tensor> {
        let logits = hidden.matmul(&Self::resident(&self.lm_head, "lm_head")?.t()?)?;
        super::gemma4::softcap(&self.spec, logits)
    }

    /// Gemma 4's per-layer inputs [L, T, P] of `tokens` with embedding rows `embedded`;
    /// `None` for a model without them.
    fn per_layer_inputs(
        &self,
        tokens: &[u32],
        embedded: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        if self.spec.per_layer_input() == 0 {
            return Ok(None);
        }
        let weights = Self::resident(&self.per_layer, "per-layer embedding table")?;
        weights.inputs(&self.spec, tokens, embedded).map(Some)
    }

    /// Refuse to run block `l` on its own (the layer-by-layer steps of calibration) where its
    /// inputs come from outside it: Gemma 4's per-layer inputs and shared caches.
    fn on_its_own(&self, l: usize) -> candle_core::Result<()> {
        match self.spec.gemma4.is_some() {
            true => Err(candle_core::Error::Msg(format!(
                "Gemma 4's block {l} reads per-layer inputs and other blocks' keys and \
                 values: it runs with its sequence's segment (`block_in`), not on its own"
            ))),
            false => Ok(()),
        }
    }

    /// cos/sin [T, D/2] for positions `start .. start + t`: the model's, and Gemma's sliding
    /// blocks' own.
    fn rope_tables(&self, start: usize, t: usize) -> candle_core::Result<RopeTables> {
        let global = match super::gemma4::global_frequencies(&self.spec) {
            Some(inv_freq) => self.angles(&inv_freq, 1.0, start, t)?,
            None => self.rope_table(&self.spec.rope_theta, &self.spec.rope_scaling, start, t)?,
        };
        let local = match &self.spec.gemma {
            Some(g) => Some(self.rope_table(&g.local_rope_theta, &RopeScaling::None, start, t)?),
            None => None,
        };
        Ok(RopeTables { global, local })
    }

    fn rope_table(
        &self,
        theta: &f64,
        scaling: &RopeScaling,
        start: usize,
        t: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let inv_freq = frequencies(&self.spec, *theta, scaling, start + t);
        self.angles(&inv_freq, scaling.attention_factor() as f32, start, t)
    }

    /// cos and sin [t, R/2] (times `scale`) of positions `start .. start + t` at `inv_freq`.
    fn angles(
        &self,
        inv_freq: &[f32],
        scale: f32,
        start: usize,
        t: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for p in start..start + t {
            for &f in inv_freq {
                // f32 product as in HF (position × inv_freq in float32), then cos/sin.
                let angle = p as f32 * f;
                cos.push(angle.cos() * scale);
                sin.push(angle.sin() * scale);
            }
        }
        Ok((
            Tensor::from_vec(cos, (t, half), &self.device)?,
            Tensor::from_vec(sin, (t, half), &self.device)?,
        ))
    }

    /// Block `l` on x [T, H] with its RoPE rows (cos, sin) and, for Gemma 4, its per-layer
    /// input [T, P].
    fn layer(
        &mut self,
        l: usize,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        per_layer: Option<&Tensor>,
        use_cache: bool,
        obs: &mut dyn Observer,
    ) -> candle_core::Result<Tensor> {
        let PlainModel {
            spec,
            layers,
            cache,
            pass_kv,
            conv_state,
            delta_state,
            device,
            ..
        } = self;
        let w = loaded(layers, l)?;
        let lo = Some(l);
        obs.observe(lo, Point::NormInput, x)?;
        let h = rms_norm(x, &w.input_norm, spec.rms_norm_eps)?;
        obs.observe(lo, Point::AttentionInput, &h)?;
        let attn = match &w.mixer {
            Mixer::Attention(a) => {
                let slot = if use_cache { Some(&mut cache[l]) } else { None };
                let shared = spec.kv_producer(l).and_then(|p| pass_kv[p].clone());
                let kv = Kv { slot, shared };
                let (out, keys, values) = attention(spec, a, &h, (cos, sin), kv, device, lo, obs)?;
                // Kept for the call only where a later block reads them (Gemma 4's producers):
                // elsewhere every block's keys and values would stay alive to the end.
                let read_later = spec.gemma4.is_some()
                    && (l + 1..spec.num_hidden_layers).any(|b| spec.kv_producer(b) == Some(l));
                if read_later {
                    pass_kv[l] = Some((keys, values));
                }
                out
            }
            Mixer::ShortConv(c) => {
                let state = if use_cache {
                    Some(&mut conv_state[l])
                } else {
                    None
                };
                short_conv(c, &h, state)?
            }
            Mixer::GatedDelta(g) => {
                let carry = if use_cache {
                    Some(&mut delta_state[l])
                } else {
                    None
                };
                super::delta::gated_delta(g, &h, carry)?
            }
        };
        obs.observe(lo, Point::OInput, &attn)?;
        let o = linear(&attn, &w.o, w.o_bias.as_ref())?;
        obs.observe(lo, Point::O, &o)?;
        let o = out_norm(spec, w.attn_out_norm.as_ref(), o, lo, obs)?;
        let x = (x + o)?;
        obs.observe(lo, Point::ResidualAfterAttention, &x)?;
        obs.observe(lo, Point::NormInput, &x)?;
        let h = rms_norm(&x, &w.post_norm, spec.rms_norm_eps)?;
        obs.observe(lo, Point::MlpInput, &h)?;
        let gate = linear(&h, &w.gate, None)?;
        let up = linear(&h, &w.up, None)?;
        obs.observe(lo, Point::Gate, &gate)?;
        obs.observe(lo, Point::Up, &up)?;
        let act = (activation(spec, &gate)? * up)?;
        obs.observe(lo, Point::SiluUp, &act)?;
        let down = linear(&act, &w.down, None)?;
        obs.observe(lo, Point::Down, &down)?;
        let down = out_norm(spec, w.mlp_out_norm.as_ref(), down, lo, obs)?;
        let mut x = (x + down)?;
        // Gemma 4: the block's per-layer input, then its scalar on the whole stream.
        if let (Some(p), Some(input)) = (&w.per_layer, per_layer) {
            x = p.forward(spec, &x, input)?;
        }
        if let Some(scalar) = w.scalar {
            x = (x * scalar)?;
        }
        obs.observe(lo, Point::ResidualAfterMlp, &x)?;
        Ok(x)
    }

    /// The embedding rows [T, H] of `tokens` (times Gemma's embedding scale).
    pub(crate) fn embed(&self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
        let x = Self::resident(&self.embed, "embedding")?.index_select(&ids, 0)?;
        match self.spec.embedding_scale() {
            1.0 => Ok(x),
            scale => x * scale as f32 as f64,
        }
    }

    /// Decoder block `l` on x [T, H] as a fresh sequence (positions 0..T, no cache): the
    /// layer-by-layer forward of calibration.
    pub(crate) fn block(
        &mut self,
        l: usize,
        x: &Tensor,
        obs: &mut dyn Observer,
    ) -> candle_core::Result<Tensor> {
        self.on_its_own(l)?;
        let t = x.dim(0)?;
        let tables = self.rope_tables(0, t)?;
        let (cos, sin) = tables.layer(&self.spec, l);
        let (cos, sin) = (cos.clone(), sin.clone());
        self.layer(l, x, (&cos, &sin), None, false, obs)
    }

    /// Block `l` in the steps of true-sequential calibration, each reading the block's current
    /// weights (a fresh sequence, positions 0..T): the q/k/v input of block input x.
    pub(crate) fn step_attention_input(&self, l: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        rms_norm(x, &self.weights(l)?.input_norm, self.spec.rms_norm_eps)
    }

    /// The o_proj input from the q/k/v input h of calibration segment `seg`.
    pub(crate) fn step_attention(
        &self,
        l: usize,
        h: &Tensor,
        seg: &mut Segment,
    ) -> candle_core::Result<Tensor> {
        let t = h.dim(0)?;
        let tables = self.rope_tables(0, t)?;
        let (cos, sin) = tables.layer(&self.spec, l);
        match &self.weights(l)?.mixer {
            Mixer::Attention(a) => {
                let producer = self.spec.kv_producer(l);
                let kv = Kv {
                    slot: None,
                    shared: producer.and_then(|p| seg.kv.get(p).cloned().flatten()),
                };
                let (o, keys, values) = attention(
                    &self.spec,
                    a,
                    h,
                    (cos, sin),
                    kv,
                    &self.device,
                    Some(l),
                    &mut Blind,
                )?;
                seg.keep(&self.spec, l, (keys, values));
                Ok(o)
            }
            Mixer::ShortConv(c) => short_conv(c, h, None),
            Mixer::GatedDelta(g) => super::delta::gated_delta(g, h, None),
        }
    }

    /// (the residual after attention, the gate/up input) from block input x and o_proj input.
    pub(crate) fn step_mlp_input(
        &self,
        l: usize,
        x: &Tensor,
        attn: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let w = self.weights(l)?;
        let o = linear(attn, &w.o, w.o_bias.as_ref())?;
        let o = out_norm(&self.spec, w.attn_out_norm.as_ref(), o, None, &mut Blind)?;
        let x = (x + o)?;
        let h = rms_norm(&x, &w.post_norm, self.spec.rms_norm_eps)?;
        Ok((x, h))
    }

    /// silu(gate)·up, the down_proj input, from the gate/up input h.
    pub(crate) fn step_mlp_act(&self, l: usize, h: &Tensor) -> candle_core::Result<Tensor> {
        let w = self.weights(l)?;
        let gate = linear(h, &w.gate, None)?;
        let up = linear(h, &w.up, None)?;
        activation(&self.spec, &gate)? * up
    }

    /// The block output from the residual after attention and the down_proj input (and, for
    /// Gemma 4, segment `seg`'s per-layer input).
    pub(crate) fn step_output(
        &self,
        l: usize,
        x: &Tensor,
        act: &Tensor,
        seg: &Segment,
    ) -> candle_core::Result<Tensor> {
        let w = self.weights(l)?;
        let down = linear(act, &w.down, None)?;
        let mut x = (x + out_norm(&self.spec, w.mlp_out_norm.as_ref(), down, None, &mut Blind)?)?;
        let input = seg.per_layer.as_ref().map(|p| p.get(l)).transpose()?;
        if let (Some(p), Some(input)) = (&w.per_layer, input) {
            x = p.forward(&self.spec, &x, &input)?;
        }
        match w.scalar {
            Some(scalar) => x * scalar,
            None => Ok(x),
        }
    }

    /// Logits [T, V] of a fresh sequence, without touching the cache.
    pub fn logits_fresh(&mut self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let h = self.hidden(tokens, false, &mut Blind)?;
        self.logits(&h)
    }

    /// Which RMSNorm `weight_mut(l, Role::Norm, post)` returns, by its checkpoint tensor.
    pub(crate) fn norm_tensor(&self, post: bool) -> LayerTensor {
        if post {
            LayerTensor::mlp_norm(&self.spec)
        } else {
            LayerTensor::InputNorm
        }
    }

    /// The f32 weight of projection `role` ([out, in]) or RMSNorm (`Role::Norm`: `post`
    /// selects post_attention_layernorm) of block `l`.
    pub(crate) fn weight_mut(&mut self, l: usize, role: Role, post: bool) -> Option<&mut Tensor> {
        let w = self.layers.get_mut(l)?.as_mut()?;
        Some(match (role, &mut w.mixer) {
            (Role::Q, Mixer::Attention(a)) => &mut a.q,
            (Role::K, Mixer::Attention(a)) => a.k.as_mut()?,
            (Role::V, Mixer::Attention(a)) => a.v.as_mut()?,
            (Role::ConvIn, Mixer::ShortConv(c)) => &mut c.in_proj,
            (Role::ConvIn, Mixer::GatedDelta(g)) => &mut g.qkv,
            (Role::OutputGate, Mixer::GatedDelta(g)) => &mut g.z,
            (Role::O, _) => &mut w.o,
            (Role::Gate, _) => &mut w.gate,
            (Role::Up, _) => &mut w.up,
            (Role::Down, _) => &mut w.down,
            (Role::Norm, _) if post => &mut w.post_norm,
            (Role::Norm, _) => &mut w.input_norm,
            _ => return None,
        })
    }

    /// The bias of q/k/v in block `l` (Qwen2), if any.
    pub(crate) fn bias_mut(&mut self, l: usize, role: Role) -> Option<&mut Tensor> {
        let w = self.layers.get_mut(l)?.as_mut()?;
        match (role, &mut w.mixer) {
            (Role::Q, Mixer::Attention(a)) => a.q_bias.as_mut(),
            (Role::K, Mixer::Attention(a)) => a.k_bias.as_mut(),
            (Role::V, Mixer::Attention(a)) => a.v_bias.as_mut(),
            (Role::ConvIn, Mixer::ShortConv(c)) => c.in_bias.as_mut(),
            _ => None,
        }
    }

    /// Keys after rope at layer `l`, [Hkv, cached, D], if any are cached (for tests).
    pub fn cached_keys(&self, l: usize) -> Option<&Tensor> {
        self.cache.get(l)?.as_ref().map(|(k, _)| k)
    }
}

/// Every [`ModelSpec`] field, and where this forward pass honours it: destructured without
/// `..`, so a field added to the spec does not compile until the reference computes it too.
fn honoured(spec: &ModelSpec) {
    let ModelSpec {
        architecture: _,
        // Shapes: every weight is loaded with the checkpoint's checked shape.
        num_hidden_layers: _,
        hidden_size: _,
        intermediate_size: _,
        num_attention_heads: _,
        num_key_value_heads: _,
        head_dim: _,
        vocab_size: _,
        // `rms_norm`; `PlainModel::load` (the head); `inverse_frequencies`; `load_layer`.
        rms_norm_eps: _,
        tie_word_embeddings: _,
        rope_theta: _,
        rope_scaling: _,
        attention_bias: _,
        // `attention`: per-head norms, blocks without RoPE.
        qk_norm: _,
        no_rope_layers: _,
        // `inverse_frequencies` and `rope`: RoPE on the leading dimensions only.
        partial_rotary_dim: _,
        // `Reference::check_tokens` refuses sequences past the context or the window.
        max_position_embeddings: _,
        sliding_window: _,
        // Not math.
        dtype: _,
        bos_token_id: _,
        eos_token_ids: _,
        // Where the text decoder came from (its tensors renamed at load).
        text_of: _,
        // `load_norm` (1 + w), `embed`/`embed_rows`, `attention` (scale, window),
        // `rope_tables` (local base), `out_norm`, `activation`.
        gemma: _,
        // `ShortConv::forward`: LFM2's conv blocks and their state.
        short_conv: _,
        // `delta::gated_delta`: Qwen3.5's DeltaNet blocks and their state.
        gated_delta: _,
        // `attention`: sigmoid(gate) times each head's output.
        attention_output_gate: _,
        // `gemma4`: per-layer inputs, full RoPE frequencies, soft-capping; `attention`: the
        // block's own head shape, shared caches, the value norm; `layer`: the scalar.
        gemma4: _,
    } = spec;
}

/// What the blocks of one calibration segment read from outside themselves (Gemma 4): the
/// per-layer inputs of its tokens, and the keys and values of the blocks later ones share. It
/// goes with the segment's hidden state from block to block ([`PlainModel::block_in`] and the
/// true-sequential steps); other models carry nothing in it.
#[derive(Default)]
pub(crate) struct Segment {
    /// [L, T, P].
    per_layer: Option<Tensor>,
    /// Per block: its keys and values, where a later block reads them.
    kv: Vec<Option<(Tensor, Tensor)>>,
}

impl Segment {
    /// Keep block `l`'s keys and values if a later block reads them.
    fn keep(&mut self, spec: &ModelSpec, l: usize, kv: (Tensor, Tensor)) {
        let n = spec.num_hidden_layers;
        if (l + 1..n).any(|b| spec.kv_producer(b) == Some(l)) {
            self.kv.resize(n, None);
            self.kv[l] = Some(kv);
        }
    }
}

/// cos/sin [T, R/2] of the model's RoPE and of Gemma's sliding blocks.
struct RopeTables {
    global: (Tensor, Tensor),
    local: Option<(Tensor, Tensor)>,
}

impl RopeTables {
    fn layer(&self, spec: &ModelSpec, l: usize) -> (&Tensor, &Tensor) {
        let local = spec
            .layer(l)
            .attention()
            .is_some_and(|a| a.rope == crate::arch::Rope::Local);
        let (cos, sin) = match (&self.local, local) {
            (Some(local), true) => local,
            _ => &self.global,
        };
        (cos, sin)
    }
}

/// Gemma's post-attention / post-feed-forward norm of a sublayer output `x` before the residual
/// add (its input shown as a norm input: the graph folds α into it); `x` itself elsewhere.
fn out_norm(
    spec: &ModelSpec,
    w: Option<&Tensor>,
    x: Tensor,
    lo: Option<usize>,
    obs: &mut dyn Observer,
) -> candle_core::Result<Tensor> {
    match w {
        Some(w) => {
            obs.observe(lo, Point::NormInput, &x)?;
            rms_norm(&x, w, spec.rms_norm_eps)
        }
        None => Ok(x),
    }
}

/// The gate's activation: Gemma's tanh-approximated GELU, else SiLU.
fn activation(spec: &ModelSpec, gate: &Tensor) -> candle_core::Result<Tensor> {
    if spec.gemma.is_some() {
        return gelu_tanh(gate);
    }
    // silu(g) = g · sigmoid(g) = g / (1 + e^-g)
    gate / (gate.neg()?.exp()? + 1.0)?
}

/// Where a block's keys and values come from beyond its own call: its cache `slot` (when the
/// call appends to the cache), or the keys and values of the block whose cache it shares.
struct Kv<'a> {
    slot: Option<&'a mut Option<(Tensor, Tensor)>>,
    shared: Option<(Tensor, Tensor)>,
}

/// Self-attention of block weights `w` on its normalised input h [T, H]: q/k/v, rope, the KV
/// cache slot when given (or the shared block's keys and values), causal softmax attention.
/// Returns the o_proj input [T, Hq·D] and the keys and values [Hkv, Tk, D] it attended over.
#[allow(clippy::too_many_arguments)]
fn attention(
    spec: &ModelSpec,
    w: &AttentionWeights,
    h: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    kv: Kv,
    device: &Device,
    lo: Option<usize>,
    obs: &mut dyn Observer,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (t, _) = h.dims2()?;
    // The block's own head shape (Gemma 4's full blocks differ from its sliding ones).
    let shape = lo.and_then(|l| spec.layer(l).attention().copied());
    let (hq, hkv, d) = match shape {
        Some(a) => (spec.num_attention_heads, a.kv_heads, a.head_dim),
        None => (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        ),
    };
    let q = linear(h, &w.q, w.q_bias.as_ref())?;
    // Qwen3.5: each head's q_proj rows are D query rows, then D rows of its output gate.
    let (q, gate) = if spec.attention_output_gate {
        let both = q.reshape((t, hq, 2, d))?;
        let part = |i: usize| both.narrow(2, i, 1)?.reshape((t, hq * d));
        (part(0)?, Some(part(1)?))
    } else {
        (q, None)
    };
    obs.observe(lo, Point::Q, &q)?;
    // [T, heads·D] → [heads, T, D]
    let heads = |x: Tensor, n: usize| -> candle_core::Result<Tensor> {
        x.reshape((t, n, d))?.transpose(0, 1)?.contiguous()
    };
    // Qwen3: RMSNorm over each head's D values, before RoPE.
    let head_norm = |x: Tensor, w: Option<&Tensor>| match w {
        Some(w) => rms_norm(&x, w, spec.rms_norm_eps),
        None => Ok(x),
    };
    // SmolLM3's NoPE blocks leave q and k unrotated.
    let rotates = lo.is_none_or(|l| {
        spec.layer(l)
            .attention()
            .is_some_and(|a| a.rope != crate::arch::Rope::None)
    });
    let q = head_norm(heads(q, hq)?, w.q_norm.as_ref())?;
    let q = if rotates { rope(&q, cos, sin)? } else { q };
    let (k, v) = match kv.shared {
        // Gemma 4's KV sharing: the producer's keys and values, normalised, rotated and with
        // every earlier position.
        Some(shared) => shared,
        None => {
            let wk = w.k.as_ref().ok_or_else(|| {
                candle_core::Error::Msg("a block that shares a cache was run on its own".into())
            })?;
            let k = linear(h, wk, w.k_bias.as_ref())?;
            // Gemma 4's k_eq_v full blocks: the values are the raw key projection.
            let v = match &w.v {
                Some(wv) => linear(h, wv, w.v_bias.as_ref())?,
                None => k.clone(),
            };
            obs.observe(lo, Point::K, &k)?;
            obs.observe(lo, Point::V, &v)?;
            let k = head_norm(heads(k, hkv)?, w.k_norm.as_ref())?;
            let mut k = if rotates { rope(&k, cos, sin)? } else { k };
            let mut v = heads(v, hkv)?;
            if w.v_norm {
                v = rms(&v, spec.rms_norm_eps)?;
            }
            if let Some(slot) = kv.slot {
                if let Some((ck, cv)) = slot.as_ref() {
                    k = Tensor::cat(&[ck, &k], 1)?;
                    v = Tensor::cat(&[cv, &v], 1)?;
                }
                *slot = Some((k.clone(), v.clone()));
            }
            (k, v)
        }
    };
    let tk = k.dim(1)?;
    // Query head h reads key/value head h / groups (HF's repeat_kv): group the query
    // heads of one kv head into one batched matmul.
    let groups = hq / hkv;
    let qg = q.reshape((hkv, groups * t, d))?;
    let scale = spec.attention_scale();
    let scores = (qg.matmul(&k.t()?)? * scale)?.reshape((hq, t, tk))?;
    // The new tokens are the last t of the tk positions: token i sees keys 0..=tk - t + i
    // (within the block's window, if it has one).
    let window = shape.and_then(|a| a.window);
    let visible = causal_mask(t, tk - t, window, device)?.broadcast_as((hq, t, tk))?;
    if obs.wants(Point::Scores) {
        obs.observe(
            lo,
            Point::Scores,
            &visible.where_cond(&scores, &scores.zeros_like()?)?,
        )?;
    }
    let neg_inf = Tensor::new(f32::NEG_INFINITY, device)?.broadcast_as((hq, t, tk))?;
    let scores = visible.where_cond(&scores, &neg_inf)?;
    let probs = softmax_last(&scores)?;
    let attn = probs
        .reshape((hkv, groups * t, tk))?
        .matmul(&v)?
        .reshape((hq, t, d))?
        .transpose(0, 1)?
        .reshape((t, hq * d))?;
    let out = match gate {
        // sigmoid(g) = 1 / (1 + e^-g)
        Some(g) => (attn * (g.neg()?.exp()? + 1.0)?.recip()?)?,
        None => attn,
    };
    Ok((out, k, v))
}

/// LFM2's short convolution on the normalised block input h [T, H]: in_proj to B, C and x,
/// B·x through the depthwise causal convolution (its K − 1 earlier inputs from `state`, zeros
/// when there are none), times C. `state` (when given) is left holding the last K − 1 conv
/// inputs. Returns the out_proj input [T, H].
fn short_conv(
    w: &ConvWeights,
    h: &Tensor,
    state: Option<&mut Option<Tensor>>,
) -> candle_core::Result<Tensor> {
    let (t, hidden) = h.dims2()?;
    let (kernel, _) = w.taps.dims2()?;
    let bcx = linear(h, &w.in_proj, w.in_bias.as_ref())?;
    let (b, c, x) = (
        bcx.narrow(1, 0, hidden)?,
        bcx.narrow(1, hidden, hidden)?,
        bcx.narrow(1, 2 * hidden, hidden)?,
    );
    let bx = (b * x)?;
    let past = match state.as_deref() {
        Some(Some(s)) => s.clone(),
        _ => Tensor::zeros((kernel - 1, hidden), bx.dtype(), bx.device())?,
    };
    // Row i + K − 1 of `seq` is input i; output i sums taps j over rows i .. i + K − 1.
    let seq = Tensor::cat(&[&past, &bx], 0)?;
    let mut y = match &w.taps_bias {
        Some(bias) => bias.unsqueeze(0)?.broadcast_as((t, hidden))?.contiguous()?,
        None => Tensor::zeros((t, hidden), bx.dtype(), bx.device())?,
    };
    for j in 0..kernel {
        y = (y + seq
            .narrow(0, j, t)?
            .broadcast_mul(&w.taps.narrow(0, j, 1)?)?)?;
    }
    if let Some(state) = state {
        *state = Some(seq.narrow(0, t, kernel - 1)?.contiguous()?);
    }
    c * y
}

/// x · W^T (+ b) for x [T, in], W [out, in].
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// x / sqrt(mean(x²) + eps) over the last dimension: an RMSNorm without weight.
fn rms(x: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_mul(&(ms + eps)?.sqrt()?.recip()?)
}

/// HF rotate-half rope on [heads, T, D] with cos/sin [T, R/2]: the first R dimensions rotate,
/// the other D - R pass through (partial RoPE; R = D otherwise).
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (d, half) = (x.dim(D::Minus1)?, cos.dim(D::Minus1)?);
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    if 2 * half == d {
        return Tensor::cat(&[a, b], D::Minus1);
    }
    let pass = x.narrow(D::Minus1, 2 * half, d - 2 * half)?;
    Tensor::cat(&[a, b, pass], D::Minus1)
}

/// Numerically stable softmax over the last dimension.
///
/// Kept as this op chain rather than fused into one pass: calibration runs through it, and
/// GPTQ turns an ulp of different f32 rounding into different index choices, so a fused
/// version would move every calibrated result (docs/quality.md, "Noise floor"). The chain
/// keeps them reproducible.
fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}

/// u8 [T, position + T]: 1 where new token i may see cache/new position j (j <= position + i,
/// and with a window W, j > position + i - W as transformers' `sliding_window_overlay`).
fn causal_mask(
    t: usize,
    position: usize,
    window: Option<usize>,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let tk = position + t;
    let m: Vec<u8> = (0..t)
        .flat_map(|i| {
            let p = position + i;
            (0..tk).map(move |j| u8::from(j <= p && window.is_none_or(|w| j + w > p)))
        })
        .collect();
    Tensor::from_vec(m, (t, tk), device)
}

/// Largest |x| of a tensor of any shape.
pub(crate) fn max_abs(x: &Tensor) -> candle_core::Result<f32> {
    x.abs()?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F32)?
        .to_scalar()
}

/// The last row of a [T, N] tensor as a vector.
pub(crate) fn last_row(x: &Tensor) -> candle_core::Result<Vec<f32>> {
    let t = x.dim(0)?;
    x.i(t - 1)?.to_vec1()
}
