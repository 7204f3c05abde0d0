//! A compiled program's constants read back by name (validate's weight check): whole, or a range
//! of elements at a time so a packed weight decodes only the rows asked for.

use std::borrow::Cow;

use super::{packed, Program, RuntimeError, Tensor};

impl Program {
    /// The value of the constant (or constexpr result) named `name`, as the program computes
    /// with it, if a kept constant has that name (a packed weight is decoded for the caller).
    pub fn constant(&self, name: &str) -> Option<Cow<'_, Tensor>> {
        let slot = *self.const_names.get(name)?;
        if let Some(p) = self.packed.get(&slot) {
            return p.dense().ok().map(Cow::Owned);
        }
        self.consts
            .iter()
            .find(|(s, _)| *s == slot)
            .map(|(_, t)| Cow::Borrowed(t.as_ref()))
    }

    /// The constant (or constexpr result) named `name`, read a range of elements at a time: a
    /// packed weight decodes only the rows a range covers (validate's weight check reads an
    /// 8B's 2.1 GB embedding this way), a held one is borrowed. `None` as for
    /// [`Program::constant`].
    pub fn constant_reader(&self, name: &str) -> Option<ConstantReader<'_>> {
        let slot = *self.const_names.get(name)?;
        if let Some(p) = self.packed.get(&slot) {
            return Some(ConstantReader::Packed(p));
        }
        self.consts
            .iter()
            .find(|(s, _)| *s == slot)
            .map(|(_, t)| ConstantReader::Held(t.as_f32()))
    }
}

/// A program's constant, read a range of elements at a time ([`Program::constant_reader`]).
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

    /// Elements `at..at + len` into `out` (cleared first), as [`Program::constant`] gives them.
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
