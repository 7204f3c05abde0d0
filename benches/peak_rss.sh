#!/usr/bin/env bash
# Peak memory of `convert` on a synthetic bf16 Llama (random weights, written once into the
# cache): peak RSS (/usr/bin/time -v), and the peak of anonymous memory alone (sampled from
# /proc/PID/status continuously), beside the package size and the largest fp16 tensor.
# The difference between the two peaks is the memory-mapped checkpoint: file pages the kernel
# can drop at any time, counted in RSS but not needed in RAM.
#
# usage: benches/peak_rss.sh [medium|large] [extra convert flags...]
#   medium: 8 layers, hidden 1024, 123M parameters, 246 MB of bf16 (about 10 s)
#   large:  16 layers, hidden 2048, 787M parameters, 1.5 GB of bf16 (about a minute; ~3 GB
#           free disk)
# env: RECIPE (default data-free-4bit), HF2COREML_PYTHON_ENV, BIN (default
#      target/release/hf2coreml), GEN (the synthetic_checkpoint example, default
#      target/release/synthetic_checkpoint)
set -euo pipefail
SIZE=${1:-medium}
shift || true
BIN=${BIN:-target/release/hf2coreml}
GEN=${GEN:-target/release/synthetic_checkpoint}
CACHE=${CACHE:-$HOME/.cache/hf2coreml}
case "$SIZE" in
  medium) DIMS="8 1024 2816 32000" ;;
  large)  DIMS="16 2048 5632 32000" ;;
  *) echo "size must be medium or large" >&2; exit 2 ;;
esac
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 3; }
[ -x "$GEN" ] || { echo "build first: cargo build --release -p hf2coreml-tools --bin synthetic_checkpoint" >&2; exit 3; }
CKPT="$CACHE/synthetic-$SIZE"
[ -f "$CKPT/config.json" ] || "$GEN" "$CKPT" $DIMS
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
WORK=$OUT
source "$(dirname "$0")/lib.sh"
# A sample every few hundred microseconds (SAMPLE=0), so a transient copy of even the largest
# tensor is seen.
SAMPLE=0 measure "$BIN" convert "$CKPT" -o "$OUT/m.mlpackage" --recipe "${RECIPE:-data-free-4bit}" \
    --max-seq-len 512 "$@"
[ "$STATUS" = 0 ] || { cat "$OUT/time" >&2; exit 1; }
cat "$OUT/stdout"
PKG=$(du -sb "$OUT/m.mlpackage" | cut -f1)
CKPT_BYTES=$(du -sbL "$CKPT" | cut -f1)
# The largest tensor is the (vocab x hidden) embedding in these models.
read -r _ HIDDEN _ VOCAB <<<"$DIMS"
LARGEST=$((VOCAB * HIDDEN * 2))
echo "checkpoint        $((CKPT_BYTES / 1048576)) MiB"
echo "package           $((PKG / 1048576)) MiB"
echo "largest fp16      $((LARGEST / 1048576)) MiB"
echo "1.5 x package + largest fp16 = $(( (PKG * 3 / 2 + LARGEST) / 1048576 )) MiB"
echo "peak RSS          $((RSS_KB / 1024)) MiB"
echo "peak anonymous    $((PEAK_ANON / 1024)) MiB"
grep -E "Elapsed \(wall clock\)" "$OUT/time"
