#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole test suite: release build (CUDA compiled when nvcc exists; CUDA tests skip without a
# GPU), the self-contained wheel and the package tests on it (scripts/test_wheel.sh), then the C++
# tests again under AddressSanitizer + UndefinedBehaviorSanitizer, then the fuzzers and the
# ThreadSanitizer stress test (scripts/test_hardening.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
KVS_BINDINGS=1 scripts/setup.sh build
(cd build && ctest --output-on-failure --timeout 1800)
echo "== the wheel: built, repaired (bundled libraries), installed into a fresh venv, checked, pytest on it =="
# (scripts/test_wheel.sh: CUDA off in the wheel; the GPU paths of the binding are tested in-tree by
# ctest's python_bindings. The transformers tests run with torch and transformers of build/venv.)
scripts/test_wheel.sh
echo "== sanitizers (ASan + UBSan) =="
scripts/setup.sh build-asan -DKVS_SANITIZE=ON -DKVS_WITH_CUDA=OFF -DKVS_BUILD_CLI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   ctest --output-on-failure --timeout 1800 -R '^(unit|unit_attention_.*|capi)$')
echo "== hardening: fuzzers (ASan + UBSan, KVS_FUZZ_SECONDS each) and the ThreadSanitizer stress test =="
KVS_CLI=build/kvsieve scripts/test_hardening.sh
