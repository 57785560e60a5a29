#!/usr/bin/env bash
# A soak: a cluster of real processes (router, encoder, prefill, two decode
# workers on the toy T5) under moderate load from bench-serve for DURATION
# seconds; every SAMPLE_S seconds each process's RSS, open descriptors and KV
# blocks in use go into a CSV. At the end: first / after warm-up / last / max
# of each, and whether RSS and descriptors stayed within 5 % of their value
# after the warm-up (the first half of the run: a worker's KV pools are
# touched page by page as blocks are first used, so RSS climbs until the
# blocks in use have been everywhere), and whether every KV block came back
# once the load stopped.
#   tests/faults/soak.sh DURATION [BIN_DIR]
#   SUMMARY=FILE.csv tests/faults/soak.sh DURATION   (the table of a CSV already taken)
# Environment: RATE (requests a second, 20), SAMPLE_S (5), CSV (where the
# samples go, /tmp/tandem-soak.csv), MODEL (tests/data/toy-numbers-t5).
# Needs jq. Exits 1 when something grew past 5 % or a block stayed held.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
duration=${1:?usage: soak.sh DURATION_SECONDS [BIN_DIR]}
bin=${2:-}
[[ -n $bin ]] || { [[ -x $root/build-rel/bin/bench-serve ]] && bin=$root/build-rel/bin || bin=$root/build/bin; }
model=${MODEL:-$root/tests/data/toy-numbers-t5}
rate=${RATE:-20}
every=${SAMPLE_S:-5}
csv=${CSV:-/tmp/tandem-soak.csv}
summary() { # csv
  echo "| process | RSS MB first / after warm-up / last / max | flat | descriptors first / after warm-up / last / max | flat | KV blocks max / after the load |"
  echo "|---|---|---|---|---|---|"
  awk -F, -v warm="$(( duration / 2 ))" '
  NR == 1 { next }
  { n = $2; if (!(n in first)) { order[++k] = n; first[n] = $3; ffd[n] = $4 }
    if ($1 >= warm && !(n in w)) { w[n] = $3; wfd[n] = $4; wmax[n] = 0; wfmax[n] = 0 }
    if (n in w) { if ($3 > wmax[n]) wmax[n] = $3; if ($4 > wfmax[n]) wfmax[n] = $4 }
    if ($3 > mx[n]) mx[n] = $3; if ($4 > mfd[n]) mfd[n] = $4
    if ($5 != "" && $5 > kvmax[n]) kvmax[n] = $5; last[n] = $3; lfd[n] = $4; kvlast[n] = $5 }
  END { bad = 0
    for (i = 1; i <= k; i++) { n = order[i]
      fr = wmax[n] <= 1.05 * w[n]; ff = wfmax[n] <= (wfd[n] * 1.05 > wfd[n] + 1 ? wfd[n] * 1.05 : wfd[n] + 1)
      kv = n == "router" ? "-" : sprintf("%d / %d", kvmax[n], kvlast[n])
      if (!fr || !ff || (n != "router" && kvlast[n] != 0)) bad = 1
      printf "| %s | %.1f / %.1f / %.1f / %.1f | %s | %d / %d / %d / %d | %s | %s |\n", n, first[n] / 1024, w[n] / 1024,
             last[n] / 1024, mx[n] / 1024, fr ? "yes" : "NO", ffd[n], wfd[n], lfd[n], mfd[n], ff ? "yes" : "NO", kv }
    exit bad }' "$1"
}
if [[ -n ${SUMMARY:-} ]]; then summary "$SUMMARY"; exit; fi
command -v jq >/dev/null || { echo "soak: jq is needed (deploy/setup.sh installs it)" >&2; exit 2; }
dir=$(mktemp -d /tmp/tandem-soak-XXXXXX)
port=$(( (RANDOM % 20000) + 30000 ))
cep=tcp://127.0.0.1:$port wep=tcp://127.0.0.1:$((port + 1))
export UCX_LOG_LEVEL=error UCX_WARN_UNUSED_ENV_VARS=n OPENBLAS_NUM_THREADS=1
declare -A pid
names=(router encoder-0 prefill-0 decode-0 decode-1)
cleanup() {
  for n in "${names[@]}"; do [[ -n ${pid[$n]:-} ]] && kill "${pid[$n]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
"$bin/tandem-router" --client-endpoint "$cep" --worker-endpoint "$wep" --prefill-threshold 4 >"$dir/router.log" 2>&1 &
pid[router]=$!
worker() { # id roles
  "$bin/tandem-worker" --router "$wep" --model "$model" --role "$2" --id "$1" --block-size 4 --threads 1 \
    --max-batch 16 --max-tokens 256 >"$dir/$1.log" 2>&1 &
  pid[$1]=$!
}
worker encoder-0 encode; worker prefill-0 prefill; worker decode-0 encode,decode; worker decode-1 encode,decode
health() { "$bin/tandem-client" --router "$cep" --health --connect-timeout-ms 2000 2>/dev/null || true; }
for _ in $(seq 100); do
  [[ $(health | jq -r '"\(.encoders) \(.prefills) \(.decoders)"' 2>/dev/null) == "3 1 2" ]] && break
  sleep 0.3
done
# greedy requests over the toy vocabulary (49 ids), a third with decoder
# prompts for the prefill worker, two thirds past EOS; one id each
nreq=$(( duration * rate ))
awk -v n="$nreq" 'BEGIN { srand(11); for (i = 0; i < n; i++) {
  len = 3 + int(rand() * 10); s = ""; for (k = 0; k < len; k++) s = s (2 + int(rand() * 47)) ", ";
  p = (i % 3 == 2) ? sprintf("\"decoder_prompt\": [0, %d, %d, %d], ", 2 + i % 20, 3 + i % 17, 5 + i % 13) : "";
  m = (i % 3 == 0) ? 32 : 64 + int(rand() * 192);
  printf "{\"id\": \"s%d\", \"input_ids\": [%s1], %s\"max_new_tokens\": %d%s}\n", i, s, p, m, (i % 3) ? ", \"ignore_eos\": true" : "" } }' \
  >"$dir/requests.jsonl"
echo "time_s,process,rss_kb,fds,kv_blocks_used" >"$csv"
sample() { # t
  local h n; h=$(health)
  for n in "${names[@]}"; do
    local p=${pid[$n]} rss fds kv=""
    rss=$(awk '/^VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || echo "")
    fds=$(ls "/proc/$p/fd" 2>/dev/null | wc -l)
    [[ $n == router ]] || kv=$(jq -r --arg id "$n" '.workers[] | select(.id == $id) |
      (.self_blocks - .free_self_blocks + .cross_blocks - .free_cross_blocks)' <<<"$h" 2>/dev/null || echo "")
    echo "$1,$n,$rss,$fds,$kv" >>"$csv"
  done
}
t0=$(date +%s)
# bench-serve's --timeout-ms bounds each request and, plus a minute, the whole run
"$bin/bench-serve" --router "$cep" --workload "$dir/requests.jsonl" --requests "$nreq" --rate "$rate" \
  --model "$model" --timeout-ms $(( (duration + 60) * 1000 )) >"$dir/bench.txt" 2>"$dir/bench.err" &
bench=$!
while kill -0 "$bench" 2>/dev/null; do
  sample $(( $(date +%s) - t0 ))
  sleep "$every"
done
brc=0; wait "$bench" || brc=$?
sleep 3
sample $(( $(date +%s) - t0 ))  # after the load: every block back
echo "Soak: $duration s at $rate requests a second ($nreq requests, toy T5), a sample every $every s: $csv"
grep -E '^\|' "$dir/bench.txt" | head -3 || true
((brc == 0)) || { echo "bench-serve failed ($brc): $(tail -3 "$dir/bench.err")"; }
echo
summary "$csv"
