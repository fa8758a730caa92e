// SPDX-License-Identifier: Apache-2.0
// Shared by the CUDA test files that drive the public C API (test_cuda_session.cu,
// test_cuda_graphs.cu): a check macro counting into the including file's own counters, an error
// check, a kvs_tensor over caller memory, and host <-> device helpers. Each file includes it once (the anonymous namespace
// gives every file its own g_pass / g_fail).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <initializer_list>
#include <vector>

#include "core/dtype.hpp"
#include "kvsieve/kvsieve.h"

namespace {

int g_pass = 0, g_fail = 0;

#define CAPI_CHECK(cond, ...)                                    \
  do {                                                           \
    if (cond) ++g_pass;                                          \
    else {                                                       \
      ++g_fail;                                                  \
      std::printf("FAIL %s:%d: %s ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                  \
      std::printf("\n");                                         \
    }                                                            \
  } while (0)

// True when e is no error; otherwise counts a failure, prints it with `what`, frees it.
bool ok(kvs_error_t e, const char* what) {
  if (!e) return true;
  std::printf("FAIL %s: %s\n", what, kvs_error_message(e));
  ++g_fail;
  kvs_error_destroy(e);
  return false;
}

// A kvs_tensor over `data` (C-contiguous, up to 3 dimensions) on device type `dev` (device id 0).
struct Tensor {
  kvs_tensor t{};
  int64_t shape[3]{};
  Tensor(void* data, int dev, kvs_dtype dt, std::initializer_list<int64_t> dims) {
    t.data = data;
    t.device = kvs_device{dev, 0};
    t.ndim = int32_t(dims.size());
    t.dtype = dt;
    int i = 0;
    for (auto x : dims) shape[i++] = x;
    t.shape = shape;
  }
};

const kvs_dtype F32{KVS_DTYPE_CODE_FLOAT, 32, 1};

[[maybe_unused]] kvs_dtype dt16(kvs_scalar_type s) {
  return s == KVS_SCALAR_BF16 ? kvs_dtype{KVS_DTYPE_CODE_BFLOAT, 16, 1} : kvs_dtype{KVS_DTYPE_CODE_FLOAT, 16, 1};
}

[[maybe_unused]] std::vector<uint16_t> to16(const std::vector<float>& x, kvs_scalar_type s) {
  std::vector<uint16_t> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = s == KVS_SCALAR_BF16 ? kvs::f32_to_bf16(x[i]) : kvs::f32_to_f16(x[i]);
  return r;
}

// A device copy of h (cudaFree it).
template <class T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  cudaMalloc(&d, h.size() * sizeof(T));
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

}  // namespace
