//! `run --logits-out` through the CLI: the .npy it writes is read back by numpy (an independent
//! reader of the format) and its values are the checkpoint's logits, position by position, as
//! the float reference forward pass computes them; greedy generation picks each row's argmax.

use std::path::Path;
use std::process::Command;

use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::Reference;
use hf2coreml_testkit::{python_env, TinyModel, FP16_LOGIT_TOL};

use crate::support::{convert, needs, Cli};

const PROMPT: [u32; 5] = [3, 10, 17, 24, 31];
const NEW_TOKENS: usize = 4;

/// numpy's view of the file: shape, dtype and the values, as JSON.
fn numpy_load(npy: &Path) -> serde_json::Value {
    let script = "import json, sys, numpy as np\n\
                  a = np.load(sys.argv[1])\n\
                  print(json.dumps({'shape': list(a.shape), 'dtype': str(a.dtype), \
                  'values': [float(x) for x in a.ravel()]}))";
    let out = Command::new(python_env().join("bin/python"))
        .args(["-c", script])
        .arg(npy)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn logits_out_holds_the_reference_logits_of_every_position() {
    needs!(Python);
    let model = TinyModel {
        // A sharper distribution than random weights give, so argmax is meaningful.
        logit_gain: 4.0,
        ..TinyModel::llama()
    };
    let dir = model.write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let pkg = root.path().join("m.mlpackage");
    convert(dir.path(), &pkg)
        .args(["--max-seq-len", "16", "--keep-fp16", "*", "-q"])
        .ok();

    let npy = root.path().join("logits.npy");
    let ids: Vec<String> = PROMPT.iter().map(|t| t.to_string()).collect();
    let r = Cli::new()
        .arg("run")
        .arg(&pkg)
        .args(["--prompt-ids", &ids.join(","), "--json", "--ignore-eos"])
        .args(["--max-new-tokens", &NEW_TOKENS.to_string()])
        .arg("--logits-out")
        .arg(&npy)
        .output();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let run: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    let generated: Vec<u32> = run["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(generated.len(), NEW_TOKENS, "{run}");

    // Every processed position: the prompt, and each generated token but the last (whose
    // logits were never computed).
    let tokens: Vec<u32> = PROMPT
        .iter()
        .chain(&generated[..NEW_TOKENS - 1])
        .copied()
        .collect();
    let v = model.vocab;
    let file = numpy_load(&npy);
    assert_eq!(file["dtype"], "float32");
    assert_eq!(file["shape"], serde_json::json!([tokens.len(), v]));
    let got: Vec<f32> = file["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();

    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let want: Vec<f32> = Reference::load(&ckpt)
        .unwrap()
        .logits_all(&tokens)
        .unwrap()
        .concat();
    assert_eq!(want.len(), got.len());
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < FP16_LOGIT_TOL, "max |Δlogit| {worst}");

    // Greedy: each generated token is the argmax of the row before it.
    for (i, &token) in generated.iter().enumerate() {
        let row = &got[(PROMPT.len() - 1 + i) * v..][..v];
        let argmax = (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
        assert_eq!(argmax as u32, token, "generated token {i}");
    }
}
