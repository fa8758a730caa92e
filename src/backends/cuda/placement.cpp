// SPDX-License-Identifier: Apache-2.0
// The cuda placement: KV of every layer in device pages (kv_layout.cuh, pages of kPageTokens tokens
// in the host store's page layout), the method's DeviceMethod, and the decode step as launches on
// the caller's stream:
//
//   host: validate tensors, reserve the new token's page (unless a batch plan did), lengths and
//         budgets, DeviceMethod::plan (selection size, scratch), one argument block
//   device: one launch carrying the argument block by value that writes it and appends the new K/V
//           rows (a block too large for that: a copy, then an append launch) -> assemble the batch
//           page table (B > 1) -> method update (on_tokens) -> method select -> dense or gathered
//           attention writing o and lse where the caller wants them
//
// Nothing synchronises the caller's stream except last_selection and save (which read back).
#ifdef KVS_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>

#include "backends/backend.hpp"
#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/cuda_util.hpp"
#include "backends/cuda/device_method.hpp"
#include "backends/cuda/kv_ops.cuh"
#include "backends/cuda/page_pool.hpp"
#include "core/error.hpp"
#include "core/kv_store.hpp"
#include "core/placement.hpp"
#include "core/session.hpp"
#include "io/tables.hpp"

namespace kvs {

using cudautil::check;
using cudautil::cuda_view;
using cudautil::DevBuf;
using cudautil::DeviceGuard;
using cudautil::S;

// ---- the cuda backend ------------------------------------------------------------------------
namespace {

class CudaBackendOps final : public Backend {
 public:
  int32_t id() const override { return KVS_BACKEND_CUDA; }
  const char* name() const override { return "cuda"; }
  void* alloc(size_t bytes, Mem where) const override {
    void* p = nullptr;
    if (where == Mem::Device) check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    else if (where == Mem::Pinned) check(cudaMallocHost(&p, bytes ? bytes : 1), "cudaMallocHost");
    else {
      p = std::malloc(bytes ? bytes : 1);
      if (!p) fail(KVS_STATUS_OUT_OF_MEMORY, "cuda backend: host allocation of " + std::to_string(bytes) + " bytes failed");
    }
    return p;
  }
  void free(void* p, Mem where) const noexcept override {
    if (!p) return;
    if (where == Mem::Device) cudaFree(p);
    else if (where == Mem::Pinned) cudaFreeHost(p);
    else std::free(p);
  }
  void copy(void* dst, Mem, const void* src, Mem, size_t bytes, void* stream) const override {
    if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, S(stream)), "cudaMemcpyAsync");
  }
  void host_fn(void* stream, std::function<void()> fn) const override {
    auto* f = new std::function<void()>(std::move(fn));
    const cudaError_t e = cudaLaunchHostFunc(
        S(stream),
        [](void* p) {
          auto* g = static_cast<std::function<void()>*>(p);
          (*g)();
          delete g;
        },
        f);
    if (e != cudaSuccess) {
      delete f;
      check(e, "cudaLaunchHostFunc");
    }
  }
  void sync(void* stream) const override { check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize"); }
  void merge(const AttnState& dst, const AttnState& src, int64_t rows, int32_t d, void* stream) const override {
    check(cuda::merge_states(dst.o.as<float>(), dst.lse.as<float>(), src.o.as<float>(), src.lse.as<float>(),
                             dst.o.as<float>(), dst.lse.as<float>(), rows, d, stream),
          "merge_states");
  }
};

constexpr int64_t kMaxLayerTokens = (int64_t(1) << 31) - 1;
std::string L(uint32_t layer) { return std::to_string(layer); }
size_t align256(size_t x) { return (x + 255) / 256 * 256; }


// One layer of one sequence: its pages (host list) and the device copy of the page table.
struct DevLayer {
  std::vector<std::shared_ptr<DevicePage>> pages;
  int64_t n = 0;
  std::shared_ptr<DevBuf> table;  // device [cap] page pointers
  int64_t table_cap = 0;
  int64_t v_off = 0;  // a caller's cache of two pools: elements from a K row to its V row (kv_layout.cuh)
  // kv_memory = pinned host: the pages the method keeps in GPU memory (DeviceMethod::hot_tokens),
  // as placed last: pages [0, hot_head) and [hot_tail, ...); new pages start on the device while
  // hot_tail is set.
  int64_t hot_head = 0, hot_tail = INT64_MAX;
  // (kv_source = KVS_KV_CALLER: pages are all of the last binding's, wrapped; n counts the first
  // of them the method has seen.)
};

}  // namespace

const Backend& cuda_backend() {
  static const CudaBackendOps b;
  return b;
}

// ---- the placement ---------------------------------------------------------------------------
namespace {

// The last selection of a layer, kept on the device until asked for.
struct SelRecord {
  std::shared_ptr<DevBuf> buf;  // idx [B, H, max_sel] then cnt [B, H]
  int32_t row = 0, batch = 0, heads = 0, max_sel = 0;
  bool dense = true, per_query_head = false;
  int64_t n = 0;
  void* stream = nullptr;
};

class CudaPlacement final : public Placement {
 public:
  CudaPlacement(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& ps, std::shared_ptr<ThreadPool> pool)
      : cfg_(cfg), spec_(spec), params_(ps), pool_(std::move(pool)), device_(cfg.device_id) {
    const auto& sh = cfg_.shape;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
      fail(KVS_STATUS_UNSUPPORTED, "params->backend: the cuda backend needs a CUDA device, none was found");
    if (device_ < 0 || device_ >= count)
      invalid("params->device_id: expected 0.." + std::to_string(count - 1) + ", got " + std::to_string(device_));
    caller_ = cfg.kv_source == KVS_KV_CALLER;
    if (cfg.kv_memory == KVS_DEVICE_CUDA_HOST) kv_mem_ = PageMemory::PinnedHost;
    else if (cfg.kv_memory != 0 && cfg.kv_memory != KVS_DEVICE_CUDA)
      fail(KVS_STATUS_UNSUPPORTED, "params->kv_memory: the cuda backend keeps its KV cache in GPU memory "
                                   "(KVS_DEVICE_CUDA or 0) or in pinned host memory (KVS_DEVICE_CUDA_HOST), got " +
                                       std::to_string(cfg.kv_memory));
    if (sh.kv_dtype == DType::F32)
      fail(KVS_STATUS_UNSUPPORTED, "params->kv_dtype: the cuda backend stores KV in bf16 or fp16, not f32");
    if (sh.head_dim != 64 && sh.head_dim != 128 && sh.head_dim != 256)
      fail(KVS_STATUS_UNSUPPORTED, "params->head_dim: the cuda backend supports head dims 64, 128 and 256, got " +
                                       std::to_string(sh.head_dim));
    DeviceGuard g(device_);
    MethodContext mc{cfg_.shape, cfg_.budget, pool_.get(), 0};
    method_ = spec_.create_cuda(mc, ps);
    layers_.resize(sh.num_layers);
    sel_.resize(sh.num_layers);
    page_bytes_ = cuda::paged_kv_page_bytes(int32_t(sh.num_kv_heads), int32_t(kPageTokens), int32_t(sh.head_dim),
                                            int32_t(dtype_size(sh.kv_dtype)));
    if (caller_) page_tokens_ = page_shift_ = 0;  // the first kvs_session_bind_kv sets them
  }

  ~CudaPlacement() override {
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    for (auto& e : arg_events_)
      if (e) cudaEventDestroy(e);
    for (auto* h : arg_host_)
      if (h) cudaFreeHost(h);
    for (auto& g : graphs_of_) g.reset();
    if (cap_stream_) cudaStreamDestroy(cap_stream_);
    release_retired(true);
    layers_.clear();
    sel_.clear();
    method_.reset();
    ws_.reset();
    if (prev >= 0) cudaSetDevice(prev);
  }

  int32_t backend() const override { return KVS_BACKEND_CUDA; }
  const Backend& ops() const override { return cuda_backend(); }
  int64_t tokens(uint32_t layer) const override { return layers_[layer].n; }

  // ---- prefill, append, build ----

  void add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                  const char* fn, bool prompt, int64_t max_tokens, void* stream) override {
    const auto& sh = cfg_.shape;
    DeviceGuard g(device_);
    View qv = cuda_view(q, "q", {-1, sh.num_q_heads, sh.head_dim}, device_, {DType::F32, sh.kv_dtype});
    const int64_t n = qv.shape[0];
    View kv, vv;  // (a caller's cache: none; the session checked its binding holds the tokens)
    if (!caller_) {
      kv = cuda_view(k, "k", {n, sh.num_kv_heads, sh.head_dim}, device_, {sh.kv_dtype});
      vv = cuda_view(v, "v", {n, sh.num_kv_heads, sh.head_dim}, device_, {sh.kv_dtype});
    }
    if (o)
      fail(KVS_STATUS_UNSUPPORTED, std::string(fn) +
                                       ": o: causal outputs of prompt chunks are not computed by the cuda backend; pass NULL");
    auto& lay = layers_[layer];
    const int64_t n0 = lay.n;
    max_tokens = std::min(max_tokens, kMaxLayerTokens);
    if (n > max_tokens - n0)
      invalid(std::string(fn) + ": q: layer " + L(layer) + " may hold at most " + std::to_string(max_tokens) +
              " tokens here (it has " + std::to_string(n0) + "), got " + std::to_string(n) + " more");
    const size_t pages0 = lay.pages.size();
    try {
      reserve(layer, n0 + n, stream);
      if (!caller_)
        check(cuda::write_kv_rows(own_kv(lay), 0, int32_t(sh.num_kv_heads), int32_t(sh.head_dim), kvdt(), int32_t(n0),
                                  int32_t(n), kv.base, vv.base, stream),
              "write_kv_rows");
      lay.n = n0 + n;
      if (prompt)
        method_->on_prompt(layer, view(lay, stream), cuda::Query{qv.base, cuda::Scalar(int32_t(qv.dtype))}, n0, n);
      method_->on_tokens(layer, view(lay, stream), n0, n0 + n);
    } catch (...) {
      lay.n = n0;
      if (!caller_) lay.pages.resize(pages0);
      method_->truncate(layer, n0);
      throw;
    }
  }

  // ---- a KV cache the caller owns (kv_source = KVS_KV_CALLER) ----

  // The caller's pages become the layer's: wrapped (never freed or written), the device page table
  // updated where the binding changed (in stream order), the count unchanged.
  void bind_kv(uint32_t layer, const BoundKv& kv, const char* fn, void* stream) override {
    if (!caller_) fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": this session stores its own KV");
    if (kv.page_size < 16)
      invalid(std::string(fn) + ": kv->page_size: the cuda backend reads pages of 16..1024 tokens, got " +
              std::to_string(kv.page_size));
    if (page_tokens_ != 0 && kv.page_size != page_tokens_)
      invalid(std::string(fn) + ": kv->page_size: expected " + std::to_string(page_tokens_) +
              " (every binding of a session has the page size of its first), got " + std::to_string(kv.page_size));
    if (page_tokens_ != 0 && int32_t(kv.nhd) != nhd_)
      invalid(std::string(fn) + ": kv->layout: expected " + (nhd_ ? "KVS_KV_LAYOUT_NHD" : "KVS_KV_LAYOUT_HND") +
              " (every binding of a session has the layout of its first)");
    if (std::string why; !method_->caller_kv_ok(kv.page_size, !kv.nhd && !kv.v_pool, &why))
      fail(KVS_STATUS_UNSUPPORTED, std::string(fn) + ": " + why);
    DeviceGuard g(device_);
    for (auto [ptr, name] : {std::pair{kv.pool, "kv->pages"}, std::pair{kv.v_pool, "kv->v_pages"}}) {
      if (!ptr) continue;
      cudaPointerAttributes at{};
      if (cudaPointerGetAttributes(&at, ptr) != cudaSuccess ||
          !((at.type == cudaMemoryTypeDevice && at.device == device_) || at.type == cudaMemoryTypeManaged)) {
        cudaGetLastError();
        invalid(std::string(fn) + ": " + name + ": expected memory of CUDA device " + std::to_string(device_) +
                " (the session's device_id)");
      }
      if (reinterpret_cast<uintptr_t>(ptr) % 256 != 0)
        invalid(std::string(fn) + ": " + name + ": expected a 256-byte aligned address on the cuda backend");
    }
    const size_t pb = kv.page_bytes;
    // Two pools: the V row of a token is the K row's address plus the pools' distance.
    const int64_t v_off = kv.v_pool ? (reinterpret_cast<intptr_t>(kv.v_pool) - reinterpret_cast<intptr_t>(kv.pool)) /
                                          int64_t(dtype_size(cfg_.shape.kv_dtype))
                                    : 0;
    auto& lay = layers_[layer];
    auto* pool = static_cast<char*>(const_cast<void*>(kv.pool));
    // Entries the session found unchanged keep their pages (an engine's table grows at its end).
    const size_t keep = std::min(kv.unchanged, lay.pages.size());
    std::vector<std::shared_ptr<DevicePage>> fresh;
    size_t first_changed = kv.pages.size();
    for (size_t i = keep; i < kv.pages.size(); ++i) {
      char* p = pool + size_t(kv.pages[i]) * pb;
      if (i < lay.pages.size() && lay.pages[i]->data() == p) {
        fresh.push_back(lay.pages[i]);
      } else {
        fresh.push_back(DevicePage::wrap(p, pb));  // (allocates: nothing changes before the last)
        first_changed = std::min(first_changed, i);
      }
    }
    // A larger device table is allocated before anything changes (out of memory keeps the binding).
    std::shared_ptr<DevBuf> grown;
    int64_t grown_cap = 0;
    if (!lay.table || int64_t(kv.pages.size()) > lay.table_cap) {
      grown_cap = std::max<int64_t>(16, lay.table_cap);
      while (grown_cap < int64_t(kv.pages.size())) grown_cap *= 2;
      grown = std::make_shared<DevBuf>();
      grown->reserve(size_t(grown_cap) * sizeof(void*), device_);
    }
    // The pinned slot of the upload too (page-table entries [from, end)).
    const size_t from = grown ? 0 : first_changed, cnt = kv.pages.size() - std::min(from, kv.pages.size());
    char* host = cnt ? arg_slot(cnt * sizeof(void*)) : nullptr;
    if (page_tokens_ == 0) {
      page_tokens_ = kv.page_size;
      page_shift_ = 0;
      while ((1 << page_shift_) < page_tokens_) ++page_shift_;
      page_bytes_ = pb;
      nhd_ = kv.nhd;
    }
    lay.v_off = v_off;
    lay.pages.resize(keep);
    for (auto& p : fresh) lay.pages.push_back(std::move(p));
    if (grown) {  // (the old table may still be read by queued steps: DevBuf's free waits for the device)
      lay.table = std::move(grown);
      lay.table_cap = grown_cap;
    }
    if (cnt) {
      // From a pinned argument slot: the copy runs in stream order and the call returns at once
      // (a pageable copy waits for its staging: about 7 us on an H100 host).
      auto* hp = reinterpret_cast<const void**>(host);
      for (size_t i = 0; i < cnt; ++i) hp[i] = lay.pages[from + i]->data();
      check(cudaMemcpyAsync(static_cast<const void**>(lay.table->p) + from, host, cnt * sizeof(void*),
                            cudaMemcpyHostToDevice, S(stream)),
            "cudaMemcpyAsync(page table)");
      arg_done(stream);
    }
  }

  void build_index(uint32_t layer, void* stream) override {
    DeviceGuard g(device_);
    method_->build_index(layer, view(layers_[layer], stream));
  }

  // ---- a batch step ----

  void plan(std::span<Placement* const> batch, void* stream) override {
    DeviceGuard g(device_);
    for (Placement* p : batch) {
      auto* c = static_cast<CudaPlacement*>(p);
      for (uint32_t l = 0; l < c->layers_.size(); ++l) c->reserve(l, c->layers_[l].n + 1, stream);
    }
  }

  void decode(std::span<Placement* const> batch, uint32_t layer, const StepTensors& t,
              std::span<StepReport> reports) override {
    const auto& sh = cfg_.shape;
    const int64_t B = int64_t(batch.size()), hq = sh.num_q_heads, hkv = sh.num_kv_heads, d = sh.head_dim;
    DeviceGuard g(device_);
    const auto [qv, kv, vv, ov, lv] = cudautil::cuda_step_views(t, B, sh, device_, !caller_);
    // One lse base per launch: the batch's sessions must agree (checked before anything changes).
    for (int64_t b = 1; b < B; ++b)
      if (static_cast<CudaPlacement*>(batch[size_t(b)])->cfg_.lse_base != cfg_.lse_base)
        invalid(std::string(t.fn) + ": sessions[" + std::to_string(b) +
                "]: on the cuda backend the sessions of one batch must share kvs_session_params.lse_base");
    std::vector<CudaPlacement*> ps(static_cast<size_t>(B));
    std::vector<DeviceMethod*> ms(static_cast<size_t>(B));
    std::vector<int64_t> lens(static_cast<size_t>(B)), budget(static_cast<size_t>(B));
    int64_t max_len = 0, max_pages = 0;
    for (int64_t b = 0; b < B; ++b) {
      auto* c = static_cast<CudaPlacement*>(batch[size_t(b)]);
      ps[size_t(b)] = c;
      ms[size_t(b)] = c->method_.get();
      const auto& lay = c->layers_[layer];
      if (lay.n >= kMaxLayerTokens)
        invalid(std::string(t.fn) + ": layer " + L(layer) + " of sessions[" + std::to_string(b) + "] is full (" +
                std::to_string(kMaxLayerTokens) + " tokens)");
      if (caller_ && c->page_tokens_ != page_tokens_)  // (the session checked the bindings hold the token)
        invalid(std::string(t.fn) + ": sessions[" + std::to_string(b) + "]: its KV pages hold " +
                std::to_string(c->page_tokens_) + " tokens, sessions[0]'s " + std::to_string(page_tokens_));
      if (caller_ && (c->nhd_ != nhd_ || lay.v_off != layers_[layer].v_off))  // (one table, one layout)
        invalid(std::string(t.fn) + ": sessions[" + std::to_string(b) + "]: layer " + L(layer) +
                " is bound to a cache of another layout or another V pool than sessions[0]'s (a batch reads "
                "one engine's pools)");
      lens[size_t(b)] = lay.n + 1;
      budget[size_t(b)] = c->cfg_.budget.keys(lay.n + 1, spec_.default_budget);
      max_len = std::max(max_len, lay.n + 1);
    }
    // The new token's page (a batch plan reserved it already: then nothing happens here).
    for (int64_t b = 0; b < B; ++b) {
      auto& lay = ps[size_t(b)]->layers_[layer];
      ps[size_t(b)]->reserve(layer, lay.n + 1, t.stream);
      ps[size_t(b)]->method_->before_step(layer, ps[size_t(b)]->view(lay, t.stream), lay.n + 1);
      ps[size_t(b)]->place_hot(lay, layer, lay.n + 1, budget[size_t(b)], t.stream);
      max_pages = std::max(max_pages, lay.table_cap);
    }

    // A captured step (CUDA graph) sizes its launches for capacities rounded up to a bucket, so
    // that one graph per layer serves every token until the context leaves the bucket.
    const bool graph = graphs_ && method_->capturable();
    DeviceStep st;
    st.shape = cuda::AttnShape{int32_t(B), int32_t(hq), int32_t(hkv), int32_t(d), sh.softmax_scale};
    st.kv_dtype = kvdt();
    st.q = cuda::Query{qv.base, cuda::Scalar(int32_t(qv.dtype))};
    st.host_lengths = lens;
    st.host_budget = budget;
    st.max_length = int32_t(graph ? round_up(max_len, kGraphBucket) : max_len);
    st.stream = t.stream;
    DevicePlan pl = method_->plan(ms, layer, st);
    if (!pl.dense && (pl.max_selected <= 0 || pl.selected.size() != size_t(B)))
      fail(KVS_STATUS_INTERNAL, "cuda method plan: selection capacity out of range");
    if (graph && !pl.dense) pl.max_selected = int32_t(round_up(pl.max_selected, kGraphBucket));

    // Argument block: pos [B], lengths [B], budget [B], counts [B] (int32), then B source page
    // tables (pointers), the caller's tensors (q, o, lse, k_new, v_new: a graph reads them from
    // here), then the method's arguments.
    const size_t ints = align256(size_t(B) * 4 * sizeof(int32_t));
    const size_t ptrs = align256(size_t(B) * sizeof(void*)) + 256;
    const size_t arg_bytes = ints + ptrs + align256(pl.arg_bytes);
    // Blocks that fit a kernel's parameters travel in the step's first launch; larger ones are
    // copied from a pinned slot.
    const bool by_value = args_by_value_ && arg_bytes <= cuda::kStepArgsMax;
    if (by_value && arg_block_.size() < arg_bytes) arg_block_.resize(cuda::kStepArgsMax);
    char* host = by_value ? arg_block_.data() : arg_slot(arg_bytes);
    auto* hi = reinterpret_cast<int32_t*>(host);
    auto* hp = reinterpret_cast<const void**>(host + ints);
    for (int64_t b = 0; b < B; ++b) {
      const auto& lay = ps[size_t(b)]->layers_[layer];
      hi[b] = int32_t(lay.n);
      hi[B + b] = int32_t(lens[size_t(b)]);
      hi[2 * B + b] = int32_t(budget[size_t(b)]);
      hi[3 * B + b] = int32_t(lay.pages.size());
      hp[b] = lay.table->p;
    }
    if (pl.arg_bytes) method_->fill_args(ms, layer, st, host + ints + ptrs);

    // Device workspace: arguments, the batch page table, the selection, a scratch lse, the kernels'.
    const int32_t H = pl.per_query_head ? int32_t(hq) : int32_t(hkv);
    const size_t table_bytes = B > 1 ? align256(size_t(B) * size_t(max_pages) * sizeof(void*)) : 0;
    const size_t lse_bytes = t.lse ? 0 : align256(size_t(B) * hq * sizeof(float));
    const bool prior = pl.prior && !pl.dense;
    const size_t attn_ws = pl.dense ? cuda::dense_decode_workspace_bytes(st.shape, st.max_length)
                                    : cuda::gathered_decode_workspace_bytes(st.shape, pl.max_selected, pl.per_query_head,
                                                                            prior);
    // The prior state (select writes it, the attention reads it) sits apart from the kernels'
    // scratch, which select and the attention each use in turn.
    const size_t prior_bytes = prior ? align256(size_t(B) * hq * d * sizeof(float)) + align256(size_t(B) * hq * sizeof(float)) : 0;
    const size_t kern_ws = align256(std::max(attn_ws, pl.workspace)) + prior_bytes;
    if (!ws_) ws_ = std::make_shared<DevBuf>();
    const void* ws_before = ws_->p;
    ws_->reserve(arg_bytes + table_bytes + lse_bytes + kern_ws, device_);
    ws_allocs_ += ws_->p != ws_before;
    char* ws = static_cast<char*>(ws_->p);
    char* dargs = ws;
    float* dlse = t.lse ? reinterpret_cast<float*>(lv.mutable_base()) : reinterpret_cast<float*>(ws + arg_bytes + table_bytes);
    const size_t tens_at = ints + ptrs - 256;  // the caller's tensors in the argument block
    const void** htens = reinterpret_cast<const void**>(host + tens_at);
    htens[0] = qv.base;
    htens[1] = ov.base;
    htens[2] = dlse;
    htens[3] = kv.base;
    htens[4] = vv.base;
    if (!by_value) {
      check(cudaMemcpyAsync(dargs, host, arg_bytes, cudaMemcpyHostToDevice, S(t.stream)), "cudaMemcpyAsync(step arguments)");
      arg_done(t.stream);
    }
    const auto* dtens = reinterpret_cast<const void* const*>(dargs + tens_at);
    const int32_t* dpos = reinterpret_cast<const int32_t*>(dargs);
    st.lengths = dpos + B;
    st.budget_keys = dpos + 2 * B;
    if (B > 1) {  // assembled by the first launch of the step (enqueue, below)
      auto** table = reinterpret_cast<const void**>(ws + arg_bytes);
      st.kv = cuda::PagedKv{table, int32_t(max_pages), page_tokens_, page_shift_, nhd_, layers_[layer].v_off};
    } else {
      st.kv = own_kv(ps[0]->layers_[layer]);
    }
    cuda::Workspace kw{ws + arg_bytes + table_bytes + lse_bytes, kern_ws - prior_bytes};
    if (prior) {
      char* pb = ws + arg_bytes + table_bytes + lse_bytes + (kern_ws - prior_bytes);
      st.prior_o = reinterpret_cast<float*>(pb);
      st.prior_lse = reinterpret_cast<float*>(pb + align256(size_t(B) * hq * d * sizeof(float)));
    }
    if (graph) st.q.at = dtens;  // the caller's tensors by reference: one graph serves tensors that move

    // Selection buffer of this layer (kept for last_selection): reused when only this batch's
    // sessions still refer to it.
    std::shared_ptr<DevBuf> selbuf;
    if (!pl.dense) {
      const size_t sel_bytes = align256(size_t(B) * H * pl.max_selected * 4) + align256(size_t(B) * H * 4);
      selbuf = step_selection(ps, layer, sel_bytes);
    }
    int32_t* idx = selbuf ? static_cast<int32_t*>(selbuf->p) : nullptr;
    int32_t* cnt = selbuf ? reinterpret_cast<int32_t*>(static_cast<char*>(selbuf->p) +
                                                      align256(size_t(B) * H * pl.max_selected * 4))
                          : nullptr;

    // The launches of the step after the argument upload: the batch page table, the new K/V rows,
    // the selection and the attention. Run on the caller's stream, or captured into this layer's
    // graph (then replayed while the key below holds).
    int64_t advanced = 0;  // sessions whose layer counts the new token (undone on failure)
    cuda::StepArgsLaunch args_launch;  // the block's launch, as a graph captures it
    auto enqueue = [&](void* s) {
      if (by_value)  // with the new K/V rows (a caller's cache holds them already)
        check(cuda::upload_step_args(host, arg_bytes, dargs, own_kv(ps[0]->layers_[layer]), int32_t(B), int32_t(hkv),
                                     int32_t(d), kvdt(), ints, caller_ ? cuda::kNoAppend : tens_at + 3 * sizeof(void*),
                                     s, &args_launch),
              "upload_step_args");
      if (B > 1)
        check(cuda::gather_page_tables(reinterpret_cast<const void* const* const*>(dargs + ints), dpos + 3 * B,
                                       int32_t(B), int32_t(max_pages), const_cast<const void**>(st.kv.pages), s),
              "gather_page_tables");
      DeviceStep sst = st;
      sst.stream = s;
      if (!caller_ && !by_value)  // (a caller's cache holds the new token already)
        check(cuda::append_kv_batch(st.kv, int32_t(B), int32_t(hkv), int32_t(d), kvdt(), dpos, kv.base, vv.base, s,
                                    graph ? dtens + 3 : nullptr),
              "append_kv_batch");
      if (!graph) advance(ps, layer, s, advanced);  // eager: the method's update in stream order
      cuda::Output out{ov.mutable_base(), cuda::Scalar(int32_t(ov.dtype)), dlse,
                       graph ? const_cast<void* const*>(dtens + 1) : nullptr, cfg_.lse_base == KVS_LSE_BASE_2,
                       st.prior_o, st.prior_lse};
      // The launches before each of these are the step's own and write no query: each may start
      // (reading the query) while the one before it ends.
      sst.pdl = pdl_;
      if (pl.dense) {
        check(cuda::dense_decode(st.shape, st.q, st.kv, kvdt(), st.lengths, st.max_length, out, kw, s, pdl_),
              "dense_decode");
      } else {
        method_->select(ms, layer, sst, pl, dargs + ints + ptrs, idx, cnt, kw);
        cuda::PagedKv akv = st.kv;
        method_->attention_kv(&akv);
        check(cuda::gathered_decode(st.shape, st.q, akv, kvdt(), idx, cnt, pl.max_selected, out, kw, s,
                                    pl.per_query_head, pdl_),
              "gathered_decode");
      }
    };
    try {
      if (graph) {
        // Before the replay, in stream order: a capturable method's on_tokens launches only work on
        // tokens stored before this step (quest folds a page it no longer writes).
        advance(ps, layer, t.stream, advanced);
        auto& key = graph_key_scratch_;
        key.clear();
        for (auto* c : ps) key.push_back(uintptr_t(c));
        // Not the caller's tensors: the kernels read their addresses from the argument block.
        for (const void* ptr : std::initializer_list<const void*>{ws, idx, st.kv.pages})
          key.push_back(uintptr_t(ptr));
        for (int64_t x : {int64_t(qv.dtype), int64_t(ov.dtype), int64_t(t.lse != nullptr), int64_t(cfg_.lse_base),
                          int64_t(st.max_length),
                          int64_t(pl.max_selected),
                          int64_t(max_pages), int64_t(st.kv.max_pages), int64_t(st.kv.nhd), st.kv.v_off,
                          int64_t(arg_bytes), int64_t(table_bytes),
                          int64_t(lse_bytes), int64_t(kern_ws), int64_t(pl.dense), int64_t(pl.per_query_head),
                          int64_t(layer)})
          key.push_back(uintptr_t(x));
        launch_graph(layer, key, enqueue, t.stream, by_value ? host : nullptr, arg_bytes, args_launch);
      } else {
        enqueue(t.stream);
      }
    } catch (...) {
      for (int64_t a = 0; a < advanced; ++a) {
        auto* c = ps[size_t(a)];
        auto& lay = c->layers_[layer];
        --lay.n;
        c->method_->truncate(layer, lay.n);
      }
      throw;
    }
    for (int64_t b = 0; b < B; ++b) {
      auto* c = ps[size_t(b)];
      auto& rec = c->sel_[layer];
      rec = SelRecord{selbuf, int32_t(b), int32_t(B), H, pl.max_selected, pl.dense, pl.per_query_head,
                      c->layers_[layer].n, t.stream};
      reports[size_t(b)] = StepReport{pl.dense ? double(lens[size_t(b)]) : pl.selected[size_t(b)], lens[size_t(b)]};
      if (!pl.dense && !pl.selected_exact) {  // the method counts on the device: settled_reports
        reports[size_t(b)].deferred = true;
        ++c->pending_steps_;
        c->pending_tokens_ = lens[size_t(b)];
      }
    }
  }

  // ---- inspection ----

  std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const override {
    const SelRecord& r = sel_[layer];
    std::vector<int32_t> out;
    if (r.dense) {
      out.resize(size_t(r.n));
      for (int64_t i = 0; i < r.n; ++i) out[size_t(i)] = int32_t(i);
      return out;
    }
    DeviceGuard g(device_);
    check(cudaStreamSynchronize(S(r.stream)), "cudaStreamSynchronize(selection)");
    const int G = cfg_.shape.group();
    const int rows = r.per_query_head ? G : 1;
    const int h0 = r.per_query_head ? int(kv_head) * G : int(kv_head);
    std::vector<int32_t> cnt(static_cast<size_t>(rows)), idx(static_cast<size_t>(rows) * size_t(r.max_sel));
    const char* base = static_cast<const char*>(r.buf->p);
    const size_t idx_bytes = align256(size_t(r.batch) * r.heads * r.max_sel * 4);
    check(cudaMemcpy(cnt.data(), base + idx_bytes + (size_t(r.row) * r.heads + h0) * 4, cnt.size() * 4,
                     cudaMemcpyDeviceToHost),
          "cudaMemcpy(selection counts)");
    check(cudaMemcpy(idx.data(), base + (size_t(r.row) * r.heads + h0) * r.max_sel * 4, idx.size() * 4,
                     cudaMemcpyDeviceToHost),
          "cudaMemcpy(selection)");
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < std::clamp(cnt[size_t(i)], 0, r.max_sel); ++j) out.push_back(idx[size_t(i) * r.max_sel + j]);
    method_->token_positions(layer, kv_head, out);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    out.erase(std::remove(out.begin(), out.end(), -1), out.end());
    // Keys a kvs_session_truncate dropped since that step are not reported.
    out.erase(std::lower_bound(out.begin(), out.end(), int32_t(r.n)), out.end());
    return out;
  }

  bool lse_base2() const override { return true; }

  // ---- rollback ----

  // full, exact_topk and streaming keep no index, Quest's bounds of whole pages below the cut stay
  // valid and the page holding the cut is folded again from its keys once it is complete
  // (QuestCuda::truncate): they roll back to any length. csattention's lists keep no undo log here
  // (DeviceMethod::truncate_floor).
  int64_t truncate_floor(uint32_t layer, std::string* why) const override {
    if (const int64_t f = method_->truncate_floor(layer, why); f > 0) return f;
    *why = "method '" + cfg_.method + "' rolls back to any length";
    return 0;
  }
  void truncate(int64_t n) override {
    DeviceGuard g(device_);
    // Kernels already queued may still read the pages dropped here, which go back to the pool.
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(truncate)");
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      auto& lay = layers_[l];
      if (lay.n <= n) continue;
      lay.n = n;
      // The page table keeps stale entries past the new end (never read below lay.n); reserve()
      // uploads the entries of pages added later. A kept last page a fork shares is copied before
      // the next token is written into it (reserve_pages).
      if (!caller_) lay.pages.resize(size_t((n + kPageTokens - 1) / kPageTokens));  // (a binding stays whole)
      method_->truncate(l, n);
      sel_[l].n = std::min(sel_[l].n, n);
    }
  }

  void stats(kvs_session_stats& st) const override {
    for (auto& l : layers_)
      for (auto& p : l.pages) {
        if (p->external()) continue;  // the caller's cache
        st.kv_bytes += p->bytes();
        if (p.use_count() > 1) st.kv_shared_bytes += p->bytes();
      }
    st.index_bytes = method_->index_bytes();
    st.workspace_bytes = ws_ ? ws_->bytes : 0;
  }
  bool stat(std::string_view name, double* out) const override {
    // The CPU phase timings are not measured here (the step is asynchronous): they read 0.
    if (name == "decode_update_seconds" || name == "decode_select_seconds" || name == "decode_attend_seconds") {
      *out = 0;
      return true;
    }
    if (name == "cuda_graph_captures" || name == "cuda_graph_launches") {
      *out = double(name == "cuda_graph_captures" ? graph_captures_ : graph_launches_);
      return true;
    }
    if (name == "cuda_workspace_allocs") {  // each one synchronises the device
      *out = double(ws_allocs_);
      return true;
    }
    return method_->stat(name, out);
  }

  // ---- tables ----

  nlohmann::json save_meta() const override {
    DeviceGuard g(device_);
    for (uint32_t l = 0; l < layers_.size(); ++l)
      if (layers_[l].n) method_->finish(l, view(layers_[l], nullptr));
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(save)");
    return method_->save_meta();
  }

  void save(io::TablesWriter& w, bool with_kv) const override {
    if (with_kv && caller_)
      fail(KVS_STATUS_UNSUPPORTED, "kvs_session_save: flags: KVS_SAVE_INCLUDE_KV: the KV cache is the caller's "
                                   "(kv_source = KVS_KV_CALLER); save the tables only");
    DeviceGuard g(device_);
    saved_pages_.clear();
    if (with_kv)
      for (uint32_t l = 0; l < layers_.size(); ++l) {
        const auto& lay = layers_[l];
        if (lay.pages.empty()) continue;
        std::vector<io::Piece> pieces;
        for (auto& p : lay.pages) {
          saved_pages_.emplace_back(p->bytes());
          check(cudaMemcpy(saved_pages_.back().data(), p->data(), p->bytes(), cudaMemcpyDefault),
                "cudaMemcpy(KV page to host)");
          pieces.push_back(io::Piece{saved_pages_.back().data(), uint64_t(p->bytes())});
        }
        w.add("kv", int32_t(l), -1, std::move(pieces));
      }
    method_->save(w);
  }

  // Always copies (to the device), so KVS_LOAD_MMAP (map) makes no difference here.
  void load(const std::shared_ptr<const io::TablesFile>& file, const nlohmann::json& meta,
            const std::vector<int64_t>& tokens, bool with_kv, const std::string& path, bool /*map*/) override {
    DeviceGuard g(device_);
    for (uint32_t l = 0; with_kv && l < layers_.size(); ++l) {
      const int64_t n = tokens[l];
      if (n == 0) continue;
      const auto& sec = file->require("kv", int32_t(l), -1);
      const int64_t np = (n + kPageTokens - 1) / kPageTokens;
      if (sec.length != uint64_t(np) * page_bytes_)
        fail(KVS_STATUS_FORMAT_INVALID, "tables file '" + path + "': section kv layer " + L(l) + ": expected " +
                                            std::to_string(uint64_t(np) * page_bytes_) + " bytes for " +
                                            std::to_string(n) + " tokens, got " + std::to_string(sec.length));
      auto& lay = layers_[l];
      reserve_pages(lay, n, nullptr);
      for (int64_t i = 0; i < np; ++i)
        check(cudaMemcpy(lay.pages[size_t(i)]->data(), sec.data + size_t(i) * page_bytes_, page_bytes_,
                         cudaMemcpyDefault),
              "cudaMemcpy(KV page to device)");
      lay.n = n;
    }
    method_->load(*file, meta);
  }

  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    return method_->index_fits(layer, tokens, why);
  }

  Settled settled_reports() const override {
    if (pending_steps_ == 0) return {};
    DeviceGuard g(device_);
    Settled st;
    double last = 0;
    method_->settle_selected(&st.sum_selected, &last);
    st.steps = std::exchange(pending_steps_, 0);
    st.last = StepReport{last, pending_tokens_};
    return st;
  }

  std::unique_ptr<Placement> fork() const override {
    DeviceGuard g(device_);
    auto p = std::make_unique<CudaPlacement>(cfg_, spec_, params_, pool_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      auto& dst = p->layers_[l];
      dst.pages = layers_[l].pages;  // shared; the last page is copied before it is written
      dst.n = layers_[l].n;
      dst.v_off = layers_[l].v_off;
      if (!dst.pages.empty()) p->upload_table(dst, 0, nullptr);
    }
    p->page_tokens_ = page_tokens_;
    p->page_shift_ = page_shift_;
    p->page_bytes_ = page_bytes_;
    p->nhd_ = nhd_;
    p->method_ = method_->clone(nullptr);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(fork)");
    return p;
  }

 private:
  cuda::Scalar kvdt() const { return cuda::Scalar(int32_t(cfg_.shape.kv_dtype)); }

  cuda::PagedKv own_kv(const DevLayer& lay) const {
    return cuda::PagedKv{lay.table ? static_cast<const void* const*>(lay.table->p) : nullptr, int32_t(lay.table_cap),
                         page_tokens_, page_shift_, nhd_, lay.v_off};
  }
  DeviceLayerView view(const DevLayer& lay, void* stream) const {
    return DeviceLayerView{own_kv(lay), lay.n, stream, kv_mem_ == PageMemory::PinnedHost};
  }

  // kv_memory = pinned host: moves the layer's pages between host and device memory so that the
  // method's hot tokens for the step at `tokens` tokens (budget: its budget in keys) are in GPU memory and the rest in host
  // memory (copies and table entries in stream order; a page left behind is released once the
  // copies that read it are done).
  void place_hot(DevLayer& lay, uint32_t layer, int64_t tokens, int64_t budget, void* stream) {
    if (kv_mem_ != PageMemory::PinnedHost) return;
    release_retired(false);
    const HotTokens h = method_->hot_tokens(layer, tokens, budget);
    const int64_t np = int64_t(lay.pages.size());
    const int64_t head = std::min(np, (std::max<int64_t>(h.head_end, 0) + kPageTokens - 1) / kPageTokens);
    const int64_t tail = h.tail_begin == INT64_MAX ? INT64_MAX : std::max<int64_t>(h.tail_begin, 0) / kPageTokens;
    if (head == lay.hot_head && tail == lay.hot_tail) return;
    // Every new page first (out of memory here changes nothing), then the copies and the swaps.
    std::vector<int64_t> at;
    std::vector<std::shared_ptr<DevicePage>> fresh;
    for (int64_t i = 0; i < np; ++i) {
      const PageMemory want = i < head || i >= tail ? PageMemory::Device : PageMemory::PinnedHost;
      if (lay.pages[size_t(i)]->memory() == want) continue;
      fresh.push_back(device_page(device_, page_bytes_, want));
      at.push_back(i);
    }
    Retired r;
    if (!at.empty()) check(cudaEventCreateWithFlags(&r.done, cudaEventDisableTiming), "cudaEventCreate(KV page move)");
    for (size_t k = 0; k < at.size(); ++k) {
      auto& pg = lay.pages[size_t(at[k])];
      // A failed copy is a device error (the stream is unusable from there on): the swap goes ahead
      // and the old pages are retired as usual.
      const cudaError_t e = cudaMemcpyAsync(fresh[k]->data(), pg->data(), page_bytes_, cudaMemcpyDefault, S(stream));
      r.pages.push_back(std::exchange(pg, std::move(fresh[k])));
      if (e != cudaSuccess) {
        retired_.push_back(std::move(r));
        check(e, "cudaMemcpyAsync(KV page between host and device)");
      }
    }
    lay.hot_head = head;
    lay.hot_tail = tail;
    if (at.empty()) return;
    // The old pages stay alive (retired) until the copies and every kernel before them are done.
    const cudaError_t re = cudaEventRecord(r.done, S(stream));
    retired_.push_back(std::move(r));
    check(re, "cudaEventRecord(KV page move)");
    upload_entries(lay, size_t(at.front()), size_t(at.back() + 1), stream);
  }
  // Pages moved away from, released once the copies reading them have run (all of them: wait).
  void release_retired(bool wait) {
    auto it = retired_.begin();
    for (; it != retired_.end(); ++it) {
      if (wait) cudaEventSynchronize(it->done);
      else if (cudaEventQuery(it->done) != cudaSuccess) break;
      cudaEventDestroy(it->done);
    }
    retired_.erase(retired_.begin(), it);
  }

  // Pages (and the method's index room) for `tokens` tokens, the last page private (copy-on-write),
  // the device table up to date.
  void reserve(uint32_t layer, int64_t tokens, void* stream) {
    reserve_pages(layers_[layer], tokens, stream);
    method_->reserve(layer, tokens, stream);
  }
  void reserve_pages(DevLayer& lay, int64_t tokens, void* stream) {
    if (caller_) return;  // the caller's cache (kvs_session_bind_kv) holds the pages
    const int64_t need = (tokens + kPageTokens - 1) / kPageTokens;
    const size_t first_new = lay.pages.size();
    size_t first_dirty = first_new;
    // The page the next token goes into must not be shared.
    if (lay.n % kPageTokens != 0 && tokens > lay.n) {
      auto& last = lay.pages[size_t(lay.n / kPageTokens)];
      if (last.use_count() > 1) {
        auto copy = device_page(device_, page_bytes_, lay.hot_tail != INT64_MAX ? PageMemory::Device : kv_mem_);
        check(cudaMemcpyAsync(copy->data(), last->data(), page_bytes_, cudaMemcpyDefault, S(stream)),
              "cudaMemcpyAsync(copy-on-write page)");
        last = std::move(copy);
        first_dirty = size_t(lay.n / kPageTokens);
      }
    }
    // A new page is hot while the method keeps the layer's tail on the device (place_hot).
    const PageMemory mem = lay.hot_tail != INT64_MAX ? PageMemory::Device : kv_mem_;
    while (int64_t(lay.pages.size()) < need) lay.pages.push_back(device_page(device_, page_bytes_, mem));
    if (first_dirty < lay.pages.size()) upload_table(lay, first_dirty, stream);
  }

  // Uploads page-table entries [from, pages) (growing the table by doubling: a new table is filled
  // whole).
  void upload_table(DevLayer& lay, size_t from, void* stream) {
    const int64_t np = int64_t(lay.pages.size());
    if (!lay.table || np > lay.table_cap) {
      int64_t cap = std::max<int64_t>(16, lay.table_cap);
      while (cap < np) cap *= 2;
      auto t = std::make_shared<DevBuf>();
      t->reserve(size_t(cap) * sizeof(void*), device_);
      lay.table = std::move(t);
      lay.table_cap = cap;
      from = 0;
    }
    upload_entries(lay, from, lay.pages.size(), stream);
  }
  void upload_entries(DevLayer& lay, size_t from, size_t to, void* stream) {
    std::vector<const void*> host(to - from);
    for (size_t i = from; i < to; ++i) host[i - from] = lay.pages[i]->data();
    if (host.empty()) return;
    // From pageable memory: returns once the entries are staged (host vector free to go), ordered on
    // the stream. Never inside a captured step: a plan or a prefill reserves pages.
    check(cudaMemcpyAsync(static_cast<const void**>(lay.table->p) + from, host.data(), host.size() * sizeof(void*),
                          cudaMemcpyHostToDevice, S(stream)),
          "cudaMemcpyAsync(page table)");
  }

  // The new token counts in each session's layer; the method sees it (on_tokens).
  void advance(const std::vector<CudaPlacement*>& ps, uint32_t layer, void* stream, int64_t& advanced) {
    for (; advanced < int64_t(ps.size()); ++advanced) {
      auto* c = ps[size_t(advanced)];
      auto& lay = c->layers_[layer];
      ++lay.n;
      c->method_->on_tokens(layer, c->view(lay, stream), lay.n - 1, lay.n);
    }
  }

  // Launches this layer's graph on `stream`, capturing it first (into a private stream: the
  // caller's may be the legacy default stream, which cannot capture) unless the last capture had
  // the same key: the same sessions, tensors, buffers and capacities, so the same launches.
  // With `args` (the step's argument block of `arg_bytes`), the graph's first launch is
  // upload_step_args: a replay gives it this step's block.
  template <class Enqueue>
  void launch_graph(uint32_t layer, const std::vector<uintptr_t>& key, Enqueue& enqueue, void* stream,
                    const char* args, size_t arg_bytes, const cuda::StepArgsLaunch& args_launch) {
    if (graphs_of_.size() < layers_.size()) graphs_of_.resize(layers_.size());
    LayerGraph& g = graphs_of_[layer];
    if (!g.exec || g.key != key) {
      g.key.clear();
      if (!cap_stream_) check(cudaStreamCreateWithFlags(&cap_stream_, cudaStreamNonBlocking), "cudaStreamCreate(capture)");
      check(cudaStreamBeginCapture(cap_stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
      cudaGraph_t graph = nullptr;
      try {
        enqueue(static_cast<void*>(cap_stream_));
      } catch (...) {
        cudaStreamEndCapture(cap_stream_, &graph);
        if (graph) cudaGraphDestroy(graph);
        cudaGetLastError();
        throw;
      }
      check(cudaStreamEndCapture(cap_stream_, &graph), "cudaStreamEndCapture");
      // A new executable graph each time (an in-place update fails whenever the launches changed
      // shape, and captures happen once per bucket of tokens, not per step). The graph stays with
      // it: set_step_args names the node by its handle in the graph.
      g.reset();
      g.graph = graph;
      check(cudaGraphInstantiate(&g.exec, graph, 0), "cudaGraphInstantiate");
      g.args_node = args ? args_node(graph, args_launch) : nullptr;
      g.args_launch = args_launch;
      g.key = key;
      ++graph_captures_;
    } else if (args) {
      check(cuda::set_step_args(g.exec, g.args_node, g.args_launch, args, arg_bytes), "set_step_args");
    }
    check(cudaGraphLaunch(g.exec, S(stream)), "cudaGraphLaunch");
    ++graph_launches_;
  }

  // The node of a captured graph that launched `l` (its root: the step's first launch).
  static cudaGraphNode_t args_node(cudaGraph_t graph, const cuda::StepArgsLaunch& l) {
    size_t n = 0;
    cudaGraphNode_t root = nullptr;
    cudaGraphNodeType type{};
    cudaKernelNodeParams p{};
    check(cudaGraphGetRootNodes(graph, nullptr, &n), "cudaGraphGetRootNodes");
    if (n == 1) check(cudaGraphGetRootNodes(graph, &root, &n), "cudaGraphGetRootNodes");
    if (n != 1 || !root || cudaGraphNodeGetType(root, &type) != cudaSuccess || type != cudaGraphNodeTypeKernel ||
        cudaGraphKernelNodeGetParams(root, &p) != cudaSuccess || p.func != l.func)
      fail(KVS_STATUS_INTERNAL, "cuda graph: the step's first node is not its argument upload");
    return root;
  }

  // A pinned host slot for a step's arguments (a ring of slots, each reused once its last upload ended).
  char* arg_slot(size_t bytes) {
    const size_t k = arg_next_;
    if (arg_events_[k]) check(cudaEventSynchronize(arg_events_[k]), "cudaEventSynchronize(argument slot)");
    if (arg_bytes_[k] < bytes) {
      if (arg_host_[k]) cudaFreeHost(arg_host_[k]);
      arg_host_[k] = nullptr;
      arg_bytes_[k] = 0;
      void* p = nullptr;
      check(cudaMallocHost(&p, std::max<size_t>(bytes, 4096)), "cudaMallocHost(step arguments)");
      arg_host_[k] = static_cast<char*>(p);
      arg_bytes_[k] = std::max<size_t>(bytes, 4096);
    }
    return arg_host_[k];
  }
  void arg_done(void* stream) {
    const size_t k = arg_next_;
    if (!arg_events_[k]) check(cudaEventCreateWithFlags(&arg_events_[k], cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventRecord(arg_events_[k], S(stream)), "cudaEventRecord");
    arg_next_ = (k + 1) % kArgSlots;
  }

  // The selection buffer for this step of `layer`: this placement's previous one when only
  // sessions of this batch still refer to it, else a new one.
  std::shared_ptr<DevBuf> step_selection(const std::vector<CudaPlacement*>& ps, uint32_t layer, size_t bytes) {
    auto& cur = sel_owned_[layer];
    if (cur) {
      long holders = 1;  // sel_owned_ itself
      for (auto* c : ps)
        if (c->sel_[layer].buf == cur) ++holders;
      if (cur.use_count() != holders || cur->bytes < bytes) cur.reset();
    }
    if (!cur) {
      cur = std::make_shared<DevBuf>();
      cur->reserve(bytes + bytes / 4, device_);  // room for the budget to grow with the context
    }
    return cur;
  }

  SessionConfig cfg_;
  const MethodSpec& spec_;
  ParamSet params_;
  std::shared_ptr<ThreadPool> pool_;
  // Steps reported deferred (DevicePlan::selected_exact false) not yet settled, and the layer's
  // tokens after the latest of them.
  mutable int64_t pending_steps_ = 0;
  int64_t pending_tokens_ = 0;
  int device_;
  size_t page_bytes_ = 0;
  // Tokens per KV page: kPageTokens for the placement's own pages; a caller's cache (caller_) has
  // the page size of its first binding (0 until then).
  bool caller_ = false;
  int32_t page_tokens_ = int32_t(kPageTokens), page_shift_ = kPageShift;
  int32_t nhd_ = 0;  // a caller's cache in the NHD layout (its first binding's; kv_layout.cuh)
  PageMemory kv_mem_ = PageMemory::Device;  // params->kv_memory
  std::unique_ptr<DeviceMethod> method_;
  std::vector<DevLayer> layers_;
  std::vector<SelRecord> sel_;
  std::map<uint32_t, std::shared_ptr<DevBuf>> sel_owned_;
  std::shared_ptr<DevBuf> ws_;
  static constexpr size_t kArgSlots = 8;
  std::vector<char> arg_block_;  // a step's argument block when it travels by value
  char* arg_host_[kArgSlots] = {};
  size_t arg_bytes_[kArgSlots] = {};
  cudaEvent_t arg_events_[kArgSlots] = {};
  size_t arg_next_ = 0;
  mutable std::vector<std::vector<std::byte>> saved_pages_;
  struct Retired {
    cudaEvent_t done = nullptr;
    std::vector<std::shared_ptr<DevicePage>> pages;
  };
  std::vector<Retired> retired_;  // place_hot's pages moved away from, in the order moved
  // CUDA graphs of the decode step, one per layer (see decode); KVS_CUDA_GRAPHS=0 turns them off.
  struct LayerGraph {
    cudaGraphExec_t exec = nullptr;
    std::vector<uintptr_t> key;
    cudaGraph_t graph = nullptr;          // the capture exec was instantiated from
    cudaGraphNode_t args_node = nullptr;  // upload_step_args in `graph`, given each replay's block
    cuda::StepArgsLaunch args_launch;
    void reset() noexcept {
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
      exec = nullptr;
      graph = nullptr;
      args_node = nullptr;
    }
  };
  static constexpr int64_t kGraphBucket = 256;  // tokens and selection slots a capture covers ahead
  bool graphs_ = !env_is("KVS_CUDA_GRAPHS", "0");
  // Programmatic dependent launches of the selection and attention kernels inside a step: off
  // unless KVS_CUDA_PDL=1 (quest at 128K: 52.5 against 55.9 us on an H100), until a rare failure
  // of their kernel test (a decode after a late writer read the writer's lengths before the
  // writer's data: 1 of about 600 runs, not reproduced alone) is understood. The chunk merge and
  // the top-k are programmatic dependents either way (docs/perf.md).
  bool pdl_ = env_is("KVS_CUDA_PDL", "1");
  // The argument block in the step's first launch (upload_step_args) unless KVS_CUDA_ARGS_BY_VALUE=0:
  // then a copy from a pinned slot and a separate append launch, as before 2026-11-28 (docs/perf.md).
  bool args_by_value_ = !env_is("KVS_CUDA_ARGS_BY_VALUE", "0");
  std::vector<LayerGraph> graphs_of_;
  std::vector<uintptr_t> graph_key_scratch_;
  cudaStream_t cap_stream_ = nullptr;
  uint64_t graph_captures_ = 0, graph_launches_ = 0;
  uint64_t ws_allocs_ = 0;  // step workspace (re)allocations

  static bool env_is(const char* name, const char* value) {
    const char* e = std::getenv(name);
    return e && std::strcmp(e, value) == 0;
  }
  static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
};

}  // namespace

std::unique_ptr<Placement> make_cuda_placement(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& ps,
                                               std::shared_ptr<ThreadPool> pool) {
  return std::make_unique<CudaPlacement>(cfg, spec, ps, std::move(pool));
}

}  // namespace kvs
#endif
