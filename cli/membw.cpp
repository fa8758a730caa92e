// SPDX-License-Identifier: Apache-2.0
#include "membw.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common.hpp"

namespace kvcli {

namespace {

size_t llc_bytes() {
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return size_t(l3);
#endif
  // sysfs fallback: the largest cache level of cpu0.
  size_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    std::string s;
    if (!(f >> s) || s.empty()) continue;
    size_t v = std::strtoull(s.c_str(), nullptr, 10);
    if (s.back() == 'K') v <<= 10;
    if (s.back() == 'M') v <<= 20;
    best = std::max(best, v);
  }
  return best != 0 ? best : size_t(32) << 20;
}

// Sums a slice with independent accumulators so loads, not the add chain, limit the loop.
uint64_t sum_slice(const uint64_t* p, size_t n) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
    a4 += p[i + 4];
    a5 += p[i + 5];
    a6 += p[i + 6];
    a7 += p[i + 7];
  }
  for (; i < n; ++i) a0 += p[i];
  return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

}  // namespace

size_t default_bandwidth_bytes() {
  size_t bytes = std::clamp(4 * llc_bytes(), size_t(256) << 20, size_t(2) << 30);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) bytes = std::min(bytes, size_t(pages) * size_t(page) / 8);
  return bytes;
}

double measure_read_bandwidth(size_t bytes, unsigned threads, int reps) {
  threads = std::max(1u, threads);
  const size_t words = std::max<size_t>(bytes / 8, threads * 1024);
  std::unique_ptr<uint64_t[]> buf(new uint64_t[words]);
  const size_t per = words / threads;
  auto slice = [&](unsigned w, size_t& n) {
    n = w + 1 == threads ? words - per * w : per;
    return buf.get() + per * w;
  };

  std::vector<std::thread> pool;
  // First touch by the thread that will read the slice (NUMA placement), non-zero content.
  for (unsigned w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      size_t n;
      uint64_t* p = slice(w, n);
      for (size_t i = 0; i < n; ++i) p[i] = i * 0x9e3779b97f4a7c15ull + w;
    });
  for (auto& t : pool) t.join();

  std::atomic<uint64_t> sink{0};
  double best = 0.0;
  for (int r = 0; r < std::max(1, reps); ++r) {
    std::atomic<unsigned> ready{0};
    std::atomic<bool> go{false};
    std::vector<Clock::time_point> done(threads);
    pool.clear();
    for (unsigned w = 0; w < threads; ++w)
      pool.emplace_back([&, w] {
        size_t n;
        const uint64_t* p = slice(w, n);
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        sink.fetch_add(sum_slice(p, n), std::memory_order_relaxed);
        done[w] = Clock::now();
      });
    while (ready.load() < threads) std::this_thread::yield();
    const auto start = Clock::now();
    go.store(true, std::memory_order_release);
    for (auto& t : pool) t.join();
    const auto end = *std::max_element(done.begin(), done.end());
    const double s = std::chrono::duration<double>(end - start).count();
    if (s > 0) best = std::max(best, double(words * 8) / s / 1e9);
  }
  if (sink.load() == 0x5bd1e995u) std::this_thread::yield();  // keeps the sums observable
  return best;
}

}  // namespace kvcli
