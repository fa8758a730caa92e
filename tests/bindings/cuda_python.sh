#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python binding's CUDA tests (DLPack from torch on a stream, device/layout errors) on a GPU
# machine that has PyTorch, numpy and pytest but no package registry. Builds the library with the
# CUDA backend and the binding into build-gpu, then runs tests/python/test_bindings.py (every test:
# the CUDA ones no longer skip).
#   tests/bindings/cuda_python.sh [PYTHON]
# When the machine lacks kvsieve's Debian build dependencies, bring them as .deb files in .debs/
# (on a Debian 12 machine: apt-get download libdnnl-dev libdnnl2 libmimalloc-dev libmimalloc2.0
#  libxxhash-dev libxxhash0 libdlpack-dev swig4.0 swig ocl-icd-libopencl1 ocl-icd-opencl-dev
#  opencl-c-headers opencl-clhpp-headers libopenblas-dev libopenblas0 libopenblas0-pthread
#  libopenblas-pthread-dev libgfortran5 libcli11-dev doctest-dev nlohmann-json3-dev); they are
# unpacked into a private sysroot (tests/bindings/debs_sysroot.sh), never into /.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-$(command -v python3)}
. tests/bindings/debs_sysroot.sh   # KVS_SYSROOT_ARGS; unpacks .debs/ when present
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVS_WITH_CUDA=ON -DKVS_BUILD_PYTHON=ON \
  -DPython3_EXECUTABLE="$PY" "${KVS_SYSROOT_ARGS[@]}"
cmake --build build-gpu --target kvsieve_python kvsieve_cli
PYTHONPATH=build-gpu/bindings/python KVSIEVE_CLI=build-gpu/kvsieve "$PY" -m pytest -v -rs -p no:cacheprovider \
  tests/python/test_bindings.py
