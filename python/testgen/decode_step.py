"""Build a tiny Llama-style contract-v1 decode step (docs/contract.md; v1 has one logits output) with
random weights, 4-bit LUT projections and the contract JSON in the metadata, and compute the
float32 numpy logits of a token sequence with the same (dequantized) weights. For the
interpreter's end-to-end StepModel test (tests/it/interp/step.rs).

usage: python decode_step.py OUT_DIR Q [Q ...]
writes OUT_DIR/q{Q}/model.mlpackage for each Q, and OUT_DIR/reference.json:
  {"tokens": [...], "logits": [[V floats] per position], "S": .., "V": ..}

HF2COREML_STEP_DIMS="L,H,HKV,D,HID,INTER,V,S" builds another size with a tied embedding and
no reference (benches use the SmolLM2-135M shape: 30,9,3,64,576,1536,49152,512).
"""

import json
import os
import sys

import numpy as np

import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

L, H, HKV, D, HID, INTER, V, S = 2, 4, 2, 8, 32, 48, 50, 16
DIMS = os.environ.get("HF2COREML_STEP_DIMS")
if DIMS:
    L, H, HKV, D, HID, INTER, V, S = (int(v) for v in DIMS.split(","))
EPS = 1e-5
THETA = 10000.0
RNG = np.random.default_rng(7)


def lut4(shape):
    """A random 4-bit palettized weight: (packed uint8 indices, fp16 LUT, dense fp16)."""
    lut = (RNG.standard_normal(16) * 0.2).astype(np.float16)
    idx = RNG.integers(0, 16, int(np.prod(shape)))
    packed = (idx[0::2] | (idx[1::2] << 4)).astype(np.uint8)
    return packed, lut, lut[idx].reshape(shape)


def weights():
    w = {"embed": (RNG.standard_normal((V, HID)) * 0.5).astype(np.float16),
         "norm": (1.0 + RNG.standard_normal(HID) * 0.1).astype(np.float16),
         "lm_head": (RNG.standard_normal((V, HID)) * 0.3).astype(np.float16)}
    if DIMS:
        w["lm_head"] = w["embed"]
    for l in range(L):
        for name, shape in [("q", (H * D, HID)), ("k", (HKV * D, HID)), ("v", (HKV * D, HID)),
                            ("o", (HID, H * D)), ("gate", (INTER, HID)), ("up", (INTER, HID)),
                            ("down", (HID, INTER))]:
            w[f"{l}.{name}"] = lut4(shape)
        w[f"{l}.in_norm"] = (1.0 + RNG.standard_normal(HID) * 0.1).astype(np.float16)
        w[f"{l}.post_norm"] = (1.0 + RNG.standard_normal(HID) * 0.1).astype(np.float16)
    return w


def rope_tables():
    inv = 1.0 / THETA ** (np.arange(0, D, 2) / D)
    ang = np.outer(np.arange(S), inv)
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)


def build(w, q_len):
    cos_t, sin_t = rope_tables()
    causal = np.where(np.tril(np.ones((q_len, q_len))) > 0, 0.0, -30000.0).astype(np.float16)
    rep = H // HKV

    @mb.program(input_specs=[mb.TensorSpec((1, q_len), types.int32),
                             mb.TensorSpec((1,), types.int32),
                             mb.TensorSpec((L, HKV, S, D), types.fp16),
                             mb.TensorSpec((L, HKV, S, D), types.fp16)],
                opset_version=ct.target.iOS17)
    def prog(input_ids, position, key_cache, value_cache):
        def rms(x, g):
            ms = mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[-1], keep_dims=True)
            return mb.mul(x=mb.mul(x=x, y=mb.rsqrt(x=ms, epsilon=np.float16(EPS))), y=g)

        def lin(x, key):
            packed, lut, dense = w[key]
            wt = mb.constexpr_lut_to_dense(indices=packed, lut=lut,
                                           shape=np.array(dense.shape, np.uint32))
            return mb.linear(x=x, weight=wt)

        def rope(t, cos, sin):
            a, b = mb.split(x=t, num_splits=2, axis=-1)
            rot = mb.concat(values=[mb.mul(x=b, y=np.float16(-1.0)), a], axis=-1)
            return mb.add(x=mb.mul(x=t, y=cos), y=mb.mul(x=rot, y=sin))

        x = mb.gather(x=w["embed"], indices=input_ids, axis=0)
        pos = mb.add(x=position, y=np.arange(q_len, dtype=np.int32))
        cos = mb.gather(x=cos_t, indices=pos, axis=0)
        sin = mb.gather(x=sin_t, indices=pos, axis=0)
        visible = mb.less(x=np.arange(S, dtype=np.int32), y=position)
        m = mb.select(cond=visible, a=np.zeros(S, np.float16), b=np.full(S, -30000, np.float16))
        m = mb.tile(x=mb.reshape(x=m, shape=[1, S]), reps=[q_len, 1])
        mask = mb.concat(values=[m, causal], axis=1)
        k_ups, v_ups = [], []
        for l in range(L):
            h = rms(x, w[f"{l}.in_norm"])
            q = mb.transpose(x=mb.reshape(x=lin(h, f"{l}.q"), shape=[1, q_len, H, D]), perm=[0, 2, 1, 3])
            k = mb.transpose(x=mb.reshape(x=lin(h, f"{l}.k"), shape=[1, q_len, HKV, D]), perm=[0, 2, 1, 3])
            v = mb.transpose(x=mb.reshape(x=lin(h, f"{l}.v"), shape=[1, q_len, HKV, D]), perm=[0, 2, 1, 3])
            q = rope(q, cos, sin)
            k = rope(k, cos, sin)
            k_ups.append(k)
            v_ups.append(v)
            kc = mb.slice_by_index(x=key_cache, begin=[l, 0, 0, 0], end=[l + 1, HKV, S, D])
            vc = mb.slice_by_index(x=value_cache, begin=[l, 0, 0, 0], end=[l + 1, HKV, S, D])
            keys = mb.concat(values=[kc, k], axis=2)
            vals = mb.concat(values=[vc, v], axis=2)

            def expand(t):
                t = mb.reshape(x=t, shape=[1, HKV, 1, S + q_len, D])
                t = mb.tile(x=t, reps=[1, 1, rep, 1, 1])
                return mb.reshape(x=t, shape=[1, H, S + q_len, D])

            keys, vals = expand(keys), expand(vals)
            sc = mb.mul(x=mb.matmul(x=q, y=keys, transpose_y=True), y=np.float16(1.0 / np.sqrt(D)))
            p = mb.softmax(x=mb.add(x=sc, y=mask), axis=-1)
            a = mb.matmul(x=p, y=vals)
            a = mb.reshape(x=mb.transpose(x=a, perm=[0, 2, 1, 3]), shape=[1, q_len, H * D])
            x = mb.add(x=x, y=lin(a, f"{l}.o"))
            h = rms(x, w[f"{l}.post_norm"])
            g = lin(h, f"{l}.gate")
            act = mb.mul(x=g, y=mb.sigmoid(x=g))
            x = mb.add(x=x, y=lin(mb.mul(x=act, y=lin(h, f"{l}.up")), f"{l}.down"))
        x = rms(x, w["norm"])
        logits = mb.linear(x=x, weight=w["lm_head"], name="logits")
        return (logits, mb.concat(values=k_ups, axis=0, name="key_update"),
                mb.concat(values=v_ups, axis=0, name="value_update"))

    return prog


def contract(q_len):
    io = lambda n, dt, sh: {"name": n, "dtype": dt, "shape": sh}
    return {
        "version": 1, "max_seq_len": S, "query_len": q_len, "num_layers": L,
        "num_kv_heads": HKV, "head_dim": D, "vocab_size": V,
        "inputs": [io("input_ids", "int32", [1, q_len]), io("position", "int32", [1]),
                   io("key_cache", "fp16", [L, HKV, S, D]), io("value_cache", "fp16", [L, HKV, S, D])],
        "outputs": [io("logits", "fp16", [1, q_len, V]), io("key_update", "fp16", [L, HKV, q_len, D]),
                    io("value_update", "fp16", [L, HKV, q_len, D])],
        "bos_token_id": 1, "eos_token_ids": [2], "rope": {"theta": THETA}, "recipe": {},
        "scaling": {}, "compute_precision": "fp16",
        "source": {"architecture": "LlamaForCausalLM", "files": {}},
        "tool": "testgen", "tool_version": "0"}


def reference(w, tokens):
    """Float32 forward over the whole sequence (causal), one row of logits per position."""
    f = lambda a: a.astype(np.float32)
    cos_t, sin_t = (f(t) for t in rope_tables())
    n = len(tokens)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * f(g)

    def rope(t):
        c, s = cos_t[:n][:, None, :], sin_t[:n][:, None, :]
        a, b = t[..., : D // 2], t[..., D // 2:]
        return t * c + np.concatenate([-b, a], -1) * s

    x = f(w["embed"])[tokens]
    causal = np.tril(np.ones((n, n))) > 0
    for l in range(L):
        dn = lambda k: f(w[f"{l}.{k}"][2])
        h = rms(x, w[f"{l}.in_norm"])
        q = rope((h @ dn("q").T).reshape(n, H, D))
        k = rope((h @ dn("k").T).reshape(n, HKV, D))
        v = (h @ dn("v").T).reshape(n, HKV, D)
        k = np.repeat(k, H // HKV, axis=1)
        v = np.repeat(v, H // HKV, axis=1)
        sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
        sc = np.where(causal[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", p, v).reshape(n, H * D)
        x = x + a @ dn("o").T
        h = rms(x, w[f"{l}.post_norm"])
        g = h @ dn("gate").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ dn("up").T)) @ dn("down").T
    return rms(x, w["norm"]) @ f(w["lm_head"]).T


def main():
    out = sys.argv[1]
    qs = [int(q) for q in sys.argv[2:]] or [1]
    w = weights()
    tokens = [int(t) for t in RNG.integers(0, V, 10)]
    for q in qs:
        model = ct.convert(build(w, q), convert_to="mlprogram",
                           minimum_deployment_target=ct.target.iOS17,
                           compute_precision=ct.precision.FLOAT16)
        model.user_defined_metadata["hf2coreml.contract"] = json.dumps(contract(q))
        model.save(os.path.join(out, f"q{q}", "model.mlpackage"))
    if DIMS:
        return
    logits = reference(w, tokens)
    with open(os.path.join(out, "reference.json"), "w") as fh:
        json.dump({"tokens": tokens, "logits": logits.tolist(), "S": S, "V": V}, fh)


if __name__ == "__main__":
    main()
