#!/usr/bin/env bash
# Cluster configurations against each other on one machine with bench-serve: each
# configuration's cluster is started with deploy/local.sh, warmed, measured with bursts
# (every request at once) and closed loops (a fixed number in flight), and stopped; a
# table of output tokens a second, with each run's ratio to the first configuration's, and
# each configuration's workers' busy shares in its last run (which pool is short).
#
#   bench/serve_configs.sh --model DIR [--workload trt|whisper|FILE] [--device cuda|cpu]
#       [--burst N] [--closed C [--closed-requests N]] [--rate R [--rate-requests N]] [--runs K]
#       [--configs "NAME=LOCAL.SH FLAGS;NAME=..."] [--engine N [--engine-parallel]]
#       [--client-spin-us N] [--out DIR]
#
# --burst N: N requests at once (0: none; default 512); --closed C: C in flight, 3 x C
# requests or --closed-requests N (0: none; default 256); --rate R: Poisson arrivals at R requests a second, N of them
# (default 1024; off by default); --runs K: each measure K times, each its own seed
# (default 2). Configurations: "agg=--encoders 0 --decodes 4;e1d3=--encoders 1 --decodes 3"
# (the default: every worker with every role on each GPU, against one encoder GPU).
# --engine N: also the engine in process on one device (the first GPU) with 1/N of each load, K + 1
# runs in one process (bench-serve --runs; the first, cold, dropped), and a second table: each
# configuration's runs against N times the engine's warm runs (N: the devices the clusters use). The
# engine's run r + 1 takes part 0 of N of the clusters' run r's own requests (bench-serve --part: requests
# 0, N, 2N, ...), so that both measure the same draw of lengths (a burst's time follows its longest outputs).
# --engine-parallel: the N engines instead, one a device (the first N of CUDA_VISIBLE_DEVICES, else 0..N-1),
# engine i with part i of each load (together the clusters' requests), every run started together (bench-serve --barrier):
# what N GPUs of this host deliver in process at once, their slowest ending each run, as a cluster's
# slowest worker ends its run.
# --client-spin-us N: bench-serve against each cluster polls N us without sleeping while answers are
# due (bench-serve --spin-us), as a latency-minded client (the gateway's --spin-us) does.
# On CUDA with nvidia-smi, a last table: the GPUs' clocks while each run measured (bench/gpu_clocks.sh:
# mean SM clock of the busy samples, shares held down by the power cap and by slowdowns).
# Programs from $TANDEM_BIN (default build/bin). Each run's full bench-serve output is in
# --out (default a temporary folder).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
model="" workload=trt device=cuda burst=512 closed=256 closed_n=0 rate=0 rate_n=1024 runs=2 out="" engines=0
eng_par=0 client_spin=0
configs="agg=--encoders 0 --prefills 0 --decodes 4;e1d3=--encoders 1 --prefills 0 --decodes 3"
while (($#)); do
  case $1 in
    --model) model=$2; shift 2 ;;
    --workload) workload=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --burst) burst=$2; shift 2 ;;
    --closed) closed=$2; shift 2 ;;
    --closed-requests) closed_n=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --rate-requests) rate_n=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --configs) configs=$2; shift 2 ;;
    --engine) engines=$2; shift 2 ;;
    --engine-parallel) eng_par=1; shift ;;
    --client-spin-us) client_spin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "serve_configs.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n $model && -d $model ]] || { echo "serve_configs.sh: --model DIR is required" >&2; exit 2; }
for v in "$burst" "$closed" "$closed_n" "$runs" "$rate_n" "$engines"; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "serve_configs.sh: --burst, --closed, --closed-requests, --rate-requests and --runs take counts" >&2; exit 2; }
done
((closed_n)) || closed_n=$((3 * closed))
if ((engines)) && ((burst && burst / engines == 0 || closed && (closed / engines == 0 || closed_n / engines == 0))); then
  echo "serve_configs.sh: --engine $engines: each load divided by $engines must leave at least one request" >&2
  exit 2
fi
[[ $rate =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "serve_configs.sh: --rate takes requests a second" >&2; exit 2; }
[[ $client_spin =~ ^[0-9]{1,6}$ ]] && ((client_spin <= 100000)) ||
  { echo "serve_configs.sh: --client-spin-us must be 0 to 100000" >&2; exit 2; }
((eng_par == 0 || engines > 0)) || { echo "serve_configs.sh: --engine-parallel goes with --engine N" >&2; exit 2; }
off_kind() { # whether a measure is off
  case $1 in burst) [[ $burst == 0 ]] ;; closed) [[ $closed == 0 ]] ;; rate) [[ $rate == 0 || $rate == 0.0 ]] ;; esac
}
bin=${TANDEM_BIN:-$root/build/bin}
[[ -x $bin/bench-serve ]] || { echo "serve_configs.sh: no $bin/bench-serve (set TANDEM_BIN)" >&2; exit 2; }
export TANDEM_BIN=$bin
out=${out:-$(mktemp -d)}
mkdir -p "$out"
source "$root/bench/gpu_clocks.sh"
clocks=0
[[ $device == cuda ]] && gpu_clocks_init && clocks=1
rows=() first=() uses=() vs=() vs_own=() clk_rows=() eclk=()
row_of() { grep -E '^\| (all at once|[0-9]+ in flight|Poisson [0-9.]+/s) \| [0-9]+/' "$1" | head -1 | awk -F'|' '{gsub(/ /, "", $5); print $5}'; }
# TTFT and TPOT p90 of a run (open loop: the rate is given, latency is the measure)
p90s() { grep -E '^\| Poisson [0-9.]+/s \| [0-9]+/' "$1" | head -1 |
  awk -F'|' '{split($7, a, " / "); split($8, b, " / "); printf "TTFT p90 %s ms, TPOT p90 %s ms", a[2], b[2]}'; }
# each worker's busy share in a run, with its mean decode batch or its inputs an encoder run (bench-serve's
# "How the workers spent the run" table)
use_of() { awk -F'|' '/^How the workers spent the run/ {on = 1; next}
  on && /^\| (all at once|[0-9]+ in flight|Poisson [0-9.]+\/s) \| / {
    gsub(/ /, "", $3); gsub(/ /, "", $4); gsub(/ /, "", $6); gsub(/ /, "", $10); gsub(/ /, "", $11)
    out = out (out ? ", " : "") $3 " " $4 " %" ($6 + 0 > 0 ? " (batch " $6 ")" : "") ($10 + 0 > 0 ? " (" $10 " a run)" : "") \
      ($11 + 0 > 0 ? " (projecting " $11 " %)" : "") }
  END {print out}' "$1"; }
# bench-serve's "Which side was short" line of the run (a split cluster's; "-" for an aggregated one)
short_of() { awk '/^Which side was short:/ {on = 1; next} on && /^- / {sub(/^- [^:]*: /, ""); s = $0} END {print s ? s : "-"}' "$1"; }
# the engine's warm runs: eng[k] is N x its tokens a second, k counting as the configurations' cells do;
# with --engine-parallel, eng[k] the engines' tokens over the slowest one's time and own[k] the sum of each
# engine's own tokens a second (N x one GPU's throughput on the same requests)
eng=() own=()
if ((engines)); then
  k=0
  for kind in burst closed; do
    off_kind $kind && continue
    # the cluster's own inputs (its run r: bursts seed 1000 + 10 r, closed loops 5 + r), the engine's run r + 1 its
    # part of them (the first run, cold and dropped, on inputs no cluster run takes)
    f=$out/engine-$kind.txt extra=(--requests "$burst" --seed 1000 --seed-step 10)
    [[ $kind == closed ]] && extra=(--requests "$closed_n" --concurrency $((closed / engines)) --seed 5)
    dev=${CUDA_VISIBLE_DEVICES:-0}
    gpu_clocks_start "$out/clocks-engine-$kind.csv"
    if ((eng_par)); then
      IFS=',' read -ra devs <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((engines - 1)))}"
      ((${#devs[@]} >= engines)) || { echo "serve_configs.sh: --engine-parallel $engines: ${#devs[@]} devices" >&2; exit 2; }
      bar=$(mktemp -d) pids=()
      for ((i = 0; i < engines; i++)); do
        CUDA_VISIBLE_DEVICES=${devs[i]} "$bin/bench-serve" --engine --device "$device" --model "$model" \
          --workload "$workload" "${extra[@]}" --part "$i/$engines" --runs $((runs + 1)) --barrier "$bar:$engines" \
          >"$out/engine-$kind-$i.txt" 2>&1 &
        pids+=($!)
      done
      wait "${pids[@]}"
      rm -rf "$bar"
    else
      CUDA_VISIBLE_DEVICES=${dev%%,*} "$bin/bench-serve" --engine --device "$device" --model "$model" \
        --workload "$workload" "${extra[@]}" --part "0/$engines" --runs $((runs + 1)) >"$f" 2>&1
    fi
    gpu_clocks_stop
    eclk+=("$kind: $(gpu_clocks_of "$out/clocks-engine-$kind.csv")")
    for r in $(seq "$runs"); do
      pat="^\| (all at once|[0-9]+ in flight), run $((r + 1)) \| [0-9]+/"
      if ((eng_par)); then
        # together: every engine's tokens over the slowest engine's duration (requests / requests a second),
        # and the sum of their own rates
        read -r v own[$k] < <(for ((i = 0; i < engines; i++)); do grep -E "$pat" "$out/engine-$kind-$i.txt" | head -1; done |
          awk -F'|' -v n="$engines" '{split($3, ok, "/"); rps = $4 + 0; tps = $5 + 0; if (rps <= 0) next
            d = ok[1] / rps; tok += tps * d; if (d > dmax) dmax = d; s += tps; c++}
            END {if (c == n && dmax > 0) printf "%.0f %.0f\n", tok / dmax, s}')
      else
        v=$(grep -E "$pat" "$f" | head -1 | awk -F'|' -v n="$engines" '{gsub(/ /, "", $5); if ($5 != "") print $5 * n}')
      fi
      eng[$k]=$v
      k=$((k + 1))
    done
  done
fi
# a table row's cells from words: "a | b | c"
join_cells() { local IFS='|'; echo "$*" | sed 's/|/ | /g'; }
# a configuration's row of its cells over a yardstick's (an array's name: eng or own), cell by cell
ratio_row() {
  local -n base=$2
  local e=() j v
  for ((j = 0; j < ${#base[@]}; j++)); do
    v=${cells[$j]%% *}
    e+=("$(awk -v a="$v" -v b="${base[$j]:-0}" 'BEGIN { if (a + 0 > 0 && b > 0) printf "%.2fx", a / b; else print "-" }')")
  done
  echo "| $1 | $(join_cells "${e[@]}") |"
}
IFS=';' read -ra list <<<"$configs"
for entry in "${list[@]}"; do
  name=${entry%%=*} flags=${entry#*=}
  run=$out/run-$name
  # shellcheck disable=SC2086 # the configuration's flags are words
  setsid bash "$root/deploy/local.sh" --model "$model" --device "$device" --no-gateway --run-dir "$run" $flags \
    >"$out/$name.local.log" 2>&1 &
  lp=$!
  for _ in $(seq 600); do grep -q '^logs' "$out/$name.local.log" && break; kill -0 $lp 2>/dev/null || break; sleep 0.5; done
  # the local link where local.sh gives one (what the figures since 2026-11-27 went through)
  ep=$(awk '/^router-local local:/ { print $2; exit }' "$out/$name.local.log")
  [[ -n $ep ]] || ep=$(grep -m1 -E '^router tcp:' "$out/$name.local.log" | awk '{print $2}')
  if [[ -z $ep ]]; then
    echo "serve_configs.sh: $name did not start: $(tail -1 "$out/$name.local.log")" >&2
    kill -TERM -- -$lp 2>/dev/null
    continue
  fi
  # bench-serve against a cluster does no CPU math: one OpenBLAS thread (on a 64-core host it used 5 s of
  # system time in a 0.6 s run, most likely its BLAS pool starting on every core beside the router and
  # the workers)
  OPENBLAS_NUM_THREADS=1 "$bin/bench-serve" --router "$ep" --model "$model" --workload "$workload" --requests 32 \
    --seed 99 >/dev/null 2>&1
  cells=() clk=()
  k=0
  for kind in burst closed rate; do
    n=$burst extra=() off=0
    [[ $kind == closed ]] && n=$closed_n extra=(--concurrency "$closed") off=1
    [[ $kind == rate ]] && n=$rate_n extra=(--rate "$rate") off=2
    off_kind $kind && continue
    for r in $(seq "$runs"); do
      f=$out/$name-$kind-$r.txt
      # the engine's warm run r takes its part of these same inputs (bursts seed 1000 + 10 r, closed loops 5 + r),
      # so that a burst's longest outputs, and a BART input's length in a TTFT, are the same draw; each kind
      # its own seeds (a cluster's encoder cache lives across its runs)
      seed=$((1000 * (off + 1) + 10 * r))
      [[ $kind == closed ]] && seed=$((5 + r))
      gpu_clocks_start "$out/clocks-$name-$kind-$r.csv"
      OPENBLAS_NUM_THREADS=1 "$bin/bench-serve" --router "$ep" --model "$model" --workload "$workload" \
        --requests "$n" "${extra[@]}" --spin-us "$client_spin" \
        --seed "$seed" >"$f" 2>&1
      gpu_clocks_stop
      clk+=("$(gpu_clocks_of "$out/clocks-$name-$kind-$r.csv")")
      v=$(row_of "$f")
      base=${first[$k]:-}
      [[ -z $base ]] && first[$k]=$v base=$v
      ratio=$(awk -v a="${v:-0}" -v b="${base:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
      if [[ $kind == rate ]]; then
        cells+=("${v:-failed} ($(p90s "$f"))")
      else
        cells+=("${v:-failed} (${ratio}x)")
      fi
      k=$((k + 1))
    done
  done
  rows+=("| $name | $flags | $(join_cells "${cells[@]}") |")
  clk_rows+=("| $name | $(join_cells "${clk[@]}") |")
  if ((engines)); then
    vs+=("$(ratio_row "$name" eng)")
    if ((eng_par)); then vs_own+=("$(ratio_row "$name" own)"); fi
  fi
  uses+=("| $name | $(use_of "$f") | $(short_of "$f") |")
  rm -f "$run"/*.pid
  kill -TERM -- -$lp 2>/dev/null
  sleep 3
  kill -KILL -- -$lp 2>/dev/null
done
head="| configuration | local.sh flags |"
sep="|---|---|"
for kind in burst closed rate; do
  off_kind $kind && continue
  for r in $(seq "$runs"); do
    case $kind in
      burst) head+=" burst of $burst, run $r |" ;;
      closed) head+=" $closed in flight, run $r |" ;;
      rate) head+=" $rate req/s, run $r |" ;;
    esac
    sep+="---|"
  done
done
echo "Output tokens a second, $workload workload, model $(basename "$model"), $(date -u +%F) (ratio: to the first configuration's same run; at a rate, the p90 latencies):"
echo
echo "$head"
echo "$sep"
printf '%s\n' "${rows[@]}"
echo
if ((engines)); then
  ehead="| configuration |" esep="|---|"
  for kind in burst closed; do
    off_kind $kind && continue
    for r in $(seq "$runs"); do
      [[ $kind == burst ]] && ehead+=" burst of $burst, run $r |" || ehead+=" $closed in flight, run $r |"
      esep+="---|"
    done
  done
  if ((eng_par)); then
    echo "Against $engines engines at once: each run over the engines' warm run of the same index (one engine a device, each with its part of the clusters' requests of that run, their runs started together; every engine's tokens over the slowest one's duration; bursts and closed loops: $(IFS=' '; echo "${eng[*]}") tok/s):"
  else
    echo "Against $engines engines: each run over $engines x the engine's warm run of the same index (the engine on one device with 1/$engines of the load; bursts and closed loops; $engines x its tokens a second: $(IFS=' '; echo "${eng[*]}")):"
  fi
  echo
  echo "$ehead"
  echo "$esep"
  printf '%s\n' "${vs[@]}"
  echo
  if ((eng_par)); then
    echo "Against $engines x one GPU: each run over the sum of the same engines' own tokens a second (each over its own duration: $(IFS=' '; echo "${own[*]}") tok/s):"
    echo
    echo "$ehead"
    echo "$esep"
    printf '%s\n' "${vs_own[@]}"
    echo
  fi
fi
echo "How the workers spent each configuration's last run (busy: inside engine steps, of the run; the short pool is the busy one):"
echo
echo "| configuration | workers | which side was short |"
echo "|---|---|---|"
printf '%s\n' "${uses[@]}"
echo
if ((clocks)); then
  echo "GPU clocks while each run measured (every GPU every 200 ms, the samples at 50 % utilisation or more: mean SM clock, shares held down by the power cap and by thermal or hardware slowdowns)$( ((engines)) && echo "; the engines, all their runs: $(IFS=';'; echo "${eclk[*]}" | sed 's/;/; /g')"):"
  echo
  echo "| configuration |${head#| configuration | local.sh flags |}"
  echo "|---|${sep#|---|---|}"
  printf '%s\n' "${clk_rows[@]}"
  echo
fi
echo "bench-serve outputs: $out"
