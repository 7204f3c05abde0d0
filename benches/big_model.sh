#!/usr/bin/env bash
# Convert a real-shaped preset (random bf16 weights, tools/synthetic_checkpoint.rs --preset) into
# a chain of packages and measure it: wall time, peak RSS (/usr/bin/time -v) and the
# peak of anonymous memory (sampled from /proc/PID/status, as benches/peak_rss.sh does), the
# parts and their sizes, then `validate --max-tokens 8` on the chain with its peak RSS.
# The machine is shared: report the numbers with the load they were measured under
# (docs/performance.md).
#
# usage: benches/big_model.sh [PRESET] [extra convert flags...]
#   PRESET: llama-3.2-1b (default; 2.5 GB of bf16), llama-3.2-3b (6.4 GB), llama-3.1-8b,
#           qwen2.5-7b, mistral-7b (15-16 GB: check the free disk first)
# env: RECIPE (default data-free-4bit), S (default 2048), LIMIT (the package size each part is
#      checked against, default 10^9 bytes), WORK (default a temp dir under /tmp,
#      removed at exit with the checkpoint unless KEEP=1), HF2COREML_PYTHON_ENV,
#      BIN (default target/release/hf2coreml), GEN (default
#      target/release/synthetic_checkpoint), VALIDATE=0 to skip the runner.
set -euo pipefail
PRESET=${1:-llama-3.2-1b}
shift || true
BIN=${BIN:-target/release/hf2coreml}
GEN=${GEN:-target/release/synthetic_checkpoint}
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 3; }
[ -x "$GEN" ] || { echo "build first: cargo build --release -p hf2coreml-tools --bin synthetic_checkpoint" >&2; exit 3; }
WORK=${WORK:-$(mktemp -d /tmp/big_model.XXXXXX)}
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
CKPT="$WORK/$PRESET"
OUT="$WORK/$PRESET.mlpackage"
[ -f "$CKPT/config.json" ] || "$GEN" "$CKPT" --preset "$PRESET"

source "$(dirname "$0")/lib.sh"

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
measure "$BIN" convert "$CKPT" -o "$OUT" --recipe "${RECIPE:-data-free-4bit}" \
  --max-seq-len "${S:-2048}" -q "$@"
[ "$STATUS" = 0 ] || { cat "$WORK/time" >&2; exit 1; }
echo "convert $PRESET (${RECIPE:-data-free-4bit}, S=${S:-2048}): wall $WALL, peak RSS" \
  "$((RSS_KB / 1024)) MiB, peak anonymous $((PEAK_ANON / 1024)) MiB"
echo "checkpoint $(( $(du -sbL "$CKPT" | cut -f1) / 1048576 )) MiB"
if [ -f "$OUT/chain.json" ]; then
  # Each package against the package limit (LIMIT, default 10^9 bytes: pass the same value as
  # any --max-package-size given) and each weight file against the compiler's 2 GiB.
  for p in "$OUT"/part-*.mlpackage; do
    PB=$(du -sb "$p" | cut -f1)
    WB=$(stat -c %s "$p/Data/com.apple.CoreML/weights/weight.bin")
    echo "  $(basename "$p"): $PB bytes ($((PB / 1048576)) MiB), weight.bin $WB bytes" \
      "$([ "$PB" -le "${LIMIT:-1000000000}" ] && [ "$WB" -lt 2147483648 ] && echo ok || echo OVER)"
  done
else
  echo "  one package: $(( $(du -sb "$OUT" | cut -f1) / 1048576 )) MiB"
fi
if [ "${VALIDATE:-1}" = 1 ]; then
  if measure "$BIN" validate "$OUT" --against "$CKPT" --max-tokens 8 --json; then
    echo "validate --max-tokens 8: wall $WALL, peak RSS $((RSS_KB / 1024)) MiB, peak anonymous" \
      "$((PEAK_ANON / 1024)) MiB (random weights: the gates are meaningless, the mechanics not)"
  else
    echo "validate --max-tokens 8 did not finish (above)"
  fi
fi
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
