// SPDX-License-Identifier: Apache-2.0
// Shared by the CUDA test files that drive the public C API (test_cuda_session.cu,
// test_cuda_graphs.cu): a check macro counting into the including file's own counters, an error
// check, and a kvs_tensor over caller memory. Each file includes it once (the anonymous namespace
// gives every file its own g_pass / g_fail).
#pragma once
#include <cstdio>
#include <initializer_list>

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

}  // namespace
