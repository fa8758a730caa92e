// SPDX-License-Identifier: Apache-2.0
// The session: attention state of one sequence across all layers of one model shape. It keeps what
// is the same on every backend (configuration, the call-order rules: prefill -> build_index ->
// decode/append, statistics) and forwards the work to its placement (core/placement.hpp), which owns
// the KV store and the method's index where they live. All argument validation happens before any
// state changes, so a rejected call leaves the session as it was.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/method.hpp"
#include "core/placement.hpp"
#include "core/tensor.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {

struct SessionConfig {
  ModelShape shape;
  int32_t backend = KVS_BACKEND_CPU;
  int32_t device_id = 0;
  int32_t kv_memory = 0;  // kvs_device_type, 0 = the backend's own memory
  int32_t kv_source = KVS_KV_OWNED;  // kvs_kv_source (runtime: not saved)
  uint32_t num_threads = 0;
  int32_t gemm = KVS_GEMM_AUTO;
  std::string method = "full";
  std::string method_params;
  Budget budget;
  int32_t lse_base = KVS_LSE_BASE_E;  // of the lse a decode step writes (runtime: not saved)
  int64_t max_rollback = 0;           // tokens kvs_session_truncate must reach (runtime: not saved)

  // Validates a public params struct (names the offending field) and converts it.
  static SessionConfig from_params(const kvs_session_params* p);
};

class Session {
 public:
  explicit Session(const SessionConfig& cfg, std::shared_ptr<ThreadPool> pool = nullptr);
  ~Session();

  const SessionConfig& config() const { return cfg_; }
  const ModelShape& shape() const { return cfg_.shape; }

  void prefill(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
               const kvs_tensor* o, void* stream);
  void build_index(void* stream);
  void decode(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
              const kvs_tensor* o, const kvs_tensor* lse, void* stream);
  // kvs_session_decode_tokens: n decode steps of one layer, row by row.
  void decode_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                     const kvs_tensor* o, const kvs_tensor* lse, void* stream);
  void append(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
              const kvs_tensor* o, void* stream);
  // kvs_session_bind_kv (KVS_KV_CALLER sessions): the layer's K/V are in the caller's paged cache.
  void bind_kv(uint32_t layer, const kvs_paged_kv* kv, void* stream);
  // kvs_session_truncate: keeps the first n tokens of every layer (checks the range first).
  void truncate(int64_t n);
  static void decode_batch(Session* const* sessions, size_t count, uint32_t layer, const kvs_tensor* q,
                           const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                           const kvs_tensor* lse, void* stream, bool single = false);

  void save(const std::string& path, uint32_t flags) const;
  static std::unique_ptr<Session> load(const std::string& path, const kvs_load_params* params);
  std::unique_ptr<Session> fork() const;
  // A new session with this one's state (KV, method index, layer states) on another backend or
  // device (kvs_session_to): the state goes through the tables format in memory, no file.
  std::unique_ptr<Session> to(int32_t backend, int32_t device_id) const;

  void stats(kvs_session_stats* out) const;
  int64_t layer_tokens(uint32_t layer) const;
  std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const;
  double method_stat(const std::string& name) const;

  Placement& placement() const { return *placement_; }
  // Validates a batch of sessions for a decode step of `layer` (same shape, method and backend,
  // distinct, decodable); fn names the API call in messages.
  static void check_batch(Session* const* sessions, size_t count, uint32_t layer, const char* fn, bool single);
  // The part of check_batch that does not depend on a layer (kvs_batch_create).
  static void check_compatible(Session* const* sessions, size_t count, const char* fn);
  // Runs a validated batch's step and records the statistics.
  static void run_step(Session* const* sessions, size_t count, uint32_t layer, const StepTensors& t);

 private:
  // The tables writer of a save: header and every section (borrowing this session's buffers).
  std::unique_ptr<io::TablesWriter> tables_writer(bool with_kv, const char* fn) const;
  // The part of load after the file is open; `lp` validated, `path` names the source in messages.
  // runtime (optional): the session whose runtime settings (lse_base, max_rollback) carry over.
  static std::unique_ptr<Session> load_from(const std::shared_ptr<const io::TablesFile>& file,
                                            const kvs_load_params& lp, const std::string& path,
                                            const SessionConfig* runtime = nullptr);
  // A session around an existing placement (fork).
  Session(const SessionConfig& cfg, std::shared_ptr<ThreadPool> pool, std::unique_ptr<Placement> placement);
  void check_layer(uint32_t layer, const char* fn) const;
  void check_decodable(uint32_t layer, const char* fn) const;
  void check_caller_kv(uint32_t layer, int64_t tokens, const kvs_tensor* k, const kvs_tensor* v, const std::string& fn,
                       const char* kn, const char* vn) const;
  void note_step(const StepReport& r);
  void settle_steps() const;  // the placement's settled steps into the statistics
  void add_steps(const Settled& s) const;

  SessionConfig cfg_;
  const MethodSpec* spec_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<Placement> placement_;
  std::vector<uint8_t> built_;          // index built for the layer's current prompt
  std::vector<int64_t> expected_len_;   // tables-only load: prompt lengths to re-supply (-1 = none)
  // kv_source = KVS_KV_CALLER: each layer's last binding (kvs_session_bind_kv checks only what changed).
  struct Bound {
    const void* pool = nullptr;
    const void* v_pool = nullptr;
    int32_t layout = 0;
    int64_t num_pages = 0;
    int32_t page_size = 0;
    int64_t tokens = 0;
    std::vector<int32_t> ids;
  };
  std::vector<Bound> bound_;
  mutable int64_t decode_steps_ = 0;
  // Selection statistics; a placement may settle a step's after it returned (settled_reports).
  mutable double last_selected_ = 0, sum_selected_ = 0, last_fraction_ = 0;
  mutable std::mutex stats_mu_;  // the statistics above and decode_steps_ (concurrent const calls)
};

}  // namespace kvs
