#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what kvsieve needs (Debian packages) when missing, then configures and builds.
#   scripts/setup.sh [BUILD_DIR] [extra cmake args...]
# Environment: KVS_JOBS (parallel build jobs, default: nproc). KVS_BINDINGS=1 also installs what the
# bindings and consumer examples need (JDK, JUnit 5, Go, Rust, bindgen + libclang, Python headers), creates
# BUILD_DIR/venv (numpy, pytest, and torch + transformers for the transformers-integration test, from
# PyPI; KVS_NO_TORCH=1 leaves those two out, as does a disk with less than 9 GB free) and configures
# with the Python and Java bindings on.
# KVS_HARDENING=1 also installs clang 19 and its compiler-rt (libFuzzer, the sanitizer runtimes) for
# scripts/test_hardening.sh. Debian 12's default clang (14) cannot compile the library (_Float16 on
# x86-64 needs clang 15); bookworm also carries clang-19 (19.1.7). The compiler-rt package is named
# explicitly: clang only recommends it, and recommends are not installed here.
set -euo pipefail
cd "$(dirname "$0")/.."

# libdnnl-dev only Recommends ocl-icd-opencl-dev, but its CMake config find_package()s OpenCL.
PKGS=(cmake ninja-build g++ pkg-config libdnnl-dev ocl-icd-opencl-dev libopenblas-dev libmimalloc-dev doctest-dev
      libcli11-dev nlohmann-json3-dev libxxhash-dev libdlpack-dev swig python3 python3-numpy)
if [ "${KVS_BINDINGS:-0}" = 1 ]; then
  PKGS+=(python3-dev python3-venv default-jdk-headless junit5 golang-go cargo rustc)
  # bindgen (0.60) regenerates bindings/rust/kvsieve-sys/src/bindings.rs for the drift check of
  # tests/bindings/consumers.sh; it loads libclang at run time and needs clang's own headers
  # (stddef.h): neither is a dependency of the Debian package.
  PKGS+=(bindgen libclang1-14 libclang-common-14-dev)
fi
if [ "${KVS_HARDENING:-0}" = 1 ]; then
  PKGS+=(clang-19 libclang-rt-19-dev)
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "kvsieve setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The CUDA toolkit is used when present (nvcc); CI and machines without a GPU still compile it.
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

BUILD=${1:-build}
shift || true
BINDING_ARGS=()
if [ "${KVS_BINDINGS:-0}" = 1 ]; then
  # Debian's python3 (the one python3-dev matches), in a venv with numpy and pytest from PyPI, and
  # the versions of torch and transformers tests/python/test_hf_integration.py was written against
  # (PyPI's x86-64 torch wheel brings its CUDA libraries: about 5.6 GB, 5 minutes on a fresh machine).
  # KVS_NO_TORCH=1 leaves torch and transformers out (that test then reports itself skipped).
  PY=/usr/bin/python3
  PIP_PKGS=(numpy pytest)
  if [ "${KVS_NO_TORCH:-0}" != 1 ] && ! "$BUILD/venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
    # pip fails deep into the download with ENOSPC otherwise: check first. The wheels land in
    # ${TMPDIR:-/tmp} (about 3 GB) while they unpack into the venv (about 6 GB); on one filesystem
    # that is 9 GB at the peak. Short of it, torch and transformers are left out with a warning
    # (test_hf_integration.py then reports itself skipped); KVS_REQUIRE_TORCH=1 makes it an error.
    mkdir -p "$BUILD"
    TMP=${TMPDIR:-/tmp}
    free_gb=$(df -Pk "$BUILD" | awk 'NR == 2 { print int($4 / 1048576) }')
    tmp_gb=$(df -Pk "$TMP" | awk 'NR == 2 { print int($4 / 1048576) }')
    if [ "$(stat -c %d "$BUILD")" = "$(stat -c %d "$TMP")" ]; then
      short=$([ "$free_gb" -lt 9 ] && echo 1 || echo 0)
      need="9 GB free in $BUILD and $TMP together (one filesystem), found $free_gb GB"
    else
      short=$([ "$free_gb" -lt 7 ] || [ "$tmp_gb" -lt 3 ] && echo 1 || echo 0)
      need="7 GB free in $BUILD and 3 GB in $TMP, found $free_gb GB and $tmp_gb GB"
    fi
    if [ "$short" = 1 ]; then
      if [ "${KVS_REQUIRE_TORCH:-0}" = 1 ]; then
        echo "kvsieve setup: torch + transformers need $need. Free some space, or unset" \
             "KVS_REQUIRE_TORCH to leave them out." >&2
        exit 1
      fi
      echo "kvsieve setup: WARNING: torch + transformers left out: they need $need." \
           "tests/python/test_hf_integration.py will report itself skipped." >&2
      KVS_NO_TORCH=1
    fi
  fi
  [ "${KVS_NO_TORCH:-0}" = 1 ] || PIP_PKGS+=(torch==2.15.0 transformers==5.23.0)
  IMPORTS=$(IFS=,; echo "${PIP_PKGS[*]%%=*}")
  if ! "$BUILD/venv/bin/python" -c "import $IMPORTS" 2>/dev/null; then
    mkdir -p "$BUILD"
    [ -x "$BUILD/venv/bin/python" ] || "$PY" -m venv "$BUILD/venv"
    echo "kvsieve setup: pip install ${PIP_PKGS[*]} into $BUILD/venv" >&2
    "$BUILD/venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir "${PIP_PKGS[@]}"
  fi
  BINDING_ARGS=(-DKVS_BUILD_PYTHON=ON -DKVS_BUILD_JAVA=ON "-DPython3_EXECUTABLE=$(cd "$BUILD" && pwd)/venv/bin/python")
fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${BINDING_ARGS[@]}" "$@" >/dev/null
cmake --build "$BUILD" -j "${KVS_JOBS:-$(nproc)}"
