//! The op kernel set: one function per MIL op the interpreter runs per step, and the index
//! arithmetic they share (broadcasting, strided windows, slices). One idea in one file, long
//! because the ops are many. Each takes its named arguments and returns raw results; the caller
//! (the compiled [`Program`](crate::Program)) checks shapes against the
//! program's declared output types and rounds to the declared dtypes. Semantics follow
//! coremltools' op definitions (iOS15..iOS17; docs/reference/mil-ops.md).

use std::collections::HashMap;

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::bulk;
use super::tensor::{strides, Data, Tensor};
use crate::mil::{DType, Op};
use crate::mlpackage::TensorTypeInfo;

/// An op failure before it is tagged with the op's type and output name
/// ([`RuntimeError::Op`](crate::RuntimeError::Op)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    #[error("missing argument `{0}`")]
    MissingArgument(String),
    #[error("output {0} is not declared")]
    UndeclaredOutput(usize),
    #[error("axis {axis} out of range for rank {rank}")]
    Axis { axis: i64, rank: usize },
    #[error("shapes {a:?} and {b:?} do not broadcast")]
    Broadcast { a: Vec<usize>, b: Vec<usize> },
    /// Arguments the op cannot take (bad shapes, values or combinations).
    #[error("{0}")]
    Invalid(String),
}

impl From<String> for OpError {
    fn from(msg: String) -> Self {
        OpError::Invalid(msg)
    }
}

impl From<&str> for OpError {
    fn from(msg: &str) -> Self {
        OpError::Invalid(msg.to_string())
    }
}

/// The result of an op kernel.
pub type OpResult<T> = Result<T, OpError>;

/// The arguments of one op invocation.
pub struct Args<'a> {
    pub map: HashMap<&'a str, Vec<&'a Tensor>>,
    /// Declared output types, in order.
    pub outputs: &'a [TensorTypeInfo],
}

impl<'a> Args<'a> {
    pub fn get(&self, name: &str) -> OpResult<&'a Tensor> {
        self.opt(name)
            .ok_or_else(|| OpError::MissingArgument(name.to_string()))
    }

    pub fn opt(&self, name: &str) -> Option<&'a Tensor> {
        self.map.get(name).and_then(|v| v.first().copied())
    }

    pub fn list(&self, name: &str) -> OpResult<&[&'a Tensor]> {
        self.map
            .get(name)
            .map(|v| v.as_slice())
            .ok_or_else(|| OpError::MissingArgument(name.to_string()))
    }

    pub fn ints(&self, name: &str) -> OpResult<Vec<i64>> {
        Ok(self.get(name)?.as_i64().into_owned())
    }

    pub fn int(&self, name: &str) -> OpResult<i64> {
        scalar_int(self.get(name)?, name)
    }

    pub fn int_or(&self, name: &str, default: i64) -> OpResult<i64> {
        match self.opt(name) {
            Some(t) => scalar_int(t, name),
            None => Ok(default),
        }
    }

    pub fn bool_or(&self, name: &str, default: bool) -> OpResult<bool> {
        match self.opt(name) {
            Some(t) => t
                .as_bool()
                .first()
                .copied()
                .ok_or_else(|| format!("`{name}` is empty").into()),
            None => Ok(default),
        }
    }

    pub fn float_or(&self, name: &str, default: f32) -> OpResult<f32> {
        match self.opt(name) {
            Some(t) => t
                .as_f32()
                .first()
                .copied()
                .ok_or_else(|| format!("`{name}` is empty").into()),
            None => Ok(default),
        }
    }

    pub fn out(&self, i: usize) -> OpResult<&'a TensorTypeInfo> {
        self.outputs.get(i).ok_or(OpError::UndeclaredOutput(i))
    }
}

fn scalar_int(t: &Tensor, name: &str) -> OpResult<i64> {
    if t.len() != 1 {
        return Err(format!("`{name}` must be a scalar, has shape {:?}", t.shape).into());
    }
    Ok(t.as_i64()[0])
}

/// Normalize a possibly negative axis against `rank`.
pub fn axis(a: i64, rank: usize) -> OpResult<usize> {
    let r = rank as i64;
    let n = if a < 0 { a + r } else { a };
    if n < 0 || n >= r.max(1) {
        return Err(OpError::Axis { axis: a, rank });
    }
    Ok(n as usize)
}

/// Apply `f` to the storage of any element type.
macro_rules! map_data {
    ($d:expr, |$v:ident| $body:expr) => {
        match $d {
            Data::F($v) => Data::F($body),
            Data::Half($v) => Data::Half($body),
            Data::I($v) => Data::I($body),
            Data::B($v) => Data::B($body),
        }
    };
}

fn take<T: Copy>(src: &[T], idx: &[usize]) -> Vec<T> {
    idx.iter().map(|&i| src[i]).collect()
}

/// Source index of every output element of a strided view: `out[i...] = x[start + step*i]`
/// per dimension.
fn strided_indices(
    in_shape: &[usize],
    start: &[i64],
    step: &[i64],
    out_shape: &[usize],
) -> Vec<usize> {
    let st = strides(in_shape);
    let n: usize = out_shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let rank = out_shape.len();
    let mut pos = vec![0usize; rank];
    loop {
        let mut off = 0i64;
        for d in 0..rank {
            off += (start[d] + step[d] * pos[d] as i64) * st[d] as i64;
        }
        out.push(off as usize);
        let mut d = rank;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            pos[d] += 1;
            if pos[d] < out_shape[d] {
                break;
            }
            pos[d] = 0;
        }
    }
}

fn broadcast_shape(a: &[usize], b: &[usize]) -> OpResult<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r {
            a[i + a.len() - r]
        } else {
            1
        };
        let db = if i + b.len() >= r {
            b[i + b.len() - r]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(OpError::Broadcast {
                a: a.to_vec(),
                b: b.to_vec(),
            });
        };
    }
    Ok(out)
}

/// For each element of `out_shape`, the index into a tensor of `shape` broadcast to it.
fn broadcast_indices(shape: &[usize], out_shape: &[usize]) -> Vec<usize> {
    let r = out_shape.len();
    let mut full = vec![1usize; r];
    full[r - shape.len()..].copy_from_slice(shape);
    let st = strides(&full);
    let bst: Vec<usize> = (0..r)
        .map(|d| if full[d] == 1 { 0 } else { st[d] })
        .collect();
    walk(out_shape, &bst)
}

fn zip_broadcast<A: Copy, B: Copy, R>(
    a: &[A],
    ash: &[usize],
    b: &[B],
    bsh: &[usize],
    f: impl Fn(A, B) -> R,
) -> OpResult<(Vec<usize>, Vec<R>)> {
    let out = broadcast_shape(ash, bsh)?;
    if ash == bsh {
        return Ok((out, a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()));
    }
    if b.len() == 1 && ash == out.as_slice() {
        let y = b[0];
        return Ok((out, a.iter().map(|&x| f(x, y)).collect()));
    }
    if a.len() == 1 && bsh == out.as_slice() {
        let x = a[0];
        return Ok((out, b.iter().map(|&y| f(x, y)).collect()));
    }
    // Trailing broadcast (e.g. [.., N] op [N]): `b` repeats along the leading dims.
    if ash == out.as_slice()
        && !b.is_empty()
        && a.len().is_multiple_of(b.len())
        && out.ends_with(trim_ones(bsh))
    {
        let n = b.len();
        return Ok((
            out,
            a.iter().enumerate().map(|(i, &x)| f(x, b[i % n])).collect(),
        ));
    }
    // Leading broadcast (e.g. [.., Q, N] op [.., Q, 1]): each element of `b` applies to a
    // contiguous block of `a`.
    if ash == out.as_slice() && !b.is_empty() && a.len().is_multiple_of(b.len()) {
        let lead = bsh.len() - bsh.iter().rev().take_while(|&&d| d == 1).count();
        let block = a.len() / b.len();
        if bsh[..lead] == out[out.len() - bsh.len()..][..lead]
            && out[..out.len() - bsh.len()].iter().all(|&d| d == 1)
        {
            let mut v = Vec::with_capacity(a.len());
            for (xs, &y) in a.chunks(block.max(1)).zip(b) {
                v.extend(xs.iter().map(|&x| f(x, y)));
            }
            return Ok((out, v));
        }
    }
    let ia = broadcast_indices(ash, &out);
    let ib = broadcast_indices(bsh, &out);
    Ok((
        out,
        ia.iter().zip(&ib).map(|(&i, &j)| f(a[i], b[j])).collect(),
    ))
}

fn trim_ones(s: &[usize]) -> &[usize] {
    let k = s.iter().take_while(|&&d| d == 1).count();
    &s[k..]
}

fn both_int(a: &Tensor, b: &Tensor) -> bool {
    matches!((&a.data, &b.data), (Data::I(_), Data::I(_)))
}

/// Elementwise binary arithmetic with numpy broadcasting.
pub fn binary(op: Op, a: &Tensor, b: &Tensor) -> OpResult<Tensor> {
    if both_int(a, b) && op != Op::RealDiv && op != Op::Pow {
        let (x, y) = (a.as_i64(), b.as_i64());
        let f: fn(i64, i64) -> i64 = match op {
            Op::Add => |x, y| x.wrapping_add(y),
            Op::Sub => |x, y| x.wrapping_sub(y),
            Op::Mul => |x, y| x.wrapping_mul(y),
            Op::Maximum => |x, y| x.max(y),
            Op::Minimum => |x, y| x.min(y),
            Op::FloorDiv => |x, y| if y == 0 { 0 } else { x.div_euclid(y) },
            Op::Mod => |x, y| if y == 0 { 0 } else { x.rem_euclid(y) },
            _ => return Err(format!("`{op}` on integers is not supported").into()),
        };
        let (shape, v) = zip_broadcast(&x, &a.shape, &y, &b.shape, f)?;
        return Ok(Tensor::new(DType::I64, shape, Data::I(v)));
    }
    let (x, y) = (a.as_f32(), b.as_f32());
    // One closure per op (not a fn pointer), so each loop is compiled for its op and
    // vectorised: the elementwise ops of a prefill chunk run over [Q, hidden] tensors.
    let (ash, bsh) = (&a.shape, &b.shape);
    let (shape, v) = match op {
        Op::Add => zip_broadcast(&x, ash, &y, bsh, |x, y| x + y),
        Op::Sub => zip_broadcast(&x, ash, &y, bsh, |x, y| x - y),
        Op::Mul => zip_broadcast(&x, ash, &y, bsh, |x, y| x * y),
        Op::RealDiv => zip_broadcast(&x, ash, &y, bsh, |x, y| x / y),
        Op::Pow => zip_broadcast(&x, ash, &y, bsh, f32::powf),
        Op::Maximum => zip_broadcast(&x, ash, &y, bsh, f32::max),
        Op::Minimum => zip_broadcast(&x, ash, &y, bsh, f32::min),
        Op::FloorDiv => zip_broadcast(&x, ash, &y, bsh, |x, y| (x / y).floor()),
        Op::Mod => zip_broadcast(&x, ash, &y, bsh, |x, y| x - (x / y).floor() * y),
        _ => return Err(format!("unknown binary op `{op}`").into()),
    }?;
    Ok(Tensor::new(DType::F32, shape, Data::F(v)))
}

/// The comparison `op` stands for, on integers or floats alike.
fn comparison<T: PartialOrd>(op: Op) -> OpResult<fn(T, T) -> bool> {
    Ok(match op {
        Op::Less => |x, y| x < y,
        Op::LessEqual => |x, y| x <= y,
        Op::Greater => |x, y| x > y,
        Op::GreaterEqual => |x, y| x >= y,
        Op::Equal => |x, y| x == y,
        Op::NotEqual => |x, y| x != y,
        _ => return Err(format!("unknown comparison `{op}`").into()),
    })
}

pub fn compare(op: Op, a: &Tensor, b: &Tensor) -> OpResult<Tensor> {
    let (shape, v) = if both_int(a, b) {
        let (x, y) = (a.as_i64(), b.as_i64());
        zip_broadcast(&x, &a.shape, &y, &b.shape, comparison::<i64>(op)?)?
    } else {
        let (x, y) = (a.as_f32(), b.as_f32());
        zip_broadcast(&x, &a.shape, &y, &b.shape, comparison::<f32>(op)?)?
    };
    Ok(Tensor::new(DType::Bool, shape, Data::B(v)))
}

pub fn logical(op: Op, a: &Tensor, b: &Tensor) -> OpResult<Tensor> {
    let (x, y) = (a.as_bool(), b.as_bool());
    let f: fn(bool, bool) -> bool = match op {
        Op::LogicalAnd => |x, y| x && y,
        Op::LogicalOr => |x, y| x || y,
        Op::LogicalXor => |x, y| x ^ y,
        _ => return Err(format!("unknown logical op `{op}`").into()),
    };
    let (shape, v) = zip_broadcast(&x, &a.shape, &y, &b.shape, f)?;
    Ok(Tensor::new(DType::Bool, shape, Data::B(v)))
}

pub fn unary(op: Op, args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    if op == Op::LogicalNot {
        let v = x.as_bool().iter().map(|&b| !b).collect();
        return Ok(Tensor::new(DType::Bool, x.shape.clone(), Data::B(v)));
    }
    if op == Op::Abs || op == Op::Square || op == Op::Relu {
        if let Data::I(v) = &x.data {
            let f: fn(i64) -> i64 = match op {
                Op::Abs => |v| v.abs(),
                Op::Square => |v| v * v,
                _ => |v| v.max(0),
            };
            return Ok(Tensor::new(
                DType::I64,
                x.shape.clone(),
                Data::I(v.iter().map(|&v| f(v)).collect()),
            ));
        }
    }
    let eps = match op {
        Op::Rsqrt => args.float_or("epsilon", 1e-12)?,
        Op::Inverse => args.float_or("epsilon", 1e-4)?,
        Op::Log => args.float_or("epsilon", 1e-45)?,
        _ => 0.0,
    };
    let (alpha, beta) = match op {
        Op::Clip => (args.float_or("alpha", 0.0)?, args.float_or("beta", 0.0)?),
        _ => (0.0, 0.0),
    };
    let v = x.as_f32();
    let apply = |f: &(dyn Fn(f32) -> f32 + Sync)| -> Vec<f32> {
        if v.len() >= 1 << 15 {
            // Elementwise, so threads give the same values (silu over a prefill chunk's
            // [Q, intermediate] is the big one).
            v.par_iter().with_min_len(1 << 13).map(|&x| f(x)).collect()
        } else {
            v.iter().map(|&x| f(x)).collect()
        }
    };
    let out = match op {
        Op::Rsqrt => apply(&|x| 1.0 / (x + eps).sqrt()),
        Op::Sqrt => apply(&|x| x.sqrt()),
        Op::Inverse => apply(&|x| 1.0 / (x + eps)),
        Op::Exp => apply(&|x| x.exp()),
        Op::Exp2 => apply(&|x| x.exp2()),
        Op::Log => apply(&|x| (x + eps).ln()),
        Op::Sin => apply(&|x| x.sin()),
        Op::Cos => apply(&|x| x.cos()),
        Op::Tanh => apply(&|x| x.tanh()),
        Op::Sigmoid => apply(&|x| 1.0 / (1.0 + (-x).exp())),
        Op::Silu => apply(&|x| x / (1.0 + (-x).exp())),
        Op::Relu => apply(&|x| x.max(0.0)),
        Op::Abs => apply(&|x| x.abs()),
        Op::Square => apply(&|x| x * x),
        Op::Floor => apply(&|x| x.floor()),
        Op::Ceil => apply(&|x| x.ceil()),
        Op::Round => apply(&|x| x.round_ties_even()),
        Op::Sign => apply(&|x| {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }),
        Op::Erf => apply(&erf),
        Op::Clip => apply(&|x| x.max(alpha).min(beta)),
        _ => return Err(format!("unknown unary op `{op}`").into()),
    };
    Ok(Tensor::new(DType::F32, x.shape.clone(), Data::F(out)))
}

/// Abramowitz–Stegun 7.1.26 is too coarse for fp32; use the complementary-error-function
/// continued form from Numerical Recipes (erfc, |error| < 1.2e-7).
fn erf(x: f32) -> f32 {
    let z = (x as f64).abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    let v = 1.0 - r;
    (if x >= 0.0 { v } else { -v }) as f32
}

fn reduce_axes(args: &Args, rank: usize) -> OpResult<Vec<bool>> {
    let mut red = vec![false; rank];
    match args.opt("axes") {
        None => red.iter_mut().for_each(|r| *r = true),
        Some(t) => {
            for a in t.as_i64().iter() {
                red[axis(*a, rank)?] = true;
            }
        }
    }
    Ok(red)
}

pub fn reduce(op: Op, args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let keep = args.bool_or("keep_dims", false)?;
    let rank = x.rank();
    let red = reduce_axes(args, rank)?;
    let kept: Vec<usize> = (0..rank)
        .map(|d| if red[d] { 1 } else { x.shape[d] })
        .collect();
    let out_n: usize = kept.iter().product();
    let ost = strides(&kept);
    let xst = strides(&x.shape);
    let count: usize = (0..rank).filter(|&d| red[d]).map(|d| x.shape[d]).product();
    let v = x.as_f32();
    let (init, comb): (f64, fn(f64, f64) -> f64) = match op {
        Op::ReduceSum | Op::ReduceMean => (0.0, |a, b| a + b),
        Op::ReduceMax => (f64::NEG_INFINITY, |a, b| a.max(b)),
        Op::ReduceMin => (f64::INFINITY, |a, b| a.min(b)),
        Op::ReduceProd => (1.0, |a, b| a * b),
        Op::ReduceSumSquare => (0.0, |a, b| a + b * b),
        _ => return Err(format!("unknown reduction `{op}`").into()),
    };
    let mut acc = vec![init; out_n];
    // Fast path: reducing only the last axis.
    if rank > 0 && red[rank - 1] && red[..rank - 1].iter().all(|r| !r) {
        let n = x.shape[rank - 1].max(1);
        for (o, chunk) in v.chunks(n).enumerate() {
            acc[o] = chunk.iter().fold(init, |a, &b| comb(a, b as f64));
        }
    } else {
        for (i, &val) in v.iter().enumerate() {
            let mut o = 0;
            for d in 0..rank {
                if !red[d] {
                    o += (i / xst[d] % x.shape[d]) * ost[d];
                }
            }
            acc[o] = comb(acc[o], val as f64);
        }
    }
    if op == Op::ReduceMean {
        acc.iter_mut().for_each(|a| *a /= count.max(1) as f64);
    }
    let shape = if keep {
        kept
    } else {
        (0..rank).filter(|&d| !red[d]).map(|d| x.shape[d]).collect()
    };
    let is_int = matches!(x.data, Data::I(_)) && op != Op::ReduceMean;
    let data = if is_int {
        Data::I(acc.iter().map(|&a| a as i64).collect())
    } else {
        Data::F(acc.iter().map(|&a| a as f32).collect())
    };
    Ok(Tensor::new(x.dtype, shape, data))
}

pub fn softmax(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let ax = axis(args.int_or("axis", -1)?, x.rank())?;
    let n = x.shape.get(ax).copied().unwrap_or(1);
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut v = x.as_f32().into_owned();
    let work = |block: &mut [f32]| {
        for i in 0..inner {
            softmax_strided(&mut block[i..], n, inner);
        }
    };
    let chunk = (n * inner).max(1);
    if v.len() >= 1 << 15 {
        // Rows are independent: a prefill chunk's [heads, Q, S] probabilities split across
        // threads give the same values.
        v.par_chunks_mut(chunk).for_each(work);
    } else {
        v.chunks_mut(chunk).for_each(work);
    }
    Ok(Tensor::new(x.dtype, x.shape.clone(), Data::F(v)))
}

/// Below this, `exp` rounds to +0.0 in f32 (e^-103.97 is half the smallest subnormal):
/// masked scores (the mask adds -inf or -65504) skip the call and get the same zero.
const EXP_UNDERFLOW: f32 = -110.0;

/// softmax over the `n` elements `v[0], v[stride], …`.
fn softmax_strided(v: &mut [f32], n: usize, stride: usize) {
    let mut m = f32::NEG_INFINITY;
    for k in 0..n {
        m = m.max(v[k * stride]);
    }
    let mut s = 0.0f32;
    for k in 0..n {
        let d = v[k * stride] - m;
        let e = if d < EXP_UNDERFLOW { 0.0 } else { d.exp() };
        v[k * stride] = e;
        s += e;
    }
    for k in 0..n {
        v[k * stride] /= s;
    }
}

/// `x` with a new shape of the same element count (reshape, expand_dims, squeeze, identity).
pub fn reshaped(x: &Tensor, shape: &[usize]) -> OpResult<Tensor> {
    let n: usize = shape.iter().product();
    if n != x.len() {
        return Err(format!("cannot view shape {:?} as {:?}", x.shape, shape).into());
    }
    Ok(Tensor::new(x.dtype, shape.to_vec(), x.data.clone()))
}

pub fn transpose(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let perm = args.ints("perm")?;
    if perm.len() != x.rank() {
        return Err(format!("perm {perm:?} for rank {}", x.rank()).into());
    }
    let perm: Vec<usize> = perm
        .iter()
        .map(|&p| axis(p, x.rank()))
        .collect::<OpResult<_>>()?;
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let st = strides(&x.shape);
    let src_strides: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    let idx = walk(&shape, &src_strides);
    let data = map_data!(&x.data, |v| take(v, &idx));
    Ok(Tensor::new(x.dtype, shape, data))
}

/// Offsets `sum(pos[d] * st[d])` for every position of `shape`, row-major: the innermost axis
/// is a run of `base + i·st[last]`, the outer position moves the base.
fn walk(shape: &[usize], st: &[usize]) -> Vec<usize> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    let Some((&inner, outer)) = shape.split_last() else {
        out.push(0);
        return out;
    };
    if n == 0 {
        return out;
    }
    let step = st[outer.len()];
    let mut pos = vec![0usize; outer.len()];
    let mut base = 0usize;
    loop {
        out.extend((0..inner).map(|i| base + i * step));
        let mut d = outer.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            pos[d] += 1;
            base += st[d];
            if pos[d] < shape[d] {
                break;
            }
            base -= st[d] * shape[d];
            pos[d] = 0;
        }
    }
}

pub fn concat(args: &Args) -> OpResult<Tensor> {
    let values = args.list("values")?;
    let first = values.first().ok_or("concat of nothing")?;
    let ax = axis(args.int("axis")?, first.rank())?;
    let interleave = args.bool_or("interleave", false)?;
    let outer: usize = first.shape[..ax].iter().product();
    let inner: usize = first.shape[ax + 1..].iter().product();
    let mut shape = first.shape.clone();
    shape[ax] = 0;
    for v in values {
        if v.rank() != first.rank()
            || (0..v.rank()).any(|d| d != ax && v.shape[d] != first.shape[d])
        {
            return Err(format!("cannot concat {:?} with {:?}", first.shape, v.shape).into());
        }
        shape[ax] += v.shape[ax];
    }
    let same_kind = values.iter().all(|v| v.data.kind() == first.data.kind());
    if !same_kind {
        return Err("concat of mixed element kinds".into());
    }
    if interleave && values.iter().any(|v| v.shape[ax] != values[0].shape[ax]) {
        return Err("interleaved concat needs equal sizes".into());
    }
    let runs = |emit: &mut dyn FnMut(usize, std::ops::Range<usize>)| {
        concat_runs(values, (ax, outer, inner), interleave, emit)
    };
    let total: usize = shape.iter().product();
    macro_rules! cat {
        ($variant:ident) => {{
            let srcs: Vec<&Vec<_>> = values
                .iter()
                .map(|v| match &v.data {
                    Data::$variant(d) => Ok(d),
                    _ => Err(OpError::from("concat of mixed storage")),
                })
                .collect::<OpResult<_>>()?;
            let mut out = Vec::with_capacity(total);
            runs(&mut |i, r| bulk::extend_copy(&mut out, &srcs[i][r]));
            Data::$variant(out)
        }};
    }
    let all_half = values.iter().all(|v| matches!(v.data, Data::Half(_)));
    let data = match &values[0].data {
        // Mixed storage (fp16 cache slices with computed rows): the rows are fp16 values
        // when the program rounds to fp16, and then the result stays fp16 (what a matmul
        // over the cache reads); otherwise it is widened into place.
        Data::F(_) | Data::Half(_) if !all_half && values.iter().any(|v| v.data.is_half()) => {
            if values.iter().all(|v| v.data.is_exact_half()) {
                let mut out = Vec::with_capacity(total);
                runs(&mut |i, r| match &values[i].data {
                    Data::Half(h) => bulk::extend_copy(&mut out, &h[r]),
                    Data::F(f) => out.extend(f[r].iter().map(|&v| f16::from_f32(v))),
                    _ => unreachable!("float kinds checked above"),
                });
                Data::Half(out)
            } else {
                let mut out = Vec::with_capacity(total);
                runs(&mut |i, r| match &values[i].data {
                    Data::Half(h) => bulk::extend_widened(&mut out, &h[r]),
                    Data::F(f) => bulk::extend_copy(&mut out, &f[r]),
                    _ => unreachable!("float kinds checked above"),
                });
                Data::F(out)
            }
        }
        Data::F(_) => cat!(F),
        Data::Half(_) => cat!(Half),
        Data::I(_) => cat!(I),
        Data::B(_) => cat!(B),
    };
    Ok(Tensor::new(first.dtype, shape, data))
}

/// The element ranges of `values` in the order `concat` lays them out along axis `ax` (`outer`
/// and `inner`: the products of the axes before and after it): `emit(value, range)`.
fn concat_runs(
    values: &[&Tensor],
    (ax, outer, inner): (usize, usize, usize),
    interleave: bool,
    emit: &mut dyn FnMut(usize, std::ops::Range<usize>),
) {
    if interleave {
        let n = values[0].shape[ax];
        for o in 0..outer {
            for k in 0..n {
                for i in 0..values.len() {
                    let base = (o * n + k) * inner;
                    emit(i, base..base + inner);
                }
            }
        }
    } else {
        for o in 0..outer {
            for (i, v) in values.iter().enumerate() {
                let len = v.shape[ax] * inner;
                emit(i, o * len..(o + 1) * len);
            }
        }
    }
}

/// split: the pieces' sizes come from the declared output shapes (fixed in a saved program).
pub fn split(args: &Args) -> OpResult<Vec<Tensor>> {
    let x = args.get("x")?;
    let ax = axis(args.int("axis")?, x.rank())?;
    let mut begin = 0i64;
    let mut out = Vec::new();
    for (i, o) in args.outputs.iter().enumerate() {
        let size = *o
            .shape
            .get(ax)
            .ok_or_else(|| format!("output {i} has no axis {ax}"))?;
        let mut start = vec![0i64; x.rank()];
        start[ax] = begin;
        let mut shape = x.shape.clone();
        shape[ax] = size;
        out.push(strided(x, &start, &vec![1; x.rank()], shape)?);
        begin += size as i64;
    }
    if begin as usize != x.shape[ax] {
        return Err(format!(
            "declared pieces cover {begin} of {} along axis {ax}",
            x.shape[ax]
        )
        .into());
    }
    Ok(out)
}

fn strided(x: &Tensor, start: &[i64], step: &[i64], shape: Vec<usize>) -> OpResult<Tensor> {
    for d in 0..x.rank() {
        if shape[d] == 0 {
            continue;
        }
        let last = start[d] + step[d] * (shape[d] as i64 - 1);
        if start[d] < 0 || last < 0 || start[d] >= x.shape[d] as i64 || last >= x.shape[d] as i64 {
            return Err(format!("slice out of bounds on axis {d} of shape {:?}", x.shape).into());
        }
    }
    // Copy contiguous runs: trailing axes taken whole, plus one more axis with step 1 (a layer
    // of the cache is a single run).
    let r = x.rank();
    let mut k = r;
    let mut run = 1usize;
    while k > 0 && step[k - 1] == 1 && start[k - 1] == 0 && shape[k - 1] == x.shape[k - 1] {
        run *= shape[k - 1];
        k -= 1;
    }
    if k > 0 && step[k - 1] == 1 {
        run *= shape[k - 1];
        k -= 1;
    }
    let mut outer_shape = shape.clone();
    for d in outer_shape.iter_mut().skip(k) {
        *d = 1;
    }
    let bases = strided_indices(&x.shape, start, step, &outer_shape);
    let data = map_data!(&x.data, |v| {
        let mut out = Vec::with_capacity(bases.len() * run);
        for &b in &bases {
            bulk::extend_copy(&mut out, &v[b..b + run]);
        }
        out
    });
    Ok(Tensor::new(x.dtype, shape, data))
}

pub fn slice_by_index(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let w = slice_window(&x.shape, args)?;
    let mut t = strided(x, &w.start, &w.stride, w.shape.clone())?;
    t.shape = w.squeezed();
    Ok(t)
}

/// The elements `slice_by_index` (and iOS18 `slice_update`) address in a tensor of `shape`:
/// per axis a start, a stride and a length, and the axes squeezed away.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub start: Vec<i64>,
    pub stride: Vec<i64>,
    pub shape: Vec<usize>,
    pub squeeze: Vec<bool>,
}

impl Window {
    /// The result's shape with the squeezed axes dropped.
    pub fn squeezed(&self) -> Vec<usize> {
        (0..self.shape.len())
            .filter(|&d| !self.squeeze[d])
            .map(|d| self.shape[d])
            .collect()
    }
}

/// `begin`, `end`, `stride` and the masks of a slice over `shape`, resolved as MIL does
/// (negative indices from the end, clamped to the axis).
pub fn slice_window(shape: &[usize], args: &Args) -> OpResult<Window> {
    let r = shape.len();
    let begin = args.ints("begin")?;
    let end = args.ints("end")?;
    let stride = match args.opt("stride") {
        Some(t) => t.as_i64().into_owned(),
        None => vec![1; r],
    };
    let mask = |name: &str| -> OpResult<Vec<bool>> {
        Ok(match args.opt(name) {
            Some(t) => t.as_bool().into_owned(),
            None => vec![false; r],
        })
    };
    let (bm, em, sm) = (
        mask("begin_mask")?,
        mask("end_mask")?,
        mask("squeeze_mask")?,
    );
    if [
        begin.len(),
        end.len(),
        stride.len(),
        bm.len(),
        em.len(),
        sm.len(),
    ]
    .iter()
    .any(|&l| l != r)
    {
        return Err(format!("slice parameters do not match rank {r}").into());
    }
    let mut start = vec![0i64; r];
    let mut out = vec![0usize; r];
    for d in 0..r {
        let n = shape[d] as i64;
        let s = stride[d];
        if s == 0 {
            return Err("stride 0".into());
        }
        let norm = |v: i64| if v < 0 { v + n } else { v };
        let (b, e) = if s > 0 {
            let b = if bm[d] { 0 } else { norm(begin[d]).clamp(0, n) };
            let e = if em[d] { n } else { norm(end[d]).clamp(0, n) };
            (b, e)
        } else {
            let b = if bm[d] {
                n - 1
            } else {
                norm(begin[d]).clamp(-1, n - 1)
            };
            let e = if em[d] {
                -1
            } else {
                norm(end[d]).clamp(-1, n - 1)
            };
            (b, e)
        };
        let len = if sm[d] {
            1
        } else if s > 0 {
            ((e - b).max(0) + s - 1) / s
        } else {
            ((b - e).max(0) + (-s) - 1) / (-s)
        };
        start[d] = b;
        out[d] = len as usize;
    }
    Ok(Window {
        start,
        stride,
        shape: out,
        squeeze: sm,
    })
}

pub fn slice_by_size(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let begin = args.ints("begin")?;
    let size = args.ints("size")?;
    if begin.len() != x.rank() || size.len() != x.rank() {
        return Err("slice parameters do not match the rank".into());
    }
    let mut start = vec![0i64; x.rank()];
    let mut shape = vec![0usize; x.rank()];
    for d in 0..x.rank() {
        let n = x.shape[d] as i64;
        let b = if begin[d] < 0 { begin[d] + n } else { begin[d] };
        let s = if size[d] < 0 { n - b } else { size[d] };
        if b < 0 || s < 0 || b + s > n {
            return Err(format!("slice [{b}, +{s}) outside axis {d} of {:?}", x.shape).into());
        }
        start[d] = b;
        shape[d] = s as usize;
    }
    strided(x, &start, &vec![1; x.rank()], shape)
}

pub fn tile(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let reps = args.ints("reps")?;
    if reps.len() != x.rank() || reps.iter().any(|&r| r < 0) {
        return Err(format!("reps {reps:?} for shape {:?}", x.shape).into());
    }
    let reps: Vec<usize> = reps.iter().map(|&r| r as usize).collect();
    let shape: Vec<usize> = x.shape.iter().zip(&reps).map(|(&d, &r)| d * r).collect();
    let data = map_data!(&x.data, |v| tile_blocks(v, &x.shape, &reps));
    Ok(Tensor::new(x.dtype, shape, data))
}

/// Tile by whole-block copies, innermost axis first (no per-element index arithmetic).
fn tile_blocks<T: Copy>(src: &[T], shape: &[usize], reps: &[usize]) -> Vec<T> {
    let mut cur = src.to_vec();
    let mut cur_shape = shape.to_vec();
    for d in (0..shape.len()).rev() {
        let r = reps[d];
        if r == 1 {
            continue;
        }
        let outer: usize = cur_shape[..d].iter().product();
        let block: usize = cur_shape[d..].iter().product();
        let mut next = Vec::with_capacity(cur.len() * r);
        for o in 0..outer {
            let b = &cur[o * block..(o + 1) * block];
            for _ in 0..r {
                next.extend_from_slice(b);
            }
        }
        cur = next;
        cur_shape[d] *= r;
    }
    cur
}

pub fn gather(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let ind = args.get("indices")?;
    if args.int_or("batch_dims", 0)? != 0 {
        return Err("gather with batch_dims > 0 is not supported".into());
    }
    let ax = axis(args.int_or("axis", 0)?, x.rank())?;
    let n = x.shape[ax];
    let outer: usize = x.shape[..ax].iter().product();
    let inner: usize = x.shape[ax + 1..].iter().product();
    let idx = gather_indices(&ind.as_i64(), n, ax)?;
    let mut shape = x.shape[..ax].to_vec();
    shape.extend_from_slice(&ind.shape);
    shape.extend_from_slice(&x.shape[ax + 1..]);
    macro_rules! g {
        ($v:expr) => {{
            let mut out = Vec::with_capacity(outer * idx.len() * inner);
            for o in 0..outer {
                for &j in &idx {
                    let base = (o * n + j) * inner;
                    out.extend_from_slice(&$v[base..base + inner]);
                }
            }
            out
        }};
    }
    let data = map_data!(&x.data, |v| g!(v));
    Ok(Tensor::new(x.dtype, shape, data))
}

/// Gather indices into an axis of size `n` (negative ones count from the end), checked.
pub fn gather_indices(ind: &[i64], n: usize, ax: usize) -> OpResult<Vec<usize>> {
    ind.iter()
        .map(|&i| {
            let j = if i < 0 { i + n as i64 } else { i };
            if j < 0 || j >= n as i64 {
                Err(format!("index {i} out of range for axis {ax} of size {n}").into())
            } else {
                Ok(j as usize)
            }
        })
        .collect()
}

pub fn select(args: &Args) -> OpResult<Tensor> {
    let c = args.get("cond")?;
    let a = args.get("a")?;
    let b = args.get("b")?;
    let shape = broadcast_shape(&broadcast_shape(&c.shape, &a.shape)?, &b.shape)?;
    let ic = broadcast_indices(&c.shape, &shape);
    let ia = broadcast_indices(&a.shape, &shape);
    let ib = broadcast_indices(&b.shape, &shape);
    let cv = c.as_bool();
    let data = if both_int(a, b) {
        let (av, bv) = (a.as_i64(), b.as_i64());
        Data::I(
            (0..ic.len())
                .map(|k| if cv[ic[k]] { av[ia[k]] } else { bv[ib[k]] })
                .collect(),
        )
    } else if matches!((&a.data, &b.data), (Data::B(_), Data::B(_))) {
        let (av, bv) = (a.as_bool(), b.as_bool());
        Data::B(
            (0..ic.len())
                .map(|k| if cv[ic[k]] { av[ia[k]] } else { bv[ib[k]] })
                .collect(),
        )
    } else {
        let (av, bv) = (a.as_f32(), b.as_f32());
        Data::F(
            (0..ic.len())
                .map(|k| if cv[ic[k]] { av[ia[k]] } else { bv[ib[k]] })
                .collect(),
        )
    };
    Ok(Tensor::new(a.dtype, shape, data))
}

pub fn fill(args: &Args) -> OpResult<Tensor> {
    let o = args.out(0)?;
    let n: usize = o.shape.iter().product();
    let data = match args.opt("value") {
        Some(v) => match &v.data {
            Data::I(d) => Data::I(vec![*d.first().ok_or("empty value")?; n]),
            Data::B(d) => Data::B(vec![*d.first().ok_or("empty value")?; n]),
            _ => Data::F(vec![*v.as_f32().first().ok_or("empty value")?; n]),
        },
        None => Data::F(vec![0.0; n]),
    };
    Ok(Tensor::new(o.dtype, o.shape.clone(), data))
}

pub fn band_part(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let lower = args.int_or("lower", -1)?;
    let upper = args.int_or("upper", -1)?;
    let r = x.rank();
    if r < 2 {
        return Err("band_part needs rank >= 2".into());
    }
    let (m, n) = (x.shape[r - 2], x.shape[r - 1]);
    let keep: Vec<bool> = (0..x.len())
        .map(|k| {
            let (i, j) = ((k / n % m) as i64, (k % n) as i64);
            (lower < 0 || i - j <= lower) && (upper < 0 || j - i <= upper)
        })
        .collect();
    let data = match &x.data {
        Data::I(v) => Data::I(
            v.iter()
                .zip(&keep)
                .map(|(&a, &k)| if k { a } else { 0 })
                .collect(),
        ),
        Data::B(v) => Data::B(v.iter().zip(&keep).map(|(&a, &k)| a && k).collect()),
        _ => Data::F(
            x.as_f32()
                .iter()
                .zip(&keep)
                .map(|(&a, &k)| if k { a } else { 0.0 })
                .collect(),
        ),
    };
    Ok(Tensor::new(x.dtype, x.shape.clone(), data))
}

pub fn range_1d(args: &Args) -> OpResult<Tensor> {
    let (s, e, st) = (args.get("start")?, args.get("end")?, args.get("step")?);
    if both_int(s, e) && matches!(st.data, Data::I(_)) {
        let (s, e, st) = (args.int("start")?, args.int("end")?, args.int("step")?);
        if st == 0 {
            return Err("step 0".into());
        }
        let mut v = Vec::new();
        let mut x = s;
        while (st > 0 && x < e) || (st < 0 && x > e) {
            v.push(x);
            x += st;
        }
        let n = v.len();
        return Ok(Tensor::new(DType::I32, vec![n], Data::I(v)));
    }
    let (s, e, st) = (
        args.float_or("start", 0.0)?,
        args.float_or("end", 0.0)?,
        args.float_or("step", 1.0)?,
    );
    if st == 0.0 {
        return Err("step 0".into());
    }
    let n = ((e - s) / st).ceil().max(0.0) as usize;
    let v = (0..n).map(|i| s + st * i as f32).collect::<Vec<_>>();
    Ok(Tensor::new(DType::F32, vec![n], Data::F(v)))
}

/// `x @ y` with optional transposes and numpy batch broadcasting.
/// The most rows of x a product x·y (y not transposed) takes row by row rather than blocked:
/// a decode step's query heads of one group (G ≤ 8 in the shipped architectures).
const AXPY_MAX_ROWS: usize = 8;

pub fn matmul(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let y = args.get("y")?;
    let tx = args.bool_or("transpose_x", false)?;
    let ty = args.bool_or("transpose_y", false)?;
    let (mut xs, mut ys) = (x.shape.clone(), y.shape.clone());
    let (x1, y1) = (xs.len() == 1, ys.len() == 1);
    if x1 {
        xs.insert(0, 1);
    }
    if y1 {
        ys.push(1);
    }
    let (xr, yr) = (xs.len(), ys.len());
    let (m, k) = if tx {
        (xs[xr - 1], xs[xr - 2])
    } else {
        (xs[xr - 2], xs[xr - 1])
    };
    let (k2, n) = if ty {
        (ys[yr - 1], ys[yr - 2])
    } else {
        (ys[yr - 2], ys[yr - 1])
    };
    if k != k2 {
        return Err(format!(
            "inner dimensions differ: {:?} @ {:?} (transpose_x={tx}, transpose_y={ty})",
            x.shape, y.shape
        )
        .into());
    }
    let batch = broadcast_shape(&xs[..xr - 2], &ys[..yr - 2])?;
    let nb: usize = batch.iter().product();
    let bx = broadcast_indices(&xs[..xr - 2], &batch);
    let by = broadcast_indices(&ys[..yr - 2], &batch);
    let xv = x.as_f32();
    // fp16 caches (a decode step's keys and values) are multiplied as they are stored: the
    // f16 kernels widen in registers and give the bits of the f32 ones on the widened values.
    let yv = match &y.data {
        Data::Half(h) => Rhs::Half(h),
        _ => Rhs::F(y.as_f32()),
    };
    let mut out = vec![0f32; nb * m * n];
    let column = |b: usize| -> Vec<f32> {
        let yb = by[b] * k..(by[b] + 1) * k;
        match &yv {
            Rhs::F(yv) => yv[yb].to_vec(),
            Rhs::Half(h) => super::bulk::widened(&h[yb]),
        }
    };
    if n == 1 && !ty && nb > 1 && bx.iter().all(|&i| i == bx[0]) {
        // One x for every batch, each with its own column (the Neural Engine layout's decode
        // attention: a group's query heads against the same cached keys and values): x is
        // read once for all of them.
        let xb = &xv[bx[0] * m * k..(bx[0] + 1) * m * k];
        let cols: Vec<Vec<f32>> = (0..nb).map(column).collect();
        let t = shared_x_columns(xb, &cols, (m, k), tx);
        for (i, row) in t.chunks_exact(nb).enumerate() {
            for (b, &v) in row.iter().enumerate() {
                out[b * m + i] = v;
            }
        }
        let mut shape = batch;
        if !x1 {
            shape.push(m);
        }
        if !y1 {
            shape.push(1);
        }
        return Ok(Tensor::new(DType::F32, shape, Data::F(out)));
    }
    let work = |b: usize, ob: &mut [f32]| {
        let xb = &xv[bx[b] * m * k..(bx[b] + 1) * m * k];
        let yb = by[b] * k * n..(by[b] + 1) * k * n;
        if n == 1 && !ty {
            // One column of y (the Neural Engine layout's decode step: scores of the cached
            // keys against a query, then the values against the probabilities).
            return column_product(xb, &column(b), (m, k), tx, ob);
        }
        let xt;
        let xb: &[f32] = if tx {
            xt = transpose2(xb, k, m);
            &xt
        } else {
            xb
        };
        match &yv {
            Rhs::F(yv) => product(xb, &yv[yb], (m, k, n), ty, ob),
            Rhs::Half(h) => product_half(xb, &h[yb], (m, k, n), ty, ob),
        }
    };
    if nb > 1 && nb * m * n * k >= 1 << 15 {
        out.par_chunks_mut((m * n).max(1))
            .enumerate()
            .for_each(|(b, ob)| work(b, ob));
    } else {
        for (b, ob) in out.chunks_mut((m * n).max(1)).enumerate() {
            work(b, ob);
        }
    }
    let mut shape = batch;
    if !x1 {
        shape.push(m);
    }
    if !y1 {
        shape.push(n);
    }
    Ok(Tensor::new(DType::F32, shape, Data::F(out)))
}

/// The right operand of a matmul: f32 values, or fp16 ones read as they are stored.
enum Rhs<'a> {
    F(std::borrow::Cow<'a, [f32]>),
    Half(&'a [f16]),
}

/// One batch of `matmul`: x [m, k] (already transposed if asked) by y [k, n] or, with `ty`,
/// by yᵀ of y [n, k], into `ob` [m, n].
fn product(xb: &[f32], yb: &[f32], (m, k, n): (usize, usize, usize), ty: bool, ob: &mut [f32]) {
    if m >= 2 && n >= 2 && (ty || m > AXPY_MAX_ROWS) {
        // A product of two matrices (a prefill chunk's attention: q·kᵀ and probs·v): the
        // blocked product, whose output-major form over yᵀ's rows is x @ y row-major.
        // (Only here: a decode step's products have m = 1, or n = 1 in the Neural Engine
        // layout, and keep their summation order, which the two layouts share. A decode
        // step's probs·v over a group of query heads, m = G rows against the whole cache,
        // takes the row-by-row form below: transposing the cache for the blocked product
        // cost more than the product.)
        let yt;
        let yb: &[f32] = if ty {
            yb
        } else {
            yt = transpose2(yb, k, n);
            &yt
        };
        gemm_nt(yb, n, xb, m, k, ob);
    } else if ty {
        // y is [n, k]: every output is a dot of two contiguous rows.
        for i in 0..m {
            let xr = &xb[i * k..(i + 1) * k];
            for j in 0..n {
                ob[i * n + j] = dot(xr, &yb[j * k..(j + 1) * k]);
            }
        }
    } else {
        // Each output sums x[i, kk]·y[kk, j] in kk order; y is read once, row by row, for
        // all m rows (at most AXPY_MAX_ROWS, or one column).
        for kk in 0..k {
            axpy_rows(xb, (m, k, kk), &yb[kk * n..(kk + 1) * n], ob);
        }
    }
}

/// x [m, k] (with `tx`, the stored x is [k, m]) times the column `y` [k] into `ob` [m]: each
/// output sums x[i, kk]·y[kk] in kk order, a multiply then an add, as [`product`]'s row-by-row
/// form does, so the same bits; but x is read in its stored order, row by row, never
/// transposed nor walked down a column.
fn column_product(xb: &[f32], y: &[f32], (m, k): (usize, usize), tx: bool, ob: &mut [f32]) {
    if tx {
        for (kk, &a) in y.iter().enumerate() {
            for (o, &v) in ob.iter_mut().zip(&xb[kk * m..(kk + 1) * m]) {
                *o += v * a;
            }
        }
    } else {
        for (o, row) in ob.iter_mut().zip(xb.chunks_exact(k.max(1))) {
            let mut s = 0f32;
            for (&v, &a) in row.iter().zip(y) {
                s += v * a;
            }
            *o = s;
        }
    }
}

/// [`column_product`] of one x by several columns, x read once: [m, columns], row i holding
/// every column's output i, each the same sum in the same order as [`column_product`]'s. The
/// rows are shared among the cores, and the columns' sums run side by side (independent
/// chains, each in its own order).
fn shared_x_columns(xb: &[f32], cols: &[Vec<f32>], (m, k): (usize, usize), tx: bool) -> Vec<f32> {
    const ROWS: usize = 64;
    let nc = cols.len();
    let mut t = vec![0f32; m * nc];
    // The columns interleaved, [k, columns]: element kk of every column side by side.
    let ct: Vec<f32> = (0..k)
        .flat_map(|kk| cols.iter().map(move |c| c[kk]))
        .collect();
    t.par_chunks_mut(ROWS * nc).enumerate().for_each(|(c, tc)| {
        let (first, len) = (c * ROWS, tc.len() / nc);
        if tx {
            // x stored [k, m]: output i sums x[kk, i]·col[kk] over kk.
            for (kk, cs) in ct.chunks_exact(nc).enumerate() {
                let xr = &xb[kk * m + first..kk * m + first + len];
                for (o, &v) in tc.chunks_exact_mut(nc).zip(xr) {
                    for (ob, &a) in o.iter_mut().zip(cs) {
                        *ob += v * a;
                    }
                }
            }
        } else {
            for (r, o) in tc.chunks_exact_mut(nc).enumerate() {
                let xr = &xb[(first + r) * k..(first + r + 1) * k];
                for (&v, cs) in xr.iter().zip(ct.chunks_exact(nc)) {
                    for (ob, &a) in o.iter_mut().zip(cs) {
                        *ob += v * a;
                    }
                }
            }
        }
    });
    t
}

/// `ob[i, ..] += x[i, kk] · yrow` for every row i of x (a multiply then an add, unfused).
#[inline]
fn axpy_rows(xb: &[f32], (m, k, kk): (usize, usize, usize), yrow: &[f32], ob: &mut [f32]) {
    let n = yrow.len();
    for i in 0..m {
        let a = xb[i * k + kk];
        let orow = &mut ob[i * n..(i + 1) * n];
        for (o, &b) in orow.iter_mut().zip(yrow) {
            *o += a * b;
        }
    }
}

/// [`product`] with fp16 y, the same bits: the blocked product's tiles and the dot products
/// widen y in registers; the row-by-row form widens each row of y once. The one form that
/// needs y transposed widens it whole first.
fn product_half(
    xb: &[f32],
    yb: &[f16],
    (m, k, n): (usize, usize, usize),
    ty: bool,
    ob: &mut [f32],
) {
    if m >= 2 && n >= 2 && ty {
        // gemm_nt_f16 over x's rows and y's gives ob transposed ([n, m]): every output the
        // same sum, the same lanes in the same order, as `product`'s gemm_nt over y's and x's.
        let mut t = vec![0f32; m * n];
        gemm_nt_f16(xb, m, yb, n, k, &mut t);
        for (j, col) in t.chunks_exact(m).enumerate() {
            for (i, v) in col.iter().enumerate() {
                ob[i * n + j] = *v;
            }
        }
    } else if m >= 2 && n >= 2 && m > AXPY_MAX_ROWS {
        product(xb, &super::bulk::widened(yb), (m, k, n), ty, ob);
    } else if ty {
        for i in 0..m {
            let xr = &xb[i * k..(i + 1) * k];
            for j in 0..n {
                ob[i * n + j] = dot_f16(xr, &yb[j * k..(j + 1) * k]);
            }
        }
    } else {
        let mut row = vec![0f32; n];
        for kk in 0..k {
            yb[kk * n..(kk + 1) * n].convert_to_f32_slice(&mut row);
            axpy_rows(xb, (m, k, kk), &row, ob);
        }
    }
}

fn transpose2(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    // In 16×16 tiles: a row-by-row walk writes one element per cache line of the result.
    const TILE: usize = 16;
    let mut t = vec![0f32; a.len()];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    t[c * rows + r] = a[r * cols + c];
                }
            }
        }
    }
    t
}

pub use super::kernels::dot;
use super::kernels::{dot_f16, gemm_nt, gemm_nt_f16};

/// `x @ weight.T + bias`: weight [OC, IC] row-major (pre-decoded at load), rows of x
/// independent. Output features are split across threads; each thread reads its weight rows
/// once for all rows of x.
pub fn linear(args: &Args) -> OpResult<Tensor> {
    let w = args.get("weight")?;
    linear_with(args, &w.shape, |xv, bias, oc, ic| {
        Ok(match &w.data {
            // fp16 weights (see Program::load) are widened in registers.
            Data::Half(wv) => gemv_rows(xv, Rows::Half(wv), bias, oc, ic),
            _ => gemv_rows(xv, Rows::Float(&w.as_f32()), bias, oc, ic),
        })
    })
}

/// `linear` for a weight of shape `w`: the checks, then `gemv(x, bias, oc, ic)` computes the
/// output-major product (the dense weight above, a packed one in `packed`).
pub fn linear_with(
    args: &Args,
    w: &[usize],
    gemv: impl FnOnce(&[f32], Option<&[f32]>, usize, usize) -> OpResult<Vec<f32>>,
) -> OpResult<Tensor> {
    let x = args.get("x")?;
    if w.len() != 2 {
        return Err(format!("weight must be rank 2, has shape {w:?}").into());
    }
    // MIL's `linear` takes x of rank 1 to 3 (coremltools does not check it; Core ML may).
    if !(1..=3).contains(&x.rank()) {
        return Err(format!(
            "x must be rank 1 to 3 (MIL linear), has shape {:?}",
            x.shape
        )
        .into());
    }
    let (oc, ic) = (w[0], w[1]);
    if x.shape.last() != Some(&ic) {
        return Err(format!("x {:?} does not match weight {w:?}", x.shape).into());
    }
    let bias = args.opt("bias").map(|b| b.as_f32());
    if let Some(b) = &bias {
        if b.len() != oc {
            return Err(format!("bias has {} elements for {oc} outputs", b.len()).into());
        }
    }
    let xv = x.as_f32();
    let rows = xv.len() / ic.max(1);
    let t = gemv(&xv, bias.as_deref(), oc, ic)?;
    let out = if rows == 1 {
        t
    } else {
        transpose2(&t, oc, rows)
    };
    let mut shape = x.shape.clone();
    if let Some(l) = shape.last_mut() {
        *l = oc;
    }
    Ok(Tensor::new(DType::F32, shape, Data::F(out)))
}

/// MIL `conv` with a 1×1 kernel: x [N, C_in, *spatial] (1 to 3 spatial axes), weight
/// [C_out, C_in, 1, ...], groups 1, strides and dilations 1, zero padding. Each spatial
/// position's channels go through the same dot products as `linear`'s, in the same order, so
/// a 1×1 conv over (B, C, 1, S) computes what `linear` computes over (B, S, C) bit for bit.
/// Anything else is refused: with a 1×1 kernel, unit strides and no padding, `pad_type`
/// valid, same and custom compute the same thing, so the kernel need not read it.
pub fn conv(args: &Args) -> OpResult<Tensor> {
    let w = args.get("weight")?;
    conv_with(args, &w.shape, |rows, bias, oc, ic| {
        Ok(match &w.data {
            Data::Half(wv) => gemv_rows(rows, Rows::Half(wv), bias, oc, ic),
            _ => gemv_rows(rows, Rows::Float(&w.as_f32()), bias, oc, ic),
        })
    })
}

/// `conv` for a weight of shape `w`, `gemv` computing each batch's product as in
/// [`linear_with`].
pub fn conv_with(
    args: &Args,
    w: &[usize],
    gemv: impl Fn(&[f32], Option<&[f32]>, usize, usize) -> OpResult<Vec<f32>>,
) -> OpResult<Tensor> {
    let x = args.get("x")?;
    check_conv(args, x, w)?;
    let (n, ic, oc) = (x.shape[0], x.shape[1], w[0]);
    let positions: usize = x.shape[2..].iter().product();
    let bias = args.opt("bias").map(|b| b.as_f32());
    if let Some(b) = &bias {
        if b.len() != oc {
            return Err(format!("bias has {} elements for {oc} outputs", b.len()).into());
        }
    }
    let xv = x.as_f32();
    let mut out = Vec::with_capacity(n * oc * positions);
    for b in 0..n {
        // [C_in, P] → P rows of C_in: the gemv's output [C_out, P] is the conv's layout.
        let rows = transpose2(
            &xv[b * ic * positions..(b + 1) * ic * positions],
            ic,
            positions,
        );
        out.extend_from_slice(&gemv(&rows, bias.as_deref(), oc, ic)?);
    }
    let mut shape = x.shape.clone();
    shape[1] = oc;
    Ok(Tensor::new(DType::F32, shape, Data::F(out)))
}

/// Refuse a `conv` the kernel does not compute: not a 1×1 kernel, grouped, strided, dilated
/// or padded, or shapes that do not match.
fn check_conv(args: &Args, x: &Tensor, w: &[usize]) -> OpResult<()> {
    if !(3..=5).contains(&x.rank()) || w.len() != x.rank() {
        return Err(format!(
            "x {:?} and weight {w:?} must have the same rank, 3 to 5 (MIL conv)",
            x.shape
        )
        .into());
    }
    if w[2..].iter().any(|&k| k != 1) {
        return Err(format!("only 1×1 kernels are interpreted; weight has shape {w:?}").into());
    }
    if w[1] != x.shape[1] {
        return Err(format!("x {:?} does not match weight {w:?}", x.shape).into());
    }
    let groups = args.int_or("groups", 1)?;
    if groups != 1 {
        return Err(format!("only groups = 1 is interpreted, not {groups}").into());
    }
    for (key, unit) in [("strides", 1), ("dilations", 1), ("pad", 0)] {
        if let Some(t) = args.opt(key) {
            if t.as_i64().iter().any(|&v| v != unit) {
                return Err(format!(
                    "`{key}` {:?}: only {unit}s are interpreted (1×1 kernel, unit stride, no \
                     padding)",
                    t.as_i64()
                )
                .into());
            }
        }
    }
    Ok(())
}

/// The weight of a projection as the kernels read it: fp16 as loaded, or f32.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Half(&'a [half::f16]),
    Float(&'a [f32]),
}

/// Output-major `x @ w.T + bias` for `rows` rows of x: output features are split across
/// threads in blocks of 32, and each thread reads its weight rows once for all rows of x. One
/// row of x (a decode step) takes a dot product per weight row, fp16 widened in registers;
/// several rows (a prefill chunk) run the register-blocked product, which widens each loaded
/// weight vector once for four of them.
fn gemv_rows(xv: &[f32], w: Rows<'_>, bias: Option<&[f32]>, oc: usize, ic: usize) -> Vec<f32> {
    const BLOCK: usize = 32;
    let rows = xv.len() / ic.max(1);
    let mut t = vec![0f32; oc * rows];
    // An empty x (a zero-length axis) has an empty product; chunks of 0 would panic.
    if t.is_empty() {
        return t;
    }
    let bias_of = |o: usize| bias.map_or(0.0, |b| b[o]);
    t.par_chunks_mut(BLOCK * rows)
        .enumerate()
        .for_each(|(blk, chunk)| {
            let o0 = blk * BLOCK;
            let n = chunk.len() / rows;
            if rows == 1 {
                for (ob, out) in chunk.iter_mut().enumerate() {
                    let o = o0 + ob;
                    let d = match w {
                        Rows::Half(wv) => dot_f16(xv, &wv[o * ic..(o + 1) * ic]),
                        Rows::Float(wv) => dot(xv, &wv[o * ic..(o + 1) * ic]),
                    };
                    *out = d + bias_of(o);
                }
                return;
            }
            let block = o0 * ic..(o0 + n) * ic;
            match w {
                Rows::Half(wv) => gemm_nt_f16(xv, rows, &wv[block], n, ic, chunk),
                Rows::Float(wv) => gemm_nt(xv, rows, &wv[block], n, ic, chunk),
            }
            for (ob, outs) in chunk.chunks_mut(rows).enumerate() {
                let b = bias_of(o0 + ob);
                outs.iter_mut().for_each(|v| *v += b);
            }
        });
    t
}

pub fn cast(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let o = args.out(0)?;
    // The conversion itself happens when the result is conformed to the declared dtype.
    Ok(Tensor::new(o.dtype, x.shape.clone(), x.data.clone()))
}

pub fn layer_norm(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let r = x.rank();
    let red = reduce_axes(args, r)?;
    let k = red.iter().rev().take_while(|&&b| b).count();
    if red.iter().filter(|&&b| b).count() != k {
        return Err("layer_norm over non-trailing axes is not supported".into());
    }
    let eps = args.float_or("epsilon", 1e-5)?;
    let n: usize = x.shape[r - k..].iter().product();
    let gamma = args.opt("gamma").map(|g| g.as_f32());
    let beta = args.opt("beta").map(|b| b.as_f32());
    let mut v = x.as_f32().into_owned();
    for row in v.chunks_mut(n.max(1)) {
        let mean = row.iter().map(|&a| a as f64).sum::<f64>() / n as f64;
        let var = row.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for (i, a) in row.iter_mut().enumerate() {
            let mut y = ((*a as f64 - mean) * inv) as f32;
            if let Some(g) = &gamma {
                y *= g[i % g.len().max(1)];
            }
            if let Some(b) = &beta {
                y += b[i % b.len().max(1)];
            }
            *a = y;
        }
    }
    Ok(Tensor::new(x.dtype, x.shape.clone(), Data::F(v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear_of(x: &Tensor, w: &Tensor) -> OpResult<Tensor> {
        let args = Args {
            map: HashMap::from([("x", vec![x]), ("weight", vec![w])]),
            outputs: &[],
        };
        linear(&args)
    }

    /// Every combination of transposes, one row of x (dot products) and several (the blocked
    /// product), batched: the definition of x @ y on small integers (exact in any order).
    #[test]
    fn matmul_is_the_definition_at_every_transpose() {
        let (b, k, n) = (2, 11, 5);
        for m in [1, 2, 7, 11] {
            let x: Vec<f32> = (0..b * m * k)
                .map(|i| ((i * 7) % 11) as f32 - 5.0)
                .collect();
            let y: Vec<f32> = (0..b * k * n)
                .map(|i| ((i * 5) % 13) as f32 - 6.0)
                .collect();
            let want: Vec<f32> = (0..b * m * n)
                .map(|o| {
                    let (bb, i, j) = (o / (m * n), o / n % m, o % n);
                    (0..k)
                        .map(|kk| x[bb * m * k + i * k + kk] * y[bb * k * n + kk * n + j])
                        .sum()
                })
                .collect();
            for (tx, ty) in [(false, false), (false, true), (true, false), (true, true)] {
                let store = |v: &[f32], rows: usize, cols: usize, t: bool| {
                    let data: Vec<f32> = (0..b)
                        .flat_map(|bb| {
                            let blk = &v[bb * rows * cols..(bb + 1) * rows * cols];
                            if t {
                                transpose2(blk, rows, cols)
                            } else {
                                blk.to_vec()
                            }
                        })
                        .collect();
                    let shape = if t {
                        vec![b, cols, rows]
                    } else {
                        vec![b, rows, cols]
                    };
                    Tensor::f32(shape, data)
                };
                let flag = |v: bool| Tensor::new(DType::Bool, vec![], Data::B(vec![v]));
                let (xt, yt, fx, fy) =
                    (store(&x, m, k, tx), store(&y, k, n, ty), flag(tx), flag(ty));
                let args = Args {
                    map: HashMap::from([
                        ("x", vec![&xt]),
                        ("y", vec![&yt]),
                        ("transpose_x", vec![&fx]),
                        ("transpose_y", vec![&fy]),
                    ]),
                    outputs: &[],
                };
                let got = matmul(&args).unwrap();
                assert_eq!(got.shape, vec![b, m, n]);
                assert_eq!(got.as_f32().into_owned(), want, "m={m} tx={tx} ty={ty}");
            }
        }
    }

    /// One x [1, 1, m, k] (or [1, 1, k, m] transposed) against a column per batch [1, G, k, 1],
    /// read once for all of them (the Neural Engine layout's decode attention), gives the bits
    /// of the same x repeated for each batch, with rows past one parallel chunk.
    #[test]
    fn a_shared_x_by_one_column_per_batch_is_each_batch_s_product() {
        let (g, m, k) = (3, 150, 37);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7) % 23) as f32 * 0.37 - 4.0)
            .collect();
        let y: Vec<f32> = (0..g * k)
            .map(|i| ((i * 5) % 13) as f32 * 0.11 - 0.6)
            .collect();
        let flag = |v: bool| Tensor::new(DType::Bool, vec![], Data::B(vec![v]));
        let yt = Tensor::f32(vec![1, g, k, 1], y);
        for tx in [false, true] {
            let (rows, cols) = if tx { (k, m) } else { (m, k) };
            let stored = if tx { transpose2(&x, m, k) } else { x.clone() };
            let run = |xt: &Tensor| {
                let fx = flag(tx);
                let args = Args {
                    map: HashMap::from([
                        ("x", vec![xt]),
                        ("y", vec![&yt]),
                        ("transpose_x", vec![&fx]),
                    ]),
                    outputs: &[],
                };
                matmul(&args).unwrap()
            };
            let shared = run(&Tensor::f32(vec![1, 1, rows, cols], stored.clone()));
            let repeated = stored.repeat(g);
            let each = run(&Tensor::f32(vec![1, g, rows, cols], repeated));
            assert_eq!(shared.shape, vec![1, g, m, 1]);
            assert_eq!(shared.shape, each.shape);
            let bits =
                |t: &Tensor| -> Vec<u32> { t.as_f32().iter().map(|v| v.to_bits()).collect() };
            assert_eq!(bits(&shared), bits(&each), "tx={tx}");
        }
    }

    /// Every broadcast form the fast paths take (same shape, a scalar, a trailing vector, a
    /// per-row value as RMSNorm's scale, a leading 1) and one they do not (a middle axis),
    /// against the definition: each output reads its own coordinates, clamped where b has 1.
    #[test]
    fn binary_ops_broadcast_by_the_definition() {
        let ash = [2usize, 3, 4];
        let a: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        for bsh in [
            vec![2, 3, 4],
            vec![1],
            vec![4],
            vec![2, 3, 1],
            vec![1, 3, 1],
            vec![1, 2, 3, 1],
            vec![3, 1],
            vec![2, 1, 4],
        ] {
            let nb: usize = bsh.iter().product();
            let b: Vec<f32> = (0..nb).map(|i| i as f32 + 1.5).collect();
            let full: Vec<usize> = std::iter::repeat_n(1, 3usize.saturating_sub(bsh.len()))
                .chain(bsh.iter().copied())
                .collect();
            let lead = full.len() - 3;
            let want: Vec<f32> = (0..24)
                .map(|o| {
                    let c = [o / 12, o / 4 % 3, o % 4];
                    let j =
                        (0..3).fold(0, |j, d| j * full[lead + d] + c[d].min(full[lead + d] - 1));
                    a[o] * b[j] - b[j]
                })
                .collect();
            let (ta, tb) = (
                Tensor::f32(ash.to_vec(), a.clone()),
                Tensor::f32(bsh.clone(), b),
            );
            let prod = binary(Op::Mul, &ta, &tb).unwrap();
            let got = binary(Op::Sub, &prod, &tb).unwrap();
            let shape: Vec<usize> = std::iter::repeat_n(1, lead).chain(ash).collect();
            assert_eq!(got.shape, shape, "b {bsh:?}");
            assert_eq!(got.as_f32().into_owned(), want, "b {bsh:?}");
        }
    }

    /// Masked scores (-inf, fp16's lowest) get exactly zero without calling exp, and the rest
    /// are the definition's, along the last axis and along a middle one, in large tensors
    /// (split across threads) as in small.
    #[test]
    fn softmax_is_the_definition_with_masked_entries() {
        for (shape, ax) in [
            (vec![3, 5], 1i64),
            (vec![2, 6, 3], 1),
            (vec![64, 9, 80], -1),
        ] {
            let len: usize = shape.iter().product();
            let x: Vec<f32> = (0..len)
                .map(|i| match i % 7 {
                    0 => f32::NEG_INFINITY,
                    3 => -65504.0,
                    _ => ((i * 37) % 101) as f32 / 9.0 - 5.0,
                })
                .collect();
            let axis_len = shape[ax.rem_euclid(shape.len() as i64) as usize];
            let inner: usize = if ax == 1 && shape.len() == 3 {
                shape[2]
            } else {
                1
            };
            let mut want = x.clone();
            for o in 0..len / (axis_len * inner) {
                for i in 0..inner {
                    let at = |k: usize| o * axis_len * inner + k * inner + i;
                    let m = (0..axis_len)
                        .map(|k| x[at(k)])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = (0..axis_len).map(|k| (x[at(k)] - m).exp()).collect();
                    let s: f32 = e.iter().sum();
                    for k in 0..axis_len {
                        want[at(k)] = e[k] / s;
                    }
                }
            }
            let t = Tensor::f32(shape.clone(), x);
            let a = Tensor::i32(vec![], &[ax as i32]);
            let args = Args {
                map: HashMap::from([("x", vec![&t]), ("axis", vec![&a])]),
                outputs: &[],
            };
            let got = softmax(&args).unwrap().as_f32().into_owned();
            assert_eq!(got, want, "shape {shape:?} axis {ax}");
            assert!(got.iter().step_by(7).all(|&p| p == 0.0));
        }
    }

    #[test]
    fn walk_lists_every_offset_in_row_major_order() {
        // The definition: every position, the last axis fastest, Σ pos[d]·st[d].
        fn naive(shape: &[usize], st: &[usize]) -> Vec<usize> {
            let n: usize = shape.iter().product();
            (0..n)
                .map(|mut i| {
                    let mut off = 0;
                    for d in (0..shape.len()).rev() {
                        off += (i % shape[d]) * st[d];
                        i /= shape[d];
                    }
                    off
                })
                .collect()
        }
        let cases: [(&[usize], &[usize]); 7] = [
            (&[], &[]),
            (&[5], &[1]),
            (&[3, 4], &[1, 3]),
            (&[2, 3, 4], &[12, 0, 1]),
            (&[2, 0, 4], &[0, 4, 1]),
            (&[1, 3, 1, 2], &[6, 2, 2, 1]),
            (&[4, 1, 3], &[1, 0, 4]),
        ];
        for (shape, st) in cases {
            assert_eq!(walk(shape, st), naive(shape, st), "{shape:?} {st:?}");
        }
    }

    /// Several rows of x take the blocked product, one row the dot products: both are x·Wᵀ.
    #[test]
    fn linear_of_many_rows_agrees_with_one_row_at_a_time() {
        let (oc, ic, rows) = (37, 45, 7);
        let wv: Vec<f32> = (0..oc * ic).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
        let xv: Vec<f32> = (0..rows * ic)
            .map(|i| ((i * 7) % 11) as f32 - 5.0)
            .collect();
        for w in [
            Tensor::f32(vec![oc, ic], wv.clone()),
            Tensor::f16(
                vec![oc, ic],
                wv.iter().map(|&v| half::f16::from_f32(v)).collect(),
            ),
        ] {
            let all = linear_of(&Tensor::f32(vec![rows, ic], xv.clone()), &w).unwrap();
            let all = all.as_f32().into_owned();
            for r in 0..rows {
                let one = linear_of(
                    &Tensor::f32(vec![ic], xv[r * ic..(r + 1) * ic].to_vec()),
                    &w,
                )
                .unwrap();
                assert_eq!(&all[r * oc..(r + 1) * oc], &one.as_f32()[..], "row {r}");
            }
        }
    }

    /// `linear` computes x·Wᵀ over the last axis for x of rank 1 to 3 and refuses rank 4, as
    /// MIL documents it (the graph must not rely on what only our interpreter accepts).
    #[test]
    fn linear_takes_rank_one_to_three() {
        let w = Tensor::f32(vec![2, 3], vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        let x = Tensor::f32(vec![1, 2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let y = linear_of(&x, &w).unwrap();
        assert_eq!(y.shape, vec![1, 2, 2]);
        assert_eq!(y.as_f32().into_owned(), vec![1.0, 6.0, 4.0, 15.0]);
        let x4 = Tensor::f32(vec![1, 1, 2, 3], vec![0.0; 6]);
        let err = linear_of(&x4, &w).unwrap_err().to_string();
        assert!(err.contains("rank 1 to 3"), "{err}");
    }
}
