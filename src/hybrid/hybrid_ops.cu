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
  for (int i = 0; i < (a.dev_on && !a.dev_on[b] ? 0 : a.num_dev); ++i) {
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

__global__ void ring_step_kernel(RingStep a) {
  const int i = blockIdx.x, h = blockIdx.y;
  const RingSession& s = a.s[i];
  const int64_t b = int64_t(a.b0) + i;
  const int vecs = a.head_dim * 2 / 16;  // 16-byte vectors per row (bf16 / fp16)
  const int64_t t_new = int64_t(s.n) - 1;
  const int64_t slot = ring_slot(t_new, s.S, s.W);
  if (slot >= 0) {
    auto* page = static_cast<char*>(s.base) + (slot >> kRingPageShift) * a.page_bytes;
    const int64_t row = (int64_t(h) * kRingPageTokens + (slot & (kRingPageTokens - 1))) * vecs;
    const int64_t v_off = int64_t(a.hkv) * kRingPageTokens * vecs;
    const auto* kn = static_cast<const uint4*>(a.k_new) + (b * a.hkv + h) * vecs;
    const auto* vn = static_cast<const uint4*>(a.v_new) + (b * a.hkv + h) * vecs;
    auto* kp = reinterpret_cast<uint4*>(page);
    for (int j = threadIdx.x; j < vecs; j += blockDim.x) {
      kp[row + j] = kn[j];
      kp[v_off + row + j] = vn[j];
    }
  }
  int32_t* idx = a.idx + (b * a.hkv + h) * a.idx_cap;
  const int32_t total = s.sinks + s.recent;
  for (int j = threadIdx.x; j < total; j += blockDim.x)
    idx[j] = j < s.sinks ? j : int32_t(ring_slot(int64_t(s.n) - s.recent + (j - s.sinks), s.S, s.W));
  if (threadIdx.x == 0) a.cnt[b * a.hkv + h] = total;
  if (h == 0) {
    const int64_t pages = (int64_t(s.S) + s.W + kRingPageTokens - 1) / kRingPageTokens;
    for (int j = threadIdx.x; j < a.max_pages; j += blockDim.x)
      a.table[b * a.max_pages + j] = j < pages ? static_cast<const char*>(s.base) + j * a.page_bytes : nullptr;
  }
}

}  // namespace

Status ring_step(const RingStep& a, void* stream) noexcept {
  if (a.count < 1 || a.count > kRingBatch || a.hkv < 1 || a.head_dim < 8 || (a.head_dim * 2) % 16 ||
      (a.dtype != Scalar::BF16 && a.dtype != Scalar::F16) || !a.k_new || !a.v_new || !a.table || !a.idx || !a.cnt)
    return Status{1, 0, "ring_step: bad arguments"};
  for (int i = 0; i < a.count; ++i) {
    const RingSession& s = a.s[i];
    const int64_t pages = (int64_t(s.S) + s.W + kRingPageTokens - 1) / kRingPageTokens;
    if (!s.base || s.S < 0 || s.W < 0 || s.n < 1 || s.sinks < 0 || s.recent < 0 || s.sinks > s.S || s.recent > s.W ||
        s.sinks + s.recent > a.idx_cap || s.sinks > s.n - s.recent || pages > a.max_pages)
      return Status{1, 0, "ring_step: a session's ring does not hold its static set"};
  }
  ring_step_kernel<<<dim3(unsigned(a.count), unsigned(a.hkv)), 64, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status{11, int32_t(e), "ring_step: launch failed"};
  return Status{};
}

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
