#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: the Python binding's CUDA tests (tests/bindings/cuda_python.sh) with kvsieve's
# Debian build dependencies carried as .deb files in .debs/ (unpacked into a private sysroot by
# tests/bindings/debs_sysroot.sh).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvs_out}
mkdir -p "$OUT"
bash tests/bindings/cuda_python.sh "${1:-$(command -v python3)}" 2>&1 | tee "$OUT/bindings_cuda.log" | tail -60
