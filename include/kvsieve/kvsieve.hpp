// SPDX-License-Identifier: Apache-2.0
// kvsieve.hpp: header-only C++17 RAII and exceptions over the C ABI (kvsieve.h). Nothing here is
// compiled into the library: it only calls kvs_* functions, so it works with any build of the
// shared library of the same ABI version.
//
//   kvsieve::Session s(kvsieve::SessionParams{}.layers(32).heads(32, 8).head_dim(128).method("quest").budget(0.05));
//   s.prefill(layer, kvsieve::tensor(q, {n, 32, 128}), kvsieve::tensor(k, {n, 8, 128}), kvsieve::tensor(v, {n, 8, 128}));
//   s.build_index();
//   s.decode(layer, kvsieve::tensor(q1, {32, 128}), ..., kvsieve::tensor(o, {32, 128}), kvsieve::tensor(lse, {32}));
//
//   kvsieve::Batch b{s0, s1};                 // sessions of one shape and method, decoded together
//   b.plan();                                 // once per token
//   b.decode(layer, kvsieve::tensor(qb, {2, 32, 128}), ..., kvsieve::tensor(ob, {2, 32, 128}));  // per layer
//
// Errors throw kvsieve::Error (code, message, backend code). Handles are move-only and freed once.
#ifndef KVSIEVE_KVSIEVE_HPP
#define KVSIEVE_KVSIEVE_HPP

#include <kvsieve/kvsieve.h>

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvsieve {

/// A kvs_error_t as an exception: code() is a kvs_status, backend_code() the backend's own code.
class Error : public std::runtime_error {
 public:
  Error(int32_t code, const std::string& message, int64_t backend_code)
      : std::runtime_error(message), code_(code), backend_code_(backend_code) {}
  int32_t code() const noexcept { return code_; }
  int64_t backend_code() const noexcept { return backend_code_; }

 private:
  int32_t code_;
  int64_t backend_code_;
};

/// Throws (and frees) err when it is not NULL.
inline void check(kvs_error_t err) {
  if (!err) return;
  Error e(kvs_error_code(err), kvs_error_message(err), kvs_error_backend_code(err));
  kvs_error_destroy(err);
  throw e;
}

/// A kvs_tensor that owns its shape and strides arrays (the data stays the caller's).
class Tensor {
 public:
  Tensor(void* data, std::initializer_list<int64_t> shape, kvs_dtype dtype,
         kvs_device device = {KVS_DEVICE_CPU, 0})
      : shape_(shape) {
    t_.data = data;
    t_.device = device;
    t_.ndim = static_cast<int32_t>(shape_.size());
    t_.dtype = dtype;
    t_.shape = shape_.data();
    t_.strides = nullptr;  // C-contiguous
    t_.byte_offset = 0;
  }
  Tensor(const Tensor& o) : t_(o.t_), shape_(o.shape_), strides_(o.strides_) { fix(); }
  Tensor& operator=(const Tensor& o) {
    t_ = o.t_, shape_ = o.shape_, strides_ = o.strides_;
    fix();
    return *this;
  }
  /// Strides in elements (not bytes), one per dimension.
  Tensor& strides(std::initializer_list<int64_t> s) {
    strides_ = s;
    fix();
    return *this;
  }
  const kvs_tensor* get() const noexcept { return &t_; }

 private:
  void fix() {
    t_.shape = shape_.data();
    t_.strides = strides_.empty() ? nullptr : strides_.data();
  }
  kvs_tensor t_{};
  std::vector<int64_t> shape_, strides_;
};

inline constexpr kvs_dtype f32{KVS_DTYPE_CODE_FLOAT, 32, 1};
inline constexpr kvs_dtype f16{KVS_DTYPE_CODE_FLOAT, 16, 1};
inline constexpr kvs_dtype bf16{KVS_DTYPE_CODE_BFLOAT, 16, 1};

/// Host float32 tensor over caller memory.
inline Tensor tensor(float* data, std::initializer_list<int64_t> shape) { return Tensor(data, shape, f32); }
inline Tensor tensor(const float* data, std::initializer_list<int64_t> shape) {
  return Tensor(const_cast<float*>(data), shape, f32);  // inputs are only read
}

inline const kvs_tensor* opt(const Tensor* t) { return t ? t->get() : nullptr; }

/// kvs_session_params with chainable setters; strings are kept alive by this object.
class SessionParams {
 public:
  SessionParams() { kvs_session_params_init(&p_); }
  SessionParams& layers(uint32_t n) { p_.num_layers = n; return *this; }
  SessionParams& heads(uint32_t q, uint32_t kv) { p_.num_q_heads = q; p_.num_kv_heads = kv; return *this; }
  SessionParams& head_dim(uint32_t d) { p_.head_dim = d; return *this; }
  SessionParams& method(std::string m) { method_ = std::move(m); return *this; }
  SessionParams& method_params(std::string m) { method_params_ = std::move(m); return *this; }
  SessionParams& budget(double f) { p_.budget = f; return *this; }
  SessionParams& budget_tokens(int64_t n) { p_.budget_tokens = n; return *this; }
  SessionParams& kv_dtype(kvs_scalar_type t) { p_.kv_dtype = t; return *this; }
  SessionParams& backend(kvs_backend b, int32_t device_id = 0) { p_.backend = b; p_.device_id = device_id; return *this; }
  // Where the KV cache lives (kvs_device_type; KVS_DEVICE_CUDA_HOST: pinned host memory, cuda backend).
  SessionParams& kv_memory(kvs_device_type m) { p_.kv_memory = m; return *this; }
  SessionParams& num_threads(uint32_t n) { p_.num_threads = n; return *this; }
  SessionParams& softmax_scale(float s) { p_.softmax_scale = s; return *this; }
  SessionParams& lse_base(kvs_lse_base b) { p_.lse_base = b; return *this; }
  SessionParams& max_rollback(int64_t tokens) { p_.max_rollback = tokens; return *this; }
  /// The C struct, pointing into this object's strings.
  const kvs_session_params* get() {
    p_.method = method_.empty() ? nullptr : method_.c_str();
    p_.method_params = method_params_.empty() ? nullptr : method_params_.c_str();
    return &p_;
  }

 private:
  kvs_session_params p_;
  std::string method_, method_params_;
};

/// A session: move-only owner of a kvs_session_t (see kvs_session_* in kvsieve.h).
class Session {
 public:
  explicit Session(SessionParams params) { check(kvs_session_create(params.get(), &s_)); }
  /// Loads a saved session; its KV pages are copied, or mapped from the file with mmap = true
  /// (then the file must not be truncated or modified while the session or a fork of it lives).
  static Session load(const std::string& path, bool mmap = false) {
    kvs_load_params p;
    kvs_load_params_init(&p);
    p.flags = mmap ? KVS_LOAD_MMAP : 0u;
    kvs_session_t s = nullptr;
    check(kvs_session_load(path.c_str(), &p, &s));
    return Session(s);
  }
  Session(Session&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Session& operator=(Session&& o) noexcept {
    if (this != &o) kvs_session_destroy(std::exchange(s_, std::exchange(o.s_, nullptr)));
    return *this;
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { kvs_session_destroy(s_); }

  void prefill(uint32_t layer, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* o = nullptr,
               void* stream = nullptr) {
    check(kvs_session_prefill(s_, layer, q.get(), k.get(), v.get(), opt(o), stream));
  }
  void build_index(void* stream = nullptr) { check(kvs_session_build_index(s_, stream)); }
  void decode(uint32_t layer, const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& o,
              const Tensor* lse = nullptr, void* stream = nullptr) {
    check(kvs_session_decode(s_, layer, q.get(), k_new.get(), v_new.get(), o.get(), opt(lse), stream));
  }
  void append(uint32_t layer, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* o = nullptr,
              void* stream = nullptr) {
    check(kvs_session_append(s_, layer, q.get(), k.get(), v.get(), opt(o), stream));
  }
  /// Rollback: keeps the first num_tokens tokens of every layer (kvs_session_truncate).
  void truncate(int64_t num_tokens) { check(kvs_session_truncate(s_, num_tokens)); }
  void save(const std::string& path, bool include_kv = false) const {
    check(kvs_session_save(s_, path.c_str(), include_kv ? KVS_SAVE_INCLUDE_KV : KVS_SAVE_TABLES));
  }
  Session fork() const {
    kvs_session_t f = nullptr;
    check(kvs_session_fork(s_, &f));
    return Session(f);
  }
  // A copy of this session's state on another backend/device (kvs_session_to).
  Session to(int32_t backend, int32_t device_id = 0) const {
    kvs_session_t f = nullptr;
    check(kvs_session_to(s_, backend, device_id, &f));
    return Session(f);
  }
  kvs_session_stats stats() const {
    kvs_session_stats st{};
    st.struct_size = sizeof st;
    check(kvs_session_get_stats(s_, &st));
    return st;
  }
  int64_t layer_tokens(uint32_t layer) const {
    int64_t n = 0;
    check(kvs_session_layer_tokens(s_, layer, &n));
    return n;
  }
  std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const {
    size_t n = 0;
    check(kvs_session_last_selection(s_, layer, kv_head, nullptr, 0, &n));
    std::vector<int32_t> out(n);
    check(kvs_session_last_selection(s_, layer, kv_head, out.data(), out.size(), &n));
    return out;
  }
  double method_stat(const std::string& name) const {
    double v = 0;
    check(kvs_session_method_stat(s_, name.c_str(), &v));
    return v;
  }
  kvs_session_t get() const noexcept { return s_; }
  /// Gives up ownership (the caller destroys the handle).
  kvs_session_t release() noexcept { return std::exchange(s_, nullptr); }

 private:
  explicit Session(kvs_session_t s) : s_(s) {}
  kvs_session_t s_ = nullptr;
};

/// A batch (kvs_batch_t): move-only owner of the batch, not of its sessions, which must outlive it.
/// Sessions of one shape, KV dtype, softmax scale, method, backend and device, decoded together:
/// plan() once per token, then decode() once per layer with [B, ...] tensors (row b = sessions[b]).
class Batch {
 public:
  /// Batch b{s0, s1, s2};
  Batch(std::initializer_list<std::reference_wrapper<Session>> sessions) {
    std::vector<kvs_session_t> h;
    h.reserve(sessions.size());
    for (Session& s : sessions) h.push_back(s.get());
    create(h);
  }
  /// Every session of a vector, in order.
  explicit Batch(std::vector<Session>& sessions) {
    std::vector<kvs_session_t> h;
    h.reserve(sessions.size());
    for (Session& s : sessions) h.push_back(s.get());
    create(h);
  }
  /// Raw handles (borrowed).
  explicit Batch(const std::vector<kvs_session_t>& sessions) { create(sessions); }
  Batch(Batch&& o) noexcept : b_(std::exchange(o.b_, nullptr)) {}
  Batch& operator=(Batch&& o) noexcept {
    if (this != &o) kvs_batch_destroy(std::exchange(b_, std::exchange(o.b_, nullptr)));
    return *this;
  }
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;
  ~Batch() { kvs_batch_destroy(b_); }

  /// Once per token, before that token's decode() calls (kvs_batch_plan).
  void plan(void* stream = nullptr) { check(kvs_batch_plan(b_, stream)); }
  /// One layer's step of the planned token: q [B, Hq, d], k_new, v_new [B, Hkv, d], o [B, Hq, d],
  /// lse [B, Hq] or nullptr; each layer at most once per plan (kvs_batch_decode).
  void decode(uint32_t layer, const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& o,
              const Tensor* lse = nullptr, void* stream = nullptr) {
    check(kvs_batch_decode(b_, layer, q.get(), k_new.get(), v_new.get(), o.get(), opt(lse), stream));
  }
  /// The number of sessions (B).
  size_t size() const noexcept { return kvs_batch_size(b_); }
  kvs_batch_t get() const noexcept { return b_; }

 private:
  void create(const std::vector<kvs_session_t>& h) {
    check(kvs_batch_create(const_cast<kvs_session_t*>(h.data()), h.size(), &b_));
  }
  kvs_batch_t b_ = nullptr;
};

/// Names of the registered methods (kvs_method_count / kvs_method_name).
inline std::vector<std::string> method_names() {
  std::vector<std::string> out;
  for (size_t i = 0, n = kvs_method_count(); i < n; ++i) out.emplace_back(kvs_method_name(i));
  return out;
}

/// Why `method` cannot run on `backend` in this build (a sentence), or nothing when it can (or the
/// method is unknown: see method_names()).
inline std::optional<std::string> method_unsupported_reason(const std::string& method, int32_t backend) {
  const char* why = kvs_method_unsupported_reason(method.c_str(), backend);
  if (!why) return std::nullopt;
  return std::string(why);
}

/// Throws Error(KVS_STATUS_ABI_MISMATCH) when the loaded library has another ABI than this header.
inline void abi_check() { check(kvs_abi_check(KVS_ABI_VERSION)); }

}  // namespace kvsieve

#endif  // KVSIEVE_KVSIEVE_HPP
