//! A chain of Core AI assets (`--target coreai --max-package-size`): every part an `.aimodel`
//! executed by Apple's runtime, the chain computing what one asset computes, `validate`,
//! `inspect` and `run` reading it, `lint` refusing it by name, and a part copied over another
//! refused at load.

use hf2coreml::mil::chain_file::{ChainFile, CHAIN_FILE};
use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::interp::Options;

use super::{convert_ranged, model, ok, run_logits, validate, SPLIT};
use crate::support::{needs, Cli};

#[test]
fn a_chain_of_assets_computes_what_one_asset_computes() {
    needs!(Python);
    let src = model().write_temp().unwrap();
    let root = tempfile::tempdir().unwrap();
    let ranges = root.path().join("ranges.json");
    std::fs::write(
        &ranges,
        r#"{"residual_max_abs": [1000, 1000, 1000, 1000, 1000, 1000], "source": "test"}"#,
    )
    .unwrap();
    let one = root.path().join("one.aimodel");
    let chain = root.path().join("chain.aimodel");
    let asset = ["--keep-fp16", "*", "--target", "coreai"];
    ok(
        &convert_ranged(src.path(), &one, &ranges)
            .args(asset)
            .output(),
        "convert (one)",
    );
    ok(
        &convert_ranged(src.path(), &chain, &ranges)
            .args(asset)
            .args(["--max-package-size", SPLIT])
            .output(),
        "convert (chain)",
    );
    assert!(hf2coreml::aimodel::is_aimodel(&one), "one asset, as before");
    assert!(!hf2coreml::aimodel::is_aimodel(&chain));
    let desc = ChainFile::read(&chain).unwrap();
    assert!(desc.parts.len() >= 3, "{desc:#?}");
    assert_eq!(desc.contract.target.as_str(), "coreai");
    for p in &desc.parts {
        assert!(p.path.ends_with(".aimodel"), "{}", p.path);
        assert!(p.bytes <= 1_200_000, "{}: {} bytes", p.path, p.bytes);
        assert!(hf2coreml::aimodel::is_aimodel(&ChainFile::part_path(
            &chain, p
        )));
        assert!(p.sha256.contains_key("metadata.json"), "{:?}", p.sha256);
    }
    assert!(root.path().join("chain.report.json").is_file());
    let loaded = Saved::load(&chain, Options::default()).unwrap();
    assert!(matches!(&loaded, Saved::Chain(c) if c.is_coreai()));
    assert!(loaded.runtime_name().contains("Core AI"));
    drop(loaded);

    // The hidden state crosses between parts as the part before returned it, in fp16 as it
    // does between blocks inside one asset.
    let a = run_logits(&one, &root.path().join("one.npy"));
    let b = run_logits(&chain, &root.path().join("chain.npy"));
    assert!(a.len() > 128);
    assert!(a == b, "the chain's logits differ from the asset's");

    let (code_one, rep_one) = validate(&one, src.path());
    let (code_chain, rep_chain) = validate(&chain, src.path());
    assert_eq!(code_one, Some(0), "{rep_one:#}");
    assert_eq!(code_chain, Some(0), "{rep_chain:#}");
    assert_eq!(rep_one["behaviour"], rep_chain["behaviour"]);
    assert_eq!(rep_one["runtime"], rep_chain["runtime"]);
    let items = rep_chain["contract"].as_array().unwrap();
    assert!(items.len() > 10 * desc.parts.len() / 2, "{items:#?}");
    assert!(items.iter().all(|i| i["ok"] == true), "{items:#?}");
    let hashed = items
        .iter()
        .filter(|i| i["what"].as_str().unwrap().contains("sha256 of main.mlirb"))
        .count();
    assert_eq!(hashed, desc.parts.len(), "{items:#?}");

    let o = Cli::new().arg("inspect").arg(&chain).arg("--json").output();
    ok(&o, "inspect");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let parts = j["parts"].as_array().unwrap();
    assert_eq!(parts.len(), desc.parts.len());
    assert!(
        parts.iter().all(|p| p["functions"][0]["name"] == "main"),
        "{j:#}"
    );

    let o = Cli::new().arg("lint").arg(&chain).output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("Core AI"), "{err}");

    // The interpreter's options are refused, not ignored, for what Apple's runtime runs.
    for model in [&chain, &one] {
        let o = Cli::new()
            .arg("run")
            .arg(model)
            .args([
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "1",
                "--compute",
                "f32",
            ])
            .output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("--compute f32 applies to hf2coreml's interpreter"),
            "{err}"
        );
    }

    // A part copied over another is refused when the chain is loaded.
    let copied = root.path().join("copied.aimodel");
    std::fs::create_dir(&copied).unwrap();
    hf2coreml::fsutil::copy_tree(&chain, &copied).unwrap();
    let (a, b) = (&desc.parts[1].path, &desc.parts[2].path);
    std::fs::remove_dir_all(copied.join(b)).unwrap();
    std::fs::create_dir(copied.join(b)).unwrap();
    hf2coreml::fsutil::copy_tree(&copied.join(a), &copied.join(b)).unwrap();
    let o = Cli::new()
        .arg("run")
        .arg(&copied)
        .args(["--prompt-ids", "1", "--max-new-tokens", "1"])
        .output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("metadata.json is not the one the chain recorded"),
        "{err}"
    );
    // A chain file whose parts are not of its target is refused.
    let text = std::fs::read_to_string(chain.join(CHAIN_FILE)).unwrap();
    let mixed = root.path().join("mixed.aimodel");
    std::fs::create_dir(&mixed).unwrap();
    hf2coreml::fsutil::copy_tree(&chain, &mixed).unwrap();
    std::fs::write(
        mixed.join(CHAIN_FILE),
        text.replacen("\"coreai\"", "\"ios17\"", 1),
    )
    .unwrap();
    let o = Cli::new().arg("inspect").arg(&mixed).output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("Core AI parts are `.aimodel`"), "{err}");
}
