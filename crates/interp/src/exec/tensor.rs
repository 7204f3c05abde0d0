//! The interpreter's values: a declared MIL dtype, a fixed shape and flat row-major data.

use std::borrow::Cow;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::mil::DType;
use crate::mlpackage::{TensorData, Values};

/// Flat element storage. Floats compute in f32 and are rounded to their declared dtype after
/// every op (an fp16 value is an f32 that is exactly representable in fp16); `Half` holds fp16
/// values that only move (cache inputs, slices of them) so they are not widened needlessly.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    F(Vec<f32>),
    Half(Vec<f16>),
    I(Vec<i64>),
    B(Vec<bool>),
}

impl Data {
    pub fn len(&self) -> usize {
        match self {
            Data::F(v) => v.len(),
            Data::Half(v) => v.len(),
            Data::I(v) => v.len(),
            Data::B(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// fp16 storage.
    pub fn is_half(&self) -> bool {
        matches!(self, Data::Half(_))
    }

    /// fp16 storage, or f32 values that fp16 holds exactly (NaN excluded: its payload may
    /// not survive the round trip).
    pub fn is_exact_half(&self) -> bool {
        match self {
            Data::Half(_) => true,
            Data::F(v) => v
                .iter()
                .all(|&x| f16::from_f32(x).to_f32().to_bits() == x.to_bits()),
            _ => false,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Data::F(_) | Data::Half(_) => "float",
            Data::I(_) => "int",
            Data::B(_) => "bool",
        }
    }
}

/// One value of the program.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Tensor {
    pub fn new(dtype: DType, shape: Vec<usize>, data: Data) -> Self {
        Tensor { dtype, shape, data }
    }

    pub fn f32(shape: Vec<usize>, v: Vec<f32>) -> Self {
        Tensor::new(DType::F32, shape, Data::F(v))
    }

    pub fn f16(shape: Vec<usize>, v: Vec<f16>) -> Self {
        Tensor::new(DType::F16, shape, Data::Half(v))
    }

    pub fn i32(shape: Vec<usize>, v: &[i32]) -> Self {
        Tensor::new(
            DType::I32,
            shape,
            Data::I(v.iter().map(|&x| x as i64).collect()),
        )
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Float view (ints and bools are converted).
    pub fn as_f32(&self) -> Cow<'_, [f32]> {
        match &self.data {
            Data::F(v) => Cow::Borrowed(v),
            Data::Half(v) => Cow::Owned(half_to_f32(v)),
            Data::I(v) => Cow::Owned(v.iter().map(|&x| x as f32).collect()),
            Data::B(v) => Cow::Owned(v.iter().map(|&x| x as u8 as f32).collect()),
        }
    }

    /// Integer view (floats truncate toward zero, as numpy's astype does).
    pub fn as_i64(&self) -> Cow<'_, [i64]> {
        match &self.data {
            Data::I(v) => Cow::Borrowed(v),
            Data::F(v) => Cow::Owned(v.iter().map(|&x| x as i64).collect()),
            Data::Half(v) => Cow::Owned(v.iter().map(|x| x.to_f32() as i64).collect()),
            Data::B(v) => Cow::Owned(v.iter().map(|&x| x as i64).collect()),
        }
    }

    pub fn as_bool(&self) -> Cow<'_, [bool]> {
        match &self.data {
            Data::B(v) => Cow::Borrowed(v),
            Data::I(v) => Cow::Owned(v.iter().map(|&x| x != 0).collect()),
            Data::F(v) => Cow::Owned(v.iter().map(|&x| x != 0.0).collect()),
            Data::Half(v) => Cow::Owned(v.iter().map(|x| x.to_f32() != 0.0).collect()),
        }
    }

    /// fp16 copy of a float tensor.
    pub fn to_f16_vec(&self) -> Vec<f16> {
        match &self.data {
            Data::Half(v) => v.clone(),
            _ => f32_to_half(&self.as_f32()),
        }
    }

    /// Build from a decoded package constant.
    pub fn from_const(t: TensorData) -> Self {
        let data = match t.values {
            Values::Float(v) => Data::F(v),
            Values::Int(v) => Data::I(v),
            Values::Bool(v) => Data::B(v),
            // Strings only appear as op parameters (cast's dtype); they never reach arithmetic.
            Values::Str(_) => Data::I(Vec::new()),
        };
        Tensor::new(t.dtype, t.shape, data)
    }
}

/// Round float data to `dtype` (fp16 overflows to ±inf as on device); wrap integers into
/// their type's range like a C cast / numpy astype.
pub fn conform_data(data: Data, dtype: DType) -> Data {
    match dtype {
        DType::F16 => match data {
            Data::Half(v) => Data::Half(v),
            Data::F(mut v) => {
                round_to_f16(&mut v);
                Data::F(v)
            }
            other => Data::F(round_vec(&other, |x| f16::from_f32(x).to_f32())),
        },
        DType::BF16 => Data::F(round_vec(&data, |x| bf16::from_f32(x).to_f32())),
        DType::F32 | DType::F64 => match data {
            Data::F(v) => Data::F(v),
            Data::Half(v) => Data::F(half_to_f32(&v)),
            other => Data::F(round_vec(&other, |x| x)),
        },
        DType::Bool => match data {
            Data::B(v) => Data::B(v),
            other => {
                let t = Tensor::new(DType::Bool, vec![], other);
                Data::B(t.as_bool().into_owned())
            }
        },
        d => {
            let t = Tensor::new(d, vec![], data);
            let v = t.as_i64();
            let bits = d.bits();
            let signed = matches!(
                d,
                DType::I4 | DType::I8 | DType::I16 | DType::I32 | DType::I64
            );
            if bits >= 64 {
                return Data::I(v.into_owned());
            }
            Data::I(
                v.iter()
                    .map(|&x| {
                        let m = x & ((1i64 << bits) - 1);
                        if signed && m >> (bits - 1) == 1 {
                            m - (1i64 << bits)
                        } else {
                            m
                        }
                    })
                    .collect(),
            )
        }
    }
}

// Bulk conversions: `half` uses the CPU's F16C instructions for slices when it has them
// (runtime detection), many times faster than converting element by element.

/// fp16 values widened to f32.
pub fn half_to_f32(v: &[f16]) -> Vec<f32> {
    super::bulk::widened(v)
}

/// f32 values rounded to fp16 (to nearest even; out of range becomes ±inf).
pub fn f32_to_half(v: &[f32]) -> Vec<f16> {
    let mut out = vec![f16::ZERO; v.len()];
    out.convert_from_f32_slice(v);
    out
}

/// Round f32 values to the nearest fp16 in place.
pub fn round_to_f16(v: &mut [f32]) {
    let mut buf = [f16::ZERO; 512];
    for chunk in v.chunks_mut(buf.len()) {
        let b = &mut buf[..chunk.len()];
        b.convert_from_f32_slice(chunk);
        b.convert_to_f32_slice(chunk);
    }
}

fn round_vec(data: &Data, f: impl Fn(f32) -> f32) -> Vec<f32> {
    let t = Tensor::new(DType::F32, vec![], data.clone());
    t.as_f32().iter().map(|&x| f(x)).collect()
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}
