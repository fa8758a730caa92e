// SPDX-License-Identifier: Apache-2.0
// The backend and placement registry: an explicit list (no static-initialisation tricks, so static
// linking keeps every backend). The only place that knows whether this build has CUDA: the cuda
// backend and its placement are listed here (each method's spec names its own cuda implementation).
#include <string>

#include "backends/backend.hpp"
#include "core/error.hpp"
#include "core/placement.hpp"
#include "core/session.hpp"

namespace kvs {

const Backend& cpu_backend();
std::unique_ptr<Placement> make_cpu_placement(const SessionConfig&, const MethodSpec&, const ParamSet&,
                                              std::shared_ptr<ThreadPool>);
#ifdef KVS_HAVE_CUDA
const Backend& cuda_backend();
std::unique_ptr<Placement> make_cuda_placement(const SessionConfig&, const MethodSpec&, const ParamSet&,
                                               std::shared_ptr<ThreadPool>);
const Backend& hybrid_backend();
std::unique_ptr<Placement> make_hybrid_placement(const SessionConfig&, const MethodSpec&, const ParamSet&,
                                                 std::shared_ptr<ThreadPool>);
constexpr const char* kNoCuda = nullptr;
#else
constexpr const char* kNoCuda = "this build of kvsieve has no CUDA backend (configure with KVS_WITH_CUDA=ON where nvcc is installed)";
#endif
constexpr const char* kNoHybrid =
    "this build of kvsieve has no CUDA backend, which the hybrid CPU+GPU placement needs (configure with "
    "KVS_WITH_CUDA=ON where nvcc is installed)";

// Called once by method_registry() (src/methods/registry.cpp) on the assembled list.
void attach_placements(std::vector<MethodSpec>& specs) {
  for (auto& s : specs) {
    s.backends = 0;
    for (int32_t b = KVS_BACKEND_CPU; b <= KVS_BACKEND_HYBRID; ++b) {
      std::string why;
      if (method_supported(s, b, &why)) s.backends |= 1u << b;
      else s.unsupported[b] = why;
    }
  }
}

// The defaults of a placement that has no rollback (the cuda placement, for now).
int64_t Placement::truncate_floor(uint32_t, std::string* why) const {
  *why = std::string("not supported on the ") + ops().name() + " backend yet (truncate on the cpu backend, or move "
         "the session there with kvs_session_to)";
  return -1;
}

void Placement::truncate(int64_t) {
  fail(KVS_STATUS_UNSUPPORTED, std::string("kvs_session_truncate: not supported on the ") + ops().name() + " backend yet");
}

void Placement::bind_kv(uint32_t, const BoundKv&, const char* fn, void*) {
  fail(KVS_STATUS_UNSUPPORTED, std::string(fn) + ": the " + ops().name() + " backend attends only the KV it stores");
}

const Backend* find_backend(int32_t id, const char** why_not) {
  if (id == KVS_BACKEND_CPU) return &cpu_backend();
  if (id == KVS_BACKEND_CUDA) {
#ifdef KVS_HAVE_CUDA
    return &cuda_backend();
#else
    if (why_not) *why_not = kNoCuda;
    return nullptr;
#endif
  }
  if (id == KVS_BACKEND_HYBRID) {
#ifdef KVS_HAVE_CUDA
    return &hybrid_backend();
#else
    if (why_not) *why_not = kNoHybrid;
    return nullptr;
#endif
  }
  if (why_not) *why_not = "unknown backend";
  return nullptr;
}

bool method_supported(const MethodSpec& spec, int32_t backend, std::string* why_not) {
  const char* why = nullptr;
  if (backend == KVS_BACKEND_CPU) return true;
  if (!find_backend(backend, &why)) {
    if (why_not) *why_not = why;
    return false;
  }
  if (backend == KVS_BACKEND_CUDA && !spec.create_cuda) {
    if (why_not) *why_not = std::string(spec.name) + ": " + spec.cuda_missing;
    return false;
  }
  return true;
}

std::unique_ptr<Placement> make_placement(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& ps,
                                          std::shared_ptr<ThreadPool> pool) {
  // (Before the backend's availability: the rule holds in every build, and a load says the same.)
  if (cfg.kv_source == KVS_KV_CALLER && cfg.backend == KVS_BACKEND_HYBRID)
    fail(KVS_STATUS_UNSUPPORTED, "params->kv_source: the hybrid backend keeps its own KV (pinned host memory); "
                                 "a cache the caller owns is attended on the cpu or cuda backend");
  std::string why;
  if (!method_supported(spec, cfg.backend, &why))
    fail(KVS_STATUS_UNSUPPORTED, "params->backend: method '" + cfg.method + "' cannot run on the " +
                                     (cfg.backend == KVS_BACKEND_CUDA ? "cuda" : cfg.backend == KVS_BACKEND_HYBRID ? "hybrid" : "cpu") +
                                     " backend: " + why);
#ifdef KVS_HAVE_CUDA
  if (cfg.backend == KVS_BACKEND_CUDA) return make_cuda_placement(cfg, spec, ps, std::move(pool));
  if (cfg.backend == KVS_BACKEND_HYBRID) return make_hybrid_placement(cfg, spec, ps, std::move(pool));
#endif
  if (cfg.kv_memory != 0 && cfg.kv_memory != KVS_DEVICE_CPU)
    fail(KVS_STATUS_UNSUPPORTED, "params->kv_memory: the cpu backend keeps its KV cache in host memory "
                                 "(KVS_DEVICE_CPU or 0), got " + std::to_string(cfg.kv_memory));
  return make_cpu_placement(cfg, spec, ps, std::move(pool));
}

}  // namespace kvs
