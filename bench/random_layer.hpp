// SPDX-License-Identifier: Apache-2.0
// The micro-benchmarks' KV layer: N tokens of bf16 keys and values drawn from a normal
// distribution (1024 tokens of rows, repeated), with the generator the caller goes on with.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "core/kv_store.hpp"

inline kvs::KVLayer random_layer(int hkv, int d, int64_t N, std::mt19937& rng) {
  kvs::KVLayer layer(kvs::DType::BF16, hkv, d);
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t(1024) * hkv * d), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (int64_t i = 0; i < N; i += 1024) layer.append(k.data(), v.data(), std::min<int64_t>(1024, N - i));
  return layer;
}
