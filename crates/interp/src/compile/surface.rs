//! What the interpreter says to its callers, shared by every layer above the kernels: its
//! errors ([`RuntimeError`]), its options ([`Options`], [`Compute`]: how floats are computed,
//! and the dtype each value computes in under them) and the range statistics of a run
//! ([`Stats`]).

use std::collections::BTreeMap;

use crate::exec::kernels::{scan_f16, scan_f32};
use crate::exec::tensor::{Data, Tensor};
use crate::mil::DType;
use crate::mlpackage::PackageError;

/// What can go wrong loading or running a program.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Package(#[from] PackageError),
    /// An `.aimodel` needs Apple's runtime from the Python environment, which is unusable.
    #[error("Python environment unusable")]
    Environment(#[source] crate::error::EnvironmentError),
    #[error("unsupported op `{op_type}` (producing `{output}`)")]
    UnsupportedOp { op_type: String, output: String },
    #[error("op `{op_type}` producing `{output}`: {msg}")]
    Op {
        op_type: String,
        output: String,
        msg: String,
    },
    #[error("program: {0}")]
    Program(String),
    #[error("input `{name}`: {msg}")]
    Input { name: String, msg: String },
    #[error("{path}: contract: {msg}")]
    Contract { path: String, msg: String },
    /// An interpreter option given for a model Apple's runtime executes.
    #[error(
        "{path}: {option} applies to hf2coreml's interpreter; Apple's Core AI runtime \
             executes this model as it was built"
    )]
    NotInterpreted { path: String, option: &'static str },
    /// A declared shape or a computed size above the interpreter's limits
    /// ([`limits`](crate::limits)).
    #[error("{what}: {msg}")]
    Limit { what: String, msg: String },
}

/// How floats are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compute {
    /// Every result rounded to the dtype the program declares (what the device does).
    #[default]
    Declared,
    /// Every float kept in f32 (debugging: separates range problems from logic errors).
    F32,
}

/// Interpreter options.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    pub compute: Compute,
    /// Decode every weight when the program loads instead of reading packed weights in place
    /// (the same results, bit for bit; benches compare the two).
    pub dense_weights: bool,
}

/// Range statistics of one op kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpStat {
    /// Largest finite |value| produced.
    pub max_abs: f32,
    /// inf or NaN values produced.
    pub non_finite: u64,
    /// Op executions seen.
    pub count: u64,
    /// Wall time spent in this op kind, in nanoseconds (for profiling the interpreter).
    pub nanos: u64,
}

/// Per-op-kind statistics over one or more runs (pass the same collector to each run).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub ops: BTreeMap<String, OpStat>,
}

impl Stats {
    pub(super) fn record(&mut self, op_type: &str, t: &Tensor, nanos: u64) {
        if !self.ops.contains_key(op_type) {
            self.ops.insert(op_type.to_string(), OpStat::default());
        }
        let Some(s) = self.ops.get_mut(op_type) else {
            return;
        };
        s.count += 1;
        s.nanos += nanos;
        let (max_abs, non_finite) = match &t.data {
            Data::F(v) => scan_f32(v),
            Data::Half(v) => scan_f16(v),
            _ => return,
        };
        s.max_abs = s.max_abs.max(max_abs);
        s.non_finite += non_finite;
    }

    /// Whether any op produced inf or NaN.
    pub fn any_non_finite(&self) -> bool {
        self.ops.values().any(|s| s.non_finite > 0)
    }
}

/// The dtype a value of declared `dtype` computes in under `options`.
pub(super) fn effective_dtype(dtype: DType, options: Options) -> DType {
    if options.compute == Compute::F32 && dtype.is_float() {
        DType::F32
    } else {
        dtype
    }
}

/// A constant labelled with the dtype it computes in under `options` (its data unchanged).
pub(super) fn conform_const(t: Tensor, options: Options) -> Tensor {
    let d = effective_dtype(t.dtype, options);
    Tensor::new(d, t.shape, t.data)
}
