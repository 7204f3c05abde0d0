//! Which constants stay in the memory-mapped weight file ([`Packed`]): a `const` of fp16 values
//! and the LUT weights whose op and operands have one of the forms [`Packed`] reads (iOS17's
//! one table; iOS18's tables along axis 0, optionally scaled per row by a following
//! `constexpr_blockwise_shift_scale`), recognised while the program loads. Anything else is
//! left to the dense decoders of [`constexpr`](super::constexpr).

use std::sync::Arc;

use super::constexpr::ios18::index_bits;
use super::loader::Loader;
use super::surface::{effective_dtype, RuntimeError};
use crate::exec::packed::{Form, Lut, Packed};
use crate::exec::tensor::Tensor;
use crate::mil::{DType, Op};
use crate::mlpackage::{proto, BlobFile, TensorTypeInfo, Values};

/// The value bound to input `key` of an iOS18 op: a literal (decoded, counted with the
/// constants) or an earlier dense constant; `None` for anything else.
fn operand18(
    ld: &mut Loader,
    op: &proto::Operation,
    key: &str,
) -> Result<Option<Arc<Tensor>>, RuntimeError> {
    let Some([b]) = op.inputs.get(key).map(|a| a.arguments.as_slice()) else {
        return Ok(None);
    };
    Ok(match &b.binding {
        Some(proto::binding::Binding::Value(v)) => Some(Arc::new(Tensor::from_const(
            ld.value(v, &format!("`{key}` of {}", op.r#type))?,
        ))),
        Some(proto::binding::Binding::Name(n)) => ld.constants().get(n).cloned(),
        None => None,
    })
}

/// The blob a value names, when its bytes are exactly what its declared type needs (the
/// dense decoder's own check): the file and the record's offset. The type is checked
/// against the limits like any other.
fn blob_of(
    ld: &Loader,
    v: &proto::Value,
    what: &str,
) -> Result<Option<(Arc<BlobFile>, u64, TensorTypeInfo)>, RuntimeError> {
    let Some(proto::value::Value::BlobFileValue(b)) = &v.value else {
        return Ok(None);
    };
    let ty = ld.declared(v.r#type.as_ref(), what)?;
    let file = ld.pkg().blob_file(&b.file_name)?;
    let Ok(rec) = file.record(b.offset) else {
        return Ok(None);
    };
    let bits = ty.dtype.bits() as usize;
    let needed = crate::mlpackage::element_count(&ty.shape)
        .and_then(|n| n.checked_mul(bits))
        .map(|b| b.div_ceil(8));
    let fits = needed.is_some_and(|n| {
        rec.dtype == ty.dtype
            && (bits >= 8 && rec.data.len() == n || bits < 8 && rec.data.len() >= n)
    });
    Ok(fits.then_some((file, b.offset, ty)))
}

/// A constant or constexpr weight left packed, when its op and operands have one of the
/// forms [`Packed`] reads; `None` leaves it to the dense decoders (which report any error).
pub(super) fn try_pack(
    ld: &mut Loader,
    op: &proto::Operation,
    kind: Op,
    ty: &TensorTypeInfo,
) -> Result<Option<Packed>, RuntimeError> {
    if ld.options().dense_weights || ty.shape.len() < 2 || !ty.dtype.is_float() {
        return Ok(None);
    }
    match kind {
        Op::Const => {
            let Some(v) = op.attributes.get("val") else {
                return Ok(None);
            };
            let Some((file, offset, vty)) = blob_of(ld, v, "const `val`")? else {
                return Ok(None);
            };
            if vty.dtype != DType::F16 || vty.shape != ty.shape {
                return Ok(None);
            }
            let dtype = effective_dtype(DType::F16, ld.options());
            Ok(Packed::new(
                file,
                offset,
                dtype,
                ty.shape.clone(),
                Form::Half,
            ))
        }
        Op::ConstexprLutToDense if op.attributes.contains_key("indices") => lut17(ld, op, ty),
        Op::ConstexprLutToDense => lut18(ld, op, ty),
        Op::ConstexprBlockwiseShiftScale => scaled18(ld, op, ty),
        _ => Ok(None),
    }
}

/// iOS16/17 `constexpr_lut_to_dense`: one table, uint8 bytes of packed indices.
fn lut17(
    ld: &mut Loader,
    op: &proto::Operation,
    ty: &TensorTypeInfo,
) -> Result<Option<Packed>, RuntimeError> {
    let (Some(idx), Some(lut), Some(shape)) = (
        op.attributes.get("indices"),
        op.attributes.get("lut"),
        op.attributes.get("shape"),
    ) else {
        return Ok(None);
    };
    let Some((file, offset, ity)) = blob_of(ld, idx, "`indices` of constexpr_lut_to_dense")? else {
        return Ok(None);
    };
    let shape = ld.value(shape, "`shape` of constexpr_lut_to_dense")?;
    let lut = ld.value(lut, "`lut` of constexpr_lut_to_dense")?;
    let dims: Vec<usize> = match &shape.values {
        Values::Int(d) => d.iter().map(|&d| d.max(0) as usize).collect(),
        _ => return Ok(None),
    };
    let (Values::Float(table), DType::U8) = (lut.values, ity.dtype) else {
        return Ok(None);
    };
    let nbits = table.len().trailing_zeros();
    if dims != ty.shape || !table.len().is_power_of_two() || ![1, 2, 3, 4, 6, 8].contains(&nbits) {
        return Ok(None);
    }
    let form = Form::Lut(Lut {
        nbits,
        tables: table,
        rows_per_table: ty.shape[0],
        scale: None,
    });
    let dtype = effective_dtype(lut.dtype, ld.options());
    Ok(Packed::new(file, offset, dtype, ty.shape.clone(), form))
}

/// iOS18 `constexpr_lut_to_dense` with scalar entries and tables only along axis 0
/// (LUT `[g, 1, .., 2^N, 1]`), indices `uintN` in a blob.
fn lut18(
    ld: &mut Loader,
    op: &proto::Operation,
    ty: &TensorTypeInfo,
) -> Result<Option<Packed>, RuntimeError> {
    let idx = match op.inputs.get("indices").map(|a| a.arguments.as_slice()) {
        Some([b]) => match &b.binding {
            Some(proto::binding::Binding::Value(v)) => v,
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let Some((file, offset, ity)) = blob_of(ld, idx, "`indices` of constexpr_lut_to_dense")? else {
        return Ok(None);
    };
    let Some(lut) = operand18(ld, op, "lut")? else {
        return Ok(None);
    };
    let (k, Ok(nbits)) = (ity.shape.len(), index_bits(ity.dtype)) else {
        return Ok(None);
    };
    let rows = ty.shape[0];
    let groups = lut.shape.first().copied().unwrap_or(0);
    let single = lut.rank() == k + 2
        && lut.shape[1..k].iter().all(|&g| g == 1)
        && lut.shape[k] == 1 << nbits
        && lut.shape[k + 1] == 1;
    if !single || ity.shape != ty.shape || groups == 0 || !rows.is_multiple_of(groups) {
        return Ok(None);
    }
    if !lut.dtype.is_float() {
        return Ok(None);
    }
    let form = Form::Lut(Lut {
        nbits,
        tables: lut.as_f32().into_owned(),
        rows_per_table: rows / groups,
        scale: None,
    });
    let dtype = effective_dtype(lut.dtype, ld.options());
    Ok(Packed::new(file, offset, dtype, ty.shape.clone(), form))
}

/// iOS18 `constexpr_blockwise_shift_scale` of a packed, unscaled LUT weight, with scales
/// (and offsets) only along axis 0.
fn scaled18(
    ld: &mut Loader,
    op: &proto::Operation,
    ty: &TensorTypeInfo,
) -> Result<Option<Packed>, RuntimeError> {
    let data = match op.inputs.get("data").map(|a| a.arguments.as_slice()) {
        Some([b]) => match &b.binding {
            Some(proto::binding::Binding::Name(n)) => ld.packed_names().get(n).cloned(),
            _ => None,
        },
        _ => None,
    };
    let Some(data) = data else {
        return Ok(None);
    };
    let (Form::Lut(lut), Some(scale)) = (&data.form, operand18(ld, op, "scale")?) else {
        return Ok(None);
    };
    let offset = operand18(ld, op, "offset")?;
    let rows = ty.shape[0];
    let per_row = |t: &Tensor| {
        t.dtype.is_float()
            && t.shape.len() == ty.shape.len()
            && t.shape[1..].iter().all(|&d| d == 1)
            && t.shape[0] > 0
            && rows.is_multiple_of(t.shape[0])
    };
    let has_offset = op.inputs.contains_key("offset");
    let offset_ok = offset
        .as_ref()
        .map_or(!has_offset, |o| o.shape == scale.shape && per_row(o));
    if lut.scale.is_some() || data.shape != ty.shape || !per_row(&scale) || !offset_ok {
        return Ok(None);
    }
    let block = rows / scale.shape[0];
    let s = scale.as_f32();
    let o = offset.as_ref().map(|o| o.as_f32());
    let scale_rows = (0..rows)
        .map(|r| (s[r / block], o.as_ref().map_or(0.0, |o| o[r / block])))
        .collect();
    let form = Form::Lut(Lut {
        scale: Some(scale_rows),
        ..lut.clone()
    });
    let dtype = effective_dtype(scale.dtype, ld.options());
    Ok(Packed::new(
        data.file.clone(),
        data.offset,
        dtype,
        ty.shape.clone(),
        form,
    ))
}
