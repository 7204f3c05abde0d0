#!/usr/bin/env bash
# One build converting one checkpoint for both targets in the same run: `convert CKPT -o
# OUT.mlpackage` (Core ML, iOS17) and `convert CKPT -o OUT.aimodel --target coreai`, with the
# same ARGS (recipe, shape), alternating ROUNDS times so a change of load hits both. Prints
# each run's wall time and peak anonymous memory, the medians and the ratio Core AI / Core ML
# of the wall times (the target: at most 1.5). The outputs go to a scratch directory and are
# removed.
#
# usage: benches/convert_targets.sh CKPT [ARGS...]
#   e.g. SmolLM2 with the default recipe:
#   benches/convert_targets.sh ~/.cache/hf2coreml/smollm2-135m-instruct
# env: BIN (default target/release/hf2coreml), S (default 512), ROUNDS (default 3),
#      SCRATCH (default a temporary directory), HF2COREML_PYTHON_ENV
set -euo pipefail
CKPT=${1:?usage: benches/convert_targets.sh CKPT [ARGS...]}
shift
BIN=${BIN:-target/release/hf2coreml}
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 3; }
WORK=$(mktemp -d "${SCRATCH:-/tmp}/convert_targets.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
source "$(dirname "$0")/lib.sh"

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
declare -A OUT FLAGS ALL
OUT[coreml]=out.mlpackage OUT[coreai]=out.aimodel
FLAGS[coreml]="" FLAGS[coreai]="--target coreai"
for round in $(seq "${ROUNDS:-3}"); do
  for side in coreml coreai; do
    # A fresh directory a run: the sidecars (report, tokenizer) go beside the output.
    rm -rf "$WORK/run" && mkdir "$WORK/run"
    # shellcheck disable=SC2086 # FLAGS holds words
    measure "$BIN" convert "$CKPT" -o "$WORK/run/${OUT[$side]}" ${FLAGS[$side]} \
      --max-seq-len "${S:-512}" -q "$@"
    [ "$STATUS" = 0 ] || { cat "$WORK/time" >&2; exit 1; }
    ALL[$side]="${ALL[$side]:-} $SECS"
    echo "$side round $round: wall $WALL ($SECS s), peak anonymous $((PEAK_ANON / 1024)) MiB," \
      "output $(du -sm "$WORK/run/${OUT[$side]}" | cut -f1) MiB"
  done
done
for side in coreml coreai; do
  ALL[$side]=$(echo "${ALL[$side]}" | median)
  echo "$side: median wall ${ALL[$side]} s"
done
echo "Core AI / Core ML wall time: $(ratio "${ALL[coreai]}" "${ALL[coreml]}") (target <= 1.5)"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
