//! Running a chain of packages as one model (docs/design.md, "Chained packages"): each step
//! runs the parts in order (ML packages in the interpreter, Core AI parts in Apple's runtime),
//! hands each the hidden state of the one before and its own layers' rows of the caches, and
//! joins their cache updates. The hidden state is passed exactly as the part returned it (the
//! residual stream times α, as inside one package), so the chain computes the logits one
//! package computes, bit for bit.

use std::path::{Path, PathBuf};

use half::f16;

use super::coreai_model::{asset_err, CoreAiModel};
use super::interp::{check_step, concat_rows, Compute, Options, Package, Program, Stats, Tensor};
use super::per_layer_table::PerLayerRows;
use super::{RuntimeError, StepModel, StepOutput};
use crate::aimodel;
use crate::mil::chain_file::{self, ChainFile};
use crate::mil::contract::{self, Contract};
use crate::mlpackage::MlPackage;

/// A loaded chain.
#[derive(Debug)]
pub struct Chain {
    dir: PathBuf,
    chain: ChainFile,
    parts: Vec<PartRunner>,
    /// Gemma 4's per-layer table beside the chain, if the contract declares one.
    per_layer: Option<PerLayerRows>,
}

/// What executes one part: hf2coreml's interpreter for an ML package, Apple's Core AI runtime
/// for an `.aimodel` part (loaded once, for the length of the command).
#[derive(Debug)]
enum PartRunner {
    Mil(Box<Program>),
    CoreAi(aimodel::Session),
}

/// The hidden state between parts, as the part before returned it (and Gemma 4's per-layer
/// inputs, as the first part returned them).
#[derive(Clone)]
enum Hidden {
    Mil(Tensor),
    CoreAi(aimodel::Tensor),
}

/// What one part returns: the hidden state or the logits, its layers' cache rows and a hybrid
/// model's part its blocks' new state, one vector per state tensor (empty without one).
struct PartOutput {
    hidden: Option<Hidden>,
    /// The first part's `per_layer_out` (Gemma 4).
    per_layer: Option<Hidden>,
    logits: Vec<f32>,
    cache: Option<(Vec<f16>, Vec<f16>)>,
    state: Vec<Vec<f16>>,
}

/// Which outputs a part's call returns: the logits (the head) or the hidden state, the cache
/// updates, the recurrent state's outputs by name.
struct PartShape<'a> {
    head: bool,
    /// It returns Gemma 4's per-layer inputs (`per_layer_out`).
    per_layer: bool,
    has_cache: bool,
    states: &'a [&'a str],
}

impl PartShape<'_> {
    /// The part's outputs, taken by name from what one runtime returned (`take`): `rows` joins
    /// the logits parts, `hidden` wraps the hidden state, `f16` reads a cache or state tensor.
    fn collect<T>(
        &self,
        c: &Contract,
        mut take: impl FnMut(&str) -> Result<T, RuntimeError>,
        rows: impl FnOnce(Vec<(T, usize)>) -> Vec<f32>,
        hidden: impl Fn(T) -> Hidden,
        f16: impl Fn(T) -> Vec<f16>,
    ) -> Result<PartOutput, RuntimeError> {
        let (mut hidden_out, mut logits) = (None, Vec::new());
        if self.head {
            let parts = c
                .logits_outputs()
                .into_iter()
                .map(|(name, width)| take(&name).map(|t| (t, width)))
                .collect::<Result<Vec<_>, _>>()?;
            logits = rows(parts);
        } else {
            hidden_out = Some(hidden(take(chain_file::HIDDEN_OUT)?));
        }
        let per_layer = if self.per_layer {
            Some(hidden(take(chain_file::PER_LAYER_OUT)?))
        } else {
            None
        };
        let cache = if self.has_cache {
            Some((
                f16(take(contract::KEY_UPDATE)?),
                f16(take(contract::VALUE_UPDATE)?),
            ))
        } else {
            None
        };
        let state = self
            .states
            .iter()
            .map(|name| take(name).map(&f16))
            .collect::<Result<_, _>>()?;
        Ok(PartOutput {
            hidden: hidden_out,
            per_layer,
            logits,
            cache,
            state,
        })
    }
}

/// A part's recurrent state as it is passed: each state tensor (with the part's shape) and its
/// values, and `valid_len` when Q > 1.
struct PartState<'a> {
    tensors: Vec<(contract::StateTensor, &'a [f16])>,
    valid: Option<i32>,
}

/// What one part's call is given besides its runner: the pieces `run_part` slices.
struct Call<'a> {
    part: &'a chain_file::ChainPart,
    hidden: Option<Hidden>,
    /// Gemma 4: the table's rows of the tokens (the first part), or the per-layer inputs the
    /// first part returned (a later part with blocks).
    per_layer: PerLayer,
    input_ids: &'a [i32],
    pos: i32,
    /// Its caches' shape and rows (empty without an attention block).
    shape: Vec<usize>,
    keys: &'a [f16],
    values: &'a [f16],
    has_layers: bool,
    has_cache: bool,
    /// Its recurrent state, when it has blocks that keep one.
    state: Option<PartState<'a>>,
}

/// What a Gemma 4 part is given for its per-layer inputs.
enum PerLayer {
    None,
    /// The first part: the per-layer table's rows of the tokens, [1, Q, L·P].
    Rows(Vec<f16>),
    /// A later part: the first part's `per_layer_out`.
    Given(Hidden),
}

/// Where one part's rows and state lie in the model's: its cache slots (its attention blocks),
/// and per state tensor the part's shape of it and where its values lie in the host's state.
struct PartSlots {
    cache: std::ops::Range<usize>,
    per_cache: usize,
    state: Vec<(contract::StateTensor, std::ops::Range<usize>)>,
}

impl PartSlots {
    fn of(c: &Contract, part: &chain_file::ChainPart) -> Self {
        let layers = &part.layers;
        let per_cache = c.num_kv_heads * c.max_seq_len * c.head_dim;
        let Some(r) = &c.recurrent else {
            return PartSlots {
                cache: part.cache_slots(),
                per_cache,
                state: Vec::new(),
            };
        };
        let (cache, slots) = r.slots(layers);
        let mut state = Vec::new();
        let mut at = 0;
        for whole in r.tensors() {
            let (len, per_slot) = (whole.len(), whole.shape[1..].iter().product::<usize>());
            if !slots.is_empty() {
                let mut shape = whole.shape.clone();
                shape[0] = slots.len();
                let values = at + slots.start * per_slot..at + slots.end * per_slot;
                state.push((contract::StateTensor { shape, ..whole }, values));
            }
            at += len;
        }
        PartSlots {
            cache,
            per_cache,
            state,
        }
    }

    fn cache_shape(&self, c: &Contract) -> Vec<usize> {
        vec![self.cache.len(), c.num_kv_heads, c.max_seq_len, c.head_dim]
    }

    fn cache_rows(&self) -> std::ops::Range<usize> {
        self.cache.start * self.per_cache..self.cache.end * self.per_cache
    }
}

fn contract_err(path: &Path, msg: String) -> RuntimeError {
    RuntimeError::Contract {
        path: path.display().to_string(),
        msg,
    }
}

/// A Core AI part's bytecode is the one the chain recorded: the session checked it against the
/// asset's own hash, so comparing that hash costs nothing, and a part taken from another
/// conversion (whose bytecode carries other weights) is refused at load.
fn check_recorded_bytecode(
    path: &Path,
    part: &chain_file::ChainPart,
    session: &aimodel::Session,
) -> Result<(), RuntimeError> {
    for (name, recorded) in part.sha256.iter().filter(|(n, _)| n.ends_with(".mlirb")) {
        let found = session.checked().sha256_of(name);
        if found != Some(recorded.as_str()) {
            return Err(contract_err(
                path,
                format!(
                    "its {name} is not the one the chain recorded (sha256 {}, recorded \
                     {recorded}): the part was replaced or damaged",
                    found.unwrap_or("absent")
                ),
            ));
        }
    }
    Ok(())
}

impl Chain {
    /// Read `dir/chain.json` and compile every part (or load it in Apple's runtime), checking
    /// each part's declared inputs against the chain file.
    pub fn load(dir: &Path, options: Options) -> Result<Self, RuntimeError> {
        let chain = ChainFile::read(dir).map_err(|e| contract_err(dir, e.to_string()))?;
        let env = if chain.contract.target.is_coreai() {
            Some(super::coreai_model::python_env()?)
        } else {
            None
        };
        let mut parts = Vec::with_capacity(chain.parts.len());
        for part in &chain.parts {
            let path = ChainFile::part_path(dir, part);
            let declared: Vec<(String, Vec<usize>)>;
            let runner = match &env {
                Some(env) => {
                    if !crate::aimodel::is_aimodel(&path) {
                        return Err(contract_err(&path, "not a Core AI asset".into()));
                    }
                    let session = aimodel::Session::open(env, &path).map_err(asset_err)?;
                    check_recorded_bytecode(&path, part, &session)?;
                    let functions = session.functions().map_err(asset_err)?;
                    let main = functions
                        .iter()
                        .find(|f| f.name == super::coreai_model::FUNCTION)
                        .ok_or_else(|| {
                            contract_err(
                                &path,
                                format!("no function `{}`", super::coreai_model::FUNCTION),
                            )
                        })?;
                    if let Some(missing) = part
                        .outputs
                        .iter()
                        .find(|o| !main.outputs.contains(&o.name))
                    {
                        return Err(contract_err(
                            &path,
                            format!("the part returns no output `{}`", missing.name),
                        ));
                    }
                    declared = main
                        .inputs
                        .iter()
                        .map(|i| (i.name.clone(), i.shape.clone()))
                        .collect();
                    PartRunner::CoreAi(session)
                }
                None => {
                    let pkg = MlPackage::open(&path)?;
                    let program = Program::load(&pkg, options)?;
                    declared = program
                        .inputs()
                        .map(|(n, ty)| (n.to_string(), ty.shape.clone()))
                        .collect();
                    PartRunner::Mil(Box::new(program))
                }
            };
            for want in &part.inputs {
                if !declared
                    .iter()
                    .any(|(n, shape)| *n == want.name && *shape == want.shape)
                {
                    return Err(contract_err(
                        &path,
                        format!(
                            "the chain file gives input `{}` the shape {:?}; the program \
                             does not declare it so",
                            want.name, want.shape
                        ),
                    ));
                }
            }
            parts.push(runner);
        }
        let per_layer = PerLayerRows::open(dir, &chain.contract)?;
        Ok(Chain {
            dir: dir.to_path_buf(),
            chain,
            parts,
            per_layer,
        })
    }

    pub fn chain(&self) -> &ChainFile {
        &self.chain
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether Apple's Core AI runtime executes the parts (a chain of `.aimodel` parts).
    pub fn is_coreai(&self) -> bool {
        self.chain.contract.target.is_coreai()
    }

    /// The fewest bits of any palettized weight of a Core AI chain's parts, as the converter
    /// recorded them in each part's metadata (`None`: every weight is fp16, or an ML package
    /// chain, whose weights `validate` reads itself).
    pub fn asset_min_bits(&self) -> Result<Option<u32>, RuntimeError> {
        let mut min = None;
        for part in self.chain.parts.iter().filter(|p| p.is_asset()) {
            let path = ChainFile::part_path(&self.dir, part);
            let bits = super::coreai_model::recorded_min_bits(&path)?;
            min = match (min, bits) {
                (Some(a), Some(b)) => Some(u32::min(a, b)),
                (a, b) => a.or(b),
            };
        }
        Ok(min)
    }

    /// The functions each Core AI part declares, in chain order (for `validate` and
    /// `inspect`); empty for a chain of ML packages.
    pub fn asset_functions(&self) -> Result<Vec<Vec<aimodel::FunctionDesc>>, RuntimeError> {
        self.parts
            .iter()
            .filter_map(|p| match p {
                PartRunner::CoreAi(s) => Some(s.functions().map_err(asset_err)),
                PartRunner::Mil(_) => None,
            })
            .collect()
    }

    /// Run part `i` on the hidden state (or the tokens, for the first part), its layers'
    /// cache rows and a hybrid model's (valid tokens, conv state).
    #[allow(clippy::too_many_arguments)]
    fn run_part(
        &self,
        i: usize,
        (hidden, per_layer): (Option<Hidden>, Option<&Hidden>),
        input_ids: &[i32],
        pos: i32,
        (key_cache, value_cache): (&[f16], &[f16]),
        recurrent: Option<(usize, &[f16])>,
        stats: Option<&mut Stats>,
    ) -> Result<PartOutput, RuntimeError> {
        let part = &self.chain.parts[i];
        let c = &self.chain.contract;
        let slots = PartSlots::of(c, part);
        let per_layer = match (&self.per_layer, per_layer) {
            (Some(t), _) if part.embedding => PerLayer::Rows(t.gather(input_ids)?),
            (Some(_), Some(given)) if !part.layers.is_empty() => PerLayer::Given(given.clone()),
            _ => PerLayer::None,
        };
        let rows = slots.cache_rows();
        let (valid, state) = recurrent.unwrap_or((0, &[]));
        // A part's state, with `valid_len` beside it when Q > 1 (checked by the step).
        let part_state = (!slots.state.is_empty()).then(|| PartState {
            tensors: slots
                .state
                .iter()
                .map(|(t, values)| (t.clone(), state.get(values.clone()).unwrap_or(&[])))
                .collect(),
            valid: (c.query_len > 1).then_some(valid as i32),
        });
        let has_cache = !slots.cache.is_empty();
        let call = Call {
            part,
            hidden,
            per_layer,
            input_ids,
            pos,
            shape: slots.cache_shape(c),
            keys: if has_cache {
                &key_cache[rows.clone()]
            } else {
                &[]
            },
            values: if has_cache { &value_cache[rows] } else { &[] },
            has_layers: !part.layers.is_empty(),
            has_cache,
            state: part_state,
        };
        match &self.parts[i] {
            PartRunner::Mil(program) => self.run_mil(program, call, stats),
            PartRunner::CoreAi(session) => self.run_coreai(session, call),
        }
    }

    /// [`run_part`](Self::run_part) in the interpreter.
    fn run_mil(
        &self,
        program: &Program,
        call: Call<'_>,
        stats: Option<&mut Stats>,
    ) -> Result<PartOutput, RuntimeError> {
        let Call {
            part,
            hidden,
            per_layer,
            input_ids,
            pos,
            shape,
            keys,
            values,
            has_layers,
            has_cache,
            state,
        } = call;
        let c = &self.chain.contract;
        let missing =
            |name: &str| contract_err(&self.dir, format!("{}: no output `{name}`", part.path));
        let mut inputs = Vec::with_capacity(4);
        match hidden {
            Some(Hidden::Mil(h)) if !part.embedding => inputs.push((chain_file::HIDDEN_IN, h)),
            _ => inputs.push((
                contract::INPUT_IDS,
                Tensor::i32(vec![1, c.query_len], input_ids),
            )),
        }
        match per_layer {
            PerLayer::Rows(rows) => {
                let shape = vec![1, c.query_len, rows.len() / c.query_len.max(1)];
                inputs.push((contract::PER_LAYER_ROWS, Tensor::f16(shape, rows)));
            }
            PerLayer::Given(Hidden::Mil(t)) => inputs.push((chain_file::PER_LAYER_IN, t)),
            PerLayer::Given(Hidden::CoreAi(_)) | PerLayer::None => {}
        }
        if has_layers {
            inputs.push((contract::POSITION, Tensor::i32(vec![1], &[pos])));
        }
        if let Some(PartState { valid: Some(v), .. }) = &state {
            inputs.push((contract::VALID_LEN, Tensor::i32(vec![1], &[*v])));
        }
        if has_cache {
            inputs.push((
                contract::KEY_CACHE,
                Tensor::f16(shape.clone(), super::interp::bulk::copied(keys)),
            ));
            inputs.push((
                contract::VALUE_CACHE,
                Tensor::f16(shape, super::interp::bulk::copied(values)),
            ));
        }
        let tensors = state.map_or_else(Vec::new, |s| s.tensors);
        for (t, values) in &tensors {
            inputs.push((t.input, Tensor::f16(t.shape.clone(), values.to_vec())));
        }
        let mut out = program.run(inputs, stats)?;
        let take = |name: &str| out.remove(name).ok_or_else(|| missing(name));
        let states: Vec<&str> = tensors.iter().map(|(t, _)| t.output).collect();
        let shape = PartShape {
            head: part.head,
            per_layer: part
                .outputs
                .iter()
                .any(|o| o.name == chain_file::PER_LAYER_OUT),
            has_cache,
            states: &states,
        };
        shape.collect(
            c,
            take,
            |parts| concat_rows(&parts, c.query_len),
            Hidden::Mil,
            |t| t.to_f16_vec(),
        )
    }

    /// [`run_part`](Self::run_part) in Apple's runtime.
    fn run_coreai(
        &self,
        session: &aimodel::Session,
        call: Call<'_>,
    ) -> Result<PartOutput, RuntimeError> {
        let Call {
            part,
            hidden,
            per_layer,
            input_ids,
            pos,
            shape,
            keys,
            values,
            has_layers,
            has_cache,
            state,
        } = call;
        let c = &self.chain.contract;
        let missing =
            |name: &str| contract_err(&self.dir, format!("{}: no output `{name}`", part.path));
        // A float input as the part declares it (fp32 parts of an fp32 chain).
        let float = |name: &str, v: &[f16], shape: Vec<usize>| {
            let fp32 = part
                .inputs
                .iter()
                .any(|i| i.name == name && i.dtype == "fp32");
            if fp32 {
                aimodel::Tensor::F32(v.iter().map(|x| x.to_f32()).collect(), shape)
            } else {
                aimodel::Tensor::F16(v.to_vec(), shape)
            }
        };
        let mut inputs = Vec::with_capacity(4);
        match hidden {
            Some(Hidden::CoreAi(h)) if !part.embedding => {
                inputs.push((chain_file::HIDDEN_IN.to_string(), h))
            }
            _ => inputs.push((
                contract::INPUT_IDS.to_string(),
                aimodel::Tensor::I32(input_ids.to_vec(), vec![1, c.query_len]),
            )),
        }
        match per_layer {
            PerLayer::Rows(rows) => {
                let shape = vec![1, c.query_len, rows.len() / c.query_len.max(1)];
                let rows = float(contract::PER_LAYER_ROWS, &rows, shape);
                inputs.push((contract::PER_LAYER_ROWS.to_string(), rows));
            }
            PerLayer::Given(Hidden::CoreAi(t)) => {
                inputs.push((chain_file::PER_LAYER_IN.to_string(), t))
            }
            PerLayer::Given(Hidden::Mil(_)) | PerLayer::None => {}
        }
        if has_layers {
            inputs.push((
                contract::POSITION.to_string(),
                aimodel::Tensor::I32(vec![pos], vec![1]),
            ));
        }
        if let Some(PartState { valid: Some(v), .. }) = &state {
            let valid = aimodel::Tensor::I32(vec![*v], vec![1]);
            inputs.push((contract::VALID_LEN.to_string(), valid));
        }
        if has_cache {
            inputs.push((
                contract::KEY_CACHE.to_string(),
                float(contract::KEY_CACHE, keys, shape.clone()),
            ));
            inputs.push((
                contract::VALUE_CACHE.to_string(),
                float(contract::VALUE_CACHE, values, shape),
            ));
        }
        let tensors = state.map_or_else(Vec::new, |s| s.tensors);
        for (t, values) in &tensors {
            let value = float(t.input, values, t.shape.clone());
            inputs.push((t.input.to_string(), value));
        }
        let mut out = session
            .call(super::coreai_model::FUNCTION, inputs)
            .map_err(asset_err)?;
        let take = |name: &str| out.remove(name).ok_or_else(|| missing(name));
        let states: Vec<&str> = tensors.iter().map(|(t, _)| t.output).collect();
        let shape = PartShape {
            head: part.head,
            per_layer: part
                .outputs
                .iter()
                .any(|o| o.name == chain_file::PER_LAYER_OUT),
            has_cache,
            states: &states,
        };
        shape.collect(
            c,
            take,
            |parts| {
                let parts: Vec<_> = parts.into_iter().map(|(t, w)| (t.to_f32(), w)).collect();
                super::coreai_model::interleave_rows(&parts, c.query_len)
            },
            Hidden::CoreAi,
            aimodel::Tensor::to_f16,
        )
    }

    /// One step of any chain: `recurrent` is a hybrid model's (valid tokens, state in), as
    /// [`StepModel::step_recurrent`] takes them; each part gets its own blocks' slots;
    /// optionally collecting range statistics (the interpreter's parts only: Apple's runtime
    /// reports none). [`Saved::step_with_stats`] is the step without a recurrent state.
    pub fn step_full(
        &self,
        input_ids: &[i32],
        position: usize,
        (key_cache, value_cache): (&[f16], &[f16]),
        recurrent: Option<(usize, &[f16])>,
        mut stats: Option<&mut Stats>,
    ) -> Result<StepOutput, RuntimeError> {
        let c = &self.chain.contract;
        let valid = recurrent.map(|(v, _)| v);
        let pos = check_step(c, input_ids, position, key_cache, value_cache, valid)?;
        let state_len = c.recurrent_len();
        if recurrent.is_some_and(|(_, s)| s.len() != state_len) {
            return Err(RuntimeError::Input {
                name: contract::CONV_STATE.into(),
                msg: format!("a recurrent state of {state_len} values is expected"),
            });
        }
        // Each state tensor's new values, part after part: the host keeps them tensor by tensor.
        let kinds = c.recurrent.as_ref().map_or(0, |r| r.tensors().len());
        let mut new_state: Vec<Vec<f16>> = vec![Vec::new(); kinds];
        let mut hidden: Option<Hidden> = None;
        // Gemma 4: the per-layer inputs the first part computed, for every later part.
        let mut per_layer: Option<Hidden> = None;
        let mut logits = Vec::new();
        let upd = c.num_layers * c.num_kv_heads * c.query_len * c.head_dim;
        let (mut key_update, mut value_update) = (Vec::with_capacity(upd), Vec::with_capacity(upd));
        for i in 0..self.parts.len() {
            let out = self.run_part(
                i,
                (hidden.take(), per_layer.as_ref()),
                input_ids,
                pos,
                (key_cache, value_cache),
                recurrent,
                stats.as_deref_mut(),
            )?;
            for (all, part) in new_state.iter_mut().zip(out.state) {
                all.extend(part);
            }
            hidden = out.hidden;
            if out.per_layer.is_some() {
                per_layer = out.per_layer;
            }
            if self.chain.parts[i].head {
                logits = out.logits;
            }
            if let Some((k, v)) = out.cache {
                key_update.extend(k);
                value_update.extend(v);
            }
        }
        let new_state: Vec<f16> = new_state.concat();
        if logits.len() != c.query_len * c.vocab_size
            || key_update.len() != upd
            || value_update.len() != upd
            || new_state.len() != state_len
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
            recurrent: new_state,
        })
    }
}

/// The runtime name `validate` reports for Core AI assets and chains of them.
const COREAI_RUNTIME: &str = "Apple Core AI runtime (coreai-core)";

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
        let coreai = crate::aimodel::is_aimodel(path)
            || path.extension().is_some_and(|x| x == "aimodel")
            || (chain_file::is_chain(path)
                && ChainFile::read(path).is_ok_and(|c| c.contract.target.is_coreai()));
        let option = if options.compute == Compute::F32 {
            Some("--compute f32")
        } else if options.dense_weights {
            Some("--dense-weights")
        } else {
            None
        };
        if let (true, Some(option)) = (coreai, option) {
            return Err(RuntimeError::NotInterpreted {
                path: path.display().to_string(),
                option,
            });
        }
        // Named an asset, it is loaded as one: a missing or damaged one then says so, not
        // that a package lacks its manifest.
        let named_asset =
            !chain_file::is_chain(path) && path.extension().is_some_and(|x| x == "aimodel");
        if crate::aimodel::is_aimodel(path) || named_asset {
            Ok(Saved::CoreAi(Box::new(CoreAiModel::load(path)?)))
        } else if chain_file::is_chain(path) {
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
            Saved::Chain(c) => c
                .parts
                .iter()
                .filter_map(|p| match p {
                    PartRunner::Mil(program) => Some(program.as_ref()),
                    PartRunner::CoreAi(_) => None,
                })
                .collect(),
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
            Saved::Chain(c) if c.is_coreai() => COREAI_RUNTIME,
            Saved::Package(_) | Saved::Chain(_) => "hf2coreml MIL interpreter",
            Saved::CoreAi(_) => COREAI_RUNTIME,
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
        let caches = (key_cache, value_cache);
        self.step_full(input_ids, position, caches, None, stats)
    }

    /// One step of any model: `recurrent` is a hybrid package's (valid tokens, state in), as
    /// [`StepModel::step_recurrent`] takes them; optionally collecting range statistics.
    pub fn step_full(
        &self,
        input_ids: &[i32],
        position: usize,
        (key_cache, value_cache): (&[f16], &[f16]),
        recurrent: Option<(usize, &[f16])>,
        stats: Option<&mut Stats>,
    ) -> Result<StepOutput, RuntimeError> {
        match (self, recurrent) {
            (Saved::Package(p), _) => {
                let caches = (key_cache, value_cache);
                p.step_full(input_ids, position, caches, recurrent, stats)
            }
            (Saved::Chain(c), _) => {
                let caches = (key_cache, value_cache);
                c.step_full(input_ids, position, caches, recurrent, stats)
            }
            // Apple's runtime reports no per-op ranges.
            (Saved::CoreAi(m), _) => {
                let caches = (key_cache, value_cache);
                m.step_full(input_ids, position, caches, recurrent)
            }
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
        match self {
            Saved::Package(p) => p.state_rows(rows),
            Saved::Chain(_) => Err(RuntimeError::Program("a chain holds no cache state".into())),
            Saved::CoreAi(_) => Err(RuntimeError::Program(
                "a Core AI asset holds no cache state".into(),
            )),
        }
    }

    fn state_recurrent(&self) -> Result<Vec<f16>, RuntimeError> {
        match self {
            Saved::Package(p) => p.state_recurrent(),
            Saved::Chain(_) | Saved::CoreAi(_) => Err(RuntimeError::Program(
                "only a package holds its recurrent state itself".into(),
            )),
        }
    }

    fn restore_state_recurrent(&mut self, values: &[f16]) -> Result<(), RuntimeError> {
        match self {
            Saved::Package(p) => p.restore_state_recurrent(values),
            Saved::Chain(_) | Saved::CoreAi(_) => Err(RuntimeError::Program(
                "only a package holds its recurrent state itself".into(),
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
