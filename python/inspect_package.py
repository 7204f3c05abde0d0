"""Describe a saved .mlpackage as JSON, through coremltools' own loader (for tests).

Usage: python inspect_package.py X.mlpackage

Prints spec version, inputs/outputs, metadata, ops by type, and for every const or
constexpr_lut_to_dense op the raw blob bytes it references in weight.bin (read with a plain
parser of the blob format, so the test sees exactly what ships).
"""

import contextlib
import io
import json
import os
import struct
import sys


def blob(weights, offset):
    with open(weights, "rb") as f:
        f.seek(offset)
        sentinel, dtype, size, data_offset = struct.unpack("<IIQQ", f.read(24))
        if sentinel != 0xDEADBEEF:
            raise ValueError(f"no blob at offset {offset}")
        f.seek(data_offset)
        return dtype, f.read(size)


def value_bytes(value, weights):
    which = value.WhichOneof("value")
    if which == "blobFileValue":
        dtype, data = blob(weights, value.blobFileValue.offset)
        return {"blob_offset": value.blobFileValue.offset, "blob_dtype": dtype, "hex": data.hex()}
    t = value.immediateValue.tensor
    kind = t.WhichOneof("value")
    if kind == "bytes":
        return {"hex": t.bytes.values.hex()}
    return {kind: list(getattr(t, kind).values)}


def main(path):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        try:
            import coremltools as ct
            from coremltools.proto import FeatureTypes_pb2 as ft
        finally:
            os.dup2(saved, 2)
    spec = ct.utils.load_spec(path)
    weights = os.path.join(path, "Data", "com.apple.CoreML", "weights", "weight.bin")
    dtypes = {v: k for k, v in ft.ArrayFeatureType.ArrayDataType.items()}

    def feature(f):
        a = f.type.multiArrayType
        return {
            "name": f.name,
            "dtype": dtypes.get(a.dataType, str(a.dataType)),
            "shape": list(a.shape),
            "description": f.shortDescription,
        }

    fn = spec.mlProgram.functions["main"]
    block = fn.block_specializations[fn.opset]
    counts, consts, luts = {}, {}, {}
    for op in block.operations:
        counts[op.type] = counts.get(op.type, 0) + 1
        name = op.outputs[0].name
        if op.type == "const":
            v = op.attributes["val"]
            if v.WhichOneof("value") == "blobFileValue":
                consts[name] = {
                    "offset": v.blobFileValue.offset,
                    "shape": [d.constant.size for d in v.type.tensorType.dimensions],
                    "dtype": v.type.tensorType.dataType,
                }
        elif op.type == "constexpr_lut_to_dense":
            luts[name] = {
                k: value_bytes(op.attributes[k], weights) for k in ("lut", "indices", "shape")
            }
    md = spec.description.metadata
    print(
        json.dumps(
            {
                "specification_version": spec.specificationVersion,
                "opset": fn.opset,
                "inputs": [feature(f) for f in spec.description.input],
                "outputs": [feature(f) for f in spec.description.output],
                "metadata": {
                    "author": md.author,
                    "short_description": md.shortDescription,
                    "version": md.versionString,
                    "user_defined": dict(md.userDefined),
                },
                "op_counts": counts,
                "consts": consts,
                "luts": luts,
                "weight_bin_bytes": os.path.getsize(weights),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
