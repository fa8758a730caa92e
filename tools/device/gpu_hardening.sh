#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine, with a build packed by tools/device/pack_gpu.sh in .dev/ and the Debian
# libraries in .debs/: the bad-input matrix of the C API on the cuda placement
# (kvsieve_backend_error_tests, plain and under memcheck), and compute-sanitizer's racecheck and
# synccheck over the kernel and session tests (--small). Logs under $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvs_out}
mkdir -p "$OUT"
. tests/bindings/debs_sysroot.sh
export LD_LIBRARY_PATH=$PWD/.dev/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
T=.dev/bin
rc=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
echo "== backend error matrix"
timeout 200 $T/kvsieve_backend_error_tests 2>&1 | tee "$OUT/backend_errors.log" | grep -vE '^PASS' | tail -25 || rc=1
( timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 $T/kvsieve_backend_error_tests >"$OUT/memcheck_errors.log" 2>&1
  echo "memcheck backend_error_tests exit $?" >>"$OUT/sanitizers.txt" ) &
( timeout 240 compute-sanitizer --tool racecheck --error-exitcode 9 $T/kvsieve_cuda_tests --small >"$OUT/racecheck.log" 2>&1
  echo "racecheck cuda_tests exit $?" >>"$OUT/sanitizers.txt" ) &
( timeout 240 compute-sanitizer --tool synccheck --error-exitcode 9 $T/kvsieve_cuda_tests --small >"$OUT/synccheck.log" 2>&1
  echo "synccheck cuda_tests exit $?" >>"$OUT/sanitizers.txt" ) &
wait
grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|passed," "$OUT"/memcheck_errors.log "$OUT"/racecheck.log "$OUT"/synccheck.log | tail -8
cat "$OUT/sanitizers.txt"
grep -q "exit [^0]" "$OUT/sanitizers.txt" && rc=1
echo "gpu_hardening exit $rc"
exit $rc
