// SPDX-License-Identifier: Apache-2.0
// streaming: StreamingLLM (attention sinks + recent window; docs/methods.md), on post-RoPE keys with
// their original positions (no position shift: a decode-time sparse-attention baseline).
#include <algorithm>

#include "core/error.hpp"
#include "core/method.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {

// Sinks within a budget of k keys: the requested count, capped at k / 8 (at least 1 where k >= 2,
// none where k = 1: the window keeps the current token). Also streaming_cuda.cpp's rule.
int64_t streaming_sinks(int64_t sinks, int64_t k, int64_t n) {
  const int64_t cap = k >= 2 ? std::max<int64_t>(1, k / 8) : 0;
  return std::min({sinks, cap, n});
}

namespace {

class Streaming final : public Method {
 public:
  Streaming(const MethodContext& ctx, const ParamSet& p)
      : ctx_(ctx), sinks_(p.get_int("sinks")), window_(p.get_int("window")) {
    if (sinks_ < 0 || window_ < 0) invalid("method_params: streaming sinks and window must be >= 0");
  }
  void select(uint32_t, const float*, const KVLayer& kv, Selection& out) override {
    const int64_t n = kv.size();
    int64_t s = std::min(sinks_, n), w = window_;
    if (window_ == 0) {
      // window = 0: the budget k minus the sinks, the sinks scaled into the budget (at most an
      // eighth of it, at least 1 when k >= 2) so that sinks + window = k at every context length.
      const int64_t k = ctx_.budget.keys(n, 0.05);
      s = streaming_sinks(sinks_, k, n);
      w = k - s;
    }
    std::vector<int32_t> l;
    for (int64_t t = 0; t < s; ++t) l.push_back(int32_t(t));
    for (int64_t t = std::max(s, n - w); t < n; ++t) l.push_back(int32_t(t));
    out.kind = Selection::Kind::PerKvHead;
    out.lists.assign(ctx_.shape.num_kv_heads, l);
  }
  bool exact_truncate() const override { return true; }  // no index: positions only
  std::unique_ptr<Method> clone() const override { return std::make_unique<Streaming>(*this); }

 private:
  MethodContext ctx_;
  int64_t sinks_, window_;
};

}  // namespace

std::unique_ptr<DeviceMethod> make_streaming_cuda(const MethodContext&, const ParamSet&);  // streaming_cuda.cpp

MethodSpec streaming_spec() {
  return MethodSpec{"streaming", "StreamingLLM: attention sinks + recent window",
                    1u << KVS_BACKEND_CPU, 0.05,
                    {{"sinks", "int", "4",
                      "initial tokens always kept (StartRecentKVCache start_size); with window = 0 at most "
                      "budget/8 of them (at least 1)"},
                     {"window", "int", "0",
                      "recent tokens kept; 0 = the budget minus the sinks (sinks + window = budget); > 0: a "
                      "fixed count (the paper's recent_size), the budget then ignored"}},
                    [](const MethodContext& c, const ParamSet& p) { return std::make_unique<Streaming>(c, p); },
      KVS_CUDA_IMPL(make_streaming_cuda)};
}

}  // namespace kvs
