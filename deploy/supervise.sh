#!/usr/bin/env bash
# Runs one process and keeps it running: restarts it when it exits abnormally
# (a non-zero status or a signal), with a back-off that doubles from
# --backoff-min to --backoff-max seconds and starts again from the minimum
# once the process stayed up --stable-after seconds. A process that exits 0
# is not restarted (a worker exits 0 after a stop or a drain): the supervisor
# exits 0 too. SIGTERM or SIGINT to the supervisor is forwarded to the
# process as SIGTERM (a worker finishes its work first), the supervisor waits
# for it (SIGKILL after --stop-timeout seconds; 0: wait as long as it takes)
# and exits with its status, restarting nothing.
#
#   deploy/supervise.sh --name NAME --run-dir DIR [--backoff-min S] [--backoff-max S]
#                       [--stable-after S] [--stop-timeout S] [--env K=V]... -- COMMAND [ARGS...]
#
# In DIR: NAME.log (the process's stdout and stderr, appended over restarts,
# and the supervisor's own lines, which begin with "supervise:"), NAME.pid
# (the running process), NAME.supervisor.pid (this script). Both pid files
# are removed when the supervisor ends.
set -uo pipefail
name="" run_dir=""
backoff_min=1 backoff_max=30 stable_after=60 stop_timeout=300
envs=()
while (($#)); do
  case $1 in
    --name) name=$2; shift 2 ;;
    --run-dir) run_dir=$2; shift 2 ;;
    --backoff-min) backoff_min=$2; shift 2 ;;
    --backoff-max) backoff_max=$2; shift 2 ;;
    --stable-after) stable_after=$2; shift 2 ;;
    --stop-timeout) stop_timeout=$2; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "supervise.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "supervise.sh: no command (see --help)" >&2; exit 2; }
[[ $name =~ ^[A-Za-z0-9._-]+$ ]] || { echo "supervise.sh: --name must be letters, digits, '.', '_' or '-'" >&2; exit 2; }
[[ -n $run_dir ]] || { echo "supervise.sh: --run-dir is required" >&2; exit 2; }
for v in "$backoff_min" "$backoff_max" "$stable_after" "$stop_timeout"; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "supervise.sh: durations are whole seconds (got $v)" >&2; exit 2; }
done
((backoff_min >= 1 && backoff_max >= backoff_min)) ||
  { echo "supervise.sh: need 1 <= --backoff-min <= --backoff-max" >&2; exit 2; }
for e in "${envs[@]}"; do
  [[ $e =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { echo "supervise.sh: --env takes NAME=VALUE (got $e)" >&2; exit 2; }
done
mkdir -p "$run_dir" || exit 1
log="$run_dir/$name.log"
pidf="$run_dir/$name.pid"
spidf="$run_dir/$name.supervisor.pid"
if [[ -f $spidf ]] && st=$(awk '{ print $3 }' "/proc/$(cat "$spidf" 2>/dev/null)/stat" 2>/dev/null) && [[ $st != Z ]]; then
  echo "supervise.sh: $name already runs under supervisor $(cat "$spidf") in $run_dir" >&2
  exit 1
fi
echo $$ >"$spidf"

say() { echo "supervise: $(date -u +%Y-%m-%dT%H:%M:%SZ) $name: $*" >>"$log"; }
# "exit status N" or "killed by SIGNAME" for a status from wait
describe() {
  local rc=$1
  if ((rc > 128 && rc < 128 + 65)); then
    echo "killed by SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128))) (status $rc)"
  else
    echo "exit status $rc"
  fi
}

child=""
stopping=0
stop_at=0
napper=""
on_stop() {
  ((stopping)) && return
  stopping=1
  stop_at=$SECONDS
  [[ -n $napper ]] && kill "$napper" 2>/dev/null
  if [[ -n $child ]] && kill -0 "$child" 2>/dev/null; then
    say "stopping: SIGTERM to pid $child"
    kill -TERM "$child" 2>/dev/null
  fi
}
trap on_stop TERM INT
trap 'rm -f "$pidf" "$spidf"' EXIT

# Waits for the child. A trapped signal interrupts wait; while stopping, the
# child is polled (a zombie has exited) so that it can be killed once
# --stop-timeout has passed.
wait_child() {
  local rc st
  while :; do
    if ((!stopping)); then
      wait "$child"
      rc=$?
      if ((rc > 128)) && kill -0 "$child" 2>/dev/null; then continue; fi
      return "$rc"
    fi
    st=$(awk '{ print $3 }' "/proc/$child/stat" 2>/dev/null)
    if [[ -z $st || $st == Z ]]; then
      wait "$child"
      return $?
    fi
    if ((stop_timeout > 0 && SECONDS - stop_at >= stop_timeout)); then
      say "still running ${stop_timeout} s after SIGTERM: SIGKILL"
      kill -KILL "$child" 2>/dev/null
      stop_at=$SECONDS
    fi
    sleep 0.2
  done
}

delay=$backoff_min
restarts=0
while :; do
  started=$SECONDS
  env "${envs[@]}" "$@" </dev/null >>"$log" 2>&1 &
  child=$!
  echo "$child" >"$pidf"
  say "started pid $child (restarts so far: $restarts): $*"
  # a stop that came before the child existed
  if ((stopping)); then stopping=0; on_stop; fi
  wait_child
  rc=$?
  up=$((SECONDS - started))
  rm -f "$pidf"
  if ((stopping)); then
    say "stopped: $(describe "$rc") after ${up} s"
    exit "$rc"
  fi
  if ((rc == 0)); then
    say "exited 0 after ${up} s: not restarted"
    exit 0
  fi
  ((up >= stable_after)) && delay=$backoff_min
  restarts=$((restarts + 1))
  say "exited: $(describe "$rc") after ${up} s; restart $restarts in ${delay} s"
  sleep "$delay" &
  napper=$!
  wait "$napper" 2>/dev/null
  napper=""
  ((stopping)) && { say "stopped while waiting to restart"; exit 0; }
  delay=$((delay * 2 > backoff_max ? backoff_max : delay * 2))
done
