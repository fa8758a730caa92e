// SPDX-License-Identifier: Apache-2.0
// The method interface: the strategy that decides which keys each decode step attends to.
// A method sees the layer's KV store (read-only), the prompt and decode queries, and returns a
// Selection; optionally it adds an extra attention state (estimated or bypassed part) that the
// session merges by LSE. See docs/architecture.md for the data flow.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/kv_store.hpp"
#include "core/params.hpp"
#include "core/thread_pool.hpp"

namespace kvs::io {
class TablesWriter;
class TablesFile;
}  // namespace kvs::io

namespace kvs {

struct ModelShape {
  uint32_t num_layers, num_q_heads, num_kv_heads, head_dim;
  float softmax_scale;
  DType kv_dtype;
  int group() const { return int(num_q_heads / num_kv_heads); }
};

// How many exact keys a step may attend: absolute tokens win over a fraction of the context.
struct Budget {
  double fraction = 0.0;  // 0 = unset
  int64_t tokens = 0;     // 0 = unset
  bool set() const { return fraction > 0 || tokens > 0; }
  // Keys for a context of n tokens given the method's default fraction; at least 1, at most n.
  int64_t keys(int64_t n, double default_fraction) const;
};

struct Selection {
  enum class Kind { All, PerKvHead, PerQueryHead };
  Kind kind = Kind::All;
  std::vector<std::vector<int32_t>> lists;  // Hkv or Hq lists of distinct token indices
  // false: the lists only report the exact keys the method attends itself, its whole state coming
  // from extra() (HGCA: near window + far part); the session does not attend them.
  bool attend = true;
};

// Counts of a static set (Method::static_keys).
struct StaticKeys {
  int64_t sinks = 0, recent = 0;
  int64_t total() const { return sinks + recent; }
};

struct MethodContext {
  ModelShape shape;
  Budget budget;
  ThreadPool* pool;
  int32_t gemm;  // kvs_gemm_provider, resolved
};

class Method {
 public:
  virtual ~Method() = default;

  // After a layer's prompt K/V are stored: q [n][Hq][d] fp32 (the prompt's queries).
  virtual void on_prefill(uint32_t layer, const float* q, int64_t n, const KVLayer& kv) {}
  // Builds the index of one prefilled layer.
  virtual void build_index(uint32_t layer, const KVLayer& kv) {}
  // After n new tokens were appended to the layer (n = 1 for a decode step, before select).
  // q [n][Hq][d] fp32. decode = true for a decode step, false for kvs_session_append.
  virtual void on_append(uint32_t layer, const float* q, int64_t n, const KVLayer& kv, bool decode) {}
  // The layer was truncated back to n tokens (a failed call is rolled back): forget indexed state
  // about tokens >= n.
  virtual void truncate(uint32_t layer, int64_t n) {}
  // True when truncate(layer, n) rolls a layer back exactly to any n >= 0, its index being a
  // function of the keys alone (full, exact_topk, streaming, quest). False: truncate only undoes the
  // latest call, and kvs_session_truncate restores a copy of the method taken earlier and replays
  // the calls since (the cpu placement's rollback history, docs/api.md "Rollback").
  virtual bool exact_truncate() const { return false; }
  // The exact keys to attend for decode query q [Hq][d] over kv (which already holds the new token).
  virtual void select(uint32_t layer, const float* q, const KVLayer& kv, Selection& out) = 0;
  // An extra attention state over keys disjoint from the selection (o [Hq][d], lse [Hq]); return
  // false when there is none this step.
  virtual bool extra(uint32_t layer, const float* q, const KVLayer& kv, float* o, float* lse) { return false; }
  // The static set: keys that every list of this step's selection holds whatever the query, tokens
  // [0, sinks) and [n - recent, n) of a layer of n tokens (the step's, the new token included),
  // the two ranges disjoint. The hybrid placement keeps them in GPU memory and attends them there
  // while the CPU attends the rest of the selection (src/hybrid/). A pure function of the method's
  // parameters, its budget and n: it may be called while another thread runs select(). The default:
  // no static set.
  virtual StaticKeys static_keys(uint32_t layer, int64_t n) const { return {}; }
  // Upper bounds of static_keys() over every layer and n ({0, 0}: the method has no static set).
  virtual StaticKeys static_capacity() const { return {}; }

  // Tables: header entries (small JSON stored in the file header under method.meta) and sections
  // written through w (borrowed pieces must stay valid until the write ends).
  virtual nlohmann::json save_meta() const { return nlohmann::json::object(); }
  virtual void save(io::TablesWriter& w) const {}
  virtual void load(const io::TablesFile& f, const nlohmann::json& meta) {}
  // After a load: whether the loaded index of `layer` fits a layer of `tokens` tokens (the count
  // the file's header gives); if not, why. A forged or inconsistent file must fail here, not make
  // a later step read tokens the layer does not hold. The default: no per-layer index.
  virtual bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const { return true; }
  virtual std::unique_ptr<Method> clone() const = 0;
  virtual uint64_t index_bytes() const { return 0; }
  // A named method-specific statistic; false if unknown.
  virtual bool stat(std::string_view name, double* out) const { return false; }
};

class DeviceMethod;  // a method's implementation on the cuda placement (src/backends/cuda/device_method.hpp)

struct MethodSpec {
  const char* name;
  const char* doc;
  uint32_t backends;  // bit mask of (1 << kvs_backend) with an implementation in this build (set by the registry)
  double default_budget;  // fraction used when the session sets none
  std::vector<ParamSpec> params;
  // The CPU implementation: the reference every other placement is tested against.
  std::function<std::unique_ptr<Method>(const MethodContext&, const ParamSet&)> create;
  // The cuda placement's implementation (KVS_CUDA_IMPL(make_<m>_cuda)); null = none in this build.
  std::unique_ptr<DeviceMethod> (*create_cuda)(const MethodContext&, const ParamSet&) = nullptr;
  // Why the method has no cuda implementation (when create_cuda is null): a sentence for the user.
  const char* cuda_missing = "not implemented on the cuda backend yet";
  // Per kvs_backend (index 1..3): empty if the method runs there in this build, else why not
  // (filled by the registry; kvs_method_unsupported_reason returns these).
  std::string unsupported[4];
};

// A method's cuda implementation factory in its spec: the function where this build has CUDA,
// nullptr where it does not (the function is then declared but never defined or referenced).
#ifdef KVS_HAVE_CUDA
#define KVS_CUDA_IMPL(factory) (factory)
#else
#define KVS_CUDA_IMPL(factory) nullptr
#endif

const std::vector<MethodSpec>& method_registry();
const MethodSpec* find_method(std::string_view name);

}  // namespace kvs
