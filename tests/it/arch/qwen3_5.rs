//! Qwen3.5's text decoder (`Qwen3_5ForCausalLM`): Gated DeltaNet blocks around a gated
//! attention block, against a checkpoint and logits transformers 5.23 wrote
//! (python/testgen/hf_models.py `qwen3_5`).

use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::model::{BackendChoice, Reference};
use hf2coreml::runtime::generate::Generator;
use hf2coreml::runtime::interp::Package;
use hf2coreml::runtime::kvfile::KvFile;

use super::hf::{
    expected, fixture, fp16_package_matches_transformers, inspect_refuses_edited_config, largest,
    max_diff, prompt_logits, reference_matches_transformers, same_state, validate, Fp16Packages,
};
use crate::support::logits::agreement;
use crate::support::{convert, needs, stdout, Cli};

/// The config as transformers reads it (DeltaNet heads and sizes, partial rotary 0.25, the
/// gate in q_proj), and the reference's logits against transformers' at every position of a
/// pass that spans two of its 64-token prefill chunks. transformers computes the text RoPE
/// through its multimodal sections (`mrope_section`), three equal position rows recomposed per
/// frequency; the reference computes plain RoPE: their agreement here is that collapse.
#[test]
fn qwen3_5_reference_matches_transformers() {
    let spec = Checkpoint::open(fixture("qwen3_5")).unwrap().spec().clone();
    let g = spec.gated_delta.clone().expect("DeltaNet blocks");
    assert_eq!(g.layers, [0, 1, 3]);
    assert_eq!(
        (g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.kernel),
        (2, 4, 16, 8, 4)
    );
    assert_eq!(g.conv_channels(), 2 * 2 * 16 + 4 * 8);
    assert_eq!(spec.rotary_dim(), 8);
    assert!(spec.attention_output_gate && spec.qk_norm && !spec.tie_word_embeddings);
    assert_eq!(spec.norm_offset(), 1.0);
    reference_matches_transformers("qwen3_5");
}

/// A DeltaNet's conv inputs and state carry across calls: tokens fed in calls of several sizes
/// give the whole pass's logits at the end of every call.
#[test]
fn qwen3_5_state_carries_across_calls_of_any_size() {
    let dir = fixture("qwen3_5");
    let want = expected(&dir);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut r = Reference::load_with(&ckpt, BackendChoice::Auto).unwrap();
    let scale = want
        .logits
        .iter()
        .flatten()
        .fold(0f32, |m, v| m.max(v.abs()));
    let mut at = 0;
    for n in [1, 2, 5, 1, 13, 3, 31, 16] {
        let row = r.step(&want.tokens[at..at + n], at).unwrap();
        at += n;
        let d = max_diff(&[row], &want.logits[at - 1..at]);
        assert!(d <= 1e-4 * scale, "call ending at {at} differs by {d}");
    }
    assert_eq!(at, want.tokens.len());
}

/// The fp16 package and the default recipe's (calibrated 6-bit: the DeltaNet's in_proj_qkv
/// and in_proj_z fitted on the block input, its out_proj on its own input) pass validate
/// against the checkpoint; the fp16 contract carries the conv state of the three DeltaNet
/// blocks and their states [3, Hv, Dk, Dv] beside the one attention block's caches. Measured:
/// default recipe KL 0.055, top-1 0.875 over 256 positions; calibrated 4-bit KL 0.92 (data-free
/// 4-bit 2.49), past the 4-bit gates on this fixture's random weights.
#[test]
fn qwen3_5_packages_validate() {
    needs!(Python);
    let dir = fixture("qwen3_5");
    let out = tempfile::tempdir().unwrap();
    let default = out.path().join("default.mlpackage");
    convert(&dir, &default).args(["--max-seq-len", "256"]).ok();
    let (code, report, err) = validate(&default, &dir, 256);
    eprintln!("qwen3_5 default recipe: {}", report["behaviour"]["kl_mean"]);
    assert_eq!(code, Some(0), "{err}\n{report:#}");
    let pkg = out.path().join("fp16.mlpackage");
    convert(&dir, &pkg)
        .args(["--max-seq-len", "128", "--keep-fp16", "*"])
        .ok();
    let (code, report, err) = validate(&pkg, &dir, 128);
    let metric = |m: &str| report["behaviour"][m].as_f64().unwrap();
    eprintln!(
        "qwen3_5 fp16: kl {} top1 {}",
        metric("kl_mean"),
        metric("top1")
    );
    assert_eq!(code, Some(0), "{err}\n{report:#}");
    assert!(metric("kl_mean") < 1e-3, "{report:#}");
    let pkg = Package::load(&pkg, Default::default()).unwrap();
    let c = hf2coreml::runtime::StepModel::contract(&pkg);
    let r = c.recurrent.as_ref().unwrap();
    assert_eq!(
        (c.num_layers, r.blocks, r.attention_layers.clone()),
        (1, 4, vec![2])
    );
    assert_eq!(r.conv_shape(), Some(vec![3, 3, 96]));
    assert_eq!(r.delta_shape(), Some(vec![3, 4, 16, 8]));
    let names: Vec<&str> = c.inputs.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "input_ids",
            "position",
            "key_cache",
            "value_cache",
            "conv_state",
            "delta_state"
        ]
    );
}

/// Prompts fed one token a call, 5 and 70 a call (72 tokens in a context of 74: the last call
/// holds 2 real tokens and padding, some of it past S) give transformers' logits and the
/// same states; a run resumed from a KV-cache file (both states in it) equals one run.
#[test]
fn qwen3_5_chunks_padding_and_the_cache_file_keep_the_state_exact() {
    needs!(Python);
    let dir = fixture("qwen3_5");
    let want = expected(&dir);
    let out = tempfile::tempdir().unwrap();
    let (s, n) = (74, want.tokens.len());
    assert_eq!(n, 72);
    let packages = Fp16Packages {
        dir: &dir,
        out: out.path(),
        s,
        made: Default::default(),
    };
    let scale = largest(&want.logits);
    let mut single = packages.generator(1);
    let (one, _) = prompt_logits(&mut single, &want.tokens, false);
    let mut chunked = packages.generator(5);
    let (five, _) = prompt_logits(&mut chunked, &want.tokens, false);
    let (d1, d5, d15) = (
        max_diff(&one, &want.logits),
        max_diff(&five, &want.logits),
        max_diff(&five, &one),
    );
    eprintln!("qwen3_5: max |Δ| Q=1 {d1:e}, Q=5 {d5:e}, between {d15:e} (scale {scale})");
    // Measured: 0.34 (Q = 1) and 0.27 (Q = 5, the chunked form) of 23.2 against transformers
    // (an fp32 program of the same weights: 0.04); 0.23 between the two forms, whose fp16
    // roundings differ.
    for d in [d1, d5] {
        assert!(d <= 0.03 * scale, "{d} of {scale}");
    }
    assert!(d15 <= 0.015 * scale, "{d15} of {scale}");
    // 70 a call: a chunk of 64 and one of 6 (its inverse padded to 8), then 2 real tokens.
    let mut long = packages.generator(70);
    let (seventy, _) = prompt_logits(&mut long, &want.tokens, false);
    for (q, got) in [(1, &one), (5, &five), (70, &seventy)] {
        let (rms, top1) = agreement(got, &want.logits);
        eprintln!("qwen3_5 Q={q}: relative RMS {rms:e}, top-1 {top1}");
        assert!(rms <= 0.01 && top1 >= 0.99, "Q={q}: {rms} {top1}");
    }
    let values = same_state(&single, &chunked);
    assert_eq!(values, 3 * 3 * 96 + 3 * 4 * 16 * 8);
    same_state(&single, &long);

    let (file, mut resumed) = packages.saved_after(5, &want.tokens[..25]);
    let contract = hf2coreml::runtime::StepModel::contract(resumed.model()).clone();
    let kv = KvFile::load(&file, &contract).unwrap();
    assert_eq!(kv.recurrent.len(), values);
    kv.restore(&mut resumed).unwrap();
    let (tail, ran) = prompt_logits(&mut resumed, &want.tokens, true);
    assert_eq!(ran, n - 25);
    assert_eq!(tail, five[25..]);
}

/// A chain whose parts are one block each (the DeltaNet parts with `conv_state` and
/// `delta_state` and no caches, the attention part with caches only), an iOS18 package with
/// prefill and decode functions, and a Core AI asset on Apple's runtime all pass validate.
#[test]
fn qwen3_5_chains_prefill_and_assets_validate() {
    needs!(Python);
    let dir = fixture("qwen3_5");
    let out = tempfile::tempdir().unwrap();
    let chain = out.path().join("chain.mlpackage");
    convert(&dir, &chain)
        .args(["--max-seq-len", "64", "--keep-fp16", "*"])
        .args(["--max-package-size", "1200KB"])
        .ok();
    let file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(chain.join("chain.json")).unwrap()).unwrap();
    let inputs: Vec<Vec<String>> = file["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["inputs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["name"].as_str().unwrap().to_string())
                .collect()
        })
        .collect();
    assert_eq!(inputs.len(), 4, "{file:#}");
    assert_eq!(
        inputs[1],
        ["hidden_in", "position", "conv_state", "delta_state"]
    );
    assert_eq!(
        inputs[2],
        ["hidden_in", "position", "key_cache", "value_cache"]
    );
    let ios18 = out.path().join("ios18.mlpackage");
    convert(&dir, &ios18)
        .args(["--max-seq-len", "64", "--keep-fp16", "*"])
        .args(["--target", "ios18", "--prefill-len", "8"])
        .ok();
    let asset = out.path().join("q.aimodel");
    convert(&dir, &asset)
        .args([
            "--max-seq-len",
            "64",
            "--keep-fp16",
            "*",
            "--target",
            "coreai",
        ])
        .ok();
    for pkg in [&chain, &ios18, &asset] {
        let (code, report, err) = validate(pkg, &dir, 64);
        let kl = report["behaviour"]["kl_mean"].as_f64().unwrap();
        eprintln!("{}: kl {kl}", pkg.display());
        assert_eq!(code, Some(0), "{}: {err}\n{report:#}", pkg.display());
        assert!(kl < 2e-3, "{report:#}");
    }
}

/// A Qwen3.5 config that does not describe a model exits 2 naming the field: value heads not
/// a multiple of the key heads, a conv kernel of 0, a block kind Qwen3.5 does not have, a
/// layer list of the wrong length.
#[test]
fn qwen3_5_inconsistent_configs_exit_2_naming_the_field() {
    for (from, to, field) in [
        (
            "\"linear_num_value_heads\": 4",
            "\"linear_num_value_heads\": 3",
            "linear_num_value_heads",
        ),
        (
            "\"linear_conv_kernel_dim\": 4",
            "\"linear_conv_kernel_dim\": 0",
            "linear_conv_kernel_dim",
        ),
        (
            "\"full_attention\",\n    \"linear_attention\"\n",
            "\"sliding_attention\",\n    \"linear_attention\"\n",
            "layer_types",
        ),
        (
            "\"num_hidden_layers\": 4",
            "\"num_hidden_layers\": 5",
            "layer_types",
        ),
    ] {
        inspect_refuses_edited_config("qwen3_5", (from, to), field);
    }
}

/// Qwen3.5 as the Hub ships it (`Qwen3_5ForConditionalGeneration`, written by transformers
/// with a vision tower): the text decoder's config from `text_config`, its tensors from
/// `model.language_model.*` (tied: no lm_head), the tower `model.visual.*` skipped unread and
/// reported; the reference gives transformers' logits of the multimodal model on text tokens,
/// and the fp16 package passes validate and matches them.
#[test]
fn qwen3_5_text_decoder_of_the_multimodal_checkpoint() {
    let dir = fixture("qwen3_5_vl");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let spec = ckpt.spec().clone();
    assert_eq!(
        spec.text_of.as_deref(),
        Some("Qwen3_5ForConditionalGeneration")
    );
    assert!(spec.tie_word_embeddings);
    assert_eq!(spec.gated_delta.as_ref().unwrap().layers, [0, 1, 2, 4]);
    let dropped = &ckpt.dropped().parts;
    assert!(
        dropped.len() == 1 && dropped[0].0 == "model.visual." && dropped[0].1 > 5,
        "{dropped:?}"
    );
    reference_matches_transformers("qwen3_5_vl");
    // The Hub's checkpoints also hold a multi-token prediction block beside the decoder
    // (`mtp.*`, a draft head): skipped unread like the tower.
    let with_mtp = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("config.json"), with_mtp.path().join("config.json")).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = st.tensors();
    let draft = vec![0u8; 2 * 64 * 128];
    tensors.push((
        "mtp.fc.weight".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![64, 128], &draft)
            .unwrap(),
    ));
    let path = with_mtp.path().join("model.safetensors");
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    let mtp = Checkpoint::open(with_mtp.path()).unwrap();
    let parts = &mtp.dropped().parts;
    assert!(
        parts
            .iter()
            .any(|p| p.0 == "mtp." && p.1 == 1 && p.2 == 64 * 128),
        "{parts:?}"
    );
    assert_eq!(mtp.tensor_names().count(), ckpt.tensor_names().count());
    needs!(Python);
    fp16_package_matches_transformers("qwen3_5_vl");
}

/// `inspect` and `budget` count the DeltaNet blocks' fixed state once and the attention
/// block's rows per position, beside what the same blocks would keep if all attended:
/// 2 × 1 × 2 heads × 32 × 128 × 2 B = 32 KiB of rows, 3 conv states of 96 × 3 × 2 B and
/// 3 DeltaNet states of 4 × 16 × 8 × 2 B (4.69 KiB), against 128 KiB.
#[test]
fn qwen3_5_inspect_and_budget_count_the_fixed_state() {
    let dir = fixture("qwen3_5");
    let o = Cli::new().arg("inspect").arg(&dir).output();
    assert!(
        stdout(&o).contains(
            "state        1 attention blocks: 256 B per token; 3 recurrent blocks: 4.69 KiB in all"
        ),
        "{}",
        stdout(&o)
    );
    let o = Cli::new()
        .args(["budget", "--device", "iphone-15", "--max-seq-len", "128"])
        .arg(&dir)
        .output();
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    let line = |key: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap_or_else(|| panic!("no `{key}` in {text}"))
            .to_string()
    };
    assert!(line("kv cache").contains("36.69 KiB"), "{text}");
    assert!(line("kv cache").contains("3 DeltaNet states of 4 × 16 × 8 × 2 B"));
    assert!(line("if all attended").contains("128.00 KiB"), "{text}");
}

/// `--kv-cache state` (iOS18) for both hybrids: the conv and DeltaNet states are Core ML
/// states beside the KV state, zeroed by the package itself when a sequence starts at position
/// 0. With prefill (8 tokens a call) and decode, a 45-token prompt gives the io package's
/// logits; a second, different prompt and then the first again give the first's logits (the
/// state was reset, not carried); a run resumed from a KV-cache file (the states read out of
/// the package and written back) equals one run; the package passes validate; `lint`
/// explains why the states keep it off the Neural Engine.
#[test]
fn hybrid_stateful_packages_keep_their_state_inside() {
    use hf2coreml::runtime::kvfile::KvFile;
    needs!(Python);
    for arch in ["lfm2_untied", "qwen3_5"] {
        let dir = fixture(arch);
        let want = expected(&dir);
        let out = tempfile::tempdir().unwrap();
        let load = |kv: &str| {
            let pkg = out.path().join(format!("{kv}.mlpackage"));
            if !pkg.exists() {
                convert(&dir, &pkg)
                    .args([
                        "--max-seq-len",
                        "64",
                        "--keep-fp16",
                        "*",
                        "--target",
                        "ios18",
                    ])
                    .args(["--prefill-len", "8", "--kv-cache", kv])
                    .ok();
            }
            (
                Generator::new(Package::load(&pkg, Default::default()).unwrap()).unwrap(),
                pkg,
            )
        };
        let prompt = &want.tokens[..45];
        let (mut io, _) = load("io");
        let (mut state, pkg) = load("state");
        let (a, _) = prompt_logits(&mut io, prompt, false);
        let (b, _) = prompt_logits(&mut state, prompt, false);
        let d = max_diff(&a, &b);
        eprintln!("{arch}: stateful against io, max |Δ| {d:e}");
        assert!(d <= 1e-3 * largest(&a), "{arch}: {d}");
        let other: Vec<u32> = prompt.iter().rev().copied().collect();
        prompt_logits(&mut state, &other, false);
        let (again, _) = prompt_logits(&mut state, prompt, false);
        assert_eq!(again, b, "{arch}: a new sequence starts from a zero state");
        // A cache file saved after 21 tokens (the states read out of the package) and loaded
        // into a fresh one continues as one run does, bit for bit.
        let (mut first, _) = load("state");
        prompt_logits(&mut first, &prompt[..21], false);
        let file = out.path().join("s.kv");
        KvFile::from_generator(&first, &prompt[..21], String::new())
            .unwrap()
            .save(&file)
            .unwrap();
        let (mut resumed, _) = load("state");
        let contract = hf2coreml::runtime::StepModel::contract(resumed.model()).clone();
        let kv = KvFile::load(&file, &contract).unwrap();
        assert_eq!(kv.recurrent.len(), contract.recurrent_len(), "{arch}");
        kv.restore(&mut resumed).unwrap();
        let (tail, ran) = prompt_logits(&mut resumed, prompt, true);
        assert_eq!(ran, prompt.len() - 21);
        assert_eq!(tail, b[21..], "{arch}: resumed from a cache file");
        let (code, report, err) = validate(&pkg, &dir, 48);
        assert_eq!(code, Some(0), "{arch}: {err}\n{report:#}");
        let o = Cli::new().arg("lint").arg(&pkg).output();
        let text = stdout(&o);
        assert!(text.contains("state-dims"), "{arch}: {text}");
    }
}
