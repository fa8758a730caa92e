// SPDX-License-Identifier: Apache-2.0
// Helpers of the unit tests that drive whole sessions through the C API and compare two of them
// step by step: random tokens (TokenData), one decode step's outputs and selections (StepOut), and
// a bit-for-bit comparison of two sessions' steps.
#pragma once
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "capi_helpers.hpp"
#include "kvsieve/kvsieve.h"
#include "reference.hpp"

namespace kvt {

// Random tokens (never zeros): q [T][Hq][d], k, v [T][Hkv][d], every 29th key 2.5x heavier.
struct TokenData {
  int hq, hkv, d;
  int64_t T;
  std::vector<float> q, k, v;
  TokenData(Rng& rng, int hq_, int hkv_, int d_, int64_t T_) : hq(hq_), hkv(hkv_), d(d_), T(T_) {
    q = rng.normals(size_t(T) * hq * d);
    k = rng.normals(size_t(T) * hkv * d);
    v = rng.normals(size_t(T) * hkv * d);
    for (int64_t t = 0; t < T; t += 29)
      for (int i = 0; i < hkv * d; ++i) k[size_t(t) * hkv * d + i] *= 2.5f;
  }
  float* qt(int64_t t) { return q.data() + t * hq * d; }
  float* kt(int64_t t) { return k.data() + t * hkv * d; }
  float* vt(int64_t t) { return v.data() + t * hkv * d; }
};

// Parameters of a cpu session of D's shape: bf16 KV, budget 10%, 2 threads.
inline kvs_session_params session_params(const TokenData& D, const char* method, uint32_t layers, int64_t max_rollback) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = layers;
  p.num_q_heads = uint32_t(D.hq);
  p.num_kv_heads = uint32_t(D.hkv);
  p.head_dim = uint32_t(D.d);
  p.kv_dtype = KVS_SCALAR_BF16;
  p.method = method;
  p.budget = 0.1;
  p.num_threads = 2;
  p.max_rollback = max_rollback;
  return p;
}

// One layer's decode step: o, lse and the selection per KV head.
struct StepOut {
  std::vector<float> o, lse;
  std::vector<std::vector<int32_t>> sel;
};

inline std::vector<int32_t> selection(kvs_session_t s, uint32_t layer, uint32_t h) {
  size_t n = 0;
  OK(kvs_session_last_selection(s, layer, h, nullptr, 0, &n));
  std::vector<int32_t> out(n);
  OK(kvs_session_last_selection(s, layer, h, out.data(), n, &n));
  return out;
}

inline int64_t layer_tokens(kvs_session_t s, uint32_t l) {
  int64_t n = -1;
  OK(kvs_session_layer_tokens(s, l, &n));
  return n;
}

// Outputs, lse and selections equal to the bit, layer by layer.
inline void require_same(const std::vector<StepOut>& a, const std::vector<StepOut>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t l = 0; l < a.size(); ++l) {
    INFO("layer " << l);
    REQUIRE(std::memcmp(a[l].o.data(), b[l].o.data(), a[l].o.size() * 4) == 0);
    REQUIRE(std::memcmp(a[l].lse.data(), b[l].lse.data(), a[l].lse.size() * 4) == 0);
    REQUIRE(a[l].sel == b[l].sel);
  }
}

}  // namespace kvt
