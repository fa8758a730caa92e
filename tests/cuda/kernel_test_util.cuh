// SPDX-License-Identifier: Apache-2.0
// Shared by the CUDA kernel test files (test_cuda_attention.cu, test_cuda_topk.cu,
// test_cuda_quest.cu, test_cuda_csa_build.cu): the CUDA error check (cuda_check.hpp), a device
// buffer, host <-> device copies and the 16-bit encodings. Each file includes it once (the
// anonymous namespace gives every file its own copy) and keeps its own pass/fail counters.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backends/cuda/cuda_attention.cuh"
#include "cuda_check.hpp"

namespace {

struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t bytes = 0) { alloc(bytes); }
  void alloc(size_t bytes) {
    free();
    n = bytes;
    if (bytes) KVS_TEST_CK(cudaMalloc(&p, bytes));
  }
  void free() {
    if (p) cudaFree(p);
    p = nullptr;
    n = 0;
  }
  ~DevBuf() { free(); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr, o.n = 0; }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// d holds exactly h afterwards (no allocation for an empty h).
template <typename T>
void upload(DevBuf& d, const std::vector<T>& h) {
  d.alloc(h.size() * sizeof(T));
  if (!h.empty()) KVS_TEST_CK(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T>
std::vector<T> download(const void* p, size_t count) {
  std::vector<T> h(count);
  if (count) KVS_TEST_CK(cudaMemcpy(h.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
template <typename T>
std::vector<T> download(const DevBuf& d, size_t count) {
  return download<T>(d.p, count);
}

// 16-bit encode/decode on the host (round to nearest even).
[[maybe_unused]] uint16_t enc(float x, kvs::cuda::Scalar t) {
  uint16_t u;
  if (t == kvs::cuda::Scalar::BF16) {
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    std::memcpy(&u, &b, 2);
  } else {
    const __half h = __float2half_rn(x);
    std::memcpy(&u, &h, 2);
  }
  return u;
}
[[maybe_unused]] float dec(uint16_t u, kvs::cuda::Scalar t) {
  if (t == kvs::cuda::Scalar::BF16) {
    const uint32_t w = uint32_t(u) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return __half2float(h);
}
[[maybe_unused]] const char* sname(kvs::cuda::Scalar t) {
  return t == kvs::cuda::Scalar::F32 ? "f32" : t == kvs::cuda::Scalar::F16 ? "f16" : "bf16";
}

}  // namespace
