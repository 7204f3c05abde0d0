//! Resource limits of the interpreter. A package is input: the shapes
//! it declares and the values its ops compute are checked against limits derived from the
//! package (its weight files' size) and the machine (its memory) *before* anything of that
//! size is allocated.
//!
//! Three checks, all in one place:
//! - every declared type (function inputs, op outputs, constant operands) fits
//!   [`Limits::max_tensor_bytes`] ([`Limits::check_type`]), checked while the program loads;
//! - the program's peak of live values, computed from the declared types and the last use of
//!   each value, fits [`Limits::max_live_bytes`] ([`Limits::check_peak`]);
//! - an op whose result size depends on input values or on a combination of input shapes
//!   (broadcasts, `concat`, `tile`, `gather`, `range_1d`, `matmul`, `linear`) is refused
//!   when that size exceeds its declared output ([`guard`]), before its kernel runs. Every
//!   other op produces at most as many elements as one of its inputs.

use std::path::Path;

use super::ops::{self, Args, OpResult};
use super::tensor::Tensor;
use crate::mil::{DType, Op};
use crate::mlpackage::TensorTypeInfo;

/// Smallest per-tensor limit, whatever the package: 128 MiB holds every tensor of the test
/// fixtures and of a decoder step of the smallest real models many times over.
const MIN_TENSOR_BYTES: u64 = 128 << 20;
/// Smallest limit on the bytes live at once (constants included).
const MIN_LIVE_BYTES: u64 = 512 << 20;
/// A weight-file byte decodes to at most 8 one-bit LUT indices, each an f32 (32 bytes), or a
/// u8 widened to an i64 (8 bytes): no legitimate tensor is larger than this many bytes per
/// byte of weights, and no program holds more than twice that live (constants, caches,
/// activations).
const BYTES_PER_WEIGHT_BYTE: u64 = 32;
/// At most this fraction of the machine's memory goes to one tensor, and twice it to all.
const MACHINE_FRACTION: u64 = 4;
/// Assumed memory when /proc/meminfo cannot be read.
const FALLBACK_MEMORY: u64 = 8 << 30;

/// The limits one program runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_tensor_bytes: u64,
    pub max_live_bytes: u64,
}

impl Limits {
    /// Limits for a package whose weight files total `weight_bytes`, on a machine with
    /// `memory` bytes: proportional to the weights, never below the floors, never above a
    /// quarter (one tensor) or half (everything live) of the memory.
    pub fn new(weight_bytes: u64, memory: u64) -> Self {
        let by_weights = weight_bytes.saturating_mul(BYTES_PER_WEIGHT_BYTE);
        let tensor_cap = memory / MACHINE_FRACTION;
        Limits {
            max_tensor_bytes: by_weights.max(MIN_TENSOR_BYTES).min(tensor_cap),
            max_live_bytes: by_weights
                .saturating_mul(2)
                .max(MIN_LIVE_BYTES)
                .min(tensor_cap * 2),
        }
    }

    /// Limits for the package in `model_dir` on this machine: its `weights/` files are summed.
    pub fn for_package(model_dir: &Path) -> Self {
        let weights = std::fs::read_dir(model_dir.join("weights"))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| std::fs::symlink_metadata(e.path()).ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        Limits::new(weights, machine_memory())
    }

    /// Refuse a declared type larger than one tensor may be.
    pub fn check_type(&self, ty: &TensorTypeInfo) -> Result<(), String> {
        let bytes = type_bytes(ty);
        if bytes > self.max_tensor_bytes {
            return Err(format!(
                "declared {} {:?} needs {bytes} bytes, above the {}-byte limit for one tensor \
                 (see docs/safety.md)",
                ty.dtype.name(),
                ty.shape,
                self.max_tensor_bytes
            ));
        }
        Ok(())
    }

    /// Refuse a program whose values live at once exceed the limit.
    pub fn check_peak(&self, peak: u64) -> Result<(), String> {
        if peak > self.max_live_bytes {
            return Err(format!(
                "its declared values need {peak} bytes live at once, above the {}-byte limit \
                 (see docs/safety.md)",
                self.max_live_bytes
            ));
        }
        Ok(())
    }
}

/// Total memory of this machine (MemTotal), or 8 GiB when it cannot be read.
pub fn machine_memory() -> u64 {
    let read = || -> Option<u64> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kb.checked_mul(1024)
    };
    read().unwrap_or(FALLBACK_MEMORY)
}

/// Bytes the interpreter stores per element of `dtype`: floats are computed in f32, integers
/// held as i64, booleans as bytes.
fn element_bytes(dtype: DType) -> u64 {
    if dtype.is_float() {
        4
    } else if dtype == DType::Bool {
        1
    } else {
        8
    }
}

/// Bytes of a declared type, saturating.
pub fn type_bytes(ty: &TensorTypeInfo) -> u64 {
    ty.shape
        .iter()
        .fold(element_bytes(ty.dtype), |a, &d| a.saturating_mul(d as u64))
}

/// Refuse to run an op whose result would have more elements than its first declared output.
/// Only ops whose result size is not bounded by one input are computed here; the count is
/// exact for valid arguments (so a valid program is never refused) and saturates.
pub fn guard(op: Op, args: &Args) -> OpResult<()> {
    match result_elements(op, args) {
        Some(n) => check_elements(n, args),
        None => Ok(()),
    }
}

/// Refuse a result of `n` elements above the first declared output (the kernels of packed
/// weights call it: their weight is not among the arguments [`guard`] reads).
pub fn check_elements(n: u64, args: &Args) -> OpResult<()> {
    let declared: u64 = args
        .out(0)?
        .shape
        .iter()
        .fold(1u64, |a, &d| a.saturating_mul(d as u64));
    if n > declared.max(1) {
        return Err(format!(
            "would produce {n} elements, the program declares {declared}: refused before \
             allocating"
        )
        .into());
    }
    Ok(())
}

fn product(shape: &[usize]) -> u64 {
    shape.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64))
}

/// Elements of `a` and `b` broadcast together (None when they do not broadcast: the kernel
/// reports that).
fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| {
        if i + s.len() >= r {
            s[i + s.len() - r]
        } else {
            1
        }
    };
    (0..r)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y || y == 1 => Some(x),
            (1, y) => Some(y),
            _ => None,
        })
        .collect()
}

fn result_elements(op: Op, args: &Args) -> Option<u64> {
    use Op::*;
    let get = |k: &str| args.opt(k);
    match op {
        Add | Sub | Mul | RealDiv | Pow | Maximum | Minimum | FloorDiv | Mod | Less | LessEqual
        | Greater | GreaterEqual | Equal | NotEqual | LogicalAnd | LogicalOr | LogicalXor => {
            Some(product(&broadcast(&get("x")?.shape, &get("y")?.shape)?))
        }
        Select => {
            let ca = broadcast(&get("cond")?.shape, &get("a")?.shape)?;
            Some(product(&broadcast(&ca, &get("b")?.shape)?))
        }
        Concat => Some(
            args.list("values")
                .ok()?
                .iter()
                .fold(0u64, |a, t| a.saturating_add(t.len() as u64)),
        ),
        Tile => {
            let reps = args.ints("reps").ok()?;
            Some(reps.iter().fold(get("x")?.len() as u64, |a, &r| {
                a.saturating_mul(r.max(0) as u64)
            }))
        }
        Gather => {
            let x = get("x")?;
            let ax = ops::axis(args.int_or("axis", 0).ok()?, x.rank()).ok()?;
            let rest = (x.len() as u64)
                .checked_div(x.shape[ax] as u64)
                .unwrap_or(0);
            Some(rest.saturating_mul(get("indices")?.len() as u64))
        }
        Range1d => range_elements(args),
        Matmul => matmul_elements(args),
        // A 1×1 conv maps every spatial position's C_in channels to C_out (the only conv the
        // kernel runs; it refuses others before computing anything).
        Conv => {
            let (x, w) = (get("x")?, get("weight")?);
            // Other kernels are refused by the kernel, by name, before it allocates anything.
            if w.shape.get(2..)?.iter().any(|&k| k != 1) {
                return None;
            }
            let ic = *w.shape.get(1)? as u64;
            let positions = (x.len() as u64).checked_div(ic).unwrap_or(0);
            Some(positions.saturating_mul(w.shape[0] as u64))
        }
        Linear => {
            let (x, w) = (get("x")?, get("weight")?);
            let ic = *w.shape.get(1)? as u64;
            let rows = (x.len() as u64).checked_div(ic).unwrap_or(0);
            Some(rows.saturating_mul(w.shape[0] as u64))
        }
        _ => None,
    }
}

fn range_elements(args: &Args) -> Option<u64> {
    let f = |k: &str, d: f32| -> Option<f64> {
        let t: &Tensor = args.opt(k)?;
        Some(t.as_f32().first().copied().unwrap_or(d) as f64)
    };
    let (s, e, st) = (f("start", 0.0)?, f("end", 0.0)?, f("step", 1.0)?);
    if st == 0.0 || !(s.is_finite() && e.is_finite() && st.is_finite()) {
        // The kernel refuses a zero step; a non-finite bound has no finite count.
        return Some(if st == 0.0 { 0 } else { u64::MAX });
    }
    let n = ((e - s) / st).ceil().max(0.0);
    Some(if n >= u64::MAX as f64 {
        u64::MAX
    } else {
        n as u64
    })
}

fn matmul_elements(args: &Args) -> Option<u64> {
    let (x, y) = (args.opt("x")?, args.opt("y")?);
    let tx = args.bool_or("transpose_x", false).ok()?;
    let ty = args.bool_or("transpose_y", false).ok()?;
    let (mut xs, mut ys) = (x.shape.clone(), y.shape.clone());
    if xs.len() == 1 {
        xs.insert(0, 1);
    }
    if ys.len() == 1 {
        ys.push(1);
    }
    let (xr, yr) = (xs.len(), ys.len());
    if xr < 2 || yr < 2 {
        return None;
    }
    let m = if tx { xs[xr - 1] } else { xs[xr - 2] };
    let n = if ty { ys[yr - 2] } else { ys[yr - 1] };
    let batch = broadcast(&xs[..xr - 2], &ys[..yr - 2])?;
    Some(
        product(&batch)
            .saturating_mul(m as u64)
            .saturating_mul(n as u64),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_weights_between_the_floor_and_the_machine() {
        let l = Limits::new(0, 64 << 30);
        assert_eq!(l.max_tensor_bytes, MIN_TENSOR_BYTES);
        assert_eq!(l.max_live_bytes, MIN_LIVE_BYTES);
        let l = Limits::new(100 << 20, 64 << 30);
        assert_eq!(l.max_tensor_bytes, 3200 << 20);
        assert_eq!(l.max_live_bytes, 6400 << 20);
        let l = Limits::new(1 << 40, 16 << 30);
        assert_eq!(l.max_tensor_bytes, 4 << 30);
        assert_eq!(l.max_live_bytes, 8 << 30);
    }

    #[test]
    fn declared_types_are_checked_in_bytes() {
        let l = Limits::new(0, 64 << 30);
        let ty = |dtype, shape: Vec<usize>| TensorTypeInfo { dtype, shape };
        assert!(l.check_type(&ty(DType::F16, vec![1 << 20, 32])).is_ok());
        assert!(l.check_type(&ty(DType::F16, vec![1 << 20, 33])).is_err());
        assert!(l.check_type(&ty(DType::I32, vec![1 << 20, 17])).is_err());
        assert!(l
            .check_type(&ty(DType::F32, vec![1 << 20, 1 << 20]))
            .is_err());
    }

    #[test]
    fn broadcast_counts_saturate_and_refuse_mismatches() {
        assert_eq!(broadcast(&[4, 1], &[1, 5]), Some(vec![4, 5]));
        assert_eq!(broadcast(&[3], &[2, 3]), Some(vec![2, 3]));
        assert_eq!(broadcast(&[3], &[2]), None);
        assert_eq!(product(&[usize::MAX, 4]), u64::MAX);
    }
}
