"""hf2coreml's bridge to coremltools: serialize a finished graph, nothing else.

The Rust side builds the whole decoder-step graph (ops, names, weights, LUTs) and calls
`emit()` once. This module only replays the op list on coremltools' MIL builder, converts for
the target the graph names (iOS17 or iOS18) and saves. No k-means, no graph decisions happen here.

coremltools prints noise on import and during conversion (C++ messages, tqdm bars); every call
runs with file descriptors 1 and 2 pointed at a capture file so none of it reaches the user.
"""

import contextlib
import json
import os
import sys
import shutil
import tempfile
import uuid


@contextlib.contextmanager
def quiet():
    """Send fds 1/2 and sys.stdout/stderr to a temp file; yield a function returning its text."""
    sys.stdout.flush()
    sys.stderr.flush()
    capture = tempfile.TemporaryFile(mode="w+b")
    saved = [os.dup(1), os.dup(2)]
    saved_py = (sys.stdout, sys.stderr)
    text_sink = open(os.devnull, "w")
    try:
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        sys.stdout = text_sink
        sys.stderr = text_sink

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
        text_sink.close()
        capture.close()


def check_environment():
    """Import coremltools quietly; return its version. ImportError means `make setup`."""
    with quiet():
        import coremltools  # noqa: F401
        import numpy  # noqa: F401
    return coremltools.__version__


def _dtypes(np, types, float_name):
    float_np = np.float16 if float_name == "fp16" else np.float32
    float_mil = types.fp16 if float_name == "fp16" else types.fp32
    mil = {"fp16": types.fp16, "fp32": types.fp32, "int32": types.int32, "bool": types.bool}
    return float_np, float_mil, mil


def _target(ct, desc):
    """The deployment target the graph was built for: its opset and the LUT forms it uses."""
    return {"ios17": ct.target.iOS17, "ios18": ct.target.iOS18}[desc.get("target", "ios17")]


def _lut18(mb, np, types, c, arrays, float_np):
    """iOS18 constexpr_lut_to_dense: one table per run of rows (LUT [groups, 1, 2^nbits, 1]),
    indices as uintN with the weight's shape; then the per-row scale, if any, as a
    constexpr_blockwise_shift_scale of the dense weight (scale [rows, 1])."""
    indices, lut, scale = arrays
    name, shape, nbits = c["name"], list(c["shape"]), int(c["nbits"])
    rows_axes = [1] * (len(shape) - 1)
    groups = lut.size >> nbits
    lut = lut.view(np.float16).astype(float_np, copy=False)
    lut = lut.reshape([groups] + rows_axes + [1 << nbits, 1])
    uint = types.nptype_from_builtin(types.string_to_builtin(f"uint{nbits}"))
    indices = indices.reshape(shape).astype(uint)
    if scale is None:
        return mb.constexpr_lut_to_dense(indices=indices, lut=lut, name=name)
    dense = mb.constexpr_lut_to_dense(indices=indices, lut=lut, name=name + "_lut")
    scale = scale.view(np.float16).astype(float_np, copy=False).reshape([shape[0]] + rows_axes)
    return mb.constexpr_blockwise_shift_scale(data=dense, scale=scale, name=name)


def _share(var, weight_id):
    """Give the const ops behind `var` (itself, or a constexpr op's const operands) the blob
    identity `weight_id`: coremltools then writes one blob that every function's op points
    to (its `weight_id` is what `ct.utils.save_multifunction` sets on equal constants)."""
    op = var.op
    if op.op_type == "const":
        if op.weight_id is None:
            op.weight_id = weight_id
        return
    for key, operand in op.inputs.items():
        if operand.op is not None:
            _share(operand, f"{weight_id}:{key}")


def _function(desc, dense, luts, shared):
    """One MIL function from its description. Constants are read from `dense`/`luts` (not
    removed: a later function may share them); those named in `shared` get a weight_id."""
    import numpy as np
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, types

    float_np, _, mil_types = _dtypes(np, types, desc["float"])
    specs = {}
    for i in desc["inputs"]:
        dt = mil_types[i["dtype"]]
        if i["dtype"] in ("fp16", "fp32"):
            dt = mil_types[desc["float"]]
        if i.get("state"):
            # A Core ML state (iOS18, `--kv-cache state`): ct.convert lists it in the model
            # description's states, not its inputs.
            specs[i["name"]] = mb.state_tensor_placeholder(shape=tuple(i["shape"]), dtype=dt)
        else:
            specs[i["name"]] = mb.placeholder(shape=tuple(i["shape"]), dtype=dt)

    ios18 = desc.get("target") == "ios18"
    with Function(specs, opset_version=_target(ct, desc)) as func:
        env = dict(func.inputs)
        for c in desc["consts"]:
            # `key`: where the arrays are when another function has a different constant of
            # the same name.
            name, key = c["name"], c.get("key", c["name"])
            if c["kind"] == "lut" and ios18:
                env[name] = _lut18(mb, np, types, c, luts[key], float_np)
            elif c["kind"] == "lut":
                packed, lut = luts[key]
                env[name] = mb.constexpr_lut_to_dense(
                    indices=packed,
                    lut=lut.view(np.float16).astype(float_np, copy=False),
                    shape=np.array(c["shape"], dtype=np.uint32),
                    name=name,
                )
            else:
                arr = dense[key]
                if c["kind"] == "f16":
                    arr = arr.view(np.float16).astype(float_np, copy=False)
                env[name] = mb.const(val=arr.reshape(c["shape"]), name=name)
            if name in shared:
                _share(env[name], name)

        def arg(a):
            kind, value = a["kind"], a.get("value")
            if kind == "var":
                return env[value]
            if kind == "vars":
                return [env[v] for v in value]
            if kind == "float":
                return float_np(value)
            if kind == "ints":
                return np.array(value, dtype=np.int32)
            if kind == "int":
                return int(value)
            if kind == "bool":
                return bool(value)
            raise ValueError(f"unknown argument kind {kind!r}")

        # A linear without a bias is saved with an explicit zero bias; one shared constant per
        # width keeps 200-odd copies of it out of weight.bin.
        zero_bias = {}

        def shared_zero_bias(weight):
            n = weight.shape[0]
            if n not in zero_bias:
                zero_bias[n] = mb.const(val=np.zeros(n, dtype=float_np), name=f"zero_bias_{n}")
                if shared:
                    _share(zero_bias[n], f"zero_bias_{n}")
            return zero_bias[n]

        for op in desc["ops"]:
            fn = getattr(mb, op["op"])
            kwargs = {k: arg(v) for k, v in op["args"].items()}
            if op["op"] == "linear" and "bias" not in kwargs:
                kwargs["bias"] = shared_zero_bias(kwargs["weight"])
            outs = op["outputs"]
            if len(outs) == 1:
                env[outs[0]] = fn(name=outs[0], **kwargs)
            else:
                # Multi-output ops name their outputs `<name>_0`, `<name>_1`, ... after the op.
                res = fn(name=outs[0] + "_op", **kwargs)
                if len(res) != len(outs):
                    raise ValueError(
                        f"op {op['op']} returned {len(res)} outputs, graph expects {len(outs)}"
                    )
                for n, r in zip(outs, res):
                    env[n] = r
        func.set_outputs([env[o] for o in desc["outputs"]])
    return func


def _build(desc, dense, luts):
    """The program: one function `main`, or (a description with `functions`) one function per
    entry, constants marked `shared` stored once for all of them (iOS18 multifunction)."""
    from coremltools.converters.mil.mil import Program

    prog = Program()
    if "functions" not in desc:
        prog.add_function("main", _function(desc, dense, luts, set()))
        dense.clear()
        luts.clear()
        return prog
    shared = {c["name"] for f in desc["functions"] for c in f["graph"]["consts"] if c.get("shared")}
    for f in desc["functions"]:
        # A shared constant is handed over once, with the first function's constants.
        prog.add_function(f["name"], _function(f["graph"], dense, luts, shared))
    dense.clear()
    luts.clear()
    prog.default_function_name = desc["default_function"]
    prog.export_as_multifunction = True
    return prog


def emit(desc_json, dense, luts, meta_json, precision, out_dir):
    """Build, convert and save the package into `out_dir/model.mlpackage`.

    desc_json: the graph description (ops, inputs, consts, outputs) as JSON.
    dense: const name -> numpy array (fp16 data travels as uint16 bits, int32 as int32).
    luts: const name -> (packed uint8 indices, uint16 LUT bits).
    meta_json: {"author", "short_description", "version", "license", "user_defined": {...},
                "input_descriptions": {...}, "output_descriptions": {...}}.
    precision: "fp16" or "fp32".
    Returns the coremltools version and the ops in the saved program, by type.
    HF2COREML_BRIDGE_PROFILE=PATH writes a cProfile of the call to PATH (a developer aid).
    """
    profile_path = os.environ.get("HF2COREML_BRIDGE_PROFILE")
    if profile_path:
        # Developer aid: cProfile of the whole call, for `python -m pstats PATH`.
        import cProfile

        prof = cProfile.Profile()
        try:
            return prof.runcall(_emit, desc_json, dense, luts, meta_json, precision, out_dir)
        finally:
            prof.dump_stats(profile_path)
    return _emit(desc_json, dense, luts, meta_json, precision, out_dir)


# Any fixed namespace works: the identifiers only need to be unique within one package.
_MANIFEST_NAMESPACE = uuid.UUID("6f1c6a52-3b0e-4c1e-9a55-68663263726d")


def _make_deterministic(package):
    """Rewrite what coremltools saves nondeterministically, without changing its meaning.

    - model.mlmodel: protobuf map fields (metadata, op attributes) are written in hash order,
      which changes with Python's per-process string hash seed; re-serialize with sorted keys.
    - Manifest.json: item identifiers are random UUIDs; derive them from each item's path.
    The same inputs then give a byte-identical package (CI caches and diffs them).
    """
    from coremltools.proto import Model_pb2

    manifest_path = os.path.join(package, "Manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    renamed = {
        old: str(uuid.uuid5(_MANIFEST_NAMESPACE, info["path"])).upper()
        for old, info in manifest["itemInfoEntries"].items()
    }
    manifest["itemInfoEntries"] = {
        renamed[old]: info for old, info in sorted(manifest["itemInfoEntries"].items(), key=lambda kv: kv[1]["path"])
    }
    manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    root = manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]["path"]
    spec_path = os.path.join(package, "Data", root)
    spec = Model_pb2.Model()
    with open(spec_path, "rb") as f:
        spec.ParseFromString(f.read())
    with open(spec_path, "wb") as f:
        f.write(spec.SerializeToString(deterministic=True))
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=4)
        f.write("\n")


def _write_without_copies():
    """Make coremltools write fp16 and uint8 constants into weight.bin from a view.

    coremltools 8 writes an fp16 constant as `np.frombuffer(val.flatten().tobytes())`: two
    full copies of each tensor alive at once, 125 MiB for a 32000 x 1024 embedding, which made
    that transient the peak of a whole conversion. A C-contiguous array reshaped to 1-D is a
    view with the same bytes, so the blob writer gets identical data without the copies.
    Anything else goes through coremltools' own function.
    """
    import numpy as np
    from coremltools.converters.mil.backend.mil import helper
    from coremltools.converters.mil.mil import types

    original = getattr(helper, "_hf2coreml_original", None) or helper._get_offset_by_writing_data

    def write(output_var, blob_writer):
        val = output_var.val
        # The MIL type decides the encoding (sub-byte types hold uint8 arrays): only plain
        # fp16 and uint8 constants take the short path.
        if isinstance(val, np.ndarray) and val.flags.c_contiguous:
            if output_var.dtype == types.fp16 and val.dtype == np.float16:
                return blob_writer.write_fp16_data(val.reshape(-1).view(np.uint16))
            if output_var.dtype == types.uint8 and val.dtype == np.uint8:
                return blob_writer.write_uint8_data(val.reshape(-1))
        return original(output_var, blob_writer)

    helper._hf2coreml_original = original
    helper._get_offset_by_writing_data = write


# coremltools' own temporaries (ct.convert's /tmp/tmpXXXX.mlpackage, the size of the package)
# go in this folder inside `out_dir`, the run's hidden .partial directory: Rust removes that
# on failure and Ctrl-C, and the next run removes it after a SIGKILL (docs/safety.md).
SCRATCH_NAME = ".coremltools-tmp"


def _emit(desc_json, dense, luts, meta_json, precision, out_dir):
    scratch = os.path.join(out_dir, SCRATCH_NAME)
    os.makedirs(scratch, exist_ok=True)
    saved_tempdir = tempfile.tempdir
    tempfile.tempdir = scratch
    try:
        return _emit_in(desc_json, dense, luts, meta_json, precision, out_dir)
    finally:
        tempfile.tempdir = saved_tempdir
        shutil.rmtree(scratch, ignore_errors=True)


def _describe_features(model, meta):
    """The inputs' and outputs' descriptions; a multifunction model declares its features per
    function (ModelDescription.functions), each of which gets them."""
    functions = model._spec.description.functions
    if not functions:
        for k, v in meta["input_descriptions"].items():
            model.input_description[k] = v
        for k, v in meta["output_descriptions"].items():
            model.output_description[k] = v
        return
    for f in functions:
        for features, texts in ((f.input, meta["input_descriptions"]), (f.output, meta["output_descriptions"])):
            for feature in features:
                if feature.name in texts:
                    feature.shortDescription = texts[feature.name]


def _emit_in(desc_json, dense, luts, meta_json, precision, out_dir):
    desc = json.loads(desc_json)
    meta = json.loads(meta_json)
    with quiet() as captured:
        try:
            import coremltools as ct

            _write_without_copies()
            prog = _build(desc, dense, luts)
            model = ct.convert(
                prog,
                convert_to="mlprogram",
                minimum_deployment_target=_target(ct, desc),
                compute_precision=(
                    ct.precision.FLOAT16 if precision == "fp16" else ct.precision.FLOAT32
                ),
                skip_model_load=True,
                # The graph arrives in its final form (linear, fused scales, fp16 throughout), so
                # coremltools' DEFAULT optimisation passes find nothing to improve on it and cost
                # ~16 s on SmolLM2 (most of it re-validating the program after each of ~100
                # passes). Only the backend passes run: silu fusion, const folding and
                # deduplication, name sanitizing.
                pass_pipeline=ct.PassPipeline.EMPTY,
            )
            model.author = meta["author"]
            model.short_description = meta["short_description"]
            model.version = meta["version"]
            model.license = meta.get("license", "")
            for k, v in meta["user_defined"].items():
                model.user_defined_metadata[k] = v
            _describe_features(model, meta)
            path = os.path.join(out_dir, "model.mlpackage")
            model.save(path)
            _make_deterministic(path)
            counts = {}
            for func in model._mil_program.functions.values():
                for op in func.operations:
                    counts[op.op_type] = counts.get(op.op_type, 0) + 1
            spec_version = model.get_spec().specificationVersion
            # ct.convert leaves its package in a temp dir that coremltools only removes when
            # the MLModel is garbage-collected at interpreter exit, which an embedded
            # interpreter may never reach: remove it now that the package is saved.
            if getattr(model, "is_temp_package", False) and os.path.isdir(model.package_path):
                shutil.rmtree(model.package_path, ignore_errors=True)
            return {
                "coremltools_version": ct.__version__,
                "op_counts": counts,
                "specification_version": spec_version,
                "path": path,
            }
        except BaseException as e:
            log = captured()
            if log.strip():
                tail = "\n".join(log.strip().splitlines()[-20:])
                raise RuntimeError(f"{type(e).__name__}: {e}\n--- coremltools output ---\n{tail}") from e
            raise
