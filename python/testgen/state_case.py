"""Build a small stateful ML Program with coremltools' own MIL builder (iOS18: a state,
read_state, slice_update at a dynamic position, coreml_update_state used and unused) and write
it with numpy results of three calls in a row, for tests/it/state/foreign.rs.

usage: python state_case.py OUT_DIR   (writes OUT_DIR/model.mlpackage and OUT_DIR/case.json)

case.json: {"state": {"name", "shape"}, "steps": [{"inputs": {...}, "outputs": {...}}],
            "rtol": r, "atol": a}; tensors as in mil_cases.py. The output is committed
(tests/fixtures/state_case); rerun this script to regenerate it.
"""

import json
import os
import sys

import numpy as np

import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Program, types

L, H, S, D = 2, 3, 32, 8
RNG = np.random.default_rng(2024)


def enc(a):
    a = np.asarray(a)
    dt = {np.dtype(np.float16): "fp16", np.dtype(np.int32): "int32"}[a.dtype]
    return {"dtype": dt, "shape": list(a.shape), "data": a.reshape(-1).tolist()}


def program():
    specs = {
        "x": mb.placeholder(shape=(1, H, 1, D), dtype=types.fp16),
        "position": mb.placeholder(shape=(1,), dtype=types.int32),
        "cache": mb.state_tensor_placeholder(shape=(L, H, S, D), dtype=types.fp16),
    }
    with Function(specs, opset_version=ct.target.iOS18) as f:
        x, pos, cache = f.inputs["x"], f.inputs["position"], f.inputs["cache"]
        old = mb.read_state(input=cache, name="old")
        seen = mb.reduce_sum(x=old, axes=[2], name="seen")
        upd = mb.concat(values=[x, mb.mul(x=x, y=np.float16(2.0))], axis=0, name="rows")
        begin = mb.concat(values=[np.array([0, 0], np.int32), pos, np.array([0], np.int32)],
                          axis=0, name="begin")
        end = mb.add(x=begin, y=np.array([L, H, 1, D], np.int32), name="end")
        new = mb.slice_update(x=old, update=upd, begin=begin, end=end, name="new")
        # Its result is read: saved as write_state followed by read_state.
        stored = mb.coreml_update_state(state=cache, value=new, name="stored")
        total = mb.reduce_sum(x=stored, axes=[2], name="total")
        f.set_outputs([seen, total])
    prog = Program()
    prog.add_function("main", f)
    return prog


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    model = ct.convert(program(), convert_to="mlprogram",
                       minimum_deployment_target=ct.target.iOS18,
                       compute_precision=ct.precision.FLOAT16, skip_model_load=True)
    model.save(os.path.join(out, "model.mlpackage"))
    state = np.zeros((L, H, S, D), np.float16)
    steps = []
    for p in (0, 1, 5):
        x = RNG.standard_normal((1, H, 1, D)).astype(np.float16)
        seen = state.astype(np.float32).sum(axis=2).astype(np.float16)
        state[:, :, p:p + 1, :] = np.concatenate([x, x * np.float16(2.0)], axis=0)
        total = state.astype(np.float32).sum(axis=2).astype(np.float16)
        steps.append({"inputs": {"x": enc(x), "position": enc(np.array([p], np.int32))},
                      "outputs": {"seen": enc(seen), "total": enc(total)}})
    doc = {"state": {"name": "cache", "shape": [L, H, S, D]}, "steps": steps,
           "rtol": 2e-3, "atol": 2e-3,
           "ops": sorted({op.op_type for op in model._mil_program.functions["main"].operations})}
    with open(os.path.join(out, "case.json"), "w") as f:
        json.dump(doc, f)
    print(" ".join(doc["ops"]))


if __name__ == "__main__":
    main()
