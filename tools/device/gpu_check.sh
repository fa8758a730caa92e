#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine, from the repository root: builds the library with CUDA, the CUDA tests, the
# CLI and the Python binding into build-gpu (kvsieve's Debian build dependencies carried as .deb
# files in .debs/, unpacked into a private sysroot: tests/bindings/debs_sysroot.sh), then
#   test      kvsieve_cuda_tests (kernels: attention, radix top-k, Quest; sessions; csattention's
#             once more with KVS_CSA_LIST_ROOM=1) and the backend consistency harness
#             (tests/backends) with the stories260K trace
#   sanitize  both under compute-sanitizer memcheck (--small)
#   bench     bench/gpu_bench.py (its default table, JSON) and `kvsieve bench --backend cuda`
#   profile   tools/device/profile_step.py $PROFILE_CASES (kernels of one step and their GPU time)
# Logs and JSON under $OUT (default /tmp/kvs_out).
# With a build made elsewhere in .dev/ (tools/device/pack_gpu.sh: the installed library and CLI in
# .dev/prefix, the test programs in .dev/bin), the build step compiles only the Python binding,
# against .dev/prefix.
#   STEPS="build test sanitize bench" tools/device/gpu_check.sh      (the default: all four)
#   BENCH_ARGS="--method quest --context 131072 --batch 1 --budget 0.05"   (one case instead of the table)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvs_out}
STEPS=${STEPS:-build test sanitize bench}
mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }
rc=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/env.txt"
. tests/bindings/debs_sysroot.sh
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
PY=$(command -v python3)
[ -d /tmp/kvs_pyb/bindings/python ] && PYB=/tmp/kvs_pyb/bindings/python  # a binding built by an earlier step
B=build-gpu
if [ -d .dev/prefix ]; then
  B=.dev
  export LD_LIBRARY_PATH=$PWD/.dev/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if has build && [ -d .dev/prefix ]; then
  echo "== build (the Python binding against .dev/prefix)"
  t0=$(date +%s)
  cmake -S . -B /tmp/kvs_pyb -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD=ON -DKVS_PYTHON_USE_INSTALLED=ON \
    -DKVS_BUILD_TESTS=OFF -DPython3_EXECUTABLE="$PY" "${KVS_SYSROOT_ARGS[@]/#-DCMAKE_PREFIX_PATH=/-DCMAKE_PREFIX_PATH=$PWD/.dev/prefix;}" \
    >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build /tmp/kvs_pyb >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  PYB=/tmp/kvs_pyb/bindings/python
  echo "built in $(( $(date +%s) - t0 )) s"
elif has build; then
  echo "== build"
  t0=$(date +%s)
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVS_WITH_CUDA=ON -DKVS_BUILD_PYTHON=ON \
    -DPython3_EXECUTABLE="$PY" "${KVS_SYSROOT_ARGS[@]}" >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build-gpu --target kvsieve kvsieve_cuda_tests kvsieve_backend_tests kvsieve_python kvsieve_cli \
    >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  echo "built in $(( $(date +%s) - t0 )) s"
  PYB=$PWD/build-gpu/bindings/python
fi
export LD_LIBRARY_PATH=$PWD/build-gpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ "$B" = .dev ]; then T=.dev/bin CLI=.dev/prefix/bin/kvsieve; else T=build-gpu/tests CLI=build-gpu/kvsieve; fi
TRACE=tests/data/stories260k-gen-t512.safetensors
# The tests and the sanitizer runs go side by side (the benchmark runs alone afterwards).
if has sanitize; then
  ( [ "${HARNESS_ONLY:-0}" = 1 ] || { timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      $T/kvsieve_cuda_tests --small >"$OUT/memcheck_cuda.log" 2>&1; echo "memcheck cuda_tests exit $?" >>"$OUT/memcheck.txt"; }
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $T/kvsieve_backend_tests --small \
      >"$OUT/memcheck_backends.log" 2>&1; echo "memcheck backend_tests exit $?" >>"$OUT/memcheck.txt" ) &
  SAN=$!
fi
if has test; then
  set -o pipefail
  if [ "${HARNESS_ONLY:-0}" != 1 ]; then  # HARNESS_ONLY=1: the consistency harness alone
    echo "== kvsieve_cuda_tests"
    timeout 300 $T/kvsieve_cuda_tests 2>&1 | tee "$OUT/cuda_tests.log" | grep -vE '^PASS' | tail -30 || rc=1
    echo "== csattention session tests, the token-ordered lists re-sorted or compacted at every step (KVS_CSA_LIST_ROOM=1)"
    KVS_CSA_LIST_ROOM=1 timeout 200 $T/kvsieve_cuda_tests --only-csattention 2>&1 | tee "$OUT/csa_room1.log" \
      | grep -vE '^PASS' | tail -5 || rc=1
  fi
  echo "== backend consistency harness"
  timeout 300 $T/kvsieve_backend_tests --trace $TRACE 2>&1 | tee "$OUT/backends.log" | grep -vE '^PASS' | tail -30 || rc=1
  set +o pipefail
fi
if has sanitize; then
  wait $SAN
  echo "== compute-sanitizer memcheck (--small)"
  for f in "$OUT"/memcheck_*.log; do
    echo "$(basename "$f"): $(grep -h -E "ERROR SUMMARY" "$f" | tail -1)"
    grep -m 12 -E "Invalid|Program hit|^=========     (at|by|Address)|^========= +Host Frame" "$f" | cut -c1-200
  done
  cat "$OUT/memcheck.txt"
  grep -q "exit [^0]" "$OUT/memcheck.txt" && rc=1
fi
if has bench; then
  echo "== gpu_bench"
  export PYTHONPATH=${PYB:-$PWD/build-gpu/bindings/python} KVS_GEMM=openblas PYTHONUNBUFFERED=1
  timeout ${BENCH_TIMEOUT:-240} "$PY" bench/gpu_bench.py ${BENCH_ARGS:-} --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log" | tail -40 || rc=1
  echo "== kvsieve bench --backend cuda"
  timeout 120 $CLI bench --backend cuda --method quest --context 131072 --budget 0.05 --steps 20 \
    --json "$OUT/cli_bench.json" 2>&1 | tail -8 || rc=1
fi
if has profile; then
  echo "== profile_step"
  export PYTHONPATH=${PYB:-$PWD/build-gpu/bindings/python} KVS_GEMM=openblas PYTHONUNBUFFERED=1
  timeout ${PROFILE_TIMEOUT:-180} "$PY" tools/device/profile_step.py ${PROFILE_ARGS:-} \
    ${PROFILE_CASES:-full:8192:1:0 exact_topk:131072:1:0.05 quest:131072:1:0.05:page_size=16} 2>&1 | tee "$OUT/profile.log" || rc=1
fi
echo "gpu_check exit $rc"
exit $rc
