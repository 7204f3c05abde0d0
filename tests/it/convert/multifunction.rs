//! iOS18 `--prefill-len`: one package with a `prefill` function (Q tokens a call) and a
//! `decode` function (the default, one token) on the tiny Llama. Both functions point at the
//! same blobs (weight.bin holds each weight once, within 1% of the single-function package),
//! prefill computes what decode computes, greedy generation through both is token for token the
//! single-function package's, `validate`, `lint` and `inspect` cover both functions, and what
//! cannot be built is refused with exit 2 before any work.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Output;

use half::f16;
use hf2coreml::mil::contract;
use hf2coreml::mlpackage::proto::{binding::Binding, value::Value as ValueKind, Operation};
use hf2coreml::mlpackage::MlPackage;
use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::interp::Package;
use hf2coreml::runtime::StepModel;
use hf2coreml::testing::{TinyModel, FP16_LOGIT_TOL};

use crate::support::{convert, hf2coreml, needs};

const S: usize = 64;
const P: usize = 8;

fn ok(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    err
}

/// The blobs (file, offset) the constants of function `name` point to.
fn blobs(pkg: &MlPackage, name: &str) -> BTreeSet<(String, u64)> {
    let f = pkg.function(name).unwrap();
    let values = |op: &Operation| {
        let inputs: Vec<_> = op
            .inputs
            .values()
            .flat_map(|a| &a.arguments)
            .filter_map(|b| match &b.binding {
                Some(Binding::Value(v)) => Some(v.clone()),
                _ => None,
            })
            .collect();
        op.attributes
            .values()
            .cloned()
            .chain(inputs)
            .collect::<Vec<_>>()
    };
    f.block
        .operations
        .iter()
        .flat_map(values)
        .filter_map(|v| match v.value {
            Some(ValueKind::BlobFileValue(b)) => Some((b.file_name, b.offset)),
            _ => None,
        })
        .collect()
}

fn weight_bin(pkg: &Path) -> u64 {
    std::fs::metadata(pkg.join("Data/com.apple.CoreML/weights/weight.bin"))
        .unwrap()
        .len()
}

fn greedy(pkg: &Path, prompt: &[u32], n: usize) -> (Vec<u32>, usize, usize) {
    let model = Package::load(pkg, Default::default()).unwrap();
    let mut gen = Generator::new(model).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: n,
        stop_at_eos: false,
        ..GenerateOptions::default()
    };
    let g = gen.generate(prompt, &opts, &mut |_| Ok(())).unwrap();
    let t = g.timing;
    (g.tokens, t.prefill_calls, t.model_calls - t.prefill_calls)
}

#[test]
fn one_package_prefill_and_decode_share_weights_and_agree() {
    needs!(Python);
    let model = TinyModel {
        logit_gain: 4.0,
        ..TinyModel::llama()
    };
    let dir = model.write_temp().unwrap();
    let out = tempfile::tempdir().unwrap();
    let (mf, single) = (
        out.path().join("mf.mlpackage"),
        out.path().join("one.mlpackage"),
    );
    let p = P.to_string();
    let palettized = ["--target", "ios18", "--nbits", "4"];
    ok(&convert(dir.path(), &mf)
        .args(["--max-seq-len", &S.to_string()])
        .args([&palettized[..], &["--prefill-len", &p]].concat())
        .output());
    ok(&convert(dir.path(), &single)
        .args(["--max-seq-len", &S.to_string()])
        .args([&palettized[..], &["--prefill-len", "0"]].concat())
        .output());

    // Two functions, decode the default; the contract lists both with their Q.
    let pkg = MlPackage::open(&mf).unwrap();
    assert_eq!(pkg.function_names().unwrap(), ["decode", "prefill"]);
    assert_eq!(pkg.main_function().unwrap().name, "decode");
    let desc = pkg.description();
    assert_eq!(desc.default_function, "decode");
    let c: contract::Contract =
        serde_json::from_str(&desc.user_defined[contract::METADATA_KEY]).unwrap();
    let qs: Vec<(&str, usize)> = c
        .functions
        .iter()
        .map(|f| (f.name.as_str(), f.query_len))
        .collect();
    assert_eq!(qs, [("prefill", P), ("decode", 1)]);
    assert_eq!(c.query_len, 1);
    let one = MlPackage::open(&single).unwrap();
    assert_eq!(one.function_names().unwrap(), ["main"]);

    // Every weight once: the functions point at the same blobs, and weight.bin is the
    // single-function package's but for the few constants that depend on Q (the causal block).
    let (pre, dec) = (blobs(&pkg, "prefill"), blobs(&pkg, "decode"));
    let shared = pre.intersection(&dec).count();
    eprintln!(
        "blobs: prefill {} decode {} shared {shared}; weight.bin {} vs single {}",
        pre.len(),
        dec.len(),
        weight_bin(&mf),
        weight_bin(&single)
    );
    assert!(shared + 2 >= pre.len().max(dec.len()), "{pre:?}\n{dec:?}");
    assert!(
        weight_bin(&mf) as f64 <= weight_bin(&single) as f64 * 1.01,
        "weight.bin {} vs {}",
        weight_bin(&mf),
        weight_bin(&single)
    );

    // One prefill call computes what P decode calls compute (fp16 rounding aside).
    let mut m = Package::load(&mf, Default::default()).unwrap();
    assert_eq!(m.prefill_len(), Some(P));
    let cache = vec![f16::ZERO; c.num_layers * c.num_kv_heads * S * c.head_dim];
    let ids: Vec<i32> = (0..P as i32)
        .map(|i| (i * 37 + 5) % model.vocab as i32)
        .collect();
    let pre = m.step(&ids, 0, &cache, &cache).unwrap();
    let mut worst = 0f32;
    {
        // Decode only: a model without its prefill function.
        let mut dm = Package::load(&single, Default::default()).unwrap();
        let (l, hkv, d) = (c.num_layers, c.num_kv_heads, c.head_dim);
        let (mut kc, mut vc) = (cache.clone(), cache.clone());
        for (t, &id) in ids.iter().enumerate() {
            let o = dm.step(&[id], t, &kc, &vc).unwrap();
            for lh in 0..l * hkv {
                let dst = (lh * S + t) * d;
                kc[dst..dst + d].copy_from_slice(&o.key_update[lh * d..(lh + 1) * d]);
                vc[dst..dst + d].copy_from_slice(&o.value_update[lh * d..(lh + 1) * d]);
            }
            let row = &pre.logits[t * c.vocab_size..(t + 1) * c.vocab_size];
            for (a, b) in row.iter().zip(&o.logits) {
                worst = worst.max((a - b).abs());
            }
        }
    }
    eprintln!("prefill vs decode: max |Δlogit| {worst}");
    assert!(worst <= FP16_LOGIT_TOL, "max |Δlogit| {worst}");
    // A call of another length is refused, naming both.
    let e = m
        .step(&ids[..3], 0, &cache, &cache)
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 (prefill)") && e.contains("1 (decode)"), "{e}");

    // Greedy generation: the same tokens as the single-function package, with a prompt of one
    // full chunk and a padded one (8 + 3 tokens: 2 prefill calls), then decode calls.
    let prompt: Vec<u32> = (0..11).map(|i| (i * 13 + 2) % model.vocab as u32).collect();
    let (a, prefills, decodes) = greedy(&mf, &prompt, 20);
    let (b, none, all) = greedy(&single, &prompt, 20);
    assert_eq!(a, b, "multifunction vs single-function greedy tokens");
    assert_eq!((prefills, decodes), (2, 19));
    assert_eq!((none, all), (0, 11 + 19));

    // validate checks both functions and their agreement; lint and inspect see both.
    let (m_s, d_s) = (mf.display().to_string(), dir.path().display().to_string());
    let o = hf2coreml(&[
        "validate",
        &m_s,
        "--against",
        &d_s,
        "--gate",
        "kl_mean<=0.2",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(o.status.code(), Some(0), "{report:#}");
    let items = report["contract"].as_array().unwrap();
    let agree = items
        .iter()
        .find(|i| {
            i["what"]
                .as_str()
                .unwrap()
                .starts_with("prefill (Q=8) agrees")
        })
        .unwrap_or_else(|| panic!("{report:#}"));
    eprintln!("validate: {agree}");
    assert_eq!(agree["ok"], true);
    for f in ["prefill", "decode"] {
        let n = items
            .iter()
            .filter(|i| i["what"].as_str().unwrap().starts_with(&format!("{f}: ")))
            .count();
        assert!(n >= 8, "{f}: {n} items\n{report:#}");
    }
    let o = hf2coreml(&["inspect", &m_s, "--json"]);
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = summary["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{summary:#}");
    assert!(names.contains(&"prefill") && names.contains(&"decode"));
    // Stored bytes are counted once although both functions point at them.
    let counted = summary["weight_bytes"].as_u64().unwrap();
    assert!(
        counted <= weight_bin(&mf),
        "{counted} > {}",
        weight_bin(&mf)
    );

    let o = hf2coreml(&[
        "run",
        &m_s,
        "--prompt-ids",
        "1,2,3,4,5,6,7,8,9,10",
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "--json",
    ]);
    let run: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(run["timing"]["prefill_calls"], 2, "{run:#}");
    assert_eq!(run["timing"]["decode_calls"], 2, "{run:#}");
}

#[test]
fn what_cannot_be_built_is_refused_before_any_work() {
    needs!(Python);
    // Four blocks of about 74 kB: 1.2 MB holds two per part (tests/it/chain).
    let dir = TinyModel {
        layers: 4,
        ..TinyModel::llama()
    }
    .write_temp()
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("refused.mlpackage");
    for (flags, says) in [
        (vec!["--prefill-len", "8"], "--target ios18"),
        (
            vec!["--target", "ios17", "--prefill-len", "8"],
            "--target ios18",
        ),
        (
            vec!["--target", "ios18", "--prefill-len", "1"],
            "2 to --max-seq-len",
        ),
        (
            vec!["--target", "ios18", "--prefill-len", "65"],
            "2 to --max-seq-len",
        ),
        (
            vec![
                "--target",
                "ios18",
                "--prefill-len",
                "8",
                "--query-len",
                "2",
            ],
            "--query-len must be 1",
        ),
        (
            vec![
                "--target",
                "ios18",
                "--max-package-size",
                "1200000",
                "--keep-fp16",
                "*",
            ],
            "--prefill-len 0",
        ),
    ] {
        let o = convert(dir.path(), &pkg)
            .args(["--max-seq-len", &S.to_string()])
            .args(&flags)
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(!pkg.exists(), "{flags:?}");
    }
}
