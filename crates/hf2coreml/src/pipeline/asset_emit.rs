//! Writing a conversion's graphs as a Core AI asset (`--target coreai`): one function or
//! several, or one part of a chain, with the metadata recording the fewest bits of any
//! palettized weight.

use super::options::ConvertOptions;
use crate::emit::{EmitError, EmitReport, Metadata};
use crate::graph::Graph;
use crate::mil::contract;

/// Serialize the graphs (`main`, or `prefill` and `decode`) as a Core AI asset: the
/// contract's outputs (each function's) name their results, and the metadata records the
/// fewest bits of any palettized weight (the asset is not read back, and `validate` picks its
/// default gates by it). Written into `into`.
pub(super) fn emit_asset(
    graphs: Vec<(String, Graph)>,
    contract: &contract::Contract,
    meta: Metadata,
    opts: &ConvertOptions,
    into: &std::path::Path,
) -> Result<EmitReport, EmitError> {
    if graphs.len() == 1 {
        let (_, graph) = graphs.into_iter().next().expect("one graph");
        return emit_one_asset(graph, &contract.outputs, meta, opts, into);
    }
    let meta = with_min_bits(meta, graphs.iter().map(|(_, g)| g));
    let r = {
        let functions = graphs
            .into_iter()
            .map(|(name, graph)| {
                let f = contract.for_function(&name).ok_or_else(|| {
                    EmitError::Protocol(format!("the contract lists no function `{name}`"))
                })?;
                Ok((name, graph, f.outputs))
            })
            .collect::<Result<Vec<_>, EmitError>>()?;
        crate::emit::coreai::emit_coreai_functions(functions, &meta, &opts.python_env, into)?
    };
    Ok(asset_report(r))
}

/// Serialize one graph (a model's `main`, or a chain part) whose outputs are `outputs` as a
/// Core AI asset in `into`, in native arithmetic.
pub(super) fn emit_one_asset(
    graph: Graph,
    outputs: &[contract::IoSpec],
    meta: Metadata,
    opts: &ConvertOptions,
    into: &std::path::Path,
) -> Result<EmitReport, EmitError> {
    let meta = with_min_bits(meta, [&graph]);
    let r = crate::emit::coreai::emit_coreai(
        graph,
        outputs,
        &meta,
        &opts.python_env,
        into,
        crate::emit::coreai::Arithmetic::Native,
    )?;
    Ok(asset_report(r))
}

/// The metadata, recording the fewest bits of any palettized weight of `graphs` (absent when
/// every weight is fp16).
fn with_min_bits<'g>(mut meta: Metadata, graphs: impl IntoIterator<Item = &'g Graph>) -> Metadata {
    if let Some(bits) = graphs.into_iter().filter_map(Graph::min_lut_bits).min() {
        meta.user_defined.insert(
            crate::runtime::coreai_model::MIN_BITS_KEY.to_string(),
            bits.to_string(),
        );
    }
    meta
}

fn asset_report(r: crate::emit::coreai::CoreAiReport) -> EmitReport {
    EmitReport {
        package: r.asset,
        coremltools_version: String::new(),
        coreai_version: Some(r.coreai_version),
        specification_version: 0,
        op_counts: r.op_counts,
        python_env: r.python_env,
    }
}
