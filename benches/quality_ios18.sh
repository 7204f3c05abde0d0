#!/usr/bin/env bash
# iOS18 grouped LUTs on a checkpoint (SmolLM2-135M-Instruct), as real packages.
# Each row converts with a variant of configs/recipes/ios18-4bit.toml (timed), then `validate`s
# the package against the checkpoint over TOKENS tokens of BOTH evaluation texts (prose:
# assets/evaluation.txt, code: assets/evaluation_code.txt). Bits per weight are over the
# palettized projections, LUTs and scales counted (the convert report's bytes_after).
# Usage: BIN=target/release/hf2coreml benches/quality_ios18.sh MODEL_DIR [OUT_DIR]
# ROWS_ONLY="5 3" runs only those rows (1-based numbers of the list below, in the order given) and
# appends them to the table.
# Run it alone, under `nice -n 10` on a shared machine: a row takes 1.5-8 minutes.
set -euo pipefail
BIN=${BIN:-target/release/hf2coreml}
MODEL=${1:?usage: benches/quality_ios18.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-out/quality_ios18}
TOKENS=${TOKENS:-512}
S=${S:-512}
command -v jq >/dev/null || { echo "quality_ios18.sh needs jq (apt install jq)" >&2; exit 3; }
mkdir -p "$OUT"

# A variant of the shipped ios18-4bit recipe: name, sed expression.
variant() {
  sed -e "$2" configs/recipes/ios18-4bit.toml > "$OUT/$1.toml"
}
# Data-free grouped LUTs: every projection role palettized with per_grouped_channel tables.
datafree() { # name, group size
  {
    echo 'target = "ios18"'
    echo 'default = "fp16"'
    echo '[roles]'
    for r in embedding lm_head norm bias; do echo "$r = \"fp16\""; done
    for r in q k v o gate up down; do
      echo "$r = { palettize = { nbits = 4, granularity = \"per_grouped_channel\", group_size = $2 } }"
    done
  } > "$OUT/$1.toml"
}
datafree df-g8 8
datafree df-g16 16
datafree df-g32 32
variant g16-2048 '$a tokens = 2048'
variant g16 ''
variant g8 "s/^group_size = 16/group_size = 8/"
variant g32 "s/^group_size = 16/group_size = 32/"
variant g16-nors "s/^row_scale = true/row_scale = false/"
variant g8-nors "s/^row_scale = true/row_scale = false/; s/^group_size = 16/group_size = 8/"
variant g32-nors "s/^row_scale = true/row_scale = false/; s/^group_size = 16/group_size = 32/"

ROWS=(
  "4-bit, data-free, LUT per 8 rows|--recipe $OUT/df-g8.toml"
  "4-bit, data-free, LUT per 16 rows|--recipe $OUT/df-g16.toml"
  "4-bit, data-free, LUT per 32 rows|--recipe $OUT/df-g32.toml"
  "4-bit, calibrated (2,048 tokens), LUT per 16 rows + row scale|--recipe $OUT/g16-2048.toml"
  "4-bit, calibrated, LUT per 16 rows + row scale|--recipe $OUT/g16.toml"
  "4-bit, calibrated, LUT per 8 rows + row scale|--recipe $OUT/g8.toml"
  "4-bit, calibrated, LUT per 32 rows + row scale|--recipe $OUT/g32.toml"
  "4-bit, calibrated, LUT per 16 rows, no row scale|--recipe $OUT/g16-nors.toml"
  "4-bit, calibrated, LUT per 8 rows, no row scale|--recipe $OUT/g8-nors.toml"
  "4-bit, calibrated, LUT per 32 rows, no row scale|--recipe $OUT/g32-nors.toml"
  "3-bit, calibrated, LUT per 16 rows + row scale|--recipe $OUT/g16.toml --nbits 3"
  "mixed 4/6/8 at 4.5 bpw, LUT per 16 rows + row scale|--recipe $OUT/g16.toml --target-bpw 4.5"
  "iOS17 baseline: 4-bit, calibrated, one LUT per tensor + row scale (calibrated-4bit)|--recipe calibrated-4bit"
  "mixed 4/6/8 at 4.3 bpw, LUT per 16 rows + row scale|--recipe $OUT/g16.toml --target-bpw 4.3"
)

TABLE="$OUT/quality.md"
ONLY=${ROWS_ONLY:-}
if [ -z "$ONLY" ] || [ ! -f "$TABLE" ]; then
  {
    echo "| row | recipe | bits/weight | text | mean KL | top-1 | top-5 | ppl ratio | convert |"
    echo "|---|---|---|---|---|---|---|---|---|"
  } > "$TABLE"
fi
r3() { jq -r "$1 | . * 1000 | round / 1000" "$2"; }
for i in ${ONLY:-$(seq ${#ROWS[@]})}; do
  row=${ROWS[$((i - 1))]}
  name=${row%%|*}
  read -r -a flags <<< "${row#*|}"
  pkg="$OUT/r$i.mlpackage"
  echo "== [$i/${#ROWS[@]}] $name" >&2
  start=$(date +%s)
  "$BIN" convert "$MODEL" -o "$pkg" --max-seq-len "$S" --force --json "${flags[@]}" > "$OUT/r$i.convert.json"
  secs=$(( $(date +%s) - start ))
  bpw=$(jq -r '[.palettize.tensors[]? | select(.nbits != null)] as $p
    | ($p | map(.bytes_after) | add) * 8 / ($p | map(.shape | reduce .[] as $d (1; . * $d)) | add)
    | . * 100 | round / 100' "$OUT/r$i.convert.json")
  for text in prose code; do
    file=assets/evaluation.txt
    [ "$text" = code ] && file=assets/evaluation_code.txt
    v="$OUT/r$i.$text.json"
    # validate exits 1 when a gate fails: the table reports the numbers either way.
    "$BIN" validate "$pkg" --against "$MODEL" --max-tokens "$TOKENS" --text "$file" --json > "$v" || true
    ppl=$(jq -r '.behaviour.ppl_package / .behaviour.ppl_reference | . * 1000 | round / 1000' "$v")
    printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s s |\n' "$i" "$name" "$bpw" "$text" \
      "$(r3 .behaviour.kl_mean "$v")" "$(r3 .behaviour.top1 "$v")" "$(r3 .behaviour.top5 "$v")" \
      "$ppl" "$secs" | tee -a "$TABLE"
  done
  rm -rf "$pkg" "$OUT/r$i".{report,tokenizer,tokenizer_config}.json
done
echo "wrote $TABLE" >&2
