//! Tensor names, llama.cpp's q/k row permutation, and a streaming fp16 safetensors writer.

use std::collections::BTreeMap;

use half::f16;

use crate::arch::{LayerTensor, TensorId};

/// How a GGUF tensor becomes a Hugging Face one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TensorPlan {
    pub gguf_name: String,
    pub hf_name: String,
    /// Row-major shape in the Hugging Face checkpoint (the GGUF's too, unless `squeezed`).
    pub shape: Vec<usize>,
    /// Undo llama.cpp's rope permutation with this many heads (q and k projections only).
    pub unpermute_heads: Option<usize>,
    /// Stored as 1 + w (Gemma's and Qwen3.5's norms): subtract 1.
    pub minus_one: bool,
    /// Stored without `shape`'s dimension 1 of size 1: llama.cpp squeezes a depthwise
    /// convolution's [C, 1, K] taps to [C, K] (LFM2's and Qwen3.5's).
    pub squeezed: bool,
    /// Stored as −exp(w) (Qwen3.5's `ssm_a` holds A = −exp(A_log)): w = ln(−x).
    pub negated_exp: bool,
    /// Value heads stored tiled (Qwen3.5 when key heads ≠ value heads): put back grouped.
    pub tiled_heads: Option<TiledHeads>,
}

impl TensorPlan {
    /// The tensor's shape in the GGUF file.
    pub fn gguf_shape(&self) -> Vec<usize> {
        match (self.squeezed, self.shape.as_slice()) {
            (true, [c, 1, k]) => vec![*c, *k],
            _ => self.shape.clone(),
        }
    }
}

/// llama.cpp's `_reorder_v_heads` on one axis of a Qwen3.5 tensor: the `key_heads × ratio`
/// value heads of `head_dim` each, starting `offset` entries into the axis, are stored tiled
/// (value head `r` of every key group, then `r + 1`: [ratio, key_heads, head_dim]), where
/// transformers has them grouped (each key head's `ratio` value heads together:
/// [key_heads, ratio, head_dim]). The axis is the rows, or the columns with `columns`
/// (`out_proj`, which reads the value heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledHeads {
    pub key_heads: usize,
    pub ratio: usize,
    pub head_dim: usize,
    pub offset: usize,
    pub columns: bool,
}

impl TiledHeads {
    /// The stored (tiled) index of grouped index `i` along the axis.
    fn tiled_index(&self, i: usize) -> usize {
        let span = self.key_heads * self.ratio * self.head_dim;
        if i < self.offset || i >= self.offset + span {
            return i;
        }
        let j = i - self.offset;
        let (head, d) = (j / self.head_dim, j % self.head_dim);
        let (k, r) = (head / self.ratio, head % self.ratio);
        self.offset + (r * self.key_heads + k) * self.head_dim + d
    }

    /// Grouped from tiled: the importer's direction. `data` is [rows, cols] row-major, and
    /// the caller guarantees the axis holds `offset + key_heads·ratio·head_dim` entries or
    /// more.
    pub fn untile(&self, data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        self.apply(data, rows, cols, false)
    }

    /// Tiled from grouped: llama.cpp's converter's direction (test fixtures).
    pub fn tile(&self, data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        self.apply(data, rows, cols, true)
    }

    fn apply(&self, data: &[f32], rows: usize, cols: usize, to_tiled: bool) -> Vec<f32> {
        let mut out = vec![0.0f32; data.len()];
        for r in 0..rows {
            for c in 0..cols {
                let (gr, gc) = match self.columns {
                    false => (self.tiled_index(r), c),
                    true => (r, self.tiled_index(c)),
                };
                let (grouped, tiled) = (r * cols + c, gr * cols + gc);
                match to_tiled {
                    true => out[tiled] = data[grouped],
                    false => out[grouped] = data[tiled],
                }
            }
        }
        out
    }
}

/// llama.cpp's name of a tensor; `post_attention_norm` where the architecture names its
/// `post_attention_layernorm` so (Gemma's four norms a block, whose `ffn_norm` is the MLP's
/// input norm; Qwen3.5's); `token_embd_norm` for LFM2's final norm (`embedding_norm`).
pub fn gguf_name(id: TensorId, post_attention_norm: bool) -> String {
    let (part, suffix) = match id {
        TensorId::Embedding => return "token_embd.weight".into(),
        TensorId::FinalNorm => return "output_norm.weight".into(),
        TensorId::LmHead => return "output.weight".into(),
        // llama.cpp's per-layer embedding names (Gemma 3n's, which Gemma 4 shares).
        TensorId::PerLayerEmbedding => return "per_layer_token_embd.weight".into(),
        TensorId::PerLayerModelProjection => return "per_layer_model_proj.weight".into(),
        TensorId::PerLayerProjectionNorm => return "per_layer_proj_norm.weight".into(),
        TensorId::Layer(_, t) => match t {
            LayerTensor::InputNorm => ("attn_norm", "weight"),
            LayerTensor::PostNorm if post_attention_norm => ("post_attention_norm", "weight"),
            LayerTensor::PostNorm | LayerTensor::PreFfnNorm => ("ffn_norm", "weight"),
            LayerTensor::PostFfnNorm => ("post_ffw_norm", "weight"),
            LayerTensor::Q => ("attn_q", "weight"),
            LayerTensor::K => ("attn_k", "weight"),
            LayerTensor::V => ("attn_v", "weight"),
            LayerTensor::O => ("attn_output", "weight"),
            LayerTensor::Gate => ("ffn_gate", "weight"),
            LayerTensor::Up => ("ffn_up", "weight"),
            LayerTensor::Down => ("ffn_down", "weight"),
            LayerTensor::QBias => ("attn_q", "bias"),
            LayerTensor::KBias => ("attn_k", "bias"),
            LayerTensor::VBias => ("attn_v", "bias"),
            LayerTensor::QNorm => ("attn_q_norm", "weight"),
            LayerTensor::KNorm => ("attn_k_norm", "weight"),
            // llama.cpp's `lfm2` names (src/llama-arch.cpp).
            LayerTensor::ConvIn => ("shortconv.in_proj", "weight"),
            LayerTensor::ConvInBias => ("shortconv.in_proj", "bias"),
            LayerTensor::Conv => ("shortconv.conv", "weight"),
            LayerTensor::ConvBias => ("shortconv.conv", "bias"),
            LayerTensor::ConvOut => ("shortconv.out_proj", "weight"),
            LayerTensor::ConvOutBias => ("shortconv.out_proj", "bias"),
            // llama.cpp's `qwen35` names (src/llama-arch.cpp); `ssm_a` has no suffix and
            // holds −exp(A_log).
            LayerTensor::DeltaQkv => ("attn_qkv", "weight"),
            LayerTensor::DeltaZ => ("attn_gate", "weight"),
            LayerTensor::DeltaB => ("ssm_beta", "weight"),
            LayerTensor::DeltaA => ("ssm_alpha", "weight"),
            LayerTensor::DeltaConv => ("ssm_conv1d", "weight"),
            LayerTensor::DeltaDtBias => ("ssm_dt", "bias"),
            LayerTensor::DeltaALog => return format!("blk.{}.ssm_a", id.layer().unwrap_or(0)),
            LayerTensor::DeltaNorm => ("ssm_norm", "weight"),
            LayerTensor::DeltaOut => ("ssm_out", "weight"),
            LayerTensor::PerLayerGate => ("inp_gate", "weight"),
            LayerTensor::PerLayerProjection => ("proj", "weight"),
            LayerTensor::PerLayerNorm => ("post_norm", "weight"),
            LayerTensor::LayerScalar => ("layer_output_scale", "weight"),
        },
    };
    format!("blk.{}.{part}.{suffix}", id.layer().unwrap_or(0))
}

/// The Hugging Face name of a llama/qwen2 GGUF tensor, `None` for names outside the llama layout.
pub fn hf_tensor_name(gguf: &str) -> Option<String> {
    tensor_id(gguf).map(TensorId::hf_name)
}

/// Which tensor of the model a llama GGUF tensor is, `None` for names outside the llama layout.
pub fn tensor_id(gguf: &str) -> Option<TensorId> {
    match gguf {
        "token_embd.weight" => return Some(TensorId::Embedding),
        "output_norm.weight" => return Some(TensorId::FinalNorm),
        "output.weight" => return Some(TensorId::LmHead),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    // Only canonical decimal layer numbers: `blk.01` would alias `blk.1`.
    if layer.is_empty()
        || !layer.bytes().all(|b| b.is_ascii_digit())
        || (layer.len() > 1 && layer.starts_with('0'))
    {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    if suffix == "bias" {
        let bias = match part {
            "attn_q" => LayerTensor::QBias,
            "attn_k" => LayerTensor::KBias,
            "attn_v" => LayerTensor::VBias,
            _ => return None,
        };
        return Some(TensorId::Layer(layer, bias));
    }
    if suffix != "weight" {
        return None;
    }
    let tensor = match part {
        "attn_norm" => LayerTensor::InputNorm,
        "ffn_norm" => LayerTensor::PostNorm,
        "attn_q" => LayerTensor::Q,
        "attn_k" => LayerTensor::K,
        "attn_v" => LayerTensor::V,
        "attn_output" => LayerTensor::O,
        "attn_q_norm" => LayerTensor::QNorm,
        "attn_k_norm" => LayerTensor::KNorm,
        "ffn_gate" => LayerTensor::Gate,
        "ffn_up" => LayerTensor::Up,
        "ffn_down" => LayerTensor::Down,
        _ => return None,
    };
    Some(TensorId::Layer(layer, tensor))
}

/// Undo llama.cpp's `permute(w, n_head)` on a `[rows, cols]` matrix.
///
/// llama.cpp stores each head's rows interleaved as (pair index, half) so its rope rotates
/// adjacent elements; transformers rotates the two halves of a head. Row `h·d + 2i + j` of
/// the GGUF matrix is row `h·d + j·d/2 + i` of the Hugging Face one (d = rows / n_head).
/// The caller guarantees `rows` is a multiple of `2·n_head` and `data.len() == rows·cols`.
pub fn unpermute_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let head_rows = rows / n_head;
    let half = head_rows / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_rows + 2 * i + j;
                let dst = h * head_rows + j * half + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// llama.cpp's `permute`, the inverse of [`unpermute_rows`] (used to build test fixtures the
/// way llama.cpp's converter does).
pub fn permute_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let head_rows = rows / n_head;
    let half = head_rows / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let hf = h * head_rows + j * half + i;
                let gg = h * head_rows + 2 * i + j;
                out[gg * cols..(gg + 1) * cols].copy_from_slice(&data[hf * cols..(hf + 1) * cols]);
            }
        }
    }
    out
}

/// f32 → little-endian f16 bytes; `Err(index)` of the first value that is not finite in f16.
pub fn to_f16_bytes(values: &[f32]) -> Result<Vec<u8>, usize> {
    let mut out = Vec::with_capacity(values.len() * 2);
    for (i, &v) in values.iter().enumerate() {
        let h = f16::from_f32(v);
        if !h.is_finite() {
            return Err(i);
        }
        out.extend_from_slice(&h.to_le_bytes());
    }
    Ok(out)
}

/// The safetensors header for fp16 tensors written back to back in `entries` order.
/// Returns the header bytes (length prefix included, padded to 8 bytes as safetensors does).
pub fn safetensors_header(entries: &[(&str, &[usize])]) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    map.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut offset = 0usize;
    let mut sorted: BTreeMap<&str, serde_json::Value> = BTreeMap::new();
    for (name, shape) in entries {
        let n = shape.iter().product::<usize>() * 2;
        sorted.insert(
            name,
            serde_json::json!({
                "dtype": "F16",
                "shape": shape,
                "data_offsets": [offset, offset + n],
            }),
        );
        offset += n;
    }
    for (k, v) in sorted {
        map.insert(k.to_string(), v);
    }
    let mut json = serde_json::Value::Object(map).to_string().into_bytes();
    // safetensors pads the header with spaces so the data section starts 8-aligned.
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_map_like_llama_cpp() {
        assert_eq!(
            hf_tensor_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_tensor_name("blk.0.ffn_down.weight").as_deref(),
            Some("model.layers.0.mlp.down_proj.weight")
        );
        assert_eq!(
            hf_tensor_name("output.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(hf_tensor_name("blk.01.attn_q.weight"), None);
        assert_eq!(
            hf_tensor_name("blk.1.attn_q.bias").as_deref(),
            Some("model.layers.1.self_attn.q_proj.bias")
        );
        assert_eq!(hf_tensor_name("blk.1.attn_output.bias"), None);
        assert_eq!(hf_tensor_name("rope_freqs.weight"), None);
        assert_eq!(hf_tensor_name("blk..attn_q.weight"), None);
    }

    #[test]
    fn unpermute_known_head() {
        // One head of 4 rows, 1 column: llama.cpp order is (i0 j0, i0 j1, i1 j0, i1 j1), i.e.
        // HF rows 0, 2, 1, 3.
        let gguf = [0.0, 2.0, 1.0, 3.0];
        assert_eq!(unpermute_rows(&gguf, 4, 1, 1), vec![0.0, 1.0, 2.0, 3.0]);
    }

    proptest! {
        #[test]
        fn permute_round_trips(heads in 1usize..5, half in 1usize..5, cols in 1usize..4, seed in 0u32..1000) {
            let rows = heads * half * 2;
            let data: Vec<f32> = (0..rows * cols).map(|i| (i as u32 ^ seed) as f32).collect();
            let p = permute_rows(&data, rows, cols, heads);
            prop_assert_eq!(unpermute_rows(&p, rows, cols, heads), data);
        }
    }

    /// 2 key heads of 3 value heads each: transformers' grouped order k0r0 k0r1 k0r2 k1r0
    /// k1r1 k1r2 is stored by llama.cpp (`reshape(nk, r, hd).swapaxes(0, 1)`) tiled as k0r0 k1r0
    /// k0r1 k1r1 k0r2 k1r2; with ratio ≠ key heads, tiling twice is not untiling.
    #[test]
    fn value_heads_tile_as_llama_cpp_does() {
        let t = TiledHeads {
            key_heads: 2,
            ratio: 3,
            head_dim: 1,
            offset: 0,
            columns: false,
        };
        let grouped: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let tiled = [0.0, 3.0, 1.0, 4.0, 2.0, 5.0];
        assert_eq!(t.tile(&grouped, 6, 1), tiled);
        assert_eq!(t.untile(&tiled, 6, 1), grouped);
        assert_ne!(t.tile(&tiled, 6, 1), grouped);
        // Columns past an offset (out_proj reads heads of 2 from column 1 on); rows as they are.
        let c = TiledHeads {
            head_dim: 2,
            offset: 1,
            columns: true,
            ..t
        };
        let row: Vec<f32> = (0..13).map(|v| v as f32).collect();
        let want = [0., 1., 2., 7., 8., 3., 4., 9., 10., 5., 6., 11., 12.];
        assert_eq!(c.tile(&row, 1, 13), want);
    }

    proptest! {
        #[test]
        fn tiling_round_trips(nk in 1usize..4, ratio in 1usize..4, hd in 1usize..4,
                              offset in 0usize..3, extra in 0usize..3, cols in 1usize..3,
                              columns: bool) {
            let t = TiledHeads { key_heads: nk, ratio, head_dim: hd, offset, columns };
            let axis = offset + nk * ratio * hd + extra;
            let (rows, cols) = if columns { (cols, axis) } else { (axis, cols) };
            let data: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            prop_assert_eq!(t.untile(&t.tile(&data, rows, cols), rows, cols), data);
        }
    }

    #[test]
    fn header_is_aligned_and_parses() {
        let header = safetensors_header(&[("b", &[2, 3]), ("a", &[5])]);
        let n = u64::from_le_bytes(header[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        assert_eq!(header.len(), 8 + n);
        let mut file = header.clone();
        file.extend(vec![0u8; (6 + 5) * 2]);
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(st.tensor("b").unwrap().shape(), &[2, 3]);
        assert_eq!(st.tensor("a").unwrap().data().len(), 10);
    }

    #[test]
    fn f16_overflow_is_reported() {
        assert!(to_f16_bytes(&[1.0, 70000.0]).is_err_and(|i| i == 1));
        assert_eq!(
            to_f16_bytes(&[1.0]).unwrap(),
            f16::ONE.to_le_bytes().to_vec()
        );
    }

    /// Every tensor name of a llama GGUF (llama.cpp's `LLM_TENSOR_NAMES`) and its name in
    /// transformers' `LlamaForCausalLM`, written out.
    #[test]
    fn every_llama_name_maps() {
        let table = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.3.attn_norm.weight",
                "model.layers.3.input_layernorm.weight",
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            (
                "blk.3.attn_k.weight",
                "model.layers.3.self_attn.k_proj.weight",
            ),
            (
                "blk.3.attn_v.weight",
                "model.layers.3.self_attn.v_proj.weight",
            ),
            (
                "blk.3.attn_output.weight",
                "model.layers.3.self_attn.o_proj.weight",
            ),
            (
                "blk.3.ffn_gate.weight",
                "model.layers.3.mlp.gate_proj.weight",
            ),
            ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
            (
                "blk.3.ffn_down.weight",
                "model.layers.3.mlp.down_proj.weight",
            ),
            (
                "blk.10.attn_q.bias",
                "model.layers.10.self_attn.q_proj.bias",
            ),
            (
                "blk.10.attn_k.bias",
                "model.layers.10.self_attn.k_proj.bias",
            ),
            (
                "blk.10.attn_v.bias",
                "model.layers.10.self_attn.v_proj.bias",
            ),
        ];
        for (gguf, hf) in table {
            assert_eq!(hf_tensor_name(gguf).as_deref(), Some(hf), "{gguf}");
        }
        // Layer numbers are canonical decimals only (`+1` and ` 1` parse as 1 in Rust).
        for bad in [
            "blk.+1.attn_q.weight",
            "blk.1x.attn_q.weight",
            "blk.-1.attn_q.weight",
            "blk.1.attn_q.scale",
            "blk.1.ffn_down.bias",
        ] {
            assert_eq!(hf_tensor_name(bad), None, "{bad}");
        }
    }

    /// Two heads of six rows, as llama.cpp's converter writes them:
    /// `w.reshape(n_head, 2, d/2, cols).swapaxes(1, 2)` puts Hugging Face row `h·d + j·d/2 + i`
    /// at GGUF row `h·d + 2i + j`, i.e. rows 0 3 1 4 2 5 | 6 9 7 10 8 11.
    #[test]
    fn two_heads_in_llama_cpp_order() {
        let gguf_order = [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11];
        let cols = 2;
        let hf: Vec<f32> = (0..12 * cols).map(|v| v as f32).collect();
        let gguf: Vec<f32> = gguf_order
            .iter()
            .flat_map(|&r| [(r * cols) as f32, (r * cols + 1) as f32])
            .collect();
        assert_eq!(unpermute_rows(&gguf, 12, cols, 2), hf);
        assert_eq!(permute_rows(&hf, 12, cols, 2), gguf);
    }
}
