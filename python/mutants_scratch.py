#!/usr/bin/env python3
"""Cheap mutation testing of the core files (docs/testing.md): each mutant of `cargo mutants --list`
is applied to a scratch copy of its file, compiled alone with `rustc --test` against the
dependency rlibs already in the target dir, and judged by that file's own unit tests.

A scratch crate holds the file under test, the few crate items it uses (copied from the
sources, see SCRATCH below) and nothing else, so one mutant costs seconds instead of the
crate's rebuild. It runs only the file's unit tests, so it can over-report survivors (never
under-report): confirm each survivor with `cargo mutants --in-place --file F --re FN`.

Usage: python/mutants_scratch.py [--jobs N] [--only NAME_SUBSTRING] FILE...  (FILE relative to
crates/hf2coreml, e.g. src/quant/kmeans.rs; CARGO_TARGET_DIR must hold a debug build of the crate's dependencies). Results: one line per
mutant on stdout and a JSON summary in mutants-scratch/<file stem>.json.
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# The library's package: FILE arguments and the sources copied are relative to it.
CRATE = os.path.join(ROOT, "crates", "hf2coreml")
MEMORY_LIMIT = 3 << 30
EXTERNS = ["half", "proptest", "serde", "serde_json", "thiserror", "safetensors"]


def read(rel):
    with open(os.path.join(CRATE, rel), encoding="utf-8") as f:
        return f.read()


def item(src, start):
    """The item whose first line matches regex `start`, through its matching closing brace."""
    m = re.search(start, src, re.M)
    if not m:
        sys.exit(f"scratch: `{start}` not found")
    i = src.index("{", m.start())
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            # Keep the attributes and doc comment right above the item.
            head = m.start()
            while True:
                prev = src.rfind("\n", 0, head - 1) + 1
                if head == 0 or not src[prev:head].lstrip().startswith(("///", "#[")):
                    return src[head : j + 1] + "\n"
                head = prev
    sys.exit(f"scratch: `{start}` is not closed")


def quant_error():
    """quant::QuantError without the variants that pull in the recipe and checkpoint modules."""
    err = item(read("src/quant/mod.rs"), r"^pub enum QuantError")
    err = re.sub(r"\n    #\[error\(\"\{path\}.*?\n    \},", "", err, flags=re.S)
    err = re.sub(r"\n    #\[error\(transparent\)\]\n    Checkpoint\(.*?\),", "", err)
    return (
        "use thiserror::Error;\n"
        + item(read("src/quant/weight.rs"), r"^pub fn nbits_list")
        + err
    )


def split_mix():
    util = read("src/util.rs")
    line = re.search(r"^pub struct SplitMix64.*$", util, re.M).group(0)
    return line + "\n" + item(util, r"^impl SplitMix64")


def arch():
    src = read("src/arch/mod.rs")
    parts = [
        item(src, r"^pub enum LayerTensor"),
        "impl LayerTensor {\n" + item(src, r"^    fn suffix\(self\)") + "}\n",
        item(src, r"^pub enum TensorId"),
        "impl TensorId {\n" + item(src, r"^    pub fn hf_name\(self\)") + "}\n",
    ]
    return "".join(parts)


def scratch(target):
    """{path in the scratch crate: text} for `target` (a path under src/)."""
    allow = "#![allow(dead_code, unused_imports)]\n"
    if target == "src/quant/pack.rs" or target == "src/quant/kmeans.rs":
        name = os.path.basename(target)[:-3]
        nbits = re.search(r"^pub const SUPPORTED_NBITS.*$", read("src/quant/kmeans.rs"), re.M)
        mods = f"pub mod {name};\n" + ("" if name == "kmeans" else nbits.group(0) + "\n")
        files = {
            "lib.rs": allow + "pub mod quant;\npub mod testing;\n",
            "quant/mod.rs": mods + ("use kmeans::SUPPORTED_NBITS;\n" if name == "kmeans" else "")
            + quant_error(),
            "testing.rs": split_mix(),
        }
        return files, f"quant/{name}.rs", f"quant::{name}::"
    if target == "src/validate/gates.rs":
        files = {
            "lib.rs": allow + "pub mod validate;\n",
            "validate/mod.rs": "pub mod gates;\npub mod metrics;\n",
            "validate/metrics.rs": read("src/validate/metrics.rs"),
        }
        return files, "validate/gates.rs", "validate::gates::"
    if target == "src/checkpoint/gguf/weights.rs":
        files = {
            "lib.rs": allow + "pub mod arch;\npub mod checkpoint;\n",
            "arch.rs": arch(),
            "checkpoint/mod.rs": "pub mod gguf;\n",
            "checkpoint/gguf/mod.rs": "pub mod weights;\n",
        }
        return files, "checkpoint/gguf/weights.rs", "checkpoint::gguf::weights::"
    sys.exit(f"scratch: no scratch layout for {target}")


def externs(deps):
    """--extern name=rlib for each dependency, the newest rlib when there are several."""
    out = []
    for name in EXTERNS:
        rlibs = [f for f in os.listdir(deps) if f.startswith(f"lib{name}-") and f.endswith(".rlib")]
        if not rlibs:
            sys.exit(f"scratch: no lib{name}-*.rlib in {deps}: build the crate's tests first")
        rlibs.sort(key=lambda f: os.path.getmtime(os.path.join(deps, f)))
        out += ["--extern", f"{name}={os.path.join(deps, rlibs[-1])}"]
    return out


def apply(text, m):
    """`text` with mutant m's unified diff (as `cargo mutants --list --json` gives it) applied."""
    lines = text.split("\n")
    out, at = [], 0
    body = m["diff"].split("\n")
    k = 0
    while k < len(body):
        h = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", body[k])
        k += 1
        if not h:
            continue
        start = int(h.group(1)) - 1
        out += lines[at:start]
        at = start
        while k < len(body) and not body[k].startswith("@@"):
            tag, rest = body[k][:1], body[k][1:]
            if tag in (" ", "-"):
                if lines[at] != rest:
                    sys.exit(f"{m['name']}: the diff does not match line {at + 1}")
                at += 1
            if tag in (" ", "+"):
                out.append(rest)
            k += 1
    return "\n".join(out + lines[at:])


def limit_memory():
    # A mutant that loops pushing to a Vec must not take the machine's memory with it.
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run(cmd, timeout, cwd=None):
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=limit_memory)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        return None, "timeout"


class Harness:
    def __init__(self, target, deps, opt):
        files, self.rel, self.filter = scratch(target)
        self.target = target
        self.source = read(target)
        self.files = files
        self.rustc = ["rustc", "--edition", "2021", "--test", "--crate-name", "scratch",
                      "-C", f"opt-level={opt}", "-C", "debuginfo=0",
                      # As the dev profile: overflow checks and debug_assert! on.
                      "-C", "debug-assertions=on", "--cap-lints", "allow",
                      "-L", f"dependency={deps}"] + externs(deps)

    def build(self, text, work):
        for path, body in list(self.files.items()) + [(self.rel, text)]:
            os.makedirs(os.path.dirname(os.path.join(work, path)), exist_ok=True)
            with open(os.path.join(work, path), "w", encoding="utf-8") as f:
                f.write(body)
        exe = os.path.join(work, "t")
        rc, log = run(self.rustc + [os.path.join(work, "lib.rs"), "-o", exe], 900)
        return exe if rc == 0 else None, log

    def test(self, exe, timeout):
        return run([exe, self.filter, "--test-threads", "1", "-q"], timeout)

    def judge(self, m, timeout):
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="mut-") as work:
            exe, log = self.build(apply(self.source, m), work)
            if exe is None:
                return "unviable", time.time() - t0
            rc, _ = self.test(exe, timeout)
        verdict = "timeout" if rc is None else ("missed" if rc == 0 else "caught")
        return verdict, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--opt", default="1", help="rustc opt-level for the scratch crate")
    ap.add_argument("--only", default="", help="only mutants whose name contains this")
    ap.add_argument("--rerun", default="", help="only the missed mutants of this earlier summary")
    ap.add_argument("--out", default=os.path.join(ROOT, "mutants-scratch"))
    args = ap.parse_args()
    deps = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "debug", "deps")
    os.makedirs(args.out, exist_ok=True)
    for target in args.files:
        campaign(target, deps, args)


def campaign(target, deps, args):
    h = Harness(target, deps, args.opt)
    listed = subprocess.run(["cargo", "mutants", "--list", "--json", "--file", target],
                            cwd=CRATE, capture_output=True, text=True, check=True)
    mutants = [m for m in json.loads(listed.stdout) if args.only in m["name"]]
    if args.rerun:
        with open(args.rerun) as f:
            missed = {r["name"] for r in json.load(f)["results"] if r["verdict"] == "missed"}
        mutants = [m for m in mutants if m["name"] in missed]
    with tempfile.TemporaryDirectory(prefix="mut-base-") as work:
        t0 = time.time()
        exe, log = h.build(h.source, work)
        if exe is None:
            sys.exit(f"{target}: the unmutated scratch crate does not build:\n{log}")
        rc, out = h.test(exe, 900)
        base = time.time() - t0
        passed = re.search(r"test result: ok\. (\d+) passed", out)
        if rc != 0 or not passed or passed.group(1) == "0":
            sys.exit(f"{target}: the unmutated tests fail or none ran:\n{out}")
    timeout = max(10.0, 5 * base)
    print(f"{target}: {len(mutants)} mutants, {passed.group(1)} unit tests, baseline build+test "
          f"{base:.1f} s", flush=True)
    results = []
    t0 = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        for m, (verdict, secs) in zip(mutants, pool.map(lambda m: h.judge(m, timeout), mutants)):
            print(f"{verdict:8} {secs:5.1f}s {m['name']}", flush=True)
            results.append({"name": m["name"], "function": (m.get("function") or {}).get("function_name"),
                            "verdict": verdict, "seconds": round(secs, 1)})
    counts = {v: sum(r["verdict"] == v for r in results) for v in ("caught", "missed", "timeout", "unviable")}
    wall = time.time() - t0
    summary = {"file": target, "mutants": len(results), **counts, "wall_seconds": round(wall, 1),
               "seconds_per_mutant": round(wall / max(1, len(results)), 1), "results": results}
    stem = os.path.basename(target)[:-3]
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{target}: {counts} in {wall:.0f} s ({summary['seconds_per_mutant']} s/mutant)", flush=True)


if __name__ == "__main__":
    main()
