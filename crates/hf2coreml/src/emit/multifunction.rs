//! One program with several functions (iOS18 multifunction: `prefill` and `decode`), each
//! built from its own graph, every constant the functions have in common stored once.
//!
//! The graphs are built from the same weights, so most constants are equal by name and value.
//! Such a constant crosses to Python once and is marked `shared`: the bridge gives its const
//! ops in every function one `weight_id`, and coremltools writes one blob that all of them
//! point to (what `ct.utils.save_multifunction` does after comparing values). A constant of the
//! same name but other values (the causal block of a Q×Q mask) crosses under its own `key`.

use std::collections::HashMap;
use std::path::Path;

use super::{emit_described, Described, EmitError, EmitReport, Metadata, PythonEnv};
use crate::graph::{Const, Graph};

/// Build, convert and save one package whose program has one function per `(name, graph)`,
/// in that order; `default` is the function an app runs when it names none. Every graph must
/// have the same target (iOS18) and float type. Written into `into`, an empty directory.
pub fn emit_functions(
    functions: Vec<(String, Graph)>,
    default: &str,
    meta: &Metadata,
    env: &PythonEnv,
    into: &Path,
) -> Result<EmitReport, EmitError> {
    let program = describe(functions, default)?;
    emit_described(program, meta, env, into)
}

/// The functions' descriptions and the constants to hand over (see the module docs).
pub(super) fn describe(
    functions: Vec<(String, Graph)>,
    default: &str,
) -> Result<Described, EmitError> {
    let protocol = |m: String| EmitError::Protocol(m);
    let (target, float) = match functions.first() {
        Some((_, g)) => (g.target, g.float),
        None => return Err(protocol("a program needs at least one function".into())),
    };
    if !functions.iter().any(|(n, _)| n == default) {
        return Err(protocol(format!(
            "no function `{default}` to be the default"
        )));
    }
    let mut consts: Vec<Const> = Vec::new();
    // Name → index in `consts` of the first function's constant of that name.
    let mut first: HashMap<String, usize> = HashMap::new();
    let mut descs = Vec::new();
    for (name, graph) in functions {
        graph.validate()?;
        if graph.target != target || graph.float != float {
            return Err(protocol(format!(
                "function `{name}` has another target or float type than the first"
            )));
        }
        let mut desc =
            serde_json::to_value(graph.description()).map_err(|e| protocol(e.to_string()))?;
        let entries = desc["consts"]
            .as_array_mut()
            .ok_or_else(|| protocol("a description without constants".into()))?;
        for (c, entry) in graph.consts.into_iter().zip(entries.iter_mut()) {
            match first.get(&c.name) {
                Some(&at) if consts[at].shape == c.shape && consts[at].data == c.data => {
                    entry["shared"] = true.into();
                }
                Some(_) => {
                    let key = format!("{name}/{}", c.name);
                    entry["key"] = key.clone().into();
                    consts.push(Const { name: key, ..c });
                }
                None => {
                    first.insert(c.name.clone(), consts.len());
                    consts.push(c);
                }
            }
        }
        descs.push(serde_json::json!({"name": name, "graph": desc}));
    }
    // The first function's entry is marked too: the bridge shares a constant by name.
    let shared: std::collections::HashSet<String> = descs
        .iter()
        .flat_map(|d| d["graph"]["consts"].as_array().into_iter().flatten())
        .filter(|c| c["shared"] == true)
        .filter_map(|c| c["name"].as_str().map(str::to_string))
        .collect();
    for d in &mut descs {
        for c in d["graph"]["consts"].as_array_mut().into_iter().flatten() {
            if c.get("key").is_none() && c["name"].as_str().is_some_and(|n| shared.contains(n)) {
                c["shared"] = true.into();
            }
        }
    }
    let desc = serde_json::json!({
        "functions": descs,
        "default_function": default,
        "target": target,
    });
    Ok(Described {
        desc: desc.to_string(),
        consts,
        target,
        float,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{var, Builder, ConstData};
    use crate::mil::contract::Target;
    use crate::mil::{DType, Op};
    use half::f16;

    fn graph(q: usize, mask: f32) -> Graph {
        let mut b = Builder::new(DType::F16);
        b.set_target(Target::Ios18);
        let x = b.input("x", DType::F16, vec![q, 4]);
        let w = b.constant("w", vec![4, 4], ConstData::F16(vec![f16::ONE; 16]), None);
        let m = b.constant(
            "m",
            vec![q, 4],
            ConstData::F16(vec![f16::from_f32(mask); q * 4]),
            None,
        );
        let y = b.op(Op::Linear, "y", vec![("x", var(&x)), ("weight", var(&w))]);
        let z = b.op(Op::Add, "z", vec![("x", var(&y)), ("y", var(&m))]);
        b.finish(vec![z]).unwrap()
    }

    #[test]
    fn equal_constants_cross_once_and_different_ones_under_their_own_key() {
        let d = describe(
            vec![
                ("prefill".into(), graph(3, 1.0)),
                ("decode".into(), graph(1, 2.0)),
            ],
            "decode",
        )
        .unwrap();
        let names: Vec<&str> = d.consts.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["w", "m", "decode/m"]);
        let desc: serde_json::Value = serde_json::from_str(&d.desc).unwrap();
        assert_eq!(desc["default_function"], "decode");
        for f in desc["functions"].as_array().unwrap() {
            let consts = f["graph"]["consts"].as_array().unwrap();
            assert_eq!(consts[0]["shared"], true, "{f}");
            assert!(consts[1].get("shared").is_none(), "{f}");
        }
        assert_eq!(
            desc["functions"][1]["graph"]["consts"][1]["key"],
            "decode/m"
        );
        assert!(describe(vec![("prefill".into(), graph(3, 1.0))], "decode").is_err());
    }
}
