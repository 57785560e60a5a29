#!/usr/bin/env bash
# Rolling restart of one pool: for each worker with ROLE, one at a time,
# drain it (the router places nothing new there; it finishes its requests,
# deregisters and exits 0), wait until it has left, start it again with the
# same command line, environment and working directory (read from /proc
# before the drain), and wait until the replacement has registered and
# serves. A drained worker exits 0, which a supervisor does not restart:
# this script starts the replacement itself, so the workers must run on
# this host. A new binary at the same path is what the replacement runs.
#
#   deploy/rolling-restart.sh --router tcp://HOST:PORT [--bin DIR] [--log-dir DIR] [--timeout S] ROLE
#
# ROLE: encode, prefill or decode. Replacements log to LOG_DIR/ID.log
# (default: the current directory). Exit status 0 when every worker was
# replaced; else 1 at the first worker that did not leave or come back.
set -euo pipefail

router="" bin="" logdir="." timeout=300 role=""
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --router) router="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --log-dir) logdir="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "rolling-restart: unknown flag $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$role" ] || { echo "rolling-restart: one ROLE only" >&2; exit 2; }; role="$1"; shift ;;
  esac
done
[ -n "$router" ] && [ -n "$role" ] || { usage >&2; exit 2; }
case "$role" in encode|prefill|decode) ;; *) echo "rolling-restart: ROLE is encode, prefill or decode" >&2; exit 2 ;; esac
if [ -z "$bin" ]; then
  bin="$(cd "$(dirname "$0")/.." && pwd)/build/bin"
fi
admin="$bin/tandem-admin"
[ -x "$admin" ] || { echo "rolling-restart: no $admin (--bin DIR)" >&2; exit 2; }
mkdir -p "$logdir"
ms=$((timeout * 1000))

# A process that has exited (a zombie its parent has not reaped counts as exited).
alive() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

mapfile -t workers < <("$admin" --router "$router" ids "$role")
[ "${#workers[@]}" -gt 0 ] || { echo "rolling-restart: no $role worker is registered" >&2; exit 1; }
echo "rolling-restart: ${#workers[@]} $role workers: $(printf '%s ' "${workers[@]%% *}")"
for line in "${workers[@]}"; do
  id="${line%% *}" pid="${line##* }"
  if [ ! -r "/proc/$pid/cmdline" ]; then
    echo "rolling-restart: worker $id (pid $pid) does not run on this host" >&2
    exit 1
  fi
  mapfile -d '' cmd < "/proc/$pid/cmdline"
  mapfile -d '' envs < "/proc/$pid/environ"
  cwd="$(readlink "/proc/$pid/cwd")"
  echo "rolling-restart: $id (pid $pid): draining"
  "$admin" --router "$router" drain "$id"
  "$admin" --router "$router" --timeout-ms "$ms" wait-gone "$id"
  for ((t = 0; t < timeout * 10; t++)); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then
    echo "rolling-restart: $id (pid $pid) deregistered but did not exit within ${timeout} s" >&2
    exit 1
  fi
  echo "rolling-restart: $id: starting its replacement: ${cmd[*]}"
  (cd "$cwd" && exec setsid env -i "${envs[@]}" "${cmd[@]}" >>"$logdir/$id.log" 2>&1 </dev/null) &
  "$admin" --router "$router" --timeout-ms "$ms" wait-up "$id"
done
echo "rolling-restart: every $role worker was replaced"
