// SPDX-License-Identifier: Apache-2.0
// A batch of sessions decoded together (kvs_batch_*): validated once at creation, planned once per
// token (every session and layer checked, capacity reserved, workspaces sized: host work only), then
// one decode call per layer that validates only the step tensors and launches.
#pragma once
#include <cstdint>
#include <vector>

#include "core/session.hpp"

namespace kvs {

class Batch {
 public:
  Batch(std::vector<Session*> sessions);
  size_t size() const { return sessions_.size(); }
  void plan(void* stream);
  void decode(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
              const kvs_tensor* lse, void* stream);

 private:
  std::vector<Session*> sessions_;
  std::vector<uint8_t> done_;  // layers decoded under the current plan
  bool planned_ = false;
};

}  // namespace kvs
