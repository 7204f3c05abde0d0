#!/usr/bin/env bash
# Two builds, the same conversions: every output compared byte for byte. For a change that
# should not change behaviour (a move, a rename, a crate cut): run it with the binary before
# and the binary after.
#
# usage: benches/same_outputs.sh OLD_BIN NEW_BIN ROOT
#   e.g. git worktree add /tmp/old REV && (cd /tmp/old && cargo build --bin hf2coreml) &&
#        cp /tmp/old/target/debug/hf2coreml /tmp/bin-old &&
#        benches/same_outputs.sh /tmp/bin-old target/debug/hf2coreml /tmp/same
# env: FIXTURES (default tests/fixtures/hf), HF2COREML_PYTHON_ENV (default ./.venv, which
#      `make setup` builds), STRICT=1 (every file with cmp, nothing filtered), ONLY=REGEX (the
#      matching cases only). Exit status: 0 when every case is identical, 1 when any differs,
#      2 on usage errors. About 2 minutes on 2 cores for the 26 cases below.
#
# It converts the tiny checkpoints transformers wrote (tests/fixtures/hf) with both binaries,
# each from its own directory with a relative output path, so the paths reports record are
# the same strings; validates some of them; and compares the file lists, modes and every file
# (the `--json` summaries, stderr and exit codes too):
#   ROOT/fixtures   a copy of the fixtures both binaries read
#   ROOT/old/CASE   OLD_BIN's outputs      ROOT/new/CASE   NEW_BIN's outputs
#   ROOT/logs/      stderr of every command
#
# Byte for byte, except what differs between two runs of one binary:
#   _convert.json             `times` (stage wall times) dropped
#   Core AI cases (.aimodel), for a binary from before the bridge named every constant's
#   storage and kept the day of `creationDate` (coreai-core names a large constant's storage
#   `resource_<random 64-bit>` and stamps the second it saved); STRICT=1 for two newer ones:
#     */metadata.json         `creationDate` dropped
#     */main.mlirb            decoded by coreai-core to MLIR text (all elements, locations
#                             included), `resource_<n>` renumbered in order of first use
#     */main.hash             not compared; checked on each side to be sha256(main.mlirb)
#     chain.json              `parts.*.bytes`, `parts.*.sha256` dropped (checked against the files)
#     model.report.json,
#     _convert.json           `package_bytes`, `weight_bin_bytes`, `bits_per_weight`,
#                             `chain.parts.*.bytes`, `chain.parts.*.sha256` dropped (each checked
#                             on each side against the files on disk)
#   model.mlmodel             byte for byte; if that fails it is compared again with its dates
#                             masked, and reported as differing only in coremltools'
#                             conversion_date (a run across midnight), not identical
# JSON files are compared as canonical JSON after the drop (python/same_outputs.py).
set -u -o pipefail

if [ $# -ne 3 ]; then
    echo "usage: $0 OLD_BIN NEW_BIN ROOT" >&2
    exit 2
fi
OLD_BIN=$(readlink -f "$1")
NEW_BIN=$(readlink -f "$2")
ROOT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
FIXTURES=${FIXTURES:-$HERE/../tests/fixtures/hf}
for b in "$OLD_BIN" "$NEW_BIN"; do
    [ -x "$b" ] || { echo "not an executable: $b" >&2; exit 2; }
done
[ -d "$FIXTURES" ] || { echo "no fixtures at $FIXTURES" >&2; exit 2; }
export HF2COREML_PYTHON_ENV=${HF2COREML_PYTHON_ENV:-$(readlink -f "$HERE/../.venv")}

mkdir -p "$ROOT"
ROOT=$(readlink -f "$ROOT")
rm -rf "$ROOT/old" "$ROOT/new" "$ROOT/fixtures" "$ROOT/logs" "$ROOT/tmp"
mkdir -p "$ROOT/old" "$ROOT/new" "$ROOT/logs" "$ROOT/tmp"
cp -a "$FIXTURES" "$ROOT/fixtures"
FX=$ROOT/fixtures

# NAME | ARCH | OUTPUT EXT | VALIDATE (v or -) | convert flags (besides --max-seq-len 64)
CASES='
qwen3_fp16            |qwen3        |mlpackage|-|--keep-fp16 *
qwen3_default         |qwen3        |mlpackage|v|
qwen3_datafree        |qwen3        |mlpackage|-|--data-free
qwen3_calib4          |qwen3        |mlpackage|-|--recipe calibrated-4bit
qwen3_ios18           |qwen3        |mlpackage|-|--target ios18
qwen3_ios18_4bit      |qwen3        |mlpackage|-|--recipe ios18-4bit
qwen3_ios18_state     |qwen3        |mlpackage|v|--target ios18 --kv-cache state
qwen3_ios18_prefill16 |qwen3        |mlpackage|-|--target ios18 --prefill-len 16 --prefill-logits all
qwen3_ane             |qwen3        |mlpackage|-|--layout ane
qwen3_chain           |qwen3        |mlpackage|v|--max-package-size 1110000
qwen3_coreai          |qwen3        |aimodel  |v|--target coreai
qwen3_coreai_chain    |qwen3        |aimodel  |-|--target coreai --max-package-size 1130000
smollm3_bpw5          |smollm3      |mlpackage|-|--target-bpw 5
smollm3_nope4_fp32    |smollm3_nope4|mlpackage|-|--compute-precision fp32 --keep-fp16 *
phi3_ane_ios18        |phi3         |mlpackage|-|--layout ane --target ios18
phi3_longrope_df4     |phi3_longrope|mlpackage|-|--data-free --nbits 4
gemma3_default        |gemma3       |mlpackage|-|
gemma3_vl_default     |gemma3_vl    |mlpackage|-|
gemma4_default        |gemma4       |mlpackage|-|
gemma4_ios18          |gemma4       |mlpackage|v|--target ios18
gemma4_kv_state       |gemma4_kv    |mlpackage|-|--target ios18 --kv-cache state
gemma4_vl_default     |gemma4_vl    |mlpackage|-|
lfm2_default          |lfm2         |mlpackage|-|
lfm2_ane              |lfm2         |mlpackage|v|--layout ane
qwen3_5_default       |qwen3_5      |mlpackage|v|
qwen3_5_coreai_prefill|qwen3_5      |aimodel  |-|--target coreai --prefill-len 8
'

trim() { local s=$1; s=${s#"${s%%[![:space:]]*}"}; s=${s%"${s##*[![:space:]]}"}; printf '%s' "$s"; }

# run SIDE BIN NAME ARCH EXT VALIDATE FLAGS...
run_case() {
    local side=$1 bin=$2 name=$3 arch=$4 ext=$5 val=$6
    shift 6
    (
        cd "$ROOT/$side" || exit 1
        mkdir -p "$name"
        "$bin" convert "$FX/$arch" -o "$name/model.$ext" --max-seq-len 64 -q --json "$@" < /dev/null \
            > "$name/_convert.json" 2> "$name/_convert.err"
        echo $? > "$name/_convert.rc"
        cp "$name/_convert.err" "$ROOT/logs/$side.$name.convert.err"
        if [ "$val" = v ]; then
            "$bin" validate "$name/model.$ext" --json -q < /dev/null \
                > "$name/_validate.json" 2> "$name/_validate.err"
            echo $? > "$name/_validate.rc"
            cp "$name/_validate.err" "$ROOT/logs/$side.$name.validate.err"
        fi
    )
}

CANON=$HERE/../python/same_outputs.py
PY=$HF2COREML_PYTHON_ENV/bin/python   # has coreai-core, for main.mlirb

AI_DROP='package_bytes weight_bin_bytes bits_per_weight chain.parts.*.bytes chain.parts.*.sha256'

# canon_cmp PYTHON KIND FILE_A FILE_B [ARGS...]: the canonical forms are equal (a helper that
# fails on either side counts as a difference, its error shown)
canon_cmp() {
    local py=$1 kind=$2 a=$3 b=$4 ca cb
    shift 4
    ca=$(mktemp "$ROOT/tmp/XXXXXX") cb=$(mktemp "$ROOT/tmp/XXXXXX")
    if ! "$py" "$CANON" "$kind" "$a" "$@" > "$ca" 2> "$ca.err" \
        || ! "$py" "$CANON" "$kind" "$b" "$@" > "$cb" 2> "$cb.err"; then
        echo "[$kind helper failed: $(tail -1 "$ca.err" "$cb.err" 2>/dev/null | tr '\n' ' ')]"
        rm -f "$ca" "$cb" "$ca.err" "$cb.err"
        return 1
    fi
    cmp -s "$ca" "$cb"
    local rc=$?
    rm -f "$ca" "$cb" "$ca.err" "$cb.err"
    return $rc
}

# compare_file REL EXT -> 0 same; 1 differs (prints why on stdout)
compare_file() {
    local f=$1 ext=$2 a=$ROOT/old/$CUR/$1 b=$ROOT/new/$CUR/$1 drops=
    if [ "${STRICT:-0}" = 1 ]; then
        cmp -s "$a" "$b" || { echo "$f"; return 1; }
        return 0
    fi
    case "$f" in
        _convert.json) drops=times; [ "$ext" = aimodel ] && drops="times $AI_DROP" ;;
        model.report.json) [ "$ext" = aimodel ] && drops=$AI_DROP ;;
        *.aimodel/metadata.json) drops=creationDate ;;
        *.aimodel/chain.json) drops='parts.*.bytes parts.*.sha256' ;;
        *.aimodel/main.hash) return 0 ;;  # checked by `consistency` on each side
        *.aimodel/main.mlirb)
            canon_cmp "$PY" mlirb "$a" "$b" || { echo "$f (MLIR text, resource names renumbered)"; return 1; }
            return 0 ;;
    esac
    if [ -n "$drops" ]; then
        # shellcheck disable=SC2086
        canon_cmp python3 json "$a" "$b" $drops || { echo "$f (JSON without: $drops)"; return 1; }
        return 0
    fi
    cmp -s "$a" "$b" && return 0
    case "$f" in
        *model.mlmodel)
            if canon_cmp python3 mask-date "$a" "$b"; then
                echo "$f (only its coremltools conversion_date: the run crossed midnight; rerun)"
                return 1
            fi ;;
    esac
    echo "$f"
    return 1
}

listing() { # DIR: one line per entry: type, mode, relative path
    (cd "$1" && find . -mindepth 1 -printf '%y %m %P\n' | LC_ALL=C sort)
}

compare_case() { # NAME EXT -> prints the verdict, returns 1 when something differs
    local name=$1 ext=$2 a=$ROOT/old/$1 b=$ROOT/new/$1 diffs=() f out side
    CUR=$name
    if ! diff -q <(listing "$a") <(listing "$b") > /dev/null; then
        diffs+=("file list or modes: $(diff <(listing "$a") <(listing "$b") | grep '^[<>]' | tr '\n' ';')")
    fi
    while IFS= read -r f; do
        [ -f "$b/$f" ] || continue
        out=$(compare_file "$f" "$ext") || diffs+=("$out")
    done < <(cd "$a" && find . -type f -printf '%P\n' | LC_ALL=C sort)
    if [ "$ext" = aimodel ] && [ "${STRICT:-0}" != 1 ]; then
        for side in old new; do
            out=$(python3 "$CANON" consistency "$ROOT/$side/$name") \
                || diffs+=("$side side inconsistent: $(echo "$out" | tr '\n' ';')")
        done
    fi
    if [ ${#diffs[@]} -eq 0 ]; then
        printf '%-24s identical (%s files)\n' "$name" "$(cd "$a" && find . -type f | wc -l)"
        return 0
    fi
    printf '%-24s DIFFERS:\n' "$name"
    printf '    %s\n' "${diffs[@]}"
    return 1
}

start=$(date +%s)
echo "old: $OLD_BIN"
echo "new: $NEW_BIN"
echo "root: $ROOT (fixtures snapshot from $FIXTURES)"
if [ "${STRICT:-0}" = 1 ]; then
    echo "STRICT=1: every file with cmp, nothing filtered"
else
    echo "filtered: _convert.json minus times; Core AI cases: metadata.json minus creationDate, main.mlirb as MLIR text with resource_<n> renumbered, main.hash checked = sha256(main.mlirb), report/summary/chain.json minus package_bytes, weight_bin_bytes, bits_per_weight, parts' bytes and sha256 (checked against the files); all else byte for byte"
fi
status=0
ncases=0
while IFS='|' read -r name arch ext val flags; do
    name=$(trim "$name")
    [ -n "$name" ] || continue
    [[ "$name" =~ ${ONLY:-.} ]] || continue
    arch=$(trim "$arch"); ext=$(trim "$ext"); val=$(trim "$val"); flags=$(trim "$flags")
    set -f  # `*` in --keep-fp16 is an argument, not a glob
    # shellcheck disable=SC2086
    run_case old "$OLD_BIN" "$name" "$arch" "$ext" "$val" $flags
    # shellcheck disable=SC2086
    run_case new "$NEW_BIN" "$name" "$arch" "$ext" "$val" $flags
    set +f
    rc=$(cat "$ROOT/old/$name/_convert.rc")
    if [ "$rc" != 0 ]; then
        # Two failures alike prove nothing: every case is one that converts.
        echo "$name: convert exited $rc with the old binary (see $ROOT/logs/old.$name.convert.err)"
        status=1
    fi
    compare_case "$name" "$ext" || status=1
    ncases=$((ncases + 1))
done <<< "$CASES"
echo "$ncases cases in $(( $(date +%s) - start )) s: $([ $status = 0 ] && echo 'ALL IDENTICAL' || echo 'SOME DIFFER')"
exit $status
