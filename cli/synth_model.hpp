// SPDX-License-Identifier: Apache-2.0
// The synthetic Q/K/V generator behind `kvsieve synth` (and the data of `bench` and `demo`). Every
// knob and formula is documented in docs/synth.md; keep the two in step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"

namespace CLI {
class App;
}

namespace kvcli {

struct SynthConfig {
  // shape
  uint32_t layers = 2;
  uint32_t q_heads = 8;
  uint32_t kv_heads = 2;
  uint32_t head_dim = 64;
  int64_t prefill = 4096;
  int64_t decode = 64;
  DType dtype = DType::F32;
  uint64_t seed = 1;
  std::vector<uint32_t> present;  // layers written; empty = all

  // structure (logit contributions are in units of the scaled logit q.k/sqrt(d))
  uint32_t sinks = 4;
  double sink_logit = 9.0;
  double sink_value_scale = 0.1;
  uint32_t segments = 16;
  double topic_logit = 2.0;
  double value_topic = 1.0;
  uint32_t needles = 0;  // 0 = 2 per segment
  uint32_t needle_len = 4;
  double needle_logit = 6.0;
  double needle_value = 2.0;
  uint32_t max_targets = 3;
  double retarget = 0.25;
  double recency_logit = 4.0;
  double noise_logit = 1.0;
  double qk_scale_ratio = 1.5;
  double key_offset = 0.25;
  double query_offset = 0.25;
  double band_noise = 0.3;
  double value_offset = 1.0;
  double value_noise = 1.0;
  double head_spread = 0.5;
  double rope_theta = 10000.0;

  int64_t total() const { return prefill + decode; }
  uint32_t needle_count() const { return needles != 0 ? needles : 2 * segments; }
  std::vector<uint32_t> present_layers() const;
};

// Throws UsageError naming the first inconsistent knob.
void validate(const SynthConfig& cfg);

// One planted needle: tokens [start, start + len) of one (layer, KV head).
struct NeedleSpan {
  int64_t start = 0;
  int64_t len = 0;
};

struct SynthLayer {
  uint32_t layer = 0;
  std::unique_ptr<char[]> q, k, v;  // [T, Hq, d], [T, Hkv, d], [T, Hkv, d] in cfg.dtype
  std::vector<std::vector<NeedleSpan>> needles;  // per KV head
};

struct SynthTrace {
  SynthConfig cfg;
  std::vector<SynthLayer> layers;  // the present layers, ascending
  std::vector<int32_t> tokens;     // [T]

  StridedArray q(size_t i) const;
  StridedArray k(size_t i) const;
  StridedArray v(size_t i) const;
  uint64_t bytes() const;
};

// Generates every present layer; deterministic for cfg (whatever `threads` is).
SynthTrace synth_generate(const SynthConfig& cfg, unsigned threads);

// Writes it as a kvsieve-trace (kvs_trace_write).
void synth_write(const SynthTrace& trace, const std::string& path);

// One line recording every knob (stored as the trace's `source`).
std::string synth_source(const SynthConfig& cfg);

// Adds the shape options (--layers ... --seed) and the structure options to a CLI11 command.
void add_synth_shape_options(CLI::App* cmd, SynthConfig& cfg, std::string& dtype);
void add_synth_model_options(CLI::App* cmd, SynthConfig& cfg);

// Attention statistics of a generated trace (synth --stats): mean over sampled decode steps,
// present layers and query heads of the exact softmax mass on each kind of key.
struct SynthStats {
  int64_t steps = 0;
  double sink_mass = 0, needle_mass = 0, recent_mass = 0, top1_mass = 0, top5_mass = 0;
  double max_prob = 0;
  double background_logit_std = 0;  // std of the scaled logits of keys that are none of the above
};
SynthStats synth_stats(const SynthTrace& trace, int64_t max_steps, unsigned threads);

}  // namespace kvcli
