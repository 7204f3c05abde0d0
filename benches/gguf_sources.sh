#!/usr/bin/env bash
# What palettizing an already-quantized GGUF source costs. SmolLM2-135M ships
# only as Q4_1, so its Q4_K_M-style and Q6_K-style versions are made from it with the test
# fixtures' reference quantizers (tools/gguf_requantize.rs; llama.cpp's fallbacks apply:
# rows of 576 are not a multiple of 256, so most q4_K become q5_0 and q6_K become q8_0).
# Each source is converted straight from its .gguf with RECIPE (default: the default recipe)
# and validated against its own imported checkpoint, on assets/evaluation.txt and on a second
# text of another kind (TEXT2, default README.md: technical prose with commands); the K
# sources are also compared with the Q4_1 source (an all-fp16 package of each, validated
# against the Q4_1 import: the KL between the sources themselves).
# Usage: BIN=target/debug/hf2coreml benches/gguf_sources.sh Q4_1.gguf [OUT_DIR]
set -euo pipefail
BIN=${BIN:-target/debug/hf2coreml}
SRC=${1:?usage: benches/gguf_sources.sh Q4_1.gguf [OUT_DIR]}
OUT=${2:-out/gguf-sources}
RECIPE=${RECIPE:-default}
TOKENS=${TOKENS:-512}
TEXT2=${TEXT2:-README.md}
export HF2COREML_CACHE=${HF2COREML_CACHE:-$OUT/cache}
command -v jq >/dev/null || { echo "gguf_sources.sh needs jq (apt install jq)" >&2; exit 3; }
mkdir -p "$OUT"
cargo run --quiet -p hf2coreml-tools --bin gguf_requantize -- "$SRC" "$OUT/q4_k_m.gguf" q4_k_m
cargo run --quiet -p hf2coreml-tools --bin gguf_requantize -- "$SRC" "$OUT/q6_k.gguf" q6_k
cp "$SRC" "$OUT/q4_1.gguf"

entry() { # the cache entry a .gguf was imported into
  echo "$HF2COREML_CACHE/imported/$(sha256sum "$1" | cut -d' ' -f1)"
}
metrics() { # validate JSON → "kl top1"
  jq -r '"\(.behaviour.kl_mean | . * 1000 | round / 1000) \(.behaviour.top1 | . * 1000 | round / 1000)"' "$1"
}

echo "| source | bits/weight | KL vs Q4_1 source (eval, text 2) | $RECIPE package vs its source: KL, top-1 (eval) | (text 2) |"
echo "|---|---|---|---|---|"
for s in q4_1 q4_k_m q6_k; do
  g="$OUT/$s.gguf"
  "$BIN" convert "$g" -o "$OUT/$s.mlpackage" --max-seq-len 512 --recipe "$RECIPE" --force 2> "$OUT/$s.convert.log"
  dir=$(entry "$g")
  for t in eval text2; do
    text=assets/evaluation.txt; [ $t = text2 ] && text=$TEXT2
    "$BIN" validate "$OUT/$s.mlpackage" --against "$dir" --text "$text" --max-tokens "$TOKENS" --json > "$OUT/$s.$t.json" || true
  done
  vs="-"
  if [ $s != q4_1 ]; then
    "$BIN" convert "$g" -o "$OUT/$s.fp16.mlpackage" --max-seq-len 512 --keep-fp16 '*' --force 2> /dev/null
    for t in eval text2; do
      text=assets/evaluation.txt; [ $t = text2 ] && text=$TEXT2
      "$BIN" validate "$OUT/$s.fp16.mlpackage" --against "$(entry "$OUT/q4_1.gguf")" --text "$text" --max-tokens "$TOKENS" --json > "$OUT/$s.src.$t.json" || true
    done
    vs="$(metrics "$OUT/$s.src.eval.json" | cut -d' ' -f1), $(metrics "$OUT/$s.src.text2.json" | cut -d' ' -f1)"
  fi
  bpw=$("$BIN" inspect "$g" --json | jq -r '.gguf.bits_per_weight | . * 100 | round / 100')
  echo "| $s | $bpw | $vs | $(metrics "$OUT/$s.eval.json") | $(metrics "$OUT/$s.text2.json") |"
done
