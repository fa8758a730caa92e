// SPDX-License-Identifier: Apache-2.0
// HGCA's far part on the host: every evicted entry with its MAW, the per-head salient sets stored
// contiguously (Alg. 1 lines 19-25, §3.2.2), padding of merged-head tasks and the threaded sparse
// attention (§3.3), and the mean attention used by the reconstructed prompt scoring and the re-evaluation (docs/methods/hgca.md).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "backends/cpu/attention.hpp"
#include "backends/cpu/gemm.hpp"
#include "backends/cpu/topk.hpp"
#include "core/error.hpp"
#include "methods/hgca/hgca.hpp"

namespace kvs::hgca {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Capacity for arrays that grow by a block per eviction, sized at a re-evaluation or a load: room
// for an eighth more, so the first evictions after the prompt do not copy the whole array (16 MB
// of MAW at 128K tokens, 8 ms on two cores) inside a decode step.
size_t headroom(size_t n) { return n + n / 8 + 4096; }
}  // namespace

FarStore::FarStore(const ModelShape& shape, const Params& p) : shape_(shape), p_(p) {
  row_ = size_t(shape.head_dim) * dtype_size(shape.kv_dtype);
  heads_.resize(shape.num_kv_heads);
}

float FarStore::agg(const float* w) const {
  const int G = shape_.group();
  if (p_.gqa == GqaAgg::Max) return *std::max_element(w, w + G);
  double s = 0;
  for (int g = 0; g < G; ++g) s += w[g];
  return float(s / G);
}

void FarStore::renormalise(Head& hd) {
  double sum = 0;
  for (float s : hd.score) sum += s;
  hd.weight.resize(hd.score.size());
  if (!(sum > 0)) {
    std::fill(hd.weight.begin(), hd.weight.end(), float(1.0 / double(hd.score.size())));
    return;
  }
  const double inv = 1.0 / sum;
  for (size_t i = 0; i < hd.score.size(); ++i) hd.weight[i] = float(double(hd.score[i]) * inv);
}

void FarStore::push(const KVLayer& kv, Head& hd, int h, int32_t t, float score) {
  hd.pos.push_back(t);
  hd.score.push_back(score);
  if (p_.cap) return;  // cap=budget reads its far keys from the layer's store: no contiguous copies
  const auto* k = kv.k_row(h, t);
  const auto* v = kv.v_row(h, t);
  hd.k.insert(hd.k.end(), k, k + row_);
  hd.v.insert(hd.v.end(), v, v + row_);
}

void FarStore::add_evicted(const KVLayer& kv, int64_t count, const float* maw, int64_t w_size, ThreadPool& pool,
                           bool test) {
  const int hq = int(shape_.num_q_heads), G = shape_.group();
  const double thr = p_.beta / double(w_size);
  maw_.insert(maw_.end(), maw, maw + size_t(count) * hq);
  // One task per KV head (its membership marks, salient entries and re-normalised weights).
  pool.parallel_for(int64_t(heads_.size()), [&](int64_t h) {
    Head& hd = heads_[size_t(h)];
    hd.in_ctx.resize(size_t(n_ + count), 0);
    bool changed = false;
    for (int64_t j = 0; test && j < count; ++j) {
      const float a = agg(maw + size_t(j) * hq + h * G);
      if (p_.beta == 0 || double(a) > thr) {
        push(kv, hd, int(h), int32_t(n_ + j), a);
        hd.in_ctx[size_t(n_ + j)] = 1;
        changed = true;
      }
    }
    if (changed) renormalise(hd);
  });
  n_ += count;  // the ranking merges the newcomers (limit): the older entries' ratios are unchanged
}

void FarStore::reevaluate(const KVLayer& kv, const float* a) {
  const int hq = int(shape_.num_q_heads), G = shape_.group();
  maw_.reserve(headroom(size_t(n_) * hq));
  maw_.assign(a, a + size_t(n_) * hq);
  reeval_n_ = n_;
  rank_dirty_ = true;
  const double thr = p_.beta / double(std::max<int64_t>(1, n_));
  for (size_t h = 0; h < heads_.size(); ++h) {
    Head& hd = heads_[h];
    hd.pos.clear();
    hd.score.clear();
    hd.k.clear();
    hd.v.clear();
    hd.in_ctx.reserve(headroom(size_t(n_)));
    hd.in_ctx.assign(size_t(n_), 0);
    for (int64_t t = 0; t < n_; ++t) {
      const float s = agg(a + size_t(t) * hq + h * G);
      if (p_.beta == 0 || double(s) > thr) {
        push(kv, hd, int(h), int32_t(t), s);
        hd.in_ctx[size_t(t)] = 1;
      }
    }
    renormalise(hd);
  }
}

void FarStore::repad(const KVLayer& kv, int heads_per_task) {
  if (armed_pad_ && !pad_saved_) {
    ck_pad_.resize(heads_.size());
    for (size_t h = 0; h < heads_.size(); ++h) ck_pad_[h] = std::move(heads_[h].pad);
    pad_saved_ = true;
  }
  for (auto& hd : heads_) hd.pad.clear();
  // Under the budget cap every head attends the same number of far keys: nothing to pad.
  if (!p_.pad || p_.cap || heads_per_task <= 1) return;
  const int hkv = int(heads_.size()), hq = int(shape_.num_q_heads), G = shape_.group();
  std::vector<int32_t> cand;
  std::vector<float> score(static_cast<size_t>(n_));
  for (int t0 = 0; t0 < hkv; t0 += heads_per_task) {
    const int t1 = std::min(hkv, t0 + heads_per_task);
    size_t longest = 0;
    for (int h = t0; h < t1; ++h) longest = std::max(longest, heads_[size_t(h)].pos.size());
    for (int h = t0; h < t1; ++h) {
      Head& hd = heads_[size_t(h)];
      const int64_t need = int64_t(longest - hd.pos.size());
      if (need <= 0) continue;
      cand.clear();
      for (int64_t t = 0; t < n_; ++t)
        if (!hd.in_ctx[size_t(t)]) {
          cand.push_back(int32_t(t));
          score[size_t(t)] = agg(maw_.data() + size_t(t) * hq + h * G);
        }
      auto better = [&](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
      const int64_t k = std::min<int64_t>(need, int64_t(cand.size()));
      if (k <= 0) continue;
      std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), better);
      cand.resize(size_t(k));
      std::sort(cand.begin(), cand.end(), better);
      hd.pad = cand;
    }
  }
}

int64_t FarStore::attend_plan(int heads_per_task) {
  const int hkv = int(heads_.size()), G = shape_.group(), d = int(shape_.head_dim);
  auto& f = fa_.v;
  f.hpt = std::max(1, heads_per_task);
  const int tasks = (hkv + f.hpt - 1) / f.hpt;
  f.len.assign(size_t(hkv), 0);
  std::vector<int64_t> task_len(static_cast<size_t>(tasks), 0);
  const bool lim = limit_ >= 0;
  for (int h = 0; h < hkv; ++h) {
    f.len[size_t(h)] = lim ? ranked_keys(h) : int64_t(heads_[size_t(h)].pos.size() + heads_[size_t(h)].pad.size());
    task_len[size_t(h / f.hpt)] = std::max(task_len[size_t(h / f.hpt)], f.len[size_t(h)]);
  }
  // Tasks of adjacent heads; a long task is cut into chunks of kFarChunk keys so every thread gets a
  // share (chunk states are merged by LSE like the window and far parts). A head's chunks do not
  // depend on the thread count, so neither does its output, bit for bit.
  const int64_t longest = tasks ? *std::max_element(task_len.begin(), task_len.end()) : 0;
  f.chunks = int(std::max<int64_t>(1, (longest + kFarChunk - 1) / kFarChunk));
  f.items.clear();
  for (int t = 0; t < tasks; ++t)
    for (int c = 0; c < std::max<int64_t>(1, (task_len[size_t(t)] + kFarChunk - 1) / kFarChunk); ++c) f.items.push_back({t, c});
  f.part_o.assign(size_t(hkv) * f.chunks * G * d, 0.f);
  f.part_lse.assign(size_t(hkv) * f.chunks * G, kNegInf);
  // Widened far sets come with their scores (widen computed them for this query).
  f.scored = lim && widened_ && score_.v.size() == heads_.size() && chosen_at_.size() == heads_.size();
  for (int h = 0; f.scored && h < hkv; ++h) f.scored = chosen_at_[size_t(h)].size() == chosen_[size_t(h)].size();
  return int64_t(f.items.size());
}

void FarStore::attend_task(const KVLayer& kv, const float* q, int64_t it) {
  const int hkv = int(heads_.size()), G = shape_.group(), d = int(shape_.head_dim);
  auto& f = fa_.v;
  const bool lim = limit_ >= 0;
  const auto [t, c] = f.items[size_t(it)];
  std::vector<const std::byte*> kr, vr;
  std::vector<float> w;
  for (int h = t * f.hpt; h < std::min(hkv, (t + 1) * f.hpt); ++h) {
    const Head& hd = heads_[size_t(h)];
    const int64_t b = int64_t(c) * kFarChunk, e = std::min(f.len[size_t(h)], b + kFarChunk);
    if (b >= e) continue;
    vr.resize(size_t(e - b));
    const size_t slot = size_t(h) * f.chunks + size_t(c);
    float* po = f.part_o.data() + slot * G * d;
    float* pl = f.part_lse.data() + slot * G;
    if (f.scored) {
      // widen scored these keys for this query: softmax over the chunk from its scores, then the
      // value pass (the K rows are not read again).
      const auto& sv = score_.v[size_t(h)];
      const size_t Mh = sv.size() / size_t(G);
      const int64_t* at = chosen_at_[size_t(h)].data();
      const int64_t cnt = e - b;
      w.resize(size_t(G) * cnt);
      for (int g = 0; g < G; ++g)
        for (int64_t j = 0; j < cnt; ++j) w[size_t(g) * cnt + j] = sv[size_t(g) * Mh + size_t(at[b + j])];
      for (int64_t j = b; j < e; ++j) vr[size_t(j - b)] = kv.v_row(h, ranked(h)[size_t(j)]);
      std::fill(po, po + size_t(G) * d, 0.f);
      cpu::softmax_rows(w.data(), G, cnt, cnt, pl);
      cpu::accumulate_rows(shape_.kv_dtype, d, G, w.data(), cnt, vr.data(), cnt, po);
      continue;
    }
    kr.resize(size_t(e - b));
    const int64_t L = int64_t(hd.pos.size());
    for (int64_t j = b; j < e; ++j) {
      if (lim) {
        const int32_t pos = ranked(h)[size_t(j)];
        kr[size_t(j - b)] = kv.k_row(h, pos);
        vr[size_t(j - b)] = kv.v_row(h, pos);
      } else if (j < L) {
        kr[size_t(j - b)] = hd.k.data() + size_t(j) * row_;
        vr[size_t(j - b)] = hd.v.data() + size_t(j) * row_;
      } else {
        const int32_t pos = hd.pad[size_t(j - L)];
        kr[size_t(j - b)] = kv.k_row(h, pos);
        vr[size_t(j - b)] = kv.v_row(h, pos);
      }
    }
    cpu::attend_rows(shape_.kv_dtype, d, G, q + size_t(h) * G * d, shape_.softmax_scale, kr.data(), vr.data(), e - b,
                     po, pl);
  }
}

void FarStore::attend_merge(float* o, float* lse) const {
  const int hkv = int(heads_.size()), G = shape_.group(), d = int(shape_.head_dim);
  const auto& f = fa_.v;
  for (int h = 0; h < hkv; ++h) {
    float* oh = o + size_t(h) * G * d;
    float* lh = lse + size_t(h) * G;
    std::fill(oh, oh + size_t(G) * d, 0.f);
    std::fill(lh, lh + G, kNegInf);
    for (int c = 0; c < f.chunks; ++c) {
      const size_t slot = size_t(h) * f.chunks + size_t(c);
      cpu::merge_states(oh, lh, f.part_o.data() + slot * G * d, f.part_lse.data() + slot * G, G, d);
    }
  }
}

void FarStore::limit(int64_t far_keys, int64_t w_size, ThreadPool& pool) {
  widened_ = false;
  if (far_keys < 0) {
    limit_ = -1;
    return;
  }
  limit_ = far_keys;
  if (heads_.empty()) return;
  const int64_t want = std::min(far_keys, n_);
  if (ranked_.size() != heads_.size() || rank_keys_.size() != heads_.size()) {
    ranked_.assign(heads_.size(), {});
    rank_keys_.assign(heads_.size(), {});
    rank_dirty_ = true;
  }
  const bool fresh = !rank_dirty_ && rank_w_ == w_size && rank_n_ <= n_;
  if (fresh && rank_n_ == n_ && rank_len_ >= want) return;
  // The ranking's prefix that the step sees: the far share with some slack (it grows by a block
  // after each eviction and by one key per 1/fraction steps), rebuilt when the far store changed
  // or the share outgrew it.
  const int64_t target = std::min(n_, want + want / 2 + 64);
  const int hq = int(shape_.num_q_heads), G = shape_.group();
  // An entry is ranked by a 64-bit key: the ratio's order-preserving image (cpu::float_key) above
  // the position, so "larger key" is the order wanted (higher ratio first, the newer entry on ties)
  // and the selection compares integers instead of chasing the ratio array.
  auto key_of = [&](int64_t h, int64_t t) {
    const float r = agg(maw_.data() + size_t(t) * hq + size_t(h) * G) * float(t < reeval_n_ ? reeval_n_ : w_size);
    return (uint64_t(cpu::float_key(r)) << 32) | uint32_t(t);
  };
  // The exact prefix kept is longer than the one seen (ranked_ holds `have` entries, rank_keys_
  // their keys: recomputing them would read the MAW at random, 1.5 ms a head at 128K). Only entries
  // [rank_n_, n_) can have come since (evictions; the older entries' ratios are unchanged), and the
  // best `have` of the whole set are among the old prefix and the newcomers, so a merge of the two
  // is exact (all of them when the old prefix held every old entry): eviction steps cost a merge
  // instead of a selection over the whole far store (about 2-3 ms a head at 256K).
  const int64_t have = int64_t(ranked_[0].size());
  const int64_t exact = have == rank_n_ ? n_ : have;  // how far a merge would be exact
  if (fresh && target <= exact) {
    if (rank_n_ < n_) {
      const int64_t len = std::min(exact, std::max(have, target));
      pool.parallel_for(int64_t(heads_.size()), [&](int64_t h) {
        auto& a = rank_keys_[size_t(h)];
        std::vector<uint64_t> b(static_cast<size_t>(n_ - rank_n_)), m(a.size() + b.size());
        for (int64_t t = rank_n_; t < n_; ++t) b[size_t(t - rank_n_)] = key_of(h, t);
        std::sort(b.begin(), b.end(), std::greater<>());
        std::merge(a.begin(), a.end(), b.begin(), b.end(), m.begin(), std::greater<>());
        m.resize(size_t(len));
        a = std::move(m);
        auto& out = ranked_[size_t(h)];
        out.resize(size_t(len));
        for (int64_t i = 0; i < len; ++i) out[size_t(i)] = int32_t(uint32_t(a[size_t(i)]));
      });
      rank_n_ = n_;
    }
    rank_len_ = target;
    return;
  }
  // A full rebuild, one task per head, keeping twice the prefix seen.
  const int64_t len = std::min(n_, 2 * target);
  pool.parallel_for(int64_t(heads_.size()), [&](int64_t h) {
    std::vector<uint64_t> key(static_cast<size_t>(n_));
    for (int64_t t = 0; t < n_; ++t) key[size_t(t)] = key_of(h, t);
    if (len > 0 && len < n_) std::nth_element(key.begin(), key.begin() + (len - 1), key.end(), std::greater<>());
    key.resize(size_t(len));
    std::sort(key.begin(), key.end(), std::greater<>());
    auto& out = ranked_[size_t(h)];
    out.resize(size_t(len));
    for (int64_t i = 0; i < len; ++i) out[size_t(i)] = int32_t(uint32_t(key[size_t(i)]));
    rank_keys_[size_t(h)] = std::move(key);
  });
  rank_dirty_ = false;
  rank_w_ = w_size;
  rank_n_ = n_;
  rank_len_ = target;
}

int64_t FarStore::widen_plan(int64_t sinks, int64_t recent) {
  widened_ = false;
  auto& p = wp_.v;
  p.tasks = 0;
  if (limit_ < 0 || heads_.empty() || n_ == 0) return 0;
  const int hkv = int(heads_.size()), G = shape_.group();
  sinks = std::clamp<int64_t>(sinks, 0, n_);
  recent = std::clamp<int64_t>(recent, 0, n_);
  // A head's pool: the MAW candidates (twice the far share, within the ranked prefix of about
  // 1.5 F + 64 entries), the sinks [0, sinks) and the recent keys [rb, n). A candidate that is also
  // a sink or a recent key is a repeat: it stays in the pool's index space (so the layout is
  // known before anything is scored) but takes no part (its range copy does). Scores are computed
  // in tasks of kWidenChunk pool entries, every head's in one parallel_for (8 KV heads would leave
  // most of a 16-thread pool idle); the tasks do not depend on the thread count, so neither does
  // the choice.
  p.sinks = sinks;
  p.rb = std::max(sinks, n_ - recent);
  p.P.assign(size_t(hkv), 0);
  p.M.assign(size_t(hkv), 0);
  p.first.assign(size_t(hkv) + 1, 0);
  const int64_t F = std::min(limit_, rank_len_);  // every head attends the same far share
  for (int h = 0; h < hkv; ++h) {
    p.P[size_t(h)] = std::min(rank_len_, 2 * F);
    p.M[size_t(h)] = p.P[size_t(h)] + sinks + (n_ - p.rb);
    p.first[size_t(h) + 1] = p.first[size_t(h)] + (p.M[size_t(h)] + kWidenChunk - 1) / kWidenChunk;
  }
  p.tasks = p.first[size_t(hkv)];
  p.tmax.assign(size_t(p.tasks) * G, kNegInf);
  p.tsum.assign(size_t(p.tasks) * G, 0.0);
  p.zmax.assign(size_t(hkv) * G, kNegInf);
  p.zinv.assign(size_t(hkv) * G, 0.f);
  score_.v.resize(size_t(hkv));
  p.w.resize(size_t(hkv));
  for (int h = 0; h < hkv; ++h) {
    score_.v[size_t(h)].resize(size_t(G) * size_t(p.M[size_t(h)]));
    p.w[size_t(h)].resize(size_t(p.M[size_t(h)]));
  }
  return p.tasks;
}

int32_t FarStore::pool_pos(int h, int64_t i) const {
  if (i < wp_.v.P[size_t(h)]) return ranked_[size_t(h)][size_t(i)];
  i -= wp_.v.P[size_t(h)];
  return int32_t(i < wp_.v.sinks ? i : wp_.v.rb + (i - wp_.v.sinks));
}

bool FarStore::pool_repeat(int h, int64_t i) const {
  if (i >= wp_.v.P[size_t(h)]) return false;
  const int32_t t = ranked_[size_t(h)][size_t(i)];
  return t < wp_.v.sinks || t >= wp_.v.rb;
}

int FarStore::widen_head(int64_t task, int64_t& b, int64_t& e) const {
  const auto& p = wp_.v;
  const int h = int(std::upper_bound(p.first.begin(), p.first.end(), task) - p.first.begin()) - 1;
  b = (task - p.first[size_t(h)]) * kWidenChunk;
  e = std::min(p.M[size_t(h)], b + kWidenChunk);
  return h;
}

void FarStore::widen_score(const KVLayer& kv, const float* q, int64_t task) {
  const int G = shape_.group(), d = int(shape_.head_dim);
  auto& p = wp_.v;
  int64_t b, e;
  const int h = widen_head(task, b, e);
  const int64_t m = p.M[size_t(h)], cnt = e - b;
  std::vector<const std::byte*> kr(static_cast<size_t>(cnt));
  for (int64_t i = b; i < e; ++i) kr[size_t(i - b)] = kv.k_row(h, pool_pos(h, i));
  std::vector<float> sc(size_t(G) * cnt);
  cpu::score_rows(shape_.kv_dtype, d, G, q + size_t(h) * G * d, shape_.softmax_scale, kr.data(), cnt, sc.data());
  // Repeats score -inf: no weight, never chosen. The task's maximum and sum of exp(s - max) per
  // query head feed the pool's normaliser (widen_choose).
  for (int64_t i = b; i < std::min(e, p.P[size_t(h)]); ++i)
    if (pool_repeat(h, i))
      for (int g = 0; g < G; ++g) sc[size_t(g) * cnt + (i - b)] = kNegInf;
  std::vector<float> ex(static_cast<size_t>(cnt));
  for (int g = 0; g < G; ++g) {
    const float* sg = sc.data() + size_t(g) * cnt;
    std::copy(sg, sg + cnt, score_.v[size_t(h)].begin() + g * m + b);
    const float mx = cpu::max_of(sg, cnt);
    p.tmax[size_t(task) * G + g] = mx;
    if (mx == kNegInf) continue;
    double sum = 0;
    std::copy(sg, sg + cnt, ex.begin());
    cpu::exp_shift(ex.data(), cnt, mx);
    for (int64_t i = 0; i < cnt; ++i)
      if (sg[i] != kNegInf) sum += ex[size_t(i)];  // exp_shift maps -inf to ~1e-38, not 0
    p.tsum[size_t(task) * G + g] = sum;
  }
}

void FarStore::widen_choose(const float* win_lse, ThreadPool& pool) {
  auto& p = wp_.v;
  if (p.tasks == 0) return;
  const int hkv = int(heads_.size()), G = shape_.group();
  chosen_.resize(heads_.size());
  chosen_at_.resize(heads_.size());
  swapped_.assign(heads_.size(), 0);
  // The normaliser of query head g: the pool's and the window's exp-sums, Z = mx + log(sum), so a
  // key's weight is sum_g exp(s_g - mx_g) / sum_g.
  for (int h = 0; h < hkv; ++h)
    for (int g = 0; g < G; ++g) {
      const float wl = win_lse[h * G + g];
      float mx = wl;
      for (int64_t t = p.first[size_t(h)]; t < p.first[size_t(h) + 1]; ++t) mx = std::max(mx, p.tmax[size_t(t) * G + g]);
      double z = std::isfinite(wl) ? std::exp(double(wl) - double(mx)) : 0.0;
      for (int64_t t = p.first[size_t(h)]; t < p.first[size_t(h) + 1]; ++t)
        if (p.tsum[size_t(t) * G + g] > 0) z += p.tsum[size_t(t) * G + g] * std::exp(double(p.tmax[size_t(t) * G + g]) - double(mx));
      p.zmax[size_t(h) * G + g] = mx;
      p.zinv[size_t(h) * G + g] = z > 0 ? float(1.0 / z) : 0.f;
    }
  // Weights per scoring task: w_i = sum_g exp(s_gi - mx_g) / sum_g, -1 for repeats (their scores
  // are -inf).
  pool.parallel_for(p.tasks, [&](int64_t task) {
    int64_t b, e;
    const int h = widen_head(task, b, e);
    const int64_t m = p.M[size_t(h)], cnt = e - b;
    float* w = p.w[size_t(h)].data() + b;
    std::fill(w, w + cnt, 0.f);
    std::vector<float> ex(static_cast<size_t>(cnt));
    for (int g = 0; g < G; ++g) {
      const float* sg = score_.v[size_t(h)].data() + g * m + b;
      std::copy(sg, sg + cnt, ex.begin());
      cpu::exp_shift(ex.data(), cnt, p.zmax[size_t(h) * G + g]);
      const float inv = p.zinv[size_t(h) * G + g];
      for (int64_t i = 0; i < cnt; ++i) w[i] += ex[size_t(i)] * inv;
    }
    const float* s0 = score_.v[size_t(h)].data() + b;
    for (int64_t i = 0; i < cnt; ++i)
      if (s0[i] == kNegInf) w[i] = -1.f;
  });
  // Per head, the F of highest weight, ties to the newer key: the F-th weight by a radix select,
  // the keys above it, and of the keys at it the newest. Then the chosen keys in pool order with
  // their scores' index (far attention reuses the scores); the ones outside the MAW ranking's
  // first F are the swapped ones.
  pool.parallel_for(hkv, [&](int64_t hh) {
    const int h = int(hh);
    const auto& rk = ranked_[size_t(h)];
    const int64_t F = std::min(limit_, rank_len_), m = p.M[size_t(h)];
    float* w = p.w[size_t(h)].data();
    auto& c = chosen_[size_t(h)];
    auto& at = chosen_at_[size_t(h)];
    c.clear();
    at.clear();
    std::vector<uint32_t> tmp;
    const float th = cpu::kth_largest(w, m, F, tmp);
    std::vector<int64_t> ties;
    int64_t above = 0;
    for (int64_t i = 0; i < m; ++i) {
      above += w[i] > th;
      if (w[i] == th) ties.push_back(i);
    }
    if (th >= 0.f && above + int64_t(ties.size()) > F) {
      // Of the keys at the threshold the F - above newest; the others drop below it.
      const int64_t keep = F - above;
      std::nth_element(ties.begin(), ties.begin() + keep, ties.end(),
                       [&](int64_t x, int64_t y) { return pool_pos(h, x) > pool_pos(h, y); });
      for (size_t k = size_t(keep); k < ties.size(); ++k) w[ties[k]] = -1.f;
    }
    std::vector<uint64_t> top(size_t(n_ + 63) / 64, 0);
    for (int64_t i = 0; i < F; ++i) top[size_t(rk[size_t(i)]) >> 6] |= uint64_t(1) << (rk[size_t(i)] & 63);
    // Without branches on the weights (a pick is about every other entry, at random): every entry
    // is written, and the write position moves on only for a pick.
    c.resize(size_t(m));
    at.resize(size_t(m));
    int64_t k = 0, sw = 0;
    const float cut = std::max(th, 0.f);
    const int32_t* r = rk.data();
    const int64_t Ph = p.P[size_t(h)], sk = p.sinks, rb = p.rb;
    for (int64_t i = 0; i < m; ++i) {
      const int64_t j = i - Ph;
      const int32_t t = int32_t(i < Ph ? r[i] : j < sk ? j : rb + (j - sk));
      const bool pick = w[i] >= cut;
      c[size_t(k)] = t;
      at[size_t(k)] = i;
      sw += pick & !((top[size_t(t) >> 6] >> (t & 63)) & 1);
      k += pick;
    }
    c.resize(size_t(k));
    at.resize(size_t(k));
    swapped_[size_t(h)] = sw;
  });
  widened_ = true;
}

void FarStore::materialise(const KVLayer& kv) {
  for (size_t h = 0; h < heads_.size(); ++h) {
    Head& hd = heads_[h];
    hd.k.clear();
    hd.v.clear();
    if (p_.cap) continue;
    hd.k.reserve(hd.pos.size() * row_);
    hd.v.reserve(hd.pos.size() * row_);
    for (int32_t t : hd.pos) {
      const auto* k = kv.k_row(int(h), t);
      const auto* v = kv.v_row(int(h), t);
      hd.k.insert(hd.k.end(), k, k + row_);
      hd.v.insert(hd.v.end(), v, v + row_);
    }
  }
}

void FarStore::set_far(int64_t n, std::vector<float> maw) {
  n_ = n;
  maw_ = std::move(maw);
  maw_.reserve(headroom(maw_.size()));
  for (auto& hd : heads_) {
    hd.in_ctx.reserve(headroom(size_t(n)));
    hd.in_ctx.assign(size_t(n), 0);
  }
  rank_dirty_ = true;
}

void FarStore::restore_head(int h, std::vector<int32_t> pos, std::vector<float> score, std::vector<int32_t> pad) {
  Head& hd = heads_[size_t(h)];
  for (int32_t t : pos) {
    if (t < 0 || t >= n_ || hd.in_ctx[size_t(t)])
      fail(KVS_STATUS_FORMAT_INVALID, "hgca: salient set of head " + std::to_string(h) + " holds an invalid or repeated position");
    hd.in_ctx[size_t(t)] = 1;
  }
  for (int32_t t : pad)
    if (t < 0 || t >= n_ || hd.in_ctx[size_t(t)])
      fail(KVS_STATUS_FORMAT_INVALID, "hgca: padding of head " + std::to_string(h) + " holds an invalid or salient position");
  hd.pos = std::move(pos);
  hd.score = std::move(score);
  hd.pad = std::move(pad);
  renormalise(hd);
}

void FarStore::checkpoint() {
  ck_n_ = n_;
  ck_len_.resize(heads_.size());
  for (size_t h = 0; h < heads_.size(); ++h) ck_len_[h] = heads_[h].pos.size();
  armed_pad_ = true;
  pad_saved_ = false;
}

void FarStore::rollback() {
  if (!armed_pad_) return;
  n_ = ck_n_;
  maw_.resize(size_t(n_) * shape_.num_q_heads);
  for (size_t h = 0; h < heads_.size(); ++h) {
    Head& hd = heads_[h];
    const size_t L = ck_len_[h];
    hd.pos.resize(L);
    hd.score.resize(L);
    if (!p_.cap) {  // the contiguous copies (cap=none only)
      hd.k.resize(L * row_);
      hd.v.resize(L * row_);
    }
    hd.in_ctx.resize(size_t(n_));
    renormalise(hd);
    if (pad_saved_) hd.pad = std::move(ck_pad_[h]);
  }
  armed_pad_ = pad_saved_ = false;
  rank_dirty_ = true;
}

uint64_t FarStore::bytes() const {
  uint64_t b = maw_.size() * sizeof(float);
  for (auto& hd : heads_)
    b += hd.pos.size() * 4 + hd.score.size() * 4 + hd.weight.size() * 4 + hd.k.size() + hd.v.size() +
         hd.pad.size() * 4 + hd.in_ctx.size();
  for (size_t h = 0; h < ranked_.size(); ++h) b += ranked_[h].size() * 4;
  for (size_t h = 0; h < rank_keys_.size(); ++h) b += rank_keys_[h].size() * 8;
  return b;
}

void mean_attention(const KVLayer& kv, int h, int64_t a, int64_t b, const float* queries, const int64_t* qpos,
                    int64_t r, const ModelShape& shape, int32_t gemm, float* out) {
  const int G = shape.group(), d = int(shape.head_dim), hq = int(shape.num_q_heads);
  const int64_t n = b - a, M = r * G;
  std::fill(out, out + size_t(n) * G, 0.f);
  if (n <= 0 || r <= 0) return;
  std::vector<float> Q(size_t(M) * d);
  for (int64_t i = 0; i < r; ++i)
    for (int g = 0; g < G; ++g)
      for (int x = 0; x < d; ++x)
        Q[(size_t(i) * G + g) * d + x] = queries[(size_t(i) * hq + h * G + g) * d + x] * shape.softmax_scale;
  const int64_t C = 4096;
  std::vector<float> Kc(size_t(std::min(C, n)) * d), S(size_t(M) * std::min(C, n));
  std::vector<double> mx(size_t(M), -std::numeric_limits<double>::infinity()), z(size_t(M), 0.0);
  const auto prov = cpu::GemmProvider(gemm);
  auto scores = [&](int64_t c0, int64_t cnt) {
    for (int64_t j = 0; j < cnt; ++j) convert_to_f32(kv.k_row(h, a + c0 + j), kv.dtype(), Kc.data() + size_t(j) * d, size_t(d));
    cpu::sgemm(prov, false, true, M, cnt, d, 1.f, Q.data(), d, Kc.data(), d, 0.f, S.data(), cnt);
  };
  // Pass 1: each query row's max and normaliser over the keys it sees.
  for (int64_t c0 = 0; c0 < n; c0 += C) {
    const int64_t cnt = std::min(C, n - c0);
    scores(c0, cnt);
    for (int64_t row = 0; row < M; ++row) {
      const int64_t see = std::min(cnt, qpos[row / G] - (a + c0) + 1);
      if (see <= 0) continue;
      const float* s = S.data() + size_t(row) * cnt;
      double m = mx[size_t(row)];
      for (int64_t j = 0; j < see; ++j) m = std::max(m, double(s[j]));
      double zz = z[size_t(row)] * std::exp(mx[size_t(row)] - m);
      if (!std::isfinite(zz)) zz = 0;
      for (int64_t j = 0; j < see; ++j) zz += std::exp(double(s[j]) - m);
      mx[size_t(row)] = m;
      z[size_t(row)] = zz;
    }
  }
  int64_t seen = 0;
  for (int64_t i = 0; i < r; ++i) seen += qpos[i] >= a ? 1 : 0;
  if (seen == 0) return;
  // Pass 2: the mean of the normalised weights.
  for (int64_t c0 = 0; c0 < n; c0 += C) {
    const int64_t cnt = std::min(C, n - c0);
    scores(c0, cnt);
    for (int64_t row = 0; row < M; ++row) {
      const int64_t see = std::min(cnt, qpos[row / G] - (a + c0) + 1);
      if (see <= 0 || z[size_t(row)] <= 0) continue;
      const float* s = S.data() + size_t(row) * cnt;
      const int g = int(row % G);
      const double m = mx[size_t(row)], inv = 1.0 / (z[size_t(row)] * double(seen));
      for (int64_t j = 0; j < see; ++j) out[size_t(c0 + j) * G + g] += float(std::exp(double(s[j]) - m) * inv);
    }
  }
}

}  // namespace kvs::hgca
