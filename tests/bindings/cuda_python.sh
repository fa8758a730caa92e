#!/usr/bin/env bash
# The Python binding's CUDA tests (DLPack from torch on a stream, device/layout errors) on a GPU
# machine that has PyTorch, numpy and pytest but no package registry. Builds the library with the
# CUDA backend and the binding into build-gpu, then runs tests/python/test_bindings.py (every test:
# the CUDA ones no longer skip).
#   tests/bindings/cuda_python.sh [PYTHON]
# When the machine lacks kvsieve's Debian build dependencies, bring them as .deb files in .debs/
# (on a Debian 12 machine: apt-get download libdnnl-dev libdnnl2 libmimalloc-dev libmimalloc2.0
#  libxxhash-dev libxxhash0 libdlpack-dev swig4.0 ocl-icd-libopencl1); they are unpacked into a
# private sysroot (/tmp/kvsieve-sysroot), never into /.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-$(command -v python3)}
ARGS=()
if ls .debs/*.deb >/dev/null 2>&1; then
  SR=/tmp/kvsieve-sysroot
  mkdir -p $SR
  for d in .debs/*.deb; do dpkg -x "$d" $SR; done
  export LD_LIBRARY_PATH=$SR/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  export PKG_CONFIG_PATH=$SR/usr/lib/x86_64-linux-gnu/pkgconfig PKG_CONFIG_SYSROOT_DIR=$SR
  export SWIG_LIB=$SR/usr/share/swig4.0
  ARGS=("-DCMAKE_PREFIX_PATH=$SR/usr;$SR/usr/lib/x86_64-linux-gnu/cmake" "-DSWIG_EXECUTABLE=$SR/usr/bin/swig4.0"
        "-DCMAKE_CXX_FLAGS=-I$SR/usr/include" "-DCMAKE_C_FLAGS=-I$SR/usr/include")
fi
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVS_WITH_CUDA=ON -DKVS_BUILD_PYTHON=ON \
  -DPython3_EXECUTABLE="$PY" "${ARGS[@]}"
cmake --build build-gpu --target kvsieve_python kvsieve_cli
PYTHONPATH=build-gpu/bindings/python KVSIEVE_CLI=build-gpu/kvsieve "$PY" -m pytest -v -rs -p no:cacheprovider \
  tests/python/test_bindings.py
