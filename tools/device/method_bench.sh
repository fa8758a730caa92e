#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine's host CPU (quiet, unlike the shared development VM): `kvsieve bench` of every
# published method against `full` at 128K, with the thread counts the issues name. Carry .dev with
# .dev/cpu/{kvsieve,libkvsieve.so.0} (a CPU build) and .dev/libs.tar.xz (see docs/perf.md); an
# optional .dev/cpu-old/ holds a previous build to compare (BENCH_OLD="method ..."). Logs under $OUT.
# METHODS picks the 2-thread methods; SKIP_1T=1 skips the one-thread lfps/exact_topk runs.
set -u
source "$(dirname "$0")/cpu_libs.sh"
CTX=${CTX:-131072}
bench() {  # DIR THREADS METHOD [extra args]
  local dir=$1 t=$2 m=$3; shift 3
  echo "== $dir: $m, $t threads $*"
  run "$dir" kvsieve bench --method "$m" --context "$CTX" --budget 0.05 --threads "$t" --steps 10 \
    --json "$OUT/bench-$(basename "$dir")-$m-$t.json" "$@"
}
{
  lscpu | grep -E 'Model name|^CPU\(s\)'
  for m in ${METHODS:-csattention ctkvr retroinfer hgca}; do bench .dev/cpu 2 "$m"; done
  for m in ${BENCH_OLD:-}; do bench .dev/cpu-old 2 "$m"; done
  if [ -z "${SKIP_1T:-}" ]; then   # SKIP_1T=1: only the 2-thread runs
    bench .dev/cpu 1 lfps --stats candidate_fraction,bypass_fraction
    bench .dev/cpu 1 exact_topk
  fi
} 2>&1 | tee "$OUT/method_bench.log"
