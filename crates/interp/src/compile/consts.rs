//! A compiled program's constants read back by name (validate's weight check) a range of
//! elements at a time ([`ConstantReader`]), so a packed weight decodes only the rows asked for.

use std::borrow::Cow;

use super::surface::RuntimeError;
use crate::exec::packed;

/// A program's constant, read a range of elements at a time
/// ([`Program::constant_reader`](crate::Program::constant_reader)).
pub enum ConstantReader<'a> {
    /// Held decoded by the program (borrowed when it holds f32).
    Held(Cow<'a, [f32]>),
    /// Left in its weight file.
    Packed(&'a packed::Packed),
}

impl ConstantReader<'_> {
    /// Elements in all.
    pub fn numel(&self) -> usize {
        match self {
            ConstantReader::Held(v) => v.len(),
            ConstantReader::Packed(p) => p.rows() * p.cols(),
        }
    }

    /// Elements `at..at + len` into `out` (cleared first), as
    /// [`Program::constant`](crate::Program::constant) gives them.
    pub fn read(&self, at: usize, len: usize, out: &mut Vec<f32>) -> Result<(), RuntimeError> {
        let bad = |msg: String| RuntimeError::Program(format!("reading a constant: {msg}"));
        match self {
            ConstantReader::Held(v) => {
                let piece = at
                    .checked_add(len)
                    .and_then(|end| v.get(at..end))
                    .ok_or_else(|| bad(format!("elements {at}..+{len} of {}", v.len())))?;
                out.clear();
                out.extend_from_slice(piece);
                Ok(())
            }
            ConstantReader::Packed(p) => p.read_range(at, len, out).map_err(|e| bad(e.to_string())),
        }
    }
}
