// SPDX-License-Identifier: Apache-2.0
#include "core/session.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>

#include "backends/backend.hpp"
#include "backends/cpu/gemm.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "io/header.hpp"
#include "io/tables.hpp"

namespace kvs {

namespace {
std::string L(uint32_t layer) { return std::to_string(layer); }
// Token indices are int32 in selections and on the GPU.
constexpr int64_t kMaxLayerTokens = (int64_t(1) << 31) - 1;
// Session limits (kvs_session_params; a tables file's shape is checked against the same).
constexpr uint32_t kMaxLayers = 4096, kMaxKvHeads = 1024, kMaxQHeads = 8192, kMinHeadDim = 8, kMaxHeadDim = 256,
                   kMaxThreads = 1024;
constexpr int64_t kMaxRollback = int64_t(1) << 20;
// The rows of a [n, ...] tensor of a prefill or append chunk (0 when q is not one: the placement
// names what is wrong with it).
int64_t rows(const kvs_tensor* q) { return q && q->ndim >= 1 && q->shape && q->shape[0] > 0 ? q->shape[0] : 0; }
// kvs_session_params.kv_memory and kvs_load_params.kv_memory: a kvs_device_type or 0.
void check_kv_memory(int32_t m, const char* what) {
  if (m != 0 && m != KVS_DEVICE_CPU && m != KVS_DEVICE_CUDA && m != KVS_DEVICE_CUDA_HOST)
    invalid(std::string(what) + ": expected 0 (the backend's own), KVS_DEVICE_CPU (1), KVS_DEVICE_CUDA (2) or "
            "KVS_DEVICE_CUDA_HOST (3), got " + std::to_string(m));
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Configuration

SessionConfig SessionConfig::from_params(const kvs_session_params* p) {
  if (!p) invalid("params: expected a kvs_session_params, got NULL");
  // Fields are appended over versions: a caller built against 0.1.0's header passes its smaller
  // struct, and the fields it does not know keep their defaults.
  constexpr size_t kFirstSize = offsetof(kvs_session_params, lse_base);
  if (p->struct_size < kFirstSize)
    invalid("params->struct_size: expected >= " + std::to_string(kFirstSize) +
            " (fill with kvs_session_params_init), got " + std::to_string(p->struct_size));
  kvs_session_params full;
  kvs_session_params_init(&full);
  std::memcpy(&full, p, std::min<size_t>(p->struct_size, sizeof full));
  full.struct_size = sizeof full;
  p = &full;
  SessionConfig c;
  auto& s = c.shape;
  if (p->num_layers < 1 || p->num_layers > kMaxLayers)
    invalid("params->num_layers: expected 1.." + std::to_string(kMaxLayers) + ", got " + std::to_string(p->num_layers));
  if (p->num_kv_heads < 1 || p->num_kv_heads > kMaxKvHeads)
    invalid("params->num_kv_heads: expected 1.." + std::to_string(kMaxKvHeads) + ", got " + std::to_string(p->num_kv_heads));
  if (p->num_q_heads < 1 || p->num_q_heads % p->num_kv_heads != 0 || p->num_q_heads > kMaxQHeads)
    invalid("params->num_q_heads: expected a positive multiple of num_kv_heads (" +
            std::to_string(p->num_kv_heads) + ") up to " + std::to_string(kMaxQHeads) + ", got " +
            std::to_string(p->num_q_heads));
  if (p->head_dim < kMinHeadDim || p->head_dim > kMaxHeadDim)
    invalid("params->head_dim: expected " + std::to_string(kMinHeadDim) + ".." + std::to_string(kMaxHeadDim) +
            ", got " + std::to_string(p->head_dim));
  if (!(p->softmax_scale >= 0.f) || std::isinf(p->softmax_scale))
    invalid("params->softmax_scale: expected 0 (= 1/sqrt(head_dim)) or a positive finite number");
  if (p->kv_dtype != KVS_SCALAR_F32 && p->kv_dtype != KVS_SCALAR_F16 && p->kv_dtype != KVS_SCALAR_BF16)
    invalid("params->kv_dtype: expected KVS_SCALAR_F32 (1), KVS_SCALAR_F16 (2) or KVS_SCALAR_BF16 (3), got " +
            std::to_string(p->kv_dtype));
  if (p->backend != KVS_BACKEND_CPU && p->backend != KVS_BACKEND_CUDA && p->backend != KVS_BACKEND_HYBRID)
    invalid("params->backend: expected KVS_BACKEND_CPU (1), KVS_BACKEND_CUDA (2) or KVS_BACKEND_HYBRID (3), got " +
            std::to_string(p->backend));
  if (p->num_threads > kMaxThreads)
    invalid("params->num_threads: expected 0.." + std::to_string(kMaxThreads) + ", got " + std::to_string(p->num_threads));
  check_kv_memory(p->kv_memory, "params->kv_memory");
  if (!(p->budget >= 0.0 && p->budget <= 1.0))
    invalid("params->budget: expected a fraction in (0, 1] or 0 (unset), got " + std::to_string(p->budget));
  if (p->budget_tokens < 0) invalid("params->budget_tokens: expected >= 0, got " + std::to_string(p->budget_tokens));
  if (p->lse_base != KVS_LSE_BASE_E && p->lse_base != KVS_LSE_BASE_2)
    invalid("params->lse_base: expected KVS_LSE_BASE_E (0) or KVS_LSE_BASE_2 (1), got " + std::to_string(p->lse_base));
  if (p->max_rollback < 0 || p->max_rollback > kMaxRollback)
    invalid("params->max_rollback: expected 0.." + std::to_string(kMaxRollback) + " tokens, got " +
            std::to_string(p->max_rollback));
  if (p->kv_source != KVS_KV_OWNED && p->kv_source != KVS_KV_CALLER)
    invalid("params->kv_source: expected KVS_KV_OWNED (0) or KVS_KV_CALLER (1), got " + std::to_string(p->kv_source));
  if (p->kv_source == KVS_KV_CALLER && p->kv_memory != 0)
    invalid("params->kv_memory: expected 0 with kv_source = KVS_KV_CALLER (the caller's cache is where it is), got " +
            std::to_string(p->kv_memory));
  s.num_layers = p->num_layers;
  s.num_q_heads = p->num_q_heads;
  s.num_kv_heads = p->num_kv_heads;
  s.head_dim = p->head_dim;
  s.softmax_scale = p->softmax_scale > 0 ? p->softmax_scale : 1.0f / std::sqrt(float(p->head_dim));
  s.kv_dtype = DType(p->kv_dtype);
  c.backend = p->backend;
  c.device_id = p->device_id;
  c.kv_memory = p->kv_memory;
  c.kv_source = p->kv_source;
  c.num_threads = p->num_threads;
  cpu::resolve_gemm(p->gemm);  // validates
  c.gemm = p->gemm;
  c.method = p->method ? p->method : "full";
  c.method_params = p->method_params ? p->method_params : "";
  c.budget.fraction = p->budget;
  c.budget.tokens = p->budget_tokens;
  c.lse_base = p->lse_base;
  c.max_rollback = p->max_rollback;
  return c;
}

// ---------------------------------------------------------------------------------------------
// Construction

Session::Session(const SessionConfig& cfg, std::shared_ptr<ThreadPool> pool) : cfg_(cfg) {
  spec_ = find_method(cfg_.method);
  if (!spec_) {
    std::string names;
    for (auto& m : method_registry()) names += (names.empty() ? "" : ", ") + std::string(m.name);
    invalid("params->method: unknown method '" + cfg_.method + "' (available: " + names + ")");
  }
  ParamSet ps = ParamSet::parse(cfg_.method, spec_->params, cfg_.method_params.c_str());
  cfg_.method_params = ps.to_text();  // normalised, defaults included
  pool_ = pool ? std::move(pool) : ThreadPool::shared(cfg_.num_threads);
  placement_ = make_placement(cfg_, *spec_, ps, pool_);
  if (cfg_.lse_base == KVS_LSE_BASE_2 && !placement_->lse_base2())
    fail(KVS_STATUS_UNSUPPORTED, std::string("params->lse_base: KVS_LSE_BASE_2 is not supported on the ") +
                                     placement_->ops().name() + " backend yet (use KVS_LSE_BASE_E and divide by ln 2)");
  built_.assign(cfg_.shape.num_layers, 0);
  expected_len_.assign(cfg_.shape.num_layers, -1);
  logf(LogLevel::Debug, "session: method %s (%s), backend %s, %u layers, %u/%u heads, d %u, kv %s, %u threads",
       cfg_.method.c_str(), cfg_.method_params.c_str(), placement_->ops().name(), cfg_.shape.num_layers,
       cfg_.shape.num_q_heads, cfg_.shape.num_kv_heads, cfg_.shape.head_dim, dtype_name(cfg_.shape.kv_dtype),
       pool_->size());
}

Session::Session(const SessionConfig& cfg, std::shared_ptr<ThreadPool> pool, std::unique_ptr<Placement> placement)
    : cfg_(cfg), spec_(find_method(cfg.method)), pool_(std::move(pool)), placement_(std::move(placement)) {
  built_.assign(cfg_.shape.num_layers, 0);
  expected_len_.assign(cfg_.shape.num_layers, -1);
}

Session::~Session() = default;

// ---------------------------------------------------------------------------------------------
// Checks

void Session::check_layer(uint32_t layer, const char* fn) const {
  if (layer >= cfg_.shape.num_layers)
    invalid(std::string(fn) + ": layer: expected 0.." + std::to_string(cfg_.shape.num_layers - 1) + ", got " + L(layer));
}

void Session::check_decodable(uint32_t layer, const char* fn) const {
  check_layer(layer, fn);
  if (placement_->tokens(layer) == 0)
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(layer) + " has no tokens: call kvs_session_prefill first");
  if (expected_len_[layer] >= 0)
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(layer) + " was loaded without KV: prefill its " +
                                       std::to_string(expected_len_[layer]) + " saved tokens first");
  if (!built_[layer])
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(layer) + " has no index: call kvs_session_build_index after prefill");
}

// ---------------------------------------------------------------------------------------------
// Prefill, build, append

void Session::prefill(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                      const kvs_tensor* o, void* stream) {
  check_layer(layer, "kvs_session_prefill");
  if (expected_len_[layer] < 0 && built_[layer])
    fail(KVS_STATUS_INVALID_STATE, "kvs_session_prefill: layer " + L(layer) + " is already indexed (" +
                                       std::to_string(placement_->tokens(layer)) + " tokens); use kvs_session_append for more");
  check_caller_kv(layer, placement_->tokens(layer) + rows(q), k, v, "kvs_session_prefill", "k", "v");
  // After a tables-only load the chunks must add up to exactly the saved length.
  placement_->add_tokens(layer, q, k, v, o, "kvs_session_prefill", /*prompt=*/true,
                         expected_len_[layer] >= 0 ? expected_len_[layer] : kMaxLayerTokens, stream);
  // A tables-only load is complete once the chunks reach the saved length; its index stays valid.
  if (expected_len_[layer] >= 0 && placement_->tokens(layer) == expected_len_[layer]) expected_len_[layer] = -1;
}

void Session::build_index(void* stream) {
  bool any = false;
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) {
    if (placement_->tokens(l) == 0 || expected_len_[l] >= 0) continue;
    any = true;
    if (built_[l]) continue;
    placement_->build_index(l, stream);
    built_[l] = 1;
  }
  if (!any) fail(KVS_STATUS_INVALID_STATE, "kvs_session_build_index: no layer has been prefilled (call kvs_session_prefill first)");
  kvs_session_stats st{};
  placement_->stats(st);
  logf(LogLevel::Info, "%s: index built (%llu bytes)", cfg_.method.c_str(), (unsigned long long)st.index_bytes);
}

void Session::append(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                     const kvs_tensor* o, void* stream) {
  check_decodable(layer, "kvs_session_append");
  check_caller_kv(layer, placement_->tokens(layer) + rows(q), k, v, "kvs_session_append", "k", "v");
  placement_->add_tokens(layer, q, k, v, o, "kvs_session_append", /*prompt=*/false, kMaxLayerTokens, stream);
}

// ---------------------------------------------------------------------------------------------
// A KV cache the caller owns

void Session::bind_kv(uint32_t layer, const kvs_paged_kv* kv, void* stream) {
  const char* fn = "kvs_session_bind_kv";
  check_layer(layer, fn);
  if (cfg_.kv_source != KVS_KV_CALLER)
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": this session stores its own KV (kv_source = KVS_KV_OWNED); "
                                   "create it with kv_source = KVS_KV_CALLER to attend a cache the caller owns");
  if (!kv) invalid(std::string(fn) + ": kv: expected a kvs_paged_kv, got NULL");
  constexpr size_t kFirstSize = sizeof(kvs_paged_kv);
  if (kv->struct_size < kFirstSize)
    invalid(std::string(fn) + ": kv->struct_size: expected >= " + std::to_string(kFirstSize) +
            " (fill with kvs_paged_kv_init), got " + std::to_string(kv->struct_size));
  if (!kv->pages) invalid(std::string(fn) + ": kv->pages: expected the page pool, got NULL");
  if (reinterpret_cast<uintptr_t>(kv->pages) % 16 != 0)
    invalid(std::string(fn) + ": kv->pages: expected a 16-byte aligned address");
  if (kv->layout != KVS_KV_LAYOUT_HND && kv->layout != KVS_KV_LAYOUT_NHD)
    invalid(std::string(fn) + ": kv->layout: expected KVS_KV_LAYOUT_HND (0) or KVS_KV_LAYOUT_NHD (1), got " +
            std::to_string(kv->layout));
  if (kv->reserved0 != 0)
    invalid(std::string(fn) + ": kv->reserved0: expected 0 (fill with kvs_paged_kv_init), got " +
            std::to_string(kv->reserved0));
  if (kv->v_pages && reinterpret_cast<uintptr_t>(kv->v_pages) % 16 != 0)
    invalid(std::string(fn) + ": kv->v_pages: expected a 16-byte aligned address");
  if (kv->num_pages < 1 || kv->num_pages > (int64_t(1) << 31) - 1)
    invalid(std::string(fn) + ": kv->num_pages: expected 1..2^31-1, got " + std::to_string(kv->num_pages));
  const int32_t P = kv->page_size;
  if (P < 1 || (P & (P - 1)) != 0 || P > 1024)
    invalid(std::string(fn) + ": kv->page_size: expected a power of two up to 1024, got " + std::to_string(P));
  const int64_t have = placement_->tokens(layer);
  if (kv->num_tokens < have || kv->num_tokens > kMaxLayerTokens)
    invalid(std::string(fn) + ": kv->num_tokens: expected " + std::to_string(have) + ".." +
            std::to_string(kMaxLayerTokens) + " (layer " + L(layer) + " holds " + std::to_string(have) +
            " tokens), got " + std::to_string(kv->num_tokens));
  // Bytes of one page of each pool: K and V together, or one of them (v_pages).
  const bool split = kv->v_pages != nullptr, nhd = kv->layout == KVS_KV_LAYOUT_NHD;
  const uint64_t page_bytes = uint64_t(split ? 1 : 2) * cfg_.shape.num_kv_heads * uint64_t(P) *
                              cfg_.shape.head_dim * dtype_size(cfg_.shape.kv_dtype);
  const std::string hs = std::to_string(cfg_.shape.num_kv_heads), ps = std::to_string(P);
  const std::string page_shape = std::string(split ? "" : "[2]") + (nhd ? "[" + ps + "][" + hs + "]" : "[" + hs + "][" + ps + "]") +
                                 "[" + std::to_string(cfg_.shape.head_dim) + "] " + dtype_name(cfg_.shape.kv_dtype);
  if (!split && kv->v_pool_bytes != 0)
    invalid(std::string(fn) + ": kv->v_pool_bytes: expected 0 without kv->v_pages, got " +
            std::to_string(kv->v_pool_bytes));
  for (auto [bytes, name] : {std::pair{kv->pool_bytes, "kv->pool_bytes"}, std::pair{split ? kv->v_pool_bytes : 0, "kv->v_pool_bytes"}})
    if (bytes != 0 && uint64_t(kv->num_pages) > bytes / page_bytes)
      invalid(std::string(fn) + ": kv->num_pages: " + std::to_string(kv->num_pages) + " pages of " +
              std::to_string(page_bytes) + " bytes (" + page_shape + ") do not fit in " + name + " = " +
              std::to_string(bytes));
  if (split) {  // two pools of num_pages pages each: apart, or a page of one would be read as the other's
    const uint64_t span = uint64_t(kv->num_pages) * page_bytes;
    const auto k0 = reinterpret_cast<uintptr_t>(kv->pages), v0 = reinterpret_cast<uintptr_t>(kv->v_pages);
    if ((k0 < v0 ? v0 - k0 : k0 - v0) < span)
      invalid(std::string(fn) + ": kv->v_pages: the V pool overlaps the K pool (" + std::to_string(kv->num_pages) +
              " pages of " + std::to_string(page_bytes) + " bytes each, " + page_shape +
              "); for K and V in one tensor [num_pages][2]..., pass it as kv->pages with kv->v_pages NULL");
  }
  const int64_t need = (kv->num_tokens + P - 1) / P;
  if (kv->num_page_indices < need || kv->num_page_indices > kMaxLayerTokens)
    invalid(std::string(fn) + ": kv->num_page_indices: expected at least " + std::to_string(need) + " (" +
            std::to_string(kv->num_tokens) + " tokens in pages of " + std::to_string(P) + "), got " +
            std::to_string(kv->num_page_indices));
  if (need > 0 && !kv->page_indices) invalid(std::string(fn) + ": kv->page_indices: expected the sequence's pages, got NULL");
  // Entries equal to the layer's last binding (same pool) were checked then: only the rest is.
  if (bound_.size() != cfg_.shape.num_layers) bound_.resize(cfg_.shape.num_layers);
  Bound& last = bound_[layer];
  const std::span<const int32_t> ids(kv->page_indices, size_t(need));
  size_t same = 0;
  if (last.pool == kv->pages && last.v_pool == kv->v_pages && last.layout == kv->layout &&
      last.num_pages == kv->num_pages && last.page_size == P) {
    // memcmp by blocks (vectorised; std::mismatch compares one int at a time: 1 ns a page on an
    // H100 host, 30 us for a 512K context in pages of 16), then the first differing block by entry.
    const size_t m = std::min(last.ids.size(), ids.size());
    constexpr size_t kBlock = 1024;
    while (same < m) {
      const size_t len = std::min(kBlock, m - same);
      if (std::memcmp(ids.data() + same, last.ids.data() + same, len * sizeof(int32_t)) == 0) {
        same += len;
        continue;
      }
      while (ids[same] == last.ids[same]) ++same;
      break;
    }
  }
  for (size_t i = same; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= kv->num_pages)
      invalid(std::string(fn) + ": kv->page_indices[" + std::to_string(i) + "]: expected 0.." +
              std::to_string(kv->num_pages - 1) + ", got " + std::to_string(ids[i]));
  placement_->bind_kv(layer, BoundKv{kv->pages, kv->v_pages, nhd, size_t(page_bytes), kv->num_pages, P, ids,
                                     kv->num_tokens, same},
                      fn, stream);
  last.pool = kv->pages;
  last.v_pool = kv->v_pages;
  last.layout = kv->layout;
  last.num_pages = kv->num_pages;
  last.page_size = P;
  last.tokens = kv->num_tokens;
  last.ids.resize(ids.size());
  std::copy(ids.begin() + std::ptrdiff_t(same), ids.end(), last.ids.begin() + std::ptrdiff_t(same));
}

// kv_source = KVS_KV_CALLER, before a call that counts the layer's tokens up to `tokens`: no K/V
// tensors (the tokens are in the caller's cache), and the binding holds them. Owned sessions: nothing.
void Session::check_caller_kv(uint32_t layer, int64_t tokens, const kvs_tensor* k, const kvs_tensor* v,
                              const std::string& fn, const char* kn, const char* vn) const {
  if (cfg_.kv_source != KVS_KV_CALLER) return;
  if (k || v)
    invalid(fn + ": " + (k ? kn : vn) + ": expected NULL: the session attends the caller's KV cache "
            "(kv_source = KVS_KV_CALLER); write the tokens there and call kvs_session_bind_kv");
  const int64_t have = layer < bound_.size() ? bound_[layer].tokens : 0;
  if (have < tokens)
    fail(KVS_STATUS_INVALID_STATE, fn + ": layer " + L(layer) + " needs " + std::to_string(tokens) +
                                       " tokens in the caller's KV cache, its binding has " + std::to_string(have) +
                                       ": call kvs_session_bind_kv first");
}

// ---------------------------------------------------------------------------------------------
// Rollback

void Session::truncate(int64_t n) {
  const char* fn = "kvs_session_truncate";
  int64_t longest = 0;
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) longest = std::max(longest, placement_->tokens(l));
  if (n < 0 || n > longest)
    invalid(std::string(fn) + ": num_tokens: expected 0.." + std::to_string(longest) +
            " (the tokens of the longest layer), got " + std::to_string(n));
  bool any = false;
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) {
    const int64_t t = placement_->tokens(l);
    if (t <= n) continue;
    any = true;
    if (expected_len_[l] >= 0)
      fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(l) + " was loaded without KV: prefill its " +
                                         std::to_string(expected_len_[l]) + " saved tokens before truncating");
    std::string why;
    const int64_t floor = placement_->truncate_floor(l, &why);
    if (floor < 0) fail(KVS_STATUS_UNSUPPORTED, std::string(fn) + ": " + why);
    if (n < floor)
      invalid(std::string(fn) + ": num_tokens: expected " + std::to_string(floor) + ".." + std::to_string(longest) +
              " (layer " + L(l) + " can go back to " + std::to_string(floor) + " tokens: " + why + "), got " +
              std::to_string(n));
  }
  if (!any) return;
  placement_->truncate(n);
  // An emptied layer starts again: prefill, then build its index.
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l)
    if (placement_->tokens(l) == 0) built_[l] = 0;
}

// ---------------------------------------------------------------------------------------------
// Decode

void Session::decode(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                     const kvs_tensor* o, const kvs_tensor* lse, void* stream) {
  Session* self = this;
  decode_batch(&self, 1, layer, q, k, v, o, lse, stream, /*single=*/true);
}

namespace {
// Row i of a tensor [n, ...] as a tensor of one rank less (the same memory: byte_offset moves).
struct RowView {
  kvs_tensor t{};
  int64_t shape[4]{}, strides[4]{};
  RowView(const kvs_tensor* src, int64_t i) {
    t = *src;
    t.ndim = src->ndim - 1;
    int64_t inner = 1;
    for (int a = src->ndim - 1; a >= 1; --a) {
      shape[a - 1] = src->shape[a];
      strides[a - 1] = src->strides ? src->strides[a] : inner;
      inner *= src->shape[a];
    }
    const int64_t s0 = src->strides ? src->strides[0] : inner;
    t.shape = shape;
    t.strides = src->strides ? strides : nullptr;
    t.byte_offset = src->byte_offset + uint64_t(i * s0 * int64_t(src->dtype.bits / 8));
  }
};
// A [n, ...] tensor of rank `rank` (null when `optional` and absent); returns n.
int64_t rows_of(const kvs_tensor* t, const char* name, int rank, bool optional, const char* fn) {
  if (!t) {
    if (optional) return -1;
    invalid(std::string(fn) + ": " + name + ": expected a tensor, got NULL");
  }
  if (t->ndim != rank || !t->shape)
    invalid(std::string(fn) + ": " + name + ": expected " + std::to_string(rank) + " dimensions [n, ...], got " +
            std::to_string(t->ndim));
  if (t->dtype.bits % 8 != 0 || t->dtype.bits == 0)
    invalid(std::string(fn) + ": " + name + ": expected a dtype of whole bytes");
  // Rows are views one row stride apart: it must not be negative, and the rows must not overlap
  // (each row's own layout is checked by the step).
  if (t->strides && t->shape[0] > 1) {
    int64_t span = 1;
    for (int a = 1; a < rank; ++a) span += (t->shape[a] - 1) * (t->strides[a] < 0 ? -t->strides[a] : t->strides[a]);
    if (t->strides[0] < span)
      invalid(std::string(fn) + ": " + name + ": expected rows that do not overlap (strides[0] >= " +
              std::to_string(span) + "), got strides[0] = " + std::to_string(t->strides[0]));
  }
  return t->shape[0];
}
}  // namespace

void Session::decode_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                            const kvs_tensor* o, const kvs_tensor* lse, void* stream) {
  const char* fn = "kvs_session_decode_tokens";
  check_decodable(layer, fn);
  const int64_t n = rows_of(q, "q", 3, false, fn);
  if (n < 1 || n > 65536) invalid(std::string(fn) + ": q: expected 1..65536 rows, got " + std::to_string(n));
  const bool ext = cfg_.kv_source == KVS_KV_CALLER;
  for (auto [t, name, rank, opt] : {std::tuple{k, "k_new", 3, ext}, std::tuple{v, "v_new", 3, ext},
                                    std::tuple{o, "o", 3, false}, std::tuple{lse, "lse", 2, true}}) {
    const int64_t m = rows_of(t, name, rank, opt, fn);
    if (m >= 0 && m != n)
      invalid(std::string(fn) + ": " + name + ": expected " + std::to_string(n) + " rows (as q), got " + std::to_string(m));
  }
  if (placement_->tokens(layer) > kMaxLayerTokens - n)
    invalid(std::string(fn) + ": q: layer " + L(layer) + " cannot hold " + std::to_string(n) + " more tokens");
  const int64_t n0 = placement_->tokens(layer);
  check_caller_kv(layer, n0 + n, k, v, fn, "k_new", "v_new");
  for (int64_t i = 0; i < n; ++i) {
    const RowView qi(q, i), oi(o, i);
    std::optional<RowView> ki, vi, li;
    if (k) ki.emplace(k, i);
    if (v) vi.emplace(v, i);
    if (lse) li.emplace(lse, i);
    try {
      decode(layer, &qi.t, ki ? &ki->t : nullptr, vi ? &vi->t : nullptr, &oi.t, li ? &li->t : nullptr, stream);
    } catch (const Error& e) {
      // The message names this call and the row: "kvs_session_decode: q: ..." -> "...: row 3: q: ...".
      std::string m = e.what();
      const std::string one = "kvs_session_decode: ";
      if (m.rfind(one, 0) == 0) m = m.substr(one.size());
      m = std::string(fn) + ": row " + std::to_string(i) + ": " + m;
      if (i > 0)
        m += " (rows 0.." + std::to_string(i - 1) + " were decoded: layer " + L(layer) + " holds " +
             std::to_string(n0 + i) + " tokens; kvs_session_truncate drops them)";
      throw Error(e.code(), m, e.backend_code());
    }
  }
}

void Session::check_batch(Session* const* sessions, size_t count, uint32_t layer, const char* fn, bool single) {
  if (!sessions) invalid(std::string(fn) + ": sessions: expected an array, got NULL");
  if (count == 0 || count > 65536 || (single && count != 1))
    invalid(std::string(fn) + ": count: expected 1..65536, got " + std::to_string(count));
  if (!sessions[0]) invalid(std::string(fn) + ": sessions[0] is NULL");
  check_compatible(sessions, count, fn);
  for (size_t b = 0; b < count; ++b) sessions[b]->check_decodable(layer, fn);
}

void Session::check_compatible(Session* const* sessions, size_t count, const char* fn) {
  const Session& s0 = *sessions[0];
  for (size_t b = 0; b < count; ++b) {
    if (!sessions[b]) invalid(std::string(fn) + ": sessions[" + std::to_string(b) + "] is NULL");
    const Session& sb = *sessions[b];
    const auto &a = sb.cfg_.shape, &z = s0.cfg_.shape;
    if (a.num_q_heads != z.num_q_heads || a.num_kv_heads != z.num_kv_heads || a.head_dim != z.head_dim ||
        a.num_layers != z.num_layers || a.kv_dtype != z.kv_dtype || a.softmax_scale != z.softmax_scale ||
        sb.cfg_.backend != s0.cfg_.backend || sb.cfg_.method != s0.cfg_.method || sb.cfg_.kv_source != s0.cfg_.kv_source ||
        (sb.cfg_.backend != KVS_BACKEND_CPU && sb.cfg_.device_id != s0.cfg_.device_id))
      invalid(std::string(fn) + ": sessions[" + std::to_string(b) +
              "]: expected the shape, dtype, softmax scale, method, backend, device and kv_source of sessions[0]");
    for (size_t c = 0; c < b; ++c)
      if (sessions[c] == sessions[b]) invalid(std::string(fn) + ": sessions[" + std::to_string(b) + "] appears twice");
  }
}

void Session::note_step(const StepReport& r) {
  if (r.deferred) return;  // counted once settled (settle_steps)
  Settled s;
  s.add(r);
  add_steps(s);
}

void Session::settle_steps() const {
  const Settled s = placement_->settled_reports();
  if (s.steps > 0) add_steps(s);
}

void Session::add_steps(const Settled& s) const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  decode_steps_ += s.steps;
  sum_selected_ += s.sum_selected;
  last_selected_ = s.last.selected;
  last_fraction_ = s.last.tokens > 0 ? s.last.selected / double(s.last.tokens) : 0.0;
}

void Session::run_step(Session* const* sessions, size_t count, uint32_t layer, const StepTensors& t) {
  for (size_t b = 0; b < count; ++b)  // (the sessions of a batch share kv_source: check_compatible)
    sessions[b]->check_caller_kv(layer, sessions[b]->placement_->tokens(layer) + 1, t.k_new, t.v_new,
                                 count > 1 ? std::string(t.fn) + ": sessions[" + std::to_string(b) + "]" : t.fn,
                                 "k_new", "v_new");
  std::vector<Placement*> ps(count);
  for (size_t b = 0; b < count; ++b) ps[b] = sessions[b]->placement_.get();
  std::vector<StepReport> reports(count);
  ps[0]->decode(ps, layer, t, reports);
  for (size_t b = 0; b < count; ++b) sessions[b]->note_step(reports[b]);
}

void Session::decode_batch(Session* const* sessions, size_t count, uint32_t layer, const kvs_tensor* q,
                           const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                           const kvs_tensor* lse, void* stream, bool single) {
  // decode() is decode_batch with B = 1 and rank-2 tensors (single); decode_batch proper has rank 3.
  const char* fn = single ? "kvs_session_decode" : "kvs_decode_batch";
  check_batch(sessions, count, layer, fn, single);
  run_step(sessions, count, layer, StepTensors{q, k, v, o, lse, stream, single, fn});
}

// ---------------------------------------------------------------------------------------------
// Inspection

void Session::stats(kvs_session_stats* out) const {
  if (!out) invalid("kvs_session_get_stats: out: expected a kvs_session_stats, got NULL");
  if (out->struct_size < sizeof(kvs_session_stats))
    invalid("kvs_session_get_stats: out->struct_size: expected >= " + std::to_string(sizeof(kvs_session_stats)) +
            ", got " + std::to_string(out->struct_size));
  kvs_session_stats st{};
  st.struct_size = sizeof(st);
  settle_steps();
  std::lock_guard<std::mutex> lock(stats_mu_);
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) st.tokens = std::max(st.tokens, placement_->tokens(l));
  st.decode_steps = decode_steps_;
  placement_->stats(st);
  st.last_selected_keys = last_selected_;
  st.mean_selected_keys = decode_steps_ ? sum_selected_ / double(decode_steps_) : 0.0;
  st.last_selected_fraction = last_fraction_;
  std::memcpy(out, &st, sizeof(st));
}

int64_t Session::layer_tokens(uint32_t layer) const {
  check_layer(layer, "kvs_session_layer_tokens");
  return placement_->tokens(layer);
}

std::vector<int32_t> Session::last_selection(uint32_t layer, uint32_t kv_head) const {
  check_layer(layer, "kvs_session_last_selection");
  if (kv_head >= cfg_.shape.num_kv_heads)
    invalid("kvs_session_last_selection: kv_head: expected 0.." + std::to_string(cfg_.shape.num_kv_heads - 1) +
            ", got " + std::to_string(kv_head));
  return placement_->last_selection(layer, kv_head);
}

double Session::method_stat(const std::string& name) const {
  double v = 0;
  if (!placement_->stat(name, &v))
    invalid("kvs_session_method_stat: name: method '" + cfg_.method + "' has no statistic '" + name + "' on the " +
            placement_->ops().name() + " backend");
  return v;
}

// ---------------------------------------------------------------------------------------------
// Save, load, fork

static nlohmann::json shape_json(const ModelShape& s) {
  return {{"num_layers", s.num_layers}, {"num_q_heads", s.num_q_heads}, {"num_kv_heads", s.num_kv_heads},
          {"head_dim", s.head_dim}, {"softmax_scale", s.softmax_scale}, {"kv_dtype", dtype_name(s.kv_dtype)},
          {"kv_page_tokens", kPageTokens}};
}

void Session::save(const std::string& path, uint32_t flags) const {
  if (flags & ~uint32_t(KVS_SAVE_INCLUDE_KV))
    invalid("kvs_session_save: flags: expected KVS_SAVE_TABLES (0) or KVS_SAVE_INCLUDE_KV (1), got " + std::to_string(flags));
  tables_writer(flags & KVS_SAVE_INCLUDE_KV, "kvs_session_save")->write_atomic(path);
}

std::unique_ptr<io::TablesWriter> Session::tables_writer(bool with_kv, const char* fn) const {
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l)
    if (expected_len_[l] >= 0 && with_kv)
      fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(l) +
                                         " was loaded without KV and not prefilled again; save with KVS_SAVE_TABLES or prefill it first");
  nlohmann::json h;
  h["format"] = "kvsieve-tables";
  h["library_version"] = kvs_version();
  h["shape"] = shape_json(cfg_.shape);
  h["method"] = {{"name", cfg_.method},
                 {"params", ParamSet::parse(cfg_.method, spec_->params, cfg_.method_params.c_str()).to_json()}};
  h["budget"] = {{"fraction", cfg_.budget.fraction}, {"tokens", cfg_.budget.tokens}};
  h["backend"] = cfg_.backend;
  h["flags"] = {{"kv_included", with_kv}};
  nlohmann::json layers = nlohmann::json::array();
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l)
    layers.push_back({{"tokens", expected_len_[l] >= 0 ? expected_len_[l] : placement_->tokens(l)},
                      {"index_built", bool(built_[l])}});
  h["layers"] = layers;
  h["method"]["meta"] = placement_->save_meta();
  auto w = std::make_unique<io::TablesWriter>(h);
  placement_->save(*w, with_kv);
  return w;
}

std::unique_ptr<Session> Session::to(int32_t backend, int32_t device_id) const {
  if (backend != KVS_BACKEND_CPU && backend != KVS_BACKEND_CUDA && backend != KVS_BACKEND_HYBRID)
    invalid("kvs_session_to: backend: expected KVS_BACKEND_CPU (1), KVS_BACKEND_CUDA (2) or KVS_BACKEND_HYBRID (3), got " +
            std::to_string(backend));
  if (device_id < 0) invalid("kvs_session_to: device_id: expected >= 0, got " + std::to_string(device_id));
  if (cfg_.kv_source == KVS_KV_CALLER)
    fail(KVS_STATUS_UNSUPPORTED, "kvs_session_to: the session attends the caller's KV cache (kv_source = "
                                 "KVS_KV_CALLER), which does not move with it; create a session with kv_source = "
                                 "KVS_KV_CALLER on the other backend and bind that backend's cache");
  // The KV of every layer goes along (a layer loaded without KV and not prefilled again cannot move).
  const auto image = tables_writer(true, "kvs_session_to")->write_memory();
  auto file = io::TablesFile::open_memory(image, "(session state in memory)");
  kvs_load_params lp;
  kvs_load_params_init(&lp);
  lp.backend = backend;
  lp.device_id = device_id;
  lp.num_threads = cfg_.num_threads;
  lp.gemm = cfg_.gemm;
  lp.flags = KVS_LOAD_MMAP;  // cpu: the pages stay in the image (one copy in all); cuda copies them up
  auto s = load_from(file, lp, "kvs_session_to", &cfg_);
  settle_steps();
  std::lock_guard<std::mutex> lock(stats_mu_);
  s->decode_steps_ = decode_steps_;
  s->sum_selected_ = sum_selected_;
  s->last_selected_ = last_selected_;
  s->last_fraction_ = last_fraction_;
  return s;
}

std::unique_ptr<Session> Session::load(const std::string& path, const kvs_load_params* params) {
  // The caller's parameters. Fields are appended to kvs_load_params over versions: a caller built
  // against an older header passes its smaller struct_size, and the fields it does not know keep
  // their defaults (flags = 0: copy).
  kvs_load_params lp;
  kvs_load_params_init(&lp);
  if (params) {
    constexpr size_t kFirstSize = offsetof(kvs_load_params, flags);  // 0.1.0's struct
    if (params->struct_size < kFirstSize)
      invalid("kvs_session_load: params->struct_size: expected >= " + std::to_string(kFirstSize) +
              " (fill with kvs_load_params_init), got " + std::to_string(params->struct_size));
    std::memcpy(&lp, params, std::min<size_t>(params->struct_size, sizeof lp));
    lp.struct_size = sizeof lp;
  }
  if (lp.backend != 0 && lp.backend != KVS_BACKEND_CPU && lp.backend != KVS_BACKEND_CUDA &&
      lp.backend != KVS_BACKEND_HYBRID)
    invalid("kvs_session_load: params->backend: expected 0 (as saved), KVS_BACKEND_CPU (1), KVS_BACKEND_CUDA (2) or "
            "KVS_BACKEND_HYBRID (3), got " + std::to_string(lp.backend));
  if (lp.num_threads > kMaxThreads)
    invalid("kvs_session_load: params->num_threads: expected 0.." + std::to_string(kMaxThreads) + ", got " +
            std::to_string(lp.num_threads));
  check_kv_memory(lp.kv_memory, "kvs_session_load: params->kv_memory");
  // (a hybrid backend with kv_source = KVS_KV_CALLER is refused where every session's is: make_placement)
  if (lp.kv_source != KVS_KV_OWNED && lp.kv_source != KVS_KV_CALLER)
    invalid("kvs_session_load: params->kv_source: expected KVS_KV_OWNED (0) or KVS_KV_CALLER (1), got " +
            std::to_string(lp.kv_source));
  if (lp.kv_source == KVS_KV_CALLER && lp.kv_memory != 0)
    invalid("kvs_session_load: params->kv_memory: expected 0 with kv_source = KVS_KV_CALLER (the caller's cache is "
            "where it is), got " + std::to_string(lp.kv_memory));
  if (lp.flags & ~uint32_t(KVS_LOAD_MMAP))
    invalid("kvs_session_load: params->flags: expected 0 or KVS_LOAD_MMAP (1), got " + std::to_string(lp.flags));
  (void)cpu::resolve_gemm(lp.gemm);  // validates lp.gemm and KVS_GEMM
  return load_from(io::TablesFile::open(path), lp, path);
}

std::unique_ptr<Session> Session::load_from(const std::shared_ptr<const io::TablesFile>& file,
                                            const kvs_load_params& lp, const std::string& path,
                                            const SessionConfig* runtime) {
  const int32_t gemm = int32_t(cpu::resolve_gemm(lp.gemm));
  // The file. Everything below that is wrong is the file's fault: KVS_STATUS_FORMAT_INVALID naming
  // the file and the header field. Every number is range-checked at the type it lands in
  // (io::HeaderReader) before it is converted.
  const auto& h = file->header();
  const io::HeaderReader hr(path);
  auto bad = [&](const std::string& what) { fail(KVS_STATUS_FORMAT_INVALID, hr.where() + "header: " + what); };
  try {
    if (const std::string f = hr.string(h, "format"); f != "kvsieve-tables")
      hr.fail("format", "expected \"kvsieve-tables\", got " + io::HeaderReader::show(f));
    const auto& sh = hr.object(h, "shape");
    const auto hs = hr.sub("shape");
    kvs_session_params p;
    kvs_session_params_init(&p);
    p.num_layers = hs.integer<uint32_t>(sh, "num_layers", 1, kMaxLayers);
    p.num_q_heads = hs.integer<uint32_t>(sh, "num_q_heads", 1, kMaxQHeads);
    p.num_kv_heads = hs.integer<uint32_t>(sh, "num_kv_heads", 1, kMaxKvHeads);
    p.head_dim = hs.integer<uint32_t>(sh, "head_dim", kMinHeadDim, kMaxHeadDim);
    p.softmax_scale = float(hs.number(sh, "softmax_scale", 0.0, double(std::numeric_limits<float>::max())));
    const std::string dt = hs.string(sh, "kv_dtype");
    p.kv_dtype = dt == "f32" ? KVS_SCALAR_F32 : dt == "f16" ? KVS_SCALAR_F16 : dt == "bf16" ? KVS_SCALAR_BF16 : 0;
    if (!p.kv_dtype) hs.fail("kv_dtype", "expected \"f32\", \"f16\" or \"bf16\", got " + io::HeaderReader::show(dt));
    if (const int64_t pt = hs.integer<int64_t>(sh, "kv_page_tokens", 1, kMaxLayerTokens); pt != kPageTokens)
      hs.fail("kv_page_tokens", "expected " + std::to_string(kPageTokens) + " (this library's KV page), got " +
                                    std::to_string(pt));
    const auto& mh = hr.object(h, "method");
    const auto hm = hr.sub("method");
    const std::string method = hm.string(mh, "name");
    const MethodSpec* spec = find_method(method);
    if (!spec) hm.fail("name", "unknown method '" + method + "'");
    p.method = method.c_str();
    const auto& bh = hr.object(h, "budget");
    p.budget = hr.sub("budget").number(bh, "fraction", 0.0, 1.0);
    p.budget_tokens = hr.sub("budget").integer<int64_t>(bh, "tokens", 0, std::numeric_limits<int64_t>::max());
    const int32_t saved_backend = hr.integer<int32_t>(h, "backend", KVS_BACKEND_CPU, KVS_BACKEND_HYBRID);
    p.backend = lp.backend ? lp.backend : saved_backend;
    p.device_id = lp.device_id;
    p.kv_memory = lp.kv_memory;
    p.kv_source = lp.kv_source;
    p.num_threads = lp.num_threads;
    p.gemm = lp.gemm;
    // The caller's fields are valid (checked above): whatever from_params refuses now is the file's.
    SessionConfig cfg;
    try {
      cfg = SessionConfig::from_params(&p);
    } catch (const Error& e) {
      if (e.code() != KVS_STATUS_INVALID_ARGUMENT) throw;
      bad(std::string("shape, budget or backend outside the session limits (") + e.what() + ")");
    }
    const auto& mp = hm.object(mh, "params");
    auto pool = ThreadPool::shared(cfg.num_threads);
    try {
      const ParamSet ps = ParamSet::from_json(method, spec->params, mp);
      cfg.method_params = ps.to_text();
      // The method checks its parameters' values (and their bounds) when it is created: build it
      // once here, so a value it refuses is reported as the file's, before any backend is set up.
      (void)spec->create(MethodContext{cfg.shape, cfg.budget, pool.get(), gemm}, ps);
    } catch (const Error& e) {
      if (e.code() != KVS_STATUS_INVALID_ARGUMENT && e.code() != KVS_STATUS_FORMAT_INVALID) throw;
      bad(std::string("method.params: parameters of method '") + method + "' that a session refuses (" + e.what() + ")");
    }
    // A session over the caller's cache reads its tables only: the KV is the engine's.
    const bool with_kv = hr.sub("flags").boolean(hr.object(h, "flags"), "kv_included") && lp.kv_source != KVS_KV_CALLER;
    const auto& layers = hr.array(h, "layers");
    if (layers.size() != p.num_layers)
      hr.fail("layers", "expected num_layers (" + std::to_string(p.num_layers) + ") entries, got " +
                            std::to_string(layers.size()));
    const auto hl = hr.sub("layers");
    std::vector<int64_t> tokens(p.num_layers, 0);
    std::vector<uint8_t> built(p.num_layers, 0);
    for (uint32_t l = 0; l < p.num_layers; ++l) {
      const auto hli = hl.sub(L(l));
      tokens[l] = hli.integer<int64_t>(layers[l], "tokens", 0, kMaxLayerTokens);
      built[l] = hli.boolean(layers[l], "index_built") ? 1 : 0;
    }
    const nlohmann::json meta = mh.contains("meta") ? hm.object(mh, "meta") : nlohmann::json::object();

    if (runtime) {
      cfg.lse_base = runtime->lse_base;
      cfg.max_rollback = runtime->max_rollback;
    }
    auto s = std::make_unique<Session>(cfg, pool);
    for (uint32_t l = 0; l < p.num_layers; ++l) {
      s->built_[l] = built[l];
      if (tokens[l] > 0 && !with_kv) s->expected_len_[l] = tokens[l];
    }
    const bool map = lp.flags & KVS_LOAD_MMAP;
    s->placement_->load(file, meta, tokens, with_kv, path, map);
    // The method's tables must fit the layers the header describes (a file whose sections and
    // header disagree, checksums valid, is refused here rather than read out of bounds later).
    for (uint32_t l = 0; l < p.num_layers; ++l) {
      std::string why;
      if (!s->placement_->index_fits(l, tokens[l], &why))
        hl.sub(L(l)).fail("tokens", std::to_string(tokens[l]) + " does not match the method's tables: " + why);
    }
    logf(LogLevel::Info, "loaded '%s': method %s, %u layers, KV %s", path.c_str(), method.c_str(), p.num_layers,
         !with_kv ? "to be prefilled again" : map ? "mapped from the file" : "copied");
    return s;
  } catch (const nlohmann::json::exception& e) {
    // A loader that reads the header directly (none should): still the file's fault.
    fail(KVS_STATUS_FORMAT_INVALID, hr.where() + "header: missing or mistyped field (" + e.what() + ")");
  }
}

std::unique_ptr<Session> Session::fork() const {
  auto s = std::unique_ptr<Session>(new Session(cfg_, pool_, placement_->fork()));
  s->built_ = built_;
  s->bound_ = bound_;
  s->expected_len_ = expected_len_;
  return s;
}

}  // namespace kvs
