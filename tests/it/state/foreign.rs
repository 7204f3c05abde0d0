//! A stateful program written by coremltools' own MIL builder (python/testgen/state_case.py,
//! committed in tests/fixtures/state_case): `read_state`, `slice_update` at a dynamic position,
//! `write_state` followed by `read_state` (a `coreml_update_state` whose result is read). Our
//! interpreter runs three calls in a row on the same states and matches numpy; a position
//! whose window leaves the state is refused without a panic.

use std::path::Path;

use half::f16;
use hf2coreml::mlpackage::MlPackage;
use hf2coreml::runtime::interp::{Options, Program, Tensor};
use serde_json::Value;

fn dir() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/state_case"
    ))
}

fn tensor(j: &Value) -> Tensor {
    let shape: Vec<usize> = j["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let data = j["data"].as_array().unwrap();
    match j["dtype"].as_str().unwrap() {
        "fp16" => Tensor::f16(
            shape,
            data.iter()
                .map(|v| f16::from_f64(v.as_f64().unwrap()))
                .collect(),
        ),
        "int32" => Tensor::i32(
            shape,
            &data
                .iter()
                .map(|v| v.as_i64().unwrap() as i32)
                .collect::<Vec<_>>(),
        ),
        other => panic!("dtype {other}"),
    }
}

fn load() -> (Program, Value) {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("case.json")).unwrap()).unwrap();
    let pkg = MlPackage::open(&dir().join("model.mlpackage")).unwrap();
    (Program::load(&pkg, Options::default()).unwrap(), doc)
}

fn inputs(step: &Value) -> Vec<(&str, Tensor)> {
    step["inputs"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, t)| (n.as_str(), tensor(t)))
        .collect()
}

#[test]
fn a_coremltools_stateful_program_runs_call_after_call() {
    let (program, doc) = load();
    let ops = doc["ops"].as_array().unwrap();
    assert!(ops.iter().any(|o| o == "slice_update") && ops.iter().any(|o| o == "read_state"));
    let declared: Vec<_> = program
        .states()
        .map(|(n, t)| (n.to_string(), t.shape.clone()))
        .collect();
    assert_eq!(declared, [("cache".to_string(), vec![2, 3, 32, 8])]);
    let inputs_declared: Vec<&str> = program.inputs().map(|(n, _)| n).collect();
    assert!(
        !inputs_declared.contains(&"cache"),
        "a state is not an input"
    );
    let (rtol, atol) = (
        doc["rtol"].as_f64().unwrap() as f32,
        doc["atol"].as_f64().unwrap() as f32,
    );
    let mut states = program.new_states();
    for (i, step) in doc["steps"].as_array().unwrap().iter().enumerate() {
        let out = program
            .run_with_states(inputs(step), &mut states, None)
            .unwrap();
        for (name, want) in step["outputs"].as_object().unwrap() {
            let want = tensor(want).as_f32().into_owned();
            let got = out[name].as_f32().into_owned();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= atol + rtol * w.abs(),
                    "step {i} `{name}`: {g} vs {w}"
                );
            }
        }
    }
    // The state holds the three rows written, nothing else.
    let cache = states.get("cache").unwrap().as_f32().into_owned();
    let written = cache
        .chunks(8)
        .filter(|row| row.iter().any(|&v| v != 0.0))
        .count();
    assert_eq!(written, 3 * 2 * 3);
}

#[test]
fn states_start_at_zero_and_run_drops_them() {
    let (program, doc) = load();
    let steps = doc["steps"].as_array().unwrap();
    // `run` uses fresh states: the second step's `seen` is then zero, not the first's rows.
    let out = program.run(inputs(&steps[1]), None).unwrap();
    assert!(out["seen"].as_f32().iter().all(|&v| v == 0.0));
    let mut states = program.new_states();
    program
        .run_with_states(inputs(&steps[0]), &mut states, None)
        .unwrap();
    let out = program
        .run_with_states(inputs(&steps[1]), &mut states, None)
        .unwrap();
    assert!(out["seen"].as_f32().iter().any(|&v| v != 0.0));
}

#[test]
fn a_window_outside_the_state_is_refused() {
    let (program, doc) = load();
    let step = &doc["steps"].as_array().unwrap()[0];
    let mut states = program.new_states();
    program
        .run_with_states(inputs(step), &mut states, None)
        .unwrap();
    for p in [32, 1000, -1, i32::MAX] {
        let mut ins = inputs(step);
        ins.retain(|(n, _)| *n != "position");
        ins.push(("position", Tensor::i32(vec![1], &[p])));
        let err = program.run_with_states(ins, &mut states, None).unwrap_err();
        assert!(err.to_string().contains("slice_update"), "{p}: {err}");
        // A failed call leaves well-formed (zeroed) states behind.
        let cache = states.get("cache").unwrap();
        assert_eq!(cache.shape, vec![2, 3, 32, 8]);
    }
}
