//! One operation of a saved function compiled: a `const` or constexpr weight becomes a constant
//! (left packed in the weight file when [`packing`] can read it there, else evaluated by
//! [`constexpr`]), anything else an instruction whose arguments are slots or inline constants.

use std::sync::Arc;

use super::constexpr;
use super::instr::{Arg, Instr, OpKind, CONSTEXPR};
use super::loader::Loader;
use super::packing;
use super::surface::{conform_const, RuntimeError};
use crate::exec::tensor::Tensor;
use crate::mlpackage::proto;

/// Compile one operation: a constant (returned, to be stored) or an instruction (pushed).
pub(super) fn operation(
    ld: &mut Loader,
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
        let ty = ld.declared(o.r#type.as_ref(), &format!("`{}`", o.name))?;
        outs.push((o.name.clone(), ty));
    }
    let kind = OpKind::parse(&op.r#type);
    if let Some(constant) = match kind {
        OpKind::Known(k) if CONSTEXPR.contains(&k) => Some(k),
        _ => None,
    } {
        let (name, ty) = outs.first().ok_or_else(|| op_err("no output".into()))?;
        if let Some(p) = packing::try_pack(ld, op, constant, ty)? {
            ld.keep_packed(name, Arc::new(p));
            return Ok(None);
        }
        let t = constexpr::evaluate(ld, op, constant, ty).map_err(|e| match e {
            RuntimeError::Program(msg) => op_err(msg),
            other => other,
        })?;
        ld.keep_constant(name, t.clone());
        return Ok(Some((ld.slot(name), t)));
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
                    let s = *ld.slots().get(n).ok_or_else(|| {
                        op_err(format!(
                            "argument `{key}` names `{n}`, which is not defined before it"
                        ))
                    })?;
                    bound.push(Arg::Slot(s));
                }
                Some(proto::binding::Binding::Value(v)) => {
                    let t = ld.value(v, &format!("argument `{key}` of `{first_out}`"))?;
                    let t = conform_const(Tensor::from_const(t), ld.options());
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
        outputs.push((ld.slot(&name), ty));
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
