#!/usr/bin/env bash
# Runs the GPU checks of the CUDA backend on a GPU machine, from the
# repository root, with the programs packed by shared/tools/device-pack:
#   tests/gpu/run_gpu.sh PACKDIR OUTDIR [ops] [model] [bench] [memcheck] [racecheck]
# (no step named: all). Logs go to OUTDIR; bench results to OUTDIR/results.md.
set -u
pack=$1 out=$2
shift 2
steps=${*:-ops model comm bench memcheck racecheck racecheck2}
source "$pack/env.sh"
mkdir -p "$out"
# the fixture tests read tests/data through the build machine's absolute path
data=$(strings "$pack/bin/test_cuda_model" | grep -m1 '/tests/data$' || true)
root=${data%/tests/data}
if [ -n "$data" ] && [ ! -e "$root" ]; then
  mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"
fi
nvidia-smi -L
summary=()
# one log per group, so that few files come back
group() { case $1 in ops | model | comm) echo tests ;; memcheck | racecheck*) echo sanitizer ;; *) echo "$1" ;; esac; }
run() { # name timeout command...
  local name=$1 t=$2 log
  shift 2
  log="$out/$(group "$name").log"
  local t0=$SECONDS
  echo "==== $name" >>"$log"
  timeout "$t" "$@" >"$log.part" 2>&1
  local rc=$?
  cat "$log.part" >>"$log"
  summary+=("$name: rc=$rc in $((SECONDS - t0)) s")
  tail -n 25 "$log.part"
  rm -f "$log.part"
}
for s in $steps; do
  case $s in
    ops) run ops 150 "$pack/bin/test_cuda_ops" --jobs 4 --verbose ;;
    comm) run comm 120 "$pack/bin/test_cuda_comm" --verbose ;;
    model) run model 100 "$pack/bin/test_cuda_model" --jobs 4 --verbose ;;
    bench) run bench 180 "$pack/bin/bench_cuda_kernels" --results "$out/results.md" ;;
    memcheck) run memcheck 220 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$pack/bin/test_cuda_ops" --jobs 4 ;;
    racecheck) run racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
      "$pack/bin/test_cuda_ops" --jobs 4 --filter 'cuda/@(graph_replay|kv_write_copy_read|topk_logprobs|unshard_cols|sample|attn_paged|norm|embed_rows_im2col|gated_act)' ;;
    racecheck2) run racecheck2 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
      "$pack/bin/test_cuda_ops" --jobs 4 --filter 'cuda/attn_dense' ;;
    ncu) run ncu 120 ncu --clock-control none --kernel-name regex:attn_kernel --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section SourceCounters --section LaunchStats \
      "$pack/bin/bench_cuda_kernels" --only "attn_dense +T5" --quick ;;
  esac
done
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
