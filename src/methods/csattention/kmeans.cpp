// SPDX-License-Identifier: Apache-2.0
// Spherical k-means for CSAttention's per-subspace query centroids (docs/methods/csattention.md; paper
// 3.2(1)): k-means++ seeding over unit vectors (D^2 = 2 - 2 max_j x.c_j), then either Sculley's
// mini-batch updates (per-centroid learning rate 1/count, centroids projected back to the sphere
// after every batch; one iteration = one epoch over the shuffled points, sklearn's max_iter) or
// full-batch Lloyd iterations (c_j = normalised sum of its points; never increases the objective).
// Point-centroid similarities go through the GEMM layer.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "backends/cpu/attention.hpp"
#include "core/error.hpp"
#include "methods/csattention/csattention.hpp"

namespace kvs::csa {

const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = f16_to_f32(uint16_t(i));
    return t;
  }();
  return table.data();
}

namespace {
__attribute__((target("avx2,f16c"))) void round_f16_f16c(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
  for (; i < n; ++i) x[i] = f16_to_f32(f32_to_f16(x[i]));
}
}  // namespace

void round_f16(float* x, int64_t n) {
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (f16c) return round_f16_f16c(x, n);
  for (int64_t i = 0; i < n; ++i) x[i] = f16_to_f32(f32_to_f16(x[i]));
}

namespace {

void normalise(float* c, int db) {
  double s = 0;
  for (int i = 0; i < db; ++i) s += double(c[i]) * c[i];
  if (s <= 0) return;
  const float inv = float(1.0 / std::sqrt(s));
  for (int i = 0; i < db; ++i) c[i] *= inv;
}

bool nonzero(const float* x, int db) {
  for (int i = 0; i < db; ++i)
    if (x[i] != 0.f) return true;
  return false;
}

// sims [rows][C] = X[rows] . cent^T; assign[r] = argmax (lowest j on ties).
void assign_rows(const float* X, int64_t rows, int db, const float* cent, int C, cpu::GemmProvider gemm,
                 std::vector<float>& sims, int32_t* assign) {
  sims.resize(size_t(rows) * C);
  cpu::sgemm(gemm, false, true, rows, C, db, 1.f, X, db, cent, db, 0.f, sims.data(), C);
  for (int64_t r = 0; r < rows; ++r) assign[r] = int32_t(cpu::argmax(sims.data() + size_t(r) * C, C));
}

}  // namespace

double kmeans_objective(const float* X, int64_t n, int db, const float* cent, int C) {
  double total = 0;
  for (int64_t r = 0; r < n; ++r) {
    double best = std::numeric_limits<double>::infinity();
    for (int j = 0; j < C; ++j) {
      double d2 = 0;
      for (int i = 0; i < db; ++i) {
        const double e = double(X[size_t(r) * db + i]) - double(cent[size_t(j) * db + i]);
        d2 += e * e;
      }
      best = std::min(best, d2);
    }
    total += best;
  }
  return total;
}

void spherical_kmeans(const float* X, int64_t n, int db, const KMeansConfig& cfg, cpu::GemmProvider gemm,
                      float* cent, const std::function<void(int, const float*)>* on_iter) {
  const int C = cfg.C;
  if (n < 1) invalid("csattention: k-means needs at least one query");
  if (cfg.init_queries) {
    if (n != C)
      invalid("method_params: csattention init=queries needs centroids equal to the number of sampled prompt queries (" +
              std::to_string(n) + "), got " + std::to_string(C));
    std::memcpy(cent, X, sizeof(float) * size_t(n) * db);
    if (on_iter) (*on_iter)(0, cent);
    return;
  }
  std::mt19937_64 rng(cfg.seed);
  // Points that carry a direction (zero sub-vectors have none).
  std::vector<int64_t> pts;
  pts.reserve(size_t(n));
  for (int64_t r = 0; r < n; ++r)
    if (nonzero(X + size_t(r) * db, db)) pts.push_back(r);
  if (pts.empty()) {  // no direction at all: any unit centroids
    for (int j = 0; j < C; ++j)
      for (int i = 0; i < db; ++i) cent[size_t(j) * db + i] = i == j % db ? 1.f : 0.f;
    if (on_iter) (*on_iter)(0, cent);
    return;
  }
  // k-means++: D^2(x) = min_j ||x - c_j||^2 = 2 - 2 max_j x.c_j for unit x and c.
  {
    std::vector<double> d2(pts.size(), std::numeric_limits<double>::infinity());
    auto pick_uniform = [&]() { return pts[size_t(std::uniform_int_distribution<size_t>(0, pts.size() - 1)(rng))]; };
    int64_t first = pick_uniform();
    std::memcpy(cent, X + size_t(first) * db, sizeof(float) * db);
    for (int j = 1; j <= C; ++j) {
      const float* c = cent + size_t(j - 1) * db;
      double total = 0;
      for (size_t p = 0; p < pts.size(); ++p) {
        const float* x = X + size_t(pts[p]) * db;
        float dot = 0.f;
        for (int i = 0; i < db; ++i) dot += x[i] * c[i];
        d2[p] = std::min(d2[p], std::max(0.0, 2.0 - 2.0 * double(dot)));
        total += d2[p];
      }
      if (j == C) break;
      int64_t chosen;
      if (total <= 0) chosen = pick_uniform();  // fewer distinct directions than centroids
      else {
        double u = std::uniform_real_distribution<double>(0.0, total)(rng), acc = 0;
        size_t p = 0;
        for (; p + 1 < pts.size(); ++p) {
          acc += d2[p];
          if (acc > u) break;
        }
        chosen = pts[p];
      }
      std::memcpy(cent + size_t(j) * db, X + size_t(chosen) * db, sizeof(float) * db);
    }
  }
  if (on_iter) (*on_iter)(0, cent);

  std::vector<float> sims;
  if (cfg.full_batch) {
    std::vector<int32_t> assign(static_cast<size_t>(n));
    std::vector<double> sum(size_t(C) * db);
    std::vector<int64_t> count(static_cast<size_t>(C));
    // Only the non-zero points move centroids; gather them densely for the GEMM.
    std::vector<float> P(pts.size() * size_t(db));
    for (size_t p = 0; p < pts.size(); ++p) std::memcpy(&P[p * db], X + size_t(pts[p]) * db, sizeof(float) * db);
    for (int it = 1; it <= cfg.iters; ++it) {
      assign_rows(P.data(), int64_t(pts.size()), db, cent, C, gemm, sims, assign.data());
      std::fill(sum.begin(), sum.end(), 0.0);
      std::fill(count.begin(), count.end(), 0);
      for (size_t p = 0; p < pts.size(); ++p) {
        const int j = assign[p];
        ++count[size_t(j)];
        for (int i = 0; i < db; ++i) sum[size_t(j) * db + i] += P[p * db + i];
      }
      for (int j = 0; j < C; ++j) {
        if (!count[size_t(j)]) continue;  // empty: keep the old centroid
        double s = 0;
        for (int i = 0; i < db; ++i) s += sum[size_t(j) * db + i] * sum[size_t(j) * db + i];
        if (s <= 0) continue;
        const double inv = 1.0 / std::sqrt(s);
        for (int i = 0; i < db; ++i) cent[size_t(j) * db + i] = float(sum[size_t(j) * db + i] * inv);
      }
      if (on_iter) (*on_iter)(it, cent);
    }
    return;
  }
  // Mini-batch (Sculley 2010) on the sphere.
  const int64_t B = std::max<int64_t>(1, std::min<int64_t>(cfg.batch, int64_t(pts.size())));
  std::vector<int64_t> order = pts;
  std::vector<float> xb(size_t(B) * db);
  std::vector<int32_t> assign(static_cast<size_t>(B));
  std::vector<int64_t> count(size_t(C), 0);
  std::vector<char> touched(static_cast<size_t>(C));
  for (int it = 1; it <= cfg.iters; ++it) {
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t start = 0; start < order.size(); start += size_t(B)) {
      const int64_t rows = std::min<int64_t>(B, int64_t(order.size() - start));
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(&xb[size_t(r) * db], X + size_t(order[start + size_t(r)]) * db, sizeof(float) * db);
      assign_rows(xb.data(), rows, db, cent, C, gemm, sims, assign.data());
      std::fill(touched.begin(), touched.end(), 0);
      for (int64_t r = 0; r < rows; ++r) {
        const int j = assign[size_t(r)];
        const float eta = float(1.0 / double(++count[size_t(j)]));
        float* c = cent + size_t(j) * db;
        const float* x = &xb[size_t(r) * db];
        for (int i = 0; i < db; ++i) c[i] = (1.f - eta) * c[i] + eta * x[i];
        touched[size_t(j)] = 1;
      }
      for (int j = 0; j < C; ++j)
        if (touched[size_t(j)]) normalise(cent + size_t(j) * db, db);
    }
    if (on_iter) (*on_iter)(it, cent);
  }
}

template <class S>
void build_list(const float* scores, int64_t n, int64_t L, int32_t* idx, S* val, std::vector<float>& tmp) {
  L = std::min(L, n);
  if (L <= 0) return;
  tmp.assign(scores, scores + n);
  std::nth_element(tmp.begin(), tmp.begin() + (n - L), tmp.end());
  const float thr = tmp[size_t(n - L)];  // the L-th largest value
  int64_t above = 0;
  for (int64_t i = 0; i < n; ++i) above += scores[i] > thr;
  int64_t w = 0, ties = L - above;
  for (int64_t i = 0; i < n; ++i) {
    const float s = scores[i];
    if (s > thr || (s == thr && ties-- > 0)) {
      idx[w] = int32_t(i);
      score_store(val[w], s);
      ++w;
    }
  }
  heap_make(idx, val, L);
}

template void build_list<uint16_t>(const float*, int64_t, int64_t, int32_t*, uint16_t*, std::vector<float>&);
template void build_list<float>(const float*, int64_t, int64_t, int32_t*, float*, std::vector<float>&);

}  // namespace kvs::csa
