// SPDX-License-Identifier: Apache-2.0
#include "methods/retroinfer/wave_index.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "backends/cpu/attention.hpp"
#include "core/error.hpp"

namespace kvs::retro {

int64_t round_half_even(double x) {
  const double f = std::floor(x), r = x - f;
  if (r > 0.5) return int64_t(f) + 1;
  if (r < 0.5) return int64_t(f);
  return int64_t(f) + (int64_t(f) % 2 != 0);
}

int64_t segment_count(int64_t n, int64_t segment_size) {
  if (segment_size <= 0) return 1;
  return std::max<int64_t>(round_half_even(double(n) / double(segment_size)), 1);
}

int64_t cluster_count(int64_t n, int64_t avg_cluster_size, int64_t align, int64_t segments) {
  const int64_t L = std::lcm(std::max<int64_t>(align, 1), std::max<int64_t>(segments, 1));
  const int64_t c = std::max(round_half_even(double(n) / double(avg_cluster_size)), L);
  const int64_t lower = c / L * L, upper = lower + L;
  return c - lower <= upper - c ? lower : upper;
}

int64_t update_cluster_count(int64_t u, int64_t avg_cluster_size, int64_t align) {
  const int64_t c = round_half_even(double(u) / double(avg_cluster_size));
  return std::max<int64_t>(c / align * align, align);
}

namespace {

// Grows v's capacity to n plus an eighth whenever n does not fit: the index's vectors grow by an
// update at a time, and the build sizes them exactly, so without the room the first update after a
// build copied the whole index (72 ms at 128K, 290 ms at 512K on an H200 host, for one 1024-token
// segment). Untouched capacity costs address space only.
template <class V>
void reserve_room(V& v, size_t n) {
  if (n > v.capacity()) v.reserve(n + n / 8);
}

constexpr int64_t kRowBlock = 256;

void normalise(float* c, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += double(c[i]) * c[i];
  if (s <= 0) return;
  const float inv = float(1.0 / std::sqrt(s));
  for (int i = 0; i < d; ++i) c[i] *= inv;
}

// out[i] = argmax_c <X_i, cent_c> (first maximum) for rows of X; scratch >= kRowBlock * k floats.
void assign_rows(const float* X, int64_t rows, int d, const float* cent, int64_t k, cpu::GemmProvider gemm,
                 int32_t* out, std::vector<float>& scratch) {
  scratch.resize(size_t(kRowBlock) * size_t(k));
  for (int64_t b = 0; b < rows; b += kRowBlock) {
    const int64_t r = std::min(kRowBlock, rows - b);
    cpu::sgemm(gemm, false, true, r, k, d, 1.f, X + size_t(b) * d, d, cent, d, 0.f, scratch.data(), k);
    for (int64_t i = 0; i < r; ++i) out[b + i] = int32_t(cpu::argmax(scratch.data() + size_t(i) * size_t(k), k));
  }
}

}  // namespace

void segmented_kmeans(const std::vector<float*>& X, int64_t n, int d, const KMeansConfig& cfg, ThreadPool& pool,
                      cpu::GemmProvider gemm, std::vector<std::vector<int32_t>>& assign,
                      std::vector<std::vector<float>>& centroids) {
  const int64_t H = int64_t(X.size()), C = cfg.clusters, s = cfg.segments;
  if (n < 1 || C < 1 || s < 1 || C % s != 0 || cfg.iterations < 1)
    invalid("retroinfer k-means: expected n >= 1, clusters a positive multiple of segments, iterations >= 1");
  const int64_t m = n / s, Cs = C / s;
  if (m < 1) invalid("retroinfer k-means: " + std::to_string(s) + " segments need at least as many tokens, got " + std::to_string(n));
  std::vector<std::vector<double>> mu(size_t(H), std::vector<double>(size_t(d), 0.0));
  assign.assign(size_t(H), std::vector<int32_t>(size_t(n), 0));
  centroids.assign(size_t(H), std::vector<float>(size_t(C) * d, 0.f));

  // Centring, per head.
  pool.parallel_for(H, [&](int64_t h) {
    if (!cfg.centre) return;
    float* x = X[size_t(h)];
    auto& m0 = mu[size_t(h)];
    for (int64_t t = 0; t < n; ++t)
      for (int i = 0; i < d; ++i) m0[size_t(i)] += x[size_t(t) * d + i];
    std::vector<float> mf(static_cast<size_t>(d));
    for (int i = 0; i < d; ++i) mf[size_t(i)] = float(m0[size_t(i)] / double(n));
    for (int64_t t = 0; t < n; ++t)
      for (int i = 0; i < d; ++i) x[size_t(t) * d + i] -= mf[size_t(i)];
    for (int i = 0; i < d; ++i) m0[size_t(i)] = mf[size_t(i)];
  });

  // Per-segment spherical iterations, one task per (head, segment).
  pool.parallel_for(H * s, [&](int64_t task) {
    const int64_t h = task / s, seg = task % s;
    const float* x = X[size_t(h)] + size_t(seg * m) * d;
    float* cent = centroids[size_t(h)].data() + size_t(seg * Cs) * d;
    for (int64_t c = 0; c < Cs; ++c) {
      if (cfg.raw_init) {  // kmeans.py: positions over the whole run, raw keys
        const int64_t cg = seg * Cs + c;
        int64_t idx = int64_t(std::floor(double(cg) * double(n) / double(C) + double(n) / (2.0 * double(C))));
        idx = std::clamp<int64_t>(idx, 0, n - 1);
        std::memcpy(cent + size_t(c) * d, X[size_t(h)] + size_t(idx) * d, sizeof(float) * size_t(d));
        continue;
      }
      int64_t idx = int64_t(std::floor(double(c) * double(m) / double(Cs) + double(m) / (2.0 * double(Cs))));
      idx = std::clamp<int64_t>(idx, 0, m - 1);
      std::memcpy(cent + size_t(c) * d, x + size_t(idx) * d, sizeof(float) * size_t(d));
      normalise(cent + size_t(c) * d, d);
    }
    std::vector<int32_t> a(static_cast<size_t>(m));
    std::vector<float> scratch;
    std::vector<double> sum(size_t(Cs) * d);
    std::vector<int64_t> cnt(static_cast<size_t>(Cs));
    for (int it = 0; it + 1 < cfg.iterations; ++it) {
      assign_rows(x, m, d, cent, Cs, gemm, a.data(), scratch);
      std::fill(sum.begin(), sum.end(), 0.0);
      std::fill(cnt.begin(), cnt.end(), 0);
      for (int64_t t = 0; t < m; ++t) {
        const int64_t c = a[size_t(t)];
        ++cnt[size_t(c)];
        double* sc = sum.data() + size_t(c) * d;
        const float* xr = x + size_t(t) * d;
        for (int i = 0; i < d; ++i) sc[i] += xr[i];
      }
      for (int64_t c = 0; c < Cs; ++c) {
        if (cnt[size_t(c)] == 0) continue;  // empty: keeps its centroid
        float* cc = cent + size_t(c) * d;
        for (int i = 0; i < d; ++i) cc[i] = float(sum[size_t(c) * d + i] / double(cnt[size_t(c)]));
        normalise(cc, d);
      }
    }
  });

  // Final global assignment of every row against all centroids, one task per (head, row block).
  const int64_t blocks = (n + 4 * kRowBlock - 1) / (4 * kRowBlock);
  pool.parallel_for(H * blocks, [&](int64_t task) {
    const int64_t h = task / blocks, b = (task % blocks) * 4 * kRowBlock;
    const int64_t r = std::min(4 * kRowBlock, n - b);
    std::vector<float> scratch;
    assign_rows(X[size_t(h)] + size_t(b) * d, r, d, centroids[size_t(h)].data(), C, gemm,
                assign[size_t(h)].data() + b, scratch);
  });

  // Un-normalised means (+ mu), per head.
  pool.parallel_for(H, [&](int64_t h) {
    const float* x = X[size_t(h)];
    const int32_t* a = assign[size_t(h)].data();
    std::vector<double> sum(size_t(C) * d, 0.0);
    std::vector<int64_t> cnt(static_cast<size_t>(C), 0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t c = a[t];
      ++cnt[size_t(c)];
      double* sc = sum.data() + size_t(c) * d;
      const float* xr = x + size_t(t) * d;
      for (int i = 0; i < d; ++i) sc[i] += xr[i];
    }
    float* cent = centroids[size_t(h)].data();
    const auto& m0 = mu[size_t(h)];
    for (int64_t c = 0; c < C; ++c)
      for (int i = 0; i < d; ++i) {
        const double v = cnt[size_t(c)] ? sum[size_t(c) * d + i] / double(cnt[size_t(c)]) : double(cent[size_t(c) * d + i]);
        cent[size_t(c) * d + i] = float(v + m0[size_t(i)]);
      }
  });
}

uint64_t WaveHead::bytes() const {
  return uint64_t(centroids.size() + value_sum.size()) * sizeof(float) + size.size() * sizeof(int32_t) +
         start.size() * sizeof(int64_t) + pos.size() * sizeof(int32_t) + keys.size() + values.size() + dcent.size() +
         dvmean.size();
}

void WaveHead::sync_decode(DType t, int d) {
  if (t == DType::F32) {
    mdt = t;
    std::vector<std::byte>().swap(dcent);
    std::vector<std::byte>().swap(dvmean);
    return;
  }
  if (t == DType::F16 && mdt == DType::BF16) t = DType::BF16;  // this head already left fp16's range
  const size_t rb = size_t(d) * 2;
  if (mdt != t) {
    dcent.clear();
    dvmean.clear();
    mdt = t;
  }
  const int64_t C = clusters();
  int64_t have = std::min<int64_t>(int64_t(dcent.size() / rb), C);
  auto mean_of = [&](int64_t c, float* mean) {
    const int32_t sz = size[size_t(c)];
    for (int i = 0; i < d; ++i) mean[i] = sz > 0 ? value_sum[size_t(c) * d + i] / float(sz) : 0.f;
  };
  std::vector<float> mean(static_cast<size_t>(d));
  if (t == DType::F16) {  // a value beyond fp16's range moves the whole head to bf16 (same exponent range as fp32)
    bool fits = true;
    for (int64_t c = have; c < C && fits; ++c) {
      mean_of(c, mean.data());
      for (int i = 0; i < d; ++i)
        if (!(std::abs(centroids[size_t(c) * d + i]) <= 65504.f) || !(std::abs(mean[size_t(i)]) <= 65504.f)) fits = false;
    }
    if (!fits) {
      t = mdt = DType::BF16;
      have = 0;
    }
  }
  reserve_room(dcent, size_t(C) * rb);
  reserve_room(dvmean, size_t(C) * rb);
  dcent.resize(size_t(C) * rb);
  dvmean.resize(size_t(C) * rb);
  for (int64_t c = have; c < C; ++c) {
    convert_from_f32(centroids.data() + size_t(c) * d, dcent.data() + size_t(c) * rb, t, size_t(d));
    mean_of(c, mean.data());
    convert_from_f32(mean.data(), dvmean.data() + size_t(c) * rb, t, size_t(d));
  }
}

void WaveHead::truncate_clusters(int64_t c, size_t row_bytes) {
  if (c >= clusters()) return;
  const int64_t r = c < clusters() ? start[size_t(c)] : rows();
  const size_t d = value_sum.size() / std::max<size_t>(size.size(), 1);
  centroids.resize(size_t(c) * d);
  value_sum.resize(size_t(c) * d);
  size.resize(size_t(c));
  start.resize(size_t(c));
  pos.resize(size_t(r));
  keys.resize(size_t(r) * row_bytes);
  values.resize(size_t(r) * row_bytes);
  if (mdt != DType::F32) {
    const size_t mb = size_t(d) * dtype_size(mdt);
    if (dcent.size() > size_t(c) * mb) {
      dcent.resize(size_t(c) * mb);
      dvmean.resize(size_t(c) * mb);
    }
  }
}

void append_clusters(WaveHead& head, const KVLayer& kv, int h, int64_t tok_begin, int64_t m, const int32_t* assign,
                     const float* centroids, int64_t C) {
  const int d = kv.head_dim();
  const size_t rb = size_t(d) * kv.elem_size();
  const int64_t r0 = head.rows(), c0 = head.clusters();
  std::vector<int64_t> cnt(static_cast<size_t>(C), 0);
  for (int64_t i = 0; i < m; ++i) ++cnt[size_t(assign[i])];
  reserve_room(head.centroids, size_t(c0 + C) * d);  // room for the updates to come
  reserve_room(head.value_sum, size_t(c0 + C) * d);
  reserve_room(head.size, size_t(c0 + C));
  reserve_room(head.start, size_t(c0 + C));
  reserve_room(head.pos, size_t(r0 + m));
  reserve_room(head.keys, size_t(r0 + m) * rb);
  reserve_room(head.values, size_t(r0 + m) * rb);
  head.centroids.insert(head.centroids.end(), centroids, centroids + size_t(C) * d);
  head.value_sum.resize(size_t(c0 + C) * d, 0.f);
  head.size.resize(size_t(c0 + C));
  head.start.resize(size_t(c0 + C));
  // The rows in cluster order (ascending positions inside each cluster: a stable counting sort),
  // then appended in that order: the new rows are written once, front to back (no zero fill, no
  // scattered stores), and each cluster's value sum is added up in one pass over its rows, in the
  // same order (ascending positions) as before.
  std::vector<int32_t> src(static_cast<size_t>(m));
  {
    std::vector<int64_t> next(static_cast<size_t>(C));
    int64_t at = 0;
    for (int64_t c = 0; c < C; ++c) {
      head.size[size_t(c0 + c)] = int32_t(cnt[size_t(c)]);
      head.start[size_t(c0 + c)] = r0 + at;
      next[size_t(c)] = at;
      at += cnt[size_t(c)];
    }
    for (int64_t i = 0; i < m; ++i) src[size_t(next[size_t(assign[i])]++)] = int32_t(i);
  }
  constexpr int64_t kAhead = 8;  // rows are gathered in cluster order: ask for them a few rows ahead
  for (int64_t j = 0; j < m; ++j) {
    if (j + kAhead < m) {
      const int64_t ta = tok_begin + src[size_t(j + kAhead)];
      for (size_t o = 0; o < rb; o += 64) {
        __builtin_prefetch(kv.k_row(h, ta) + o);
        __builtin_prefetch(kv.v_row(h, ta) + o);
      }
    }
    const int64_t t = tok_begin + src[size_t(j)];
    head.pos.push_back(int32_t(t));
    head.keys.insert(head.keys.end(), kv.k_row(h, t), kv.k_row(h, t) + rb);
    head.values.insert(head.values.end(), kv.v_row(h, t), kv.v_row(h, t) + rb);
  }
  std::vector<double> vs(static_cast<size_t>(d));
  std::vector<float> row(static_cast<size_t>(d));
  for (int64_t c = 0; c < C; ++c) {
    std::fill(vs.begin(), vs.end(), 0.0);
    const int64_t b = head.start[size_t(c0 + c)];
    for (int64_t j = b; j < b + cnt[size_t(c)]; ++j) {
      convert_to_f32(head.values.data() + size_t(j) * rb, kv.dtype(), row.data(), size_t(d));
      for (int i = 0; i < d; ++i) vs[size_t(i)] += row[size_t(i)];
    }
    float* out = head.value_sum.data() + size_t(c0 + c) * d;
    for (int i = 0; i < d; ++i) out[i] = float(vs[size_t(i)]);
  }
}

void cluster_attention(const WaveHead& head, const float* q, int d, float scale, const std::vector<int32_t>& ids,
                       float* o, float* lse) {
  std::vector<double> lg;
  std::vector<int32_t> use;
  double mx = -std::numeric_limits<double>::infinity();
  for (int32_t c : ids) {
    if (head.size[size_t(c)] == 0) continue;
    double s = 0;
    for (int i = 0; i < d; ++i) s += double(q[i]) * head.centroids[size_t(c) * d + i];
    lg.push_back(s * scale);
    use.push_back(c);
    mx = std::max(mx, lg.back());
  }
  std::fill(o, o + d, 0.f);
  if (use.empty()) {
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  double den = 0;
  std::vector<double> num(size_t(d), 0.0);
  for (size_t j = 0; j < use.size(); ++j) {
    const double w = std::exp(lg[j] - mx);
    den += w * head.size[size_t(use[j])];
    for (int i = 0; i < d; ++i) num[size_t(i)] += w * head.value_sum[size_t(use[j]) * d + i];
  }
  for (int i = 0; i < d; ++i) o[i] = float(num[size_t(i)] / den);
  *lse = float(mx + std::log(den));
}

}  // namespace kvs::retro
