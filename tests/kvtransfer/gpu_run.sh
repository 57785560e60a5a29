#!/usr/bin/env bash
# kvtransfer on the GPU machine: the GPU checks, then the benchmark.
#   tests/kvtransfer/gpu_run.sh PACKDIR staged|nccl|ipc|all COMMIT [bench args...]
# PACKDIR comes from ../shared/tools/device-pack (gpu_kvx, bench_kv_transfer).
# gpu_kvx modes: gather (one GPU), staged (one GPU), nccl (gather + two GPUs),
# ipc (CUDA IPC on one GPU, and between two when present), all.
# Bench args, e.g. --only ipc: one path of bench_kv_transfer.
# Logs and the benchmark's results section are written to $OUT.
set -u
pack=$1; what=$2; commit=$3; shift 3
source "$pack/env.sh"
export UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-error} TANDEM_LOG=${TANDEM_LOG:-warn} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
out=${OUT:-/tmp}
nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
echo "nproc $(nproc); shmmax $(cat /proc/sys/kernel/shmmax 2>/dev/null); /dev/shm $(df -h /dev/shm | tail -1)"
timeout 240 "$pack/bin/gpu_kvx" "$what" 2>&1 | tee "$out/gpu_kvx_$what.log"
echo "gpu_kvx exit ${PIPESTATUS[0]}"
timeout 300 "$pack/bin/bench_kv_transfer" --results "$out/kvx_results.md" --commit "$commit" "$@" 2>&1 | tee "$out/bench_$what.log"
echo "bench exit ${PIPESTATUS[0]}"
