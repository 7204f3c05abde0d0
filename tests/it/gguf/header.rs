//! `inspect` and `budget` on a .gguf read the header only: they describe a file whose tensor
//! data is incomplete (and say where it stops), including the first ~95 MB of the real
//! DeepSeek-R1-Distill-Qwen-7B Q4_K_M (`make gguf-7b-head`, `HF2COREML_GGUF_7B_HEAD`), and
//! the same header over ~4.7 GB of data they never read.

use std::path::Path;

use hf2coreml::checkpoint::gguf::{self, GgufError};
use hf2coreml_testkit::gguf::TinyGguf;

use crate::support::need::gguf_7b_head;
use crate::support::{hf2coreml, needs};

fn run(args: &[&std::ffi::OsStr]) -> (Option<i32>, String, String) {
    let o = hf2coreml(args);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn inspect_json(file: &Path) -> serde_json::Value {
    let (code, out, err) = run(&["inspect".as_ref(), file.as_os_str(), "--json".as_ref()]);
    assert_eq!(code, Some(0), "{err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn real_7b_header_is_described_and_planned() {
    needs!(Gguf7bHead);
    let file = gguf_7b_head();
    let j = inspect_json(&file);
    assert_eq!(j["architecture"], "Qwen2ForCausalLM");
    assert_eq!(j["layers"], 28);
    assert_eq!(j["hidden_size"], 3584);
    assert_eq!(j["intermediate_size"], 18944);
    assert_eq!(j["num_attention_heads"], 28);
    assert_eq!(j["num_key_value_heads"], 4);
    assert_eq!(j["vocab_size"], 152_064);
    let params = j["parameters"].as_u64().unwrap();
    assert!((7.5e9..7.7e9).contains(&(params as f64)), "{params}");
    let g = &j["gguf"];
    let size = std::fs::metadata(&file).unwrap().len();
    assert_eq!(g["truncated_at"], size);
    let count = |name: &str| {
        g["tensor_types"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .map_or(0, |t| t["tensors"].as_u64().unwrap())
    };
    assert!(
        count("Q4_K") > 150 && count("Q6_K") > 20 && count("F32") > 50,
        "{g:#}"
    );
    let bpw = g["bits_per_weight"].as_f64().unwrap();
    assert!(
        (4.7..5.0).contains(&bpw),
        "Q4_K_M is ~4.85 bits/weight: {bpw}"
    );
    assert_eq!(g["projection_type"][0], "Q4_K");

    let (_, text, _) = run(&["inspect".as_ref(), file.as_os_str()]);
    assert!(
        text.contains(&format!("tensor data truncated at byte {size}")),
        "{text}"
    );
    assert!(
        text.contains("Q4_K") && text.contains("bits/weight"),
        "{text}"
    );

    // An iPhone plan from the header: 4-bit projections, fp16 embedding and lm_head (about
    // 3.3 GB + 2.2 GB).
    let (code, out, err) = run(&[
        "budget".as_ref(),
        file.as_os_str(),
        "--device".as_ref(),
        "iphone-17-pro".as_ref(),
        "--increased-memory-limit".as_ref(),
        "--recipe".as_ref(),
        "calibrated-4bit".as_ref(),
        "--max-seq-len".as_ref(),
        "1024".as_ref(),
        "--json".as_ref(),
    ]);
    assert!(matches!(code, Some(0) | Some(1)), "{err}");
    let b: serde_json::Value = serde_json::from_str(&out).unwrap();
    let weights = b["weights_bytes"].as_f64().unwrap();
    assert!((5.0e9..7.0e9).contains(&weights), "{b:#}");
    // Exit 0 only when it fits in memory and splits into packages under the device's limit
    // (Qwen2's fp16 embedding, 1.09 GB, is over an iPhone's 1 GB).
    let splits = b["packages"]["parts"].is_array();
    assert_eq!(code == Some(0), b["fits"] == true && splits, "{b:#}");
    let (_, text, _) = run(&[
        "budget".as_ref(),
        file.as_os_str(),
        "--device".as_ref(),
        "iphone-17-pro".as_ref(),
        "--increased-memory-limit".as_ref(),
        "--recipe".as_ref(),
        "calibrated-4bit".as_ref(),
    ]);
    assert!(
        text.contains("re-quantizes") && text.contains("truncated at byte"),
        "{text}"
    );

    // Converting needs the data: the import names the truncation.
    match gguf::GgufFile::open(&file) {
        Err(GgufError::Truncated { file_size, .. }) => assert_eq!(file_size, size),
        other => panic!("expected a truncation error, got {other:?}"),
    }
}

#[test]
fn truncated_fixture_is_inspected_but_not_imported() {
    let bytes = TinyGguf::llama().build().writer.to_bytes();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cut.gguf");
    let cut = bytes.len() - 1000;
    std::fs::write(&file, &bytes[..cut]).unwrap();
    let j = inspect_json(&file);
    assert_eq!(j["gguf"]["truncated_at"], cut as u64);
    assert_eq!(j["layers"], 2);
    let (code, _, err) = run(&[
        "import-gguf".as_ref(),
        file.as_os_str(),
        "-o".as_ref(),
        dir.path().join("out").as_os_str(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("truncated"), "{err}");
}

#[test]
fn header_only_commands_never_read_tensor_data() {
    needs!(Gguf7bHead);
    // The 7B head extended (sparsely, with zeros: not a valid model's data) to the full size
    // its header declares, ~4.7 GB: inspect answers at once and sees a complete file.
    let head = gguf_7b_head();
    let g = gguf::GgufFile::open_header(&head).unwrap();
    let end = g
        .tensors()
        .iter()
        .map(|t| t.start + t.n_bytes)
        .max()
        .unwrap();
    assert!(end > 4 << 30, "{end}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("full.gguf");
    std::fs::copy(&head, &file).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(end).unwrap();
    drop(f);
    let t = std::time::Instant::now();
    let j = inspect_json(&file);
    assert!(
        t.elapsed().as_secs_f64() < 10.0,
        "inspect took {:?}",
        t.elapsed()
    );
    assert_eq!(j["hidden_size"], 3584);
    assert!(j["gguf"]["truncated_at"].is_null(), "{j:#}");
}

/// Every architecture's file, cut short, is described from its header alone (its own
/// architecture and shapes, the tensors a plan needs) and planned by `budget`.
#[test]
fn every_architecture_is_described_and_planned_from_its_header() {
    use hf2coreml_testkit::gguf::{q4_k_m_fixture, q4_k_m_spm_fixture};
    use hf2coreml_testkit::TinyModel;
    let dir = tempfile::tempdir().unwrap();
    for (name, model, sp) in [
        ("Qwen3ForCausalLM", TinyModel::qwen3(), false),
        ("Gemma3ForCausalLM", TinyModel::gemma3(), true),
        ("LlamaForCausalLM", TinyModel::mistral(), true),
        ("Phi3ForCausalLM", TinyModel::phi3(), false),
    ] {
        let head_dim = hf2coreml_testkit::gguf::kquant_model(model.clone())
            .spec()
            .head_dim;
        let src = tempfile::tempdir().unwrap();
        let built = match sp {
            true => q4_k_m_spm_fixture(model, src.path()),
            false => q4_k_m_fixture(model, src.path()),
        }
        .unwrap();
        let bytes = built.writer.to_bytes();
        let file = dir.path().join(format!("{name}.gguf"));
        std::fs::write(&file, &bytes[..bytes.len() - 4096]).unwrap();
        let j = inspect_json(&file);
        assert_eq!(j["architecture"], name, "{j:#}");
        assert_eq!(j["head_dim"], head_dim, "{name}");
        assert!(j["gguf"]["truncated_at"].is_u64(), "{name}");
        let (code, out, err) = run(&[
            "budget".as_ref(),
            file.as_os_str(),
            "--device".as_ref(),
            "iphone-15-pro".as_ref(),
            "--json".as_ref(),
        ]);
        assert_eq!(code, Some(0), "{name}: {err}");
        let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert!(plan["fits"].as_bool().unwrap(), "{name}: {plan:#}");
    }
}
