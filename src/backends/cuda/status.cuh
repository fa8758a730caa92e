// SPDX-License-Identifier: Apache-2.0
// Status values and the CUDA-error checks shared by the kernel files (nvcc only; private to
// src/backends/cuda/*.cu). A failed CUDA call or launch returns KVS_STATUS_BACKEND with its
// cudaError_t; the message is a static string naming the call.
#pragma once
#include <cuda_runtime.h>

#include "backends/cuda/cuda_attention.cuh"
#include "kvsieve/kvsieve.h"

namespace kvs::cuda {

inline Status invalid(const char* m) { return Status{KVS_STATUS_INVALID_ARGUMENT, 0, m}; }
inline Status unsupported(const char* m) { return Status{KVS_STATUS_UNSUPPORTED, 0, m}; }
inline Status cuda_fail(cudaError_t e, const char* m) { return Status{KVS_STATUS_BACKEND, int32_t(e), m}; }
// The last launch's error, as a Status.
inline Status launch_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : cuda_fail(e, what);
}

}  // namespace kvs::cuda

#define KVS_CUDA_TRY(call, what)                                             \
  do {                                                                       \
    cudaError_t kvs_e_ = (call);                                             \
    if (kvs_e_ != cudaSuccess) return ::kvs::cuda::cuda_fail(kvs_e_, what); \
  } while (0)
#define KVS_LAUNCH_CHECK(what)                                               \
  do {                                                                       \
    cudaError_t kvs_e_ = cudaGetLastError();                                 \
    if (kvs_e_ != cudaSuccess) return ::kvs::cuda::cuda_fail(kvs_e_, what); \
  } while (0)
