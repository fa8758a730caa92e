#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the CUDA attention kernels, runs their tests (also under compute-sanitizer on small
# sizes) and the side-by-side benchmark against torch SDPA. Meant for the GPU machine (`run`),
# from the repository root; logs go to $OUT (default /tmp/kvs_cuda_out).
#
#   tools/device/cuda_check.sh                 # build + test + sanitize + bench
#   PREBUILT=1 tools/device/cuda_check.sh      # use binaries already in $BUILD (built elsewhere
#                                              # with the same commands, carried along)
#   STEPS="test bench" tools/device/cuda_check.sh   # any of: build test sanitize bench
#   BENCH_ARGS=--quick ...                     # fewer benchmark cases
#   OLD_LIB=path/to/old.so ...                 # also time the previous kernels' shim (before/after)
#   STEPS="test+sanitize bench"                # tests and memcheck at the same time (saves device
#                                              # time; not for timings), then the benchmark
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvs_cuda_out}
BUILD=${BUILD:-.cudabuild}
NVCC=${NVCC:-nvcc}
STEPS=${STEPS:-build test sanitize bench}
[ "${PREBUILT:-0}" = 1 ] && STEPS=${STEPS//build/}
mkdir -p "$OUT" "$BUILD"
FLAGS="-std=c++17 -O3 -arch=sm_90 -I src -I include"
rc=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has build; then
  echo "== build"
  $NVCC $FLAGS -Xcompiler -fPIC -Xptxas -v -c src/backends/cuda/cuda_attention.cu -o "$BUILD/attn.o" \
    >"$BUILD/ptxas.log" 2>&1 &
  p1=$!
  $NVCC $FLAGS -DKVS_NO_SESSION_TESTS -c tests/cuda/test_cuda_attention.cu -o "$BUILD/test.o" &
  p2=$!
  $NVCC $FLAGS -Xcompiler -fPIC -c bench/cuda_decode_bench.cu -o "$BUILD/shim.o" &
  p3=$!
  wait $p1 || { echo "build failed: attn"; tail -50 "$BUILD/ptxas.log"; exit 1; }
  wait $p2 && wait $p3 || { echo "build failed"; exit 1; }
  $NVCC -arch=sm_90 "$BUILD/attn.o" "$BUILD/test.o" -o "$BUILD/test_cuda_attention" || exit 1
  $NVCC -arch=sm_90 -shared -Xlinker -Bsymbolic "$BUILD/attn.o" "$BUILD/shim.o" -o "$BUILD/libkvs_cuda_bench.so" || exit 1
fi
cp "$BUILD/ptxas.log" "$OUT/" 2>/dev/null

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  nvcc --version | tail -1; } >"$OUT/env.txt" 2>&1

run_tests() {
  echo "== tests"
  set -o pipefail
  timeout 300 "$BUILD/test_cuda_attention" 2>&1 | tee "$OUT/tests.log" | grep -v '^PASS'
  local t=$?
  set +o pipefail
  return $t
}
run_sanitize() {
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/test_cuda_attention" --small \
    >"$OUT/memcheck.log" 2>&1
  local s=$?
  echo "== compute-sanitizer memcheck (--small)"
  grep -E "ERROR SUMMARY|passed|FAIL" "$OUT/memcheck.log" | tail -5
  echo "memcheck exit $s"
  return $s
}

if has test+sanitize; then
  run_sanitize >"$OUT/memcheck.summary" 2>&1 &
  ps=$!
  run_tests || rc=1
  wait $ps || rc=1
  cat "$OUT/memcheck.summary"
fi
if has test; then run_tests || rc=1; fi

if has bench; then
  echo "== bench"
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/cuda_sdpa_compare.py --lib "$BUILD/libkvs_cuda_bench.so" \
    ${OLD_LIB:+--old-lib "$OLD_LIB"} --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || rc=1
fi

if has sanitize; then run_sanitize || rc=1; fi
echo "cuda_check exit $rc"
exit $rc
