#!/usr/bin/env bash
# End-to-end `convert` bench: wall time and peak RSS of converting the real model
# (SmolLM2-135M, S=512 by default) with /usr/bin/time -v. Targets: < 15 s, < 1.5 GB.
#
# usage: benches/convert.sh [MODEL_DIR] [extra convert flags...]
# env:   HF2COREML_PYTHON_ENV (the venv with coremltools), BIN (default target/release/hf2coreml)
set -euo pipefail
MODEL_DIR=${1:-${HF2COREML_MODEL_DIR:-$HOME/.cache/hf2coreml/smollm2-135m-instruct}}
shift || true
BIN=${BIN:-target/release/hf2coreml}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 3; }
[ -d "$MODEL_DIR" ] || { echo "no model at $MODEL_DIR (run make model)" >&2; exit 3; }
/usr/bin/time -v "$BIN" convert "$MODEL_DIR" -o "$OUT/model.mlpackage" --max-seq-len 512 "$@" \
    >"$OUT/stdout" 2>"$OUT/time"
cat "$OUT/stdout"
grep -E "Elapsed \(wall clock\)|Maximum resident set size" "$OUT/time"
