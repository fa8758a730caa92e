#!/usr/bin/env bash
# On the GPU machine: runs the CMake-built CUDA test binary (kernels + sessions through the C API
# against the CPU backend), carried with the shared libraries the device lacks (oneDNN, OpenBLAS,
# mimalloc, xxHash) in .dev/ (see docs/perf.md for how .dev is made). Logs under $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvs_out}
mkdir -p "$OUT" /tmp/kvs_libs
tar xJf .dev/libs.tar.xz -C /tmp/kvs_libs
export LD_LIBRARY_PATH=/tmp/kvs_libs/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
set -o pipefail
.dev/kvsieve_cuda_tests "$@" 2>&1 | tee "$OUT/cuda_tests.log" | grep -vE '^PASS' | tail -60
