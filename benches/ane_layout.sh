#!/usr/bin/env bash
# What `--layout ane` costs here: SmolLM2-135M-Instruct converted in the
# default layout (the baseline) and in the ane layout in the same run, same recipe; for each:
# ops in the program, weight bytes, package bytes (lint's summary), and the interpreter's
# decode time per step (`run --json`, greedy, --ignore-eos, the same prompt), each median of
# REPS runs. Prints one row per layout and the ane/default ratios. The interpreter is a CPU
# reference: its times say what the extra ops cost here, not what either layout costs on a
# device (no Neural Engine here; docs/targets.md, "The Neural Engine layout").
# Usage: BIN=target/debug/hf2coreml benches/ane_layout.sh MODEL_DIR [OUT_DIR]
set -euo pipefail
BIN=${BIN:-target/debug/hf2coreml}
MODEL=${1:?usage: benches/ane_layout.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-out/ane-layout}
RECIPE=${RECIPE:-default}
S=${S:-256}
STEPS=${STEPS:-32}
REPS=${REPS:-3}
command -v jq >/dev/null || { echo "ane_layout.sh needs jq (apt install jq)" >&2; exit 3; }
mkdir -p "$OUT"
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
declare -A ops wbytes pbytes step
for layout in default ane; do
  pkg="$OUT/$layout.mlpackage"
  "$BIN" convert "$MODEL" -o "$pkg" --max-seq-len "$S" --recipe "$RECIPE" --layout "$layout" \
    --force --json > "$OUT/$layout.convert.json"
  # lint exits 1 on a blocking finding; the summary is wanted either way.
  "$BIN" lint "$pkg" --json > "$OUT/$layout.lint.json" || true
  ops[$layout]=$(jq '.summary.ops' "$OUT/$layout.lint.json")
  wbytes[$layout]=$(jq '.summary.weight_bytes' "$OUT/$layout.lint.json")
  pbytes[$layout]=$(jq '.summary.package_bytes' "$OUT/$layout.lint.json")
done
# Interleaved repetitions, so both layouts see the same machine load.
for r in $(seq "$REPS"); do
  for layout in default ane; do
    "$BIN" run "$OUT/$layout.mlpackage" --prompt "The Neural Engine" --max-new-tokens "$STEPS" \
      --ignore-eos --json > "$OUT/$layout.run$r.json"
  done
done
for layout in default ane; do
  step[$layout]=$(for r in $(seq "$REPS"); do
    jq '.timing.decode_seconds / .timing.decode_tokens * 1000' "$OUT/$layout.run$r.json"
  done | median)
done
echo "| layout | ops | weight bytes | package bytes | interpreter ms/step (median of $REPS) |"
echo "|---|---|---|---|---|"
for layout in default ane; do
  printf '| %s | %s | %s | %s | %.1f |\n' "$layout" "${ops[$layout]}" "${wbytes[$layout]}" \
    "${pbytes[$layout]}" "${step[$layout]}"
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }
printf '| ane / default | %s | %s | %s | %s |\n' "$(ratio "${ops[ane]}" "${ops[default]}")" \
  "$(ratio "${wbytes[ane]}" "${wbytes[default]}")" "$(ratio "${pbytes[ane]}" "${pbytes[default]}")" \
  "$(ratio "${step[ane]}" "${step[default]}")"
# Same tokens from both layouts (greedy): the layouts compute the same model.
if [ "$(jq -c .generated_ids "$OUT/default.run1.json")" = "$(jq -c .generated_ids "$OUT/ane.run1.json")" ]; then
  echo "greedy tokens: identical ($STEPS)"
else
  echo "greedy tokens: DIFFER"
fi
