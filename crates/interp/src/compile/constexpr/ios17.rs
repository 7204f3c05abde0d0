//! The iOS16/17 form of `constexpr_lut_to_dense`, whose operands are attributes
//! (docs/reference/mlpackage-format.md).

use crate::exec::ops::OpError;
use crate::exec::tensor::{Data, Tensor};
use crate::mlpackage::{self, TensorTypeInfo, Values};

/// iOS16/17 `constexpr_lut_to_dense`: one LUT of 2^nbits entries, indices packed LSB-first
/// into uint8.
pub(crate) fn lut_to_dense(
    indices: mlpackage::TensorData,
    lut: mlpackage::TensorData,
    shape: mlpackage::TensorData,
    ty: &TensorTypeInfo,
) -> Result<Tensor, OpError> {
    let Values::Int(packed) = indices.values else {
        return Err("indices must be uint8".into());
    };
    let Values::Int(dims) = shape.values else {
        return Err("shape must be uint32".into());
    };
    let out_shape: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
    if out_shape != ty.shape {
        return Err(format!(
            "shape {out_shape:?} does not match the declared {:?}",
            ty.shape
        )
        .into());
    }
    let n = mlpackage::element_count(&out_shape).ok_or("shape overflows")?;
    let entries = lut.values.len();
    let nbits = match entries {
        2 => 1,
        4 => 2,
        8 => 3,
        16 => 4,
        64 => 6,
        256 => 8,
        _ => {
            return Err(format!(
                "a LUT of {entries} entries is not 2^nbits for nbits in 1,2,3,4,6,8"
            )
            .into())
        }
    };
    let bytes: Vec<u8> = packed.iter().map(|&b| b as u8).collect();
    let idx = mlpackage::unpack_bits(&bytes, nbits, n)
        .ok_or_else(|| format!("{} index bytes for {n} {nbits}-bit indices", bytes.len()))?;
    let data = match lut.values {
        Values::Float(l) => Data::F(idx.iter().map(|&i| l[i as usize]).collect()),
        Values::Int(l) => Data::I(idx.iter().map(|&i| l[i as usize]).collect()),
        _ => return Err("LUT must be float or integer".into()),
    };
    Ok(Tensor::new(lut.dtype, out_shape, data))
}
