// SPDX-License-Identifier: Apache-2.0
// retroinfer: the wave index of RetroInfer (Chen et al., arXiv 2505.02922; docs/methods/retroinfer.md,
// after microsoft/RetrievalAttention@6b1228c), CPU reference. By default (budget=session) the exact
// keys fill the session budget (a steady zone scaled to a share of it, then whole clusters in rank
// order, then part of the next); preset=paper keeps the authors' fixed zones, described here.
// Per layer and KV head the keys outside the steady zone (4 sinks + 64 local) are clustered by segmented spherical k-means
// (wave_index.hpp); a decode step ranks the clusters by the group's summed per-head softmax of
// q.C/sqrt(d), attends the top r clusters (retrieval zone) exactly together with the steady zone
// (returned by select, attended by the session), estimates the next e clusters (estimation zone)
// from centroids, exact sizes and value sums (eqs. 2-4, returned by extra and merged by LSE by the
// session), and ignores the rest. Every update_segment tokens past the index are clustered on their
// own and appended. docs/methods/retroinfer.md documents every parameter and deviation.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "core/error.hpp"
#include "core/method.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"
#include "backends/cpu/attention.hpp"
#include "backends/cpu/topk.hpp"
#include "methods/param_bounds.hpp"
#include "methods/retroinfer/retroinfer.hpp"
#include "methods/retroinfer/wave_index.hpp"

namespace kvs {
int64_t streaming_sinks(int64_t sinks, int64_t k, int64_t n);  // methods/streaming/streaming.cpp
namespace {

using retro::WaveHead;

// One clustering run: tokens [tok_begin, tok_end), clusters [clu_begin, clu_end), and the zone
// sizes it adds.
struct Chunk {
  int64_t tok_begin, tok_end, clu_begin, clu_end, segments, r_add, e_add;
  double build_ms;
};

struct LayerIndex {
  std::vector<WaveHead> heads;  // Hkv, empty = no index
  std::vector<Chunk> chunks;
  int64_t indexed_end = 0;      // tokens [sinks, indexed_end) are clustered
  int64_t r = 0, e = 0;         // retrieval / estimation zone sizes in clusters
  uint64_t generation = 0;      // a new value after every change (retro::IndexView)
  uint64_t lineage = 0;         // a new value after every change but an append (retro::IndexView)
  int64_t clusters() const { return heads.empty() ? 0 : heads[0].clusters(); }
};

// Per-step figures, averaged over KV heads.
struct StepStats {
  double retrieval_clusters = 0, retrieval_tokens = 0, estimation_clusters = 0, estimation_tokens = 0,
         steady_tokens = 0, fill_tokens = 0, budget_unused = 0, budget_overrun = 0;
};

// Estimation numerators: num[g][:] += a[g] * row for the G query heads of a group, one meta row
// (value sums in fp32, or value means in the 16-bit KV dtype) converted once for the group.
__attribute__((target("avx2,fma,f16c"))) void accumulate_row_avx2(const std::byte* row, DType t, int d, int G,
                                                                  const float* a, float* num) {
  for (int i = 0; i < d; i += 8) {
    __m256 x;
    if (t == DType::BF16)
      x = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * size_t(i)))), 16));
    else if (t == DType::F16)
      x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * size_t(i))));
    else
      x = _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
    for (int g = 0; g < G; ++g) {
      float* nu = num + size_t(g) * d + i;
      _mm256_storeu_ps(nu, _mm256_fmadd_ps(_mm256_set1_ps(a[g]), x, _mm256_loadu_ps(nu)));
    }
  }
}

void accumulate_row_portable(const std::byte* row, DType t, int d, int G, const float* a, float* num) {
  for (int i = 0; i < d; ++i) {
    const float x = load_as_f32(row, t, size_t(i));
    for (int g = 0; g < G; ++g) num[size_t(g) * d + i] = std::fma(a[g], x, num[size_t(g) * d + i]);
  }
}

const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");

// Per-KV-head decode scratch, kept between steps (no per-step allocations once grown).
struct HeadScratch {
  std::vector<float> E, dist, num, a;
  std::vector<double> dens;
  std::vector<int32_t> cand, zr, ze, zo;
  std::vector<float> mx, vals, rank, part;
  std::vector<uint64_t> bits, cbits;
  std::vector<uint32_t> rtmp;
};

// max of x[0, n) (-inf for n = 0).
__attribute__((target("avx2"))) float max_avx2(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float t[8];
  _mm256_storeu_ps(t, m);
  float r = t[0];
  for (int l = 1; l < 8; ++l) r = std::max(r, t[l]);
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

float max_of(const float* x, int64_t n) {
  if (kAvx2) return max_avx2(x, n);
  float r = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

// x rounded to t (round to nearest even, as a store to a tensor of dtype t and a load back); for
// fp16, a finite x beyond its range saturates to +-65504 (inf would make the ranking softmax NaN).
inline float round_to(DType t, float x) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(x));
  if (t == DType::F16) {
    const float r = f16_to_f32(f32_to_f16(x));
    return std::isinf(r) && std::isfinite(x) ? std::copysign(65504.f, x) : r;
  }
  return x;
}

// One query head's share of the cluster ranking in the 16-bit dtype t (rank_dtype=model), at the
// points where the authors' code rounds (batch_gemm_softmax: the scaled logits are stored in the
// model dtype and the softmax is computed in fp32 from the stored values, its outputs stored in the
// model dtype again; torch.sum then adds the group's outputs in fp32 and stores the sum in the
// model dtype, which the caller rounds once every head is in): dist[c] += round_t(softmax_c(round_t(e))).
// e: the fp32 logits of the C centroids (left unchanged); empty clusters (csize 0) are left out of
// the softmax when drop_empty (mask_empty=before_softmax). R: scratch.
void rank_row_model(DType t, const float* e, int64_t C, const int32_t* csize, bool drop_empty, std::vector<float>& R,
                    float* dist) {
  R.resize(size_t(C));
  float* x = R.data();
  for (int64_t c = 0; c < C; ++c)
    x[c] = drop_empty && csize[c] == 0 ? -std::numeric_limits<float>::infinity() : round_to(t, e[c]);
  const float m = max_of(x, C);
  double z = cpu::exp_shift(x, C, m);
  if (drop_empty) {
    z = 0;
    for (int64_t c = 0; c < C; ++c) z += (x[c] = csize[c] > 0 ? x[c] : 0.f);
  }
  const float inv = float(1.0 / z);
  for (int64_t c = 0; c < C; ++c) dist[c] += round_to(t, x[c] * inv);
}

constexpr int64_t kTok = (int64_t(1) << 31) - 1;  // token counts and indices are int32

class RetroInfer final : public Method {
 public:
  RetroInfer(const MethodContext& ctx, const ParamSet& p)
      : ctx_(ctx),
        // Integers are range-checked at int64 before use (param_bounds.hpp): token counts below
        // 2^31, so sums like sinks + local cannot overflow.
        sinks_(int_param(p, "retroinfer", "sinks", 0, kTok)),
        local_(int_param(p, "retroinfer", "local", 0, kTok)),
        cluster_size_(int_param(p, "retroinfer", "cluster_size", 1, kTok)),
        segment_size_(int_param(p, "retroinfer", "segment_size", 0, kTok, "0 = whole context")),
        iterations_(int_param(p, "retroinfer", "iterations", 1, 1000)),
        align_(int_param(p, "retroinfer", "cluster_align", 1, 4096)),
        retrieval_(p.get_float("retrieval")),
        estimation_(p.get_float("estimation")),
        update_(int_param(p, "retroinfer", "update_segment", 1, kTok)),
        index_min_(int_param(p, "retroinfer", "index_min", 0, kTok, "0 = update_segment")),
        session_budget_(p.get_string("budget") == "session"),
        steady_share_(p.get_float("steady_share")),
        centre_(p.get_bool("centre")),
        probe_(int_param(p, "retroinfer", "recall_probe", 0, kTok, "0 = off")),
        meta_dtype_(p.get_string("meta_dtype")),
        from_prompt_(p.get_string("cluster_basis") == "prompt"),
        raw_init_(p.get_string("kmeans_init") == "raw"),
        mask_after_(p.get_string("mask_empty") == "after_softmax"),
        rank_model_(p.get_string("rank_dtype") == "model"),
        layers_(ctx.shape.num_layers) {
    auto bad = [](const std::string& name, const std::string& want, const std::string& got) {
      invalid("method_params: retroinfer " + name + ": expected " + want + ", got " + got);
    };
    if (!(retrieval_ >= 0 && retrieval_ <= 1)) bad("retrieval", "a fraction of the clusters in [0, 1]", std::to_string(retrieval_));
    if (!(estimation_ >= 0 && estimation_ <= 1)) bad("estimation", "a fraction of the clusters in [0, 1]", std::to_string(estimation_));
    if (!(steady_share_ >= 0 && steady_share_ <= 1)) bad("steady_share", "a share of the budget in [0, 1]", std::to_string(steady_share_));
    for (auto& l : layers_) l.indexed_end = sinks_;
  }

  // ------------------------------------------------------------------------------------------
  // Index build and update

  void build_index(uint32_t layer, const KVLayer& kv) override {
    auto& L = layers_[layer];
    L = LayerIndex{};
    L.generation = L.lineage = ++generation_;
    L.indexed_end = sinks_;
    const int64_t n_idx = kv.size() - local_ - sinks_;
    // Short prompts (n < sinks + local + index_min) stay in the steady zone until enough tokens
    // accumulate (retroinfer_cache.py, where index_min is update_segment).
    if (n_idx >= min_index()) {
      // Segment and cluster counts from the whole prompt (config.py is given the context length),
      // or from the clustered tokens only (cluster_basis=indexed).
      const int64_t basis = from_prompt_ ? kv.size() : n_idx;
      const int64_t s = std::min(retro::segment_count(basis, segment_size_), n_idx);
      // At most one cluster per token (the rounding to lcm(cluster_align, segments) can ask for
      // more on short prompts): still a multiple of the segments, each segment's k-means gets at
      // most as many clusters as it has tokens.
      const int64_t C = std::min(retro::cluster_count(basis, cluster_size_, align_, s), s * (n_idx / s));
      // Python round (halves to even), as retroinfer_cache.py sizes the zones.
      const int64_t r = std::clamp<int64_t>(retro::round_half_even(double(C) * retrieval_), retrieval_ > 0 ? 1 : 0, C);
      const int64_t e = std::min<int64_t>(retro::round_half_even(double(C) * estimation_), C - r);
      add_chunk(layer, kv, sinks_, sinks_ + n_idx, s, C, r, e);
    }
    update(layer, kv);
  }

  void on_append(uint32_t layer, const float*, int64_t, const KVLayer& kv, bool) override { update(layer, kv); }

  void truncate(uint32_t layer, int64_t n) override {
    auto& L = layers_[layer];
    L.generation = L.lineage = ++generation_;
    const size_t rb = size_t(ctx_.shape.head_dim) * dtype_size(ctx_.shape.kv_dtype);
    // A chunk exists only while its tokens are outside the local window; drop those that are not.
    while (!L.chunks.empty() && L.chunks.back().tok_end > n - local_) {
      const Chunk c = L.chunks.back();
      L.chunks.pop_back();
      for (auto& h : L.heads) h.truncate_clusters(c.clu_begin, rb);
      L.r -= c.r_add;
      L.e -= c.e_add;
      L.indexed_end = c.tok_begin;
    }
    if (L.chunks.empty()) {
      L.heads.clear();
      L.r = L.e = 0;
      L.indexed_end = sinks_;
    }
  }

  // ------------------------------------------------------------------------------------------
  // Decode

  // The step's zones before any cluster is ranked: the steady zone, the room left for clusters
  // (budget=session), or nothing indexed yet (retroinfer.hpp, shared with the cuda placement).
  //
  // budget=session with steady_share > 0 (the default): the steady zone scales with the budget
  // (sinks [0, sk) and a local window [lb, n) within steady_share of it, as ctkvr's static set),
  // and the exact keys are filled up to the budget (whole clusters, then part of the next one,
  // then unclustered tokens, most recent first). Otherwise the steady zone is [0, sinks) and
  // every token from indexed_end on.
  retro::StepLayout layout(uint32_t layer, int64_t n, int64_t budget_keys) const {
    using SL = retro::StepLayout;
    const auto& L = layers_[layer];
    SL s;
    const bool scaled = session_budget_ && steady_share_ > 0;
    s.sinks_end = std::min(sinks_, n);
    s.sk = s.sinks_end;
    s.lb = L.indexed_end;
    if (scaled) {
      // Sinks by streaming's rule (at most an eighth of the budget, at least 1 where k >= 2; not an
      // eighth of the steady share, which dropped heavy sinks below k = 64), within the share.
      const int64_t share = int64_t(std::floor(steady_share_ * double(budget_keys)));
      s.sk = std::min(streaming_sinks(sinks_, budget_keys, n), share);
      s.lb = n - std::min(local_, std::max<int64_t>(0, share - s.sk));
    }
    if (L.clusters() == 0) {
      // Nothing indexed (a prompt below the indexing threshold): the whole context, or (scaled)
      // streaming's selection, the sinks (streaming's rule, not capped by the steady share) and
      // the most recent tokens, the whole budget.
      if (!scaled) {
        s.mode = SL::All;
        s.sk = n;
        s.lb = n;
        return s;
      }
      s.mode = SL::Streaming;
      s.sk = streaming_sinks(sinks_, budget_keys, n);
      s.lw = std::min(n - s.sk, budget_keys - s.sk);
      return s;
    }
    s.mode = !session_budget_ ? SL::Paper : scaled ? SL::Scaled : SL::Session;
    if (session_budget_) {
      s.room = budget_keys - (s.sk + (n - s.lb));
      if (s.room < 0) s.overrun = -s.room, s.room = 0;
    }
    return s;
  }

  void select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) override {
    auto& L = layers_[layer];
    const int64_t n = kv.size();
    est_layer_ = -1;
    const int hkv = int(ctx_.shape.num_kv_heads);
    const int64_t budget_keys = session_budget_ ? ctx_.budget.keys(n, 0.05) : 0;
    const retro::StepLayout lay = layout(layer, n, budget_keys);
    const bool scaled = lay.mode == retro::StepLayout::Scaled;
    const int64_t sk = lay.sk, lb = lay.lb;
    if (lay.mode == retro::StepLayout::All || lay.mode == retro::StepLayout::Streaming) {
      last_ = StepStats{};
      if (lay.mode == retro::StepLayout::All) {  // nothing indexed: the steady zone is the whole context
        out.kind = Selection::Kind::All;
        out.lists.clear();
        last_.steady_tokens = double(n);
        return;
      }
      const int64_t lw = lay.lw;
      out.kind = Selection::Kind::PerKvHead;
      out.lists.resize(size_t(hkv));
      for (auto& list : out.lists) {
        list.clear();
        for (int64_t t = 0; t < sk; ++t) list.push_back(int32_t(t));
        for (int64_t t = n - lw; t < n; ++t) list.push_back(int32_t(t));
      }
      last_.steady_tokens = double(sk + lw);
      return;
    }
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
    const int64_t C = L.clusters();
    const float scale = ctx_.shape.softmax_scale;
    const int64_t steady = sk + (n - lb);
    out.kind = Selection::Kind::PerKvHead;
    out.lists.resize(size_t(hkv));  // the lists keep their capacity between steps
    est_o_.assign(size_t(hkv) * G * d, 0.f);
    est_lse_.assign(size_t(hkv) * G, -std::numeric_limits<float>::infinity());
    std::vector<StepStats> hs(static_cast<size_t>(hkv));
    std::vector<double> probe(static_cast<size_t>(hkv), 0.0), probe_cl(static_cast<size_t>(hkv), 0.0);
    if (scratch_.size() < size_t(hkv)) scratch_.resize(size_t(hkv));

    ctx_.pool->parallel_for(hkv, [&](int64_t hh) {
      const int h = int(hh);
      const WaveHead& W = L.heads[size_t(h)];
      const float* qg = q + size_t(h) * G * d;
      HeadScratch& S = scratch_[size_t(h)];
      // 1. Cluster ranking: P[g][c] = softmax_c(q_g.C_c * scale), summed over g; the softmax runs over
      //    every centroid and empty clusters are dropped after the sum (batch_gemm_softmax, then
      //    masked_fill), or over the non-empty clusters only (mask_empty=before_softmax).
      //    The centroid logits are one GEMV over the C x d meta rows (the block kernel's score pass),
      //    read in the decode dtype (16-bit when the KV is), then a vectorised exp per head.
      //    rank_dtype=model rounds the logits, the softmax outputs and the sum to the KV dtype.
      const bool m16 = W.mdt != DType::F32;
      S.E.resize(size_t(G) * C);
      S.dist.assign(size_t(C), 0.f);
      S.mx.assign(size_t(G), -std::numeric_limits<float>::infinity());
      float* E = S.E.data();
      float* dist = S.dist.data();
      //    With more pool threads than KV heads the GEMV's rows are cut into parts (block-aligned:
      //    the same logits whatever the cut).
      const DType cdt = m16 ? W.mdt : DType::F32;
      const std::byte* crows = m16 ? W.dcent.data() : reinterpret_cast<const std::byte*>(W.centroids.data());
      const size_t crb = size_t(d) * dtype_size(cdt);
      parallel_ranges(*ctx_.pool, C, parts_per_task(*ctx_.pool, hkv), 64, 512, [&](int64_t b, int64_t e) {
        cpu::score_contig(cdt, d, G, qg, scale, crows + size_t(b) * crb, e - b, E + b, C);
      });
      auto& cand = S.cand;
      cand.resize(size_t(C));
      const int32_t* csize = W.size.data();
      int64_t nc = 0;
      for (int64_t c = 0; c < C; ++c) {  // the non-empty clusters, without a branch
        cand[size_t(nc)] = int32_t(c);
        nc += csize[c] > 0;
      }
      cand.resize(size_t(nc));
      const bool any_empty = nc < C && !mask_after_;
      // rank_dtype=model on a 16-bit KV: the distances come from rounded copies of the logits
      // (rank_row_model); E keeps the fp32 weights the estimation zone reads (the authors'
      // estimation recomputes its logits in fp32 from the same centroids).
      const DType rdt = rank_model_ ? ctx_.shape.kv_dtype : DType::F32;
      if (nc > 0)
        for (int g = 0; g < G; ++g) {
          float* e = E + size_t(g) * C;
          if (rdt != DType::F32) rank_row_model(rdt, e, C, csize, any_empty, S.rank, dist);
          if (any_empty)
            for (int64_t c = 0; c < C; ++c)
              if (csize[c] == 0) e[c] = -std::numeric_limits<float>::infinity();
          const float m = max_of(e, C);
          double z = cpu::exp_shift(e, C, m);
          if (any_empty) {  // exact zeros for the empty clusters (before_softmax)
            z = 0;
            for (int64_t c = 0; c < C; ++c) z += (e[c] = csize[c] > 0 ? e[c] : 0.f);
          }
          if (rdt == DType::F32) {
            const float inv = float(1.0 / z);
            for (int64_t c = 0; c < C; ++c) dist[c] += e[c] * inv;
          }
          S.mx[size_t(g)] = m;
        }
      if (rdt != DType::F32)
        for (int64_t c = 0; c < C; ++c) dist[c] = round_to(rdt, dist[c]);
      auto better = [&](int32_t a, int32_t b) {
        return dist[size_t(a)] > dist[size_t(b)] || (dist[size_t(a)] == dist[size_t(b)] && a < b);
      };
      // 2. Zones: cand[0, r) retrieval, cand[r, r + e) estimation.
      int64_t r, k2, er;
      // budget=session: part of cluster `part` (its rows ord[0, pm)), the unclustered tokens
      // [tb, lb) and [sb, sinks) attended besides the steady zone.
      int32_t part = -1;
      int64_t pm = 0, tb = lb, sb = std::min(sinks_, n);
      StepStats& st = hs[size_t(h)];
      bool est_sorted = false;
      if (!session_budget_) {
        r = std::min(L.r, nc);
        er = r;
        k2 = std::min(L.r + L.e, nc);
        // The top r and top k2 by (dist desc, id asc) through two value thresholds (the k2-th and
        // r-th largest distances, then one pass in id order that admits the ties lowest id first):
        // the same sets as a comparator selection, each zone listed in ascending cluster id.
        auto& v = S.vals;
        v.resize(size_t(nc));
        for (int64_t i = 0; i < nc; ++i) v[size_t(i)] = dist[cand[size_t(i)]];
        const float inf = std::numeric_limits<float>::infinity();
        float t2 = k2 > 0 ? -inf : inf, t1 = inf;  // k2 = nc: everything; k2 = 0, r = 0: nothing
        // (radix select: the distances are >= +0.0, never -0.0 or NaN)
        if (k2 > 0 && k2 < nc) t2 = cpu::kth_largest(v.data(), nc, k2, S.rtmp);
        if (r > 0) t1 = cpu::kth_largest(v.data(), nc, r, S.rtmp);
        int64_t above1 = 0, above2 = 0;
        for (int64_t i = 0; i < nc; ++i) {
          const float x = dist[cand[size_t(i)]];
          above1 += x > t1;
          above2 += x > t2;
        }
        int64_t ties1 = r - above1, ties2 = k2 - above2;
        auto& zr = S.zr;
        auto& ze = S.ze;
        auto& zo = S.zo;
        zr.clear();
        ze.clear();
        zo.clear();
        for (int64_t i = 0; i < nc; ++i) {
          const int32_t c = cand[size_t(i)];
          const float x = dist[c];
          const bool in2 = x > t2 || (x == t2 && ties2 > 0);
          if (x == t2 && in2 && !(x > t2)) --ties2;
          const bool in1 = x > t1 || (x == t1 && ties1 > 0);
          if (x == t1 && in1 && !(x > t1)) --ties1;
          (in1 ? zr : in2 ? ze : zo).push_back(c);
        }
        std::copy(zr.begin(), zr.end(), cand.begin());
        std::copy(ze.begin(), ze.end(), cand.begin() + int64_t(zr.size()));
        std::copy(zo.begin(), zo.end(), cand.begin() + int64_t(zr.size() + ze.size()));
        est_sorted = true;
      } else {
        // Whole clusters in rank order while they fit the exact budget left after the steady zone;
        // the first that does not fit ends the retrieval zone (budget_unused_tokens says how much
        // of the budget stayed unused, budget_overrun_tokens how far the steady zone exceeds it).
        const int64_t room = lay.room;
        st.budget_overrun = double(lay.overrun);
        // cand[0, sorted) holds the best clusters in rank order, the rest unordered. Each time the
        // walk reaches its end the prefix grows by the next `want` clusters at least (their count
        // guessed from the room left and the mean cluster size, doubled): a radix select gives the
        // want-th largest distance of the rest, a pass moves every cluster at or above it to the
        // front, and only those are sorted (instead of partial_sorts over all C clusters).
        // The want-th largest distance of the clusters cand[from, nc) (radix select).
        auto kth_of_rest = [&](int64_t from, int64_t want) {
          auto& v = S.vals;
          v.resize(size_t(nc - from));
          for (int64_t j = from; j < nc; ++j) v[size_t(j - from)] = dist[cand[size_t(j)]];
          return cpu::kth_largest(v.data(), nc - from, want, S.rtmp);
        };
        const double mean_size = double(std::max<int64_t>(1, L.indexed_end - std::min(sinks_, n))) / double(std::max<int64_t>(1, nc));
        int64_t sorted = 0, i = 0, used = 0;
        while (i < nc) {
          if (i >= sorted) {
            const int64_t rest = nc - sorted;
            const int64_t want = std::max<int64_t>({64, sorted, int64_t(2.0 * double(room - used) / mean_size)});
            auto first = cand.begin() + sorted;
            if (want >= rest) {
              std::sort(first, cand.end(), better);
              sorted = nc;
            } else {
              const float t = kth_of_rest(sorted, want);
              const auto mid = std::partition(first, cand.end(), [&](int32_t c) { return dist[size_t(c)] >= t; });
              std::sort(first, mid, better);
              sorted = int64_t(mid - cand.begin());
            }
          }
          const int64_t sz = W.size[size_t(cand[size_t(i)])];
          if (sz > room - used) break;
          used += sz;
          ++i;
        }
        r = i;
        if (scaled && used < room && r < nc) {
          // Part of the next cluster (it does not fit whole): its rows of highest exact score (the
          // largest logit over the group), then no longer estimated.
          part = cand[size_t(r)];
          const int64_t b = W.start[size_t(part)], m = W.size[size_t(part)];
          pm = std::min(room - used, m);
          // The cluster's key rows are contiguous (cluster order): one score pass of the group over
          // them (the centroid GEMV's kernel), then the largest logit per row.
          auto& sc = S.vals;
          S.part.resize(size_t(G) * m);
          const size_t rb = size_t(d) * dtype_size(ctx_.shape.kv_dtype);
          cpu::score_contig(ctx_.shape.kv_dtype, d, G, qg, scale, W.keys.data() + size_t(b) * rb, m, S.part.data());
          sc.assign(S.part.begin(), S.part.begin() + m);
          for (int g = 1; g < G; ++g)
            for (int64_t j = 0; j < m; ++j) sc[size_t(j)] = std::max(sc[size_t(j)], S.part[size_t(g) * m + j]);
          auto& ord = S.zo;
          ord.resize(size_t(m));
          for (int64_t j = 0; j < m; ++j) ord[size_t(j)] = int32_t(j);
          std::partial_sort(ord.begin(), ord.begin() + pm, ord.end(), [&](int32_t a, int32_t c2) {
            return sc[size_t(a)] > sc[size_t(c2)] || (sc[size_t(a)] == sc[size_t(c2)] && a < c2);
          });
          ord.resize(size_t(pm));
          used += pm;
        }
        if (scaled) {
          // Unclustered tokens outside the steady zone, most recent first: the tail waiting for
          // the next index update, then the sinks beyond the scaled ones.
          const int64_t tail = std::min(room - used, lb - L.indexed_end);
          tb = lb - tail;
          used += tail;
          const int64_t head = std::min(room - used, std::min(sinks_, n) - sk);
          sb = std::min(sinks_, n) - head;
          used += head;
        }
        st.budget_unused = double(room - used);
        er = r + (part >= 0 ? 1 : 0);
        k2 = std::min(nc, er + L.e);
        if (k2 > sorted && k2 < nc) {
          // The next k2 - sorted clusters in rank order, unordered (nth_element's set): those above
          // the (k2 - sorted)-th largest distance of the rest, then its ties lowest id first.
          const int64_t want = k2 - sorted;
          auto first = cand.begin() + sorted;
          const float t = kth_of_rest(sorted, want);
          const auto above = std::partition(first, cand.end(), [&](int32_t c) { return dist[size_t(c)] > t; });
          const auto tied = std::partition(above, cand.end(), [&](int32_t c) { return dist[size_t(c)] == t; });
          const auto end = first + want;  // above <= end <= tied
          if (end < tied) std::nth_element(above, end, tied);
        }
      }
      // 3. Exact part: steady zone + retrieval clusters (original positions, ascending).
      auto& list = out.lists[size_t(h)];
      list.clear();
      list.reserve(size_t(steady) + size_t(16 * r));
      for (int64_t t = 0; t < sk; ++t) list.push_back(int32_t(t));
      for (int64_t t = sb; t < std::min(sinks_, n); ++t) list.push_back(int32_t(t));
      // The retrieval clusters' positions (all in [sinks, indexed_end), distinct) in ascending order
      // through a bitmap over that range instead of a sort.
      int64_t rt = 0;
      const int64_t lo = std::min(sinks_, n);
      auto& bits = S.bits;
      bits.assign(size_t((L.indexed_end - lo + 63) / 64), 0);
      for (int64_t i = 0; i < r; ++i) {
        const int32_t c = cand[size_t(i)];
        const int32_t* p = W.pos.data() + W.start[size_t(c)];
        const int32_t m = W.size[size_t(c)];
        uint64_t* bw = bits.data();
        for (int32_t j = 0; j < m; ++j) {
          const uint64_t o = uint64_t(p[j] - lo);
          bw[o >> 6] |= uint64_t(1) << (o & 63);
        }
        rt += m;
      }
      for (int64_t j = 0; j < pm; ++j) {
        const uint64_t o = uint64_t(W.pos[size_t(W.start[size_t(part)] + S.zo[size_t(j)])] - lo);
        bits[o >> 6] |= uint64_t(1) << (o & 63);
      }
      for (size_t w = 0; w < bits.size(); ++w)
        for (uint64_t x = bits[w]; x; x &= x - 1) list.push_back(int32_t(lo + int64_t(w) * 64 + __builtin_ctzll(x)));
      for (int64_t t = tb; t < n; ++t) list.push_back(int32_t(t));
      // 4. Estimation zone (eqs. 2-4): lse = mx + log sum s_i E_i, o = sum E_i VS_i / sum s_i E_i.
      int64_t et = 0;
      for (int64_t i = er; i < k2; ++i) et += W.size[size_t(cand[size_t(i)])];
      if (k2 > er) {
        // Meta rows in ascending cluster order (address order, prefetched ahead), each read once for
        // the whole group; fp32 numerators, fp64 denominators. 16-bit meta rows hold value means,
        // so their weight is E_i * size_i (VS_i = size_i * mean_i).
        if (!est_sorted) {
          // Ascending cluster ids through a bitmap over the clusters instead of a sort.
          auto& eb = S.cbits;
          eb.assign(size_t((C + 63) / 64), 0);
          for (int64_t i = er; i < k2; ++i) eb[size_t(cand[size_t(i)]) >> 6] |= uint64_t(1) << (cand[size_t(i)] & 63);
          int32_t* w = cand.data() + er;
          for (size_t x = 0; x < eb.size(); ++x)
            for (uint64_t y = eb[x]; y; y &= y - 1) *w++ = int32_t(int64_t(x) * 64 + __builtin_ctzll(y));
        }
        const DType mt = m16 ? W.mdt : DType::F32;
        const size_t mrb = size_t(d) * dtype_size(mt);
        const std::byte* meta = m16 ? W.dvmean.data() : reinterpret_cast<const std::byte*>(W.value_sum.data());
        S.num.assign(size_t(G) * d, 0.f);
        S.dens.assign(size_t(G), 0.0);
        S.a.resize(size_t(G));
        const bool vec = kAvx2 && d % 8 == 0;
        constexpr int64_t kAhead = 8;
        for (int64_t i = er; i < k2; ++i) {
          if (i + kAhead < k2) {
            const std::byte* nx = meta + size_t(cand[size_t(i + kAhead)]) * mrb;
            for (size_t o = 0; o < mrb; o += 64) __builtin_prefetch(nx + o);
          }
          const int32_t c = cand[size_t(i)];
          const double sz = W.size[size_t(c)];
          for (int g = 0; g < G; ++g) {
            const float w = E[size_t(g) * C + size_t(c)];
            S.dens[size_t(g)] += double(w) * sz;
            S.a[size_t(g)] = m16 ? w * float(sz) : w;
          }
          const std::byte* row = meta + size_t(c) * mrb;
          if (vec) accumulate_row_avx2(row, mt, d, G, S.a.data(), S.num.data());
          else accumulate_row_portable(row, mt, d, G, S.a.data(), S.num.data());
        }
        for (int g = 0; g < G; ++g) {
          const double den = S.dens[size_t(g)];
          const float* nu = S.num.data() + size_t(g) * d;
          if (den > 0) {
            float* o = est_o_.data() + (size_t(h) * G + g) * d;
            for (int j = 0; j < d; ++j) o[j] = float(double(nu[j]) / den);
            est_lse_[size_t(h) * G + g] = float(double(S.mx[size_t(g)]) + std::log(den));
          }
        }
      }
      st.retrieval_clusters = double(r);
      st.retrieval_tokens = double(rt);
      st.estimation_clusters = double(k2 - er);
      st.estimation_tokens = double(et);
      st.steady_tokens = double(steady);
      st.fill_tokens = double(pm + (lb - tb) + (std::min(sinks_, n) - sb));
      if (probe_ > 0) probe_recall(W, qg, S.dist, cand, probe[size_t(h)], probe_cl[size_t(h)]);
    });
    last_ = StepStats{};
    for (auto& s : hs) {
      last_.retrieval_clusters += s.retrieval_clusters / hkv;
      last_.retrieval_tokens += s.retrieval_tokens / hkv;
      last_.estimation_clusters += s.estimation_clusters / hkv;
      last_.estimation_tokens += s.estimation_tokens / hkv;
      last_.steady_tokens += s.steady_tokens / hkv;
      last_.fill_tokens += s.fill_tokens / hkv;
      last_.budget_unused += s.budget_unused / hkv;
      last_.budget_overrun += s.budget_overrun / hkv;
    }
    sum_budget_unused_ += last_.budget_unused;
    sum_budget_overrun_ += last_.budget_overrun;
    ++steps_;
    if (probe_ > 0)
      for (int h = 0; h < hkv; ++h) {
        probe_sum_ += probe[size_t(h)];
        probe_cl_sum_ += probe_cl[size_t(h)];
        ++probe_n_;
      }
    est_layer_ = int64_t(layer);
    est_any_ = last_.estimation_clusters > 0;
  }

  bool extra(uint32_t layer, const float*, const KVLayer&, float* o, float* lse) override {
    if (est_layer_ != int64_t(layer) || !est_any_) return false;
    std::memcpy(o, est_o_.data(), est_o_.size() * sizeof(float));
    std::memcpy(lse, est_lse_.data(), est_lse_.size() * sizeof(float));
    return true;
  }

  // ------------------------------------------------------------------------------------------
  // Tables

  nlohmann::json save_meta() const override {
    nlohmann::json meta = nlohmann::json::object();
    meta["layout"] =
        "per layer and KV head: centroids [C][d] f32, value_sum [C][d] f32, size [C] i32, pos [R] i32, keys/values "
        "[R][d] kv dtype, rows cluster by cluster (start[c] = sum of earlier sizes)";
    nlohmann::json layers = nlohmann::json::object();
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      if (L.chunks.empty()) continue;
      nlohmann::json j;
      j["indexed_end"] = L.indexed_end;
      j["clusters"] = L.clusters();
      j["retrieval_clusters"] = L.r;
      j["estimation_clusters"] = L.e;
      int64_t mx = 0, empty = 0;
      for (const auto& h : L.heads)
        for (int32_t s : h.size) mx = std::max<int64_t>(mx, s), empty += s == 0;
      j["max_cluster_size"] = mx;
      j["empty_clusters"] = empty;
      nlohmann::json ch = nlohmann::json::array();
      for (const auto& c : L.chunks)
        ch.push_back({{"tokens", {c.tok_begin, c.tok_end}}, {"clusters", {c.clu_begin, c.clu_end}},
                      {"segments", c.segments}, {"r_add", c.r_add}, {"e_add", c.e_add}, {"build_ms", c.build_ms}});
      j["chunks"] = ch;
      layers[std::to_string(l)] = j;
    }
    meta["layers"] = layers;
    return meta;
  }

  void save(io::TablesWriter& w) const override {
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      if (L.chunks.empty()) continue;
      for (size_t h = 0; h < L.heads.size(); ++h) {
        const auto& H = L.heads[h];
        const int32_t li = int32_t(l), hi = int32_t(h);
        w.add("retroinfer.centroids", li, hi, {io::Piece{H.centroids.data(), H.centroids.size() * sizeof(float)}});
        w.add("retroinfer.value_sum", li, hi, {io::Piece{H.value_sum.data(), H.value_sum.size() * sizeof(float)}});
        w.add("retroinfer.size", li, hi, {io::Piece{H.size.data(), H.size.size() * sizeof(int32_t)}});
        w.add("retroinfer.pos", li, hi, {io::Piece{H.pos.data(), H.pos.size() * sizeof(int32_t)}});
        w.add("retroinfer.keys", li, hi, {io::Piece{H.keys.data(), H.keys.size()}});
        w.add("retroinfer.values", li, hi, {io::Piece{H.values.data(), H.values.size()}});
      }
    }
  }

  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    const int d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
    const size_t rb = size_t(d) * dtype_size(ctx_.shape.kv_dtype);
    // Header numbers are range-checked at their type before they are used (io/header.hpp); token
    // and cluster counts are below 2^31, so every size below fits in size_t.
    const io::HeaderReader hm(f.path(), "method.meta");
    const nlohmann::json layers = hm.has(meta, "layers") ? hm.object(meta, "layers") : nlohmann::json::object();
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      L = LayerIndex{};
      L.generation = L.lineage = ++generation_;
      L.indexed_end = sinks_;
      const auto key = std::to_string(l);
      if (!layers.contains(key)) continue;
      auto bad = [&](const std::string& what) {
        fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "retroinfer tables, layer " + key + ": " + what);
      };
      const auto hl = hm.sub("layers").sub(key);
      const auto& j = hm.sub("layers").object(layers, key);
      L.indexed_end = hl.integer<int64_t>(j, "indexed_end", 0, kTok);
      const int64_t C = hl.integer<int64_t>(j, "clusters", 1, kTok);
      L.r = hl.integer<int64_t>(j, "retrieval_clusters", 0, C);
      L.e = hl.integer<int64_t>(j, "estimation_clusters", 0, C);
      const auto& chunks = hl.array(j, "chunks");
      for (size_t ci = 0; ci < chunks.size(); ++ci) {
        const auto hc = hl.sub("chunks").sub(std::to_string(ci));
        const auto& c = chunks[ci];
        const auto& tk = hc.array(c, "tokens");
        const auto& cl = hc.array(c, "clusters");
        if (tk.size() != 2) hc.fail("tokens", "expected [begin, end]");
        if (cl.size() != 2) hc.fail("clusters", "expected [begin, end]");
        Chunk ch{};
        ch.tok_begin = hc.integer_value<int64_t>(tk[0], "tokens.0", 0, kTok);
        ch.tok_end = hc.integer_value<int64_t>(tk[1], "tokens.1", ch.tok_begin, kTok);
        ch.clu_begin = hc.integer_value<int64_t>(cl[0], "clusters.0", 0, C);
        ch.clu_end = hc.integer_value<int64_t>(cl[1], "clusters.1", ch.clu_begin, C);
        ch.segments = hc.integer<int64_t>(c, "segments", 1, kTok);
        ch.r_add = hc.integer<int64_t>(c, "r_add", 0, C);
        ch.e_add = hc.integer<int64_t>(c, "e_add", 0, C);
        ch.build_ms = hc.number(c, "build_ms", 0.0, std::numeric_limits<double>::max());
        L.chunks.push_back(ch);
      }
      const int64_t rows = L.indexed_end - sinks_;
      if (L.chunks.empty() || rows < 1 || L.chunks.front().tok_begin != sinks_ ||
          L.chunks.back().tok_end != L.indexed_end || L.chunks.back().clu_end != C)
        bad("chunks do not cover the indexed tokens and clusters (different sinks parameter?)");
      L.heads.resize(size_t(hkv));
      for (int h = 0; h < hkv; ++h) {
        auto& H = L.heads[size_t(h)];
        auto sec = [&](const char* tag, uint64_t bytes) {
          const auto& s = f.require(tag, int32_t(l), h);
          if (s.length != bytes)
            bad(std::string(tag) + " head " + std::to_string(h) + ": expected " + std::to_string(bytes) +
                " bytes, got " + std::to_string(s.length));
          return s.data;
        };
        // The section's size is checked before anything is allocated for it.
        auto copy = [&](auto& v, const char* tag, size_t count) {
          const std::byte* src = sec(tag, count * sizeof(v[0]));
          v.resize(count);
          std::memcpy(v.data(), src, count * sizeof(v[0]));
        };
        copy(H.centroids, "retroinfer.centroids", size_t(C) * d);
        copy(H.value_sum, "retroinfer.value_sum", size_t(C) * d);
        copy(H.size, "retroinfer.size", size_t(C));
        copy(H.pos, "retroinfer.pos", size_t(rows));
        copy(H.keys, "retroinfer.keys", size_t(rows) * rb);
        copy(H.values, "retroinfer.values", size_t(rows) * rb);
        H.start.resize(size_t(C));
        int64_t at = 0;
        for (int64_t c = 0; c < C; ++c) {
          if (H.size[size_t(c)] < 0) bad("negative cluster size");
          H.start[size_t(c)] = at;
          at += H.size[size_t(c)];
        }
        if (at != rows) bad("cluster sizes do not add up to the indexed tokens");
        for (int32_t p : H.pos)
          if (p < sinks_ || p >= L.indexed_end) bad("a list position lies outside the indexed tokens");
        H.sync_decode(decode_dtype(), d);
      }
    }
  }

  std::unique_ptr<Method> clone() const override { return std::make_unique<RetroInfer>(*this); }

  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    if (layers_[layer].indexed_end <= tokens) return true;
    *why = "its retroinfer clusters index tokens up to " + std::to_string(layers_[layer].indexed_end);
    return false;
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (const auto& L : layers_)
      for (const auto& h : L.heads) b += h.bytes();
    return b;
  }

  bool stat(std::string_view name, double* out) const override {
    if (name == "retrieval_clusters") *out = last_.retrieval_clusters;
    else if (name == "retrieval_tokens") *out = last_.retrieval_tokens;
    else if (name == "estimation_clusters") *out = last_.estimation_clusters;
    else if (name == "estimation_tokens") *out = last_.estimation_tokens;
    else if (name == "steady_tokens") *out = last_.steady_tokens;
    else if (name == "fill_tokens") *out = last_.fill_tokens;
    else if (name == "budget_unused_tokens") *out = last_.budget_unused;
    else if (name == "budget_overrun_tokens") *out = last_.budget_overrun;
    else if (name == "mean_budget_unused_tokens") *out = steps_ ? sum_budget_unused_ / double(steps_) : 0.0;
    else if (name == "mean_budget_overrun_tokens") *out = steps_ ? sum_budget_overrun_ / double(steps_) : 0.0;
    else if (name == "clusters") {
      double c = 0;
      for (const auto& L : layers_) c += double(L.clusters());
      *out = c;
    } else if (name == "indexed_tokens") {
      double c = 0;
      for (const auto& L : layers_) c += double(L.heads.empty() ? 0 : L.heads[0].rows());
      *out = c;
    } else if (name == "index_updates") {
      double c = 0;
      for (const auto& L : layers_) c += L.chunks.empty() ? 0.0 : double(L.chunks.size() - 1);
      *out = c;
    } else if (name == "build_ms") {
      double c = 0;
      for (const auto& L : layers_)
        for (const auto& ch : L.chunks) c += ch.build_ms;
      *out = c;
    } else if (name == "probe_recall") *out = probe_n_ ? probe_sum_ / double(probe_n_) : 0.0;
    else if (name == "probe_clusters") *out = probe_n_ ? probe_cl_sum_ / double(probe_n_) : 0.0;
    else return false;
    return true;
  }

 private:
  // Clusters tokens [b, e) of every head (s segments, C clusters) and appends them.
  void add_chunk(uint32_t layer, const KVLayer& kv, int64_t b, int64_t e, int64_t s, int64_t C, int64_t r_add,
                 int64_t e_add) {
    const auto t0 = std::chrono::steady_clock::now();
    auto& L = layers_[layer];
    const int d = int(ctx_.shape.head_dim), hkv = int(ctx_.shape.num_kv_heads);
    const int64_t m = e - b;
    retro::KMeansConfig cfg{C, s, int(iterations_), centre_, raw_init_};
    std::vector<std::vector<int32_t>> assign;
    std::vector<std::vector<float>> cent;
    if (clusterer_) {
      clusterer_(layer, b, m, cfg, assign, cent);
    } else {
      std::vector<std::vector<float>> X(size_t(hkv), std::vector<float>(size_t(m) * d));
      ctx_.pool->parallel_for(hkv, [&](int64_t h) {
        for (int64_t t = 0; t < m; ++t)
          convert_to_f32(kv.k_row(int(h), b + t), kv.dtype(), X[size_t(h)].data() + size_t(t) * d, size_t(d));
      });
      std::vector<float*> xp;
      for (auto& x : X) xp.push_back(x.data());
      retro::segmented_kmeans(xp, m, d, cfg, *ctx_.pool, cpu::GemmProvider(ctx_.gemm), assign, cent);
    }
    if (L.heads.empty()) L.heads.resize(size_t(hkv));
    const int64_t c0 = L.clusters();
    std::vector<DType> mdt_before;
    for (const auto& H : L.heads) mdt_before.push_back(H.mdt);
    ctx_.pool->parallel_for(hkv, [&](int64_t h) {
      retro::append_clusters(L.heads[size_t(h)], kv, int(h), b, m, assign[size_t(h)].data(), cent[size_t(h)].data(), C);
      L.heads[size_t(h)].sync_decode(decode_dtype(), d);
    });
    L.r += r_add;
    L.e += e_add;
    L.indexed_end = e;
    L.generation = ++generation_;
    // An append keeps the lineage (retro::IndexView), unless a head's 16-bit meta copy was encoded
    // again in bf16 (a value past fp16's range): its rows seen before changed.
    for (size_t h = 0; h < L.heads.size(); ++h)
      if (L.heads[h].mdt != mdt_before[h]) L.lineage = L.generation;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    L.chunks.push_back(Chunk{b, e, c0, c0 + C, s, r_add, e_add, ms});
  }

  // The dtype decode reads the meta index in (meta_dtype): auto = fp16 for a 16-bit KV (bf16 for a
  // head beyond fp16's range), fp32 for an fp32 KV; kv = the KV dtype (the authors' model dtype).
  DType decode_dtype() const {
    if (meta_dtype_ == "f32") return DType::F32;
    if (meta_dtype_ == "bf16") return DType::BF16;
    if (meta_dtype_ == "f16") return DType::F16;
    if (meta_dtype_ == "kv") return ctx_.shape.kv_dtype;
    return ctx_.shape.kv_dtype == DType::F32 ? DType::F32 : DType::F16;
  }

  // Incremental update: once more than update_segment tokens lie between the index and the local
  // window, the oldest update_segment of them are clustered alone (one segment) and appended. The
  // authors check before appending a decode token (decode_update_kv_cache: a steady zone of
  // sinks + local + UPDATE_SEGMENT is clustered, then the token appended); this runs after the
  // append, hence "more than": the same tokens are clustered at the same step.
  // A layer without an index waits for more than index_min such tokens (the prompt's rule), then
  // clusters them update_segment at a time.
  void update(uint32_t layer, const KVLayer& kv) {
    auto& L = layers_[layer];
    while (update_due(L, kv.size())) {
      const int64_t C = update_kmeans().clusters;
      // UPDATE_NPROBE and UPDATE_ES: Python round, at least 1 cluster each (estimation 0 stays off:
      // the authors' max(..., 1) would estimate one cluster per update even then).
      const int64_t r_add = retrieval_ > 0 ? std::max<int64_t>(retro::round_half_even(double(C) * retrieval_), 1) : 0;
      const int64_t e_add = estimation_ > 0 ? std::max<int64_t>(retro::round_half_even(double(C) * estimation_), 1) : 0;
      add_chunk(layer, kv, L.indexed_end, L.indexed_end + update_, 1, C, r_add, e_add);
    }
  }

  // The fewest clusterable tokens (past the sinks, before the local window) a layer is indexed at.
  int64_t min_index() const { return index_min_ > 0 ? index_min_ : update_; }
  bool update_due(const LayerIndex& L, int64_t n) const {
    const int64_t waiting = n - local_ - L.indexed_end;
    return waiting > update_ && (!L.chunks.empty() || waiting > min_index());
  }
  // The k-means of one update (update_segment tokens, one segment): C clusters (UPDATE_CENTROIDS).
  retro::KMeansConfig update_kmeans() const {
    const int64_t C = std::min(retro::update_cluster_count(update_, cluster_size_, align_), update_);
    return retro::KMeansConfig{C, 1, int(iterations_), centre_, raw_init_};
  }

  // recall@k of the clustering (Fig. 17b): clusters in rank order until they hold >= k tokens;
  // the share of the exact top-k indexed tokens (by the group's summed softmax) they contain.
  void probe_recall(const WaveHead& W, const float* qg, const std::vector<float>& dist, std::vector<int32_t> cand,
                    double& recall, double& clusters) const {
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
    const int64_t R = W.rows();
    const int64_t k = std::min<int64_t>(probe_, R);
    std::vector<double> sc(size_t(G) * R), agg(size_t(R), 0.0);
    std::vector<float> row(static_cast<size_t>(d));
    const size_t rb = size_t(d) * dtype_size(ctx_.shape.kv_dtype);
    for (int64_t j = 0; j < R; ++j) {
      convert_to_f32(W.keys.data() + size_t(j) * rb, ctx_.shape.kv_dtype, row.data(), size_t(d));
      for (int g = 0; g < G; ++g) {
        double s = 0;
        for (int i = 0; i < d; ++i) s += double(qg[size_t(g) * d + i]) * row[size_t(i)];
        sc[size_t(g) * R + j] = s * ctx_.shape.softmax_scale;
      }
    }
    for (int g = 0; g < G; ++g) {
      const double* s = sc.data() + size_t(g) * R;
      const double m = *std::max_element(s, s + R);
      double z = 0;
      for (int64_t j = 0; j < R; ++j) z += std::exp(s[j] - m);
      for (int64_t j = 0; j < R; ++j) agg[size_t(j)] += std::exp(s[j] - m) / z;
    }
    std::vector<int64_t> rows(static_cast<size_t>(R));
    for (int64_t j = 0; j < R; ++j) rows[size_t(j)] = j;
    std::nth_element(rows.begin(), rows.begin() + (k - 1), rows.end(),
                     [&](int64_t a, int64_t b) { return agg[size_t(a)] > agg[size_t(b)] || (agg[size_t(a)] == agg[size_t(b)] && a < b); });
    std::vector<char> top(size_t(R), 0);
    for (int64_t j = 0; j < k; ++j) top[size_t(rows[size_t(j)])] = 1;
    std::sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) {
      return dist[size_t(a)] > dist[size_t(b)] || (dist[size_t(a)] == dist[size_t(b)] && a < b);
    });
    int64_t got = 0, hits = 0, used = 0;
    for (int32_t c : cand) {
      if (got >= k) break;
      for (int64_t j = W.start[size_t(c)]; j < W.start[size_t(c)] + W.size[size_t(c)]; ++j) hits += top[size_t(j)];
      got += W.size[size_t(c)];
      ++used;
    }
    recall = k > 0 ? double(hits) / double(k) : 0.0;
    clusters = double(used);
  }

  friend retro::IndexView retro::index_view(const Method&, uint32_t);
  friend bool retro::update_due(const Method&, uint32_t, int64_t);
  friend retro::StepLayout retro::step_layout(const Method&, uint32_t, int64_t, int64_t);
  friend retro::Rules retro::rules(const Method&);
  friend void retro::record_steps(Method&, const retro::StepFigures&, double, double, int64_t);
  friend void retro::set_clusterer(Method&, retro::Clusterer);
  retro::Clusterer clusterer_;  // null: the CPU k-means (retro::set_clusterer)

  MethodContext ctx_;
  uint64_t generation_ = 0;
  int64_t sinks_, local_, cluster_size_, segment_size_, iterations_, align_;
  double retrieval_, estimation_;
  int64_t update_;
  int64_t index_min_;  // 0: update_ (min_index())
  bool session_budget_;
  double steady_share_;
  bool centre_;
  int64_t probe_;
  std::string meta_dtype_;
  bool from_prompt_, raw_init_, mask_after_, rank_model_;
  std::vector<LayerIndex> layers_;
  // The last select's estimation state ([Hkv*G][d], [Hkv*G]) for extra().
  std::vector<float> est_o_, est_lse_;
  std::vector<HeadScratch> scratch_;  // per KV head
  int64_t est_layer_ = -1;
  bool est_any_ = false;
  StepStats last_;
  int64_t steps_ = 0;
  double sum_budget_unused_ = 0, sum_budget_overrun_ = 0;
  double probe_sum_ = 0, probe_cl_sum_ = 0;
  int64_t probe_n_ = 0;
};

}  // namespace

namespace retro {
namespace {
const RetroInfer& as_retro(const Method& m) {
  const auto* r = dynamic_cast<const RetroInfer*>(&m);
  if (!r) fail(KVS_STATUS_INTERNAL, "retroinfer: the host index is not the retroinfer method");
  return *r;
}
}  // namespace

IndexView index_view(const Method& m, uint32_t layer) {
  const auto& L = as_retro(m).layers_[layer];
  return IndexView{&L.heads, L.indexed_end, L.r, L.e, L.generation, L.lineage};
}
bool update_due(const Method& m, uint32_t layer, int64_t n) {
  const auto& r = as_retro(m);
  return r.update_due(r.layers_[layer], n);
}
StepLayout step_layout(const Method& m, uint32_t layer, int64_t n, int64_t budget_keys) {
  return as_retro(m).layout(layer, n, budget_keys);
}
Rules rules(const Method& m) {
  const auto& r = as_retro(m);
  return Rules{r.sinks_, r.local_, r.update_, r.mask_after_, r.rank_model_, !r.session_budget_, r.update_kmeans(),
               r.min_index()};
}
void set_clusterer(Method& m, Clusterer c) { const_cast<RetroInfer&>(as_retro(m)).clusterer_ = std::move(c); }
void record_steps(Method& m, const StepFigures& f, double sum_unused, double sum_overrun, int64_t steps) {
  auto& r = const_cast<RetroInfer&>(as_retro(m));
  r.last_ = StepStats{f.retrieval_clusters, f.retrieval_tokens, f.estimation_clusters, f.estimation_tokens,
                      f.steady_tokens,      f.fill_tokens,      f.budget_unused,       f.budget_overrun};
  r.sum_budget_unused_ = sum_unused;
  r.sum_budget_overrun_ = sum_overrun;
  r.steps_ = steps;
}
}  // namespace retro

std::unique_ptr<DeviceMethod> make_retroinfer_cuda(const MethodContext&, const ParamSet&);  // retroinfer_cuda.cpp

MethodSpec retroinfer_spec() {
  return MethodSpec{
      "retroinfer",
      "RetroInfer wave index: segmented spherical k-means clusters; the session budget attended exactly (a scaled "
      "steady zone of sinks+local, then clusters in rank order; preset=paper: the top 1.8%), next 23.2% of the "
      "clusters estimated from centroids/sizes/value sums, LSE-merged (docs/methods/retroinfer.md)",
      1u << KVS_BACKEND_CPU,
      0.05,
      {{"preset", "enum:kvsieve|paper", "kvsieve",
        "paper: every parameter below that has a paper value takes it (the authors' code, "
        "microsoft/RetrievalAttention); parameters given explicitly win"},
       {"sinks", "int", "4", "steady zone: first tokens always attended, never clustered (static_pattern_start)", "4"},
       {"local", "int", "64", "steady zone: last tokens always attended, never clustered (static_pattern_end)", "64"},
       {"cluster_size", "int", "16", "average tokens per cluster: clusters = round(n / cluster_size) (avg_cluster_size)", "16"},
       {"segment_size", "int", "8192", "k-means segment length in tokens; segments = max(round(n / segment_size), 1); 0 = whole context", "8192"},
       {"cluster_basis", "enum:prompt|indexed", "prompt",
        "n in the cluster and segment counts: the whole prompt length (config.py) or the clustered tokens only "
        "(prompt minus the steady zone)", "prompt"},
       {"iterations", "int", "10", "k-means iterations: iterations-1 per-segment spherical passes + 1 global un-normalised pass", "10"},
       {"kmeans_init", "enum:raw|normalised", "raw",
        "initial centroids: the raw (centred) keys at evenly spaced positions of the whole run (kmeans.py), or "
        "per-segment positions L2-normalised", "raw"},
       {"cluster_align", "int", "8", "cluster counts are multiples of lcm(cluster_align, segments) (authors' kernel tile)", "8"},
       {"retrieval", "float", "0.018", "retrieval zone: fraction of clusters attended exactly (at least 1 when > 0)", "0.018"},
       {"estimation", "float", "0.232", "estimation zone: fraction of clusters estimated from centroids (0 = off)", "0.232"},
       {"mask_empty", "enum:after_softmax|before_softmax", "after_softmax",
        "empty clusters in the ranking: dropped after the group's softmaxes over every centroid are summed (the "
        "authors' code), or left out of the softmax", "after_softmax"},
       {"update_segment", "int", "64",
        "generated tokens clustered on their own and appended once that many wait past the index "
        "(UPDATE_SEGMENT; chosen on the tuning texts: docs/accuracy.md)", "1024"},
       {"index_min", "int", "1024",
        "clusterable tokens (past the sinks, before the local window) a layer needs before it is indexed: at the "
        "build, or at the first update once more than max(index_min, update_segment) wait; shorter contexts take "
        "the steady zone (streaming's keys); 0 = update_segment (the authors' rule)", "0"},
       {"budget", "enum:paper|session", "session",
        "session: the exact keys (steady zone + retrieval zone) fill the session budget: the steady zone takes at "
        "most steady_share of it, whole clusters in rank order the rest, then part of the next cluster and "
        "unclustered tokens up to the budget; below the indexing threshold the sinks and the most recent tokens; "
        "paper: r = retrieval x clusters, fixed steady zone (session budget ignored)", "paper"},
       {"steady_share", "float", "0.75",
        "budget=session: the steady zone (sinks + local) takes at most this share of the budget, sinks at most an "
        "eighth of it, so it scales down at small budgets; 0 = the fixed sinks + local + unclustered tail, whole "
        "clusters only (the budget may be exceeded: budget_overrun_tokens)", "0"},
       {"centre", "bool", "true", "subtract the keys' mean before clustering (added back to the centroids)", "true"},
       {"meta_dtype", "enum:auto|kv|f16|bf16|f32", "auto",
        "dtype decode reads the centroids and value means in (a derived copy; half the bytes per step when 16-bit): "
        "auto = f16 for a 16-bit KV, f32 for an f32 KV; kv = the KV dtype (the authors keep the meta index in the "
        "model dtype); f16 falls back to bf16 for a head beyond fp16's range", "kv"},
       {"rank_dtype", "enum:f32|model", "f32",
        "precision of the cluster ranking: f32, or model = the KV dtype (the authors' batch_gemm_softmax and "
        "torch.sum): logits, each head's softmax outputs and the group's sum rounded to it (f32 KV: the same as f32)",
        "model"},
       {"cache_ratio", "float", "0.05",
        "wave buffer (cuda backend with the KV cache in pinned host memory, kv_memory = KVS_DEVICE_CUDA_HOST): the GPU "
        "block cache holds this fraction of each KV head's clustered rows (blocks of 8 rows of one cluster, LRU over "
        "clusters); 0 = no cache (every retrieved row read over the bus); not used elsewhere", "0.05"},
       {"wave_misses", "enum:stage|copy|inplace", "stage",
        "wave buffer, the rows of clusters the cache misses: stage = gathered from host memory by one kernel into an "
        "execution buffer in GPU memory that the attention reads, the admissions copying from there after the host's "
        "LRU decision (each row over the bus once, the host off the critical path; the authors' design); copy = "
        "admitted into the cache first, the attention waiting for the host's decision; inplace = read by the "
        "attention from host memory, the admissions reading them again"},
       {"recall_probe", "int", "0", "k > 0: measure the clustering's recall@k each step (stat probe_recall; slow, exact scores)"}},
      [](const MethodContext& c, const ParamSet& p) { return std::make_unique<RetroInfer>(c, p); },
      KVS_CUDA_IMPL(make_retroinfer_cuda)};
}

}  // namespace kvs
