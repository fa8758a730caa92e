#!/usr/bin/env bash
# Installs what kvsieve needs (Debian packages) when missing, then configures and builds.
#   scripts/setup.sh [BUILD_DIR] [extra cmake args...]
# Environment: KVS_JOBS (parallel build jobs, default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(cmake ninja-build g++ pkg-config libdnnl-dev libopenblas-dev libmimalloc-dev doctest-dev
      libcli11-dev nlohmann-json3-dev libxxhash-dev libdlpack-dev swig python3 python3-numpy)
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
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$BUILD" -j "${KVS_JOBS:-$(nproc)}"
