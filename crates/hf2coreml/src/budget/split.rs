//! The split planner: a model too large for one package becomes a chain of packages cut at
//! block boundaries (docs/design.md, "Chained packages").
//!
//! The model is a sequence of units in order: the token embedding, each decoder block, and
//! the head (final norm and lm_head). A part is a run of consecutive units. Every part must
//! stay under the limit; among the partitions with the fewest parts, the planner picks one
//! whose largest part is as small as possible (balanced by bytes). Because the embedding and
//! the head are units of their own, a part may hold only one of them when that balances
//! better. A tied table is stored by the part that embeds and again by the part that computes
//! the logits when those are different parts; one package stores it once.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::arch::{ModelSpec, Role, TensorId, TensorSlot};

/// Bytes each part carries besides its weights: the RoPE tables ([S, D] fp16, twice), the
/// mask constants, the program and the package files. A fixed allowance per part keeps the
/// planner pure; [`part_overhead_bytes`] computes it.
pub fn part_overhead_bytes(spec: &ModelSpec, max_seq_len: usize) -> u64 {
    // cos and sin tables in fp16, plus 1 MiB for model.mlmodel, Manifest.json and small constants.
    2 * (max_seq_len * spec.head_dim) as u64 * 2 + (1 << 20)
}

/// What the planner splits: the bytes of each unit of the model, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelBytes {
    /// The token embedding table.
    pub embedding: u64,
    /// Each decoder block's weights.
    pub blocks: Vec<u64>,
    /// The final norm and the lm_head (with a tied table: the table again, see `tied`).
    pub head: u64,
    /// The table is tied: `embedding` bytes are also part of `head`, stored once when both are
    /// in one part.
    pub tied: bool,
    /// Bytes every part carries besides its weights ([`part_overhead_bytes`]).
    pub per_part: u64,
    /// Per unit, whether it must be in the part of the unit before it: Gemma 4's first block
    /// with the embedding (the per-layer inputs are computed there), and every block from a
    /// shared block's producer to the shared block (it reads the producer's keys and values
    /// of the same step).
    #[serde(skip_serializing_if = "glued_nowhere")]
    pub glued: Vec<bool>,
}

fn glued_nowhere(glued: &[bool]) -> bool {
    !glued.contains(&true)
}

impl ModelBytes {
    /// The units of `spec` when each tensor slot takes `bytes(slot)` (for example
    /// `|s| recipe.storage(s).bytes(s.numel())`).
    pub fn measure(
        spec: &ModelSpec,
        slots: &[TensorSlot],
        per_part: u64,
        bytes: impl Fn(&TensorSlot) -> u64,
    ) -> Self {
        let layers = spec.num_hidden_layers;
        // Block l is unit l + 1.
        let mut glued = vec![false; layers + 2];
        if spec.per_layer_input() > 0 && layers > 0 {
            glued[1] = true;
        }
        for l in 0..layers {
            if let Some(p) = spec.layer(l).attention().and_then(|a| a.kv_from) {
                for g in glued.iter_mut().take(l + 2).skip(p + 2) {
                    *g = true;
                }
            }
        }
        let mut m = ModelBytes {
            embedding: 0,
            blocks: vec![0; layers],
            head: 0,
            tied: spec.tie_word_embeddings,
            per_part,
            glued,
        };
        for s in slots {
            let b = bytes(s);
            match (s.layer, s.role) {
                (Some(l), _) if l < m.blocks.len() => m.blocks[l] += b,
                // Gemma 4's per-layer inputs are computed beside the embedding, from it.
                (_, Role::Embedding | Role::PerLayerEmbedding | Role::PerLayer) => m.embedding += b,
                _ if s.name == TensorId::PerLayerProjectionNorm.hf_name() => m.embedding += b,
                _ => m.head += b,
            }
        }
        if m.tied {
            m.head += m.embedding;
        }
        m
    }

    /// The units' weight bytes in model order: embedding, blocks, head.
    fn units(&self) -> Vec<u64> {
        let mut u = Vec::with_capacity(self.blocks.len() + 2);
        u.push(self.embedding);
        u.extend(&self.blocks);
        u.push(self.head);
        u
    }

    /// Bytes of everything in one package (a tied table once).
    pub fn whole(&self) -> u64 {
        let tied_again = if self.tied { self.embedding } else { 0 };
        self.units().iter().sum::<u64>() - tied_again + self.per_part
    }
}

/// One package of a chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartPlan {
    /// The decoder blocks it runs (may be empty for an embedding- or head-only part).
    pub layers: Range<usize>,
    /// It maps `input_ids` to the hidden state (the first part).
    pub embedding: bool,
    /// It maps the hidden state to the logits (the last part).
    pub head: bool,
    /// Its predicted bytes: weights plus the per-part allowance.
    pub bytes: u64,
}

/// The split of a model into packages, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChainPlan {
    pub limit: u64,
    pub parts: Vec<PartPlan>,
}

impl ChainPlan {
    pub fn is_single(&self) -> bool {
        self.parts.len() == 1
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChainError {
    #[error(
        "{unit} alone needs {need} bytes, over the package size limit of {limit} bytes: no split \
         at block boundaries fits; raise --max-package-size or use a recipe with fewer bits"
    )]
    UnitTooLarge { unit: String, need: u64, limit: u64 },
}

/// Split `m` into packages of at most `limit` bytes each: one package when the whole model
/// fits; otherwise the fewest parts, with the largest part as small as possible.
pub fn plan(m: &ModelBytes, limit: u64) -> Result<ChainPlan, ChainError> {
    let units = m.units();
    let n = units.len();
    if m.whole() <= limit {
        return Ok(ChainPlan {
            limit,
            parts: vec![part(m, &units, 0..n)],
        });
    }
    let groups = groups(m, n);
    for g in &groups {
        let need = part(m, &units, g.clone()).bytes;
        if need > limit {
            let unit = match g.len() {
                1 => unit_name(g.start, n),
                _ => format!(
                    "{} to {}, which stay in one part (Gemma 4 computes the per-layer inputs \
                     with the first block and runs a block that shares with its producer),",
                    unit_name(g.start, n),
                    unit_name(g.end - 1, n),
                ),
            };
            return Err(ChainError::UnitTooLarge { unit, need, limit });
        }
    }
    let fewest = greedy(m, &units, &groups, limit).len();
    // The smallest bound on the largest part that still needs no more parts than `fewest`.
    let (mut lo, mut hi) = (0u64, limit);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let fits = groups
            .iter()
            .all(|g| part(m, &units, g.clone()).bytes <= mid);
        if fits && greedy(m, &units, &groups, mid).len() <= fewest {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let parts = greedy(m, &units, &groups, hi)
        .into_iter()
        .map(|r| part(m, &units, r))
        .collect();
    Ok(ChainPlan { limit, parts })
}

/// Unit `i` of `n` by name.
fn unit_name(i: usize, n: usize) -> String {
    match i {
        0 => "the token embedding".to_string(),
        i if i + 1 == n => "the final norm and lm_head".to_string(),
        i => format!("decoder block {}", i - 1),
    }
}

/// Units `r` as one part.
fn part(m: &ModelBytes, units: &[u64], r: Range<usize>) -> PartPlan {
    let n = units.len();
    let embedding = r.start == 0;
    let head = r.end == n;
    let mut bytes: u64 = units[r.clone()].iter().sum::<u64>() + m.per_part;
    if m.tied && embedding && head {
        bytes -= m.embedding;
    }
    PartPlan {
        layers: r.start.max(1) - 1..r.end.min(n - 1).max(1) - 1,
        embedding,
        head,
        bytes,
    }
}

/// The units in runs that are never cut (a unit glued to the one before joins its run).
fn groups(m: &ModelBytes, n: usize) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for i in 0..n {
        match out.last_mut() {
            Some(g) if m.glued.get(i).copied().unwrap_or(false) => g.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// Consecutive runs of `groups`, each as long as it can be under `bound` (every single group
/// is under it). Greedy filling gives the fewest parts for a bound.
fn greedy(m: &ModelBytes, units: &[u64], groups: &[Range<usize>], bound: u64) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for g in groups.iter().skip(1) {
        if part(m, units, start..g.end).bytes > bound {
            out.push(start..g.start);
            start = g.start;
        }
    }
    out.push(start..units.len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(embedding: u64, blocks: &[u64], head: u64, tied: bool) -> ModelBytes {
        ModelBytes {
            embedding,
            blocks: blocks.to_vec(),
            head,
            tied,
            per_part: 10,
            glued: Vec::new(),
        }
    }

    /// Every part under the limit; the parts cover embedding, every block once and in order,
    /// and the head.
    fn check_cover(m: &ModelBytes, p: &ChainPlan) {
        let layers = m.blocks.len();
        assert!(p.parts.iter().all(|x| x.bytes <= p.limit), "{p:?}");
        assert!(p.parts[0].embedding && p.parts.last().unwrap().head);
        assert_eq!(p.parts.iter().filter(|x| x.embedding).count(), 1);
        assert_eq!(p.parts.iter().filter(|x| x.head).count(), 1);
        let mut next = 0;
        for x in &p.parts {
            assert_eq!(x.layers.start, next, "{p:?}");
            assert!(x.layers.end >= x.layers.start);
            assert!(
                !x.layers.is_empty() || x.embedding || x.head,
                "empty part: {p:?}"
            );
            next = x.layers.end;
        }
        assert_eq!(next, layers);
    }

    #[test]
    fn a_model_that_fits_is_one_part() {
        let m = model(100, &[50, 50], 20, false);
        let p = plan(&m, 230).unwrap();
        assert_eq!(p.parts.len(), 1);
        assert_eq!(p.parts[0].layers, 0..2);
        assert_eq!(p.parts[0].bytes, 230);
        // A tied table counts once in one package.
        let m = model(100, &[50, 50], 101, true);
        assert_eq!(plan(&m, 211).unwrap().parts.len(), 1);
    }

    #[test]
    fn parts_are_balanced_and_fewest() {
        // 8 blocks of 100, small embedding and head: 3 parts under 400 (each 10 of overhead).
        let m = model(20, &[100; 8], 20, false);
        let p = plan(&m, 400).unwrap();
        check_cover(&m, &p);
        assert_eq!(p.parts.len(), 3);
        let max = p.parts.iter().map(|x| x.bytes).max().unwrap();
        // 3 blocks per part at most; the part that also holds the embedding or the head: 330.
        assert_eq!(max, 330, "{p:?}");
    }

    #[test]
    fn embedding_and_head_may_stand_alone() {
        // A huge tied table: embedding and head are parts of their own.
        let m = model(300, &[50; 4], 301, true);
        let p = plan(&m, 320).unwrap();
        check_cover(&m, &p);
        assert_eq!(p.parts.first().unwrap().layers, 0..0);
        assert_eq!(p.parts.last().unwrap().layers, 4..4);
        assert_eq!(p.parts.len(), 3);
    }

    #[test]
    fn glued_units_stay_in_one_part() {
        // Blocks 2..=5 read one another (units 3..=6), block 0 stays with the embedding.
        let mut m = model(20, &[100; 8], 20, false);
        m.glued = vec![false; 10];
        for u in [1, 4, 5, 6] {
            m.glued[u] = true;
        }
        let free = plan(&model(20, &[100; 8], 20, false), 330).unwrap();
        assert!(free
            .parts
            .iter()
            .any(|p| p.layers.start > 2 && p.layers.start <= 5));
        let p = plan(&m, 430).unwrap();
        check_cover(&m, &p);
        for x in &p.parts {
            assert!(!(3..=5).contains(&x.layers.start), "{p:?}");
            assert!(x.layers.start != 0 || x.layers.end > 0 || !x.embedding);
        }
        assert!(p.parts[0].layers.end >= 1);
        // A glued run larger than the limit is named.
        let err = plan(&m, 330).unwrap_err().to_string();
        assert!(err.contains("decoder block 2 to decoder block 5"), "{err}");
    }

    #[test]
    fn one_block_over_the_limit_is_a_typed_error() {
        let m = model(20, &[100, 500, 100], 20, false);
        let e = plan(&m, 400).unwrap_err();
        assert_eq!(
            e,
            ChainError::UnitTooLarge {
                unit: "decoder block 1".into(),
                need: 510,
                limit: 400
            }
        );
        assert!(e.to_string().contains("--max-package-size"));
    }

    /// Llama 3.1 8B (published shapes) with 4-bit projections at S = 2048 under the iPhone's
    /// 1 GB: its untied fp16 tables are 1.05 GB each, so with them in fp16 no split fits (the
    /// error names the embedding); with 8-bit tables every part fits.
    #[test]
    fn llama_8b_splits_under_one_gigabyte_only_with_compressed_tables() {
        use crate::arch::expected_tensors;
        use crate::quant::Storage;
        let spec = ModelSpec::from_config_str(
            r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "tie_word_embeddings": false, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "torch_dtype": "bfloat16"}"#,
        )
        .unwrap();
        let slots = expected_tensors(&spec);
        let per_part = part_overhead_bytes(&spec, 2048);
        let measure = |table_bits: Option<u8>| {
            let storage = move |s: &TensorSlot| match (s.role, table_bits) {
                (r, _) if r.is_projection() => Storage::Lut { nbits: 4, luts: 1 },
                (Role::Embedding | Role::LmHead, Some(nbits)) => Storage::Lut { nbits, luts: 1 },
                _ => Storage::Fp16,
            };
            let m = ModelBytes::measure(&spec, &slots, per_part, |s| storage(s).bytes(s.numel()));
            let total = crate::budget::weights_bytes(&slots, storage);
            assert_eq!(m.embedding + m.blocks.iter().sum::<u64>() + m.head, total);
            m
        };
        let fp16 = measure(None);
        assert_eq!(fp16.embedding, 128_256 * 4096 * 2);
        match plan(&fp16, 1_000_000_000) {
            Err(ChainError::UnitTooLarge { unit, .. }) => assert_eq!(unit, "the token embedding"),
            other => panic!("{other:?}"),
        }
        let m = measure(Some(8));
        let p = plan(&m, 1_000_000_000).unwrap();
        check_cover(&m, &p);
        assert!(p.parts.iter().all(|x| x.bytes <= 1_000_000_000), "{p:#?}");
        // 3.5 GB of 4-bit blocks and two 0.53 GB tables: at least 5 parts.
        assert!(p.parts.len() >= 5, "{p:#?}");
    }

    #[test]
    fn random_models_are_covered_exactly_once_under_the_limit() {
        let mut rng = crate::util::SplitMix64(7);
        for _ in 0..500 {
            let layers = 1 + rng.next_u64() as usize % 12;
            let blocks: Vec<u64> = (0..layers).map(|_| 1 + rng.next_u64() % 200).collect();
            let tied = rng.next_u64().is_multiple_of(2);
            let emb = 1 + rng.next_u64() % 300;
            let head = if tied {
                emb + 1
            } else {
                1 + rng.next_u64() % 300
            };
            let m = model(emb, &blocks, head, tied);
            let limit = 50 + rng.next_u64() % 800;
            match plan(&m, limit) {
                Ok(p) => {
                    check_cover(&m, &p);
                    // Fewest parts: greedy at the limit is optimal for contiguous splits.
                    let units = m.units();
                    let fewest = if m.whole() <= limit {
                        1
                    } else {
                        greedy(&m, &units, &groups(&m, units.len()), limit).len()
                    };
                    assert_eq!(p.parts.len(), fewest);
                }
                Err(ChainError::UnitTooLarge { need, .. }) => assert!(need > limit),
            }
        }
    }
}
