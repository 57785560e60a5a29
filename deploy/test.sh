#!/usr/bin/env bash
# Installs dependencies, builds (release with CUDA when nvcc is present, and
# an ASan+UBSan CPU build) and runs every CPU test under the sanitizers.
#   deploy/test.sh [ctest args...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/deploy/setup.sh" all
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/lsan.supp}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
cd "$root/build-asan"
ctest --output-on-failure --timeout 900 "$@"
