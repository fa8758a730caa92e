// SPDX-License-Identifier: Apache-2.0
// streaming on the cuda placement: sinks + recent window as device index lists (window_select),
// the same lists as the CPU method (streaming.cpp), attended by the gathered kernel.
#ifdef KVS_HAVE_CUDA
#include <algorithm>

#include "backends/cuda/cuda_util.hpp"
#include "backends/cuda/device_method.hpp"
#include "backends/cuda/selection.cuh"

namespace kvs {
int64_t streaming_sinks(int64_t sinks, int64_t k, int64_t n);  // streaming.cpp
namespace {
class StreamingCuda final : public DeviceMethod {
 public:
  StreamingCuda(const ParamSet& p) : sinks_(p.get_int("sinks")), window_(p.get_int("window")) {
    if (sinks_ < 0 || window_ < 0) invalid("method_params: streaming sinks and window must be >= 0");
  }
  DevicePlan plan(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st) const override {
    DevicePlan p;
    for (size_t b = 0; b < st.host_lengths.size(); ++b) {
      const int64_t n = st.host_lengths[b];
      int64_t s = std::min(sinks_, n), w = window_;
      if (window_ == 0) {  // the CPU method's rule (streaming.cpp)
        s = streaming_sinks(sinks_, st.host_budget[b], n);
        w = std::max<int64_t>(1, st.host_budget[b] - s);
      }
      const int64_t c = s + std::min(w, n - s);
      p.selected.push_back(double(c));
      p.max_selected = std::max<int32_t>(p.max_selected, int32_t(c));
    }
    return p;
  }
  void select(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st, const DevicePlan& p, const void*,
              int32_t* idx, int32_t* cnt, const cuda::Workspace&) override {
    cudautil::check(cuda::window_select(st.shape.batch, st.shape.num_kv_heads, st.lengths, st.budget_keys,
                                        int32_t(sinks_), int32_t(window_), idx, cnt, p.max_selected, st.stream),
                    "window_select");
  }
  bool capturable() const override { return true; }
  std::unique_ptr<DeviceMethod> clone(void*) const override { return std::make_unique<StreamingCuda>(*this); }

 private:
  int64_t sinks_, window_;
};
}  // namespace

std::unique_ptr<DeviceMethod> make_streaming_cuda(const MethodContext&, const ParamSet& p) {
  return std::make_unique<StreamingCuda>(p);
}
}  // namespace kvs
#endif
