//! Gemma 4's text decoder (checkpoints transformers 5.23 wrote, docs/reference/gemma4.md): the
//! config read as transformers reads it, the float reference against transformers' logits
//! (per-layer inputs, KV sharing, full blocks of their own head size with proportional RoPE,
//! past the window, soft-capped), the multimodal checkpoint as its text decoder, and its
//! packages (every form of the contract, chains included, with the per-layer table beside
//! them) against transformers and the reference.

use hf2coreml::arch::{LayerKind, Role};
use hf2coreml::checkpoint::Checkpoint;

use super::hf::{
    expected, fixture, fp16_package_matches_transformers, largest, max_diff, prompt_logits,
    reference_matches_transformers, validate, Fp16Packages,
};
use crate::support::{convert, needs, stdout, Cli};

/// The fixtures' shape: blocks S, S, F, S, S, F; the last two read blocks 3 and 2's caches.
#[test]
fn gemma4_config_gives_each_block_its_shape_and_cache() {
    for (arch, global_kv) in [("gemma4", 2), ("gemma4_kv", 1)] {
        let spec = Checkpoint::open(fixture(arch)).unwrap().spec().clone();
        let g = spec.gemma4.clone().expect("Gemma 4's part");
        assert_eq!(
            (g.global_head_dim, g.global_kv_heads, g.global_rotated_pairs),
            (32, global_kv, 4),
            "{arch}"
        );
        assert_eq!((g.first_shared, g.shared_intermediate_size), (4, 192));
        assert_eq!((g.per_layer_input, g.per_layer_vocab), (16, 128));
        assert_eq!(g.final_logit_softcapping, Some(30.0));
        assert_eq!(g.k_eq_v, arch == "gemma4_kv");
        assert_eq!(spec.norm_offset(), 0.0, "Gemma 4's norms multiply by w");
        assert_eq!(spec.attention_scale(), 1.0);
        let shapes: Vec<(usize, usize, Option<usize>, Option<usize>)> = spec
            .layers()
            .iter()
            .map(|k| match k {
                LayerKind::Attention(a) => (a.kv_heads, a.head_dim, a.window, a.kv_from),
                other => panic!("{arch}: {other:?}"),
            })
            .collect();
        let (s, f) = ((2, 16, Some(16), None), (global_kv, 32, None, None));
        assert_eq!(
            shapes,
            [
                s,
                s,
                f,
                s,
                (2, 16, Some(16), Some(3)),
                (global_kv, 32, None, Some(2))
            ],
            "{arch}"
        );
        // Only the blocks that keep a cache have state; the shared ones keep none.
        assert_eq!(spec.attention_layers(0..6), [0, 1, 2, 3]);
        assert!(spec.layer(4).state().is_empty() && spec.layer(5).state().is_empty());
        let kv_row = |heads: usize, d: usize| 2 * heads * d * 2;
        assert_eq!(
            spec.state_bytes(1) as usize,
            3 * kv_row(2, 16) + kv_row(global_kv, 32)
        );
        // Per-layer inputs: the table, the model's projection and its norm, then per block.
        let ckpt = Checkpoint::open(fixture(arch)).unwrap();
        let roles: Vec<Role> = ckpt.slots().iter().map(|s| s.role).collect();
        assert_eq!(
            roles.iter().filter(|r| **r == Role::PerLayer).count(),
            1 + 2 * 6
        );
        assert!(roles.contains(&Role::PerLayerEmbedding));
    }
}

#[test]
fn gemma4_reference_matches_transformers() {
    for arch in ["gemma4", "gemma4_kv"] {
        reference_matches_transformers(arch);
        // Block by block (what `validate` runs past its reference budget, E2B's case), with
        // the per-layer table's rows of the text only: the whole model's logits.
        let dir = fixture(arch);
        let want = expected(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let got = hf2coreml::model::layerwise::logits_layerwise(&ckpt, &want.tokens, &mut |_| {})
            .unwrap();
        let (d, scale) = (max_diff(&got, &want.logits), largest(&want.logits));
        eprintln!("{arch} block by block: max |Δ| {d:e} of {scale}");
        assert!(d <= 1e-4 * scale, "{arch}: {d}");
    }
}

/// `Gemma4ForConditionalGeneration` is its text decoder: the vision tower and its projection
/// into the text stream are left out unread, and the reference gives transformers' logits.
#[test]
fn gemma4_multimodal_checkpoint_is_its_text_decoder() {
    let dir = fixture("gemma4_vl");
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(
        ckpt.spec().text_of.as_deref(),
        Some("Gemma4ForConditionalGeneration")
    );
    let dropped: Vec<&str> = ckpt.dropped().parts.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(dropped, ["model.embed_vision.", "model.vision_tower."]);
    reference_matches_transformers("gemma4_vl");
}

/// The Hub ships Gemma 4 sharded: the same multimodal checkpoint in two shards under an index
/// (the tower in the second, beside text tensors) reads and computes as the single file does.
#[test]
fn gemma4_sharded_multimodal_checkpoint_is_its_text_decoder() {
    let src = fixture("gemma4_vl");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let half = tensors.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        let name = format!("model-{:05}-of-00002.safetensors", i + 1);
        for (t, _) in part {
            map.insert(t.clone(), name.clone().into());
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> = part.to_vec();
        safetensors::serialize_to_file(views, None, &dir.path().join(&name)).unwrap();
    }
    assert!(map
        .values()
        .any(|f| f == "model-00002-of-00002.safetensors"));
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let dropped: Vec<&str> = ckpt.dropped().parts.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(dropped, ["model.embed_vision.", "model.vision_tower."]);
    super::hf::reference_of_matches_transformers(dir.path(), "gemma4_vl");
}

/// Google's original releases still store the key and value projections and key norm of the
/// blocks that share a cache, which transformers skips on load: so does the reader, and the
/// model computes the same.
#[test]
fn gemma4_shared_blocks_stored_keys_and_values_are_left_unread() {
    let src = fixture("gemma4");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let k = st.tensor("model.layers.3.self_attn.k_proj.weight").unwrap();
    let norm = st.tensor("model.layers.3.self_attn.k_norm.weight").unwrap();
    for (name, view) in [
        ("model.layers.4.self_attn.k_proj.weight", &k),
        ("model.layers.4.self_attn.v_proj.weight", &k),
        ("model.layers.4.self_attn.k_norm.weight", &norm),
    ] {
        out.push((name.to_string(), view.clone()));
    }
    safetensors::serialize_to_file(out, None, &dir.path().join("model.safetensors")).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert!(ckpt.contains("model.layers.4.self_attn.k_proj.weight"));
    assert!(!ckpt
        .slots()
        .iter()
        .any(|s| s.name == "model.layers.4.self_attn.k_proj.weight"));
    // A block that keeps its own cache may not carry a stray tensor.
    let bias = st.tensor("model.layers.3.self_attn.k_norm.weight").unwrap();
    let dir2 = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir2.path().join("config.json")).unwrap();
    let mut out: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    out.push(("model.layers.2.self_attn.v_norm.weight".into(), bias));
    safetensors::serialize_to_file(out, None, &dir2.path().join("model.safetensors")).unwrap();
    let err = Checkpoint::open(dir2.path()).unwrap_err().to_string();
    assert!(err.contains("v_norm"), "{err}");
}

/// `inspect` and `budget` count the caches that exist; a conversion that would calibrate its
/// blocks one at a time (mixed precision) or palettize its per-layer table in groups of rows
/// is refused by name before any work.
#[test]
fn gemma4_is_inspected_and_its_refusals_named() {
    let dir = fixture("gemma4");
    let text = stdout(&Cli::new().arg("inspect").arg(&dir).output());
    assert!(text.contains("Gemma4ForCausalLM"), "{text}");
    assert!(
        text.contains(
            "KV cache     4 blocks keep one: 640 B per token; 2 read another's (4←3, 5←2)"
        ),
        "{text}"
    );
    assert!(
        text.contains("full blocks  head_dim 32, 2 key/value heads"),
        "{text}"
    );
    let budget = stdout(
        &Cli::new()
            .arg("budget")
            .arg(&dir)
            .args(["--max-seq-len", "64", "--device", "iphone-15"])
            .output(),
    );
    assert!(
        budget.contains("40.00 KiB  2 × (3 layers × 2 kv heads × 16 + 1 layer × 2 kv heads × 32)"),
        "{budget}"
    );
    let out = tempfile::tempdir().unwrap();
    // Refused with exit 2 naming `needles`, nothing written.
    let refused = |args: &[&std::ffi::OsStr], needles: &[&str]| {
        let o = Cli::new()
            .arg("convert")
            .arg(&dir)
            .arg("-o")
            .arg(out.path().join("g.mlpackage"))
            .args(["--max-seq-len", "64"])
            .args(args)
            .python()
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(needles.iter().all(|n| err.contains(n)), "{err}");
        assert!(!out.path().join("g.mlpackage").exists());
    };
    let os = |a: &'static str| std::ffi::OsStr::new(a);
    refused(
        &[os("--keep-fp16"), os("*"), os("--target-bpw"), os("5")],
        &["`target_bpw (--target-bpw)` does not carry"],
    );
    // The per-layer table has one LUT per block: one per group of rows is refused.
    let recipe = out.path().join("table.toml");
    std::fs::write(
        &recipe,
        "target = \"ios18\"\ndefault = \"fp16\"\n[roles]\nper_layer_embedding = { palettize = \
         { nbits = 4, granularity = \"per_grouped_channel\", group_size = 16 } }\n",
    )
    .unwrap();
    refused(
        &[os("--recipe"), recipe.as_os_str()],
        &["role `per_layer_embedding`", "lut4/g16"],
    );
}

/// fp16 packages of the three fixtures transformers wrote (full blocks whose heads fill two
/// cache slots each, or one slot of the sliding blocks' two heads with `attention_k_eq_v`;
/// shared caches; per-layer inputs; soft-capping; the multimodal checkpoint) pass validate and
/// match transformers' logits over 48 tokens, three times the window.
#[test]
fn gemma4_fp16_package_matches_transformers() {
    needs!(Python);
    fp16_package_matches_transformers("gemma4");
}

#[test]
fn gemma4_kv_fp16_package_matches_transformers() {
    needs!(Python);
    fp16_package_matches_transformers("gemma4_kv");
}

#[test]
fn gemma4_multimodal_fp16_package_matches_transformers() {
    needs!(Python);
    fp16_package_matches_transformers("gemma4_vl");
}

/// The contract's caches for Gemma 4: slots of the sliding blocks' head shape, a full block's
/// rows in as many as they fill, none for the blocks that share; a chunked package over a
/// prompt that is no multiple of Q matches the one-token package and transformers, and a run
/// resumed from a KV-cache file equals one run bit for bit.
#[test]
fn gemma4_chunks_and_the_cache_file_match_one_run() {
    use hf2coreml::runtime::kvfile::KvFile;
    use hf2coreml::runtime::StepModel;
    needs!(Python);
    for (arch, slots) in [("gemma4", 5), ("gemma4_kv", 4)] {
        let dir = fixture(arch);
        let want = expected(&dir);
        let out = tempfile::tempdir().unwrap();
        let packages = Fp16Packages {
            dir: &dir,
            out: out.path(),
            s: 64,
            made: Default::default(),
        };
        let mut single = packages.generator(1);
        let c = StepModel::contract(single.model()).clone();
        assert_eq!(
            (c.num_layers, c.num_kv_heads, c.head_dim),
            (slots, 2, 16),
            "{arch}"
        );
        let (one, _) = prompt_logits(&mut single, &want.tokens, false);
        let mut chunked = packages.generator(5);
        let (five, _) = prompt_logits(&mut chunked, &want.tokens, false);
        // Against transformers as `gemma4_fp16_package_matches_transformers` holds them.
        let (rms, top1) = crate::support::logits::agreement(&one, &want.logits);
        let (scale, d15) = (largest(&want.logits), max_diff(&five, &one));
        eprintln!("{arch}: Q=1 relative RMS {rms:e}, Q=1 against Q=5 max |Δ| {d15:e} of {scale}");
        assert!(rms <= 0.01 && top1 >= 0.99 && d15 <= 0.01 * scale, "{arch}");

        let (file, mut resumed) = packages.saved_after(5, &want.tokens[..25]);
        let contract = StepModel::contract(resumed.model()).clone();
        KvFile::load(&file, &contract)
            .unwrap()
            .restore(&mut resumed)
            .unwrap();
        let (tail, ran) = prompt_logits(&mut resumed, &want.tokens, true);
        assert_eq!(ran, want.tokens.len() - 25);
        assert_eq!(tail, five[25..], "{arch}");
    }
}

/// Every other form of the contract: a stateful iOS18 package, one with prefill and decode
/// functions, and a Core AI asset on Apple's runtime, each within validate's gates of the
/// reference.
#[test]
fn gemma4_states_functions_and_assets_validate() {
    needs!(Python);
    let dir = fixture("gemma4");
    let out = tempfile::tempdir().unwrap();
    let forms: [(&str, &[&str]); 3] = [
        (
            "state.mlpackage",
            &["--target", "ios18", "--kv-cache", "state"],
        ),
        (
            "prefill.mlpackage",
            &["--target", "ios18", "--prefill-len", "8"],
        ),
        ("g.aimodel", &["--target", "coreai"]),
    ];
    for (name, args) in forms {
        let pkg = out.path().join(name);
        convert(&dir, &pkg)
            .args(["--max-seq-len", "64", "--keep-fp16", "*"])
            .args(args)
            .ok();
        let (code, report, err) = validate(&pkg, &dir, 64);
        let kl = report["behaviour"]["kl_mean"].as_f64().unwrap();
        eprintln!("{name}: kl {kl}");
        assert_eq!(code, Some(0), "{name}: {err}\n{report:#}");
        assert!(kl < 2e-3, "{name}: {report:#}");
    }
}

/// A recipe that palettizes the per-layer table (role `per_layer_embedding`) gets it beside
/// the package as LUT indices: one LUT per block, the exact k-means fit of that block's
/// columns (`palettize_f16` of them gives the same LUT and indices), then the rows, each
/// packed on its own as an LSB-first bit stream. `budget` counts that file; one package and a
/// chain pass validate with it, under the gates of the table's bits.
#[test]
fn gemma4_per_layer_table_palettized_beside_the_package() {
    use half::f16;
    use hf2coreml::quant::palettize_f16;
    needs!(Python);
    let dir = fixture("gemma4");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let g = ckpt.spec().gemma4.clone().unwrap();
    let (rows, layers, width) = (
        g.per_layer_vocab,
        ckpt.spec().num_hidden_layers,
        g.per_layer_input,
    );
    let table = ckpt
        .tensor("model.embed_tokens_per_layer.weight")
        .unwrap()
        .to_f16();
    let out = tempfile::tempdir().unwrap();
    let recipe = |nbits: u8| {
        let path = out.path().join(format!("r{nbits}.toml"));
        let text = format!(
            "default = \"fp16\"\n[roles]\nper_layer_embedding = {{ palettize = {{ nbits = {nbits} }} }}\n"
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    for nbits in [8u8, 6, 4] {
        let pkg = out.path().join(format!("t{nbits}.mlpackage"));
        convert(&dir, &pkg)
            .args(["--max-seq-len", "64", "--recipe"])
            .arg(recipe(nbits))
            .ok();
        let bytes = std::fs::read(out.path().join(format!("t{nbits}.per_layer.bin"))).unwrap();
        let k = 1usize << nbits;
        let (head, body) = bytes.split_at(layers * k * 2);
        let row_bytes = (layers * width * nbits as usize).div_ceil(8);
        assert_eq!(body.len(), rows * row_bytes);
        let indices: Vec<Vec<u8>> = body
            .chunks_exact(row_bytes)
            .map(|r| hf2coreml::quant::unpack_indices(r, nbits, layers * width))
            .collect();
        for l in 0..layers {
            let column: Vec<f16> = (0..rows)
                .flat_map(|r| table[(r * layers + l) * width..][..width].to_vec())
                .collect();
            let fit = palettize_f16(&column, nbits, None).unwrap();
            let lut: Vec<f16> = head[l * k * 2..][..k * 2]
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect();
            assert_eq!(lut, fit.lut, "block {l}'s LUT");
            let stored: Vec<u8> = indices
                .iter()
                .flat_map(|r| r[l * width..][..width].to_vec())
                .collect();
            assert_eq!(stored, fit.indices, "block {l}'s indices");
        }
        let report: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.path().join(format!("t{nbits}.report.json"))).unwrap(),
        )
        .unwrap();
        let t = &report["contract"]["per_layer"];
        assert_eq!(t["dtype"], format!("lut{nbits}"));
        assert_eq!(t["sha256"], hf2coreml::util::sha256_hex(&bytes));
        let budget = Cli::new()
            .arg("budget")
            .arg(&dir)
            .args([
                "--max-seq-len",
                "64",
                "--device",
                "iphone-15",
                "--json",
                "--recipe",
            ])
            .arg(recipe(nbits))
            .output();
        let budget: serde_json::Value = serde_json::from_slice(&budget.stdout).unwrap();
        assert_eq!(budget["mapped_bytes"], bytes.len());
        assert_eq!(budget["per_layer_bits"], nbits);
        let (code, report, err) = validate(&pkg, &dir, 64);
        let kl = report["behaviour"]["kl_mean"].as_f64().unwrap();
        eprintln!("gemma4, the per-layer table at {nbits} bits: KL {kl}");
        assert_eq!(code, Some(0), "{err}\n{report:#}");
        assert!(kl < [2e-2, 2e-3][usize::from(nbits == 8)], "{kl}");
    }
    // A chain reads the same table beside it.
    let chain = out.path().join("chain.mlpackage");
    convert(&dir, &chain)
        .args([
            "--max-seq-len",
            "64",
            "--max-package-size",
            "1450KB",
            "--recipe",
        ])
        .arg(recipe(8))
        .ok();
    assert!(out.path().join("chain/chain.json").is_file() || chain.join("chain.json").is_file());
    let (code, report, err) = validate(&chain, &dir, 64);
    assert_eq!(code, Some(0), "{err}\n{report:#}");
}

/// The per-layer table lives beside the package, not in it: `X.per_layer.bin` holds the
/// checkpoint's table as fp16 rows, the contract its shape and hash, `budget` counts it as
/// mapped; `run` refuses a package whose table is missing or cut short (exit 2, naming the
/// file), and `validate` fails one whose table was changed.
#[test]
fn gemma4_per_layer_table_lives_beside_the_package() {
    needs!(Python);
    let dir = fixture("gemma4");
    let out = tempfile::tempdir().unwrap();
    let pkg = out.path().join("t.mlpackage");
    convert(&dir, &pkg)
        .args(["--max-seq-len", "64", "--keep-fp16", "*"])
        .ok();
    let table = out.path().join("t.per_layer.bin");
    let bytes = std::fs::read(&table).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let name = "model.embed_tokens_per_layer.weight";
    let want: Vec<u8> = ckpt
        .tensor(name)
        .unwrap()
        .to_f16()
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert!(
        bytes == want,
        "the table file is the checkpoint's table in fp16"
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("t.report.json")).unwrap()).unwrap();
    let t = &report["contract"]["per_layer"];
    let g = ckpt.spec().gemma4.clone().unwrap();
    assert_eq!(t["rows"], g.per_layer_vocab);
    assert_eq!(t["layers"], ckpt.spec().num_hidden_layers);
    assert_eq!(t["width"], g.per_layer_input);
    assert_eq!(t["sha256"], hf2coreml::util::sha256_hex(&bytes));
    let stored: Vec<&str> = report["palettize"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert!(!stored.is_empty() && !stored.contains(&name), "{stored:?}");
    let budget = Cli::new()
        .arg("budget")
        .arg(&dir)
        .args(["--max-seq-len", "64", "--device", "iphone-15", "--json"])
        .output();
    let budget: serde_json::Value = serde_json::from_slice(&budget.stdout).unwrap();
    assert_eq!(budget["mapped_bytes"], bytes.len());

    let run = || {
        Cli::new()
            .arg("run")
            .arg(&pkg)
            .args(["--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
            .output()
    };
    assert_eq!(run().status.code(), Some(0));
    std::fs::write(&table, &bytes[..bytes.len() - 2]).unwrap();
    let o = run();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("t.per_layer.bin") && err.contains("bytes"),
        "{err}"
    );
    std::fs::remove_file(&table).unwrap();
    let o = run();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("t.per_layer.bin"), "{err}");

    let mut changed = bytes.clone();
    changed[7] ^= 0x10;
    std::fs::write(&table, &changed).unwrap();
    let (code, report, err) = validate(&pkg, &dir, 64);
    assert_eq!(code, Some(1), "{err}");
    let failed: Vec<&str> = report["contract"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["ok"] == false)
        .map(|i| i["what"].as_str().unwrap())
        .collect();
    assert_eq!(
        failed,
        ["per-layer table `t.per_layer.bin` sha256"],
        "{report:#}"
    );

    // Another model converted over it: refused without --force; with it, the output is that
    // model's files only (no table of the earlier one left behind).
    let llama = hf2coreml_testkit::TinyModel::llama().write_temp().unwrap();
    let o = convert(llama.path(), &pkg)
        .args(["--max-seq-len", "16", "--keep-fp16", "*"])
        .output();
    assert_eq!(o.status.code(), Some(2));
    convert(llama.path(), &pkg)
        .args(["--max-seq-len", "16", "--keep-fp16", "*", "--force"])
        .ok();
    assert!(!table.exists(), "the earlier model's table is gone");
    assert!(pkg.is_dir());
}

/// A chain of Gemma 4 computes what one package computes, bit for bit: the first part hands
/// the per-layer inputs on, a shared block is in its producer's part, and the cache slots of
/// each part are its blocks'; the chain's per-layer table is beside it and validate checks it.
/// A chain of Core AI assets validates on Apple's runtime.
#[test]
fn gemma4_chain_computes_what_one_package_computes() {
    needs!(Python);
    use hf2coreml::runtime::chain_runner::Saved;
    use hf2coreml::runtime::generate::Generator;
    let dir = fixture("gemma4");
    let want = expected(&dir);
    let out = tempfile::tempdir().unwrap();
    let (one, chain) = (
        out.path().join("one.mlpackage"),
        out.path().join("chain.mlpackage"),
    );
    for (pkg, args) in [
        (&one, &[][..]),
        (&chain, &["--max-package-size", "1450KB"][..]),
    ] {
        convert(&dir, pkg)
            .args(["--max-seq-len", "64", "--keep-fp16", "*"])
            .args(args)
            .ok();
    }
    let file = hf2coreml::mil::chain_file::ChainFile::read(&chain).unwrap();
    let parts: Vec<_> = file
        .parts
        .iter()
        .map(|p| (p.layers.clone(), p.slots.clone()))
        .collect();
    eprintln!("gemma4 chain: {parts:?}");
    assert!(parts.len() > 1, "{parts:?}");
    // Blocks 4 and 5 read blocks 3 and 2: one part holds blocks 2 to 5.
    assert!(file
        .parts
        .iter()
        .any(|p| p.layers.start <= 2 && p.layers.end >= 6));
    assert!(out.path().join("chain.per_layer.bin").is_file());
    let logits = |path: &std::path::Path| {
        let saved = Saved::load(path, Default::default()).unwrap();
        prompt_logits(&mut Generator::new(saved).unwrap(), &want.tokens, false).0
    };
    let (a, b) = (logits(&one), logits(&chain));
    assert!(
        a == b,
        "the chain's logits differ: max |Δ| {}",
        max_diff(&a, &b)
    );
    let (code, report, err) = validate(&chain, &dir, 64);
    assert_eq!(code, Some(0), "{err}\n{report:#}");
    // The same chain of Core AI assets on Apple's runtime.
    let assets = out.path().join("assets.aimodel");
    convert(&dir, &assets)
        .args([
            "--max-seq-len",
            "64",
            "--keep-fp16",
            "*",
            "--target",
            "coreai",
        ])
        .args(["--max-package-size", "1450KB"])
        .ok();
    assert!(hf2coreml::mil::chain_file::is_chain(&assets));
    let (code, report, err) = validate(&assets, &dir, 64);
    assert_eq!(code, Some(0), "{err}\n{report:#}");
    assert!(
        report["behaviour"]["kl_mean"].as_f64().unwrap() < 2e-3,
        "{report:#}"
    );
}

/// Settings transformers would compute differently from the dense causal text decoder are
/// refused naming the field.
#[test]
fn gemma4_unsupported_fields_exit_2() {
    use super::hf::inspect_refuses_edited_config;
    for (from, to, field) in [
        (
            "\"enable_moe_block\": false",
            "\"enable_moe_block\": true",
            "enable_moe_block",
        ),
        (
            "\"use_bidirectional_attention\": null",
            "\"use_bidirectional_attention\": \"all\"",
            "use_bidirectional_attention",
        ),
        (
            "\"num_kv_shared_layers\": 2",
            "\"num_kv_shared_layers\": 5",
            "num_kv_shared_layers",
        ),
        (
            "\"rope_type\": \"proportional\"",
            "\"rope_type\": \"yarn\"",
            "rope_parameters.full_attention.rope_type",
        ),
        (
            "\"head_dim\": 32",
            "\"head_dim\": 32, \"intermediate_size\": 8",
            "per_layer_config",
        ),
    ] {
        inspect_refuses_edited_config("gemma4", (from, to), field);
    }
}

/// The default recipe calibrates Gemma 4 through its per-layer inputs and shared caches: each
/// fixture's package passes validate (the multimodal checkpoint's report naming the towers
/// left out), and on `gemma4` the calibrated package is nearer the reference than the
/// data-free one at the same bits.
#[test]
fn gemma4_default_recipe_calibrates_through_per_layer_inputs_and_shared_caches() {
    needs!(Python);
    let out = tempfile::tempdir().unwrap();
    let default = |arch: &str, name: &str, args: &[&str]| {
        let dir = fixture(arch);
        let pkg = out.path().join(name);
        convert(&dir, &pkg)
            .args(["--max-seq-len", "64"])
            .args(args)
            .ok();
        let (code, report, err) = validate(&pkg, &dir, 64);
        let kl = report["behaviour"]["kl_mean"].as_f64().unwrap();
        eprintln!("{arch} {args:?}: KL {kl}");
        (code, kl, format!("{err}\n{report:#}"))
    };
    let mut calibrated = 0.0;
    for arch in ["gemma4", "gemma4_kv", "gemma4_vl"] {
        let (code, kl, why) = default(arch, &format!("{arch}.mlpackage"), &[]);
        assert_eq!(code, Some(0), "{arch}: {why}");
        if arch == "gemma4" {
            calibrated = kl;
        }
    }
    // The conversion's report records the towers it left out.
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("gemma4_vl.report.json")).unwrap())
            .unwrap();
    let dropped: Vec<&str> = written["dropped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["prefix"].as_str().unwrap())
        .collect();
    assert_eq!(dropped, ["model.embed_vision.", "model.vision_tower."]);
    assert!(written["dropped"][1]["parameters"].as_u64().unwrap() > 0);
    let (_, data_free, _) = default("gemma4", "d.mlpackage", &["--data-free"]);
    assert!(calibrated < 0.7 * data_free, "{calibrated} {data_free}");
}
