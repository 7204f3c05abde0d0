"""Write tiny random Hugging Face checkpoints of the newer architectures with transformers itself,
plus transformers' float32 logits for a fixed token sequence: the fixtures under
tests/fixtures/hf/<arch>/ that tests/it/arch/ hold the Rust reference and converted packages to.

usage: python hf_models.py [OUT_DIR] [ARCH ...]
  OUT_DIR defaults to tests/fixtures/hf beside this repository's python/ folder; ARCH names a
  subset (default: all of ARCHS below).

Each OUT_DIR/<arch>/ gets what save_pretrained writes (config.json, model.safetensors in
bfloat16) and reference.json: {"transformers": version, "torch": version, "tokens": [...],
"logits": [[V floats] per position]}. The logits come from the float32 model whose weights
were first rounded to bfloat16, so they are exactly the saved weights' logits.

Needs torch and transformers from PyPI, in a venv of their own (not the coremltools one):
  python -m venv ~/.cache/hf2coreml/venv-testgen
  ~/.cache/hf2coreml/venv-testgen/bin/pip install torch==2.15.0 transformers==5.23.0
Rerunning with the same versions rewrites byte-identical weights (seeded).
"""

import json
import os
import sys

import torch
import transformers

VOCAB = 128
# Long enough to exceed the sliding windows; LENGTH overrides the length per fixture.
TOKENS = [(i * 37 + 11) % VOCAB for i in range(40)]
LENGTH = {"phi3_longrope": 136, "lfm2": 56, "lfm2_untied": 56, "qwen3_5": 72, "qwen3_5_vl": 64,
          "gemma4": 48, "gemma4_kv": 48, "gemma4_vl": 48}


def common(**kw):
    """Fields every tiny model shares."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(kw)
    return base


def qwen3():
    """q_norm/k_norm per head before RoPE, explicit head_dim (32, not 64/4), tied, no biases."""
    cfg = transformers.Qwen3Config(
        **common(num_hidden_layers=2, head_dim=32, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
        tie_word_embeddings=True,
        attention_bias=False,
    )
    return transformers.Qwen3ForCausalLM, cfg


def smollm3():
    """Llama-like with NoPE blocks; every 2nd here (no_rope_layers = [1, 0]) so that two blocks
    cover one of each (the real models: every 4th)."""
    cfg = transformers.SmolLM3Config(
        **common(num_hidden_layers=2, rope_theta=100_000.0, rms_norm_eps=1e-6),
        tie_word_embeddings=True,
        no_rope_layer_interval=2,
    )
    return transformers.SmolLM3ForCausalLM, cfg


def smollm3_nope4():
    """SmolLM3 as the real models lay out their NoPE blocks (every 4th: block 3 of 4), the one
    pattern a GGUF can hold (llama.cpp fixes it; its files carry no key)."""
    cfg = transformers.SmolLM3Config(
        **common(num_hidden_layers=4, rope_theta=100_000.0, rms_norm_eps=1e-6),
        tie_word_embeddings=True,
    )
    return transformers.SmolLM3ForCausalLM, cfg


def phi3():
    """Phi-3-mini's layout: fused qkv_proj and gate_up_proj, full RoPE, untied, no window."""
    cfg = transformers.Phi3Config(
        **common(num_hidden_layers=2, rope_theta=10_000.0, rms_norm_eps=1e-5),
        tie_word_embeddings=False,
        sliding_window=None,
    )
    return transformers.Phi3ForCausalLM, cfg


def phi3_partial():
    """Phi-4-mini's shape: partial RoPE (0.75 of each head's 16 dimensions rotate), tied."""
    cfg = transformers.Phi3Config(
        **common(num_hidden_layers=2, rope_theta=10_000.0, rms_norm_eps=1e-5),
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        sliding_window=None,
    )
    return transformers.Phi3ForCausalLM, cfg


def phi3_longrope():
    """Phi-4-mini's RoPE: partial (0.75) with LongRoPE factors and an original context of 128
    tokens (a package's longest context, enough positions to validate it on), so that the 136
    tokens run on the long factors and the first PREFIX on the short ones."""
    cfg = transformers.Phi3Config(
        **common(num_hidden_layers=2, rope_theta=10_000.0, rms_norm_eps=1e-5),
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
        },
        sliding_window=None,
    )
    return transformers.Phi3ForCausalLM, cfg


def gemma3(**kw):
    """Gemma 3: (1 + w) norms, four per block, q/k norms, GeGLU, embeddings times √hidden
    (hidden 80: √80 rounds to 8.9375 in bf16), query_pre_attn_scalar 24 (not head_dim 16), a
    sliding block with a window of 6 (the 40 tokens outgrow it) on its own RoPE base, and a
    global block with the 4B's linear RoPE scaling."""
    cfg = transformers.Gemma3TextConfig(
        **common(
            num_hidden_layers=2, hidden_size=80, intermediate_size=160, head_dim=16,
            rms_norm_eps=1e-6,
            bos_token_id=2, eos_token_id=1,
        ),
        tie_word_embeddings=True,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        **kw,
    )
    return transformers.Gemma3ForCausalLM, cfg


def gemma3_vl():
    """Gemma 3 as the Hub ships it from 4B up: `Gemma3ForConditionalGeneration`, the text
    decoder of [`gemma3`] (tied) under `model.language_model.*` beside a one-layer SigLIP tower
    `model.vision_tower.*` and its projector `model.multi_modal_projector.*`; the image token
    ids lie outside the vocabulary, so the fixture's text tokens are text only."""
    _, text = gemma3()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=4)
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=250,
        eoi_token_index=251,
        image_token_index=252,
    )
    return transformers.Gemma3ForConditionalGeneration, cfg


GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}


def gemma4_text(**kw):
    """Gemma 4's text decoder as a dict (docs/reference/gemma4.md §4): six blocks (sliding,
    sliding, full, sliding, sliding, full), the last two reading the caches of blocks 3 and 2
    (KV sharing) with double-wide MLPs, head size 16 on sliding blocks and 32 on full ones
    (proportional partial RoPE), a window of 16 under the 48 tokens, per-layer input
    embeddings of width 16 and final soft-capping 30."""
    text = dict(
        **common(num_hidden_layers=6, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
                 bos_token_id=2, eos_token_id=1),
        global_head_dim=32,
        tie_word_embeddings=True,
        sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters=GEMMA4_ROPE,
        final_logit_softcapping=30.0,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    )
    text.update(kw)
    return text


def gemma4():
    """Gemma 4 text (`Gemma4ForCausalLM`): [`gemma4_text`]."""
    return transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig(**gemma4_text())


def gemma4_kv():
    """Gemma 4 text with `attention_k_eq_v`: the full blocks have no v_proj (the values are the
    raw key projection) and one KV head of their own (`num_global_key_value_heads`)."""
    cfg = transformers.Gemma4TextConfig(
        **gemma4_text(attention_k_eq_v=True, num_global_key_value_heads=1))
    return transformers.Gemma4ForCausalLM, cfg


def gemma4_vl():
    """Gemma 4 as the Hub ships E2B/E4B: `Gemma4ForConditionalGeneration`, the text decoder of
    [`gemma4`] under `model.language_model.*` beside a one-layer vision tower and its
    projection `model.embed_vision.*`; the special token ids lie outside the vocabulary."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                  pooling_kernel_size=2, position_embedding_size=16)
    cfg = transformers.Gemma4Config(
        text_config=gemma4_text(),
        vision_config=vision,
        boi_token_id=250, eoi_token_id=251, image_token_id=252, video_token_id=253,
        boa_token_id=254, eoa_token_index=255, audio_token_id=256,
    )
    return transformers.Gemma4ForConditionalGeneration, cfg


def lfm2():
    """LFM2: short-convolution blocks (kernel 3, no biases) around two attention blocks with
    q/k norms, KV heads ≠ query heads, tied; the feed-forward width from LFM2's rule
    (int(2 · 128 / 3) = 85, rounded up to a multiple of 32: 96)."""
    cfg = transformers.Lfm2Config(
        **common(num_hidden_layers=5, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
        norm_eps=1e-5,
        tie_word_embeddings=True,
        conv_L_cache=3,
        block_multiple_of=32,
        block_auto_adjust_ff_dim=True,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
    )
    return transformers.Lfm2ForCausalLM, cfg


def lfm2_untied():
    """LFM2 with biases in its conv blocks, kernel 4, a separate lm_head, the feed-forward
    width scaled (1.5 · int(2 · 128 / 3) = 127, rounded up to 128 by multiple_of 16)."""
    cfg = transformers.Lfm2Config(
        **common(num_hidden_layers=3, num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
        norm_eps=1e-5,
        tie_word_embeddings=False,
        conv_L_cache=4,
        conv_bias=True,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.5,
        layer_types=["conv", "full_attention", "conv"],
    )
    return transformers.Lfm2ForCausalLM, cfg


# Qwen3.5's RoPE as its configs give it: a quarter of each head rotated, and the multimodal
# sections (here over the 4 frequencies of a 32-wide head) that text positions collapse.
QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}


def qwen3_5():
    """Qwen3.5 text: Gated DeltaNet blocks (grouped value heads, key head size ≠ value head
    size, conv kernel 4) around a gated attention block (q_proj twice as wide: query and a
    sigmoid output gate per head) with zero-centred q/k norms, partial rotary 0.25 and the
    multimodal RoPE sections a text position collapses to plain RoPE; untied."""
    cfg = transformers.Qwen3_5TextConfig(
        **common(num_hidden_layers=4, head_dim=32),
        rope_parameters=QWEN3_5_ROPE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    return transformers.Qwen3_5ForCausalLM, cfg


def qwen3_5_vl():
    """Qwen3.5 as the Hub ships it: `Qwen3_5ForConditionalGeneration`, the text decoder (tied
    here, 5 blocks: DeltaNets at 0, 1, 2 and 4, grouped value heads) under
    `model.language_model.*` beside a one-block vision tower `model.visual.*`; the vision
    token ids lie outside the vocabulary, so the fixture's text tokens are text only."""
    text = dict(
        **common(num_hidden_layers=5, head_dim=32),
        rope_parameters=QWEN3_5_ROPE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                  num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=250,
        video_token_id=251,
        vision_start_token_id=252,
        vision_end_token_id=253,
        tie_word_embeddings=True,
    )
    return transformers.Qwen3_5ForConditionalGeneration, cfg


ARCHS = {
    "qwen3": qwen3,
    "smollm3": smollm3,
    "smollm3_nope4": smollm3_nope4,
    "phi3": phi3,
    "phi3_partial": phi3_partial,
    "phi3_longrope": phi3_longrope,
    "gemma3": gemma3,
    "gemma3_big": gemma3,
    "gemma3_vl": gemma3_vl,
    "gemma4": gemma4,
    "gemma4_kv": gemma4_kv,
    "gemma4_vl": gemma4_vl,
    "lfm2": lfm2,
    "lfm2_untied": lfm2_untied,
    "qwen3_5": qwen3_5,
    "qwen3_5_vl": qwen3_5_vl,
}
# Fixtures whose post-attention and post-feed-forward norm weights are this large: Gemma's
# residual stream then passes fp16's 65,504 (the real models reach ~300,000).
POST_NORM = {"gemma3_big": 30_000.0}
# Fixtures whose reference.json also holds "prefix_logits": transformers' logits for a separate
# forward pass over the first n TOKENS (LongRoPE: within the original context).
PREFIX = {"phi3_longrope": 24}


def randomize(model, gain, arch):
    """Weights that make a peaked next-token distribution, like a trained model's: N(0, 0.08)
    matrices, norms near 1 (Gemma: its w near 0, as it multiplies by 1 + w), the final norm
    times `gain`."""
    gen = torch.Generator().manual_seed(1234)
    gemma = arch.startswith("gemma3")
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Qwen3.5's norms multiply by 1 + w too, but for the plain gated norm of its
            # DeltaNet blocks.
            qwen = arch.startswith("qwen3_5") and "visual" not in name
            tower = "visual" in name or "vision_tower" in name
            centred = (gemma and not tower) or (qwen and "linear_attn.norm" not in name)
            if p.dim() == 1 and "norm" in name:
                p.copy_((0.0 if centred else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
                # Gemma 4 attends at scale 1: its q/k norm weights are the softmax's temperature,
                # which training sets. At 1 the scores of unit-normed heads spread √D wide
                # (every other fixture's 1/√D scale spreads them about 1), a softmax so sharp
                # that transformers' own float32 logits drift from its float64 ones ten times
                # further than other fixtures' do. D^-1/4 on each gives the scores the spread
                # of 1/√D attention.
                if arch.startswith("gemma4") and not tower and name.endswith(("q_norm.weight",
                                                                              "k_norm.weight")):
                    p.mul_(p.shape[0] ** -0.25)
                big = POST_NORM.get(arch)
                if big and ("post_attention" in name or "post_feedforward" in name):
                    p.add_(big)
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
        # Gemma 4's per-block output scale is a saved buffer that init leaves at 1, which would
        # hide a reader that drops it.
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_((0.5 + torch.rand(b.shape, generator=gen)).to(torch.bfloat16))
        # LFM2's final norm is its `embedding_norm` (applied after the last block).
        text = getattr(model.model, "language_model", model.model)
        w = text.norm.weight if hasattr(text, "norm") else text.embedding_norm.weight
        if gemma or arch.startswith("qwen3_5"):
            w.copy_((1.0 + w) * gain - 1.0)
        else:
            w.mul_(gain)
        # Round to bf16 once: the saved weights and the float32 logits below agree exactly.
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def write(out_dir, arch):
    cls, cfg = ARCHS[arch]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    randomize(model, gain=8.0, arch=arch)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if arch.startswith("gemma3"):
        # transformers multiplies by √hidden in the weights' dtype: the bf16 checkpoint's
        # normalizer, also in this float32 pass.
        embed = getattr(model.model, "language_model", model.model).embed_tokens
        embed.embed_scale.copy_(embed.embed_scale.to(torch.bfloat16).to(torch.float32))
    tokens = [(i * 37 + 11) % VOCAB for i in range(LENGTH.get(arch, len(TOKENS)))]
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].to(torch.float32)
        n = PREFIX.get(arch)
        prefix = n and model(torch.tensor([tokens[:n]])).logits[0].to(torch.float32)
    dest = os.path.join(out_dir, arch)
    os.makedirs(dest, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    for extra in ("generation_config.json",):
        path = os.path.join(dest, extra)
        if os.path.exists(path):
            os.remove(path)
    ref = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokens": tokens,
        "logits": [[round(float(v), 7) for v in row] for row in logits],
    }
    if n:
        ref["prefix_logits"] = [[round(float(v), 7) for v in row] for row in prefix]
    with open(os.path.join(dest, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(dest, n)) for n in os.listdir(dest))
    print(f"{arch}: {dest} ({size} bytes)")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "..", "tests", "fixtures", "hf")
    args = sys.argv[1:]
    out_dir = args.pop(0) if args and args[0] not in ARCHS else default
    for arch in args or list(ARCHS):
        write(out_dir, arch)


if __name__ == "__main__":
    main()
