// SPDX-License-Identifier: Apache-2.0
// streaming: StreamingLLM (attention sinks + recent window; docs/methods.md), on post-RoPE keys with
// their original positions (no position shift: a decode-time sparse-attention baseline).
#include <algorithm>

#include "core/error.hpp"
#include "core/method.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {
namespace {

class Streaming final : public Method {
 public:
  Streaming(const MethodContext& ctx, const ParamSet& p)
      : ctx_(ctx), sinks_(p.get_int("sinks")), window_(p.get_int("window")) {
    if (sinks_ < 0 || window_ < 0) invalid("method_params: streaming sinks and window must be >= 0");
  }
  void select(uint32_t, const float*, const KVLayer& kv, Selection& out) override {
    const int64_t n = kv.size();
    const int64_t s = std::min(sinks_, n);
    // window = 0: the budget minus the sinks (at least 1 recent token: the current one).
    const int64_t w = window_ > 0 ? window_ : std::max<int64_t>(1, ctx_.budget.keys(n, 0.05) - s);
    std::vector<int32_t> l;
    for (int64_t t = 0; t < s; ++t) l.push_back(int32_t(t));
    for (int64_t t = std::max(s, n - w); t < n; ++t) l.push_back(int32_t(t));
    out.kind = Selection::Kind::PerKvHead;
    out.lists.assign(ctx_.shape.num_kv_heads, l);
  }
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
                    {{"sinks", "int", "4", "initial tokens always kept (StartRecentKVCache start_size)"},
                     {"window", "int", "0", "recent tokens kept; 0 = budget minus sinks"}},
                    [](const MethodContext& c, const ParamSet& p) { return std::make_unique<Streaming>(c, p); },
      KVS_CUDA_IMPL(make_streaming_cuda)};
}

}  // namespace kvs
