//! Per-architecture facts: which tensors a checkpoint holds, their shapes and their roles.
//!
//! Llama, Mistral and Qwen2 share one decoder layout; they differ in q/k/v biases (Qwen2),
//! tied embeddings and rope details, all carried by [`ModelSpec`].

use serde::{Deserialize, Serialize};

mod spec;

pub use spec::{Architecture, ModelSpec, RopeScaling};

/// What a tensor does in the model; recipes match on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    Norm,
    /// q/k/v biases (Qwen2): tiny, always kept in fp16.
    Bias,
    LmHead,
}

impl Role {
    pub const ALL: [Role; 11] = [
        Role::Embedding,
        Role::Q,
        Role::K,
        Role::V,
        Role::O,
        Role::Gate,
        Role::Up,
        Role::Down,
        Role::Norm,
        Role::Bias,
        Role::LmHead,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::Q => "q",
            Role::K => "k",
            Role::V => "v",
            Role::O => "o",
            Role::Gate => "gate",
            Role::Up => "up",
            Role::Down => "down",
            Role::Norm => "norm",
            Role::Bias => "bias",
            Role::LmHead => "lm_head",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The coarse group `inspect` reports.
    pub fn group(self) -> RoleGroup {
        match self {
            Role::Embedding => RoleGroup::Embedding,
            Role::Q | Role::K | Role::V | Role::O | Role::Bias => RoleGroup::Attention,
            Role::Gate | Role::Up | Role::Down => RoleGroup::Mlp,
            Role::Norm => RoleGroup::Norms,
            Role::LmHead => RoleGroup::LmHead,
        }
    }

    /// A 2-D projection inside a decoder block (the bulk a recipe palettizes).
    pub fn is_projection(self) -> bool {
        matches!(
            self,
            Role::Q | Role::K | Role::V | Role::O | Role::Gate | Role::Up | Role::Down
        )
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rows of the `inspect` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleGroup {
    Embedding,
    Attention,
    Mlp,
    Norms,
    LmHead,
}

impl RoleGroup {
    pub const ALL: [RoleGroup; 5] = [
        RoleGroup::Embedding,
        RoleGroup::Attention,
        RoleGroup::Mlp,
        RoleGroup::Norms,
        RoleGroup::LmHead,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RoleGroup::Embedding => "embedding",
            RoleGroup::Attention => "attention",
            RoleGroup::Mlp => "mlp",
            RoleGroup::Norms => "norms",
            RoleGroup::LmHead => "lm_head",
        }
    }
}

/// One tensor the architecture expects in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSlot {
    /// The Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    /// Decoder block index, `None` for embedding, final norm and lm_head.
    pub layer: Option<usize>,
}

impl TensorSlot {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Every tensor the checkpoint must hold, in model order. With tied embeddings there is no
/// `lm_head.weight` slot: the embedding serves both roles.
pub fn expected_tensors(spec: &ModelSpec) -> Vec<TensorSlot> {
    let h = spec.hidden_size;
    let q = spec.q_dim();
    let kv = spec.kv_dim();
    let i = spec.intermediate_size;
    let mut out = Vec::with_capacity(spec.num_hidden_layers * 12 + 3);
    let slot = |name: String, shape: Vec<usize>, role: Role, layer: Option<usize>| TensorSlot {
        name,
        shape,
        role,
        layer,
    };
    out.push(slot(
        "model.embed_tokens.weight".into(),
        vec![spec.vocab_size, h],
        Role::Embedding,
        None,
    ));
    for l in 0..spec.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push(slot(
            format!("{p}.input_layernorm.weight"),
            vec![h],
            Role::Norm,
            Some(l),
        ));
        out.push(slot(
            format!("{p}.self_attn.q_proj.weight"),
            vec![q, h],
            Role::Q,
            Some(l),
        ));
        out.push(slot(
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv, h],
            Role::K,
            Some(l),
        ));
        out.push(slot(
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv, h],
            Role::V,
            Some(l),
        ));
        if spec.attention_bias {
            out.push(slot(
                format!("{p}.self_attn.q_proj.bias"),
                vec![q],
                Role::Bias,
                Some(l),
            ));
            out.push(slot(
                format!("{p}.self_attn.k_proj.bias"),
                vec![kv],
                Role::Bias,
                Some(l),
            ));
            out.push(slot(
                format!("{p}.self_attn.v_proj.bias"),
                vec![kv],
                Role::Bias,
                Some(l),
            ));
        }
        out.push(slot(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, q],
            Role::O,
            Some(l),
        ));
        out.push(slot(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Role::Norm,
            Some(l),
        ));
        out.push(slot(
            format!("{p}.mlp.gate_proj.weight"),
            vec![i, h],
            Role::Gate,
            Some(l),
        ));
        out.push(slot(
            format!("{p}.mlp.up_proj.weight"),
            vec![i, h],
            Role::Up,
            Some(l),
        ));
        out.push(slot(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, i],
            Role::Down,
            Some(l),
        ));
    }
    out.push(slot("model.norm.weight".into(), vec![h], Role::Norm, None));
    if !spec.tie_word_embeddings {
        out.push(slot(
            "lm_head.weight".into(),
            vec![spec.vocab_size, h],
            Role::LmHead,
            None,
        ));
    }
    out
}

/// The MIL-safe name of a checkpoint tensor: `model.layers.0.self_attn.q_proj.weight` →
/// `model_layers_0_self_attn_q_proj_weight`. Packages name weight ops this way so they map
/// back to their source.
pub fn mil_name(hf_name: &str) -> String {
    hf_name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tied: bool, bias: bool) -> ModelSpec {
        let arch = if bias {
            "Qwen2ForCausalLM"
        } else {
            "LlamaForCausalLM"
        };
        let text = format!(
            r#"{{"architectures":["{arch}"],"hidden_size":64,"intermediate_size":96,"num_attention_heads":4,
            "num_hidden_layers":2,"num_key_value_heads":2,"vocab_size":50,"tie_word_embeddings":{tied}}}"#
        );
        ModelSpec::from_config_str(&text).unwrap()
    }

    #[test]
    fn tensor_counts_follow_ties_and_biases() {
        assert_eq!(expected_tensors(&spec(true, false)).len(), 1 + 2 * 9 + 1);
        assert_eq!(expected_tensors(&spec(false, false)).len(), 1 + 2 * 9 + 2);
        assert_eq!(expected_tensors(&spec(false, true)).len(), 1 + 2 * 12 + 2);
    }

    #[test]
    fn gqa_shapes() {
        let t = expected_tensors(&spec(true, false));
        let k = t
            .iter()
            .find(|s| s.name == "model.layers.1.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k.shape, vec![32, 64]);
        assert_eq!(k.role, Role::K);
        assert_eq!(k.layer, Some(1));
    }

    #[test]
    fn mil_names() {
        assert_eq!(
            mil_name("model.layers.0.self_attn.q_proj.weight"),
            "model_layers_0_self_attn_q_proj_weight"
        );
    }
}
