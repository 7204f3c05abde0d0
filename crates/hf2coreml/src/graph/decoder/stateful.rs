//! `--kv-cache state` (iOS18): the key/value cache as one Core ML state instead of inputs and
//! outputs (docs/design.md, "Stateful KV cache").
//!
//! The state [`KV_STATE`] is [2·L, Hkv, S', D] (layer l's keys at index l, its values at L + l;
//! S' is S rounded up to a multiple of 32, [`contract::kv_state_shape`]). The step reads it once
//! (`read_state`); each block slices its layer's rows out of that value exactly as it slices
//! the `key_cache`/`value_cache` inputs of an io package, and joins them with its new rows, so
//! attention computes what the io package computes. After the last block the new rows of every
//! layer ([2·L, Hkv, Q, D]) replace rows `position .. position + Q` of the value read
//! (`slice_update`), and that is stored back (`coreml_update_state`). The mask is the io
//! package's over S' rows: row j is visible iff j < position, and position + Q <= S, so the
//! rows from S on (never written, zero) are always masked.

use super::step::Dims;
use crate::graph::{var, Arg, Builder, ConstData, GraphError, Op};
use crate::mil::contract::{self, KvCache, Target, KV_STATE};

/// The state read at the start of the step.
pub(super) struct StateCache {
    /// The state input.
    pub(super) state: String,
    /// Its value, read once: [2·L, Hkv, S', D].
    pub(super) read: String,
    /// L: the index of layer 0's values.
    pub(super) layers: usize,
}

/// Refuse what a stateful package cannot be: iOS17 (states are iOS18), the `ane` layout, or a
/// part of a chain (each part would need its own state and the host its own step per part:
/// not built).
pub fn check(
    kv_cache: KvCache,
    target: Target,
    layout: contract::Layout,
    whole: bool,
) -> Result<(), GraphError> {
    if kv_cache != KvCache::State {
        return Ok(());
    }
    let refuse = |why: &str| Err(GraphError::Unsupported(format!("--kv-cache state {why}")));
    if target != Target::Ios18 {
        return refuse("needs --target ios18 (Core ML states are an iOS18 feature)");
    }
    if layout != contract::Layout::Default {
        return refuse("is built for the default layout only: drop --layout ane");
    }
    if !whole {
        return refuse(
            "is built as one package only: a chain of stateful parts is not supported \
             (raise --max-package-size or use --kv-cache io)",
        );
    }
    Ok(())
}

/// Declare the state and read it.
pub(super) fn read(b: &mut Builder, layers: usize, dims: &Dims) -> StateCache {
    let fl = b.float();
    let shape = vec![2 * layers, dims.hkv, dims.s, dims.d];
    let state = b.state_input(KV_STATE, fl, shape);
    let read = b.op(Op::ReadState, "kv_cache_read", vec![("input", var(&state))]);
    StateCache {
        state,
        read,
        layers,
    }
}

/// A hybrid model's recurrent state tensor `name` kept as a Core ML state: declared, read once,
/// and taken as zeros when `position` is 0, so a new sequence starts from a zero state without
/// the host resetting anything. Returns the state input and the value the blocks read.
pub(super) fn recurrent(
    b: &mut Builder,
    name: &str,
    shape: Vec<usize>,
    position: &str,
) -> (String, String) {
    let fl = b.float();
    let state = b.state_input(name, fl, shape);
    let read = b.op(
        Op::ReadState,
        &format!("{name}_read"),
        vec![("input", var(&state))],
    );
    let continues = b.op(
        Op::Greater,
        &format!("{name}_continues"),
        vec![("x", var(position)), ("y", Arg::Int(0))],
    );
    let one = b.constant(
        &format!("{name}_one"),
        vec![1],
        ConstData::F16(vec![half::f16::ONE]),
        None,
    );
    let zero = b.constant(
        &format!("{name}_zero"),
        vec![1],
        ConstData::F16(vec![half::f16::ZERO]),
        None,
    );
    let keep = b.op(
        Op::Select,
        &format!("{name}_keep"),
        vec![
            ("cond", var(&continues)),
            ("a", var(&one)),
            ("b", var(&zero)),
        ],
    );
    let value = b.op(
        Op::Mul,
        &format!("{name}_value"),
        vec![("x", var(&read)), ("y", var(&keep))],
    );
    (state, value)
}

/// Store a recurrent state's new value (see [`recurrent`]).
pub(super) fn write_recurrent(b: &mut Builder, state: &str, value: &str) {
    b.op(
        Op::CoremlUpdateState,
        &format!("{state}_write"),
        vec![("state", var(state)), ("value", var(value))],
    );
}

/// Write every layer's new keys and values ([1, Hkv, Q, D] each) into rows `position ..
/// position + Q` of the value read, and store it back into the state.
pub(super) fn write(
    b: &mut Builder,
    cache: &StateCache,
    keys: Vec<String>,
    values: Vec<String>,
    position: &str,
    dims: &Dims,
) {
    let rows: Vec<String> = keys.into_iter().chain(values).collect();
    let update = b.op(
        Op::Concat,
        "kv_cache_rows",
        vec![
            ("values", Arg::Vars(rows)),
            ("axis", Arg::Int(0)),
            ("interleave", Arg::Bool(false)),
        ],
    );
    let zeros2 = b.constant(
        "kv_cache_begin_lead",
        vec![2],
        ConstData::I32(vec![0, 0]),
        None,
    );
    let zero1 = b.constant(
        "kv_cache_begin_tail",
        vec![1],
        ConstData::I32(vec![0]),
        None,
    );
    let begin = b.op(
        Op::Concat,
        "kv_cache_begin",
        vec![
            (
                "values",
                Arg::Vars(vec![zeros2, position.to_string(), zero1]),
            ),
            ("axis", Arg::Int(0)),
            ("interleave", Arg::Bool(false)),
        ],
    );
    let extent: Vec<i32> = [2 * cache.layers, dims.hkv, dims.q, dims.d]
        .iter()
        .map(|&n| n as i32)
        .collect();
    let extent = b.constant("kv_cache_extent", vec![4], ConstData::I32(extent), None);
    let end = b.op(
        Op::Add,
        "kv_cache_end",
        vec![("x", var(&begin)), ("y", var(&extent))],
    );
    let updated = b.op(
        Op::SliceUpdate,
        "kv_cache_updated",
        vec![
            ("x", var(&cache.read)),
            ("update", var(&update)),
            ("begin", var(&begin)),
            ("end", var(&end)),
        ],
    );
    b.op(
        Op::CoremlUpdateState,
        "kv_cache_write",
        vec![("state", var(&cache.state)), ("value", var(&updated))],
    );
}
