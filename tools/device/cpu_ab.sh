#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine's host CPU (quiet, AVX-512): a CPU build against a previous one in one call.
# Carry .dev with .dev/cpu/{kvsieve,libkvsieve.so.0,kvsieve_cpu_attention_micro,kvsieve_tests}
# (a CPU build, -DKVS_WITH_CUDA=OFF), .dev/cpu-old/ (the same files of the previous build) and
# .dev/libs.tar.xz (see docs/perf.md). Logs under $OUT/cpu_ab.log.
#   1. the unit tests of the attention kernels and the methods on this CPU's AVX-512 paths (and
#      with KVS_CPU_ISA=avx2 / KVS_CPU_BF16X2=off);
#   2. the dense decode: micro-benchmark and `bench --method streaming` at 128K, new and old
#      alternated (REPS pairs, default 3);
#   3. `bench` of each method in METHODS (new, new with KVS_HUGE_PAGES=0, old; REPS rounds) and of
#      csattention with each parameter set in CSA_PARAMS (';'-separated), 2 threads, 128K, budget
#      0.05, with the phase split (update / select / attention).
set -u
source "$(dirname "$0")/cpu_libs.sh"
{
  lscpu | grep -E 'Model name|^CPU\(s\)'
  echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
  echo "== unit tests (native ISA, avx2, bf16x2 off)"
  run .dev/cpu kvsieve_tests -tc='*attention*,*merg*,*full*,*exact_topk*,*csattention*,*ctkvr*,*retroinfer*' | tail -3
  KVS_CPU_ISA=avx2 run .dev/cpu kvsieve_tests -tc='*attention*,*csattention*' | tail -2
  KVS_CPU_BF16X2=off run .dev/cpu kvsieve_tests -tc='*attention*' | tail -2
  for i in $(seq "${REPS:-3}"); do
    for dir in .dev/cpu .dev/cpu-old; do
      echo "== dense $dir ($i)"
      run $dir kvsieve_cpu_attention_micro 2 131072 15
      run $dir kvsieve bench --method streaming --context 131072 --threads 2 --steps 10 | grep -E 'full  |speedup'
      KVS_HUGE_PAGES=0 run $dir kvsieve bench --method streaming --context 131072 --threads 2 --steps 10 | grep -E 'full  '
    done
  done
  for i in $(seq "${REPS:-3}"); do
    for m in ${METHODS:-csattention ctkvr retroinfer}; do
      for cfg in .dev/cpu:1 .dev/cpu:0 .dev/cpu-old:1; do
        dir=${cfg%:*}
        echo "== $dir (KVS_HUGE_PAGES=${cfg#*:}): $m ($i)"
        KVS_HUGE_PAGES=${cfg#*:} run $dir kvsieve bench --method "$m" --context 131072 --budget 0.05 --threads 2 \
          --steps 10 --no-membw | grep -E 'index build|p50 / p99|speedup|phases'
      done
    done
  done
  IFS=';' read -r -a sets <<< "${CSA_PARAMS:-}"
  for p in "${sets[@]}"; do
    echo "== .dev/cpu: csattention $p"
    run .dev/cpu kvsieve bench --method csattention --context 131072 --budget 0.05 --threads 2 --steps 10 --no-membw \
      --params "$p" | grep -E 'index build|p50 / p99|speedup|phases'
  done
} 2>&1 | tee "$OUT/cpu_ab.log"
