#!/usr/bin/env bash
# Starts, shows and stops a Tandem cluster spread over hosts, as a cluster
# file describes it (docs/deploy.md: the format). Each host's processes run
# under deploy/supervise.sh, started over ssh (or here, for a host whose
# "ssh" is "local"), with their logs and pid files in the run directory on
# that host (RUN_DIR/HOST_NAME).
#
#   deploy/cluster.sh up FILE      the router, then every host's workers; waits until all
#                                  have registered; prints "router tcp://ADDR:PORT" and
#                                  "metrics http://ADDR:PORT/metrics"
#   deploy/cluster.sh status FILE  each process (host, name, pid, restarts) and the
#                                  router's health (tandem-client --health, on its host)
#   deploy/cluster.sh down FILE    SIGTERM to every worker (they drain), then the router;
#                                  waits until no process of the cluster is left
#   deploy/cluster.sh keys FILE DIR  the CURVE key pairs and lists the file's "keys" needs, made
#                                  here in DIR (a new folder); prints which files each host takes
#                                  (copy them to "keys.dir" there yourself, over a trusted channel)
set -euo pipefail
cmd=${1:-}
file=${2:-}
usage() { sed -n '2,/^set -euo/{/^set/!p}' "$0"; }
[[ $cmd == -h || $cmd == --help ]] && { usage; exit 0; }
[[ $cmd == up || $cmd == down || $cmd == status || $cmd == keys ]] && [[ -n $file ]] || { usage >&2; exit 2; }
out_dir=${3:-}
[[ $cmd != keys || -n $out_dir ]] || { usage >&2; exit 2; }
[[ -f $file ]] || { echo "cluster.sh: no cluster file $file" >&2; exit 2; }
command -v jq >/dev/null || { echo "cluster.sh: jq is needed (deploy/setup.sh installs it)" >&2; exit 2; }
jq -e 'type == "object"' "$file" >/dev/null 2>&1 || { echo "cluster.sh: $file is not a JSON object" >&2; exit 2; }
q() { jq -r "$1" "$file"; } # a value of the file ("null" when absent)

die() { echo "cluster.sh: $file: $*" >&2; exit 2; }
# ---- the file, checked before anything starts
name=$(q '.name // empty')
[[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die '"name": letters, digits, ".", "_" or "-"'
tandem=$(q '.tandem // empty')
[[ $tandem == /* ]] || die '"tandem": the absolute path of the Tandem tree on every host'
bin=$(q ".bin // \"$tandem/build/bin\"")
model=$(q '.model // empty')
[[ $model == /* ]] || die '"model": the absolute path of the model folder on every host'
tokenizer=$(q '.tokenizer // empty')
run_root=$(q ".run_dir // \"$tandem/run/cluster-$name\"")
[[ $run_root == /* ]] || die '"run_dir": an absolute path'
stop_timeout=$(q '.stop_timeout_s // 300')
[[ $stop_timeout =~ ^[0-9]+$ ]] || die '"stop_timeout_s": whole seconds'
q '.env // {} | type' | grep -qx object || die '"env": an object of strings'
mapfile -t env_kv < <(jq -r '.env // {} | to_entries[] | "\(.key)=\(.value)"' "$file")
for e in "${env_kv[@]}"; do [[ $e =~ ^[A-Za-z_][A-Za-z0-9_]*= && $e != *$'\n'* ]] || die "\"env\": bad entry $e"; done
mapfile -t ssh_opts < <(jq -r '.ssh_options // [] | .[]' "$file")
addr_re='^[A-Za-z0-9.:-]+$'
# CURVE: key files by path (the same folder on every host); none on a command line
key_dir=$(q '.keys.dir // empty')
key_client=$(q '.keys.client // "operator"')
if [[ $(q '.keys // empty') != "" ]]; then
  [[ $key_dir == /* && $key_dir != *[[:space:]]* ]] || die '"keys.dir": the absolute path of the key folder on every host'
  [[ $key_client =~ ^[A-Za-z0-9._-]+$ ]] || die '"keys.client": the name of a client key (NAME.key in "keys.dir")'
fi

r_ssh=$(q '.router.ssh // "local"')
r_addr=$(q '.router.address // empty')
r_bind=$(q ".router.bind // \"$r_addr\"")
r_cport=$(q '.router.client_port // empty')
r_wport=$(q '.router.worker_port // empty')
r_mport=$(q '.router.metrics_port // empty')
r_cross=$(q '.router.cross_mode // "auto"')
r_spin=$(q '.router.spin_us // 0')
[[ $r_addr =~ $addr_re && $r_bind =~ $addr_re ]] || die '"router.address" (and "router.bind"): an address'
[[ $r_addr != 127.* && $r_addr != localhost && $r_addr != 0.0.0.0 ]] ||
  die "\"router.address\" $r_addr: the workers of other hosts must reach it"
for p in "$r_cport" "$r_wport"; do [[ $p =~ ^[0-9]+$ ]] || die '"router.client_port", "router.worker_port": ports'; done
[[ -z $r_mport || $r_mport =~ ^[0-9]+$ ]] || die '"router.metrics_port": a port'
[[ $r_spin =~ ^[0-9]{1,6}$ ]] && ((r_spin <= 100000)) || die '"router.spin_us": 0 to 100000 microseconds'
client_ep="tcp://$r_addr:$r_cport"

# worker defaults, each overridable per pool
defaults='{"device": "cpu", "kv_transport": "auto", "block_size": 16, "threads": 1, "gpu_memory_fraction": 0.9}'
n_hosts=$(q '.hosts | length')
((n_hosts >= 1)) || die '"hosts": at least one'
# plan: one line a process: host index, id, its arguments (one string, shell-quoted)
plan=()
decoders=0
for ((h = 0; h < n_hosts; h++)); do
  hn=$(q ".hosts[$h].name // empty")
  [[ $hn =~ ^[A-Za-z0-9._-]+$ ]] || die "hosts[$h].name: letters, digits, '.', '_' or '-'"
  ha=$(q ".hosts[$h].address // empty")
  hadv=$(q ".hosts[$h].advertise // empty")
  [[ $ha =~ $addr_re ]] || die "hosts[$h].address: the address the host's workers bind (and the others reach, without \"advertise\")"
  [[ -z $hadv || $hadv =~ $addr_re ]] || die "hosts[$h].advertise: the address the others reach the host's workers at"
  reach=${hadv:-$ha} field=address
  [[ -z $hadv ]] || field=advertise
  [[ $reach != 0.0.0.0 && $reach != :: && $reach != '*' ]] ||
    die "hosts[$h].$field $reach: a wildcard cannot be reached (bind it as \"address\" and give \"advertise\")"
  if ((n_hosts > 1)) || [[ $(q ".hosts[$h].ssh // \"local\"") != local ]]; then
    [[ $reach != 127.* && $reach != localhost ]] || die "hosts[$h] $reach: other hosts cannot reach a loopback address"
  fi
  hgpus=$(q ".hosts[$h].gpus // 0")
  [[ $hgpus =~ ^[0-9]+$ ]] || die "hosts[$h].gpus: a count"
  gpu=0
  np=$(q ".hosts[$h].pools // [] | length")
  for ((p = 0; p < np; p++)); do
    pool=$(jq -c --argjson d "$defaults" ".hosts[$h].pools[$p] | \$d + ." "$file")
    pf() { jq -r "$1" <<<"$pool"; }
    role=$(pf '.role // empty')
    case $role in encode|prefill|decode|encode,decode) ;; *) die "hosts[$h].pools[$p].role: encode, prefill, decode or encode,decode" ;; esac
    count=$(pf '.count // 1') tp=$(pf '.tp // 1') pp=$(pf '.pp // 1')
    for v in "$count" "$tp" "$pp"; do [[ $v =~ ^[0-9]+$ ]] || die "hosts[$h].pools[$p]: count, tp and pp are counts"; done
    ((tp == 1 || pp == 1)) || die "hosts[$h].pools[$p]: a group is tensor- or pipeline-parallel, not both"
    ranks=$((tp * pp))
    [[ $ranks -eq 1 || $role == decode || $role == encode ]] ||
      die "hosts[$h].pools[$p]: only decode workers and encoders form TP / PP groups"
    ct=$(pf '.cross_transfer // empty')
    [[ $ranks -eq 1 || $role != encode || $ct != kv ]] ||
      die "hosts[$h].pools[$p]: an encoder group pushes encoder states (cross_transfer kv needs single-rank encoders)"
    [[ -z $ct || ($role == encode && ($ct == states || $ct == kv)) ]] ||
      die "hosts[$h].pools[$p].cross_transfer: states or kv, on an encode pool"
    te=$(pf '.tp_encoder // empty')
    [[ -z $te || (($te == heads || $te == rows) && $tp -gt 1) ]] ||
      die "hosts[$h].pools[$p].tp_encoder: heads or rows, on a pool of TP groups (\"tp\" above 1)"
    if [[ -n $key_dir ]]; then
      [[ $(pf '.kv_transport') != ucx ]] || die "hosts[$h].pools[$p]: \"kv_transport\": \"ucx\" with keys (UCX has no CURVE; KV goes over ZeroMQ)"
    fi
    device=$(pf '.device')
    [[ $device == cpu || $device == cuda ]] || die "hosts[$h].pools[$p].device: cpu or cuda"
    [[ $device == cpu || $hgpus -gt 0 ]] || die "hosts[$h]: cuda workers on a host of \"gpus\": 0"
    common="--router tcp://$r_addr:$r_wport --model $(printf %q "$model") --device $device --host $ha"
    [[ -z $hadv ]] || common+=" --advertise $hadv"
    common+=" --block-size $(pf '.block_size') --threads $(pf '.threads') --kv-transport $(pf '.kv_transport')"
    common+=" --cross-mode $r_cross --gpu-memory-fraction $(pf '.gpu_memory_fraction')"
    mb=$(pf '.max_batch // empty')
    [[ -z $mb ]] || common+=" --max-batch $mb"
    sp=$(pf '.spin_us // 0')
    [[ $sp =~ ^[0-9]{1,6}$ ]] && ((sp <= 100000)) || die "hosts[$h].pools[$p].spin_us: 0 to 100000 microseconds"
    ((sp == 0)) || common+=" --spin-us $sp"
    for ((c = 0; c < count; c++)); do
      base="$hn-${role%%,*}-$c"
      [[ $role == encode,decode ]] && base="$hn-decode-$c"
      [[ $role == *decode* ]] && decoders=$((decoders + 1))
      for ((r = 0; r < ranks; r++)); do
        id=$base
        ((r > 0)) && id="$base-rank$r"
        args="$common --id $id --role $role"
        # encoders push encoder states (every decode worker, group or not, projects them) unless told kv
        [[ -n $ct ]] && args+=" --cross-transfer $ct"
        if [[ $device == cuda ]]; then
          args+=" --gpu $gpu"
          gpu=$(((gpu + 1) % hgpus))
        fi
        if ((ranks > 1)); then
          args+=" --group $base --rank $r"
          ((tp > 1)) && args+=" --tp $tp"
          [[ -n $te ]] && args+=" --tp-encoder $te"
          ((pp > 1)) && args+=" --pp $pp"
        fi
        [[ -z $key_dir ]] ||
          args+=" --curve-secret $key_dir/$id.key --router-key $key_dir/router.pub --worker-keys $key_dir/workers.list"
        plan+=("$h $id $args")
      done
    done
  done
done
((decoders >= 1)) || die "no decode worker in any pool"
dups=$(printf '%s\n' "${plan[@]}" | awk '{ print $2 }' | sort | uniq -d)
[[ -z $dups ]] || die "worker ids twice: $dups (host names must differ)"

# ---- running a script on a host: over ssh, or here for "local"
on_host() { # ssh target, then the script on stdin
  local t=$1
  if [[ $t == local ]]; then bash -s; else ssh -o BatchMode=yes "${ssh_opts[@]}" "$t" bash -s; fi
}
sup_env=()
for e in "${env_kv[@]}"; do sup_env+=(--env "$e"); done
# a script that starts one supervised process in DIR (it outlives the ssh session)
start_script() { # dir, name, command...
  local dir=$1 nm=$2; shift 2
  printf 'mkdir -p %q && : >%q\n' "$dir" "$dir/$nm.log"
  printf 'setsid %q --name %q --run-dir %q --stop-timeout %q' "$tandem/deploy/supervise.sh" "$nm" "$dir" "$stop_timeout"
  printf ' %q' "${sup_env[@]}" -- "$@"
  printf ' </dev/null >/dev/null 2>&1 &\n'
}
# a script that stops the supervisors of DIR (all, or those named) and waits
stop_script() { # dir, timeout s
  cat <<EOF
cd $(printf %q "$1") 2>/dev/null || exit 0
live() { local s; s=\$(awk '{ print \$3 }' "/proc/\$1/stat" 2>/dev/null) && [ -n "\$s" ] && [ "\$s" != Z ]; }
for f in *.supervisor.pid; do [ -e "\$f" ] && kill -TERM "\$(cat "\$f")" 2>/dev/null; done
for i in \$(seq $(($2 * 10))); do
  left=0
  for f in *.supervisor.pid; do [ -e "\$f" ] && live "\$(cat "\$f")" && left=1; done
  [ \$left = 0 ] && exit 0
  sleep 0.1
done
echo "cluster.sh: processes still running in \$PWD" >&2
exit 1
EOF
}
host_ssh() { q ".hosts[$1].ssh // \"local\""; }
host_dir() { echo "$run_root/$(q ".hosts[$1].name")"; }
router_dir="$run_root/router"
client_keys=()
[[ -z $key_dir ]] || client_keys=(--curve-secret "$key_dir/$key_client.key" --router-key "$key_dir/router.pub")
health() { # the router's health, asked on its host
  {
    printf '%q --router %q' "$bin/tandem-client" "$client_ep"
    ((${#client_keys[@]} == 0)) || printf ' %q' "${client_keys[@]}"
    printf ' --health --timeout-ms 1000 2>/dev/null\n'
  } | on_host "$r_ssh"
}
# the key files a host's processes read, missing there (a line each)
missing_keys() { # ssh target, files...
  local t=$1; shift
  { printf 'for f in'; printf ' %q' "$@"; printf '; do [ -r "$f" ] || echo "$f"; done\n'; } | on_host "$t"
}
router_key_files() {
  echo "$key_dir/router.key" "$key_dir/router.pub" "$key_dir/workers.list" "$key_dir/clients.list" \
       "$key_dir/admins.list" "$key_dir/$key_client.key"
}

case $cmd in
keys)
  [[ -n $key_dir ]] || die 'no "keys" in the file: give "keys": {"dir": "/etc/tandem/keys"}'
  [[ ! -e $out_dir ]] || { echo "cluster.sh: $out_dir exists: keys are never overwritten" >&2; exit 2; }
  mkdir -p "$out_dir" && chmod 700 "$out_dir"
  kg() { "$bin/tandem-keygen" "$out_dir/$1" >/dev/null || { echo "cluster.sh: tandem-keygen $1 failed" >&2; exit 1; }; }
  ids=$(printf '%s\n' "${plan[@]}" | awk '{ print $2 }')
  kg router
  kg "$key_client"
  for id in $ids; do kg "$id"; done
  for id in $ids; do cat "$out_dir/$id.pub"; done >"$out_dir/workers.list"
  cp "$out_dir/$key_client.pub" "$out_dir/clients.list"
  cp "$out_dir/$key_client.pub" "$out_dir/admins.list"
  echo "router ($r_ssh): $(router_key_files | sed "s|$key_dir/||g") -> $key_dir"
  for ((h = 0; h < n_hosts; h++)); do
    hk=$(printf '%s\n' "${plan[@]}" | awk -v h="$h" '$1 == h { printf "%s.key ", $2 }')
    [[ -z $hk ]] || echo "$(q ".hosts[$h].name") ($(host_ssh "$h")): ${hk}router.pub workers.list -> $key_dir"
  done
  echo "other clients: a pair each (tandem-keygen NAME), NAME.pub added to clients.list (admins.list: admin commands)"
  ;;
up)
  if [[ -n $key_dir ]]; then
    # every file where it is read, before anything starts
    lack=$(missing_keys "$r_ssh" $(router_key_files))
    [[ -z $lack ]] || die "the router's host ($r_ssh) lacks $(echo $lack) (cluster.sh keys FILE DIR makes them)"
    for ((h = 0; h < n_hosts; h++)); do
      mapfile -t need < <(printf '%s\n' "${plan[@]}" | awk -v h="$h" -v d="$key_dir" '$1 == h { print d "/" $2 ".key" }')
      ((${#need[@]})) || continue
      lack=$(missing_keys "$(host_ssh "$h")" "${need[@]}" "$key_dir/router.pub" "$key_dir/workers.list")
      [[ -z $lack ]] || die "host $(q ".hosts[$h].name") lacks $(echo $lack) (cluster.sh keys FILE DIR makes them)"
    done
  fi
  rargs=(--client-endpoint "tcp://$r_bind:$r_cport" --worker-endpoint "tcp://$r_bind:$r_wport" --cross-mode "$r_cross")
  [[ $r_bind == "$r_addr" ]] || rargs+=(--advertise "$r_addr")
  [[ -n $r_mport ]] && rargs+=(--metrics-port "$r_mport" --metrics-host "$r_bind")
  [[ -n $tokenizer ]] && rargs+=(--tokenizer "$tokenizer")
  ((r_spin == 0)) || rargs+=(--spin-us "$r_spin")
  [[ -z $key_dir ]] || rargs+=(--curve-secret "$key_dir/router.key" --worker-keys "$key_dir/workers.list"
                               --client-keys "$key_dir/clients.list" --admin-keys "$key_dir/admins.list")
  start_script "$router_dir" router "$bin/tandem-router" "${rargs[@]}" | on_host "$r_ssh"
  for _ in $(seq 100); do
    [[ -n $(health) ]] && break
    sleep 0.2
  done
  [[ -n $(health) ]] || { echo "cluster.sh: the router did not answer at $client_ep (its log: $r_ssh:$router_dir/router.log)" >&2; exit 1; }
  for ((h = 0; h < n_hosts; h++)); do
    script=""
    for line in "${plan[@]}"; do
      read -r hi id args <<<"$line"
      ((hi == h)) || continue
      # shellcheck disable=SC2086
      script+=$(eval "start_script $(printf %q "$(host_dir "$h")") $id $(printf %q "$bin/tandem-worker") $args")$'\n'
    done
    [[ -z $script ]] || on_host "$(host_ssh "$h")" <<<"$script"
  done
  # registered: every rank-0 id in the router's list
  want=$(printf '%s\n' "${plan[@]}" | awk '$2 !~ /-rank[0-9]+$/ { print $2 }' | sort | jq -R . | jq -cs .)
  for _ in $(seq 600); do
    got=$(health | jq -c '[.workers[].id] | sort' 2>/dev/null || true)
    [[ $got == "$want" ]] && break
    sleep 0.2
  done
  [[ $got == "$want" ]] || { echo "cluster.sh: not every worker registered (want $want, have ${got:-none}); logs in $run_root/HOST on each host" >&2; exit 1; }
  echo "router $client_ep"
  [[ -z $key_dir ]] || echo "keys $key_dir (clients: --curve-secret NAME.key --router-key $key_dir/router.pub)"
  [[ -n $r_mport ]] && echo "metrics http://$r_addr:$r_mport/metrics"
  ;;
status)
  for ((h = -1; h < n_hosts; h++)); do
    if ((h < 0)); then t=$r_ssh d=$router_dir hn=router; else t=$(host_ssh "$h") d=$(host_dir "$h") hn=$(q ".hosts[$h].name"); fi
    cat <<EOF | on_host "$t" || true
cd $(printf %q "$d") 2>/dev/null || { echo "$hn: no run directory"; exit 0; }
for f in *.supervisor.pid; do
  [ -e "\$f" ] || continue
  n=\${f%.supervisor.pid}
  s=\$(awk '{ print \$3 }' "/proc/\$(cat "\$f")/stat" 2>/dev/null)
  state=running; { [ -z "\$s" ] || [ "\$s" = Z ]; } && state=gone
  echo "$hn \$n supervisor \$(cat "\$f") \$state pid \$(cat "\$n.pid" 2>/dev/null || echo -) restarts \$(grep -c '^supervise: .* exited' "\$n.log")"
done
EOF
  done
  h=$(health)
  if [[ -n $h ]]; then echo "health $h"; else echo "health: the router does not answer at $client_ep"; exit 1; fi
  ;;
down)
  rc=0
  for ((h = 0; h < n_hosts; h++)); do
    stop_script "$(host_dir "$h")" "$((stop_timeout + 10))" | on_host "$(host_ssh "$h")" || rc=1
  done
  stop_script "$router_dir" 30 | on_host "$r_ssh" || rc=1
  exit $rc
  ;;
esac
