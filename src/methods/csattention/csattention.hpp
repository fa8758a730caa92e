// SPDX-License-Identifier: Apache-2.0
// CSAttention building blocks shared by the method and its white-box tests: spherical k-means
// (k-means++ seeding, mini-batch or full-batch Lloyd updates), the fixed-length Top-L score lists
// kept as binary min-heaps, and the streaming try-insert.
#pragma once
#include <atomic>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "backends/cpu/gemm.hpp"
#include "core/dtype.hpp"
#include "core/method.hpp"

namespace kvs::csa {

struct KMeansConfig {
  int C = 64;              // centroids
  int iters = 10;          // epochs over the sample (mini-batch) or Lloyd iterations (full batch)
  int batch = 1024;        // mini-batch size
  bool full_batch = false; // Lloyd's spherical k-means instead of Sculley's mini-batch updates
  bool init_queries = false;  // centroids = the (normalised) points themselves; requires n == C
  uint64_t seed = 0;
};

// Spherical k-means over the rows of X [n][db] (rows already unit-norm, or zero: zero rows are
// ignored by the updates). Writes C unit centroids to cent [C][db]. on_iter (optional) is called
// after the seeding (iter 0) and after every iteration with the current centroids.
void spherical_kmeans(const float* X, int64_t n, int db, const KMeansConfig& cfg, cpu::GemmProvider gemm,
                      float* cent, const std::function<void(int, const float*)>* on_iter = nullptr);

// Objective sum_x min_j ||x - c_j||^2 in float64 (rows of X and centroids as given).
double kmeans_objective(const float* X, int64_t n, int db, const float* cent, int C);

// fp16 -> fp32 through a 65536-entry table (no F16C assumed; heap compares and portable gathers).
const float* f16_table();
// x[i] <- fp32(fp16(x[i])) for n values (F16C when the CPU has it).
void round_f16(float* x, int64_t n);

// Table score storage: fp16 (the paper's tables) or fp32 (an exact-ordering option).
inline float score_f(uint16_t v) { return f16_table()[v]; }
inline float score_f(float v) { return v; }
inline void score_store(uint16_t& dst, float v) { dst = f32_to_f16(v); }
inline void score_store(float& dst, float v) { dst = v; }
// The value a score takes once stored (ordering is always on stored values).
inline float score_round(float v, bool f16) { return f16 ? f16_to_f32(f32_to_f16(v)) : v; }

// A list entry a is worse than b: lower stored score, or equal score and a later token (so an
// appended key must strictly beat the minimum, and build and streaming agree on ties).
template <class S>
inline bool worse(float va, int32_t ia, float vb, int32_t ib) {
  return va < vb || (va == vb && ia > ib);
}

// Restores the min-heap property (root = worst entry) below position i of a list of length L.
// Each step asks for the node's descendants three levels down (8 consecutive entries) so that a
// path through a large cold heap does not wait for one memory access per level.
template <class S>
void heap_sift_down(int32_t* idx, S* val, int64_t L, int64_t i) {
  const int32_t xi = idx[i];
  const S xv = val[i];
  const float xf = score_f(xv);
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= L) break;
    if (const int64_t g = 8 * i + 7; g < L) {
      __builtin_prefetch(idx + g);
      __builtin_prefetch(idx + std::min(g + 7, L - 1));
      __builtin_prefetch(val + g);
    }
    float cf = score_f(val[c]);
    if (c + 1 < L) {
      const float rf = score_f(val[c + 1]);
      if (worse<S>(rf, idx[c + 1], cf, idx[c])) {
        ++c;
        cf = rf;
      }
    }
    if (!worse<S>(cf, idx[c], xf, xi)) break;
    idx[i] = idx[c];
    val[i] = val[c];
    i = c;
  }
  idx[i] = xi;
  val[i] = xv;
}

template <class S>
void heap_make(int32_t* idx, S* val, int64_t L) {
  for (int64_t i = L / 2 - 1; i >= 0; --i) heap_sift_down(idx, val, L, i);
}

// Try-insert of token t (later than every listed token) with raw score s: replaces the list's
// minimum when the stored score beats it. Returns true and the evicted entry when inserted.
template <class S>
bool heap_try_insert(int32_t* idx, S* val, int64_t L, int32_t t, float s, int32_t* ev_idx, S* ev_val) {
  S sv;
  score_store(sv, s);
  if (L <= 0 || !(score_f(sv) > score_f(val[0]))) return false;
  *ev_idx = idx[0];
  *ev_val = val[0];
  idx[0] = t;
  val[0] = sv;
  heap_sift_down(idx, val, L, 0);
  return true;
}

// Top-L of scores[0..n) (already rounded to their stored values) by (score desc, index asc),
// written as a heap. tmp: scratch of n floats.
template <class S>
void build_list(const float* scores, int64_t n, int64_t L, int32_t* idx, S* val, std::vector<float>& tmp);

// Test hook: when set, every search takes the fallback path of its candidate collection (the
// lists are added again and every touched key collected), which the sampled threshold otherwise
// rarely needs. The selections must not change.
extern std::atomic<bool> g_force_recollect;

// ---- shared by the cpu method (csattention.cpp) and its cuda implementation (csattention_cuda.cpp) ----

// The parsed parameters (csattention.cpp validates them; docs/methods/csattention.md).
struct Params {
  int d = 0, G = 1, m = 8, TH = 0;  // head dim, group, subspaces, table heads (Hkv, or Hq per query head)
  int64_t C = 64, list_len = 0, sample = 8192, recent = -1, sinks = 0, period = 1;
  double alpha = 0.1, recent_frac = 0.5, rerank = 0;
  uint64_t seed = 0;
  bool f16 = true, qnorm = false, window_in_budget = true, per_query = false, group_sum = false;
  bool missing_min = false, sched = false;
  double sched_rho = 0.05;
  KMeansConfig km;
  std::vector<int> db, off;  // subspace sizes and first dims
  std::vector<float> w;      // w_b
};
constexpr int64_t kRecentMax = 64;  // the default recent window's cap

// The keys one step attends around the search (csattention.cpp's rule): n tokens, a budget of k
// keys. Emitted in this order: sinks [0, s_emit), the searched keys (the best `rest` of
// [s_end, w_begin), or of the period's cached search filtered to that range), the window [w_emit, n).
struct StepKeys {
  int64_t k = 0, s_end = 0, w_begin = 0, s_emit = 0, w_emit = 0, rest = 0;
};
StepKeys step_keys(const Params& p, const Budget& session_budget, int64_t n);

// The cpu method's parsed parameters and one layer's tables, for the cuda implementation, which
// keeps a cpu object to parse its parameters and to save and load the tables file (m must come
// from csattention_spec().create).
struct LayerTables {
  bool* built;
  bool* dense_fallback;
  int64_t *L, *C, *indexed, *step;
  std::vector<float>* cent;
  std::vector<int32_t>* idx;
  std::vector<uint16_t>* v16;
  std::vector<float>* v32;
  std::vector<std::vector<int32_t>>* cached;
};
const Params& params_of(const Method& m);
LayerTables tables_of(Method& m, uint32_t layer);

}  // namespace kvs::csa
