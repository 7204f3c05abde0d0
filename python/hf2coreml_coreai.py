"""hf2coreml's bridge to Apple's Core AI (`coreai-core`): serialize a finished graph as an
`.aimodel`, and run a saved one with Apple's runtime. Nothing else.

The Rust side builds the whole decoder-step graph (the same op list the coremltools bridge
replays, in MIL's op names and argument conventions) and calls `emit()` once. This module maps
each MIL op to the Core AI op (or the few ops) that computes the same thing: no graph decisions,
no numerics (a palettized weight's indices arrive packed as the runtime reads them).

Core AI's authoring API declares a graph from a Python function's annotations, so the function
is made here with the graph's inputs as its parameters. Sub-byte LUT indices go through the one
private seam the beta needs (`_dense_resource`): see docs/reference/coreai.md.
"""

import asyncio
import contextlib
import inspect
import json
import os
import sys
import tempfile
from typing import Annotated


@contextlib.contextmanager
def quiet():
    """Send fds 1/2 and sys.stdout/stderr to a temp file (the runtime logs every function
    load on stderr); yield a function returning the captured text."""
    sys.stdout.flush()
    sys.stderr.flush()
    capture = tempfile.TemporaryFile(mode="w+b")
    saved = [os.dup(1), os.dup(2)]
    saved_py = (sys.stdout, sys.stderr)
    sink = open(os.devnull, "w")
    try:
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        sys.stdout = sink
        sys.stderr = sink

        def captured():
            capture.flush()
            capture.seek(0)
            return capture.read().decode("utf-8", "replace")

        yield captured
    finally:
        sys.stdout, sys.stderr = saved_py
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        sink.close()
        capture.close()


def check_environment():
    """Import coreai quietly; return its version. ImportError means `make setup`."""
    with quiet():
        from coreai import _version
        import coreai.authoring  # noqa: F401
        import coreai.runtime  # noqa: F401
    return _version.__version__


def _np_float(np, name):
    return np.float16 if name == "fp16" else np.float32


_NP_DTYPES = {"fp16": "float16", "fp32": "float32", "int32": "int32", "bool": "bool"}


def _dense_resource(np, packed, shape, nbits, name):
    """A constant of type uint<nbits>[shape] whose storage is `packed` (a bit stream), a
    resource named `name`. The authoring API's `constant(dtype=uint4)` stores one index per byte
    while the runtime reads packed bits, so the bytes are handed over as a dense resource of the
    sub-byte type (8-bit indices too, so that no resource is named at random, see
    `_named_constant`)."""
    from coreai._compiler.dialects._coreai_ops_gen import ConstantOp
    from coreai._compiler.ir import DenseResourceElementsAttr, IntegerType, RankedTensorType
    from coreai.authoring import Value

    t = RankedTensorType.get(list(shape), IntegerType.get_unsigned(nbits))
    attr = DenseResourceElementsAttr.get_from_buffer(np.ascontiguousarray(packed), name, t)
    return Value._from_mlir(ConstantOp(value=attr).result)


def _named_constant(np, arr, name):
    """A tensor constant stored as a resource named after the graph's constant. The authoring
    API names the resource of a large constant `resource_<random number>`, so two saves of one
    program would differ in those names (and in the bytecode's hash)."""
    from coreai._compiler.dialects._coreai_ops_gen import ConstantOp
    from coreai._compiler.ir import (
        DenseResourceElementsAttr,
        F16Type,
        F32Type,
        IntegerType,
        RankedTensorType,
    )
    from coreai.authoring import Value
    from coreai.authoring.constant import constant

    element = {
        np.dtype(np.float16): F16Type.get,
        np.dtype(np.float32): F32Type.get,
        np.dtype(np.int32): lambda: IntegerType.get_signed(32),
    }.get(arr.dtype)
    if element is None or arr.ndim == 0:
        return constant(arr)
    t = RankedTensorType.get(list(arr.shape), element())
    attr = DenseResourceElementsAttr.get_from_buffer(np.ascontiguousarray(arr), name, t)
    v = Value._from_mlir(ConstantOp(value=attr).result)
    _NAMED[v._to_mlir()] = (arr, name)
    return v


# The constants `_named_constant` made, by their MLIR value: the authoring API folds an op on
# a constant (a weight reshaped for a 1x1 conv) into a new constant whose storage it names at
# random, so `_Ops.op_reshape` reshapes these itself.
_NAMED = {}


def _lut_weight(np, ca, c, arrays, float_np):
    """A palettized weight as `lut_to_dense`: indices [rows, ...] of uint<nbits>, one table per
    run of rows (LUT [groups, 1.., 2^nbits, 1]), then the per-row scale, if any."""
    from coreai.authoring.constant import constant

    name, shape, nbits = c["name"], list(c["shape"]), int(c["nbits"])
    numel = int(np.prod(shape))
    indices, lut = arrays[0], arrays[1]
    scale = arrays[2] if len(arrays) > 2 else None
    lut = lut.view(np.float16).astype(float_np, copy=False)
    groups = lut.size >> nbits
    lut = lut.reshape([groups] + [1] * (len(shape) - 1) + [1 << nbits, 1])
    # The bit stream Core AI reads for a uintN tensor: element i in bits [i*nbits, (i+1)*nbits).
    need = (numel * nbits + 7) // 8
    if indices.size != need:
        raise ValueError(f"{name}: {indices.size} bytes of packed indices, {need} expected")
    idx = _dense_resource(np, indices, shape, nbits, name)
    table = _named_constant(np, lut, f"{name}_lut")
    w = ca.lut_to_dense(idx, table, constant(np.array(0, dtype=np.int16)))
    if scale is None:
        return w
    scale = scale.view(np.float16).astype(float_np, copy=False).reshape([shape[0]] + [1] * (len(shape) - 1))
    return ca.broadcasting_mul(w, _named_constant(np, scale, f"{name}_scale"))


def _shape(v):
    return list(v._to_mlir().type.shape)


class _Ops:
    """MIL ops (name, keyword arguments as the graph gives them) → Core AI values."""

    def __init__(self, np, ca, float_np):
        from coreai.authoring.constant import constant

        self.np, self.ca, self.float_np, self.const = np, ca, float_np, constant

    def i32(self, v):
        return self.const(self.np.array(v, dtype=self.np.int32))

    def u32(self, v):
        return self.const(self.np.array(v, dtype=self.np.uint32))

    def value(self, v):
        """A scalar argument as a rank-0 constant: a MIL float in the graph's float type, a
        MIL int as int32 (the description keeps the two apart: 0.0 against 0)."""
        if isinstance(v, bool):
            return self.const(self.np.array(v))
        if isinstance(v, int):
            return self.const(self.np.array(v, dtype=self.np.int32))
        if isinstance(v, float):
            return self.const(self.np.array(v, dtype=self.float_np))
        return v

    def axis(self, x, a):
        return a + len(_shape(x)) if a < 0 else a

    def call(self, op, a):
        fn = getattr(self, "op_" + op, None)
        if fn is None:
            raise ValueError(f"the Core AI bridge has no translation for MIL op `{op}`")
        return fn(**a)

    # Element-wise, broadcasting as MIL does.
    def op_add(self, x, y):
        return self.ca.broadcasting_add(self.value(x), self.value(y))

    def op_sub(self, x, y):
        return self.ca.broadcasting_sub(self.value(x), self.value(y))

    def op_mul(self, x, y):
        return self.ca.broadcasting_mul(self.value(x), self.value(y))

    def op_real_div(self, x, y):
        return self.ca.broadcasting_divide(self.value(x), self.value(y))

    def op_maximum(self, x, y):
        return self.ca.broadcasting_maximum(self.value(x), self.value(y))

    def op_minimum(self, x, y):
        return self.ca.broadcasting_minimum(self.value(x), self.value(y))

    def op_greater(self, x, y):
        return self.ca.broadcasting_greater(self.value(x), self.value(y))

    def op_less(self, x, y):
        return self.ca.broadcasting_greater(self.value(y), self.value(x))

    def op_greater_equal(self, x, y):
        return self.ca.not_(self.ca.broadcasting_greater(self.value(y), self.value(x)))

    def op_less_equal(self, x, y):
        return self.ca.not_(self.ca.broadcasting_greater(self.value(x), self.value(y)))

    def op_logical_and(self, x, y):
        return self.ca.broadcasting_and(x, y)

    def op_logical_or(self, x, y):
        return self.ca.broadcasting_or(x, y)

    def op_logical_not(self, x):
        return self.ca.not_(x)

    def op_select(self, cond, a, b):
        return self.ca.broadcasting_where(cond, self.value(a), self.value(b))

    def op_clip(self, x, alpha, beta):
        return self.op_minimum(self.op_maximum(x, alpha), beta)

    def op_rsqrt(self, x, epsilon=None):
        if epsilon:
            x = self.op_add(x, epsilon)
        return self.ca.rsqrt(x)

    def op_sqrt(self, x):
        return self.ca.sqrt(x)

    def op_exp(self, x):
        return self.ca.exp(x)

    def op_log(self, x):
        return self.ca.log(x)

    def op_tanh(self, x):
        return self.ca.tanh(x)

    def op_silu(self, x):
        return self.ca.silu(x)

    def op_sigmoid(self, x):
        return self.ca.sigmoid(x)

    def op_relu(self, x):
        return self.ca.relu(x)

    def op_abs(self, x):
        return self.ca.abs_(x)

    def op_identity(self, x):
        return x

    # Reductions.
    def _reduce(self, fn, x, axes, keep_dims=False):
        shape = _shape(x)
        axes = [self.axis(x, a) for a in axes]
        y = fn(x, self.i32(axes))
        if not keep_dims:
            y = self.ca.reshape(y, self.i32([d for i, d in enumerate(shape) if i not in axes]))
        return y

    def op_reduce_mean(self, x, axes, keep_dims=False):
        return self._reduce(self.ca.reduce_mean, x, axes, keep_dims)

    def op_reduce_max(self, x, axes, keep_dims=False):
        return self._reduce(self.ca.reduce_max, x, axes, keep_dims)

    def op_reduce_sum(self, x, axes, keep_dims=False):
        return self._reduce(self.ca.reduce_sum, x, axes, keep_dims)

    def op_softmax(self, x, axis=-1):
        return self.ca.softmax(x, self.i32(self.axis(x, axis)))

    # Shapes and data movement.
    def op_reshape(self, x, shape):
        named = _NAMED.get(x._to_mlir())
        if named is not None:
            arr, name = named
            return _named_constant(self.np, arr.reshape(shape), f"{name}_{'x'.join(map(str, shape))}")
        return self.ca.reshape(x, self.i32(list(shape)))

    def op_expand_dims(self, x, axes):
        return self.ca.expand_dims(x, self.i32(list(axes)))

    def op_squeeze(self, x, axes):
        shape = _shape(x)
        axes = [self.axis(x, a) for a in axes]
        return self.ca.reshape(x, self.i32([d for i, d in enumerate(shape) if i not in axes]))

    def op_transpose(self, x, perm):
        return self.ca.transpose(x, self.u32(list(perm)))

    def op_concat(self, values, axis, interleave=False):
        if interleave:
            raise ValueError("the Core AI bridge does not translate concat(interleave=True)")
        return self.ca.concat(self.i32(self.axis(values[0], axis)), list(values))

    def op_split(self, x, num_splits, axis):
        axis = self.axis(x, axis)
        size = _shape(x)[axis] // num_splits
        return self.ca.split(x, self.u32(size), self.i32(axis))

    def op_slice_by_index(self, x, begin, end, stride=None):
        stride = list(stride) if stride is not None else [1] * len(begin)
        return self.ca.slice_(x, self.i32(list(begin)), self.i32(list(end)), self.i32(stride))

    def op_tile(self, x, reps):
        return self.ca.tile(x, self.u32(list(reps)))

    def op_gather(self, x, indices, axis=0):
        """MIL gather: out.shape = x.shape[:axis] + indices.shape + x.shape[axis+1:]."""
        rank = len(_shape(x))
        axis = self.axis(x, axis)
        k = len(_shape(indices))
        idx = self.ca.expand_dims(indices, self.i32([k]))
        if axis == 0:
            return self.ca.gather_nd(x, idx)
        front = [axis] + [i for i in range(rank) if i != axis]
        y = self.ca.gather_nd(self.op_transpose(x, front), idx)
        # y: indices dims, then x's other axes in order; put the indices dims back at `axis`.
        back = list(range(k, k + axis)) + list(range(k)) + list(range(k + axis, k + rank - 1))
        return self.op_transpose(y, back)

    # Linear algebra.
    def op_matmul(self, x, y, transpose_x=False, transpose_y=False):
        if transpose_x:
            x = self._swap_last(x)
        if transpose_y:
            y = self._swap_last(y)
        if str(x._to_mlir().type.element_type) != "f16":
            return self.ca.broadcasting_batch_matmul(x, y)
        # An fp16 `batch_matmul` accumulates in fp16 on Apple's CPU runtime (its error grows with
        # the contraction: attention over long contexts, a DeltaNet state's Sᵀq); a grouped 1×1
        # `conv2d` with x as its weight (a graph value) sums exact products in fp32 and rounds
        # once, and runs faster (docs/reference/coreai.md). One group per batch of y, N on the
        # width axis.
        np = self.np
        xs, ys = _shape(x), _shape(y)
        (m, k), n = xs[-2:], ys[-1]
        bx, by = xs[:-2], ys[:-2]
        rank = max(len(bx), len(by))
        bx, by = [1] * (rank - len(bx)) + bx, [1] * (rank - len(by)) + by
        batch = [max(a, b) for a, b in zip(bx, by)]
        nb = int(np.prod(batch, dtype=np.int64)) if batch else 1
        if int(np.prod(by, dtype=np.int64)) == 1:
            groups = 1
        else:
            groups = nb
            if bx != batch:
                x = self.ca.broadcast_to(x, self.i32(batch + [m, k]))
            if by != batch:
                y = self.ca.broadcast_to(y, self.i32(batch + [k, n]))
        yi = self.op_reshape(y, [1, groups * k, 1, n])
        w = self.op_reshape(x, [nb * m, k, 1, 1])
        z = self.ca.conv2d(yi, w, self.u32([1, 1]), self.u32([1, 1]), self.u32(groups))
        return self.op_reshape(z, batch + [m, n])

    def _swap_last(self, x):
        r = len(_shape(x))
        return self.op_transpose(x, list(range(r - 2)) + [r - 1, r - 2])

    def op_conv(self, x, weight, strides, pad, dilations, groups, bias=None):
        """MIL's `conv` with explicit padding; Core AI's `conv2d` pads nothing, so only a zero
        `pad` has a translation."""
        if any(pad):
            raise ValueError(f"conv: padding {list(pad)} has no translation in the Core AI bridge")
        y = self.ca.conv2d(x, weight, self.u32(list(strides)), self.u32(list(dilations)), self.u32(groups))
        if bias is None:
            return y
        return self.ca.broadcasting_add(y, self.op_reshape(bias, [1, _shape(bias)[0], 1, 1]))

    def op_linear(self, x, weight, bias=None):
        # A 1×1 conv over the rows as its batch ([n, in, 1, 1], reshapes only): the runtime
        # accumulates a conv's dot products in fp32 where an fp16 `batch_matmul` accumulates in
        # fp16 (docs/reference/coreai.md).
        lead, n_in = _shape(x)[:-1], _shape(x)[-1]
        n_out = _shape(weight)[0]
        rows = 1
        for d in lead:
            rows *= d
        x4 = self.op_reshape(x, [rows, n_in, 1, 1])
        w4 = self.op_reshape(weight, [n_out, n_in, 1, 1])
        y = self.ca.conv2d(x4, w4, self.u32([1, 1]), self.u32([1, 1]), self.u32(1))
        y = self.op_reshape(y, lead + [n_out])
        return y if bias is None else self.ca.broadcasting_add(y, bias)


def _make_function(name, input_specs, output_specs, body):
    """A Python function Core AI's `graph` can read: one annotated parameter per input, the
    outputs as the annotated return type."""
    from coreai.authoring import Value

    names = [s.name for s in input_specs]

    def fn(*args):
        return body(dict(zip(names, args)))

    fn.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    )
    ann = {n: Annotated[Value, s] for n, s in zip(names, input_specs)}
    ann["return"] = tuple[tuple(Annotated[Value, s] for s in output_specs)]
    fn.__annotations__ = ann
    fn.__name__ = name
    fn.__qualname__ = name
    return fn


def _function(name, desc, dense, luts):
    """Declare one graph function `name` in the current module from its description."""
    import numpy as np
    import coreai.authoring as ca
    from coreai.authoring import TensorType, graph

    float_np = _np_float(np, desc["float"])
    # With `round_each_op` the program keeps its fp16 interface but computes every op in fp32
    # and rounds each float result to fp16, as hf2coreml's interpreter does (the cross-check):
    # Apple's Linux CPU runtime otherwise accumulates fp16 matmuls in fp16.
    rounding = bool(desc.get("round_each_op")) and float_np == np.float16
    compute_np = np.float32 if rounding else float_np
    ops = _Ops(np, ca, compute_np)

    def np_dtype(d):
        return float_np if d in ("fp16", "fp32") else np.dtype(_NP_DTYPES[d]).type

    def is_f32(v):
        return str(v._to_mlir().type.element_type) == "f32"

    def rounded(v):
        if rounding and not isinstance(v, (list, tuple)) and is_f32(v):
            return ca.cast(ca.cast(v, np.float16), np.float32)
        return v

    for i in desc["inputs"]:
        if i.get("state"):
            raise ValueError("the Core AI bridge does not author states")
    input_specs = [TensorType(tuple(i["shape"]), np_dtype(i["dtype"]), name=i["name"]) for i in desc["inputs"]]
    output_specs = [
        TensorType(tuple(o["shape"]), np_dtype(o["dtype"]), name=o["name"]) for o in desc["output_specs"]
    ]

    def body(env):
        if rounding:
            for i in desc["inputs"]:
                if i["dtype"] in ("fp16", "fp32"):
                    env[i["name"]] = ca.cast(env[i["name"]], np.float32)
        for c in desc["consts"]:
            cname, key = c["name"], c.get("key", c["name"])
            if c["kind"] == "lut":
                env[cname] = rounded(_lut_weight(np, ca, c, luts[key], compute_np))
            else:
                arr = dense[key]
                if c["kind"] == "f16":
                    arr = arr.view(np.float16).astype(compute_np, copy=False)
                env[cname] = _named_constant(np, arr.reshape(c["shape"]), cname)

        def arg(a):
            kind, value = a["kind"], a.get("value")
            if kind == "var":
                return env[value]
            if kind == "vars":
                return [env[v] for v in value]
            if kind == "float":
                return float(value)
            if kind in ("int", "bool"):
                return value
            if kind == "ints":
                return list(value)
            raise ValueError(f"unknown argument kind {kind!r}")

        for op in desc["ops"]:
            res = ops.call(op["op"], {k: arg(v) for k, v in op["args"].items()})
            outs = op["outputs"]
            if len(outs) == 1:
                env[outs[0]] = rounded(res)
            else:
                if len(res) != len(outs):
                    raise ValueError(f"op {op['op']} gave {len(res)} outputs, graph expects {len(outs)}")
                for n, r in zip(outs, res):
                    env[n] = rounded(r)
        results = [env[o] for o in desc["outputs"]]
        if rounding:
            results = [ca.cast(r, np.float16) if is_f32(r) else r for r in results]
        return tuple(results)

    graph(_make_function(name, input_specs, output_specs, body))
    return len(desc["ops"])


def emit(desc_json, dense, luts, meta_json, out_dir):
    """Build and save the program as `out_dir/model.aimodel`.

    desc_json: the graph description (ops, inputs, consts, outputs, output_specs) as JSON, or
    one with `functions` (each {"name", "graph"}) for a multifunction asset.
    dense: const name -> numpy array (fp16 data travels as uint16 bits, int32 as int32).
    luts: const name -> (indices, uint16 LUT bits, uint16 per-row scale bits or None); the
    indices packed LSB-first, the bit stream a uintN constant holds.
    meta_json: {"user_defined": {...}} stored in the asset's metadata.json.
    Returns the coreai version, the ops in the saved program by type, and the path.
    """
    desc = json.loads(desc_json)
    meta = json.loads(meta_json)
    _NAMED.clear()
    with quiet() as captured:
        try:
            from pathlib import Path
            from coreai import _version
            from coreai.authoring import AIProgram, Module

            m = Module.create()
            with m:
                functions = desc["functions"] if "functions" in desc else [{"name": "main", "graph": desc}]
                for f in functions:
                    _function(f["name"], f["graph"], dense, luts)
            dense.clear()
            luts.clear()
            _NAMED.clear()
            counts = _op_counts(m)
            path = os.path.join(out_dir, "model.aimodel")
            AIProgram(m).save_asset(Path(path))
            _write_metadata(path, meta)
            return {"coreai_version": _version.__version__, "op_counts": counts, "path": path}
        except BaseException as e:
            log = captured()
            if log.strip():
                tail = "\n".join(log.strip().splitlines()[-20:])
                raise RuntimeError(f"{type(e).__name__}: {e}\n--- coreai output ---\n{tail}") from e
            raise


def _op_counts(module):
    """The Core AI ops in the program, by name (constants included)."""
    counts = {}
    raw = getattr(module, "_mlir_module", None)
    if raw is None:
        return counts

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    name = inner.operation.name
                    counts[name] = counts.get(name, 0) + 1
                    walk(inner.operation)

    walk(raw.operation)
    return counts


def _write_metadata(path, meta):
    """hf2coreml's metadata (the contract, tool, source) beside what Core AI wrote."""
    md_path = os.path.join(path, "metadata.json")
    with open(md_path) as f:
        md = json.load(f)
    md.setdefault("userDefined", {}).update(meta.get("user_defined", {}))
    # Core AI stamps the second it saved (`20261207T044838Z`); the day alone, as coremltools
    # records a package's conversion date, keeps two saves of one program the same bytes.
    stamp = md.get("creationDate")
    if isinstance(stamp, str) and len(stamp) == 16 and stamp[8] == "T" and stamp.endswith("Z"):
        md["creationDate"] = stamp[:8] + "T000000Z"
    with open(md_path, "w") as f:
        json.dump(md, f, indent=2, sort_keys=True)
        f.write("\n")


class Session:
    """One loaded `.aimodel` for the length of a command: the executable stays open and each
    `call` runs one function on numpy inputs."""

    def __init__(self, path):
        with quiet():
            from coreai.authoring import AIModelAsset

            self._loop = asyncio.new_event_loop()
            self._asset = AIModelAsset.load(path)
            self._ctx = self._asset.executable()
            self._model = self._loop.run_until_complete(self._ctx.__aenter__())
            self._functions = {}

    def function_names(self):
        return list(self._model.function_names)

    def describe(self, name):
        """Function `name`'s inputs (name, shape, dtype), outputs and states."""
        d = self._function(name).desc
        return {
            "inputs": [
                {"name": n, "shape": list(d.input_descriptor(n).shape), "dtype": str(d.input_descriptor(n).dtype)}
                for n in d.input_names
            ],
            "outputs": list(d.output_names),
            "states": list(d.state_names),
        }

    def _function(self, name):
        if name not in self._functions:
            with quiet():
                self._functions[name] = self._model.load_function(name)
        return self._functions[name]

    def call(self, name, inputs):
        """Run function `name` on {input name: numpy array}; {output name: numpy array}."""
        from coreai.runtime import NDArray

        fn = self._function(name)
        with quiet():
            out = self._loop.run_until_complete(fn({k: NDArray(v) for k, v in inputs.items()}))
        return {k: out[k].numpy() for k in fn.desc.output_names}

    def close(self):
        if self._ctx is not None:
            with quiet():
                self._loop.run_until_complete(self._ctx.__aexit__(None, None, None))
            self._ctx = None
            self._loop.close()


def open_session(path):
    return Session(path)


# The worker: Apple's runtime runs in a child process of hf2coreml (`serve` is its main), so a
# bytecode file that makes it abort, fault or allocate without end takes only the child down.
# The parent speaks over the child's stdin and stdout, one request and one reply at a time:
# a frame is a little-endian u32 length, a JSON header of that length, then the raw bytes of
# the tensors the header lists (C order, in the listed order). Everything else the process
# writes goes to stderr, which the parent keeps in a file.

_FRAME_DTYPES = {"float16": 2, "float32": 4, "int32": 4}


def _read_exact(f, n):
    """n bytes from f, or None at a clean end of input before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            if got == 0:
                return None
            raise EOFError(f"input ended after {got} of {n} bytes")
        got += k
    return buf


def _read_frame(f, np):
    import struct

    head = _read_exact(f, 4)
    if head is None:
        return None, {}
    (n,) = struct.unpack("<I", head)
    if n > (16 << 20):
        raise ValueError(f"a request header of {n} bytes")
    req = json.loads(bytes(_read_exact(f, n)))
    arrays = {}
    for t in req.get("tensors", []):
        arr = np.empty(t["shape"], dtype=t["dtype"])
        view = memoryview(arr.reshape(-1)).cast("B")
        got = 0
        while got < arr.nbytes:
            k = f.readinto(view[got:])
            if not k:
                raise EOFError("input ended inside a tensor")
            got += k
        arrays[t["name"]] = arr
    return req, arrays


def _write_frame(f, header, arrays, np):
    import struct

    tensors = []
    blobs = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.name not in _FRAME_DTYPES:
            raise TypeError(f"output `{name}` of dtype {a.dtype.name}")
        tensors.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape)})
        blobs.append(a)
    header = dict(header, tensors=tensors)
    body = json.dumps(header).encode()
    f.write(struct.pack("<I", len(body)))
    f.write(body)
    for a in blobs:
        f.write(memoryview(a.reshape(-1)).cast("B"))
    f.flush()


def serve():
    """Answer the parent's requests (open, functions, call, close) until its end of the pipe
    closes. Ctrl-C at the terminal reaches the whole process group: the parent decides what
    it means, so the worker ignores it."""
    import signal
    import time

    import numpy as np

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    rd = os.fdopen(rfd, "rb", buffering=0)
    wr = os.fdopen(wfd, "wb", buffering=1 << 20)
    session = None
    while True:
        req, arrays = _read_frame(rd, np)
        if req is None:
            break
        op = req.get("op")
        out = {}
        try:
            if op == "open":
                session = Session(req["path"])
                reply = {}
            elif op == "functions":
                reply = {
                    "functions": [
                        dict(name=n, **session.describe(n)) for n in session.function_names()
                    ]
                }
            elif op == "call":
                started = time.perf_counter()
                out = session.call(req["function"], arrays)
                reply = {"runtime_seconds": time.perf_counter() - started}
            elif op == "close":
                if session is not None:
                    session.close()
                _write_frame(wr, {"ok": True}, {}, np)
                break
            else:
                raise ValueError(f"unknown request `{op}`")
            _write_frame(wr, dict(reply, ok=True), out, np)
        except Exception as e:  # noqa: BLE001 - every failure is the parent's to report
            _write_frame(wr, {"ok": False, "error": f"{type(e).__name__}: {e}"}, {}, np)
