//! Running a chain of packages as one model (docs/design.md, "Chained packages"): each step
//! runs the parts in order, hands each the hidden state of the one before and its own layers'
//! rows of the caches, and joins their cache updates. The hidden state is passed exactly as the
//! part returned it (the residual stream times α, as inside one package), so the chain computes
//! the logits one package computes, bit for bit.

use std::path::{Path, PathBuf};

use half::f16;

use super::coreai::CoreAiModel;
use super::interp::{check_step, concat_rows, Options, Package, Program, Stats, Tensor};
use super::{RuntimeError, StepModel, StepOutput};
use crate::mil::chain::{self, ChainFile};
use crate::mil::contract::{self, Contract};
use crate::mlpackage::MlPackage;

/// A loaded chain.
#[derive(Debug)]
pub struct Chain {
    dir: PathBuf,
    chain: ChainFile,
    programs: Vec<Program>,
}

fn contract_err(path: &Path, msg: String) -> RuntimeError {
    RuntimeError::Contract {
        path: path.display().to_string(),
        msg,
    }
}

impl Chain {
    /// Read `dir/chain.json` and compile every part, checking each part's declared inputs
    /// against the chain file.
    pub fn load(dir: &Path, options: Options) -> Result<Self, RuntimeError> {
        let chain = ChainFile::read(dir).map_err(|e| contract_err(dir, e.to_string()))?;
        let mut programs = Vec::with_capacity(chain.parts.len());
        for part in &chain.parts {
            let path = ChainFile::part_path(dir, part);
            let pkg = MlPackage::open(&path)?;
            let program = Program::load(&pkg, options)?;
            for want in &part.inputs {
                let found = program.inputs().find(|(n, _)| *n == want.name);
                match found {
                    Some((_, ty)) if ty.shape == want.shape => {}
                    _ => {
                        return Err(contract_err(
                            &path,
                            format!(
                                "the chain file gives input `{}` the shape {:?}; the program \
                                 does not declare it so",
                                want.name, want.shape
                            ),
                        ))
                    }
                }
            }
            programs.push(program);
        }
        Ok(Chain {
            dir: dir.to_path_buf(),
            chain,
            programs,
        })
    }

    pub fn chain(&self) -> &ChainFile {
        &self.chain
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// One step through every part, optionally collecting range statistics.
    pub fn step_with_stats(
        &self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
        mut stats: Option<&mut Stats>,
    ) -> Result<StepOutput, RuntimeError> {
        let c = &self.chain.contract;
        let pos = check_step(c, input_ids, position, key_cache, value_cache)?;
        let per_layer = c.num_kv_heads * c.max_seq_len * c.head_dim;
        let mut hidden: Option<Tensor> = None;
        let mut logits = Vec::new();
        let upd = c.num_layers * c.num_kv_heads * c.query_len * c.head_dim;
        let (mut key_update, mut value_update) = (Vec::with_capacity(upd), Vec::with_capacity(upd));
        for (part, program) in self.chain.parts.iter().zip(&self.programs) {
            let mut inputs = Vec::with_capacity(4);
            match hidden.take() {
                Some(h) if !part.embedding => inputs.push((chain::HIDDEN_IN, h)),
                _ => inputs.push((
                    contract::INPUT_IDS,
                    Tensor::i32(vec![1, c.query_len], input_ids),
                )),
            }
            let (l0, l1) = (part.layers.start, part.layers.end);
            if l1 > l0 {
                let shape = vec![l1 - l0, c.num_kv_heads, c.max_seq_len, c.head_dim];
                let rows = l0 * per_layer..l1 * per_layer;
                inputs.push((contract::POSITION, Tensor::i32(vec![1], &[pos])));
                inputs.push((
                    contract::KEY_CACHE,
                    Tensor::f16(shape.clone(), key_cache[rows.clone()].to_vec()),
                ));
                inputs.push((
                    contract::VALUE_CACHE,
                    Tensor::f16(shape, value_cache[rows].to_vec()),
                ));
            }
            let mut out = program.run(inputs, stats.as_deref_mut())?;
            let mut take = |name: &str| {
                out.remove(name).ok_or_else(|| {
                    contract_err(&self.dir, format!("{}: no output `{name}`", part.path))
                })
            };
            if part.head {
                let parts = c
                    .logits_outputs()
                    .into_iter()
                    .map(|(name, width)| take(&name).map(|t| (t, width)))
                    .collect::<Result<Vec<_>, _>>()?;
                logits = concat_rows(&parts, c.query_len);
            } else {
                hidden = Some(take(chain::HIDDEN_OUT)?);
            }
            if l1 > l0 {
                key_update.extend(take(contract::KEY_UPDATE)?.to_f16_vec());
                value_update.extend(take(contract::VALUE_UPDATE)?.to_f16_vec());
            }
        }
        if logits.len() != c.query_len * c.vocab_size
            || key_update.len() != upd
            || value_update.len() != upd
        {
            return Err(contract_err(
                &self.dir,
                "output sizes do not match the contract's dimensions".into(),
            ));
        }
        Ok(StepOutput {
            logits,
            key_update,
            value_update,
        })
    }
}

/// A saved model: one package, a chain directory, or a Core AI asset (what `run` and
/// `validate` take).
#[derive(Debug)]
pub enum Saved {
    Package(Box<Package>),
    Chain(Box<Chain>),
    /// An `.aimodel`, stepped by Apple's Core AI runtime.
    CoreAi(Box<CoreAiModel>),
}

impl Saved {
    /// A chain when `path` holds a chain file, a Core AI asset when it holds Core AI's files,
    /// else a package.
    pub fn load(path: &Path, options: Options) -> Result<Self, RuntimeError> {
        if crate::aimodel::is_aimodel(path) {
            Ok(Saved::CoreAi(Box::new(CoreAiModel::load(path)?)))
        } else if chain::is_chain(path) {
            Ok(Saved::Chain(Box::new(Chain::load(path, options)?)))
        } else {
            Ok(Saved::Package(Box::new(Package::load(path, options)?)))
        }
    }

    /// The compiled programs: the package's, or each part's in chain order (none for a Core
    /// AI asset, which Apple's runtime compiles).
    pub fn programs(&self) -> Vec<&Program> {
        match self {
            Saved::Package(p) => vec![p.program()],
            Saved::Chain(c) => c.programs.iter().collect(),
            Saved::CoreAi(_) => Vec::new(),
        }
    }

    pub fn contract(&self) -> &Contract {
        match self {
            Saved::Package(p) => p.contract(),
            Saved::Chain(c) => &c.chain.contract,
            Saved::CoreAi(m) => m.contract(),
        }
    }

    /// What executes the steps: hf2coreml's MIL interpreter, or Apple's Core AI runtime.
    pub fn runtime_name(&self) -> &'static str {
        match self {
            Saved::Package(_) | Saved::Chain(_) => "hf2coreml MIL interpreter",
            Saved::CoreAi(_) => "Apple Core AI runtime (coreai-core)",
        }
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
        match self {
            Saved::Package(p) => {
                p.step_with_stats(input_ids, position, key_cache, value_cache, stats)
            }
            Saved::Chain(c) => {
                c.step_with_stats(input_ids, position, key_cache, value_cache, stats)
            }
            // Apple's runtime reports no per-op ranges.
            Saved::CoreAi(m) => m.step(input_ids, position, key_cache, value_cache),
        }
    }
}

impl StepModel for Saved {
    fn contract(&self) -> &Contract {
        Saved::contract(self)
    }

    fn prefill_len(&self) -> Option<usize> {
        match self {
            Saved::Package(p) => p.prefill_len(),
            Saved::CoreAi(m) => m.prefill_len(),
            Saved::Chain(_) => None,
        }
    }

    fn prefill_last_row_only(&self) -> bool {
        match self {
            Saved::Package(p) => p.prefill_last_row_only(),
            Saved::CoreAi(m) => m.prefill_last_row_only(),
            Saved::Chain(_) => false,
        }
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

    fn state_rows(&self, rows: usize) -> Result<(Vec<f16>, Vec<f16>), RuntimeError> {
        match self {
            Saved::Package(p) => p.state_rows(rows),
            Saved::Chain(_) => Err(RuntimeError::Program("a chain holds no cache state".into())),
            Saved::CoreAi(_) => Err(RuntimeError::Program(
                "a Core AI asset holds no cache state".into(),
            )),
        }
    }

    fn restore_state_rows(
        &mut self,
        rows: usize,
        keys: &[f16],
        values: &[f16],
    ) -> Result<(), RuntimeError> {
        match self {
            Saved::Package(p) => p.restore_state_rows(rows, keys, values),
            Saved::Chain(_) => Err(RuntimeError::Program("a chain holds no cache state".into())),
            Saved::CoreAi(_) => Err(RuntimeError::Program(
                "a Core AI asset holds no cache state".into(),
            )),
        }
    }
}
