#!/usr/bin/env bash
# What a `prefill` function buys in the interpreter, and what it costs on disk.
# SmolLM2-135M-Instruct (fp16 weights: no k-means in the way) converted in the same run as
#   decode.mlpackage   --target ios18 --prefill-len 0         (one function, Q = 1: the baseline)
#   prefill.mlpackage  --target ios18 --prefill-len 0 --query-len P  (the second of two packages)
#   mf.mlpackage       --target ios18 --prefill-len P         (prefill and decode in one package)
#   mfall.mlpackage    the same with --prefill-logits all     (prefill returns every row's logits)
# Prints the sizes (mf against decode alone and against decode + prefill as two packages) and
# the time to the first token (`run --json` prompt_seconds, median of REPS interleaved runs) of
# a P-token prompt and of a short one (padded to P), mf against decode-only, and mf (prefill
# returns the last row's logits, the default) against mfall (every row's).
# Usage: BIN=target/debug/hf2coreml benches/prefill.sh MODEL_DIR [OUT_DIR]
set -euo pipefail
BIN=${BIN:-target/debug/hf2coreml}
MODEL=${1:?usage: benches/prefill.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-out/prefill}
P=${P:-64}
S=${S:-256}
SHORT=${SHORT:-8}
REPS=${REPS:-3}
command -v jq >/dev/null || { echo "prefill.sh needs jq (apt install jq)" >&2; exit 3; }
mkdir -p "$OUT"
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# Given ranges (residual scale 1/8), so the three conversions measure nothing twice.
echo '{"residual_max_abs": ['"$(printf '1000,%.0s' $(seq 31))"'1000], "source": "bench"}' \
  > "$OUT/ranges.json"
conv() {
  "$BIN" convert "$MODEL" -o "$OUT/$1.mlpackage" --target ios18 --max-seq-len "$S" \
    --keep-fp16 '*' --activation-ranges "$OUT/ranges.json" --force -q "${@:2}"
}
conv decode --prefill-len 0
conv prefill --prefill-len 0 --query-len "$P"
conv mf --prefill-len "$P"
conv mfall --prefill-len "$P" --prefill-logits all
size() { du -sb "$OUT/$1.mlpackage" | cut -f1; }
wbin() { stat -c %s "$OUT/$1.mlpackage/Data/com.apple.CoreML/weights/weight.bin"; }
ids() { seq -s, 100 $((99 + $1)); }
declare -A ttft
for r in $(seq "$REPS"); do
  for pkg in decode mf mfall; do
    for n in "$P" "$SHORT"; do
      "$BIN" run "$OUT/$pkg.mlpackage" --prompt-ids "$(ids "$n")" --max-new-tokens 1 --json \
        > "$OUT/$pkg.$n.run$r.json"
    done
  done
done
for pkg in decode mf mfall; do
  for n in "$P" "$SHORT"; do
    ttft[$pkg.$n]=$(for r in $(seq "$REPS"); do
      jq '.timing.prompt_seconds' "$OUT/$pkg.$n.run$r.json"; done | median)
  done
done
calls=$(jq -r '"\(.timing.prefill_calls) prefill + \(.timing.decode_calls) decode"' "$OUT/mf.$P.run1.json")
printf 'package sizes (bytes)\n'
printf '  decode only        %12d  weight.bin %12d\n' "$(size decode)" "$(wbin decode)"
printf '  prefill only (Q=%d) %11d  weight.bin %12d\n' "$P" "$(size prefill)" "$(wbin prefill)"
printf '  prefill+decode     %12d  weight.bin %12d\n' "$(size mf)" "$(wbin mf)"
awk -v m="$(size mf)" -v d="$(size decode)" -v p="$(size prefill)" 'BEGIN {
  printf "  mf / decode-only: %.4f   mf / (decode + prefill packages): %.4f\n", m / d, m / (d + p) }'
printf 'time to first token, interpreter, median of %d (s)\n' "$REPS"
for n in "$P" "$SHORT"; do
  awk -v n="$n" -v d="${ttft[decode.$n]}" -v m="${ttft[mf.$n]}" 'BEGIN {
    printf "  %3d-token prompt: decode-only %.3f  prefill %.3f  speedup %.2fx\n", n, d, m, d / m }'
done
printf '  (mf, %d-token prompt: %s calls)\n' "$P" "$calls"
for n in "$P" "$SHORT"; do
  awk -v n="$n" -v a="${ttft[mfall.$n]}" -v m="${ttft[mf.$n]}" 'BEGIN {
    printf "  %3d-token prompt: prefill of every row %.3f  of the last row %.3f  speedup %.2fx\n", n, a, m, a / m }'
done
