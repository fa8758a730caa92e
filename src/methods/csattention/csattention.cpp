// SPDX-License-Identifier: Apache-2.0
// csattention: Centroid-Scoring Attention (arXiv 2604.08584, §§3.1-3.4 and App. B; docs/methods/csattention.md), CPU reference.
//
// Index (build_index, from the prompt's queries and keys), per layer and table head:
//   - the head dim is split into m subspaces (uniform d/m, or `splits`);
//   - per subspace, C unit centroids from spherical k-means (k-means++ seeding, mini-batch or
//     Lloyd) over the normalised query sub-vectors of a sample of the prompt's queries;
//   - centroid-key partial scores s_j^(b)(i) = c_j^(b) . k_i^(b) by one GEMM per subspace
//     (C x d_b times d_b x N through the GEMM layer), raw keys, no scaling;
//   - per centroid a fixed-length Top-L list (int32 token index + fp16 score) kept as a binary
//     min-heap, L = alpha N or `list_len`.
// Decode (select): per query head and subspace the nearest centroid (max cosine), the chosen lists
// gathered and reduced by key (s(i) = sum_b w_b V[i], a dense accumulator with epoch stamps), the
// recent window R and optional sinks forced, Top-(K - forced) from the rest (window inside the
// budget by default), exact attention by the session. The search runs every `period` steps; in
// between the previous search result is reused with the current window.
// Streaming (on_append): every appended key is scored against all m*C centroids and try-inserted
// into each list when it beats the list minimum; lists never grow; centroids are frozen.
// GQA: per KV head tables over the pooled group queries with the union of the G heads' lists
// (default), or per query head tables and selections.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

#include "backends/cpu/attention.hpp"
#include "backends/cpu/gemm.hpp"
#include "backends/cpu/topk.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/method.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"
#include "methods/csattention/csattention.hpp"
#include "methods/param_bounds.hpp"

namespace kvs {
std::atomic<bool> csa::g_force_recollect{false};
namespace {

using namespace csa;

std::vector<std::string> split_colon(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ':')) out.push_back(item);
  return out;
}

// Reduce-by-key into a dense per-table-head accumulator of N floats (512 KiB at 128K tokens: it
// stays in L2). Untouched slots hold -0.0f (bits 0x80000000); every added value is canonicalised by
// + 0.0f (never -0.0f), and a sum of such values is never -0.0f in round-to-nearest, so "touched"
// is exactly "bits != 0x80000000" without a separate stamp array. Entries of a token are added in
// list order (lists in (subspace, centroid) order), so results are deterministic and the SIMD and
// scalar paths agree bit for bit (each entry adds (w * V) + off rounded twice, as the CUDA kernels
// do: this file is compiled with -ffp-contract=off, CMakeLists.txt). Tokens within one list are distinct, so the AVX-512
// gather/add/scatter of 16 entries has no conflicts.
constexpr uint32_t kUntouched = 0x80000000u;

inline bool touched(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u != kUntouched;
}

template <class S>
void scatter_portable(const int32_t* idx, const S* val, int64_t L, float w, float off, float* acc) {
  for (int64_t i = 0; i < L; ++i) {
    const float v = w * score_f(val[i]) + off;
    acc[idx[i]] += v + 0.0f;
  }
}

__attribute__((target("avx512f,f16c"))) void scatter_f16_avx512(const int32_t* idx, const uint16_t* val, int64_t L,
                                                           float w, float off, float* acc) {
  const __m512 wv = _mm512_set1_ps(w), ov = _mm512_set1_ps(off), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= L; i += 16) {
    const __m512i ix = _mm512_loadu_si512(idx + i);
    const __m512 v = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(wv, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(val + i)))), ov),
        zero);
    const __m512 a = _mm512_mask_i32gather_ps(zero, __mmask16(0xFFFF), ix, acc, 4);
    _mm512_i32scatter_ps(acc, ix, _mm512_add_ps(a, v), 4);
  }
  for (; i < L; ++i) {
    const float v = w * _cvtsh_ss(val[i]) + off;
    acc[idx[i]] += v + 0.0f;
  }
}

__attribute__((target("avx512f,f16c"))) void scatter_f32_avx512(const int32_t* idx, const float* val, int64_t L, float w,
                                                           float off, float* acc) {
  const __m512 wv = _mm512_set1_ps(w), ov = _mm512_set1_ps(off), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= L; i += 16) {
    const __m512i ix = _mm512_loadu_si512(idx + i);
    const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(wv, _mm512_loadu_ps(val + i)), ov), zero);
    const __m512 a = _mm512_mask_i32gather_ps(zero, __mmask16(0xFFFF), ix, acc, 4);
    _mm512_i32scatter_ps(acc, ix, _mm512_add_ps(a, v), 4);
  }
  for (; i < L; ++i) {
    const float v = w * val[i] + off;
    acc[idx[i]] += v + 0.0f;
  }
}

__attribute__((target("avx2,f16c"))) void scatter_f16_f16c(const int32_t* idx, const uint16_t* val, int64_t L, float w,
                                                          float off, float* acc) {
  alignas(32) float vf[8];
  const __m256 wv = _mm256_set1_ps(w), ov = _mm256_set1_ps(off), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= L; i += 8) {
    _mm256_store_ps(
        vf, _mm256_add_ps(
                _mm256_add_ps(_mm256_mul_ps(wv, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(val + i)))), ov),
                zero));
    for (int l = 0; l < 8; ++l) acc[idx[i + l]] += vf[l];
  }
  for (; i < L; ++i) {
    const float v = w * _cvtsh_ss(val[i]) + off;
    acc[idx[i]] += v + 0.0f;
  }
}

// Candidates of [b, e): touched slots with score >= tau, appended in token order to tok/sc;
// returns the number of touched slots seen. Every slot read is reset to untouched (-0.0f), so the
// accumulator needs no separate clearing pass.
int64_t collect_portable(float* acc, int64_t b, int64_t e, float tau, int32_t* tok, float* sc, int64_t* nout) {
  int64_t nt = 0, k = *nout;
  for (int64_t t = b; t < e; ++t) {
    const float v = acc[t];
    if (!touched(v)) continue;
    acc[t] = -0.0f;
    ++nt;
    if (v >= tau) {
      tok[k] = int32_t(t);
      sc[k++] = v;
    }
  }
  *nout = k;
  return nt;
}

__attribute__((target("avx512f,f16c"))) int64_t collect_avx512(float* acc, int64_t b, int64_t e, float tau,
                                                         int32_t* tok, float* sc, int64_t* nout) {
  int64_t nt = 0, k = *nout, t = b;
  const __m512i neg0 = _mm512_set1_epi32(int(kUntouched));
  const __m512 tv = _mm512_set1_ps(tau);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i ids = _mm512_add_epi32(_mm512_set1_epi32(int32_t(t)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (; t + 16 <= e; t += 16) {
    const __m512 v = _mm512_loadu_ps(acc + t);
    _mm512_storeu_si512(acc + t, neg0);
    const __mmask16 tm = _mm512_cmpneq_epi32_mask(_mm512_castps_si512(v), neg0);
    const __mmask16 km = _mm512_mask_cmp_ps_mask(tm, v, tv, _CMP_GE_OQ);
    nt += __builtin_popcount(unsigned(tm));
    if (km) {
      _mm512_mask_compressstoreu_epi32(tok + k, km, ids);
      _mm512_mask_compressstoreu_ps(sc + k, km, v);
      k += __builtin_popcount(unsigned(km));
    }
    ids = _mm512_add_epi32(ids, step);
  }
  *nout = k;
  return nt + collect_portable(acc, t, e, tau, tok, sc, nout);
}

// AVX2: 8 slots per compare; the few candidates are appended from the mask bits (no compress
// store before AVX-512), in token order like the other paths.
__attribute__((target("avx2,f16c"))) int64_t collect_avx2(float* acc, int64_t b, int64_t e, float tau, int32_t* tok,
                                                        float* sc, int64_t* nout) {
  int64_t nt = 0, k = *nout, t = b;
  const __m256i neg0 = _mm256_set1_epi32(int(kUntouched));
  const __m256 tv = _mm256_set1_ps(tau);
  for (; t + 8 <= e; t += 8) {
    const __m256 v = _mm256_loadu_ps(acc + t);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + t), neg0);
    const __m256 untouched = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_castps_si256(v), neg0));
    const unsigned um = unsigned(_mm256_movemask_ps(untouched));
    nt += 8 - __builtin_popcount(um);
    unsigned km = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(v, tv, _CMP_GE_OQ))) & ~um & 0xFFu;
    if (km) {
      alignas(32) float vf[8];
      _mm256_store_ps(vf, v);
      for (; km; km &= km - 1) {
        const int l = __builtin_ctz(km);
        tok[k] = int32_t(t + l);
        sc[k++] = vf[l];
      }
    }
  }
  *nout = k;
  return nt + collect_portable(acc, t, e, tau, tok, sc, nout);
}

const bool kHaveF16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");
// KVS_CSA_SCATTER=avx2 keeps the F16C/AVX2 reduce (8-wide convert, scalar adds) on an AVX-512 CPU
// instead of the gather/scatter one, for comparisons (like KVS_CPU_ISA; results are bit-identical).
const bool kScatter512 = kHaveAvx512 && [] {
  const char* e = std::getenv("KVS_CSA_SCATTER");
  return !(e && std::strcmp(e, "avx2") == 0);
}();

// Bounds of the parameters that size memory or time (docs/methods/csattention.md).
constexpr int64_t kMaxCentroids = int64_t(1) << 20;  // per subspace, before the clamp to the query rows
constexpr int64_t kMaxIters = 1000;                  // k-means iterations (the paper uses 10)
constexpr int64_t kMaxSample = int64_t(1) << 20;     // prompt queries kept for the clustering

struct Schedule {
  double rho;
  int64_t period;
};

class CSAttention final : public Method {
 public:
  CSAttention(const MethodContext& ctx, const ParamSet& p) : ctx_(ctx) {
    const auto& s = ctx.shape;
    d_ = int(s.head_dim);
    G_ = s.group();
    // Integers are range-checked at int64 before they are narrowed (param_bounds.hpp); those that
    // size memory or time have bounds (docs/methods/csattention.md).
    constexpr int64_t kTok = (int64_t(1) << 31) - 1;  // token counts and indices are int32
    // 0 (the default): 8 subspaces (the paper's m), but none narrower than 8 dims. A spherical
    // k-means of 1- to 4-dim sub-vectors keeps little more than their signs (a 1-dim sub-vector
    // normalises to +-1), so small heads get fewer, wider subspaces: d 8 -> 1, 16 -> 2, 32 -> 4
    // (with longer lists, below).
    m_ = int(int_param(p, "csattention", "subspaces", 0, d_, "0 = auto, else at most head_dim"));
    const bool auto_m = m_ == 0;
    if (auto_m) m_ = std::min(8, std::max(1, d_ / 8));
    C_ = int_param(p, "csattention", "centroids", 1, kMaxCentroids,
                   "per subspace; clamped at build time to the sampled prompt queries");
    alpha_ = p.get_float("list_frac");
    list_len_ = int_param(p, "csattention", "list_len", 0, kTok, "0 = list_frac * N; clamped at build time to N");
    km_.iters = int(int_param(p, "csattention", "iters", 0, kMaxIters));
    km_.batch = int(int_param(p, "csattention", "batch", 1, kTok));
    km_.full_batch = p.get_string("kmeans") == "lloyd";
    km_.init_queries = p.get_string("init") == "queries";
    seed_ = uint64_t(p.get_int("seed"));
    sample_ = int_param(p, "csattention", "sample", 1, kMaxSample, "prompt queries kept for the clustering");
    f16_ = p.get_string("score_dtype") == "f16";
    qnorm_ = p.get_string("weights") == "qnorm";
    recent_ = int_param(p, "csattention", "recent", -1, kTok);
    recent_frac_ = p.get_float("recent_frac");
    sinks_ = int_param(p, "csattention", "sinks", 0, kTok);
    window_in_budget_ = p.get_bool("window_in_budget");
    period_ = int_param(p, "csattention", "period", 1, kTok);
    per_query_ = p.get_string("gqa") == "per_query_head";
    group_sum_ = p.get_string("group_pick") == "sum";
    rerank_ = p.get_float("rerank");
    missing_min_ = p.get_string("missing") == "list_min";
    const std::string sched = p.get_string("schedule");
    if (sched != "none") {
      sched_ = true;
      schedule_.rho = sched == "0.05-step-1" ? 0.05 : sched == "0.15-step-4" ? 0.15 : 0.20;
      schedule_.period = sched == "0.05-step-1" ? 1 : sched == "0.15-step-4" ? 4 : 8;
      period_ = schedule_.period;
    }
    const std::string splits = p.get_string("splits");
    if (splits.empty()) {
      if (d_ % m_)
        invalid("method_params: csattention subspaces must divide head_dim=" + std::to_string(d_) +
                " for a uniform split (or give splits=a:b:...), got " + std::to_string(m_));
      for (int b = 0; b < m_; ++b) db_.push_back(d_ / m_);
    } else {
      int sum = 0;
      for (auto& t : split_colon(splits)) {
        char* end = nullptr;
        const long v = std::strtol(t.c_str(), &end, 10);
        if (t.empty() || *end || v < 1 || v > d_)
          invalid("method_params: csattention splits must be colon-separated positive sizes, got '" + splits + "'");
        db_.push_back(int(v));
        sum += int(v);
      }
      if (int(db_.size()) != m_ || sum != d_)
        invalid("method_params: csattention splits must have subspaces=" + std::to_string(m_) +
                " sizes summing to head_dim=" + std::to_string(d_) + ", got '" + splits + "'");
    }
    for (int b = 0, o = 0; b < m_; ++b) {
      off_.push_back(o);
      o += db_[size_t(b)];
    }
    if (!(alpha_ > 0.0 && alpha_ <= 1.0)) invalid("method_params: csattention list_frac must be in (0, 1]");
    // Fewer subspaces than the paper's 8 (auto, small heads): lists 8/m times longer, so the tables
    // keep the paper's size (m * C * L) and the step the same pool of candidates.
    if (auto_m && m_ < 8) alpha_ = std::min(1.0, alpha_ * 8.0 / m_);
    if (!(recent_frac_ >= 0.0 && recent_frac_ <= 1.0)) invalid("method_params: csattention recent_frac must be in [0, 1]");
    if (!(rerank_ == 0.0 || (rerank_ >= 1.0 && rerank_ <= 64.0)))
      invalid("method_params: csattention rerank must be 0 (off) or in [1, 64], got " + std::to_string(rerank_));
    const std::string wl = p.get_string("weight_list");
    w_.assign(size_t(m_), 1.f);
    if (!wl.empty()) {
      auto parts = split_colon(wl);
      if (int(parts.size()) != m_)
        invalid("method_params: csattention weight_list must have subspaces=" + std::to_string(m_) +
                " colon-separated numbers, got '" + wl + "'");
      for (int b = 0; b < m_; ++b) {
        char* end = nullptr;
        const double v = std::strtod(parts[size_t(b)].c_str(), &end);
        if (parts[size_t(b)].empty() || *end || !std::isfinite(v) || v < 0 || v > double(std::numeric_limits<float>::max()))
          invalid("method_params: csattention weight_list entries must be numbers in [0, 3.4e38] (float), got '" + wl + "'");
        w_[size_t(b)] = float(v);
      }
    }
    km_.C = int(C_);
    TH_ = per_query_ ? int(s.num_q_heads) : int(s.num_kv_heads);
    layers_.resize(s.num_layers);
    P_ = Params{d_, G_, m_, TH_, C_, list_len_, sample_, recent_, sinks_, period_, alpha_, recent_frac_, rerank_,
                seed_, f16_, qnorm_, window_in_budget_, per_query_, group_sum_, missing_min_, sched_,
                schedule_.rho, km_, db_, off_, w_};
  }

  const Params& params() const { return P_; }
  LayerTables tables(uint32_t layer) {
    auto& L = layers_[layer];
    L.minv.clear();  // the caller may write the lists
    return LayerTables{&L.built, &L.dense_fallback, &L.L, &L.C, &L.indexed, &L.step, &L.cent, &L.idx, &L.v16, &L.v32, &L.cached};
  }

  // ---- prefill: keep a systematic sample of the prompt's queries (every stride-th token) ----
  void on_prefill(uint32_t layer, const float* q, int64_t n, const KVLayer& kv) override {
    auto& L = layers_[layer];
    if (L.built) return;  // a tables-only load gets its prompt again: the index is already there
    const size_t row = size_t(ctx_.shape.num_q_heads) * d_;
    const int64_t n0 = kv.size() - n;
    const int64_t cap = std::max<int64_t>(1, per_query_ ? sample_ : sample_ / G_);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = n0 + i;
      if (t % L.stride) continue;
      L.qtok.push_back(t);
      L.qrows.insert(L.qrows.end(), q + size_t(i) * row, q + size_t(i + 1) * row);
      while (int64_t(L.qtok.size()) > cap) thin(L, row);
    }
  }

  void build_index(uint32_t layer, const KVLayer& kv) override {
    auto& L = layers_[layer];
    const int64_t N = kv.size();
    if (L.qtok.empty())
      fail(KVS_STATUS_INVALID_STATE, "csattention: layer " + std::to_string(layer) + " has no prompt queries to cluster");
    L.L = std::clamp<int64_t>(list_len_ > 0 ? list_len_ : int64_t(std::llround(alpha_ * double(N))), 1, N);
    // C is clamped to the rows the k-means clusters (the sampled prompt queries, pooled over the
    // group per KV head): more centroids than points only repeat seeds, and every centroid costs a
    // row of N scores and m lists (1e6 centroids over a 64-token prompt used to run for minutes).
    L.C = std::min<int64_t>(C_, int64_t(L.qtok.size()) * (per_query_ ? 1 : G_));
    const size_t per_head_lists = size_t(m_) * L.C * L.L;
    L.cent.assign(size_t(TH_) * L.C * d_, 0.f);
    L.idx.assign(size_t(TH_) * per_head_lists, 0);
    if (f16_) L.v16.assign(L.idx.size(), 0);
    else L.v32.assign(L.idx.size(), 0.f);
    const auto gemm = cpu::GemmProvider(ctx_.gemm);
    const size_t row = size_t(ctx_.shape.num_q_heads) * d_;
    const int64_t ntok = int64_t(L.qtok.size());
    ctx_.pool->parallel_for(TH_, [&](int64_t th) {
      const int h = int(th), kvh = per_query_ ? h / G_ : h;
      // The head's keys in fp32 [N][d].
      std::vector<float> kf(size_t(N) * d_);
      for (int64_t t = 0; t < N; ++t) convert_to_f32(kv.k_row(kvh, t), kv.dtype(), &kf[size_t(t) * d_], size_t(d_));
      const int gq = per_query_ ? 1 : G_;
      const int64_t rows = ntok * gq;
      std::vector<float> X, scores(size_t(L.C) * N), tmp;
      for (int b = 0; b < m_; ++b) {
        const int db = db_[size_t(b)], off = off_[size_t(b)];
        // Normalised query sub-vectors of the sample (pooled over the group in per-KV-head mode).
        X.assign(size_t(rows) * db, 0.f);
        for (int64_t r = 0; r < ntok; ++r)
          for (int g = 0; g < gq; ++g) {
            const int qh = per_query_ ? h : h * G_ + g;
            const float* src = L.qrows.data() + size_t(r) * row + size_t(qh) * d_ + off;
            float* dst = &X[size_t(r * gq + g) * db];
            double nn = 0;
            for (int i = 0; i < db; ++i) nn += double(src[i]) * src[i];
            if (nn > 0) {
              const float inv = float(1.0 / std::sqrt(nn));
              for (int i = 0; i < db; ++i) dst[i] = src[i] * inv;
            }
          }
        float* cent = centroids(L, h, b);
        KMeansConfig kc = km_;
        kc.C = int(L.C);
        kc.seed = seed_ * 0x9E3779B97F4A7C15ull + uint64_t(layer) * 1000003ull + uint64_t(h) * 8191ull + uint64_t(b);
        spherical_kmeans(X.data(), rows, db, kc, gemm, cent);
        // Centroid-key partial scores [C][N] = cent [C][db] x K^(b)^T.
        cpu::sgemm(gemm, false, true, L.C, N, db, 1.f, cent, db, kf.data() + off, d_, 0.f, scores.data(), N);
        for (int64_t j = 0; j < L.C; ++j) {
          float* srow = scores.data() + size_t(j) * N;
          if (f16_) round_f16(srow, N);
          const size_t base = list_base(L, h, b, j);
          if (f16_) build_list(srow, N, L.L, &L.idx[base], &L.v16[base], tmp);
          else build_list(srow, N, L.L, &L.idx[base], &L.v32[base], tmp);
        }
      }
    });
    L.indexed = N;
    L.built = true;
    L.dense_fallback = false;
    L.undo.clear();
    L.minv.clear();
    L.step = 0;
    L.cached.clear();
    std::vector<float>().swap(L.qrows);
    std::vector<int64_t>().swap(L.qtok);
    const double ratio = double(table_bytes(L)) / double(kv_bytes(N));
    if (ratio > 1.0)
      logf(LogLevel::Warn,
           "csattention: layer %u tables (%.1f MiB) exceed its KV cache (%.1f MiB), ratio %.2f; lower centroids or list_frac",
           layer, double(table_bytes(L)) / 1048576.0, double(kv_bytes(N)) / 1048576.0, ratio);
  }

  // ---- streaming update ----
  void on_append(uint32_t layer, const float*, int64_t, const KVLayer& kv, bool) override {
    auto& L = layers_[layer];
    L.undo.clear();  // the previous call succeeded: its inserts are final
    if (!L.built || L.dense_fallback) return;
    const int64_t n = kv.size();
    if (L.indexed >= n) return;
    const int64_t t0 = L.indexed;
    std::vector<std::vector<Undo>> logs(static_cast<size_t>(TH_));
    if (L.L <= 0) {  // no list to enter
      L.indexed = n;
      return;
    }
    const size_t lists = size_t(TH_) * size_t(m_) * size_t(L.C);
    if (L.minv.size() != lists) {
      L.minv.resize(lists);
      for (size_t i = 0; i < lists; ++i) L.minv[i] = f16_ ? score_f(L.v16[i * size_t(L.L)]) : L.v32[i * size_t(L.L)];
    }
    auto work = [&](int64_t th) {
      const int h = int(th), kvh = per_query_ ? h / G_ : h;
      std::vector<float> k(static_cast<size_t>(d_)), sc(size_t(m_) * size_t(L.C));
      float* minv = L.minv.data() + size_t(h) * m_ * size_t(L.C);  // [m][C] of this head
      for (int64_t t = t0; t < n; ++t) {
        convert_to_f32(kv.k_row(kvh, t), kv.dtype(), k.data(), size_t(d_));
        for (int b = 0; b < m_; ++b) {
          const int db = db_[size_t(b)], off = off_[size_t(b)];
          const float* cent = centroids(L, h, b);
          const float* kb = k.data() + off;
          for (int64_t j = 0; j < L.C; ++j) {
            const float* c = cent + size_t(j) * db;
            // Eight partial sums (vectorised by the compiler; one running sum is a dependency chain).
            float s8[8] = {};
            int i = 0;
            for (; i + 8 <= db; i += 8)
              for (int u = 0; u < 8; ++u) s8[u] += c[i + u] * kb[i + u];
            for (; i < db; ++i) s8[0] += c[i] * kb[i];
            sc[size_t(b) * L.C + size_t(j)] = ((s8[0] + s8[4]) + (s8[1] + s8[5])) + ((s8[2] + s8[6]) + (s8[3] + s8[7]));
          }
        }
        // A list is touched only when the key enters it: its stored score above the list's
        // minimum (heap_try_insert's own test, on the same stored value), which after the first
        // steps few keys pass; the m*C lists lie far apart, each a cache miss.
        for (int64_t i = 0; i < m_ * L.C; ++i) {
          const float s = sc[size_t(i)];
          float stored;
          if (f16_) {
            uint16_t sv;
            score_store(sv, s);
            stored = score_f(sv);
          } else {
            stored = s;
          }
          if (!(stored > minv[i])) continue;
          const size_t base = list_base(L, h, int(i / L.C), i % L.C);
          Undo u{base, int32_t(t), 0, 0};
          bool ins;
          if (f16_) {
            uint16_t ev;
            ins = heap_try_insert(&L.idx[base], &L.v16[base], L.L, int32_t(t), s, &u.old_idx, &ev);
            u.old_bits = ev;
            minv[i] = score_f(L.v16[base]);
          } else {
            float ev;
            ins = heap_try_insert(&L.idx[base], &L.v32[base], L.L, int32_t(t), s, &u.old_idx, &ev);
            std::memcpy(&u.old_bits, &ev, 4);
            minv[i] = L.v32[base];
          }
          if (ins) logs[size_t(h)].push_back(u);
        }
      }
    };
    if ((n - t0) * TH_ >= 4) ctx_.pool->parallel_for(TH_, work);
    else for (int h = 0; h < TH_; ++h) work(h);
    for (auto& lg : logs) L.undo.insert(L.undo.end(), lg.begin(), lg.end());
    std::sort(L.undo.begin(), L.undo.end(), [](const Undo& a, const Undo& b) { return a.token < b.token; });
    L.indexed = n;
  }

  void truncate(uint32_t layer, int64_t n) override {
    auto& L = layers_[layer];
    if (!L.built) {  // prompt chunks: drop the sampled queries of tokens >= n
      size_t keep = 0;
      while (keep < L.qtok.size() && L.qtok[keep] < n) ++keep;
      L.qtok.resize(keep);
      L.qrows.resize(keep * size_t(ctx_.shape.num_q_heads) * d_);
      return;
    }
    for (auto& c : L.cached) c.erase(std::remove_if(c.begin(), c.end(), [&](int32_t t) { return t >= n; }), c.end());
    if (L.indexed <= n) return;
    const int64_t first_logged = L.undo.empty() ? L.indexed : std::min<int64_t>(L.undo.front().token, L.indexed);
    // Inserts of tokens >= n are undone in reverse order (the evicted entry comes back).
    while (!L.undo.empty() && L.undo.back().token >= n) {
      const Undo u = L.undo.back();
      L.undo.pop_back();
      int32_t* idx = &L.idx[u.base];
      int64_t p = 0;
      while (p < L.L && idx[p] != u.token) ++p;
      if (p == L.L) continue;
      idx[p] = u.old_idx;
      if (f16_) {
        L.v16[u.base + size_t(p)] = uint16_t(u.old_bits);
        heap_make(idx, &L.v16[u.base], L.L);
        if (!L.minv.empty()) L.minv[u.base / size_t(L.L)] = score_f(L.v16[u.base]);
      } else {
        std::memcpy(&L.v32[u.base + size_t(p)], &u.old_bits, 4);
        heap_make(idx, &L.v32[u.base], L.L);
        if (!L.minv.empty()) L.minv[u.base / size_t(L.L)] = L.v32[u.base];
      }
    }
    if (n < first_logged && n < L.indexed) {
      // Beyond what the undo log covers (not reachable through the session, which only rolls back
      // its latest call): the lists may name tokens that are gone, so attend densely.
      L.dense_fallback = true;
      logf(LogLevel::Warn, "csattention: layer %u truncated below its indexed prompt; decoding densely", layer);
    }
    L.indexed = n;
  }

  // ---- decode ----
  void select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) override {
    auto& L = layers_[layer];
    const int64_t n = kv.size();
    if (!L.built || L.dense_fallback) {
      out.kind = Selection::Kind::All;
      out.lists.clear();
      return;
    }
    if (L.indexed < n) on_append(layer, q, n - L.indexed, kv, true);  // keys appended without on_append
    const StepKeys sk = step_keys(P_, ctx_.budget, n);
    const int64_t s_end = sk.s_end, w_begin = sk.w_begin, rest = sk.rest;
    const bool search = L.cached.size() != size_t(TH_) || L.step % period_ == 0;
    ++L.step;
    if (search) {
      L.cached.resize(size_t(TH_));
      // One task per pool thread, each taking table heads in turn with its own scratch: the dense
      // accumulator (N floats) is reset after every head and so stays in the thread's cache for
      // the next head instead of one cold accumulator per head.
      const int64_t T = std::min<int64_t>(int64_t(ctx_.pool->size()), TH_);
      if (int64_t(scratch_.size()) < T) scratch_.resize(size_t(T));
      head_union_.resize(size_t(TH_));
      std::atomic<int64_t> next{0};
      ctx_.pool->parallel_for(T, [&](int64_t task) {
        for (int64_t th; (th = next.fetch_add(1)) < TH_;)
          search_head(L, int(th), scratch_[size_t(task)], q, kv, n, s_end, w_begin, rest);
      });
      ++searches_;
      for (int64_t u : head_union_) union_sum_ += double(u);
      union_samples_ += TH_;
    }
    out.kind = per_query_ ? Selection::Kind::PerQueryHead : Selection::Kind::PerKvHead;
    out.lists.resize(size_t(TH_));
    // Sorted without a sort: sinks < the searched keys in [s_end, w_begin) (kept sorted) < window.
    for (int h = 0; h < TH_; ++h) {
      auto& l = out.lists[size_t(h)];
      const auto& c = L.cached[size_t(h)];
      l.clear();
      l.reserve(size_t(sk.s_emit + (n - sk.w_emit)) + c.size());
      for (int64_t t = 0; t < sk.s_emit; ++t) l.push_back(int32_t(t));
      for (int32_t t : c)
        if (t >= s_end && t < w_begin) l.push_back(t);
      for (int64_t t = sk.w_emit; t < n; ++t) l.push_back(int32_t(t));
    }
  }

  // ---- tables ----
  nlohmann::json save_meta() const override {
    nlohmann::json meta = figures();
    nlohmann::json layers = nlohmann::json::object();
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      if (!L.built) continue;
      layers[std::to_string(l)] = {{"indexed_tokens", L.indexed}, {"list_len", L.L}, {"centroids", L.C}, {"step", L.step},
                                   {"table_bytes", table_bytes(L)}, {"dense_fallback", L.dense_fallback}};
    }
    meta["layers"] = layers;
    return meta;
  }

  void save(io::TablesWriter& w) const override {
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      if (!L.built) continue;
      const int32_t li = int32_t(l);
      w.add("csa.cent", li, -1, {io::Piece{L.cent.data(), uint64_t(L.cent.size() * 4)}});
      w.add("csa.idx", li, -1, {io::Piece{L.idx.data(), uint64_t(L.idx.size() * 4)}});
      if (f16_) w.add("csa.val", li, -1, {io::Piece{L.v16.data(), uint64_t(L.v16.size() * 2)}});
      else w.add("csa.val", li, -1, {io::Piece{L.v32.data(), uint64_t(L.v32.size() * 4)}});
      if (L.cached.size() == size_t(TH_)) {  // the period's reused search result
        std::vector<int32_t> sel;
        for (auto& c : L.cached) sel.push_back(int32_t(c.size()));
        for (auto& c : L.cached) sel.insert(sel.end(), c.begin(), c.end());
        w.add_copy("csa.sel", li, -1, sel.data(), sel.size() * 4);
      }
    }
  }

  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    const io::HeaderReader hm(f.path(), "method.meta");
    const nlohmann::json layers = hm.has(meta, "layers") ? hm.object(meta, "layers") : nlohmann::json::object();
    constexpr int64_t kTok = (int64_t(1) << 31) - 1;
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const auto key = std::to_string(l);
      const auto* cs = f.find("csa.cent", int32_t(l), -1);
      if (!cs) continue;
      auto bad = [&](const std::string& what) {
        fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "csattention tables layer " + key + ": " + what);
      };
      if (!layers.contains(key)) bad("no entry in method.meta.layers");
      const auto& lm = layers[key];
      const auto hl = hm.sub("layers").sub(key);
      auto& L = layers_[l];
      L.indexed = hl.integer<int64_t>(lm, "indexed_tokens", 1, kTok);
      L.L = hl.integer<int64_t>(lm, "list_len", 1, L.indexed);
      // Files written before the clamp hold the parameter's C.
      L.C = hl.integer_or<int64_t>(lm, "centroids", 1, C_, C_);
      L.step = hl.integer_or<int64_t>(lm, "step", 0, std::numeric_limits<int64_t>::max(), 0);
      L.dense_fallback = hl.boolean_or(lm, "dense_fallback", false);
      // TH * m * C <= 2^13 * 2^8 * 2^20 and TH * C * d fit in uint64; times L (< 2^31) need not, so
      // the list count is derived from the section and compared.
      const uint64_t per_len = uint64_t(TH_) * m_ * L.C;
      const auto& is = f.require("csa.idx", int32_t(l), -1);
      const auto& vs = f.require("csa.val", int32_t(l), -1);
      if (cs->length != uint64_t(TH_) * L.C * d_ * 4) bad("csa.cent size does not match the shape and centroids");
      const uint64_t lists = is.length / 4;
      if (is.length % 4 || lists % per_len || lists / per_len != uint64_t(L.L))
        bad("csa.idx size does not match list_len and the shape");
      if (vs.length != lists * (f16_ ? 2 : 4)) bad("csa.val size does not match list_len and score_dtype");
      L.cent.resize(size_t(TH_) * L.C * d_);
      std::memcpy(L.cent.data(), cs->data, cs->length);
      L.idx.resize(size_t(lists));
      std::memcpy(L.idx.data(), is.data, is.length);
      for (int32_t t : L.idx)
        if (t < 0 || t >= L.indexed) bad("csa.idx holds a token index outside [0, indexed_tokens)");
      if (f16_) {
        L.v16.resize(size_t(lists));
        std::memcpy(L.v16.data(), vs.data, vs.length);
      } else {
        L.v32.resize(size_t(lists));
        std::memcpy(L.v32.data(), vs.data, vs.length);
      }
      L.cached.clear();
      if (const auto* ss = f.find("csa.sel", int32_t(l), -1)) {
        const int32_t* p = reinterpret_cast<const int32_t*>(ss->data);
        const uint64_t words = ss->length / 4;
        if (ss->length % 4 || words < uint64_t(TH_)) bad("csa.sel too short");
        uint64_t total = TH_;
        for (int h = 0; h < TH_; ++h) {
          if (p[h] < 0) bad("csa.sel has a negative count");
          total += uint64_t(p[h]);
        }
        if (total != words) bad("csa.sel size does not match its counts");
        L.cached.resize(size_t(TH_));
        const int32_t* q = p + TH_;
        for (int h = 0; h < TH_; ++h) {
          L.cached[size_t(h)].assign(q, q + p[h]);
          std::sort(L.cached[size_t(h)].begin(), L.cached[size_t(h)].end());
          for (int32_t t : L.cached[size_t(h)])
            if (t < 0 || t >= L.indexed) bad("csa.sel holds a token index outside [0, indexed_tokens)");
          q += p[h];
        }
      }
      L.built = true;
      L.undo.clear();
      L.minv.clear();
    }
  }

  std::unique_ptr<Method> clone() const override { return std::make_unique<CSAttention>(*this); }

  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    const auto& L = layers_[layer];
    if (!L.built || L.indexed <= tokens) return true;
    *why = "its csattention tables index " + std::to_string(L.indexed) + " tokens";
    return false;
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (auto& L : layers_) b += table_bytes(L);
    return b;
  }

  bool stat(std::string_view name, double* out) const override {
    if (name == "table_kv_ratio") {
      uint64_t kvb = 0;
      for (auto& L : layers_)
        if (L.built) kvb += kv_bytes(L.indexed);
      *out = kvb ? double(index_bytes()) / double(kvb) : 0.0;
    } else if (name == "paper_ratio") {
      *out = paper_ratio();
    } else if (name == "mean_union") {
      *out = union_samples_ ? union_sum_ / double(union_samples_) : 0.0;
    } else if (name == "searches") {
      *out = double(searches_);
    } else if (name == "list_len") {
      *out = 0;
      for (auto& L : layers_)
        if (L.built) {
          *out = double(L.L);
          break;
        }
    } else {
      return false;
    }
    return true;
  }

 private:
  struct Undo {
    size_t base;
    int32_t token;
    int32_t old_idx;
    uint32_t old_bits;
  };
  struct LayerState {
    // Before build: sampled prompt tokens and their query rows [kept][Hq][d].
    int64_t stride = 1;
    std::vector<int64_t> qtok;
    std::vector<float> qrows;
    // Tables.
    bool built = false, dense_fallback = false;
    int64_t L = 0, indexed = 0;
    int64_t C = 0;  // centroids per subspace: the parameter, clamped to the clustered query rows
    std::vector<float> cent;     // [TH][subspace b: C x d_b] (C * d floats per head)
    std::vector<int32_t> idx;    // [TH][m][C][L]
    std::vector<uint16_t> v16;   // [TH][m][C][L] fp16 scores (score_dtype=f16)
    std::vector<float> v32;      // fp32 scores (score_dtype=f32)
    std::vector<Undo> undo;      // inserts of the latest call, by token
    // Each list's minimum (its heap root's score) in one dense array [TH][m][C], kept by on_append
    // so that a new key touches only the lists it enters; empty = to be read from the roots (after
    // a build, a load, a truncation or a hand-out of the tables).
    std::vector<float> minv;
    // Search period.
    int64_t step = 0;
    std::vector<std::vector<int32_t>> cached;
  };
  struct Scratch {
    std::vector<float> acc;  // dense accumulator, -0.0f = untouched (kept so between searches)
    std::vector<std::pair<int64_t, float>> picks;
    std::vector<float> qsum, smp, csc;
    std::vector<int32_t> ctok;
    std::vector<uint32_t> rtmp;  // radix-select scratch
    std::vector<int32_t> rtok;   // rerank: candidates
    std::vector<const std::byte*> rrows;
    std::vector<float> rsc, ragg;
  };

  void thin(LayerState& L, size_t row) {
    L.stride *= 2;
    size_t w = 0;
    for (size_t i = 0; i < L.qtok.size(); ++i)
      if (L.qtok[i] % L.stride == 0) {
        if (w != i) {
          L.qtok[w] = L.qtok[i];
          std::memmove(&L.qrows[w * row], &L.qrows[i * row], row * sizeof(float));
        }
        ++w;
      }
    L.qtok.resize(w);
    L.qrows.resize(w * row);
  }

  float* centroids(LayerState& L, int h, int b) const {
    return L.cent.data() + size_t(h) * L.C * d_ + size_t(L.C) * off_[size_t(b)];
  }
  const float* centroids(const LayerState& L, int h, int b) const {
    return L.cent.data() + size_t(h) * L.C * d_ + size_t(L.C) * off_[size_t(b)];
  }
  size_t list_base(const LayerState& L, int h, int b, int64_t j) const {
    return ((size_t(h) * m_ + size_t(b)) * size_t(L.C) + size_t(j)) * size_t(L.L);
  }
  uint64_t table_bytes(const LayerState& L) const {
    return L.cent.size() * 4 + L.idx.size() * 4 + L.v16.size() * 2 + L.v32.size() * 4;
  }
  uint64_t kv_bytes(int64_t n) const {
    return uint64_t(n) * ctx_.shape.num_kv_heads * d_ * 2 * dtype_size(ctx_.shape.kv_dtype);
  }
  // The paper's linear coefficient 6 m C alpha / (2 d B) (= 3 m C alpha / (2 d) for bf16/fp16 KV,
  // B = KV dtype bytes), with per-query-head tables
  // G times larger, for the configured alpha (or the first built layer's L/N).
  double paper_ratio() const {
    double a = alpha_;
    for (auto& L : layers_)
      if (L.built && list_len_ > 0) {
        a = double(L.L) / double(L.indexed);
        break;
      }
    return 6.0 * m_ * double(C_) * a / (2.0 * d_ * double(dtype_size(ctx_.shape.kv_dtype))) * (per_query_ ? G_ : 1);
  }

  nlohmann::json figures() const {
    nlohmann::json j;
    j["subspaces_m"] = m_;
    j["subspace_dims"] = db_;
    j["centroids_C"] = C_;
    j["list_frac_alpha"] = alpha_;
    j["list_len_param"] = list_len_;
    j["score_dtype"] = f16_ ? "f16" : "f32";
    j["gqa"] = per_query_ ? "per_query_head" : "per_kv_head";
    j["group_pick"] = group_sum_ ? "sum" : "union";
    j["rerank"] = rerank_;
    j["missing"] = missing_min_ ? "list_min" : "zero";
    j["table_heads"] = TH_;
    j["period"] = period_;
    uint64_t tb = 0, kvb = 0;
    int64_t Lmax = 0;
    for (auto& L : layers_)
      if (L.built) {
        tb += table_bytes(L);
        kvb += kv_bytes(L.indexed);
        Lmax = std::max(Lmax, L.L);
      }
    j["list_len_L"] = Lmax;
    j["table_bytes"] = tb;
    j["kv_bytes_indexed"] = kvb;
    j["table_kv_ratio"] = kvb ? double(tb) / double(kvb) : 0.0;
    j["paper_ratio_6mCalpha_over_2dB"] = paper_ratio();
    if (kvb && tb > kvb)
      j["warning"] = "tables exceed the KV cache (ratio " + std::to_string(double(tb) / double(kvb)) +
                     "): lower centroids or list_frac";
    return j;
  }

  // out = the k best of the nc (token, score) pairs (token-ascending input), by score descending and
  // then token ascending, in token order.
  static void top_by_score(const int32_t* tok, const float* sc, int64_t nc, int64_t k, std::vector<int32_t>& out,
                           std::vector<uint32_t>& rtmp) {
    out.clear();
    cpu::append_top_k(tok, sc, nc, k, out, rtmp);
  }

  // Exact rerank of the candidates S.rtok (token order) of table head h: keeps `rest` of them in out.
  void rerank_exact(int h, const float* q, const KVLayer& kv, Scratch& S, int64_t rest, std::vector<int32_t>& out) {
    const int64_t nc = int64_t(S.rtok.size());
    const int gq = per_query_ ? 1 : G_;
    const int kvh = per_query_ ? h / G_ : h;
    const float* qg = q + size_t(per_query_ ? h : h * G_) * d_;
    S.rrows.resize(size_t(nc));
    for (int64_t i = 0; i < nc; ++i) S.rrows[size_t(i)] = kv.k_row(kvh, S.rtok[size_t(i)]);
    S.rsc.resize(size_t(gq) * nc);
    cpu::score_rows(kv.dtype(), d_, gq, qg, ctx_.shape.softmax_scale, S.rrows.data(), nc, S.rsc.data());
    S.ragg.assign(size_t(nc), 0.f);
    for (int g = 0; g < gq; ++g) {
      float* row = S.rsc.data() + size_t(g) * nc;
      const float mx = *std::max_element(row, row + nc);
      const double z = cpu::exp_shift(row, nc, mx);  // row = exp(s - max)
      const float inv = float(1.0 / z);
      for (int64_t i = 0; i < nc; ++i) S.ragg[size_t(i)] += row[i] * inv;
    }
    top_by_score(S.rtok.data(), S.ragg.data(), nc, rest, out, S.rtmp);
  }

  // One table head's search: nearest centroids, reduce-by-key of the chosen lists, Top-rest.
  // No allocations once the scratch has grown to the context.
  void search_head(LayerState& L, int h, Scratch& S, const float* q, const KVLayer& kv, int64_t n, int64_t s_end,
                   int64_t w_begin, int64_t rest) {
    if (int64_t(S.acc.size()) < n) S.acc.resize(size_t(n), -0.0f);
    // (subspace, centroid) picks with their summed weights over the group's query heads.
    auto& picks = S.picks;
    picks.clear();
    const bool sum = !per_query_ && group_sum_;
    const int gq = per_query_ || sum ? 1 : G_;
    if (sum) {  // the group's summed query picks one centroid per subspace, weighted G (uniform)
      S.qsum.assign(size_t(d_), 0.f);
      for (int g = 0; g < G_; ++g)
        for (int i = 0; i < d_; ++i) S.qsum[size_t(i)] += q[size_t(h * G_ + g) * d_ + i];
    }
    for (int g = 0; g < gq; ++g) {
      const float* qh = sum ? S.qsum.data() : q + size_t(per_query_ ? h : h * G_ + g) * d_;
      for (int b = 0; b < m_; ++b) {
        const int db = db_[size_t(b)], off = off_[size_t(b)];
        const float* cent = centroids(L, h, b);
        double nn = 0;
        for (int i = 0; i < db; ++i) nn += double(qh[off + i]) * qh[off + i];
        // argmax_j c_j . q^(b) (= max cosine: the norm of q^(b) does not change the argmax).
        int64_t best = 0;
        float bs = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < L.C; ++j) {
          const float* c = cent + size_t(j) * db;
          float s = 0.f;
          for (int i = 0; i < db; ++i) s += c[i] * qh[off + i];
          if (s > bs) {
            bs = s;
            best = j;
          }
        }
        const float w = w_[size_t(b)] * (qnorm_ ? float(std::sqrt(nn)) : sum ? float(G_) : 1.f);
        picks.emplace_back(int64_t(b) * L.C + best, w);
      }
    }
    // Distinct lists, each gathered once with the summed weight of the heads that picked it.
    std::sort(picks.begin(), picks.end(), [](auto& a, auto& b) { return a.first < b.first; });
    // Everything that allocates comes before the scatter: an exception after it would leave the
    // thread's accumulator dirty for its next search.
    if (int64_t(S.ctok.size()) < n) {
      S.ctok.resize(size_t(n));
      S.csc.resize(size_t(n));
    }
    if (S.rtmp.size() < size_t(n)) S.rtmp.resize(size_t(n));
    S.smp.reserve(size_t(n) / 32 + 1);
    float* acc = S.acc.data();
    scatter_picks(L, h, picks, acc);
    // Top-rest of the union outside the forced keys, by (score desc, token asc). A threshold tau
    // from a 1/32 sample of the candidate range keeps ~1.2x the candidates needed (collected in
    // token order); if fewer pass, the lists are added again (the same sums, bit for bit) and
    // everything touched is collected. Exact either way. The k-th largest values come from a radix
    // select (touched scores are never -0.0 or NaN, so it gives the value nth_element would). The
    // collection resets every slot it reads, the forced ranges are reset here.
    auto collect = [&](float tau, int64_t* nc) {
      *nc = 0;
      return kHaveAvx512 ? collect_avx512(acc, s_end, w_begin, tau, S.ctok.data(), S.csc.data(), nc)
             : kHaveF16c ? collect_avx2(acc, s_end, w_begin, tau, S.ctok.data(), S.csc.data(), nc)
                         : collect_portable(acc, s_end, w_begin, tau, S.ctok.data(), S.csc.data(), nc);
    };
    // Candidates the search must deliver: rest, or rerank*rest for the exact rerank (rerank >= 1).
    const int64_t cand = rerank_ > 0 ? std::llround(rerank_ * double(rest)) : rest;
    const float ninf = -std::numeric_limits<float>::infinity();
    float tau = ninf;
    if (rest > 0) {
      constexpr int64_t kStride = 32;
      const int64_t want = cand + cand / 5 + 8 * kStride;  // candidates aimed at
      S.smp.clear();
      for (int64_t t = s_end + kStride / 2; t < w_begin; t += kStride)
        if (touched(acc[t])) S.smp.push_back(acc[t]);
      const int64_t j = want / kStride;
      if (int64_t(S.smp.size()) > j) tau = cpu::kth_largest(S.smp.data(), int64_t(S.smp.size()), j + 1, S.rtmp);
    }
    // The forced ranges (sinks, window) are not collected: counted and reset here.
    auto reset_forced = [&] {
      int64_t c = 0;
      for (const auto& [b, e] : {std::pair<int64_t, int64_t>{0, s_end}, {w_begin, n}})
        for (int64_t t = b; t < e; ++t) {
          c += touched(acc[t]);
          acc[t] = -0.0f;
        }
      return c;
    };
    int64_t nc = 0;
    int64_t nt = reset_forced() + collect(rest > 0 ? tau : std::numeric_limits<float>::infinity(), &nc);
    if (rest > 0 && (nc < cand || csa::g_force_recollect.load(std::memory_order_relaxed)) && tau != ninf) {
      scatter_picks(L, h, picks, acc);
      collect(ninf, &nc);
      reset_forced();
    }
    head_union_[size_t(h)] = nt;
    auto& out = L.cached[size_t(h)];
    if (rerank_ > 0 && nc > rest && rest > 0) {
      // Rerank (not in the paper, off by default): the best rerank*rest candidates by the summed list scores
      // are scored exactly, and the rest best of them by the group's summed softmax (normalised per
      // query head over those candidates) are kept.
      top_by_score(S.ctok.data(), S.csc.data(), nc, std::min(nc, cand), S.rtok, S.rtmp);
      rerank_exact(h, q, kv, S, rest, out);
    } else {
      top_by_score(S.ctok.data(), S.csc.data(), nc, std::min<int64_t>(rest, nc), out, S.rtmp);
    }
  }

  // Adds the picked lists (distinct, sorted by list) into the accumulator: each list once, with the
  // summed weight of the heads that picked it.
  void scatter_picks(const LayerState& L, int h, const std::vector<std::pair<int64_t, float>>& picks, float* acc) const {
    for (size_t i = 0; i < picks.size();) {
      float w = 0.f;
      size_t j = i;
      for (; j < picks.size() && picks[j].first == picks[i].first; ++j) w += picks[j].second;
      const size_t base = list_base(L, h, int(picks[i].first / L.C), picks[i].first % L.C);
      const int32_t* idx = &L.idx[base];
      // missing=list_min: a key absent from a list is taken to score that list's minimum (the heap
      // root), so each entry adds w (V - min) and every key's absent terms share one constant.
      const float off = missing_min_ ? -(w * (f16_ ? score_f(L.v16[base]) : L.v32[base])) : 0.f;
      if (f16_) {
        if (kScatter512) scatter_f16_avx512(idx, &L.v16[base], L.L, w, off, acc);
        else if (kHaveF16c) scatter_f16_f16c(idx, &L.v16[base], L.L, w, off, acc);
        else scatter_portable(idx, &L.v16[base], L.L, w, off, acc);
      } else {
        if (kHaveAvx512) scatter_f32_avx512(idx, &L.v32[base], L.L, w, off, acc);
        else scatter_portable(idx, &L.v32[base], L.L, w, off, acc);
      }
      i = j;
    }
  }

  MethodContext ctx_;
  int d_, G_, m_, TH_;
  int64_t C_, list_len_, sample_, recent_, sinks_, period_;
  double recent_frac_;
  double alpha_;
  uint64_t seed_;
  bool f16_, qnorm_, window_in_budget_, per_query_, group_sum_, sched_ = false;
  double rerank_ = 0;
  bool missing_min_ = false;
  Schedule schedule_{0.05, 1};
  KMeansConfig km_;
  std::vector<int> db_, off_;
  std::vector<float> w_;
  std::vector<LayerState> layers_;
  Params P_;  // the same parameters, for step_keys and the cuda implementation
  std::vector<Scratch> scratch_;       // per search task (pool thread)
  std::vector<int64_t> head_union_;    // |U| of each table head's last search
  double union_sum_ = 0;
  int64_t union_samples_ = 0, searches_ = 0;
};

}  // namespace

namespace csa {
StepKeys step_keys(const Params& p, const Budget& session_budget, int64_t n) {
  StepKeys s;
  s.k = p.sched ? Budget{p.sched_rho, 0}.keys(n, p.sched_rho) : session_budget.keys(n, 0.05);
  // Forced keys: sinks [0, s_end) and the recent window [n - R, n). R: explicit, or by default a
  // function of the budget, min(64, round(recent_frac * K)), so a small budget is not swallowed by
  // the window. When they exceed K: the first sinks, then the newest keys.
  const int64_t R = p.recent >= 0 ? p.recent : std::min<int64_t>(kRecentMax, std::llround(p.recent_frac * double(s.k)));
  s.s_end = std::min(p.sinks, n);
  s.w_begin = std::max(s.s_end, n - R);
  s.s_emit = s.s_end;
  s.w_emit = s.w_begin;
  if (s.s_end + (n - s.w_begin) > s.k) {
    s.s_emit = std::min(s.s_end, s.k);
    s.w_emit = std::max(s.s_end, n - (s.k - s.s_emit));
  }
  const int64_t forced = s.s_emit + (n - s.w_emit);
  s.rest = p.window_in_budget ? std::max<int64_t>(0, s.k - forced) : s.k;
  return s;
}

const Params& params_of(const Method& m) { return static_cast<const CSAttention&>(m).params(); }
LayerTables tables_of(Method& m, uint32_t layer) { return static_cast<CSAttention&>(m).tables(layer); }
}  // namespace csa

std::unique_ptr<DeviceMethod> make_csattention_cuda(const MethodContext&, const ParamSet&);  // csattention_cuda.cpp

MethodSpec csattention_spec() {
  return MethodSpec{
      "csattention",
      "CSAttention: per-subspace query centroids score keys offline into Top-L lists; decode sums the nearest "
      "centroids' lists, keeps the recent window and the Top-K",
      1u << KVS_BACKEND_CPU,
      0.05,
      {{"preset", "enum:kvsieve|paper", "kvsieve",
        "paper: the paper's algorithm (the defaults before 2026-11-27): missing=zero, weights=uniform; parameters "
        "given explicitly win. kvsieve: missing=list_min, weights=qnorm (chosen on the validation suite's tuning "
        "half, docs/methods/csattention.md)"},
       {"subspaces", "int", "0", "m: subspaces the head dim is split into; 0 = 8 (the paper's), but at most head_dim / 8 (none narrower than 8 dims), the lists then 8/m times longer (list_frac * 8/m)"},
       {"splits", "string", "", "non-uniform subspace sizes a:b:..., summing to head_dim (empty = d/m each)"},
       {"centroids", "int", "64", "C: query centroids per subspace (paper 64/128/200; with alpha 0.1 tables are 0.6x a bf16 KV at d=128)"},
       {"list_frac", "float", "0.1", "alpha: list length L = alpha * prompt tokens (paper: typical 0.2-0.4; 0.1 measured as accurate, half the memory and gathers)"},
       {"list_len", "int", "0", "absolute list length L (overrides list_frac when > 0)"},
       {"iters", "int", "10", "I: k-means iterations (mini-batch: epochs over the sample) (paper 10)"},
       {"kmeans", "enum:minibatch|lloyd", "minibatch",
        "spherical mini-batch k-means (paper) or full-batch Lloyd (objective never increases)"},
       {"batch", "int", "1024", "mini-batch size [the paper does not say; our choice]"},
       {"sample", "int", "8192",
        "query sub-vectors per table head clustered: every stride-th prompt token kept [the paper does not say; our choice]"},
       {"init", "enum:kmeans++|queries", "kmeans++",
        "centroid seeding; queries = the sampled normalised queries themselves (needs centroids = their count; "
        "the exactness test)"},
       {"seed", "int", "0", "k-means random seed"},
       {"score_dtype", "enum:f16|f32", "f16", "stored list scores (paper fp16; f32 orders exactly)"},
       {"weights", "enum:uniform|qnorm", "qnorm",
        "w_b: ||q^(b)|| (reconstructed, not in the paper: restores the query norm that cosine matching drops) or 1 "
        "(uniform, the paper's)", "uniform"},
       {"weight_list", "string", "", "explicit w_b as w1:w2:...:wm (multiplies weights)"},
       {"recent", "int", "-1",
        "R: recent window always attended; -1 = min(64, round(recent_frac * K)) [the paper does not say; our choice]"},
       {"recent_frac", "float", "0.5", "window share of the budget K when recent = -1 (R = min(64, round(recent_frac * K)))"},
       {"sinks", "int", "0", "first tokens always attended [reconstructed: the paper has none; peers use 4]"},
       {"window_in_budget", "bool", "true",
        "window and sinks count inside K (Top-(K-R) from the rest) [reconstructed: the paper does not say]; false adds them on top"},
       {"period", "int", "1", "P: search every P steps, reuse the selection (plus the current window) between"},
       {"schedule", "enum:none|0.05-step-1|0.15-step-4|0.20-step-8", "none",
        "the paper's rho-step-P schedules: set the keep ratio (replacing the session budget) and period"},
       {"gqa", "enum:per_kv_head|per_query_head", "per_kv_head",
        "tables per KV head over pooled group queries [reconstructed: the paper does not say], or per query head"},
       {"group_pick", "enum:union|sum", "union",
        "per_kv_head: every query head picks its centroids and the G*m lists are unioned [reconstructed: the paper does not say], or the group's "
        "summed query picks m lists (weight G): G times fewer gathers"},
       {"missing", "enum:zero|list_min", "list_min",
        "reduce-by-key term of a key absent from a picked list: that list's minimum score [reconstructed: the paper "
        "does not say] or 0 (zero, the paper's)", "zero"},
       {"rerank", "float", "0",
        "0 = off (paper). r >= 1: the r*K' best keys by summed list scores are scored exactly and the K' best by "
        "the group's summed softmax kept (K' = K minus forced keys) [not in the paper]"}},
      [](const MethodContext& c, const ParamSet& p) { return std::make_unique<CSAttention>(c, p); },
      KVS_CUDA_IMPL(make_csattention_cuda)};
}

}  // namespace kvs
