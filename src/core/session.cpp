#include "core/session.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "backends/cpu/attention.hpp"
#include "backends/cpu/gemm.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "io/tables.hpp"

#ifdef KVS_HAVE_CUDA
#include "backends/cuda/cuda_backend.hpp"
#else
namespace kvs {
class CudaBackend {};  // this build has no CUDA backend
}  // namespace kvs
#endif

namespace kvs {

namespace {
std::string L(uint32_t layer) { return std::to_string(layer); }
// Token indices are int32 in selections and on the GPU.
constexpr int64_t kMaxLayerTokens = (int64_t(1) << 31) - 1;
}  // namespace

// ---------------------------------------------------------------------------------------------
// Configuration

SessionConfig SessionConfig::from_params(const kvs_session_params* p) {
  if (!p) invalid("params: expected a kvs_session_params, got NULL");
  if (p->struct_size < sizeof(kvs_session_params))
    invalid("params->struct_size: expected >= " + std::to_string(sizeof(kvs_session_params)) +
            " (fill with kvs_session_params_init), got " + std::to_string(p->struct_size));
  SessionConfig c;
  auto& s = c.shape;
  if (p->num_layers < 1 || p->num_layers > 4096)
    invalid("params->num_layers: expected 1..4096, got " + std::to_string(p->num_layers));
  if (p->num_kv_heads < 1 || p->num_kv_heads > 1024)
    invalid("params->num_kv_heads: expected 1..1024, got " + std::to_string(p->num_kv_heads));
  if (p->num_q_heads < 1 || p->num_q_heads % p->num_kv_heads != 0 || p->num_q_heads > 8192)
    invalid("params->num_q_heads: expected a positive multiple of num_kv_heads (" +
            std::to_string(p->num_kv_heads) + "), got " + std::to_string(p->num_q_heads));
  if (p->head_dim < 8 || p->head_dim > 256)
    invalid("params->head_dim: expected 8..256, got " + std::to_string(p->head_dim));
  if (!(p->softmax_scale >= 0.f) || std::isinf(p->softmax_scale))
    invalid("params->softmax_scale: expected 0 (= 1/sqrt(head_dim)) or a positive finite number");
  if (p->kv_dtype != KVS_SCALAR_F32 && p->kv_dtype != KVS_SCALAR_F16 && p->kv_dtype != KVS_SCALAR_BF16)
    invalid("params->kv_dtype: expected KVS_SCALAR_F32 (1), KVS_SCALAR_F16 (2) or KVS_SCALAR_BF16 (3), got " +
            std::to_string(p->kv_dtype));
  if (p->backend != KVS_BACKEND_CPU && p->backend != KVS_BACKEND_CUDA && p->backend != KVS_BACKEND_HYBRID)
    invalid("params->backend: expected KVS_BACKEND_CPU (1), KVS_BACKEND_CUDA (2) or KVS_BACKEND_HYBRID (3), got " +
            std::to_string(p->backend));
  if (p->num_threads > 1024) invalid("params->num_threads: expected 0..1024, got " + std::to_string(p->num_threads));
  if (!(p->budget >= 0.0 && p->budget <= 1.0))
    invalid("params->budget: expected a fraction in (0, 1] or 0 (unset), got " + std::to_string(p->budget));
  if (p->budget_tokens < 0) invalid("params->budget_tokens: expected >= 0, got " + std::to_string(p->budget_tokens));
  s.num_layers = p->num_layers;
  s.num_q_heads = p->num_q_heads;
  s.num_kv_heads = p->num_kv_heads;
  s.head_dim = p->head_dim;
  s.softmax_scale = p->softmax_scale > 0 ? p->softmax_scale : 1.0f / std::sqrt(float(p->head_dim));
  s.kv_dtype = DType(p->kv_dtype);
  c.backend = p->backend;
  c.device_id = p->device_id;
  c.num_threads = p->num_threads;
  cpu::resolve_gemm(p->gemm);  // validates
  c.gemm = p->gemm;
  c.method = p->method ? p->method : "full";
  c.method_params = p->method_params ? p->method_params : "";
  c.budget.fraction = p->budget;
  c.budget.tokens = p->budget_tokens;
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
  if (!(spec_->backends & (1u << cfg_.backend))) {
    const char* bn = cfg_.backend == KVS_BACKEND_CUDA ? "cuda" : cfg_.backend == KVS_BACKEND_HYBRID ? "hybrid" : "cpu";
    fail(KVS_STATUS_UNSUPPORTED, "params->backend: method '" + cfg_.method + "' does not support the " + bn + " backend");
  }
  ParamSet ps = ParamSet::parse(cfg_.method, spec_->params, cfg_.method_params.c_str());
  cfg_.method_params = ps.to_text();  // normalised, defaults included
  pool_ = pool ? std::move(pool) : std::make_shared<ThreadPool>(cfg_.num_threads);
  MethodContext mc{cfg_.shape, cfg_.budget, pool_.get(), int32_t(cpu::resolve_gemm(cfg_.gemm))};
  method_ = spec_->create(mc, ps);
  const auto& s = cfg_.shape;
  layers_.reserve(s.num_layers);
  for (uint32_t l = 0; l < s.num_layers; ++l) layers_.emplace_back(s.kv_dtype, int(s.num_kv_heads), int(s.head_dim));
  built_.assign(s.num_layers, 0);
  expected_len_.assign(s.num_layers, -1);
  last_sel_.resize(s.num_layers);
  last_n_.assign(s.num_layers, 0);
  if (cfg_.backend == KVS_BACKEND_CUDA) {
#ifdef KVS_HAVE_CUDA
    cuda_ = std::make_unique<CudaBackend>(*this);
#else
    fail(KVS_STATUS_UNSUPPORTED, "params->backend: this build of kvsieve has no CUDA backend (configure with KVS_WITH_CUDA=ON)");
#endif
  }
  if (cfg_.backend == KVS_BACKEND_HYBRID)
    fail(KVS_STATUS_UNSUPPORTED, "params->backend: the hybrid backend is not available yet in this version");
  logf(LogLevel::Debug, "session: method %s (%s), %u layers, %u/%u heads, d %u, kv %s, %u threads", cfg_.method.c_str(),
       cfg_.method_params.c_str(), cfg_.shape.num_layers, cfg_.shape.num_q_heads, cfg_.shape.num_kv_heads,
       cfg_.shape.head_dim, dtype_name(cfg_.shape.kv_dtype), pool_->size());
}

Session::~Session() = default;

// ---------------------------------------------------------------------------------------------
// Checks

void Session::check_layer(uint32_t layer, const char* fn) const {
  if (layer >= cfg_.shape.num_layers)
    invalid(std::string(fn) + ": layer: expected 0.." + std::to_string(cfg_.shape.num_layers - 1) + ", got " + L(layer));
}

int64_t Session::n_tokens(uint32_t layer) const {
#ifdef KVS_HAVE_CUDA
  if (cuda_) return cuda_->layer_tokens(layer);
#endif
  return layers_[layer].size();
}

void Session::check_decodable(uint32_t layer, const char* fn) const {
  check_layer(layer, fn);
  if (n_tokens(layer) == 0)
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(layer) + " has no tokens: call kvs_session_prefill first");
  if (expected_len_[layer] >= 0)
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(layer) + " was loaded without KV: prefill its " +
                                       std::to_string(expected_len_[layer]) + " prompt tokens first");
  if (!built_[layer])
    fail(KVS_STATUS_INVALID_STATE, std::string(fn) + ": layer " + L(layer) + " has no index: call kvs_session_build_index after prefill");
}

// ---------------------------------------------------------------------------------------------
// Prefill, build, append

void Session::causal_outputs(uint32_t layer, const float* q, int64_t n, int64_t first, float* o) {
  const auto& s = cfg_.shape;
  const size_t qs = size_t(s.num_q_heads) * s.head_dim;
  std::vector<float> lse(s.num_q_heads);
  for (int64_t i = 0; i < n; ++i)
    cpu::attend_dense(layers_[layer], q + size_t(i) * qs, s.group(), first + i + 1, s.softmax_scale,
                      o + size_t(i) * qs, lse.data(), *pool_);
}

void Session::prefill(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                      const kvs_tensor* o, void* stream) {
  check_layer(layer, "kvs_session_prefill");
#ifdef KVS_HAVE_CUDA
  if (cuda_) return cuda_->prefill(layer, q, k, v, o, stream);
#endif
  if (expected_len_[layer] < 0 && built_[layer])
    fail(KVS_STATUS_INVALID_STATE, "kvs_session_prefill: layer " + L(layer) + " is already indexed (" +
                                       std::to_string(layers_[layer].size()) + " tokens); use kvs_session_append for more");
  // After a tables-only load the chunks must add up to exactly the saved length.
  add_tokens(layer, q, k, v, o, "kvs_session_prefill", /*prompt=*/true,
             expected_len_[layer] >= 0 ? expected_len_[layer] : kMaxLayerTokens);
  // A tables-only load is complete once the chunks reach the saved length; its index stays valid.
  if (expected_len_[layer] >= 0 && layers_[layer].size() == expected_len_[layer]) expected_len_[layer] = -1;
}

// Prompt chunks and appended turns: validate, convert, append (rolled back on failure), let the
// method see the tokens, and write the causal outputs only once everything succeeded.
void Session::add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                         const kvs_tensor* o, const char* fn, bool prompt, int64_t max_tokens) {
  const auto& s = cfg_.shape;
  const int64_t hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim;
  View qv = check_tensor(q, "q", {-1, hq, d}, Where::Host);
  const int64_t n = qv.shape[0];
  View kv = check_tensor(k, "k", {n, hkv, d}, Where::Host);
  View vv = check_tensor(v, "v", {n, hkv, d}, Where::Host);
  View ov;
  if (o) ov = check_tensor(o, "o", {n, hq, d}, Where::Host);
  auto& lay = layers_[layer];
  const int64_t n0 = lay.size();
  if (n > max_tokens - n0)
    invalid(std::string(fn) + ": q: layer " + L(layer) + " may hold at most " + std::to_string(max_tokens) +
            " tokens here (it has " + std::to_string(n0) + "), got " + std::to_string(n) + " more");
  std::vector<float> qf(static_cast<size_t>(qv.numel())), kf(size_t(kv.numel())), vf(size_t(vv.numel()));
  read_f32(qv, qf.data());
  read_f32(kv, kf.data());
  read_f32(vv, vf.data());
  std::vector<float> of(o ? size_t(n) * hq * d : 0);
  try {
    lay.append(kf.data(), vf.data(), n);
    if (prompt) method_->on_prefill(layer, qf.data(), n, lay);
    else method_->on_append(layer, qf.data(), n, lay, false);
    if (o) causal_outputs(layer, qf.data(), n, n0, of.data());
  } catch (...) {
    lay.truncate(n0);
    method_->truncate(layer, n0);
    throw;
  }
  if (o) write_f32(ov, of.data());
}

void Session::build_index(void* stream) {
  bool any = false;
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) {
    if (n_tokens(l) == 0 || expected_len_[l] >= 0) continue;
    any = true;
    if (built_[l]) continue;
#ifdef KVS_HAVE_CUDA
    if (cuda_) cuda_->build_index(l, stream);
#endif
    method_->build_index(l, layers_[l]);
    built_[l] = 1;
  }
  if (!any) fail(KVS_STATUS_INVALID_STATE, "kvs_session_build_index: no layer has been prefilled (call kvs_session_prefill first)");
  logf(LogLevel::Info, "%s: index built (%llu bytes)", cfg_.method.c_str(), (unsigned long long)method_->index_bytes());
}

void Session::append(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                     const kvs_tensor* o, void* stream) {
  check_decodable(layer, "kvs_session_append");
#ifdef KVS_HAVE_CUDA
  if (cuda_) return cuda_->append(layer, q, k, v, o, stream);
#endif
  add_tokens(layer, q, k, v, o, "kvs_session_append", /*prompt=*/false, kMaxLayerTokens);
}

// ---------------------------------------------------------------------------------------------
// Decode

void Session::decode_f32(uint32_t layer, const float* q, const float* k, const float* v, float* o, float* lse) {
  const auto& s = cfg_.shape;
  const int G = s.group();
  auto& lay = layers_[layer];
  const int64_t n0 = lay.size();
  lay.append(k, v, 1);
  try {
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    method_->on_append(layer, q, 1, lay, true);
    const auto t1 = Clock::now();
    Selection& sel = last_sel_[layer];
    method_->select(layer, q, lay, sel);
    const auto t2 = Clock::now();
    const int64_t n = lay.size();
    double selected = 0;
    if (!sel.attend) {  // reported only: the method's extra() is the whole state
      std::fill(o, o + size_t(s.num_q_heads) * s.head_dim, 0.f);
      std::fill(lse, lse + s.num_q_heads, -std::numeric_limits<float>::infinity());
    }
    switch (sel.kind) {
      case Selection::Kind::All:
        if (sel.attend) cpu::attend_dense(lay, q, G, n, s.softmax_scale, o, lse, *pool_);
        selected = double(n);
        break;
      case Selection::Kind::PerKvHead:
        if (sel.lists.size() != s.num_kv_heads) fail(KVS_STATUS_INTERNAL, "method returned a selection of the wrong size");
        if (sel.attend) cpu::attend_gather_kv(lay, q, G, sel.lists, s.softmax_scale, o, lse, *pool_);
        for (auto& l : sel.lists) selected += double(l.size());
        selected /= double(s.num_kv_heads);
        break;
      case Selection::Kind::PerQueryHead:
        if (sel.lists.size() != s.num_q_heads) fail(KVS_STATUS_INTERNAL, "method returned a selection of the wrong size");
        if (sel.attend) cpu::attend_gather_q(lay, q, G, sel.lists, s.softmax_scale, o, lse, *pool_);
        for (uint32_t h = 0; h < s.num_kv_heads; ++h) selected += double(last_selection(layer, h).size());
        selected /= double(s.num_kv_heads);
        break;
    }
    std::vector<float> eo(size_t(s.num_q_heads) * s.head_dim), el(s.num_q_heads);
    if (method_->extra(layer, q, lay, eo.data(), el.data()))
      cpu::merge_states(o, lse, eo.data(), el.data(), int(s.num_q_heads), int(s.head_dim));
    phase_seconds_[0] += std::chrono::duration<double>(t1 - t0).count();
    phase_seconds_[1] += std::chrono::duration<double>(t2 - t1).count();
    phase_seconds_[2] += std::chrono::duration<double>(Clock::now() - t2).count();
    last_n_[layer] = n;
    ++decode_steps_;
    last_selected_ = selected;
    last_fraction_ = selected / double(n);
    sum_selected_ += selected;
  } catch (...) {
    lay.truncate(n0);
    method_->truncate(layer, n0);
    throw;
  }
}

void Session::decode(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                     const kvs_tensor* o, const kvs_tensor* lse, void* stream) {
  Session* self = this;
  decode_batch(&self, 1, layer, q, k, v, o, lse, stream, /*single=*/true);
}

void Session::decode_batch(Session* const* sessions, size_t count, uint32_t layer, const kvs_tensor* q,
                           const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                           const kvs_tensor* lse, void* stream, bool single) {
  // decode() is decode_batch with B = 1 and rank-2 tensors (single); decode_batch proper has rank 3.
  const char* fn = single ? "kvs_session_decode" : "kvs_decode_batch";
  if (!sessions) invalid(std::string(fn) + ": sessions: expected an array, got NULL");
  if (count == 0 || count > 65536 || (single && count != 1))
    invalid(std::string(fn) + ": count: expected 1..65536, got " + std::to_string(count));
  Session& s0 = *sessions[0];
  for (size_t b = 0; b < count; ++b) {
    if (!sessions[b]) invalid("kvs_decode_batch: sessions[" + std::to_string(b) + "] is NULL");
    const Session& sb = *sessions[b];
    const auto &a = sb.cfg_.shape, &z = s0.cfg_.shape;
    if (a.num_q_heads != z.num_q_heads || a.num_kv_heads != z.num_kv_heads || a.head_dim != z.head_dim ||
        a.num_layers != z.num_layers || a.kv_dtype != z.kv_dtype || a.softmax_scale != z.softmax_scale ||
        sb.cfg_.backend != s0.cfg_.backend || sb.cfg_.method != s0.cfg_.method)
      invalid("kvs_decode_batch: sessions[" + std::to_string(b) +
              "]: expected the shape, dtype, softmax scale, method and backend of sessions[0]");
    for (size_t c = 0; c < b; ++c)
      if (sessions[c] == sessions[b]) invalid("kvs_decode_batch: sessions[" + std::to_string(b) + "] appears twice");
    sb.check_decodable(layer, fn);
  }
#ifdef KVS_HAVE_CUDA
  if (s0.cuda_) return CudaBackend::decode_batch(sessions, count, layer, q, k, v, o, lse, stream, single);
#endif
  const auto& s = s0.cfg_.shape;
  const int64_t B = int64_t(count), hq = s.num_q_heads, hkv = s.num_kv_heads, d = s.head_dim;
  View qv, kv, vv, ov, lv;
  if (single) {
    qv = check_tensor(q, "q", {hq, d}, Where::Host);
    kv = check_tensor(k, "k_new", {hkv, d}, Where::Host);
    vv = check_tensor(v, "v_new", {hkv, d}, Where::Host);
    ov = check_tensor(o, "o", {hq, d}, Where::Host);
    if (lse) lv = check_tensor(lse, "lse", {hq}, Where::Host);
  } else {
    qv = check_tensor(q, "q", {B, hq, d}, Where::Host);
    kv = check_tensor(k, "k_new", {B, hkv, d}, Where::Host);
    vv = check_tensor(v, "v_new", {B, hkv, d}, Where::Host);
    ov = check_tensor(o, "o", {B, hq, d}, Where::Host);
    if (lse) lv = check_tensor(lse, "lse", {B, hq}, Where::Host);
  }
  if (lse && lv.dtype != DType::F32) invalid(std::string(fn) + ": lse: expected dtype float32");
  std::vector<float> qf(static_cast<size_t>(B * hq * d)), kf(size_t(B * hkv * d)), vf(size_t(B * hkv * d));
  std::vector<float> of(static_cast<size_t>(B * hq * d)), lf(size_t(B * hq));
  read_f32(qv, qf.data());
  read_f32(kv, kf.data());
  read_f32(vv, vf.data());
  for (int64_t b = 0; b < B; ++b)
    if (sessions[b]->layers_[layer].size() >= kMaxLayerTokens)
      invalid(std::string(fn) + ": layer " + L(layer) + " of sessions[" + std::to_string(b) + "] is full (" +
              std::to_string(kMaxLayerTokens) + " tokens)");
  for (int64_t b = 0; b < B; ++b) {
    try {
      sessions[b]->decode_f32(layer, qf.data() + b * hq * d, kf.data() + b * hkv * d, vf.data() + b * hkv * d,
                              of.data() + b * hq * d, lf.data() + b * hq);
    } catch (...) {
      // All or nothing: the sessions already advanced drop their new token again.
      for (int64_t a = 0; a < b; ++a) {
        Session& sa = *sessions[a];
        const int64_t n = sa.layers_[layer].size() - 1;
        sa.layers_[layer].truncate(n);
        sa.method_->truncate(layer, n);
        --sa.decode_steps_;
      }
      throw;
    }
  }
  write_f32(ov, of.data());
  if (lse) write_f32(lv, lf.data());
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
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) st.tokens = std::max(st.tokens, n_tokens(l));
  st.decode_steps = decode_steps_;
  for (auto& l : layers_) {
    st.kv_bytes += l.bytes();
    st.kv_shared_bytes += l.shared_bytes();
  }
#ifdef KVS_HAVE_CUDA
  if (cuda_) st.kv_bytes = cuda_->kv_bytes();
#endif
  st.index_bytes = method_->index_bytes();
  st.workspace_bytes = 0;
  st.last_selected_keys = last_selected_;
  st.mean_selected_keys = decode_steps_ ? sum_selected_ / double(decode_steps_) : 0.0;
  st.last_selected_fraction = last_fraction_;
  std::memcpy(out, &st, sizeof(st));
}

int64_t Session::layer_tokens(uint32_t layer) const {
  check_layer(layer, "kvs_session_layer_tokens");
  return n_tokens(layer);
}

std::vector<int32_t> Session::last_selection(uint32_t layer, uint32_t kv_head) const {
  check_layer(layer, "kvs_session_last_selection");
  if (kv_head >= cfg_.shape.num_kv_heads)
    invalid("kvs_session_last_selection: kv_head: expected 0.." + std::to_string(cfg_.shape.num_kv_heads - 1) +
            ", got " + std::to_string(kv_head));
#ifdef KVS_HAVE_CUDA
  if (cuda_) return cuda_->last_selection(layer, kv_head);
#endif
  const Selection& sel = last_sel_[layer];
  std::vector<int32_t> out;
  switch (sel.kind) {
    case Selection::Kind::All:
      out.resize(size_t(last_n_[layer]));
      for (size_t i = 0; i < out.size(); ++i) out[i] = int32_t(i);
      break;
    case Selection::Kind::PerKvHead:
      if (kv_head < sel.lists.size()) out = sel.lists[kv_head];
      std::sort(out.begin(), out.end());
      break;
    case Selection::Kind::PerQueryHead: {
      const int G = cfg_.shape.group();
      for (int g = 0; g < G; ++g) {
        size_t h = size_t(kv_head) * G + g;
        if (h < sel.lists.size()) out.insert(out.end(), sel.lists[h].begin(), sel.lists[h].end());
      }
      std::sort(out.begin(), out.end());
      out.erase(std::unique(out.begin(), out.end()), out.end());
      break;
    }
  }
  return out;
}

double Session::method_stat(const std::string& name) const {
  // Session-level statistics, the same for every method (CPU decode only).
  static const char* const kPhases[3] = {"decode_update_seconds", "decode_select_seconds", "decode_attend_seconds"};
  for (int i = 0; i < 3; ++i)
    if (name == kPhases[i]) return phase_seconds_[i];
  double v = 0;
  if (!method_->stat(name, &v))
    invalid("kvs_session_method_stat: name: method '" + cfg_.method + "' has no statistic '" + name + "'");
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
  if (cuda_) fail(KVS_STATUS_UNSUPPORTED, "kvs_session_save: saving a cuda-backend session is not supported yet");
  const bool with_kv = flags & KVS_SAVE_INCLUDE_KV;
  for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l)
    if (expected_len_[l] >= 0 && with_kv)
      fail(KVS_STATUS_INVALID_STATE, "kvs_session_save: layer " + L(l) +
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
    layers.push_back({{"tokens", expected_len_[l] >= 0 ? expected_len_[l] : layers_[l].size()},
                      {"index_built", bool(built_[l])}});
  h["layers"] = layers;
  h["method"]["meta"] = method_->save_meta();
  io::TablesWriter w(h);
  if (with_kv)
    for (uint32_t l = 0; l < cfg_.shape.num_layers; ++l) {
      std::vector<io::Piece> pieces;
      for (auto& p : layers_[l].pages()) pieces.push_back(io::Piece{p->data(), uint64_t(p->bytes())});
      if (!pieces.empty()) w.add("kv", int32_t(l), -1, std::move(pieces));
    }
  method_->save(w);
  w.write_atomic(path);
}

std::unique_ptr<Session> Session::load(const std::string& path, const kvs_load_params* params) {
  kvs_load_params lp;
  kvs_load_params_init(&lp);
  if (params) {
    if (params->struct_size < sizeof(kvs_load_params))
      invalid("kvs_session_load: params->struct_size: expected >= " + std::to_string(sizeof(kvs_load_params)));
    lp = *params;
  }
  auto file = io::TablesFile::open(path);
  const auto& h = file->header();
  auto bad = [&](const std::string& what) {
    fail(KVS_STATUS_FORMAT_INVALID, "tables file '" + path + "': header: " + what);
  };
  try {
    if (h.value("format", "") != "kvsieve-tables") bad("format is not kvsieve-tables");
    const auto& sh = h.at("shape");
    kvs_session_params p;
    kvs_session_params_init(&p);
    p.num_layers = sh.at("num_layers").get<uint32_t>();
    p.num_q_heads = sh.at("num_q_heads").get<uint32_t>();
    p.num_kv_heads = sh.at("num_kv_heads").get<uint32_t>();
    p.head_dim = sh.at("head_dim").get<uint32_t>();
    p.softmax_scale = sh.at("softmax_scale").get<float>();
    const std::string dt = sh.at("kv_dtype").get<std::string>();
    p.kv_dtype = dt == "f32" ? KVS_SCALAR_F32 : dt == "f16" ? KVS_SCALAR_F16 : dt == "bf16" ? KVS_SCALAR_BF16 : 0;
    if (sh.at("kv_page_tokens").get<int64_t>() != kPageTokens) bad("kv_page_tokens differs from this library's");
    const std::string method = h.at("method").at("name").get<std::string>();
    p.method = method.c_str();
    p.budget = h.at("budget").at("fraction").get<double>();
    p.budget_tokens = h.at("budget").at("tokens").get<int64_t>();
    p.backend = lp.backend ? lp.backend : h.at("backend").get<int32_t>();
    p.device_id = lp.device_id;
    p.num_threads = lp.num_threads;
    p.gemm = lp.gemm;
    SessionConfig cfg = SessionConfig::from_params(&p);
    const MethodSpec* spec = find_method(method);
    if (!spec) bad("unknown method '" + method + "'");
    cfg.method_params = ParamSet::from_json(method, spec->params, h.at("method").at("params")).to_text();
    if (cfg.backend != KVS_BACKEND_CPU) fail(KVS_STATUS_UNSUPPORTED, "kvs_session_load: only the cpu backend can load tables yet");
    auto s = std::make_unique<Session>(cfg);
    const bool with_kv = h.at("flags").at("kv_included").get<bool>();
    const auto& layers = h.at("layers");
    if (!layers.is_array() || layers.size() != p.num_layers) bad("layers does not have num_layers entries");
    std::shared_ptr<const void> keep = file;
    for (uint32_t l = 0; l < p.num_layers; ++l) {
      const int64_t n = layers[l].at("tokens").get<int64_t>();
      if (n < 0 || n > kMaxLayerTokens) bad("layer " + L(l) + " has an invalid token count " + std::to_string(n));
      s->built_[l] = layers[l].at("index_built").get<bool>() ? 1 : 0;
      if (n == 0) continue;
      if (!with_kv) {
        s->expected_len_[l] = n;
        continue;
      }
      const auto& sec = file->require("kv", int32_t(l), -1);
      auto& lay = s->layers_[l];
      const int64_t np = (n + kPageTokens - 1) / kPageTokens;
      if (sec.length != uint64_t(np) * lay.page_bytes())
        fail(KVS_STATUS_FORMAT_INVALID, "tables file '" + path + "': section kv layer " + L(l) + ": expected " +
                                            std::to_string(uint64_t(np) * lay.page_bytes()) + " bytes for " +
                                            std::to_string(n) + " tokens, got " + std::to_string(sec.length));
      std::vector<std::shared_ptr<Page>> pages;
      for (int64_t i = 0; i < np; ++i)
        pages.push_back(std::make_shared<Page>(sec.data + size_t(i) * lay.page_bytes(), lay.page_bytes(), keep));
      lay.adopt(std::move(pages), n);
    }
    s->method_->load(*file, h.at("method").value("meta", nlohmann::json::object()));
    logf(LogLevel::Info, "loaded '%s': method %s, %u layers, KV %s", path.c_str(), method.c_str(), p.num_layers,
         with_kv ? "mapped from the file" : "to be prefilled again");
    return s;
  } catch (const nlohmann::json::exception& e) {
    fail(KVS_STATUS_FORMAT_INVALID,
         "tables file '" + path + "': header: missing or mistyped field (" + e.what() + ")");
  }
}

std::unique_ptr<Session> Session::fork() const {
  if (cuda_) fail(KVS_STATUS_UNSUPPORTED, "kvs_session_fork: forking a cuda-backend session is not supported yet");
  auto s = std::make_unique<Session>(cfg_, pool_);
  s->layers_ = layers_;  // shares pages; copy-on-write on the next append
  s->built_ = built_;
  s->expected_len_ = expected_len_;
  s->method_ = method_->clone();
  return s;
}

}  // namespace kvs
