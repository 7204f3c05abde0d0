//! What every DeltaNet block of a step reads besides its weights and the conv state
//! ([`DeltaInputs`]): the DeltaNet state (an input, or a stateful package's Core ML state), the
//! real tokens of a padded call and the chunked form's constants.

use half::f16;

use super::chunk::{chunk_consts, ChunkConsts, CHUNKED_FROM};
use crate::arch::GatedDelta;
use crate::graph::{ints, var, Builder, ConstData, Op};

/// What every DeltaNet block of a step reads besides its weights and the conv state.
pub(crate) struct DeltaInputs {
    /// The `delta_state` input [Ld, Hv, Dk, Dv] (a stateful package: its value, read).
    pub(super) state: String,
    /// A stateful package's Core ML state, where the update is stored.
    pub(crate) stored: Option<String>,
    /// [1, Q, 1]: 1 for a real token, 0 for padding (Q > 1 only).
    pub(super) real: Option<String>,
    /// The chunked form's constants (none when the call takes its tokens one by one).
    pub(super) chunks: Vec<ChunkConsts>,
}

impl DeltaInputs {
    /// The inputs of a step with `layers` DeltaNet blocks of shape `g`, Q tokens; `valid` is
    /// the `valid_len` input when Q > 1; `stateful` the `position` input of a `--kv-cache
    /// state` package, whose DeltaNet state is a Core ML state.
    pub(crate) fn new(
        b: &mut Builder,
        (layers, g): (usize, &GatedDelta),
        (q, valid): (usize, Option<&str>),
        stateful: Option<&str>,
    ) -> Self {
        let fl = b.float();
        let (name, shape) = (
            crate::mil::contract::DELTA_STATE,
            vec![layers, g.value_heads, g.key_dim, g.value_dim],
        );
        let (state, stored) = match stateful {
            Some(position) => {
                let (stored, value) =
                    crate::graph::decoder::stateful::recurrent(b, name, shape, position);
                (value, Some(stored))
            }
            None => (b.input(name, fl, shape), None),
        };
        let real = valid.map(|valid| {
            let index = b.constant(
                "delta_token_index",
                vec![q],
                ConstData::I32((0..q as i32).collect()),
                None,
            );
            let is_real = b.op(
                Op::Less,
                "delta_token_is_real",
                vec![("x", var(&index)), ("y", var(valid))],
            );
            let one = b.constant(
                "delta_token_one",
                vec![q],
                ConstData::F16(vec![f16::ONE; q]),
                None,
            );
            let zero = b.constant(
                "delta_token_zero",
                vec![q],
                ConstData::F16(vec![f16::ZERO; q]),
                None,
            );
            let m = b.op(
                Op::Select,
                "delta_token_real_flat",
                vec![("cond", var(&is_real)), ("a", var(&one)), ("b", var(&zero))],
            );
            b.op(
                Op::Reshape,
                "delta_token_real",
                vec![("x", var(&m)), ("shape", ints(&[1, q as i64, 1]))],
            )
        });
        let chunks = if q >= CHUNKED_FROM {
            chunk_consts(b, q)
        } else {
            Vec::new()
        };
        DeltaInputs {
            state,
            stored,
            real,
            chunks,
        }
    }
}
