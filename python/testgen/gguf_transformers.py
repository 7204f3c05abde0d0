"""What transformers makes of hf2coreml's GGUF fixtures: the independent reader
tests/it/gguf/transformers.rs holds the importer to.

usage: python gguf_transformers.py GGUF [GGUF ...]
each GGUF (written by `cargo run -p hf2coreml-tools --bin gguf_fixture ARCH GGUF`) is loaded with
`AutoModelForCausalLM.from_pretrained(DIR, gguf_file=NAME)` and
`AutoTokenizer.from_pretrained(DIR, gguf_file=NAME)`, and GGUF's stem + ".json" is written
beside it:
  {"gguf_sha256", "transformers", "torch",
   "tensors": {HF name: sha256 of the weight rounded to fp16, little-endian},
   "text": TEXT, "ids": transformers' ids of TEXT (no special tokens), "ids_with_specials"
   (as a model is prompted: BOS/EOS as the file asks), "specials", "specials_ids" (a text
   spelling special tokens), "decoded" (ids back to text), "whitespace", "whitespace_ids" and
   "whitespace_decoded" (runs of spaces, tabs and newlines beside HTML tags),
   "tokens": [...], "logits": [[V floats] per position] (float32 forward pass, every weight
   rounded to fp16 first)}

Needs torch, transformers, accelerate and gguf in a venv of their own:
  python -m venv ~/.cache/hf2coreml/venv-testgen
  ~/.cache/hf2coreml/venv-testgen/bin/pip install torch==2.15.0 transformers==5.23.0 accelerate gguf
"""

import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers
from gguf import GGUFReader

# Digits, whitespace runs, accents, CJK and emoji: every byte-level path of the tokenizer.
TEXT = "Hello world! 12345 the  thin\tcat\n\n  café 東京 🚀✨ déjà-vu 0.5e-3"
# The vocabulary's own special tokens written out: kept whole, never split into pieces.
SPECIALS = "<s>Hi</s> <unk>x<|im_start|>y"
# Runs of spaces, tabs and newlines beside HTML tags: where user-defined pieces (Gemma's
# whitespace runs and tags) must keep their own ids.
WHITESPACE = "<h1>Hi</h1>\n\n\n<table>\t\t\tcat  the   in    a\n \t<br>x<br/>  \n\t end  "
TOKENS = [(i * 37 + 11) % 259 for i in range(24)]


def config_overrides(path):
    """What transformers' GGUF config mapping leaves at its class defaults although the file
    or llama.cpp fixes it (docs/reference/gguf-archs.md): qwen3 drops `attention.key_length`,
    so the file's own head_dim is given back; Gemma 3's attention scale is head_dim^-1/2 in
    llama.cpp below 27B, not `Gemma3TextConfig`'s query_pre_attn_scalar of 256."""
    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    key = f"{arch}.attention.key_length"
    out = {}
    if key in r.fields:
        out["head_dim"] = int(r.fields[key].parts[-1][0])
        if arch == "gemma3":
            out["query_pre_attn_scalar"] = out["head_dim"]
    return out


def describe(path):
    d, name = os.path.split(os.path.abspath(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=name, dtype=torch.float32, **config_overrides(path)
    )
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    tensors = {}
    for k, v in model.state_dict().items():
        b = v.detach().to(torch.float16).numpy().astype("<f2").tobytes()
        tensors[k] = hashlib.sha256(b).hexdigest()
    with torch.no_grad():
        # The weights as an fp16 checkpoint holds them: what an import can be held to exactly
        # (fp16 rounding alone moves Gemma 3's logits by 0.02).
        for p in model.parameters():
            p.copy_(p.half().float())
        logits = model(torch.tensor([TOKENS])).logits[0].float().numpy()
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {
        "gguf_sha256": digest,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tensors": tensors,
        "text": TEXT,
        "ids": tok.encode(TEXT, add_special_tokens=False),
        "ids_with_specials": tok.encode(TEXT, add_special_tokens=True),
        "specials": SPECIALS,
        "specials_ids": tok.encode(SPECIALS, add_special_tokens=False),
        "whitespace": WHITESPACE,
        "whitespace_ids": tok.encode(WHITESPACE, add_special_tokens=False),
        "whitespace_decoded": tok.decode(tok.encode(WHITESPACE, add_special_tokens=False)),
        "decoded": tok.decode(tok.encode(TEXT, add_special_tokens=False)),
        "tokens": TOKENS,
        "logits": [[float(f"{x:.7g}") for x in row] for row in logits.astype(np.float32)],
    }


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        out = os.path.splitext(path)[0] + ".json"
        with open(out, "w") as f:
            json.dump(describe(path), f)
            f.write("\n")
        print("wrote", out)


if __name__ == "__main__":
    main()
