# Shared by the bench scripts: `source "$(dirname "$0")/lib.sh"`.
#
# measure CMD...: run CMD under /usr/bin/time -v (stdout in $WORK/stdout, the report in
# $WORK/time), sampling the child's anonymous memory (RssAnon in /proc/PID/status) every
# $SAMPLE seconds (default 0.1; 0 samples continuously, with builtins only, to see even a
# transient copy in a short run, at the price of one of the machine's cores). Sets STATUS (the
# exit status; 0 and 1 return normally: 1 is validate's verdict, which random weights fail
# while the run is measured all the same), PEAK_ANON and RSS_KB (KiB), WALL (as time prints it)
# and SECS (seconds). Any other status prints the time report and returns 1.
measure() {
  /usr/bin/time -v "$@" >"${WORK:?}/stdout" 2>"$WORK/time" &
  local tpid=$! pid
  sleep 0.2
  pid=$(pgrep -P "$tpid" | head -1 || true)
  PEAK_ANON=0
  while kill -0 "$tpid" 2>/dev/null; do
    { while read -r KEY VALUE _; do
      if [ "$KEY" = "RssAnon:" ]; then
        [ "$VALUE" -gt "$PEAK_ANON" ] && PEAK_ANON=$VALUE
        break
      fi
    done <"/proc/$pid/status"; } 2>/dev/null || true
    # A sampler without a pause takes one of the 2 cores from the run it measures.
    [ "${SAMPLE:-0.1}" = 0 ] || sleep "${SAMPLE:-0.1}"
  done
  STATUS=0
  wait "$tpid" || STATUS=$?
  [ "$STATUS" -le 1 ] || { cat "$WORK/time" >&2; return 1; }
  RSS_KB=$(awk -F: '/Maximum resident set size/ {gsub(/ /,"",$2); print $2}' "$WORK/time")
  WALL=$(awk '/Elapsed \(wall clock\)/ {print $NF}' "$WORK/time")
  SECS=$(awk '/Elapsed \(wall clock\)/ {n=split($NF,a,":"); s=0; for(i=1;i<=n;i++) s=s*60+a[i]; print s}' "$WORK/time")
}

# ratio A B: A / B to two decimals, "-" when B is not positive.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }

# median: the median of the numbers on stdin, one a line or separated by spaces.
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
