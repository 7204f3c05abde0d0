//! Gemma 4's additions to the plain forward pass (docs/reference/gemma4.md §2): the per-layer
//! inputs computed once from the tokens and their embeddings, the sub-block that adds a block's
//! share of them to the residual stream, the proportional RoPE frequencies of the full blocks
//! and the soft-capped logits.

use candle_core::{Device, Tensor};

use super::primitives;
use super::reference_error::ReferenceError;
use crate::arch::{ModelSpec, TensorId};
use crate::checkpoint::Checkpoint;

/// The model-level weights of the per-layer inputs.
pub(super) struct PerLayerInput {
    /// [rows, L·P] in f32 (`embed_tokens_per_layer`), or only the rows of some tokens.
    table: Tensor,
    /// With only some rows: token id → its row in `table`.
    index: Option<std::collections::HashMap<u32, u32>>,
    /// [L·P, H] (`per_layer_model_projection`).
    projection: Tensor,
    /// [P] (`per_layer_projection_norm`).
    norm: Tensor,
}

/// A block's per-layer input sub-block.
pub(super) struct PerLayerBlock {
    /// [P, H] (`per_layer_input_gate`).
    pub gate: Tensor,
    /// [H, P] (`per_layer_projection`).
    pub projection: Tensor,
    /// [H] (`post_per_layer_input_norm`).
    pub norm: Tensor,
}

impl PerLayerInput {
    /// The model's per-layer input weights, if it has per-layer inputs.
    pub(super) fn load(ckpt: &Checkpoint, device: &Device) -> Result<Option<Self>, ReferenceError> {
        if ckpt.spec().per_layer_input() == 0 {
            return Ok(None);
        }
        let get = |id: TensorId| primitives::load(ckpt, &id.hf_name(), device);
        Ok(Some(PerLayerInput {
            table: get(TensorId::PerLayerEmbedding)?,
            index: None,
            projection: get(TensorId::PerLayerModelProjection)?,
            norm: get(TensorId::PerLayerProjectionNorm)?,
        }))
    }

    /// [`load`](Self::load) with the table's rows of `tokens` only, read from the checkpoint
    /// row by row: E2B's whole table is 9.4 GB in f32, a text's rows a few MB.
    pub(super) fn load_rows(
        ckpt: &Checkpoint,
        tokens: &[u32],
        device: &Device,
    ) -> Result<Option<Self>, ReferenceError> {
        if ckpt.spec().per_layer_input() == 0 {
            return Ok(None);
        }
        let name = TensorId::PerLayerEmbedding.hf_name();
        let table = ckpt.tensor(&name)?;
        let width = table.shape.get(1).copied().unwrap_or(0);
        let mut distinct: Vec<u32> = tokens.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let mut values = Vec::with_capacity(distinct.len() * width);
        for &t in &distinct {
            let row = table.row(t as usize).ok_or_else(|| {
                ReferenceError::candle(
                    format!("reading `{name}`"),
                    candle_core::Error::Msg(format!("token {t} has no per-layer row")),
                )
            })?;
            values.extend(row.to_f32());
        }
        let rows = Tensor::from_vec(values, (distinct.len(), width), device)
            .map_err(|e| ReferenceError::candle(format!("reading `{name}`"), e))?;
        let index = distinct
            .iter()
            .enumerate()
            .map(|(i, &t)| (t, i as u32))
            .collect();
        let get = |id: TensorId| primitives::load(ckpt, &id.hf_name(), device);
        Ok(Some(PerLayerInput {
            table: rows,
            index: Some(index),
            projection: get(TensorId::PerLayerModelProjection)?,
            norm: get(TensorId::PerLayerProjectionNorm)?,
        }))
    }

    /// Every block's per-layer input [L, T, P] for `tokens`, whose embedding rows (already
    /// times √H) are `embedded` [T, H]: (RMSNorm(embedded·Wᵀ / √H) + table rows · √P) / √2.
    pub(super) fn inputs(
        &self,
        spec: &ModelSpec,
        tokens: &[u32],
        embedded: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let g = spec
            .gemma4
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("per-layer inputs outside Gemma 4".into()))?;
        let (t, h) = embedded.dims2()?;
        let (layers, p) = (spec.num_hidden_layers, g.per_layer_input);
        let at: Vec<u32> = match &self.index {
            None => tokens.to_vec(),
            Some(index) => tokens
                .iter()
                .map(|t| {
                    index.get(t).copied().ok_or_else(|| {
                        candle_core::Error::Msg(format!("token {t}'s per-layer row is not loaded"))
                    })
                })
                .collect::<candle_core::Result<_>>()?,
        };
        let ids = Tensor::from_slice(&at, t, embedded.device())?;
        let rows = (self.table.index_select(&ids, 0)? * g.per_layer_scale)?;
        let rows = rows.reshape((t, layers, p))?;
        let projected = (embedded.matmul(&self.projection.t()?)? * (h as f64).powf(-0.5))?;
        let projected = primitives::rms_norm(
            &projected.reshape((t, layers, p))?,
            &self.norm,
            spec.rms_norm_eps,
        )?;
        // [T, L, P] → [L, T, P]: block l takes row l.
        ((projected + rows)? * std::f64::consts::FRAC_1_SQRT_2)?
            .transpose(0, 1)?
            .contiguous()
    }
}

impl PerLayerBlock {
    /// Block `l`'s per-layer input weights, if the model has per-layer inputs.
    pub(super) fn load(
        ckpt: &Checkpoint,
        l: usize,
        device: &Device,
    ) -> Result<Option<Self>, ReferenceError> {
        use crate::arch::LayerTensor;
        if ckpt.spec().per_layer_input() == 0 {
            return Ok(None);
        }
        let get = |t: LayerTensor| primitives::load(ckpt, &crate::arch::tensor_name(l, t), device);
        Ok(Some(PerLayerBlock {
            gate: get(LayerTensor::PerLayerGate)?,
            projection: get(LayerTensor::PerLayerProjection)?,
            norm: get(LayerTensor::PerLayerNorm)?,
        }))
    }

    /// The residual stream `x` [T, H] plus RMSNorm(act(x·Gᵀ) ⊙ input · Pᵀ), `input` [T, P]
    /// being the block's per-layer input.
    pub(super) fn forward(
        &self,
        spec: &ModelSpec,
        x: &Tensor,
        input: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let gate = primitives::gelu_tanh(&x.matmul(&self.gate.t()?)?)?;
        let y = (gate * input)?.matmul(&self.projection.t()?)?;
        x + primitives::rms_norm(&y, &self.norm, spec.rms_norm_eps)?
    }
}

/// The full blocks' inverse frequencies ([`crate::arch::Gemma4Spec::full_inv_freq`]) in f32.
pub(super) fn global_frequencies(spec: &ModelSpec) -> Option<Vec<f32>> {
    let g = spec.gemma4.as_ref()?;
    Some(
        g.full_inv_freq(spec.rope_theta)
            .into_iter()
            .map(|f| f as f32)
            .collect(),
    )
}

/// c·tanh(logits / c) with Gemma 4's `final_logit_softcapping` c; the logits as they are
/// otherwise.
pub(super) fn softcap(spec: &ModelSpec, logits: Tensor) -> candle_core::Result<Tensor> {
    match spec.gemma4.as_ref().and_then(|g| g.final_logit_softcapping) {
        Some(c) => (logits / c)?.tanh()? * c,
        None => Ok(logits),
    }
}
