// SPDX-License-Identifier: Apache-2.0
// Micro-benchmark of retroinfer's cluster layout alone (retro::append_clusters: the rows of every
// KV head put in cluster order with their positions and value sums), as an index build runs it
// after its k-means, one task per KV head on the thread pool:
//   kvsieve_retro_layout_micro THREADS CONTEXT [REPS]
// One layer of 8 KV heads x head dim 128, bf16, CONTEXT tokens assigned at random to CONTEXT / 16
// clusters. Prints the median of REPS layouts, each into fresh heads (as a build's), in ms.
// `kvsieve bench --backend cuda --method retroinfer --stats build_ms,build_kmeans_ms` times it inside
// a real build.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/kv_store.hpp"
#include "core/thread_pool.hpp"
#include "methods/retroinfer/wave_index.hpp"
#include "random_layer.hpp"

int main(int argc, char** argv) {
  const unsigned threads = argc > 1 ? unsigned(std::atoi(argv[1])) : 2;
  const int64_t N = argc > 2 ? std::atoll(argv[2]) : 131072;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  const int hkv = 8, d = 128;
  if (N < 16 || reps < 1) {
    std::fprintf(stderr, "usage: kvsieve_retro_layout_micro THREADS CONTEXT(>= 16) [REPS]\n");
    return 2;
  }
  std::mt19937 rng(1);
  const kvs::KVLayer layer = random_layer(hkv, d, N, rng);
  const int64_t C = N / 16;
  std::vector<std::vector<int32_t>> assign(size_t(hkv), std::vector<int32_t>(static_cast<size_t>(N)));
  for (auto& a : assign)
    for (auto& x : a) x = int32_t(rng() % uint64_t(C));
  const std::vector<float> cent(size_t(C) * d, 0.25f);
  kvs::ThreadPool pool(threads);
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    std::vector<kvs::retro::WaveHead> heads(static_cast<size_t>(hkv));
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(hkv, [&](int64_t h) {
      kvs::retro::append_clusters(heads[size_t(h)], layer, int(h), 0, N, assign[size_t(h)].data(), cent.data(), C);
    });
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("retro layout: %lld tokens x %d KV heads, %lld clusters a head, %u threads: median %.1f ms of %d\n",
              (long long)N, hkv, (long long)C, pool.size(), ms[ms.size() / 2], reps);
  return 0;
}
