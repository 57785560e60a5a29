#!/usr/bin/env bash
# deploy/slurm/tandem.sbatch under a real single-node Slurm (Debian's
# slurm-wlm with munge), configured here in a temporary folder: this host
# is the controller and the node. The job starts the router and the pools
# with the bundled toy model; requests go through its router and the
# answers are checked; scancel ends it and every step.
#   test_slurm.sh BIN_DIR WORK_DIR
# Skips (exit 77) only where the daemons cannot run: not root.
set -euo pipefail
bin=$(cd "$1" && pwd)
work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
model=$src/tests/data/toy-numbers-t5
if [[ $(id -u) -ne 0 ]]; then
  echo "test_slurm: SKIP: slurmctld and slurmd need root here (munge, the job's user)"
  exit 77
fi
for b in slurmctld slurmd munged sbatch scancel squeue scontrol; do
  command -v "$b" >/dev/null || { echo "test_slurm: $b is missing (deploy/setup.sh installs slurm-wlm and munge)" >&2; exit 1; }
done
rm -rf "$work"; mkdir -p "$work"
d=$(cd "$work" && pwd)
# munge's and the daemons' folders hold Unix sockets, whose paths must fit 108 bytes whatever the
# checkout's depth: a short folder of their own (the logs stay in $d)
mg=$(mktemp -d /tmp/td-slurm.XXXXXX)
chmod 700 "$mg"
mkdir -p "$mg"/{state,spool}
pids=()
job=""
cleanup() {
  [[ -n $job ]] && scancel "$job" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do [[ -n $job ]] && squeue -h -j "$job" 2>/dev/null | grep -q . || break; sleep 0.2; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$mg"
}
trap cleanup EXIT
fail() { echo "test_slurm: FAIL: $*" >&2; for f in "$d"/*.log "$d"/job.out; do [[ -f $f ]] && { echo "== $f"; tail -n 30 "$f"; }; done >&2; exit 1; }

# a port nothing listens on (a connection to it is refused)
free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 40000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
}
ctl_port=$(free_port); node_port=$(free_port); client_port=$(free_port); worker_port=$(free_port); metrics_port=$(free_port)

# munge: a key of our own, its socket in the folder
dd if=/dev/urandom of="$mg/munge.key" bs=1024 count=1 status=none
chmod 400 "$mg/munge.key"
munged --force --key-file "$mg/munge.key" --socket "$mg/sock" --pid-file "$mg/pid" \
  --log-file "$d/munged.log" --seed-file "$mg/seed" -F 2>>"$d/munged.log" &
pids+=($!)
for ((i = 0; i < 50; i++)); do [[ -S $mg/sock ]] && break; sleep 0.1; done
[[ -S $mg/sock ]] || fail "munged did not start"

host=$(hostname -s)
cat > "$d/slurm.conf" <<CONF
ClusterName=tandemtest
SlurmctldHost=$host
SlurmctldPort=$ctl_port
SlurmdPort=$node_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$mg/sock
CredType=cred/munge
StateSaveLocation=$mg/state
SlurmdSpoolDir=$mg/spool
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/slurmctld.log
SlurmdLogFile=$d/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 RealMemory=2000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$d/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" >"$d/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" -N "$host" >"$d/slurmd.out" 2>&1 &
pids+=($!)
for ((i = 0; i < 150; i++)); do
  sinfo -h -o %T 2>/dev/null | grep -qE '^idle' && break
  sleep 0.2
done
sinfo -h -o %T 2>/dev/null | grep -qE '^idle' || fail "the Slurm node did not become idle: $(sinfo 2>&1)"

# the job: router + 1 encoder + 1 decode worker on CPU
job=$(MODEL=$model TANDEM_BIN=$bin ENCODERS=1 PREFILLS=0 DECODES=1 DEVICE=cpu CLIENT_PORT=$client_port \
      WORKER_PORT=$worker_port METRICS_PORT=$metrics_port ENDPOINT_FILE=$d/endpoint \
      WORKER_FLAGS="--max-batch 8 --max-tokens 128" OPENBLAS_NUM_THREADS=1 \
      sbatch --parsable --ntasks=3 --chdir="$d" --output="$d/job.out" "$src/deploy/slurm/tandem.sbatch") ||
  fail "sbatch refused the script"
echo "test_slurm: job $job"
for ((i = 0; i < 600; i++)); do [[ -s $d/endpoint ]] && break; sleep 0.1; done
[[ -s $d/endpoint ]] || fail "the job wrote no endpoint: $(squeue -j "$job" 2>&1)"
ep=$(cat "$d/endpoint")
[[ $ep == "tcp://$host:$client_port" ]] || fail "endpoint $ep"
"$bin/tandem-admin" --router "$ep" list | tee "$d/list.txt"
grep -q '^encode-0 ' "$d/list.txt" && grep -q '^decode-0 ' "$d/list.txt" || fail "the pools are not as asked"

# requests through the job's router, checked against the model's examples
n=0
while IFS=$'\t' read -r text want; do
  got=$("$bin/tandem-client" --router "$ep" --text "$text" | sed -n 's/.*"text": *"\([^"]*\)".*/\1/p')
  [[ $got == "$want" ]] || fail "'$text' gave '$got', want '$want'"
  n=$((n + 1))
done < <(sed -n 's/.*"text": "\(.*\)",/\1/p; s/.*"expected": "\(.*\)"/\1/p' "$model/examples.json" | paste - - | head -n 4)
((n == 4)) || fail "$n requests checked"
health=$(curl -sf "http://127.0.0.1:$metrics_port/health") || fail "the router's /health does not answer"
[[ $health == ok ]] || fail "/health says $health"

scancel "$job"
for ((i = 0; i < 150; i++)); do squeue -h -j "$job" 2>/dev/null | grep -q . || break; sleep 0.2; done
squeue -h -j "$job" 2>/dev/null | grep -q . && fail "the job did not end after scancel"
pgrep -f "tandem-worker --router tcp://$host:$worker_port" >/dev/null && fail "a worker outlived scancel"
job=""
echo "test_slurm: OK ($n answers through the job's router)"
