#!/usr/bin/env bash
# A tensor-parallel decode group under deploy/local.sh's supervisors: when a
# rank dies (SIGKILL of rank 1, then of the leader) while requests run, its
# supervisor restarts it, the router fails the old group and the ranks form
# it anew, and every request is answered right (retried once the group is
# back: it is the only decode worker). An encoder pushes it encoder states,
# which its ranks project (local.sh no longer asks encoders for K/V).
# With ROLE encode the group is the encoder instead (TP=2, pushing encoder
# states to a single-rank decode worker), killed the same way.
#   tests/integration/test_group_restart.sh BIN_DIR WORK_DIR [ROLE: decode (default) | encode]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=$(cd "$1" && pwd)
work=$2
role=${3:-decode}
rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
export TANDEM_BIN=$bin
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
run="$work/cluster"
main=""
cleanup() { [[ -n $main ]] && kill -TERM "$main" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT

if [[ $role == encode ]]; then
  g=encoder-0 layout=(--encoder-tp 2)
else
  g=decode-0 layout=(--decode-tp 2)
fi
"$root/deploy/local.sh" --run-dir "$run" --encoders 1 --prefills 0 "${layout[@]}" --no-gateway --no-metrics \
  >"$work/out" 2>"$work/err" &
main=$!
wait_for 600 grep -q '^router ' "$work/out" 2>/dev/null
router=$(awk '/^router /{print $2}' "$work/out")
[[ -n $router ]] || { echo "FAIL the cluster did not start"; cat "$work/err"; exit 1; }
words=("seven" "forty two" "three hundred five" "ninety thousand one")
digits=("7" "42" "305" "90001")
for ((i = 0; i < 16; i++)); do echo "{\"id\": \"r$i\", \"text\": \"${words[i % 4]}\"}"; done >"$work/req.jsonl"
all_right() { # output file
  local i ok=0 id text
  declare -A got=()
  while read -r id text; do got[$id]=$text; done < <(jq -r '"\(.id) \(.outputs[0].text // "-")"' "$1" 2>/dev/null)
  for ((i = 0; i < 16; i++)); do [[ ${got[r$i]:-} == "${digits[i % 4]}" ]] && ok=$((ok + 1)); done
  ((ok == 16)) || { echo "  $ok of 16 right:"; cat "$1"; return 1; }
}
formed() { # how many times the router saw the group form
  grep -c "worker group $g: 2 ranks joined" "$run/router.log"
}
up() { "$bin/tandem-client" --router "$router" --health --timeout-ms 2000 |
  jq -e ".workers | any(.id == \"$g\")" >/dev/null; }
check "the group forms" wait_for 300 up
"$bin/tandem-client" --router "$router" --requests "$work/req.jsonl" --timeout-ms 60000 >"$work/before.out" 2>&1
check "served by the group" all_right "$work/before.out"
check "the encoder pushes encoder states" grep -q "cross transfer: encoder states" "$run/encoder-0.log"

for victim in $g-rank1 $g; do
  n=$(formed)
  "$bin/tandem-client" --router "$router" --requests "$work/req.jsonl" --timeout-ms 60000 >"$work/$victim.out" 2>&1 &
  client=$!
  sleep 0.2
  old=$(cat "$run/$victim.pid")
  kill -KILL "$old"
  check "$victim killed: its supervisor starts it again" \
    wait_for 100 bash -c "[[ -f '$run/$victim.pid' && \$(cat '$run/$victim.pid' 2>/dev/null) != $old ]]"
  check "$victim killed: the group forms anew" wait_for 300 bash -c "(( \$(grep -c 'worker group $g: 2 ranks joined' '$run/router.log') > $n ))"
  wait "$client"
  check "$victim killed: every request answered right" all_right "$work/$victim.out"
  check "$victim killed: the group serves" wait_for 300 up
done
check "the router said why the old group failed" grep -q "worker group $g failed" "$run/router.log"
"$bin/tandem-client" --router "$router" --requests "$work/req.jsonl" --timeout-ms 60000 >"$work/after.out" 2>&1
check "served after both restarts" all_right "$work/after.out"
kill -TERM "$main"
wait "$main"
main=""
echo "$failed failed"
((failed == 0))
