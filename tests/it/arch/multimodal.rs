//! The text decoder of a multimodal checkpoint (`Gemma3ForConditionalGeneration`): its
//! `text_config` and its `language_model.model.*` / `model.language_model.*` tensors are the
//! text model's, its vision tower and projector are skipped unread, and it computes what the
//! same text model saved on its own computes.

use std::path::Path;

use hf2coreml::checkpoint::Checkpoint;
use hf2coreml_testkit::TinyModel;

/// `text` (a text-only checkpoint) rewritten as the multimodal class stores it, its tensors
/// under `prefix`, beside a vision tower and a projector.
fn as_multimodal(text: &Path, dir: &Path, prefix: &str) {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(text.join("config.json")).unwrap()).unwrap();
    let nested = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": config,
        "vision_config": {"hidden_size": 8, "model_type": "siglip_vision_model"},
        "mm_tokens_per_image": 4,
    });
    std::fs::write(dir.join("config.json"), nested.to_string()).unwrap();
    let bytes = std::fs::read(text.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let renamed = match name.strip_prefix("model.") {
                Some(rest) => format!("{prefix}{rest}"),
                None => name,
            };
            (renamed, view)
        })
        .collect();
    let tower = vec![0u8; 2 * 8 * 12];
    for name in [
        "vision_tower.embeddings.patch_embedding.weight",
        "multi_modal_projector.mm_input_projection_weight",
    ] {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![8, 12], &tower)
                .unwrap();
        out.push((name.to_string(), view));
    }
    safetensors::serialize_to_file(out, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn a_multimodal_gemma3_checkpoint_is_its_text_decoder() {
    let model = TinyModel::gemma3();
    let text = model.write_temp().unwrap();
    let plain = Checkpoint::open(text.path()).unwrap();
    for prefix in ["language_model.model.", "model.language_model."] {
        let dir = tempfile::tempdir().unwrap();
        as_multimodal(text.path(), dir.path(), prefix);
        let mm = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(
            mm.spec().text_of.as_deref(),
            Some("Gemma3ForConditionalGeneration")
        );
        let mut names: Vec<&str> = mm.tensor_names().collect();
        let mut want: Vec<&str> = plain.tensor_names().collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "{prefix}");
        for slot in plain.slots() {
            let (a, b) = (
                plain.tensor(&slot.name).unwrap(),
                mm.tensor(&slot.name).unwrap(),
            );
            assert!(a.data == b.data, "{}", slot.name);
        }
        let dropped = &mm.dropped().parts;
        assert_eq!(
            dropped,
            &[
                ("multi_modal_projector.".to_string(), 1, 96, 192),
                ("vision_tower.".to_string(), 1, 96, 192),
            ]
        );
        let o = crate::support::hf2coreml(&["inspect", dir.path().to_str().unwrap()]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(
            out.contains("text decoder of Gemma3ForConditionalGeneration")
                && out.contains("vision_tower.*  1 tensors"),
            "{out}"
        );
    }
}

/// A tensor of the multimodal class that is neither the text decoder's nor a known tower's
/// is refused by name, as any unused tensor is.
#[test]
fn an_unknown_part_of_a_multimodal_checkpoint_is_refused() {
    let text = TinyModel::gemma3().write_temp().unwrap();
    let dir = tempfile::tempdir().unwrap();
    as_multimodal(text.path(), dir.path(), "language_model.model.");
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st.tensors();
    let audio = vec![0u8; 16];
    out.push((
        "audio_tower.conv.weight".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![8], &audio).unwrap(),
    ));
    safetensors::serialize_to_file(out, None, &dir.path().join("model.safetensors")).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("audio_tower.conv.weight"), "{e}");
}

/// The multimodal Gemma 3 checkpoint transformers 5.23 writes (`gemma3_vl`: the legacy
/// `language_model.model.*` names beside a one-layer SigLIP tower and its projector) is its
/// text decoder: the tower is left out unread and named by `inspect`, the reference gives
/// transformers' logits of the text tokens, and the fp16 package matches them.
#[test]
fn gemma3_multimodal_checkpoint_transformers_wrote_converts_as_its_text_decoder() {
    use super::hf::{fixture, fp16_package_matches_transformers, reference_matches_transformers};
    use crate::support::{needs, stdout, Cli};

    let dir = fixture("gemma3_vl");
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(
        ckpt.spec().text_of.as_deref(),
        Some("Gemma3ForConditionalGeneration")
    );
    let dropped: Vec<&str> = ckpt.dropped().parts.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(dropped, ["multi_modal_projector.", "vision_tower."]);
    let text = stdout(&Cli::new().arg("inspect").arg(&dir).output());
    assert!(
        text.contains("vision_tower.*  32 tensors, 19,200 parameters"),
        "{text}"
    );
    reference_matches_transformers("gemma3_vl");
    needs!(Python);
    fp16_package_matches_transformers("gemma3_vl");
}
