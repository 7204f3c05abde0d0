//! (a) The contract: the package's (or chain's) declared dimensions, I/O and files against the
//! checkpoint and the chain file, and the checkpoint against the package it is said to be the
//! source of.

use std::path::Path;

use super::report::ContractItem;
use super::validate_error::ValidateError;
use crate::checkpoint::Checkpoint;
use crate::mil::chain_file::{ChainFile, ChainPart};
use crate::mil::contract::{self, Contract};
use crate::mlpackage::MlPackage;

/// Refuse a checkpoint the package was not converted from, before anything is compared: its
/// dimensions differ from the ones the contract records. (A re-saved or imported config with
/// the same model passes; weights that differ are what the gates measure.)
pub(super) fn check_source(
    c: &Contract,
    ckpt: &Checkpoint,
    pkg: &Path,
) -> Result<(), ValidateError> {
    let spec = ckpt.spec();
    let pairs = [
        ("layers", c.num_layers, spec.cache_layers()),
        ("kv heads", c.num_kv_heads, spec.num_key_value_heads),
        ("head_dim", c.head_dim, spec.head_dim),
        ("vocab", c.vocab_size, spec.vocab_size),
    ];
    let differ: Vec<String> = pairs
        .iter()
        .filter(|(_, a, b)| a != b)
        .map(|(k, a, b)| format!("{k} {a} vs {b}"))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(ValidateError::NotFromCheckpoint {
        package: pkg.to_path_buf(),
        checkpoint: ckpt.dir().to_path_buf(),
        differ: differ.join(", "),
    })
}

/// A recurrent state as the report prints it.
fn recurrent_text(r: Option<&contract::Recurrent>) -> String {
    match r {
        None => "none".into(),
        Some(r) => serde_json::to_string(r).unwrap_or_default(),
    }
}

/// Gemma 4's per-layer table: the shape the checkpoint's config makes against the contract's
/// (stored as the contract's dtype says: fp16 or LUT indices), and the file beside the
/// package (`path`) against the hash the contract records.
pub(super) fn per_layer_items(path: &Path, c: &Contract, ckpt: &Checkpoint) -> Vec<ContractItem> {
    let spec = ckpt.spec();
    let shape =
        |rows: usize, layers: usize, width: usize| format!("{rows} rows of {layers}×{width}");
    let expected = match &spec.gemma4 {
        Some(g) if g.per_layer_input > 0 => {
            shape(g.per_layer_vocab, spec.num_hidden_layers, g.per_layer_input)
        }
        _ => "none".into(),
    };
    let found = c
        .per_layer
        .as_ref()
        .map_or("none".into(), |t| shape(t.rows, t.layers, t.width));
    let what = match &c.per_layer {
        Some(t) => format!("per-layer table ({})", t.dtype),
        None => "per-layer table".into(),
    };
    let mut items = vec![item(&what, expected, found)];
    if let Some(t) = &c.per_layer {
        let file = contract::per_layer_file(path);
        let hash = crate::fsutil::sha256_file(&file)
            .unwrap_or_else(|e| format!("{}: {e}", file.display()));
        let name = file.file_name().unwrap_or_default().to_string_lossy();
        items.push(item(
            &format!("per-layer table `{name}` sha256"),
            &t.sha256,
            hash,
        ));
    }
    items
}

pub(super) fn item(what: &str, expected: impl ToString, found: impl ToString) -> ContractItem {
    let (expected, found) = (expected.to_string(), found.to_string());
    ContractItem {
        ok: expected == found,
        what: what.to_string(),
        expected,
        found,
    }
}

/// (a): spec version, contract dimensions against the checkpoint, I/O names, dtypes, shapes.
pub(super) fn check_contract(
    pkg: &MlPackage,
    c: &Contract,
    ckpt: &Checkpoint,
) -> Vec<ContractItem> {
    let spec = ckpt.spec();
    let mut items = vec![
        item(
            &format!("specificationVersion ({})", c.target.as_str()),
            c.target.spec_version(),
            pkg.spec_version(),
        ),
        item("contract version", contract::CONTRACT_VERSION, c.version),
        item("layers", spec.cache_layers(), c.num_layers),
        item("kv heads", spec.num_key_value_heads, c.num_kv_heads),
        item("head_dim", spec.head_dim, c.head_dim),
        item("vocab", spec.vocab_size, c.vocab_size),
        item(
            "recurrent state",
            recurrent_text(spec.recurrent_state(0..spec.num_hidden_layers).as_ref()),
            recurrent_text(c.recurrent.as_ref()),
        ),
    ];
    let float = if c.compute_precision == "fp32" {
        "fp32"
    } else {
        "fp16"
    };
    // An io package has the cache inputs and update outputs; a stateful one (`kv_cache =
    // "state"`) has neither, and its one state instead.
    let (inputs, outputs, states) = c.expected_io(float);
    let desc = pkg.description();
    for (kind, want, have) in [
        ("input", inputs, &desc.inputs),
        ("output", outputs, &desc.outputs),
        ("state", states, &desc.states),
    ] {
        let count = want.len();
        for w in want {
            let found = have.iter().find(|f| f.name == w.name);
            let shape = |s: &[i64]| format!("{s:?}");
            let want_shape: Vec<i64> = w.shape.iter().map(|&d| d as i64).collect();
            items.push(match found {
                Some(f) => item(
                    &format!("{kind} `{}`", w.name),
                    format!("{} {}", w.dtype, shape(&want_shape)),
                    format!("{} {}", f.dtype, shape(&f.shape)),
                ),
                None => item(&format!("{kind} `{}`", w.name), "present", "missing"),
            });
        }
        items.push(item(&format!("{kind} count"), count, have.len()));
    }
    items.push(item(
        "every shape fixed",
        true,
        desc.inputs
            .iter()
            .chain(&desc.outputs)
            .all(|f| !f.shape.is_empty() && f.shape.iter().all(|&d| d > 0)),
    ));
    items
}

/// (a) for a chain: the chain's contract against the checkpoint, then each part's spec
/// version and I/O against the chain file's description of it.
pub(super) fn check_chain(
    chain: &ChainFile,
    pkgs: &[MlPackage],
    ckpt: &Checkpoint,
) -> Vec<ContractItem> {
    let mut items = chain_items(chain, ckpt);
    for (part, pkg) in chain.parts.iter().zip(pkgs) {
        items.extend(check_part(part, pkg, &chain.contract, chain.hidden_size));
    }
    items
}

/// The chain's contract and shape against the checkpoint.
pub(super) fn chain_items(chain: &ChainFile, ckpt: &Checkpoint) -> Vec<ContractItem> {
    let spec = ckpt.spec();
    let c = &chain.contract;
    vec![
        item("contract version", contract::CONTRACT_VERSION, c.version),
        item("layers", spec.cache_layers(), c.num_layers),
        item("kv heads", spec.num_key_value_heads, c.num_kv_heads),
        item("head_dim", spec.head_dim, c.head_dim),
        item("vocab", spec.vocab_size, c.vocab_size),
        item("hidden size", spec.hidden_size, chain.hidden_size),
        item(
            "residual scale",
            c.scaling
                .get("residual_scale")
                .and_then(|v| v.as_f64())
                .unwrap_or(f64::NAN),
            chain.residual_scale,
        ),
    ]
}

/// Each part's files hash as the chain file recorded: the parts are the ones converted together.
pub(super) fn check_hashes(dir: &Path, chain: &ChainFile) -> Vec<ContractItem> {
    let mut items = Vec::new();
    for part in &chain.parts {
        for (file, want) in &part.sha256 {
            let found = match ChainFile::part_file(dir, part, file) {
                Ok(path) => {
                    crate::fsutil::sha256_file(&path).unwrap_or_else(|e| format!("unreadable: {e}"))
                }
                Err(e) => e,
            };
            items.push(item(
                &format!("{}: sha256 of {file}", part.path),
                want,
                found,
            ));
        }
    }
    items
}

/// The inputs and outputs a part of `c` running its layers has, and whether the chain file
/// gives it those (pushed to `items`).
pub(super) fn part_io(
    part: &ChainPart,
    c: &Contract,
    hidden: usize,
    items: &mut Vec<ContractItem>,
) -> (Vec<contract::IoSpec>, Vec<contract::IoSpec>) {
    let p = &part.path;
    let (inputs, outputs) = ChainPart::io(
        c,
        hidden,
        (&part.layers, &part.cache_slots()),
        part.embedding,
        part.head,
        &c.compute_precision,
    );
    items.push(item(
        &format!("{p}: inputs as the chain says"),
        true,
        inputs == part.inputs,
    ));
    items.push(item(
        &format!("{p}: outputs as the chain says"),
        true,
        outputs == part.outputs,
    ));
    (inputs, outputs)
}

/// One part's spec version and I/O names, dtypes and shapes.
fn check_part(part: &ChainPart, pkg: &MlPackage, c: &Contract, hidden: usize) -> Vec<ContractItem> {
    let p = &part.path;
    let mut items = vec![item(
        &format!("{p}: specificationVersion ({})", c.target.as_str()),
        c.target.spec_version(),
        pkg.spec_version(),
    )];
    let (inputs, outputs) = part_io(part, c, hidden, &mut items);
    let desc = pkg.description();
    for (kind, want, have) in [
        ("input", inputs, &desc.inputs),
        ("output", outputs, &desc.outputs),
    ] {
        for w in &want {
            let want_shape: Vec<i64> = w.shape.iter().map(|&d| d as i64).collect();
            let found = have.iter().find(|f| f.name == w.name);
            items.push(match found {
                Some(f) => item(
                    &format!("{p}: {kind} `{}`", w.name),
                    format!("{} {want_shape:?}", w.dtype),
                    format!("{} {:?}", f.dtype, f.shape),
                ),
                None => item(&format!("{p}: {kind} `{}`", w.name), "present", "missing"),
            });
        }
        items.push(item(&format!("{p}: {kind} count"), want.len(), have.len()));
    }
    items
}
