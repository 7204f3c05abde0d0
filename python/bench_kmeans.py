"""coremltools' k-means baseline for `make bench-palettize` (benches/palettize_vs_coremltools.rs).

Reads the tensors the Rust bench dumped (manifest.json + tensors.f16, little-endian fp16), runs
coremltools.models.neural_network.quantization_utils._get_kmeans_lookup_table_and_weight on each
one, and writes per-tensor seconds and MSEs as JSON. Only the k-means call is timed.

--dtype f16 passes the weights as float16: coremltools then uses kmeans1d (exact 1-D k-means) when
it is installed. --dtype f32 passes float32: coremltools uses scikit-learn's KMeans, its path for
every non-fp16 weight and whenever kmeans1d is missing.
"""

import argparse
import json
import os
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--nbits", type=int, default=4)
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    # coremltools prints platform noise on import; keep it off the bench's stdout.
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        from coremltools.models.neural_network import quantization_utils as qu
    finally:
        os.dup2(saved, 1)
        os.close(saved)

    with open(os.path.join(args.dir, "manifest.json")) as f:
        manifest = json.load(f)
    blob = np.fromfile(os.path.join(args.dir, "tensors.f16"), dtype="<f2")

    results = []
    total = 0.0
    for t in manifest:
        w16 = blob[t["offset"] : t["offset"] + t["numel"]].reshape(t["shape"])
        w = w16 if args.dtype == "f16" else w16.astype(np.float32)
        start = time.perf_counter()
        lut, wq = qu._get_kmeans_lookup_table_and_weight(args.nbits, w)
        seconds = time.perf_counter() - start
        total += seconds
        lut = np.asarray(lut, dtype=np.float64).reshape(-1)
        idx = np.asarray(wq).reshape(-1)
        x = w16.astype(np.float64).reshape(-1)
        mse_float = float(np.mean((x - lut[idx]) ** 2))
        # What a package would store: the LUT as fp16.
        lut16 = lut.astype(np.float16).astype(np.float64)
        mse_fp16 = float(np.mean((x - lut16[idx]) ** 2))
        results.append(
            {
                "name": t["name"],
                "seconds": seconds,
                "mse_float_lut": mse_float,
                "mse_fp16_lut": mse_fp16,
            }
        )
        print(f"  coremltools {t['name']}: {seconds:.3f} s", file=sys.stderr)

    with open(args.out, "w") as f:
        json.dump({"dtype": args.dtype, "total_seconds": total, "tensors": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
