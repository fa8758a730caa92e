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
    out.lists.assign(size_t(per_query_ ? hkv * G : hkv), {});
    // Forced keys: first sinks_ and last local_ tokens (within the budget).
    std::vector<char> forced(size_t(n), 0);
    std::vector<int32_t> forced_list;
    for (int64_t t = 0; t < std::min(sinks_, n); ++t) forced[size_t(t)] = 1;
    for (int64_t t = std::max<int64_t>(0, n - local_); t < n; ++t) forced[size_t(t)] = 1;
    for (int64_t t = 0; t < n; ++t)
      if (forced[size_t(t)]) forced_list.push_back(int32_t(t));
    if (int64_t(forced_list.size()) > k) forced_list.resize(size_t(k));  // sinks first
    std::vector<int32_t> cand;
    cand.reserve(size_t(n));
    for (int64_t t = 0; t < n; ++t)
      if (!forced[size_t(t)]) cand.push_back(int32_t(t));
    const int64_t rest = k - int64_t(forced_list.size());

    std::vector<float> scores(size_t(G) * n), agg(static_cast<size_t>(n));
    for (int h = 0; h < hkv; ++h) {
      cpu::score_keys(kv, h, q + size_t(h) * G * d, G, n, ctx_.shape.softmax_scale, scores.data(), *ctx_.pool);
      if (per_query_) {
        for (int g = 0; g < G; ++g) {
          auto& l = out.lists[size_t(h * G + g)];
          l = forced_list;
          std::vector<int32_t> c = cand;
          cpu::topk_of(scores.data() + size_t(g) * n, c, rest, l);
          std::sort(l.begin(), l.end());
        }
      } else {
        std::fill(agg.begin(), agg.end(), 0.f);
        for (int g = 0; g < G; ++g) {
          const float* s = scores.data() + size_t(g) * n;
          const float mx = *std::max_element(s, s + n);
          double z = 0;
          for (int64_t t = 0; t < n; ++t) z += std::exp(double(s[t] - mx));
          const float inv = float(1.0 / z);
          for (int64_t t = 0; t < n; ++t) agg[size_t(t)] += std::exp(s[t] - mx) * inv;
        }
        auto& l = out.lists[size_t(h)];
        l = forced_list;
        std::vector<int32_t> c = cand;
        cpu::topk_of(agg.data(), c, rest, l);
        std::sort(l.begin(), l.end());
      }
    }
  }
  bool exact_truncate() const override { return true; }  // no index: every key scored per step
  std::unique_ptr<Method> clone() const override { return std::make_unique<ExactTopk>(*this); }

 private:
  MethodContext ctx_;
  bool per_query_;
  int64_t sinks_, local_;
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
