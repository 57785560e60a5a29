#!/usr/bin/env bash
# The router's /metrics through a real Prometheus (Debian's `prometheus`,
# installed by deploy/setup.sh): deploy/local.sh starts a cluster and prints
# its metrics line, Prometheus scrapes it every second, tandem-client sends
# requests, and Prometheus' HTTP API must give back the TTFT histogram's
# count (the requests sent) and the decode worker's KV gauges (as /metrics
# shows them). A missing prometheus fails the test: it is never skipped.
#   tests/integration/test_prometheus.sh BIN_DIR WORK_DIR
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
test_dirs "$1" "$2"
n=5

command -v prometheus >/dev/null || { echo "FAIL prometheus is not installed (deploy/setup.sh installs it)" >&2; exit 1; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

# ---- a cluster through local.sh: "router EP" and "metrics URL" come out
rm -rf "$work/cluster"
rm -f "$work/cluster.out" "$work/cluster.err"
"$root/deploy/local.sh" --run-dir "$work/cluster" --encoders 1 --prefills 0 --no-gateway \
  >"$work/cluster.out" 2>"$work/cluster.err" &
pids+=($!)
for _ in $(seq 600); do
  grep -q '^metrics ' "$work/cluster.out" 2>/dev/null && break
  kill -0 "${pids[-1]}" 2>/dev/null || break
  sleep 0.1
done
router=$(awk '/^router /{print $2}' "$work/cluster.out")
metrics=$(awk '/^metrics /{print $2}' "$work/cluster.out")
if [[ -z $router || ! $metrics =~ ^http://127\.0\.0\.1:[0-9]+/metrics$ ]]; then
  echo "FAIL the cluster did not start or printed no metrics line" >&2
  cat "$work/cluster.out" "$work/cluster.err" >&2
  exit 1
fi
echo "router $router, metrics $metrics"
target=${metrics#http://}
target=${target%/metrics}

# ---- Prometheus on a free port, scraping every second
cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: tandem
    metrics_path: /metrics
    static_configs:
      - targets: ["$target"]
EOF
prom=""
for attempt in 1 2 3 4 5; do
  port=$((20000 + RANDOM % 20000))
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && continue # taken
  rm -rf "$work/tsdb"
  prometheus --config.file "$work/prometheus.yml" --storage.tsdb.path "$work/tsdb" \
    --web.listen-address "127.0.0.1:$port" >"$work/prometheus.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1 && { prom="http://127.0.0.1:$port"; break; }
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  [[ -n $prom ]] && break
  kill -TERM "${pids[-1]}" 2>/dev/null
  unset 'pids[-1]'
done
[[ -n $prom ]] || { echo "FAIL prometheus did not start:" >&2; tail -20 "$work/prometheus.log" >&2; exit 1; }
echo "prometheus $prom"

# One instant query's value ("" when the result is empty).
query() {
  curl -s "$prom/api/v1/query" --data-urlencode "query=$1" | jq -r '.data.result[0].value[1] // empty'
}
# Waits (30 s) until the query gives want.
wait_query() { # query want: Prometheus answers it
  local got=""
  for _ in $(seq 300); do
    got=$(query "$1")
    [[ $got == "$2" ]] && return 0
    sleep 0.1
  done
  echo "  $1 = '$got', want '$2'" >&2
  return 1
}
# A sample of the router's /metrics as it is now.
direct() { curl -s "$metrics" | awk -v s="$1" 'index($0, s " ") == 1 { print $2 }'; }

check "prometheus scrapes the router" wait_query 'up{job="tandem"}' 1

# ---- requests through tandem-client
for i in $(seq $n); do echo "{\"id\": \"p$i\", \"text\": \"forty two\"}"; done >"$work/req.jsonl"
"$bin/tandem-client" --router "$router" --requests "$work/req.jsonl" --timeout-ms 60000 >"$work/results.jsonl"
check "every request answered" test "$(grep -c '"outputs"' "$work/results.jsonl")" -eq $n

check "the TTFT histogram's count through Prometheus" wait_query 'tandem:time_to_first_token_seconds_count' $n
check "the TTFT histogram's +Inf bucket through Prometheus" \
  wait_query 'tandem:time_to_first_token_seconds_bucket{le="+Inf"}' $n
check "successes by finish reason through Prometheus" wait_query 'sum(tandem:request_success_total)' $n

# the idle decode worker's KV gauges: what /metrics says once its heartbeats
# show it idle, and blocks free
for _ in $(seq 100); do
  [[ $(direct 'tandem:worker_kv_blocks_used{worker="decode-0",pool="self"}') == 0 &&
     $(direct 'tandem:worker_kv_blocks_used{worker="decode-0",pool="cross"}') == 0 ]] && break
  sleep 0.1
done
free_cross=$(direct 'tandem:worker_kv_blocks_free{worker="decode-0",pool="cross"}')
free_self=$(direct 'tandem:worker_kv_blocks_free{worker="decode-0",pool="self"}')
check "/metrics has the decode worker's free cross blocks" test "${free_cross:-0}" -gt 0
check "/metrics has the decode worker's free self blocks" test "${free_self:-0}" -gt 0
check "free cross blocks through Prometheus" \
  wait_query 'tandem:worker_kv_blocks_free{worker="decode-0",pool="cross"}' "$free_cross"
check "free self blocks through Prometheus" \
  wait_query 'tandem:worker_kv_blocks_free{worker="decode-0",pool="self"}' "$free_self"
check "used self blocks through Prometheus" wait_query 'tandem:worker_kv_blocks_used{worker="decode-0",pool="self"}' 0
check "the decode worker is up through Prometheus" wait_query 'tandem:worker_up{worker="decode-0"}' 1

# the cluster stops; the router's log (a sanitizer build's) holds no report
kill -TERM "${pids[0]}" 2>/dev/null
wait "${pids[0]}" 2>/dev/null
check "the router's log holds no sanitizer report" \
  bash -c "! grep -E 'ERROR: (Address|Leak)Sanitizer|runtime error:' '$work/cluster/router.log'"

if ((failed)); then
  echo "$failed checks failed; logs in $work" >&2
  exit 1
fi
echo "all checks passed"
