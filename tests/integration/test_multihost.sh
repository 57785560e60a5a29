#!/usr/bin/env bash
# deploy/cluster.sh across three "hosts" on one machine: network namespaces
# (each with its own address and hostname, joined by a bridge in a fourth),
# Debian's sshd in each (keys and configuration made here, in a temporary
# folder; the machine's own ssh set-up is untouched), `cluster.sh up` over
# ssh: the router on one host, the encoder on a second, the prefill and
# decode workers on a third. Requests give tandem-generate's tokens; the
# router's health shows KV blocks that left the encoder's host and reached
# the decode worker's, over UCX (TCP: the hosts' names differ, so no shared
# memory) or ZeroMQ. The router and host b bind every interface and
# advertise their addresses ("router.bind", "advertise"): ZeroMQ endpoints
# on the wildcard, UCX on the advertised address's interface, KV still
# crossing. A SIGKILLed decode worker is restarted by its supervisor
# and requests are served again; `cluster.sh down` leaves no process. Then
# the same hosts with CURVE keys that `cluster.sh keys` made, referenced by
# path in the cluster file: served with the client's key, refused without.
# Skipped (status 77) only where namespaces cannot be made (not root).
#   tests/integration/test_multihost.sh BIN_DIR WORK_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=$(cd "$1" && pwd)
work=$2
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  echo "SKIP: network namespaces need root and iproute2"
  exit 77
fi
sshd=/usr/sbin/sshd
[[ -x $sshd ]] || { echo "FAIL $sshd missing (deploy/setup.sh installs openssh-server)"; exit 1; }
rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

tag="td$$"
nets=("$tag-sw" "$tag-r" "$tag-a" "$tag-b")
hosts=(r a b)
declare -A addr=([r]=10.213.0.1 [a]=10.213.0.2 [b]=10.213.0.3)
sshd_pids=()
cleanup() {
  for f in "$work/cluster.json" "$work/keyed.json"; do
    [[ -f $f ]] && ip netns exec "$tag-r" "$root/deploy/cluster.sh" down "$f" >/dev/null 2>&1
  done
  for p in "${sshd_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for n in "${nets[@]}"; do ip netns del "$n" 2>/dev/null; done
}
trap cleanup EXIT
ip netns add "$tag-sw" || { echo "SKIP: ip netns add failed (no namespaces here)"; exit 77; }
ip -n "$tag-sw" link add br0 type bridge
ip -n "$tag-sw" link set br0 up
for h in "${hosts[@]}"; do
  ns="$tag-$h"
  ip netns add "$ns"
  ip -n "$ns" link add eth0 type veth peer name "p-$h" netns "$tag-sw"
  ip -n "$tag-sw" link set "p-$h" master br0 up
  ip -n "$ns" addr add "${addr[$h]}/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done

# ---- sshd in each namespace, its own keys and configuration
ssh-keygen -q -t ed25519 -N "" -f "$work/hostkey"
ssh-keygen -q -t ed25519 -N "" -f "$work/userkey"
cp "$work/userkey.pub" "$work/authorized_keys"
chmod 600 "$work/authorized_keys"
mkdir -p /run/sshd # sshd's privilege separation folder (the package makes it at boot)
for h in "${hosts[@]}"; do
  cat >"$work/sshd-$h.conf" <<EOF
Port 2222
ListenAddress ${addr[$h]}
HostKey $work/hostkey
PidFile $work/sshd-$h.pid
AuthorizedKeysFile $work/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AcceptEnv none
EOF
  # its own hostname too: Tandem and UCX tell hosts apart by it
  ip netns exec "$tag-$h" unshare --uts sh -c "hostname $tag-$h && exec $sshd -D -e -f $work/sshd-$h.conf" \
    >"$work/sshd-$h.log" 2>&1 &
  sshd_pids+=($!)
done
ssh_opts=(-p 2222 -i "$work/userkey" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR
          -o ConnectTimeout=5)
on() { ip netns exec "$tag-r" ssh -o BatchMode=yes "${ssh_opts[@]}" "root@${addr[$1]}" "$2"; }
for h in "${hosts[@]}"; do
  check "sshd on host $h" wait_for 100 bash -c "$(declare -f on); $(declare -p ssh_opts addr tag); on $h true 2>/dev/null"
done
check "hosts have their own names" test "$(on a hostname)" = "$tag-a"

# ---- the cluster file: router on r, encoder on a, prefill and decode on b
model="$root/tests/data/toy-numbers-t5"
jq -n --arg tandem "$root" --arg bin "$bin" --arg model "$model" --arg run "$work/run" \
  --arg r "${addr[r]}" --arg a "${addr[a]}" --arg b "${addr[b]}" \
  --argjson ssh "$(printf '%s\n' "${ssh_opts[@]}" | jq -R . | jq -s .)" '{
  name: "nstest", tandem: $tandem, bin: $bin, model: $model, run_dir: $run, ssh_options: $ssh,
  stop_timeout_s: 20,
  env: {UCX_LOG_LEVEL: "error", UCX_WARN_UNUSED_ENV_VARS: "n"},
  router: {ssh: ("root@" + $r), address: $r, bind: "0.0.0.0", client_port: 7000, worker_port: 7001, metrics_port: 7002},
  hosts: [
    {name: "a", ssh: ("root@" + $a), address: $a, pools: [{role: "encode", count: 1}]},
    {name: "b", ssh: ("root@" + $b), address: "0.0.0.0", advertise: $b,
     pools: [{role: "prefill", count: 1}, {role: "decode", count: 1}]}
  ]}' >"$work/cluster.json"
cp "$work/cluster.json" "$work/cluster.json.bak"
cr() { ip netns exec "$tag-r" "$root/deploy/cluster.sh" "$@"; }
t0=$SECONDS
cr up "$work/cluster.json" >"$work/up.out" 2>"$work/up.err"
check "cluster.sh up" grep -qx "router tcp://${addr[r]}:7000" "$work/up.out" || { cat "$work/up.err"; exit 1; }
echo "up in $((SECONDS - t0)) s"
check "processes on their hosts" test -f "$work/run/a/a-encode-0.pid" -a -f "$work/run/b/b-decode-0.pid" \
  -a -f "$work/run/router/router.pid"
check "the encoder binds its host's address" grep -q "${addr[a]}" <(ip netns exec "$tag-a" ss -ltnp)
check "the encoder listens on no loopback or wildcard address" \
  bash -c "ip netns exec $tag-a ss -Hltnp | grep -q tandem-worker &&
           ! ip netns exec $tag-a ss -Hltnp | grep tandem-worker | awk '{ print \$4 }' | grep -E '^(127\.|0\.0\.0\.0|\*|\[::)'"
# host b: ZeroMQ on every interface, advertised at its address; UCX on that address's interface only
check "b's decode worker advertises its host's address" grep -q "KV endpoint zmq:tcp://${addr[b]}:" "$work/run/b/b-decode-0.log"
check "b's workers bind every interface" \
  bash -c "ip netns exec $tag-b ss -Hltnp | grep tandem-worker | awk '{ print \$4 }' | grep -qE '^(0\.0\.0\.0|\*):'"
check "b's UCX listens on the advertised address" \
  bash -c "ip netns exec $tag-b ss -Hltnp | grep tandem-worker | awk '{ print \$4 }' | grep -q '^${addr[b]}:'"
check "b's workers listen on no loopback address" \
  bash -c "! ip netns exec $tag-b ss -Hltnp | grep tandem-worker | awk '{ print \$4 }' | grep -qE '^(127\.|\[::1\])'"
check "the router binds every interface, says its address" \
  grep -q "router serving clients on tcp://${addr[r]}:7000, workers on tcp://${addr[r]}:7001" "$work/run/router/router.log"

# ---- requests from the router's host: tandem-generate's tokens
cat >"$work/req.jsonl" <<'EOF'
{"id": "g1", "input_ids": [37, 42, 11, 9, 5, 1], "max_new_tokens": 16}
{"id": "g2", "input_ids": [3, 14, 15, 22, 45, 1], "max_new_tokens": 12}
{"id": "b1", "input_ids": [12, 8, 17, 31, 1], "num_beams": 4, "num_return_sequences": 2, "max_new_tokens": 12}
{"id": "g3", "input_ids": [9, 26, 33, 38, 1], "max_new_tokens": 8}
EOF
"$bin/tandem-generate" --model "$model" --requests "$work/req.jsonl" --block-size 16 >"$work/want.out" 2>/dev/null
tokens() { jq -c '{id, t: [.outputs[].tokens]}' "$1" | sort; }
check "tandem-generate answered every request" test "$(jq -s '[.[] | select(.outputs[0].tokens | length > 0)] | length' "$work/want.out")" -eq 4
send() { ip netns exec "$tag-r" "$bin/tandem-client" --router "tcp://${addr[r]}:7000" --requests "$work/req.jsonl" \
           --timeout-ms 60000 >"$1" 2>&1; }
send "$work/got.out"
check "the tokens of tandem-generate" test "$(tokens "$work/got.out")" = "$(tokens "$work/want.out")"
health() { ip netns exec "$tag-r" "$bin/tandem-client" --router "tcp://${addr[r]}:7000" --health; }
kv() { jq --arg id "$1" ".workers[] | select(.id == \$id) | $2" "$work/health.json"; }
# the workers report their counts with their heartbeats
moved() { health >"$work/health.json" && (($(kv a-encode-0 '.kv_out_ucx + .kv_out_zmq') > 0 &&
                                            $(kv b-decode-0 '.kv_in_ucx + .kv_in_zmq') > 0)); }
wait_for 50 moved
check "KV left the encoder's host" test "$(kv a-encode-0 '.kv_out_ucx + .kv_out_zmq')" -gt 0
check "KV reached the decode worker's host" test "$(kv b-decode-0 '.kv_in_ucx + .kv_in_zmq')" -gt 0
echo "KV blocks: encoder out ucx $(kv a-encode-0 .kv_out_ucx) zmq $(kv a-encode-0 .kv_out_zmq);" \
     "decoder in ucx $(kv b-decode-0 .kv_in_ucx) zmq $(kv b-decode-0 .kv_in_zmq)"
check "no same-host path between the hosts" bash -c "! grep -q 'same-host puts' '$work'/run/*/*.log"
ip netns exec "$tag-r" curl -s "http://${addr[r]}:7002/metrics" >"$work/metrics.txt"
check "the router's /metrics on its address" grep -q "^tandem:" "$work/metrics.txt"

# ---- SIGKILL the decode worker on host b: restarted, serving again
victim=$(cat "$work/run/b/b-decode-0.pid")
on b "kill -KILL $victim"
check "restart logged on host b" wait_for 100 grep -q "b-decode-0: exited: killed by SIGKILL" "$work/run/b/b-decode-0.log"
check "registered again" wait_for 300 bash -c "[[ \$(grep -c 'registered with the router' '$work/run/b/b-decode-0.log') -ge 2 ]]"
send "$work/again.out"
check "served after the restart, same tokens" test "$(tokens "$work/again.out")" = "$(tokens "$work/want.out")"
cr status "$work/cluster.json" >"$work/status.out" 2>&1
check "status: the restart counted" grep -q "^b b-decode-0 supervisor [0-9]* running pid [0-9]* restarts 1$" "$work/status.out"
check "status: the router's health" grep -q '^health {"serving": true' "$work/status.out"

# ---- down: every process gone
pids=$(cat "$work"/run/*/*.pid 2>/dev/null)
cr down "$work/cluster.json" >"$work/down.out" 2>&1
check "cluster.sh down" test $? -eq 0
left=0
for p in $pids; do
  st=$(awk '{ print $3 }' "/proc/$p/stat" 2>/dev/null) && [[ $st != Z ]] && { left=1; ps -o pid,args -p "$p"; }
done
check "down: no process left" test "$left" -eq 0
check "down: the workers drained" grep -q "b-decode-0: stopped: exit status 0" "$work/run/b/b-decode-0.log"
rm -f "$work/cluster.json" # nothing left for the clean-up to stop

# ---- the same hosts with CURVE keys: made by `cluster.sh keys`, read by path where they run
jq --arg k "$work/keys" --arg run "$work/run-keyed" '.keys = {dir: $k} | .run_dir = $run' "$work/cluster.json.bak" \
  >"$work/keyed.json"
cr up "$work/keyed.json" >/dev/null 2>"$work/nokeys.err"
check "keys: up refuses a host without its key files" grep -q "lacks $work/keys/router.key" "$work/nokeys.err"
cr keys "$work/keyed.json" "$work/keys" >"$work/keys.out" 2>&1
check "keys: made, and each host's files named" grep -q "^b (root@${addr[b]}): b-prefill-0.key b-decode-0.key router.pub workers.list" "$work/keys.out"
cr up "$work/keyed.json" >"$work/kup.out" 2>"$work/kup.err"
check "keys: cluster.sh up" grep -qx "router tcp://${addr[r]}:7000" "$work/kup.out" || cat "$work/kup.err"
check "keys: the router runs with them" grep -q "CURVE on the client and worker endpoints" "$work/run-keyed/router/router.log"
kc=(--curve-secret "$work/keys/operator.key" --router-key "$work/keys/router.pub")
ip netns exec "$tag-r" "$bin/tandem-client" --router "tcp://${addr[r]}:7000" "${kc[@]}" --requests "$work/req.jsonl" \
  --timeout-ms 60000 >"$work/keyed.out" 2>&1
check "keys: the tokens of tandem-generate" test "$(tokens "$work/keyed.out")" = "$(tokens "$work/want.out")"
ip netns exec "$tag-r" "$bin/tandem-client" --router "tcp://${addr[r]}:7000" --requests "$work/req.jsonl" \
  --connect-timeout-ms 1500 >"$work/nokey.out" 2>&1
check "keys: a client without keys is refused" test $? -eq 2
ip netns exec "$tag-r" "$bin/tandem-client" --router "tcp://${addr[r]}:7000" "${kc[@]}" --health >"$work/health.json"
check "keys: KV crossed over ZeroMQ (CURVE)" test "$(kv b-decode-0 '.kv_in_zmq')" -gt 0
check "keys: no secret key on a command line" bash -c "
  for f in '$work/keys'/*.key; do grep -qsF -f \"\$f\" /proc/[0-9]*/cmdline && exit 1; done; exit 0"
cr status "$work/keyed.json" >"$work/kstatus.out" 2>&1
check "keys: status asks the health with its key" grep -q '^health {"serving": true' "$work/kstatus.out"
cr down "$work/keyed.json" >/dev/null 2>&1
check "keys: cluster.sh down" test $? -eq 0
rm -f "$work/keyed.json"
echo "$failed failed"
((failed == 0))
