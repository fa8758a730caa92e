// SPDX-License-Identifier: Apache-2.0
// Shared by the CUDA test files that drive the public C API (test_cuda_session.cu,
// test_cuda_graphs.cu): a check macro counting into the including file's own counters, an error
// check, a kvs_tensor over caller memory, and host <-> device helpers. Each file includes it once (the anonymous namespace
// gives every file its own g_pass / g_fail).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <vector>

#include "core/dtype.hpp"
#include "kvsieve/kvsieve.h"

namespace {

int g_pass = 0, g_fail = 0;

// A one-layer session of `method` (backend: the cpu until set; more layers: set num_layers).
[[maybe_unused]] kvs_session_params one_layer_params(const char* method, kvs_scalar_type kvdt, int hq, int hkv, int d, double budget) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = uint32_t(hq);
  p.num_kv_heads = uint32_t(hkv);
  p.head_dim = uint32_t(d);
  p.kv_dtype = kvdt;
  p.method = method;
  p.budget = budget;
  return p;
}

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

// One kvs_decode_batch of the B GPU sessions from host rows (q [B][Hq][d] fp32, k16/v16 [B][Hkv][d]
// in the KV dtype); out [B][Hq][d] and lse [B][Hq] come back to the host (out poisoned with NaN
// first, so an unwritten row shows).
[[maybe_unused]] void gpu_decode_batch(std::vector<kvs_session_t>& gpu, const std::vector<float>& q,
                                       const std::vector<uint16_t>& k16, const std::vector<uint16_t>& v16, int hq,
                                       int hkv, int d, kvs_scalar_type kvdt, cudaStream_t stream,
                                       std::vector<float>& out, std::vector<float>& lse) {
  const int64_t B = int64_t(gpu.size());
  float* dq = upload(q);
  uint16_t* dk = upload(k16);
  uint16_t* dv = upload(v16);
  float *dout = nullptr, *dlse = nullptr;
  out.assign(size_t(B) * hq * d, 0.f);
  lse.assign(size_t(B) * hq, 0.f);
  cudaMalloc(&dout, out.size() * 4);
  cudaMalloc(&dlse, lse.size() * 4);
  cudaMemset(dout, 0xff, out.size() * 4);
  Tensor gq(dq, KVS_DEVICE_CUDA, F32, {B, hq, d}), gk(dk, KVS_DEVICE_CUDA, dt16(kvdt), {B, hkv, d}),
      gv(dv, KVS_DEVICE_CUDA, dt16(kvdt), {B, hkv, d}), go(dout, KVS_DEVICE_CUDA, F32, {B, hq, d}),
      gl(dlse, KVS_DEVICE_CUDA, F32, {B, hq});
  ok(kvs_decode_batch(gpu.data(), size_t(B), 0, &gq.t, &gk.t, &gv.t, &go.t, &gl.t, stream), "decode_batch cuda");
  cudaStreamSynchronize(stream);
  cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  cudaFree(dlse);
}

// Folds the worst per-row relative L2 error of out against ref (rows of d; NaN counts as 1e9) into
// err, and the worst |lse - rlse| into lse_err.
[[maybe_unused]] void fold_errors(const std::vector<float>& out, const std::vector<float>& ref,
                                  const std::vector<float>& lse, const std::vector<float>& rlse, int d, double& err,
                                  double& lse_err) {
  for (size_t r = 0; r < rlse.size(); ++r) {
    double num = 0, den = 0;
    for (int i = 0; i < d; ++i) {
      const double a = out[r * d + i], b = ref[r * d + i];
      num += (a - b) * (a - b);
      den += b * b;
    }
    const double e = std::sqrt(num / std::max(den, 1e-30));
    err = std::isnan(e) ? 1e9 : std::max(err, e);
    lse_err = std::max(lse_err, double(std::fabs(lse[r] - rlse[r])));
  }
}

}  // namespace
