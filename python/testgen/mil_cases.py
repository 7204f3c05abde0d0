"""Build small MIL programs with coremltools, save them as .mlpackage, and write the numpy
results beside them, for the Rust interpreter tests (tests/it/interp/).

usage: python mil_cases.py OUT_DIR [CASE ...]

Each case becomes OUT_DIR/NAME/model.mlpackage plus OUT_DIR/NAME/case.json:
  {"inputs": {name: tensor}, "outputs": {name: tensor}, "rtol": r, "atol": a, "ops": [...]}
  tensor = {"dtype": "fp16|fp32|int32", "shape": [...], "data": [flat values]}
Non-finite floats are written as the strings "inf", "-inf", "nan" (JSON has no such numbers).
Programs go through ct.convert's DEFAULT pass pipeline, as real packages do.
"""

import json
import os
import sys

import numpy as np

import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

RNG = np.random.default_rng(1234)
F16 = types.fp16
F32 = types.fp32
I32 = types.int32

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def enc(a):
    a = np.asarray(a)
    if a.dtype == np.float16:
        dt = "fp16"
    elif a.dtype == np.float32:
        dt = "fp32"
    elif a.dtype == np.int32:
        dt = "int32"
    elif a.dtype == np.bool_:
        dt = "bool"
    else:
        raise ValueError(a.dtype)
    flat = []
    for v in a.reshape(-1).tolist():
        if isinstance(v, float) and not np.isfinite(v):
            flat.append("nan" if np.isnan(v) else ("inf" if v > 0 else "-inf"))
        else:
            flat.append(v)
    return {"dtype": dt, "shape": list(a.shape), "data": flat}


def rand(shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ---- fp32 programs: every op checked tightly against numpy ----------------------------------

@case
def elementwise():
    a = rand((2, 3, 8))
    b = rand((3, 8))
    p = np.abs(rand((2, 3, 8))) + 0.5

    @mb.program(input_specs=[mb.TensorSpec((2, 3, 8), F32), mb.TensorSpec((3, 8), F32),
                             mb.TensorSpec((2, 3, 8), F32)], opset_version=ct.target.iOS17)
    def prog(a, b, p):
        return (mb.add(x=a, y=b, name="o_add"), mb.sub(x=a, y=b, name="o_sub"),
                mb.mul(x=a, y=b, name="o_mul"), mb.real_div(x=a, y=p, name="o_div"),
                mb.pow(x=p, y=mb.mul(x=b, y=0.5), name="o_pow"),
                mb.maximum(x=a, y=b, name="o_max"), mb.minimum(x=a, y=b, name="o_min"),
                mb.rsqrt(x=p, epsilon=1e-3, name="o_rsqrt"), mb.exp(x=a, name="o_exp"),
                mb.sin(x=a, name="o_sin"), mb.cos(x=a, name="o_cos"),
                mb.sigmoid(x=a, name="o_sigmoid"),
                mb.mul(x=a, y=mb.sigmoid(x=a), name="o_silu"),
                mb.sqrt(x=p, name="o_sqrt"), mb.tanh(x=a, name="o_tanh"),
                mb.real_div(x=a, y=4.0, name="o_div_const"),
                mb.clip(x=a, alpha=-0.5, beta=0.5, name="o_clip"))

    exp = {"o_add": a + b, "o_sub": a - b, "o_mul": a * b, "o_div": a / p,
           "o_pow": np.power(p, b * 0.5), "o_max": np.maximum(a, b), "o_min": np.minimum(a, b),
           "o_rsqrt": 1.0 / np.sqrt(p + 1e-3), "o_exp": np.exp(a), "o_sin": np.sin(a),
           "o_cos": np.cos(a), "o_sigmoid": sigmoid(a), "o_silu": a * sigmoid(a),
           "o_sqrt": np.sqrt(p), "o_tanh": np.tanh(a), "o_div_const": a / 4.0,
           "o_clip": np.clip(a, -0.5, 0.5)}
    return prog, {"a": a, "b": b, "p": p}, exp, "fp32", 1e-5, 1e-5


@case
def reductions():
    x = rand((2, 3, 5))

    @mb.program(input_specs=[mb.TensorSpec((2, 3, 5), F32)], opset_version=ct.target.iOS17)
    def prog(x):
        return (mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name="o_mean"),
                mb.reduce_sum(x=x, axes=[0, 2], keep_dims=False, name="o_sum"),
                mb.reduce_max(x=x, axes=[1], keep_dims=False, name="o_rmax"),
                mb.softmax(x=x, axis=-1, name="o_softmax"),
                mb.softmax(x=x, axis=1, name="o_softmax1"),
                mb.reduce_sum(x=x, name="o_sum_all"))

    e = np.exp(x - x.max(-1, keepdims=True))
    e1 = np.exp(x - x.max(1, keepdims=True))
    exp = {"o_mean": x.mean(-1, keepdims=True), "o_sum": x.sum((0, 2)), "o_rmax": x.max(1),
           "o_softmax": e / e.sum(-1, keepdims=True), "o_softmax1": e1 / e1.sum(1, keepdims=True),
           "o_sum_all": np.array(x.sum(), np.float32)}
    return prog, {"x": x}, exp, "fp32", 1e-5, 1e-5


@case
def shapes():
    x = rand((2, 3, 4))
    y = rand((2, 3, 2))

    @mb.program(input_specs=[mb.TensorSpec((2, 3, 4), F32), mb.TensorSpec((2, 3, 2), F32)],
                opset_version=ct.target.iOS17)
    def prog(x, y):
        s1, s2 = mb.split(x=x, num_splits=2, axis=-1)
        t1, t2, t3 = mb.split(x=x, split_sizes=[1, 1, 2], axis=2)
        return (mb.reshape(x=x, shape=[6, 4], name="o_reshape"),
                mb.reshape(x=x, shape=[-1, 2], name="o_reshape_infer"),
                mb.transpose(x=x, perm=[2, 0, 1], name="o_transpose"),
                mb.concat(values=[x, y], axis=-1, name="o_concat"),
                mb.concat(values=[x, x], axis=1, interleave=True, name="o_concat_il"),
                mb.add(x=s1, y=0.0, name="o_split1"), mb.add(x=s2, y=0.0, name="o_split2"),
                mb.add(x=t3, y=t1, name="o_split3"),
                mb.slice_by_index(x=x, begin=[0, 1, 0], end=[2, 3, 4], stride=[1, 1, 2],
                                  name="o_slice"),
                mb.slice_by_index(x=x, begin=[1, 0, 1], end=[0, 0, 3], end_mask=[False, True, False],
                                  squeeze_mask=[True, False, False], name="o_slice_sq"),
                mb.slice_by_index(x=x, begin=[0, 0, 3], end=[2, 3, 0], stride=[1, 1, -1],
                                  end_mask=[False, False, True], name="o_slice_rev"),
                mb.slice_by_size(x=x, begin=[1, 0, 1], size=[1, -1, 2], name="o_slice_size"),
                mb.expand_dims(x=x, axes=[0, -1], name="o_expand"),
                mb.squeeze(x=mb.expand_dims(x=x, axes=[1]), axes=[1], name="o_squeeze"),
                mb.tile(x=x, reps=[1, 2, 1], name="o_tile"),
                mb.band_part(x=x, lower=1, upper=0, name="o_band"))

    band = np.zeros_like(x)
    for i in range(3):
        for j in range(4):
            if (i - j) <= 1 and (j - i) <= 0:
                band[:, i, j] = x[:, i, j]
    il = np.stack([x, x], axis=2).reshape(2, 6, 4)
    exp = {"o_reshape": x.reshape(6, 4), "o_reshape_infer": x.reshape(-1, 2),
           "o_transpose": x.transpose(2, 0, 1), "o_concat": np.concatenate([x, y], -1),
           "o_concat_il": il, "o_split1": x[..., :2], "o_split2": x[..., 2:],
           "o_split3": x[..., 2:] + x[..., 0:1],
           "o_slice": x[0:2, 1:3, 0:4:2], "o_slice_sq": x[1, :, 1:3],
           "o_slice_rev": x[:, :, 3::-1], "o_slice_size": x[1:2, :, 1:3],
           "o_expand": x[None, ..., None], "o_squeeze": x, "o_tile": np.tile(x, (1, 2, 1)),
           "o_band": band}
    return prog, {"x": x, "y": y}, exp, "fp32", 0.0, 0.0


@case
def matmul_linear():
    a = rand((2, 3, 4))
    b = rand((2, 4, 5))
    c = rand((5, 4))
    w = rand((6, 4))
    bias = rand((6,))

    @mb.program(input_specs=[mb.TensorSpec((2, 3, 4), F32), mb.TensorSpec((2, 4, 5), F32),
                             mb.TensorSpec((5, 4), F32)], opset_version=ct.target.iOS17)
    def prog(a, b, c):
        return (mb.matmul(x=a, y=b, name="o_mm"),
                mb.matmul(x=a, y=c, transpose_y=True, name="o_mm_ty"),
                mb.matmul(x=b, y=a, transpose_x=True, transpose_y=True, name="o_mm_txy"),
                mb.linear(x=a, weight=w, bias=bias, name="o_linear"),
                mb.linear(x=a, weight=w, name="o_linear_nobias"),
                mb.add(x=mb.matmul(x=a, y=w.T), y=bias, name="o_mm_add"))

    exp = {"o_mm": a @ b, "o_mm_ty": a @ c.T, "o_mm_txy": b.transpose(0, 2, 1) @ a.transpose(0, 2, 1),
           "o_linear": a @ w.T + bias, "o_linear_nobias": a @ w.T, "o_mm_add": a @ w.T + bias}
    return prog, {"a": a, "b": b, "c": c}, exp, "fp32", 1e-5, 1e-5


@case
def conv():
    """1×1 convs over (B, C, 1, S) and (B, C, S) (--layout ane's projections), with and without
    a bias, and pad_type "same" (the same thing for a 1×1 kernel)."""
    x = rand((2, 4, 1, 3))
    x1 = rand((1, 4, 5))
    w = rand((6, 4, 1, 1))
    bias = rand((6,))

    @mb.program(input_specs=[mb.TensorSpec((2, 4, 1, 3), F32), mb.TensorSpec((1, 4, 5), F32)],
                opset_version=ct.target.iOS17)
    def prog(x, x1):
        return (mb.conv(x=x, weight=w, bias=bias, name="o_conv"),
                mb.conv(x=x, weight=w, pad_type="same", name="o_conv_same"),
                mb.conv(x=x1, weight=w[:, :, :, 0], name="o_conv1d"))

    w2 = w[:, :, 0, 0]
    exp = {"o_conv": np.einsum("oc,bchw->bohw", w2, x) + bias[None, :, None, None],
           "o_conv_same": np.einsum("oc,bchw->bohw", w2, x),
           "o_conv1d": np.einsum("oc,bcw->bow", w2, x1)}
    return prog, {"x": x, "x1": x1}, exp, "fp32", 1e-5, 1e-5


@case
def conv_3x3():
    """A conv the interpreter does not compute (3×3 kernel, stride 2): refused by name."""
    x = rand((1, 2, 5, 5))
    w = rand((3, 2, 3, 3))

    @mb.program(input_specs=[mb.TensorSpec((1, 2, 5, 5), F32)], opset_version=ct.target.iOS17)
    def prog(x):
        return mb.conv(x=x, weight=w, strides=[2, 2], name="o_conv")

    return prog, {"x": x}, {}, "fp32", 1e-5, 1e-5


@case
def compare_select():
    x = rand((3, 4))
    y = rand((3, 4))
    i = RNG.integers(-5, 5, (3, 4)).astype(np.int32)

    @mb.program(input_specs=[mb.TensorSpec((3, 4), F32), mb.TensorSpec((3, 4), F32),
                             mb.TensorSpec((3, 4), I32)], opset_version=ct.target.iOS17)
    def prog(x, y, i):
        less = mb.less(x=x, y=y)
        return (mb.select(cond=less, a=x, b=y, name="o_sel"),
                mb.select(cond=mb.equal(x=i, y=0), a=mb.fill(shape=[3, 4], value=1.0),
                          b=mb.fill(shape=[3, 4], value=-1.0), name="o_eq"),
                mb.select(cond=mb.greater_equal(x=i, y=1), a=i, b=mb.mul(x=i, y=-1),
                          name="o_ge"),
                mb.cast(x=mb.less_equal(x=i, y=2), dtype="int32", name="o_le"),
                mb.cast(x=mb.greater(x=x, y=0.0), dtype="fp32", name="o_gt"),
                mb.cast(x=mb.logical_and(x=less, y=mb.greater(x=i, y=0)), dtype="int32",
                        name="o_and"),
                mb.cast(x=x, dtype="int32", name="o_cast_i"),
                mb.add(x=mb.cast(x=i, dtype="fp32"), y=x, name="o_cast_f"),
                mb.add(x=mb.range_1d(start=2, end=mb.reduce_max(x=mb.fill(shape=[1], value=9)),
                                     step=3), y=mb.reduce_sum(x=mb.cast(x=mb.less(x=i, y=100),
                                                                         dtype="int32")),
                       name="o_range"))

    exp = {"o_sel": np.where(x < y, x, y), "o_eq": np.where(i == 0, 1.0, -1.0).astype(np.float32),
           "o_ge": np.where(i >= 1, i, -i).astype(np.int32), "o_le": (i <= 2).astype(np.int32),
           "o_gt": (x > 0).astype(np.float32),
           "o_and": ((x < y) & (i > 0)).astype(np.int32),
           "o_cast_i": x.astype(np.int32), "o_cast_f": i.astype(np.float32) + x,
           "o_range": (np.arange(2, 9, 3) + 12).astype(np.int32)}
    return prog, {"x": x, "y": y, "i": i}, exp, "fp32", 1e-6, 1e-6


@case
def gather_fp32():
    table = rand((10, 4))
    idx = np.array([[3, 0, 9], [1, 1, 2]], np.int32)

    @mb.program(input_specs=[mb.TensorSpec((2, 3), I32), mb.TensorSpec((10, 4), F32)],
                opset_version=ct.target.iOS17)
    def prog(idx, t):
        return (mb.gather(x=table, indices=idx, axis=0, name="o_gather"),
                mb.gather(x=t, indices=mb.slice_by_size(x=mb.reshape(x=idx, shape=[6]), begin=[0],
                                                        size=[2]), axis=0, name="o_gather1"))

    exp = {"o_gather": table[idx], "o_gather1": table[idx.reshape(6)[:2]]}
    return prog, {"idx": idx, "t": table}, exp, "fp32", 0.0, 0.0


# ---- fp16 programs: rounding, overflow, the int16 gather path ---------------------------

@case
def fp16_rounding():
    x = rand((4, 16), np.float16)
    w = rand((8, 16), np.float16, 0.25)

    @mb.program(input_specs=[mb.TensorSpec((4, 16), F16)], opset_version=ct.target.iOS17)
    def prog(x):
        h = mb.linear(x=x, weight=w, name="h")
        sq = mb.mul(x=h, y=h)
        ms = mb.reduce_mean(x=sq, axes=[-1], keep_dims=True)
        n = mb.mul(x=h, y=mb.rsqrt(x=ms, epsilon=np.float16(1e-5)), name="o_norm")
        return n, mb.softmax(x=h, axis=-1, name="o_softmax"), mb.silu(x=h, name="o_silu")

    # numpy, rounding to fp16 after each op like the device does
    h = (x.astype(np.float32) @ w.T.astype(np.float32)).astype(np.float16)
    sq = (h.astype(np.float32) ** 2).astype(np.float16)
    ms = sq.astype(np.float32).mean(-1, keepdims=True).astype(np.float16)
    r = (1.0 / np.sqrt(ms.astype(np.float32) + np.float32(np.float16(1e-5)))).astype(np.float16)
    n = (h.astype(np.float32) * r.astype(np.float32)).astype(np.float16)
    hf = h.astype(np.float32)
    e = np.exp(hf - hf.max(-1, keepdims=True))
    sm = (e / e.sum(-1, keepdims=True)).astype(np.float16)
    silu = (hf * sigmoid(hf)).astype(np.float16)
    # one fp16 ulp at the values' magnitude: the order of summation may differ
    return prog, {"x": x}, {"o_norm": n, "o_softmax": sm, "o_silu": silu}, "fp16", 2e-3, 2e-3


@case
def fp16_overflow():
    x = np.array([[100.0, 300.0, -400.0, 2.0]], np.float16)

    @mb.program(input_specs=[mb.TensorSpec((1, 4), F16)], opset_version=ct.target.iOS17)
    def prog(x):
        sq = mb.mul(x=x, y=x, name="sq")
        return (mb.add(x=sq, y=np.float16(0.0), name="o_sq"),
                mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="o_mean"),
                mb.mul(x=x, y=np.float16(0.5), name="o_half"))

    sq = x * x
    return prog, {"x": x}, {"o_sq": sq, "o_mean": np.array([[np.inf]], np.float16),
                            "o_half": x * np.float16(0.5)}, "fp16", 0.0, 0.0


@case
def fp16_gather_int16():
    """An embedding lookup in an fp16 program: DEFAULT passes insert int16/uint16 casts and the
    greater_equal/add/select guard for negative indices."""
    table = rand((40, 8), np.float16)
    cos = rand((12, 4), np.float16)
    ids = np.array([[5, 39, 0]], np.int32)
    pos = np.array([7], np.int32)

    @mb.program(input_specs=[mb.TensorSpec((1, 3), I32), mb.TensorSpec((1,), I32)],
                opset_version=ct.target.iOS17)
    def prog(ids, pos):
        e = mb.gather(x=table, indices=ids, axis=0, name="o_embed")
        p = mb.add(x=pos, y=np.arange(3, dtype=np.int32))
        c = mb.gather(x=cos, indices=p, axis=0, name="o_cos")
        return e, c

    p = pos + np.arange(3)
    return prog, {"ids": ids, "pos": pos}, {"o_embed": table[ids], "o_cos": cos[p]}, "fp16", 0.0, 0.0


@case
def attention_fp16():
    """The attention pattern of a contract-v1 decode step: a layer sliced from the cache,
    concatenated with the new keys, a mask built from `position`, softmax, values."""
    L, H, S, D, Q = 2, 2, 6, 4, 2
    q = rand((1, H, Q, D), np.float16)
    k = rand((1, H, Q, D), np.float16)
    cache = rand((L, H, S, D), np.float16)
    pos = np.array([3], np.int32)
    causal = np.where(np.tril(np.ones((Q, Q))) > 0, 0.0, -30000.0).astype(np.float16)

    @mb.program(input_specs=[mb.TensorSpec((1, H, Q, D), F16), mb.TensorSpec((1, H, Q, D), F16),
                             mb.TensorSpec((L, H, S, D), F16), mb.TensorSpec((1,), I32)],
                opset_version=ct.target.iOS17)
    def prog(q, k, cache, pos):
        layer = mb.slice_by_index(x=cache, begin=[1, 0, 0, 0], end=[2, H, S, D])
        keys = mb.concat(values=[layer, k], axis=2)
        scores = mb.mul(x=mb.matmul(x=q, y=keys, transpose_y=True), y=np.float16(0.5))
        visible = mb.less(x=np.arange(S, dtype=np.int32), y=pos)
        m = mb.select(cond=visible, a=np.zeros(S, np.float16), b=np.full(S, -30000, np.float16))
        m = mb.tile(x=mb.reshape(x=m, shape=[1, S]), reps=[Q, 1])
        mask = mb.concat(values=[m, causal], axis=1)
        p = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        return mb.matmul(x=p, y=keys, name="o_attn")

    keys = np.concatenate([cache[1:2], k], axis=2).astype(np.float32)
    sc = (q.astype(np.float32) @ keys.transpose(0, 1, 3, 2)) * 0.5
    m = np.where(np.arange(S) < pos[0], 0.0, -30000.0)
    mask = np.concatenate([np.tile(m[None], (Q, 1)), causal.astype(np.float32)], axis=1)
    sc = sc + mask
    e = np.exp(sc - sc.max(-1, keepdims=True))
    pr = e / e.sum(-1, keepdims=True)
    out = (pr @ keys).astype(np.float16)
    # fp16 rounding of scores and probabilities: a few fp16 ulps of values of magnitude ~1
    return prog, {"q": q, "k": k, "cache": cache, "pos": pos}, {"o_attn": out}, "fp16", 1e-2, 1e-2


def lut_case(nbits):
    oc, ic = 6, 10
    lut = rand((2 ** nbits,), np.float16)
    idx = RNG.integers(0, 2 ** nbits, oc * ic)
    bits = np.zeros(oc * ic * nbits, np.uint8)
    for k, v in enumerate(idx):
        for b in range(nbits):
            bits[k * nbits + b] = (v >> b) & 1
    packed = np.packbits(bits, bitorder="little")
    dense = lut[idx].reshape(oc, ic)
    x = rand((2, ic), np.float16)

    def build():
        @mb.program(input_specs=[mb.TensorSpec((2, ic), F16)], opset_version=ct.target.iOS17)
        def prog(x):
            w = mb.constexpr_lut_to_dense(indices=packed, lut=lut,
                                          shape=np.array([oc, ic], np.uint32))
            return mb.linear(x=x, weight=w, name="o_lut")
        return prog

    y = (x.astype(np.float32) @ dense.T.astype(np.float32)).astype(np.float16)
    return build(), {"x": x}, {"o_lut": y}, "fp16", 2e-3, 2e-3


for _n in (1, 2, 4, 6, 8):
    CASES[f"lut{_n}"] = (lambda n: (lambda: lut_case(n)))(_n)


def palettized18_case(nbits, group_size, per_channel_scale):
    """A linear whose fp16 weight is palettized by coremltools' own palettize_weights (iOS18,
    per_grouped_channel, optionally enable_per_channel_scale); the expected output uses the
    weight as coremltools itself dequantizes it (cto.decompress_weights)."""
    import coremltools.optimize.coreml as cto

    oc, ic = 16, 12
    w = rand((oc, ic), np.float16) * np.linspace(0.2, 3.0, ic).astype(np.float16)
    x = rand((2, ic), np.float16)

    @mb.program(input_specs=[mb.TensorSpec((2, ic), F16)], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.linear(x=x, weight=w, name="o_pal")

    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                       compute_precision=ct.precision.FLOAT16)
    # "uniform": the venv has neither kmeans1d nor scikit-learn; the layout is the same.
    op = cto.OpPalettizerConfig(mode="uniform", nbits=nbits, granularity="per_grouped_channel",
                                group_size=group_size,
                                enable_per_channel_scale=per_channel_scale,
                                weight_threshold=1)
    model = cto.palettize_weights(model, cto.OptimizationConfig(global_config=op))
    dense_model = cto.decompress_weights(model)
    linear = [o for o in dense_model._mil_program.functions["main"].operations
              if o.op_type == "linear"][0]
    dense = np.asarray(linear.weight.val, np.float32)
    assert dense.shape == (oc, ic), dense.shape
    y = (x.astype(np.float32) @ dense.T).astype(np.float16)
    return model, {"x": x}, {"o_pal": y}, "fp16", 2e-3, 2e-3


for _n in (1, 2, 3, 4, 6, 8):
    CASES[f"pal18_n{_n}_g4_pcs"] = (lambda n: (lambda: palettized18_case(n, 4, True)))(_n)
CASES["pal18_n4_g8"] = lambda: palettized18_case(4, 8, False)
CASES["pal18_n3_g16"] = lambda: palettized18_case(3, 16, False)


def main():
    out = sys.argv[1]
    names = sys.argv[2:] or list(CASES)
    for name in names:
        prog, inputs, expected, precision, rtol, atol = CASES[name]()
        cp = ct.precision.FLOAT32 if precision == "fp32" else ct.precision.FLOAT16
        if isinstance(prog, ct.models.MLModel):
            # Built, converted and compressed by the case itself (iOS18 cases).
            model = prog
        else:
            model = ct.convert(prog, convert_to="mlprogram",
                               minimum_deployment_target=ct.target.iOS17, compute_precision=cp)
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        model.save(os.path.join(d, "model.mlpackage"))
        ops = sorted({op.op_type for op in model._mil_program.functions["main"].operations})
        doc = {"inputs": {k: enc(v) for k, v in inputs.items()},
               "outputs": {k: enc(v) for k, v in expected.items()},
               "rtol": rtol, "atol": atol, "ops": ops}
        with open(os.path.join(d, "case.json"), "w") as f:
            json.dump(doc, f)
        print(name, " ".join(ops))


if __name__ == "__main__":
    main()
