//! How many LUTs a tensor gets.

use serde::Serialize;

/// How many LUTs a tensor gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Granularity {
    /// One LUT for the whole tensor (the only iOS17 option).
    PerTensor,
    /// iOS18: one LUT per `group_size` consecutive channels along `axis`.
    PerGroupedChannel { group_size: usize, axis: usize },
}

impl Granularity {
    /// LUTs a tensor of `shape` gets.
    pub fn num_luts(&self, shape: &[usize]) -> usize {
        match *self {
            Granularity::PerTensor => 1,
            Granularity::PerGroupedChannel { group_size, axis } => shape
                .get(axis)
                .map_or(1, |&c| c.div_ceil(group_size.max(1)).max(1)),
        }
    }
}

impl std::fmt::Display for Granularity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Granularity::PerTensor => f.write_str("per_tensor"),
            Granularity::PerGroupedChannel { group_size, axis } => {
                write!(
                    f,
                    "per_grouped_channel(group_size={group_size}, axis={axis})"
                )
            }
        }
    }
}
