//! Neural Engine readiness: `lint` reads any ML Program package (ours, coremltools', ANEMLL's)
//! with the pure-Rust reader and checks it against the rules in [`rules::RULES`]. Nothing runs:
//! the program's declared types, its constants and the package's files are enough.

pub mod rules;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::mil::DType;
use crate::mlpackage::{proto, MlPackage, PackageError, Values};
pub use rules::{rule, Rule, Severity, RULES};

/// The JSON schema id of [`LintReport`] (fields are only ever added).
pub const SCHEMA: &str = "hf2coreml.lint/1";

#[derive(Debug, thiserror::Error)]
pub enum LintError {
    #[error(transparent)]
    Package(#[from] PackageError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unknown rule `{0}`; the rules are: {1}")]
    UnknownRule(String, String),
    #[error(transparent)]
    Chain(#[from] crate::mil::chain_file::ChainFileError),
    #[error(
        "{}: a Core AI asset (or a chain of them): lint checks Core ML programs against the \
         Neural Engine's rules, and Core AI compiles its assets for the device itself \
         (`validate` runs them on Apple's runtime)",
        .0.display()
    )]
    CoreAi(PathBuf),
}

/// What the caller tolerates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    /// Cost-level findings fail too.
    pub deny_cost: bool,
    /// Rules whose findings are dropped.
    pub allow: Vec<String>,
}

impl Policy {
    /// Refuse rule ids that are not in the table.
    pub fn check(&self) -> Result<(), LintError> {
        match self.allow.iter().find(|a| rule(a).is_none()) {
            Some(bad) => Err(LintError::UnknownRule(
                bad.clone(),
                RULES.iter().map(|r| r.id).collect::<Vec<_>>().join(", "),
            )),
            None => Ok(()),
        }
    }
}

/// One finding: a rule broken by one op or value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    pub rule: String,
    pub severity: Severity,
    /// The op type (`linear`), or `input` / `output` / `package` / `weight-file`.
    pub op_type: String,
    /// The value (or file) it concerns.
    pub value: String,
    /// What was found, e.g. `[1, 1, 49152]: W = 49152 > 16384`.
    pub detail: String,
    pub why: String,
    pub fix: String,
    pub source: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    pub error: usize,
    pub fallback: usize,
    pub cost: usize,
}

/// What would stay on the Neural Engine: ops (constants excluded) without an error- or
/// fallback-level finding, and the weight bytes only such ops read. A package-level error or
/// fallback (its size) leaves nothing there.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub ops: usize,
    pub ops_on_neural_engine: usize,
    pub weight_bytes: u64,
    pub weight_bytes_on_neural_engine: u64,
    pub package_bytes: u64,
}

/// The whole result (`lint --json` prints it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LintReport {
    pub schema: String,
    pub package: String,
    pub passed: bool,
    pub deny_cost: bool,
    pub allowed: Vec<String>,
    pub counts: Counts,
    pub summary: Summary,
    pub findings: Vec<Finding>,
}

impl LintReport {
    /// The findings grouped by rule, in table order: (rule, findings).
    pub fn by_rule(&self) -> Vec<(&'static Rule, Vec<&Finding>)> {
        RULES
            .iter()
            .map(|r| (r, self.findings.iter().filter(|f| f.rule == r.id).collect()))
            .filter(|(_, f): &(_, Vec<_>)| !f.is_empty())
            .collect()
    }
}

/// A declared tensor type: dtype and dimensions (`None` where unknown).
#[derive(Debug, Clone)]
struct TypeInfo {
    dtype: Option<DType>,
    dims: Vec<Option<u64>>,
}

fn type_info(vt: Option<&proto::ValueType>) -> Option<TypeInfo> {
    use proto::value_type::Type;
    match vt?.r#type.as_ref()? {
        Type::TensorType(t) => Some(TypeInfo {
            dtype: DType::from_mil(t.data_type),
            dims: t
                .dimensions
                .iter()
                .map(|d| match &d.dimension {
                    Some(proto::dimension::Dimension::Constant(c)) => Some(c.size),
                    _ => None,
                })
                .collect(),
        }),
        Type::StateType(s) => type_info(s.wrapped_type.as_ref()),
        _ => None,
    }
}

fn shape_text(t: &TypeInfo) -> String {
    let d: Vec<String> = t
        .dims
        .iter()
        .map(|d| d.map_or("?".to_string(), |v| v.to_string()))
        .collect();
    format!("[{}]", d.join(", "))
}

fn is_const(op_type: &str) -> bool {
    op_type == "const" || op_type.starts_with("constexpr_")
}

/// Findings as they are collected, with the op they belong to.
struct Collector {
    allow: BTreeSet<String>,
    found: Vec<(Option<usize>, Finding)>,
}

impl Collector {
    fn add(
        &mut self,
        op: Option<usize>,
        id: &'static str,
        op_type: &str,
        value: &str,
        detail: String,
    ) {
        if self.allow.contains(id) {
            return;
        }
        let Some(r) = rule(id) else { return };
        self.found.push((
            op,
            Finding {
                rule: r.id.to_string(),
                severity: r.severity,
                op_type: op_type.to_string(),
                value: value.to_string(),
                detail,
                why: r.why.to_string(),
                fix: r.fix.to_string(),
                source: r.source.to_string(),
            },
        ));
    }
}

/// Lint a package, or every part of a chain (docs/design.md, "Chained packages") as one
/// report: each part is checked on its own (each is a package the device loads alone), the
/// findings name their part, and the counts and sizes are summed.
pub fn lint_saved(path: &Path, policy: &Policy) -> Result<LintReport, LintError> {
    use crate::mil::chain_file::{is_chain, ChainFile};
    if !is_chain(path) {
        return lint(path, policy);
    }
    let chain = ChainFile::read(path)?;
    if chain.contract.target.is_coreai() {
        return Err(LintError::CoreAi(path.to_path_buf()));
    }
    let mut all: Option<LintReport> = None;
    for part in &chain.parts {
        let mut r = lint(&ChainFile::part_path(path, part), policy)?;
        for f in &mut r.findings {
            f.value = format!("{}: {}", part.path, f.value);
        }
        all = Some(match all {
            None => r,
            Some(mut a) => {
                a.passed &= r.passed;
                a.counts.error += r.counts.error;
                a.counts.fallback += r.counts.fallback;
                a.counts.cost += r.counts.cost;
                a.summary.ops += r.summary.ops;
                a.summary.ops_on_neural_engine += r.summary.ops_on_neural_engine;
                a.summary.weight_bytes += r.summary.weight_bytes;
                a.summary.weight_bytes_on_neural_engine += r.summary.weight_bytes_on_neural_engine;
                a.summary.package_bytes += r.summary.package_bytes;
                a.findings.extend(r.findings);
                a
            }
        });
    }
    let mut all = all.ok_or_else(|| {
        LintError::Chain(crate::mil::chain_file::ChainFileError::Invalid {
            path: path.to_path_buf(),
            message: "no parts".into(),
        })
    })?;
    all.package = path.display().to_string();
    Ok(all)
}

/// Lint the package at `path`: every function of it (a multifunction package's other
/// functions add their findings, named `function: value`, to the default function's report;
/// the package's files and its states are checked once).
pub fn lint(path: &Path, policy: &Policy) -> Result<LintReport, LintError> {
    policy.check()?;
    if crate::aimodel::is_aimodel(path) {
        return Err(LintError::CoreAi(path.to_path_buf()));
    }
    let pkg = MlPackage::open(path)?;
    let main = pkg.main_function()?;
    let mut all = lint_function(path, &pkg, main, policy)?;
    for name in pkg.function_names()? {
        if name == main.name {
            continue;
        }
        let r = lint_function(path, &pkg, pkg.function(name)?, policy)?;
        all.passed &= r.passed;
        for mut f in r.findings {
            // Package files and the states (every function declares the same ones; `validate`
            // checks each function's against the contract) are reported once.
            if matches!(f.op_type.as_str(), "package" | "weight-file" | "state") {
                continue;
            }
            match f.severity {
                Severity::Error => all.counts.error += 1,
                Severity::Fallback => all.counts.fallback += 1,
                Severity::Cost => all.counts.cost += 1,
            }
            f.value = format!("{name}: {}", f.value);
            all.findings.push(f);
        }
    }
    Ok(all)
}

fn lint_function(
    path: &Path,
    pkg: &MlPackage,
    main: crate::mlpackage::MainFunction<'_>,
    policy: &Policy,
) -> Result<LintReport, LintError> {
    let mut ops = Vec::new();
    crate::mlpackage::summary::flatten(main.block, &mut ops);
    let mut c = Collector {
        allow: policy.allow.iter().cloned().collect(),
        found: Vec::new(),
    };
    let types = value_types(main.inputs, &ops);
    for input in main.inputs {
        if let Some(t) = type_info(input.r#type.as_ref()) {
            check_value(&mut c, None, "input", &input.name, &t, false);
            check_io_last_axis(&mut c, "input", &input.name, &t);
        }
    }
    for name in &main.block.outputs {
        if let Some(t) = types.get(name.as_str()) {
            check_io_last_axis(&mut c, "output", name, t);
        }
    }
    check_states(&mut c, main.inputs);
    let consumers = consumers(&ops);
    let mut weight_bytes = vec![0u64; ops.len()];
    for (i, op) in ops.iter().enumerate() {
        check_op(&mut c, i, op, &types);
        weight_bytes[i] = scan_constants(&mut c, pkg, i, op)?;
    }
    let package_bytes = check_sizes(&mut c, path)?;
    Ok(report(
        path,
        policy,
        c,
        &ops,
        &consumers,
        &weight_bytes,
        package_bytes,
    ))
}

fn value_types<'a>(
    inputs: &'a [proto::NamedValueType],
    ops: &[&'a proto::Operation],
) -> HashMap<&'a str, TypeInfo> {
    let mut m = HashMap::new();
    let outputs = ops.iter().flat_map(|op| op.outputs.iter());
    for v in inputs.iter().chain(outputs) {
        if let Some(t) = type_info(v.r#type.as_ref()) {
            m.insert(v.name.as_str(), t);
        }
    }
    m
}

/// Value name → the ops that read it.
fn consumers<'a>(ops: &[&'a proto::Operation]) -> HashMap<&'a str, Vec<usize>> {
    let mut m: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        for arg in op.inputs.values() {
            for b in &arg.arguments {
                if let Some(proto::binding::Binding::Name(n)) = &b.binding {
                    m.entry(n.as_str()).or_default().push(i);
                }
            }
        }
    }
    m
}

/// Rank, static shape, dtype and dimension ranges of one value.
fn check_value(
    c: &mut Collector,
    op: Option<usize>,
    op_type: &str,
    name: &str,
    t: &TypeInfo,
    constant: bool,
) {
    let shape = shape_text(t);
    if t.dims.len() > rules::MAX_RANK {
        let detail = format!("{shape}: rank {} > {}", t.dims.len(), rules::MAX_RANK);
        c.add(op, "rank", op_type, name, detail);
    }
    if t.dims.iter().any(Option::is_none) {
        c.add(
            op,
            "dynamic-shape",
            op_type,
            name,
            format!("{shape}: not fixed"),
        );
    }
    match t.dtype {
        Some(d @ (DType::F32 | DType::F64 | DType::BF16)) => {
            c.add(op, "fp32", op_type, name, format!("{} {shape}", d.name()));
        }
        Some(d) if !constant && op.is_some() && computes_int(d) => {
            c.add(
                op,
                "int-compute",
                op_type,
                name,
                format!("{} {shape}", d.name()),
            );
        }
        _ => {}
    }
    if !constant {
        if let Some(detail) = out_of_range(t) {
            c.add(
                op,
                "dimension-range",
                op_type,
                name,
                format!("{shape}: {detail}"),
            );
        }
    }
}

/// Integer or boolean results the Neural Engine does not compute (it has int8 and int16).
fn computes_int(d: DType) -> bool {
    (d.is_int() || d == DType::Bool) && !matches!(d, DType::I8 | DType::I16 | DType::U8)
}

/// The first dimension outside the compiler's range, right-aligned as N, D, C, H, W.
fn out_of_range(t: &TypeInfo) -> Option<String> {
    let limits = rules::DIM_LIMITS.iter().rev();
    for (d, (axis, max)) in t.dims.iter().rev().zip(limits) {
        if let Some(v) = *d {
            if v == 0 || v > *max {
                return Some(format!("{axis} = {v} outside [1, {max}]"));
            }
        }
    }
    None
}

fn check_io_last_axis(c: &mut Collector, kind: &str, name: &str, t: &TypeInfo) {
    let (Some(dtype), Some(Some(last))) = (t.dtype, t.dims.last()) else {
        return;
    };
    let bytes = last * dtype.size_bytes() as u64;
    if bytes < rules::LAST_AXIS_BYTES {
        let detail = format!(
            "{} {}: last axis {last} x {} B = {bytes} B < {} B",
            dtype.name(),
            shape_text(t),
            dtype.size_bytes(),
            rules::LAST_AXIS_BYTES
        );
        c.add(None, "narrow-last-axis", kind, name, detail);
    }
}

/// States (iOS18): their last two dimensions multiples of 32, one shape for all of them.
fn check_states(c: &mut Collector, inputs: &[proto::NamedValueType]) {
    use proto::value_type::Type;
    let mut shapes: Vec<(&str, TypeInfo)> = Vec::new();
    for i in inputs {
        let Some(Type::StateType(_)) = i.r#type.as_ref().and_then(|t| t.r#type.as_ref()) else {
            continue;
        };
        let Some(t) = type_info(i.r#type.as_ref()) else {
            continue;
        };
        let tail = &t.dims[t.dims.len().saturating_sub(2)..];
        let aligned = |d: &Option<u64>| d.is_some_and(|d| d % 32 == 0);
        if !tail.iter().all(aligned) {
            let detail = format!(
                "state {}: last two dimensions not multiples of 32",
                shape_text(&t)
            );
            c.add(None, "state-dims", "state", &i.name, detail);
        }
        if let Some((first, ft)) = shapes.first() {
            if ft.dims != t.dims {
                let detail = format!(
                    "state {} beside `{first}` {}",
                    shape_text(&t),
                    shape_text(ft)
                );
                c.add(None, "state-shapes", "state", &i.name, detail);
            }
        }
        shapes.push((&i.name, t));
    }
}

/// The rules about one op: its outputs' types, its kind, and decomposed norms.
fn check_op(c: &mut Collector, i: usize, op: &proto::Operation, types: &HashMap<&str, TypeInfo>) {
    let kind = op.r#type.as_str();
    let out = op.outputs.first().map_or("", |o| o.name.as_str());
    for o in &op.outputs {
        if let Some(t) = types.get(o.name.as_str()) {
            check_value(c, Some(i), kind, &o.name, t, is_const(kind));
        }
    }
    match kind {
        "gather_nd" => c.add(
            Some(i),
            "gather-nd",
            kind,
            out,
            "gather_nd in the graph".into(),
        ),
        "scaled_dot_product_attention" => c.add(
            Some(i),
            "fused-sdpa",
            kind,
            out,
            "fused attention op".into(),
        ),
        _ => {}
    }
}

/// Flags decomposed norms: a reduction whose result reaches an `rsqrt`/`sqrt` directly or
/// through one `add` (the ε).
fn check_norms(
    c: &mut Collector,
    ops: &[&proto::Operation],
    consumers: &HashMap<&str, Vec<usize>>,
) {
    const REDUCE: &[&str] = &["reduce_mean", "reduce_sum", "reduce_sum_square"];
    const ROOT: &[&str] = &["rsqrt", "sqrt"];
    let readers = |name: &str| consumers.get(name).cloned().unwrap_or_default();
    for (i, op) in ops.iter().enumerate() {
        if !REDUCE.contains(&op.r#type.as_str()) {
            continue;
        }
        let Some(out) = op.outputs.first() else {
            continue;
        };
        let reaches_root = readers(&out.name).into_iter().any(|j| {
            let next = ops[j];
            ROOT.contains(&next.r#type.as_str())
                || next.r#type == "add"
                    && next.outputs.first().is_some_and(|o| {
                        readers(&o.name)
                            .into_iter()
                            .any(|k| ROOT.contains(&ops[k].r#type.as_str()))
                    })
        });
        if reaches_root {
            let detail = format!("{} → {} as separate ops", op.r#type, ROOT.join("/"));
            c.add(Some(i), "decomposed-norm", &op.r#type, &out.name, detail);
        }
    }
}

/// Bytes of weight.bin an op's constants hold; flags -inf (or values below fp16's range) in
/// any constant, immediate or stored.
fn scan_constants(
    c: &mut Collector,
    pkg: &MlPackage,
    i: usize,
    op: &proto::Operation,
) -> Result<u64, LintError> {
    let out = op.outputs.first().map_or("", |o| o.name.as_str());
    let immediates = op
        .inputs
        .values()
        .flat_map(|a| &a.arguments)
        .filter_map(|b| match &b.binding {
            Some(proto::binding::Binding::Value(v)) => Some(v),
            _ => None,
        });
    let mut bytes = 0u64;
    let mut lowest = f32::INFINITY;
    for v in op.attributes.values().chain(immediates) {
        match &v.value {
            Some(proto::value::Value::BlobFileValue(b)) => {
                let file = pkg.blob_file(&b.file_name)?;
                let rec = file.record(b.offset)?;
                bytes += rec.data.len() as u64;
                lowest = lowest.min(lowest_raw(rec.dtype, rec.data));
            }
            Some(proto::value::Value::ImmediateValue(_)) => {
                let is_float = type_info(v.r#type.as_ref())
                    .and_then(|t| t.dtype)
                    .is_some_and(DType::is_float);
                if is_float {
                    if let Values::Float(f) = pkg.value(v, out)?.values {
                        lowest = f.iter().fold(lowest, |m, &x| m.min(x));
                    }
                }
            }
            None => {}
        }
    }
    if lowest < rules::FP16_LOWEST {
        let detail = format!("holds {lowest} (fp16's lowest is {})", rules::FP16_LOWEST);
        c.add(Some(i), "neg-inf", &op.r#type, out, detail);
    }
    Ok(bytes)
}

/// The lowest float in raw little-endian storage (infinity for non-floats).
fn lowest_raw(dtype: DType, data: &[u8]) -> f32 {
    let min = |it: &mut dyn Iterator<Item = f32>| it.fold(f32::INFINITY, f32::min);
    match dtype {
        DType::F16 => min(&mut data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())),
        DType::BF16 => min(&mut data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        DType::F32 => min(&mut data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        _ => f32::INFINITY,
    }
}

/// The package's bytes on disk; flags the iPhone model size and oversized weight files.
fn check_sizes(c: &mut Collector, path: &Path) -> Result<u64, LintError> {
    let mut total = 0u64;
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let io = |source| LintError::Io {
            path: dir.clone(),
            source,
        };
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let meta = entry.file_type().map_err(io)?;
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                let len = entry.metadata().map_err(io)?.len();
                total += len;
                let name = entry.path();
                if name.extension().is_some_and(|e| e == "bin") && len > rules::WEIGHT_FILE_BYTES {
                    let rel = name
                        .strip_prefix(path)
                        .unwrap_or(&name)
                        .display()
                        .to_string();
                    let detail = format!("{len} B > {} B", rules::WEIGHT_FILE_BYTES);
                    c.add(None, "weight-file-size", "weight-file", &rel, detail);
                }
            }
        }
    }
    if total > rules::IPHONE_MODEL_BYTES {
        let detail = format!("{total} B > {} B", rules::IPHONE_MODEL_BYTES);
        c.add(
            None,
            "ios-model-size",
            "package",
            &path.display().to_string(),
            detail,
        );
    }
    Ok(total)
}

fn report(
    path: &Path,
    policy: &Policy,
    mut c: Collector,
    ops: &[&proto::Operation],
    consumers: &HashMap<&str, Vec<usize>>,
    weight_bytes: &[u64],
    package_bytes: u64,
) -> LintReport {
    check_norms(&mut c, ops, consumers);
    let blocking = |s: Severity| s != Severity::Cost;
    let off: BTreeSet<usize> = c
        .found
        .iter()
        .filter(|(op, f)| op.is_some() && blocking(f.severity))
        .filter_map(|(op, _)| *op)
        .collect();
    let package_off = c.found.iter().any(|(op, f)| {
        op.is_none() && f.op_type != "input" && f.op_type != "output" && blocking(f.severity)
    });
    let mut s = Summary {
        package_bytes,
        ..Summary::default()
    };
    for (i, op) in ops.iter().enumerate() {
        if is_const(&op.r#type) {
            s.weight_bytes += weight_bytes[i];
            let readers = op
                .outputs
                .iter()
                .flat_map(|o| consumers.get(o.name.as_str()).into_iter().flatten());
            let mut readers = readers.peekable();
            let used = readers.peek().is_some();
            if used && readers.all(|j| !off.contains(j)) {
                s.weight_bytes_on_neural_engine += weight_bytes[i];
            }
        } else {
            s.ops += 1;
            s.ops_on_neural_engine += usize::from(!off.contains(&i));
        }
    }
    if package_off {
        s.ops_on_neural_engine = 0;
        s.weight_bytes_on_neural_engine = 0;
    }
    let findings: Vec<Finding> = c.found.into_iter().map(|(_, f)| f).collect();
    let count = |sev| findings.iter().filter(|f| f.severity == sev).count();
    let counts = Counts {
        error: count(Severity::Error),
        fallback: count(Severity::Fallback),
        cost: count(Severity::Cost),
    };
    LintReport {
        schema: SCHEMA.to_string(),
        package: path.display().to_string(),
        passed: counts.error + counts.fallback == 0 && (!policy.deny_cost || counts.cost == 0),
        deny_cost: policy.deny_cost,
        allowed: policy.allow.clone(),
        counts,
        summary: s,
        findings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(dims: &[u64]) -> TypeInfo {
        TypeInfo {
            dtype: Some(DType::F16),
            dims: dims.iter().map(|&d| Some(d)).collect(),
        }
    }

    #[test]
    fn dimensions_are_right_aligned_as_ndchw() {
        assert_eq!(out_of_range(&t(&[1, 1, 16_384])), None);
        let w = out_of_range(&t(&[1, 1, 49_152])).unwrap();
        assert!(w.starts_with("W = 49152"), "{w}");
        let h = out_of_range(&t(&[20_000, 64])).unwrap();
        assert!(h.starts_with("H = 20000"), "{h}");
        // C allows 65,536 where H and W allow 16,384.
        assert_eq!(out_of_range(&t(&[60_000, 1, 64])), None);
        assert!(out_of_range(&t(&[70_000, 1, 64]))
            .unwrap()
            .starts_with("C ="));
        assert!(out_of_range(&t(&[0, 64])).is_some());
    }

    #[test]
    fn int8_and_int16_are_neural_engine_types() {
        assert!(!computes_int(DType::I8) && !computes_int(DType::I16));
        assert!(computes_int(DType::I32) && computes_int(DType::Bool));
        assert!(!computes_int(DType::F16));
    }

    #[test]
    fn lowest_raw_sees_negative_infinity_in_fp16() {
        let bytes: Vec<u8> = [0.0f32, -30_000.0, f32::NEG_INFINITY]
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        assert_eq!(lowest_raw(DType::F16, &bytes), f32::NEG_INFINITY);
        assert_eq!(lowest_raw(DType::F16, &bytes[..4]), -30_000.0);
    }
}
