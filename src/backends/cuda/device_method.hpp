// SPDX-License-Identifier: Apache-2.0
// A method's implementation on the cuda placement: its index lives on the GPU, and a decode step
// is launches only (no host synchronisation, no allocation), reading the query and the paged KV
// where they are and writing a selection into device buffers that the placement attends.
//
// The placement owns the KV pages and the step: it appends the new tokens, builds the batch's page
// table, asks plan() (host only) how large the selection and the method's scratch must be, calls
// select() and then runs dense or gathered attention. The index's serialised form is the tables
// file's, the same as the CPU implementation's, so an index moves between placements through
// save/load (a CPU-built tables file loads onto the GPU and decodes the same).
#pragma once
#ifdef KVS_HAVE_CUDA
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kv_layout.cuh"
#include "core/method.hpp"

namespace kvs {

// One sequence's layer as a method sees it outside a step (prefill, append, build).
struct DeviceLayerView {
  cuda::PagedKv kv;      // B = 1: this sequence's own page table
  int64_t tokens = 0;    // tokens stored
  void* stream = nullptr;
  bool host_kv = false;  // the pages live in pinned host memory (kv_memory = KVS_DEVICE_CUDA_HOST), but
                         // for those hot_tokens() keeps in GPU memory
};

// The tokens of a layer a method wants in GPU memory while the KV cache lives in pinned host
// memory: [0, head_end) and [tail_begin, tokens), by whole pages.
struct HotTokens {
  int64_t head_end = 0;
  int64_t tail_begin = INT64_MAX;
};

// One layer of one decode step for a batch, as built by the placement (after the append).
struct DeviceStep {
  cuda::AttnShape shape;            // batch = B
  cuda::Scalar kv_dtype = cuda::Scalar::BF16;
  cuda::PagedKv kv;                 // the batch's page table
  cuda::Query q;
  const int32_t* lengths = nullptr;      // device [B]: tokens after the append
  const int32_t* budget_keys = nullptr;  // device [B]: the budget in keys for that length
  std::span<const int64_t> host_lengths; // the same, on the host
  std::span<const int64_t> host_budget;
  int32_t max_length = 0;
  void* stream = nullptr;
  // The stream's last launch is the step's own (the KV append, which writes no query): select()'s
  // first kernel may be a programmatic dependent launch (the `pdl` of cuda_attention.cuh).
  bool pdl = false;
  // With DevicePlan::prior: where select() writes the attention state over keys outside its lists
  // (o [B, Hq, d] fp32, lse [B, Hq] natural log; -inf for none), merged into the step's output.
  float* prior_o = nullptr;
  float* prior_lse = nullptr;
};

// What a step needs, decided on the host before any launch.
struct DevicePlan {
  bool dense = false;           // attend every key (no selection)
  bool per_query_head = false;  // selection rows are query heads (else KV heads)
  int32_t max_selected = 0;     // capacity of a selection row
  size_t workspace = 0;         // the method's own scratch for select()
  size_t arg_bytes = 0;         // bytes of per-step arguments the method uploads (see select)
  bool prior = false;           // select() also writes a prior state (DeviceStep::prior_o, _lse)
  // False: `selected` is only a bound; the step's exact counts come later from settle_selected
  // (the session's statistics then wait for them).
  bool selected_exact = true;
  std::vector<double> selected; // per session: the exact keys each KV head attends (statistics)
};

class DeviceMethod {
 public:
  virtual ~DeviceMethod() = default;
  // Tokens [t0, t1) were stored in the layer (prefill chunk, appended turn, or t1 - t0 = 1 for the
  // token a decode step appends: then called before select, in stream order).
  virtual void on_tokens(uint32_t layer, const DeviceLayerView& v, int64_t t0, int64_t t1) {}
  // A prompt chunk's queries (q: [n][Hq][d] on the device, F32 or the KV dtype) for tokens
  // [t0, t0 + n), before on_tokens of the same chunk (methods that cluster the prompt's queries).
  virtual void on_prompt(uint32_t layer, const DeviceLayerView& v, const cuda::Query& q, int64_t t0, int64_t n) {}
  virtual void build_index(uint32_t layer, const DeviceLayerView& v) {}
  // Room for the index of `tokens` tokens in the layer, so that the steps up to there allocate
  // nothing (called before every step, by a batch plan and by each direct decode, before
  // fill_args: device buffers may move here, never during a step).
  virtual void reserve(uint32_t layer, int64_t tokens, void* stream) {}
  // Host side of a decode step, after reserve and before plan: v holds the tokens stored before the
  // step, `tokens` counts the step's own (v.tokens + 1). A method whose index changes on the host
  // as the context grows (retroinfer's update) does it here, so that the step sees it.
  virtual void before_step(uint32_t layer, const DeviceLayerView& v, int64_t tokens) {}
  // With the KV cache in pinned host memory: the tokens the step at `tokens` tokens (budget_keys its
  // budget) reads most
  // (RetroInfer's steady zone), which the placement then keeps in GPU memory (pages move between
  // host and device in stream order after before_step; a new page starts in GPU memory while the
  // tail is hot). The default: none, every page stays in host memory.
  virtual HotTokens hot_tokens(uint32_t layer, int64_t tokens, int64_t budget_keys) const { return {}; }
  // kv_source = KVS_KV_CALLER: whether the method reads the caller's KV pages of P tokens, in
  // kvsieve's own layout (own_layout: HND, K and V in one page) or another (kv_layout.cuh); if not,
  // why, naming the kvs_paged_kv field. The default: any P and layout the kernels take.
  virtual bool caller_kv_ok(int32_t P, bool own_layout, std::string* why) const { return true; }
  virtual void truncate(uint32_t layer, int64_t n) {}
  // The least length kvs_session_truncate may roll the layer back to (0: any; else why not below).
  virtual int64_t truncate_floor(uint32_t layer, std::string* why) const { return 0; }
  // Host only, on batch[0]'s implementation for the whole batch.
  virtual DevicePlan plan(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& step) const = 0;
  // Launches that write the selection (idx [B, H, max_selected] -1 padded, cnt [B, H]) unless the
  // plan is dense. `args` is plan.arg_bytes of device memory holding what fill_args wrote on the
  // host (uploaded in stream order before this call).
  virtual void fill_args(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& step,
                         void* host_args) const {}
  virtual void select(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& step,
                      const DevicePlan& plan, const void* args, int32_t* idx, int32_t* cnt,
                      const cuda::Workspace& ws) = 0;
  // After select() (on batch[0]'s implementation): the page table the gathered attention reads
  // instead of the step's, when select() wrote its selection against one of its own (RetroInfer's
  // wave buffer: block-cache pages ahead of the sequence's); false for the step's.
  virtual bool attention_kv(cuda::PagedKv* kv) const { return false; }
  // The keys of this session's last selection of a layer and KV head (as select() wrote them, read
  // back after the step) as token positions, for the selections of a method with its own page table
  // (attention_kv). May synchronise.
  virtual void token_positions(uint32_t layer, uint32_t kv_head, std::vector<int32_t>& keys) const {}
  // True when a step can be captured in a CUDA graph and replayed for later tokens: for a decode
  // token on_tokens launches only work that reads tokens stored before that token (it runs in
  // stream order before the replay, while the token is appended by the replay), and select() launches the same kernels with the same
  // arguments for every step with the same plan capacities (DeviceStep::max_length, the plan's
  // max_selected, workspace), reading every per-token value from device memory (lengths,
  // budget_keys, the uploaded args, and the query through DeviceStep::q.at, which is set in a
  // captured step: the caller's query may move between replays). The placement may then raise
  // max_length and max_selected to a bucket's capacity (select() must treat them as capacities)
  // and replays one graph per layer.
  virtual bool capturable() const { return false; }
  // Before a save: bring the index up to date for the stored tokens (may synchronise).
  virtual void finish(uint32_t layer, const DeviceLayerView& v) {}

  // After a load: as Method::index_fits.
  virtual bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const { return true; }
  virtual nlohmann::json save_meta() const { return nlohmann::json::object(); }
  virtual void save(io::TablesWriter& w) const {}
  virtual void load(const io::TablesFile& f, const nlohmann::json& meta) {}
  virtual std::unique_ptr<DeviceMethod> clone(void* stream) const = 0;
  virtual uint64_t index_bytes() const { return 0; }
  // For plans with selected_exact = false: the exact keys attended (mean over KV heads) summed over
  // this session's steps since the last call, and the latest step's (may synchronise).
  virtual void settle_selected(double* sum, double* last) const {}
  virtual bool stat(std::string_view name, double* out) const { return false; }
};

}  // namespace kvs
#endif
