// SPDX-License-Identifier: Apache-2.0
#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kvcli {

namespace {

constexpr int64_t kChunk = 4096;  // keys per work item; fixed so sums never depend on threads

void load_row(const StridedArray& a, int64_t row, int64_t head, double* dst) {
  const void* p = a.at(row, head);
  const int64_t d = a.dim();
  switch (a.dtype()) {
    case DType::F32: {
      const float* f = static_cast<const float*>(p);
      for (int64_t i = 0; i < d; ++i) dst[i] = f[i];
      break;
    }
    default:
      for (int64_t i = 0; i < d; ++i) dst[i] = load_elem(p, a.dtype(), size_t(i));
  }
}

}  // namespace

void exact_attention(const StridedArray& q, const StridedArray& k, const StridedArray& v, int64_t t,
                     double scale, bool want_ranks, unsigned threads, ExactAttention& r) {
  const int64_t hq = q.heads(), hkv = k.heads(), d = q.dim();
  const int64_t group = hq / hkv;
  const int64_t n = t + 1;
  r.n = n;
  r.q_heads = hq;
  r.kv_heads = hkv;
  r.head_dim = d;
  r.prob.assign(size_t(hq * n), 0.0);
  r.out.assign(size_t(hq * d), 0.0);
  r.lse.assign(size_t(hq), 0.0);

  std::vector<double> qd(size_t(hq * d));
  for (int64_t h = 0; h < hq; ++h) load_row(q, t, h, qd.data() + h * d);

  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const size_t items = size_t(hkv * chunks);

  // 1. scaled logits, written into prob
  parallel_for(items, threads, [&](size_t item) {
    const int64_t g = int64_t(item) / chunks, c = int64_t(item) % chunks;
    const int64_t j0 = c * kChunk, j1 = std::min(n, j0 + kChunk);
    std::vector<double> kd(static_cast<size_t>(d));
    for (int64_t j = j0; j < j1; ++j) {
      load_row(k, j, g, kd.data());
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const double* qh = qd.data() + h * d;
        double s = 0.0;
        for (int64_t i = 0; i < d; ++i) s += qh[i] * kd[size_t(i)];
        r.prob[size_t(h * n + j)] = s * scale;
      }
    }
  });

  // 2. softmax and lse per query head
  parallel_for(size_t(hq), threads, [&](size_t h) {
    double* p = r.prob.data() + h * size_t(n);
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(p[j] - m);
    const double lse = m + std::log(sum);
    for (int64_t j = 0; j < n; ++j) p[j] = std::exp(p[j] - lse);
    r.lse[h] = lse;
  });

  // 3. output: per-chunk partial sums, reduced in chunk order
  std::vector<double> partial(size_t(chunks * hq * d), 0.0);
  parallel_for(items, threads, [&](size_t item) {
    const int64_t g = int64_t(item) / chunks, c = int64_t(item) % chunks;
    const int64_t j0 = c * kChunk, j1 = std::min(n, j0 + kChunk);
    std::vector<double> vd(static_cast<size_t>(d));
    for (int64_t j = j0; j < j1; ++j) {
      load_row(v, j, g, vd.data());
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const double w = r.prob[size_t(h * n + j)];
        double* acc = partial.data() + (c * hq + h) * d;
        for (int64_t i = 0; i < d; ++i) acc[i] += w * vd[size_t(i)];
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t x = 0; x < hq * d; ++x) r.out[size_t(x)] += partial[size_t(c * hq * d + x)];

  // 4. ranks of keys by the group's summed softmax (the score of recall@k, docs/cli.md)
  if (!want_ranks) {
    r.rank.clear();
    return;
  }
  r.rank.assign(size_t(hkv * n), 0);
  parallel_for(size_t(hkv), threads, [&](size_t g) {
    std::vector<double> score(size_t(n), 0.0);
    for (int64_t h = int64_t(g) * group; h < int64_t(g + 1) * group; ++h) {
      const double* p = r.probs(h);
      for (int64_t j = 0; j < n; ++j) score[size_t(j)] += p[j];
    }
    std::vector<int32_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return score[size_t(a)] != score[size_t(b)] ? score[size_t(a)] > score[size_t(b)] : a < b;
    });
    int32_t* rk = r.rank.data() + g * size_t(n);
    for (int64_t i = 0; i < n; ++i) rk[order[size_t(i)]] = int32_t(i);
  });
}

}  // namespace kvcli
