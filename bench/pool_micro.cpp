// SPDX-License-Identifier: Apache-2.0
// Micro-benchmark of the thread pool's fork and join (core/thread_pool.hpp), which every method's
// CPU step pays once per parallel_for round:
//   kvsieve_pool_micro THREADS [ROUNDS]
// For tasks of 0, 5 and 50 us of arithmetic (no memory traffic) and 8, 16 and 128 tasks a round, the
// median time of a round in us over ROUNDS rounds (in batches of 50), and what an ideal pool would
// take (ceil(tasks / threads) x the task). Rounds follow each other after 20 us of the caller's own
// work, as a method's phases do, so the workers have gone to sleep or not as they would in a step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/thread_pool.hpp"

namespace {
using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

// About `us` microseconds of dependent arithmetic (calibrated once).
double g_iters_per_us = 0;
double spin(double us) {
  double x = 1.0;
  const long n = long(us * g_iters_per_us);
  for (long i = 0; i < n; ++i) x = x * 1.0000001 + 1e-9;
  return x;
}
void calibrate() {
  g_iters_per_us = 100;
  const auto t = Clock::now();
  volatile double s = spin(20000);  // 2M iterations
  (void)s;
  g_iters_per_us = 2e6 / us_since(t);
}
}  // namespace

int main(int argc, char** argv) {
  const unsigned threads = argc > 1 ? unsigned(std::atoi(argv[1])) : 2;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 2000;
  if (threads < 1 || rounds < 50) {
    std::fprintf(stderr, "usage: kvsieve_pool_micro THREADS(>= 1) [ROUNDS(>= 50)]\n");
    return 2;
  }
  calibrate();
  kvs::ThreadPool pool(threads);
  std::vector<double> sink(1024, 0.0);
  std::printf("pool of %u threads, %d rounds a case; median us a round (ideal)\n", threads, rounds);
  for (double task : {0.0, 5.0, 50.0})
    for (int64_t n : {8, 16, 128}) {
      std::vector<double> per;
      for (int b = 0; b < rounds / 50; ++b) {
        double total = 0;
        for (int r = 0; r < 50; ++r) {
          sink[0] += spin(20);  // the caller's serial work between rounds
          const auto t = Clock::now();
          pool.parallel_for(n, [&](int64_t i) { sink[size_t(8 * (i % 128))] += spin(task); });
          total += us_since(t);
        }
        per.push_back(total / 50);
      }
      std::nth_element(per.begin(), per.begin() + per.size() / 2, per.end());
      const double ideal = std::ceil(double(n) / threads) * task;
      std::printf("task %4.0f us, %4lld tasks: %8.2f us (%.0f)\n", task, (long long)n, per[per.size() / 2], ideal);
    }
  return sink[0] == 12345.678 ? 1 : 0;
}
