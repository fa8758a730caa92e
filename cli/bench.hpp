// SPDX-License-Identifier: Apache-2.0
// The timing code of `kvsieve bench`, shared with `kvsieve demo`: synthetic data of a given shape,
// then decode steps of a method and of `full` alternated in one process (cmd_bench.cpp).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "synth_model.hpp"

namespace kvcli {

struct BenchOptions {
  std::string method, params, dtype = "bf16", backend = "cpu", json, stats;
  int64_t context = 32768;
  uint32_t q_heads = 32, kv_heads = 8, head_dim = 128;
  double budget = 0.05;
  unsigned threads = 0;
  int64_t steps = 20, warmup = 3;
  int64_t batch = 1;  // sessions of each kind, stepped together by kvs_decode_batch (1: kvs_session_decode)
  uint64_t seed = 1;
  double membw_mib = 0;
  bool no_membw = false;
  int device = 0;  // CUDA device (--backend cuda)
  std::string kv_memory = "cuda";  // --backend cuda: where the KV cache lives (cuda or cuda_host)
};

// Method statistics by name (nullopt: the method does not know the name).
using MethodStats = std::vector<std::pair<std::string, std::optional<double>>>;

// What bench_cpu measured: per-step wall times (after the warm-up) of the method and of `full`
// (of the whole batch's step when o.batch > 1), the method's phase times (update, select,
// attention; the mean over the batch's sessions), the first method session's statistics and the
// statistics named in BenchOptions::stats (nullopt: the method does not know the name).
struct BenchTiming {
  std::vector<double> method_us, full_us, phase_us[3];
  double prefill_ms = 0, index_ms = 0;
  kvs_session_stats stats{};
  MethodStats method_stats;
};

// Throws UsageError on a bad option (unknown method, context < 64, ...).
void validate_options(const BenchOptions& o);
// One layer of structured synthetic data (docs/synth.md): o.context prompt tokens, then
// (o.warmup + o.steps) * o.batch decode tokens (session b of a batch takes token b of each step's
// run of o.batch).
SynthTrace bench_data(const BenchOptions& o, DType dtype, unsigned threads);
// CPU-backend (or hybrid) timing of o.method against full on `data` (from bench_data with the same o).
BenchTiming bench_cpu(const BenchOptions& o, DType dtype, const SynthTrace& data);
// The whole `kvsieve bench` command: times, prints, writes o.json.
int run_bench(const BenchOptions& o);
// Whether this build has CUDA and the runtime sees at least one device.
bool cuda_device_visible();

}  // namespace kvcli
