"""Build small ML Program packages with coremltools' MIL builder for the lint tests
(tests/it/lint/cases.rs): for each Neural Engine rule one package that breaks it (NAME_bad) and
one that does not (NAME_ok), plus one package that breaks several at once (several_bad).

usage: python lint_cases.py OUT_DIR [CASE ...]

Each package is OUT_DIR/CASE.mlpackage. Programs are saved with an EMPTY pass pipeline, so the
package holds exactly the ops written here (the default pipeline would, for instance, fuse a
decomposed norm). What coremltools refuses to save (rank 6) is written at rank 5 and the saved
spec's declared type patched, the way a hand-edited or foreign package could be.
"""

import os
import sys

import numpy as np

import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

F16 = types.fp16
F32 = types.fp32
I32 = types.int32
IOS17 = ct.target.iOS17
RNG = np.random.default_rng(7)

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def w16(*shape):
    return (RNG.standard_normal(shape) * 0.1).astype(np.float16)


def linear_prog(width):
    """x [1, 1, 64] fp16 → linear to [1, 1, width]."""
    @mb.program(input_specs=[mb.TensorSpec((1, 1, 64), F16)], opset_version=IOS17)
    def prog(x):
        return mb.linear(x=x, weight=w16(width, 64), name="logits")
    return prog


@case
def dimension_range_bad():
    return linear_prog(16385)


@case
def dimension_range_ok():
    return linear_prog(16384)


def add_prog(dtype, shape=(1, 1, 64), rank6=False):
    @mb.program(input_specs=[mb.TensorSpec(shape, dtype)], opset_version=IOS17)
    def prog(x):
        one = np.float16(1.0) if dtype == F16 else np.float32(1.0)
        return mb.add(x=x, y=one, name="out")
    return prog


@case
def fp32_bad():
    return add_prog(F32), ct.precision.FLOAT32


@case
def fp32_ok():
    return add_prog(F16)


@case
def rank_bad():
    # Saved at rank 5, then the output's declared type is patched to rank 6 (see main()).
    return add_prog(F16, (1, 2, 2, 2, 32)), None, "rank6"


@case
def rank_ok():
    return add_prog(F16, (1, 2, 2, 2, 32))


@case
def narrow_last_axis_bad():
    return add_prog(F16, (1, 64, 1))


@case
def narrow_last_axis_ok():
    return add_prog(F16, (1, 1, 64))


@case
def dynamic_shape_bad():
    @mb.program(input_specs=[mb.TensorSpec((1, get_new_symbol(), 64), F16)],
                opset_version=IOS17)
    def prog(x):
        return mb.add(x=x, y=np.float16(1.0), name="out")
    return prog


@case
def dynamic_shape_ok():
    return add_prog(F16, (1, 8, 64))


def mask_prog(fill):
    mask = np.where(np.tril(np.ones((64, 64))) > 0, 0.0, fill).astype(np.float16)

    @mb.program(input_specs=[mb.TensorSpec((1, 64, 64), F16)], opset_version=IOS17)
    def prog(scores):
        return mb.softmax(x=mb.add(x=scores, y=mask), axis=-1, name="out")
    return prog


@case
def neg_inf_bad():
    return mask_prog(-np.inf)


@case
def neg_inf_ok():
    return mask_prog(-40000.0)


@case
def gather_nd_bad():
    table = w16(128, 64)

    @mb.program(input_specs=[mb.TensorSpec((1, 1), I32)], opset_version=IOS17)
    def prog(pos):
        return mb.gather_nd(x=table, indices=mb.expand_dims(x=pos, axes=[-1]), name="out")
    return prog


@case
def gather_nd_ok():
    # RoPE rows passed in, as Apple's rules say: nothing gathered in the graph.
    @mb.program(input_specs=[mb.TensorSpec((1, 1, 64), F16), mb.TensorSpec((1, 1, 64), F16)],
                opset_version=IOS17)
    def prog(x, cos):
        return mb.mul(x=x, y=cos, name="out")
    return prog


@case
def fused_sdpa_bad():
    shape = (1, 2, 32, 64)

    @mb.program(input_specs=[mb.TensorSpec(shape, F16) for _ in range(3)], opset_version=ct.target.iOS18)
    def prog(q, k, v):
        return mb.scaled_dot_product_attention(query=q, key=k, value=v, name="out")
    return prog, None, None, ct.target.iOS18


@case
def fused_sdpa_ok():
    shape = (1, 2, 32, 64)

    @mb.program(input_specs=[mb.TensorSpec(shape, F16) for _ in range(3)], opset_version=IOS17)
    def prog(q, k, v):
        s = mb.matmul(x=q, y=k, transpose_y=True)
        p = mb.softmax(x=mb.mul(x=s, y=np.float16(0.125)), axis=-1)
        return mb.matmul(x=p, y=v, name="out")
    return prog


@case
def decomposed_norm_bad():
    @mb.program(input_specs=[mb.TensorSpec((1, 1, 64), F16)], opset_version=IOS17)
    def prog(x):
        ms = mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[-1], keep_dims=True)
        return mb.mul(x=x, y=mb.rsqrt(x=ms, epsilon=np.float16(1e-5)), name="out")
    return prog


@case
def decomposed_norm_ok():
    @mb.program(input_specs=[mb.TensorSpec((1, 1, 64), F16)], opset_version=IOS17)
    def prog(x):
        return mb.layer_norm(x=x, axes=[-1], epsilon=np.float16(1e-5), name="out")
    return prog


@case
def int_compute_bad():
    @mb.program(input_specs=[mb.TensorSpec((1, 16), I32), mb.TensorSpec((1, 16, 64), F16)],
                opset_version=IOS17)
    def prog(pos, x):
        p = mb.add(x=pos, y=np.arange(16, dtype=np.int32))
        return mb.gather(x=w16(64, 64), indices=p, axis=0, name="out"), mb.identity(x=x)
    return prog


@case
def int_compute_ok():
    return add_prog(F16, (1, 16, 64))


@case
def several_bad():
    """fp32 compute, a -inf mask, a 20000-wide output and a narrow input, at once."""
    mask = np.where(np.tril(np.ones((4, 4))) > 0, 0.0, -np.inf).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec((1, 4, 4), F32), mb.TensorSpec((1, 4, 1), F32)],
                opset_version=IOS17)
    def prog(scores, narrow):
        p = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        wide = mb.linear(x=p, weight=(RNG.standard_normal((20000, 4)) * 0.1).astype(np.float32))
        return mb.mul(x=wide, y=narrow, name="out")
    return prog, ct.precision.FLOAT32


def normalize(built):
    """(prog, precision, patch, target) from what a case returns."""
    if not isinstance(built, tuple):
        built = (built,)
    prog, precision, patch, target = (tuple(built) + (None, None, None))[:4]
    return prog, precision or ct.precision.FLOAT16, patch, target or IOS17


def patch_rank6(model):
    """The output's declared type gains a leading 1: rank 6, which coremltools refuses."""
    spec = model.get_spec()
    fn = spec.mlProgram.functions["main"]
    for op in fn.block_specializations[fn.opset].operations:
        for out in op.outputs:
            if out.name == "out":
                dims = out.type.tensorType.dimensions
                dims.insert(0, type(dims[0])())
                dims[0].constant.size = 1
                out.type.tensorType.rank = len(dims)
    return ct.models.MLModel(spec, weights_dir=model.weights_dir, skip_model_load=True)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name in sys.argv[2:] or list(CASES):
        prog, precision, patch, target = normalize(CASES[name]())
        model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=target,
                           compute_precision=precision, pass_pipeline=ct.PassPipeline.EMPTY,
                           skip_model_load=True)
        if patch == "rank6":
            model = patch_rank6(model)
        model.save(os.path.join(out, f"{name}.mlpackage"))
        print(name)


if __name__ == "__main__":
    main()
