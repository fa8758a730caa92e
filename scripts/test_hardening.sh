#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Hardening checks (issue 22), run last by scripts/test.sh and runnable alone:
#  1. build-tsan: the library under ThreadSanitizer (gcc); runs tests/stress/tsan_stress.cpp.
#  2. The fuzzers' seed corpora, made by a kvsieve command (tests/fuzz/make_corpus.sh) into
#     build-fuzz/corpus: KVS_CLI when set (scripts/test.sh passes build/kvsieve, already built), else
#     one built in build-tsan.
#  3. build-fuzz: the libFuzzer harnesses of tests/fuzz (clang 19, ASan + UBSan), each run for
#     KVS_FUZZ_SECONDS on its seeds; any crash, sanitizer report, leak or timeout fails.
# Environment: KVS_FUZZ_SECONDS (per fuzzer, default 60; 0 replays the seeds only), KVS_STRESS_SECONDS
# (default 3), KVS_CLI, KVS_JOBS.
# A failing input is saved as build-fuzz/artifacts/<fuzzer>-crash-<sha1> (tests/fuzz/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${KVS_FUZZ_SECONDS:-60}
STRESS_SECONDS=${KVS_STRESS_SECONDS:-3}
# One OpenMP thread: libgomp (oneDNN's threading) is not instrumented, so TSan could not see the
# synchronisation of a parallel region and would report its workers' writes as races (none showed on
# 2 cores, where oneDNN's small GEMMs here stay on one thread; a precaution). The fuzzers run faster too.
export OMP_NUM_THREADS=1
T0=$SECONDS
elapsed() { echo "($((SECONDS - $1)) s)"; }

CLI=${KVS_CLI:-}
TSAN_CLI=OFF
if [ -z "$CLI" ]; then
  TSAN_CLI=ON
  CLI=build-tsan/kvsieve
fi

echo "== hardening: ThreadSanitizer build (build-tsan) =="
t=$SECONDS
KVS_HARDENING=1 scripts/setup.sh build-tsan -DKVS_TSAN=ON -DKVS_WITH_CUDA=OFF -DKVS_BUILD_TESTS=OFF \
  -DKVS_BUILD_CLI=$TSAN_CLI -DCMAKE_BUILD_TYPE=RelWithDebInfo
echo "build-tsan $(elapsed $t)"

echo "== hardening: ThreadSanitizer stress test =="
t=$SECONDS
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  build-tsan/tests/stress/kvsieve_tsan_stress "$STRESS_SECONDS"
echo "tsan_stress $(elapsed $t)"

echo "== hardening: fuzz seed corpora ($CLI synth / build) =="
t=$SECONDS
TSAN_OPTIONS="halt_on_error=1 ${TSAN_OPTIONS:-}" tests/fuzz/make_corpus.sh "$CLI" build-fuzz/corpus
echo "corpus $(elapsed $t)"

echo "== hardening: libFuzzer build (build-fuzz, clang 19, ASan + UBSan) =="
t=$SECONDS
KVS_HARDENING=1 scripts/setup.sh build-fuzz -DKVS_FUZZ=ON -DKVS_WITH_CUDA=OFF -DKVS_BUILD_TESTS=OFF \
  -DKVS_BUILD_CLI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang-19 -DCMAKE_CXX_COMPILER=clang++-19
echo "build-fuzz $(elapsed $t)"

echo "== hardening: fuzzers, ${FUZZ_SECONDS} s each =="
# Stack traces: clang 19's llvm-symbolizer when installed (package llvm-19), else binutils' addr2line
# (the runtimes only look for an llvm-symbolizer on PATH, and an older one fails on clang 19's output).
SYMBOLIZER=/usr/lib/llvm-19/bin/llvm-symbolizer
[ -x "$SYMBOLIZER" ] || SYMBOLIZER=$(command -v addr2line || true)
mkdir -p build-fuzz/artifacts
# libFuzzer reads -max_total_time=0 as "no limit"; -runs=0 runs the corpus once and stops.
if [ "$FUZZ_SECONDS" = 0 ]; then LIMIT=-runs=0; else LIMIT=-max_total_time=$FUZZ_SECONDS; fi
failed=()
for name in trace tables method_params; do
  t=$SECONDS
  dict=()
  case $name in
    trace) dict=(-dict=tests/fuzz/trace.dict) ;;
    tables) dict=(-dict=build-fuzz/corpus/tables.dict) ;;
    method_params) dict=(-dict=build-fuzz/corpus/method_params.dict -max_len=512) ;;
  esac
  # New inputs go to the first directory (kept between local runs); the seeds stay as made.
  mkdir -p "build-fuzz/work/$name"
  log=build-fuzz/artifacts/$name.log
  if ASAN_OPTIONS="detect_leaks=1 external_symbolizer_path=$SYMBOLIZER ${ASAN_OPTIONS:-}" \
     UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1 external_symbolizer_path=$SYMBOLIZER ${UBSAN_OPTIONS:-}" \
     "build-fuzz/tests/fuzz/kvsieve_fuzz_$name" "$LIMIT" -timeout=25 -rss_limit_mb=2048 \
       -print_final_stats=1 "${dict[@]}" -artifact_prefix="build-fuzz/artifacts/$name-" \
       "build-fuzz/work/$name" "build-fuzz/corpus/$name" >"$log" 2>&1; then
    echo "fuzz_$name: ok, $(grep -o 'number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?') inputs," \
      "coverage $(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*$' || echo '?') $(elapsed $t)"
  else
    echo "fuzz_$name: FAILED $(elapsed $t); the end of $log:"
    tail -n 60 "$log"
    failed+=("$name")
  fi
done
echo "hardening: total $(elapsed $T0)"
if [ ${#failed[@]} -gt 0 ]; then
  echo "hardening: fuzzers that failed: ${failed[*]} (inputs in build-fuzz/artifacts/; tests/fuzz/README.md says how to replay)"
  exit 1
fi
