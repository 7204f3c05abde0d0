//! The iOS18 constexpr weight ops, evaluated once when a program loads:
//! - `constexpr_lut_to_dense` (iOS18 form): indices `uintN` with the output's shape (vector
//!   palettization aside) and a LUT of rank K + 2, `[g0, .., gK-1, 2^N, VECTOR_SIZE]`; every
//!   `g_k` divides the indices' dimension k, giving one table per block of `d_k / g_k`
//!   positions along each axis (grouped channels); a VECTOR_SIZE above 1 writes that many
//!   consecutive values along `vector_axis` per index.
//! - `constexpr_blockwise_shift_scale`: `out = scale[b] · (data − offset[b])`, `b` being the
//!   block of each element (`data.shape[k] / scale.shape[k]` positions along axis k). Its
//!   `data` may itself be a constexpr result (coremltools chains it after a LUT for per-channel
//!   scales, or before one to scale the LUT).
//!
//! Every size is checked against the declared output type (itself checked against the limits
//! before this runs) before the output is allocated.

use crate::exec::ops::OpError;
use crate::exec::tensor::{Data, Tensor};
use crate::mil::DType;
use crate::mlpackage::TensorTypeInfo;

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        s[k] = s[k + 1] * shape[k + 1];
    }
    s
}

/// The width of an iOS18 LUT index type.
pub(crate) fn index_bits(dtype: DType) -> Result<u32, OpError> {
    match dtype {
        DType::U1 => Ok(1),
        DType::U2 => Ok(2),
        DType::U3 => Ok(3),
        DType::U4 => Ok(4),
        DType::U6 => Ok(6),
        DType::U8 => Ok(8),
        other => Err(format!("indices must be uint1/2/3/4/6/8, not {}", other.name()).into()),
    }
}

/// For each axis, how many positions share one block: `outer[k] / inner[k]`, which must divide.
fn blocks(outer: &[usize], inner: &[usize], what: &str) -> Result<Vec<usize>, OpError> {
    outer
        .iter()
        .zip(inner)
        .enumerate()
        .map(|(k, (&o, &i))| {
            if i == 0 || o % i != 0 {
                Err(format!("{what} dimension {k} is {i}, which does not divide {o}").into())
            } else {
                Ok(o / i)
            }
        })
        .collect()
}

/// Advance a row-major multi-index over `shape` by one position.
fn step(m: &mut [usize], shape: &[usize]) {
    for k in (0..m.len()).rev() {
        m[k] += 1;
        if m[k] < shape[k] {
            return;
        }
        m[k] = 0;
    }
}

/// iOS18 `constexpr_lut_to_dense`.
pub(crate) fn lut_to_dense(
    indices: &Tensor,
    lut: &Tensor,
    vector_axis: Option<i64>,
    ty: &TensorTypeInfo,
) -> Result<Tensor, OpError> {
    let k = indices.rank();
    if k == 0 || lut.rank() != k + 2 {
        return Err(format!(
            "a LUT of rank {} for indices of rank {k} (needs rank {})",
            lut.rank(),
            k + 2
        )
        .into());
    }
    let nbits = index_bits(indices.dtype)?;
    let (palettes, vsize) = (lut.shape[k], lut.shape[k + 1]);
    if palettes != 1 << nbits || vsize == 0 {
        return Err(format!("LUT of {palettes}×{vsize} entries for {nbits}-bit indices").into());
    }
    let block = blocks(&indices.shape, &lut.shape[..k], "LUT")?;
    let axis = match (vsize, vector_axis) {
        (1, _) => None,
        (_, Some(a)) if (-(k as i64)..k as i64).contains(&a) => {
            Some(a.rem_euclid(k as i64) as usize)
        }
        (_, a) => {
            return Err(
                format!("vector size {vsize} needs a vector_axis in rank {k}, got {a:?}").into(),
            )
        }
    };
    let mut out_shape = indices.shape.clone();
    if let Some(a) = axis {
        out_shape[a] *= vsize;
    }
    if out_shape != ty.shape || indices.len() != indices.shape.iter().product::<usize>() {
        return Err(format!(
            "output {out_shape:?} does not match the declared {:?}",
            ty.shape
        )
        .into());
    }
    let (gstride, ostride) = (strides(&lut.shape[..k]), strides(&out_shape));
    let table = lut.as_f32();
    let idx = indices.as_i64();
    let mut out = vec![0f32; out_shape.iter().product()];
    let mut m = vec![0usize; k];
    for &i in idx.iter() {
        if i < 0 || i >= palettes as i64 {
            return Err(format!("index {i} is outside a LUT of {palettes} entries").into());
        }
        let g: usize = (0..k).map(|a| m[a] / block[a] * gstride[a]).sum();
        let base = (g * palettes + i as usize) * vsize;
        let mut at: usize = (0..k).map(|a| m[a] * ostride[a]).sum();
        if let Some(a) = axis {
            at += m[a] * (vsize - 1) * ostride[a];
        }
        let vstride = axis.map_or(0, |a| ostride[a]);
        for v in 0..vsize {
            out[at + v * vstride] = table[base + v];
        }
        step(&mut m, &indices.shape);
    }
    let data = if lut.dtype.is_float() {
        Data::F(out)
    } else {
        Data::I(out.into_iter().map(|x| x as i64).collect())
    };
    Ok(Tensor::new(lut.dtype, out_shape, data))
}

/// `constexpr_blockwise_shift_scale`.
pub(crate) fn shift_scale(
    data: &Tensor,
    scale: &Tensor,
    offset: Option<&Tensor>,
    ty: &TensorTypeInfo,
) -> Result<Tensor, OpError> {
    if data.rank() == 0 || scale.rank() != data.rank() {
        return Err(format!(
            "scale of rank {} for data of rank {} (they must match)",
            scale.rank(),
            data.rank()
        )
        .into());
    }
    if offset.is_some_and(|o| o.shape != scale.shape) {
        return Err("offset and scale differ in shape".into());
    }
    if !scale.dtype.is_float() {
        return Err(format!("scale must be fp16 or fp32, not {}", scale.dtype.name()).into());
    }
    let block = blocks(&data.shape, &scale.shape, "scale")?;
    if data.shape != ty.shape || data.len() != data.shape.iter().product::<usize>() {
        return Err(format!(
            "data {:?} does not match the declared {:?}",
            data.shape, ty.shape
        )
        .into());
    }
    let sstride = strides(&scale.shape);
    let (d, s) = (data.as_f32(), scale.as_f32());
    let o = offset.map(|o| o.as_f32());
    let mut m = vec![0usize; data.rank()];
    let mut out = Vec::with_capacity(d.len());
    for &x in d.iter() {
        let b: usize = (0..m.len()).map(|a| m[a] / block[a] * sstride[a]).sum();
        let shift = o.as_ref().map_or(0.0, |o| o[b]);
        out.push(s[b] * (x - shift));
        step(&mut m, &data.shape);
    }
    Ok(Tensor::new(scale.dtype, data.shape.clone(), Data::F(out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(shape: &[usize]) -> TensorTypeInfo {
        TensorTypeInfo {
            dtype: DType::F16,
            shape: shape.to_vec(),
        }
    }

    fn ints(dtype: DType, shape: &[usize], v: &[i64]) -> Tensor {
        Tensor::new(dtype, shape.to_vec(), Data::I(v.to_vec()))
    }

    #[test]
    fn grouped_lut_follows_the_op_definition() {
        // coremltools' docstring example: indices uint2 [6, 2], LUT [2, 1, 4, 1]: two tables
        // over row groups of 3.
        let idx = ints(DType::U2, &[6, 2], &[2, 3, 3, 0, 1, 0, 3, 0, 2, 1, 0, 3]);
        let lut = Tensor::f32(vec![2, 1, 4, 1], vec![1., 5., 9., 13., 2., 10., 18., 26.]);
        let out = lut_to_dense(&idx, &lut, None, &ty(&[6, 2])).unwrap();
        assert_eq!(
            out.as_f32().to_vec(),
            vec![9., 13., 13., 1., 5., 1., 26., 2., 18., 10., 2., 26.]
        );
    }

    #[test]
    fn vector_lut_fills_along_its_axis() {
        // Case 2 of the definition: uint1 [2, 2, 2], LUT [1, 1, 1, 2, 3].
        let idx = ints(DType::U1, &[2, 2, 2], &[0, 0, 1, 0, 1, 1, 0, 0]);
        let lut = Tensor::f32(vec![1, 1, 1, 2, 3], vec![0., 1., 2., 10., 11., 12.]);
        let out = lut_to_dense(&idx, &lut, Some(2), &ty(&[2, 2, 6])).unwrap();
        assert_eq!(
            out.as_f32()[..12].to_vec(),
            vec![0., 1., 2., 0., 1., 2., 10., 11., 12., 0., 1., 2.]
        );
        let out = lut_to_dense(&idx, &lut, Some(1), &ty(&[2, 6, 2])).unwrap();
        assert_eq!(
            out.as_f32()[..12].to_vec(),
            vec![0., 0., 1., 1., 2., 2., 10., 0., 11., 1., 12., 2.]
        );
    }

    #[test]
    fn bad_luts_are_refused() {
        let idx = ints(DType::U2, &[6, 2], &[0; 12]);
        let lut = Tensor::f32(vec![4, 1, 4, 1], vec![0.; 16]);
        assert!(
            lut_to_dense(&idx, &lut, None, &ty(&[6, 2])).is_err(),
            "4 ∤ 6"
        );
        let lut = Tensor::f32(vec![1, 1, 8, 1], vec![0.; 8]);
        assert!(
            lut_to_dense(&idx, &lut, None, &ty(&[6, 2])).is_err(),
            "8 entries, 2 bits"
        );
        let lut = Tensor::f32(vec![1, 1, 4, 1], vec![0.; 4]);
        assert!(
            lut_to_dense(&idx, &lut, None, &ty(&[6, 3])).is_err(),
            "declared shape"
        );
        let bad = ints(DType::U2, &[6, 2], &[7; 12]);
        assert!(
            lut_to_dense(&bad, &lut, None, &ty(&[6, 2])).is_err(),
            "index range"
        );
        let lut = Tensor::f32(vec![1, 1, 4, 2], vec![0.; 8]);
        assert!(
            lut_to_dense(&idx, &lut, None, &ty(&[6, 4])).is_err(),
            "no vector_axis"
        );
    }

    #[test]
    fn blockwise_scale_and_offset() {
        let data = Tensor::f32(vec![2, 4], vec![1., 2., 3., 4., 5., 6., 7., 8.]);
        let scale = Tensor::f32(vec![2, 2], vec![1., 10., 100., 1000.]);
        let offset = Tensor::f32(vec![2, 2], vec![1., 0., 0., 1.]);
        let out = shift_scale(&data, &scale, Some(&offset), &ty(&[2, 4])).unwrap();
        assert_eq!(
            out.as_f32().to_vec(),
            vec![0., 1., 30., 40., 500., 600., 6000., 7000.]
        );
        let scale = Tensor::f32(vec![2, 3], vec![1.; 6]);
        assert!(shift_scale(&data, &scale, None, &ty(&[2, 4])).is_err());
    }
}
