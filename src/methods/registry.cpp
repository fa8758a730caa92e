// SPDX-License-Identifier: Apache-2.0
// The method registry: an explicit list (no static-initialisation tricks, so static linking keeps
// every method). Each method folder provides one spec factory.
#include <algorithm>
#include <cmath>

#include "core/method.hpp"

namespace kvs {

MethodSpec full_spec();
MethodSpec exact_topk_spec();
MethodSpec streaming_spec();
MethodSpec quest_spec();
MethodSpec csattention_spec();
MethodSpec ctkvr_spec();
MethodSpec lfps_spec();
MethodSpec hgca_spec();
MethodSpec retroinfer_spec();

void attach_placements(std::vector<MethodSpec>& specs);  // src/backends/registry.cpp

const std::vector<MethodSpec>& method_registry() {
  static const std::vector<MethodSpec> reg = [] {
    std::vector<MethodSpec> v = {
      full_spec(),
      exact_topk_spec(),
      streaming_spec(),
      quest_spec(),
      csattention_spec(),
      ctkvr_spec(),
      lfps_spec(),
      hgca_spec(),
      retroinfer_spec(),
    };
    attach_placements(v);
    return v;
  }();
  return reg;
}

const MethodSpec* find_method(std::string_view name) {
  for (auto& m : method_registry())
    if (name == m.name) return &m;
  return nullptr;
}

int64_t Budget::keys(int64_t n, double default_fraction) const {
  int64_t k;
  if (tokens > 0) k = tokens;
  else k = int64_t(std::ceil((fraction > 0 ? fraction : default_fraction) * double(n)));
  return std::clamp<int64_t>(k, std::min<int64_t>(1, n), n);
}

}  // namespace kvs
