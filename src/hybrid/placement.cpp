// SPDX-License-Identifier: Apache-2.0
// The hybrid placement: the KV cache and the method's index in host memory (the KV in pinned
// pages the GPU reads in place), the method's search on the CPU, the exact attention over what it
// selected on the GPU. It is a composition, not a third backend: the host part is the cpu
// placement itself (src/backends/cpu/host_part.hpp), so prefill, index build, append, rollback,
// save/load, fork and every method's selection are the reference code; the GPU part is the cuda
// backend's attention kernels pointed at pinned host pages, and one merge kernel.
//
// A decode step, all on the caller's stream (nothing blocks the caller's thread on the device):
//
//   device -> pinned   q, k_new, v_new of the batch (async copies)
//   host function      for every session: append the token, the method's update and select (its
//                      extra state too), the sessions at once on the thread pool (one task each,
//                      their own rounds nested); the selection, the lengths and the page table
//                      written to pinned buffers
//   pinned -> device   the page table (a few KB)
//   device             dense attention (sessions whose selection is every key), gathered attention
//                      per KV head and per query head (rows of the other kinds have count 0: those
//                      CTAs return at once), each reading only the selected K/V rows over the bus;
//                      the merge of those states with the host part's extra state (read in place)
//                      into o and lse in the caller's dtype
//
// The step's selection is decided on the CPU while the GPU waits for it, so only the selected rows
// cross the bus (2 * Hkv * d * 2 bytes per key); the query and the outputs never leave the GPU
// otherwise.
//
// The split step (methods with a static set, Method::static_keys: lfps's sinks, ctkvr's sinks and
// local window): the static set's K/V rows are also kept in GPU memory, in a ring per layer (the
// first S tokens and the last W, S and W the method's static_capacity()), and no K/V row crosses
// the bus during the step:
//
//   caller's stream                          side stream (forked at the call, joined before the merge)
//   device -> pinned   q, k_new, v_new       ring_step: the new rows into the ring, the static
//   host function      select (as above),               set's slot lists
//                      then the CPU attends  gathered attention over the ring's static slots
//                      the rest of the
//                      selection in host
//                      memory -> pinned state
//   (wait for the side stream)
//   merge of the GPU's state and the host part's into o and lse
//
// The GPU part runs while the CPU searches and attends; only the query, the new K/V row and the
// host part's state (o, lse: Hq * (d + 1) floats) cross the bus. GPU memory per session is the
// rings (S + W slots per layer), whatever the context. KVS_HYBRID_SPLIT=0 at session creation
// turns the split off (every method then takes the path above). Host-side calls that read the host part (statistics, selections, save, fork, truncate,
// prefill) first wait for the steps in flight; an error of the host part inside a step (out of
// memory, a selection that names a token the layer does not hold) is reported by the session's
// next call, with the failed step taken back on every session of its batch.
#ifdef KVS_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <atomic>
#include <utility>
#include <vector>

#include "backends/backend.hpp"
#include "backends/cpu/host_part.hpp"
#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/cuda_util.hpp"
#include "core/error.hpp"
#include "core/kv_store.hpp"
#include "core/placement.hpp"
#include "core/session.hpp"
#include "core/tensor.hpp"
#include "hybrid/hybrid_ops.cuh"

namespace kvs {

const Backend& cuda_backend();
std::unique_ptr<Placement> make_cpu_placement(const SessionConfig&, const MethodSpec&, const ParamSet&,
                                              std::shared_ptr<ThreadPool>);

using cudautil::check;
using cudautil::cuda_view;
using cudautil::DevBuf;
using cudautil::PinnedBuf;
using cudautil::DeviceGuard;
using cudautil::S;

namespace {

constexpr int64_t kMaxLayerTokens = (int64_t(1) << 31) - 1;
// The largest static set kept on the GPU (S + W slots per layer); a method whose static set can be
// larger takes the unsplit step.
constexpr int64_t kMaxRingSlots = 16384;

// The cuda backend's operations under the hybrid placement's name.
class HybridBackendOps final : public Backend {
 public:
  int32_t id() const override { return KVS_BACKEND_HYBRID; }
  const char* name() const override { return "hybrid"; }
  void* alloc(size_t bytes, Mem where) const override { return cuda_backend().alloc(bytes, where); }
  void free(void* p, Mem where) const noexcept override { cuda_backend().free(p, where); }
  void copy(void* dst, Mem dm, const void* src, Mem sm, size_t bytes, void* stream) const override {
    cuda_backend().copy(dst, dm, src, sm, bytes, stream);
  }
  void host_fn(void* stream, std::function<void()> fn) const override { cuda_backend().host_fn(stream, std::move(fn)); }
  void sync(void* stream) const override { cuda_backend().sync(stream); }
  void merge(const AttnState& dst, const AttnState& src, int64_t rows, int32_t d, void* stream) const override {
    cuda_backend().merge(dst, src, rows, d, stream);
  }
};


}  // namespace

const Backend& hybrid_backend() {
  static const HybridBackendOps b;
  return b;
}

namespace {

size_t al(size_t x) { return (x + 255) / 256 * 256; }

// Lays buffers out one after the other in one allocation, each at a 256-byte boundary.
struct Packer {
  size_t bytes = 0;
  void put(size_t& at, size_t n) {
    at = bytes;
    bytes += al(n);
  }
};

bool pin_extent(void* p, size_t bytes) {
  return cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped) == cudaSuccess;
}
void unpin_extent(void* p) { cudaHostUnregister(p); }

// A host copy of a caller tensor given on the device (prefill and append accept either): the
// bytes, and a kvs_tensor describing them on the host.
struct HostTensor {
  std::vector<char> bytes;
  std::vector<int64_t> shape;
  kvs_tensor t{};
  // input: the tensor's contents are copied (an output only gets a host buffer of its size).
  const kvs_tensor* from(const kvs_tensor* src, const char* name, int device, void* stream, bool input = true) {
    if (!src || src->device.device_type != KVS_DEVICE_CUDA) return src;
    View v = cuda_view(src, name, {-1, -1, -1}, device, {DType::F32, DType::BF16, DType::F16}, 1);
    bytes.resize(size_t(v.numel()) * dtype_size(v.dtype));
    if (input) {
      check(cudaMemcpyAsync(bytes.data(), v.base, bytes.size(), cudaMemcpyDeviceToHost, S(stream)),
            "cudaMemcpyAsync(to host)");
      check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize");
    }
    shape.assign(src->shape, src->shape + src->ndim);
    t = *src;
    t.data = bytes.data();
    t.byte_offset = 0;
    t.strides = nullptr;
    t.shape = shape.data();
    t.device = kvs_device{KVS_DEVICE_CPU, 0};
    return &t;
  }
};

class HybridPlacement final : public Placement {
 public:
  HybridPlacement(const SessionConfig& cfg, std::unique_ptr<Placement> host_owner)
      : cfg_(cfg), device_(cfg.device_id), owner_(std::move(host_owner)), host_(host_part(owner_.get())) {
    if (!host_) fail(KVS_STATUS_INTERNAL, "hybrid placement: the host part is not a cpu placement");
    const auto& sh = cfg_.shape;
    for (uint32_t l = 0; l < sh.num_layers; ++l) host_->kv_layer(l).set_pinned(true, true);
    tokens_.resize(sh.num_layers);
    sync_tokens();
    DeviceGuard g(device_);
    check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
    // The split step: a static set that fits a ring, unless turned off.
    const StaticKeys cap = host_->static_capacity();
    const char* env = std::getenv("KVS_HYBRID_SPLIT");
    if (cap.total() > 0 && cap.total() <= kMaxRingSlots && !(env && std::string(env) == "0")) {
      split_ = true;
      ring_cap_ = cap;
      ring_pages_ = int32_t((cap.total() + cuda::kRingPageTokens - 1) / cuda::kRingPageTokens);
      ring_page_bytes_ = size_t(2 * sh.num_kv_heads) * cuda::kRingPageTokens * sh.head_dim * dtype_size(sh.kv_dtype);
      ring_.resize(sh.num_layers);
      ring_n_.assign(sh.num_layers, -1);
      check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate(hybrid side stream)");
      check(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming), "cudaEventCreate");
    }
  }

  static std::unique_ptr<Placement> create(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& ps,
                                           std::shared_ptr<ThreadPool> pool) {
    const auto& sh = cfg.shape;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
      fail(KVS_STATUS_UNSUPPORTED, "params->backend: the hybrid backend needs a CUDA device, none was found");
    if (cfg.device_id < 0 || cfg.device_id >= count)
      invalid("params->device_id: expected 0.." + std::to_string(count - 1) + ", got " + std::to_string(cfg.device_id));
    if (cfg.kv_memory != 0 && cfg.kv_memory != KVS_DEVICE_CUDA_HOST)
      fail(KVS_STATUS_UNSUPPORTED, "params->kv_memory: the hybrid backend keeps its KV cache in pinned host memory "
                                   "(KVS_DEVICE_CUDA_HOST or 0), got " + std::to_string(cfg.kv_memory));
    if (sh.kv_dtype == DType::F32)
      fail(KVS_STATUS_UNSUPPORTED, "params->kv_dtype: the hybrid backend stores KV in bf16 or fp16, not f32");
    if (sh.head_dim != 64 && sh.head_dim != 128 && sh.head_dim != 256)
      fail(KVS_STATUS_UNSUPPORTED, "params->head_dim: the hybrid backend supports head dims 64, 128 and 256, got " +
                                       std::to_string(sh.head_dim));
    int same_ptr = 0;
    cudaDeviceGetAttribute(&same_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, cfg.device_id);
    if (!same_ptr)
      fail(KVS_STATUS_UNSUPPORTED, "params->backend: the hybrid backend reads pinned host pages in place, and CUDA device " +
                                       std::to_string(cfg.device_id) + " cannot use host pointers to registered memory");
    {
      DeviceGuard g(cfg.device_id);
      set_pin_hooks(PinHooks{&pin_extent, &unpin_extent});
    }
    SessionConfig hc = cfg;
    hc.backend = KVS_BACKEND_CPU;
    hc.kv_memory = 0;
    return std::make_unique<HybridPlacement>(cfg, make_cpu_placement(hc, spec, ps, std::move(pool)));
  }

  ~HybridPlacement() override {
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    cudaEventSynchronize(done_);  // (an event never recorded is complete)
    cudaEventDestroy(done_);
    if (side_) {
      cudaStreamSynchronize(side_);
      cudaStreamDestroy(side_);
      cudaEventDestroy(fork_);
      cudaEventDestroy(join_);
    }
    ws_ = DevBuf();
    side_ws_ = DevBuf();
    ring_.clear();
    if (prev >= 0) cudaSetDevice(prev);
  }

  int32_t backend() const override { return KVS_BACKEND_HYBRID; }
  const Backend& ops() const override { return hybrid_backend(); }

  // ---- prefill, append, build: the host part's, after the steps in flight ----

  void add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                  const char* fn, bool prompt, int64_t max_tokens, void* stream) override {
    drain();
    DeviceGuard g(device_);
    // Tensors on the device are copied to the host (the prompt is not the hot path); the host
    // part validates shapes and values as on the cpu backend.
    HostTensor hq, hk, hv, ho;
    const kvs_tensor* oh = ho.from(o, "o", device_, stream, /*input=*/false);
    invalidate_rings();
    owner_->add_tokens(layer, hq.from(q, "q", device_, stream), hk.from(k, "k", device_, stream),
                       hv.from(v, "v", device_, stream), oh, fn, prompt, max_tokens, stream);
    if (o && oh != o) {
      View ov = cuda_view(o, "o", {-1, -1, -1}, device_, {DType::F32, DType::BF16, DType::F16}, 1);
      check(cudaMemcpyAsync(ov.mutable_base(), ho.bytes.data(), ho.bytes.size(), cudaMemcpyHostToDevice, S(stream)),
            "cudaMemcpyAsync(o)");
      check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize");
    }
    sync_tokens();
  }

  void build_index(uint32_t layer, void* stream) override {
    drain();
    owner_->build_index(layer, stream);
  }

  // ---- a batch step ----

  void decode(std::span<Placement* const> batch, uint32_t layer, const StepTensors& t,
              std::span<StepReport> reports) override {
    const auto& sh = cfg_.shape;
    const int64_t B = int64_t(batch.size()), hq = sh.num_q_heads, hkv = sh.num_kv_heads, d = sh.head_dim;
    DeviceGuard g(device_);
    std::vector<HybridPlacement*> ps(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      ps[size_t(b)] = static_cast<HybridPlacement*>(batch[size_t(b)]);
      ps[size_t(b)]->raise_deferred();
    }
    const auto [qv, kv, vv, ov, lv] = cudautil::cuda_step_views(t, B, sh, device_);
    if (B > 65535) invalid(std::string(t.fn) + ": the hybrid backend decodes at most 65535 sessions per call");
    int64_t cap = 1;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = ps[size_t(b)]->tokens(layer);
      if (n >= kMaxLayerTokens)
        invalid(std::string(t.fn) + ": layer " + std::to_string(layer) + " of sessions[" + std::to_string(b) +
                "] is full (" + std::to_string(kMaxLayerTokens) + " tokens)");
      cap = std::max(cap, n + 1);
    }
    const int64_t max_pages = (cap + kPageTokens - 1) / kPageTokens;
    // The split step when every session of the batch takes it; each session's static set at this
    // step (the layer's tokens after the append), within its ring.
    bool split = true;
    for (auto* p : ps) split = split && p->split_;
    std::vector<StaticKeys> sks;
    if (split) {
      sks.resize(size_t(B));
      for (int64_t b = 0; b < B; ++b) {
        HybridPlacement* p = ps[size_t(b)];
        const StaticKeys sk = p->host_->static_keys(layer, p->tokens(layer) + 1);
        if (sk.sinks < 0 || sk.recent < 0 || sk.sinks > p->ring_cap_.sinks || sk.recent > p->ring_cap_.recent)
          fail(KVS_STATUS_INTERNAL, "hybrid: the method's static set (" + std::to_string(sk.sinks) + " sinks, " +
                                        std::to_string(sk.recent) + " recent keys) exceeds its capacity");
        sks[size_t(b)] = sk;
      }
    }

    // The step's buffers (this session's: the batch's leader). A buffer that must grow waits for
    // the steps that still read it.
    const size_t qb = size_t(hq * d) * dtype_size(qv.dtype), kb = size_t(hkv * d) * dtype_size(sh.kv_dtype);
    Layout L;
    Packer pk;
    pk.put(L.q, size_t(B) * qb);
    pk.put(L.k, size_t(B) * kb);
    pk.put(L.v, size_t(B) * kb);
    pk.put(L.extra_o, size_t(B * hq * d) * 4);
    pk.put(L.extra_lse, size_t(B * hq) * 4);
    pk.put(L.lens, size_t(B) * 4);
    pk.put(L.cnt_kv, size_t(B * hkv) * 4);
    pk.put(L.cnt_q, size_t(B * hq) * 4);
    pk.put(L.flags, size_t(B) * 2);
    pk.put(L.table, size_t(B * max_pages) * sizeof(void*));
    pk.put(L.idx_kv, split ? 0 : size_t(B * hkv * cap) * 4);  // (the split step's selection stays on the host)
    pk.put(L.idx_q, split ? 0 : size_t(B * hq * cap) * 4);
    const cuda::AttnShape shape{int32_t(B), int32_t(hq), int32_t(hkv), int32_t(d), sh.softmax_scale};
    const size_t ws = std::max({cuda::dense_decode_workspace_bytes(shape, int32_t(cap)),
                                cuda::gathered_decode_workspace_bytes(shape, int32_t(cap), false),
                                cuda::gathered_decode_workspace_bytes(shape, int32_t(cap), true)});
    const size_t states = al(size_t(3 * B * hq * d) * 4) + al(size_t(3 * B * hq) * 4);
    if (pk.bytes > host_buf_.bytes || !host_buf_.p || states + ws > ws_.bytes || !ws_.p ||
        size_t(B * max_pages) * sizeof(void*) > table_.bytes || !table_.p) {
      for (auto* p : ps) p->drain();
      host_buf_.reserve(pk.bytes, "cudaHostAlloc(hybrid step buffers)");
      ws_.reserve(states + ws, device_, "cudaMalloc(hybrid workspace)");
      table_.reserve(std::max<size_t>(size_t(B * max_pages) * sizeof(void*), 4096), device_, "cudaMalloc(hybrid page table)");
    }
    // The pages the host part may take during the step (a new page or a copy on write, one per
    // session): pinning is not allowed inside a host function, so they are pinned and set aside
    // now, and given back to the pool by the step.
    const size_t page_bytes = host_->kv_layer(layer).page_bytes();
    // The split step's device buffers and rings (a ring that does not reflect its layer, after a
    // prefill, an append, a truncate, a load or a failed step, is filled again from the host KV).
    SideLayout SL{};
    if (split) {
      SL = side_layout(shape, ps);
      if (SL.bytes > side_ws_.bytes || !side_ws_.p) {
        for (auto* p : ps) p->drain();
        side_ws_.reserve(SL.bytes, device_, "cudaMalloc(hybrid split workspace)");
      }
      for (auto* p : ps)
        if (p->ring_n_[layer] != p->tokens(layer)) p->refill_ring(layer, t.stream);
    }
    reserve_pinned_pages(page_bytes, uint32_t(B));

    auto job = std::make_shared<Job>();
    job->ps = ps;
    job->layer = layer;
    job->L = L;
    job->buf = host_buf_.p;
    job->qdtype = qv.dtype;
    job->cap = cap;
    job->max_pages = max_pages;
    job->page_bytes = page_bytes;
    job->split = split;
    job->sks = sks;
    cudaStream_t st = S(t.stream);
    bool queued = false;
    try {
      // After every earlier step of every session of the batch, whatever stream it ran on: each
      // session's done_ event then covers all of its steps, and the leader's buffers are free.
      for (auto* p : ps)
        if (p->pending_) check(cudaStreamWaitEvent(st, p->done_, 0), "cudaStreamWaitEvent");
      if (split) {  // the GPU part on the side stream, beside the host function
        check(cudaEventRecord(fork_, st), "cudaEventRecord(fork)");
        check(cudaStreamWaitEvent(side_, fork_, 0), "cudaStreamWaitEvent(fork)");
        launch_static(shape, qv, kv, vv, SL, ps, sks, layer);
        check(cudaEventRecord(join_, side_), "cudaEventRecord(join)");
        for (auto* p : ps) ++p->ring_n_[layer];
      }
      check(cudaMemcpyAsync(host_buf_.at<char>(L.q), qv.base, size_t(B) * qb, cudaMemcpyDeviceToHost, st),
            "cudaMemcpyAsync(q)");
      check(cudaMemcpyAsync(host_buf_.at<char>(L.k), kv.base, size_t(B) * kb, cudaMemcpyDeviceToHost, st),
            "cudaMemcpyAsync(k_new)");
      check(cudaMemcpyAsync(host_buf_.at<char>(L.v), vv.base, size_t(B) * kb, cudaMemcpyDeviceToHost, st),
            "cudaMemcpyAsync(v_new)");
      cuda_backend().host_fn(t.stream, [job] { job->run(); });
      queued = true;
      for (auto* p : ps) p->tokens_add(layer, 1);
      if (split) {
        check(cudaStreamWaitEvent(st, join_, 0), "cudaStreamWaitEvent(join)");
        // The static set's state counts only where the host part took the step (its flags).
        combine(shape, ov, lv, t.lse != nullptr, L, 1, side_ws_.as<float>(),
                reinterpret_cast<float*>(side_ws_.as<char>() + SL.lse), host_buf_.at<uint8_t>(L.flags), st);
      } else {
        check(cudaMemcpyAsync(table_.p, host_buf_.at<char>(L.table), size_t(B * max_pages) * sizeof(void*),
                              cudaMemcpyHostToDevice, st),
              "cudaMemcpyAsync(page table)");
        launch_attention(shape, qv, ov, lv, t.lse != nullptr, L, cap, max_pages, ws, states, st);
      }
      for (auto* p : ps) p->record_step(st);
    } catch (...) {
      if (split)
        for (auto* p : ps) p->ring_n_[layer] = -1;  // filled again at the next step
      if (!queued) {
        unreserve_pinned_pages(page_bytes, uint32_t(B));
        throw;
      }
      // The host function is queued: cancel it, or, if it runs already, wait for it and take its
      // step back, so the failed call leaves every session as it was.
      if (!job->cancel()) {
        job->wait();
        if (job->ok)
          for (auto* p : ps) p->host_->undo_step(layer);
      }
      for (auto* p : ps) {
        p->tokens_add(layer, -1);
        try {
          p->record_step(st);  // later steps still wait for what was launched
        } catch (...) {
        }
      }
      throw;
    }
    for (int64_t b = 0; b < B; ++b) reports[size_t(b)] = StepReport{0, ps[size_t(b)]->tokens(layer), true};
  }

  bool lse_base2() const override { return true; }

  // ---- everything else: the host part's, after the steps in flight ----

  int64_t truncate_floor(uint32_t layer, std::string* why) const override {
    drain();
    return owner_->truncate_floor(layer, why);
  }
  void truncate(int64_t n) override {
    drain();
    invalidate_rings();
    owner_->truncate(n);
    sync_tokens();
  }
  std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const override {
    drain();
    return owner_->last_selection(layer, kv_head);
  }
  void stats(kvs_session_stats& st) const override {
    drain();
    owner_->stats(st);
    st.workspace_bytes = ws_.bytes + table_.bytes + host_buf_.bytes + side_ws_.bytes;
    for (const auto& r : ring_) st.workspace_bytes += r.bytes;
  }
  Settled settled_reports() const override {
    drain();
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(settled_, Settled{});
  }
  bool stat(std::string_view name, double* out) const override {
    drain();
    if (name == "hybrid_split" || name == "hybrid_static_keys" || name == "hybrid_host_keys") {
      std::lock_guard<std::mutex> lock(mu_);
      const double n = double(std::max<int64_t>(1, split_steps_));
      *out = name == "hybrid_split" ? double(split_) : (name == "hybrid_static_keys" ? split_gpu_keys_ : split_cpu_keys_) / n;
      return true;
    }
    return owner_->stat(name, out);
  }
  nlohmann::json save_meta() const override {
    drain();
    return owner_->save_meta();
  }
  void save(io::TablesWriter& w, bool with_kv) const override {
    drain();
    owner_->save(w, with_kv);
  }
  void load(const std::shared_ptr<const io::TablesFile>& f, const nlohmann::json& meta, const std::vector<int64_t>& tokens,
            bool with_kv, const std::string& path, bool) override {
    invalidate_rings();
    owner_->load(f, meta, tokens, with_kv, path, false);  // pinned copies, never the file's mapping
    sync_tokens();
  }
  bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const override {
    drain();
    return owner_->index_fits(layer, tokens, why);
  }
  std::unique_ptr<Placement> fork() const override {
    drain();
    return std::make_unique<HybridPlacement>(cfg_, owner_->fork());
  }

 private:
  struct Layout {
    size_t q, k, v, extra_o, extra_lse, lens, cnt_kv, cnt_q, flags, table, idx_kv, idx_q;
  };

  // The GPU part of a step: the three kinds of selection attended (rows of the other kinds have no
  // keys and return at once), merged with the host part's extra state into o and lse.
  void launch_attention(const cuda::AttnShape& shape, const View& qv, const View& ov, const View& lv, bool with_lse,
                        const Layout& L, int64_t cap, int64_t max_pages, size_t ws, size_t states, cudaStream_t st) {
    const int64_t B = shape.batch, hq = shape.num_q_heads, d = shape.head_dim;
    float* so = ws_.as<float>();
    float* sl = reinterpret_cast<float*>(ws_.as<char>() + al(size_t(3 * B * hq * d) * 4));
    const cuda::Workspace w{ws_.as<char>() + states, ws};
    const cuda::PagedKv pk{static_cast<const void* const*>(table_.p), int32_t(max_pages), int32_t(kPageTokens),
                           kPageShift};
    const cuda::Scalar kdt = cuda::Scalar(int32_t(cfg_.shape.kv_dtype));
    const cuda::Query qq{qv.base, cuda::Scalar(int32_t(qv.dtype))};
    const size_t rows = size_t(B * hq);
    auto out = [&](int i) { return cuda::Output{so + size_t(i) * rows * d, cuda::Scalar::F32, sl + size_t(i) * rows}; };
    check(cuda::dense_decode(shape, qq, pk, kdt, host_buf_.at<int32_t>(L.lens), int32_t(cap), out(0), w, st),
          "dense_decode (hybrid)");
    check(cuda::gathered_decode(shape, qq, pk, kdt, host_buf_.at<int32_t>(L.idx_kv), host_buf_.at<int32_t>(L.cnt_kv),
                                int32_t(cap), out(1), w, st, false),
          "gathered_decode (hybrid, per KV head)");
    check(cuda::gathered_decode(shape, qq, pk, kdt, host_buf_.at<int32_t>(L.idx_q), host_buf_.at<int32_t>(L.cnt_q),
                                int32_t(cap), out(2), w, st, true),
          "gathered_decode (hybrid, per query head)");
    combine(shape, ov, lv, with_lse, L, 3, so, sl, nullptr, st);
  }

  // The merge of `num_dev` device states (o at so + i * rows * d, lse at sl + i * rows) with the
  // host part's into o and lse. dev_on [B] (nullptr: always): whether a session's device states
  // count (the split step passes the host part's flags, so a failed step's outputs are zeros).
  void combine(const cuda::AttnShape& shape, const View& ov, const View& lv, bool with_lse, const Layout& L,
               int num_dev, float* so, float* sl, const uint8_t* dev_on, cudaStream_t st) {
    const int64_t B = shape.batch, hq = shape.num_q_heads, d = shape.head_dim;
    const size_t rows = size_t(B * hq);
    cuda::CombineArgs ca;
    for (int i = 0; i < num_dev; ++i) {
      ca.dev_o[i] = so + size_t(i) * rows * d;
      ca.dev_lse[i] = sl + size_t(i) * rows;
    }
    ca.num_dev = num_dev;
    ca.dev_on = dev_on;
    ca.host_o = host_buf_.at<float>(L.extra_o);
    ca.host_lse = host_buf_.at<float>(L.extra_lse);
    ca.host_on = host_buf_.at<uint8_t>(L.flags);
    ca.lse_base2 = host_buf_.at<uint8_t>(L.flags) + B;
    ca.batch = int32_t(B);
    ca.heads = int32_t(hq);
    ca.head_dim = int32_t(d);
    ca.o = ov.mutable_base();
    ca.o_dtype = cuda::Scalar(int32_t(ov.dtype));
    ca.lse = with_lse ? static_cast<float*>(lv.mutable_base()) : nullptr;
    check(cuda::combine_states(ca, st), "combine_states (hybrid)");
  }

  // ---- the split step's GPU part ----

  // The side stream's device buffers: the static set's attention state (o [B * Hq, d] at 0, lse
  // [B * Hq] at lse), the rings' page table, the slot lists and counts, the attention's workspace.
  struct SideLayout {
    size_t lse = 0, table = 0, idx = 0, cnt = 0, ws = 0, ws_bytes = 0, bytes = 0;
    int32_t max_pages = 0, idx_cap = 0;
  };
  static SideLayout side_layout(const cuda::AttnShape& shape, const std::vector<HybridPlacement*>& ps) {
    const int64_t B = int64_t(ps.size());
    SideLayout sl;
    for (const auto* p : ps) {  // the sessions of a batch may hold rings of different sizes
      sl.max_pages = std::max(sl.max_pages, p->ring_pages_);
      sl.idx_cap = std::max(sl.idx_cap, int32_t(p->ring_cap_.total()));
    }
    Packer pk;
    size_t o_at = 0;
    pk.put(o_at, size_t(B * shape.num_q_heads * shape.head_dim) * 4);
    pk.put(sl.lse, size_t(B * shape.num_q_heads) * 4);
    pk.put(sl.table, size_t(B * sl.max_pages) * sizeof(void*));
    pk.put(sl.idx, size_t(B * shape.num_kv_heads * sl.idx_cap) * 4);
    pk.put(sl.cnt, size_t(B * shape.num_kv_heads) * 4);
    sl.ws_bytes = cuda::gathered_decode_workspace_bytes(shape, sl.idx_cap, false);
    pk.put(sl.ws, sl.ws_bytes);
    sl.bytes = pk.bytes;
    return sl;
  }

  // On the side stream: the new rows into the rings and the static set's slot lists (ring_step),
  // then the gathered attention of q over them into the side state.
  void launch_static(const cuda::AttnShape& shape, const View& qv, const View& kv, const View& vv,
                     const SideLayout& SL, const std::vector<HybridPlacement*>& ps, const std::vector<StaticKeys>& sks,
                     uint32_t layer) {
    const int64_t B = shape.batch;
    char* base = side_ws_.as<char>();
    cuda::RingStep rs;
    rs.hkv = shape.num_kv_heads;
    rs.head_dim = shape.head_dim;
    rs.dtype = cuda::Scalar(int32_t(cfg_.shape.kv_dtype));
    rs.max_pages = SL.max_pages;
    rs.idx_cap = SL.idx_cap;
    rs.page_bytes = int64_t(ring_page_bytes_);
    rs.k_new = kv.base;
    rs.v_new = vv.base;
    rs.table = reinterpret_cast<const void**>(base + SL.table);
    rs.idx = reinterpret_cast<int32_t*>(base + SL.idx);
    rs.cnt = reinterpret_cast<int32_t*>(base + SL.cnt);
    for (int64_t b0 = 0; b0 < B; b0 += cuda::kRingBatch) {
      rs.b0 = int32_t(b0);
      rs.count = int32_t(std::min<int64_t>(cuda::kRingBatch, B - b0));
      for (int32_t i = 0; i < rs.count; ++i) {
        HybridPlacement* p = ps[size_t(b0 + i)];
        const StaticKeys& sk = sks[size_t(b0 + i)];
        rs.s[i] = cuda::RingSession{p->ring_[layer].p, int32_t(p->ring_cap_.sinks), int32_t(p->ring_cap_.recent),
                                    int32_t(p->tokens(layer) + 1), int32_t(sk.sinks), int32_t(sk.recent)};
      }
      check(cuda::ring_step(rs, side_), "ring_step (hybrid)");
    }
    const cuda::PagedKv pk{rs.table, SL.max_pages, cuda::kRingPageTokens, cuda::kRingPageShift};
    const cuda::Output out{base, cuda::Scalar::F32, reinterpret_cast<float*>(base + SL.lse)};
    check(cuda::gathered_decode(shape, cuda::Query{qv.base, cuda::Scalar(int32_t(qv.dtype))}, pk, rs.dtype, rs.idx,
                                rs.cnt, SL.idx_cap, out, cuda::Workspace{base + SL.ws, SL.ws_bytes}, side_, false),
          "gathered_decode (hybrid, static set)");
  }

  // Fills the layer's ring from the host KV (tokens [0, S) and the last W), on the caller's
  // stream, and waits for it: after a prefill, an append, a truncate, a load or a failed step.
  void refill_ring(uint32_t layer, void* stream) {
    drain();
    const KVLayer& kv = host_->kv_layer(layer);
    const int64_t N = kv.size(), sinks = ring_cap_.sinks, window = ring_cap_.recent;
    const int64_t hkv = cfg_.shape.num_kv_heads;
    const size_t row = size_t(kv.head_dim()) * kv.elem_size(), bytes = size_t(ring_pages_) * ring_page_bytes_;
    DevBuf& r = ring_[layer];
    if (!r.p) r.reserve(bytes, device_, "cudaMalloc(hybrid static-set ring)");
    std::vector<std::byte> img(bytes);
    auto put = [&](int64_t t) {
      const int64_t slot = cuda::ring_slot(t, sinks, window);
      std::byte* page = img.data() + size_t(slot / cuda::kRingPageTokens) * ring_page_bytes_;
      for (int64_t h = 0; h < hkv; ++h) {
        const size_t at = size_t(h * cuda::kRingPageTokens + slot % cuda::kRingPageTokens) * row;
        std::memcpy(page + at, kv.k_row(int(h), t), row);
        std::memcpy(page + size_t(hkv) * cuda::kRingPageTokens * row + at, kv.v_row(int(h), t), row);
      }
    };
    for (int64_t t = 0; t < std::min(sinks, N); ++t) put(t);
    for (int64_t t = std::max(sinks, N - window); t < N; ++t) put(t);
    DeviceGuard g(device_);
    check(cudaMemcpyAsync(r.p, img.data(), bytes, cudaMemcpyHostToDevice, S(stream)), "cudaMemcpyAsync(ring)");
    check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize");
    ring_n_[layer] = N;
  }
  void invalidate_rings() { std::fill(ring_n_.begin(), ring_n_.end(), -1); }

  // The host function of one step: runs on CUDA's callback thread once the copies of q, k_new and
  // v_new have landed; must not call CUDA. Never throws (an error is kept for the next call).
  struct Job {
    std::vector<HybridPlacement*> ps;
    uint32_t layer = 0;
    Layout L{};
    void* buf = nullptr;
    DType qdtype = DType::F32;
    int64_t cap = 0, max_pages = 0;
    size_t page_bytes = 0;
    bool split = false;              // the split step: the host part attends the selection's rest
    std::vector<StaticKeys> sks;     // with split: each session's static set (on the GPU)
    bool ok = false;                 // the host part took the step (read after wait())
    std::atomic<int> state{0};       // 0 queued, 1 running, 2 done, 3 cancelled

    // Before it runs: it will do nothing (true), or it runs or ran already (false).
    bool cancel() {
      int expected = 0;
      return state.compare_exchange_strong(expected, 3);
    }
    void wait() const {
      while (state.load() != 2) std::this_thread::yield();
    }

    template <class T>
    T* at(size_t o) const {
      return reinterpret_cast<T*>(static_cast<char*>(buf) + o);
    }

    // fn(b) for every session b of the batch, as one job on the leader's pool (each session's own
    // parallel rounds nest in it, so the threads one session's step leaves idle serve the others).
    // Each task in a NoPinScope, as this host function's thread is.
    void batch_for(const std::function<void(int64_t)>& fn) const {
      ps[0]->host_->pool().parallel_for(int64_t(ps.size()), [&fn](int64_t b) {
        NoPinScope no_pin;
        fn(b);
      });
    }

    // Nothing to attend: the kernels queued after this host function read only these.
    void clear_selection() noexcept {
      const auto& sh = ps[0]->cfg_.shape;
      const int64_t B = int64_t(ps.size());
      std::fill(at<int32_t>(L.lens), at<int32_t>(L.lens) + B, 0);
      std::fill(at<int32_t>(L.cnt_kv), at<int32_t>(L.cnt_kv) + B * sh.num_kv_heads, 0);
      std::fill(at<int32_t>(L.cnt_q), at<int32_t>(L.cnt_q) + B * sh.num_q_heads, 0);
      std::fill(at<uint8_t>(L.flags), at<uint8_t>(L.flags) + 2 * B, uint8_t(0));
    }

    void run() noexcept {
      int expected = 0;
      if (!state.compare_exchange_strong(expected, 1)) {  // cancelled by a failed decode call
        clear_selection();
        unreserve_pinned_pages(page_bytes, uint32_t(ps.size()));
        return;
      }
      {
        NoPinScope no_pin;  // the whole step, its undo included: no CUDA call from the page pool here
        body();
      }
      unreserve_pinned_pages(page_bytes, uint32_t(ps.size()));
      state.store(2);
    }

    void body() noexcept {
      const auto& sh = ps[0]->cfg_.shape;
      const int64_t B = int64_t(ps.size()), hq = sh.num_q_heads, hkv = sh.num_kv_heads, d = sh.head_dim;
      int32_t* lens = at<int32_t>(L.lens);
      int32_t* cnt_kv = at<int32_t>(L.cnt_kv);
      int32_t* cnt_q = at<int32_t>(L.cnt_q);
      uint8_t* on = at<uint8_t>(L.flags);
      clear_selection();
      std::vector<uint8_t> took;  // per session: its host part took the step
      const char* err = nullptr;
      std::string what;
      kvs_status code = KVS_STATUS_INTERNAL;
      try {
        // A session whose earlier step failed takes no step until its caller has seen the error
        // (its host part is one token short of what later steps were enqueued for).
        for (auto* p : ps) {
          std::lock_guard<std::mutex> lock(p->mu_);
          if (!p->deferred_.empty()) fail(KVS_STATUS_INVALID_STATE, "an earlier step of a session of this batch failed");
        }
        std::vector<float> q(size_t(B * hq * d)), k(size_t(B * hkv * d)), v(size_t(B * hkv * d));
        convert_to_f32(at<char>(L.q), qdtype, q.data(), q.size());
        convert_to_f32(at<char>(L.k), sh.kv_dtype, k.data(), k.size());
        convert_to_f32(at<char>(L.v), sh.kv_dtype, v.data(), v.size());
        for (const auto* x : {&q, &k, &v})
          for (float f : *x)
            if (!std::isfinite(f))
              invalid(std::string(x == &q ? "q" : x == &k ? "k_new" : "v_new") + ": expected finite values, got NaN or inf");
        took.assign(size_t(B), 0);
        std::vector<HostPart::Step> steps(static_cast<size_t>(B));
        batch_for([&](int64_t b) {
          steps[size_t(b)] = ps[size_t(b)]->host_->select_step(
              layer, q.data() + b * hq * d, k.data() + b * hkv * d, v.data() + b * hkv * d,
              at<float>(L.extra_o) + b * hq * d, at<float>(L.extra_lse) + b * hq);
          took[size_t(b)] = 1;
        });
        for (int64_t b = 0; b < B; ++b) {
          const Selection& sel = *steps[size_t(b)].sel;
          for (const auto& list : sel.lists)
            if (int64_t(list.size()) > cap)
              fail(KVS_STATUS_FORMAT_INVALID, "the method selected " + std::to_string(list.size()) +
                                                  " keys for one head of a layer of at most " + std::to_string(cap) +
                                                  " tokens: its tables do not match the layer");
        }
        for (int64_t b = 0; b < B; ++b) ps[size_t(b)]->host_->log_decode(layer, q.data() + b * hq * d);
        // Session b's host part took the step: its flags for combine_states (extra: its host state
        // counts) and, under its lock, the step's report and whatever `more` adds.
        auto settle = [&](int64_t b, bool extra, auto&& more) {
          HybridPlacement* p = ps[size_t(b)];
          on[b] = extra;
          on[B + b] = p->cfg_.lse_base == KVS_LSE_BASE_2;
          std::lock_guard<std::mutex> lock(p->mu_);
          p->settled_.add(steps[size_t(b)].report);
          more(*p);
        };
        if (split) {  // the rest of each selection attended here, merged with the method's extra state
          std::vector<double> kept(static_cast<size_t>(B));
          batch_for([&](int64_t b) {
            kept[size_t(b)] = ps[size_t(b)]->host_->attend_rest(layer, q.data() + b * hq * d, steps[size_t(b)],
                                                                sks[size_t(b)], at<float>(L.extra_o) + b * hq * d,
                                                                at<float>(L.extra_lse) + b * hq);
          });
          for (int64_t b = 0; b < B; ++b)
            settle(b, true, [&](HybridPlacement& p) {
              p.split_steps_ += 1;
              p.split_gpu_keys_ += double(sks[size_t(b)].total());
              p.split_cpu_keys_ += kept[size_t(b)];
            });
          ok = true;
          return;
        }
        const void** table = at<const void*>(L.table);
        for (int64_t b = 0; b < B; ++b) {
          const HostPart::Step& s = steps[size_t(b)];
          const Selection& sel = *s.sel;
          const KVLayer& lay = ps[size_t(b)]->host_->kv_layer(layer);
          if (sel.attend) {
            if (sel.kind == Selection::Kind::All) {
              lens[b] = int32_t(lay.size());
            } else {
              const bool kvh = sel.kind == Selection::Kind::PerKvHead;
              const int64_t H = kvh ? hkv : hq;
              int32_t* cnt = kvh ? cnt_kv : cnt_q;
              int32_t* idx = at<int32_t>(kvh ? L.idx_kv : L.idx_q);
              for (int64_t h = 0; h < H; ++h) {
                const auto& list = sel.lists[size_t(h)];
                std::memcpy(idx + (b * H + h) * cap, list.data(), list.size() * 4);
                cnt[b * H + h] = int32_t(list.size());
              }
            }
          }
          const auto& pages = lay.pages();
          for (size_t i = 0; i < pages.size(); ++i) table[b * max_pages + int64_t(i)] = pages[i]->data();
          settle(b, s.has_extra, [](HybridPlacement&) {});
        }
        ok = true;
        return;
      } catch (const Error& e) {
        err = e.what();
        code = e.code();
      } catch (const std::bad_alloc&) {
        err = "out of host memory";
        code = KVS_STATUS_OUT_OF_MEMORY;
      } catch (const std::exception& e) {
        err = e.what();
      } catch (...) {
        err = "unknown error";
      }
      // All or nothing: the sessions that advanced take their token back; the step attends nothing.
      for (size_t a = 0; a < took.size(); ++a) {
        if (!took[a]) continue;
        try {
          ps[a]->host_->undo_step(layer);
        } catch (...) {
        }
      }
      clear_selection();
      for (auto* p : ps) {
        try {
          std::lock_guard<std::mutex> lock(p->mu_);
          if (p->deferred_.empty()) {
            p->deferred_ = "a decode step of layer " + std::to_string(layer) + " failed in the hybrid backend's host "
                           "part and was taken back (its outputs are zeros, and the steps queued after it on this "
                           "session took no token): " + err;
            p->deferred_code_ = code;
          }
        } catch (...) {  // no memory for the message: a shorter one
          std::lock_guard<std::mutex> lock(p->mu_);
          p->deferred_code_ = KVS_STATUS_OUT_OF_MEMORY;
        }
      }
    }
  };

  // Waits for this session's steps in flight (its done_ event covers all of them), then reports an
  // error one of them left.
  void drain() const {
    bool wait;
    {
      std::lock_guard<std::mutex> lock(mu_);
      wait = pending_;
    }
    if (wait) {
      DeviceGuard g(device_);
      check(cudaEventSynchronize(done_), "cudaEventSynchronize");
      std::lock_guard<std::mutex> lock(mu_);
      pending_ = false;
    }
    raise_deferred();
  }
  // An error a finished step left: the session's state is the host part's (every later step of
  // the session refused to run), which the caller is told once.
  void raise_deferred() const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (deferred_.empty() && deferred_code_ == KVS_STATUS_INTERNAL) return;
    }
    {
      DeviceGuard g(device_);
      cudaEventSynchronize(done_);  // the steps queued after the failed one have run (and refused)
    }
    std::string msg;
    kvs_status code;
    {
      std::lock_guard<std::mutex> lock(mu_);
      msg.swap(deferred_);
      code = deferred_code_;
      deferred_code_ = KVS_STATUS_INTERNAL;
      pending_ = false;
    }
    const_cast<HybridPlacement*>(this)->sync_tokens();
    fail(code, msg.empty() ? "a decode step failed in the hybrid backend's host part (out of memory)" : msg);
  }
  void record_step(cudaStream_t st) {
    check(cudaEventRecord(done_, st), "cudaEventRecord");
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = true;
  }
  void sync_tokens() {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t l = 0; l < tokens_.size(); ++l) tokens_[l] = host_->kv_layer(l).size();
  }
  void tokens_add(uint32_t layer, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    tokens_[layer] += n;
  }

 public:
  int64_t tokens(uint32_t layer) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return tokens_[layer];
  }

 private:
  SessionConfig cfg_;
  int device_;
  std::unique_ptr<Placement> owner_;  // the cpu placement
  HostPart* host_;                    // the same object
  cudaEvent_t done_ = nullptr;        // recorded after this session's latest step (which waited for the earlier ones)
  PinnedBuf host_buf_;                // the step buffers of the steps this session leads
  DevBuf ws_, table_;
  // The split step (see the top of this file): the static set's capacity, one ring per layer and
  // the tokens each reflects (-1: fill it again from the host KV), the side stream and its events,
  // its device buffers (the batch leader's).
  bool split_ = false;
  StaticKeys ring_cap_{};
  int32_t ring_pages_ = 0;
  size_t ring_page_bytes_ = 0;
  std::vector<DevBuf> ring_;
  std::vector<int64_t> ring_n_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  DevBuf side_ws_;
  // Shared with the host function and with concurrent const calls (kvs_session_get_stats, ...).
  mutable std::mutex mu_;
  std::vector<int64_t> tokens_;       // per layer, counting the steps in flight
  mutable bool pending_ = false;      // a step may be in flight
  mutable std::string deferred_;      // an error a step left for the next call
  mutable kvs_status deferred_code_ = KVS_STATUS_INTERNAL;  // != INTERNAL with an empty message: out of memory
  mutable Settled settled_;           // completed steps' reports not yet taken
  int64_t split_steps_ = 0;           // split steps taken, and the keys per list they attended on
  double split_gpu_keys_ = 0, split_cpu_keys_ = 0;  // the GPU (the static set) and on the host
};

}  // namespace

std::unique_ptr<Placement> make_hybrid_placement(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& ps,
                                                 std::shared_ptr<ThreadPool> pool) {
  return HybridPlacement::create(cfg, spec, ps, std::move(pool));
}

}  // namespace kvs
#endif
