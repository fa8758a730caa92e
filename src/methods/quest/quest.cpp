// SPDX-License-Identifier: Apache-2.0
// quest: query-aware page selection (Tang et al., ICML 2024, after mit-han-lab/Quest@01c1623;
// docs/methods.md "quest"). Keys are grouped in pages of P tokens; per page and KV head the
// element-wise max M and min m of the keys are kept (built at build_index, updated on append).
// A query scores a page by the upper bound U_p = sum_i max(q_i M_i, q_i m_i) >= max_{j in p} q.k_j
// (estimate.cu, unscaled), the top pages are attended exactly, and the current (last) page always is
// (the kernel path's page budget counts it). GQA: per KV head with the group's bounds summed
// (gqa=sum, the default: a KV head reads only its budget), or per query head (the authors'
// evaluation path, repeat_kv: a KV head reads the union of its query heads' pages). score_dtype=f16
// rounds the page scores to fp16 before the top-k, as the authors' estimate kernel writes them;
// dense_layers keeps the first layers dense (the authors keep 2). preset=paper sets them (and
// page_budget=pages, the authors' page rounding) to the authors' values. Bounds hold the stored-dtype key values exactly, so the bound is never below
// the true page maximum; for a bf16 / fp16 KV they are kept in that dtype (half the bytes the
// scoring reads), in tables files as fp32. Ties between page scores go to the lower page index.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "backends/cpu/topk.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/method.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"
#include "methods/quest/quest.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvs {

namespace {

#if defined(__x86_64__)
#define QUEST_AVX512 __attribute__((target("avx512f")))
#define QUEST_AVX2 __attribute__((target("avx2,f16c")))

// Up to 8 heads of a group per pass over a page (8 accumulators of 16 lanes).
constexpr int kHeadsPerPass = 8;

// Adds the bounds of ng <= 8 heads, given as their 16 partial sums, to the page's running total in
// the scalar order: each head's bound is part[0] + ... + part[15], and the total takes the heads one
// by one (((0 + u_0) + u_1) + ..., across passes too).
inline float add_heads(float total, const float (*part)[16], int ng) {
  float u[kHeadsPerPass];
  for (int g = 0; g < ng; ++g) u[g] = 0.f;
  for (int l = 0; l < 16; ++l)  // the heads' chains interleaved
    for (int g = 0; g < ng; ++g) u[g] += part[g][l];
  for (int g = 0; g < ng; ++g) total += u[g];
  return total;
}

// Sixteen (AVX-512) or eight (AVX2) bounds as floats: fp32 as stored, or a 16-bit KV dtype's
// values (bf16: the 16 bits shifted up; fp16: the F16C conversion), both exact.
template <DType T>
QUEST_AVX512 inline __m512 load16(const void* p) {
  if constexpr (T == DType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(p));
  } else {
    const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    if constexpr (T == DType::BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
}
template <DType T>
QUEST_AVX2 inline __m256 load8(const void* p) {
  if constexpr (T == DType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(p));
  } else {
    const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
    if constexpr (T == DType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

// E: the stored element (float or uint16_t), T its dtype.
template <DType T, class E>
QUEST_AVX512 void page_scores512(const float* q, int ng, const E* bounds, int64_t pages, int hkv, int h, int d,
                                 float* score) {
  alignas(64) float part[kHeadsPerPass][16];
  for (int64_t p = 0; p < pages; ++p) {
    const E* mx = bounds + (size_t(p) * hkv + size_t(h)) * 2 * d;
    const E* mn = mx + d;
    float total = 0.f;
    for (int g0 = 0; g0 < ng; g0 += kHeadsPerPass) {
      const int gn = std::min(kHeadsPerPass, ng - g0);
      __m512 acc[kHeadsPerPass];
      for (int g = 0; g < gn; ++g) acc[g] = _mm512_setzero_ps();
      for (int i = 0; i < d; i += 16) {
        const __m512 a = load16<T>(mx + i), b = load16<T>(mn + i);
        for (int g = 0; g < gn; ++g) {
          const __m512 qq = _mm512_loadu_ps(q + size_t(g0 + g) * d + i);
          // max(q M, q m) as the scalar `x > y ? x : y` (max_ps returns its second operand
          // unless the first is greater)
          acc[g] = _mm512_add_ps(acc[g], _mm512_max_ps(_mm512_mul_ps(qq, a), _mm512_mul_ps(qq, b)));
        }
      }
      for (int g = 0; g < gn; ++g) _mm512_store_ps(part[g], acc[g]);
      total = add_heads(total, part, gn);
    }
    score[p] = total;
  }
}

template <DType T, class E>
QUEST_AVX2 void page_scores256(const float* q, int ng, const E* bounds, int64_t pages, int hkv, int h, int d,
                               float* score) {
  alignas(32) float part[kHeadsPerPass][16];
  for (int64_t p = 0; p < pages; ++p) {
    const E* mx = bounds + (size_t(p) * hkv + size_t(h)) * 2 * d;
    const E* mn = mx + d;
    float total = 0.f;
    for (int g0 = 0; g0 < ng; g0 += kHeadsPerPass / 2) {  // 2 registers of 8 lanes per head
      const int gn = std::min(kHeadsPerPass / 2, ng - g0);
      __m256 lo[kHeadsPerPass / 2], hi[kHeadsPerPass / 2];
      for (int g = 0; g < gn; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
      for (int i = 0; i < d; i += 16) {
        const __m256 a0 = load8<T>(mx + i), a1 = load8<T>(mx + i + 8);
        const __m256 b0 = load8<T>(mn + i), b1 = load8<T>(mn + i + 8);
        for (int g = 0; g < gn; ++g) {
          const float* qg = q + size_t(g0 + g) * d + i;
          const __m256 q0 = _mm256_loadu_ps(qg), q1 = _mm256_loadu_ps(qg + 8);
          lo[g] = _mm256_add_ps(lo[g], _mm256_max_ps(_mm256_mul_ps(q0, a0), _mm256_mul_ps(q0, b0)));
          hi[g] = _mm256_add_ps(hi[g], _mm256_max_ps(_mm256_mul_ps(q1, a1), _mm256_mul_ps(q1, b1)));
        }
      }
      for (int g = 0; g < gn; ++g) {
        _mm256_store_ps(part[g], lo[g]);
        _mm256_store_ps(part[g] + 8, hi[g]);
      }
      total = add_heads(total, part, gn);
    }
    score[p] = total;
  }
}
#endif

}  // namespace

namespace {
std::atomic<int> g_quest_simd{0};  // quest_simd_limit(): 0 = the best the machine has
}  // namespace

bool quest_simd_limit(int level) {
  if (level < 0 || level > 3) return false;
  g_quest_simd.store(level, std::memory_order_relaxed);
  return true;
}

int quest_simd_level() {
  // KVS_QUEST_SIMD=1|2|3 in the environment caps it too (for side-by-side timing).
  static const int best = [] {
#if defined(__x86_64__)
    int b = __builtin_cpu_supports("avx512f") ? 3 : __builtin_cpu_supports("avx2") ? 2 : 1;
#else
    int b = 1;
#endif
    const char* env = std::getenv("KVS_QUEST_SIMD");
    if (env && env[0] >= '1' && env[0] <= '3' && env[1] == '\0') b = std::min(b, env[0] - '0');
    return b;
  }();
  const int limit = g_quest_simd.load(std::memory_order_relaxed);
  return limit ? std::min(limit, best) : best;
}

void quest_page_scores(const float* q, int ng, const float* bounds, int64_t pages, int hkv, int h, int d, float* score) {
#if defined(__x86_64__)
  const int level = d % 16 == 0 ? quest_simd_level() : 1;
  if (level == 3) return page_scores512<DType::F32>(q, ng, bounds, pages, hkv, h, d, score);
  if (level == 2) return page_scores256<DType::F32>(q, ng, bounds, pages, hkv, h, d, score);
#endif
  for (int64_t p = 0; p < pages; ++p) {
    const float* mx = bounds + (size_t(p) * hkv + size_t(h)) * 2 * d;
    float u = 0.f;
    for (int g = 0; g < ng; ++g) u += quest_upper_bound(q + size_t(g) * d, mx, mx + d, d);
    score[p] = u;
  }
}

void quest_page_scores16(const float* q, int ng, const uint16_t* bounds, DType t, int64_t pages, int hkv, int h, int d,
                         float* score) {
  if (t != DType::BF16 && t != DType::F16) invalid("quest_page_scores16: bounds must be bf16 or fp16");
#if defined(__x86_64__)
  const int level = d % 16 == 0 ? quest_simd_level() : 1;
  const bool bf = t == DType::BF16;
  if (level == 3) {
    return bf ? page_scores512<DType::BF16>(q, ng, bounds, pages, hkv, h, d, score)
              : page_scores512<DType::F16>(q, ng, bounds, pages, hkv, h, d, score);
  }
  static const bool f16c = __builtin_cpu_supports("f16c");
  if (level == 2 && f16c) {
    return bf ? page_scores256<DType::BF16>(q, ng, bounds, pages, hkv, h, d, score)
              : page_scores256<DType::F16>(q, ng, bounds, pages, hkv, h, d, score);
  }
#endif
  thread_local std::vector<float> mm;  // (select calls this once per page: no allocation per call)
  mm.resize(size_t(2) * d);
  for (int64_t p = 0; p < pages; ++p) {
    const uint16_t* b = bounds + (size_t(p) * hkv + size_t(h)) * 2 * d;
    for (int i = 0; i < 2 * d; ++i) mm[size_t(i)] = t == DType::BF16 ? bf16_to_f32(b[i]) : f16_to_f32(b[i]);
    float u = 0.f;
    for (int g = 0; g < ng; ++g) u += quest_upper_bound(q + size_t(g) * d, mm.data(), mm.data() + d, d);
    score[p] = u;
  }
}

namespace {

class Quest final : public Method {
 public:
  Quest(const MethodContext& ctx, const ParamSet& p)
      : ctx_(ctx),
        page_(p.get_int("page_size")),
        dense_layers_(p.get_int("dense_layers")),
        per_query_(p.get_string("gqa") == "per_query_head"),
        f16_scores_(p.get_string("score_dtype") == "f16"),
        fit_(p.get_string("page_budget") == "fit"),
        bounds_(ctx.shape.num_layers),
        b16_(ctx.shape.num_layers),
        use16_(ctx.shape.num_layers, 0),
        indexed_(ctx.shape.num_layers, 0) {
    std::fill(use16_.begin(), use16_.end(), char(kv16()));
    if (page_ < 1 || page_ > 4096) invalid("method_params: quest page_size must be in [1, 4096]");
    if (dense_layers_ < 0) invalid("method_params: quest dense_layers must be >= 0");
  }

  void build_index(uint32_t layer, const KVLayer& kv) override {
    bounds_[layer].clear();
    b16_[layer].clear();
    use16_[layer] = kv16();
    indexed_[layer] = 0;
    extend(layer, kv);
  }
  void on_append(uint32_t layer, const float*, int64_t, const KVLayer& kv, bool) override { extend(layer, kv); }
  void truncate(uint32_t layer, int64_t n) override {
    if (indexed_[layer] <= n) return;
    // Drop the pages past n and the partial page holding n: extend() rebuilds it from the keys.
    const int64_t keep = n / page_;
    const size_t len = size_t(keep) * ctx_.shape.num_kv_heads * 2 * ctx_.shape.head_dim;
    if (use16_[layer]) b16_[layer].resize(len);
    else bounds_[layer].resize(len);
    indexed_[layer] = keep * page_;
  }

  // The bounds are a function of the keys: the pages past n go, the partial page is folded again.
  bool exact_truncate() const override { return true; }

  // Pages per scoring task (at 8 KV heads x d 128: 64 x 8 KiB of bounds).
  static constexpr int64_t kScorePages = 64;
  void select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) override {
    const int64_t n = kv.size();
    if (int64_t(layer) < dense_layers_) {
      out.kind = Selection::Kind::All;
      out.lists.clear();
      return;
    }
    extend(layer, kv);  // index built lazily if build_index was not called
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
    const int64_t pages = (n + page_ - 1) / page_;
    // Page budget, current page included: budget tokens / page_size (the authors' page_budget). A
    // budget in tokens is not clamped to the context first, so a budget of at least as many pages
    // as the context has attends every page (as the authors' controller does).
    // page_budget=fit (the default): the current page (c tokens) plus floor((k - c) / page_size)
    // more, so the selection never exceeds the k budget keys and falls short by less than a page; a
    // budget below the current page attends its last k tokens (the newest). page_budget=pages: the
    // authors' page_budget = k / page_size pages, current page counted as a whole page.
    const int64_t k = !fit_ && ctx_.budget.tokens > 0 ? ctx_.budget.tokens : ctx_.budget.keys(n, 0.05);
    const QuestPagePlan pp = quest_page_plan(n, k, page_, fit_);
    const int64_t want = pp.want, cur_skip = pp.skip;
    const bool b16 = use16_[layer] != 0;
    const float* b = bounds_[layer].data();
    const uint16_t* bh = b16_[layer].data();
    const DType bt = ctx_.shape.kv_dtype;
    out.kind = per_query_ ? Selection::Kind::PerQueryHead : Selection::Kind::PerKvHead;
    const int rows = per_query_ ? G : 1;  // score rows per KV head
    out.lists.assign(size_t(hkv * rows), {});
    // 1. Scores of every page but the current one, in tasks of consecutive pages, every head's
    // bounds of a page together: the bounds stream in address order ([page][Hkv][2][d]; one task
    // per KV head read a d-sized slice of every page, which took 1.7x as long on one thread).
    const int64_t np = pages - 1;
    scores_.resize(size_t(hkv * rows) * size_t(std::max<int64_t>(np, 0)));
    const int64_t tasks = (np + kScorePages - 1) / kScorePages;
    ctx_.pool->parallel_for(tasks, [&](int64_t c) {
      for (int64_t p = c * kScorePages; p < std::min(np, (c + 1) * kScorePages); ++p)
        for (int h = 0; h < hkv; ++h)
          for (int r = 0; r < rows; ++r) {
            const int ga = per_query_ ? r : 0, gb = per_query_ ? r + 1 : G;
            float* out_p = scores_.data() + size_t(h * rows + r) * size_t(np) + size_t(p);
            const float* qh = q + size_t(h * G + ga) * d;
            if (b16) quest_page_scores16(qh, gb - ga, bh + size_t(p) * hkv * 2 * d, bt, 1, hkv, h, d, out_p);
            else quest_page_scores(qh, gb - ga, b + size_t(p) * hkv * 2 * d, 1, hkv, h, d, out_p);
            if (f16_scores_) *out_p = f16_to_f32(f32_to_f16(*out_p));
          }
    });
    // 2. Per score row: the top pages, the current one always, as token lists.
    ctx_.pool->parallel_for(hkv * rows, [&](int64_t row) {
      std::vector<int32_t> cand, chosen;
      cand.reserve(size_t(np));
      for (int64_t p = 0; p < np; ++p) cand.push_back(int32_t(p));
      chosen.push_back(int32_t(pages - 1));
      cpu::topk_of(scores_.data() + size_t(row) * size_t(np), cand, want - 1, chosen);
      std::sort(chosen.begin(), chosen.end());
      auto& l = out.lists[size_t(row)];
      for (int32_t p : chosen)
        for (int64_t t = int64_t(p) * page_ + (p == pages - 1 ? cur_skip : 0); t < std::min(n, int64_t(p + 1) * page_); ++t)
          l.push_back(int32_t(t));
    });
  }

  // Bounds layout per layer: [page][Hkv][2][d] (max then min), in fp32 (bounds_), or, for a bf16
  // or fp16 KV, in the KV's dtype (b16_: its values exactly, half the bytes the scoring reads).
  // Tables files hold fp32 either way.

  nlohmann::json save_meta() const override {
    nlohmann::json meta = nlohmann::json::object();
    for (uint32_t l = 0; l < bounds_.size(); ++l)
      if (has_bounds(l)) meta["indexed_tokens"][std::to_string(l)] = indexed_[l];
    return meta;
  }
  void save(io::TablesWriter& w) const override {
    for (uint32_t l = 0; l < bounds_.size(); ++l) {
      if (!has_bounds(l)) continue;
      if (!use16_[l]) {
        w.add("quest.bounds", int32_t(l), -1,
              {io::Piece{bounds_[l].data(), uint64_t(bounds_[l].size() * sizeof(float))}});
        continue;
      }
      std::vector<float> f(b16_[l].size());
      for (size_t i = 0; i < f.size(); ++i) f[i] = dec(b16_[l][i]);
      w.add_copy("quest.bounds", int32_t(l), -1, f.data(), f.size() * sizeof(float));
    }
  }
  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    const size_t per_page = size_t(ctx_.shape.num_kv_heads) * 2 * ctx_.shape.head_dim;
    for (uint32_t l = 0; l < bounds_.size(); ++l) {
      const auto* s = f.find("quest.bounds", int32_t(l), -1);
      if (!s) continue;
      const auto key = std::to_string(l);
      // Header numbers are range-checked before they are converted (io/header.hpp).
      const io::HeaderReader hm(f.path(), "method.meta");
      const int64_t n =
          hm.sub("indexed_tokens").integer<int64_t>(hm.object(meta, "indexed_tokens"), key, 0, (int64_t(1) << 31) - 1);
      const int64_t pages = (n + page_ - 1) / page_;
      if (s->length != uint64_t(pages) * per_page * sizeof(float))
        fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "section quest.bounds layer " + key + ": size does not match " +
                                            std::to_string(n) + " indexed tokens");
      bounds_[l].resize(size_t(pages) * per_page);
      std::memcpy(bounds_[l].data(), s->data, s->length);
      b16_[l].clear();
      use16_[l] = 0;
      if (kv16()) {  // kept in the KV's dtype when every bound is one of its values (a file of this dtype's KV)
        std::vector<uint16_t> h(bounds_[l].size());
        bool exact = true;
        for (size_t i = 0; i < h.size() && exact; ++i) {
          h[i] = enc(bounds_[l][i]);
          const float back = dec(h[i]);
          exact = std::memcmp(&back, &bounds_[l][i], sizeof(float)) == 0;
        }
        if (exact) {
          b16_[l].swap(h);
          std::vector<float>().swap(bounds_[l]);
          use16_[l] = 1;
        }
      }
      indexed_[l] = n;
    }
  }
  std::unique_ptr<Method> clone() const override { return std::make_unique<Quest>(*this); }
  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    if (indexed_[layer] <= tokens) return true;
    *why = "its quest bounds cover " + std::to_string(indexed_[layer]) + " tokens";
    return false;
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (auto& v : bounds_) b += v.size() * sizeof(float);
    for (auto& v : b16_) b += v.size() * sizeof(uint16_t);
    return b;
  }

 private:
  // Folds tokens [indexed_, kv.size()) into the page bounds.
  void extend(uint32_t layer, const KVLayer& kv) {
    if (use16_[layer]) return extend16(layer, kv);
    const int64_t n = kv.size();
    const int d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
    auto& b = bounds_[layer];
    const size_t per_page = size_t(hkv) * 2 * d;
    std::vector<float> row(static_cast<size_t>(d));
    for (int64_t t = indexed_[layer]; t < n; ++t) {
      const int64_t p = t / page_;
      if (t % page_ == 0) {
        b.resize(size_t(p + 1) * per_page);
        for (int h = 0; h < hkv; ++h) {
          float* mm = b.data() + (size_t(p) * hkv + h) * 2 * d;
          std::fill(mm, mm + d, -std::numeric_limits<float>::infinity());
          std::fill(mm + d, mm + 2 * d, std::numeric_limits<float>::infinity());
        }
      }
      for (int h = 0; h < hkv; ++h) {
        convert_to_f32(kv.k_row(h, t), kv.dtype(), row.data(), size_t(d));
        float* mm = b.data() + (size_t(p) * hkv + h) * 2 * d;
        for (int i = 0; i < d; ++i) {
          mm[i] = std::max(mm[i], row[size_t(i)]);
          mm[d + i] = std::min(mm[d + i], row[size_t(i)]);
        }
      }
    }
    indexed_[layer] = n;
  }

  // The same in the KV's 16-bit dtype: each key element is one of its values, so the max and min
  // are too. A page's bounds are folded in fp32 with extend()'s comparisons (so the bits are the
  // same), then stored back: one decode and encode per page touched, not per token.
  void extend16(uint32_t layer, const KVLayer& kv) {
    const int64_t n = kv.size();
    const int d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
    auto& b = b16_[layer];
    const size_t per_page = size_t(hkv) * 2 * d;
    std::vector<float> row(static_cast<size_t>(d)), mm(size_t(2) * d);
    for (int64_t t0 = indexed_[layer]; t0 < n;) {
      const int64_t p = t0 / page_, t1 = std::min(n, (p + 1) * page_);
      const bool fresh = t0 % page_ == 0;
      if (fresh) b.resize(size_t(p + 1) * per_page);
      for (int h = 0; h < hkv; ++h) {
        uint16_t* bh = b.data() + (size_t(p) * hkv + h) * 2 * d;
        if (fresh) {
          std::fill(mm.begin(), mm.begin() + d, -std::numeric_limits<float>::infinity());
          std::fill(mm.begin() + d, mm.end(), std::numeric_limits<float>::infinity());
        } else {
          for (int i = 0; i < 2 * d; ++i) mm[size_t(i)] = dec(bh[i]);
        }
        for (int64_t t = t0; t < t1; ++t) {
          convert_to_f32(kv.k_row(h, t), kv.dtype(), row.data(), size_t(d));
          for (int i = 0; i < d; ++i) {
            mm[size_t(i)] = std::max(mm[size_t(i)], row[size_t(i)]);
            mm[size_t(d + i)] = std::min(mm[size_t(d + i)], row[size_t(i)]);
          }
        }
        for (int i = 0; i < 2 * d; ++i) bh[i] = enc(mm[size_t(i)]);
      }
      t0 = t1;
    }
    indexed_[layer] = n;
  }
  bool kv16() const { return ctx_.shape.kv_dtype == DType::BF16 || ctx_.shape.kv_dtype == DType::F16; }
  float dec(uint16_t x) const { return ctx_.shape.kv_dtype == DType::BF16 ? bf16_to_f32(x) : f16_to_f32(x); }
  uint16_t enc(float x) const { return ctx_.shape.kv_dtype == DType::BF16 ? f32_to_bf16(x) : f32_to_f16(x); }
  bool has_bounds(uint32_t l) const { return use16_[l] ? !b16_[l].empty() : !bounds_[l].empty(); }

  MethodContext ctx_;
  int64_t page_, dense_layers_;
  bool per_query_, f16_scores_, fit_;
  std::vector<std::vector<float>> bounds_;
  std::vector<std::vector<uint16_t>> b16_;
  std::vector<char> use16_;  // per layer: the bounds are in b16_
  std::vector<float> scores_;  // select: the page scores [Hkv x rows][pages - 1] of the step
  std::vector<int64_t> indexed_;
};

}  // namespace

std::unique_ptr<DeviceMethod> make_quest_cuda(const MethodContext&, const ParamSet&);  // quest_cuda.cpp

MethodSpec quest_spec() {
  return MethodSpec{
      "quest", "Quest: pages of 16 keys scored by their min/max upper bound, top pages attended (docs/methods.md)",
      1u << KVS_BACKEND_CPU, 0.05,
      {{"preset", "enum:kvsieve|paper", "kvsieve",
        "paper: the authors' code (mit-han-lab/Quest): dense_layers=2, gqa=per_query_head, score_dtype=f16, "
        "page_budget=pages; "
        "parameters given explicitly win"},
       {"page_size", "int", "16", "tokens per page (Quest --chunk_size 16)", "16"},
       {"dense_layers", "int", "0",
        "first layers attended densely (paper: 2); 0 keeps every layer within the budget", "2"},
       {"gqa", "enum:sum|per_query_head", "sum",
        "sum: one page set per KV head from the group's summed bounds (keeps the budget); per_query_head: each "
        "query head scores and attends its own pages (the authors' evaluation path, repeat_kv; a KV head then "
        "reads the union of its query heads' pages, more than the budget)", "per_query_head"},
       {"score_dtype", "enum:f32|f16", "f32",
        "page scores as computed (f32) or rounded to fp16 before the top-k as the authors' kernel writes them "
        "(paper: f16; cpu only)", "f16"},
       {"page_budget", "enum:fit|pages", "fit",
        "fit: the current page plus floor((k - current page) / page_size) pages, never more than the k budget "
        "keys (short by less than a page; a budget below the current page attends its newest k tokens); pages: "
        "the authors' page_budget = k / page_size pages, the current page counted whole (up to a page over)",
        "pages"}},
      [](const MethodContext& c, const ParamSet& p) { return std::make_unique<Quest>(c, p); },
      KVS_CUDA_IMPL(make_quest_cuda)};
}

}  // namespace kvs
