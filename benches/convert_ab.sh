#!/usr/bin/env bash
# Two builds converting one checkpoint with one recipe, in the same run: `convert CKPT -o OUT
# --max-seq-len S -q [ARGS...]`, the two alternating ROUNDS times so a change of load hits
# both. Prints each run's wall time, peak RSS and peak anonymous memory, the medians and the
# ratio A/B of the wall times (above 1: B is faster). The packages are written to a scratch
# directory and removed.
#
# usage: benches/convert_ab.sh BIN_A BIN_B CKPT [ARGS...]
#   e.g. a baseline binary against target/release/hf2coreml on the 1B preset with the
#   default recipe (calibrated): benches/convert_ab.sh OLD target/release/hf2coreml CKPT
# env: S (default 2048), ROUNDS (default 1), SCRATCH (default a temporary directory)
set -euo pipefail
BIN_A=${1:?usage: benches/convert_ab.sh BIN_A BIN_B CKPT [ARGS...]}
BIN_B=${2:?}
CKPT=${3:?}
shift 3
WORK=$(mktemp -d "${SCRATCH:-/tmp}/convert_ab.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
source "$(dirname "$0")/lib.sh"

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
declare -A BIN ALL
BIN[A]=$BIN_A BIN[B]=$BIN_B
for round in $(seq "${ROUNDS:-1}"); do
  for side in A B; do
    # A fresh directory a run: the package's sidecars (report, tokenizer) go beside it.
    rm -rf "$WORK/run" && mkdir "$WORK/run"
    measure "${BIN[$side]}" convert "$CKPT" -o "$WORK/run/out.mlpackage" \
      --max-seq-len "${S:-2048}" -q "$@"
    [ "$STATUS" = 0 ] || { cat "$WORK/time" >&2; exit 1; }
    ALL[$side]="${ALL[$side]:-} $SECS"
    echo "$side round $round: wall $WALL ($SECS s), peak RSS $((RSS_KB / 1024)) MiB," \
      "peak anonymous $((PEAK_ANON / 1024)) MiB"
  done
done
for side in A B; do
  ALL[$side]=$(echo "${ALL[$side]}" | median)
  echo "$side (${BIN[$side]}): median wall ${ALL[$side]} s"
done
echo "A/B wall time: $(ratio "${ALL[A]}" "${ALL[B]}")"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
