#!/usr/bin/env bash
# Two builds of the runner, each on the package or chain it converted, in the same run:
# `run --prompt-ids 1,2,3,4 --max-new-tokens TOKENS`, the two alternating ROUNDS times so a
# change of load hits both. Prints each run's decode speed, peak RSS and peak anonymous memory,
# the medians and the ratio B/A, and the physical bound of a decode step: the bytes of the
# weight files over the machine's read bandwidth, measured here (numpy's sum over 1 GiB, one
# thread, the best of 3).
#
# usage: benches/runner_ab.sh BIN_A PKG_A BIN_B PKG_B
#   e.g. a baseline binary on the chain it wrote against target/release/hf2coreml on its own
#   (benches/big_model.sh with KEEP=1 makes a chain; both converted from one checkpoint).
# env: TOKENS (default 16), ROUNDS (default 2), PYTHON (with numpy; default the venv `make
#      setup` builds, else python3)
set -euo pipefail
BIN_A=${1:?usage: benches/runner_ab.sh BIN_A PKG_A BIN_B PKG_B}
PKG_A=${2:?}
BIN_B=${3:?}
PKG_B=${4:?}
WORK=$(mktemp -d /tmp/runner_ab.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
source "$(dirname "$0")/lib.sh"

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
declare -A BIN PKG ALL RSS ANON
BIN[A]=$BIN_A PKG[A]=$PKG_A BIN[B]=$BIN_B PKG[B]=$PKG_B
for round in $(seq "${ROUNDS:-2}"); do
  for side in A B; do
    measure "${BIN[$side]}" run "${PKG[$side]}" --prompt-ids 1,2,3,4 \
      --max-new-tokens "${TOKENS:-16}" --ignore-eos --json
    [ "$STATUS" = 0 ] || { cat "$WORK/time" >&2; exit 1; }
    TPS=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["timing"]["decode_tokens_per_second"])' <"$WORK/stdout")
    ALL[$side]="${ALL[$side]:-} $TPS"
    RSS[$side]=$((RSS_KB / 1024)) ANON[$side]=$((PEAK_ANON / 1024))
    echo "$side round $round: wall $SECS s, decode $TPS tok/s, peak RSS ${RSS[$side]} MiB," \
      "peak anonymous ${ANON[$side]} MiB"
  done
done
for side in A B; do
  ALL[$side]=$(echo "${ALL[$side]}" | median)
  echo "$side (${BIN[$side]} on ${PKG[$side]}): median decode ${ALL[$side]} tok/s"
done
echo "B/A decode speed: $(ratio "${ALL[B]}" "${ALL[A]}")"
BYTES=$(find "$PKG_B" -name weight.bin -printf '%s\n' | awk '{s+=$1} END {printf "%.0f", s}')
VENV_PY="$(dirname "$0")/../.venv/bin/python"
[ -x "$VENV_PY" ] || VENV_PY=python3
GBS=$("${PYTHON:-$VENV_PY}" -c '
import time, numpy as np
a = np.ones(1 << 28, dtype=np.float32)
best = 0.0
for _ in range(3):
    t = time.perf_counter(); a.sum(); d = time.perf_counter() - t
    best = max(best, a.nbytes / d / 1e9)
print(f"{best:.1f}")')
echo "weights read per step: $((BYTES / 1048576)) MiB; read bandwidth ${GBS} GB/s (one thread):" \
  "bound $(awk -v g="$GBS" -v b="$BYTES" 'BEGIN { printf "%.2f", g * 1e9 / b }') tok/s"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
