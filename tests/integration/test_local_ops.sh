#!/usr/bin/env bash
# deploy/local.sh's operations on a running cluster: a SIGKILLed worker is
# restarted by its supervisor and registers again under its id (the router
# waits out the old connection) while requests are still served; `add decode`
# brings a worker in, `remove ID` drains one out; stopping local.sh leaves no
# process and no pid file. With --auth every process runs with keys made in
# the run directory (the gateway too): listed clients and the gateway are
# served, a client without keys is refused, `add` takes a spare key, and no
# secret is on a command line.
#   tests/integration/test_local_ops.sh BIN_DIR WORK_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=$(cd "$1" && pwd)
work=$2
rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
export TANDEM_BIN=$bin
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
run="$work/cluster"
main=""
cleanup() { [[ -n $main ]] && kill -TERM "$main" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT

"$root/deploy/local.sh" --run-dir "$run" --decodes 2 --no-gateway --no-metrics >"$work/out" 2>"$work/err" &
main=$!
wait_for 600 grep -q '^router-local ' "$work/out" 2>/dev/null
router=$(awk '/^router-local /{print $2}' "$work/out")
[[ -n $router ]] || { echo "FAIL the cluster did not start"; cat "$work/err"; exit 1; }
check "by default clients on this host are given the router's local link" test "$router" = "local:$run/router-clients.sock"
check "the router's TCP endpoint comes first" bash -c "head -1 '$work/out' | grep -qE '^router tcp://127.0.0.1:[0-9]+\$'"
# a process's command line, from the pid file local.sh keeps in its run directory
args_in() { tr '\0' ' ' <"/proc/$(cat "$1/$2.pid")/cmdline"; }
# polling before sleeping is local.sh's default only on GPU hosts with cores to spare (docs/latency.md)
if ! { command -v nvidia-smi && nvidia-smi -L; } >/dev/null 2>&1; then
  no_polling() {
    args_in "$run" router | grep -q -- "--spin-us 0 " && ! args_in "$run" decode-0 | grep -q -- "--spin-us" &&
      ! grep -q "poll" "$work/out"
  }
  check "on the CPU no loop polls by default" no_polling
fi
health() { "$bin/tandem-client" --router "$router" --health --timeout-ms 2000; }
ids() { health | jq -c '[.workers[].id] | sort'; }
registered() { health | jq -e --arg id "$1" '.workers | any(.id == $id)' >/dev/null; }
# requests of known answers (the bundled model reads number words)
words=("seven" "forty two" "three hundred five" "ninety thousand one")
digits=("7" "42" "305" "90001")
requests() { # file, count
  local i
  for ((i = 0; i < $2; i++)); do
    echo "{\"id\": \"r$i\", \"text\": \"${words[i % 4]}\"}"
  done >"$1"
}
all_right() { # output file, count
  local i ok=0 id text
  declare -A got=()
  while read -r id text; do got[$id]=$text; done < <(jq -r '"\(.id) \(.outputs[0].text // "-")"' "$1" 2>/dev/null)
  for ((i = 0; i < $2; i++)); do
    [[ ${got[r$i]:-} == "${digits[i % 4]}" ]] && ok=$((ok + 1))
  done
  ((ok == $2)) || { echo "  $ok of $2 right:"; cat "$1"; return 1; }
}

# ---- SIGKILL a decode worker while requests run
requests "$work/req.jsonl" 24
"$bin/tandem-client" --router "$router" --requests "$work/req.jsonl" --timeout-ms 60000 >"$work/kill.out" 2>&1 &
client=$!
sleep 0.3
victim=$(cat "$run/decode-0.pid")
kill -KILL "$victim"
wait "$client"
check "SIGKILL of a worker: every request answered right" all_right "$work/kill.out" 24
check "the supervisor logs the signal" wait_for 50 grep -q "decode-0: exited: killed by SIGKILL" "$run/decode-0.log"
check "a new process" wait_for 50 bash -c "[[ -f '$run/decode-0.pid' && \$(cat '$run/decode-0.pid') != $victim ]]"
check "it registers again under its id" wait_for 300 grep -q "registered with the router\|registered as" "$run/decode-0.log"
check "the router lists it" wait_for 300 registered decode-0
"$bin/tandem-client" --router "$router" --requests "$work/req.jsonl" --timeout-ms 60000 >"$work/after.out" 2>&1
check "served after the restart" all_right "$work/after.out" 24

# ---- add and remove
"$root/deploy/local.sh" add decode --run-dir "$run" >"$work/add.out" 2>&1
check "add: prints the new id" grep -qx "added decode-2" "$work/add.out"
check "add: registered" registered decode-2
"$root/deploy/local.sh" add bogus --run-dir "$run" >/dev/null 2>"$work/add-bad.err"
check "add: a bad role is refused" grep -q "ROLE must be" "$work/add-bad.err"
"$root/deploy/local.sh" remove decode-0 --run-dir "$run" >"$work/remove.out" 2>&1
check "remove: prints the id" grep -qx "removed decode-0" "$work/remove.out"
check "remove: the worker drained and exited 0" grep -q "decode-0: stopped: exit status 0" "$run/decode-0.log"
check "remove: no restart" test ! -e "$run/decode-0.supervisor.pid"
check "remove: the router no longer lists it" wait_for 100 bash -c "[[ \$(\"$bin/tandem-client\" --router $router --health | jq -c '[.workers[].id] | sort') == '[\"decode-1\",\"decode-2\",\"encoder-0\",\"prefill-0\"]' ]]"
"$root/deploy/local.sh" remove decode-0 --run-dir "$run" >/dev/null 2>"$work/remove-bad.err"
check "remove: an id not running is refused" grep -q "no worker decode-0" "$work/remove-bad.err"
"$bin/tandem-client" --router "$router" --requests "$work/req.jsonl" --timeout-ms 60000 >"$work/moved.out" 2>&1
check "served by the added worker" all_right "$work/moved.out" 24
"$root/deploy/local.sh" add encode --run-dir "$run" >"$work/add2.out" 2>&1
check "add encode: registered" grep -qx "added encoder-1" "$work/add2.out"
"$root/deploy/local.sh" remove "$(cut -d' ' -f2 "$work/add2.out")" --run-dir "$run" >"$work/remove2.out" 2>&1
check "remove of an added worker" grep -q "^removed " "$work/remove2.out"
check "the added worker decoded" bash -c "health() { \"$bin/tandem-client\" --router $router --health; }; [[ \$(\"$bin/tandem-client\" --router $router --health | jq '[.workers[] | select(.id == \"decode-2\") | .kv_in_ucx + .kv_in_zmq] | add') -gt 0 ]]"
check "its health counts its steps, tokens and busy time" bash -c "[[ \$(\"$bin/tandem-client\" --router $router --health | jq '[.workers[] | select(.id == \"decode-2\") | (.steps > 0 and .tokens >= .steps and .busy_seconds > 0 and .idle_seconds > 0)] | all') == true ]]"
check "tandem-admin --json list carries the counters" bash -c "\"$bin/tandem-admin\" --router $router --json list | jq -e '[.workers[] | has(\"busy_seconds\") and has(\"project_seconds\") and has(\"steps\")] | all' >/dev/null"

# ---- stop: every supervisor and process of the run ends (the added one too)
pids=$(cat "$run"/*.pid 2>/dev/null)
kill -TERM "$main"
wait "$main"
main=""
check "stop: no pid file left" bash -c "! ls '$run'/*.pid >/dev/null 2>&1"
left=0
# (a zombie, where this container's init reaps none, has exited)
for p in $pids; do
  st=$(awk '{ print $3 }' "/proc/$p/stat" 2>/dev/null) && [[ $st != Z ]] && { left=1; ps -o pid,args -p "$p"; }
done
check "stop: no process left" test "$left" -eq 0
check "stop: the added workers drained" grep -q "decode-2: stopped: exit status 0" "$run/decode-2.log"
# ---- a keyed cluster (--auth): keys made in the run directory, every process started with them
# (the gateway too); listed clients are served, a client without keys is refused
arun="$work/keyed"
"$root/deploy/local.sh" --auth --spare-keys 1 --run-dir "$arun" --no-metrics --gateway-port 0 >"$work/auth.out" \
  2>"$work/auth.err" &
main=$!
wait_for 600 grep -q '^api-keys ' "$work/auth.out" 2>/dev/null
router=$(awk '/^router /{print $2}' "$work/auth.out")
keys=$(awk '/^keys /{print $2}' "$work/auth.out")
gw=$(awk '/^gateway /{print $2}' "$work/auth.out")
check "--auth: the cluster serves and names its keys" test -n "$router" -a "$keys" = "$arun/keys" -a -n "$gw"
ck=(--curve-secret "$keys/client.key" --router-key "$keys/router.pub")
check "--auth: the key folder is the owner's alone" test "$(stat -c %a "$keys")" = 700
check "--auth: secret keys mode 0600" bash -c "! stat -c %a '$keys'/*.key | grep -vx 600"
requests "$work/areq.jsonl" 8
"$bin/tandem-client" --router "$router" "${ck[@]}" --requests "$work/areq.jsonl" --timeout-ms 60000 >"$work/auth1.out" 2>&1
check "--auth: a listed client is served" all_right "$work/auth1.out" 8
"$bin/tandem-client" --router "$router" --text "forty two" --connect-timeout-ms 1500 >"$work/nokey.out" 2>&1
rc=$?
check "--auth: a client without keys is refused" test "$rc" -eq 2
check "--auth: ... and told no router answers" grep -q "no router answers" "$work/nokey.out"
check "--auth: the router logs it" wait_for 50 grep -q "on the client endpoint" "$arun/router.log"
apikeys=$(awk '/^api-keys /{print $2}' "$work/auth.out")
check "--auth: the HTTP API's key made in the key folder, mode 0600" \
  test "$apikeys" = "$keys/gateway-api.keys" -a "$(stat -c %a "$apikeys" 2>/dev/null)" = 600
apikey=$(head -1 "$apikeys" 2>/dev/null)
check "--auth: the HTTP API's key is 32 random bytes" bash -c "[[ '$apikey' =~ ^tdk-[0-9a-f]{64}$ ]]"
code() { curl -s -o "$work/api.body" -w '%{http_code}' "$@"; }
check "--auth: /v1/models without a key: 401" test "$(code "$gw/v1/models")" = 401
check "--auth: ... as OpenAI's invalid_api_key" jq -e '.error.code == "invalid_api_key"' "$work/api.body"
check "--auth: a wrong key: 401" test "$(code -H "Authorization: Bearer ${apikey}x" "$gw/v1/models")" = 401
check "--auth: /health needs no key (probes)" test "$(code "$gw/health")" = 200
ans=$(curl -s "$gw/v1/completions" -H 'Content-Type: application/json' -H "Authorization: Bearer $apikey" \
        -d '{"model": "toy-numbers-t5", "prompt": "three hundred five", "max_tokens": 8}' | jq -r '.choices[0].text')
check "--auth: the gateway reaches the router with its key" test "$ans" = "305"
"$bin/tandem-admin" --router "$router" --curve-secret "$keys/operator.key" --router-key "$keys/router.pub" list \
  >"$work/admin.out" 2>&1
check "--auth: the operator's key lists the workers" grep -q "decode-0" "$work/admin.out"
"$bin/tandem-admin" --router "$router" "${ck[@]}" list >/dev/null 2>&1
check "--auth: a plain client key is no admin" test $? -eq 1
"$root/deploy/local.sh" add decode --run-dir "$arun" >"$work/aadd.out" 2>&1
check "--auth: add takes a spare key" grep -qx "added decode-1" "$work/aadd.out"
check "--auth: ... named after the worker" test -f "$keys/decode-1.key" -a ! -e "$keys/spare-0.key"
"$root/deploy/local.sh" add decode --run-dir "$arun" >/dev/null 2>"$work/aadd2.err"
check "--auth: no spare key left is said" grep -q "no spare worker key left" "$work/aadd2.err"
check "--auth: no secret key on a command line" bash -c "
  for f in '$keys'/*.key '$apikeys'; do grep -qsF -f \"\$f\" /proc/[0-9]*/cmdline && exit 1; done; exit 0"
check "--auth: KV over ZeroMQ (UCX has no CURVE)" bash -c "\"$bin/tandem-client\" --router $router ${ck[*]} --health |
  jq -e '[.workers[] | select(.id == \"decode-0\") | .kv_in_zmq] | add > 0' >/dev/null"
kill -TERM "$main"
wait "$main"
main=""
"$root/deploy/local.sh" --auth --kv-transport ucx --run-dir "$work/nope" >/dev/null 2>"$work/auth-ucx.err"
check "--auth: --kv-transport ucx is refused" grep -q "UCX has no CURVE" "$work/auth-ucx.err"
# a tensor-parallel decode group with keys: its ranks' own sockets are CURVE too (its ranks only)
"$root/deploy/local.sh" --auth --decode-tp 2 --encoders 0 --prefills 0 --demo --no-gateway --no-metrics \
  --run-dir "$work/keyed-tp" >"$work/auth-tp.out" 2>"$work/auth-tp.err"
check "--auth --decode-tp 2: the demo's answers" grep -qF "forty two  ->  42" "$work/auth-tp.out"
check "--auth --decode-tp 2: the group's sockets admit its ranks only" \
  grep -q "(CURVE: the group's ranks only)" "$work/keyed-tp/decode-0.log"

# ---- decode workers that also encode, their encoder runs capped (--local-encode-seqs); the encoder's
# too (--encoder-seqs), pushing K/V; no encoder cache; every loop spinning 2 ms after work (--spin-us);
# an added encoder and decode worker take the options their role was started with
"$root/deploy/local.sh" --run-dir "$work/lse" --encoders 1 --prefills 0 --decodes 1 --decoders-encode \
  --local-encode-seqs 2 --encoder-seqs 3 --cross-transfer kv --encode-queue-runs 5 --encoder-cache-fraction 0 \
  --spin-us 2000 --no-gateway --no-metrics >"$work/lse.out" 2>"$work/lse.err" &
lse=$!
wait_for 600 grep -q '^router ' "$work/lse.out" 2>/dev/null
router=$(awk '/^router /{print $2}' "$work/lse.out")
args_of() { args_in "$work/lse" "$1"; }
"$root/deploy/local.sh" add encode --run-dir "$work/lse" >"$work/lse-add.out" 2>&1
check "--encoder-seqs: add encode registered" grep -qx "added encoder-1" "$work/lse-add.out"
"$root/deploy/local.sh" add encode,decode --run-dir "$work/lse" >"$work/lse-add.out" 2>&1
check "--local-encode-seqs: add encode,decode registered" grep -qx "added decode-1" "$work/lse-add.out"
for w in encoder-0 encoder-1; do
  enc_opts() { args_of "$w" | grep -q -- "--max-enc-seqs 3 " && args_of "$w" | grep -q -- "--cross-transfer kv "; }
  check "--encoder-seqs, --cross-transfer kv: $w's runs capped, K/V pushed" enc_opts
done
dec1_capped() { args_of decode-1 | grep -q -- "--max-enc-seqs 2 "; }
check "--local-encode-seqs: the added decode worker's encoder runs capped" dec1_capped
requests "$work/lse.jsonl" 12
"$bin/tandem-client" --router "$router" --requests "$work/lse.jsonl" --timeout-ms 60000 >"$work/lse-res.out" 2>&1
check "--local-encode-seqs: every request answered right" all_right "$work/lse-res.out" 12
capped() { tr '\0' ' ' <"/proc/$(cat "$work/lse/decode-0.pid")/cmdline" | grep -q -- "--max-enc-seqs 2 "; }
check "--local-encode-seqs: the decode worker's encoder runs capped" capped
no_cache() { tr '\0' ' ' <"/proc/$(cat "$work/lse/encoder-0.pid")/cmdline" | grep -q -- "--encoder-cache-fraction 0 "; }
check "--encoder-cache-fraction 0 reaches the workers" no_cache
queue_runs() { tr '\0' ' ' <"/proc/$(cat "$work/lse/router.pid")/cmdline" | grep -q -- "--encode-queue-runs 5 "; }
check "--encode-queue-runs reaches the router" queue_runs
spins() { for p in router encoder-0 encoder-1 decode-0 decode-1; do args_of "$p" | grep -q -- "--spin-us 2000 " || return 1; done; }
check "--spin-us reaches the router and every worker, added ones too" spins
kill -TERM "$lse"
wait "$lse"
# ---- local links (--local-link all): workers, added ones too, and clients reach the router over Unix
# sockets in the run directory; a worker killed is gone from the router at once (its link closed), not
# after missed heartbeats; the run directory deeper than a Unix socket's address takes (its sockets
# are reached through the directory)
lld=$work/a-run-directory-under-a-build-path-deeper-than-the-107-bytes-of-a-unix-socket-address/ll
"$root/deploy/local.sh" --run-dir "$lld" --encoders 1 --prefills 0 --decodes 1 --local-link all \
  --no-gateway --no-metrics >"$work/ll.out" 2>"$work/ll.err" &
ll=$!
wait_for 600 grep -q '^router-local ' "$work/ll.out" 2>/dev/null
router=$(awk '/^router-local /{print $2}' "$work/ll.out")
check "--local-link all: clients are given the router's local link" test "$router" = "local:$lld/router-clients.sock"
"$root/deploy/local.sh" add decode --run-dir "$lld" >"$work/ll-add.out" 2>&1
check "--local-link all: add decode registered" grep -qx "added decode-1" "$work/ll-add.out"
ll_args() { tr '\0' ' ' <"/proc/$(cat "$lld/$1.pid")/cmdline"; }
linked() { for p in encoder-0 decode-0 decode-1; do ll_args "$p" | grep -q -- "--router local:$lld/router-workers.sock " || return 1; done; }
check "--local-link all: every worker, the added one too, on the router's local link" linked
requests "$work/ll.jsonl" 12
"$bin/tandem-client" --router "$router" --requests "$work/ll.jsonl" --timeout-ms 60000 >"$work/ll-res.out" 2>&1
check "--local-link all: every request answered right" all_right "$work/ll-res.out" 12
kill -KILL "$(cat "$lld/decode-1.pid")"
wait_for 20 grep -q "worker decode-1 is gone: its local link closed" "$lld/router.log" || true
check "--local-link: a killed worker is gone at once" grep -q "worker decode-1 is gone: its local link closed" "$lld/router.log"
kill -TERM "$ll"
wait "$ll"
"$root/deploy/local.sh" --local-link yes >/dev/null 2>"$work/ll-bad.err"
check "--local-link yes is refused" grep -q "local-link must be auto, off, workers or all" "$work/ll-bad.err"
"$root/deploy/local.sh" --local-link workers --auth >/dev/null 2>"$work/ll-bad.err"
check "--local-link with --auth is refused" grep -q "local-link has no CURVE" "$work/ll-bad.err"
"$root/deploy/local.sh" --local-encode-seqs 2 >/dev/null 2>"$work/lse-bad.err"
check "--local-encode-seqs without --decoders-encode is refused" grep -q "decode workers that encode" "$work/lse-bad.err"
"$root/deploy/local.sh" --decoders-encode --local-encode-seqs 0 >/dev/null 2>"$work/lse-bad.err"
check "--local-encode-seqs 0 is refused" grep -q "must be a number of inputs" "$work/lse-bad.err"
"$root/deploy/local.sh" --encoders 1 --encoder-seqs 0 >/dev/null 2>"$work/lse-bad.err"
check "--encoder-seqs 0 is refused" grep -q "encoder-seqs must be a number of inputs" "$work/lse-bad.err"
"$root/deploy/local.sh" --encoders 0 --encoder-seqs 4 >/dev/null 2>"$work/lse-bad.err"
check "--encoder-seqs without encoders is refused" grep -q "is for encoder workers" "$work/lse-bad.err"
"$root/deploy/local.sh" --encode-queue-runs 1001 >/dev/null 2>"$work/lse-bad.err"
check "--encode-queue-runs 1001 is refused" grep -q "encode-queue-runs must be 1 to 1000" "$work/lse-bad.err"
"$root/deploy/local.sh" --encoder-cache-fraction 1.5 >/dev/null 2>"$work/lse-bad.err"
check "--encoder-cache-fraction 1.5 is refused" grep -q "must be in \\[0, 1\\]" "$work/lse-bad.err"
"$root/deploy/local.sh" --gateway-spin-us 100001 >/dev/null 2>"$work/lse-bad.err"
check "--gateway-spin-us 100001 is refused" grep -q "gateway-spin-us must be 0 to 100000" "$work/lse-bad.err"
"$root/deploy/local.sh" --spin-us 100001 >/dev/null 2>"$work/lse-bad.err"
check "--spin-us 100001 is refused" grep -q "spin-us must be 0 to 100000" "$work/lse-bad.err"
"$root/deploy/local.sh" --decode-pp 2 --encode-defer 4 >/dev/null 2>"$work/lse-bad.err"
check "--encode-defer without --pp-sets 2 is refused" grep -q "encode-defer takes a number of steps, with --pp-sets 2" "$work/lse-bad.err"
"$root/deploy/local.sh" --decode-pp 2 --pp-sets 2 --encode-defer soon >/dev/null 2>"$work/lse-bad.err"
check "--encode-defer soon is refused" grep -q "encode-defer takes a number of steps" "$work/lse-bad.err"
"$root/deploy/local.sh" --tp-encoder rows >/dev/null 2>"$work/lse-bad.err"
check "--tp-encoder without a TP group is refused" grep -q "tp-encoder is for tensor-parallel groups" "$work/lse-bad.err"
"$root/deploy/local.sh" --decode-tp 2 --tp-encoder columns >/dev/null 2>"$work/lse-bad.err"
check "--tp-encoder columns is refused" grep -q "tp-encoder must be heads or rows" "$work/lse-bad.err"

# ---- what a worker and cluster.sh refuse before anything starts
"$bin/tandem-worker" --router tcp://127.0.0.1:9 --model "$root/tests/data/toy-numbers-t5" --role decode --id w \
  --host 0.0.0.0 >"$work/wild.out" 2>&1
check "worker: a wildcard --host without --advertise is refused" grep -q "give --advertise" "$work/wild.out"
refused() { # what the message must hold, then the cluster file's JSON
  echo "$2" >"$work/bad.json"
  ! "$root/deploy/cluster.sh" up "$work/bad.json" >/dev/null 2>"$work/bad.err" && grep -q "$1" "$work/bad.err"
}
good='{"name": "t", "tandem": "/opt/t", "model": "/m", "router": {"address": "10.1.1.1", "client_port": 1, "worker_port": 2},
       "hosts": [{"name": "a", "ssh": "a", "address": "10.1.1.2", "pools": [{"role": "decode"}]}]}'
check "cluster file: not JSON" refused "not a JSON object" "{"
check "cluster file: a router on loopback" refused "must reach it" "$(jq -c '.router.address = "127.0.0.1"' <<<"$good")"
check "cluster file: a wildcard worker address" refused "wildcard" "$(jq -c '.hosts[0].address = "0.0.0.0"' <<<"$good")"
check "cluster file: a wildcard advertised" refused "advertise 0.0.0.0: a wildcard" \
  "$(jq -c '.hosts[0].address = "0.0.0.0" | .hosts[0].advertise = "0.0.0.0"' <<<"$good")"
check "cluster file: a loopback address advertised" refused "loopback" "$(jq -c '.hosts[0].advertise = "127.0.0.1"' <<<"$good")"
check "cluster file: a loopback worker address" refused "loopback" "$(jq -c '.hosts[0].address = "127.0.0.1"' <<<"$good")"
check "cluster file: no decode worker" refused "no decode worker" "$(jq -c '.hosts[0].pools[0].role = "encode"' <<<"$good")"
check "cluster file: a bad role" refused "role: encode" "$(jq -c '.hosts[0].pools[0].role = "x"' <<<"$good")"
check "cluster file: a TP group of prefill workers" refused "only decode workers and encoders" "$(jq -c '.hosts[0].pools += [{"role": "prefill", "tp": 2}]' <<<"$good")"
check "cluster file: an encoder group pushing K/V" refused "encoder group pushes encoder states" "$(jq -c '.hosts[0].pools += [{"role": "encode", "tp": 2, "cross_transfer": "kv"}]' <<<"$good")"
check "cluster file: tp_encoder without TP groups" refused "tp_encoder: heads or rows, on a pool of TP groups" "$(jq -c '.hosts[0].pools[0].tp_encoder = "rows"' <<<"$good")"
check "cluster file: tp_encoder diagonal" refused "tp_encoder: heads or rows" "$(jq -c '.hosts[0].pools[0].tp = 2 | .hosts[0].pools[0].tp_encoder = "diagonal"' <<<"$good")"
check "cluster file: cuda without GPUs" refused "gpus" "$(jq -c '.hosts[0].pools[0].device = "cuda"' <<<"$good")"
check "cluster file: ids twice" refused "ids twice" "$(jq -c '.hosts += [.hosts[0]]' <<<"$good")"
check "cluster file: keys not by an absolute path" refused "keys.dir" "$(jq -c '.keys = {dir: "keys"}' <<<"$good")"
check "cluster file: keys and a UCX pool" refused "UCX has no CURVE" \
  "$(jq -c '.keys = {dir: "/k"} | .hosts[0].pools[0].kv_transport = "ucx"' <<<"$good")"
check "cluster file: an absurd router spin" refused "router.spin_us" "$(jq -c '.router.spin_us = 100001' <<<"$good")"
check "cluster file: a pool's spin not a number" refused "spin_us: 0 to 100000" "$(jq -c '.hosts[0].pools[0].spin_us = "fast"' <<<"$good")"

# ---- int8 cross K/V (--cross-kv-dtype int8): refused where there is no GPU, for a group, or where the worker
# would push encoder states (which stay as they are)
m=$root/tests/data/t5-tiny
said() { # want, command...: exit status 2 and the reason on stderr
  local want=$1; shift
  "$@" >/dev/null 2>"$work/said.err"
  local rc=$?
  ((rc == 2)) && grep -q -- "$want" "$work/said.err" || { echo "  exit $rc: $(head -2 "$work/said.err")" >&2; return 1; }
}
w=("$bin/tandem-worker" --router tcp://127.0.0.1:1 --model "$m")
check "int8 cross K/V: a CPU worker is refused" said "int8 needs --device cuda" "${w[@]}" --cross-kv-dtype int8
check "int8 cross K/V: an encoder that pushes states is refused" said "encoders that push K/V (--cross-transfer kv)" \
  "${w[@]}" --device cuda --role encode --cross-kv-dtype int8
check "int8 cross K/V: a prefill-only worker is refused" said "is for decode workers" \
  "${w[@]}" --device cuda --role prefill --cross-kv-dtype int8
check "int8 cross K/V: a group's rank is refused" said "not a group" \
  "${w[@]}" --device cuda --group g --tp 2 --rank 0 --cross-kv-dtype int8
check "int8 cross K/V: an unknown dtype" said "bf16 or int8" "${w[@]}" --cross-kv-dtype fp8
check "tandem-generate: int8 cross K/V on the CPU is refused" bash -c \
  "'$bin/tandem-generate' --model '$m' --requests /dev/null --device cpu --cross-kv-dtype int8 >/dev/null 2>'$work/gen.err'
   (( \$? != 0 )) && grep -q 'int8 cross K/V needs a CUDA device' '$work/gen.err'"
check "local.sh: int8 cross K/V on the CPU is refused" said "needs GPU workers" \
  "$root/deploy/local.sh" --run-dir "$work/q8" --device cpu --cross-kv-dtype int8
check "local.sh: int8 cross K/V pushed by an encoder group is refused" said "needs encoders of one rank" \
  "$root/deploy/local.sh" --run-dir "$work/q8" --device cuda --encoders 1 --encoder-tp 2 --cross-transfer kv --cross-kv-dtype int8
check "local.sh: int8 cross K/V in cross mode states is refused" said "not with --cross-mode states" \
  "$root/deploy/local.sh" --run-dir "$work/q8" --device cuda --cross-mode states --cross-kv-dtype int8
check "local.sh: int8 cross K/V in a TP group is refused" said "decode workers of one rank" \
  "$root/deploy/local.sh" --run-dir "$work/q8" --device cuda --decode-tp 2 --cross-kv-dtype int8
check "local.sh: an unknown dtype" said "bf16 or int8" "$root/deploy/local.sh" --run-dir "$work/q8" --cross-kv-dtype fp8

echo "$failed failed"
((failed == 0))
