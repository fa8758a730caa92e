# SPDX-License-Identifier: Apache-2.0
# Sourced by the device scripts that run a carried CPU build (cpu_ab.sh, cpu_bench.sh,
# method_bench.sh): goes to the repository root, sets OUT (default /tmp/kvs_out) and LIBS (the
# libraries the device lacks, unpacked from .dev/libs.tar.xz; see docs/perf.md), and defines
#   run DIR PROGRAM [args]   the program of a carried build directory with its libraries (at most
#                            300 s), blank lines dropped.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/kvs_out}
mkdir -p "$OUT" /tmp/kvs_libs
tar xJf .dev/libs.tar.xz -C /tmp/kvs_libs
LIBS=/tmp/kvs_libs/libs
run() {
  local dir=$1 prog=$2
  shift 2
  LD_LIBRARY_PATH=$PWD/$dir:$LIBS timeout 300 "$dir/$prog" "$@" 2>&1 | grep -v '^\s*$'
}
