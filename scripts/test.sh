#!/usr/bin/env bash
# The whole test suite: release build (CUDA compiled when nvcc exists; CUDA tests skip without a
# GPU), then the C++ tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
(cd build && ctest --output-on-failure --timeout 1800)
echo "== sanitizers (ASan + UBSan) =="
scripts/setup.sh build-asan -DKVS_SANITIZE=ON -DKVS_WITH_CUDA=OFF -DKVS_BUILD_CLI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   ctest --output-on-failure --timeout 1800 -R '^(unit|unit_attention_.*|capi)$')
