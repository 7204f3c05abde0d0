//! A compiled function ([`Program`]) and everything done with it.
//!
//! Compiling: names become slots, each operation a constant (decoded or left packed, see
//! [`translate`]) or an instruction, the weights that stay packed are settled ([`weights`]),
//! and every instruction records which values die after it ([`liveness`]). Running: inputs
//! checked against their declarations, one instruction after another through the kernels of
//! `exec` ([`dispatch::run_op`]), each result checked against its declared shape and rounded to
//! its declared dtype, values freed after their last reader; a state's value lives in its slot
//! while a call runs (`read_state` shares it, `write_state` replaces it). What a compiled
//! program exposes besides running it: its declared inputs, states and outputs, its constants
//! by name, and its compiled form as it runs ([`ProgramView`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use super::consts::ConstantReader;
use super::instr::{Arg, Instr, OpKind, CONSTEXPR, LAYOUT_OPS, RESHAPE_OPS};
use super::loader::Loader;
use super::surface::{effective_dtype, Options, RuntimeError, Stats};
use super::view::ProgramView;
use super::{liveness, translate, weights};
use crate::exec::dispatch;
use crate::exec::limits::Limits;
use crate::exec::ops::Args;
use crate::exec::packed;
use crate::exec::states::{update_window, States};
use crate::exec::tensor::{self, Tensor};
use crate::mil::{DType, Op};
use crate::mlpackage::{self, proto, MlPackage, TensorTypeInfo};

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
    pub(crate) inputs: Vec<(String, usize, TensorTypeInfo)>,
    /// Core ML states (iOS18): name, slot, the wrapped tensor type.
    pub(crate) states: Vec<(String, usize, TensorTypeInfo)>,
    instrs: Vec<Instr>,
    outputs: Vec<(String, usize)>,
    opset: String,
    limits: Limits,
}

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
        let mut ld = Loader::new(pkg, options, limits);
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
            if let Some(c) = translate::operation(&mut ld, op, &mut instrs)? {
                consts.push(c);
            }
        }
        let mut outputs = Vec::new();
        for name in &main.block.outputs {
            let s = *ld.slots().get(name).ok_or_else(|| {
                RuntimeError::Program(format!("block output `{name}` is never defined"))
            })?;
            outputs.push((name.clone(), s));
        }
        let n_slots = ld.slots().len();
        let packed = weights::settle_packed(&mut ld, &instrs, &outputs, &mut consts)?;
        let const_bytes = ld.const_bytes();
        weights::drop_unread_constants(&mut consts, &instrs, &outputs);
        // States stay live across the whole call, like the outputs.
        let kept: Vec<(String, usize)> = outputs
            .iter()
            .cloned()
            .chain(states.iter().map(|(n, s, _)| (n.clone(), *s)))
            .collect();
        liveness::schedule_frees(&mut instrs, &kept, &consts);
        let state_slots: Vec<usize> = states.iter().map(|(_, s, _)| *s).collect();
        liveness::in_place_updates(&mut instrs, &state_slots);
        let live_in: Vec<_> = inputs.iter().chain(&states).cloned().collect();
        let peak = liveness::peak_live_bytes(&live_in, &instrs, const_bytes);
        limits.check_peak(peak).map_err(|msg| RuntimeError::Limit {
            what: format!("{}", pkg.model_path().display()),
            msg,
        })?;
        weights::store_linear_weights_half(&mut consts, &instrs);
        let kept: std::collections::HashSet<usize> = consts
            .iter()
            .map(|(s, _)| *s)
            .chain(packed.keys().copied())
            .collect();
        let const_names = ld
            .slots()
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

    /// The compiled form as it runs ([`ProgramView`]).
    pub fn view(&self) -> ProgramView<'_> {
        ProgramView {
            inputs: &self.inputs,
            states: &self.states,
            instrs: &self.instrs,
            outputs: &self.outputs,
            consts: &self.consts,
            packed: &self.packed,
            const_names: &self.const_names,
        }
    }
}

/// What [`Program::run_traced`] hands every value to.
pub type Tracer<'a> = dyn FnMut(&str, &Tensor) + 'a;

impl Program {
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
        let result = self.run_env(inputs, &mut env, stats, None);
        for (v, (_, s, _)) in states.values.iter_mut().zip(&self.states) {
            *v = env[*s].take();
        }
        if result.is_err() {
            states.refill(effective_dtype(DType::F16, self.options));
        }
        result
    }

    /// Run once on fresh states, handing every value an op produces to `trace` (its name and
    /// the value as the next op reads it) before the program moves on.
    pub fn run_traced(
        &self,
        inputs: Vec<(&str, Tensor)>,
        trace: &mut Tracer<'_>,
    ) -> Result<HashMap<String, Tensor>, RuntimeError> {
        let mut states = self.new_states();
        let mut env: Vec<Option<Arc<Tensor>>> = vec![None; self.n_slots];
        for (v, (_, s, _)) in states.values.iter_mut().zip(&self.states) {
            env[*s] = v.take();
        }
        self.run_env(inputs, &mut env, None, Some(trace))
    }

    fn run_env(
        &self,
        inputs: Vec<(&str, Tensor)>,
        env: &mut [Option<Arc<Tensor>>],
        mut stats: Option<&mut Stats>,
        mut trace: Option<&mut Tracer<'_>>,
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
                if let Some(f) = trace.as_deref_mut() {
                    f(name, &t);
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
        let res = dispatch::run_op(op, &args).map_err(|e| RuntimeError::Op {
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

impl Program {
    /// Execute `ins` if it reads or writes a state; `false` for any other op.
    fn state_op(&self, ins: &Instr, env: &mut [Option<Arc<Tensor>>]) -> Result<bool, RuntimeError> {
        let (state_key, data_key) = match ins.op {
            OpKind::Known(Op::ReadState) => ("input", None),
            OpKind::Known(Op::WriteState) => ("input", Some("data")),
            OpKind::Known(Op::CoremlUpdateState) => ("state", Some("value")),
            _ => return Ok(false),
        };
        let err = |msg: String| RuntimeError::Op {
            op_type: ins.op.name().to_string(),
            output: ins.out_names.first().cloned().unwrap_or_default(),
            msg,
        };
        let arg = |key: &str| ins.inputs.iter().find(|(k, _)| k == key).map(|(_, a)| a);
        let state = match arg(state_key).map(|a| a.as_slice()) {
            Some([Arg::Slot(s)]) => *s,
            _ => return Err(err(format!("`{state_key}` must name one state"))),
        };
        let (_, _, ty) = self
            .states
            .iter()
            .find(|(_, s, _)| *s == state)
            .ok_or_else(|| err(format!("`{state_key}` is not a state of the function")))?;
        let value = match data_key {
            None => env[state]
                .clone()
                .ok_or_else(|| err("the state has no value".into()))?,
            Some(key) => {
                let v = match arg(key).map(|a| a.as_slice()) {
                    Some([Arg::Slot(s)]) => env[*s].clone(),
                    Some([Arg::Const(t)]) => Some(t.clone()),
                    _ => None,
                }
                .ok_or_else(|| err(format!("`{key}` has no value")))?;
                if v.shape != ty.shape || v.dtype.is_float() != ty.dtype.is_float() {
                    return Err(err(format!(
                        "writes {} {:?} into a state of {} {:?}",
                        v.dtype.name(),
                        v.shape,
                        ty.dtype.name(),
                        ty.shape
                    )));
                }
                let v = if v.dtype == effective_dtype(ty.dtype, self.options) {
                    v
                } else {
                    Arc::new(self.conform((*v).clone(), ty.dtype))
                };
                env[state] = Some(v.clone());
                v
            }
        };
        if let Some((slot, out_ty)) = ins.outputs.first() {
            if value.shape != out_ty.shape {
                return Err(err(format!(
                    "the state is {:?}, the program declares {:?}",
                    value.shape, out_ty.shape
                )));
            }
            env[*slot] = Some(value);
        }
        Ok(true)
    }

    /// A `slice_update` marked by [`in_place_updates`](liveness::in_place_updates) whose `x`
    /// dies here and shares its storage with nothing but the state: the window is written into
    /// that storage.
    fn update_in_place(
        &self,
        ins: &Instr,
        env: &mut [Option<Arc<Tensor>>],
    ) -> Result<Option<Tensor>, RuntimeError> {
        let Some(state) = ins.in_place else {
            return Ok(None);
        };
        let x = match ins
            .inputs
            .iter()
            .find(|(k, _)| k == "x")
            .map(|(_, a)| a.as_slice())
        {
            Some([Arg::Slot(s)]) if ins.frees.contains(s) => *s,
            _ => return Ok(None),
        };
        let Some(xa) = env[x].take() else {
            return Ok(None);
        };
        let held = env[state].take_if(|s| Arc::ptr_eq(s, &xa));
        let mut t = match Arc::try_unwrap(xa) {
            Ok(t) => t,
            Err(xa) => {
                env[state] = env[state].take().or(held);
                env[x] = Some(xa);
                return Ok(None);
            }
        };
        let map = arguments(ins, env, Some("x"))?;
        let types: Vec<TensorTypeInfo> = ins.outputs.iter().map(|(_, t)| t.clone()).collect();
        let args = Args {
            map,
            outputs: &types,
        };
        update_window(&mut t, &args).map_err(|e| RuntimeError::Op {
            op_type: ins.op.name().to_string(),
            output: ins.out_names.first().cloned().unwrap_or_default(),
            msg: e.to_string(),
        })?;
        Ok(Some(t))
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
