// SPDX-License-Identifier: Apache-2.0
// The host half of the hybrid placement (src/hybrid/), implemented by the cpu placement: one
// session's decode step up to its selection (the KV append, the method's update and select, its
// extra state), leaving the exact attention over the selection to the GPU. Everything else a
// hybrid session does (prefill, index build, append, rollback, save/load, fork, statistics) is the
// cpu placement's own code, so the two placements cannot drift apart.
#pragma once
#include <cstdint>

#include "core/kv_store.hpp"
#include "core/method.hpp"
#include "core/placement.hpp"

namespace kvs {

class HostPart {
 public:
  struct Step {
    const Selection* sel = nullptr;  // valid until the layer's next step or truncate
    bool has_extra = false;          // extra_o / extra_lse were written
    StepReport report;
  };
  virtual ~HostPart() = default;
  // q [Hq][d], k, v [Hkv][d] fp32. Appends the token, runs the method (timed into the session's
  // decode_update/select_seconds), checks the selection against the layer and writes the method's
  // extra state (o [Hq][d], lse [Hq], natural log) when it has one. Throws with the layer and the
  // method as they were.
  virtual Step select_step(uint32_t layer, const float* q, const float* k, const float* v, float* extra_o,
                           float* extra_lse) = 0;
  // Takes back the latest select_step of the layer (a later session of the batch failed).
  virtual void undo_step(uint32_t layer) = 0;
  // After the batch's steps all succeeded: the rollback history records the step's query.
  virtual void log_decode(uint32_t layer, const float* q) = 0;
  virtual KVLayer& kv_layer(uint32_t layer) = 0;
};

// The host part of a cpu placement (null for any other placement).
HostPart* host_part(Placement* p);

}  // namespace kvs
