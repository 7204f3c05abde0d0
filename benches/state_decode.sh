#!/usr/bin/env bash
# What `--kv-cache state` saves in the interpreter: SmolLM2-135M-Instruct
# converted for iOS18 with the cache as inputs/outputs (io, the baseline) and as one state, same
# recipe, in the same run; the interpreter's decode time per step (`run --json`, greedy,
# --ignore-eos, the same prompt), median of REPS interleaved runs, at each S in SEQ_LENS. An io
# step copies both caches into the program's inputs and the update rows back into the host
# cache; a stateful step updates the state in place. Prints one row per S and mode, and the
# state/io ratio. The interpreter is a CPU reference: on a device Core ML decides (Apple measured
# 1.25 → 16.26 tok/s on an M1 Max GPU for Llama 3.1 8B; docs/targets.md, "Stateful KV cache").
# Usage: BIN=target/debug/hf2coreml benches/state_decode.sh MODEL_DIR [OUT_DIR]
set -euo pipefail
BIN=${BIN:-target/debug/hf2coreml}
MODEL=${1:?usage: benches/state_decode.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-out/state-decode}
RECIPE=${RECIPE:-data-free-4bit}
SEQ_LENS=${SEQ_LENS:-512 2048}
STEPS=${STEPS:-32}
REPS=${REPS:-3}
command -v jq >/dev/null || { echo "state_decode.sh needs jq (apt install jq)" >&2; exit 3; }
mkdir -p "$OUT"
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }
echo "| S | kv cache | interpreter ms/step (median of $REPS) |"
echo "|---|---|---|"
for s in $SEQ_LENS; do
  declare -A step=()
  for mode in io state; do
    "$BIN" convert "$MODEL" -o "$OUT/$mode-$s.mlpackage" --max-seq-len "$s" --recipe "$RECIPE" \
      --target ios18 --kv-cache "$mode" --force --json > "$OUT/$mode-$s.convert.json"
  done
  # Interleaved repetitions, so both modes see the same machine load.
  for r in $(seq "$REPS"); do
    for mode in io state; do
      "$BIN" run "$OUT/$mode-$s.mlpackage" --prompt "The three primary colors are" \
        --max-new-tokens "$STEPS" --ignore-eos --json > "$OUT/$mode-$s.run$r.json"
    done
  done
  for mode in io state; do
    step[$mode]=$(for r in $(seq "$REPS"); do
      jq '.timing.decode_seconds / .timing.decode_tokens * 1000' "$OUT/$mode-$s.run$r.json"
    done | median)
    printf '| %s | %s | %.1f |\n' "$s" "$mode" "${step[$mode]}"
  done
  printf '| %s | state / io | %s |\n' "$s" "$(ratio "${step[state]}" "${step[io]}")"
  same=$(jq -c .generated_ids "$OUT/io-$s.run1.json")
  [ "$same" = "$(jq -c .generated_ids "$OUT/state-$s.run1.json")" ] \
    && echo "S=$s greedy tokens: identical ($STEPS)" || echo "S=$s greedy tokens: DIFFER"
done
