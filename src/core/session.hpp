// The session: attention state of one sequence across all layers of one model shape. It owns the
// KV store (paged, shareable) and the method (index), and runs the decode data flow of DESIGN.md:
// append -> method.select -> attend -> method.extra -> merge. All argument validation happens before
// any state changes, so a rejected call leaves the session as it was.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/method.hpp"
#include "core/tensor.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs {

class CudaBackend;  // src/backends/cuda (only with KVS_HAVE_CUDA)

struct SessionConfig {
  ModelShape shape;
  int32_t backend = KVS_BACKEND_CPU;
  int32_t device_id = 0;
  uint32_t num_threads = 0;
  int32_t gemm = KVS_GEMM_AUTO;
  std::string method = "full";
  std::string method_params;
  Budget budget;

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
  void append(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
              const kvs_tensor* o, void* stream);
  static void decode_batch(Session* const* sessions, size_t count, uint32_t layer, const kvs_tensor* q,
                           const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                           const kvs_tensor* lse, void* stream, bool single = false);

  void save(const std::string& path, uint32_t flags) const;
  static std::unique_ptr<Session> load(const std::string& path, const kvs_load_params* params);
  std::unique_ptr<Session> fork() const;

  void stats(kvs_session_stats* out) const;
  int64_t layer_tokens(uint32_t layer) const;
  std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const;
  double method_stat(const std::string& name) const;

  // Core decode on fp32 host buffers (validated inputs): q [Hq][d], k, v [Hkv][d] -> o [Hq][d], lse [Hq].
  void decode_f32(uint32_t layer, const float* q, const float* k, const float* v, float* o, float* lse);

 private:
  void check_layer(uint32_t layer, const char* fn) const;
  int64_t n_tokens(uint32_t layer) const;  // tokens held by the layer on whichever backend
  void check_decodable(uint32_t layer, const char* fn) const;
  void causal_outputs(uint32_t layer, const float* q, int64_t n, int64_t first, float* o);
  void add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                  const kvs_tensor* o, const char* fn, bool prompt, int64_t max_tokens);

  SessionConfig cfg_;
  const MethodSpec* spec_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<Method> method_;
  std::vector<KVLayer> layers_;
  std::vector<uint8_t> built_;          // index built for the layer's current prompt
  std::vector<int64_t> expected_len_;   // tables-only load: prompt lengths to re-supply (-1 = none)
  std::vector<Selection> last_sel_;
  std::vector<int64_t> last_n_;
  int64_t decode_steps_ = 0;
  double last_selected_ = 0, sum_selected_ = 0, last_fraction_ = 0;
  // Wall time of the CPU decode phases, summed over every step and layer: the method's streaming
  // update (on_append), its selection (select) and the exact attention with the merge.
  double phase_seconds_[3] = {0, 0, 0};
  std::unique_ptr<CudaBackend> cuda_;
  friend class CudaBackend;
};

}  // namespace kvs
