//! Core ML states (iOS18): `read_state`, `write_state` (coremltools' `coreml_update_state`)
//! and `slice_update`, and the values a stateful program keeps between calls ([`States`]).
//!
//! A state's value lives in its input slot while a call runs: `read_state` shares it (no
//! copy), `write_state` replaces it. `slice_update` copies `x` with a window replaced, except
//! where the program reads a state, updates a window of what it read and writes the result
//! back before anything else reads that state: then the update is made in place in the state's
//! own storage ([`in_place_updates`]), which is what makes a stateful decode step cheaper than
//! passing the cache in and out.

use std::sync::Arc;

use super::ops::{self, Args, OpResult, Window};
use super::program::Instr;
use super::tensor::{Data, Tensor};
use crate::mil::DType;
use crate::mlpackage::TensorTypeInfo;

/// The values of a program's states, in declaration order, kept between calls (Core ML's
/// `MLState`). New states are zero, as `model.makeState()` makes them.
#[derive(Debug, Clone)]
pub struct States {
    pub(super) names: Vec<String>,
    pub(super) values: Vec<Option<Arc<Tensor>>>,
    pub(super) types: Vec<TensorTypeInfo>,
}

impl States {
    /// Zero-filled states of these declared types (each was checked against the interpreter's
    /// limits when the program loaded).
    pub(super) fn zeros(decl: &[(String, usize, TensorTypeInfo)], float: DType) -> Self {
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
    pub(super) fn refill(&mut self, float: DType) {
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

/// Mark each `slice_update` that may write into a state's storage: its `x` is the value a
/// `read_state` of state S returned, and the first instruction after it that names S writes
/// this update's result into S. Nothing can then observe S's old value after the update (the
/// run checks at the time that no other value shares the storage).
pub(super) fn in_place_updates(instrs: &mut [Instr], state_slots: &[usize]) {
    use super::program::{Arg, OpKind};
    use crate::mil::Op;
    let slot_of = |ins: &Instr, key: &str| -> Option<usize> {
        match ins.inputs.iter().find(|(k, _)| k == key)?.1.as_slice() {
            [Arg::Slot(s)] => Some(*s),
            _ => None,
        }
    };
    let names = |ins: &Instr, s: usize| {
        ins.inputs
            .iter()
            .any(|(_, a)| a.iter().any(|b| matches!(b, Arg::Slot(x) if *x == s)))
    };
    for i in 0..instrs.len() {
        if instrs[i].op != OpKind::Known(Op::SliceUpdate) {
            continue;
        }
        let (Some(x), Some(&(out, _))) = (slot_of(&instrs[i], "x"), instrs[i].outputs.first())
        else {
            continue;
        };
        let Some(state) = instrs[..i].iter().find_map(|p| {
            let reads = p.op == OpKind::Known(Op::ReadState);
            let made_x = p.outputs.first().is_some_and(|(s, _)| *s == x);
            (reads && made_x)
                .then(|| slot_of(p, "input"))
                .flatten()
                .filter(|s| state_slots.contains(s))
        }) else {
            continue;
        };
        let next = instrs[i + 1..].iter().find(|n| names(n, state));
        let writes_back = next.is_some_and(|n| match &n.op {
            OpKind::Known(Op::WriteState) => {
                slot_of(n, "input") == Some(state) && slot_of(n, "data") == Some(out)
            }
            OpKind::Known(Op::CoremlUpdateState) => {
                slot_of(n, "state") == Some(state) && slot_of(n, "value") == Some(out)
            }
            _ => false,
        });
        if writes_back {
            instrs[i].in_place = Some(state);
        }
    }
}

impl super::Program {
    /// Execute `ins` if it reads or writes a state; `false` for any other op.
    pub(super) fn state_op(
        &self,
        ins: &Instr,
        env: &mut [Option<Arc<Tensor>>],
    ) -> Result<bool, super::RuntimeError> {
        use super::program::{Arg, OpKind};
        use crate::mil::Op;
        let (state_key, data_key) = match ins.op {
            OpKind::Known(Op::ReadState) => ("input", None),
            OpKind::Known(Op::WriteState) => ("input", Some("data")),
            OpKind::Known(Op::CoremlUpdateState) => ("state", Some("value")),
            _ => return Ok(false),
        };
        let err = |msg: String| super::RuntimeError::Op {
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
                let v = if v.dtype == super::effective_dtype(ty.dtype, self.options) {
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

    /// A `slice_update` marked by [`in_place_updates`] whose `x` dies here and shares its
    /// storage with nothing but the state: the window is written into that storage.
    pub(super) fn update_in_place(
        &self,
        ins: &Instr,
        env: &mut [Option<Arc<Tensor>>],
    ) -> Result<Option<Tensor>, super::RuntimeError> {
        use super::program::Arg;
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
        let map = super::run::arguments(ins, env, Some("x"))?;
        let types: Vec<TensorTypeInfo> = ins.outputs.iter().map(|(_, t)| t.clone()).collect();
        let args = Args {
            map,
            outputs: &types,
        };
        update_window(&mut t, &args).map_err(|e| super::RuntimeError::Op {
            op_type: ins.op.name().to_string(),
            output: ins.out_names.first().cloned().unwrap_or_default(),
            msg: e.to_string(),
        })?;
        Ok(Some(t))
    }
}

impl super::Package {
    /// The logits parts of a step's outputs joined: [rows, V], rows being Q, or 1 for a
    /// prefill function that returns the last position's only.
    pub(super) fn logits(
        c: &crate::mil::contract::Contract,
        out: &mut std::collections::HashMap<String, Tensor>,
    ) -> Result<Vec<f32>, super::RuntimeError> {
        let parts = c
            .logits_outputs()
            .into_iter()
            .map(|(name, width)| super::package::take_output(out, &name).map(|t| (t, width)))
            .collect::<Result<Vec<_>, _>>()?;
        let rows = c.logits_rows();
        let logits = super::package::concat_rows(&parts, rows);
        if logits.len() != rows * c.vocab_size {
            return Err(super::RuntimeError::Contract {
                path: String::new(),
                msg: "output sizes do not match the contract's dimensions".into(),
            });
        }
        Ok(logits)
    }

    /// One step of a stateful package: `input_ids` and `position` in, the logits out; the
    /// program writes the new rows into its state. No update rows are returned.
    pub(super) fn state_step(
        &self,
        states: &std::sync::Mutex<States>,
        (input_ids, valid): (&[i32], Option<usize>),
        position: usize,
        stats: Option<&mut super::Stats>,
    ) -> Result<crate::runtime::StepOutput, super::RuntimeError> {
        use crate::mil::contract;
        // Every function of a multifunction package reads and writes the same state.
        let (program, c) = self.function_for(input_ids.len())?;
        let pos = super::package::check_step(c, input_ids, position, &[], &[], valid)?;
        let mut inputs = vec![
            (
                contract::INPUT_IDS,
                Tensor::i32(vec![1, c.query_len], input_ids),
            ),
            (contract::POSITION, Tensor::i32(vec![1], &[pos])),
        ];
        inputs.extend(self.per_layer_input(input_ids)?);
        // A hybrid package keeps its recurrent state in its own states; a chunk says how many
        // of its tokens are real (`check_step` bounded it by Q).
        if c.recurrent.is_some() && c.query_len > 1 {
            let valid = valid.unwrap_or(input_ids.len()) as i32;
            inputs.push((contract::VALID_LEN, Tensor::i32(vec![1], &[valid])));
        }
        let mut guard = states.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = program.run_with_states(inputs, &mut guard, stats)?;
        Ok(crate::runtime::StepOutput {
            logits: Self::logits(c, &mut out)?,
            key_update: Vec::new(),
            value_update: Vec::new(),
            recurrent: Vec::new(),
        })
    }

    /// Rows `[0, rows)` of the state's keys and values: [L, Hkv, rows, D] each.
    pub(super) fn read_state_rows(
        &self,
        rows: usize,
    ) -> Result<(Vec<half::f16>, Vec<half::f16>), super::RuntimeError> {
        let (states, [l, hkv, s, d]) = self.kv_state(rows)?;
        let guard = states.lock().unwrap_or_else(|p| p.into_inner());
        let t = guard
            .get(crate::mil::contract::KV_STATE)
            .ok_or_else(no_state)?;
        let all = t.to_f16_vec();
        let mut out = [Vec::new(), Vec::new()];
        for (half, dst) in out.iter_mut().enumerate() {
            dst.reserve(l * hkv * rows * d);
            for lh in 0..l * hkv {
                let at = (half * l * hkv + lh) * s * d;
                dst.extend_from_slice(&all[at..at + rows * d]);
            }
        }
        let [k, v] = out;
        Ok((k, v))
    }

    /// Write [L, Hkv, rows, D] keys and values into the state's first rows.
    pub(super) fn write_state_rows(
        &self,
        rows: usize,
        keys: &[half::f16],
        values: &[half::f16],
    ) -> Result<(), super::RuntimeError> {
        let (states, [l, hkv, s, d]) = self.kv_state(rows)?;
        let want = l * hkv * rows * d;
        if keys.len() != want || values.len() != want {
            return Err(super::RuntimeError::Input {
                name: crate::mil::contract::KV_STATE.into(),
                msg: format!(
                    "{} key and {} value values for {rows} rows of {want}",
                    keys.len(),
                    values.len()
                ),
            });
        }
        let mut guard = states.lock().unwrap_or_else(|p| p.into_inner());
        let t = guard
            .get_mut(crate::mil::contract::KV_STATE)
            .ok_or_else(no_state)?;
        let block = rows * d;
        for (half, src) in [keys, values].into_iter().enumerate() {
            for lh in 0..l * hkv {
                let at = (half * l * hkv + lh) * s * d;
                let from = &src[lh * block..(lh + 1) * block];
                match &mut t.data {
                    Data::Half(dst) => dst[at..at + block].copy_from_slice(from),
                    Data::F(dst) => {
                        for (o, i) in dst[at..at + block].iter_mut().zip(from) {
                            *o = i.to_f32();
                        }
                    }
                    _ => return Err(no_state()),
                }
            }
        }
        Ok(())
    }

    /// A hybrid package's recurrent states (each of [`Recurrent::tensors`], in order), as one
    /// list of values.
    ///
    /// [`Recurrent::tensors`]: crate::mil::contract::Recurrent::tensors
    pub(super) fn read_recurrent_states(&self) -> Result<Vec<half::f16>, super::RuntimeError> {
        let states = self.states.as_ref().ok_or_else(no_state)?;
        let guard = states.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for t in self.recurrent_tensors()? {
            let held = guard.get(t.input).ok_or_else(|| no_recurrent(t.input))?;
            if held.shape.iter().product::<usize>() != t.len() {
                return Err(no_recurrent(t.input));
            }
            out.extend(held.to_f16_vec());
        }
        Ok(out)
    }

    /// Put `values` (as [`read_recurrent_states`](Self::read_recurrent_states) returned
    /// them) back into the recurrent states.
    pub(super) fn write_recurrent_states(
        &self,
        values: &[half::f16],
    ) -> Result<(), super::RuntimeError> {
        let tensors = self.recurrent_tensors()?;
        let want: usize = tensors.iter().map(|t| t.len()).sum();
        if values.len() != want {
            return Err(super::RuntimeError::Input {
                name: "recurrent state".into(),
                msg: format!("{} values for a state of {want}", values.len()),
            });
        }
        let states = self.states.as_ref().ok_or_else(no_state)?;
        let mut guard = states.lock().unwrap_or_else(|p| p.into_inner());
        let mut at = 0;
        for t in tensors {
            let held = guard
                .get_mut(t.input)
                .ok_or_else(|| no_recurrent(t.input))?;
            let from = &values[at..at + t.len()];
            at += t.len();
            match &mut held.data {
                Data::Half(dst) if dst.len() == from.len() => dst.copy_from_slice(from),
                Data::F(dst) if dst.len() == from.len() => {
                    for (o, i) in dst.iter_mut().zip(from) {
                        *o = i.to_f32();
                    }
                }
                _ => return Err(no_recurrent(t.input)),
            }
        }
        Ok(())
    }

    fn recurrent_tensors(
        &self,
    ) -> Result<Vec<crate::mil::contract::StateTensor>, super::RuntimeError> {
        self.contract
            .recurrent
            .as_ref()
            .map(|r| r.tensors())
            .ok_or_else(|| {
                super::RuntimeError::Program("the package has no recurrent state".into())
            })
    }

    /// The state holder and the state's [L, Hkv, S', D] (per half), with `rows` within S.
    fn kv_state(
        &self,
        rows: usize,
    ) -> Result<(&std::sync::Mutex<States>, [usize; 4]), super::RuntimeError> {
        let c = &self.contract;
        let states = self.states.as_ref().ok_or_else(no_state)?;
        let shape = crate::mil::contract::kv_state_shape(
            c.max_seq_len,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
        );
        if rows > c.max_seq_len {
            return Err(super::RuntimeError::Input {
                name: crate::mil::contract::KV_STATE.into(),
                msg: format!("{rows} rows of a {}-row cache", c.max_seq_len),
            });
        }
        Ok((states, [c.num_layers, c.num_kv_heads, shape[2], c.head_dim]))
    }
}

fn no_recurrent(name: &str) -> super::RuntimeError {
    super::RuntimeError::Program(format!(
        "the package holds no `{name}` state of its contract's shape"
    ))
}

fn no_state() -> super::RuntimeError {
    super::RuntimeError::Program("the package holds no `kv_cache` state".into())
}
