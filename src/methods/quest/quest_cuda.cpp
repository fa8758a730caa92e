// SPDX-License-Identifier: Apache-2.0
// quest on the cuda placement: the page bounds (max then min per page, KV head and dimension, in the
// KV dtype: the stored key values, exact) live on the device per layer and are folded in as tokens
// arrive; a step scores pages by the upper bound (summed over the group, or per query head), picks
// the top pages plus the current one and attends their tokens (quest_select, then the gathered
// kernel). The rules are the CPU method's (quest.cpp) except score_dtype=f16 (the fp16 page scores
// of the authors' kernel), which is refused here; the tables sections are the same (fp32
// bounds), so a CPU-built index loads here and the other way round.
//
// The last page is always attended and never scored, so its bounds are folded in once it is no
// longer the last page: by the first decode token past it (one launch per session every page_size
// decode steps, reading only tokens stored before that step, so it runs before a captured step's
// launches), by an append of several tokens, and before a save. A step is graph-capturable: the
// query is read through DeviceStep::q.at, every per-token value comes from device memory, and the
// page capacity of the selection grows in steps of 256 keys (kWantStep).
#ifdef KVS_HAVE_CUDA
#include <algorithm>
#include <cstring>
#include <vector>

#include "backends/cuda/cuda_util.hpp"
#include "backends/cuda/device_method.hpp"
#include "backends/cuda/quest.cuh"
#include "methods/quest/quest.hpp"
#include "core/dtype.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"

namespace kvs {
namespace {

using cudautil::check;
using cudautil::S;

class QuestCuda final : public DeviceMethod {
 public:
  QuestCuda(const MethodContext& ctx, const ParamSet& p)
      : shape_(ctx.shape),
        budget_(ctx.budget),
        page_(p.get_int("page_size")),
        dense_layers_(p.get_int("dense_layers")),
        per_query_(p.get_string("gqa") == "per_query_head"),
        fit_(p.get_string("page_budget") == "fit"),
        layers_(ctx.shape.num_layers) {
    if (page_ < 1 || page_ > 4096) invalid("method_params: quest page_size must be in [1, 4096]");
    if (dense_layers_ < 0) invalid("method_params: quest dense_layers must be >= 0");
    // The selection kernel compares fp32 page scores; the authors' fp16 rounding is cpu only.
    if (p.get_string("score_dtype") != "f32")
      fail(KVS_STATUS_UNSUPPORTED, "method_params: quest score_dtype=" + p.get_string("score_dtype") +
                                       " is not supported on the cuda backend (cpu only); use score_dtype=f32");
    check(cudaGetDevice(&device_), "cudaGetDevice");
  }
  ~QuestCuda() override {
    for (auto& l : layers_) cudaFree(l.bounds);
  }
  QuestCuda(const QuestCuda&) = delete;

  void on_tokens(uint32_t layer, const DeviceLayerView& v, int64_t t0, int64_t t1) override {
    if (t1 - t0 == 1) {  // a decode token: the pages before its own are candidates from now on
      const int64_t whole = t0 / page_ * page_;
      if (layers_[layer].folded < whole) fold(layer, v, whole);
      return;
    }
    fold(layer, v, t1);
  }
  bool capturable() const override { return true; }
  void build_index(uint32_t layer, const DeviceLayerView& v) override {
    layers_[layer].folded = 0;
    fold(layer, v, v.tokens);
  }
  void reserve(uint32_t layer, int64_t tokens, void* stream) override {
    grow(layers_[layer], (tokens + page_ - 1) / page_, stream);
  }
  void truncate(uint32_t layer, int64_t n) override {
    auto& l = layers_[layer];
    l.folded = std::min(l.folded, n / page_ * page_);
  }
  void finish(uint32_t layer, const DeviceLayerView& v) override {
    if (layers_[layer].bounds || layers_[layer].folded > 0) fold(layer, v, v.tokens);
  }

  DevicePlan plan(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& st) const override {
    DevicePlan p;
    if (int64_t(layer) < dense_layers_) {
      p.dense = true;
      return p;
    }
    p.per_query_head = per_query_;
    int64_t max_want = 1;
    for (size_t b = 0; b < st.host_lengths.size(); ++b) {
      const int64_t n = st.host_lengths[b], pages = (n + page_ - 1) / page_;
      const int64_t k = budget_keys(batch[b], n, st.host_budget[b]), cur = n - (pages - 1) * page_;
      const auto [want, skip] = quest_page_plan(n, k, page_, static_cast<const QuestCuda*>(batch[b])->fit_);
      max_want = std::max(max_want, want);
      p.selected.push_back(double((want - 1) * page_ + cur - skip));
    }
    // Capacity in whole pages, grown in steps of kWantStep keys: a captured step (whose kernels
    // take max_want as an argument) then serves every token until the budget leaves the step.
    max_want = std::max(max_want, (max_want * page_ + kWantStep - 1) / kWantStep * kWantStep / page_);
    p.max_selected = int32_t(max_want * page_);
    max_want_ = int32_t(max_want);
    p.workspace = cuda::quest_select_workspace_bytes(st.shape, st.max_length, int32_t(page_), int32_t(max_want));
    p.arg_bytes = st.host_lengths.size() * (sizeof(void*) + sizeof(int32_t));
    return p;
  }
  // Arguments: the sessions' bounds buffers [B], then their page budgets in keys [B] (int32).
  void fill_args(std::span<DeviceMethod* const> batch, uint32_t layer, const DeviceStep& st, void* host) const override {
    auto* ptrs = static_cast<const void**>(host);
    auto* keys = reinterpret_cast<int32_t*>(ptrs + batch.size());
    for (size_t b = 0; b < batch.size(); ++b) {
      ptrs[b] = static_cast<const QuestCuda*>(batch[b])->layers_[layer].bounds;
      const int32_t k = int32_t(budget_keys(batch[b], st.host_lengths[b], st.host_budget[b]));
      keys[b] = static_cast<const QuestCuda*>(batch[b])->fit_ ? -k : k;  // negative: fit (quest.cuh)
    }
  }
  void select(std::span<DeviceMethod* const>, uint32_t, const DeviceStep& st, const DevicePlan& p, const void* args,
              int32_t* idx, int32_t* cnt, const cuda::Workspace& ws) override {
    const auto* bounds = static_cast<const void* const*>(args);
    const auto* keys = reinterpret_cast<const int32_t*>(bounds + st.shape.batch);
    check(cuda::quest_select(st.shape, st.q, st.kv_dtype, bounds, st.lengths, keys, st.max_length, int32_t(page_), max_want_, per_query_, idx, cnt,
                             p.max_selected, ws, st.stream, st.pdl),
          "quest_select");
  }

  // ---- tables: the CPU method's sections (fp32 bounds [page][Hkv][2][d], indexed_tokens) ----
  nlohmann::json save_meta() const override {
    nlohmann::json meta = nlohmann::json::object();
    for (uint32_t l = 0; l < layers_.size(); ++l)
      if (layers_[l].folded > 0) meta["indexed_tokens"][std::to_string(l)] = layers_[l].folded;
    return meta;
  }
  void save(io::TablesWriter& w) const override {
    staged_.clear();
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      if (L.folded <= 0) continue;
      const int64_t pages = (L.folded + page_ - 1) / page_;
      std::vector<uint16_t> raw(size_t(pages) * per_page());
      check(cudaMemcpy(raw.data(), L.bounds, raw.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy(quest bounds)");
      staged_.emplace_back(raw.size());
      convert_to_f32(raw.data(), shape_.kv_dtype, staged_.back().data(), raw.size());
      w.add("quest.bounds", int32_t(l), -1,
            {io::Piece{staged_.back().data(), uint64_t(staged_.back().size() * sizeof(float))}});
    }
  }
  void load(const io::TablesFile& f, const nlohmann::json& meta) override {
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      const auto* s = f.find("quest.bounds", int32_t(l), -1);
      if (!s) continue;
      const auto key = std::to_string(l);
      // Header numbers are range-checked before they are converted (io/header.hpp).
      const io::HeaderReader hm(f.path(), "method.meta");
      const int64_t n =
          hm.sub("indexed_tokens").integer<int64_t>(hm.object(meta, "indexed_tokens"), key, 0, (int64_t(1) << 31) - 1);
      const int64_t pages = (n + page_ - 1) / page_;
      if (s->length != uint64_t(pages) * per_page() * sizeof(float))
        fail(KVS_STATUS_FORMAT_INVALID, hm.where() + "section quest.bounds layer " + key + ": size does not match " +
                                            std::to_string(n) + " indexed tokens");
      std::vector<float> f32(size_t(pages) * per_page());
      std::memcpy(f32.data(), s->data, s->length);
      std::vector<uint16_t> raw(f32.size());
      convert_from_f32(f32.data(), raw.data(), shape_.kv_dtype, raw.size());
      auto& L = layers_[l];
      grow(L, pages, nullptr);
      check(cudaMemcpy(L.bounds, raw.data(), raw.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy(quest bounds)");
      L.folded = n;
    }
  }
  std::unique_ptr<DeviceMethod> clone(void* stream) const override {
    auto c = std::unique_ptr<QuestCuda>(new QuestCuda(shape_, budget_, page_, dense_layers_, per_query_, fit_, device_));
    for (size_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      if (!L.bounds) continue;
      c->grow(c->layers_[l], L.cap, stream);
      check(cudaMemcpyAsync(c->layers_[l].bounds, L.bounds, size_t(L.cap) * per_page() * 2, cudaMemcpyDeviceToDevice,
                            S(stream)),
            "cudaMemcpyAsync(quest bounds)");
      c->layers_[l].folded = L.folded;
    }
    return c;
  }
  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    if (layers_[layer].folded <= tokens) return true;
    *why = "its quest bounds cover " + std::to_string(layers_[layer].folded) + " tokens";
    return false;
  }
  uint64_t index_bytes() const override {
    uint64_t b = 0;
    for (auto& l : layers_) b += uint64_t(l.cap) * per_page() * 2;
    return b;
  }

 private:
  struct Layer {
    void* bounds = nullptr;  // [cap][Hkv][2][d] in the KV dtype
    int64_t cap = 0;         // pages
    int64_t folded = 0;      // tokens folded into the bounds
  };
  QuestCuda(const ModelShape& s, const Budget& budget, int64_t page, int64_t dense, bool pq, bool fit, int dev)
      : shape_(s), budget_(budget), page_(page), dense_layers_(dense), per_query_(pq), fit_(fit), device_(dev),
        layers_(s.num_layers) {}

  // The keys the page budget comes from (quest.cpp's rule): a budget in tokens as given, not
  // clamped to the context first (a budget covering the context attends every page, a partial last
  // page included); a fraction as the session computed it. Capped where it cannot matter (int32).
  int64_t budget_keys(const DeviceMethod* m, int64_t n, int64_t session_keys) const {
    const auto* qm = static_cast<const QuestCuda*>(m);
    const Budget& bg = qm->budget_;
    if (bg.tokens <= 0 || qm->fit_) return std::max<int64_t>(1, session_keys);  // fit: the clamped keys
    return std::min<int64_t>(bg.tokens, (n / page_ + 2) * page_);
  }

  static constexpr int64_t kWantStep = 256;  // keys: see plan()

  size_t per_page() const { return size_t(shape_.num_kv_heads) * 2 * shape_.head_dim; }

  void grow(Layer& L, int64_t pages, void* stream) {
    if (pages <= L.cap) return;
    int64_t cap = std::max<int64_t>(64, L.cap);
    while (cap < pages) cap *= 2;
    void* nb = nullptr;
    check(cudaMalloc(&nb, size_t(cap) * per_page() * 2), "cudaMalloc(quest bounds)");
    if (L.bounds) {
      const cudaError_t e = cudaMemcpyAsync(nb, L.bounds, size_t(L.cap) * per_page() * 2, cudaMemcpyDeviceToDevice, S(stream));
      if (e != cudaSuccess) {
        cudaFree(nb);
        check(e, "cudaMemcpyAsync(quest bounds grow)");
      }
      // The old buffer may still be read by work queued on the stream: free after it.
      check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize(quest bounds grow)");
      cudaFree(L.bounds);
    }
    L.bounds = nb;
    L.cap = cap;
  }

  // Folds tokens [folded, n) into the bounds (the partial page at `folded` is recomputed whole).
  void fold(uint32_t layer, const DeviceLayerView& v, int64_t n) {
    auto& L = layers_[layer];
    if (n <= L.folded) return;
    grow(L, (n + page_ - 1) / page_, v.stream);
    const cuda::AttnShape sh{1, int32_t(shape_.num_q_heads), int32_t(shape_.num_kv_heads), int32_t(shape_.head_dim),
                             shape_.softmax_scale};
    check(cuda::quest_update_bounds(sh, v.kv, cuda::Scalar(int32_t(shape_.kv_dtype)), 0, int32_t(L.folded / page_ * page_),
                                    int32_t(n), int32_t(page_), L.bounds, v.stream),
          "quest_update_bounds");
    L.folded = n;
  }

  ModelShape shape_;
  Budget budget_;
  int64_t page_, dense_layers_;
  bool per_query_, fit_ = true;
  int device_ = 0;
  std::vector<Layer> layers_;
  mutable int32_t max_want_ = 1;
  mutable std::vector<std::vector<float>> staged_;
};
}  // namespace

std::unique_ptr<DeviceMethod> make_quest_cuda(const MethodContext& c, const ParamSet& p) {
  return std::make_unique<QuestCuda>(c, p);
}
}  // namespace kvs
#endif
