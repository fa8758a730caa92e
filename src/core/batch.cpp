// SPDX-License-Identifier: Apache-2.0
#include "core/batch.hpp"

#include <string>

#include "core/error.hpp"

namespace kvs {

Batch::Batch(std::vector<Session*> sessions) : sessions_(std::move(sessions)) {
  if (sessions_.empty() || sessions_.size() > 65536)
    invalid("kvs_batch_create: count: expected 1..65536, got " + std::to_string(sessions_.size()));
  // Shapes, methods, backends and distinctness; layers are checked at plan time.
  Session::check_compatible(sessions_.data(), sessions_.size(), "kvs_batch_create");
  done_.assign(sessions_[0]->shape().num_layers, 0);
}

void Batch::plan(void* stream) {
  planned_ = false;
  const uint32_t L = sessions_[0]->shape().num_layers;
  for (uint32_t l = 0; l < L; ++l) Session::check_batch(sessions_.data(), sessions_.size(), l, "kvs_batch_plan", false);
  std::vector<Placement*> ps(sessions_.size());
  for (size_t b = 0; b < ps.size(); ++b) ps[b] = &sessions_[b]->placement();
  ps[0]->plan(ps, stream);
  std::fill(done_.begin(), done_.end(), 0);
  planned_ = true;
}

void Batch::decode(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                   const kvs_tensor* lse, void* stream) {
  if (!planned_) fail(KVS_STATUS_INVALID_STATE, "kvs_batch_decode: no plan for this token: call kvs_batch_plan first");
  if (layer >= done_.size())
    invalid("kvs_batch_decode: layer: expected 0.." + std::to_string(done_.size() - 1) + ", got " + std::to_string(layer));
  if (done_[layer])
    fail(KVS_STATUS_INVALID_STATE, "kvs_batch_decode: layer " + std::to_string(layer) +
                                       " was already decoded under this plan: call kvs_batch_plan for the next token");
  Session::run_step(sessions_.data(), sessions_.size(), layer,
                    StepTensors{q, k, v, o, lse, stream, false, "kvs_batch_decode"});
  done_[layer] = 1;
}

}  // namespace kvs
