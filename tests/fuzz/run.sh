#!/usr/bin/env bash
# A long libFuzzer run of one target of the ASan build, from its seed
# corpus; what it finds new is kept in a work folder (not the tree), a
# crashing input saved there too. Prints the executions and the outcome.
#   tests/fuzz/run.sh TARGET SECONDS [WORK]   (WORK: default /tmp/tandem-fuzz)
#   e.g. tests/fuzz/run.sh fuzz_jsonl 600
# BUILD (default build-asan) names the build folder. Exit status: 0 when
# no finding, else libFuzzer's.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
target=${1:?usage: run.sh TARGET SECONDS [WORK]}
secs=${2:?usage: run.sh TARGET SECONDS [WORK]}
work=${3:-/tmp/tandem-fuzz}/$target
bin=$root/${BUILD:-build-asan}/bin/$target
seeds=$root/tests/fuzz/corpus/$target
[[ -x $bin ]] || { echo "run.sh: no $bin (deploy/setup.sh asan builds it where clang is)" >&2; exit 2; }
mkdir -p "$work/corpus" "$work/crashes"
[[ -d $seeds ]] || seeds=  # the tokenizer and gateway targets start from nothing
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
rc=0
"$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$work/crashes/" "$work/corpus" $seeds > "$work/log" 2>&1 || rc=$?
runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/log" | grep -o '[0-9]*$' || echo "?")
cov=$(grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE)' "$work/log" | tail -1 | grep -o 'cov: [0-9]*' || true)
echo "$target: ${secs} s, $runs executions, $cov, corpus $(ls "$work/corpus" | wc -l) files, exit $rc" \
     "$( ((rc)) && echo "FINDING: $(ls "$work/crashes") (log: $work/log)" || echo "no finding")"
exit $rc
