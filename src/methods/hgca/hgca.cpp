// SPDX-License-Identifier: Apache-2.0
// hgca: Hybrid GPU-CPU Attention (Deng et al., arXiv 2507.03153; docs/methods/hgca.md). The near window
// (NearWindow, Alg. 1 lines 2-13) and the far store (FarStore, lines 19-25) are separate components;
// each decode step computes the window's dense state and the far part's sparse state and merges
// them by LSE (§3.3). The Selection only reports the keys attended (attend = false); the state
// comes from extra(). Prompt tokens beyond the window get MAW from the last r prompt queries and
// the far entries are judged like an append (reconstructed: the paper does not say how prompt entries are judged); an append re-evaluates every far entry.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "backends/cpu/attention.hpp"
#include "core/error.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"
#include "methods/param_bounds.hpp"
#include "kvsieve/kvsieve.h"
#include "methods/hgca/hgca.hpp"

namespace kvs {
int64_t streaming_sinks(int64_t sinks, int64_t k, int64_t n);  // methods/streaming/streaming.cpp
namespace hgca {
namespace {

struct LayerState {
  bool built = false;
  bool materialised = true;
  int64_t l_max = 0;
  int64_t blk = 0;  // block size: block_size, or smaller under cap=budget (a quarter of the window)
  std::unique_ptr<NearWindow> win;
  FarStore far;
  std::vector<float> stash_q;      // last r prompt queries [r][Hq][d] (until the index is built)
  std::vector<int64_t> stash_pos;
  // Loaded and not yet materialised: window tokens [wb, we) with MAW [we - wb][Hq].
  int64_t wb = 0, we = 0;
  std::vector<float> wmaw;
  // This step's merged state (extra()).
  std::vector<float> o, lse;
  // Statistics.
  int64_t steps = 0;
  double sum_keys = 0, sum_far_keys = 0, sum_widened = 0;

  LayerState() = default;
  LayerState(const LayerState& x)
      : built(x.built), materialised(x.materialised), l_max(x.l_max), blk(x.blk), win(x.win ? x.win->clone() : nullptr),
        far(x.far), stash_q(x.stash_q), stash_pos(x.stash_pos), wb(x.wb), we(x.we), wmaw(x.wmaw), o(x.o),
        lse(x.lse), steps(x.steps), sum_keys(x.sum_keys), sum_far_keys(x.sum_far_keys), sum_widened(x.sum_widened) {}
  LayerState& operator=(LayerState&&) = default;
  LayerState(LayerState&&) = default;
};

enum class UndoKind { None, Step, Full };

constexpr int64_t kWidenSinks = 4;  // streaming's default sinks (scaled into the budget as streaming does)

class Hgca final : public Method {
 public:
  Hgca(const MethodContext& ctx, const Params& p) : ctx_(ctx), p_(p), layers_(ctx.shape.num_layers) {
    undo_kind_.assign(ctx.shape.num_layers, UndoKind::None);
    undo_n_.assign(ctx.shape.num_layers, -1);
    undo_full_.resize(ctx.shape.num_layers);
    for (auto& l : layers_) l.far = FarStore(ctx.shape, p_);
  }
  Hgca(const Hgca& x)
      : ctx_(x.ctx_), p_(x.p_), layers_(x.layers_), undo_kind_(x.layers_.size(), UndoKind::None),
        undo_n_(x.layers_.size(), -1), undo_full_(x.layers_.size()) {}

  int heads_per_task() const {
    const int hkv = int(ctx_.shape.num_kv_heads);
    if (p_.heads_per_task > 0) return int(std::min<int64_t>(p_.heads_per_task, hkv));
    return (hkv + int(ctx_.pool->size()) - 1) / int(ctx_.pool->size());
  }

  // Keeps the last r queries (r = score_queries; 0 = all) with their positions.
  void stash(LayerState& st, const float* q, int64_t n, int64_t first) {
    const size_t qs = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
    st.stash_q.insert(st.stash_q.end(), q, q + size_t(n) * qs);
    for (int64_t i = 0; i < n; ++i) st.stash_pos.push_back(first + i);
    const int64_t r = p_.score_queries;
    if (r > 0 && int64_t(st.stash_pos.size()) > r) {
      const size_t drop = st.stash_pos.size() - size_t(r);
      st.stash_q.erase(st.stash_q.begin(), st.stash_q.begin() + int64_t(drop * qs));
      st.stash_pos.erase(st.stash_pos.begin(), st.stash_pos.begin() + int64_t(drop));
    }
  }

  void on_prefill(uint32_t layer, const float* q, int64_t n, const KVLayer& kv) override {
    LayerState& st = layers_[layer];
    if (st.built) return;  // a tables-only load re-supplying its prompt: the state is loaded
    stash(st, q, n, kv.size() - n);
  }

  void build_index(uint32_t layer, const KVLayer& kv) override {
    LayerState& st = layers_[layer];
    if (st.built) return;
    const int64_t n = kv.size();
    int64_t W = p_.window;
    LayerState fresh;
    fresh.blk = p_.block_size;
    int64_t blocks;
    if (W <= 0 && p_.window_ratio <= 0 && p_.cap) {
      // cap=budget: the window holds at most window_share of the budget (at least the current
      // token); blocks of a quarter of it, so the resident count (l_max - blk .. l_max - 1 with
      // free_slot) stays near that share; the far set takes the rest of the budget each step.
      W = std::max<int64_t>(1, int64_t(std::floor(p_.window_share * double(ctx_.budget.keys(n, 0.05)))));
      fresh.blk = std::clamp<int64_t>(W / 4, 1, p_.block_size);
      blocks = std::max<int64_t>((W + (p_.free_slot ? 1 : 0)) / fresh.blk, p_.free_slot ? 2 : 1);
    } else {
      if (W <= 0) W = p_.window_ratio > 0 ? int64_t(std::ceil(p_.window_ratio * double(n))) : ctx_.budget.keys(n, 0.05);
      blocks = std::max<int64_t>((W + p_.block_size - 1) / p_.block_size, p_.free_slot ? 2 : 1);
    }
    fresh.l_max = blocks * fresh.blk;
    fresh.win = std::make_unique<CpuNearWindow>(ctx_.shape, fresh.l_max, 0, p_.alpha);
    fresh.far = FarStore(ctx_.shape, p_);
    fresh.stash_q = st.stash_q;
    fresh.stash_pos = st.stash_pos;
    absorb(fresh, kv, n, /*reeval=*/p_.prompt_maw_queries);
    fresh.built = true;
    fresh.stash_q.clear();
    fresh.stash_pos.clear();
    st = std::move(fresh);
  }

  // Tokens [win.end(), win.end() + m) enter: block eviction (Alg. 1 lines 10-13), the newcomers'
  // MAW, then either a re-evaluation of every far entry or the evicted entries' own test.
  void absorb(LayerState& st, const KVLayer& kv, int64_t m, bool reeval) {
    const auto& s = ctx_.shape;
    const int hq = int(s.num_q_heads), G = s.group(), hkv = int(s.num_kv_heads);
    NearWindow& w = *st.win;
    const int64_t first = w.end();
    const int64_t cnt = evict_count(w.size(), m, st.l_max, st.blk, p_.free_slot);
    const int64_t from_win = std::min(cnt, w.size()), from_new = cnt - from_win;
    std::vector<float> ev(size_t(cnt) * hq, p_.maw_init);
    w.evict(from_win, ev.data());
    const bool have_q = !st.stash_pos.empty();
    const bool do_reeval = reeval && have_q;
    st.far.add_evicted(kv, cnt, ev.data(), st.l_max, *ctx_.pool, /*test=*/!do_reeval);
    w.skip(from_new);
    std::vector<float> init(size_t(m - from_new) * hq, p_.maw_init);
    w.insert(kv, m - from_new, init.data());
    const int64_t r = int64_t(st.stash_pos.size());
    if (p_.prompt_maw_queries && have_q && m - from_new > 0) {
      // Reconstructed (the paper does not say): window-normalised mean attention of the last r queries gives the newcomers' MAW.
      const int64_t a = w.begin(), b = w.end();
      std::vector<float> A(size_t(b - a) * G), row(static_cast<size_t>(hq));
      std::vector<float> all(size_t(b - a) * hq);
      for (int h = 0; h < hkv; ++h) {
        mean_attention(kv, h, a, b, st.stash_q.data(), st.stash_pos.data(), r, s, ctx_.gemm, A.data());
        for (int64_t j = 0; j < b - a; ++j)
          for (int g = 0; g < G; ++g) all[size_t(j) * hq + h * G + g] = A[size_t(j) * G + g];
      }
      for (int64_t t = std::max(a, first + from_new); t < b; ++t) w.set_maw(t, all.data() + size_t(t - a) * hq);
    }
    if (do_reeval && st.far.tokens() > 0) {
      // Alg. 1 lines 19-22: A_cpu from every CPU-side entry (mean over the r queries: reconstructed, the paper does not say).
      const int64_t nf = st.far.tokens();
      std::vector<float> A(size_t(nf) * G), all(size_t(nf) * hq);
      for (int h = 0; h < hkv; ++h) {
        mean_attention(kv, h, 0, nf, st.stash_q.data(), st.stash_pos.data(), r, s, ctx_.gemm, A.data());
        for (int64_t j = 0; j < nf; ++j)
          for (int g = 0; g < G; ++g) all[size_t(j) * hq + h * G + g] = A[size_t(j) * G + g];
      }
      st.far.reevaluate(kv, all.data());
    }
    st.far.repad(kv, heads_per_task());
  }

  void on_append(uint32_t layer, const float* q, int64_t n, const KVLayer& kv, bool decode) override {
    LayerState& st = layers_[layer];
    if (decode) return;  // the decode step runs in select()
    if (!st.built) fail(KVS_STATUS_INVALID_STATE, "hgca: layer " + std::to_string(layer) + " has no index");
    materialise(st, kv, kv.size() - n);
    if (st.win->end() != kv.size() - n)
      fail(KVS_STATUS_INTERNAL, "hgca: layer " + std::to_string(layer) + " window ends at token " +
                                    std::to_string(st.win->end()) + " before an append at " + std::to_string(kv.size() - n));
    undo_full_[layer] = std::make_unique<LayerState>(st);
    undo_kind_[layer] = UndoKind::Full;
    undo_n_[layer] = kv.size() - n;
    st.stash_q.clear();
    st.stash_pos.clear();
    stash(st, q, n, kv.size() - n);
    absorb(st, kv, n, p_.reeval_on_append);
    st.stash_q.clear();
    st.stash_pos.clear();
  }

  void truncate(uint32_t layer, int64_t n) override {
    LayerState& st = layers_[layer];
    if (undo_kind_[layer] == UndoKind::Step && undo_n_[layer] == n) {
      st.win->rollback();
      st.far.rollback();
      --st.steps;
      st.sum_keys -= last_keys_;
      st.sum_far_keys -= last_far_keys_;
      st.sum_widened -= last_widened_;
    } else if (undo_kind_[layer] == UndoKind::Full && undo_n_[layer] == n && undo_full_[layer]) {
      st = std::move(*undo_full_[layer]);
    } else if (!st.built) {
      const size_t qs = size_t(ctx_.shape.num_q_heads) * ctx_.shape.head_dim;
      size_t keep = 0;
      while (keep < st.stash_pos.size() && st.stash_pos[keep] < n) ++keep;
      st.stash_pos.resize(keep);
      st.stash_q.resize(keep * qs);
    }
    undo_kind_[layer] = UndoKind::None;
    undo_full_[layer].reset();
  }

  // After a load the K/V copies (window ring, salient sets) are rebuilt from the layer's store.
  void materialise(LayerState& st, const KVLayer& kv, int64_t n_before) {
    if (st.materialised) return;
    if (kv.size() < st.we)
      fail(KVS_STATUS_INVALID_STATE, "hgca: the layer holds " + std::to_string(kv.size()) + " tokens, the loaded state " +
                                         std::to_string(st.we));
    auto w = std::make_unique<CpuNearWindow>(ctx_.shape, st.l_max, st.wb, p_.alpha);
    w->insert(kv, st.we - st.wb, st.wmaw.data());
    st.win = std::move(w);
    st.far.materialise(kv);
    st.wmaw.clear();
    st.materialised = true;
  }

  void select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) override {
    LayerState& st = layers_[layer];
    const auto& s = ctx_.shape;
    const int hq = int(s.num_q_heads), hkv = int(s.num_kv_heads), d = int(s.head_dim);
    const int64_t n = kv.size();
    if (!st.built) fail(KVS_STATUS_INVALID_STATE, "hgca: layer " + std::to_string(layer) + " has no index");
    materialise(st, kv, n - 1);
    NearWindow& w = *st.win;
    if (w.end() != n - 1)
      fail(KVS_STATUS_INTERNAL, "hgca: layer " + std::to_string(layer) + " window ends at token " + std::to_string(w.end()) +
                                    ", the layer holds " + std::to_string(n - 1) + " before this step");
    undo_full_[layer].reset();
    w.checkpoint();
    st.far.checkpoint();
    undo_kind_[layer] = UndoKind::Step;
    undo_n_[layer] = n - 1;
    // Alg. 1 lines 10-13 and 23-25: block eviction, the evicted entries' salience test.
    const int64_t cnt = evict_count(w.size(), 1, st.l_max, st.blk, p_.free_slot);
    if (cnt > 0) {
      std::vector<float> ev(size_t(cnt) * hq);
      w.evict(cnt, ev.data());
      st.far.add_evicted(kv, cnt, ev.data(), st.l_max, *ctx_.pool);
      st.far.repad(kv, heads_per_task());
    }
    std::vector<float> init(static_cast<size_t>(hq), p_.maw_init);
    w.insert(kv, 1, init.data());  // line 9; its MAW is updated from the next step on
    // cap=budget: the far set is the budget's rest after the window, best salience first.
    st.far.limit(p_.cap ? std::max<int64_t>(0, ctx_.budget.keys(n, 0.05) - w.size()) : -1, st.l_max, *ctx_.pool);
    // Near part: dense over the window, MAW update (line 8). Far part: sparse over the salient sets.
    st.o.resize(size_t(hq) * d);
    st.lse.resize(size_t(hq));
    // One round of tasks scores the window (a task per KV head, the largest first) and widen's pool
    // (widen=recent: streaming's sinks and its recent keys beyond the window join the MAW far set as
    // candidates, scored in chunks); the choice needs the window's LSE (st.lse). A second round
    // attends the far sets (from widen's scores where it ran) beside the report of the keys attended.
    const bool widen = st.far.limited() >= 0 && p_.widen;
    int64_t wtasks = 0;
    if (widen) {
      const int64_t k = ctx_.budget.keys(n, 0.05);
      const int64_t sk = streaming_sinks(kWidenSinks, k, n);
      wtasks = st.far.widen_plan(sk, std::max<int64_t>(0, k - sk - w.size()));
    }
    ctx_.pool->parallel_for(hkv + wtasks, [&](int64_t i) {
      if (i < hkv) w.attend_head(q, int(i), st.o.data(), st.lse.data(), /*update=*/true, /*no_update_from=*/n - 1);
      else st.far.widen_score(kv, q, i - hkv);
    });
    w.attend_done(/*update=*/true);
    if (widen) st.far.widen_choose(st.lse.data(), *ctx_.pool);
    // The report, per KV head: a capped far set (F keys, all below the window) is put in ascending
    // order through a bitmap over the far store: F bit sets and a scan of n / 64 words, where
    // sorting took F log F (0.4 ms a head at F = 10K).
    out.kind = Selection::Kind::PerKvHead;
    out.attend = false;
    out.lists.resize(size_t(hkv));
    std::vector<size_t> nfar(static_cast<size_t>(hkv));
    auto report = [&](int h) {
      const auto& hd = st.far.heads()[size_t(h)];
      auto& l = out.lists[size_t(h)];
      l.clear();
      if (st.far.limited() >= 0) {
        const int64_t fk = st.far.ranked_keys(h);
        l.reserve(size_t(fk + w.size()));
        const int32_t* r = st.far.ranked(h);
        const int64_t nf = st.far.tokens();
        std::vector<uint64_t> bits(size_t(nf + 63) / 64, 0);
        for (int64_t i = 0; i < fk; ++i)
          if (r[i] >= 0 && r[i] < nf) bits[size_t(r[i]) >> 6] |= uint64_t(1) << (r[i] & 63);
        for (size_t wi = 0; wi < bits.size(); ++wi)
          for (uint64_t b = bits[wi]; b; b &= b - 1) l.push_back(int32_t(wi * 64 + size_t(__builtin_ctzll(b))));
        if (int64_t(l.size()) != fk) fail(KVS_STATUS_INTERNAL, "hgca: a far set repeats a key or lies beyond the far store");
      } else {
        l.reserve(hd.pos.size() + hd.pad.size() + size_t(w.size()));
        l.insert(l.end(), hd.pos.begin(), hd.pos.end());
        l.insert(l.end(), hd.pad.begin(), hd.pad.end());
      }
      nfar[size_t(h)] = l.size();
      for (int64_t t = w.begin(); t < w.end(); ++t) l.push_back(int32_t(t));
    };
    const int64_t ftasks = st.far.attend_plan(heads_per_task());
    ctx_.pool->parallel_for(ftasks + hkv, [&](int64_t i) {
      if (i < ftasks) st.far.attend_task(kv, q, i);
      else report(int(i - ftasks));
    });
    std::vector<float> fo(size_t(hq) * d), fl(static_cast<size_t>(hq));
    st.far.attend_merge(fo.data(), fl.data());
    cpu::merge_states(st.o.data(), st.lse.data(), fo.data(), fl.data(), hq, d);
    double keys = 0, far_keys = 0, widened = 0;
    for (int h = 0; h < hkv; ++h) {
      widened += double(st.far.widened_keys(h));
      keys += double(out.lists[size_t(h)].size());
      far_keys += double(nfar[size_t(h)]);
    }
    last_keys_ = keys / hkv;
    last_far_keys_ = far_keys / hkv;
    last_widened_ = widened / hkv;
    ++st.steps;
    st.sum_keys += last_keys_;
    st.sum_far_keys += last_far_keys_;
    st.sum_widened += last_widened_;
  }

  bool extra(uint32_t layer, const float*, const KVLayer&, float* o, float* lse) override {
    const LayerState& st = layers_[layer];
    std::copy(st.o.begin(), st.o.end(), o);
    std::copy(st.lse.begin(), st.lse.end(), lse);
    return true;
  }

  // ---- tables ----
  nlohmann::json save_meta() const override {
    nlohmann::json meta = nlohmann::json::object();
    nlohmann::json layers = nlohmann::json::object();
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const LayerState& st = layers_[l];
      if (!st.built && st.stash_pos.empty()) continue;
      nlohmann::json j;
      j["built"] = st.built;
      j["stash_queries"] = st.stash_pos.size();
      if (st.built) {
        j["window_slots"] = st.l_max;
        j["block_size"] = st.blk;
        j["reeval_far_tokens"] = st.far.reeval_tokens();
        j["window_begin"] = st.materialised ? st.win->begin() : st.wb;
        j["window_end"] = st.materialised ? st.win->end() : st.we;
        const int64_t nf = st.far.tokens();
        j["far_tokens"] = nf;
        nlohmann::json sal = nlohmann::json::array(), frac = nlohmann::json::array(), pad = nlohmann::json::array();
        for (auto& hd : st.far.heads()) {
          sal.push_back(hd.pos.size());
          frac.push_back(nf ? double(hd.pos.size()) / double(nf) : 0.0);
          pad.push_back(hd.pad.size());
        }
        j["salient"] = sal;
        j["salient_fraction"] = frac;
        j["padding"] = pad;
      }
      layers[std::to_string(l)] = j;
    }
    meta["layers"] = layers;
    return meta;
  }

  void save(io::TablesWriter& wr) const override {
    const int hq = int(ctx_.shape.num_q_heads);
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const LayerState& st = layers_[l];
      const int32_t L = int32_t(l);
      if (!st.stash_pos.empty()) {
        wr.add_copy("hgca.stash.q", L, -1, st.stash_q.data(), st.stash_q.size() * 4);
        wr.add_copy("hgca.stash.pos", L, -1, st.stash_pos.data(), st.stash_pos.size() * 8);
      }
      if (!st.built) continue;
      std::vector<float> wm;
      if (st.materialised) {
        std::vector<float> row(static_cast<size_t>(hq));
        for (int64_t t = st.win->begin(); t < st.win->end(); ++t) {
          st.win->maw(t, row.data());
          wm.insert(wm.end(), row.begin(), row.end());
        }
      } else {
        wm = st.wmaw;
      }
      wr.add_copy("hgca.wmaw", L, -1, wm.data(), wm.size() * 4);
      wr.add_copy("hgca.farmaw", L, -1, st.far.maw().data(), st.far.maw().size() * 4);
      for (size_t h = 0; h < st.far.heads().size(); ++h) {
        const auto& hd = st.far.heads()[h];
        wr.add_copy("hgca.ctx.pos", L, int32_t(h), hd.pos.data(), hd.pos.size() * 4);
        wr.add_copy("hgca.ctx.score", L, int32_t(h), hd.score.data(), hd.score.size() * 4);
        wr.add_copy("hgca.pad", L, int32_t(h), hd.pad.data(), hd.pad.size() * 4);
      }
    }
  }

  template <class T>
  static std::vector<T> section(const io::TablesFile& f, const char* tag, int32_t l, int32_t h, size_t count) {
    const auto& s = f.require(tag, l, h);
    if (s.length != count * sizeof(T))
      fail(KVS_STATUS_FORMAT_INVALID, "tables file '" + f.path() + "': section " + tag + " layer " + std::to_string(l) + ": expected " +
                                          std::to_string(count * sizeof(T)) + " bytes, got " + std::to_string(s.length));
    std::vector<T> v(count);
    if (count) std::memcpy(v.data(), s.data, s.length);
    return v;
  }

  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    const auto& s = ctx_.shape;
    const size_t hq = s.num_q_heads, qs = hq * s.head_dim;
    // Header numbers are range-checked at their type before they are used (io/header.hpp); token
    // counts are int32 in the far store, so every count is below 2^31 and the products below fit.
    const io::HeaderReader hm(f.path(), "method.meta");
    if (!hm.has(meta, "layers")) return;
    constexpr int64_t kTok = (int64_t(1) << 31) - 1;
    for (auto& [key, j] : hm.object(meta, "layers").items()) {
      // The key is a layer number: decimal digits only (no sign, no spaces), below num_layers.
      int64_t l = key.empty() || key.size() > 9 ? -1 : 0;
      for (char c : key) l = l >= 0 && c >= '0' && c <= '9' ? l * 10 + (c - '0') : -1;
      if (l < 0 || l >= int64_t(layers_.size()))
        hm.fail("layers", "key '" + key + "' is not a layer number in [0, " + std::to_string(layers_.size() - 1) + "]");
      const auto hl = hm.sub("layers").sub(key);
      if (!j.is_object()) hm.sub("layers").fail(key, "expected an object, got " + io::HeaderReader::show(j));
      const int32_t L = int32_t(l);
      LayerState st;
      st.far = FarStore(s, p_);
      const size_t ns = size_t(hl.integer<int64_t>(j, "stash_queries", 0, kTok));
      if (ns) {
        st.stash_q = section<float>(f, "hgca.stash.q", L, -1, ns * qs);
        st.stash_pos = section<int64_t>(f, "hgca.stash.pos", L, -1, ns);
      }
      if (hl.boolean(j, "built")) {
        st.built = true;
        st.materialised = false;
        st.l_max = hl.integer<int64_t>(j, "window_slots", 1, kTok);
        st.blk = hl.has(j, "block_size") ? hl.integer<int64_t>(j, "block_size", 1, 65536) : p_.block_size;
        st.wb = hl.integer<int64_t>(j, "window_begin", 0, kTok);
        st.we = hl.integer<int64_t>(j, "window_end", 0, kTok);
        const int64_t nf = hl.integer<int64_t>(j, "far_tokens", 0, kTok);
        if (st.l_max < st.blk || st.l_max % st.blk || st.wb != nf || st.we < st.wb ||
            st.we - st.wb > st.l_max)
          fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "hgca: layer " + key + ": inconsistent window/far sizes in the header");
        st.wmaw = section<float>(f, "hgca.wmaw", L, -1, size_t(st.we - st.wb) * hq);
        st.far.set_far(nf, section<float>(f, "hgca.farmaw", L, -1, size_t(nf) * hq));
        if (hl.has(j, "reeval_far_tokens")) st.far.set_reeval_tokens(hl.integer<int64_t>(j, "reeval_far_tokens", 0, nf));
        const auto& sal = hl.array(j, "salient");
        const auto& pad = hl.array(j, "padding");
        if (sal.size() != s.num_kv_heads || pad.size() != s.num_kv_heads)
          hl.fail("salient", "salient and padding must have num_kv_heads (" + std::to_string(s.num_kv_heads) +
                                 ") entries, have " + std::to_string(sal.size()) + " and " + std::to_string(pad.size()));
        for (uint32_t h = 0; h < s.num_kv_heads; ++h) {
          const size_t ns_h = size_t(hl.integer_value<int64_t>(sal[h], "salient." + std::to_string(h), 0, nf));
          const size_t np_h = size_t(hl.integer_value<int64_t>(pad[h], "padding." + std::to_string(h), 0, nf));
          st.far.restore_head(int(h), section<int32_t>(f, "hgca.ctx.pos", L, int32_t(h), ns_h),
                              section<float>(f, "hgca.ctx.score", L, int32_t(h), ns_h),
                              section<int32_t>(f, "hgca.pad", L, int32_t(h), np_h));
        }
      }
      layers_[size_t(l)] = std::move(st);
    }
  }

  std::unique_ptr<Method> clone() const override { return std::make_unique<Hgca>(*this); }
  const LayerState* layer_state(uint32_t l) const {
    return l < layers_.size() && layers_[l].built && layers_[l].materialised ? &layers_[l] : nullptr;
  }

  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    const auto& st = layers_[layer];
    if (!st.built) return true;
    const int64_t end = st.materialised ? (st.win ? st.win->end() : tokens) : st.we;
    if (end == tokens) return true;
    *why = "its hgca window ends at token " + std::to_string(end);
    return false;
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (auto& st : layers_) {
      if (st.win) b += st.win->bytes();
      b += st.far.bytes() + st.stash_q.size() * 4 + st.stash_pos.size() * 8 + st.wmaw.size() * 4;
    }
    return b;
  }

  bool stat(std::string_view name, double* out) const override {
    const std::string nm(name);
    unsigned L = 0, H = 0;
    if (std::sscanf(nm.c_str(), "salient_fraction.%u.%u", &L, &H) == 2) {
      if (L >= layers_.size() || H >= ctx_.shape.num_kv_heads) return false;
      const auto& st = layers_[L];
      const int64_t nf = st.far.tokens();
      *out = nf && st.built ? double(st.far.heads()[H].pos.size()) / double(nf) : 0.0;
      return true;
    }
    double sum = 0, mn = 1, mx = 0, cnt = 0, pad = 0, far = 0, win = 0, keys = 0, steps = 0, fk = 0, wk = 0;
    for (auto& st : layers_) {
      if (!st.built) continue;
      const int64_t nf = st.far.tokens();
      far += double(nf);
      win += double(st.materialised ? st.win->size() : st.we - st.wb);
      keys += st.sum_keys;
      fk += st.sum_far_keys;
      wk += st.sum_widened;
      steps += double(st.steps);
      for (auto& hd : st.far.heads()) {
        pad += double(hd.pad.size());
        if (!nf) continue;
        const double fr = double(hd.pos.size()) / double(nf);
        sum += fr;
        mn = std::min(mn, fr);
        mx = std::max(mx, fr);
        cnt += 1;
      }
    }
    const double nl = std::max(1.0, double(std::count_if(layers_.begin(), layers_.end(), [](auto& s) { return s.built; })));
    if (nm == "salient_fraction") *out = cnt ? sum / cnt : 0.0;
    else if (nm == "salient_fraction_min") *out = cnt ? mn : 0.0;
    else if (nm == "salient_fraction_max") *out = cnt ? mx : 0.0;
    else if (nm == "padding_keys") *out = pad / (nl * ctx_.shape.num_kv_heads);
    else if (nm == "far_tokens") *out = far / nl;
    else if (nm == "window_tokens") *out = win / nl;
    else if (nm == "exact_keys") *out = steps ? keys / steps : 0.0;
    else if (nm == "far_keys") *out = steps ? fk / steps : 0.0;
    else if (nm == "widened_keys") *out = steps ? wk / steps : 0.0;
    else return false;
    return true;
  }

 private:
  MethodContext ctx_;
  Params p_;
  std::vector<LayerState> layers_;
  std::vector<UndoKind> undo_kind_;
  std::vector<int64_t> undo_n_;
  std::vector<std::unique_ptr<LayerState>> undo_full_;
  double last_keys_ = 0, last_far_keys_ = 0, last_widened_ = 0;
};

Params parse(const MethodContext& ctx, const ParamSet& ps) {
  Params p;
  p.beta = ps.get_float("beta");
  // Integers are range-checked at int64 (param_bounds.hpp). The window's memory grows with the
  // tokens it holds (CpuNearWindow::grow), so a window larger than the context costs nothing extra.
  p.window = int_param(ps, "hgca", "window", 0, int64_t(1) << 30, "tokens; 0 = window_ratio or the budget");
  p.window_ratio = ps.get_float("window_ratio");
  p.block_size = int_param(ps, "hgca", "block_size", 1, 65536);
  p.alpha = ps.get_float("alpha");
  const double maw_init = ps.get_float("maw_init");  // checked before it is narrowed to float
  if (!(maw_init >= 0 && maw_init <= 1)) invalid("method_params: hgca maw_init must be in [0, 1], got " + std::to_string(maw_init));
  p.maw_init = float(maw_init);
  p.gqa = ps.get_string("gqa") == "mean" ? GqaAgg::Mean : GqaAgg::Max;
  p.score_queries = int_param(ps, "hgca", "score_queries", 0, (int64_t(1) << 31) - 1, "0 = all");
  p.prompt_maw_queries = ps.get_string("prompt_maw") == "queries";
  p.reeval_on_append = ps.get_bool("reeval_on_append");
  p.free_slot = ps.get_bool("free_slot");
  p.pad = ps.get_bool("pad");
  p.heads_per_task = int_param(ps, "hgca", "heads_per_task", 0, 1024, "0 = auto");
  p.cap = ps.get_string("cap") == "budget";
  p.window_share = ps.get_float("window_share");
  p.widen = ps.get_string("widen") == "recent";
  if (!(p.window_share > 0 && p.window_share <= 1))
    invalid("method_params: hgca window_share must be in (0, 1], got " + std::to_string(p.window_share));
  if (!(p.beta >= 0) || std::isinf(p.beta)) invalid("method_params: hgca beta must be a finite number >= 0, got " + std::to_string(p.beta));
  if (!(p.window_ratio >= 0 && p.window_ratio <= 1))
    invalid("method_params: hgca window_ratio must be in [0, 1] (0 = the session budget), got " + std::to_string(p.window_ratio));
  if (!(p.alpha > 0 && p.alpha <= 1)) invalid("method_params: hgca alpha must be in (0, 1], got " + std::to_string(p.alpha));
  if (!(p.maw_init >= 0 && p.maw_init <= 1)) invalid("method_params: hgca maw_init must be in [0, 1], got " + std::to_string(p.maw_init));
  (void)ctx;
  return p;
}

}  // namespace

const NearWindow* window_of(const Method& m, uint32_t layer) {
  const auto* h = dynamic_cast<const Hgca*>(&m);
  const auto* st = h ? h->layer_state(layer) : nullptr;
  return st ? st->win.get() : nullptr;
}
const FarStore* far_of(const Method& m, uint32_t layer) {
  const auto* h = dynamic_cast<const Hgca*>(&m);
  const auto* st = h ? h->layer_state(layer) : nullptr;
  return st ? &st->far : nullptr;
}

}  // namespace hgca

MethodSpec hgca_spec() {
  return MethodSpec{
      "hgca",
      "HGCA: recent window (dense, MAW per entry) + per-head salient far entries (MAW > beta/W), merged by LSE",
      1u << KVS_BACKEND_CPU,
      0.05,
      {{"beta", "float", "1", "salience factor: far entry kept iff its MAW > beta / W (re-evaluation: > beta / far size); 0 keeps all"},
       {"window", "int", "0", "near-window tokens W, rounded up to whole blocks; 0 = window_ratio, else the budget"},
       {"window_ratio", "float", "0", "W as a fraction of the prompt (paper's GPU KV ratio); 0 = the session budget"},
       {"block_size", "int", "64", "entries per window block, the eviction unit [the paper does not say; our choice]"},
       {"alpha", "float", "0.1", "MAW factor: MAW <- (1 - alpha) MAW + alpha A_window [the paper does not say; our choice]"},
       {"maw_init", "float", "0", "MAW of a newly inserted token, updated from the next step on [the paper does not say; our choice]"},
       {"gqa", "enum:max|mean", "max", "MAW of a KV head's entry: max or mean over its query heads [reconstructed: the paper does not say]"},
       {"score_queries", "int", "64", "last r queries of a prompt/append that score its tokens [reconstructed: the paper does not say]; 0 = all"},
       {"prompt_maw", "enum:queries|init", "queries",
        "prompt/appended tokens: MAW and far test from the r queries' mean attention [reconstructed: the paper does not say], or maw_init"},
       {"reeval_on_append", "bool", "true", "an append re-evaluates every far entry (Alg. 1 lines 19-22)"},
       {"free_slot", "bool", "true", "eviction as printed in Alg. 1 (size+m >= l_max: one slot stays free); false: exact capacity"},
       {"pad", "bool", "true", "pad the heads of a far task to equal length with the best sub-threshold entries (paper 3.3)"},
       {"heads_per_task", "int", "0", "adjacent KV heads per far task; 0 = ceil(kv heads / threads) (paper fn. 4)"},
       {"cap", "enum:budget|none", "budget",
        "budget: the exact keys keep to the session budget: the window takes window_share of it (unless window or "
        "window_ratio is given) and each step's far set is the rest, the far entries of highest salience (MAW x the "
        "size they are judged against; salient ones first), replacing the threshold sets and padding; none: the "
        "paper's adaptive, uncapped sets (window = the budget unless window/window_ratio)"},
       {"window_share", "float", "0.25",
        "with cap=budget and no window/window_ratio: the near window's share of the budget (0..1]; blocks of a "
        "quarter of the window (at most block_size)"},
       {"widen", "enum:recent|none", "recent",
        "with cap=budget: each step's far set is the best by this query's exact weights among the MAW-ranked far "
        "set, streaming's sinks and its recent keys beyond the window (scored, not attended: up to about twice the "
        "far keys read for scores); none: the MAW ranking alone [ours]"}},
      [](const MethodContext& c, const ParamSet& p) { return std::make_unique<hgca::Hgca>(c, hgca::parse(c, p)); }};
}

}  // namespace kvs
