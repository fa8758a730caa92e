// SPDX-License-Identifier: Apache-2.0
// exact_topk: the oracle ("Flat" in CTkvr §4.1.2, MagicPIG's top-k harness; docs/methods.md).
// Every key is scored exactly; the top-k are attended. Per KV head (default) the group's query
// heads are aggregated as the sum of their per-head softmax (the RetroInfer aggregator, docs/methods.md
// §12), giving one set per KV head; per_query_head selects per query head. Optional forced sinks
// and local window count toward the budget.
#include <algorithm>
#include <cmath>

#include "backends/cpu/attention.hpp"
#include "backends/cpu/topk.hpp"
#include "core/error.hpp"
#include "core/method.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {
namespace {

class ExactTopk final : public Method {
 public:
  ExactTopk(const MethodContext& ctx, const ParamSet& p)
      : ctx_(ctx),
        per_query_(p.get_string("mode") == "per_query_head"),
        sinks_(p.get_int("sinks")),
        local_(p.get_int("local")) {
    if (sinks_ < 0 || local_ < 0) invalid("method_params: exact_topk sinks and local must be >= 0");
  }

  void select(uint32_t, const float* q, const KVLayer& kv, Selection& out) override {
    const int64_t n = kv.size();
    const int G = ctx_.shape.group(), d = int(ctx_.shape.head_dim);
    const int hkv = int(ctx_.shape.num_kv_heads);
    const int64_t k = ctx_.budget.keys(n, 0.05);
    out.kind = per_query_ ? Selection::Kind::PerQueryHead : Selection::Kind::PerKvHead;
    out.lists.resize(size_t(per_query_ ? hkv * G : hkv));
    // Forced keys: the sinks [0, s_end) and the local window [w_begin, n), within the budget with
    // the sinks first (then the window's oldest tokens); the candidates are the range between.
    const int64_t s_end = std::min(sinks_, n), w_begin = std::max(s_end, n - local_);
    const int64_t nf_s = std::min(s_end, k), nf_l = std::min(n - w_begin, k - nf_s);
    const int64_t rest = k - nf_s - nf_l;
    // Every head's exact scores (each call spread over the pool), then one task per list: the
    // group's summed softmax (the vectorised exponential), the top `rest` of the candidates by a
    // radix select and one pass (ties to the lower token), written in token order.
    scores_.resize(size_t(hkv) * G * size_t(n));
    for (int h = 0; h < hkv; ++h)
      cpu::score_keys(kv, h, q + size_t(h) * G * d, G, n, ctx_.shape.softmax_scale, scores_.data() + size_t(h) * G * n,
                      *ctx_.pool);
    if (int64_t(tok_.size()) < n) {
      const size_t from = tok_.size();
      tok_.resize(size_t(n));
      for (size_t t = from; t < tok_.size(); ++t) tok_[t] = int32_t(t);
    }
    if (!per_query_) agg_.resize(size_t(hkv) * n);
    ctx_.pool->parallel_for(int64_t(out.lists.size()), [&](int64_t i) {
      const float* rank = scores_.data() + size_t(i) * n;  // per query head: its own scores
      if (!per_query_) {
        float* a = agg_.data() + size_t(i) * n;
        for (int g = 0; g < G; ++g) {
          float* s = scores_.data() + (size_t(i) * G + g) * n;
          const float inv = float(1.0 / cpu::exp_shift(s, n, cpu::max_of(s, n)));
          if (g == 0) {
            for (int64_t t = 0; t < n; ++t) a[t] = s[t] * inv;
          } else {
            for (int64_t t = 0; t < n; ++t) a[t] += s[t] * inv;
          }
        }
        rank = a;
      }
      auto& l = out.lists[size_t(i)];
      l.clear();
      for (int64_t t = 0; t < nf_s; ++t) l.push_back(int32_t(t));
      thread_local std::vector<uint32_t> tmp;
      cpu::append_top_k(tok_.data() + s_end, rank + s_end, w_begin - s_end, rest, l, tmp);
      for (int64_t t = w_begin; t < w_begin + nf_l; ++t) l.push_back(int32_t(t));
    });
  }
  bool exact_truncate() const override { return true; }  // no index: every key scored per step
  std::unique_ptr<Method> clone() const override { return std::make_unique<ExactTopk>(*this); }

 private:
  MethodContext ctx_;
  bool per_query_;
  int64_t sinks_, local_;
  std::vector<float> scores_, agg_;  // [Hkv][G][n] exact scores, [Hkv][n] the group's summed softmax
  std::vector<int32_t> tok_;         // 0, 1, 2, ...: the candidates' tokens
};

}  // namespace

std::unique_ptr<DeviceMethod> make_exact_topk_cuda(const MethodContext&, const ParamSet&);  // exact_topk_cuda.cpp

MethodSpec exact_topk_spec() {
  return MethodSpec{
      "exact_topk",
      "oracle: exact scores of every key, top-k by the group's summed softmax",
      1u << KVS_BACKEND_CPU,
      0.05,
      {{"mode", "enum:per_kv_head|per_query_head", "per_kv_head",
        "one set per KV head (group-summed softmax) or one per query head"},
       {"sinks", "int", "0", "first tokens always attended (count toward the budget)"},
       {"local", "int", "0", "most recent tokens always attended (count toward the budget)"}},
      [](const MethodContext& c, const ParamSet& p) { return std::make_unique<ExactTopk>(c, p); },
      KVS_CUDA_IMPL(make_exact_topk_cuda)};
}

}  // namespace kvs
