//! Reading a recipe file: its TOML, key by key, into a [`Recipe`] and the [`PackageOptions`]
//! it sets. Every key, role and value the format does not know is an error saying where it is.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::recipe_error::RecipeError;
use super::{Calibration, Decision, NameRule, Recipe, RecipeFile};
use crate::arch::Role;
use crate::mil::PackageOptions;
use crate::quant::kmeans::check_nbits;
use crate::quant::{Granularity, QuantError};

impl RecipeFile {
    /// Parse recipe text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, QuantError> {
        parse_file(text, origin).map_err(|error| QuantError::Recipe {
            path: PathBuf::from(origin),
            error,
        })
    }
}

/// The recipe and package options of recipe text, key by key in the table's order (the first
/// bad key is the one reported).
fn parse_file(text: &str, origin: &str) -> Result<RecipeFile, RecipeError> {
    let table: toml::Table =
        toml::from_str(text).map_err(|e| RecipeError::Syntax(e.to_string()))?;
    let mut recipe = Recipe {
        origin: origin.to_string(),
        default: Decision::Fp16,
        roles: BTreeMap::new(),
        names: Vec::new(),
        nbits_override: None,
        calibration: None,
    };
    let mut package = PackageOptions::default();
    for (key, value) in &table {
        if let Some(set) = package.set(key, value) {
            set?;
            continue;
        }
        match key.as_str() {
            "default" => recipe.default = parse_decision(value, "default")?,
            "roles" => recipe.roles = parse_roles(value)?,
            "tensors" => recipe.names = parse_tensors(value)?,
            "calibration" => recipe.calibration = Some(Calibration::parse(value)?),
            other => {
                return Err(RecipeError::Invalid(format!(
                    "unknown key `{other}` (expected {}, default, roles, tensors, calibration)",
                    PackageOptions::KEYS.join(", ")
                )))
            }
        }
    }
    Ok(RecipeFile { recipe, package })
}

/// The `[roles]` table: a decision per [`Role`] name.
fn parse_roles(value: &toml::Value) -> Result<BTreeMap<Role, Decision>, RecipeError> {
    let roles = value.as_table().ok_or("`roles` must be a table")?;
    let mut out = BTreeMap::new();
    for (name, v) in roles {
        let role = Role::parse(name).ok_or_else(|| {
            RecipeError::Invalid(format!(
                "roles.{name}: unknown role (known: {})",
                Role::ALL.map(|r| r.as_str()).join(", ")
            ))
        })?;
        out.insert(role, parse_decision(v, &format!("roles.{name}"))?);
    }
    Ok(out)
}

/// The `[[tensors]]` rules, in file order (the first match wins).
fn parse_tensors(value: &toml::Value) -> Result<Vec<NameRule>, RecipeError> {
    let rules = value
        .as_array()
        .ok_or("`tensors` must be an array of tables ([[tensors]])")?;
    let mut out = Vec::with_capacity(rules.len());
    for (i, rule) in rules.iter().enumerate() {
        let at = format!("tensors[{i}]");
        let t = rule
            .as_table()
            .ok_or_else(|| RecipeError::Invalid(format!("{at} must be a table")))?;
        let mut glob = None;
        let mut decision = None;
        for (k, v) in t {
            match k.as_str() {
                "glob" => {
                    glob = Some(
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| format!("{at}.glob must be a string"))?,
                    )
                }
                "decision" => decision = Some(parse_decision(v, &format!("{at}.decision"))?),
                other => {
                    return Err(RecipeError::Invalid(format!(
                        "{at}: unknown key `{other}` (expected glob, decision)"
                    )))
                }
            }
        }
        let glob = glob.ok_or_else(|| format!("{at}: missing `glob`"))?;
        let decision = decision.ok_or_else(|| format!("{at}: missing `decision`"))?;
        out.push(NameRule::new(&glob, decision, Some(&at))?);
    }
    Ok(out)
}

fn parse_decision(v: &toml::Value, at: &str) -> Result<Decision, RecipeError> {
    let expected = "expected \"fp16\" or { palettize = { nbits = N } }";
    match v {
        toml::Value::String(s) if s == "fp16" => Ok(Decision::Fp16),
        toml::Value::String(s) => Err(RecipeError::Invalid(format!(
            "{at}: unknown decision `{s}` ({expected})"
        ))),
        toml::Value::Table(t) => {
            let mut it = t.iter();
            let (Some((k, p)), None) = (it.next(), it.next()) else {
                return Err(RecipeError::Invalid(format!("{at}: {expected}")));
            };
            if k != "palettize" {
                return Err(RecipeError::Invalid(format!(
                    "{at}: unknown key `{k}` ({expected})"
                )));
            }
            let p = p
                .as_table()
                .ok_or_else(|| format!("{at}.palettize must be a table"))?;
            parse_palettize(p, &format!("{at}.palettize"))
        }
        _ => Err(RecipeError::Invalid(format!("{at}: {expected}"))),
    }
}

fn parse_palettize(t: &toml::Table, at: &str) -> Result<Decision, RecipeError> {
    let int = |k: &str, v: &toml::Value| -> Result<i64, String> {
        v.as_integer()
            .ok_or_else(|| format!("{at}.{k} must be an integer"))
    };
    let mut nbits = None;
    let mut gran = "per_tensor".to_string();
    let mut group_size = None;
    let mut axis = None;
    for (k, v) in t {
        match k.as_str() {
            "nbits" => nbits = Some(int(k, v)?),
            "granularity" => {
                gran = v
                    .as_str()
                    .ok_or_else(|| format!("{at}.granularity must be a string"))?
                    .to_string()
            }
            "group_size" => group_size = Some(int(k, v)?),
            "axis" => axis = Some(int(k, v)?),
            other => {
                return Err(RecipeError::Invalid(format!(
                    "{at}: unknown key `{other}` (expected nbits, granularity, group_size, axis)"
                )))
            }
        }
    }
    let nbits = nbits.ok_or_else(|| format!("{at}: missing `nbits`"))?;
    let nbits = u8::try_from(nbits)
        .ok()
        .filter(|n| check_nbits(*n).is_ok())
        .ok_or_else(|| RecipeError::UnsupportedNbits {
            at: at.to_string(),
            nbits,
        })?;
    let granularity = match gran.as_str() {
        "per_tensor" => {
            if group_size.is_some() || axis.is_some() {
                return Err(RecipeError::Invalid(format!(
                    "{at}: group_size and axis only apply to granularity = \"per_grouped_channel\""
                )));
            }
            Granularity::PerTensor
        }
        "per_grouped_channel" => {
            let group_size = group_size
                .ok_or_else(|| format!("{at}: per_grouped_channel needs `group_size`"))?;
            let group_size = usize::try_from(group_size)
                .ok()
                .filter(|g| *g >= 1)
                .ok_or_else(|| format!("{at}.group_size must be at least 1"))?;
            let axis = usize::try_from(axis.unwrap_or(0))
                .ok()
                .filter(|a| *a <= 1)
                .ok_or_else(|| format!("{at}.axis must be 0 (output channels) or 1"))?;
            Granularity::PerGroupedChannel { group_size, axis }
        }
        other => {
            return Err(RecipeError::Invalid(format!(
                "{at}.granularity: unknown `{other}` (expected per_tensor, per_grouped_channel)"
            )))
        }
    };
    Ok(Decision::Palettize { nbits, granularity })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_file_and_key() {
        let cases = [
            ("defualt = \"fp16\"", "defualt"),
            ("[roles]\nqq = \"fp16\"", "qq"),
            ("[roles]\nq = \"int8\"", "int8"),
            ("[roles]\nq = { palettize = { nbits = 5 } }", "nbits = 5"),
            ("[roles]\nq = { palettize = { nbit = 4 } }", "nbit"),
            ("[roles]\nq = { palettise = { nbits = 4 } }", "palettise"),
            (
                "[[tensors]]\nglob = \"*\"\ndecision = \"fp16\"\nwhy = 1",
                "why",
            ),
            ("[[tensors]]\nglob = \"*\"", "decision"),
            ("[[tensors]]\nglob = \"a[\"\ndecision = \"fp16\"", "a["),
            (
                "[roles]\nq = { palettize = { nbits = 4, granularity = \"per_block\" } }",
                "per_block",
            ),
            (
                "[roles]\nq = { palettize = { nbits = 4, group_size = 8 } }",
                "group_size",
            ),
            ("default = [", "recipe.toml"),
        ];
        for (text, needle) in cases {
            let e = Recipe::parse(text, "recipe.toml").unwrap_err().to_string();
            assert!(e.starts_with("recipe.toml"), "{e}");
            assert!(e.contains(needle), "`{needle}` not in: {e}");
        }
    }

    #[test]
    fn errors_are_typed_where_a_caller_may_react() {
        let recipe_error = |text: &str| match Recipe::parse(text, "r.toml") {
            Err(QuantError::Recipe { error, .. }) => error,
            other => panic!("{other:?}"),
        };
        let e = recipe_error("default = { palettize = { nbits = 5 } }");
        assert_eq!(
            e,
            RecipeError::UnsupportedNbits {
                at: "default.palettize".into(),
                nbits: 5
            }
        );
        assert_eq!(
            e.to_string(),
            "default.palettize.nbits = 5: supported are 1, 2, 3, 4, 6, 8"
        );
        let e = recipe_error("[[tensors]]\nglob = \"a[\"\ndecision = \"fp16\"");
        assert!(
            matches!(&e, RecipeError::Glob { glob, .. } if glob == "a["),
            "{e:?}"
        );
        assert!(
            e.to_string().starts_with("tensors[0]: invalid glob `a[`: "),
            "{e}"
        );
        let Err(QuantError::Recipe { error, path }) = Recipe::default().keep_fp16("a[") else {
            panic!("`a[` is not a glob")
        };
        assert_eq!(path, PathBuf::from("--keep-fp16"));
        assert!(
            error.to_string().starts_with("invalid glob `a[`: "),
            "{error}"
        );
        assert!(matches!(
            recipe_error("default = ["),
            RecipeError::Syntax(_)
        ));
    }
}
