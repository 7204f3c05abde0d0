#!/usr/bin/env bash
# `make quality`: the quality table of docs/recipes.md for a checkpoint (SmolLM2-135M-Instruct by
# default).
# Each row converts a real package with one recipe (timed), then `validate`s it against the
# checkpoint's float reference on the shipped evaluation text: package size, bits per weight
# of the palettized projections, perplexity, mean KL(ref‖pkg), top-1 agreement, convert time.
# Usage: BIN=target/release/hf2coreml benches/quality.sh MODEL_DIR [OUT_DIR]
# ROWS_ONLY="7 10" runs only those rows (1-based, in the order below) and appends them to the table.
set -euo pipefail
BIN=${BIN:-target/release/hf2coreml}
MODEL=${1:?usage: benches/quality.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-out/quality}
TOKENS=${TOKENS:-512}   # evaluation tokens per package
S=${S:-512}
command -v jq >/dev/null || { echo "quality.sh needs jq (apt install jq)" >&2; exit 3; }
mkdir -p "$OUT"

# Variants of the calibrated recipe, one method switched at a time (the older rows without
# the input rotation, as they were measured).
variant() { # name, sed expression on calibrated-4bit.toml
  sed -e "$2" configs/recipes/calibrated-4bit.toml > "$OUT/$1.toml"
}
NOROT='s/^rotate = true/rotate = false/'
variant rs-only "$NOROT; s/^weighted = true/weighted = false/; s/^gptq = true/gptq = false/"
variant rs-weighted "$NOROT; s/^gptq = true/gptq = false/"
variant gptq "$NOROT"
variant awq "$NOROT; s/^awq = false/awq = true/"
variant groups4 "$NOROT; s/^row_groups = 1/row_groups = 4/"
variant rows32 's/^row_groups = 1 .*/row_groups = 1\nallocation_rows = 32/'

ROWS=(
  "fp16 (no palettization)|--keep-fp16 *"
  "8-bit, data-free|--recipe data-free-4bit --nbits 8"
  "6-bit, data-free|--recipe data-free-4bit --nbits 6"
  "4-bit, data-free (textbook iOS17)|--recipe data-free-4bit"
  "4-bit, row scales|--recipe $OUT/rs-only.toml"
  "4-bit, row scales + E[x²]-weighted LUT|--recipe $OUT/rs-weighted.toml"
  "4-bit, calibrated (+ GPTQ, act order)|--recipe $OUT/gptq.toml"
  "4-bit, calibrated + AWQ scales|--recipe $OUT/awq.toml"
  "4-bit, calibrated, 4 LUTs per projection|--recipe $OUT/groups4.toml"
  "mixed 4/6/8, --target-bpw 4.5|--recipe $OUT/gptq.toml --target-bpw 4.5"
  "mixed 4/6/8, --target-bpw 5|--recipe $OUT/gptq.toml --target-bpw 5"
  "4-bit, calibrated + rotated inputs (calibrated-4bit)|--recipe calibrated-4bit"
  "mixed 4/6/8 + rotated inputs, --target-bpw 4.5|--recipe calibrated-4bit --target-bpw 4.5"
  "6-bit, calibrated on 2,048 tokens (the default recipe)|--recipe default"
  "mixed 4/6/8 by 32-row chunks + rotated inputs, --target-bpw 4.5|--recipe $OUT/rows32.toml --target-bpw 4.5"
)

TABLE="$OUT/quality.md"
ONLY=${ROWS_ONLY:-}
if [ -z "$ONLY" ] || [ ! -f "$TABLE" ]; then
  {
    echo "| recipe | package | bits/weight (projections) | perplexity | mean KL | top-1 | convert |"
    echo "|---|---|---|---|---|---|---|"
  } > "$TABLE"
fi
i=0
for row in "${ROWS[@]}"; do
  i=$((i + 1))
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $i "* ]]; then continue; fi
  name=${row%%|*}
  read -r -a flags <<< "${row#*|}"
  pkg="$OUT/q$i.mlpackage"
  echo "== [$i/${#ROWS[@]}] $name" >&2
  start=$(date +%s)
  "$BIN" convert "$MODEL" -o "$pkg" --max-seq-len "$S" --force --json "${flags[@]}" > "$OUT/q$i.convert.json"
  secs=$(( $(date +%s) - start ))
  # validate exits 1 when a gate fails: the table reports the numbers either way.
  "$BIN" validate "$pkg" --against "$MODEL" --max-tokens "$TOKENS" --json > "$OUT/q$i.validate.json" || true
  size=$(jq -r '.package_bytes / 1048576 | . * 10 | round / 10' "$OUT/q$i.convert.json")
  bpw=$(jq -r '[.palettize.tensors[]? | select(.nbits != null)] as $p
    | if ($p | length) == 0 then "16 (fp16)"
      else (($p | map(.bytes_after) | add) * 8 / ($p | map(.shape | reduce .[] as $d (1; . * $d)) | add)
            | . * 100 | round / 100 | tostring) end' "$OUT/q$i.convert.json")
  ppl=$(jq -r '.behaviour.ppl_package | . * 100 | round / 100' "$OUT/q$i.validate.json")
  pplr=$(jq -r '.behaviour.ppl_reference | . * 100 | round / 100' "$OUT/q$i.validate.json")
  kl=$(jq -r '.behaviour.kl_mean | . * 1000 | round / 1000' "$OUT/q$i.validate.json")
  top1=$(jq -r '.behaviour.top1 | . * 1000 | round / 1000' "$OUT/q$i.validate.json")
  printf '| %s | %s MiB | %s | %s (ref %s) | %s | %s | %s s |\n' \
    "$name" "$size" "$bpw" "$ppl" "$pplr" "$kl" "$top1" "$secs" | tee -a "$TABLE"
  # The package and what convert writes beside it (tokenizer files, report).
  rm -rf "$pkg" "$OUT/q$i".tokenizer*.json "$OUT/q$i".report.json
done
echo "wrote $TABLE" >&2
