#!/usr/bin/env bash
# Tensor / pipeline parallel checks and benchmarks on a machine with 2+ GPUs:
#   tests/gpu/run_parallel.sh PACKDIR OUTDIR [steps...]
# steps: cluster1 cluster comm parallel tp1 tp2 tp2-nccl pp2 fixtures xl-exchange (default: all but fixtures
# and xl-exchange; xl-exchange: the Flan-T5-XL step at TP=1, 2 and 4 with the fused row-parallel
# all-reduce and the logits' all-gather on peer memory against each off, two interleaved rounds)
set -u
pack=$1 out=$2
shift 2
steps=${*:-cluster1 cluster comm parallel tp1 tp2 tp2-nccl pp2}
source "$pack/env.sh"
mkdir -p "$out"
nvidia-smi -L | tee "$out/device.txt"
summary=()
run() { # name timeout command...
  local name=$1 t=$2
  shift 2
  local t0=$SECONDS
  timeout "$t" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc in $((SECONDS - t0)) s")
  tail -n 12 "$out/$name.log"
  cp bench/RESULTS.md "$out/RESULTS.md"
  printf '%s\n' "${summary[@]}" >"$out/summary.txt"
}
for s in $steps; do
  case $s in
    cluster1)
      run cluster-1gpu 120 env TANDEM_BIN="$pack/bin" deploy/local.sh --device cuda --demo --run-dir /tmp/run-1gpu
      tar -C /tmp -czf "$out/run-1gpu.tgz" run-1gpu ;;
    cluster)
      run cluster-tp2 120 env TANDEM_BIN="$pack/bin" deploy/local.sh --device cuda --decode-tp 2 --demo --run-dir /tmp/run-tp2
      tar -C /tmp -czf "$out/run-tp2.tgz" run-tp2 ;;
    comm) run comm 60 test_cuda_comm --verbose ;;
    parallel) run parallel 200 test_cuda_parallel --jobs 1 --verbose ;;
    tp1) run bench-tp1 120 bench-decode-step --batches 1,16,64 ;;
    tp2) run bench-tp2 120 bench-decode-step --tp 2 --batches 1,16,64 ;;
    tp2-nccl) run bench-tp2-nccl 120 env TANDEM_CUDA_CUSTOM_ALLREDUCE=0 bench-decode-step --tp 2 --batches 1,64 --no-record ;;
    pp2) run bench-pp2 120 bench-decode-step --pp 2 --batches 1,16,64 ;;
    xl-exchange)
      xl="bench-decode-step --shape flan-t5-xl --model-dir /tmp/xl --enc-len 512 --ctx 64 --batches 1,4,64 --no-record"
      run xl-tp1 300 $xl
      for round in 1 2; do
        for tp in 2 4; do
          run "xl-tp$tp-r$round" 120 $xl --tp "$tp"
          run "xl-tp$tp-r$round-unfused" 120 env TANDEM_CUDA_FUSE_ALLREDUCE=0 $xl --tp "$tp"
          run "xl-tp$tp-r$round-nccl-gather" 120 env TANDEM_CUDA_CUSTOM_ALLGATHER=0 $xl --tp "$tp"
        done
      done ;;
    fixtures)
      run fixtures 120 sh -c "mkdir -p /tmp/fx2 && PYTHONUNBUFFERED=1 python3 tests/tools/make_fixtures.py /tmp/fx2 t5-gated-untied-head"
      tar -C /tmp -czf "$out/fixtures.tgz" fx2 ;;
  esac
done
cp bench/RESULTS.md "$out/RESULTS.md"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
