// SPDX-License-Identifier: Apache-2.0
// Kernels of kv_ops.cuh. Rows move as 16-byte vectors (d * element size is a multiple of 16 for
// every supported head dim, and pages and caller tensors are 16-byte aligned).
#include "backends/cuda/kv_ops.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/status.cuh"

#include <cuda_runtime.h>

#include "kvsieve/kvsieve.h"

namespace kvs::cuda {
namespace {

// One block per (row, head) pair of a token range: vectors of 16 bytes.
__global__ void write_rows_kernel(PagedKv kv, int32_t b, int32_t hkv, int32_t vecs_per_row, int32_t t0, int32_t n,
                                  const uint4* __restrict__ src_k, const uint4* __restrict__ src_v) {
  const int32_t i = blockIdx.x, h = blockIdx.y;
  const int32_t t = t0 + i;
  const uint4* page = static_cast<const uint4*>(kv.pages[int64_t(b) * kv.max_pages + (t >> kv.page_shift)]);
  uint4* kp = const_cast<uint4*>(page) + (int64_t(h) * kv.page_tokens + (t & (kv.page_tokens - 1))) * vecs_per_row;
  uint4* vp = kp + int64_t(hkv) * kv.page_tokens * vecs_per_row;
  const int64_t s = (int64_t(i) * hkv + h) * vecs_per_row;
  for (int32_t j = threadIdx.x; j < vecs_per_row; j += blockDim.x) {
    kp[j] = src_k[s + j];
    vp[j] = src_v[s + j];
  }
}

__global__ void append_batch_kernel(PagedKv kv, int32_t hkv, int32_t vecs_per_row, const int32_t* __restrict__ pos,
                                    const uint4* k_new, const uint4* v_new, const void* const* kv_at) {
  // A programmatic dependent launch after this one may start now (it waits before reading KV).
  pdl_launch_dependents();
  const int32_t b = blockIdx.x, h = blockIdx.y;
  if (kv_at) {
    k_new = static_cast<const uint4*>(kv_at[0]);
    v_new = static_cast<const uint4*>(kv_at[1]);
  }
  const int32_t t = pos[b];
  const uint4* page = static_cast<const uint4*>(kv.pages[int64_t(b) * kv.max_pages + (t >> kv.page_shift)]);
  uint4* kp = const_cast<uint4*>(page) + (int64_t(h) * kv.page_tokens + (t & (kv.page_tokens - 1))) * vecs_per_row;
  uint4* vp = kp + int64_t(hkv) * kv.page_tokens * vecs_per_row;
  const int64_t s = (int64_t(b) * hkv + h) * vecs_per_row;
  for (int32_t j = threadIdx.x; j < vecs_per_row; j += blockDim.x) {
    kp[j] = k_new[s + j];
    vp[j] = v_new[s + j];
  }
}

__global__ void gather_tables_kernel(const void* const* const* __restrict__ src, const int32_t* __restrict__ counts,
                                     int32_t max_pages, const void** __restrict__ dst) {
  const int32_t b = blockIdx.y;
  const int32_t n = counts[b];
  const void* const* s = src[b];
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < max_pages; i += gridDim.x * blockDim.x)
    dst[int64_t(b) * max_pages + i] = i < n ? s[i] : nullptr;
}

int32_t vecs(int32_t d, Scalar dt) { return d * (dt == Scalar::F32 ? 4 : 2) / 16; }

}  // namespace

Status write_kv_rows(const PagedKv& kv, int32_t b, int32_t hkv, int32_t d, Scalar dt, int32_t t0, int32_t n,
                     const void* src_k, const void* src_v, void* stream) noexcept {
  if (n <= 0) return Status{};
  if (!kv_default_layout(kv)) return Status{KVS_STATUS_UNSUPPORTED, 0, "write_kv_rows: kvsieve writes its own page layout only"};
  if ((d * (dt == Scalar::F32 ? 4 : 2)) % 16) return Status{KVS_STATUS_UNSUPPORTED, 0, "write_kv_rows: row not a multiple of 16 bytes"};
  const int32_t v = vecs(d, dt);
  write_rows_kernel<<<dim3(unsigned(n), unsigned(hkv)), unsigned(v < 32 ? 32 : v > 128 ? 128 : v), 0,
                      static_cast<cudaStream_t>(stream)>>>(kv, b, hkv, v, t0, n, static_cast<const uint4*>(src_k),
                                                           static_cast<const uint4*>(src_v));
  return launch_status("write_kv_rows launch");
}

Status append_kv_batch(const PagedKv& kv, int32_t batch, int32_t hkv, int32_t d, Scalar dt, const int32_t* pos,
                       const void* k_new, const void* v_new, void* stream, const void* const* kv_at) noexcept {
  if (!kv_default_layout(kv)) return Status{KVS_STATUS_UNSUPPORTED, 0, "append_kv_batch: kvsieve writes its own page layout only"};
  if ((d * (dt == Scalar::F32 ? 4 : 2)) % 16) return Status{KVS_STATUS_UNSUPPORTED, 0, "append_kv_batch: row not a multiple of 16 bytes"};
  const int32_t v = vecs(d, dt);
  append_batch_kernel<<<dim3(unsigned(batch), unsigned(hkv)), unsigned(v < 32 ? 32 : v > 128 ? 128 : v), 0,
                        static_cast<cudaStream_t>(stream)>>>(kv, hkv, v, pos, static_cast<const uint4*>(k_new),
                                                             static_cast<const uint4*>(v_new), kv_at);
  return launch_status("append_kv_batch launch");
}

Status gather_page_tables(const void* const* const* src, const int32_t* counts, int32_t batch, int32_t max_pages,
                          const void** dst, void* stream) noexcept {
  const unsigned gx = unsigned((max_pages + 255) / 256);
  gather_tables_kernel<<<dim3(gx, unsigned(batch)), 256, 0, static_cast<cudaStream_t>(stream)>>>(src, counts, max_pages, dst);
  return launch_status("gather_page_tables launch");
}

}  // namespace kvs::cuda
