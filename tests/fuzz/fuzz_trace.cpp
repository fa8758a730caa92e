// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness of the trace reader (safetensors, "kvsieve-trace" v1; docs/formats.md): the
// input is written to a file, opened with kvs_trace_open, and when it opens, every view the
// reader hands out is checked against the trace's own description and read end to end (a view
// that pointed outside the mapping would fault here).
// Seeds: traces written by `kvsieve synth` (tests/fuzz/make_corpus.sh); dictionary: trace.dict.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fuzz_common.hpp"

namespace {

[[noreturn]] void broken(const char* what, uint32_t layer, const char* name) {
  std::fprintf(stderr, "trace view '%s' of layer %u: %s\n", name, layer, what);
  std::abort();
}

size_t dtype_bytes(int32_t scalar) {
  switch (scalar) {
    case KVS_SCALAR_F32: return 4;
    case KVS_SCALAR_F16:
    case KVS_SCALAR_BF16: return 2;
    default: return 0;
  }
}

// Checks a view's shape, dtype and strides against the info and reads every byte it covers.
void check_view(const kvs_trace_info& info, uint32_t layer, const char* name, const kvs_tensor& t) {
  const bool tokens = std::strcmp(name, "tokens") == 0;
  const int64_t T = info.total_len;
  const int64_t heads = name[0] == 'q' ? info.num_q_heads : info.num_kv_heads;
  const int32_t want_ndim = tokens ? 1 : 3;
  if (t.ndim != want_ndim || !t.shape || !t.data) broken("ndim, shape or data", layer, name);
  if (t.device.device_type != KVS_DEVICE_CPU) broken("device is not the CPU", layer, name);
  if (t.shape[0] != T) broken("first dimension differs from total_len", layer, name);
  size_t elem = 4;
  if (tokens) {
    if (t.dtype.code != KVS_DTYPE_CODE_INT || t.dtype.bits != 32) broken("tokens are not int32", layer, name);
  } else {
    if (t.shape[1] != heads || t.shape[2] != int64_t(info.head_dim)) broken("shape differs from the info", layer, name);
    elem = dtype_bytes(info.dtype);
    if (elem == 0 || t.dtype.bits != elem * 8) broken("dtype differs from the info", layer, name);
  }
  // Extent of the view in elements: strides as given (the reader's views are C-contiguous).
  size_t count = 1;
  for (int32_t i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) broken("negative dimension", layer, name);
    count *= size_t(t.shape[i]);
  }
  if (t.strides) {
    int64_t expect = 1;
    for (int32_t i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] > 1 && t.strides[i] != expect) broken("strides are not C-contiguous", layer, name);
      expect *= t.shape[i];
    }
  }
  const auto* p = static_cast<const volatile uint8_t*>(t.data) + t.byte_offset;
  uint8_t sum = 0;
  for (size_t i = 0; i < count * elem; ++i) sum = uint8_t(sum + p[i]);
  (void)sum;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvs_set_log_callback(nullptr, nullptr, KVS_LOG_OFF);
  kvs_fuzz::scratch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = kvs_fuzz::scratch().write(data, size);
  kvs_trace_t tr = nullptr;
  kvs_error_t err = kvs_trace_open(path.c_str(), &tr);
  if (err) {
    if (tr) std::abort();  // outputs are untouched on error
    kvs_fuzz::expect_not_internal(err, "kvs_trace_open");
    return 0;
  }
  kvs_trace_info info;
  kvs_trace_info_init(&info);
  err = kvs_trace_get_info(tr, &info);
  if (err) {
    std::fprintf(stderr, "kvs_trace_get_info failed on an open trace: %s\n", kvs_error_message(err));
    std::abort();
  }
  // What docs/formats.md promises of a trace that opened.
  if (info.num_layers < 1 || info.num_q_heads < 1 || info.num_kv_heads < 1 || info.head_dim < 1 ||
      info.num_q_heads % info.num_kv_heads != 0 || info.prefill_len < 1 || info.prefill_len > info.total_len ||
      info.num_present_layers > info.num_layers || !(info.softmax_scale > 0.0f)) {
    std::fprintf(stderr, "an opened trace breaks its documented invariants\n");
    std::abort();
  }
  if (info.source) (void)std::strlen(info.source);
  for (uint32_t i = 0; i < info.num_present_layers; ++i) {
    uint32_t layer = 0;
    err = kvs_trace_layer_index(tr, i, &layer);
    if (err || layer >= info.num_layers) {
      std::fprintf(stderr, "present layer %u: %s\n", i, err ? kvs_error_message(err) : "index out of range");
      std::abort();
    }
    for (const char* name : {"q", "k", "v"}) {
      kvs_tensor t{};
      err = kvs_trace_tensor(tr, layer, name, &t);
      if (err) {
        std::fprintf(stderr, "present layer %u has no '%s': %s\n", layer, name, kvs_error_message(err));
        std::abort();
      }
      check_view(info, layer, name, t);
    }
  }
  // Out-of-range requests are errors, never views.
  kvs_tensor t{};
  uint32_t layer = 0;
  err = kvs_trace_layer_index(tr, info.num_present_layers, &layer);
  if (!err) std::abort();
  kvs_fuzz::expect_not_internal(err, "kvs_trace_layer_index");
  err = kvs_trace_tensor(tr, info.num_layers, "q", &t);
  if (!err) std::abort();
  kvs_fuzz::expect_not_internal(err, "kvs_trace_tensor");
  err = kvs_trace_tensor(tr, 0, "tokens", &t);
  if (!err) check_view(info, 0, "tokens", t);
  kvs_fuzz::expect_not_internal(err, "kvs_trace_tensor(tokens)");
  kvs_trace_destroy(tr);
  return 0;
}
