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
#include "core/thread_pool.hpp"

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
  // The method's static set at a layer of n tokens and its bounds (Method::static_keys; safe to
  // call while a step runs on another thread).
  virtual StaticKeys static_keys(uint32_t layer, int64_t n) const = 0;
  virtual StaticKeys static_capacity() const = 0;
  // After select_step: attention of q [Hq][d] over the step's selection without its static set
  // (held and attended elsewhere), merged with the method's extra state when the step had one:
  // o [Hq][d], lse [Hq] (natural log; -inf where a head has nothing left). Throws
  // KVS_STATUS_INTERNAL if a list lacks a key of the static set. Returns the keys it attended per
  // list (the mean over the selection's lists), timed into the session's decode_attend_seconds.
  virtual double attend_rest(uint32_t layer, const float* q, const Step& step, StaticKeys sk, float* o,
                             float* lse) = 0;
  // select_step and attend_rest of different sessions may run at once (on different threads).
  // Takes back the latest select_step of the layer (another session of the batch failed).
  virtual void undo_step(uint32_t layer) = 0;
  // After the batch's steps all succeeded: the rollback history records the step's query.
  virtual void log_decode(uint32_t layer, const float* q) = 0;
  virtual KVLayer& kv_layer(uint32_t layer) = 0;
  // The session's thread pool (the steps of a batch run as one job on its leader's).
  virtual ThreadPool& pool() = 0;
};

// The host part of a cpu placement (null for any other placement).
HostPart* host_part(Placement* p);

namespace testing {
// Unit tests only (a hidden symbol, not part of the C ABI): from now on, the decode step of a cpu or
// hybrid session whose layer holds `tokens` tokens before the step fails after its method's update
// and selection, with KVS_STATUS_INTERNAL "injected failure" - a failure past every argument check,
// as running out of memory there would be. -1 turns it off (the default).
void fail_step_at(int64_t tokens);
}  // namespace testing

}  // namespace kvs
