//! Running a compiled [`Program`]: inputs checked against their declarations, one instruction
//! after another, each result checked against its declared shape and rounded to its declared
//! dtype, values freed after their last reader.

use std::collections::HashMap;
use std::sync::Arc;

use super::ops::{self, Args};
use super::program::{Arg, Instr, OpKind, CONSTEXPR, LAYOUT_OPS, RESHAPE_OPS};
use super::{effective_dtype, limits, packed, state, tensor};
use super::{Data, Program, RuntimeError, States, Stats, Tensor};
use crate::mil::{DType, Op};
use crate::mlpackage::TensorTypeInfo;

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

    pub(super) fn conform(&self, t: Tensor, dtype: DType) -> Tensor {
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
pub(super) fn arguments<'e>(
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
