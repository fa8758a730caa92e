#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Here (not on the GPU machine): packs a CUDA build for tools/device/gpu_check.sh into .dev/ (ignored
# by git): the library and CLI installed into .dev/prefix, the CUDA test programs into .dev/bin,
# stripped. The device then needs only .debs/ (the Debian libraries, see gpu_check.sh) besides.
#   tools/device/pack_gpu.sh [BUILD_DIR]      (default: build, configured with KVS_WITH_CUDA=ON)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
cmake --build "$BUILD" --target kvsieve kvsieve_cli kvsieve_cuda_tests kvsieve_backend_tests kvsieve_backend_error_tests
rm -rf .dev/prefix .dev/bin
cmake --install "$BUILD" --prefix .dev/prefix >/dev/null
mkdir -p .dev/bin
cp "$BUILD/tests/kvsieve_cuda_tests" "$BUILD/tests/kvsieve_backend_tests" "$BUILD/tests/kvsieve_backend_error_tests" .dev/bin/
strip --strip-unneeded .dev/bin/* .dev/prefix/bin/kvsieve .dev/prefix/lib/libkvsieve.so.*.*.*
du -sh .dev
