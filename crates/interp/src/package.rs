//! A saved package that follows the contract ([`Package`]): its contract read from the metadata
//! and checked against the program's inputs, a multifunction package's functions (`decode` and
//! `prefill`, one picked per call by the number of tokens), a step's arguments checked before
//! it runs, and a stateful package's step, whose cache stays in the program's states between
//! steps (its rows read and written for the KV-cache file).

use std::collections::HashMap;
use std::path::Path;

use half::f16;

use super::compile::{Options, Program, RuntimeError, Stats};
use super::exec::bulk;
use super::exec::states::States;
use super::exec::tensor::{Data, Tensor};
use crate::mil::contract::{self, Contract};
use crate::mlpackage::{self, MlPackage};
use crate::per_layer_table::PerLayerRows;
use crate::step::{StepModel, StepOutput};

/// A saved package that follows the contract, ready to step (implements
/// [`crate::StepModel`]).
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
    /// Gemma 4's per-layer table beside the package, if the contract declares one.
    per_layer: Option<PerLayerRows>,
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
        if let Some(r) = &contract.recurrent {
            r.check(contract.num_layers).map_err(bad)?;
        }
        let program = Program::load(&pkg, options)?;
        check_contract_inputs(&program, &contract).map_err(bad)?;
        let others = load_other_functions(&pkg, &contract, options).map_err(|e| match e {
            RuntimeError::Contract { msg, .. } => bad(msg),
            other => other,
        })?;
        let states = (contract.kv_cache == contract::KvCache::State)
            .then(|| std::sync::Mutex::new(program.new_states()));
        let per_layer = PerLayerRows::open(path, &contract)?;
        Ok(Package {
            program,
            contract,
            description,
            states,
            others,
            per_layer,
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

    /// Whether the `prefill` function returns the last position's logits only.
    pub fn prefill_last_row_only(&self) -> bool {
        self.others
            .iter()
            .find(|f| f.name == contract::PREFILL)
            .is_some_and(|f| f.contract.logits_rows() == 1 && f.contract.query_len > 1)
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

    /// Gemma 4's per-layer table beside the package, if the contract declares one.
    pub fn per_layer_table(&self) -> Option<&PerLayerRows> {
        self.per_layer.as_ref()
    }

    /// The [`contract::PER_LAYER_ROWS`] input of a step of `input_ids`, for a package with a
    /// per-layer table.
    fn per_layer_input(
        &self,
        input_ids: &[i32],
    ) -> Result<Option<(&'static str, Tensor)>, RuntimeError> {
        let Some(t) = &self.per_layer else {
            return Ok(None);
        };
        let shape = vec![1, input_ids.len(), t.row_len()];
        let rows = Tensor::f16(shape, t.gather(input_ids)?);
        Ok(Some((contract::PER_LAYER_ROWS, rows)))
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
    ) -> Result<StepOutput, RuntimeError> {
        self.step_full(input_ids, position, (key_cache, value_cache), None, stats)
    }

    /// One step of any package: `recurrent` is a hybrid package's (valid tokens, state in),
    /// as [`StepModel::step_recurrent`] takes them; optionally collecting range statistics.
    pub fn step_full(
        &self,
        input_ids: &[i32],
        position: usize,
        (key_cache, value_cache): (&[f16], &[f16]),
        recurrent: Option<(usize, &[f16])>,
        stats: Option<&mut Stats>,
    ) -> Result<StepOutput, RuntimeError> {
        if let Some(states) = &self.states {
            let valid = recurrent.map(|(v, _)| v);
            return self.state_step(states, (input_ids, valid), position, stats);
        }
        let (program, c) = self.function_for(input_ids.len())?;
        let cache_shape = vec![c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim];
        let valid = recurrent.map(|(v, _)| v);
        let pos = check_step(c, input_ids, position, key_cache, value_cache, valid)?;
        let mut inputs = vec![
            (
                contract::INPUT_IDS,
                Tensor::i32(vec![1, c.query_len], input_ids),
            ),
            (contract::POSITION, Tensor::i32(vec![1], &[pos])),
            (
                contract::KEY_CACHE,
                Tensor::f16(cache_shape.clone(), bulk::copied(key_cache)),
            ),
            (
                contract::VALUE_CACHE,
                Tensor::f16(cache_shape, bulk::copied(value_cache)),
            ),
        ];
        inputs.extend(self.per_layer_input(input_ids)?);
        let tensors = state_tensors(c, recurrent)?;
        if !tensors.is_empty() {
            let (valid, state) = recurrent.unwrap_or((0, &[]));
            if c.query_len > 1 {
                // `check_step` bounded it by Q.
                inputs.push((contract::VALID_LEN, Tensor::i32(vec![1], &[valid as i32])));
            }
            for (t, part) in split_state(&tensors, state) {
                inputs.push((t.input, Tensor::f16(t.shape.clone(), part.to_vec())));
            }
        }
        let mut out = program.run(inputs, stats)?;
        let logits = Self::logits(c, &mut out)?;
        let mut take = |name: &str| take_output(&mut out, name);
        let k = take(contract::KEY_UPDATE)?;
        let v = take(contract::VALUE_UPDATE)?;
        let mut state = Vec::with_capacity(c.recurrent_len());
        for t in &tensors {
            state.extend(take(t.output)?.to_f16_vec());
        }
        let upd = c.num_layers * c.num_kv_heads * c.query_len * c.head_dim;
        if k.len() != upd || v.len() != upd || state.len() != c.recurrent_len() {
            return Err(RuntimeError::Contract {
                path: String::new(),
                msg: "output sizes do not match the contract's dimensions".into(),
            });
        }
        Ok(StepOutput {
            logits,
            key_update: k.to_f16_vec(),
            value_update: v.to_f16_vec(),
            recurrent: state,
        })
    }
}

impl Package {
    /// The logits parts of a step's outputs joined: [rows, V], rows being Q, or 1 for a
    /// prefill function that returns the last position's only.
    fn logits(c: &Contract, out: &mut HashMap<String, Tensor>) -> Result<Vec<f32>, RuntimeError> {
        let parts = c
            .logits_outputs()
            .into_iter()
            .map(|(name, width)| take_output(out, &name).map(|t| (t, width)))
            .collect::<Result<Vec<_>, _>>()?;
        let rows = c.logits_rows();
        let logits = concat_rows(&parts, rows);
        if logits.len() != rows * c.vocab_size {
            return Err(RuntimeError::Contract {
                path: String::new(),
                msg: "output sizes do not match the contract's dimensions".into(),
            });
        }
        Ok(logits)
    }

    /// One step of a stateful package: `input_ids` and `position` in, the logits out; the
    /// program writes the new rows into its state. No update rows are returned.
    fn state_step(
        &self,
        states: &std::sync::Mutex<States>,
        (input_ids, valid): (&[i32], Option<usize>),
        position: usize,
        stats: Option<&mut Stats>,
    ) -> Result<StepOutput, RuntimeError> {
        // Every function of a multifunction package reads and writes the same state.
        let (program, c) = self.function_for(input_ids.len())?;
        let pos = check_step(c, input_ids, position, &[], &[], valid)?;
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
        Ok(StepOutput {
            logits: Self::logits(c, &mut out)?,
            key_update: Vec::new(),
            value_update: Vec::new(),
            recurrent: Vec::new(),
        })
    }

    /// Rows `[0, rows)` of the state's keys and values: [L, Hkv, rows, D] each.
    fn read_state_rows(&self, rows: usize) -> Result<(Vec<f16>, Vec<f16>), RuntimeError> {
        let (states, [l, hkv, s, d]) = self.kv_state(rows)?;
        let guard = states.lock().unwrap_or_else(|p| p.into_inner());
        let t = guard.get(contract::KV_STATE).ok_or_else(no_state)?;
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
    fn write_state_rows(
        &self,
        rows: usize,
        keys: &[f16],
        values: &[f16],
    ) -> Result<(), RuntimeError> {
        let (states, [l, hkv, s, d]) = self.kv_state(rows)?;
        let want = l * hkv * rows * d;
        if keys.len() != want || values.len() != want {
            return Err(RuntimeError::Input {
                name: contract::KV_STATE.into(),
                msg: format!(
                    "{} key and {} value values for {rows} rows of {want}",
                    keys.len(),
                    values.len()
                ),
            });
        }
        let mut guard = states.lock().unwrap_or_else(|p| p.into_inner());
        let t = guard.get_mut(contract::KV_STATE).ok_or_else(no_state)?;
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
    /// [`Recurrent::tensors`]: contract::Recurrent::tensors
    fn read_recurrent_states(&self) -> Result<Vec<f16>, RuntimeError> {
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
    fn write_recurrent_states(&self, values: &[f16]) -> Result<(), RuntimeError> {
        let tensors = self.recurrent_tensors()?;
        let want: usize = tensors.iter().map(|t| t.len()).sum();
        if values.len() != want {
            return Err(RuntimeError::Input {
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

    fn recurrent_tensors(&self) -> Result<Vec<contract::StateTensor>, RuntimeError> {
        self.contract
            .recurrent
            .as_ref()
            .map(|r| r.tensors())
            .ok_or_else(|| RuntimeError::Program("the package has no recurrent state".into()))
    }

    /// The state holder and the state's [L, Hkv, S', D] (per half), with `rows` within S.
    fn kv_state(
        &self,
        rows: usize,
    ) -> Result<(&std::sync::Mutex<States>, [usize; 4]), RuntimeError> {
        let c = &self.contract;
        let states = self.states.as_ref().ok_or_else(no_state)?;
        let shape =
            contract::kv_state_shape(c.max_seq_len, c.num_layers, c.num_kv_heads, c.head_dim);
        if rows > c.max_seq_len {
            return Err(RuntimeError::Input {
                name: contract::KV_STATE.into(),
                msg: format!("{rows} rows of a {}-row cache", c.max_seq_len),
            });
        }
        Ok((states, [c.num_layers, c.num_kv_heads, shape[2], c.head_dim]))
    }
}

fn no_recurrent(name: &str) -> RuntimeError {
    RuntimeError::Program(format!(
        "the package holds no `{name}` state of its contract's shape"
    ))
}

fn no_state() -> RuntimeError {
    RuntimeError::Program("the package holds no `kv_cache` state".into())
}

fn take_output(out: &mut HashMap<String, Tensor>, name: &str) -> Result<Tensor, RuntimeError> {
    out.remove(name).ok_or_else(|| RuntimeError::Contract {
        path: String::new(),
        msg: format!("the program has no output `{name}`"),
    })
}

/// A hybrid contract's state tensors (conv state, DeltaNet state), once the state a step is
/// given holds exactly their values; none without one.
pub fn state_tensors(
    c: &Contract,
    recurrent: Option<(usize, &[f16])>,
) -> Result<Vec<contract::StateTensor>, RuntimeError> {
    let tensors = c
        .recurrent
        .as_ref()
        .map_or_else(Vec::new, contract::Recurrent::tensors);
    let want: usize = tensors.iter().map(contract::StateTensor::len).sum();
    let got = recurrent.map_or(0, |(_, s)| s.len());
    if got != want {
        let shapes: Vec<_> = tensors.iter().map(|t| t.shape.clone()).collect();
        return Err(RuntimeError::Input {
            name: tensors
                .first()
                .map_or(contract::CONV_STATE, |t| t.input)
                .into(),
            msg: format!("{got} recurrent state values, expected {want} ({shapes:?})"),
        });
    }
    Ok(tensors)
}

/// The host's recurrent state cut into its tensors' values (`state` holds their sum).
pub fn split_state<'a, 't>(
    tensors: &'t [contract::StateTensor],
    mut state: &'a [f16],
) -> Vec<(&'t contract::StateTensor, &'a [f16])> {
    tensors
        .iter()
        .map(|t| {
            let (part, rest) = state.split_at(t.len().min(state.len()));
            state = rest;
            (t, part)
        })
        .collect()
}

/// The step's arguments against the contract: Q tokens, a position that leaves room for them,
/// caches of [L, Hkv, S, D]. Returns the position as the int32 the programs take.
pub fn check_step(
    c: &Contract,
    input_ids: &[i32],
    position: usize,
    key_cache: &[f16],
    value_cache: &[f16],
    valid: Option<usize>,
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
    // A hybrid package takes `valid` real tokens (its padding may run past S); the others'
    // Q tokens are all real.
    let real = match (&c.recurrent, valid) {
        (Some(_), Some(n)) if (1..=c.query_len).contains(&n) => n,
        (Some(_), _) => {
            return Err(RuntimeError::Input {
                name: contract::VALID_LEN.into(),
                msg: format!(
                    "{valid:?}: a hybrid package's step takes 1 to {} real tokens and its \
                     recurrent state",
                    c.query_len
                ),
            })
        }
        (None, Some(_)) => {
            return Err(RuntimeError::Input {
                name: contract::VALID_LEN.into(),
                msg: "the package carries no recurrent state".into(),
            })
        }
        (None, None) => c.query_len,
    };
    if position + real > c.max_seq_len {
        return Err(RuntimeError::Input {
            name: contract::POSITION.into(),
            msg: format!(
                "position {position} + {real} tokens passes max_seq_len {}",
                c.max_seq_len
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
pub fn concat_rows(parts: &[(Tensor, usize)], q: usize) -> Vec<f32> {
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

impl StepModel for Package {
    fn contract(&self) -> &Contract {
        &self.contract
    }

    fn prefill_len(&self) -> Option<usize> {
        Package::prefill_len(self)
    }

    fn prefill_last_row_only(&self) -> bool {
        Package::prefill_last_row_only(self)
    }

    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        self.step_with_stats(input_ids, position, key_cache, value_cache, None)
    }

    fn step_recurrent(
        &mut self,
        input_ids: &[i32],
        valid: usize,
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
        recurrent: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        let caches = (key_cache, value_cache);
        self.step_full(input_ids, position, caches, Some((valid, recurrent)), None)
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

    fn state_recurrent(&self) -> Result<Vec<f16>, RuntimeError> {
        self.read_recurrent_states()
    }

    fn restore_state_recurrent(&mut self, values: &[f16]) -> Result<(), RuntimeError> {
        self.write_recurrent_states(values)
    }
}
