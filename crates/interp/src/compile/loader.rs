//! The state of a program while it compiles ([`Loader`]): name → slot, the constants decoded so
//! far, counted against the limits before each is decoded, and the weights left packed. Only
//! this file writes it; the steps of compiling call its methods.

use std::collections::HashMap;
use std::sync::Arc;

use super::surface::{Options, RuntimeError};
use crate::exec::limits::{self, Limits};
use crate::exec::packed;
use crate::exec::tensor::Tensor;
use crate::mlpackage::{self, proto, MlPackage, TensorTypeInfo};

/// Key of a decoded blob constant: file, offset, declared shape.
pub(super) type ConstKey = (String, u64, Vec<usize>);

/// State while a program compiles: name → slot, the constants decoded so far and their bytes.
pub(super) struct Loader<'p> {
    pkg: &'p MlPackage,
    options: Options,
    limits: Limits,
    slots: HashMap<String, usize>,
    const_bytes: u64,
    const_cache: HashMap<ConstKey, Arc<Tensor>>,
    /// Every constant and constexpr result so far, by name: iOS18 constexpr ops may name one
    /// as an operand.
    constants: HashMap<String, Arc<Tensor>>,
    /// The weights left packed so far, by slot and by name
    /// ([`settle_packed`](super::weights::settle_packed) decides which stay so).
    packed: Vec<(usize, Arc<packed::Packed>)>,
    packed_names: HashMap<String, Arc<packed::Packed>>,
}

impl<'p> Loader<'p> {
    /// Nothing compiled yet: no slots, no constants.
    pub(super) fn new(pkg: &'p MlPackage, options: Options, limits: Limits) -> Self {
        Loader {
            pkg,
            options,
            limits,
            slots: HashMap::new(),
            const_bytes: 0,
            const_cache: HashMap::new(),
            constants: HashMap::new(),
            packed: Vec::new(),
            packed_names: HashMap::new(),
        }
    }

    pub(super) fn pkg(&self) -> &'p MlPackage {
        self.pkg
    }

    pub(super) fn options(&self) -> Options {
        self.options
    }

    /// Every name given a slot so far.
    pub(super) fn slots(&self) -> &HashMap<String, usize> {
        &self.slots
    }

    /// Bytes of the constants decoded so far.
    pub(super) fn const_bytes(&self) -> u64 {
        self.const_bytes
    }

    /// Blob constants decoded so far, by file, offset and declared shape.
    pub(super) fn const_cache(&self) -> &HashMap<ConstKey, Arc<Tensor>> {
        &self.const_cache
    }

    /// Every constant and constexpr result so far, by name.
    pub(super) fn constants(&self) -> &HashMap<String, Arc<Tensor>> {
        &self.constants
    }

    /// The weights left packed so far, by name.
    pub(super) fn packed_names(&self) -> &HashMap<String, Arc<packed::Packed>> {
        &self.packed_names
    }

    /// A blob constant decoded, kept for the next constant of the same blob and shape.
    pub(super) fn cache_const(&mut self, key: ConstKey, t: Arc<Tensor>) {
        self.const_cache.insert(key, t);
    }

    /// The constant or constexpr result named `name`, for the iOS18 ops that name one.
    pub(super) fn keep_constant(&mut self, name: &str, t: Arc<Tensor>) {
        self.constants.insert(name.to_string(), t);
    }

    /// A weight left packed, given the slot of `name`.
    pub(super) fn keep_packed(&mut self, name: &str, p: Arc<packed::Packed>) {
        let s = self.slot(name);
        self.packed.push((s, p.clone()));
        self.packed_names.insert(name.to_string(), p);
    }

    /// The weights left packed, by slot, handed over once every instruction is known.
    pub(super) fn take_packed(&mut self) -> Vec<(usize, Arc<packed::Packed>)> {
        std::mem::take(&mut self.packed)
    }

    /// `bytes` more of constants (a dense constexpr result), counted before they are made.
    pub(super) fn count(&mut self, bytes: u64, what: &str) -> Result<(), RuntimeError> {
        let total = self.const_bytes.saturating_add(bytes);
        self.limits
            .check_peak(total)
            .map_err(|msg| self.limit_err(what, msg))?;
        self.const_bytes = total;
        Ok(())
    }

    pub(super) fn slot(&mut self, name: &str) -> usize {
        let n = self.slots.len();
        *self.slots.entry(name.to_string()).or_insert(n)
    }

    pub(super) fn limit_err(&self, what: &str, msg: String) -> RuntimeError {
        RuntimeError::Limit {
            what: format!("{}: {what}", self.pkg.model_path().display()),
            msg,
        }
    }

    /// A declared tensor type, refused above the per-tensor limit.
    pub(super) fn declared(
        &self,
        vt: Option<&proto::ValueType>,
        what: &str,
    ) -> Result<TensorTypeInfo, RuntimeError> {
        let ty = mlpackage::tensor_type(vt, what)?;
        self.limits
            .check_type(&ty)
            .map_err(|msg| self.limit_err(what, msg))?;
        Ok(ty)
    }

    /// Decode a constant value after checking its declared size, alone and added to every
    /// constant decoded before it.
    pub(super) fn value(
        &mut self,
        v: &proto::Value,
        what: &str,
    ) -> Result<mlpackage::TensorData, RuntimeError> {
        let ty = self.declared(v.r#type.as_ref(), what)?;
        let total = self.const_bytes.saturating_add(limits::type_bytes(&ty));
        self.limits
            .check_peak(total)
            .map_err(|msg| self.limit_err(what, format!("with the constants before it, {msg}")))?;
        self.const_bytes = total;
        Ok(self.pkg.value(v, what)?)
    }

    /// A packed weight decoded whole, counted with the constants first.
    pub(super) fn unpack(
        &mut self,
        p: &packed::Packed,
        what: &str,
    ) -> Result<Tensor, RuntimeError> {
        let total = self.const_bytes.saturating_add(p.dense_bytes());
        self.limits
            .check_peak(total)
            .map_err(|msg| self.limit_err(what, msg))?;
        self.const_bytes = total;
        p.dense().map_err(|e| RuntimeError::Program(e.to_string()))
    }
}
