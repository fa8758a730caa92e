// SPDX-License-Identifier: Apache-2.0
// full: dense, exact attention over every key (the reference every method is judged against).
#include "core/method.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {
namespace {
class Full final : public Method {
 public:
  void select(uint32_t, const float*, const KVLayer&, Selection& out) override {
    out.kind = Selection::Kind::All;
    out.lists.clear();
  }
  bool exact_truncate() const override { return true; }  // no index
  std::unique_ptr<Method> clone() const override { return std::make_unique<Full>(*this); }
};
}  // namespace

std::unique_ptr<DeviceMethod> make_full_cuda(const MethodContext&, const ParamSet&);  // full_cuda.cpp

MethodSpec full_spec() {
  return MethodSpec{"full", "dense exact attention over every key (baseline)",
                    1u << KVS_BACKEND_CPU, 1.0, {},
                    [](const MethodContext&, const ParamSet&) { return std::make_unique<Full>(); },
      KVS_CUDA_IMPL(make_full_cuda)};
}
}  // namespace kvs
