#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
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
rc=$?
# The same binary under compute-sanitizer memcheck (small kernel sizes; sessions as above).
if command -v compute-sanitizer >/dev/null; then
  timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 .dev/kvsieve_cuda_tests --small \
    >"$OUT/memcheck.log" 2>&1
  m=$?
  grep -E 'ERROR SUMMARY' "$OUT/memcheck.log"
  [ $m -ne 0 ] && rc=1
fi
exit $rc
