//! Core ML states (iOS18): the values a stateful program keeps between calls ([`States`]), and
//! `slice_update`, which copies `x` with a window replaced ([`slice_update`]) or, where the
//! compiled program found that nothing else reads the old value, writes the window into the
//! state's own storage ([`update_window`]), which is what makes a stateful decode step cheaper
//! than passing the cache in and out. The state ops themselves (`read_state`, `write_state`,
//! coremltools' `coreml_update_state`) move values between slots, which the run loop does.

use std::sync::Arc;

use super::ops::{self, Args, OpResult, Window};
use super::tensor::{Data, Tensor};
use crate::mil::DType;
use crate::mlpackage::TensorTypeInfo;

/// The values of a program's states, in declaration order, kept between calls (Core ML's
/// `MLState`). New states are zero, as `model.makeState()` makes them.
#[derive(Debug, Clone)]
pub struct States {
    pub(crate) names: Vec<String>,
    pub(crate) values: Vec<Option<Arc<Tensor>>>,
    types: Vec<TensorTypeInfo>,
}

impl States {
    /// Zero-filled states of these declared types (each was checked against the interpreter's
    /// limits when the program loaded).
    pub(crate) fn zeros(decl: &[(String, usize, TensorTypeInfo)], float: DType) -> Self {
        let mut s = States {
            names: decl.iter().map(|(n, _, _)| n.clone()).collect(),
            values: Vec::with_capacity(decl.len()),
            types: decl.iter().map(|(_, _, t)| t.clone()).collect(),
        };
        for i in 0..s.names.len() {
            s.values.push(Some(Arc::new(zero(&s.types[i], float))));
        }
        s
    }

    /// State names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(|n| n.as_str())
    }

    /// The value of state `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        let i = self.names.iter().position(|n| n == name)?;
        self.values[i].as_deref()
    }

    /// Mutable access to the value of state `name` (a host writing rows it restores).
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        let i = self.names.iter().position(|n| n == name)?;
        self.values[i].as_mut().map(Arc::make_mut)
    }

    /// Zero every state whose value a failed call left behind (taken out mid-update).
    pub(crate) fn refill(&mut self, float: DType) {
        for (v, ty) in self.values.iter_mut().zip(&self.types) {
            if v.is_none() {
                *v = Some(Arc::new(zero(ty, float)));
            }
        }
    }
}

/// A zero tensor of a declared state type: fp16 states are kept as fp16 (they only move).
fn zero(ty: &TensorTypeInfo, float: DType) -> Tensor {
    let n: usize = ty.shape.iter().product();
    let data = match ty.dtype {
        DType::F16 if float == DType::F16 => Data::Half(vec![half::f16::ZERO; n]),
        d if d.is_float() => Data::F(vec![0.0; n]),
        DType::Bool => Data::B(vec![false; n]),
        _ => Data::I(vec![0; n]),
    };
    let dtype = if ty.dtype.is_float() && float == DType::F32 {
        DType::F32
    } else {
        ty.dtype
    };
    Tensor::new(dtype, ty.shape.clone(), data)
}

/// `slice_update` as a fresh tensor: a copy of `x` with the window replaced by `update`.
pub fn slice_update(args: &Args) -> OpResult<Tensor> {
    let x = args.get("x")?;
    let mut out = x.clone();
    update_window(&mut out, args)?;
    Ok(out)
}

/// Replace the window `begin..end` (slice_by_index's arguments) of `x` with `update`, in
/// place. The window must lie inside `x` and hold exactly `update`'s elements; nothing is
/// written otherwise.
pub fn update_window(x: &mut Tensor, args: &Args) -> OpResult<()> {
    let update = args.get("update")?;
    let w = ops::slice_window(&x.shape, args)?;
    check_window(&x.shape, &w)?;
    let want: usize = w.shape.iter().product();
    let squeezed = w.squeezed();
    if update.len() != want || (update.shape != squeezed && update.shape != w.shape) {
        return Err(format!(
            "update of shape {:?} for a window of shape {:?} in {:?}",
            update.shape, squeezed, x.shape
        )
        .into());
    }
    if x.dtype.is_float() != update.dtype.is_float() {
        return Err(format!(
            "{} update for a {} tensor",
            update.dtype.name(),
            x.dtype.name()
        )
        .into());
    }
    let shape = x.shape.clone();
    match (&mut x.data, &update.data) {
        (Data::F(d), Data::F(u)) => write(d, &shape, &w, u),
        (Data::Half(d), Data::Half(u)) => write(d, &shape, &w, u),
        (Data::Half(d), Data::F(u)) => {
            let u: Vec<half::f16> = u.iter().map(|&v| half::f16::from_f32(v)).collect();
            write(d, &shape, &w, &u)
        }
        (Data::F(d), Data::Half(u)) => {
            let u: Vec<f32> = u.iter().map(|v| v.to_f32()).collect();
            write(d, &shape, &w, &u)
        }
        (Data::I(d), Data::I(u)) => write(d, &shape, &w, u),
        (Data::B(d), Data::B(u)) => write(d, &shape, &w, u),
        _ => return Err("update data of another kind than x".into()),
    }
    Ok(())
}

/// Every addressed element inside the axis (a clamped window may be empty, never outside).
fn check_window(shape: &[usize], w: &Window) -> OpResult<()> {
    for d in 0..shape.len() {
        if w.shape[d] == 0 {
            continue;
        }
        let last = w.start[d] + w.stride[d] * (w.shape[d] as i64 - 1);
        let n = shape[d] as i64;
        if w.start[d] < 0 || last < 0 || w.start[d] >= n || last >= n {
            return Err(format!("update window outside axis {d} of shape {shape:?}").into());
        }
    }
    Ok(())
}

/// Write `src` (the window's elements in row-major order) into `dst`, a run of the last axis
/// at a time when its stride is 1.
fn write<T: Copy>(dst: &mut [T], shape: &[usize], w: &Window, src: &[T]) {
    let r = shape.len();
    if src.is_empty() || r == 0 {
        if r == 0 && !src.is_empty() {
            dst[0] = src[0];
        }
        return;
    }
    let mut st = vec![1usize; r];
    for d in (0..r - 1).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    let run = w.shape[r - 1];
    let contiguous = w.stride[r - 1] == 1;
    let mut pos = vec![0usize; r];
    let mut at = 0;
    loop {
        let mut off = 0i64;
        for d in 0..r {
            off += (w.start[d] + w.stride[d] * pos[d] as i64) * st[d] as i64;
        }
        let off = off as usize;
        if contiguous {
            dst[off..off + run].copy_from_slice(&src[at..at + run]);
            at += run;
        } else {
            for k in 0..run {
                let o = (off as i64 + w.stride[r - 1] * k as i64 * st[r - 1] as i64) as usize;
                dst[o] = src[at];
                at += 1;
            }
        }
        // Next position over every axis but the last.
        let mut d = r - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            pos[d] += 1;
            if pos[d] < w.shape[d] {
                break;
            }
            pos[d] = 0;
        }
    }
}
