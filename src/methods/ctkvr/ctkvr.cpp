// SPDX-License-Identifier: Apache-2.0
// ctkvr: CTkvr, centroid-then-token KV retrieval (arXiv 2512.15550; docs/methods/ctkvr.md).
//
// Index (build_index, per layer and KV head): a query-centroid inverted file. Centroids are C
// prompt queries (the last C by default; random / initial / equispaced as options), each the
// concatenation of its group's G query rows; centroid c's posting list holds the top-rho keys of
// the whole prompt by the group-aggregated score (sum over the group of softmax over all keys by
// default; max or summed logits as options).
//
// Decode (select): recall = cosine of the query against every centroid, top-lambda centroids,
// gather their lists and deduplicate with a bitmap (only the recalled bits are touched, so no O(N)
// pass), drop the static sink + local keys; rerank = exact scores of the recalled keys, top-k by the
// group-aggregated score; the static set and the top-k are attended exactly (their union returned
// as the selection, or the top-k as the selection and the static set as extra() merged by LSE).
// Dynamic centroid update: (q_t, top-rho of the recalled keys) is pushed into the FIFO, the oldest
// centroid beyond C is dropped. Tokens leaving the local window are offered to every centroid's
// list (7.3 (a)) or join the DCU candidates (7.3 (b)). Multi-turn append pushes the chunk's last
// queries as centroids with top-rho over all keys (7.3).
#include "methods/ctkvr/ctkvr.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <immintrin.h>

#include "backends/cpu/attention.hpp"
#include "backends/cpu/gemm.hpp"
#include "backends/cpu/topk.hpp"
#include "core/error.hpp"
#include "core/method.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"
#include "methods/param_bounds.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {
namespace ctkvr {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
struct HeapCmp {  // min-heap on s (a functor, so the heap routines inline it)
  bool operator()(const Entry& a, const Entry& b) const { return a.s > b.s || (a.s == b.s && a.i < b.i); }
};
constexpr HeapCmp heap_cmp{};

// exp(x) for x <= 0 ranges, branch-free so loops over it vectorise: 2^n * p(f), |rel err| < 2e-7
// (the constants of the attention kernel's exp256).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float t = x * 1.44269504088896341f + 12582912.f;
  const float n = t - 12582912.f;
  float f = x - n * 0.693359375f;
  f = f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * (f * f) + (f + 1.f);
  int32_t ti;
  std::memcpy(&ti, &t, 4);
  const int32_t e = (ti - 0x4B400000 + 127) << 23;
  float sc;
  std::memcpy(&sc, &e, 4);
  return p * sc;
}

float dot_scalar(const float* a, const float* b, int d) {
  float part[8] = {};
  int i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (; i < d; ++i) s += a[i] * b[i];
  for (int l = 0; l < 8; ++l) s += part[l];
  return s;
}

#define CTKVR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

CTKVR_AVX512 float dot512(const float* a, const float* b, int d) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= d; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i + 16 <= d; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  float r = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  for (; i < d; ++i) r += a[i] * b[i];
  return r;
}

// exp on 16 lanes (the same polynomial as fast_exp).
CTKVR_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// s[j] <- exp(s[j] - max); returns the max, *z = the sum.
CTKVR_AVX512 float softmax_row512(float* s, int64_t N, float* z) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
  float mx = _mm512_reduce_max_ps(mv);
  for (int64_t r = j; r < N; ++r) mx = std::max(mx, s[r]);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (j = 0; j + 16 <= N; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  float t = _mm512_reduce_add_ps(acc);
  for (; j < N; ++j) t += (s[j] = fast_exp(s[j] - mx));
  *z = t;
  return mx;
}

float softmax_row(float* s, int64_t N, float* z);

// log sum_j exp(x[j]).
CTKVR_AVX512 float lse_row512(const float* x, size_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  size_t j = 0;
  for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + j));
  float mx = _mm512_reduce_max_ps(mv);
  for (size_t r = j; r < n; ++r) mx = std::max(mx, x[r]);
  if (mx == -std::numeric_limits<float>::infinity()) return mx;
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, exp512(_mm512_sub_ps(_mm512_loadu_ps(x + j), m)));
  float t = _mm512_reduce_add_ps(acc);
  for (; j < n; ++j) t += fast_exp(x[j] - mx);
  return mx + std::log(t);
}

// agg[j] += exp(x[j] - c) (or agg[j] = max(agg[j], exp(x[j] - c)) with take_max).
CTKVR_AVX512 void add_exp_row512(float* agg, const float* x, float c, size_t n, bool take_max) {
  const __m512 cv = _mm512_set1_ps(c);
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + j), cv));
    const __m512 a = _mm512_loadu_ps(agg + j);
    _mm512_storeu_ps(agg + j, take_max ? _mm512_max_ps(a, e) : _mm512_add_ps(a, e));
  }
  for (; j < n; ++j) agg[j] = take_max ? std::max(agg[j], fast_exp(x[j] - c)) : agg[j] + fast_exp(x[j] - c);
}

bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                         __builtin_cpu_supports("fma");
  return ok;
}

float softmax_row(float* s, int64_t N, float* z) {
  if (use_avx512()) return softmax_row512(s, N, z);
  float mx = -std::numeric_limits<float>::infinity(), t = 0.f;
  for (int64_t j = 0; j < N; ++j) mx = std::max(mx, s[j]);
  for (int64_t j = 0; j < N; ++j) t += (s[j] = fast_exp(s[j] - mx));
  *z = t;
  return mx;
}

float lse_row(const float* x, size_t n) {
  if (use_avx512()) return lse_row512(x, n);
  float mx = -std::numeric_limits<float>::infinity(), t = 0.f;
  for (size_t j = 0; j < n; ++j) mx = std::max(mx, x[j]);
  if (mx == -std::numeric_limits<float>::infinity()) return mx;
  for (size_t j = 0; j < n; ++j) t += fast_exp(x[j] - mx);
  return mx + std::log(t);
}

void add_exp_row(float* agg, const float* x, float c, size_t n, bool take_max) {
  if (use_avx512()) return add_exp_row512(agg, x, c, n, take_max);
  for (size_t j = 0; j < n; ++j) agg[j] = take_max ? std::max(agg[j], fast_exp(x[j] - c)) : agg[j] + fast_exp(x[j] - c);
}

float dot(const float* a, const float* b, int d) { return use_avx512() ? dot512(a, b, d) : dot_scalar(a, b, d); }

}  // namespace

float aggregate(Agg a, const float* s, const float* lse, int G) {
  float r = 0.f;
  for (int g = 0; g < G; ++g) {
    switch (a) {
      case Agg::SumSoftmax: r += fast_exp(s[g] - lse[g]); break;
      case Agg::MaxSoftmax: r = std::max(r, fast_exp(s[g] - lse[g])); break;
      case Agg::SumLogits: r += s[g]; break;
    }
  }
  return r;
}

Fifo::Fifo(int cap, int rho, int G, int d) : cap_(cap), rho_(rho), G_(G), d_(d), gd_(G * d) {}

// Storage grows with the centroids held instead of being sized for the capacity up front (C x rho
// list entries per layer and KV head, most of them never used on a short context). Until the FIFO
// first fills, head_ is 0 and centroid i lives in slot i, so growing only appends slots; once it
// is full every slot exists.
void Fifo::grow(int slots) {
  if (slots <= alloc_) return;
  const int n = std::min(cap_, std::max({slots, 2 * alloc_, 16}));
  cent_.resize(size_t(n) * gd_);
  lse_.resize(size_t(n) * G_);
  hnorm_.resize(size_t(n) * G_);
  cnorm_.resize(size_t(n));
  min_.resize(size_t(n));
  pos_.resize(size_t(n));
  len_.resize(size_t(n));
  lists_.resize(size_t(n) * rho_);
  alloc_ = n;
}

void Fifo::set(int p, int64_t pos, const float* cent, const float* lse, const Entry* list, int len) {
  std::memcpy(cent_.data() + size_t(p) * gd_, cent, size_t(gd_) * 4);
  std::memcpy(lse_.data() + size_t(p) * G_, lse, size_t(G_) * 4);
  double all = 0;
  for (int g = 0; g < G_; ++g) {
    double s = 0;
    for (int i = 0; i < d_; ++i) s += double(cent[g * d_ + i]) * cent[g * d_ + i];
    hnorm_[size_t(p) * G_ + g] = float(std::sqrt(s));
    all += s;
  }
  cnorm_[size_t(p)] = float(std::sqrt(all));
  pos_[size_t(p)] = pos;
  len = std::min(len, rho_);
  len_[size_t(p)] = len;
  Entry* l = lists_.data() + size_t(p) * rho_;
  std::copy(list, list + len, l);
  std::make_heap(l, l + len, heap_cmp);
  refresh_min(p);
}

void Fifo::push_back(int64_t pos, const float* cent, const float* lse, const Entry* list, int len, Item* popped) {
  int p;
  if (count_ < cap_) {
    p = phys(count_);
    grow(p + 1);
    ++count_;
  } else {
    if (popped) *popped = item(0);
    p = head_;
    head_ = (head_ + 1) % cap_;
  }
  set(p, pos, cent, lse, list, len);
}

void Fifo::pop_back() {
  if (count_ > 0) --count_;
}

void Fifo::push_front(const Item& it) {
  grow(cap_);  // the slot before head_ wraps around to the end
  if (count_ == cap_) pop_back();
  head_ = (head_ - 1 + cap_) % cap_;
  ++count_;
  set(head_, it.pos, it.cent.data(), it.lse.data(), it.list.data(), int(it.list.size()));
}

Fifo::Item Fifo::item(int i) const {
  Item it;
  it.pos = pos(i);
  it.cent.assign(cent(i), cent(i) + gd_);
  it.lse.assign(lse(i), lse(i) + G_);
  it.list.assign(list(i), list(i) + list_len(i));
  return it;
}

void Fifo::offer(int i, float s, int32_t t) {
  const int p = phys(i);
  if (s < min_[size_t(p)]) return;  // below a full list's weakest member: the list is not touched
  Entry* l = list_mut(i);
  int& len = list_len_mut(i);
  if (len < rho_) {
    l[len++] = Entry{s, t};
    std::push_heap(l, l + len, heap_cmp);
  } else if (len > 0 && heap_cmp(Entry{s, t}, l[0])) {
    std::pop_heap(l, l + len, heap_cmp);
    l[len - 1] = Entry{s, t};
    std::push_heap(l, l + len, heap_cmp);
  }
  refresh_min(p);
}

void Fifo::refresh_min(int p) {
  const int len = len_[size_t(p)];
  min_[size_t(p)] = len == rho_ && len > 0 ? lists_[size_t(p) * rho_].s : -std::numeric_limits<float>::infinity();
}

void Fifo::forget_tokens_from(int64_t n) {
  // Centroids of positions >= n go (they are the newest), then list entries >= n.
  while (count_ > 0 && pos(count_ - 1) >= n) pop_back();
  for (int i = 0; i < count_; ++i) {
    Entry* l = list_mut(i);
    int& len = list_len_mut(i);
    const int m = int(std::remove_if(l, l + len, [n](const Entry& e) { return e.i >= n; }) - l);
    if (m != len) {
      len = m;
      std::make_heap(l, l + len, heap_cmp);
      refresh_min(phys(i));
    }
  }
}

uint64_t Fifo::bytes() const {
  return uint64_t(cent_.size() + lse_.size() + hnorm_.size() + cnorm_.size() + min_.size()) * 4 + pos_.size() * 8 +
         len_.size() * 4 + lists_.size() * sizeof(Entry);
}

}  // namespace ctkvr

namespace {

using ctkvr::Agg;
using ctkvr::Entry;
using ctkvr::Fifo;
using ctkvr::dot;
using ctkvr::fast_exp;
using ctkvr::kNegInf;
using ctkvr::lse_row;

enum class Init { Last, Random, Initial, Equispaced };
enum class NewTokens { Insert, Dcu, None };

// The prompt queries kept until build_index, as the init strategy needs them (bounded by 2C rows).
struct PromptQueries {
  std::vector<int64_t> pos;
  std::vector<float> rows;  // [m][Hq*d]
  int64_t seen = 0, stride = 1;
  std::mt19937_64 rng;
};

constexpr int64_t kTok = (int64_t(1) << 31) - 1;  // token counts and indices are int32

class Ctkvr final : public Method {
 public:
  Ctkvr(const MethodContext& ctx, const ParamSet& p)
      : ctx_(ctx),
        C_(p.get_int("centroids")),
        rho_(p.get_int("rho")),
        lambda_(p.get_int("lambda")),
        topk_(int_param(p, "ctkvr", "topk", 0, kTok, "0 = the session budget")),
        sinks_(int_param(p, "ctkvr", "sinks", 0, kTok)),
        local_(int_param(p, "ctkvr", "local", 0, kTok)),
        static_share_(p.get_float("static_share")),
        seed_(p.get_int("seed")),
        append_q_(int_param(p, "ctkvr", "append_queries", -1, kTok, "-1 = C, 0 = none")),
        dcu_(p.get_bool("dcu")),
        union_(p.get_string("merge") == "union"),
        mean_head_(p.get_string("recall_sim") == "mean_head_cosine"),
        recall_budget_(p.get_string("recall") == "budget") {
    auto pos_int = [](int64_t v, int64_t hi, const char* name, const char* what) {
      if (v < 1 || v > hi) invalid(std::string("method_params: ctkvr ") + name + " must be " + what);
    };
    pos_int(C_, 1 << 20, "centroids", "in [1, 1048576] (the FIFO capacity C)");
    pos_int(rho_, int64_t(1) << 30, "rho", "in [1, 2^30] (keys per centroid)");
    pos_int(lambda_, 1 << 20, "lambda", "in [1, 1048576] (centroids recalled per step)");
    if (!(static_share_ >= 0 && static_share_ <= 1))
      invalid("method_params: ctkvr static_share must be in [0, 1] (0 = fixed sinks + local), got " +
              std::to_string(static_share_));
    if (C_ * rho_ > (int64_t(1) << 27))
      invalid("method_params: ctkvr centroids * rho must be <= 2^27 (posting lists take 8 bytes per entry per layer and "
              "KV head), got " + std::to_string(C_) + " * " + std::to_string(rho_));
    const auto& init = p.get_string("init");
    init_ = init == "random" ? Init::Random : init == "initial" ? Init::Initial : init == "equispaced" ? Init::Equispaced : Init::Last;
    const auto& agg = p.get_string("aggregate");
    agg_ = agg == "max_softmax" ? Agg::MaxSoftmax : agg == "sum_logits" ? Agg::SumLogits : Agg::SumSoftmax;
    const auto& nt = p.get_string("new_tokens");
    new_ = nt == "dcu" ? NewTokens::Dcu : nt == "none" ? NewTokens::None : NewTokens::Insert;
    const auto L = ctx.shape.num_layers, H = ctx.shape.num_kv_heads;
    fifo_.resize(L);
    undo_.resize(L);
    prompt_.resize(L);
    for (auto& pq : prompt_) pq.rng.seed(uint64_t(seed_));
    indexed_.assign(L, 0);
    first_.assign(L, 0);
    tokens_.assign(L, 0);
    built_.assign(L, 0);
    ws_.resize(H);
  }

  // ------------------------------------------------------------------------------------------
  // Prefill: keep the queries the init strategy may pick.
  void on_prefill(uint32_t layer, const float* q, int64_t n, const KVLayer& kv) override {
    if (built_[layer]) return;  // a tables-only load: the chunks refill the KV, the index stays
    auto& pq = prompt_[layer];
    const size_t row = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
    const int64_t n0 = kv.size() - n;
    auto add = [&](int64_t t) {
      pq.pos.push_back(n0 + t);
      pq.rows.insert(pq.rows.end(), q + size_t(t) * row, q + size_t(t + 1) * row);
    };
    switch (init_) {
      case Init::Last: {
        for (int64_t t = std::max<int64_t>(0, n - C_); t < n; ++t) add(t);
        const int64_t extra = int64_t(pq.pos.size()) - C_;
        if (extra > 0) {
          pq.pos.erase(pq.pos.begin(), pq.pos.begin() + extra);
          pq.rows.erase(pq.rows.begin(), pq.rows.begin() + size_t(extra) * row);
        }
        break;
      }
      case Init::Initial:
        for (int64_t t = 0; t < n && int64_t(pq.pos.size()) < C_; ++t) add(t);
        break;
      case Init::Random:  // reservoir sampling: a uniform C-subset of the prompt
        for (int64_t t = 0; t < n; ++t, ++pq.seen) {
          if (int64_t(pq.pos.size()) < C_) {
            add(t);
          } else {
            const int64_t j = int64_t(pq.rng() % uint64_t(pq.seen + 1));
            if (j < C_) {
              pq.pos[size_t(j)] = n0 + t;
              std::copy(q + size_t(t) * row, q + size_t(t + 1) * row, pq.rows.begin() + size_t(j) * row);
            }
          }
        }
        break;
      case Init::Equispaced:  // positions that are multiples of a doubling stride, at most 2C
        for (int64_t t = 0; t < n; ++t) {
          if ((n0 + t) % pq.stride) continue;
          add(t);
          if (int64_t(pq.pos.size()) > 2 * C_) {
            pq.stride *= 2;
            size_t w = 0;
            for (size_t r = 0; r < pq.pos.size(); ++r)
              if (pq.pos[r] % pq.stride == 0) {
                pq.pos[w] = pq.pos[r];
                std::copy(pq.rows.begin() + r * row, pq.rows.begin() + (r + 1) * row, pq.rows.begin() + w * row);
                ++w;
              }
            pq.pos.resize(w);
            pq.rows.resize(w * row);
          }
        }
        break;
    }
  }

  void build_index(uint32_t layer, const KVLayer& kv) override {
    auto& pq = prompt_[layer];
    const size_t row = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
    // Order by position (the FIFO pops the earliest first), pick C (equispaced thins evenly).
    std::vector<size_t> ord(pq.pos.size());
    for (size_t i = 0; i < ord.size(); ++i) ord[i] = i;
    std::sort(ord.begin(), ord.end(), [&](size_t a, size_t b) { return pq.pos[a] < pq.pos[b]; });
    if (int64_t(ord.size()) > C_) {
      std::vector<size_t> pick;
      if (init_ == Init::Equispaced)
        for (int64_t i = 0; i < C_; ++i) pick.push_back(ord[size_t(i * int64_t(ord.size()) / C_)]);
      else
        pick.assign(ord.end() - C_, ord.end());
      ord = pick;
    }
    std::vector<float> qs(ord.size() * row);
    std::vector<int64_t> pos(ord.size());
    for (size_t i = 0; i < ord.size(); ++i) {
      std::copy(pq.rows.begin() + ord[i] * row, pq.rows.begin() + (ord[i] + 1) * row, qs.begin() + i * row);
      pos[i] = pq.pos[ord[i]];
    }
    pq = PromptQueries{};
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
    fifo_[layer].assign(ctx_.shape.num_kv_heads, Fifo(int(C_), int(rho_), G, d));
    undo_[layer].clear();
    push_centroids(layer, qs.data(), pos.data(), int64_t(pos.size()), kv, nullptr);
    indexed_[layer] = kv.size();
    tokens_[layer] = kv.size();
    built_[layer] = 1;
  }

  // ------------------------------------------------------------------------------------------
  // Append (decode token or a new prompt chunk).
  void on_append(uint32_t layer, const float* q, int64_t n, const KVLayer& kv, bool decode) override {
    if (!built_[layer]) return;
    auto& U = undo_[layer];
    U.assign(ctx_.shape.num_kv_heads, HeadUndo{});
    first_[layer] = kv.size() - n;
    tokens_[layer] = kv.size();
    if (decode) return;  // window evictions, recall, DCU happen in select
    // Multi-turn: earlier tokens pushed out of the window by the chunk are offered (7.3 (a)); the
    // chunk's own keys are reached through its last queries, pushed as centroids.
    const int64_t N = kv.size();
    if (new_ == NewTokens::Insert) {
      const int64_t up = std::max(indexed_[layer], std::min(first_[layer], N - local_));
      ctx_.pool->parallel_for(ctx_.shape.num_kv_heads, [&](int64_t h) { insert_tokens(layer, int(h), indexed_[layer], up, kv); });
    }
    indexed_[layer] = N;
    const int64_t m = std::min<int64_t>(append_q_ < 0 ? C_ : append_q_, n);
    if (m <= 0) return;
    const size_t row = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
    std::vector<int64_t> pos(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) pos[size_t(i)] = N - m + i;
    push_centroids(layer, q + size_t(n - m) * row, pos.data(), m, kv, &U);
  }

  void truncate(uint32_t layer, int64_t n) override {
    if (!built_[layer]) {
      auto& pq = prompt_[layer];
      const size_t row = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
      size_t w = 0;
      for (size_t r = 0; r < pq.pos.size(); ++r)
        if (pq.pos[r] < n) {
          pq.pos[w] = pq.pos[r];
          std::copy(pq.rows.begin() + r * row, pq.rows.begin() + (r + 1) * row, pq.rows.begin() + w * row);
          ++w;
        }
      pq.pos.resize(w);
      pq.rows.resize(w * row);
      return;
    }
    auto& U = undo_[layer];
    for (size_t h = 0; h < fifo_[layer].size(); ++h) {
      Fifo& f = fifo_[layer][h];
      // Centroids at positions >= n (the newest) go; the last call's evictions come back when that
      // call is the one rolled back (oldest restored last, so the FIFO order is as before).
      f.forget_tokens_from(n);
      if (first_[layer] >= n && h < U.size())
        for (auto it = U[h].popped.rbegin(); it != U[h].popped.rend(); ++it) f.push_front(*it);
      f.forget_tokens_from(n);
    }
    U.clear();
    indexed_[layer] = std::min(indexed_[layer], n);
    tokens_[layer] = std::min(tokens_[layer], n);
  }

  // The static set of a layer of n tokens: [0, sinks) and [n - recent, n).
  StaticKeys static_set(int64_t n) const {
    // With topk = 0 the whole selection keeps to the session budget: the static set is clipped to it
    // (sinks first, like exact_topk's forced keys) and the rerank keeps the rest.
    const int64_t budget = ctx_.budget.keys(n, 0.05);
    const int64_t cap = topk_ > 0 ? n : budget;
    // static_share > 0 (the default 0.5): the static set scales with the budget, at most that share
    // of it (sinks at most an eighth of the share), so retrieval keeps the rest at every context
    // length; 0: the fixed counts, clipped to the budget only.
    int64_t sinks = sinks_, local = local_;
    if (topk_ == 0 && static_share_ > 0) {
      const int64_t st = int64_t(std::floor(static_share_ * double(budget)));
      sinks = std::min(sinks, st >= 2 ? std::max<int64_t>(1, st / 8) : 0);
      local = std::min(local, std::max<int64_t>(0, st - sinks));
    }
    const int64_t s_end = std::min({sinks, n, cap});
    const int64_t l_begin = std::max<int64_t>(s_end, n - std::min(local, cap - s_end));
    return StaticKeys{s_end, n - l_begin};
  }

  // ------------------------------------------------------------------------------------------
  // Decode.
  void select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) override {
    if (!built_[layer]) fail(KVS_STATUS_INVALID_STATE, "ctkvr: layer " + std::to_string(layer) + " has no index");
    const int64_t n = kv.size();
    const int hkv = int(ctx_.shape.num_kv_heads);
    const int64_t budget = ctx_.budget.keys(n, 0.05);
    const StaticKeys sk = static_set(n);
    const int64_t s_end = sk.sinks, l_begin = n - sk.recent;
    const int64_t k = topk_ > 0 ? topk_ : std::max<int64_t>(0, budget - sk.total());
    const int64_t ev0 = indexed_[layer], ev1 = std::max(indexed_[layer], l_begin);
    auto& U = undo_[layer];
    if (U.size() != size_t(hkv)) {
      U.assign(size_t(hkv), HeadUndo{});
      first_[layer] = n - 1;
    }
    tokens_[layer] = n;
    out.kind = Selection::Kind::PerKvHead;
    out.lists.assign(size_t(hkv), {});
    ctx_.pool->parallel_for(hkv, [&](int64_t hh) {
      const int h = int(hh);
      // Policy (a): a few evicted tokens (one per decode step) are scored in the recall's pass over
      // the centroids; a longer range (after an append or a load) first, separately.
      const bool fuse = new_ == NewTokens::Insert && ev1 - ev0 <= 4;
      if (new_ == NewTokens::Insert && !fuse) insert_tokens(layer, h, ev0, ev1, kv);
      select_head(layer, h, q + size_t(h) * ctx_.shape.group() * ctx_.shape.head_dim, kv, s_end, l_begin, k,
                  new_ == NewTokens::Dcu ? ev0 : ev1, ev1, fuse ? ev0 : ev1, ev1, U[size_t(h)], out.lists[size_t(h)]);
    });
    indexed_[layer] = ev1;
    if (!union_) {
      static_lists_.assign(size_t(hkv), {});
      for (auto& l : static_lists_) {
        for (int64_t t = 0; t < s_end; ++t) l.push_back(int32_t(t));
        for (int64_t t = l_begin; t < n; ++t) l.push_back(int32_t(t));
      }
    }
  }

  // The static set (sinks and the local window) when the selection holds it (merge=union); with
  // merge=lse it is attended through extra() and the selection is the retrieved keys alone.
  StaticKeys static_keys(uint32_t, int64_t n) const override { return union_ ? static_set(n) : StaticKeys{}; }
  StaticKeys static_capacity() const override { return union_ ? StaticKeys{sinks_, local_} : StaticKeys{}; }

  bool extra(uint32_t layer, const float* q, const KVLayer& kv, float* o, float* lse) override {
    if (union_) return false;
    cpu::attend_gather_kv(kv, q, ctx_.shape.group(), static_lists_, ctx_.shape.softmax_scale, o, lse, *ctx_.pool);
    return true;
  }

  // ------------------------------------------------------------------------------------------
  nlohmann::json save_meta() const override {
    nlohmann::json m = nlohmann::json::object();
    m["centroids"] = C_;
    m["rho"] = rho_;
    m["lambda"] = lambda_;
    m["group_dim"] = ctx_.shape.group() * int(ctx_.shape.head_dim);
    for (uint32_t l = 0; l < fifo_.size(); ++l) {
      if (!built_[l]) continue;
      nlohmann::json L;
      L["indexed_tokens"] = indexed_[l];
      L["tokens"] = tokens_[l];
      std::vector<int> counts;
      uint64_t entries = 0;
      for (auto& f : fifo_[l]) {
        counts.push_back(f.size());
        for (int i = 0; i < f.size(); ++i) entries += uint64_t(f.list_len(i));
      }
      L["counts"] = counts;
      L["list_entries"] = entries;
      m["layers"][std::to_string(l)] = L;
    }
    double v;
    if (stat("dedup_coefficient", &v)) m["mean_dedup_coefficient"] = v;
    return m;
  }

  void save(io::TablesWriter& w) const override {
    const int G = ctx_.shape.group(), gd = G * int(ctx_.shape.head_dim);
    for (uint32_t l = 0; l < fifo_.size(); ++l) {
      if (!built_[l]) continue;
      for (size_t h = 0; h < fifo_[l].size(); ++h) {
        const Fifo& f = fifo_[l][h];
        const int c = f.size();
        std::vector<float> cent(size_t(c) * gd), lse(size_t(c) * G);
        std::vector<int64_t> pos(static_cast<size_t>(c));
        std::vector<int32_t> len(static_cast<size_t>(c));
        std::vector<Entry> lists(size_t(c) * rho_, Entry{0.f, -1});
        for (int i = 0; i < c; ++i) {
          std::copy(f.cent(i), f.cent(i) + gd, cent.begin() + size_t(i) * gd);
          std::copy(f.lse(i), f.lse(i) + G, lse.begin() + size_t(i) * G);
          pos[size_t(i)] = f.pos(i);
          len[size_t(i)] = f.list_len(i);
          std::copy(f.list(i), f.list(i) + f.list_len(i), lists.begin() + size_t(i) * rho_);
        }
        const int32_t L = int32_t(l), H = int32_t(h);
        w.add_copy("ctkvr.cent", L, H, cent.data(), cent.size() * 4);
        w.add_copy("ctkvr.lse", L, H, lse.data(), lse.size() * 4);
        w.add_copy("ctkvr.pos", L, H, pos.data(), pos.size() * 8);
        w.add_copy("ctkvr.len", L, H, len.data(), len.size() * 4);
        w.add_copy("ctkvr.lists", L, H, lists.data(), lists.size() * sizeof(Entry));
      }
    }
  }

  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim), gd = G * d;
    const io::HeaderReader hm(f.path(), "method.meta");
    auto bad = [&](const std::string& what) { fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "ctkvr tables: " + what); };
    if (!hm.has(meta, "layers")) return;
    // Header numbers are range-checked at their type before they are compared (io/header.hpp).
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    if (hm.integer<int64_t>(meta, "centroids", 1, kMax) != C_ || hm.integer<int64_t>(meta, "rho", 1, kMax) != rho_ ||
        hm.integer<int64_t>(meta, "group_dim", 1, kMax) != gd)
      bad("centroids/rho/group_dim in the header do not match the session's parameters and shape");
    const auto& layers = hm.object(meta, "layers");
    for (uint32_t l = 0; l < fifo_.size(); ++l) {
      const auto key = std::to_string(l);
      if (!layers.contains(key)) continue;
      const auto& L = hm.sub("layers").object(layers, key);
      const auto hl = hm.sub("layers").sub(key);
      const int64_t ntok = hl.integer<int64_t>(L, "tokens", 0, kTok);
      const int64_t nidx = hl.integer<int64_t>(L, "indexed_tokens", 0, ntok);
      const auto& counts = hl.array(L, "counts");
      if (counts.size() != ctx_.shape.num_kv_heads)
        hl.fail("counts", "expected num_kv_heads (" + std::to_string(ctx_.shape.num_kv_heads) + ") entries, got " +
                              std::to_string(counts.size()));
      fifo_[l].assign(ctx_.shape.num_kv_heads, Fifo(int(C_), int(rho_), G, d));
      for (int h = 0; h < int(ctx_.shape.num_kv_heads); ++h) {
        const int64_t c = hl.integer_value<int64_t>(counts[size_t(h)], "counts." + std::to_string(h), 0, C_);
        auto sec = [&](const char* tag, uint64_t bytes) {
          const auto& s = f.require(tag, int32_t(l), h);
          if (s.length != bytes) bad(std::string("section ") + tag + " layer " + key + " head " + std::to_string(h) + ": size mismatch");
          return s.data;
        };
        const auto* cent = reinterpret_cast<const float*>(sec("ctkvr.cent", uint64_t(c) * gd * 4));
        const auto* lse = reinterpret_cast<const float*>(sec("ctkvr.lse", uint64_t(c) * G * 4));
        const auto* pos = reinterpret_cast<const int64_t*>(sec("ctkvr.pos", uint64_t(c) * 8));
        const auto* len = reinterpret_cast<const int32_t*>(sec("ctkvr.len", uint64_t(c) * 4));
        const auto* lists = reinterpret_cast<const Entry*>(sec("ctkvr.lists", uint64_t(c) * rho_ * sizeof(Entry)));
        for (int64_t i = 0; i < c; ++i) {
          if (len[i] < 0 || len[i] > rho_) bad("layer " + key + ": invalid list length");
          for (int32_t j = 0; j < len[i]; ++j) {
            const int32_t t = lists[size_t(i) * rho_ + j].i;
            if (t < 0 || t >= ntok) bad("layer " + key + ": token index out of range");
          }
          fifo_[l][size_t(h)].push_back(pos[i], cent + size_t(i) * gd, lse + size_t(i) * G, lists + size_t(i) * rho_,
                                        len[i], nullptr);
        }
      }
      indexed_[l] = nidx;
      tokens_[l] = ntok;
      built_[l] = 1;
      undo_[l].clear();
      prompt_[l] = PromptQueries{};
    }
  }

  std::unique_ptr<Method> clone() const override { return std::make_unique<Ctkvr>(*this); }

  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    if (tokens_[layer] <= tokens) return true;
    *why = "its ctkvr index has seen " + std::to_string(tokens_[layer]) + " tokens";
    return false;
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (auto& L : fifo_)
      for (auto& f : L) b += f.bytes();
    return b;
  }

  bool stat(std::string_view name, double* out) const override {
    double beta = 0, recalled = 0, steps = 0, last = 0, cents = 0, filled = 0;
    for (auto& w : ws_) {
      beta += w.beta_sum;
      recalled += w.recalled_sum;
      cents += w.centroids_sum;
      filled += w.filled_sum;
      steps += double(w.steps);
      last += w.last_beta;
    }
    if (name == "dedup_coefficient") *out = steps > 0 ? beta / steps : 0.0;
    else if (name == "last_dedup_coefficient") *out = ws_.empty() ? 0.0 : last / double(ws_.size());
    else if (name == "recalled_keys") *out = steps > 0 ? recalled / steps : 0.0;
    else if (name == "recalled_centroids") *out = steps > 0 ? cents / steps : 0.0;
    else if (name == "filled_keys") *out = steps > 0 ? filled / steps : 0.0;
    else if (name == "centroids") {
      double c = 0, m = 0;
      for (uint32_t l = 0; l < fifo_.size(); ++l)
        for (auto& f : fifo_[l]) c += f.size(), ++m;
      *out = m > 0 ? c / m : 0.0;
    } else return false;
    return true;
  }

  const Fifo* fifo(uint32_t layer, int h) const {
    if (layer >= fifo_.size() || h < 0 || size_t(h) >= fifo_[layer].size()) return nullptr;
    return &fifo_[layer][size_t(h)];
  }

 private:
  struct HeadUndo {
    std::vector<Fifo::Item> popped;  // centroids from before the call that it evicted, oldest first
  };
  struct Workspace {
    std::vector<uint64_t> bits;
    std::vector<int32_t> all, rec, cand;
    std::vector<float> sims, st, agg, kf, qn;
    std::vector<const std::byte*> rows;  // the rerank's K rows
    std::vector<int32_t> cidx;           // centroids in order of similarity
    std::vector<int32_t> ties;           // the update's candidates at its threshold
    std::vector<Entry> list;
    std::vector<uint32_t> radix;  // kth_largest's scratch
    double beta_sum = 0, recalled_sum = 0, last_beta = 0, centroids_sum = 0, filled_sum = 0;
    int64_t steps = 0;
  };

  // Scores keys [t0, t1) of head h against every centroid of its FIFO and offers them (7.3 (a)).
  void insert_tokens(uint32_t layer, int h, int64_t t0, int64_t t1, const KVLayer& kv) {
    if (t1 <= t0) return;
    Fifo& f = fifo_[layer][size_t(h)];
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
    const float scale = ctx_.shape.softmax_scale;
    std::vector<float> kf(static_cast<size_t>(d)), s(static_cast<size_t>(G));
    for (int64_t t = t0; t < t1; ++t) {
      convert_to_f32(kv.k_row(h, t), kv.dtype(), kf.data(), size_t(d));
      for (int i = 0; i < f.size(); ++i) {
        const float* c = f.cent(i);
        for (int g = 0; g < G; ++g) s[size_t(g)] = scale * dot(c + size_t(g) * d, kf.data(), d);
        f.offer(i, ctkvr::aggregate(agg_, s.data(), f.lse(i), G), int32_t(t));
      }
    }
  }

  void select_head(uint32_t layer, int h, const float* qg, const KVLayer& kv, int64_t s_end, int64_t l_begin,
                   int64_t k, int64_t ev0, int64_t ev1, int64_t ins0, int64_t ins1, HeadUndo& undo,
                   std::vector<int32_t>& out) {
    Fifo& f = fifo_[layer][size_t(h)];
    Workspace& w = ws_[size_t(h)];
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
    const int64_t n = kv.size();
    // 1. Recall: cosine against every centroid, top-lambda.
    const int c = f.size();
    w.sims.resize(size_t(c));
    w.qn.resize(size_t(G));
    float* qn = w.qn.data();
    float qall = 0;
    for (int g = 0; g < G; ++g) {
      qn[g] = std::sqrt(dot(qg + size_t(g) * d, qg + size_t(g) * d, d));
      qall += qn[g] * qn[g];
    }
    qall = std::sqrt(qall);
    const int nins = int(ins1 - ins0);
    w.kf.resize(size_t(std::max(nins, 1)) * d);
    for (int r = 0; r < nins; ++r) convert_to_f32(kv.k_row(h, ins0 + r), kv.dtype(), w.kf.data() + size_t(r) * d, size_t(d));
    const float scale = ctx_.shape.softmax_scale;
    // With more pool threads than KV heads, the centroids and the rerank's rows are cut into parts
    // (each centroid's list and similarity, each row's score, are its own: the same numbers).
    const int64_t parts = parts_per_task(*ctx_.pool, int64_t(ctx_.shape.num_kv_heads));
    parallel_ranges(*ctx_.pool, c, parts, 1, 128, [&](int64_t i0, int64_t i1) {
      std::vector<float> sv(static_cast<size_t>(G));
      for (int i = int(i0); i < int(i1); ++i) {
        const float* cc = f.cent(i);
        for (int r = 0; r < nins; ++r) {  // tokens leaving the window (7.3 (a)), while the centroid is in cache
          for (int g = 0; g < G; ++g) sv[size_t(g)] = scale * dot(cc + size_t(g) * d, w.kf.data() + size_t(r) * d, d);
          f.offer(i, ctkvr::aggregate(agg_, sv.data(), f.lse(i), G), int32_t(ins0 + r));
        }
        float sim = 0;
        if (mean_head_) {
          const float* hn = f.hnorm(i);
          for (int g = 0; g < G; ++g)
            sim += dot(qg + size_t(g) * d, cc + size_t(g) * d, d) / std::max(qn[g] * hn[g], 1e-30f);
          sim /= float(G);
        } else {
          sim = dot(qg, cc, G * d) / std::max(qall * f.cnorm(i), 1e-30f);
        }
        w.sims[size_t(i)] = sim;
      }
    });
    w.cidx.resize(size_t(c));
    for (int i = 0; i < c; ++i) w.cidx[size_t(i)] = i;
    auto closer = [&](int32_t a, int32_t b) {
      return w.sims[size_t(a)] > w.sims[size_t(b)] || (w.sims[size_t(a)] == w.sims[size_t(b)] && a > b);
    };
    const int lam = int(std::min<int64_t>(lambda_, c));
    std::partial_sort(w.cidx.begin(), w.cidx.begin() + lam, w.cidx.end(), closer);
    // 2. Gather + deduplicate with the bitmap; 3. drop the static keys (got: the recalled keys
    // outside the static set).
    const size_t words = size_t((n + 63) / 64);
    if (w.bits.size() < words) w.bits.resize(std::max(words, w.bits.size() * 2), 0);
    size_t n_all = 0;
    int64_t got = 0;
    auto mark = [&](int64_t t) {  // sets t's bit; true if it was clear
      uint64_t& word = w.bits[size_t(t) >> 6];
      const uint64_t bit = uint64_t(1) << (t & 63);
      const bool fresh = !(word & bit);
      word |= bit;
      return fresh;
    };
    auto gather = [&](int i) {
      const Entry* l = f.list(i);
      for (int j = 0, e = f.list_len(i); j < e; ++j) {
        const int32_t t = l[j].i;
        const bool fresh = mark(t);
        n_all += fresh;
        got += fresh && t >= s_end && t < l_begin;
      }
    };
    int used = 0;
    for (; used < lam; ++used) gather(w.cidx[size_t(used)]);
    // recall=budget: the next centroids by similarity until the rerank has its k candidates, then,
    // when every list is gathered and still short, the most recent keys outside the static set.
    int64_t filled = 0;
    if (recall_budget_ && got < k) {
      if (used < c) std::sort(w.cidx.begin() + used, w.cidx.end(), closer);
      for (; used < c && got < k; ++used) gather(w.cidx[size_t(used)]);
      for (int64_t t = l_begin - 1; t >= s_end && got < k; --t)
        if (mark(t)) {
          ++got;
          ++filled;
        }
    }
    const double beta = double(n_all) / (double(std::max<int64_t>(lambda_, used)) * double(rho_));
    // Policy (b): the tokens evicted from the window since the last step join the DCU candidates.
    w.all.clear();
    for (int64_t t = ev0; t < ev1; ++t)
      if (!(w.bits[size_t(t) >> 6] & (uint64_t(1) << (t & 63)))) w.all.push_back(int32_t(t));
    // The recalled keys in token order (rows read in address order), the bitmap cleared on the way;
    // the bitmap is n/64 words, the only per-step pass whose length grows with the context.
    w.rec.clear();
    for (size_t wi = 0; wi < words; ++wi) {
      uint64_t x = w.bits[wi];
      if (!x) continue;
      w.bits[wi] = 0;
      do {
        const int32_t t = int32_t(wi * 64 + size_t(__builtin_ctzll(x)));
        if (t >= s_end && t < l_begin) w.rec.push_back(t);
        x &= x - 1;
      } while (x);
    }
    w.beta_sum += beta;
    w.last_beta = beta;
    w.centroids_sum += used;
    w.filled_sum += double(filled);
    w.recalled_sum += double(w.rec.size());
    ++w.steps;
    w.cand = w.rec;
    w.cand.insert(w.cand.end(), w.all.begin(), w.all.end());
    // 4. Rerank: exact scores, per-head normalisers over the candidates and the static set.
    const size_t m = w.cand.size();
    std::vector<float> lse(size_t(G), 0.f);
    // Per-head rows [G][mt] (the candidates, then the static set) so the normalisers and the
    // aggregation run on 16 lanes, scored by the gathered attention's score pass.
    w.rows.clear();
    for (int32_t t : w.cand) w.rows.push_back(kv.k_row(h, t));
    if (agg_ != Agg::SumLogits) {
      for (int64_t t = 0; t < s_end; ++t) w.rows.push_back(kv.k_row(h, t));
      for (int64_t t = l_begin; t < n; ++t) w.rows.push_back(kv.k_row(h, t));
    }
    const size_t mt = w.rows.size();  // m, or m + the static set
    w.st.resize(mt * G);
    parallel_ranges(*ctx_.pool, int64_t(mt), parts, 64, 512, [&](int64_t b, int64_t e) {
      cpu::score_rows(kv.dtype(), d, G, qg, scale, w.rows.data() + b, e - b, w.st.data() + b, int64_t(mt));
    });
    w.agg.assign(m, 0.f);
    for (int g = 0; g < G; ++g) {
      const float* row = w.st.data() + size_t(g) * mt;
      if (agg_ == Agg::SumLogits) {
        for (size_t j = 0; j < m; ++j) w.agg[j] += row[j];
      } else {
        lse[size_t(g)] = ctkvr::lse_row(row, mt);
        ctkvr::add_exp_row(w.agg.data(), row, lse[size_t(g)], m, agg_ == Agg::MaxSoftmax);
      }
    }
    // A NaN score (keys so large that their dot products overflow, e.g. from a loaded file) ranks
    // last: the selects below order by value and count ties, which NaN would break.
    for (size_t j = 0; j < m; ++j)
      if (std::isnan(w.agg[j])) w.agg[j] = kNegInf;
    // Top-k among the recalled keys (evicted DCU-only candidates are not attended this step; the
    // recalled keys come first in cand, in token order), ties to the lower token. The selection
    // comes out in token order.
    out.clear();
    if (union_)
      for (int64_t t = 0; t < s_end; ++t) out.push_back(int32_t(t));
    cpu::append_top_k(w.cand.data(), w.agg.data(), int64_t(w.rec.size()), k, out, w.radix);
    if (union_)
      for (int64_t t = l_begin; t < n; ++t) out.push_back(int32_t(t));
    // 5. Dynamic centroid update: (q_t, top-rho of the candidates by the same score, ties lowest
    // token first).
    if (dcu_) {
      const size_t r = size_t(std::min<int64_t>(rho_, int64_t(m)));
      // (cand is not in token order here: the evicted candidates follow the recalled ones.)
      const float rth = r < m ? cpu::kth_largest(w.agg.data(), int64_t(m), int64_t(r), w.radix) : kNegInf;
      w.list.clear();
      w.ties.clear();
      for (size_t j = 0; j < m; ++j) {
        if (w.agg[j] > rth) w.list.push_back(Entry{w.agg[j], w.cand[j]});
        else if (w.agg[j] == rth) w.ties.push_back(w.cand[j]);
      }
      if (w.list.size() < r) {
        std::sort(w.ties.begin(), w.ties.end());
        for (size_t j = 0; w.list.size() < r && j < w.ties.size(); ++j) w.list.push_back(Entry{rth, w.ties[j]});
      }
      Fifo::Item popped;
      const bool full = f.size() == f.capacity();
      f.push_back(n - 1, qg, lse.data(), w.list.data(), int(w.list.size()), &popped);
      if (full && popped.pos < n - 1) undo.popped.push_back(std::move(popped));
    }
  }

  // Pushes centroids (queries qs [m][Hq][d] at positions pos) with their top-rho over all keys of
  // kv, per KV head. The scores go through one GEMM per block of centroids; the per-centroid
  // softmax, aggregation and top-rho run on the pool.
  void push_centroids(uint32_t layer, const float* qs, const int64_t* pos, int64_t m, const KVLayer& kv,
                      std::vector<HeadUndo>* undo) {
    const int64_t N = kv.size();
    if (m <= 0 || N <= 0) return;
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
    const size_t row = size_t(ctx_.shape.num_q_heads) * d;
    const auto gemm = cpu::GemmProvider(cpu::resolve_gemm(ctx_.gemm));
    const int64_t block = std::max<int64_t>(1, std::min<int64_t>(m, (int64_t(64) << 20) / (int64_t(G) * N * 4)));
    std::vector<float> kf(size_t(N) * d), S(size_t(block) * G * N), A(size_t(block) * G * d);
    std::vector<std::vector<Entry>> lists(static_cast<size_t>(block));
    std::vector<std::vector<float>> lses(static_cast<size_t>(block), std::vector<float>(static_cast<size_t>(G)));
    const int64_t rho = std::min<int64_t>(rho_, N);
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(int64_t(ctx_.pool->size()) * 4, N / 1024));
    for (int h = 0; h < hkv; ++h) {
      ctx_.pool->parallel_for(chunks, [&](int64_t c) {
        for (int64_t t = c * N / chunks; t < (c + 1) * N / chunks; ++t)
          convert_to_f32(kv.k_row(h, t), kv.dtype(), kf.data() + size_t(t) * d, size_t(d));
      });
      for (int64_t b0 = 0; b0 < m; b0 += block) {
        const int64_t bn = std::min(block, m - b0);
        for (int64_t i = 0; i < bn; ++i)
          std::copy(qs + size_t(b0 + i) * row + size_t(h) * G * d, qs + size_t(b0 + i) * row + size_t(h + 1) * G * d,
                    A.begin() + size_t(i) * G * d);
        cpu::sgemm(gemm, false, true, bn * G, N, d, ctx_.shape.softmax_scale, A.data(), d, kf.data(), d, 0.f, S.data(), N);
        ctx_.pool->parallel_for(bn, [&](int64_t i) { centroid_list(S.data() + size_t(i) * G * N, N, G, rho, lses[size_t(i)], lists[size_t(i)]); });
        for (int64_t i = 0; i < bn; ++i) {
          Fifo::Item popped;
          Fifo& f = fifo_[layer][size_t(h)];
          const bool full = f.size() == f.capacity();
          f.push_back(pos[b0 + i], A.data() + size_t(i) * G * d, lses[size_t(i)].data(), lists[size_t(i)].data(),
                      int(lists[size_t(i)].size()), undo ? &popped : nullptr);
          if (undo && full && popped.pos < first_[layer]) (*undo)[size_t(h)].popped.push_back(std::move(popped));
        }
      }
    }
  }

  // One centroid's scores S [G][N] -> lse [G] and its top-rho list by the aggregated score.
  void centroid_list(float* S, int64_t N, int G, int64_t rho, std::vector<float>& lse, std::vector<Entry>& list) const {
    std::vector<float> agg(size_t(N), 0.f);
    for (int g = 0; g < G; ++g) {
      float* s = S + size_t(g) * N;
      if (agg_ == Agg::SumLogits) {
        lse[size_t(g)] = 0.f;
        for (int64_t j = 0; j < N; ++j) agg[size_t(j)] += s[j];
        continue;
      }
      float z = 0.f;
      const float mx = ctkvr::softmax_row(s, N, &z);
      lse[size_t(g)] = mx + std::log(z);
      const float inv = 1.f / z;
      if (agg_ == Agg::SumSoftmax)
        for (int64_t j = 0; j < N; ++j) agg[size_t(j)] += s[j] * inv;
      else
        for (int64_t j = 0; j < N; ++j) agg[size_t(j)] = std::max(agg[size_t(j)], s[j] * inv);
    }
    // Top-rho: a threshold from a sample keeps the candidates few; exact fallback otherwise.
    std::vector<int32_t> cand;
    if (N > 8 * rho && N > 4096) {
      const int64_t ns = 2048;
      std::vector<float> sample(static_cast<size_t>(ns));
      for (int64_t i = 0; i < ns; ++i) sample[size_t(i)] = agg[size_t(i * N / ns)];
      const int64_t r = std::min<int64_t>(ns - 1, 2 * rho * ns / N + 16);
      std::nth_element(sample.begin(), sample.begin() + r, sample.end(), std::greater<float>());
      const float thr = sample[size_t(r)];
      for (int64_t j = 0; j < N; ++j)
        if (agg[size_t(j)] >= thr) cand.push_back(int32_t(j));
    }
    if (int64_t(cand.size()) < rho) {
      cand.resize(size_t(N));
      for (int64_t j = 0; j < N; ++j) cand[size_t(j)] = int32_t(j);
    }
    auto better = [&](int32_t a, int32_t b) { return agg[size_t(a)] > agg[size_t(b)] || (agg[size_t(a)] == agg[size_t(b)] && a < b); };
    if (rho < int64_t(cand.size())) std::nth_element(cand.begin(), cand.begin() + (rho - 1), cand.end(), better);
    list.resize(size_t(rho));
    for (int64_t j = 0; j < rho; ++j) list[size_t(j)] = Entry{agg[size_t(cand[size_t(j)])], cand[size_t(j)]};
  }

  MethodContext ctx_;
  int64_t C_, rho_, lambda_, topk_, sinks_, local_, seed_, append_q_;
  double static_share_;
  bool dcu_, union_, mean_head_, recall_budget_;
  Init init_;
  Agg agg_;
  NewTokens new_;
  std::vector<std::vector<Fifo>> fifo_;       // [layer][kv head]
  std::vector<std::vector<HeadUndo>> undo_;   // [layer][kv head]: the last call's FIFO changes
  std::vector<int64_t> first_;                // [layer]: first token of the last call
  std::vector<int64_t> tokens_;               // [layer]: tokens the index has seen
  std::vector<PromptQueries> prompt_;
  std::vector<int64_t> indexed_;  // tokens below this are retrievable (listed or offered)
  std::vector<char> built_;
  std::vector<Workspace> ws_;     // per KV head
  std::vector<std::vector<int32_t>> static_lists_;
};

}  // namespace

const ctkvr::Fifo* ctkvr_fifo(const Method& m, uint32_t layer, int kv_head) {
  const auto* c = dynamic_cast<const Ctkvr*>(&m);
  return c ? c->fifo(layer, kv_head) : nullptr;
}

MethodSpec ctkvr_spec() {
  return MethodSpec{
      "ctkvr",
      "CTkvr: query-centroid IVF (last prompt queries, top-rho keys each), recall by cosine, exact rerank, "
      "FIFO centroid update",
      1u << KVS_BACKEND_CPU,
      0.05,
      {{"preset", "enum:kvsieve|paper", "kvsieve",
        "paper: the paper's settings: static_share=0 (the fixed sinks + local), recall=lambda (parameters given "
        "explicitly win); kvsieve: static_share=0.5, recall=budget"},
       {"centroids", "int", "640", "C: FIFO capacity (centroids per KV head); paper: accuracy flat from ~320"},
       {"rho", "int", "1024", "keys per centroid's posting list (the value is lost from the paper's text, about 2k; we chose 1024)"},
       {"lambda", "int", "5", "centroids recalled per step (paper: stable from ~5); with recall=budget at least this many"},
       {"recall", "enum:budget|lambda", "budget",
        "budget: beyond lambda, further centroids by similarity until the rerank has its k candidates, then the most "
        "recent keys when every list is gathered (the selection holds k keys at every context length) [ours]; lambda: "
        "exactly lambda centroids (the paper; at long contexts lambda * rho recalled keys are fewer than k)",
        "lambda"},
       {"topk", "int", "0", "keys kept after rerank (paper: 512/1024); 0 = session budget minus the static keys"},
       {"sinks", "int", "4", "first tokens in the static set (the paper does not say; 4 as MagicPIG and RetroInfer)"},
       {"local", "int", "64", "most recent tokens in the static set (the paper does not say; our choice)"},
       {"static_share", "float", "0.5",
        "with topk = 0: the static set (sinks + local) takes at most this share of the budget, sinks at most an "
        "eighth of it (at least 1), so the counts scale down at small budgets; 0 = the fixed sinks + local "
        "(clipped to the budget)", "0"},
       {"init", "enum:last|random|initial|equispaced", "last", "which prompt queries become centroids (paper: last)"},
       {"seed", "int", "0", "random generator seed for init=random"},
       {"aggregate", "enum:sum_softmax|max_softmax|sum_logits", "sum_softmax",
        "GQA score of a key for lists, rerank and DCU (reconstructed: the paper does not say; default: sum over the group of per-head softmax)"},
       {"recall_sim", "enum:concat_cosine|mean_head_cosine", "concat_cosine",
        "query-centroid similarity (reconstructed: the paper does not say; default: cosine of the concatenated group query; or mean per-head cosine)"},
       {"dcu", "bool", "true", "dynamic centroid update: push (q_t, top-rho of the recalled keys) each step"},
       {"new_tokens", "enum:insert|dcu|none", "insert",
        "tokens leaving the local window: offered to every list (7.3 a), DCU candidates only (7.3 b), or none"},
       {"append_queries", "int", "-1", "last queries of an appended chunk pushed as centroids (-1 = C, 0 = none)"},
       {"merge", "enum:union|lse", "union",
        "static + top-k returned as one selection (exact), or top-k selected and the static set as an LSE-merged extra"}},
      [](const MethodContext& c, const ParamSet& p) { return std::make_unique<Ctkvr>(c, p); }};
}

}  // namespace kvs
