//! What each decoder block is ([`LayerKind`]) and the state it carries from one call to the next
//! ([`StateEntry`]): the one place the float reference, the graph, `budget` and the runner's
//! cache learn which blocks attend over which positions, how they rotate, and what memory a
//! sequence costs them. A block kind is added here first (with its state), then lowered.

use super::ModelSpec;

/// What one decoder block computes beside its norms and MLP.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LayerKind {
    /// Softmax attention over cached key and value rows, one row per position.
    Attention(Attention),
    /// LFM2's gated short convolution: a fixed-size state, whatever the context.
    ShortConv(ShortConv),
    /// Qwen3.5's Gated DeltaNet: a short convolution, then linear attention whose state is a
    /// fixed-size matrix per value head.
    GatedDelta(GatedDelta),
}

/// A Gated DeltaNet block's shape (see [`crate::arch::GatedDeltaSpec`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedDelta {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub kernel: usize,
}

impl GatedDelta {
    /// The convolution's channels: q, k and v side by side.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// A short-convolution block's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShortConv {
    /// Channels of the depthwise convolution (the hidden size).
    pub channels: usize,
    /// Its taps; the state holds the last `kernel − 1` inputs.
    pub kernel: usize,
    pub bias: bool,
}

/// An attention block's shape and reach.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Token i sees keys j with i − window < j ≤ i only (Gemma 3's sliding blocks; every
    /// block of a model with `sliding_window`); `None`: every earlier position.
    pub window: Option<usize>,
    pub rope: Rope,
    /// The earlier block whose keys and values it attends over, keeping none of its own
    /// (Gemma 4's KV sharing); `None`: its own.
    pub kv_from: Option<usize>,
}

/// How an attention block rotates its queries and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    /// Not at all (SmolLM3's NoPE blocks).
    None,
    /// With the model's base and scaling (`rope_theta`, `rope_scaling`).
    Global,
    /// With Gemma 3's sliding blocks' own base and no scaling.
    Local,
}

/// One tensor of state a block keeps per sequence, fp16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateEntry {
    /// Key rows [heads, S, head_dim]: a row per position.
    Keys { heads: usize, head_dim: usize },
    /// Value rows [heads, S, head_dim].
    Values { heads: usize, head_dim: usize },
    /// A convolution's last inputs [width, channels], oldest first: the same size at any
    /// context length.
    Conv { channels: usize, width: usize },
    /// A Gated DeltaNet's state [value heads, key_dim, value_dim]: the same size at any
    /// context length.
    Delta {
        heads: usize,
        key_dim: usize,
        value_dim: usize,
    },
}

impl StateEntry {
    /// Its shape at context length `max_seq_len`.
    pub fn shape(&self, max_seq_len: usize) -> Vec<usize> {
        match *self {
            StateEntry::Keys { heads, head_dim } | StateEntry::Values { heads, head_dim } => {
                vec![heads, max_seq_len, head_dim]
            }
            StateEntry::Conv { channels, width } => vec![width, channels],
            StateEntry::Delta {
                heads,
                key_dim,
                value_dim,
            } => vec![heads, key_dim, value_dim],
        }
    }

    /// Its size in bytes at context length `max_seq_len` (fp16).
    pub fn bytes(&self, max_seq_len: usize) -> u64 {
        self.shape(max_seq_len)
            .iter()
            .map(|&d| d as u64)
            .product::<u64>()
            * 2
    }
}

impl LayerKind {
    /// The state the block keeps per sequence.
    pub fn state(&self) -> Vec<StateEntry> {
        match *self {
            LayerKind::Attention(a) if a.kv_from.is_some() => Vec::new(),
            LayerKind::Attention(a) => {
                let (heads, head_dim) = (a.kv_heads, a.head_dim);
                vec![
                    StateEntry::Keys { heads, head_dim },
                    StateEntry::Values { heads, head_dim },
                ]
            }
            LayerKind::ShortConv(c) => vec![StateEntry::Conv {
                channels: c.channels,
                width: c.kernel - 1,
            }],
            LayerKind::GatedDelta(g) => vec![
                StateEntry::Conv {
                    channels: g.conv_channels(),
                    width: g.kernel - 1,
                },
                StateEntry::Delta {
                    heads: g.value_heads,
                    key_dim: g.key_dim,
                    value_dim: g.value_dim,
                },
            ],
        }
    }

    /// The attention block's parameters, if it attends.
    pub fn attention(&self) -> Option<&Attention> {
        match self {
            LayerKind::Attention(a) => Some(a),
            LayerKind::ShortConv(_) | LayerKind::GatedDelta(_) => None,
        }
    }

    /// The depthwise convolution's (channels, kernel) of a block that convolves.
    pub fn conv(&self) -> Option<(usize, usize)> {
        match self {
            LayerKind::Attention(_) => None,
            LayerKind::ShortConv(c) => Some((c.channels, c.kernel)),
            LayerKind::GatedDelta(g) => Some((g.conv_channels(), g.kernel)),
        }
    }
}

impl ModelSpec {
    /// Block `l`'s kind.
    pub fn layer(&self, l: usize) -> LayerKind {
        if let Some(c) = self.short_conv.as_ref().filter(|c| c.layers.contains(&l)) {
            return LayerKind::ShortConv(ShortConv {
                channels: self.hidden_size,
                kernel: c.kernel,
                bias: c.bias,
            });
        }
        if let Some(g) = self.gated_delta.as_ref().filter(|g| g.layers.contains(&l)) {
            return LayerKind::GatedDelta(GatedDelta {
                key_heads: g.key_heads,
                value_heads: g.value_heads,
                key_dim: g.key_dim,
                value_dim: g.value_dim,
                kernel: g.kernel,
            });
        }
        let sliding = self.gemma.as_ref().map(|g| g.sliding_layers.contains(&l));
        let rope = match sliding {
            _ if self.no_rope_layers.contains(&l) => Rope::None,
            Some(true) => Rope::Local,
            _ => Rope::Global,
        };
        // Gemma 4's full blocks have a head shape of their own.
        let (kv_heads, head_dim) = match &self.gemma4 {
            Some(g) if sliding == Some(false) => (g.global_kv_heads, g.global_head_dim),
            _ => (self.num_key_value_heads, self.head_dim),
        };
        LayerKind::Attention(Attention {
            kv_heads,
            head_dim,
            // Gemma's global blocks see everything; elsewhere `sliding_window` is every block's.
            window: match sliding {
                Some(false) => None,
                _ => self.sliding_window,
            },
            rope,
            kv_from: self.kv_producer(l),
        })
    }

    /// The block whose keys and values block `l` reads instead of its own: with Gemma 4's KV
    /// sharing, the last block before the first shared one that is windowed as `l` is.
    pub fn kv_producer(&self, l: usize) -> Option<usize> {
        let first = self.gemma4.as_ref()?.first_shared;
        let sliding = |b: usize| {
            self.gemma
                .as_ref()
                .is_some_and(|g| g.sliding_layers.contains(&b))
        };
        (l >= first)
            .then(|| (0..first).rev().find(|&b| sliding(b) == sliding(l)))
            .flatten()
    }

    /// Block `l`'s query heads × head size: the o_proj input.
    pub fn q_dim_of(&self, l: usize) -> usize {
        match self.layer(l) {
            LayerKind::Attention(a) => self.num_attention_heads * a.head_dim,
            _ => self.q_dim(),
        }
    }

    /// The widths of block `l`'s four projection inputs, as calibration collects them: the
    /// block input (q/k/v, a conv's or DeltaNet's in_proj), the output projection's input
    /// (o_proj: query heads × head size; LFM2's out_proj: hidden; a DeltaNet's out_proj: value
    /// heads × value head size), the MLP input and the down projection's input.
    pub fn site_widths(&self, l: usize) -> [usize; 4] {
        let o = match self.layer(l) {
            LayerKind::Attention(_) => self.q_dim_of(l),
            LayerKind::ShortConv(c) => c.channels,
            LayerKind::GatedDelta(g) => g.value_heads * g.value_dim,
        };
        [self.hidden_size, o, self.hidden_size, self.intermediate(l)]
    }

    /// Every block's kind, in order.
    pub fn layers(&self) -> Vec<LayerKind> {
        (0..self.num_hidden_layers).map(|l| self.layer(l)).collect()
    }

    /// The shape (KV heads, head size) of one slot of the stacked caches [slots, Hkv, S, D]: the
    /// model's own (`num_key_value_heads`, `head_dim`). A block whose heads are of another shape
    /// (Gemma 4's full blocks) fills [`kv_slots`](Self::kv_slots) whole slots with its rows.
    /// `None` when no block keeps rows or a block's rows do not fill whole slots.
    pub fn stacked_kv(&self) -> Option<(usize, usize)> {
        let slot = (self.num_key_value_heads, self.head_dim);
        let mut any = false;
        for l in 0..self.num_hidden_layers {
            let Some(a) = self.layer(l).attention().copied() else {
                continue;
            };
            if a.kv_from.is_none() {
                slot_pieces(a, slot)?;
                any = true;
            }
        }
        any.then_some(slot)
    }

    /// The slots of the stacked caches block `l` keeps its key (and value) rows in: 1 for a
    /// block of the model's own head shape, H'·D' / (Hkv·D) for one of another (Gemma 4's full
    /// blocks), 0 for a block that keeps none (a recurrent block, or one reading another's).
    pub fn kv_slots(&self, l: usize) -> usize {
        let slot = (self.num_key_value_heads, self.head_dim);
        match self.layer(l).attention() {
            Some(a) if a.kv_from.is_none() => slot_pieces(*a, slot).map_or(1, |(m, _)| m),
            _ => 0,
        }
    }

    /// The slots the stacked caches hold: every block's, or a hybrid model's attention blocks'.
    pub fn cache_layers(&self) -> usize {
        self.cache_slots(0..self.num_hidden_layers)
    }

    /// The slots blocks `layers` keep rows in (a chain part's caches).
    pub fn cache_slots(&self, layers: std::ops::Range<usize>) -> usize {
        layers.map(|l| self.kv_slots(l)).sum()
    }

    /// The blocks of `layers` that keep key and value rows (the caches' slots, in order): the
    /// blocks that attend, but for those that read another's (KV sharing).
    pub fn attention_layers(&self, layers: std::ops::Range<usize>) -> Vec<usize> {
        layers
            .filter(|&l| {
                self.layer(l)
                    .attention()
                    .is_some_and(|a| a.kv_from.is_none())
            })
            .collect()
    }

    /// The recurrent state blocks `layers` carry beside the caches, as the contract declares
    /// it; `None` when every one of them attends.
    pub fn recurrent_state(
        &self,
        layers: std::ops::Range<usize>,
    ) -> Option<crate::mil::contract::Recurrent> {
        use crate::mil::contract::{ConvState, DeltaState, Recurrent};
        // Every block that convolves (LFM2's, or a DeltaNet's conv) shares one conv state
        // shape: a model mixes no two kinds of them (the config checks it).
        let conv: Vec<(usize, (usize, usize))> = layers
            .clone()
            .filter_map(|l| self.layer(l).conv().map(|c| (l, c)))
            .collect();
        let delta: Vec<(usize, GatedDelta)> = layers
            .clone()
            .filter_map(|l| match self.layer(l) {
                LayerKind::GatedDelta(g) => Some((l, g)),
                _ => None,
            })
            .collect();
        if conv.is_empty() {
            return None;
        }
        Some(Recurrent {
            blocks: layers.len(),
            attention_layers: self.attention_layers(layers),
            conv: conv.first().map(|&(_, (channels, kernel))| ConvState {
                layers: conv.iter().map(|(l, _)| *l).collect(),
                width: kernel - 1,
                channels,
            }),
            delta: delta.first().map(|&(_, g)| DeltaState {
                layers: delta.iter().map(|(l, _)| *l).collect(),
                heads: g.value_heads,
                key_dim: g.key_dim,
                value_dim: g.value_dim,
            }),
        })
    }

    /// The state every block keeps per sequence at context length `max_seq_len`, in bytes
    /// (the KV cache of an all-attention model: 2 × L × Hkv × S × D × 2).
    pub fn state_bytes(&self, max_seq_len: usize) -> u64 {
        self.layers()
            .iter()
            .flat_map(LayerKind::state)
            .map(|e| e.bytes(max_seq_len))
            .sum()
    }
}

/// How block `a`'s key rows fill slots of shape `(heads, head_dim)`: (m, k) with each of its
/// heads cut into k pieces of `head_dim` along D, and those H'·k pieces filling m slots of
/// `heads` heads each (piece j of head h is head j·H' + h of the m·Hkv). `None` when its rows
/// fill no whole number of slots.
pub fn slot_pieces(a: Attention, (heads, head_dim): (usize, usize)) -> Option<(usize, usize)> {
    if head_dim == 0 || heads == 0 || !a.head_dim.is_multiple_of(head_dim) {
        return None;
    }
    let k = a.head_dim / head_dim;
    (a.kv_heads * k)
        .is_multiple_of(heads)
        .then_some((a.kv_heads * k / heads, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(config: &str) -> ModelSpec {
        ModelSpec::from_config_str(config).unwrap()
    }

    const LLAMA: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,
        "intermediate_size":128,"num_attention_heads":4,"num_hidden_layers":3,
        "num_key_value_heads":2,"vocab_size":100"#;

    #[test]
    fn an_attention_block_keeps_a_key_and_a_value_row_per_position() {
        let s = spec(&format!("{LLAMA}}}"));
        let kinds = s.layers();
        assert_eq!(kinds.len(), 3);
        let a = kinds[1].attention().unwrap();
        assert_eq!(
            (a.kv_heads, a.head_dim, a.window, a.rope),
            (2, 16, None, Rope::Global)
        );
        assert_eq!(
            kinds[1].state(),
            [
                StateEntry::Keys {
                    heads: 2,
                    head_dim: 16
                },
                StateEntry::Values {
                    heads: 2,
                    head_dim: 16
                }
            ]
        );
        assert_eq!(kinds[1].state()[0].shape(512), [2, 512, 16]);
        // 2 × L × Hkv × S × D × 2 bytes.
        assert_eq!(s.state_bytes(512), 2 * 3 * 2 * 512 * 16 * 2);
        assert_eq!(s.stacked_kv(), Some((2, 16)));
    }

    #[test]
    fn a_block_of_another_head_shape_fills_whole_slots() {
        let block = |kv_heads, head_dim| Attention {
            kv_heads,
            head_dim,
            window: None,
            rope: Rope::Global,
            kv_from: None,
        };
        // Gemma 4 E2B's full block (one 512-wide head) in slots of one 256-wide head: two
        // slots, each head in two pieces; `gemma4_kv`'s one 32-wide head in one slot of two
        // 16-wide heads.
        assert_eq!(slot_pieces(block(1, 512), (1, 256)), Some((2, 2)));
        assert_eq!(slot_pieces(block(1, 32), (2, 16)), Some((1, 2)));
        assert_eq!(slot_pieces(block(2, 16), (2, 16)), Some((1, 1)));
        assert_eq!(slot_pieces(block(4, 16), (2, 16)), Some((2, 1)));
        // Half a slot, or a head width that is no multiple of the slot's: no whole slots.
        assert_eq!(slot_pieces(block(1, 16), (2, 16)), None);
        assert_eq!(slot_pieces(block(2, 24), (2, 16)), None);
    }

    #[test]
    fn a_window_without_gemma_is_every_blocks() {
        let s = spec(&format!("{LLAMA},\"sliding_window\":8}}").replace("Llama", "Mistral"));
        assert!(s
            .layers()
            .iter()
            .all(|k| k.attention().unwrap().window == Some(8)));
    }
}
