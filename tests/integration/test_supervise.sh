#!/usr/bin/env bash
# deploy/supervise.sh on small shell programs: restarts after a failing exit
# and after SIGKILL with the doubling back-off, logs each restart with its
# status or signal, keeps pid files, does not restart a process that exited
# 0, forwards SIGTERM (the process finishes first) and restarts nothing
# after it, and SIGKILLs a process that outlives --stop-timeout.
#   tests/integration/test_supervise.sh WORK_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
sup="$root/deploy/supervise.sh"
work=$1
rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
alive() { kill -0 "$1" 2>/dev/null; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

# A program that fails twice (status 3), then serves until SIGTERM, which it
# answers by finishing its work (0.5 s) and exiting 0.
cat >"$work/flaky.sh" <<'EOF'
#!/usr/bin/env bash
n=$(cat "$1" 2>/dev/null || echo 0); echo $((n + 1)) >"$1"
echo "flaky run $n"
((n < 2)) && exit 3
trap 'echo "draining"; sleep 0.5; echo "drained" >"$1.drained"; exit 0' TERM
while :; do sleep 0.1; done
EOF
chmod +x "$work/flaky.sh"
"$sup" --name flaky --run-dir "$work/run" --backoff-min 1 --backoff-max 2 -- "$work/flaky.sh" "$work/count" &
sp=$!
pids+=($sp)
log="$work/run/flaky.log"
check "restarted after two failures" wait_for 80 grep -q "flaky run 2" "$log"
check "each failure logged with its status" test "$(grep -c 'exited: exit status 3' "$log")" -eq 2
check "back-off doubles (1 s, then 2 s)" grep -q "restart 2 in 2 s" "$log"
check "supervisor pid file" test "$(cat "$work/run/flaky.supervisor.pid")" = "$sp"
child=$(cat "$work/run/flaky.pid")
check "pid file names the running process" alive "$child"
kill -KILL "$child"
check "restarted after SIGKILL" wait_for 50 grep -q "flaky run 3" "$log"
check "the signal is logged" grep -q "killed by SIGKILL" "$log"
child2=$(cat "$work/run/flaky.pid")
check "a new pid" test "$child2" != "$child"
sleep 0.3
kill -TERM "$sp"
wait "$sp"
rc=$?
check "SIGTERM: the supervisor exits with the process's 0" test "$rc" -eq 0
check "SIGTERM reached the process, which finished first" test -f "$work/count.drained"
check "no restart after the stop" test "$(cat "$work/count")" -eq 4
check "pid files removed" test ! -e "$work/run/flaky.pid" -a ! -e "$work/run/flaky.supervisor.pid"

# exit 0 on its own: not restarted
cat >"$work/once.sh" <<'EOF'
#!/usr/bin/env bash
echo once >>"$1"
exit 0
EOF
chmod +x "$work/once.sh"
"$sup" --name once --run-dir "$work/run" -- "$work/once.sh" "$work/once.count"
rc=$?
check "exit 0: the supervisor ends with 0" test "$rc" -eq 0
check "exit 0: ran once" test "$(wc -l <"$work/once.count")" -eq 1
check "exit 0: logged as not restarted" grep -q "exited 0 after .*not restarted" "$work/run/once.log"

# a process that ignores SIGTERM is killed after --stop-timeout
cat >"$work/stubborn.sh" <<'EOF'
#!/usr/bin/env bash
trap '' TERM
echo up >"$1"
while :; do sleep 0.1; done
EOF
chmod +x "$work/stubborn.sh"
"$sup" --name stubborn --run-dir "$work/run" --stop-timeout 1 -- "$work/stubborn.sh" "$work/stubborn.up" &
sp=$!
pids+=($sp)
wait_for 50 test -f "$work/stubborn.up"
child=$(cat "$work/run/stubborn.pid")
kill -TERM "$sp"
wait "$sp"
rc=$?
check "stop timeout: SIGKILL logged" grep -q "SIGKILL" "$work/run/stubborn.log"
check "stop timeout: status of the kill" test "$rc" -eq 137
check "stop timeout: the process is gone" bash -c "! kill -0 $child 2>/dev/null"

# a second supervisor of the same name in the same run directory is refused
"$sup" --name stubborn --run-dir "$work/run" -- sleep 30 &
sp=$!
pids+=($sp)
wait_for 30 test -f "$work/run/stubborn.supervisor.pid"
"$sup" --name stubborn --run-dir "$work/run" -- sleep 30 2>"$work/dup.err"
rc=$?
check "same name twice: refused" test "$rc" -eq 1
check "same name twice: says why" grep -q "already runs" "$work/dup.err"
kill -TERM "$sp"
wait "$sp"
check "bad option: refused" bash -c "! '$sup' --name x --run-dir '$work/run' --backoff-min 0 -- true 2>/dev/null"

echo "$failed failed"
((failed == 0))
