//! One conversion into one package: read → (palettize) → build → serialize, then the sidecar
//! files and the report; a model over the package size limit goes to [`super::convert_chain`]. The
//! command only parses flags and prints.

use std::collections::BTreeMap;
use std::time::Instant;

use super::asset_emit::emit_asset;
use super::convert_chain;
use super::convert_error::{io_err, ConvertError};
use super::convert_summary::{report_bytes, ConvertSummary, StageTimes};
use super::declared_contract::contract_for;
use super::options::ConvertOptions;
use super::package_files::{
    asset_weight_bytes, stage_per_layer_table, stage_sidecars, weight_bin, Outputs,
};
use super::ranges::scaling_for;
use super::weight_stream::WeightStream;
use crate::arch::ModelSpec;
use crate::checkpoint::Checkpoint;
use crate::emit::Metadata;
use crate::fsutil::{dir_bytes, Staged};
use crate::graph::decoder::{self, StepOptions};
use crate::graph::{Graph, Weight};
use crate::mil::contract;
use crate::progress::Progress;

/// Run the conversion. `weights` reads and palettizes each checkpoint tensor when a package
/// needs it (a chain takes them part by part); `recipe` is the applied recipe as recorded in
/// the contract.
pub fn convert(
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    mut weights: WeightStream<'_>,
    recipe: serde_json::Value,
    mut times: StageTimes,
    progress: &dyn Progress,
) -> Result<ConvertSummary, ConvertError> {
    let start = Instant::now();
    let outputs = Outputs::for_package(&opts.output)?;
    if opts.output.exists() && !opts.force {
        return Err(ConvertError::Exists(opts.output.clone()));
    }
    let spec = ckpt.spec().clone();
    let parameters: u64 = ckpt.package_slots().iter().map(|s| s.numel() as u64).sum();
    if let Some(limit) = opts.max_package_size {
        let plan = convert_chain::plan(ckpt, opts, &weights, limit)?;
        if !plan.is_single() {
            // Refused before anything is built: a chain of stateful parts is not supported.
            crate::graph::decoder::check_kv_cache(opts.kv_cache, opts.target, opts.layout, false)?;
            if opts.prefill_len > 0 {
                return Err(ConvertError::PrefillChain {
                    parts: plan.parts.len(),
                });
            }
            let job = convert_chain::ChainJob {
                plan,
                parameters,
                recipe,
            };
            return convert_chain::convert_chain(ckpt, opts, weights, job, times, progress);
        }
    }
    // One package: it is under the size limit, so all its weights are held at once.
    progress.begin(
        "palettize",
        weights.report().totals.palettized_tensors as u64,
    );
    let taken = weights.take_all();
    progress.end();
    let taken = taken?;
    let streamed = weights.finish();
    times.palettize = streamed.secs;
    let (tensors, palettize) = (streamed.labels, Some(streamed.report));

    let t = Instant::now();
    let scaling = scaling_for(opts.precision, opts.ranges.as_ref());
    let step = opts.step_options(&scaling);
    let graphs = build_functions(&spec, taken, &step, opts.prefill_len, opts.prefill_logits)?;
    let predicted_weight_bytes = graphs[0].1.const_bytes();
    let files = opts.source_hashes(ckpt)?;
    let mut outputs = outputs;
    let mut out = Staged::new(&opts.output, opts.force).map_err(io_err(&opts.output))?;
    let per_layer = stage_per_layer_table(ckpt, opts.per_layer_bits, &mut outputs, &mut out)?;
    let contract = contract_for(ckpt, opts, &scaling, (recipe, files), per_layer)?;
    let model_name = ckpt
        .dir()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let meta = Metadata::for_contract(&contract, &model_name)?;
    times.build = t.elapsed().as_secs_f64();

    let t = Instant::now();
    progress.begin("serialize", 1);
    progress.working_on(if opts.target.is_coreai() {
        "coreai-core"
    } else {
        "coremltools"
    });
    let emit = match graphs.len() {
        _ if opts.target.is_coreai() => emit_asset(graphs, &contract, meta, opts, out.path()),
        1 => {
            let (_, graph) = graphs.into_iter().next().expect("one graph");
            crate::emit::emit(graph, &meta, &opts.python_env, out.path())
        }
        _ => crate::emit::emit_functions(
            graphs,
            contract::DECODE,
            &meta,
            &opts.python_env,
            out.path(),
        ),
    };
    if emit.is_ok() {
        progress.advance(1);
    }
    progress.end();
    let mut emit = emit?;
    emit.package = opts.output.clone();
    times.serialize = t.elapsed().as_secs_f64();

    stage_sidecars(ckpt, &mut outputs, &mut out)?;
    let built = out.path();
    let package_bytes = dir_bytes(built).map_err(io_err(&outputs.package))?;
    let weight_bin_bytes = if opts.target.is_coreai() {
        asset_weight_bytes(built).map_err(io_err(&outputs.package))?
    } else {
        let wb = weight_bin(built);
        std::fs::metadata(&wb)
            .map_err(io_err(&weight_bin(&outputs.package)))?
            .len()
    };
    times.total = times.read + times.ranges + streamed.fit_secs + start.elapsed().as_secs_f64();
    let summary = ConvertSummary {
        outputs,
        contract,
        package_bytes,
        weight_bin_bytes,
        predicted_weight_bytes,
        parameters,
        bits_per_weight: weight_bin_bytes as f64 * 8.0 / parameters.max(1) as f64,
        times,
        emit,
        tensors,
        palettize,
        inputs: opts.inputs.clone(),
        source: std::path::absolute(ckpt.dir()).unwrap_or_else(|_| ckpt.dir().to_path_buf()),
        chain: None,
        dropped: super::inspect::DroppedPart::of(ckpt),
    };
    let report = &summary.outputs.report;
    out.add_file(report, &report_bytes(&summary)?)
        .map_err(io_err(report))?;
    out.commit().map_err(io_err(&opts.output))?;
    Ok(summary)
}

/// The program's functions: `main` alone, or with `prefill_len` > 0 `prefill` (Q =
/// `prefill_len`, the logits rows `prefill_logits` says) and `decode` (Q = `step.query_len`),
/// built from the same weights. The decode graph is built from a copy of them, so they are
/// held twice while the graphs are built; the emitter hands every constant the two share to
/// coremltools once.
fn build_functions(
    spec: &ModelSpec,
    weights: BTreeMap<String, Weight>,
    step: &StepOptions,
    prefill_len: usize,
    prefill_logits: contract::PrefillLogits,
) -> Result<Vec<(String, Graph)>, ConvertError> {
    if prefill_len == 0 {
        return Ok(vec![(
            "main".to_string(),
            decoder::build(spec, weights, step)?,
        )]);
    }
    let decode = decoder::build(spec, weights.clone(), step)?;
    let prefill_step = StepOptions {
        query_len: prefill_len,
        last_logits_only: prefill_logits == contract::PrefillLogits::Last,
        ..step.clone()
    };
    let prefill = decoder::build(spec, weights, &prefill_step)?;
    Ok(vec![
        (contract::PREFILL.to_string(), prefill),
        (contract::DECODE.to_string(), decode),
    ])
}
