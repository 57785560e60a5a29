#!/usr/bin/env bash
# The fault suite: every fault of tandem-faults in turn, each on a fresh
# cluster of real processes under load, and the table of their outcomes.
#   tests/faults/run.sh [BIN_DIR] [FAULT...]
# BIN_DIR: where tandem-faults and the programs are (default build-rel/bin,
# else build/bin); FAULT: a subset (default: all); FAULT/fail: the router
# runs --kv-load-failure fail. Needs root for the
# network namespace of netem-decode (iproute2's ip and tc).
# Environment: REQUESTS (800), KILL_DECODE_REQUESTS (800, as Dynamo's
# pod-kill measure), RATE (80 a second), MAX_NEW (384 tokens), MIN_CORRECT
# (a fault with fewer correct, in percent, fails; default 0),
# MODEL (tests/data/toy-numbers-t5), LOAD (driver: arrivals evenly spaced by
# tandem-faults; bench-serve: bench-serve's open loop of Poisson arrivals at
# the same mean rate). Exits 1 when any fault failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=${1:-}
[[ -n $bin ]] || { [[ -x $root/build-rel/bin/tandem-faults ]] && bin=$root/build-rel/bin || bin=$root/build/bin; }
shift || true
model=${MODEL:-$root/tests/data/toy-numbers-t5}
requests=${REQUESTS:-800}
kd_requests=${KILL_DECODE_REQUESTS:-800}
rate=${RATE:-80}
min_correct=${MIN_CORRECT:-0}
max_new=${MAX_NEW:-384}
load=${LOAD:-driver}
faults=("$@")
((${#faults[@]})) || faults=(none kill-decode kill-encoder kill-prefill kill-rank kill-router
  stop-decode stop-encoder stop-prefill stop-rank stop-router hang-decode hang-encoder hang-prefill
  restart-decode restart-encoder cut-transfer cut-transfer/fail dup-worker dup-request netem-decode slow-decode)
export UCX_LOG_LEVEL=error UCX_WARN_UNUSED_ENV_VARS=n
arrivals="evenly spaced"
[[ $load == bench-serve ]] && arrivals="bench-serve's Poisson arrivals"
echo "Model $(basename "$model"), $requests requests ($kd_requests for kill-decode) at $rate a second ($arrivals), greedy," \
     "up to $max_new tokens; fault after 40 % of the arrivals; SIGSTOP / restart pauses 3 s; request deadline 30 s."
echo
echo "| fault | sent | in flight at the fault | correct | clear errors | silently wrong | lost | leaked blocks" \
     "| recovery s | in-flight ones done after s | in-flight errors after s | slowest error s | retries | notes |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
rc=0
for f in "${faults[@]}"; do
  n=$requests
  [[ $f == kill-decode ]] && n=$kd_requests
  policy=recompute
  [[ $f == */fail ]] && policy=fail
  f=${f%/fail}
  row=$("$bin/tandem-faults" --bin "$bin" --model "$model" --fault "$f" --requests "$n" --rate "$rate" \
        --kv-load-failure "$policy" --load "$load" \
        --max-new "$max_new" --min-correct "$min_correct" 2>"/tmp/tandem-faults-$f.err")
  st=$?
  if ((st == 3)); then  # the kernel lacks the qdisc: said, not failed
    echo "| $f | not run: $(tail -1 "/tmp/tandem-faults-$f.err" | sed 's/^tandem-faults: //') |"
    continue
  fi
  if [[ -z $row ]]; then row="| $f | (no result: status $st) |"; fi
  ((st == 0)) || sed 's/^/    /' "/tmp/tandem-faults-$f.err" >&2
  echo "$row"
  ((st == 0)) || rc=1
done
exit $rc
