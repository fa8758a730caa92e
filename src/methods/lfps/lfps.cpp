// SPDX-License-Identifier: Apache-2.0
// lfps: Learn From the Past for Sparse Indexing (arXiv 2506.15704; docs/methods/lfps.md,
// whose reconstruction of the lost equations (4)-(10) is the spec here; every reconstructed or assumed item
// is a parameter, see docs/methods/lfps.md).
//
// Per layer and owner (a query head, or a KV head in per_kv_head mode) two score tables:
//   vertical V[j] by absolute key position j in O = [sinks, n),
//   slash    S[δ] by offset δ = t - j, t = n - 1 the current token (δ = 0 is the token itself).
// build_index (§4.2, eq. 4 [reconstructed from the paper's prose]): the tables are the attention of the last T prompt queries,
//   renormalised over O (sinks excluded), weighted gamma^tau, scaled so each table sums to
//   0.5 / (1 - gamma), the steady-state mass of update (10). Priors: K-bar, V-bar (means over O) and
//   rho = Var_j(q_p.k_j) / |q_p|^2 with q_p the last prompt query.
// select, per owner (§4.2 (1)-(4)):
//   sparsity estimate (eqs. 5-6, App. B.1 [reconstructed from the paper's prose]): A_sink exact, A_glob = |O| exp(mu + sigma^2/2)
//   (log-normal logits, mu = q.K-bar s, sigma^2 = rho |q|^2 s^2), A_loc exact over the last W_loc
//   keys of O; r = A_sink / (A_sink + max(A_glob, A_loc)); r > theta: the head is bypassed: it
//   attends its sinks exactly and extra() adds (V-bar, log A_glob), merged by LSE; no update.
//   candidates (eqs. 7-8 [reconstructed from the paper's prose]): {j : V[j] > tau_V} u {j : S[t-j] > tau_S} with
//   tau = mu + alpha * alpha_scale * sigma * 3 / kurtosis, moments kept incrementally (docs/methods/lfps.md).
//   expansion (eq. 9): j + o, o in {-1, 0, 1, 2}, kept if V or S there is above its mean.
//   exact top-k over the candidates (k = budget minus the sinks); the selection is sinks + top-k.
//   update (eq. 10): V = gamma V + a~, S = gamma S + a~ (shifted), a~ = half the softmax over the
//   selected non-sink keys; lazy decay with a global scale (docs/methods/lfps.md): O(k) per step.
#include "methods/lfps/lfps.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <sstream>

#include "backends/cpu/attention.hpp"
#include "backends/cpu/gemm.hpp"
#include "backends/cpu/topk.hpp"
#include "core/error.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs::lfps {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

#define LFPS_AVX2 __attribute__((target("avx2,fma")))

const bool kHaveAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");

LFPS_AVX2 float dot_avx2(const float* a, const float* b, int d) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(s0, s1));
  float s = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

float dot(const float* a, const float* b, int d) {
  if (kHaveAvx2) return dot_avx2(a, b, d);
  float part[8] = {};
  int i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (; i < d; ++i) s += a[i] * b[i];
  for (float p : part) s += p;
  return s;
}

// ---- Candidate bitmasks over tokens (bit j of word j / 64 is token j).

// bits[pos ..] |= word (64 bits at any bit position; bits has a spare word at the end).
inline void or_bits(uint64_t* bits, int64_t pos, uint64_t word) {
  const int64_t w = pos >> 6;
  const int r = int(pos & 63);
  bits[w] |= word << r;
  if (r) bits[w + 1] |= word >> (64 - r);
}

inline uint64_t reverse_bits(uint64_t x) {
  x = ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
  x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
  x = ((x >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((x & 0x0F0F0F0F0F0F0F0Full) << 4);
  return __builtin_bswap64(x);
}

// Bit i of the results: x[i] > hi, x[i] > lo, for 64 entries from x.
LFPS_AVX2 void above64_avx2(const float* x, float hi, float lo, uint64_t& mhi, uint64_t& mlo) {
  const __m256 h = _mm256_set1_ps(hi), l = _mm256_set1_ps(lo);
  uint64_t a = 0, b = 0;
  for (int k = 0; k < 8; ++k) {
    const __m256 v = _mm256_loadu_ps(x + 8 * k);
    a |= uint64_t(unsigned(_mm256_movemask_ps(_mm256_cmp_ps(v, h, _CMP_GT_OQ)))) << (8 * k);
    b |= uint64_t(unsigned(_mm256_movemask_ps(_mm256_cmp_ps(v, l, _CMP_GT_OQ)))) << (8 * k);
  }
  mhi = a;
  mlo = b;
}

void above64(const float* x, float hi, float lo, uint64_t& mhi, uint64_t& mlo) {
  if (kHaveAvx2) return above64_avx2(x, hi, lo, mhi, mlo);
  uint64_t a = 0, b = 0;
  for (int k = 0; k < 64; ++k) {
    a |= uint64_t(x[k] > hi) << k;
    b |= uint64_t(x[k] > lo) << k;
  }
  mhi = a;
  mlo = b;
}

// The scan of eqs. (7)-(8) over one owner's tables, O = [ns, n), t = n - 1: into T (words of
// tokens, zeroed, one spare word) the tokens above a threshold (V[j - ns] > tau_v or S[t - j] >
// tau_s), into M those above a mean (the expansion's condition of eq. 9). The slash table runs
// backwards in token order: its words are bit-reversed. One pass over the 2 (n - ns) floats.
void scan_tables(const float* xv, const float* xs, int64_t ns, int64_t n, float tau_v, float mu_v, float tau_s,
                 float mu_s, uint64_t* T, uint64_t* M) {
  const int64_t m = n - ns, t = n - 1;
  int64_t i = 0;
  for (; i + 64 <= m; i += 64) {
    uint64_t th, tl;
    above64(xv + i, tau_v, mu_v, th, tl);
    or_bits(T, ns + i, th);
    or_bits(M, ns + i, tl);
    above64(xs + i, tau_s, mu_s, th, tl);  // delta = i + b is token t - i - b: bit 63 - b from t - i - 63
    or_bits(T, t - i - 63, reverse_bits(th));
    or_bits(M, t - i - 63, reverse_bits(tl));
  }
  for (; i < m; ++i) {
    const int64_t jv = ns + i, js = t - i;
    T[jv >> 6] |= uint64_t(xv[i] > tau_v) << (jv & 63);
    M[jv >> 6] |= uint64_t(xv[i] > mu_v) << (jv & 63);
    T[js >> 6] |= uint64_t(xs[i] > tau_s) << (js & 63);
    M[js >> 6] |= uint64_t(xs[i] > mu_s) << (js & 63);
  }
}

// Word w of the mask shifted by o tokens (bit p of the result is bit p - o of x; W words).
inline uint64_t shifted_word(const uint64_t* x, int64_t W, int64_t w, int o) {
  auto at = [&](int64_t i) { return i >= 0 && i < W ? x[i] : uint64_t(0); };
  if (o >= 0) {
    const int64_t q = o >> 6;
    const int r = o & 63;
    return (at(w - q) << r) | (r ? at(w - q - 1) >> (64 - r) : 0);
  }
  const int64_t q = (-o) >> 6;
  const int r = (-o) & 63;
  return (at(w + q) >> r) | (r ? at(w + q + 1) << (64 - r) : 0);
}

// Set bits of W words: the POPCNT instruction where the CPU has it (the library's x86-64 baseline
// lacks it, and __builtin_popcountll there is a call into libgcc's table code per word).
__attribute__((target("popcnt"))) int64_t popcount_hw(const uint64_t* x, int64_t W) {
  int64_t c = 0;
  for (int64_t w = 0; w < W; ++w) c += __builtin_popcountll(x[w]);
  return c;
}
int64_t popcount_sw(const uint64_t* x, int64_t W) {
  int64_t c = 0;
  for (int64_t w = 0; w < W; ++w) c += __builtin_popcountll(x[w]);
  return c;
}
const bool kHavePopcnt = __builtin_cpu_supports("popcnt");
int64_t popcount(const uint64_t* x, int64_t W) { return kHavePopcnt ? popcount_hw(x, W) : popcount_sw(x, W); }

// Per-thread scratch (the pool's threads persist).
struct ThreadScratch {
  std::vector<uint64_t> m, c;               // an owner's scan: above a mean; the candidates
  std::vector<const std::byte*> rows;       // their K rows
  std::vector<float> qa, score, agg, tmp, lse;  // active queries [na][d], scores [na][nc], ranking
  std::vector<uint32_t> keys;               // kth_largest's scratch
  std::vector<int32_t> pos, above, ties;    // a set's chosen keys' positions in rest; the choice's parts
  std::vector<float> row;
};
thread_local ThreadScratch tls;

double log_sum_exp(const double* s, size_t n) {
  double m = kNegInf;
  for (size_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  if (m == kNegInf) return kNegInf;
  double z = 0;
  for (size_t i = 0; i < n; ++i) z += std::exp(s[i] - m);
  return m + std::log(z);
}


std::vector<int> parse_offsets(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ';')) {
    if (item.empty()) continue;
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (*end || v < -64 || v > 64)
      invalid("method_params: lfps offsets: expected integers in [-64, 64] separated by ';', got '" + s + "'");
    if (std::find(out.begin(), out.end(), int(v)) == out.end()) out.push_back(int(v));
  }
  if (std::find(out.begin(), out.end(), 0) == out.end()) out.push_back(0);  // o = 0 always kept
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tables

void Table::pop_to(size_t m) {
  while (x.size() > m) {
    const double v = x.back();
    x.pop_back();
    const double v2 = v * v;
    s[0] -= v;
    s[1] -= v2;
    s[2] -= v2 * v;
    s[3] -= v2 * v2;
  }
  if (x.empty()) s[0] = s[1] = s[2] = s[3] = 0;
}

void Table::add_change(double* s, double a, double b) {
  const double a2 = a * a, b2 = b * b;
  s[0] += b - a;
  s[1] += b2 - a2;
  s[2] += b2 * b - a2 * a;
  s[3] += b2 * b2 - a2 * a2;
}

void Table::set(size_t i, float v) {
  add_change(s, x[i], v);
  x[i] = v;
}

void Table::recompute() {
  double a[4] = {0, 0, 0, 0};
  for (float f : x) {
    const double v = f, v2 = v * v;
    a[0] += v;
    a[1] += v2;
    a[2] += v2 * v;
    a[3] += v2 * v2;
  }
  std::copy(a, a + 4, s);
}

// ---------------------------------------------------------------------------------------------
// Construction

Params parse_params(const ParamSet& ps) {
  Params p;
  p.gamma = ps.get_float("gamma");
  p.alpha = ps.get_float("alpha");
  p.alpha_scale = ps.get_float("alpha_scale");
  p.theta = ps.get_float("theta");
  p.bypass = ps.get_bool("bypass");
  p.sinks = ps.get_int("sinks");
  p.last_q = ps.get_int("last_q");
  p.init_decayed = ps.get_string("init_weights") == "decayed";
  p.init_mass = ps.get_float("init_mass");
  p.local_est = ps.get_int("local_est");
  p.combine_sum = ps.get_string("combine") == "sum";
  p.offsets = parse_offsets(ps.get_string("offsets"));
  p.local_window = ps.get_int("local_window");
  p.min_keys = ps.get_int("min_keys");
  p.per_kv_head = ps.get_string("gqa") == "per_kv_head";
  p.update_priors = ps.get_bool("update_priors");
  p.diagnostics = ps.get_bool("diagnostics");
  p.empty_fallback = ps.get_bool("empty_fallback");
  p.kv_cap = ps.get_string("kv_budget") == "cap";
  p.fill_recent = ps.get_string("fill") == "recent";
  p.widen = ps.get_string("widen") == "recent";
  return p;
}

Lfps::Lfps(const MethodContext& ctx, const Params& p) : ctx_(ctx), p_(p) {
  if (!(p_.gamma > 0.0 && p_.gamma < 1.0)) invalid("method_params: lfps gamma: expected a number in (0, 1), got " + std::to_string(p_.gamma));
  if (std::isnan(p_.alpha) || p_.alpha == std::numeric_limits<double>::infinity())
    invalid("method_params: lfps alpha: expected a finite number or -inf (every entry a candidate)");
  if (!(p_.alpha_scale >= 0.0) || std::isinf(p_.alpha_scale))
    invalid("method_params: lfps alpha_scale: expected a finite number >= 0, got " + std::to_string(p_.alpha_scale));
  if (!(p_.theta >= 0.0 && p_.theta <= 1.0)) invalid("method_params: lfps theta: expected a number in [0, 1], got " + std::to_string(p_.theta));
  if (p_.sinks < 0 || p_.sinks > 4096) invalid("method_params: lfps sinks: expected 0..4096, got " + std::to_string(p_.sinks));
  if (p_.last_q < 1 || p_.last_q > 4096) invalid("method_params: lfps last_q: expected 1..4096, got " + std::to_string(p_.last_q));
  if (!(p_.init_mass >= 0.0) || std::isinf(p_.init_mass))
    invalid("method_params: lfps init_mass: expected 0 (= 0.5 / (1 - gamma)) or a positive number");
  if (p_.local_est < 0 || p_.local_est > 4096) invalid("method_params: lfps local_est: expected 0..4096, got " + std::to_string(p_.local_est));
  if (p_.local_window < 0) invalid("method_params: lfps local_window: expected >= 0, got " + std::to_string(p_.local_window));
  if (p_.min_keys < 0) invalid("method_params: lfps min_keys: expected >= 0, got " + std::to_string(p_.min_keys));
  owners_ = int(p_.per_kv_head ? ctx_.shape.num_kv_heads : ctx_.shape.num_q_heads);
  layers_.resize(ctx_.shape.num_layers);
  for (auto& L : layers_) {
    L.bypass.assign(ctx_.shape.num_q_heads, 0);
    L.bypass_lse.assign(ctx_.shape.num_q_heads, 0.f);
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill and index

void Lfps::on_prefill(uint32_t layer, const float* q, int64_t n, const KVLayer& kv) {
  Layer& L = layers_[layer];
  if (L.built) {  // tables loaded without KV: the prompt comes again and the tables cover it
    if (kv.size() >= L.tokens) L.awaiting_kv = false;
    return;
  }
  // Keep the last T prompt query rows (the prompt may arrive in chunks).
  const size_t row = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
  const int64_t first = kv.size() - n;
  int64_t rows = int64_t(L.tail.size() / row);
  if (rows > 0 && L.tail_first + rows != first) {  // not contiguous (a failed chunk): restart
    L.tail.clear();
    rows = 0;
  }
  if (rows == 0) L.tail_first = first;
  L.tail.insert(L.tail.end(), q, q + size_t(n) * row);
  rows += n;
  if (rows > p_.last_q) {
    const int64_t drop = rows - p_.last_q;
    L.tail.erase(L.tail.begin(), L.tail.begin() + ptrdiff_t(size_t(drop) * row));
    L.tail_first += drop;
  }
}

void Lfps::add_priors(Layer& L, const KVLayer& kv, int64_t from, int64_t to) {
  const int d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
  std::vector<float> buf(size_t(d) * 2);
  for (int64_t j = std::max(from, p_.sinks); j < to; ++j)
    for (int h = 0; h < hkv; ++h) {
      convert_to_f32(kv.k_row(h, j), kv.dtype(), buf.data(), size_t(d));
      convert_to_f32(kv.v_row(h, j), kv.dtype(), buf.data() + d, size_t(d));
      for (int i = 0; i < d; ++i) {
        L.ksum[size_t(h) * d + i] += buf[size_t(i)];
        L.vsum[size_t(h) * d + i] += buf[size_t(d + i)];
      }
    }
  L.prior_count += std::max<int64_t>(0, to - std::max(from, p_.sinks));
}

void Lfps::build_index(uint32_t layer, const KVLayer& kv) {
  Layer& L = layers_[layer];
  const int64_t N = kv.size(), ns = p_.sinks, m = std::max<int64_t>(0, N - ns);
  const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
  const int hq = int(ctx_.shape.num_q_heads);
  const double scale = ctx_.shape.softmax_scale;
  L.tokens = N;
  L.heads.assign(size_t(owners_), Head{});
  for (auto& H : L.heads)
    for (auto& t : H.t) t.x.assign(size_t(m), 0.f);
  L.ksum.assign(size_t(hkv) * d, 0.0);
  L.vsum.assign(size_t(hkv) * d, 0.0);
  L.prior_count = 0;
  add_priors(L, kv, ns, N);
  L.rho.assign(size_t(hq), 0.0);
  L.undo_tokens = -1;

  const size_t qrow = size_t(hq) * d;
  const int64_t R = int64_t(L.tail.size() / qrow);
  // Only rows that see at least one key of O, and that lie in the prompt.
  if (R > 0 && m > 0 && L.tail_first + R == N) {
    // Weights of the rows: gamma^tau (tau = steps before the last prompt token) or 1; lambda makes
    // each table's sum the steady-state mass of update (10).
    std::vector<double> w(size_t(R), 0.0);
    double wsum = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t pos = L.tail_first + r;
      if (pos < ns) continue;
      w[size_t(r)] = p_.init_decayed ? std::pow(p_.gamma, double(N - 1 - pos)) : 1.0;
      wsum += w[size_t(r)];
    }
    const double target = p_.init_mass > 0 ? p_.init_mass : 0.5 / (1.0 - p_.gamma);
    if (wsum > 0)
      for (auto& x : w) x *= target / wsum;

    const auto gemm = cpu::GemmProvider(ctx_.gemm);
    constexpr int64_t kChunk = 2048;
    const int64_t chunks = (N + kChunk - 1) / kChunk;
    const int64_t M = int64_t(G) * R;  // rows of the group: g * R + r
    std::vector<float> qg(size_t(M) * d), scores(size_t(M) * N);
    std::vector<double> vacc(size_t(G) * m), sacc(size_t(G) * m);
    for (int h = 0; h < hkv; ++h) {
      for (int g = 0; g < G; ++g)
        for (int64_t r = 0; r < R; ++r)
          std::memcpy(qg.data() + (size_t(g) * R + r) * d, L.tail.data() + size_t(r) * qrow + size_t(h * G + g) * d,
                      size_t(d) * sizeof(float));
      // Raw dots of the group's last T queries with every key, a chunk of keys per task.
      ctx_.pool->parallel_for(chunks, [&](int64_t c) {
        const int64_t b = c * kChunk, e = std::min(N, b + kChunk);
        std::vector<float> kb(size_t(e - b) * d);
        for (int64_t j = b; j < e; ++j) convert_to_f32(kv.k_row(h, j), kv.dtype(), kb.data() + size_t(j - b) * d, size_t(d));
        cpu::sgemm(gemm, false, true, M, e - b, d, 1.0f, qg.data(), d, kb.data(), d, 0.0f, scores.data() + b, N);
      });
      std::fill(vacc.begin(), vacc.end(), 0.0);
      std::fill(sacc.begin(), sacc.end(), 0.0);
      ctx_.pool->parallel_for(G, [&](int64_t g) {
        double* va = vacc.data() + size_t(g) * m;
        double* sa = sacc.data() + size_t(g) * m;
        std::vector<double> e(static_cast<size_t>(N));
        for (int64_t r = 0; r < R; ++r) {
          const int64_t pos = L.tail_first + r;
          if (pos < ns || w[size_t(r)] == 0.0) continue;
          const float* s = scores.data() + (size_t(g) * R + r) * N;
          // A_hat: the causal row (keys <= pos) renormalised over O (sinks excluded, §4.2 footnote).
          double mx = kNegInf;
          for (int64_t j = ns; j <= pos; ++j) mx = std::max(mx, double(s[j]) * scale);
          double z = 0;
          for (int64_t j = ns; j <= pos; ++j) z += (e[size_t(j)] = std::exp(double(s[j]) * scale - mx));
          const double f = w[size_t(r)] / z;
          for (int64_t j = ns; j <= pos; ++j) {
            const double a = e[size_t(j)] * f;
            va[j - ns] += a;
            sa[pos - j] += a;
          }
        }
        // rho (§4.2 priors [reconstructed from the paper's prose]): variance over O of the last prompt query's raw dots, over |q_p|^2.
        const int64_t rl = R - 1;
        const float* qp = qg.data() + (size_t(g) * R + rl) * d;
        double qn = 0;
        for (int i = 0; i < d; ++i) qn += double(qp[i]) * qp[i];
        const float* s = scores.data() + (size_t(g) * R + rl) * N;
        double mu = 0, m2 = 0;
        for (int64_t j = ns; j < N; ++j) mu += s[j];
        mu /= double(m);
        for (int64_t j = ns; j < N; ++j) m2 += (s[j] - mu) * (s[j] - mu);
        L.rho[size_t(h * G + g)] = qn > 0 ? m2 / double(m) / qn : 0.0;
      });
      for (int g = 0; g < G; ++g) {
        Head& H = L.heads[size_t(p_.per_kv_head ? h : h * G + g)];
        for (int64_t i = 0; i < m; ++i) {
          H.t[0].x[size_t(i)] += float(vacc[size_t(g) * m + i]);
          H.t[1].x[size_t(i)] += float(sacc[size_t(g) * m + i]);
        }
      }
    }
  }
  for (auto& H : L.heads)
    for (auto& t : H.t) t.recompute();
  L.tail.clear();
  L.tail.shrink_to_fit();
  L.built = true;
  L.awaiting_kv = false;
}

void Lfps::add_zero_entries(Layer& L, int64_t n_new) {
  for (int64_t i = 0; i < n_new; ++i) {
    if (L.tokens + 1 > p_.sinks)
      for (auto& H : L.heads)
        for (auto& t : H.t) t.push_zero();
    ++L.tokens;
  }
}

void Lfps::on_append(uint32_t layer, const float*, int64_t n, const KVLayer& kv, bool) {
  Layer& L = layers_[layer];
  check_built(layer, "lfps: append");
  // A new step: the previous step's writes are final.
  for (auto& H : L.heads) {
    H.undo.clear();
    H.undo_rescaled = false;
    H.undo_x[0].clear();
    H.undo_x[1].clear();
  }
  L.undo_tokens = -1;
  const int64_t from = L.tokens;
  add_zero_entries(L, n);  // new keys enter with V = 0; slash offsets need no shift (eq. 10)
  if (p_.update_priors) {
    const std::vector<double> k0 = L.ksum, v0 = L.vsum;
    const int64_t c0 = L.prior_count;
    add_priors(L, kv, from, L.tokens);
    L.prior_dk.resize(k0.size());
    L.prior_dv.resize(v0.size());
    for (size_t i = 0; i < k0.size(); ++i) {
      L.prior_dk[i] = L.ksum[i] - k0[i];
      L.prior_dv[i] = L.vsum[i] - v0[i];
    }
    L.prior_dn = L.prior_count - c0;
    L.prior_from = from;
  }
}

void Lfps::check_built(uint32_t layer, const char* fn) const {
  if (!layers_[layer].built)
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": lfps layer " + std::to_string(layer) + " has no tables (build the index first)");
}

void Lfps::apply_undo(Layer& L) {
  for (auto& H : L.heads) {
    if (H.undo_rescaled) {
      for (int w = 0; w < 2; ++w) {
        H.t[w].x = H.undo_x[w];
        H.t[w].recompute();
      }
    } else {
      for (auto it = H.undo.rbegin(); it != H.undo.rend(); ++it) H.t[it->which].set(size_t(it->idx), it->old);
    }
    H.g = H.undo_g;
    H.undo.clear();
    H.undo_rescaled = false;
    H.last_upd.clear();
  }
}

void Lfps::truncate(uint32_t layer, int64_t n) {
  Layer& L = layers_[layer];
  if (!L.built) {  // a failed prompt chunk: forget its query rows
    const size_t row = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
    const int64_t rows = int64_t(L.tail.size() / row);
    const int64_t keep = std::clamp<int64_t>(n - L.tail_first, 0, rows);
    L.tail.resize(size_t(keep) * row);
    return;
  }
  if (L.awaiting_kv) return;  // re-prefill after a tables-only load: the tables stay
  if (n >= L.tokens) return;
  if (L.undo_tokens == L.tokens && n == L.tokens - 1) apply_undo(L);  // a failed decode step
  L.undo_tokens = -1;
  const size_t m = size_t(std::max<int64_t>(0, n - p_.sinks));
  for (auto& H : L.heads)
    for (auto& t : H.t) t.pop_to(m);
  if (p_.update_priors && L.prior_from >= 0 && n <= L.prior_from) {  // the last append's keys go
    for (size_t i = 0; i < L.ksum.size(); ++i) {
      L.ksum[i] -= L.prior_dk[i];
      L.vsum[i] -= L.prior_dv[i];
    }
    L.prior_count -= L.prior_dn;
  }
  L.prior_from = -1;
  L.tokens = n;
}

// ---------------------------------------------------------------------------------------------
// Thresholds

TableStats Lfps::stats_of(const Table& t, double g) const {
  TableStats s;
  s.count = int64_t(t.x.size());
  if (s.count == 0) return s;
  const double c = double(s.count);
  const double e1 = t.s[0] / c, e2 = t.s[1] / c, e3 = t.s[2] / c, e4 = t.s[3] / c;
  const double m2 = e2 - e1 * e1;
  const double m4 = e4 - 4 * e1 * e3 + 6 * e1 * e1 * e2 - 3 * e1 * e1 * e1 * e1;
  s.mean = g * e1;
  if (m2 > 1e-12 * std::max(e2, 1e-300) && m4 > 0) {
    s.stddev = g * std::sqrt(m2);
    s.kurtosis = m4 / (m2 * m2);
  }
  s.tau = threshold_from(s);
  return s;
}

double Lfps::threshold_from(const TableStats& s) const {
  if (p_.alpha == kNegInf) return kNegInf;
  if (s.stddev <= 0 || s.kurtosis <= 0) return s.mean;  // a flat table: its mean
  // eq. (8) [reconstructed from the paper's prose]: tau = mu + alpha sigma (3 / kappa); higher kurtosis -> lower tau, more candidates.
  return s.mean + p_.alpha * p_.alpha_scale * s.stddev * (3.0 / s.kurtosis);
}

TableStats Lfps::brute_stats(const std::vector<double>& v) const {
  TableStats s;
  s.count = int64_t(v.size());
  if (v.empty()) return s;
  double mu = 0;
  for (double x : v) mu += x;
  mu /= double(v.size());
  double m2 = 0, m4 = 0;
  for (double x : v) {
    const double dd = (x - mu) * (x - mu);
    m2 += dd;
    m4 += dd * dd;
  }
  m2 /= double(v.size());
  m4 /= double(v.size());
  s.mean = mu;
  if (m2 > 0) {
    s.stddev = std::sqrt(m2);
    s.kurtosis = m4 / (m2 * m2);
  }
  s.tau = threshold_from(s);
  return s;
}

TableStats Lfps::table_stats(uint32_t layer, int owner, int which) const {
  const Head& H = layers_[layer].heads[size_t(owner)];
  return stats_of(H.t[which], H.g);
}

std::vector<double> Lfps::table(uint32_t layer, int owner, int which) const {
  const Head& H = layers_[layer].heads[size_t(owner)];
  std::vector<double> out(H.t[which].x.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = H.g * double(H.t[which].x[i]);
  return out;
}

std::vector<double> Lfps::mean_key(uint32_t layer, int h) const {
  const Layer& L = layers_[layer];
  const int d = int(ctx_.shape.head_dim);
  std::vector<double> out(size_t(d), 0.0);
  if (L.prior_count > 0)
    for (int i = 0; i < d; ++i) out[size_t(i)] = L.ksum[size_t(h) * d + i] / double(L.prior_count);
  return out;
}
std::vector<double> Lfps::mean_value(uint32_t layer, int h) const {
  const Layer& L = layers_[layer];
  const int d = int(ctx_.shape.head_dim);
  std::vector<double> out(size_t(d), 0.0);
  if (L.prior_count > 0)
    for (int i = 0; i < d; ++i) out[size_t(i)] = L.vsum[size_t(h) * d + i] / double(L.prior_count);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decode

void Lfps::select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) {
  check_built(layer, "lfps: select");
  Layer& L = layers_[layer];
  const int64_t n = kv.size();
  if (L.tokens != n)
    fail(KVS_STATUS_INTERNAL, "lfps: layer " + std::to_string(layer) + " tables cover " + std::to_string(L.tokens) +
                                  " tokens, the KV store holds " + std::to_string(n));
  const int hq = int(ctx_.shape.num_q_heads);
  out.kind = Selection::Kind::PerQueryHead;
  out.lists.assign(size_t(hq), {});
  std::fill(L.bypass.begin(), L.bypass.end(), 0);
  const int64_t k_total = total_keys(n);
  const int64_t ns = static_keys(layer, n).sinks;
  if (n <= p_.sinks) {  // nothing offloaded yet: the sinks are the whole context
    for (auto& l : out.lists)
      for (int64_t j = 0; j < ns; ++j) l.push_back(int32_t(j));
    return;
  }
  const int64_t k_top = std::max<int64_t>(0, k_total - ns);
  // Forced recent keys (an option not in the paper): attended whatever their score.
  const int64_t lw = std::min(p_.local_window, std::min(n - p_.sinks, k_top));
  L.undo_tokens = n;  // set first: a throw half-way still rolls back the owners already updated
  // Five rounds on the pool, so that every thread works whatever the number of heads:
  //  1. per owner: the bypass test and the candidate scan (steps B, A);
  //  2. per set of keys (a KV head's under kv_budget=cap with query-head tables, else an owner's):
  //     the owners' union of candidates, completed with recent keys;
  //  3. per chunk of kScoreChunk keys of a set: the exact scores of the active heads (step C) and
  //     each head's softmax statistics over the chunk;
  //  4. per set: the best k_top by the heads' summed softmax;
  //  5. per owner: the lists of its heads and its table updates (step D).
  ctx_.pool->parallel_for(owners_, [&](int64_t u) { prepare_owner(layer, int(u), q, kv, ns, out); });
  const int G = ctx_.shape.group();
  const bool group = p_.kv_cap && !p_.per_kv_head && G > 1;
  std::vector<KeySet>& sets = sets_.v;
  sets.resize(size_t(group ? int64_t(ctx_.shape.num_kv_heads) : owners_));
  for (size_t i = 0; i < sets.size(); ++i) {
    KeySet& S = sets[i];
    S.owners.clear();
    if (group) {
      S.h = int(i);
      for (int g = 0; g < G; ++g) S.owners.push_back(int(i) * G + g);
    } else {
      S.h = p_.per_kv_head ? int(i) : int(i) / G;
      S.owners.push_back(int(i));
    }
  }
  ctx_.pool->parallel_for(int64_t(sets.size()), [&](int64_t i) { plan_set(L, sets[size_t(i)], n, lw, k_top - lw); });
  int64_t tasks = 0;
  for (KeySet& S : sets) {
    S.first_task = tasks;
    tasks += S.chunks;
  }
  ctx_.pool->parallel_for(tasks, [&](int64_t task) {
    const auto it = std::upper_bound(sets.begin(), sets.end(), task,
                                     [](int64_t t, const KeySet& S) { return t < S.first_task; }) - 1;
    score_chunk(q, kv, *it, task - it->first_task);
  });
  ctx_.pool->parallel_for(int64_t(sets.size()), [&](int64_t i) { choose_keys(q, kv, sets[size_t(i)], k_top - lw, lw); });
  // 5. per owner: its heads' lists and its table updates (step D) from its heads' scores of the set.
  ctx_.pool->parallel_for(owners_, [&](int64_t u) {
    const KeySet& S = sets[size_t(group ? u / G : u)];
    size_t a = 0;  // the owner's first active head among the set's
    for (int o : S.owners) {
      if (o == int(u)) break;
      a += L.heads[size_t(o)].active.v.size();
    }
    const std::vector<int>& act = L.heads[size_t(u)].active.v;
    if (act.empty()) return;
    std::vector<int> own;
    const int h0 = p_.per_kv_head ? int(u) * G : int(u);
    for (int g : act) own.push_back(h0 + g);
    finish_owner(layer, int(u), q, kv, own, S.sel, S.ssel.data() + a * S.sel.size(), S.sel.size(), ns, out);
  });
  for (int h = 0; h < hq; ++h) L.bypass_heads += L.bypass[size_t(h)];
  L.head_steps += hq;
}

std::vector<int32_t> Lfps::last_candidates(uint32_t layer, int owner) const {
  const auto& bits = layers_[layer].heads[size_t(owner)].cand.v;
  std::vector<int32_t> out;
  for (size_t w = 0; w < bits.size(); ++w)
    for (uint64_t x = bits[w]; x; x &= x - 1) out.push_back(int32_t(w * 64 + size_t(__builtin_ctzll(x))));
  return out;
}

// Steps B and A of one owner: the bypass decision of the query heads it serves (bypassed heads get
// their sink lists here) and, for the active ones, the candidates of eqs. (7)-(9) as a bitmask over
// the tokens (H.cand). Returns false when every head served is bypassed.
bool Lfps::prepare_owner(uint32_t layer, int u, const float* q, const KVLayer& kv, int64_t ns_sel, Selection& out) {
  Layer& L = layers_[layer];
  Head& H = L.heads[size_t(u)];
  const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
  const int h = p_.per_kv_head ? u : u / G;                 // KV head
  const int h0 = p_.per_kv_head ? u * G : u, nh = p_.per_kv_head ? G : 1;  // query heads served
  const int64_t n = kv.size(), ns = p_.sinks, m = n - ns;
  const float scale = ctx_.shape.softmax_scale;
  ThreadScratch& sc = tls;
  sc.row.resize(size_t(d));
  H.last_upd.clear();
  H.undo.clear();
  H.undo_rescaled = false;
  H.undo_g = H.g;
  std::vector<int>& active = H.active.v;
  active.clear();
  H.cand.v.clear();

  auto key = [&](int64_t j) -> const float* {
    convert_to_f32(kv.k_row(h, j), kv.dtype(), sc.row.data(), size_t(d));
    return sc.row.data();
  };

  // ---- Step B: head sparsity (eqs. 5-6, App. B.1 [reconstructed from the paper's prose]) and the sink-value bypass.
  const std::vector<double> kbar = mean_key(layer, h);
  const int64_t wl = std::min(p_.local_est, m);
  std::vector<double> sink_all(size_t(ns) * nh), loc_all(size_t(wl) * nh);
  for (int64_t j = 0; j < ns; ++j) {
    const float* k = key(j);
    for (int g = 0; g < nh; ++g) sink_all[size_t(g) * ns + j] = double(scale) * dot(q + size_t(h0 + g) * d, k, d);
  }
  for (int64_t i = 0; i < wl; ++i) {
    const float* k = key(n - wl + i);
    for (int g = 0; g < nh; ++g) loc_all[size_t(g) * wl + i] = double(scale) * dot(q + size_t(h0 + g) * d, k, d);
  }
  for (int g = 0; g < nh; ++g) {
    const int qh = h0 + g;
    const float* qq = q + size_t(qh) * d;
    double qk = 0, qn = 0;
    for (int i = 0; i < d; ++i) {
      qk += double(qq[i]) * kbar[size_t(i)];
      qn += double(qq[i]) * qq[i];
    }
    const double mu = qk * scale, var = L.rho[size_t(qh)] * qn * double(scale) * scale;
    const double log_glob = std::log(double(m)) + mu + 0.5 * var;
    const double log_sink = log_sum_exp(sink_all.data() + size_t(g) * ns, size_t(ns));
    const double log_loc = log_sum_exp(loc_all.data() + size_t(g) * wl, size_t(wl));
    double log_other;
    if (p_.combine_sum) {
      const double a[2] = {log_glob, log_loc};
      log_other = log_sum_exp(a, 2);
    } else {
      log_other = std::max(log_glob, log_loc);
    }
    // r = A_sink / (A_sink + A_other) = 1 / (1 + exp(log_other - log_sink))
    const double r = log_sink == kNegInf ? 0.0 : 1.0 / (1.0 + std::exp(log_other - log_sink));
    if (p_.bypass && r > p_.theta) {
      L.bypass[size_t(qh)] = 1;
      L.bypass_lse[size_t(qh)] = float(log_glob);
      auto& l = out.lists[size_t(qh)];
      for (int64_t j = 0; j < ns_sel; ++j) l.push_back(int32_t(j));
    } else {
      active.push_back(g);
    }
  }
  if (active.empty()) return false;  // every head served is bypassed: no candidates, no update

  // ---- Step A: candidates (eqs. 7-9), as bitmasks over the tokens. C0 (eq. 7): above either
  // threshold; M: above either mean; C = C0 u (C0 expanded by the offsets, eq. 9) n M.
  const TableStats st_v = stats_of(H.t[0], H.g), st_s = stats_of(H.t[1], H.g);
  auto stored = [&](double v) { return v == kNegInf ? -std::numeric_limits<float>::infinity() : float(v / H.g); };
  const int64_t W = (n + 63) / 64;
  std::vector<uint64_t>& c0 = H.cand.v;
  c0.assign(size_t(W) + 1, 0);
  sc.m.assign(size_t(W) + 1, 0);
  scan_tables(H.t[0].x.data(), H.t[1].x.data(), ns, n, stored(st_v.tau), stored(st_v.mean), stored(st_s.tau),
              stored(st_s.mean), c0.data(), sc.m.data());
  const uint64_t* M = sc.m.data();
  if (popcount(c0.data(), W) == 0 && p_.empty_fallback) {
    // No entry above either threshold: the thresholds are scale-free and the tables would only decay,
    // so the head would never select again. Fall back to the means (alpha = 0) for this step.
    std::copy(M, M + W, c0.begin());
    ++H.fallback_n;
  }
  std::vector<uint64_t>& c = sc.c;
  c.assign(size_t(W) + 1, 0);
  int offs[8], no = 0;  // the nonzero offsets; all within a word's reach (the defaults): neighbours only
  bool near = p_.offsets.size() <= 8;
  for (int o : p_.offsets) {
    if (o == 0 || !near) continue;
    offs[no++] = o;
    near &= o > -64 && o < 64;
  }
  if (near) {
    const uint64_t* x = c0.data();
    uint64_t prev = 0, cur = W > 0 ? x[0] : 0;
    for (int64_t w = 0; w < W; ++w) {
      const uint64_t next = w + 1 < W ? x[w + 1] : 0;
      uint64_t e = 0;
      for (int k = 0; k < no; ++k) {
        const int o = offs[k];
        e |= o > 0 ? (cur << o) | (prev >> (64 - o)) : (cur >> -o) | (next << (64 + o));
      }
      c[size_t(w)] = cur | (e & M[w]);
      prev = cur;
      cur = next;
    }
  } else {
    for (int64_t w = 0; w < W; ++w) {
      uint64_t e = 0;
      for (int o : p_.offsets)
        if (o != 0) e |= shifted_word(c0.data(), W, w, o);
      c[size_t(w)] = c0[size_t(w)] | (e & M[w]);
    }
  }
  const int64_t count = popcount(c.data(), W);
  H.cand.v.swap(c);  // the buffers circulate between the owners and the threads
  H.cand_frac_sum += double(count) / double(m);
  ++H.cand_n;
  return true;
}
// Round 2 for one set of keys: its active query heads, and the keys step C ranks: the owners' union
// of candidates below the forced window [n - lw, n), ascending, completed with recent keys:
// fill=recent completes fewer than `want` with the most recent keys of O not among them;
// widen=recent (with kv_budget=cap) adds the `want` most recent keys of O below n - lw whatever
// their number (a query the tables do not predict then gets streaming's recent keys from the exact
// top-k of step C).
void Lfps::plan_set(const Layer& L, KeySet& S, int64_t n, int64_t lw, int64_t want) const {
  const int G = ctx_.shape.group();
  S.qheads.clear();
  S.rest.clear();
  S.chunks = 0;
  for (int u : S.owners) {
    const int h0 = p_.per_kv_head ? u * G : u;
    for (int g : L.heads[size_t(u)].active.v) S.qheads.push_back(h0 + g);
  }
  if (S.qheads.empty()) return;  // every head served is bypassed
  const int64_t W = (n + 63) / 64, ns = p_.sinks, hi = n - lw;  // keys in [ns, hi)
  std::vector<uint64_t>& u = tls.c;
  u.assign(size_t(W), 0);
  for (int o : S.owners) {
    const auto& c = L.heads[size_t(o)].cand.v;
    if (c.empty()) continue;  // every head of the owner bypassed
    for (int64_t w = 0; w < W; ++w) u[size_t(w)] |= c[size_t(w)];
  }
  if (hi < n) {  // clear the forced window's bits
    u[size_t(hi >> 6)] &= (uint64_t(1) << (hi & 63)) - 1;
    for (int64_t w = (hi >> 6) + 1; w < W; ++w) u[size_t(w)] = 0;
  }
  auto set_bit = [&](int64_t j) { u[size_t(j >> 6)] |= uint64_t(1) << (j & 63); };
  if (p_.fill_recent && want > 0) {
    if (p_.widen && p_.kv_cap) {
      for (int64_t j = std::max(ns, hi - want); j < hi; ++j) set_bit(j);
    } else {
      int64_t have = popcount(u.data(), W);
      for (int64_t j = hi - 1; j >= ns && have < want; --j)
        if (!(u[size_t(j >> 6)] >> (j & 63) & 1)) {
          set_bit(j);
          ++have;
        }
    }
  }
  for (int64_t w = 0; w < W; ++w)
    for (uint64_t x = u[size_t(w)]; x; x &= x - 1) S.rest.push_back(int32_t(w * 64 + __builtin_ctzll(x)));
  const size_t na = S.qheads.size(), nc = S.rest.size();
  S.chunks = (int64_t(nc) + kScoreChunk - 1) / kScoreChunk;
  S.score.resize(na * nc);
  S.w.resize(na > 1 ? na * nc : 0);
  S.cmax.resize(size_t(S.chunks) * na);
  S.csum.resize(size_t(S.chunks) * na);
}

// The queries of the query heads qheads, contiguous ([qheads][d]).
void Lfps::gather_queries(const float* q, const std::vector<int>& qheads, std::vector<float>& qa) const {
  const int d = int(ctx_.shape.head_dim);
  qa.resize(qheads.size() * size_t(d));
  for (size_t a = 0; a < qheads.size(); ++a) std::copy_n(q + size_t(qheads[a]) * d, d, qa.data() + a * size_t(d));
}

// Round 3, step C for chunk c of a set's keys: the exact scores of its active heads (the CPU
// backend's gathered kernel, every head at once) and, with several heads, each head's maximum over
// the chunk, exp(score - maximum) and their sum (the summed softmax's parts).
void Lfps::score_chunk(const float* q, const KVLayer& kv, KeySet& S, int64_t c) const {
  ThreadScratch& sc = tls;
  const int d = int(ctx_.shape.head_dim);
  const int na = int(S.qheads.size());
  const int64_t nc = int64_t(S.rest.size()), b = c * kScoreChunk, e = std::min(nc, b + kScoreChunk), len = e - b;
  gather_queries(q, S.qheads, sc.qa);
  sc.rows.resize(size_t(len));
  for (int64_t i = 0; i < len; ++i) sc.rows[size_t(i)] = kv.k_row(S.h, S.rest[size_t(b + i)]);
  sc.score.resize(size_t(na) * size_t(len));
  cpu::score_rows(kv.dtype(), d, na, sc.qa.data(), ctx_.shape.softmax_scale, sc.rows.data(), len, sc.score.data());
  for (int a = 0; a < na; ++a) {
    const float* s = sc.score.data() + size_t(a) * len;
    std::copy_n(s, len, S.score.data() + size_t(a) * nc + b);
    if (na == 1) continue;
    float* w = S.w.data() + size_t(a) * nc + b;
    std::copy_n(s, len, w);
    const float mx = cpu::max_of(w, len);
    S.cmax[size_t(c) * na + a] = mx;
    S.csum[size_t(c) * na + a] = cpu::exp_shift(w, len, mx);
  }
}

// Round 4 for one set: the `want` best of its keys (by the score, or by the active heads' summed
// softmax; ties to the older key), then the forced recent keys [n - lw, n), with every active
// head's scores of them (S.sel, S.ssel).
void Lfps::choose_keys(const float* q, const KVLayer& kv, KeySet& S, int64_t want, int64_t lw) const {
  S.sel.clear();
  S.ssel.clear();
  if (S.qheads.empty()) return;
  ThreadScratch& sc = tls;
  const int d = int(ctx_.shape.head_dim);
  const int64_t n = kv.size();
  const int na = int(S.qheads.size());
  const int64_t nc = int64_t(S.rest.size());
  const float* rank_by = S.score.data();
  if (na > 1 && nc > 0) {
    // summed softmax: sum over heads a of w[a][i] * exp(cmax[chunk][a] - M_a) / Z_a
    sc.agg.assign(size_t(nc), 0.f);
    for (int a = 0; a < na; ++a) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < S.chunks; ++c) M = std::max(M, S.cmax[size_t(c) * na + a]);
      double Z = 0;
      for (int64_t c = 0; c < S.chunks; ++c)
        Z += S.csum[size_t(c) * na + a] * std::exp(double(S.cmax[size_t(c) * na + a]) - M);
      for (int64_t c = 0; c < S.chunks; ++c) {
        const float f = float(std::exp(double(S.cmax[size_t(c) * na + a]) - M) / Z);
        const int64_t b = c * kScoreChunk, e = std::min(nc, b + kScoreChunk);
        const float* w = S.w.data() + size_t(a) * nc;
        for (int64_t i = b; i < e; ++i) sc.agg[size_t(i)] += w[i] * f;
      }
    }
    rank_by = sc.agg.data();
  }
  // The `take` best: every entry above the take-th largest, then its ties in ascending key order.
  const int64_t take = std::clamp<int64_t>(want, 0, nc);
  const size_t ks = size_t(take + lw);
  std::vector<int32_t>& pos = sc.pos;
  pos.clear();
  if (take == nc) {
    for (int64_t c = 0; c < nc; ++c) pos.push_back(int32_t(c));
  } else if (take > 0) {
    const uint32_t kth = cpu::float_key(cpu::kth_largest(rank_by, nc, take, sc.keys));
    // One branchless pass: the entries above the k-th value, and those equal to it; then the
    // first (take - above) of the ties merged in.
    sc.above.resize(size_t(nc));
    sc.ties.resize(size_t(nc));
    int64_t n_above = 0, nt = 0;
    for (int64_t c = 0; c < nc; ++c) {
      const uint32_t k = cpu::float_key(rank_by[c]);
      sc.above[size_t(n_above)] = int32_t(c);
      n_above += k > kth;
      sc.ties[size_t(nt)] = int32_t(c);
      nt += k == kth;
    }
    pos.resize(size_t(take));
    std::merge(sc.above.begin(), sc.above.begin() + n_above, sc.ties.begin(), sc.ties.begin() + (take - n_above), pos.begin());
  }
  std::vector<int32_t>& sel = S.sel;  // ascending: rest is, and the forced window lies above it
  sel.clear();
  std::vector<float>& ssel = S.ssel;  // [na][ks]
  ssel.resize(size_t(na) * ks);
  for (size_t i = 0; i < pos.size(); ++i) {
    sel.push_back(S.rest[size_t(pos[i])]);
    for (int a = 0; a < na; ++a) ssel[size_t(a) * ks + i] = S.score[size_t(a) * size_t(nc) + size_t(pos[i])];
  }
  if (lw > 0) {
    gather_queries(q, S.qheads, sc.qa);
    sc.rows.resize(size_t(lw));
    for (int64_t i = 0; i < lw; ++i) {
      sel.push_back(int32_t(n - lw + i));
      sc.rows[size_t(i)] = kv.k_row(S.h, n - lw + i);
    }
    sc.score.resize(size_t(na) * size_t(lw));
    cpu::score_rows(kv.dtype(), d, na, sc.qa.data(), ctx_.shape.softmax_scale, sc.rows.data(), lw, sc.score.data());
    for (int a = 0; a < na; ++a)
      std::copy_n(sc.score.data() + size_t(a) * lw, lw, ssel.data() + size_t(a) * ks + pos.size());
  }
}

// The lists of the owner's active query heads (sinks + sel), the diagnostics and Step D.
// ssel [qheads][ks]: the scores of sel (ascending) for each of the owner's active query heads.
void Lfps::finish_owner(uint32_t layer, int u, const float* q, const KVLayer& kv, const std::vector<int>& qheads,
                        const std::vector<int32_t>& sel, const float* ssel, size_t ks, int64_t ns_sel,
                        Selection& out) {
  Layer& L = layers_[layer];
  Head& H = L.heads[size_t(u)];
  const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
  const int h = p_.per_kv_head ? u : u / G;
  const int64_t n = kv.size(), t = n - 1, ns = p_.sinks, m = n - ns;
  const float scale = ctx_.shape.softmax_scale;
  const int na = int(qheads.size());
  ThreadScratch& sc = tls;
  H.retrieved_sum += double(ks);
  for (int a = 0; a < na; ++a) {
    auto& l = out.lists[size_t(qheads[size_t(a)])];
    l.clear();
    l.reserve(size_t(ns_sel) + ks);
    for (int64_t j = 0; j < ns_sel; ++j) l.push_back(int32_t(j));
    l.insert(l.end(), sel.begin(), sel.end());
  }

  // Diagnostics: overlap with the exact top-|S| over O per active head (eq. 2, the paper's metric).
  if (p_.diagnostics && ks > 0) {
    std::vector<float> all(size_t(na) * size_t(m));  // [qheads][O]: every key's score
    std::vector<const std::byte*> rows(static_cast<size_t>(m));
    std::vector<int32_t> idx(static_cast<size_t>(m));
    std::vector<uint8_t> in(static_cast<size_t>(m), 0);
    for (int32_t j : sel) in[size_t(j - ns)] = 1;
    for (int64_t j = ns; j < n; ++j) rows[size_t(j - ns)] = kv.k_row(h, j);
    gather_queries(q, qheads, sc.qa);
    cpu::score_rows(kv.dtype(), d, na, sc.qa.data(), scale, rows.data(), m, all.data());
    for (int a = 0; a < na; ++a) {
      const float* sa = all.data() + size_t(a) * size_t(m);
      for (int64_t i = 0; i < m; ++i) idx[size_t(i)] = int32_t(i);
      std::nth_element(idx.begin(), idx.begin() + int64_t(ks - 1), idx.end(),
                       [&](int32_t x, int32_t y) { return sa[x] > sa[y] || (sa[x] == sa[y] && x < y); });
      int64_t hit = 0;
      for (size_t i = 0; i < ks; ++i) hit += in[size_t(idx[i])];
      H.overlap_sum += double(hit) / double(ks);
      ++H.overlap_n;
    }
  }

  // ---- Step D: table update, eq. (10): X = gamma X + a~, a~ = half the softmax over the selected
  // non-sink keys (summed over the group's active heads in per_kv_head mode).
  // (A head with no selected key still decays: a~ = 0 in eq. (10).)
  std::vector<float>& at = sc.agg;
  at.assign(ks, 0.f);
  if (ks > 0) {
    sc.tmp.assign(ssel, ssel + size_t(na) * ks);
    sc.lse.resize(size_t(na));
    cpu::softmax_rows(sc.tmp.data(), na, int64_t(ks), int64_t(ks), sc.lse.data());
    for (int a = 0; a < na; ++a)
      for (size_t i = 0; i < ks; ++i) at[i] += 0.5f * sc.tmp[size_t(a) * ks + i];
  }
  H.g *= p_.gamma;  // lazy decay of every entry of both tables
  if (H.g < kRescaleBelow) {
    H.undo_rescaled = true;
    for (int w = 0; w < 2; ++w) {
      H.undo_x[w] = H.t[w].x;
      for (float& x : H.t[w].x) x = float(double(x) * H.g);
      H.t[w].recompute();
    }
    H.g = 1.0;
  }
  const double inv = 1.0 / H.g;
  const size_t u0 = H.undo.size(), l0 = H.last_upd.size();
  if (!H.undo_rescaled) H.undo.resize(u0 + 2 * ks);
  H.last_upd.resize(l0 + ks);
  Undo* undo = H.undo.data() + u0;
  std::pair<int32_t, float>* upd = H.last_upd.data() + l0;
  float* x0 = H.t[0].x.data();
  float* x1 = H.t[1].x.data();
  // Table::set's power-sum changes added up here and into the tables once: kept in the tables they
  // were one chain of dependent adds through memory, the loop's cost.
  double d0[4] = {0, 0, 0, 0}, d1[4] = {0, 0, 0, 0};
  constexpr size_t kAhead = 16;  // the entries are scattered over both tables: ask for them ahead
  for (size_t i = 0; i < ks; ++i) {
    if (i + kAhead < ks) {
      const int32_t jp = sel[i + kAhead];
      _mm_prefetch(reinterpret_cast<const char*>(x0 + (jp - ns)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(x1 + (t - jp)), _MM_HINT_T0);
    }
    const int32_t j = sel[i];
    const size_t iv = size_t(j - ns), is = size_t(t - j);
    const float a0 = x0[iv], a1 = x1[is];
    if (!H.undo_rescaled) {
      undo[2 * i] = {0, int32_t(iv), a0};
      undo[2 * i + 1] = {1, int32_t(is), a1};
    }
    const float b0 = float(double(a0) + double(at[i]) * inv), b1 = float(double(a1) + double(at[i]) * inv);
    Table::add_change(d0, a0, b0);
    Table::add_change(d1, a1, b1);
    x0[iv] = b0;
    x1[is] = b1;
    upd[i] = {j, at[i]};
  }
  for (int p = 0; p < 4; ++p) {
    H.t[0].s[p] += d0[p];
    H.t[1].s[p] += d1[p];
  }
}

int64_t Lfps::total_keys(int64_t n) const {
  return std::max(ctx_.budget.keys(n, 0.02), std::min(p_.min_keys, n));
}

// kv_budget=cap: the sinks count toward the budget and are clipped to it (first sinks first).
StaticKeys Lfps::static_keys(uint32_t, int64_t n) const {
  return StaticKeys{p_.kv_cap ? std::min({p_.sinks, n, total_keys(n)}) : std::min(p_.sinks, n), 0};
}

// The sink-value bypass (§4.2 [reconstructed from the paper's prose]): o = V-bar, lse = log A_glob, merged by the session with
// the exact sink attention of the selection.
bool Lfps::extra(uint32_t layer, const float*, const KVLayer&, float* o, float* lse) {
  const Layer& L = layers_[layer];
  const int hq = int(ctx_.shape.num_q_heads), d = int(ctx_.shape.head_dim), G = ctx_.shape.group();
  bool any = false;
  for (int qh = 0; qh < hq; ++qh) {
    float* oh = o + size_t(qh) * d;
    if (!L.bypass[size_t(qh)]) {
      std::fill(oh, oh + d, 0.f);
      lse[qh] = -std::numeric_limits<float>::infinity();
      continue;
    }
    any = true;
    const std::vector<double> vb = mean_value(layer, qh / G);
    for (int i = 0; i < d; ++i) oh[i] = float(vb[size_t(i)]);
    lse[qh] = L.bypass_lse[size_t(qh)];
  }
  return any;
}

// ---------------------------------------------------------------------------------------------
// Tables file, statistics

nlohmann::json Lfps::save_meta() const {
  nlohmann::json meta = nlohmann::json::object();
  meta["owners"] = owners_;
  meta["gqa"] = p_.per_kv_head ? "per_kv_head" : "per_query_head";
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    if (!L.built) continue;
    double kv = 0, ks = 0, fv = 0, fs = 0;
    for (int u = 0; u < owners_; ++u) {
      const Head& H = L.heads[size_t(u)];
      const TableStats a = stats_of(H.t[0], H.g), b = stats_of(H.t[1], H.g);
      kv += a.kurtosis;
      ks += b.kurtosis;
      int64_t cv = 0, cs = 0;
      for (float x : H.t[0].x) cv += H.g * x > a.tau;
      for (float x : H.t[1].x) cs += H.g * x > b.tau;
      if (a.count > 0) fv += double(cv) / double(a.count);
      if (b.count > 0) fs += double(cs) / double(b.count);
    }
    const double U = double(owners_);
    meta["layers"][std::to_string(l)] = {{"tokens", L.tokens},
                                         {"entries", L.heads.empty() ? 0 : L.heads[0].t[0].x.size()},
                                         {"prior_count", L.prior_count},
                                         {"mean_kurtosis_vertical", kv / U},
                                         {"mean_kurtosis_slash", ks / U},
                                         {"above_threshold_vertical", fv / U},
                                         {"above_threshold_slash", fs / U}};
  }
  double v;
  nlohmann::json st = nlohmann::json::object();
  for (const char* name : {"candidate_fraction", "bypass_fraction", "retrieved_keys", "decode_steps"})
    if (stat(name, &v)) st[name] = v;
  meta["stats"] = st;
  return meta;
}

void Lfps::save(io::TablesWriter& w) const {
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    if (!L.built) continue;
    for (int which = 0; which < 2; ++which) {
      std::vector<io::Piece> pieces;
      for (const Head& H : L.heads) pieces.push_back({H.t[which].x.data(), uint64_t(H.t[which].x.size() * sizeof(float))});
      w.add(which == 0 ? "lfps.vertical" : "lfps.slash", int32_t(l), -1, std::move(pieces));
    }
    std::vector<double> g;
    for (const Head& H : L.heads) g.push_back(H.g);
    w.add_copy("lfps.scale", int32_t(l), -1, g.data(), g.size() * sizeof(double));
    w.add("lfps.ksum", int32_t(l), -1, {io::Piece{L.ksum.data(), uint64_t(L.ksum.size() * sizeof(double))}});
    w.add("lfps.vsum", int32_t(l), -1, {io::Piece{L.vsum.data(), uint64_t(L.vsum.size() * sizeof(double))}});
    w.add("lfps.rho", int32_t(l), -1, {io::Piece{L.rho.data(), uint64_t(L.rho.size() * sizeof(double))}});
  }
}

void Lfps::load(const io::TablesFile& f, const nlohmann::json& meta) {
  const int d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads), hq = int(ctx_.shape.num_q_heads);
  // Header numbers are range-checked at their type before they are used (io/header.hpp).
  const io::HeaderReader hm(f.path(), "method.meta");
  if (const int64_t o = hm.integer_or<int64_t>(meta, "owners", 1, std::numeric_limits<int64_t>::max(), owners_);
      o != owners_)
    fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "lfps tables: owners " + std::to_string(o) +
                                        " do not match the gqa mode of this session (" + std::to_string(owners_) + ")");
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const auto* sv = f.find("lfps.vertical", int32_t(l), -1);
    if (!sv) continue;
    const std::string key = std::to_string(l);
    auto bad = [&](const std::string& what) {
      fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "lfps tables layer " + key + ": " + what);
    };
    if (!hm.has(meta, "layers")) bad("layer entry missing from the header");
    const auto& layers = hm.object(meta, "layers");
    if (!layers.contains(key)) bad("layer entry missing from the header");
    const auto hl = hm.sub("layers").sub(key);
    const auto& lm = hm.sub("layers").object(layers, key);
    const int64_t n = hl.integer<int64_t>(lm, "tokens", 0, (int64_t(1) << 31) - 1);
    const int64_t cnt = hl.integer<int64_t>(lm, "prior_count", 0, n);
    const uint64_t m = uint64_t(std::max<int64_t>(0, n - p_.sinks));
    const auto& ss = f.require("lfps.slash", int32_t(l), -1);
    const auto& sg = f.require("lfps.scale", int32_t(l), -1);
    const auto& sk = f.require("lfps.ksum", int32_t(l), -1);
    const auto& sV = f.require("lfps.vsum", int32_t(l), -1);
    const auto& sr = f.require("lfps.rho", int32_t(l), -1);
    const uint64_t U = uint64_t(owners_);
    if (sv->length != U * m * 4 || ss.length != U * m * 4) bad("table size does not match " + std::to_string(n) + " tokens");
    if (sg.length != U * 8 || sk.length != uint64_t(hkv) * d * 8 || sV.length != uint64_t(hkv) * d * 8 ||
        sr.length != uint64_t(hq) * 8)
      bad("prior or scale section size does not match the model shape");
    Layer& L = layers_[l];
    L.heads.assign(size_t(U), Head{});
    const float* pv = reinterpret_cast<const float*>(sv->data);
    const float* ps = reinterpret_cast<const float*>(ss.data);
    const double* pg = reinterpret_cast<const double*>(sg.data);
    for (size_t u = 0; u < U; ++u) {
      Head& H = L.heads[u];
      H.t[0].x.assign(pv + u * m, pv + (u + 1) * m);
      H.t[1].x.assign(ps + u * m, ps + (u + 1) * m);
      H.g = pg[u];
      if (!(H.g > 0 && H.g <= 1)) bad("scale out of (0, 1]");
      for (auto& t : H.t) t.recompute();
    }
    L.ksum.assign(reinterpret_cast<const double*>(sk.data), reinterpret_cast<const double*>(sk.data) + size_t(hkv) * d);
    L.vsum.assign(reinterpret_cast<const double*>(sV.data), reinterpret_cast<const double*>(sV.data) + size_t(hkv) * d);
    L.rho.assign(reinterpret_cast<const double*>(sr.data), reinterpret_cast<const double*>(sr.data) + hq);
    L.prior_count = cnt;
    L.tokens = n;
    L.built = true;
    L.awaiting_kv = true;  // cleared by on_prefill when the prompt is back (or already: KV included)
    L.tail.clear();
    L.undo_tokens = -1;
  }
}

uint64_t Lfps::index_bytes() const {
  uint64_t b = 0;
  for (const Layer& L : layers_) {
    for (const Head& H : L.heads) b += (H.t[0].x.size() + H.t[1].x.size()) * sizeof(float) + sizeof(double);
    b += (L.ksum.size() + L.vsum.size() + L.rho.size()) * sizeof(double);
  }
  return b;
}

bool Lfps::stat(std::string_view name, double* out) const {
  double cand = 0, ov = 0, ret = 0;
  int64_t cn = 0, on = 0, byp = 0, hs = 0, fb = 0;
  for (const Layer& L : layers_) {
    for (const Head& H : L.heads) {
      cand += H.cand_frac_sum;
      cn += H.cand_n;
      ov += H.overlap_sum;
      on += H.overlap_n;
      ret += H.retrieved_sum;
      fb += H.fallback_n;
    }
    byp += L.bypass_heads;
    hs += L.head_steps;
  }
  if (name == "candidate_fraction") *out = cn ? cand / double(cn) : 0.0;      // mean |C| / |O|
  else if (name == "bypass_fraction") *out = hs ? double(byp) / double(hs) : 0.0;  // bypassed head-steps
  else if (name == "overlap") *out = on ? ov / double(on) : 0.0;            // needs diagnostics=true
  else if (name == "retrieved_keys") *out = cn ? ret / double(cn) : 0.0;    // mean |S| (non-sink)
  else if (name == "fallback_fraction") *out = cn ? double(fb) / double(cn) : 0.0;  // empty C0 steps
  else if (name == "decode_steps") *out = double(hs) / double(ctx_.shape.num_q_heads);
  else return false;
  return true;
}

}  // namespace kvs::lfps

namespace kvs {

MethodSpec lfps_spec() {
  return MethodSpec{
      "lfps",
      "LFPS: vertical and slash score tables learnt from past attention, kurtosis thresholds, "
      "expansion, sink-value bypass of sparse heads, exact top-k on the candidates",
      1u << KVS_BACKEND_CPU,
      0.02,
      {{"preset", "enum:kvsieve|paper", "kvsieve",
        "paper: the paper's settings: alpha=0.2, kv_budget=union, fill=none, widen=none (parameters given "
        "explicitly win); kvsieve: alpha=0.1 (chosen on the validation suite's tuning half, docs/methods/lfps.md), "
        "kv_budget=cap, fill=recent, widen=recent"},
       {"gamma", "float", "0.95", "decay of the score tables, eq. (10) (paper 5, App. B.2)"},
       {"alpha", "float", "0.1",
        "threshold coefficient of eq. (8) (the paper uses 0.2 and 0.3; preset=paper: 0.2); -inf makes every key a "
        "candidate",
        "0.2"},
       {"alpha_scale", "float", "600",
        "calibration factor on alpha in tau = mu + alpha*alpha_scale*sigma*3/kurtosis [reconstructed from the paper's prose]; 600 gives the paper's "
        "Table 4 candidate fractions at 4K on real SmolLM2-135M traces (6.0% at alpha 0.2, 4.8% at 0.3; docs/methods/lfps.md)"},
       {"theta", "float", "0.85", "bypass a head when its sink share r exceeds theta, eq. (6) (Table 3)"},
       {"bypass", "bool", "true", "enable the sink-value bypass of highly sparse heads"},
       {"sinks", "int", "4", "first tokens always attended exactly (kept on the GPU in the paper)"},
       {"last_q", "int", "64", "T: last prompt queries whose attention seeds the tables, eq. (4) [the paper does not say; our choice]"},
       {"init_weights", "enum:decayed|uniform", "decayed", "eq. (4) row weights gamma^tau or 1 [reconstructed from the paper's prose]"},
       {"init_mass", "float", "0", "sum of each initial table; 0 = 0.5/(1-gamma), the steady state of eq. (10) [reconstructed from the paper's prose]"},
       {"local_est", "int", "5", "W_loc: recent keys scored exactly for the sparsity estimate (App. B.1)"},
       {"combine", "enum:max|sum", "max", "eq. (6): A_sink / (A_sink + max(A_glob, A_loc)) or + (A_glob + A_loc) [reconstructed from the paper's prose]"},
       {"offsets", "string", "-1;0;1;2", "expansion offsets of eq. (9), ';'-separated"},
       {"local_window", "int", "0", "most recent keys always attended (counts toward k) [not in the paper: a safety net]"},
       {"min_keys", "int", "0", "floor of the budget in keys (256 is a sensible floor)"},
       {"gqa", "enum:per_query_head|per_kv_head", "per_query_head",
        "tables per query head (faithful) or per KV head with a~ summed over the group"},
       {"update_priors", "bool", "false", "keep K-bar, V-bar as running means over appended tokens (paper: prefill only)"},
       {"empty_fallback", "bool", "true",
        "when no table entry exceeds its threshold, use the tables' means for that step (else the head never selects again) [the paper does not say; our choice]"},
       {"diagnostics", "bool", "false", "measure overlap with exact top-k per step (stat 'overlap'; costs a full scan)"},
       {"kv_budget", "enum:cap|union", "cap",
        "cap: the sinks are clipped to the budget and a KV head's query heads share one set of budget - sinks keys "
        "(their candidates' union ranked by the group's summed softmax); union: each query head keeps its own "
        "top-(budget - sinks) and the KV head reads their union (the paper's per-head form: up to G x budget)",
        "union"},
       {"fill", "enum:recent|none", "recent",
        "recent: candidates fewer than the budget are completed with the most recent keys not among them, so a "
        "KV head attends the whole budget; none: it attends only its candidates (the paper)",
        "none"},
       {"widen", "enum:recent|none", "recent",
        "with kv_budget=cap and fill=recent: the budget's count of most recent keys (outside local_window) join "
        "the candidates every step, so the exact top-k can prefer them to the tables' candidates (a query the "
        "tables do not predict); none: they only fill a shortfall [ours]",
        "none"}},
      [](const MethodContext& c, const ParamSet& p) { return std::make_unique<lfps::Lfps>(c, lfps::parse_params(p)); }};
}

}  // namespace kvs
