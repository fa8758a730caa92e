// SPDX-License-Identifier: Apache-2.0
// full on the cuda placement: every key, dense attention (the placement's dense kernel).
#ifdef KVS_HAVE_CUDA
#include "backends/cuda/device_method.hpp"

namespace kvs {
namespace {
class FullCuda final : public DeviceMethod {
 public:
  DevicePlan plan(std::span<DeviceMethod* const>, uint32_t, const DeviceStep&) const override {
    DevicePlan p;
    p.dense = true;
    return p;
  }
  void select(std::span<DeviceMethod* const>, uint32_t, const DeviceStep&, const DevicePlan&, const void*, int32_t*,
              int32_t*, const cuda::Workspace&) override {}
  bool capturable() const override { return true; }
  std::unique_ptr<DeviceMethod> clone(void*) const override { return std::make_unique<FullCuda>(); }
};
}  // namespace

std::unique_ptr<DeviceMethod> make_full_cuda(const MethodContext&, const ParamSet&) { return std::make_unique<FullCuda>(); }
}  // namespace kvs
#endif
