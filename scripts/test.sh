#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole test suite: release build (CUDA compiled when nvcc exists; CUDA tests skip without a
# GPU), then the C++ tests again under AddressSanitizer + UndefinedBehaviorSanitizer, then the
# fuzzers and the ThreadSanitizer stress test (scripts/test_hardening.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
KVS_BINDINGS=1 scripts/setup.sh build
(cd build && ctest --output-on-failure --timeout 1800)
echo "== pip install . (the Python package built from source by scikit-build-core), pytest on it =="
# (the transformers tests skip themselves when the venv has no torch/transformers: KVS_NO_TORCH=1)
# (CUDA off in the wheel: the GPU paths of the binding are tested in-tree by ctest's python_bindings)
build/venv/bin/pip install -q --disable-pip-version-check . --config-settings=build-dir=build/pip \
  --config-settings=cmake.define.KVS_WITH_CUDA=OFF
(cd build && KVSIEVE_CLI=$PWD/kvsieve venv/bin/python -c 'import kvsieve, sys; assert "site-packages" in kvsieve.__file__, kvsieve.__file__' \
   && KVSIEVE_CLI=$PWD/kvsieve venv/bin/python -m pytest -q -p no:cacheprovider ../tests/python/test_bindings.py \
        ../tests/python/test_hf_generate.py ../tests/python/test_hf_integration.py)
echo "== sanitizers (ASan + UBSan) =="
scripts/setup.sh build-asan -DKVS_SANITIZE=ON -DKVS_WITH_CUDA=OFF -DKVS_BUILD_CLI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   ctest --output-on-failure --timeout 1800 -R '^(unit|unit_attention_.*|capi)$')
echo "== hardening: fuzzers (ASan + UBSan, KVS_FUZZ_SECONDS each) and the ThreadSanitizer stress test =="
KVS_CLI=build/kvsieve scripts/test_hardening.sh
