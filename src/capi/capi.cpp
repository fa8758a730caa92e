// SPDX-License-Identifier: Apache-2.0
// The C ABI: validate, convert, catch everything, call the core. Nothing here throws.
#include <cstring>
#include <string>

#include "capi/guard.hpp"
#include "core/batch.hpp"
#include "core/method.hpp"
#include "core/session.hpp"
#include "kvsieve/kvsieve.h"

#ifndef KVS_VERSION_STRING
#define KVS_VERSION_STRING "0.0.0"
#endif

struct kvs_session_s {
  std::unique_ptr<kvs::Session> impl;
};

struct kvs_batch_s {
  std::unique_ptr<kvs::Batch> impl;
};

namespace kvs::capi {
kvs_error_s g_oom_error{KVS_STATUS_OUT_OF_MEMORY, "out of memory", 0};
}

using kvs::capi::guarded;

namespace {
kvs::Session& S(kvs_session_t s, const char* fn) {
  if (!s || !s->impl) kvs::invalid(std::string(fn) + ": session: expected a session handle, got NULL");
  return *s->impl;
}
template <class T>
void need(const T* p, const char* fn, const char* name) {
  if (!p) kvs::invalid(std::string(fn) + ": " + name + ": expected a pointer, got NULL");
}
}  // namespace

extern "C" {

// ---- versions and errors --------------------------------------------------------------------
const char* kvs_version(void) { return KVS_VERSION_STRING; }
uint32_t kvs_version_number(void) {
  return KVS_VERSION_MAJOR * 10000u + KVS_VERSION_MINOR * 100u + KVS_VERSION_PATCH;
}
uint32_t kvs_abi_version(void) { return KVS_ABI_VERSION; }

kvs_error_t kvs_abi_check(uint32_t header_abi_version) {
  if (header_abi_version == KVS_ABI_VERSION) return nullptr;
  return kvs::capi::make_error(KVS_STATUS_ABI_MISMATCH,
                               "kvs_abi_check: header_abi_version: the caller was compiled against ABI " +
                                   std::to_string(header_abi_version) + " but the loaded library implements ABI " +
                                   std::to_string(KVS_ABI_VERSION));
}

int32_t kvs_error_code(const struct kvs_error_s* err) { return err ? err->code : KVS_STATUS_OK; }
const char* kvs_error_message(const struct kvs_error_s* err) { return err ? err->message.c_str() : ""; }
int64_t kvs_error_backend_code(const struct kvs_error_s* err) { return err ? err->backend_code : 0; }
void kvs_error_destroy(kvs_error_t err) {
  if (err && err != &kvs::capi::g_oom_error) delete err;
}
void kvs_string_free(char* s) { std::free(s); }

// ---- registry -------------------------------------------------------------------------------
size_t kvs_method_count(void) { return kvs::method_registry().size(); }
const char* kvs_method_name(size_t i) {
  const auto& r = kvs::method_registry();
  return i < r.size() ? r[i].name : nullptr;
}
const char* kvs_method_doc(const char* method) {
  const auto* m = method ? kvs::find_method(method) : nullptr;
  return m ? m->doc : nullptr;
}
const char* kvs_method_unsupported_reason(const char* method, int32_t backend) {
  const kvs::MethodSpec* m = method ? kvs::find_method(method) : nullptr;
  if (!m) return nullptr;
  if (backend < 0 || backend > 3) return "unknown backend: expected KVS_BACKEND_CPU (1), KVS_BACKEND_CUDA (2) or KVS_BACKEND_HYBRID (3)";
  if (backend == 0) return "unknown backend 0: expected KVS_BACKEND_CPU (1), KVS_BACKEND_CUDA (2) or KVS_BACKEND_HYBRID (3)";
  return m->unsupported[backend].empty() ? nullptr : m->unsupported[backend].c_str();
}

uint32_t kvs_method_backends(const char* method) {
  const auto* m = method ? kvs::find_method(method) : nullptr;
  return m ? m->backends : 0u;
}

static const kvs::MethodSpec& require_method(const char* method, const char* fn) {
  if (!method) kvs::invalid(std::string(fn) + ": method: expected a method name, got NULL");
  const auto* m = kvs::find_method(method);
  if (!m) kvs::invalid(std::string(fn) + ": method: unknown method '" + method + "'");
  return *m;
}

kvs_error_t kvs_method_param_count(const char* method, size_t* out_count) {
  return guarded([&] {
    const auto& m = require_method(method, "kvs_method_param_count");
    need(out_count, "kvs_method_param_count", "out_count");
    *out_count = m.params.size();
  });
}

kvs_error_t kvs_method_param(const char* method, size_t i, kvs_param_info* out) {
  return guarded([&] {
    const auto& m = require_method(method, "kvs_method_param");
    need(out, "kvs_method_param", "out");
    if (out->struct_size < sizeof(kvs_param_info))
      kvs::invalid("kvs_method_param: out->struct_size: expected >= " + std::to_string(sizeof(kvs_param_info)));
    if (i >= m.params.size())
      kvs::invalid("kvs_method_param: i: expected < " + std::to_string(m.params.size()) + ", got " + std::to_string(i));
    const auto& p = m.params[i];
    out->name = p.name;
    out->type = p.type;
    out->default_value = p.default_value;
    out->doc = p.doc;
  });
}

// ---- sessions -------------------------------------------------------------------------------
void kvs_session_params_init(kvs_session_params* p) {
  if (!p) return;
  std::memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->num_layers = 1;
  p->num_q_heads = 1;
  p->num_kv_heads = 1;
  p->head_dim = 128;
  p->softmax_scale = 0.f;
  p->kv_dtype = KVS_SCALAR_BF16;
  p->backend = KVS_BACKEND_CPU;
  p->gemm = KVS_GEMM_AUTO;
  p->method = "full";
  p->lse_base = KVS_LSE_BASE_E;
  p->max_rollback = 0;
}

void kvs_load_params_init(kvs_load_params* p) {
  if (!p) return;
  std::memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->flags = 0;  // loads copy; KVS_LOAD_MMAP is the caller's explicit choice
}

kvs_error_t kvs_session_create(const kvs_session_params* params, kvs_session_t* out) {
  return guarded([&] {
    need(out, "kvs_session_create", "out");
    auto cfg = kvs::SessionConfig::from_params(params);
    auto h = std::make_unique<kvs_session_s>();
    h->impl = std::make_unique<kvs::Session>(cfg);
    *out = h.release();
  });
}

void kvs_session_destroy(kvs_session_t s) { delete s; }

kvs_error_t kvs_session_prefill(kvs_session_t s, uint32_t layer, const kvs_tensor* q, const kvs_tensor* k,
                                const kvs_tensor* v, const kvs_tensor* o, void* stream) {
  return guarded([&] { S(s, "kvs_session_prefill").prefill(layer, q, k, v, o, stream); });
}

kvs_error_t kvs_session_build_index(kvs_session_t s, void* stream) {
  return guarded([&] { S(s, "kvs_session_build_index").build_index(stream); });
}

kvs_error_t kvs_session_decode(kvs_session_t s, uint32_t layer, const kvs_tensor* q, const kvs_tensor* k_new,
                               const kvs_tensor* v_new, const kvs_tensor* o, const kvs_tensor* lse, void* stream) {
  return guarded([&] {
    S(s, "kvs_session_decode").decode(layer, q, k_new, v_new, o, lse, stream);
  });
}

kvs_error_t kvs_session_decode_tokens(kvs_session_t s, uint32_t layer, const kvs_tensor* q, const kvs_tensor* k_new,
                                      const kvs_tensor* v_new, const kvs_tensor* o, const kvs_tensor* lse, void* stream) {
  return guarded([&] { S(s, "kvs_session_decode_tokens").decode_tokens(layer, q, k_new, v_new, o, lse, stream); });
}

kvs_error_t kvs_session_append(kvs_session_t s, uint32_t layer, const kvs_tensor* q, const kvs_tensor* k,
                               const kvs_tensor* v, const kvs_tensor* o, void* stream) {
  return guarded([&] { S(s, "kvs_session_append").append(layer, q, k, v, o, stream); });
}

void kvs_paged_kv_init(kvs_paged_kv* kv) {
  if (!kv) return;
  std::memset(kv, 0, sizeof(*kv));
  kv->struct_size = sizeof(*kv);
}

kvs_error_t kvs_session_bind_kv(kvs_session_t s, uint32_t layer, const kvs_paged_kv* kv, void* stream) {
  return guarded([&] { S(s, "kvs_session_bind_kv").bind_kv(layer, kv, stream); });
}

kvs_error_t kvs_session_truncate(kvs_session_t s, int64_t num_tokens) {
  return guarded([&] { S(s, "kvs_session_truncate").truncate(num_tokens); });
}

kvs_error_t kvs_decode_batch(kvs_session_t* sessions, size_t count, uint32_t layer, const kvs_tensor* q,
                             const kvs_tensor* k_new, const kvs_tensor* v_new, const kvs_tensor* o,
                             const kvs_tensor* lse, void* stream) {
  return guarded([&] {
    need(sessions, "kvs_decode_batch", "sessions");
    // Checked before the handle array is allocated (the core checks it again for its own callers).
    if (count == 0 || count > 65536) kvs::invalid("kvs_decode_batch: count: expected 1..65536, got " + std::to_string(count));
    std::vector<kvs::Session*> v(count);
    for (size_t i = 0; i < count; ++i) {
      if (!sessions[i] || !sessions[i]->impl)
        kvs::invalid("kvs_decode_batch: sessions[" + std::to_string(i) + "]: expected a session handle, got NULL");
      v[i] = sessions[i]->impl.get();
    }
    kvs::Session::decode_batch(v.data(), count, layer, q, k_new, v_new, o, lse, stream);
  });
}

kvs_error_t kvs_batch_create(kvs_session_t* sessions, size_t count, kvs_batch_t* out) {
  return guarded([&] {
    need(sessions, "kvs_batch_create", "sessions");
    need(out, "kvs_batch_create", "out");
    if (count == 0 || count > 65536) kvs::invalid("kvs_batch_create: count: expected 1..65536, got " + std::to_string(count));
    std::vector<kvs::Session*> v(count);
    for (size_t i = 0; i < count; ++i) {
      if (!sessions[i] || !sessions[i]->impl)
        kvs::invalid("kvs_batch_create: sessions[" + std::to_string(i) + "]: expected a session handle, got NULL");
      v[i] = sessions[i]->impl.get();
    }
    auto h = std::make_unique<kvs_batch_s>();
    h->impl = std::make_unique<kvs::Batch>(std::move(v));
    *out = h.release();
  });
}

void kvs_batch_destroy(kvs_batch_t b) { delete b; }

size_t kvs_batch_size(kvs_batch_t b) { return b && b->impl ? b->impl->size() : 0; }

kvs_error_t kvs_batch_plan(kvs_batch_t b, void* stream) {
  return guarded([&] {
    if (!b || !b->impl) kvs::invalid("kvs_batch_plan: batch: expected a batch handle, got NULL");
    b->impl->plan(stream);
  });
}

kvs_error_t kvs_batch_decode(kvs_batch_t b, uint32_t layer, const kvs_tensor* q, const kvs_tensor* k_new,
                             const kvs_tensor* v_new, const kvs_tensor* o, const kvs_tensor* lse, void* stream) {
  return guarded([&] {
    if (!b || !b->impl) kvs::invalid("kvs_batch_decode: batch: expected a batch handle, got NULL");
    b->impl->decode(layer, q, k_new, v_new, o, lse, stream);
  });
}

kvs_error_t kvs_session_save(kvs_session_t s, const char* path, uint32_t flags) {
  return guarded([&] {
    auto& sess = S(s, "kvs_session_save");
    if (!path || !*path) kvs::invalid("kvs_session_save: path: expected a file path, got NULL or empty");
    sess.save(path, flags);
  });
}

kvs_error_t kvs_session_load(const char* path, const kvs_load_params* params, kvs_session_t* out) {
  return guarded([&] {
    if (!path || !*path) kvs::invalid("kvs_session_load: path: expected a file path, got NULL or empty");
    need(out, "kvs_session_load", "out");
    auto h = std::make_unique<kvs_session_s>();
    h->impl = kvs::Session::load(path, params);
    *out = h.release();
  });
}

kvs_error_t kvs_session_fork(kvs_session_t s, kvs_session_t* out) {
  return guarded([&] {
    auto& sess = S(s, "kvs_session_fork");
    need(out, "kvs_session_fork", "out");
    auto h = std::make_unique<kvs_session_s>();
    h->impl = sess.fork();
    *out = h.release();
  });
}

kvs_error_t kvs_session_to(kvs_session_t s, int32_t backend, int32_t device_id, kvs_session_t* out) {
  return guarded([&] {
    auto& sess = S(s, "kvs_session_to");
    need(out, "kvs_session_to", "out");
    auto h = std::make_unique<kvs_session_s>();
    h->impl = sess.to(backend, device_id);
    *out = h.release();
  });
}

kvs_error_t kvs_session_get_stats(kvs_session_t s, kvs_session_stats* out) {
  return guarded([&] { S(s, "kvs_session_get_stats").stats(out); });
}

kvs_error_t kvs_session_layer_tokens(kvs_session_t s, uint32_t layer, int64_t* out) {
  return guarded([&] {
    auto& sess = S(s, "kvs_session_layer_tokens");
    need(out, "kvs_session_layer_tokens", "out");
    *out = sess.layer_tokens(layer);
  });
}

kvs_error_t kvs_session_last_selection(kvs_session_t s, uint32_t layer, uint32_t kv_head, int32_t* out,
                                       size_t capacity, size_t* out_count) {
  return guarded([&] {
    auto& sess = S(s, "kvs_session_last_selection");
    need(out_count, "kvs_session_last_selection", "out_count");
    if (capacity > 0 && !out) kvs::invalid("kvs_session_last_selection: out: expected a buffer of capacity entries, got NULL");
    auto sel = sess.last_selection(layer, kv_head);
    const size_t n = std::min(capacity, sel.size());
    if (n) std::memcpy(out, sel.data(), n * sizeof(int32_t));
    *out_count = sel.size();
  });
}

kvs_error_t kvs_session_method_stat(kvs_session_t s, const char* name, double* out) {
  return guarded([&] {
    auto& sess = S(s, "kvs_session_method_stat");
    if (!name) kvs::invalid("kvs_session_method_stat: name: expected a statistic name, got NULL");
    need(out, "kvs_session_method_stat", "out");
    *out = sess.method_stat(name);
  });
}

}  // extern "C"
