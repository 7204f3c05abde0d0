//! Converting a model too large for one package into a chain (docs/design.md, "Chained
//! packages"): plan the split, build and serialize each part in turn (each released before
//! the next is built), describe the chain, and move the whole directory into place at once,
//! with its sidecars.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Instant;

use super::convert_error::{io_err, ConvertError};
use super::convert_summary::{report_bytes, ConvertSummary, StageTimes};
use super::declared_contract::contract_for;
use super::options::ConvertOptions;
use super::package_files::{
    asset_hashes, asset_weight_bytes, package_hashes, stage_per_layer_table, stage_sidecars,
    weight_bin, Outputs,
};
use super::ranges::scaling_for;
use super::weight_stream::WeightStream;
use crate::arch::{tensor_ids, ModelSpec, TensorId, TensorSlot};
use crate::budget::split::{self as planner, ChainPlan, ModelBytes, PartPlan};
use crate::checkpoint::Checkpoint;
use crate::emit::{EmitReport, Metadata};
use crate::fsutil::{dir_bytes, Staged};
use crate::graph::decoder::{self, Part};
use crate::mil::chain_file::{ChainFile, ChainPart, CHAIN_FILE, CHAIN_FORMAT};
use crate::mil::contract::Contract;
use crate::progress::Progress;

/// The split of this model's weights under `limit` bytes per package.
pub fn plan(
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    weights: &WeightStream<'_>,
    limit: u64,
) -> Result<ChainPlan, ConvertError> {
    let spec = ckpt.spec();
    let per_part = planner::part_overhead_bytes(spec, opts.max_seq_len);
    let bytes = ModelBytes::measure(spec, &ckpt.package_slots(), per_part, |s| weights.bytes(s));
    planner::plan(&bytes, limit).map_err(|source| ConvertError::Chain {
        path: opts.output.clone(),
        source,
    })
}

/// What [`convert_chain`] needs besides the checkpoint and its weights.
pub struct ChainJob {
    pub plan: ChainPlan,
    pub parameters: u64,
    /// The applied recipe, as the contract records it.
    pub recipe: serde_json::Value,
}

/// The checkpoint tensors each part uses, in part order: its blocks', the embedding in the
/// first, the final norm and lm_head in the last, and a tied table in both.
fn part_names(spec: &ModelSpec, slots: &[TensorSlot], plan: &ChainPlan) -> Vec<Vec<String>> {
    let last = plan.parts.len() - 1;
    let mut out: Vec<Vec<String>> = vec![Vec::new(); plan.parts.len()];
    let mut known = HashSet::new();
    for id in tensor_ids(spec) {
        let name = id.hf_name();
        known.insert(name.clone());
        let at = match id {
            TensorId::Layer(l, _) => plan
                .parts
                .iter()
                .position(|p| p.layers.contains(&l))
                .unwrap_or(last),
            TensorId::Embedding
            | TensorId::PerLayerEmbedding
            | TensorId::PerLayerModelProjection
            | TensorId::PerLayerProjectionNorm => 0,
            TensorId::FinalNorm | TensorId::LmHead => last,
        };
        if id == TensorId::Embedding && spec.tie_word_embeddings && last != 0 {
            out[last].push(name.clone());
        }
        out[at].push(name);
    }
    // Anything else has no place in the architecture: the builder of the last part says so.
    let unknown = slots.iter().filter(|s| !known.contains(&s.name));
    out[last].extend(unknown.map(|s| s.name.clone()));
    out
}

/// Convert into a chain of packages at `opts.output` (a directory holding [`CHAIN_FILE`] and
/// the parts), written beside it under a temporary name and renamed into place at the end.
pub fn convert_chain(
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    mut weights: WeightStream<'_>,
    job: ChainJob,
    mut times: StageTimes,
    progress: &dyn Progress,
) -> Result<ConvertSummary, ConvertError> {
    let start = Instant::now();
    let mut outputs = Outputs::for_package(&opts.output)?;
    let spec = ckpt.spec().clone();
    let scaling = scaling_for(opts.precision, opts.ranges.as_ref());
    let sources = (job.recipe, opts.source_hashes(ckpt)?);
    let mut dir = Staged::new(&opts.output, opts.force).map_err(io_err(&opts.output))?;
    // Gemma 4's per-layer table, beside the chain as beside one package.
    let per_layer = stage_per_layer_table(ckpt, opts.per_layer_bits, &mut outputs, &mut dir)?;
    let contract = contract_for(ckpt, opts, &scaling, sources, per_layer)?;
    let model_name = ckpt
        .dir()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let step = opts.step_options(&scaling);
    let n = job.plan.parts.len();
    let mut parts = Vec::with_capacity(n);
    let mut predicted = 0;
    let mut emit = None;
    // One step per palettized tensor and one per part serialized.
    let tensors = weights.report().totals.palettized_tensors as u64;
    progress.begin("convert", tensors + n as u64);
    let names = part_names(&spec, &ckpt.package_slots(), &job.plan);
    for (i, (pp, names)) in job.plan.parts.iter().zip(names).enumerate() {
        progress.working_on(&format!("part {}/{n}: reading and palettizing", i + 1));
        let w = weights.take(&names)?;
        let serializer = if opts.target.is_coreai() {
            "coreai-core"
        } else {
            "coremltools"
        };
        progress.working_on(&format!("part {}/{n}: {serializer}", i + 1));
        let t = Instant::now();
        let graph = decoder::build_part(&spec, w, &step, &graph_part(pp))?;
        predicted += graph.const_bytes();
        times.build += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut part = describe(&contract, &spec, pp, i, opts);
        let meta = Metadata::for_part(&contract, &part, i, n, &model_name)?;
        let path = dir.path().join(&part.path);
        std::fs::create_dir(&path).map_err(io_err(&path))?;
        emit = Some(if opts.target.is_coreai() {
            super::asset_emit::emit_one_asset(graph, &part.outputs, meta, opts, &path)?
        } else {
            crate::emit::emit(graph, &meta, &opts.python_env, &path)?
        });
        crate::fsutil::release_free_memory();
        part.sha256 = if part.is_asset() {
            asset_hashes(&path)?
        } else {
            package_hashes(&path)?
        };
        part.bytes = dir_bytes(&path).map_err(io_err(&path))?;
        parts.push(part);
        times.serialize += t.elapsed().as_secs_f64();
        progress.advance(1);
    }
    progress.end();
    let chain = ChainFile {
        format: CHAIN_FORMAT.to_string(),
        residual_scale: scaling.residual_scale,
        hidden_size: spec.hidden_size,
        contract: contract.clone(),
        parts,
    };
    let chain_path = dir.path().join(CHAIN_FILE);
    let json = serde_json::to_vec_pretty(&chain)?;
    std::fs::write(&chain_path, json).map_err(io_err(&chain_path))?;
    stage_sidecars(ckpt, &mut outputs, &mut dir)?;
    let package_bytes = chain.parts.iter().map(|p| p.bytes).sum();
    let weight_bin_bytes = chain_weight_bytes(dir.path(), &chain)?;
    let streamed = weights.finish();
    times.palettize = streamed.secs;
    times.total = times.read + times.ranges + streamed.fit_secs + start.elapsed().as_secs_f64();
    let mut emit: EmitReport = emit.expect("a chain has parts");
    emit.package = opts.output.clone();
    let summary = ConvertSummary {
        outputs,
        contract,
        package_bytes,
        weight_bin_bytes,
        predicted_weight_bytes: predicted,
        parameters: job.parameters,
        bits_per_weight: weight_bin_bytes as f64 * 8.0 / job.parameters.max(1) as f64,
        times,
        emit,
        tensors: streamed.labels,
        palettize: Some(streamed.report),
        inputs: opts.inputs.clone(),
        source: std::path::absolute(ckpt.dir()).unwrap_or_else(|_| ckpt.dir().to_path_buf()),
        chain: Some(chain),
        dropped: super::inspect::DroppedPart::of(ckpt),
    };
    let report = &summary.outputs.report;
    dir.add_file(report, &report_bytes(&summary)?)
        .map_err(io_err(report))?;
    dir.commit().map_err(io_err(&opts.output))?;
    Ok(summary)
}

fn graph_part(pp: &PartPlan) -> Part {
    Part {
        layers: pp.layers.clone(),
        embedding: pp.embedding,
        head: pp.head,
    }
}

/// Part `i`'s entry in the chain file (hashes and size filled in once it is written).
fn describe(
    c: &Contract,
    spec: &ModelSpec,
    pp: &PartPlan,
    i: usize,
    opts: &ConvertOptions,
) -> ChainPart {
    let before = spec.cache_slots(0..pp.layers.start);
    let slots = before..before + spec.cache_slots(pp.layers.clone());
    let (inputs, outputs) = ChainPart::io(
        c,
        spec.hidden_size,
        (&pp.layers, &slots),
        pp.embedding,
        pp.head,
        opts.precision.as_str(),
    );
    ChainPart {
        path: format!("part-{i}.{}", opts.target.extension()),
        layers: pp.layers.clone(),
        // Recorded, for every part, where the slots are not the blocks one to one.
        slots: (c.recurrent.is_none()
            && (0..spec.num_hidden_layers).any(|l| spec.kv_slots(l) != 1))
        .then_some(slots),
        embedding: pp.embedding,
        head: pp.head,
        inputs,
        outputs,
        sha256: BTreeMap::new(),
        bytes: 0,
    }
}

/// Bytes of every part's weight.bin (a Core AI part's bytecode, which holds its weights).
fn chain_weight_bytes(dir: &Path, chain: &ChainFile) -> Result<u64, ConvertError> {
    let mut total = 0;
    for p in &chain.parts {
        let path = ChainFile::part_path(dir, p);
        if p.is_asset() {
            total += asset_weight_bytes(&path).map_err(io_err(&path))?;
        } else if let Ok(m) = std::fs::metadata(weight_bin(&path)) {
            total += m.len();
        }
    }
    Ok(total)
}
