#!/usr/bin/env bash
# bench/serve_configs.sh on the CPU with the toy T5: two configurations started, measured with a
# burst and a closed loop (of a given number of requests), stopped, and set against the engine (--engine); the table has a row each with numbers and the first's ratio 1.00.
#   test_serve_configs.sh BINDIR WORKDIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
source "$here/lib.sh"
bin=$1 work=$2
rm -rf "$work"
mkdir -p "$work"
# bench-serve --runs on the engine: the measure twice in one process, the second with inputs of its own
# (its encoder cache hit nothing), as serve_configs.sh measures a cluster's second run warm
eng=$("$bin/bench-serve" --engine --model "$root/tests/data/toy-numbers-t5" --workload trt --requests 6 --concurrency 2 \
  --runs 2 --seed 7 2>&1)
check "bench-serve --runs 2: the first run's row" has "$eng" "| 2 in flight, run 1 | 6/6 |"
check "bench-serve --runs 2: the second run's row" has "$eng" "| 2 in flight, run 2 | 6/6 |"
check "bench-serve --runs 2: each run its own inputs (no encoder-cache hit)" grep -q "12 runs (requests encoded).*: 0 hits, 12 misses" <<<"$eng"
part=$("$bin/bench-serve" --engine --model "$root/tests/data/toy-numbers-t5" --workload trt --requests 6 --part 1/2 \
  --runs 2 --seed 7 --seed-step 10 2>&1)
check "bench-serve --part 1/2: half the requests, each run" has "$part" "| all at once, run 2 | 3/3 |"
check "bench-serve --part: named in the header" has "$part" "3 requests (part 1 of 2 of 6)"
check "bench-serve --seed-step: each run its own inputs" grep -q "6 runs (requests encoded).*: 0 hits, 6 misses" <<<"$part"
check "bench-serve --part 2/2: refused" sh -c "! '$bin/bench-serve' --engine --model '$root/tests/data/toy-numbers-t5' --part 2/2 2>/dev/null"
check "bench-serve --seed-step 0: refused" sh -c "! '$bin/bench-serve' --engine --model '$root/tests/data/toy-numbers-t5' --seed-step 0 2>/dev/null"
check "bench-serve --runs with a rate: refused" sh -c "! '$bin/bench-serve' --engine --model '$root/tests/data/toy-numbers-t5' --runs 2 --rate 5 2>/dev/null"
TANDEM_BIN=$bin timeout 600 bash "$root/bench/serve_configs.sh" --model "$root/tests/data/toy-numbers-t5" --device cpu \
  --burst 8 --closed 4 --closed-requests 6 --runs 1 --engine 2 --out "$work/out" \
  --configs "agg=--encoders 0 --prefills 0 --decodes 1;split=--encoders 1 --prefills 0 --decodes 1" >"$work/table.md" 2>"$work/err"
rc=$?
cat "$work/table.md"
check "serve_configs.sh ran" test "$rc" -eq 0
check "the first configuration's row, ratios 1.00" grep -qE '^\| agg \| .* \| [0-9]+ \(1\.00x\) \| [0-9]+ \(1\.00x\) \|$' "$work/table.md"
check "the second configuration's row, with ratios" grep -qE '^\| split \| .* \| [0-9]+ \([0-9.]+x\) \| [0-9]+ \([0-9.]+x\) \|$' "$work/table.md"
# the encoder pushes states (cross mode auto): the decode worker projects them
d='decode-0 [0-9.]+ % \(batch [0-9.]+\) \(projecting [0-9.]+ %\)' e='encoder-0 [0-9.]+ % \([0-9.]+ a run\)'
s='(The (encoders|decode workers) are the short side|Encoders and decode workers are balanced) \(busy [^|]*'
check "the split's workers: the encoder's runs, the decode worker's batch and projection; which side was short" \
  grep -qE "^\| split \| ($e, $d|$d, $e) \| $s \|\$" "$work/table.md"
# --engine 2: the engine with half of each load (4 at once; 3 requests, 2 in flight), two runs, the second the
# measure; the clusters against twice it
check "the engine's warm run, half the burst" grep -qE '^\| all at once, run 2 \| 4/4 \|' "$work/out/engine-burst.txt"
check "the engine's warm run, half the closed loop" grep -qE '^\| 2 in flight, run 2 \| 3/3 \|' "$work/out/engine-closed.txt"
check "each configuration against two engines" grep -qE '^\| split \| [0-9]+\.[0-9]+x \| [0-9]+\.[0-9]+x \|$' "$work/table.md"
check "the first configuration too" grep -qE '^\| agg \| [0-9]+\.[0-9]+x \| [0-9]+\.[0-9]+x \|$' "$work/table.md"
check "the closed loop's first run has the engine's first warm run's inputs (seed 5 + 1)" grep -q 'seed 6$' "$work/out/agg-closed-1.txt"
check "the engine's burst: part 0 of the clusters' (seeds 1000 + 10 r, the first cold)" \
  grep -qE '4 requests \(part 0 of 2 of 8\).*seed 1000$' "$work/out/engine-burst.txt"
check "the clusters' first burst: seed 1010" grep -qE '8 requests .*seed 1010$' "$work/out/agg-burst-1.txt"
check "the engine's closed loop: part 0 of the clusters'" grep -qE '3 requests \(part 0 of 2 of 6\).*seed 5$' "$work/out/engine-closed.txt"
check "the closed loop ran --closed-requests requests, 4 in flight" grep -qE '^\| 4 in flight \| 6/6 \|' "$work/out/agg-closed-1.txt"
check "the aggregated cluster has no sides" grep -qE '^\| agg \| decode-0 [^|]* \| - \|$' "$work/table.md"
check "no cluster left running" sh -c "! pgrep -f 'run-dir $work/ou[t]' >/dev/null"
# --engine-parallel: two engines at once (CPU "devices" 0 and 1), each half the cluster's burst, each
# run started together (bench-serve --barrier); the cluster against every engine's tokens over the slowest's time;
# the cluster's clients and workers on its local links, bench-serve polling 200 us before it sleeps
CUDA_VISIBLE_DEVICES= TANDEM_BIN=$bin timeout 600 bash "$root/bench/serve_configs.sh" --model "$root/tests/data/toy-numbers-t5" \
  --device cpu --burst 8 --closed 0 --runs 1 --engine 2 --engine-parallel --out "$work/par" --client-spin-us 200 \
  --configs "agg=--encoders 0 --prefills 0 --decodes 1 --local-link all" >"$work/par.md" 2>"$work/par.err"
rc=$?
cat "$work/par.md"
check "--engine-parallel ran" test "$rc" -eq 0
for i in 0 1; do
  check "engine $i's warm run, half the burst" grep -qE '^\| all at once, run 2 \| 4/4 \|' "$work/par/engine-burst-$i.txt"
done
check "the engines take parts 0 and 1 of the cluster's burst" sh -c "grep -q '(part 0 of 2 of 8).*seed 1000\$' '$work/par/engine-burst-0.txt' && grep -q '(part 1 of 2 of 8).*seed 1000\$' '$work/par/engine-burst-1.txt'"
check "the cluster against the engines at once" grep -qE '^Against 2 engines at once: .*: [0-9]+ tok/s\):$' "$work/par.md"
check "the configuration's ratios (engines at once; the sum of their own rates)" \
  test "$(grep -cE '^\| agg \| [0-9]+\.[0-9]+x \|$' "$work/par.md")" -eq 2
check "against 2 x one GPU: the engines' own rates summed" grep -qE '^Against 2 x one GPU: .*: [0-9]+ tok/s\):$' "$work/par.md"
check "--local-link all: bench-serve measured the cluster over its local link" grep -q "^cluster at local:" "$work/par/agg-burst-1.txt"
check "--client-spin-us 100001: refused" sh -c "! bash '$root/bench/serve_configs.sh' --model '$root/tests/data/toy-numbers-t5' --client-spin-us 100001 2>/dev/null"
check "--engine-parallel without --engine: refused" sh -c "! bash '$root/bench/serve_configs.sh' --model '$root/tests/data/toy-numbers-t5' --engine-parallel 2>/dev/null"
# bench/gpu_clocks.sh over a stand-in nvidia-smi that speaks the driver's older field name only: the
# samples of a run and their summary (busy samples only: mean SM clock, the power cap's share, slowdowns')
fake=$work/fake-smi
cat >"$fake" <<'SMI'
#!/usr/bin/env bash
case "$*" in *clocks_event_reasons*) exit 6 ;; esac
lines=("0, 95, 1605, 0x0000000000000004" "1, 99, 1980, 0x0000000000000000"
       "0, 10, 345, 0x0000000000000001" "1, 97, 1755, 0x0000000000000024")
case "$*" in
  *-lms*) while :; do printf '%s\n' "${lines[@]}"; sleep 0.05; done ;;
  *) printf '%s\n' "${lines[0]}" ;;
esac
SMI
chmod +x "$fake"
clk=$(TD_NVIDIA_SMI=$fake bash -c 'source "$1/bench/gpu_clocks.sh"; gpu_clocks_init || exit 1; echo "q=$gpu_clocks_q"
  gpu_clocks_start "$2/clk.csv"; sleep 0.3; gpu_clocks_stop; gpu_clocks_of "$2/clk.csv"; gpu_clocks_of "$2/none.csv"' _ "$root" "$work")
check "gpu_clocks.sh: the older reasons field where the newer is refused" has "$clk" "q=index,utilization.gpu,clocks.sm,clocks_throttle_reasons.active"
check "gpu_clocks.sh: busy samples only, their clock, cap and slowdown shares" has "$clk" "1780 MHz, capped 67 %, slowed 33 %"
check "gpu_clocks.sh: no samples" grep -qx -- "-" <<<"$clk"
check "gpu_clocks.sh: no nvidia-smi, no sampling" sh -c "! TD_NVIDIA_SMI=/nonexistent bash -c 'source \"$root/bench/gpu_clocks.sh\"; gpu_clocks_init'"
bar=$(mktemp -d)
check "bench-serve --barrier without N: refused" sh -c "! '$bin/bench-serve' --engine --model '$root/tests/data/toy-numbers-t5' --barrier '$bar' 2>/dev/null"
rm -rf "$bar"
((failed == 0)) || { echo "$failed checks failed; logs in $work" >&2; exit 1; }
