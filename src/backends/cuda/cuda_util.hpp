// SPDX-License-Identifier: Apache-2.0
// Host-side helpers shared by the cuda backend's C++ files: error conversion, the device guard,
// validation of caller tensors on the device. Compiled by the host compiler against the CUDA runtime.
#pragma once
#ifdef KVS_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>

#include "backends/cuda/cuda_attention.cuh"
#include "core/error.hpp"
#include "core/method.hpp"
#include "core/placement.hpp"
#include "core/tensor.hpp"

namespace kvs::cudautil {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    if (e == cudaErrorMemoryAllocation)
      fail(KVS_STATUS_OUT_OF_MEMORY, std::string("CUDA: ") + what + ": " + cudaGetErrorString(e), int64_t(e));
    fail(KVS_STATUS_BACKEND, std::string("CUDA: ") + what + ": " + cudaGetErrorString(e), int64_t(e));
  }
}
inline void check(const cuda::Status& st, const char* what) {
  if (!st.ok()) fail(kvs_status(st.code), std::string("CUDA ") + what + ": " + st.message, int64_t(st.cuda_error));
}
inline cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// Switches to a device for the scope and back.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    check(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != dev) check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev && prev >= 0) cudaSetDevice(prev);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

// A device buffer that frees itself (on its device).
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  int device = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(std::exchange(o.p, nullptr)), bytes(std::exchange(o.bytes, 0)), device(o.device) {}
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      release();
      p = std::exchange(o.p, nullptr);
      bytes = std::exchange(o.bytes, 0);
      device = o.device;
    }
    return *this;
  }
  ~DevBuf() { release(); }
  void release() noexcept {
    if (p) {
      int prev = -1;
      cudaGetDevice(&prev);
      if (prev != device) cudaSetDevice(device);
      cudaFree(p);
      if (prev >= 0 && prev != device) cudaSetDevice(prev);
    }
    p = nullptr;
    bytes = 0;
  }
  // Grows to at least n bytes (contents not kept), by at least a quarter each time: the step's
  // sizes creep up with the context, and a reallocation synchronises the device. An empty buffer
  // gets exactly n bytes.
  void reserve(size_t n, int dev, const char* what = "cudaMalloc(workspace)") {
    if (n <= bytes && p) return;
    n = std::max(n, bytes + bytes / 4);  // before release(), which zeroes `bytes`
    release();
    device = dev;
    check(cudaMalloc(&p, n ? n : 1), what);
    bytes = n;
  }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// Page-locked host memory mapped into every device's address space (cudaHostAllocMapped |
// cudaHostAllocPortable): the host reads and writes it at at(), kernels at dev(). Grows like DevBuf
// (contents not kept).
struct PinnedBuf {
  void* p = nullptr;
  void* d = nullptr;  // p's device address
  size_t bytes = 0;
  PinnedBuf() = default;
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
  ~PinnedBuf() { release(); }
  void release() noexcept {
    if (p) cudaFreeHost(p);
    p = d = nullptr;
    bytes = 0;
  }
  void reserve(size_t n, const char* what = "cudaHostAlloc(pinned buffer)") {
    if (n <= bytes && p) return;
    n = std::max(n, bytes + bytes / 4);
    release();
    check(cudaHostAlloc(&p, n ? n : 1, cudaHostAllocMapped | cudaHostAllocPortable), what);
    bytes = n;
    if (cudaError_t e = cudaHostGetDevicePointer(&d, p, 0); e != cudaSuccess) {
      release();
      check(e, what);
    }
  }
  template <class T>
  T* at(size_t byte_offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(p) + byte_offset);
  }
  template <class T>
  T* dev(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(d) + byte_offset);
  }
};

// A contiguous CUDA tensor of the given shape, on `device`, of one of the allowed dtypes, its data
// `align`-byte aligned (16 for rows read as 16-byte vectors).
inline View cuda_view(const kvs_tensor* t, const char* name, std::initializer_list<int64_t> shape, int device,
                      std::initializer_list<DType> allowed, int align = 16) {
  View v = check_tensor(t, name, shape, Where::Cuda);
  if (v.device_id != device)
    invalid(std::string(name) + ": expected a tensor on CUDA device " + std::to_string(device) + ", got device " +
            std::to_string(v.device_id));
  if (!v.contiguous()) invalid(std::string(name) + ": the cuda backend expects a contiguous tensor");
  if (reinterpret_cast<uintptr_t>(v.base) % uintptr_t(align))
    invalid(std::string(name) + ": the cuda backend expects " + std::to_string(align) + "-byte aligned data");
  bool ok = false;
  std::string names;
  for (DType a : allowed) {
    ok |= a == v.dtype;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(a));
  }
  if (!ok) invalid(std::string(name) + ": expected dtype " + names + " on the cuda backend, got " + dtype_name(v.dtype));
  return v;
}

// The tensors of a decode step on the GPU (the cuda and hybrid placements): q [B, Hq, d] (rank 2
// without B for a single session) in fp32 or the KV dtype, k_new and v_new [B, Hkv, d] in the KV
// dtype, o like q, lse [B, Hq] fp32 (optional), all on `device`, contiguous.
struct StepViews {
  View q, k, v, o, lse;
};
// with_kv false (a cache the caller owns): k_new and v_new are not read (the placement checks they are NULL).
inline StepViews cuda_step_views(const StepTensors& t, int64_t B, const ModelShape& sh, int device, bool with_kv = true) {
  const int64_t hq = sh.num_q_heads, hkv = sh.num_kv_heads, d = sh.head_dim;
  const std::initializer_list<DType> qdt = {DType::F32, sh.kv_dtype};
  StepViews s;
  if (t.single) {
    s.q = cuda_view(t.q, "q", {hq, d}, device, qdt);
    if (with_kv) s.k = cuda_view(t.k_new, "k_new", {hkv, d}, device, {sh.kv_dtype});
    if (with_kv) s.v = cuda_view(t.v_new, "v_new", {hkv, d}, device, {sh.kv_dtype});
    s.o = cuda_view(t.o, "o", {hq, d}, device, qdt);
    if (t.lse) s.lse = cuda_view(t.lse, "lse", {hq}, device, {DType::F32}, 4);
  } else {
    s.q = cuda_view(t.q, "q", {B, hq, d}, device, qdt);
    if (with_kv) s.k = cuda_view(t.k_new, "k_new", {B, hkv, d}, device, {sh.kv_dtype});
    if (with_kv) s.v = cuda_view(t.v_new, "v_new", {B, hkv, d}, device, {sh.kv_dtype});
    s.o = cuda_view(t.o, "o", {B, hq, d}, device, qdt);
    if (t.lse) s.lse = cuda_view(t.lse, "lse", {B, hq}, device, {DType::F32}, 4);
  }
  return s;
}

}  // namespace kvs::cudautil
#endif
