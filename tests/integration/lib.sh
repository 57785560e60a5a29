# Helpers of the shell tests (sourced): named checks counted in $failed,
# waits by polling, substring expectations.
failed=0
check() { # name, then a command that must succeed
  local name=$1; shift
  if "$@"; then echo "ok   $name"; else echo "FAIL $name"; failed=$((failed + 1)); fi
}
wait_for() { # tries of 0.1 s, then a command
  local n=$1; shift
  for _ in $(seq "$n"); do "$@" && return 0; sleep 0.1; done
  return 1
}
has() { [[ $1 == *"$2"* ]] || { echo "  want '$2' in: ${1:0:600}" >&2; return 1; }; }
