#!/usr/bin/env bash
# The runner at size: `run` (and `validate --max-tokens 8`) on a converted
# package or chain, once with the weights read in place from the memory-mapped weight files
# (the default) and once with --dense-weights (every weight decoded when the package loads:
# the interpreter before packed weights), in the same run, under the same load. Prints wall
# time, decode speed, peak RSS and peak anonymous memory of each and the ratios, and checks
# that both wrote the same logits, byte for byte. With CHECKPOINT, `validate` the same way,
# its float reference once whole and once block by block.
#
# usage: benches/runner_memory.sh PACKAGE [CHECKPOINT]
#   PACKAGE: a package or chain (e.g. made by benches/big_model.sh with KEEP=1, or
#            `hf2coreml convert CKPT -o OUT --recipe data-free-4bit --max-seq-len 2048`)
#   CHECKPOINT: the checkpoint it came from; when given, validate is measured too, with its
#               float reference of the whole model in f32 and block by block (the default).
# env: BIN (default target/release/hf2coreml), TOKENS (new tokens to generate, default 4),
#      VTOKENS (validate's --max-tokens, default 8), RUN=0 to measure validate only,
#      ROUNDS (runs of each mode, alternating; default 1)
set -euo pipefail
PKG=${1:?usage: benches/runner_memory.sh PACKAGE [CHECKPOINT]}
CKPT=${2:-}
BIN=${BIN:-target/release/hf2coreml}
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 3; }
WORK=$(mktemp -d /tmp/runner_memory.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

source "$(dirname "$0")/lib.sh"

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
echo "weights on disk: $(( $(du -sbL "$PKG" | cut -f1) / 1048576 )) MiB"
declare -A WALL RSS ANON TPS ALL
# ROUNDS rounds, the two modes alternating, so a change of load on a shared machine hits both:
# the decode speed reported is each mode's median over the rounds.
if [ "${RUN:-1}" = 1 ]; then
  for round in $(seq "${ROUNDS:-1}"); do
  for mode in dense mapped; do
      flag=(); [ "$mode" = dense ] && flag=(--dense-weights)
      measure "$BIN" run "$PKG" --prompt-ids 1,2,3,4 --max-new-tokens "${TOKENS:-4}" --ignore-eos \
        --json --logits-out "$WORK/logits-$mode.npy" "${flag[@]}"
    [ "$STATUS" = 0 ] || { cat "$WORK/time" >&2; exit 1; }
      WALL[$mode]=$SECS RSS[$mode]=$((RSS_KB / 1024)) ANON[$mode]=$((PEAK_ANON / 1024))
      TPS[$mode]=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["timing"]["decode_tokens_per_second"])' <"$WORK/stdout")
      ALL[$mode]="${ALL[$mode]:-} ${TPS[$mode]}"
      echo "run ($mode, round $round): wall ${WALL[$mode]} s, decode ${TPS[$mode]} tok/s," \
        "peak RSS ${RSS[$mode]} MiB, peak anonymous ${ANON[$mode]} MiB"
    done
  done
  for mode in dense mapped; do
    TPS[$mode]=$(echo "${ALL[$mode]}" | median)
    echo "run ($mode): median decode ${TPS[$mode]} tok/s over ${ROUNDS:-1} round(s)"
  done
  cmp -s "$WORK/logits-dense.npy" "$WORK/logits-mapped.npy" \
    && echo "logits: identical, byte for byte ($(stat -c %s "$WORK/logits-mapped.npy") bytes)" \
    || { echo "logits DIFFER between mapped and dense weights" >&2; exit 1; }
  echo "run mapped/dense: wall $(ratio "${WALL[mapped]}" "${WALL[dense]}"), decode speed" \
    "$(ratio "${TPS[mapped]}" "${TPS[dense]}"), peak RSS $(ratio "${RSS[mapped]}" "${RSS[dense]}")," \
    "peak anonymous $(ratio "${ANON[mapped]}" "${ANON[dense]}")"
fi
if [ -n "$CKPT" ]; then
  # validate (weights in place) with the float reference computed two ways: the whole model
  # loaded in f32 (`--reference-budget 1000GB`: what validate did before the block-by-block
  # reference) and the default (block by block once the f32 weights pass 2 GiB).
  for mode in whole default; do
    flag=(); [ "$mode" = whole ] && flag=(--reference-budget 1000GB)
    measure "$BIN" validate "$PKG" --against "$CKPT" --max-tokens "${VTOKENS:-8}" --json \
      "${flag[@]}" || exit 1
    WALL[$mode]=$SECS RSS[$mode]=$((RSS_KB / 1024)) ANON[$mode]=$((PEAK_ANON / 1024))
    REF=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["reference"])' <"$WORK/stdout")
    echo "validate --max-tokens ${VTOKENS:-8} ($mode: $REF): wall ${WALL[$mode]} s," \
      "peak RSS ${RSS[$mode]} MiB, peak anonymous ${ANON[$mode]} MiB"
  done
  echo "validate default/whole reference: wall $(ratio "${WALL[default]}" "${WALL[whole]}")," \
    "peak RSS $(ratio "${RSS[default]}" "${RSS[whole]}"), peak anonymous" \
    "$(ratio "${ANON[default]}" "${ANON[whole]}")"
fi
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
