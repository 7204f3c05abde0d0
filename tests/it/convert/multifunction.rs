//! iOS18 `--prefill-len`: one package with a `prefill` function (Q tokens a call) and a
//! `decode` function (the default, one token) on the tiny Llama. Both functions point at the
//! same blobs (weight.bin holds each weight once, within 1% of the single-function package),
//! prefill computes what decode computes (its last row by default, every row with
//! `--prefill-logits all`), greedy generation through both is token for token the
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
use hf2coreml_testkit::{TinyModel, FP16_LOGIT_TOL};

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
    let every = out.path().join("every.mlpackage");
    ok(&convert(dir.path(), &every)
        .args(["--max-seq-len", &S.to_string()])
        .args(
            [
                &palettized[..],
                &["--prefill-len", &p, "--prefill-logits", "all"],
            ]
            .concat(),
        )
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
    // The prefill function returns its last row only; its cache updates cover the whole chunk.
    let prefill = c.for_function("prefill").unwrap();
    let shape = |name: &str| {
        prefill
            .outputs
            .iter()
            .find(|o| o.name == name)
            .map(|o| o.shape.clone())
    };
    assert_eq!(shape("logits"), Some(vec![1, 1, model.vocab]));
    assert_eq!(
        shape("key_update"),
        Some(vec![c.num_layers, c.num_kv_heads, P, c.head_dim])
    );
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

    // One prefill call computes what P decode calls compute (fp16 rounding aside): the last
    // row, or every row with --prefill-logits all, and the cache rows in both.
    let mut m = Package::load(&mf, Default::default()).unwrap();
    assert_eq!(m.prefill_len(), Some(P));
    assert!(m.prefill_last_row_only());
    let mut all = Package::load(&every, Default::default()).unwrap();
    assert!(!all.prefill_last_row_only());
    let cache = vec![f16::ZERO; c.num_layers * c.num_kv_heads * S * c.head_dim];
    let ids: Vec<i32> = (0..P as i32)
        .map(|i| (i * 37 + 5) % model.vocab as i32)
        .collect();
    let pre = m.step(&ids, 0, &cache, &cache).unwrap();
    let pre_all = all.step(&ids, 0, &cache, &cache).unwrap();
    assert_eq!(pre.logits.len(), c.vocab_size);
    assert_eq!(pre_all.logits.len(), P * c.vocab_size);
    assert_eq!(pre.key_update, pre_all.key_update);
    let (mut worst, mut worst_cache) = (0f32, 0f32);
    {
        // Decode only: a model without its prefill function.
        let mut dm = Package::load(&single, Default::default()).unwrap();
        let (l, hkv, d) = (c.num_layers, c.num_kv_heads, c.head_dim);
        let (mut kc, mut vc) = (cache.clone(), cache.clone());
        let mut diff = |a: &[f32], b: &[f32]| {
            for (a, b) in a.iter().zip(b) {
                worst = worst.max((a - b).abs());
            }
        };
        for (t, &id) in ids.iter().enumerate() {
            let o = dm.step(&[id], t, &kc, &vc).unwrap();
            for lh in 0..l * hkv {
                let dst = (lh * S + t) * d;
                kc[dst..dst + d].copy_from_slice(&o.key_update[lh * d..(lh + 1) * d]);
                vc[dst..dst + d].copy_from_slice(&o.value_update[lh * d..(lh + 1) * d]);
                let src = (lh * P + t) * d;
                for (a, b) in pre.key_update[src..src + d]
                    .iter()
                    .chain(&pre.value_update[src..src + d])
                    .zip(
                        o.key_update[lh * d..(lh + 1) * d]
                            .iter()
                            .chain(&o.value_update[lh * d..(lh + 1) * d]),
                    )
                {
                    worst_cache = worst_cache.max((a.to_f32() - b.to_f32()).abs());
                }
            }
            diff(
                &pre_all.logits[t * c.vocab_size..(t + 1) * c.vocab_size],
                &o.logits,
            );
            if t == P - 1 {
                diff(&pre.logits, &o.logits);
            }
        }
    }
    eprintln!("prefill vs decode: max |Δlogit| {worst}, max |Δ| of cache rows {worst_cache}");
    assert!(worst <= FP16_LOGIT_TOL, "max |Δlogit| {worst}");
    assert!(worst_cache <= 0.02, "max |Δ| of cache rows {worst_cache}");
    // A call of another length is refused, naming both.
    let e = m
        .step(&ids[..3], 0, &cache, &cache)
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 (prefill)") && e.contains("1 (decode)"), "{e}");

    // Greedy generation: the same tokens as the single-function package, with a prompt of one
    // full chunk and one that slides back to end on the last token (8 + 3 tokens: 2 prefill
    // calls; padded with --prefill-logits all), then decode calls. A prompt shorter than P
    // goes through one padded prefill call up to its last token, which decode takes.
    let prompt: Vec<u32> = (0..11).map(|i| (i * 13 + 2) % model.vocab as u32).collect();
    let (a, prefills, decodes) = greedy(&mf, &prompt, 20);
    let (b, none, every_call) = greedy(&single, &prompt, 20);
    let (e, e_prefills, e_decodes) = greedy(&every, &prompt, 20);
    assert_eq!(a, b, "multifunction vs single-function greedy tokens");
    assert_eq!(
        e, b,
        "--prefill-logits all vs single-function greedy tokens"
    );
    assert_eq!((prefills, decodes), (2, 19));
    assert_eq!((e_prefills, e_decodes), (2, 19));
    assert_eq!((none, every_call), (0, 11 + 19));
    let (short, prefills, decodes) = greedy(&mf, &prompt[..5], 4);
    assert_eq!(short, greedy(&single, &prompt[..5], 4).0);
    assert_eq!((prefills, decodes), (1, 1 + 3));

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
    let rows = items
        .iter()
        .find(|i| {
            i["what"]
                .as_str()
                .unwrap()
                .starts_with("prefill (Q=8) writes the cache rows")
        })
        .unwrap_or_else(|| panic!("{report:#}"));
    eprintln!("validate: {rows}");
    assert_eq!(rows["ok"], true);
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

    // Every position's logits: through decode when prefill returns the last row only, through
    // prefill with --prefill-logits all; the same rows either way, fp16 rounding aside.
    let logits_of = |pkg: &Path, name: &str| {
        let npy = out.path().join(name);
        let o = hf2coreml(&[
            "run",
            &pkg.display().to_string(),
            "--prompt-ids",
            "1,2,3,4,5,6,7,8,9,10",
            "--max-new-tokens",
            "1",
            "--logits-out",
            &npy.display().to_string(),
            "--json",
        ]);
        let run: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let bytes = std::fs::read(&npy).unwrap();
        let floats: Vec<f32> = bytes[bytes.len() - 10 * model.vocab * 4..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (run["timing"]["prefill_calls"].as_u64().unwrap(), floats)
    };
    let (calls_last, rows_last) = logits_of(&mf, "last.npy");
    let (calls_all, rows_all) = logits_of(&every, "all.npy");
    assert_eq!((calls_last, calls_all), (0, 2));
    let worst = rows_last
        .iter()
        .zip(&rows_all)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= FP16_LOGIT_TOL,
        "--logits-out: max |Δlogit| {worst}"
    );
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
        (vec!["--prefill-logits", "all"], "has none"),
        (
            vec![
                "--target",
                "ios18",
                "--prefill-len",
                "0",
                "--prefill-logits",
                "last",
            ],
            "has none",
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
