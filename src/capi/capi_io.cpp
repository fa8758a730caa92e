// SPDX-License-Identifier: Apache-2.0
// C API for files: tables inspection and traces. Thin: validate arguments, call src/io.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "capi/guard.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "io/safetensors.hpp"
#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"

// A trace handle: the mapped trace plus the shape/stride storage that kvs_tensor views point to
// (the same for every layer), so views stay valid while the handle lives.
struct kvs_trace_s {
  std::shared_ptr<kvs::io::Trace> trace;
  int64_t q_shape[3];
  int64_t kv_shape[3];
  int64_t qkv_strides[2][3];  // [q | kv][dim]
  int64_t tok_shape[1];
  int64_t tok_strides[1];
};

namespace {

void need(const void* p, const char* name) {
  if (!p) kvs::invalid(std::string(name) + ": expected a non-NULL pointer, got NULL");
}

char* dup_string(const std::string& s) {
  char* r = static_cast<char*>(std::malloc(s.size() + 1));  // freed by kvs_string_free (free)
  if (!r) throw std::bad_alloc();
  std::memcpy(r, s.c_str(), s.size() + 1);
  return r;
}

// The bytes of a validated host tensor in C order: borrowed when contiguous, else gathered into
// `store` (element by element, no dtype conversion).
kvs::io::Piece contiguous_bytes(const kvs::View& v, std::vector<std::vector<char>>& store) {
  const size_t es = kvs::dtype_size(v.dtype);
  const uint64_t n = uint64_t(v.numel());
  if (v.contiguous()) return {v.base, n * es};
  std::vector<char> buf(size_t(n * es));
  int64_t idx[4] = {0, 0, 0, 0};
  for (uint64_t lin = 0; lin < n; ++lin) {
    std::memcpy(buf.data() + lin * es, v.base + v.offset(idx) * int64_t(es), es);
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (++idx[d] < v.shape[d]) break;
      idx[d] = 0;
    }
  }
  store.push_back(std::move(buf));
  return {store.back().data(), n * es};
}

}  // namespace

extern "C" {

KVS_API kvs_error_t kvs_tables_describe(const char* path, char** out_json) {
  return kvs::capi::guarded([&] {
    need(path, "path");
    need(out_json, "out_json");
    nlohmann::json d = kvs::io::describe_tables(path);
    std::string text = d.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
    char* s = dup_string(text);
    // Documented exception to "outputs untouched on error": a corrupt file is described in the
    // JSON *and* reported as the error, so the caller frees both.
    *out_json = s;
    if (!d["ok"].get<bool>())
      throw kvs::Error(kvs_status(d["error_code"].get<int>()), d["error"].get<std::string>());
  });
}

KVS_API void kvs_trace_info_init(kvs_trace_info* info) {
  if (!info) return;
  std::memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
  info->dtype = KVS_SCALAR_BF16;
}

KVS_API kvs_error_t kvs_trace_open(const char* path, kvs_trace_t* out) {
  return kvs::capi::guarded([&] {
    need(path, "path");
    need(out, "out");
    auto h = std::make_unique<kvs_trace_s>();
    h->trace = kvs::io::Trace::open(path);
    const auto& m = h->trace->meta();
    const int64_t T = h->trace->total_len(), d = m.head_dim;
    const int64_t shapes[2][3] = {{T, m.num_q_heads, d}, {T, m.num_kv_heads, d}};
    for (int i = 0; i < 3; ++i) {
      h->q_shape[i] = shapes[0][i];
      h->kv_shape[i] = shapes[1][i];
    }
    for (int w = 0; w < 2; ++w) {
      h->qkv_strides[w][2] = 1;
      h->qkv_strides[w][1] = d;
      h->qkv_strides[w][0] = shapes[w][1] * d;
    }
    h->tok_shape[0] = T;
    h->tok_strides[0] = 1;
    *out = h.release();
  });
}

KVS_API void kvs_trace_destroy(kvs_trace_t t) { delete t; }

KVS_API kvs_error_t kvs_trace_get_info(kvs_trace_t t, kvs_trace_info* out) {
  return kvs::capi::guarded([&] {
    need(t, "t");
    need(out, "out");
    if (out->struct_size < sizeof(kvs_trace_info))
      kvs::invalid("out->struct_size: expected >= " + std::to_string(sizeof(kvs_trace_info)) +
                   " (call kvs_trace_info_init first), got " + std::to_string(out->struct_size));
    const auto& tr = *t->trace;
    const auto& m = tr.meta();
    kvs_trace_info r;
    r.struct_size = out->struct_size;
    r.num_layers = m.num_layers;
    r.num_q_heads = m.num_q_heads;
    r.num_kv_heads = m.num_kv_heads;
    r.head_dim = m.head_dim;
    r.prefill_len = m.prefill_len;
    r.total_len = tr.total_len();
    r.num_present_layers = uint32_t(tr.layers().size());
    r.softmax_scale = tr.softmax_scale();
    r.dtype = int32_t(tr.dtype());
    r.source = m.source.c_str();
    // Fields a newer caller appended after ours are left as it initialised them.
    std::memcpy(out, &r, sizeof r);
  });
}

KVS_API kvs_error_t kvs_trace_layer_index(kvs_trace_t t, uint32_t i, uint32_t* out_layer) {
  return kvs::capi::guarded([&] {
    need(t, "t");
    need(out_layer, "out_layer");
    const auto& ls = t->trace->layers();
    if (i >= ls.size())
      kvs::invalid("i: expected < num_present_layers = " + std::to_string(ls.size()) + ", got " +
                   std::to_string(i));
    *out_layer = ls[i];
  });
}

KVS_API kvs_error_t kvs_trace_tensor(kvs_trace_t t, uint32_t layer, const char* name,
                                     kvs_tensor* out) {
  return kvs::capi::guarded([&] {
    need(t, "t");
    need(name, "name");
    need(out, "out");
    kvs_tensor r{};
    r.device = kvs_device{KVS_DEVICE_CPU, 0};
    r.byte_offset = 0;
    if (std::strcmp(name, "tokens") == 0) {
      // Not per layer: `layer` is ignored.
      const int32_t* tok = t->trace->tokens();
      if (!tok) kvs::invalid("name: the trace '" + t->trace->path() + "' has no 'tokens' tensor");
      r.data = const_cast<int32_t*>(tok);
      r.ndim = 1;
      r.dtype = kvs_dtype{KVS_DTYPE_CODE_INT, 32, 1};
      r.shape = t->tok_shape;
      r.strides = t->tok_strides;
    } else {
      if (std::strcmp(name, "q") && std::strcmp(name, "k") && std::strcmp(name, "v"))
        kvs::invalid(std::string("name: expected \"q\", \"k\", \"v\" or \"tokens\", got \"") + name + "\"");
      if (!t->trace->has_layer(layer))
        kvs::invalid("layer: " + std::to_string(layer) + " is not present in trace '" +
                     t->trace->path() + "'");
      auto v = t->trace->tensor(layer, name);
      const bool is_q = name[0] == 'q';
      // Read-only: the data lies in a read-only mapping.
      r.data = const_cast<void*>(v.data);
      r.ndim = 3;
      r.dtype = kvs::dl_from_dtype(v.dtype);
      r.shape = is_q ? t->q_shape : t->kv_shape;
      r.strides = t->qkv_strides[is_q ? 0 : 1];
    }
    *out = r;
  });
}

KVS_API kvs_error_t kvs_trace_write(const char* path, const kvs_trace_info* info,
                                    const uint32_t* layers, size_t num_layers_present,
                                    const kvs_tensor* const* q, const kvs_tensor* const* k,
                                    const kvs_tensor* const* v, const kvs_tensor* tokens) {
  return kvs::capi::guarded([&] {
    need(path, "path");
    need(info, "info");
    if (info->struct_size < sizeof(kvs_trace_info))
      kvs::invalid("info->struct_size: expected >= " + std::to_string(sizeof(kvs_trace_info)) +
                   " (call kvs_trace_info_init first), got " + std::to_string(info->struct_size));
    if (num_layers_present < 1) kvs::invalid("num_layers_present: expected >= 1, got 0");
    need(layers, "layers");
    need(q, "q");
    need(k, "k");
    need(v, "v");
    if (info->dtype != KVS_SCALAR_F32 && info->dtype != KVS_SCALAR_F16 && info->dtype != KVS_SCALAR_BF16)
      kvs::invalid("info->dtype: expected KVS_SCALAR_F32, F16 or BF16, got " + std::to_string(info->dtype));
    if (info->num_q_heads < 1 || info->num_kv_heads < 1 || info->head_dim < 1)
      kvs::invalid("info: num_q_heads, num_kv_heads and head_dim must be >= 1");
    const kvs::DType dt = kvs::DType(info->dtype);
    kvs::io::TraceMeta m;
    m.num_layers = info->num_layers;
    m.num_q_heads = info->num_q_heads;
    m.num_kv_heads = info->num_kv_heads;
    m.head_dim = info->head_dim;
    m.prefill_len = info->prefill_len;
    m.softmax_scale = info->softmax_scale;
    if (info->source) m.source = info->source;

    int64_t T = info->total_len > 0 ? info->total_len : -1;  // 0 = take it from the tensors
    const int64_t Hq = info->num_q_heads, Hkv = info->num_kv_heads, d = info->head_dim;
    std::vector<std::vector<char>> store;
    std::vector<kvs::io::TraceLayerData> data;
    for (size_t i = 0; i < num_layers_present; ++i) {
      kvs::io::TraceLayerData L;
      L.layer = layers[i];
      const kvs_tensor* const* arr[3] = {q, k, v};
      const char* nm[3] = {"q", "k", "v"};
      for (int j = 0; j < 3; ++j) {
        const std::string name = std::string(nm[j]) + "[" + std::to_string(i) + "]";
        auto view = kvs::check_tensor(arr[j][i], name.c_str(), {T, j == 0 ? Hq : Hkv, d},
                                      kvs::Where::Host);
        if (view.dtype != dt)
          kvs::invalid(name + ": expected dtype " + kvs::dtype_name(dt) + " (info->dtype), got " +
                       kvs::dtype_name(view.dtype));
        T = view.shape[0];
        (j == 0 ? L.q : j == 1 ? L.k : L.v).push_back(contiguous_bytes(view, store));
      }
      data.push_back(std::move(L));
    }
    std::vector<int32_t> tok;
    if (tokens) {
      if (tokens->ndim != 1 || !tokens->shape || tokens->shape[0] != T)
        kvs::invalid("tokens: expected shape [" + std::to_string(T) + "]");
      if (tokens->dtype.code != KVS_DTYPE_CODE_INT || tokens->dtype.bits != 32 || tokens->dtype.lanes != 1)
        kvs::invalid("tokens: expected dtype int32");
      const int32_t dev = tokens->device.device_type;
      if (dev != KVS_DEVICE_CPU && dev != KVS_DEVICE_CUDA_HOST)
        kvs::invalid("tokens: expected a host tensor (device CPU or CUDA_HOST)");
      if (T > 0 && !tokens->data) kvs::invalid("tokens: data is NULL");
      // Checked as check_tensor checks q/k/v (a negative stride read before the buffer), and so
      // that the last element's offset cannot overflow.
      const int64_t stride = tokens->strides ? tokens->strides[0] : 1;
      if (stride < 0)
        kvs::invalid("tokens: negative strides are not supported (dimension 0), got " + std::to_string(stride));
      const unsigned __int128 last_byte =
          (unsigned __int128)(uint64_t(stride)) * uint64_t(T > 0 ? T - 1 : 0) * sizeof(int32_t) + tokens->byte_offset;
      if (last_byte > (unsigned __int128)(std::numeric_limits<int64_t>::max()))
        kvs::invalid("tokens: stride " + std::to_string(stride) + " is too large for " + std::to_string(T) +
                     " elements (the last one's byte offset overflows)");
      const auto* base = reinterpret_cast<const int32_t*>(static_cast<const char*>(tokens->data) +
                                                          tokens->byte_offset);
      tok.resize(size_t(T));
      for (int64_t i = 0; i < T; ++i) tok[size_t(i)] = base[i * stride];
    }
    kvs::io::write_trace(path, m, dt, T, data, tokens ? tok.data() : nullptr);
  });
}

}  // extern "C"
