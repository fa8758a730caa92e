#include "core/batch.hpp"

#include <string>

#include "core/error.hpp"

namespace kvs {

Batch::Batch(std::vector<Session*> sessions) : sessions_(std::move(sessions)) {
  if (sessions_.empty() || sessions_.size() > 65536)
    invalid("kvs_batch_create: count: expected 1..65536, got " + std::to_string(sessions_.size()));
  // Shapes, methods, backends and distinctness; layers are checked at plan time.
  const Session& s0 = *sessions_[0];
  for (size_t b = 0; b < sessions_.size(); ++b) {
    const Session& sb = *sessions_[b];
    const auto &a = sb.config().shape, &z = s0.config().shape;
    if (a.num_q_heads != z.num_q_heads || a.num_kv_heads != z.num_kv_heads || a.head_dim != z.head_dim ||
        a.num_layers != z.num_layers || a.kv_dtype != z.kv_dtype || a.softmax_scale != z.softmax_scale ||
        sb.config().backend != s0.config().backend || sb.config().method != s0.config().method ||
        (sb.config().backend != KVS_BACKEND_CPU && sb.config().device_id != s0.config().device_id))
      invalid("kvs_batch_create: sessions[" + std::to_string(b) +
              "]: expected the shape, dtype, softmax scale, method, backend and device of sessions[0]");
    for (size_t c = 0; c < b; ++c)
      if (sessions_[c] == sessions_[b]) invalid("kvs_batch_create: sessions[" + std::to_string(b) + "] appears twice");
  }
  done_.assign(s0.shape().num_layers, 0);
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
