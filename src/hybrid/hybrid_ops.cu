// SPDX-License-Identifier: Apache-2.0
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "hybrid/hybrid_ops.cuh"

namespace kvs::cuda {
namespace {

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// One warp per row (b, h): the states' weights from their LSEs, then o = sum w_i o_i.
template <typename T>
__global__ void combine_kernel(CombineArgs a) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t rows = int64_t(a.batch) * a.heads;
  if (row >= rows) return;
  const int b = int(row / a.heads);
  float l[4];
  const float* src[4];
  int n = 0;
  for (int i = 0; i < a.num_dev; ++i) {
    l[n] = a.dev_lse[i][row];
    src[n++] = a.dev_o[i] + row * a.head_dim;
  }
  if (a.host_o && a.host_on[b]) {
    l[n] = a.host_lse[row];
    src[n++] = a.host_o + row * a.head_dim;
  }
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) m = fmaxf(m, l[i]);
  float w[4], sum = 0.f;
  for (int i = 0; i < n; ++i) {
    w[i] = m == -INFINITY ? 0.f : __expf(l[i] - m);
    sum += w[i];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  T* o = static_cast<T*>(a.o) + row * a.head_dim;
  for (int j = lane; j < a.head_dim; j += 32) {
    float acc = 0.f;
    for (int i = 0; i < n; ++i)
      if (w[i] != 0.f) acc += w[i] * src[i][j];
    o[j] = from_f32<T>(acc * inv);
  }
  if (lane == 0 && a.lse) {
    const float lse = sum > 0.f ? m + logf(sum) : -INFINITY;
    a.lse[row] = a.lse_base2 && a.lse_base2[b] ? lse * 1.4426950408889634f : lse;
  }
}

}  // namespace

Status combine_states(const CombineArgs& a, void* stream) noexcept {
  if (a.num_dev < 0 || a.num_dev > 3 || a.batch < 1 || a.heads < 1 || a.head_dim < 1 || !a.o)
    return Status{1, 0, "combine_states: bad arguments"};
  const int64_t rows = int64_t(a.batch) * a.heads;
  constexpr int kWarps = 8;
  const dim3 grid(unsigned((rows + kWarps - 1) / kWarps)), block(32 * kWarps);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.o_dtype) {
    case Scalar::F32: combine_kernel<float><<<grid, block, 0, s>>>(a); break;
    case Scalar::BF16: combine_kernel<__nv_bfloat16><<<grid, block, 0, s>>>(a); break;
    case Scalar::F16: combine_kernel<__half><<<grid, block, 0, s>>>(a); break;
    default: return Status{3, 0, "combine_states: o dtype must be F32, BF16 or F16"};
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status{11, int32_t(e), "combine_states: launch failed"};
  return Status{};
}

}  // namespace kvs::cuda
