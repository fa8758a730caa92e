#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine's host CPU: the CPU dense-decode benchmark (kvsieve bench) and the kernel
# micro-benchmark at several thread counts, paired with and without the bf16x2 conversion.
# Carry .dev with .dev/cpu/{kvsieve,libkvsieve.so.0,kvsieve_cpu_attention_micro} (a CPU build,
# -DKVS_WITH_CUDA=OFF) and .dev/libs.tar.xz (see docs/perf.md). Logs under $OUT.
set -u
source "$(dirname "$0")/cpu_libs.sh"
export LD_LIBRARY_PATH=$PWD/.dev/cpu:$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L2|L3|Flags' | sed 's/Flags:.*\(avx512_bf16\).*/Flags: ... avx512_bf16 .../'
  for t in ${THREADS:-1 2 4 8}; do
    echo "== threads $t"
    .dev/cpu/kvsieve_cpu_attention_micro "$t" 131072 15
    KVS_CPU_BF16X2=off .dev/cpu/kvsieve_cpu_attention_micro "$t" 131072 15
    .dev/cpu/kvsieve bench --method streaming --context 131072 --threads "$t" --steps 10 --budget 0.05
  done
  echo "== in-L2 single thread"
  for i in 1 2 3; do
    .dev/cpu/kvsieve_cpu_attention_micro 1 256 2000
    KVS_CPU_BF16X2=off .dev/cpu/kvsieve_cpu_attention_micro 1 256 2000
  done
} 2>&1 | tee "$OUT/cpu_bench.log"
