//! `const` and the constexpr weight ops, evaluated once when a program loads: iOS16/17 ops carry
//! their operands as attributes ([`ios17`]), iOS18 ones as inputs, each a value or the name of an
//! earlier constant ([`ios18`]). Every dense result is counted with the constants before it is
//! made.

pub(crate) mod ios17;
pub(crate) mod ios18;

use std::sync::Arc;

use super::loader::Loader;
use super::surface::{conform_const, Options, RuntimeError};
use crate::exec::limits;
use crate::exec::tensor::Tensor;
use crate::mil::Op;
use crate::mlpackage::{self, proto, TensorTypeInfo};

/// Evaluate a `const` or constexpr op. Blob-backed values are decoded once per
/// (file, offset), so a tied embedding shared by gather and lm_head costs one copy.
pub(super) fn evaluate(
    ld: &mut Loader,
    op: &proto::Operation,
    kind: Op,
    ty: &TensorTypeInfo,
) -> Result<Arc<Tensor>, RuntimeError> {
    // iOS16/17 constexpr ops carry their operands as attributes; iOS18 as const inputs.
    let mut operand = |key: &str| -> Result<mlpackage::TensorData, RuntimeError> {
        match op.attributes.get(key) {
            Some(v) => ld.value(v, &format!("`{key}` of {}", op.r#type)),
            None => Err(RuntimeError::Program(format!("missing attribute `{key}`"))),
        }
    };
    let t = match kind {
        Op::Const => {
            let v = op
                .attributes
                .get("val")
                .ok_or_else(|| RuntimeError::Program("const without `val`".into()))?;
            if let Some(proto::value::Value::BlobFileValue(b)) = &v.value {
                let key = (b.file_name.clone(), b.offset, ty.shape.clone());
                if let Some(t) = ld.const_cache().get(&key) {
                    return Ok(t.clone());
                }
                let t = Tensor::from_const(ld.value(v, "const `val`")?);
                let t = checked_const(t, ty, ld.options())?;
                ld.cache_const(key, t.clone());
                return Ok(t);
            } else {
                Tensor::from_const(ld.value(v, "const `val`")?)
            }
        }
        Op::ConstexprLutToDense | Op::ConstexprBlockwiseShiftScale
            if !op.attributes.contains_key("indices") =>
        {
            evaluate_ios18(ld, op, kind, ty)?
        }
        Op::ConstexprLutToDense => {
            let indices = operand("indices")?;
            let lut = operand("lut")?;
            let shape = operand("shape")?;
            // The dense result is counted with the constants (its operands were, on decoding).
            ld.count(limits::type_bytes(ty), &op.r#type)?;
            ios17::lut_to_dense(indices, lut, shape, ty)
                .map_err(|e| RuntimeError::Program(e.to_string()))?
        }
        other => {
            return Err(RuntimeError::Program(format!(
                "`{other}` is not a constexpr op"
            )))
        }
    };
    checked_const(t, ty, ld.options())
}

/// An iOS18 constexpr op: operands are inputs, each a value or the name of an earlier
/// constant. The dense result is counted with the constants before it is made.
fn evaluate_ios18(
    ld: &mut Loader,
    op: &proto::Operation,
    kind: Op,
    ty: &TensorTypeInfo,
) -> Result<Tensor, RuntimeError> {
    let mut operand = |key: &str| -> Result<Option<Arc<Tensor>>, RuntimeError> {
        let Some(arg) = op.inputs.get(key) else {
            return Ok(None);
        };
        let [b] = arg.arguments.as_slice() else {
            return Err(RuntimeError::Program(format!(
                "`{key}` must bind one value"
            )));
        };
        match &b.binding {
            Some(proto::binding::Binding::Value(v)) => Ok(Some(Arc::new(Tensor::from_const(
                ld.value(v, &format!("`{key}` of {}", op.r#type))?,
            )))),
            Some(proto::binding::Binding::Name(n)) => match ld.constants().get(n) {
                Some(t) => Ok(Some(t.clone())),
                None => match ld.packed_names().get(n).cloned() {
                    Some(p) => Ok(Some(Arc::new(ld.unpack(&p, key)?))),
                    None => Err(RuntimeError::Program(format!(
                        "`{key}` names `{n}`, which is not a constant defined before it"
                    ))),
                },
            },
            None => Err(RuntimeError::Program(format!("`{key}` binds nothing"))),
        }
    };
    let mut required = |key: &str| {
        operand(key)?.ok_or_else(|| RuntimeError::Program(format!("missing input `{key}`")))
    };
    let result = if kind == Op::ConstexprLutToDense {
        let (indices, lut) = (required("indices")?, required("lut")?);
        let axis = operand("vector_axis")?.and_then(|a| a.as_i64().first().copied());
        ld.count(limits::type_bytes(ty), &op.r#type)?;
        ios18::lut_to_dense(&indices, &lut, axis, ty)
    } else {
        let (data, scale) = (required("data")?, required("scale")?);
        let offset = operand("offset")?;
        ld.count(limits::type_bytes(ty), &op.r#type)?;
        ios18::shift_scale(&data, &scale, offset.as_deref(), ty)
    };
    result.map_err(|e| RuntimeError::Program(e.to_string()))
}

/// A constant's value with its declared shape and the dtype it computes in.
fn checked_const(
    t: Tensor,
    ty: &TensorTypeInfo,
    options: Options,
) -> Result<Arc<Tensor>, RuntimeError> {
    if t.shape != ty.shape && !(t.len() == 1 && ty.shape.iter().product::<usize>() == 1) {
        return Err(RuntimeError::Program(format!(
            "value of shape {:?}, declared {:?}",
            t.shape, ty.shape
        )));
    }
    let t = Tensor::new(t.dtype, ty.shape.clone(), t.data);
    Ok(Arc::new(conform_const(t, options)))
}
