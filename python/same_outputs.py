"""Helpers for benches/same_outputs.sh, a development tool: canonical forms of the few output
files that vary run to run with the same binary, and consistency checks that stand in for the
fields dropped.

  json FILE PATH...      FILE as canonical JSON without the given paths (dot-separated keys,
                         `*` = every list element / every key), printed to stdout
  mlirb FILE             a Core AI main.mlirb decoded to MLIR text with every element printed,
                         its `resource_<n>` names renumbered in order of first appearance
                         (run with the Python environment that holds coreai-core)
  mask-date FILE         FILE's bytes with every YYYY-MM-DD date replaced (coremltools'
                         conversion_date in model.mlmodel), to stdout
  consistency CASE_DIR   for a Core AI case: every main.hash is the sha256 of its main.mlirb;
                         chain.json's sha256 and bytes of each part match the files; the
                         report's and summary's package_bytes, weight_bin_bytes and
                         bits_per_weight match the files on disk. Exit 1 with the reason.
"""

import hashlib
import json
import os
import re
import sys


def drop(x, path):
    if not path:
        return None
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        keys = list(x) if head == "*" else [head]
        for k in keys:
            if k in x:
                if rest:
                    drop(x[k], rest)
                else:
                    del x[k]
    elif isinstance(x, list) and head == "*":
        for v in x:
            drop(v, rest)


def cmd_json(path, *drops):
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw.decode("utf-8"))
    except ValueError:  # not JSON (an empty summary of a failed run): the bytes themselves
        sys.stdout.buffer.write(b"not JSON:\n" + raw)
        return
    for p in drops:
        drop(d, p.split("."))
    sys.stdout.write(json.dumps(d, indent=1) + "\n")


def cmd_mlirb(path):
    from pathlib import Path

    import coreai.authoring  # noqa: F401  (registers the dialects)
    from coreai._compiler.context import Context
    from coreai.authoring.asset import load_module_from_bytecode

    ctx = Context()._mlir_context
    module = load_module_from_bytecode(context=ctx, path=Path(path))
    text = module.operation.get_asm(large_elements_limit=None, enable_debug_info=True)
    names = {}

    def rename(m):
        return names.setdefault(m.group(0), "resource_#%d" % len(names))

    sys.stdout.write(re.sub(r"\bresource_\d+\b", rename, text))


def cmd_mask_date(path):
    with open(path, "rb") as f:
        data = f.read()
    sys.stdout.buffer.write(re.sub(rb"\d{4}-\d{2}-\d{2}", b"YYYY-MM-DD", data))


def sha256(p):
    with open(p, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def files_under(d):
    return [os.path.join(a, f) for a, _, fs in os.walk(d) for f in fs]


def cmd_consistency(case):
    errors = []
    pkgs = [os.path.join(case, p) for p in os.listdir(case) if p.endswith(".aimodel")]
    for pkg in pkgs:
        for f in files_under(pkg):
            if os.path.basename(f) == "main.mlirb":
                h = os.path.join(os.path.dirname(f), "main.hash")
                with open(h, "rb") as fh:
                    if fh.read() != hashlib.sha256(open(f, "rb").read()).digest():
                        errors.append(f"{h} is not the sha256 of main.mlirb")
        chain = None
        if os.path.exists(os.path.join(pkg, "chain.json")):
            chain = json.load(open(os.path.join(pkg, "chain.json")))
            for part in chain["parts"]:
                d = os.path.join(pkg, part["path"])
                size = sum(os.path.getsize(f) for f in files_under(d))
                if part["bytes"] != size:
                    errors.append(f"chain.json: {part['path']} bytes {part['bytes']} != {size}")
                for name, h in part["sha256"].items():
                    if sha256(os.path.join(d, name)) != h:
                        errors.append(f"chain.json: {part['path']}/{name} sha256 does not match")
        mlirb = sum(os.path.getsize(f) for f in files_under(pkg) if f.endswith("main.mlirb"))
        if chain:
            total = sum(p["bytes"] for p in chain["parts"])
        else:
            total = sum(os.path.getsize(f) for f in files_under(pkg))
        for js in ("model.report.json", "_convert.json"):
            p = os.path.join(case, js)
            if not os.path.exists(p) or os.path.getsize(p) == 0:
                continue
            r = json.load(open(p))
            if r.get("weight_bin_bytes") != mlirb:
                errors.append(f"{js}: weight_bin_bytes {r.get('weight_bin_bytes')} != {mlirb}")
            if r.get("package_bytes") != total:
                errors.append(f"{js}: package_bytes {r.get('package_bytes')} != {total}")
            bpw = mlirb * 8 / r["parameters"]
            if abs(r.get("bits_per_weight", -1) - bpw) > 1e-9 * bpw:
                errors.append(f"{js}: bits_per_weight {r.get('bits_per_weight')} != {bpw}")
            if chain and "chain" in r:
                if [(p["bytes"], p["sha256"]) for p in r["chain"]["parts"]] != [
                    (p["bytes"], p["sha256"]) for p in chain["parts"]
                ]:
                    errors.append(f"{js}: chain parts' bytes/sha256 differ from chain.json")
    for e in errors:
        print(e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    {
        "json": cmd_json,
        "mlirb": cmd_mlirb,
        "mask-date": cmd_mask_date,
        "consistency": cmd_consistency,
    }[sys.argv[1]](*sys.argv[2:])
