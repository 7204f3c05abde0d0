//! The Neural Engine rules, in one table: each with its severity, why, fix and source
//! (docs/reference/neural-engine.md collects them with their sources; docs/design.md, "Neural Engine readiness", says
//! how they are read). Adding a rule is one entry here and one check in [`super::check`].

use serde::{Deserialize, Serialize};

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// The compiler rejects it, or the Neural Engine computes it wrong.
    Error,
    /// The op (or the model) leaves the Neural Engine for the GPU or CPU.
    Fallback,
    /// It runs on the Neural Engine but pays (padding, extra ops).
    Cost,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Fallback => "fallback",
            Severity::Cost => "cost",
        }
    }
}

/// One rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rule {
    pub id: &'static str,
    pub severity: Severity,
    pub why: &'static str,
    pub fix: &'static str,
    pub source: &'static str,
}

const APPLE: &str =
    "apple/coreai-models skills/skills/model-authoring/references/neural_engine_rules.md";

/// The Neural Engine compiler's dimension limits, right-aligned: N, D, C, H, W.
pub const DIM_LIMITS: [(char, u64); 5] = [
    ('N', 65_536),
    ('D', 16_384),
    ('C', 65_536),
    ('H', 16_384),
    ('W', 16_384),
];
/// The highest rank the Neural Engine (and Core ML) takes.
pub const MAX_RANK: usize = 5;
/// Inputs and outputs are laid out with their last axis aligned to this many bytes.
pub const LAST_AXIS_BYTES: u64 = 64;
/// "cannot be larger than 1 GB" (coremltools docs), read as 10^9 bytes, the stricter reading.
pub const IPHONE_MODEL_BYTES: u64 = 1_000_000_000;
/// "Weight file size (...) exceeds the maximum (2147483648 bytes)".
pub const WEIGHT_FILE_BYTES: u64 = 1 << 31;
/// The most negative finite fp16 value: anything below it is -inf in fp16.
pub const FP16_LOWEST: f32 = -65_504.0;

pub const RULES: &[Rule] = &[
    Rule {
        id: "rank",
        severity: Severity::Error,
        why: "tensors of rank above 5 are refused (Core ML refuses rank 6+ at conversion)",
        fix: "merge axes with a reshape so that every tensor has rank 5 or less",
        source: APPLE,
    },
    Rule {
        id: "fp32",
        severity: Severity::Fallback,
        why: "the Neural Engine computes fp16, int8 and int16 only: an fp32 op or constant \
              runs on the GPU or CPU",
        fix: "convert with compute precision fp16 and make every float constant fp16",
        source: APPLE,
    },
    Rule {
        id: "dimension-range",
        severity: Severity::Error,
        why: "the compiler takes dimensions N[1-65536] D[1-16384] C[1-65536] H[1-16384] \
              W[1-16384], right-aligned",
        fix: "split the axis into parts of at most 16384 (e.g. the lm_head into vocab/16384 \
              parts, as ANEMLL does)",
        source: "Neural Engine compiler error text (FluidAudio #121); ANEMLL \
                 anemll/models/llama_model.py",
    },
    Rule {
        id: "narrow-last-axis",
        severity: Severity::Cost,
        why: "the last axis of inputs and outputs is padded to 64 bytes (a last axis of 1 in \
              fp16 takes 32x its memory)",
        fix: "keep at least 64 bytes (32 fp16 elements) in the last axis of inputs and outputs",
        source: APPLE,
    },
    Rule {
        id: "dynamic-shape",
        severity: Severity::Fallback,
        why: "the Neural Engine runs fully static shapes only",
        fix: "give every dimension a fixed size: one function per shape",
        source: APPLE,
    },
    Rule {
        id: "neg-inf",
        severity: Severity::Error,
        why: "the Neural Engine does not handle IEEE -inf correctly in softmax, and fp16 has \
              nothing below -65504",
        fix: "mask with -40000 (or another value fp16 holds), never -inf",
        source: APPLE,
    },
    Rule {
        id: "gather-nd",
        severity: Severity::Fallback,
        why: "indexing a table inside the graph with gather_nd yields a 3-D output outside the \
              Neural Engine's layout",
        fix: "pass RoPE cos/sin in as (1, head_dim, 1, S) inputs instead of gathering them",
        source: APPLE,
    },
    Rule {
        id: "fused-sdpa",
        severity: Severity::Fallback,
        why: "the Neural Engine has no fused scaled_dot_product_attention",
        fix: "write attention per head: matmul, softmax, matmul",
        source: APPLE,
    },
    Rule {
        id: "decomposed-norm",
        severity: Severity::Cost,
        why: "a norm written as reduce/mul/add ops runs as several Neural Engine ops instead \
              of one",
        fix: "use a high-level norm op (layer_norm; RMSNorm over channels in the (B, C, 1, S) \
              layout)",
        source: APPLE,
    },
    Rule {
        id: "int-compute",
        severity: Severity::Cost,
        why: "integer arithmetic outside int8/int16 (index math on int32 positions) is not \
              Neural Engine compute: Core ML runs it on the CPU, a hand-off at the graph's edge",
        fix: "keep int32 index math at the start of the graph and small, or pass its result in",
        source: APPLE,
    },
    Rule {
        id: "ios-model-size",
        severity: Severity::Fallback,
        why: "a model deployed to run on the Neural Engine on an iPhone cannot be larger than \
              1 GB",
        fix: "palettize to fewer bits or split the model (ct.models.utils.bisect_model)",
        source: "coremltools docs-guides/source/mlmodel-utilities.md",
    },
    Rule {
        id: "state-dims",
        severity: Severity::Error,
        why: "a Core ML state whose last two dimensions are not multiples of 32 fails to run \
              on the Neural Engine (CPU and GPU run it)",
        fix: "pad the state's last two axes to multiples of 32 (hf2coreml pads the cache \
              rows; a head_dim that is not a multiple of 32 cannot be padded) or run on the GPU",
        source: "coremltools issue #2631 (width 270 fails, 256 runs)",
    },
    Rule {
        id: "state-shapes",
        severity: Severity::Error,
        why: "M1 and A14 Neural Engines reject a model whose states have different shapes",
        fix: "give every state the same shape (hf2coreml stacks all keys and values in one)",
        source: "ANEMLL 0.3.5 release notes (docs/reference/neural-engine.md)",
    },
    Rule {
        id: "weight-file-size",
        severity: Severity::Error,
        why: "the Neural Engine compiler refuses a weight file above 2147483648 bytes",
        fix: "split the model so that each weight.bin stays under 2 GiB",
        source: "Neural Engine compiler error text (coremltools PR #2593, issue #1807)",
    },
];

/// The rule with this id.
pub fn rule(id: &str) -> Option<&'static Rule> {
    RULES.iter().find(|r| r.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_every_rule_is_sourced() {
        let mut seen = std::collections::BTreeSet::new();
        for r in RULES {
            assert!(seen.insert(r.id), "{} twice", r.id);
            assert!(!r.why.is_empty() && !r.fix.is_empty() && !r.source.is_empty());
        }
    }
}
