// SPDX-License-Identifier: Apache-2.0
// Micro-benchmark of the CPU dense decode kernel alone (no session, no data generation):
//   kvsieve_cpu_attention_micro THREADS CONTEXT [REPS [FRACTION]]
// One layer of 8 KV heads x head dim 128, bf16, GQA 4 (32 query heads). Prints the median time of
// REPS calls, the implied K+V read rate and the thread CPU time of the first call. With a small
// CONTEXT (256: one page, held in L2) it measures the kernel's compute rate; KVS_CPU_ISA=avx2|scalar
// caps the instruction set for comparisons. With FRACTION in (0, 1) it times the gathered kernel
// (attend_gather_kv) over a random token-sorted FRACTION of the keys per KV head instead, as a
// sparse method's attention step reads them; the rate then counts the selected rows only.
// `kvsieve bench` is the end-to-end benchmark.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#include "backends/cpu/attention.hpp"
#include "random_layer.hpp"

int main(int argc, char** argv) {
  const unsigned threads = argc > 1 ? unsigned(std::atoi(argv[1])) : 2;
  const int64_t N = argc > 2 ? std::atoll(argv[2]) : 131072;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 15;
  const double frac = argc > 4 ? std::atof(argv[4]) : 0.0;
  const int hkv = 8, d = 128, G = 4;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const kvs::KVLayer layer = random_layer(hkv, d, N, rng);
  kvs::ThreadPool pool(threads);
  std::vector<float> q(size_t(G) * hkv * d), o(q.size()), lse(size_t(G) * hkv);
  for (auto& x : q) x = nd(rng);
  std::vector<std::vector<int32_t>> lists(hkv);
  int64_t rows = N;
  if (frac > 0 && frac < 1) {
    std::uniform_real_distribution<double> u;
    for (auto& l : lists) {
      for (int64_t t = 0; t < N; ++t)
        if (u(rng) < frac) l.push_back(int32_t(t));
    }
    rows = int64_t(lists[0].size());
  }
  std::vector<double> times;
  double cpu_ms = 0;
  for (int r = 0; r < reps; ++r) {
    timespec c0, c1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    const auto t0 = std::chrono::steady_clock::now();
    if (rows < N) kvs::cpu::attend_gather_kv(layer, q.data(), G, lists, 0.0884f, o.data(), lse.data(), pool);
    else kvs::cpu::attend_dense(layer, q.data(), G, N, 0.0884f, o.data(), lse.data(), pool);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    if (r == 0) cpu_ms = double(c1.tv_sec - c0.tv_sec) * 1e3 + double(c1.tv_nsec - c0.tv_nsec) * 1e-6;
  }
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2], bytes = double(rows) * hkv * d * 2 * 2;
  std::printf("threads %u, context %lld, %lld rows per head: median %.3f ms, %.2f GB/s of K+V (first call: %.2f ms of calling-thread CPU)\n",
              threads, (long long)N, (long long)rows, med * 1e3, bytes / med / 1e9, cpu_ms);
  return 0;
}
