#!/usr/bin/env bash
# Installs Tandem's dependencies from Debian packages (when missing) and builds.
#   deploy/setup.sh [release|asan|all]     (default: release)
# Builds go to build/ (release, CUDA when nvcc is found) and build-asan/
# (AddressSanitizer + UBSan, CPU only). Idempotent: re-running only rebuilds.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
what=${1:-release}

# one package a line: the parts of the project add theirs
packages=(
  build-essential cmake pkg-config
  libzmq3-dev libprotobuf-c-dev protobuf-c-compiler libucx-dev   # cluster
  libcriterion-dev                                                # tests
  libopenblas-dev                                                 # CPU GEMM
  libcjson-dev uthash-dev libxxhash-dev                           # JSON, hash tables, hashing
  libsndfile1-dev libsoxr-dev libkissfft-dev                      # audio: decoding, resampling, FFT
  zlib1g-dev                                                      # long-form audio: transformers' compression ratio
  libpcre2-dev libutf8proc-dev libsentencepiece-dev               # tokenizers
  libmicrohttpd-dev libcurl4-openssl-dev curl                     # gateway (HTTP server), bench-serve --gateway, its test
  openssh-server iproute2 util-linux                              # cluster.sh over ssh; its test: sshd in network namespaces (ip, unshare)
  prometheus jq                                                   # the router's /metrics scraped by a real Prometheus (its test)
  iproute2                                                        # tests/faults: ip netns, tc (a slow or lossy link)
  clang libclang-rt-dev                                           # libFuzzer targets (asan build): Debian's default clang and its runtime
  slurm-wlm munge                                                 # deploy/slurm: a real single-node Slurm in its test
  yq                                                              # deploy/k8s: its test parses the manifests
)
# the gateway's test runs the openai Node client (a Node from elsewhere brings its own npm)
command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

jobs=$(nproc 2>/dev/null || echo 2)
build() {  # dir, cmake args...
  local dir=$1; shift
  if [[ ! -f $root/$dir/CMakeCache.txt ]]; then
    cmake -S "$root" -B "$root/$dir" "$@" >/dev/null
  fi
  cmake --build "$root/$dir" -j"$jobs"
}
case $what in
  release) build build -DCMAKE_BUILD_TYPE=Release ;;
  asan) build build-asan -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=ON -DTANDEM_CUDA=OFF ;;
  all) build build -DCMAKE_BUILD_TYPE=Release
       build build-asan -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=ON -DTANDEM_CUDA=OFF ;;
  *) echo "usage: $0 [release|asan|all]" >&2; exit 2 ;;
esac
