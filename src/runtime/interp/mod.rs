//! The MIL interpreter: runs the `main` function of a saved ML Program on the CPU (or, for a
//! multifunction package, each function by name: [`Package`] picks one per call).
//!
//! At load the program is compiled once: names become slots, `const` values and constexpr
//! weights (`constexpr_lut_to_dense`) are decoded to f32 and shared, except the weights that
//! stay packed in the memory-mapped weight file ([`packed`]), and the last use of every
//! intermediate is recorded so it is freed as soon as possible. Each op's result is checked
//! against the shape the program declares and rounded to the declared dtype (fp16 stays fp16
//! and overflows to inf, as on device), unless [`Compute::F32`] is chosen.

mod constexpr18;
mod kernels;
pub mod limits;
pub mod ops;
pub mod packed;
mod state;
pub mod tensor;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use half::f16;

use crate::mil::contract::{self, Contract};
use crate::mil::{DType, Op};
use crate::mlpackage::{self, proto, MlPackage, PackageError, TensorTypeInfo, Values};
use limits::Limits;
use ops::{Args, OpError};
pub use state::States;
pub use tensor::{Data, Tensor};

/// What can go wrong loading or running a program.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Package(#[from] PackageError),
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
    /// A declared shape or a computed size above the interpreter's limits ([`limits`]).
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
    /// Decode every weight when the program loads, as before packed weights (the same
    /// results, bit for bit; benches compare the two).
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
    fn record(&mut self, op_type: &str, t: &Tensor, nanos: u64) {
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

use kernels::{scan_f16, scan_f32};

#[derive(Debug, Clone)]
enum Arg {
    Slot(usize),
    Const(Arc<Tensor>),
}

/// An instruction's operation, resolved once when the program loads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum OpKind {
    Known(Op),
    /// A name the interpreter does not implement: the program loads, running it fails with
    /// [`RuntimeError::UnsupportedOp`].
    Unknown(String),
}

impl OpKind {
    fn parse(name: &str) -> Self {
        Op::from_name(name).map_or_else(|| OpKind::Unknown(name.to_string()), OpKind::Known)
    }

    /// The MIL name, for errors and statistics.
    fn name(&self) -> &str {
        match self {
            OpKind::Known(op) => op.as_str(),
            OpKind::Unknown(name) => name,
        }
    }

    fn is(&self, ops: &[Op]) -> bool {
        matches!(self, OpKind::Known(op) if ops.contains(op))
    }
}

#[derive(Debug)]
struct Instr {
    op: OpKind,
    inputs: Vec<(String, Vec<Arg>)>,
    outputs: Vec<(usize, TensorTypeInfo)>,
    out_names: Vec<String>,
    /// Slots whose last use is this instruction.
    frees: Vec<usize>,
    /// A `slice_update` of a state's value that may write into the state's storage: the
    /// state's slot (see [`state`]).
    in_place: Option<usize>,
}

/// A compiled `main` function.
#[derive(Debug)]
pub struct Program {
    options: Options,
    n_slots: usize,
    consts: Vec<(usize, Arc<Tensor>)>,
    /// Weights left in the weight file, by slot: only `linear`, `conv` and `gather` read them.
    packed: HashMap<usize, Arc<packed::Packed>>,
    /// The slots of the kept constants, by name (validate reads weights back through them).
    const_names: HashMap<String, usize>,
    inputs: Vec<(String, usize, TensorTypeInfo)>,
    /// Core ML states (iOS18): name, slot, the wrapped tensor type.
    states: Vec<(String, usize, TensorTypeInfo)>,
    instrs: Vec<Instr>,
    outputs: Vec<(String, usize)>,
    opset: String,
    limits: Limits,
}

/// Ops that only move elements: their results need no rounding when the dtype is unchanged.
const LAYOUT_OPS: &[Op] = &[
    Op::Reshape,
    Op::ExpandDims,
    Op::Squeeze,
    Op::Identity,
    Op::Transpose,
    Op::Concat,
    Op::Split,
    Op::SliceByIndex,
    Op::SliceBySize,
    Op::Tile,
    Op::Gather,
    Op::SliceUpdate,
];

/// Ops that give their input a new shape without touching its elements.
const RESHAPE_OPS: &[Op] = &[Op::Reshape, Op::ExpandDims, Op::Squeeze, Op::Identity];

/// Ops whose value is computed once at load.
const CONSTEXPR: &[Op] = &[
    Op::Const,
    Op::ConstexprLutToDense,
    Op::ConstexprBlockwiseShiftScale,
];

impl Program {
    /// Compile the `main` function of `pkg`, decoding every constant and constexpr weight.
    /// Every declared type, and the sum of the values live at once, is checked against
    /// [`Limits::for_package`] before anything of that size is allocated.
    pub fn load(pkg: &MlPackage, options: Options) -> Result<Self, RuntimeError> {
        Self::load_with(pkg, options, Limits::for_package(pkg.model_dir()))
    }

    /// [`Program::load`] under explicit limits.
    pub fn load_with(
        pkg: &MlPackage,
        options: Options,
        limits: Limits,
    ) -> Result<Self, RuntimeError> {
        Self::compile(pkg, pkg.main_function()?, options, limits)
    }

    /// Compile the function `name` of `pkg` (a multifunction package's `prefill` or
    /// `decode`), under the same limits as [`Program::load`].
    pub fn load_function(
        pkg: &MlPackage,
        name: &str,
        options: Options,
    ) -> Result<Self, RuntimeError> {
        let limits = Limits::for_package(pkg.model_dir());
        Self::compile(pkg, pkg.function(name)?, options, limits)
    }

    fn compile(
        pkg: &MlPackage,
        main: mlpackage::MainFunction<'_>,
        options: Options,
        limits: Limits,
    ) -> Result<Self, RuntimeError> {
        let mut ld = Loader {
            pkg,
            options,
            limits,
            slots: HashMap::new(),
            const_bytes: 0,
            const_cache: HashMap::new(),
            constants: HashMap::new(),
            packed: Vec::new(),
            packed_names: HashMap::new(),
        };
        let mut inputs = Vec::new();
        let mut states = Vec::new();
        for i in main.inputs {
            let (vt, list) = match state_wrapped(i.r#type.as_ref()) {
                Some(w) => (Some(w), &mut states),
                None => (i.r#type.as_ref(), &mut inputs),
            };
            let ty = ld.declared(vt, &format!("input `{}`", i.name))?;
            let s = ld.slot(&i.name);
            list.push((i.name.clone(), s, ty));
        }
        let mut consts = Vec::new();
        let mut instrs = Vec::new();
        for op in &main.block.operations {
            if let Some(c) = ld.instr(op, &mut instrs)? {
                consts.push(c);
            }
        }
        let mut outputs = Vec::new();
        for name in &main.block.outputs {
            let s = *ld.slots.get(name).ok_or_else(|| {
                RuntimeError::Program(format!("block output `{name}` is never defined"))
            })?;
            outputs.push((name.clone(), s));
        }
        let n_slots = ld.slots.len();
        let packed = settle_packed(&mut ld, &instrs, &outputs, &mut consts)?;
        let const_bytes = ld.const_bytes;
        drop_unread_constants(&mut consts, &instrs, &outputs);
        // States stay live across the whole call, like the outputs.
        let kept: Vec<(String, usize)> = outputs
            .iter()
            .cloned()
            .chain(states.iter().map(|(n, s, _)| (n.clone(), *s)))
            .collect();
        schedule_frees(&mut instrs, &kept, &consts);
        let state_slots: Vec<usize> = states.iter().map(|(_, s, _)| *s).collect();
        state::in_place_updates(&mut instrs, &state_slots);
        let live_in: Vec<_> = inputs.iter().chain(&states).cloned().collect();
        let peak = peak_live_bytes(&live_in, &instrs, const_bytes);
        limits.check_peak(peak).map_err(|msg| RuntimeError::Limit {
            what: format!("{}", pkg.model_path().display()),
            msg,
        })?;
        store_linear_weights_half(&mut consts, &instrs);
        let kept: std::collections::HashSet<usize> = consts
            .iter()
            .map(|(s, _)| *s)
            .chain(packed.keys().copied())
            .collect();
        let const_names = ld
            .slots
            .iter()
            .filter(|(_, s)| kept.contains(s))
            .map(|(n, s)| (n.clone(), *s))
            .collect();
        Ok(Program {
            options,
            n_slots,
            consts,
            packed,
            const_names,
            inputs,
            states,
            instrs,
            outputs,
            opset: main.opset.to_string(),
            limits,
        })
    }

    /// The value of the constant (or constexpr result) named `name`, as the program computes
    /// with it, if a kept constant has that name (a packed weight is decoded for the caller).
    pub fn constant(&self, name: &str) -> Option<Cow<'_, Tensor>> {
        let slot = *self.const_names.get(name)?;
        if let Some(p) = self.packed.get(&slot) {
            return p.dense().ok().map(Cow::Owned);
        }
        self.consts
            .iter()
            .find(|(s, _)| *s == slot)
            .map(|(_, t)| Cow::Borrowed(t.as_ref()))
    }

    /// The constant (or constexpr result) named `name`, read a range of elements at a time: a
    /// packed weight decodes only the rows a range covers (validate's weight check reads an
    /// 8B's 2.1 GB embedding this way), a held one is borrowed. `None` as for
    /// [`Program::constant`].
    pub fn constant_reader(&self, name: &str) -> Option<ConstantReader<'_>> {
        let slot = *self.const_names.get(name)?;
        if let Some(p) = self.packed.get(&slot) {
            return Some(ConstantReader::Packed(p));
        }
        self.consts
            .iter()
            .find(|(s, _)| *s == slot)
            .map(|(_, t)| ConstantReader::Held(t.as_f32()))
    }

    /// How many weights are left packed in the weight files (read in place, not held).
    pub fn packed_weights(&self) -> usize {
        self.packed.len()
    }

    /// The limits this program was loaded under.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The function's opset (`CoreML7` for iOS17).
    pub fn opset(&self) -> &str {
        &self.opset
    }

    /// Declared inputs: name, dtype and shape.
    pub fn inputs(&self) -> impl Iterator<Item = (&str, &TensorTypeInfo)> {
        self.inputs.iter().map(|(n, _, t)| (n.as_str(), t))
    }

    /// Declared states (iOS18): name, dtype and shape of the tensor each wraps.
    pub fn states(&self) -> impl Iterator<Item = (&str, &TensorTypeInfo)> {
        self.states.iter().map(|(n, _, t)| (n.as_str(), t))
    }

    /// Fresh values for this program's states: zeros, as Core ML's `makeState()` gives.
    pub fn new_states(&self) -> States {
        let float = effective_dtype(DType::F16, self.options);
        States::zeros(&self.states, float)
    }

    /// Output names in order.
    pub fn output_names(&self) -> impl Iterator<Item = &str> {
        self.outputs.iter().map(|(n, _)| n.as_str())
    }

    /// Run once. `inputs` must hold every declared input with its declared shape; a float
    /// input may be given as f32 or fp16 data. Returns the block outputs by name. A program
    /// with states runs on fresh (zero) ones, which are then dropped: see
    /// [`run_with_states`](Self::run_with_states) to keep them.
    pub fn run(
        &self,
        inputs: Vec<(&str, Tensor)>,
        stats: Option<&mut Stats>,
    ) -> Result<HashMap<String, Tensor>, RuntimeError> {
        self.run_with_states(inputs, &mut self.new_states(), stats)
    }

    /// Run once on `states` (from [`new_states`](Self::new_states) or an earlier call), which
    /// hold what the program wrote into them afterwards. A call that fails leaves the states
    /// it was updating zeroed.
    pub fn run_with_states(
        &self,
        inputs: Vec<(&str, Tensor)>,
        states: &mut States,
        stats: Option<&mut Stats>,
    ) -> Result<HashMap<String, Tensor>, RuntimeError> {
        if states.names.len() != self.states.len()
            || states
                .names
                .iter()
                .zip(&self.states)
                .any(|(a, (b, _, _))| a != b)
        {
            return Err(RuntimeError::Program(
                "states of another program".to_string(),
            ));
        }
        let mut env: Vec<Option<Arc<Tensor>>> = vec![None; self.n_slots];
        // The states' values move into their slots for the call and back after it.
        for (v, (_, s, _)) in states.values.iter_mut().zip(&self.states) {
            env[*s] = v.take();
        }
        let result = self.run_env(inputs, &mut env, stats);
        for (v, (_, s, _)) in states.values.iter_mut().zip(&self.states) {
            *v = env[*s].take();
        }
        if result.is_err() {
            states.refill(effective_dtype(DType::F16, self.options));
        }
        result
    }

    fn run_env(
        &self,
        inputs: Vec<(&str, Tensor)>,
        env: &mut [Option<Arc<Tensor>>],
        mut stats: Option<&mut Stats>,
    ) -> Result<HashMap<String, Tensor>, RuntimeError> {
        for (s, t) in &self.consts {
            env[*s] = Some(t.clone());
        }
        let mut given: HashMap<&str, Tensor> = inputs.into_iter().collect();
        for (name, s, ty) in &self.inputs {
            let t = given
                .remove(name.as_str())
                .ok_or_else(|| RuntimeError::Input {
                    name: name.clone(),
                    msg: "not given".into(),
                })?;
            if t.shape != ty.shape {
                return Err(RuntimeError::Input {
                    name: name.clone(),
                    msg: format!("shape {:?}, the program declares {:?}", t.shape, ty.shape),
                });
            }
            if t.dtype.is_float() != ty.dtype.is_float() {
                return Err(RuntimeError::Input {
                    name: name.clone(),
                    msg: format!("{} data for a {} input", t.data.kind(), ty.dtype.name()),
                });
            }
            env[*s] = Some(Arc::new(self.conform(t, ty.dtype)));
        }
        if let Some(extra) = given.keys().next() {
            return Err(RuntimeError::Input {
                name: extra.to_string(),
                msg: "the program has no such input".into(),
            });
        }
        for ins in &self.instrs {
            let started = stats.is_some().then(std::time::Instant::now);
            if self.state_op(ins, env)? {
                for &f in &ins.frees {
                    env[f] = None;
                }
                continue;
            }
            let results = match self.reshape_in_place(ins, env) {
                Some(t) => vec![t],
                None => match self.update_in_place(ins, env)? {
                    Some(t) => vec![t],
                    None => self.exec(ins, env)?,
                },
            };
            for ((s, ty), (mut t, name)) in ins
                .outputs
                .iter()
                .zip(results.into_iter().zip(&ins.out_names))
            {
                if t.shape != ty.shape {
                    // Rank-0 and rank-1 single-element results describe the same value.
                    if t.len() == 1 && ty.shape.iter().product::<usize>() == 1 {
                        t.shape = ty.shape.clone();
                    } else {
                        return Err(RuntimeError::Op {
                            op_type: ins.op.name().to_string(),
                            output: name.clone(),
                            msg: format!(
                                "computed shape {:?}, the program declares {:?}",
                                t.shape, ty.shape
                            ),
                        });
                    }
                }
                // Ops that only move values keep them representable in their dtype.
                let t = if ins.op.is(LAYOUT_OPS)
                    && t.dtype == effective_dtype(ty.dtype, self.options)
                {
                    t
                } else {
                    self.conform(t, ty.dtype)
                };
                if let Some(st) = stats.as_deref_mut() {
                    let nanos = started.map_or(0, |s| s.elapsed().as_nanos() as u64);
                    st.record(ins.op.name(), &t, nanos);
                }
                env[*s] = Some(Arc::new(t));
            }
            for &f in &ins.frees {
                env[f] = None;
            }
        }
        let mut out = HashMap::new();
        for (name, s) in &self.outputs {
            let t = env[*s].take().ok_or_else(|| {
                RuntimeError::Program(format!("output `{name}` was not computed"))
            })?;
            out.insert(
                name.clone(),
                Arc::try_unwrap(t).unwrap_or_else(|a| (*a).clone()),
            );
        }
        Ok(out)
    }

    /// A reshape-like op whose input dies here takes the input's storage instead of copying.
    fn reshape_in_place(&self, ins: &Instr, env: &mut [Option<Arc<Tensor>>]) -> Option<Tensor> {
        if !ins.op.is(RESHAPE_OPS) {
            return None;
        }
        let (_, args) = ins.inputs.iter().find(|(k, _)| k == "x")?;
        let Some(Arg::Slot(s)) = args.first() else {
            return None;
        };
        let (_, ty) = ins.outputs.first()?;
        if !ins.frees.contains(s) {
            return None;
        }
        let arc = env[*s].take()?;
        match Arc::try_unwrap(arc) {
            Ok(mut t) if t.len() == ty.shape.iter().product::<usize>() => {
                t.shape = ty.shape.clone();
                Some(t)
            }
            Ok(t) => {
                env[*s] = Some(Arc::new(t));
                None
            }
            Err(arc) => {
                env[*s] = Some(arc);
                None
            }
        }
    }

    fn conform(&self, t: Tensor, dtype: DType) -> Tensor {
        let dtype = effective_dtype(dtype, self.options);
        let data = tensor::conform_data(t.data, dtype);
        Tensor::new(dtype, t.shape, data)
    }

    fn exec(&self, ins: &Instr, env: &[Option<Arc<Tensor>>]) -> Result<Vec<Tensor>, RuntimeError> {
        let output = ins.out_names.first().cloned().unwrap_or_default();
        let weight = ins.inputs.iter().find_map(|(k, a)| match a.as_slice() {
            [Arg::Slot(s)] => self.packed.get(s).map(|p| (k.as_str(), p)),
            _ => None,
        });
        let map = arguments(ins, env, weight.map(|(k, _)| k))?;
        let types: Vec<TensorTypeInfo> = ins.outputs.iter().map(|(_, t)| t.clone()).collect();
        let args = Args {
            map,
            outputs: &types,
        };
        if let Some((_, w)) = weight {
            let res = match ins.op {
                OpKind::Known(Op::Linear) => packed::linear(&args, w),
                OpKind::Known(Op::Conv) => packed::conv(&args, w),
                _ => packed::gather(&args, w),
            };
            return res.map(|t| vec![t]).map_err(|e| RuntimeError::Op {
                op_type: ins.op.name().to_string(),
                output,
                msg: e.to_string(),
            });
        }
        let op = match &ins.op {
            OpKind::Known(op) if !CONSTEXPR.contains(op) => *op,
            other => {
                return Err(RuntimeError::UnsupportedOp {
                    op_type: other.name().to_string(),
                    output,
                })
            }
        };
        let res = run_op(op, &args).map_err(|e| RuntimeError::Op {
            op_type: op.as_str().to_string(),
            output: output.clone(),
            msg: e.to_string(),
        })?;
        if res.len() != ins.outputs.len() {
            return Err(RuntimeError::Op {
                op_type: op.as_str().to_string(),
                output,
                msg: format!(
                    "{} results for {} declared outputs",
                    res.len(),
                    ins.outputs.len()
                ),
            });
        }
        Ok(res)
    }
}

/// An instruction's arguments by name, from the constants and `env` (all but `skip`).
fn arguments<'e>(
    ins: &'e Instr,
    env: &'e [Option<Arc<Tensor>>],
    skip: Option<&str>,
) -> Result<HashMap<&'e str, Vec<&'e Tensor>>, RuntimeError> {
    let mut map: HashMap<&str, Vec<&Tensor>> = HashMap::new();
    for (k, a) in ins.inputs.iter().filter(|(k, _)| Some(k.as_str()) != skip) {
        let mut v = Vec::with_capacity(a.len());
        for b in a {
            v.push(match b {
                Arg::Const(t) => t.as_ref(),
                Arg::Slot(s) => env[*s].as_deref().ok_or_else(|| RuntimeError::Op {
                    op_type: ins.op.name().to_string(),
                    output: ins.out_names.first().cloned().unwrap_or_default(),
                    msg: format!("argument `{k}` has no value (freed or never computed)"),
                })?,
            });
        }
        map.insert(k.as_str(), v);
    }
    Ok(map)
}

/// The tensor type a state type wraps, if `vt` is a state type.
fn state_wrapped(vt: Option<&proto::ValueType>) -> Option<&proto::ValueType> {
    match vt?.r#type.as_ref()? {
        proto::value_type::Type::StateType(s) => s.wrapped_type.as_ref(),
        _ => None,
    }
}

/// Key of a decoded blob constant: file, offset, declared shape.
type ConstKey = (String, u64, Vec<usize>);

/// State while a program compiles: name → slot, the constants decoded so far and their bytes.
struct Loader<'p> {
    pkg: &'p MlPackage,
    options: Options,
    limits: Limits,
    slots: HashMap<String, usize>,
    const_bytes: u64,
    const_cache: HashMap<ConstKey, Arc<Tensor>>,
    /// Every constant and constexpr result so far, by name: iOS18 constexpr ops may name one
    /// as an operand.
    constants: HashMap<String, Arc<Tensor>>,
    /// The weights left packed so far, by slot and by name ([`settle_packed`] decides which
    /// stay so).
    packed: Vec<(usize, Arc<packed::Packed>)>,
    packed_names: HashMap<String, Arc<packed::Packed>>,
}

impl Loader<'_> {
    fn slot(&mut self, name: &str) -> usize {
        let n = self.slots.len();
        *self.slots.entry(name.to_string()).or_insert(n)
    }

    fn limit_err(&self, what: &str, msg: String) -> RuntimeError {
        RuntimeError::Limit {
            what: format!("{}: {what}", self.pkg.model_path().display()),
            msg,
        }
    }

    /// A declared tensor type, refused above the per-tensor limit.
    fn declared(
        &self,
        vt: Option<&proto::ValueType>,
        what: &str,
    ) -> Result<TensorTypeInfo, RuntimeError> {
        let ty = mlpackage::tensor_type(vt, what)?;
        self.limits
            .check_type(&ty)
            .map_err(|msg| self.limit_err(what, msg))?;
        Ok(ty)
    }

    /// Decode a constant value after checking its declared size, alone and added to every
    /// constant decoded before it.
    fn value(
        &mut self,
        v: &proto::Value,
        what: &str,
    ) -> Result<mlpackage::TensorData, RuntimeError> {
        let ty = self.declared(v.r#type.as_ref(), what)?;
        let total = self.const_bytes.saturating_add(limits::type_bytes(&ty));
        self.limits
            .check_peak(total)
            .map_err(|msg| self.limit_err(what, format!("with the constants before it, {msg}")))?;
        self.const_bytes = total;
        Ok(self.pkg.value(v, what)?)
    }

    /// A packed weight decoded whole, counted with the constants first.
    fn unpack(&mut self, p: &packed::Packed, what: &str) -> Result<Tensor, RuntimeError> {
        let total = self.const_bytes.saturating_add(p.dense_bytes());
        self.limits
            .check_peak(total)
            .map_err(|msg| self.limit_err(what, msg))?;
        self.const_bytes = total;
        p.dense().map_err(|e| RuntimeError::Program(e.to_string()))
    }

    /// Compile one operation: a constant (returned, to be stored) or an instruction (pushed).
    fn instr(
        &mut self,
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
            let ty = self.declared(o.r#type.as_ref(), &format!("`{}`", o.name))?;
            outs.push((o.name.clone(), ty));
        }
        let kind = OpKind::parse(&op.r#type);
        if let Some(constant) = match kind {
            OpKind::Known(k) if CONSTEXPR.contains(&k) => Some(k),
            _ => None,
        } {
            let (name, ty) = outs.first().ok_or_else(|| op_err("no output".into()))?;
            if let Some(p) = packed::try_pack(self, op, constant, ty)? {
                let (p, s) = (Arc::new(p), self.slot(name));
                self.packed.push((s, p.clone()));
                self.packed_names.insert(name.clone(), p);
                return Ok(None);
            }
            let t = constexpr(self, op, constant, ty).map_err(|e| match e {
                RuntimeError::Program(msg) => op_err(msg),
                other => other,
            })?;
            self.constants.insert(name.clone(), t.clone());
            return Ok(Some((self.slot(name), t)));
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
                        let s = *self.slots.get(n).ok_or_else(|| {
                            op_err(format!(
                                "argument `{key}` names `{n}`, which is not defined before it"
                            ))
                        })?;
                        bound.push(Arg::Slot(s));
                    }
                    Some(proto::binding::Binding::Value(v)) => {
                        let t = self.value(v, &format!("argument `{key}` of `{first_out}`"))?;
                        let t = conform_const(Tensor::from_const(t), self.options);
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
            outputs.push((self.slot(&name), ty));
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
}

/// Keep packed the weights only `linear` and `conv` (as `weight`) and `gather` (as `x`,
/// along axis 0) read; decode the others, counted with the constants, as dense constants.
/// A packed weight nothing reads (a LUT a scale op was applied to) is dropped.
fn settle_packed(
    ld: &mut Loader,
    instrs: &[Instr],
    outputs: &[(String, usize)],
    consts: &mut Vec<(usize, Arc<Tensor>)>,
) -> Result<HashMap<usize, Arc<packed::Packed>>, RuntimeError> {
    let mut kept = HashMap::new();
    for (s, p) in std::mem::take(&mut ld.packed) {
        let reads = |i: &&Instr| {
            i.inputs
                .iter()
                .any(|(_, a)| a.iter().any(|b| matches!(b, Arg::Slot(x) if *x == s)))
        };
        let readers: Vec<&Instr> = instrs.iter().filter(reads).collect();
        let output = outputs.iter().any(|(_, o)| *o == s);
        if readers.is_empty() && !output {
            continue;
        }
        let known = |slot: usize| {
            consts
                .iter()
                .find(|(c, _)| *c == slot)
                .map(|(_, t)| t.clone())
        };
        if !output && readers.iter().all(|i| reads_packed_in_place(i, s, &known)) {
            let linear = readers
                .iter()
                .any(|i| matches!(i.op, OpKind::Known(Op::Linear | Op::Conv)));
            let p = if linear && p.dtype == DType::F16 {
                let mut half = (*p).clone();
                half.gathers_half = true;
                Arc::new(half)
            } else {
                p
            };
            kept.insert(s, p);
            continue;
        }
        let t = ld.unpack(&p, "a weight read by other ops")?;
        consts.push((s, Arc::new(t)));
    }
    Ok(kept)
}

/// Whether `ins` reads slot `s` only where a packed weight can be read in place. A `gather`'s
/// `axis` and `batch_dims` must be 0, given inline or as constants (`known`: a constant slot's
/// value; coremltools writes them as named `const` ops).
fn reads_packed_in_place(
    ins: &Instr,
    s: usize,
    known: &dyn Fn(usize) -> Option<Arc<Tensor>>,
) -> bool {
    let key = match ins.op {
        OpKind::Known(Op::Linear | Op::Conv) => "weight",
        OpKind::Known(Op::Gather) => "x",
        _ => return false,
    };
    let is_zero = |t: &Tensor| t.as_i64().iter().all(|&v| v == 0);
    let zero = |k: &str| {
        ins.inputs.iter().all(|(n, a)| {
            n != k
                || match a.as_slice() {
                    [Arg::Const(t)] => is_zero(t),
                    [Arg::Slot(c)] => known(*c).is_some_and(|t| is_zero(&t)),
                    _ => false,
                }
        })
    };
    let gather_ok = key != "x" || (zero("axis") && zero("batch_dims"));
    gather_ok
        && ins.inputs.iter().all(|(k, a)| {
            let here = a.iter().any(|b| matches!(b, Arg::Slot(x) if *x == s));
            !here || (k == key && a.len() == 1)
        })
}

/// Free each computed value after its last reader; outputs and constants are kept. A value
/// nobody reads is freed right after the instruction that made it.
fn schedule_frees(
    instrs: &mut [Instr],
    outputs: &[(String, usize)],
    consts: &[(usize, Arc<Tensor>)],
) {
    let mut last: HashMap<usize, usize> = HashMap::new();
    for (i, ins) in instrs.iter().enumerate() {
        for (s, _) in &ins.outputs {
            last.entry(*s).or_insert(i);
        }
        for (_, a) in &ins.inputs {
            for b in a {
                if let Arg::Slot(s) = b {
                    last.insert(*s, i);
                }
            }
        }
    }
    let keep: std::collections::HashSet<usize> = outputs
        .iter()
        .map(|(_, s)| *s)
        .chain(consts.iter().map(|(s, _)| *s))
        .collect();
    for (s, i) in last {
        if !keep.contains(&s) && !instrs[i].frees.contains(&s) {
            instrs[i].frees.push(s);
        }
    }
}

/// The most bytes live at once while the program runs, from the declared types: constants,
/// inputs, and every value from the instruction that makes it to its last use (block
/// outputs to the end).
fn peak_live_bytes(
    inputs: &[(String, usize, TensorTypeInfo)],
    instrs: &[Instr],
    const_bytes: u64,
) -> u64 {
    let mut size: HashMap<usize, u64> = HashMap::new();
    let mut live = inputs.iter().fold(const_bytes, |a, (_, _, t)| {
        a.saturating_add(limits::type_bytes(t))
    });
    let mut peak = live;
    for ins in instrs {
        for (s, ty) in &ins.outputs {
            let b = limits::type_bytes(ty);
            size.insert(*s, b);
            live = live.saturating_add(b);
        }
        peak = peak.max(live);
        for f in &ins.frees {
            live = live.saturating_sub(size.get(f).copied().unwrap_or(0));
        }
    }
    peak
}

/// Run the kernel of one op that is computed per step.
fn run_op(op: Op, args: &Args) -> ops::OpResult<Vec<Tensor>> {
    use Op::*;
    limits::guard(op, args)?;
    let one = |r: ops::OpResult<Tensor>| r.map(|t| vec![t]);
    let x = || args.get("x");
    let y = || args.get("y");
    match op {
        Add | Sub | Mul | RealDiv | Pow | Maximum | Minimum | FloorDiv | Mod => {
            one(x().and_then(|x| ops::binary(op, x, y()?)))
        }
        Less | LessEqual | Greater | GreaterEqual | Equal | NotEqual => {
            one(x().and_then(|x| ops::compare(op, x, y()?)))
        }
        LogicalAnd | LogicalOr | LogicalXor => one(x().and_then(|x| ops::logical(op, x, y()?))),
        Rsqrt | Sqrt | Inverse | Exp | Exp2 | Log | Sin | Cos | Tanh | Sigmoid | Silu | Relu
        | Abs | Square | Floor | Ceil | Round | Sign | Erf | Clip | LogicalNot => {
            one(ops::unary(op, args))
        }
        ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd | ReduceSumSquare => {
            one(ops::reduce(op, args))
        }
        Softmax => one(ops::softmax(args)),
        LayerNorm => one(ops::layer_norm(args)),
        Reshape | ExpandDims | Squeeze | Identity => {
            one(x().and_then(|x| ops::reshaped(x, &args.out(0)?.shape)))
        }
        Transpose => one(ops::transpose(args)),
        Concat => one(ops::concat(args)),
        Split => ops::split(args),
        SliceByIndex => one(ops::slice_by_index(args)),
        SliceBySize => one(ops::slice_by_size(args)),
        Tile => one(ops::tile(args)),
        Gather => one(ops::gather(args)),
        Select => one(ops::select(args)),
        Fill => one(ops::fill(args)),
        BandPart => one(ops::band_part(args)),
        Range1d => one(ops::range_1d(args)),
        Matmul => one(ops::matmul(args)),
        Linear => one(ops::linear(args)),
        Conv => one(ops::conv(args)),
        Cast => one(ops::cast(args)),
        Shape => one(x().map(|x| {
            let s: Vec<i64> = x.shape.iter().map(|&d| d as i64).collect();
            Tensor::new(DType::I32, vec![s.len()], Data::I(s))
        })),
        SliceUpdate => one(state::slice_update(args)),
        Const | ConstexprLutToDense | ConstexprBlockwiseShiftScale => {
            Err(format!("`{op}` is computed when the program loads").into())
        }
        ReadState | WriteState | CoremlUpdateState => {
            Err(format!("`{op}` reads or writes a state: the run loop executes it").into())
        }
    }
}

fn effective_dtype(dtype: DType, options: Options) -> DType {
    if options.compute == Compute::F32 && dtype.is_float() {
        DType::F32
    } else {
        dtype
    }
}

fn conform_const(t: Tensor, options: Options) -> Tensor {
    let d = effective_dtype(t.dtype, options);
    Tensor::new(d, t.shape, t.data)
}

/// Evaluate a `const` or constexpr op. Blob-backed values are decoded once per
/// (file, offset), so a tied embedding shared by gather and lm_head costs one copy.
fn constexpr(
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
                if let Some(t) = ld.const_cache.get(&key) {
                    return Ok(t.clone());
                }
                let t = Tensor::from_const(ld.value(v, "const `val`")?);
                let t = checked_const(t, ty, ld.options)?;
                ld.const_cache.insert(key, t.clone());
                return Ok(t);
            } else {
                Tensor::from_const(ld.value(v, "const `val`")?)
            }
        }
        Op::ConstexprLutToDense | Op::ConstexprBlockwiseShiftScale
            if !op.attributes.contains_key("indices") =>
        {
            constexpr18(ld, op, kind, ty)?
        }
        Op::ConstexprLutToDense => {
            let indices = operand("indices")?;
            let lut = operand("lut")?;
            let shape = operand("shape")?;
            // The dense result is counted with the constants (its operands were, on decoding).
            let total = ld.const_bytes.saturating_add(limits::type_bytes(ty));
            ld.limits
                .check_peak(total)
                .map_err(|msg| ld.limit_err(&op.r#type, msg))?;
            ld.const_bytes = total;
            lut_to_dense(indices, lut, shape, ty)
                .map_err(|e| RuntimeError::Program(e.to_string()))?
        }
        other => {
            return Err(RuntimeError::Program(format!(
                "`{other}` is not a constexpr op"
            )))
        }
    };
    checked_const(t, ty, ld.options)
}

/// An iOS18 constexpr op: operands are inputs, each a value or the name of an earlier
/// constant. The dense result is counted with the constants before it is made.
fn constexpr18(
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
            Some(proto::binding::Binding::Name(n)) => match ld.constants.get(n) {
                Some(t) => Ok(Some(t.clone())),
                None => match ld.packed_names.get(n).cloned() {
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
        let total = ld.const_bytes.saturating_add(limits::type_bytes(ty));
        ld.limits
            .check_peak(total)
            .map_err(|msg| ld.limit_err(&op.r#type, msg))?;
        ld.const_bytes = total;
        constexpr18::lut_to_dense(&indices, &lut, axis, ty)
    } else {
        let (data, scale) = (required("data")?, required("scale")?);
        let offset = operand("offset")?;
        let total = ld.const_bytes.saturating_add(limits::type_bytes(ty));
        ld.limits
            .check_peak(total)
            .map_err(|msg| ld.limit_err(&op.r#type, msg))?;
        ld.const_bytes = total;
        constexpr18::shift_scale(&data, &scale, offset.as_deref(), ty)
    };
    result.map_err(|e| RuntimeError::Program(e.to_string()))
}

/// Constants no instruction reads and no output names (a LUT an iOS18 op consumed at load,
/// the dense weight a scale op was applied to) are not kept.
fn drop_unread_constants(
    consts: &mut Vec<(usize, Arc<Tensor>)>,
    instrs: &[Instr],
    outputs: &[(String, usize)],
) {
    let read: std::collections::HashSet<usize> = instrs
        .iter()
        .flat_map(|i| i.inputs.iter().flat_map(|(_, a)| a.iter()))
        .filter_map(|a| match a {
            Arg::Slot(s) => Some(*s),
            Arg::Const(_) => None,
        })
        .chain(outputs.iter().map(|(_, s)| *s))
        .collect();
    consts.retain(|(s, _)| read.contains(s));
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

/// iOS16/17 `constexpr_lut_to_dense`: one LUT of 2^nbits entries, indices packed LSB-first
/// into uint8.
fn lut_to_dense(
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

/// fp16 `linear` (and `conv`) weights stay fp16 in memory (they are exact there): a decode step is bound by
/// reading the weights, and half the bytes is nearly half the time. Every op reads fp16 data;
/// `linear` and `gather` (a tied embedding shares the lm_head's storage) read it without
/// widening the whole tensor.
fn store_linear_weights_half(consts: &mut [(usize, Arc<Tensor>)], instrs: &[Instr]) {
    let weight_slots: std::collections::HashSet<usize> = instrs
        .iter()
        .filter(|ins| matches!(ins.op, OpKind::Known(Op::Linear | Op::Conv)))
        .flat_map(|ins| ins.inputs.iter().filter(|(k, _)| k == "weight"))
        .flat_map(|(_, a)| a.iter())
        .filter_map(|a| match a {
            Arg::Slot(s) => Some(*s),
            Arg::Const(_) => None,
        })
        .collect();
    // Storage shared between slots (deduplicated blobs) is converted once and stays shared.
    // The map holds the original too, so no address is freed and reused while it is a key.
    let mut converted: HashMap<*const Tensor, (Arc<Tensor>, Arc<Tensor>)> = HashMap::new();
    for (s, t) in consts.iter() {
        if !weight_slots.contains(s) || t.dtype != DType::F16 {
            continue;
        }
        let Data::F(v) = &t.data else { continue };
        converted.entry(Arc::as_ptr(t)).or_insert_with(|| {
            let half = Tensor::new(
                DType::F16,
                t.shape.clone(),
                Data::Half(tensor::f32_to_half(v)),
            );
            (t.clone(), Arc::new(half))
        });
    }
    for (_, t) in consts.iter_mut() {
        if let Some((_, h)) = converted.get(&Arc::as_ptr(t)) {
            *t = h.clone();
        }
    }
}

/// A saved package that follows the contract, ready to step (implements
/// [`crate::runtime::StepModel`]).
#[derive(Debug)]
pub struct Package {
    program: Program,
    contract: Contract,
    description: mlpackage::Description,
    /// A stateful package's cache (`kv_cache = "state"`), kept between steps.
    states: Option<std::sync::Mutex<States>>,
    /// A multifunction package's other functions (`prefill`), each with the contract as it
    /// follows it; `program` and `contract` are the default function's (`decode`).
    others: Vec<Function>,
}

/// One more function of a multifunction package.
#[derive(Debug)]
pub struct Function {
    pub name: String,
    pub program: Program,
    pub contract: Contract,
}

impl Package {
    /// Open the package at `path`, read its contract from the user-defined metadata and
    /// compile its program.
    pub fn load(path: &Path, options: Options) -> Result<Self, RuntimeError> {
        let pkg = MlPackage::open(path)?;
        let description = pkg.description();
        let json = description
            .user_defined
            .get(contract::METADATA_KEY)
            .ok_or_else(|| RuntimeError::Contract {
                path: path.display().to_string(),
                msg: format!(
                    "no `{}` metadata: not an hf2coreml package",
                    contract::METADATA_KEY
                ),
            })?;
        let contract: Contract =
            serde_json::from_str(json).map_err(|e| RuntimeError::Contract {
                path: path.display().to_string(),
                msg: e.to_string(),
            })?;
        let bad = |msg: String| RuntimeError::Contract {
            path: path.display().to_string(),
            msg,
        };
        let program = Program::load(&pkg, options)?;
        check_contract_inputs(&program, &contract).map_err(bad)?;
        let others = load_other_functions(&pkg, &contract, options).map_err(|e| match e {
            RuntimeError::Contract { msg, .. } => bad(msg),
            other => other,
        })?;
        let states = (contract.kv_cache == contract::KvCache::State)
            .then(|| std::sync::Mutex::new(program.new_states()));
        Ok(Package {
            program,
            contract,
            description,
            states,
            others,
        })
    }

    /// Every function: its name, program and the contract as it follows it; the default
    /// function first.
    pub fn functions(&self) -> Vec<(&str, &Program, &Contract)> {
        let default = if self.contract.functions.is_empty() {
            "main"
        } else {
            contract::DECODE
        };
        std::iter::once((default, &self.program, &self.contract))
            .chain(
                self.others
                    .iter()
                    .map(|f| (f.name.as_str(), &f.program, &f.contract)),
            )
            .collect()
    }

    /// The Q of the `prefill` function, if the package has one.
    pub fn prefill_len(&self) -> Option<usize> {
        self.others
            .iter()
            .find(|f| f.name == contract::PREFILL)
            .map(|f| f.contract.query_len)
    }

    /// The function that takes `n` tokens a call, with its contract: how a step picks
    /// `decode` or `prefill` (the inputs it is then given do not matter here).
    fn function_for(&self, n: usize) -> Result<(&Program, &Contract), RuntimeError> {
        if n == self.contract.query_len {
            return Ok((&self.program, &self.contract));
        }
        self.others
            .iter()
            .find(|f| f.contract.query_len == n)
            .map(|f| (&f.program, &f.contract))
            .ok_or_else(|| RuntimeError::Input {
                name: contract::INPUT_IDS.into(),
                msg: format!(
                    "{n} tokens; the package's functions take {}",
                    self.functions()
                        .iter()
                        .map(|(name, _, c)| format!("{} ({name})", c.query_len))
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            })
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    pub fn description(&self) -> &mlpackage::Description {
        &self.description
    }

    /// One step, optionally collecting range statistics.
    pub fn step_with_stats(
        &self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
        stats: Option<&mut Stats>,
    ) -> Result<super::StepOutput, RuntimeError> {
        if let Some(states) = &self.states {
            return self.state_step(states, input_ids, position, stats);
        }
        let (program, c) = self.function_for(input_ids.len())?;
        let cache_shape = vec![c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim];
        let pos = check_step(c, input_ids, position, key_cache, value_cache)?;
        let inputs = vec![
            (
                contract::INPUT_IDS,
                Tensor::i32(vec![1, c.query_len], input_ids),
            ),
            (contract::POSITION, Tensor::i32(vec![1], &[pos])),
            (
                contract::KEY_CACHE,
                Tensor::f16(cache_shape.clone(), key_cache.to_vec()),
            ),
            (
                contract::VALUE_CACHE,
                Tensor::f16(cache_shape, value_cache.to_vec()),
            ),
        ];
        let mut out = program.run(inputs, stats)?;
        let logits = Self::logits(c, &mut out)?;
        let mut take = |name: &str| take_output(&mut out, name);
        let k = take(contract::KEY_UPDATE)?;
        let v = take(contract::VALUE_UPDATE)?;
        let upd = c.num_layers * c.num_kv_heads * c.query_len * c.head_dim;
        if logits.len() != c.query_len * c.vocab_size || k.len() != upd || v.len() != upd {
            return Err(RuntimeError::Contract {
                path: String::new(),
                msg: "output sizes do not match the contract's dimensions".into(),
            });
        }
        Ok(super::StepOutput {
            logits,
            key_update: k.to_f16_vec(),
            value_update: v.to_f16_vec(),
        })
    }
}

fn take_output(out: &mut HashMap<String, Tensor>, name: &str) -> Result<Tensor, RuntimeError> {
    out.remove(name).ok_or_else(|| RuntimeError::Contract {
        path: String::new(),
        msg: format!("the program has no output `{name}`"),
    })
}

/// The step's arguments against the contract: Q tokens, a position that leaves room for them,
/// caches of [L, Hkv, S, D]. Returns the position as the int32 the programs take.
pub(crate) fn check_step(
    c: &Contract,
    input_ids: &[i32],
    position: usize,
    key_cache: &[f16],
    value_cache: &[f16],
) -> Result<i32, RuntimeError> {
    let cache_shape = [c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim];
    let cache_len = cache_shape.iter().product::<usize>();
    if input_ids.len() != c.query_len {
        return Err(RuntimeError::Input {
            name: contract::INPUT_IDS.into(),
            msg: format!(
                "{} tokens, the package takes {}",
                input_ids.len(),
                c.query_len
            ),
        });
    }
    if position + c.query_len > c.max_seq_len {
        return Err(RuntimeError::Input {
            name: contract::POSITION.into(),
            msg: format!(
                "position {position} + {} tokens passes max_seq_len {}",
                c.query_len, c.max_seq_len
            ),
        });
    }
    let io = c.kv_cache == contract::KvCache::Io;
    for (name, cache) in [
        (contract::KEY_CACHE, key_cache),
        (contract::VALUE_CACHE, value_cache),
    ] {
        if io && cache.len() != cache_len {
            return Err(RuntimeError::Input {
                name: name.into(),
                msg: format!(
                    "{} elements, expected {cache_len} ({cache_shape:?})",
                    cache.len()
                ),
            });
        }
    }
    let pos = i32::try_from(position).map_err(|_| RuntimeError::Input {
        name: contract::POSITION.into(),
        msg: format!("{position} does not fit int32"),
    })?;
    Ok(pos)
}

/// A multifunction package's functions besides the default one, each checked against the
/// contract as it follows it. The program's functions must be the contract's: the default
/// (`decode`) and the others, no more, no fewer.
fn load_other_functions(
    pkg: &MlPackage,
    c: &Contract,
    options: Options,
) -> Result<Vec<Function>, RuntimeError> {
    let bad = |msg: String| RuntimeError::Contract {
        path: String::new(),
        msg,
    };
    let declared: Vec<&str> = pkg.function_names()?;
    let mut listed = c.function_names();
    listed.sort_unstable();
    if declared != listed {
        return Err(bad(format!(
            "the contract lists the functions {listed:?}, the program has {declared:?}"
        )));
    }
    if c.functions.is_empty() {
        return Ok(Vec::new());
    }
    let default = pkg.main_function()?.name;
    if default != contract::DECODE
        || c.for_function(contract::DECODE).as_ref()
            != Some(&Contract {
                functions: Vec::new(),
                ..c.clone()
            })
    {
        return Err(bad(format!(
            "the default function is `{default}` and the contract's own Q and I/O must be \
             `{}`'s",
            contract::DECODE
        )));
    }
    let mut out = Vec::new();
    for f in c.functions.iter().filter(|f| f.name != contract::DECODE) {
        let program = Program::load_function(pkg, &f.name, options)?;
        let view = c.for_function(&f.name).expect("listed");
        check_contract_inputs(&program, &view)
            .map_err(|msg| bad(format!("function `{}`: {msg}", f.name)))?;
        out.push(Function {
            name: f.name.clone(),
            program,
            contract: view,
        });
    }
    Ok(out)
}

/// The contract's dimensions must be the ones the program declares for its inputs (which the
/// loader bounded): the runner sizes its caches from the contract, so a contract that claims
/// more than the program takes would otherwise allocate it.
fn check_contract_inputs(program: &Program, c: &Contract) -> Result<(), String> {
    let (inputs, _, states) = c.expected_io("");
    let declared = [("input", &program.inputs), ("state", &program.states)];
    for (want, (kind, have)) in inputs
        .into_iter()
        .map(|w| (w, declared[0]))
        .chain(states.into_iter().map(|w| (w, declared[1])))
    {
        let (_, _, ty) = have
            .iter()
            .find(|(n, _, _)| *n == want.name)
            .ok_or_else(|| format!("the program has no {kind} `{}`", want.name))?;
        if ty.shape != want.shape {
            return Err(format!(
                "the contract's dimensions give input `{}` the shape {:?}, the program declares \
                 {:?}",
                want.name, want.shape, ty.shape
            ));
        }
    }
    Ok(())
}

/// The logits parts ([1, Q, width] each) joined along the vocabulary: [Q, V] row-major. A part
/// of the wrong size leaves the result short, which the caller's size check reports.
pub(crate) fn concat_rows(parts: &[(Tensor, usize)], q: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(q * parts.iter().map(|(_, w)| w).sum::<usize>());
    let parts: Vec<_> = parts.iter().map(|(t, w)| (t.as_f32(), *w)).collect();
    if parts.iter().any(|(t, w)| t.len() != q * w) {
        return out;
    }
    for row in 0..q {
        for (t, w) in &parts {
            out.extend_from_slice(&t[row * w..(row + 1) * w]);
        }
    }
    out
}

impl super::StepModel for Package {
    fn contract(&self) -> &Contract {
        &self.contract
    }

    fn prefill_len(&self) -> Option<usize> {
        Package::prefill_len(self)
    }

    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<super::StepOutput, RuntimeError> {
        self.step_with_stats(input_ids, position, key_cache, value_cache, None)
    }

    fn state_rows(&self, rows: usize) -> Result<(Vec<f16>, Vec<f16>), RuntimeError> {
        self.read_state_rows(rows)
    }

    fn restore_state_rows(
        &mut self,
        rows: usize,
        keys: &[f16],
        values: &[f16],
    ) -> Result<(), RuntimeError> {
        self.write_state_rows(rows, keys, values)
    }
}

/// A program's constant, read a range of elements at a time ([`Program::constant_reader`]).
pub enum ConstantReader<'a> {
    /// Held decoded by the program (borrowed when it holds f32).
    Held(Cow<'a, [f32]>),
    /// Left in its weight file.
    Packed(&'a packed::Packed),
}

impl ConstantReader<'_> {
    /// Elements in all.
    pub fn numel(&self) -> usize {
        match self {
            ConstantReader::Held(v) => v.len(),
            ConstantReader::Packed(p) => p.rows() * p.cols(),
        }
    }

    /// Elements `at..at + len` into `out` (cleared first), as [`Program::constant`] gives them.
    pub fn read(&self, at: usize, len: usize, out: &mut Vec<f32>) -> Result<(), RuntimeError> {
        let bad = |msg: String| RuntimeError::Program(format!("reading a constant: {msg}"));
        match self {
            ConstantReader::Held(v) => {
                let piece = at
                    .checked_add(len)
                    .and_then(|end| v.get(at..end))
                    .ok_or_else(|| bad(format!("elements {at}..+{len} of {}", v.len())))?;
                out.clear();
                out.extend_from_slice(piece);
                Ok(())
            }
            ConstantReader::Packed(p) => p.read_range(at, len, out).map_err(|e| bad(e.to_string())),
        }
    }
}
