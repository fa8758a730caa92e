// SPDX-License-Identifier: Apache-2.0
// Independent float64 references and helpers for the tests.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.hpp"
#include "kvsieve/kvsieve.h"

namespace kvt {

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t seed) : g(seed) {}
  float normal() { return std::normal_distribution<float>(0.f, 1.f)(g); }
  std::vector<float> normals(size_t n, float scale = 1.f) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal() * scale;
    return v;
  }
  int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
};

// Rounds values through a storage dtype (what the library stores).
inline std::vector<float> rounded(const std::vector<float>& x, kvs::DType t) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == kvs::DType::BF16) r[i] = kvs::bf16_to_f32(kvs::f32_to_bf16(x[i]));
    else if (t == kvs::DType::F16) r[i] = kvs::f16_to_f32(kvs::f32_to_f16(x[i]));
    else r[i] = x[i];
  }
  return r;
}

// Exact attention in float64 for one query row of head hq over keys in `keys` (token indices).
// K, V: [T][Hkv][d]; q: [Hq][d].
inline void attention_ref(const float* q, const float* K, const float* V, int hq, int G, int hkv, int d,
                          const std::vector<int64_t>& keys, double scale, std::vector<double>& o, double& lse) {
  const int h = hq / G;
  o.assign(size_t(d), 0.0);
  if (keys.empty()) {
    lse = -std::numeric_limits<double>::infinity();
    return;
  }
  std::vector<double> s(keys.size());
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t j = 0; j < keys.size(); ++j) {
    double acc = 0;
    for (int i = 0; i < d; ++i) acc += double(q[size_t(hq) * d + i]) * double(K[(size_t(keys[j]) * hkv + h) * d + i]);
    s[j] = acc * scale;
    mx = std::max(mx, s[j]);
  }
  double z = 0;
  for (double x : s) z += std::exp(x - mx);
  for (size_t j = 0; j < keys.size(); ++j) {
    const double w = std::exp(s[j] - mx) / z;
    for (int i = 0; i < d; ++i) o[size_t(i)] += w * double(V[(size_t(keys[j]) * hkv + h) * d + i]);
  }
  lse = mx + std::log(z);
}

inline double rel_err(const std::vector<double>& ref, const float* got, int d) {
  double num = 0, den = 0;
  for (int i = 0; i < d; ++i) {
    num += (double(got[i]) - ref[size_t(i)]) * (double(got[i]) - ref[size_t(i)]);
    den += ref[size_t(i)] * ref[size_t(i)];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// A kvs_tensor over a host buffer (shape storage owned by the struct).
struct T {
  kvs_tensor t{};
  int64_t shape[4]{};
  int64_t strides[4]{};
  T(void* data, kvs_dtype dt, std::initializer_list<int64_t> dims, bool with_strides = false) {
    t.data = data;
    t.device = kvs_device{KVS_DEVICE_CPU, 0};
    t.ndim = int32_t(dims.size());
    t.dtype = dt;
    int i = 0;
    for (int64_t x : dims) shape[i++] = x;
    t.shape = shape;
    if (with_strides) {
      int64_t s = 1;
      for (int j = t.ndim - 1; j >= 0; --j) {
        strides[j] = s;
        s *= shape[j];
      }
      t.strides = strides;
    }
  }
  kvs_tensor* ptr() { return &t; }
};

inline kvs_dtype f32() { return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 32, 1}; }
inline kvs_dtype f16() { return kvs_dtype{KVS_DTYPE_CODE_FLOAT, 16, 1}; }
inline kvs_dtype bf16() { return kvs_dtype{KVS_DTYPE_CODE_BFLOAT, 16, 1}; }

}  // namespace kvt
