//! An `.aimodel` stepped by Apple's Core AI runtime ([`crate::aimodel::Session`]): the
//! contract's static-cache step, one runtime call per step, the asset loaded once.

use std::path::{Path, PathBuf};

use half::f16;

use super::per_layer_table::PerLayerRows;
use super::{RuntimeError, StepOutput};
use crate::aimodel::{self, Session, Tensor};
use crate::mil::contract::{self, Contract};
use crate::pyenv::{PyEnvError, PythonEnv};

/// The function of a one-function hf2coreml asset (a multifunction asset has `prefill` and
/// `decode`, as its contract's `functions` list them).
pub const FUNCTION: &str = "main";

/// The asset metadata key holding the fewest bits of any palettized weight (absent: every
/// weight is fp16), which `validate` picks its default gates by: the asset's bytecode is not
/// read back, so the converter records it.
pub const MIN_BITS_KEY: &str = "hf2coreml.min_bits";

/// The fewest bits of any palettized weight of the asset at `path`, as the converter recorded
/// it in its metadata (`None`: every weight is fp16).
pub fn recorded_min_bits(path: &Path) -> Result<Option<u32>, RuntimeError> {
    let meta = aimodel::read_metadata(path).map_err(asset_err)?;
    let Some(b) = meta.user_defined.get(MIN_BITS_KEY) else {
        return Ok(None);
    };
    b.parse::<u32>()
        .ok()
        .filter(|b| (1..=8).contains(b))
        .map(Some)
        .ok_or_else(|| RuntimeError::Contract {
            path: path.display().to_string(),
            msg: format!("metadata `{MIN_BITS_KEY}` is `{b}`, not a bit width 1-8"),
        })
}

/// `rows` rows of logits from the vocabulary's parts (`(values, width)`, each [rows, width]):
/// each row the parts' rows side by side. A part shorter than its rows gives no logits (the
/// caller checks the length).
pub(super) fn interleave_rows(parts: &[(Vec<f32>, usize)], rows: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * parts.iter().map(|(_, w)| w).sum::<usize>());
    if parts.iter().any(|(p, w)| p.len() != rows * w) {
        return out;
    }
    for row in 0..rows {
        for (part, w) in parts {
            out.extend_from_slice(&part[row * w..(row + 1) * w]);
        }
    }
    out
}

/// A loaded `.aimodel` and its contract.
#[derive(Debug)]
pub struct CoreAiModel {
    path: PathBuf,
    contract: Contract,
    /// Each function's name and the contract as it follows it (Q, I/O): `main`, or `decode`
    /// and `prefill`.
    functions: Vec<(String, Contract)>,
    min_bits: Option<u32>,
    session: Session,
    /// Gemma 4's per-layer table beside the asset, if the contract declares one.
    per_layer: Option<PerLayerRows>,
}

/// The Python environment whose Core AI runtime executes assets.
pub(super) fn python_env() -> Result<PythonEnv, RuntimeError> {
    PythonEnv::discover(None).map_err(|e| match e {
        PyEnvError::Environment(e) => RuntimeError::Environment(e),
        other => RuntimeError::Program(other.to_string()),
    })
}

/// A Core AI error as the runtime reports it (an unusable environment keeps its exit code).
pub(super) fn asset_err(e: aimodel::AimodelError) -> RuntimeError {
    match e {
        aimodel::AimodelError::Python(PyEnvError::Environment(e)) => RuntimeError::Environment(e),
        // The error names the asset already.
        other => RuntimeError::Program(other.to_string()),
    }
}

impl CoreAiModel {
    /// Load `path` with the Core AI runtime of the discovered Python environment, and check
    /// that it declares the contract's inputs.
    pub fn load(path: &Path) -> Result<Self, RuntimeError> {
        let contract = aimodel::read_contract(path).map_err(asset_err)?;
        let min_bits = recorded_min_bits(path)?;
        if !contract.target.is_coreai() {
            return Err(RuntimeError::Contract {
                path: path.display().to_string(),
                msg: format!(
                    "an .aimodel whose contract names target `{}`",
                    contract.target.as_str()
                ),
            });
        }
        if !contract.kv_cache.is_io() {
            return Err(RuntimeError::Contract {
                path: path.display().to_string(),
                msg: "a Core AI asset is stepped with its caches as inputs and outputs".into(),
            });
        }
        let mut names = contract.function_names();
        // The default function first: `decode` of a multifunction asset.
        names.sort_by_key(|n| *n != contract::DECODE);
        let functions = names
            .into_iter()
            .map(|n| {
                let c = contract
                    .for_function(n)
                    .ok_or_else(|| RuntimeError::Contract {
                        path: path.display().to_string(),
                        msg: format!("the contract has no function `{n}`"),
                    })?;
                Ok((n.to_string(), c))
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        if functions.len() > 1 && !functions.iter().any(|(n, _)| n == contract::DECODE) {
            return Err(RuntimeError::Contract {
                path: path.display().to_string(),
                msg: format!("several functions and none named `{}`", contract::DECODE),
            });
        }
        let per_layer = PerLayerRows::open(path, &contract)?;
        let env = python_env()?;
        let session = Session::open(&env, path).map_err(asset_err)?;
        let model = CoreAiModel {
            path: path.to_path_buf(),
            contract,
            functions,
            min_bits,
            session,
            per_layer,
        };
        model.check_interface()?;
        Ok(model)
    }

    /// Each of the asset's functions declares its contract's inputs, shapes included, and its
    /// outputs.
    fn check_interface(&self) -> Result<(), RuntimeError> {
        let declared = self.session.functions().map_err(asset_err)?;
        let bad = |msg: String| RuntimeError::Contract {
            path: self.path.display().to_string(),
            msg,
        };
        if let Some(r) = &self.contract.recurrent {
            r.check(self.contract.num_layers).map_err(bad)?;
        }
        for (name, c) in &self.functions {
            let f = declared
                .iter()
                .find(|f| f.name == *name)
                .ok_or_else(|| bad(format!("the asset has no function `{name}`")))?;
            for spec in &c.inputs {
                let got = f
                    .inputs
                    .iter()
                    .find(|i| i.name == spec.name)
                    .ok_or_else(|| {
                        bad(format!("function `{name}` has no input `{}`", spec.name))
                    })?;
                if got.shape != spec.shape {
                    return Err(bad(format!(
                        "function `{name}`: input `{}` has shape {:?}, the contract {:?}",
                        spec.name, got.shape, spec.shape
                    )));
                }
            }
            for spec in &c.outputs {
                if !f.outputs.contains(&spec.name) {
                    return Err(bad(format!(
                        "function `{name}` has no output `{}`",
                        spec.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// The Q of the `prefill` function, if the asset has one.
    pub fn prefill_len(&self) -> Option<usize> {
        self.functions
            .iter()
            .find(|(n, _)| n == contract::PREFILL)
            .map(|(_, c)| c.query_len)
    }

    /// Whether the `prefill` function returns the last position's logits only.
    pub fn prefill_last_row_only(&self) -> bool {
        self.functions
            .iter()
            .find(|(n, _)| n == contract::PREFILL)
            .is_some_and(|(_, c)| c.logits_rows() == 1 && c.query_len > 1)
    }

    /// The function that takes `n` tokens a call, with its contract.
    fn function_for(&self, n: usize) -> Result<(&str, &Contract), RuntimeError> {
        self.functions
            .iter()
            .find(|(_, c)| c.query_len == n)
            .map(|(name, c)| (name.as_str(), c))
            .ok_or_else(|| RuntimeError::Input {
                name: contract::INPUT_IDS.into(),
                msg: format!(
                    "{n} tokens; the asset's functions take {}",
                    self.functions
                        .iter()
                        .map(|(name, c)| format!("{} ({name})", c.query_len))
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            })
    }

    pub fn contract(&self) -> &Contract {
        &self.contract
    }

    /// The fewest bits of any palettized weight, as the converter recorded it (`None`: fp16).
    pub fn min_bits(&self) -> Option<u32> {
        self.min_bits
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The functions the runtime reports, for `inspect`.
    pub fn functions(&self) -> Result<Vec<aimodel::FunctionDesc>, RuntimeError> {
        self.session.functions().map_err(asset_err)
    }

    fn float(&self, name: &str, values: &[f16], shape: Vec<usize>) -> Tensor {
        let fp32 = self
            .contract
            .inputs
            .iter()
            .any(|i| i.name == name && i.dtype == "fp32");
        if fp32 {
            Tensor::F32(values.iter().map(|x| x.to_f32()).collect(), shape)
        } else {
            Tensor::F16(values.to_vec(), shape)
        }
    }

    /// One step of the contract: Q tokens at `position`, the cache rows before it.
    pub fn step(
        &self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        self.step_full(input_ids, position, (key_cache, value_cache), None)
    }

    /// One step of any asset: `recurrent` is a hybrid model's (valid tokens, state in), as
    /// [`crate::runtime::StepModel::step_recurrent`] takes them.
    pub fn step_full(
        &self,
        input_ids: &[i32],
        position: usize,
        (key_cache, value_cache): (&[f16], &[f16]),
        recurrent: Option<(usize, &[f16])>,
    ) -> Result<StepOutput, RuntimeError> {
        let (function, c) = self.function_for(input_ids.len())?;
        let cache_shape = vec![c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim];
        let valid = recurrent.map(|(v, _)| v);
        let pos = super::interp::check_step(c, input_ids, position, key_cache, value_cache, valid)?;
        let mut inputs = vec![
            (
                contract::INPUT_IDS.to_string(),
                Tensor::I32(input_ids.to_vec(), vec![1, c.query_len]),
            ),
            (
                contract::POSITION.to_string(),
                Tensor::I32(vec![pos], vec![1]),
            ),
            (
                contract::KEY_CACHE.to_string(),
                self.float(contract::KEY_CACHE, key_cache, cache_shape.clone()),
            ),
            (
                contract::VALUE_CACHE.to_string(),
                self.float(contract::VALUE_CACHE, value_cache, cache_shape),
            ),
        ];
        if let Some(t) = &self.per_layer {
            let shape = vec![1, input_ids.len(), t.row_len()];
            let rows = self.float(contract::PER_LAYER_ROWS, &t.gather(input_ids)?, shape);
            inputs.push((contract::PER_LAYER_ROWS.to_string(), rows));
        }
        let tensors = super::interp::state_tensors(c, recurrent)?;
        if !tensors.is_empty() {
            let (valid, state) = recurrent.unwrap_or((0, &[]));
            if c.query_len > 1 {
                // `check_step` bounded it by Q.
                let valid = Tensor::I32(vec![valid as i32], vec![1]);
                inputs.push((contract::VALID_LEN.to_string(), valid));
            }
            for (t, part) in super::interp::split_state(&tensors, state) {
                let state = self.float(t.input, part, t.shape.clone());
                inputs.push((t.input.to_string(), state));
            }
        }
        let mut out = self.session.call(function, inputs).map_err(asset_err)?;
        let mut take = |name: &str| {
            out.remove(name).ok_or_else(|| RuntimeError::Contract {
                path: self.path.display().to_string(),
                msg: format!("the asset returned no output `{name}`"),
            })
        };
        let parts = c
            .logits_outputs()
            .into_iter()
            .map(|(name, w)| Ok((take(&name)?.to_f32(), w)))
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let (q, v, rows) = (c.query_len, c.vocab_size, c.logits_rows());
        let logits = interleave_rows(&parts, rows);
        let k = take(contract::KEY_UPDATE)?.to_f16();
        let val = take(contract::VALUE_UPDATE)?.to_f16();
        let mut state = Vec::with_capacity(c.recurrent_len());
        for t in &tensors {
            state.extend(take(t.output)?.to_f16());
        }
        let upd = c.num_layers * c.num_kv_heads * q * c.head_dim;
        let sizes = [(logits.len(), rows * v), (k.len(), upd), (val.len(), upd)];
        if sizes.iter().any(|(a, b)| a != b) || state.len() != c.recurrent_len() {
            return Err(RuntimeError::Contract {
                path: self.path.display().to_string(),
                msg: "output sizes do not match the contract's dimensions".into(),
            });
        }
        Ok(StepOutput {
            logits,
            key_update: k,
            value_update: val,
            recurrent: state,
        })
    }
}
