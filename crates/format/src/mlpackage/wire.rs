//! What decoding model.mlmodel would allocate, computed from the wire bytes before decoding. A
//! protobuf entry costs two bytes on disk but a whole Rust struct in memory (an empty
//! `Operation` is 2 bytes and ~170 decoded), so the file-size cap alone does not bound memory:
//! a 200 MB file of empty entries decodes to gigabytes. This walks the bytes with the schema of
//! [`super::proto`] and sums, for every field occurrence, the size of what prost would make of
//! it (the struct, the string, the packed elements, the map entry); unknown fields cost nothing
//! (prost skips them). The sum is an upper bound.

use std::mem::size_of;

use super::proto;

/// Largest in-memory size of a decoded model.mlmodel. A real program (a decoder step, weights
/// in weight.bin) decodes to a few MB even at 80 layers.
pub const MAX_DECODED_BYTES: u64 = 256 << 20;
/// Nesting deeper than this is refused (prost's own recursion limit is 100).
const MAX_DEPTH: u32 = 100;
/// Per map entry: the hash table's slot overhead beyond key and value.
const MAP_ENTRY_OVERHEAD: u64 = 16;

/// The messages of [`super::proto`], for the walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Msg {
    Model,
    ModelDescription,
    FeatureDescription,
    FeatureType,
    ArrayFeatureType,
    StateFeatureType,
    Metadata,
    Program,
    Function,
    Block,
    Operation,
    Argument,
    Binding,
    NamedValueType,
    ValueType,
    StateType,
    TensorType,
    Dimension,
    Value,
    ImmediateValue,
    TupleValue,
    TensorValue,
    /// Repeated scalars in field 1 with this many bytes per decoded element.
    Repeated(u64),
    RepeatedStrings,
    RepeatedBytes,
    /// A map entry: key string (field 1), value (field 2) of this kind.
    Entry(Val),
    /// Decoded as an empty message: contents skipped.
    Opaque,
}

/// A map's value kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Val {
    Str,
    Function,
    Block,
    Value,
    Argument,
}

/// What one field occurrence becomes.
#[derive(Debug, Clone, Copy)]
enum Field {
    /// A sub-message of this kind, stored in a struct of this many bytes.
    Msg(Msg, u64),
    /// A string or bytes: its length plus the `String`/`Vec`.
    Str,
    /// A repeated scalar, each element this many bytes decoded.
    Scalars(u64),
    /// A singular scalar or an unknown field: nothing beyond its parent.
    Free,
}

fn m<T>(msg: Msg) -> Field {
    Field::Msg(msg, size_of::<T>() as u64)
}

fn entry(v: Val) -> Field {
    let value = match v {
        Val::Str => size_of::<String>(),
        Val::Function => size_of::<proto::Function>(),
        Val::Block => size_of::<proto::Block>(),
        Val::Value => size_of::<proto::Value>(),
        Val::Argument => size_of::<proto::Argument>(),
    };
    Field::Msg(
        Msg::Entry(v),
        (size_of::<String>() + value) as u64 + MAP_ENTRY_OVERHEAD,
    )
}

/// The schema: what field `tag` of `msg` decodes to.
fn field(msg: Msg, tag: u32) -> Field {
    use Msg::*;
    match (msg, tag) {
        (Model, 2) => m::<proto::ModelDescription>(ModelDescription),
        (Model, 502) => m::<proto::Program>(Program),
        (ModelDescription, 1 | 10 | 13) => m::<proto::FeatureDescription>(FeatureDescription),
        (ModelDescription, 100) => m::<proto::Metadata>(Metadata),
        (FeatureDescription, 1 | 2) => Field::Str,
        (FeatureDescription, 3) => m::<proto::FeatureType>(FeatureType),
        (FeatureType, 5) => m::<proto::ArrayFeatureType>(ArrayFeatureType),
        (FeatureType, 8) => m::<proto::StateFeatureType>(StateFeatureType),
        (ArrayFeatureType, 1) => Field::Scalars(8),
        (StateFeatureType, 1) => m::<proto::ArrayFeatureType>(ArrayFeatureType),
        (Metadata, 1..=4) => Field::Str,
        (Metadata, 100) => entry(Val::Str),
        (Program, 2) => entry(Val::Function),
        (Program, 3) => Field::Str,
        (Program, 4) => entry(Val::Value),
        (Function, 1) | (Block, 1) | (Operation, 3) => m::<proto::NamedValueType>(NamedValueType),
        (Function, 2) => Field::Str,
        (Function, 3) => entry(Val::Block),
        (Function | Block, 4) | (Operation, 5) => entry(Val::Value),
        (Block, 2) | (Operation, 1) => Field::Str,
        (Block, 3) => m::<proto::Operation>(Operation),
        (Operation, 2) => entry(Val::Argument),
        (Operation, 4) => m::<proto::Block>(Block),
        (Argument, 1) => m::<proto::Binding>(Binding),
        (Binding, 1) => Field::Str,
        (Binding, 2) => m::<proto::Value>(Value),
        (NamedValueType, 1) => Field::Str,
        (NamedValueType, 2) | (StateType, 1) | (Value, 2) => m::<proto::ValueType>(ValueType),
        (ValueType, 1) => m::<proto::TensorType>(TensorType),
        (ValueType, 2..=4) => m::<proto::Opaque>(Opaque),
        (ValueType, 5) => m::<proto::StateType>(StateType),
        (TensorType, 3) => m::<proto::Dimension>(Dimension),
        (Dimension, 1 | 2) => Field::Free,
        (Value, 1) => Field::Str,
        (Value, 3) => m::<proto::ImmediateValue>(ImmediateValue),
        (Value, 5) => Field::Str,
        (ImmediateValue, 1) => m::<proto::TensorValue>(TensorValue),
        (ImmediateValue, 2 | 3) => m::<proto::TupleValue>(TupleValue),
        (ImmediateValue, 4) => m::<proto::Opaque>(Opaque),
        (TupleValue, 1) => m::<proto::Value>(Value),
        (TensorValue, 1) => m::<proto::RepeatedFloats>(Repeated(4)),
        (TensorValue, 2) => m::<proto::RepeatedInts>(Repeated(4)),
        (TensorValue, 3) => m::<proto::RepeatedBools>(Repeated(1)),
        (TensorValue, 4) => m::<proto::RepeatedStrings>(RepeatedStrings),
        (TensorValue, 5) => m::<proto::RepeatedLongInts>(Repeated(8)),
        (TensorValue, 6) => m::<proto::RepeatedDoubles>(Repeated(8)),
        (TensorValue, 7) => m::<proto::RepeatedBytes>(RepeatedBytes),
        (Repeated(n), 1) => Field::Scalars(n),
        (RepeatedStrings | RepeatedBytes, 1) => Field::Str,
        (Entry(_), 1) => Field::Str,
        (Entry(Val::Str), 2) => Field::Str,
        (Entry(Val::Function), 2) => m::<proto::Function>(Function),
        (Entry(Val::Block), 2) => m::<proto::Block>(Block),
        (Entry(Val::Value), 2) => m::<proto::Value>(Value),
        (Entry(Val::Argument), 2) => m::<proto::Argument>(Argument),
        _ => Field::Free,
    }
}

/// Why the walk stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("malformed protobuf at byte {0}")]
    Malformed(usize),
    #[error("nested deeper than {MAX_DEPTH} messages")]
    TooDeep,
    #[error(
        "decoding it would take more than {limit} bytes of memory ({at_byte} bytes in); \
         a real program needs a few MB (see docs/safety.md)"
    )]
    TooLarge { limit: u64, at_byte: usize },
}

struct Walk<'a> {
    bytes: &'a [u8],
    cost: u64,
    limit: u64,
}

impl Walk<'_> {
    fn varint(&self, at: &mut usize) -> Result<u64, WireError> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = *self.bytes.get(*at).ok_or(WireError::Malformed(*at))?;
            *at += 1;
            v |= ((b & 0x7f) as u64) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireError::Malformed(*at))
    }

    fn add(&mut self, n: u64, at: usize) -> Result<(), WireError> {
        self.cost = self.cost.saturating_add(n);
        if self.cost > self.limit {
            return Err(WireError::TooLarge {
                limit: self.limit,
                at_byte: at,
            });
        }
        Ok(())
    }

    /// Walk the message of kind `msg` in `bytes[start..end]`.
    fn message(&mut self, msg: Msg, start: usize, end: usize, depth: u32) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        let mut at = start;
        while at < end {
            let key = self.varint(&mut at)?;
            let (tag, wire) = ((key >> 3) as u32, key & 7);
            let f = field(msg, tag);
            match wire {
                0 => {
                    self.varint(&mut at)?;
                    if let Field::Scalars(n) = f {
                        self.add(n, at)?;
                    }
                }
                1 | 5 => {
                    at += if wire == 1 { 8 } else { 4 };
                    if let Field::Scalars(n) = f {
                        self.add(n, at)?;
                    }
                }
                2 => {
                    let len = self.varint(&mut at)?;
                    let body = at;
                    let stop = usize::try_from(len)
                        .ok()
                        .and_then(|l| at.checked_add(l))
                        .filter(|&s| s <= end)
                        .ok_or(WireError::Malformed(at))?;
                    at = stop;
                    match f {
                        Field::Msg(sub, size) => {
                            self.add(size, body)?;
                            self.message(sub, body, stop, depth + 1)?;
                        }
                        Field::Str => self.add(len + size_of::<String>() as u64, body)?,
                        // Packed: at most one element per byte.
                        Field::Scalars(n) => self.add(len.saturating_mul(n), body)?,
                        Field::Free => {}
                    }
                }
                _ => return Err(WireError::Malformed(at)),
            }
        }
        if at != end {
            return Err(WireError::Malformed(end));
        }
        Ok(())
    }
}

/// Refuse model bytes whose decoded form would exceed `limit` bytes; returns the estimate.
pub fn check_decoded_size(bytes: &[u8], limit: u64) -> Result<u64, WireError> {
    let mut w = Walk {
        bytes,
        cost: size_of::<proto::Model>() as u64,
        limit,
    };
    w.message(Msg::Model, 0, bytes.len(), 0)?;
    Ok(w.cost)
}
