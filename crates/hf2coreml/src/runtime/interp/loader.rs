//! The state of a program while it compiles ([`Loader`]): name → slot, the constants decoded so
//! far, counted against the limits before each is decoded, and one operation at a time turned
//! into a constant or an instruction.

use std::collections::HashMap;
use std::sync::Arc;

use super::constexpr;
use super::limits::{self, Limits};
use super::program::{Arg, Instr, OpKind, CONSTEXPR};
use super::{conform_const, packed, Options, RuntimeError, Tensor};
use crate::mlpackage::{self, proto, MlPackage, TensorTypeInfo};

/// Key of a decoded blob constant: file, offset, declared shape.
pub(super) type ConstKey = (String, u64, Vec<usize>);

/// State while a program compiles: name → slot, the constants decoded so far and their bytes.
pub(super) struct Loader<'p> {
    pub(super) pkg: &'p MlPackage,
    pub(super) options: Options,
    pub(super) limits: Limits,
    pub(super) slots: HashMap<String, usize>,
    pub(super) const_bytes: u64,
    pub(super) const_cache: HashMap<ConstKey, Arc<Tensor>>,
    /// Every constant and constexpr result so far, by name: iOS18 constexpr ops may name one
    /// as an operand.
    pub(super) constants: HashMap<String, Arc<Tensor>>,
    /// The weights left packed so far, by slot and by name
    /// ([`settle_packed`](super::weights::settle_packed) decides which stay so).
    pub(super) packed: Vec<(usize, Arc<packed::Packed>)>,
    pub(super) packed_names: HashMap<String, Arc<packed::Packed>>,
}

impl Loader<'_> {
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

    /// Compile one operation: a constant (returned, to be stored) or an instruction (pushed).
    pub(super) fn instr(
        &mut self,
        op: &proto::Operation,
        instrs: &mut Vec<Instr>,
    ) -> Result<Option<(usize, Arc<Tensor>)>, RuntimeError> {
        let first_out = op
            .outputs
            .first()
            .map(|o| o.name.clone())
            .unwrap_or_default();
        let op_err = |msg: String| RuntimeError::Op {
            op_type: op.r#type.clone(),
            output: first_out.clone(),
            msg,
        };
        let mut outs = Vec::new();
        for o in &op.outputs {
            let ty = self.declared(o.r#type.as_ref(), &format!("`{}`", o.name))?;
            outs.push((o.name.clone(), ty));
        }
        let kind = OpKind::parse(&op.r#type);
        if let Some(constant) = match kind {
            OpKind::Known(k) if CONSTEXPR.contains(&k) => Some(k),
            _ => None,
        } {
            let (name, ty) = outs.first().ok_or_else(|| op_err("no output".into()))?;
            if let Some(p) = packed::try_pack(self, op, constant, ty)? {
                let (p, s) = (Arc::new(p), self.slot(name));
                self.packed.push((s, p.clone()));
                self.packed_names.insert(name.clone(), p);
                return Ok(None);
            }
            let t = constexpr::evaluate(self, op, constant, ty).map_err(|e| match e {
                RuntimeError::Program(msg) => op_err(msg),
                other => other,
            })?;
            self.constants.insert(name.clone(), t.clone());
            return Ok(Some((self.slot(name), t)));
        }
        if op.r#type.starts_with("constexpr_") {
            return Err(RuntimeError::UnsupportedOp {
                op_type: op.r#type.clone(),
                output: first_out,
            });
        }
        let mut args = Vec::new();
        let mut keys: Vec<&String> = op.inputs.keys().collect();
        keys.sort();
        for key in keys {
            let mut bound = Vec::new();
            for b in &op.inputs[key].arguments {
                match &b.binding {
                    Some(proto::binding::Binding::Name(n)) => {
                        let s = *self.slots.get(n).ok_or_else(|| {
                            op_err(format!(
                                "argument `{key}` names `{n}`, which is not defined before it"
                            ))
                        })?;
                        bound.push(Arg::Slot(s));
                    }
                    Some(proto::binding::Binding::Value(v)) => {
                        let t = self.value(v, &format!("argument `{key}` of `{first_out}`"))?;
                        let t = conform_const(Tensor::from_const(t), self.options);
                        bound.push(Arg::Const(Arc::new(t)));
                    }
                    None => return Err(op_err(format!("argument `{key}` has an empty binding"))),
                }
            }
            args.push((key.clone(), bound));
        }
        let mut outputs = Vec::new();
        let mut out_names = Vec::new();
        for (name, ty) in outs {
            outputs.push((self.slot(&name), ty));
            out_names.push(name);
        }
        instrs.push(Instr {
            op: kind,
            inputs: args,
            outputs,
            out_names,
            frees: Vec::new(),
            in_place: None,
        });
        Ok(None)
    }
}
