//! What `inspect` reports about a checkpoint.

use serde::Serialize;

use crate::arch::RoleGroup;
use crate::budget;
use crate::checkpoint::Checkpoint;
use crate::quant::Recipe;
use crate::quant::Storage;

/// Tensors, parameters and bytes of one role group.
#[derive(Debug, Clone, Serialize)]
pub struct GroupSummary {
    pub role: &'static str,
    pub tensors: usize,
    pub parameters: u64,
    /// Bytes as stored in the checkpoint.
    pub bytes: u64,
}

/// The `inspect --json` document.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub path: String,
    pub architecture: String,
    /// Parameters, tied weights counted once.
    pub parameters: u64,
    pub layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// Per-head q/k RMSNorms (Qwen3).
    pub qk_norm: bool,
    /// Blocks without RoPE (SmolLM3).
    pub no_rope_layers: Vec<usize>,
    pub rope_theta: f64,
    pub rope_scaling: crate::arch::RopeScaling,
    pub rms_norm_eps: f64,
    /// The dtype most weights are stored in.
    pub dtype: &'static str,
    /// The dtype config.json declares.
    pub config_dtype: Option<String>,
    pub checkpoint_bytes: u64,
    pub groups: Vec<GroupSummary>,
    pub fp16_bytes: u64,
    /// Bytes under the default recipe (projections 4-bit, embedding/lm_head/norms fp16).
    pub default_recipe_bytes: u64,
    /// The recipe `inspect` was given (its file, or the built-in default).
    pub recipe: String,
    /// Bytes under that recipe.
    pub recipe_bytes: u64,
}

/// Summarize `ckpt`, sizing its weights under `recipe` (and the default recipe).
pub fn summarize(ckpt: &Checkpoint, recipe: &Recipe) -> Summary {
    let spec = ckpt.spec();
    let slots = ckpt.slots();
    let default = Recipe::default();
    let mut groups: Vec<GroupSummary> = RoleGroup::ALL
        .iter()
        .map(|g| GroupSummary {
            role: g.as_str(),
            tensors: 0,
            parameters: 0,
            bytes: 0,
        })
        .collect();
    for slot in &slots {
        let g = &mut groups[RoleGroup::ALL
            .iter()
            .position(|x| *x == slot.role.group())
            .expect("every role has a group")];
        g.tensors += 1;
        g.parameters += slot.numel() as u64;
        if let Ok(t) = ckpt.tensor(&slot.name) {
            g.bytes += t.data.len() as u64;
        }
    }
    Summary {
        path: ckpt.dir().display().to_string(),
        architecture: spec.architecture.hf_name().to_string(),
        parameters: slots.iter().map(|s| s.numel() as u64).sum(),
        layers: spec.num_hidden_layers,
        hidden_size: spec.hidden_size,
        intermediate_size: spec.intermediate_size,
        num_attention_heads: spec.num_attention_heads,
        num_key_value_heads: spec.num_key_value_heads,
        head_dim: spec.head_dim,
        vocab_size: spec.vocab_size,
        context_length: spec.max_position_embeddings,
        tie_word_embeddings: spec.tie_word_embeddings,
        attention_bias: spec.attention_bias,
        qk_norm: spec.qk_norm,
        no_rope_layers: spec.no_rope_layers.clone(),
        rope_theta: spec.rope_theta,
        rope_scaling: spec.rope_scaling.clone(),
        rms_norm_eps: spec.rms_norm_eps,
        dtype: ckpt.storage_dtype().short_name(),
        config_dtype: spec.dtype.clone(),
        checkpoint_bytes: ckpt.file_bytes(),
        groups,
        fp16_bytes: budget::weights_bytes(&slots, |_| Storage::Fp16),
        default_recipe_bytes: budget::weights_bytes(&slots, |s| default.storage(s)),
        recipe: recipe.origin().to_string(),
        recipe_bytes: budget::weights_bytes(&slots, |s| recipe.storage(s)),
    }
}
