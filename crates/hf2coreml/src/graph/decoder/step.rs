//! What a step is built to: its options ([`StepOptions`]), its dimensions ([`Dims`]), the slice
//! of the model a package computes ([`Part`]) and the constants every builder shares.

use crate::arch::ModelSpec;
use crate::graph::scaling::Scaling;
use crate::graph::{DType, GraphError};
use crate::mil::contract::{self, KvCache};

/// Masked attention scores: large and finite, because -inf turns a fully masked row into NaN
/// (and the Neural Engine mishandles -inf in softmax) and fp16 has no room for anything below
/// -65,504 anyway. Apple's rules use -40,000; -30,000 is as safe: any value fp16 holds works.
pub const MASK_VALUE: f32 = -30_000.0;

/// Fixed dimensions and numerics of one package.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOptions {
    /// S: cache rows.
    pub max_seq_len: usize,
    /// Q: tokens per step.
    pub query_len: usize,
    /// The float type the program computes in.
    pub float: DType,
    pub scaling: Scaling,
    /// The OS the program is built for.
    pub target: crate::mil::contract::Target,
    /// The hidden state's layout (`--layout`): [`super::ane`] builds the (B, C, 1, S) form.
    pub layout: crate::mil::contract::Layout,
    /// How the cache is passed (`--kv-cache`): inputs/outputs, or one state ([`super::stateful`]).
    pub kv_cache: crate::mil::contract::KvCache,
    /// Compute the logits of the last of the Q positions only (a `prefill` function's
    /// `--prefill-logits last`): the final norm and the lm_head see one row.
    pub last_logits_only: bool,
}

/// The step's dimensions (a block's own: its KV heads and head width,
/// [`super::shared::Shared::dims_of`]).
#[derive(Clone, Copy)]
pub(super) struct Dims {
    /// S: cache rows.
    pub(super) s: usize,
    /// Q: tokens per step.
    pub(super) q: usize,
    /// Query heads, key/value heads, head width.
    pub(super) h: usize,
    pub(super) hkv: usize,
    pub(super) d: usize,
}

impl Dims {
    pub(super) fn new(spec: &ModelSpec, opts: &StepOptions) -> Result<Self, GraphError> {
        let (s, q) = (opts.max_seq_len, opts.query_len);
        let (h, hkv, d) = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        );
        if s == 0 || q == 0 || q > s {
            return Err(GraphError::Unsupported(format!(
                "query length {q} and max sequence length {s}: need 1 <= Q <= S"
            )));
        }
        if d % 2 != 0 || h % hkv != 0 {
            return Err(GraphError::Unsupported(format!(
                "head_dim {d} must be even and {h} query heads a multiple of {hkv} key/value heads"
            )));
        }
        if !matches!(opts.float, DType::F16 | DType::F32) {
            return Err(GraphError::Unsupported(format!(
                "float type {} is not a float",
                opts.float.name()
            )));
        }
        // A state's rows are padded to a multiple of 32 (always masked: see [`state`]).
        let s = rows(opts);
        for l in 0..spec.num_hidden_layers {
            let Some(a) = spec.layer(l).attention().copied() else {
                continue;
            };
            if a.head_dim % 2 != 0 || h % a.kv_heads != 0 {
                return Err(GraphError::Unsupported(format!(
                    "block {l}: head_dim {} must be even and {h} query heads a multiple of its \
                     {} key/value heads",
                    a.head_dim, a.kv_heads
                )));
            }
        }
        Ok(Dims { s, q, h, hkv, d })
    }
}

/// The cache rows S the graph is built with: the state's padded row count in state mode.
fn rows(opts: &StepOptions) -> usize {
    match opts.kv_cache {
        KvCache::Io => opts.max_seq_len,
        KvCache::State => opts.max_seq_len.next_multiple_of(contract::STATE_ALIGN),
    }
}

/// Which slice of the model one package computes: the whole model, or one part of a chain
/// (docs/design.md, "Chained packages").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The decoder blocks it runs; its caches hold these layers only.
    pub layers: std::ops::Range<usize>,
    /// It takes `input_ids` and embeds them (else it takes `hidden`).
    pub embedding: bool,
    /// It ends in the final norm and the logits (else it returns `hidden`).
    pub head: bool,
}

impl Part {
    /// The whole model: one package.
    pub fn whole(spec: &ModelSpec) -> Self {
        Part {
            layers: 0..spec.num_hidden_layers,
            embedding: true,
            head: true,
        }
    }
}

/// The channel axis of the default layout's [1, Q, C] (and of a head's [1, n, Q, D]).
pub(super) const TOKENS_CHANNELS: i64 = -1;
