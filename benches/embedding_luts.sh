#!/usr/bin/env bash
# What palettizing the token embedding and lm_head costs: real packages of
# SmolLM2-135M-Instruct (tied: one table) with the default recipe, the default with the table at
# 8 and at 6 bits, calibrated-4bit, and large-model (calibrated-4bit with the table at 8 bits);
# each validated against the float model on two texts of different kinds (prose:
# assets/evaluation.txt, code: assets/evaluation_code.txt). Prints one row per package and
# text: package size, mean KL, top-1, perplexity ratio, convert time.
# Usage: BIN=target/debug/hf2coreml benches/embedding_luts.sh MODEL_DIR [OUT_DIR]
# ROWS_ONLY="2 3" runs only those rows (1-based, in the order below).
set -euo pipefail
BIN=${BIN:-target/debug/hf2coreml}
MODEL=${1:?usage: benches/embedding_luts.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-out/embedding-luts}
TOKENS=${TOKENS:-384}
S=${S:-512}
command -v jq >/dev/null || { echo "embedding_luts.sh needs jq (apt install jq)" >&2; exit 3; }
mkdir -p "$OUT"
table() { # recipe, bits: the recipe with its embedding and lm_head palettized at `bits`
  sed -e "s/^embedding = \"fp16\"/embedding = { palettize = { nbits = $2 } }/" \
      -e "s/^lm_head = \"fp16\"/lm_head = { palettize = { nbits = $2 } }/" \
      "configs/recipes/$1.toml" > "$OUT/$1-table$2.toml"
}
table default 8
table default 6
ROWS=(
  "default (embedding/lm_head fp16)|--recipe default"
  "default, embedding/lm_head 8-bit|--recipe $OUT/default-table8.toml"
  "default, embedding/lm_head 6-bit|--recipe $OUT/default-table6.toml"
  "calibrated-4bit (embedding/lm_head fp16)|--recipe calibrated-4bit"
  "large-model (calibrated-4bit, embedding/lm_head 8-bit)|--recipe configs/recipes/large-model.toml"
)
echo "| recipe | package | text | mean KL | top-1 | ppl ratio | convert |"
echo "|---|---|---|---|---|---|---|"
i=0
for row in "${ROWS[@]}"; do
  i=$((i + 1))
  if [ -n "${ROWS_ONLY:-}" ] && [[ " $ROWS_ONLY " != *" $i "* ]]; then continue; fi
  name=${row%%|*}
  read -r -a flags <<< "${row#*|}"
  pkg="$OUT/e$i.mlpackage"
  start=$(date +%s)
  "$BIN" convert "$MODEL" -o "$pkg" --max-seq-len "$S" --force --json "${flags[@]}" > "$OUT/e$i.convert.json"
  secs=$(( $(date +%s) - start ))
  size=$(jq -r '.package_bytes / 1048576 | . * 10 | round / 10' "$OUT/e$i.convert.json")
  for text in assets/evaluation.txt assets/evaluation_code.txt; do
    kind=prose; [[ $text == *code* ]] && kind=code
    # validate exits 1 when a gate fails: the table reports the numbers either way.
    "$BIN" validate "$pkg" --against "$MODEL" --text "$text" --max-tokens "$TOKENS" --json \
      > "$OUT/e$i.$kind.json" || true
    jq -r --arg n "$name" --arg s "$size MiB" --arg k "$kind" --arg t "$secs s" \
      '"| \($n) | \($s) | \($k) | \(.behaviour.kl_mean * 10000 | round / 10000) | \(.behaviour.top1 * 1000 | round / 1000) | \(.behaviour.ppl_package / .behaviour.ppl_reference * 1000 | round / 1000) | \($t) |"' \
      "$OUT/e$i.$kind.json"
  done
  rm -rf "$pkg"
done
