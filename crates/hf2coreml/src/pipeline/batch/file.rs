//! Batch files: a `[defaults]` table and `[[export]]` entries, expanded into one export per
//! combination of their list-valued keys (models × recipes × devices × lengths). Parsing and
//! expansion only; [`super::runner`] runs the exports.
//!
//! ```toml
//! [defaults]
//! model = "${HF2COREML_MODEL_DIR}"
//! validate = true
//!
//! [[export]]
//! output = "out/smollm2-s{max_seq_len}-{device}-{recipe}.mlpackage"
//! max_seq_len = [512, 2048]
//! device = ["iphone-15", "iphone-16-pro"]
//! recipe = ["default", "compact"]
//! ```
//!
//! Relative paths resolve against the batch file's folder; `~/` and `${VAR}` expand. Unknown
//! keys and ill-typed values are errors that give the line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use toml::Spanned;

use crate::pipeline::options::ComputePrecision;
use crate::quant::recipe::RecipeFile;
use crate::quant::Recipe;
use crate::validate::gates::Gate;

/// Most exports one file may expand to: a typo in a list should not queue a week of work.
pub const MAX_EXPORTS: usize = 10_000;

#[derive(Debug, Error)]
pub enum BatchError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// TOML syntax, unknown keys, wrong types: the message carries line and column.
    #[error("{}: {message}", path.display())]
    Toml { path: PathBuf, message: String },
    #[error("{}:{line}: {message}", path.display())]
    Invalid {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
}

/// The recipe of an export.
#[derive(Debug, Clone, PartialEq)]
pub enum RecipeSource {
    /// The tool's default recipe (no `recipe` key).
    Default,
    /// A shipped recipe by name.
    Builtin(String),
    /// A recipe file.
    File(PathBuf),
    /// Rules written in the batch file; `origin` names the entry.
    Inline { toml: String, origin: String },
}

impl RecipeSource {
    /// The recipe itself, with the package options it sets.
    pub fn load(&self) -> Result<RecipeFile, crate::quant::QuantError> {
        match self {
            RecipeSource::Default => Ok(RecipeFile::default()),
            RecipeSource::Builtin(name) => RecipeFile::from_file_or_name(Path::new(name)),
            RecipeSource::File(path) => RecipeFile::from_file(path),
            RecipeSource::Inline { toml, origin } => RecipeFile::parse(toml, origin),
        }
    }

    /// How reports name it.
    pub fn describe(&self) -> String {
        match self {
            RecipeSource::Default => "default".into(),
            RecipeSource::Builtin(n) => n.clone(),
            RecipeSource::File(p) => p.display().to_string(),
            RecipeSource::Inline { origin, .. } => origin.clone(),
        }
    }
}

impl Serialize for RecipeSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.describe())
    }
}

/// What to check after converting.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValidateSpec {
    /// Explicit gates (empty: the defaults for the recipe's kind).
    pub gates: Vec<String>,
    pub max_tokens: Option<usize>,
    /// Evaluation text (default: the shipped one).
    pub text: Option<PathBuf>,
}

/// One export: everything `convert` (+ `validate`) needs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Export {
    /// Unique within the file: the `name` template, or the output's stem.
    pub name: String,
    /// Position in the expanded list (0-based): shards and reports keep this order.
    pub index: usize,
    /// Line of the `[[export]]` entry it came from.
    pub line: usize,
    pub model: PathBuf,
    pub output: PathBuf,
    pub max_seq_len: usize,
    pub query_len: usize,
    pub recipe: RecipeSource,
    pub device: Option<String>,
    pub compute_precision: ComputePrecision,
    pub calibration: Option<PathBuf>,
    pub increased_memory_limit: bool,
    pub allow_over_budget: bool,
    /// The largest package before the model is split into a chain (`--max-package-size`);
    /// none: the device's limit, else 1 GB.
    pub max_package_size: Option<u64>,
    pub validate: Option<ValidateSpec>,
}

/// A parsed and expanded batch file.
#[derive(Debug, Clone)]
pub struct BatchFile {
    pub path: PathBuf,
    pub exports: Vec<Export>,
}

/// `I/N`: the I-th of N shards (1-based), a deterministic round-robin slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl std::str::FromStr for Shard {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}`: a shard is I/N with 1 <= I <= N, e.g. 2/4");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let index: usize = i.trim().parse().map_err(|_| bad())?;
        let count: usize = n.trim().parse().map_err(|_| bad())?;
        if count == 0 || index == 0 || index > count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl Shard {
    /// Export `i` (0-based, in file order) belongs to shard `i mod N + 1`: every export lands
    /// in exactly one shard, and shards differ in size by at most one.
    pub fn contains(&self, i: usize) -> bool {
        i % self.count + 1 == self.index
    }
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    defaults: Option<Spanned<RawEntry>>,
    #[serde(default)]
    export: Vec<Spanned<RawEntry>>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    name: Option<Spanned<String>>,
    model: Option<Spanned<toml::Value>>,
    output: Option<Spanned<String>>,
    max_seq_len: Option<Spanned<toml::Value>>,
    query_len: Option<Spanned<toml::Value>>,
    recipe: Option<Spanned<toml::Value>>,
    device: Option<Spanned<toml::Value>>,
    compute_precision: Option<Spanned<String>>,
    calibration: Option<Spanned<String>>,
    increased_memory_limit: Option<Spanned<bool>>,
    allow_over_budget: Option<Spanned<bool>>,
    max_package_size: Option<Spanned<toml::Value>>,
    validate: Option<Spanned<toml::Value>>,
}

impl RawEntry {
    /// This entry's keys, falling back to `defaults` key by key.
    fn over(self, d: &RawEntry) -> RawEntry {
        RawEntry {
            name: self.name.or_else(|| d.name.clone()),
            model: self.model.or_else(|| d.model.clone()),
            output: self.output.or_else(|| d.output.clone()),
            max_seq_len: self.max_seq_len.or_else(|| d.max_seq_len.clone()),
            query_len: self.query_len.or_else(|| d.query_len.clone()),
            recipe: self.recipe.or_else(|| d.recipe.clone()),
            device: self.device.or_else(|| d.device.clone()),
            compute_precision: self
                .compute_precision
                .or_else(|| d.compute_precision.clone()),
            calibration: self.calibration.or_else(|| d.calibration.clone()),
            increased_memory_limit: self
                .increased_memory_limit
                .or_else(|| d.increased_memory_limit.clone()),
            allow_over_budget: self
                .allow_over_budget
                .or_else(|| d.allow_over_budget.clone()),
            max_package_size: self.max_package_size.or_else(|| d.max_package_size.clone()),
            validate: self.validate.or_else(|| d.validate.clone()),
        }
    }
}

/// Parses values with the file's text at hand, so errors can give lines.
struct Ctx<'a> {
    path: &'a Path,
    dir: &'a Path,
    text: &'a str,
}

impl Ctx<'_> {
    fn line(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    fn err<T>(
        &self,
        span: std::ops::Range<usize>,
        message: impl Into<String>,
    ) -> Result<T, BatchError> {
        Err(BatchError::Invalid {
            path: self.path.to_path_buf(),
            line: self.line(span.start),
            message: message.into(),
        })
    }

    /// `~/`, `${VAR}`, then relative to the batch file's folder.
    fn path(
        &self,
        raw: &str,
        span: std::ops::Range<usize>,
        key: &str,
    ) -> Result<PathBuf, BatchError> {
        let mut out = String::new();
        let mut rest = raw;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find('}') else {
                return self.err(
                    span,
                    format!("{key}: `${{` without a closing `}}` in `{raw}`"),
                );
            };
            let var = &after[..end];
            match std::env::var(var) {
                Ok(v) if !v.is_empty() => out.push_str(&v),
                _ => {
                    return self.err(
                        span,
                        format!("{key}: environment variable {var} is not set (in `{raw}`)"),
                    )
                }
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        let expanded = match out.strip_prefix("~/") {
            Some(tail) => match std::env::var_os("HOME") {
                Some(home) => PathBuf::from(home).join(tail),
                None => return self.err(span, format!("{key}: `~` but HOME is not set")),
            },
            None => PathBuf::from(out),
        };
        if expanded.as_os_str().is_empty() {
            return self.err(span, format!("{key}: empty path"));
        }
        Ok(if expanded.is_absolute() {
            expanded
        } else {
            self.dir.join(expanded)
        })
    }

    /// A model: a path as [`Ctx::path`] reads it, or a Hub id kept as written when no such
    /// path exists beside the batch file and the local Hub cache holds it (the job resolves it
    /// there again). A path that is neither stays a path, for the error to name.
    fn model_path(&self, raw: &str, span: std::ops::Range<usize>) -> Result<PathBuf, BatchError> {
        let path = self.path(raw, span, "model")?;
        let cached = || {
            let roots = crate::checkpoint::hub::cache_roots();
            matches!(crate::checkpoint::hub::resolve_in(&roots, raw), Some(Ok(_)))
        };
        Ok(if !raw.contains("${") && !path.exists() && cached() {
            PathBuf::from(raw)
        } else {
            path
        })
    }

    /// A value or a list of values: the list's items, each checked by `one`.
    fn list<T>(
        &self,
        value: &Spanned<toml::Value>,
        key: &str,
        what: &str,
        one: impl Fn(&toml::Value) -> Option<T>,
    ) -> Result<Vec<T>, BatchError> {
        let items: Vec<&toml::Value> = match value.get_ref() {
            toml::Value::Array(a) => a.iter().collect(),
            v => vec![v],
        };
        if items.is_empty() {
            return self.err(
                value.span(),
                format!("{key}: an empty list exports nothing"),
            );
        }
        items
            .into_iter()
            .map(|v| match one(v) {
                Some(t) => Ok(t),
                None => self.err(
                    value.span(),
                    format!("{key}: expected {what} or a list of them, found `{v}`"),
                ),
            })
            .collect()
    }

    /// `max_package_size`: a size as `--max-package-size` takes it (`"1GiB"`, `"900 MB"`) or a
    /// byte count, at least 1 byte.
    fn package_size(&self, value: &Spanned<toml::Value>) -> Result<u64, BatchError> {
        let bytes = match value.get_ref() {
            toml::Value::String(s) => {
                crate::budget::parse_size(s).and_then(|b| crate::budget::package_size(b, s))
            }
            toml::Value::Integer(n) => {
                crate::budget::package_size(u64::try_from(*n).unwrap_or(0), &n.to_string())
            }
            other => {
                return self.err(
                    value.span(),
                    format!(
                        "max_package_size: expected a size such as \"1GiB\" or a byte count, \
                         found `{other}`"
                    ),
                )
            }
        };
        bytes.or_else(|e| self.err(value.span(), format!("max_package_size: {e}")))
    }

    fn sizes(&self, value: &Spanned<toml::Value>, key: &str) -> Result<Vec<usize>, BatchError> {
        let v = self.list(value, key, "a positive integer", |v| {
            v.as_integer().and_then(|i| usize::try_from(i).ok())
        })?;
        if let Some(bad) = v.iter().find(|&&n| n == 0 || n > MAX_LENGTH) {
            return self.err(
                value.span(),
                format!("{key}: {bad} is not a usable length (1 to {MAX_LENGTH})"),
            );
        }
        Ok(v)
    }

    /// Recipes: names of shipped ones, files, or inline tables (with an optional `name` for
    /// output templates). Returns (label, source) pairs.
    fn recipes(
        &self,
        value: &Spanned<toml::Value>,
        entry_line: usize,
    ) -> Result<Vec<(String, RecipeSource)>, BatchError> {
        let items = self.list(value, "recipe", "a recipe name, file or table", |v| {
            matches!(v, toml::Value::String(_) | toml::Value::Table(_)).then(|| v.clone())
        })?;
        let mut out = Vec::new();
        for (i, item) in items.into_iter().enumerate() {
            match item {
                toml::Value::String(s) => {
                    let local = self.dir.join(&s);
                    if Recipe::builtin(&s).is_some() && !local.exists() {
                        out.push((s.clone(), RecipeSource::Builtin(s)));
                    } else {
                        let path = self.path(&s, value.span(), "recipe")?;
                        let label = path
                            .file_stem()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_else(|| "recipe".into());
                        out.push((label, RecipeSource::File(path)));
                    }
                }
                toml::Value::Table(mut t) => {
                    let label = match t.remove("name") {
                        Some(toml::Value::String(n)) => n,
                        Some(other) => {
                            return self.err(
                                value.span(),
                                format!("recipe.name: expected a string, found `{other}`"),
                            )
                        }
                        None => format!("inline{}", i + 1),
                    };
                    let origin = format!(
                        "{}:{entry_line} (inline recipe `{label}`)",
                        self.path.display()
                    );
                    let toml = toml::to_string(&t).map_err(|e| BatchError::Invalid {
                        path: self.path.to_path_buf(),
                        line: self.line(value.span().start),
                        message: format!("recipe: {e}"),
                    })?;
                    // Check the rules now, so a typo fails the file before any export runs.
                    if let Err(e) = Recipe::parse(&toml, &origin) {
                        return self.err(value.span(), format!("recipe: {e}"));
                    }
                    out.push((label, RecipeSource::Inline { toml, origin }));
                }
                _ => unreachable!("filtered by list()"),
            }
        }
        Ok(out)
    }

    fn validate(&self, value: &Spanned<toml::Value>) -> Result<Option<ValidateSpec>, BatchError> {
        let table = match value.get_ref() {
            toml::Value::Boolean(false) => return Ok(None),
            toml::Value::Boolean(true) => {
                return Ok(Some(ValidateSpec {
                    gates: Vec::new(),
                    max_tokens: None,
                    text: None,
                }))
            }
            toml::Value::Table(t) => t,
            other => {
                return self.err(
                    value.span(),
                    format!("validate: expected true, false or a table, found `{other}`"),
                )
            }
        };
        let mut spec = ValidateSpec {
            gates: Vec::new(),
            max_tokens: None,
            text: None,
        };
        for (key, v) in table {
            match (key.as_str(), v) {
                ("gates", toml::Value::Array(items)) => {
                    for g in items {
                        let Some(s) = g.as_str() else {
                            return self.err(
                                value.span(),
                                format!("validate.gates: `{g}` is not a string"),
                            );
                        };
                        if let Err(e) = s.parse::<Gate>() {
                            return self.err(value.span(), format!("validate.gates: {e}"));
                        }
                        spec.gates.push(s.to_string());
                    }
                }
                ("max_tokens", toml::Value::Integer(n)) if *n > 0 => {
                    spec.max_tokens = Some(*n as usize);
                }
                ("text", toml::Value::String(s)) => {
                    spec.text = Some(self.path(s, value.span(), "validate.text")?);
                }
                ("gates" | "max_tokens" | "text", v) => {
                    return self.err(
                        value.span(),
                        format!("validate.{key}: unexpected value `{v}`"),
                    );
                }
                _ => {
                    return self.err(
                        value.span(),
                        format!("validate: unknown key `{key}` (known: gates, max_tokens, text)"),
                    )
                }
            }
        }
        Ok(Some(spec))
    }
}

/// Longest max_seq_len / query_len a batch file may ask for.
const MAX_LENGTH: usize = 1 << 20;

/// A template (`output`, `name`) that cannot be filled.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FillError {
    #[error("`{{` without `}}` in `{template}`")]
    Unclosed { template: String },
    #[error(
        "unknown placeholder `{{{key}}}` in `{template}` (known: {})",
        braced(known)
    )]
    Unknown {
        key: String,
        template: String,
        known: Vec<String>,
    },
}

/// `{a}, {b}`: placeholders as written in a template.
fn braced(keys: &[String]) -> String {
    keys.iter()
        .map(|k| format!("{{{k}}}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The output template's placeholders and their values for one combination.
fn fill(template: &str, vars: &BTreeMap<&str, String>) -> Result<String, FillError> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let end = after.find('}').ok_or_else(|| FillError::Unclosed {
            template: template.to_string(),
        })?;
        let key = &after[..end];
        let value = vars.get(key).ok_or_else(|| FillError::Unknown {
            key: key.to_string(),
            template: template.to_string(),
            known: vars.keys().map(|k| k.to_string()).collect(),
        })?;
        out.push_str(value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// What a path is called in names: a directory's name, a file's stem, a Hub id's name.
fn stem(p: &Path) -> String {
    let hub_name = p
        .to_str()
        .filter(|_| !p.exists())
        .and_then(crate::checkpoint::hub::parse_id);
    if let Some((_, name, _)) = hub_name {
        return name.to_string();
    }
    let name = if p.is_dir() {
        p.file_name()
    } else {
        p.file_stem()
    };
    name.map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// One entry's keys, checked: the lists it expands over and the values every export shares.
struct Axes<'e> {
    models: Vec<PathBuf>,
    output: &'e Spanned<String>,
    lengths: Vec<usize>,
    queries: Vec<usize>,
    recipes: Vec<(String, RecipeSource)>,
    devices: Vec<Option<String>>,
    precision: ComputePrecision,
    calibration: Option<PathBuf>,
    package_size: Option<u64>,
    validate: Option<ValidateSpec>,
}

impl Axes<'_> {
    fn combinations(&self) -> usize {
        self.models.len()
            * self.recipes.len()
            * self.devices.len()
            * self.lengths.len()
            * self.queries.len()
    }
}

impl Ctx<'_> {
    /// Check an entry's keys (with its defaults applied), in the order they are reported.
    fn axes<'e>(
        &self,
        e: &'e RawEntry,
        span: std::ops::Range<usize>,
        line: usize,
    ) -> Result<Axes<'e>, BatchError> {
        let models = match &e.model {
            Some(v) => self
                .list(v, "model", "a path", |v| v.as_str().map(str::to_string))?
                .into_iter()
                .map(|m| self.model_path(&m, v.span()))
                .collect::<Result<Vec<_>, _>>()?,
            None => return self.err(span, "`model` is missing (in the entry or [defaults])"),
        };
        let Some(output) = &e.output else {
            return self.err(span, "`output` is missing (in the entry or [defaults])");
        };
        let lengths = match &e.max_seq_len {
            Some(v) => self.sizes(v, "max_seq_len")?,
            None => vec![512],
        };
        let queries = match &e.query_len {
            Some(v) => self.sizes(v, "query_len")?,
            None => vec![1],
        };
        let recipes = match &e.recipe {
            Some(v) => self.recipes(v, line)?,
            None => vec![("default".to_string(), RecipeSource::Default)],
        };
        let devices: Vec<Option<String>> = match &e.device {
            Some(v) => self
                .list(v, "device", "a device name", |v| {
                    v.as_str().map(str::to_string)
                })?
                .into_iter()
                .map(Some)
                .collect(),
            None => vec![None],
        };
        let precision = match &e.compute_precision {
            None => ComputePrecision::Fp16,
            Some(p) => match p.get_ref().as_str() {
                "fp16" => ComputePrecision::Fp16,
                "fp32" => ComputePrecision::Fp32,
                other => {
                    return self.err(
                        p.span(),
                        format!("compute_precision: `{other}` (expected fp16 or fp32)"),
                    )
                }
            },
        };
        let calibration = match &e.calibration {
            Some(c) => Some(self.path(c.get_ref(), c.span(), "calibration")?),
            None => None,
        };
        let package_size = match &e.max_package_size {
            Some(v) => Some(self.package_size(v)?),
            None => None,
        };
        let validate = match &e.validate {
            Some(v) => self.validate(v)?,
            None => None,
        };
        Ok(Axes {
            models,
            output,
            lengths,
            queries,
            recipes,
            devices,
            precision,
            calibration,
            package_size,
            validate,
        })
    }

    /// Append one export per combination of an entry's lists, in file order.
    fn expand(
        &self,
        e: &RawEntry,
        axes: &Axes<'_>,
        line: usize,
        exports: &mut Vec<Export>,
    ) -> Result<(), BatchError> {
        let flag = |b: &Option<Spanned<bool>>| b.as_ref().is_some_and(|b| *b.get_ref());
        for model in &axes.models {
            for (recipe_label, recipe) in &axes.recipes {
                for device in &axes.devices {
                    for &max_seq_len in &axes.lengths {
                        for &query_len in &axes.queries {
                            let vars = BTreeMap::from([
                                ("model", stem(model)),
                                ("recipe", recipe_label.clone()),
                                ("device", device.clone().unwrap_or_else(|| "any".into())),
                                ("max_seq_len", max_seq_len.to_string()),
                                ("query_len", query_len.to_string()),
                                ("compute_precision", axes.precision.as_str().to_string()),
                            ]);
                            let (name, output) = self.names(e, axes.output, &vars)?;
                            exports.push(Export {
                                name,
                                index: exports.len(),
                                line,
                                model: model.clone(),
                                output,
                                max_seq_len,
                                query_len,
                                recipe: recipe.clone(),
                                device: device.clone(),
                                compute_precision: axes.precision,
                                calibration: axes.calibration.clone(),
                                increased_memory_limit: flag(&e.increased_memory_limit),
                                allow_over_budget: flag(&e.allow_over_budget),
                                max_package_size: axes.package_size,
                                validate: axes.validate.clone(),
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// An export's name and output path: the templates filled; without a `name` template,
    /// the output's stem.
    fn names(
        &self,
        e: &RawEntry,
        output: &Spanned<String>,
        vars: &BTreeMap<&str, String>,
    ) -> Result<(String, PathBuf), BatchError> {
        let out = fill(output.get_ref(), vars)
            .or_else(|m| self.err(output.span(), format!("output: {m}")))?;
        let output_path = self.path(&out, output.span(), "output")?;
        let name = match &e.name {
            Some(n) => {
                fill(n.get_ref(), vars).or_else(|m| self.err(n.span(), format!("name: {m}")))?
            }
            None => {
                let file = output_path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                file.strip_suffix(".mlpackage")
                    .or_else(|| file.strip_suffix(".aimodel"))
                    .unwrap_or(&file)
                    .to_string()
            }
        };
        Ok((name, output_path))
    }
}

/// Largest batch file read (a regular file; real ones are a few kB).
pub const MAX_BATCH_FILE_BYTES: u64 = 1 << 20;

impl BatchFile {
    /// Every export's model is there (a checkpoint directory or a .gguf file): what `--list`
    /// checks, so a CI matrix is never built from exports that cannot run. The first missing
    /// one is the error, with its entry's line.
    pub fn check_models<'a>(
        &self,
        exports: impl IntoIterator<Item = &'a Export>,
    ) -> Result<(), BatchError> {
        for e in exports {
            let found = crate::checkpoint::resolve_source(&e.model).map(|p| p.exists());
            let why = match found {
                Ok(true) => continue,
                Ok(false) => "no such checkpoint directory or file".to_string(),
                Err(err) => err.to_string(),
            };
            return Err(BatchError::Invalid {
                path: self.path.clone(),
                line: e.line,
                message: format!("export `{}`: model {}: {why}", e.name, e.model.display()),
            });
        }
        Ok(())
    }

    /// Read, check and expand a batch file.
    pub fn load(path: &Path) -> Result<BatchFile, BatchError> {
        let text =
            crate::fsutil::read_input_text(path, MAX_BATCH_FILE_BYTES).map_err(|source| {
                BatchError::Read {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
        Self::parse(path, &text)
    }

    /// Parse `text` as if read from `path` (relative paths resolve against its folder).
    pub fn parse(path: &Path, text: &str) -> Result<BatchFile, BatchError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| BatchError::Toml {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        // A file in the working directory has the empty parent: its relative paths stay as
        // written.
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let cx = Ctx {
            path,
            dir: &dir,
            text,
        };
        if raw.export.is_empty() {
            return Err(BatchError::File {
                path: path.to_path_buf(),
                message: "no [[export]] entries".into(),
            });
        }
        let defaults = raw.defaults.map(Spanned::into_inner).unwrap_or_default();
        let mut exports: Vec<Export> = Vec::new();
        for entry in raw.export {
            let line = cx.line(entry.span().start);
            let span = entry.span();
            let e = entry.into_inner().over(&defaults);
            let axes = cx.axes(&e, span.clone(), line)?;
            if exports.len() + axes.combinations() > MAX_EXPORTS {
                return cx.err(span, format!("more than {MAX_EXPORTS} exports"));
            }
            cx.expand(&e, &axes, line, &mut exports)?;
        }
        check_unique(path, &exports)?;
        Ok(BatchFile {
            path: path.to_path_buf(),
            exports,
        })
    }

    /// The exports a shard and a name filter select, in file order.
    pub fn select(
        &self,
        shard: Option<Shard>,
        only: &[String],
    ) -> Result<Vec<&Export>, BatchError> {
        let known: BTreeSet<&str> = self.exports.iter().map(|e| e.name.as_str()).collect();
        if let Some(missing) = only.iter().find(|n| !known.contains(n.as_str())) {
            return Err(BatchError::File {
                path: self.path.clone(),
                message: format!(
                    "--only {missing}: no such export (see `hf2coreml batch {} --list`)",
                    self.path.display()
                ),
            });
        }
        Ok(self
            .exports
            .iter()
            .filter(|e| shard.is_none_or(|s| s.contains(e.index)))
            .filter(|e| only.is_empty() || only.contains(&e.name))
            .collect())
    }
}

/// A path one export writes: its package or one of the sidecars beside it.
struct Written<'e> {
    export: &'e Export,
    /// Resolved (`o/./x/../a` and a symlinked folder name the same place).
    path: PathBuf,
    /// The package this path belongs to (the export's output), for the messages.
    package: &'e Path,
    /// The path is the package itself, not a sidecar.
    is_package: bool,
}

/// Every path `e` writes, resolved: the package (first) and the sidecars named after it (the
/// tokenizer, its config, the report, a per-layer table, and the validation when it
/// validates).
fn written(e: &Export) -> Vec<PathBuf> {
    let mut paths = vec![e.output.clone()];
    // A name that makes no sidecars is refused when the export runs; here it writes only
    // its package.
    if let Ok(o) = crate::pipeline::package_files::Outputs::for_package(&e.output) {
        paths.extend(o.tokenizer);
        paths.extend(o.tokenizer_config);
        paths.push(o.report);
        paths.extend(o.per_layer);
    }
    if e.validate.is_some() {
        paths.push(crate::pipeline::package_files::validation_path(&e.output));
    }
    let resolved = |p: &Path| crate::fsutil::resolved(p).unwrap_or_else(|_| p.to_path_buf());
    paths.iter().map(|p| resolved(p)).collect()
}

/// Two exports writing one file (a package, or the sidecars `o/x.mlpackage` and
/// `o/x.aimodel` share), one writing inside what another writes, or sharing a name, would
/// race or overwrite each other; an export writing over, into or around another's model
/// would destroy that export's input. Paths are compared resolved, and also ignoring case:
/// on a case-insensitive file system (macOS's default) `X.mlpackage` is `x.mlpackage`.
fn check_unique(path: &Path, exports: &[Export]) -> Result<(), BatchError> {
    let invalid = |e: &Export, message: String| BatchError::Invalid {
        path: path.to_path_buf(),
        line: e.line,
        message,
    };
    let resolved = |p: &Path| crate::fsutil::resolved(p).unwrap_or_else(|_| p.to_path_buf());
    let models: BTreeMap<PathBuf, &Export> =
        exports.iter().map(|e| (resolved(&e.model), e)).collect();
    let mut all: BTreeMap<PathBuf, Written<'_>> = BTreeMap::new();
    let mut folded: BTreeMap<String, PathBuf> = BTreeMap::new();
    for e in exports {
        for (i, p) in written(e).into_iter().enumerate() {
            check_model_overlap(&p, e, &models).map_err(|m| invalid(e, m))?;
            let w = Written {
                export: e,
                path: p.clone(),
                package: &e.output,
                is_package: i == 0,
            };
            if let Some(first) = all.get(&p) {
                return Err(invalid(e, same_file(first, &w)));
            }
            let key = p.to_string_lossy().to_lowercase();
            if let Some(other) = folded.get(&key).and_then(|o| all.get(o)) {
                return Err(invalid(e, same_file_ignoring_case(other, &w)));
            }
            folded.insert(key, p.clone());
            all.insert(p, w);
        }
    }
    let mut names: BTreeMap<&str, &Export> = BTreeMap::new();
    for e in exports {
        if let Some(first) = names.insert(&e.name, e) {
            return Err(invalid(
                e,
                format!(
                    "two exports are named `{}` (lines {} and {}): set `name`",
                    e.name, first.line, e.line
                ),
            ));
        }
    }
    // Whatever lies under a written path is written into another export's package (or under
    // a file): the paths below `p` follow it in the map's component order.
    for (p, outer) in &all {
        let inner = all
            .range::<PathBuf, _>((std::ops::Bound::Excluded(p), std::ops::Bound::Unbounded))
            .next()
            .filter(|(q, _)| q.starts_with(p));
        if let Some((_, inner)) = inner {
            return Err(invalid(inner.export, nested(outer, inner)));
        }
    }
    Ok(())
}

/// An export's written path `p` over, into or around any export's model.
fn check_model_overlap(
    p: &Path,
    e: &Export,
    models: &BTreeMap<PathBuf, &Export>,
) -> Result<(), String> {
    let inside = p.ancestors().find_map(|a| models.get(a));
    let around = models
        .range::<Path, _>((std::ops::Bound::Included(p), std::ops::Bound::Unbounded))
        .next()
        .filter(|(m, _)| m.starts_with(p))
        .map(|(_, other)| other);
    match inside.or(around) {
        Some(other) => Err(format!(
            "export `{}` writes {}, which would overlap the model {} of export `{}` (line {}): \
             choose an output elsewhere",
            e.name,
            p.display(),
            other.model.display(),
            other.name,
            other.line
        )),
        None => Ok(()),
    }
}

/// "its package" or "a sidecar of X" for a written path.
fn role(w: &Written<'_>) -> String {
    match w.is_package {
        true => "its package".into(),
        false => format!("a sidecar of {}", w.package.display()),
    }
}

fn same_file(first: &Written<'_>, second: &Written<'_>) -> String {
    let (a, b) = (first.export, second.export);
    if first.is_package && second.is_package {
        return format!(
            "two exports write {} (`{}` and `{}`, the entries at lines {} and {}): put \
             {{max_seq_len}}, {{device}}, {{recipe}} or {{model}} in `output`",
            second.path.display(),
            a.name,
            b.name,
            a.line,
            b.line
        );
    }
    format!(
        "exports `{}` (line {}) and `{}` (line {}) both write {}: {} for `{}`, {} for `{}`; \
         one would replace the other's. Name their outputs apart by more than the extension",
        a.name,
        a.line,
        b.name,
        b.line,
        second.path.display(),
        role(first),
        a.name,
        role(second),
        b.name
    )
}

fn same_file_ignoring_case(first: &Written<'_>, second: &Written<'_>) -> String {
    format!(
        "exports `{}` (line {}) and `{}` (line {}) write {} and {}, which differ only in case: \
         one file on a case-insensitive file system (macOS's default). Name them apart",
        first.export.name,
        first.export.line,
        second.export.name,
        second.export.line,
        first.path.display(),
        second.path.display()
    )
}

fn nested(outer: &Written<'_>, inner: &Written<'_>) -> String {
    format!(
        "export `{}` (line {}) writes {}, inside {} that export `{}` (line {}) writes ({}): \
         choose an output outside it",
        inner.export.name,
        inner.export.line,
        inner.path.display(),
        outer.path.display(),
        outer.export.name,
        outer.export.line,
        role(outer)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<BatchFile, BatchError> {
        BatchFile::parse(Path::new("/b/batch.toml"), text)
    }

    #[test]
    fn lists_expand_to_every_combination_with_filled_outputs() {
        let b = parse(
            r#"
[defaults]
model = "models/smol"
validate = true

[[export]]
output = "out/{model}-s{max_seq_len}-{device}-{recipe}.mlpackage"
max_seq_len = [512, 2048]
device = ["iphone-15", "iphone-16-pro"]
recipe = ["default", "data-free-4bit"]
"#,
        )
        .unwrap();
        assert_eq!(b.exports.len(), 8);
        let names: Vec<&str> = b.exports.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names[0], "smol-s512-iphone-15-default");
        assert_eq!(names[7], "smol-s2048-iphone-16-pro-data-free-4bit");
        assert_eq!(b.exports[0].model, Path::new("/b/models/smol"));
        assert_eq!(
            b.exports[1].output,
            Path::new("/b/out/smol-s2048-iphone-15-default.mlpackage")
        );
        assert!(b
            .exports
            .iter()
            .all(|e| e.validate.is_some() && e.line == 6));
        assert_eq!(b.exports[2].recipe, RecipeSource::Builtin("default".into()));
        assert_eq!(
            b.exports[5].recipe,
            RecipeSource::Builtin("data-free-4bit".into())
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_give_the_line() {
        let e = parse("[[export]]\nmodel = \"m\"\noutput = \"o.mlpackage\"\nmax_len = 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 4") && e.contains("max_len"), "{e}");
        let e = parse("[[export]]\nmodel = \"m\"\noutput = \"o.mlpackage\"\nmax_seq_len = 0\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("/b/batch.toml:4: max_seq_len: 0"), "{e}");
        let e = parse("[[export]]\nmodel = \"m\"\n\noutput = \"o-{size}.mlpackage\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(":4: output: unknown placeholder `{size}`"),
            "{e}"
        );
        let e = parse("[defaults]\nmodel = \"m\"\n[[export]]\noutput = \"o.mlpackage\"\nvalidate = { gates = [\"kl<1\"] }\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains(":5: validate.gates"), "{e}");
        let e = parse("[[export]]\nmodel = \"m\"\noutput = \"o.mlpackage\"\nrecipe = { roles = { qq = \"fp16\" } }\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains(":4: recipe:") && e.contains("qq"), "{e}");
        let e = parse("[[export]]\noutput = \"o.mlpackage\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains(":1: `model` is missing"), "{e}");
    }

    #[test]
    fn colliding_outputs_are_refused() {
        let e =
            parse("[[export]]\nmodel = \"m\"\noutput = \"o.mlpackage\"\nmax_seq_len = [1, 2]\n")
                .unwrap_err()
                .to_string();
        assert!(e.contains("two exports write /b/o.mlpackage"), "{e}");
    }

    #[test]
    fn exports_sharing_a_sidecar_or_writing_inside_another_are_refused() {
        let two = |a: &str, b: &str| {
            parse(&format!(
                "[[export]]\nname = \"a\"\nmodel = \"m\"\noutput = \"{a}\"\n\
                 [[export]]\nname = \"b\"\nmodel = \"m\"\noutput = \"{b}\"\n"
            ))
            .map(|_| ())
            .map_err(|e| e.to_string())
        };
        // One stem, two targets: the tokenizer and report beside them are one file.
        let e = two("o/x.mlpackage", "o/x.aimodel").unwrap_err();
        assert!(
            e.starts_with(
                "/b/batch.toml:5: exports `a` (line 1) and `b` (line 5) both write \
                 /b/o/x.tokenizer.json: a sidecar of /b/o/x.mlpackage for `a`, a sidecar of \
                 /b/o/x.aimodel for `b`"
            ),
            "{e}"
        );
        // Inside another export's package, or under its sidecar file.
        let e = two("o/x.mlpackage", "o/x.mlpackage/y.mlpackage").unwrap_err();
        assert!(
            e.contains(
                "export `b` (line 5) writes /b/o/x.mlpackage/y.mlpackage, inside \
                 /b/o/x.mlpackage that export `a` (line 1) writes (its package)"
            ),
            "{e}"
        );
        let e = two("o/x.mlpackage/y.mlpackage", "o/x.mlpackage").unwrap_err();
        assert!(
            e.contains("export `a` (line 1) writes /b/o/x.mlpackage/y"),
            "{e}"
        );
        let e = two("o/x.mlpackage", "o/x.report.json/y.mlpackage").unwrap_err();
        assert!(e.contains("(a sidecar of /b/o/x.mlpackage)"), "{e}");
        // One file where case does not count (macOS).
        let e = two("o/X.mlpackage", "o/x.mlpackage").unwrap_err();
        assert!(e.contains("differ only in case"), "{e}");
        // Neighbours whose names only share a prefix are apart.
        two("o/x.mlpackage", "o/x.mlpackage2.mlpackage").unwrap();
        two("o/x.mlpackage", "o/xy.aimodel").unwrap();
    }

    #[test]
    fn an_output_over_another_exports_model_is_refused() {
        // Export a writes m3.mlpackage, which export b reads as its checkpoint.
        let e = parse(
            "[[export]]\nname = \"a\"\nmodel = \"m\"\noutput = \"m3.mlpackage\"\n\
             [[export]]\nname = \"b\"\nmodel = \"m3.mlpackage\"\noutput = \"b.mlpackage\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("export `a` writes") && e.contains("model /b/m3.mlpackage of export `b`"),
            "{e}"
        );
        let e = parse("[[export]]\nname = \"a\"\nmodel = \"m\"\noutput = \"m/inside.mlpackage\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("would overlap the model /b/m of export `a`"),
            "{e}"
        );
    }

    #[test]
    fn inline_recipes_are_named_and_checked() {
        let b = parse(
            r#"
[[export]]
model = "m"
output = "o-{recipe}.mlpackage"
recipe = [{ name = "fp16", default = "fp16" }, { default = { palettize = { nbits = 8 } } }]
"#,
        )
        .unwrap();
        let names: Vec<&str> = b.exports.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["o-fp16", "o-inline2"]);
        let r = b.exports[1].recipe.load().unwrap().recipe;
        assert!(r
            .origin()
            .contains("batch.toml:2 (inline recipe `inline2`)"));
    }

    #[test]
    fn environment_variables_and_home_expand() {
        std::env::set_var("HF2COREML_BATCH_TEST_DIR", "/models");
        let b = parse("[[export]]\nmodel = \"${HF2COREML_BATCH_TEST_DIR}/smol\"\noutput = \"~/o.mlpackage\"\n").unwrap();
        assert_eq!(b.exports[0].model, Path::new("/models/smol"));
        assert!(b.exports[0].output.ends_with("o.mlpackage") && b.exports[0].output.is_absolute());
        let e = parse(
            "[[export]]\nmodel = \"${HF2COREML_SURELY_UNSET_VAR}\"\noutput = \"o.mlpackage\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("HF2COREML_SURELY_UNSET_VAR is not set"), "{e}");
    }

    #[test]
    fn shards_cover_every_export_exactly_once() {
        for n in 1..=7 {
            let mut seen = vec![0; 20];
            for i in 1..=n {
                let s: Shard = format!("{i}/{n}").parse().unwrap();
                for (k, c) in seen.iter_mut().enumerate() {
                    if s.contains(k) {
                        *c += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "n={n}: {seen:?}");
        }
        for bad in ["0/2", "3/2", "1/0", "x", "1/2/3"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
    }
}
