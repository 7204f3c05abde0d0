"""Blocks of every GGUF tensor type hf2coreml dequantizes, and what gguf-py (the `gguf` package,
an independent numpy implementation of ggml's dequantizers) makes of them. For
tests/it/gguf/dequant.rs, which checks crates/numerics/src/dequant.rs against these bit for bit.

usage: python gguf_dequant.py OUT_DIR
writes, for each type NAME, OUT_DIR/NAME.bin (whole blocks) and OUT_DIR/NAME.f32 (gguf-py's
values, little-endian float32), and OUT_DIR/manifest.json: [{"name", "id", "blocks"}].

Blocks come from gguf-py's quantizers where it has one (the legacy types, on ordinary,
extreme and all-zero data) and from random valid bytes for every type: every fp16 scale
field finite, including the extremes (65504, the smallest subnormal, -0), plus an all-zero
block, an all-ones-bits block and blocks whose quants are all zero under non-zero scales
(the minimum-bits sub-blocks).
"""

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

RNG = np.random.default_rng(25)

# (type, byte offsets of its fp16 scale fields within a block)
TYPES = [
    (T.F32, []),
    (T.F16, None),
    (T.BF16, None),
    (T.Q4_0, [0]),
    (T.Q4_1, [0, 2]),
    (T.Q5_0, [0]),
    (T.Q5_1, [0, 2]),
    (T.Q8_0, [0]),
    (T.Q2_K, [80, 82]),
    (T.Q3_K, [108]),
    (T.Q4_K, [0, 2]),
    (T.Q5_K, [0, 2]),
    (T.Q6_K, [208]),
    (T.IQ4_NL, [0]),
    (T.IQ4_XS, [0]),
]
QUANTIZABLE = {T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
EXTREME_F16 = [0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x8000, 0x0000, 0x3C00]


def finite_f16(n):
    """n random finite fp16 bit patterns (the exponent is never all ones)."""
    bits = RNG.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits).astype(np.uint16)


def random_blocks(qtype, fields, n):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, size=(n, size), dtype=np.uint16).astype(np.uint8)
    if qtype == T.F32:
        vals = RNG.standard_normal(n).astype(np.float32) * np.float32(1e3)
        return vals.view(np.uint8).reshape(n, size)
    if qtype == T.F16:
        return finite_f16(n).view(np.uint8).reshape(n, size)
    if qtype == T.BF16:
        bits = RNG.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
        bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0xBFFF, bits).astype(np.uint16)
        return bits.view(np.uint8).reshape(n, size)
    for off in fields:
        raw[:, off : off + 2] = finite_f16(n).view(np.uint8).reshape(n, 2)
    # Extreme scales in the first blocks, every field in turn.
    for i, e in enumerate(EXTREME_F16):
        for off in fields:
            raw[i, off : off + 2] = np.array([e], dtype=np.uint16).view(np.uint8)
    # An all-zero block, an all-ones-bits block (scales kept finite) and blocks whose quants
    # are all zero with ordinary scales.
    k = len(EXTREME_F16)
    raw[k, :] = 0
    raw[k + 1, :] = 0xFF
    for j in (k, k + 1):
        for off in fields:
            raw[j, off : off + 2] = np.array([0x3555], dtype=np.uint16).view(np.uint8)
    for j in (k + 2, k + 3):
        keep = {b for off in fields for b in (off, off + 1)}
        for b in range(size):
            if b not in keep:
                raw[j, b] = 0 if j == k + 2 else raw[j, b] & 0xC0
    return raw


def quantized_blocks(qtype):
    block, _ = GGML_QUANT_SIZES[qtype]
    rows = [
        RNG.standard_normal(block * 8).astype(np.float32),
        (RNG.standard_normal(block * 4) * 8e3).astype(np.float32),
        (RNG.standard_normal(block * 4) * 1e-6).astype(np.float32),
        np.zeros(block * 2, dtype=np.float32),
        np.linspace(-1, 1, block * 2, dtype=np.float32),
    ]
    data = np.concatenate(rows).reshape(1, -1)
    return np.asarray(quantize(data, qtype)).reshape(-1, GGML_QUANT_SIZES[qtype][1])


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for qtype, fields in TYPES:
        n = 64 if GGML_QUANT_SIZES[qtype][0] > 1 else 4096
        blocks = random_blocks(qtype, fields or [], n)
        if qtype in QUANTIZABLE:
            blocks = np.concatenate([quantized_blocks(qtype), blocks])
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        values = np.asarray(dequantize(blocks.reshape(-1), qtype), dtype=np.float32)
        (out / f"{qtype.name}.bin").write_bytes(blocks.tobytes())
        (out / f"{qtype.name}.f32").write_bytes(values.astype("<f4").tobytes())
        manifest.append({"name": qtype.name, "id": int(qtype), "blocks": int(blocks.shape[0])})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
