// SPDX-License-Identifier: Apache-2.0
// Kernels of kv_ops.cuh. Rows move as 16-byte vectors (d * element size is a multiple of 16 for
// every supported head dim, and pages and caller tensors are 16-byte aligned).
#include "backends/cuda/kv_ops.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/status.cuh"

#include <cuda_runtime.h>

#include <cstring>

#include "kvsieve/kvsieve.h"

namespace kvs::cuda {
namespace {

// Head h's K and V rows of token t into `page` (kvsieve's own layout: K[Hkv][P][d] then V), each
// vecs_per_row 16-byte vectors taken from k_src / v_src at vector offset s; the block's threads
// split the row.
__device__ __forceinline__ void write_row(const void* page, int32_t page_tokens, int32_t hkv, int32_t h, int32_t t,
                                          int32_t vecs_per_row, const uint4* k_src, const uint4* v_src, int64_t s) {
  uint4* kp = static_cast<uint4*>(const_cast<void*>(page)) +
              (int64_t(h) * page_tokens + (t & (page_tokens - 1))) * vecs_per_row;
  uint4* vp = kp + int64_t(hkv) * page_tokens * vecs_per_row;
  for (int32_t j = threadIdx.x; j < vecs_per_row; j += blockDim.x) {
    kp[j] = k_src[s + j];
    vp[j] = v_src[s + j];
  }
}

// One block per (row, head) pair of a token range: vectors of 16 bytes.
__global__ void write_rows_kernel(PagedKv kv, int32_t b, int32_t hkv, int32_t vecs_per_row, int32_t t0, int32_t n,
                                  const uint4* __restrict__ src_k, const uint4* __restrict__ src_v) {
  const int32_t i = blockIdx.x, h = blockIdx.y;
  const int32_t t = t0 + i;
  write_row(kv.pages[int64_t(b) * kv.max_pages + (t >> kv.page_shift)], kv.page_tokens, hkv, h, t, vecs_per_row, src_k,
            src_v, (int64_t(i) * hkv + h) * vecs_per_row);
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
  write_row(kv.pages[int64_t(b) * kv.max_pages + (t >> kv.page_shift)], kv.page_tokens, hkv, h, t, vecs_per_row, k_new,
            v_new, (int64_t(b) * hkv + h) * vecs_per_row);
}

template <int kBytes>
struct alignas(16) ArgBlock {
  uint4 v[kBytes / 16];
};

// Block (0, 0) writes the argument block; block (b, h) appends head h of sequence b's new row
// (vecs_per_row 0: no append). __grid_constant__: the block is read in place, not copied per thread.
template <int kBytes>
__global__ void step_args_kernel(const __grid_constant__ ArgBlock<kBytes> a, int32_t n16, uint4* __restrict__ dst,
                                 int32_t page_tokens, int32_t page_shift, int32_t hkv, int32_t vecs_per_row,
                                 int32_t tables_at, int32_t kv_at) {
  const int32_t b = blockIdx.x, h = blockIdx.y;
  if (b == 0 && h == 0)
    for (int32_t j = threadIdx.x; j < n16; j += blockDim.x) dst[j] = a.v[j];
  if (!vecs_per_row) return;
  const auto* base = reinterpret_cast<const unsigned char*>(a.v);
  const int32_t t = reinterpret_cast<const int32_t*>(base)[b];
  const auto* table = static_cast<const void* const*>(reinterpret_cast<const void* const*>(base + tables_at)[b]);
  const auto* k_new = static_cast<const uint4*>(reinterpret_cast<const void* const*>(base + kv_at)[0]);
  const auto* v_new = static_cast<const uint4*>(reinterpret_cast<const void* const*>(base + kv_at)[1]);
  write_row(table[t >> page_shift], page_tokens, hkv, h, t, vecs_per_row, k_new, v_new,
            (int64_t(b) * hkv + h) * vecs_per_row);
}

template <int kBytes>
cudaError_t launch_step_args(const StepArgsLaunch& l, const void* host, size_t bytes, cudaStream_t st, void* exec,
                             void* node) {
  ArgBlock<kBytes> a{};
  std::memcpy(a.v, host, bytes);
  if (!exec) {
    step_args_kernel<kBytes><<<dim3(l.grid_x, l.grid_y), l.threads, 0, st>>>(
        a, l.n16, static_cast<uint4*>(l.dst), l.page_tokens, l.page_shift, l.hkv, l.vecs, l.tables_at, l.kv_at);
    return cudaGetLastError();
  }
  auto dst = static_cast<uint4*>(l.dst);
  void* args[] = {&a,    const_cast<int32_t*>(&l.n16), &dst, const_cast<int32_t*>(&l.page_tokens),
                  const_cast<int32_t*>(&l.page_shift), const_cast<int32_t*>(&l.hkv), const_cast<int32_t*>(&l.vecs),
                  const_cast<int32_t*>(&l.tables_at), const_cast<int32_t*>(&l.kv_at)};
  cudaKernelNodeParams p{};
  p.func = const_cast<void*>(l.func);
  p.gridDim = dim3(l.grid_x, l.grid_y);
  p.blockDim = dim3(l.threads);
  p.kernelParams = args;
  return cudaGraphExecKernelNodeSetParams(static_cast<cudaGraphExec_t>(exec), static_cast<cudaGraphNode_t>(node), &p);
}

template <int kBytes>
const void* step_args_func() {
  return reinterpret_cast<const void*>(&step_args_kernel<kBytes>);
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
bool whole_vectors(int32_t d, Scalar dt) { return (d * (dt == Scalar::F32 ? 4 : 2)) % 16 == 0; }
// Threads of a block that writes one row of v vectors: a warp at least, 128 at most.
unsigned row_threads(int32_t v) { return unsigned(v < 32 ? 32 : v > 128 ? 128 : v); }

}  // namespace

Status write_kv_rows(const PagedKv& kv, int32_t b, int32_t hkv, int32_t d, Scalar dt, int32_t t0, int32_t n,
                     const void* src_k, const void* src_v, void* stream) noexcept {
  if (n <= 0) return Status{};
  if (!kv_default_layout(kv)) return Status{KVS_STATUS_UNSUPPORTED, 0, "write_kv_rows: kvsieve writes its own page layout only"};
  if (!whole_vectors(d, dt)) return Status{KVS_STATUS_UNSUPPORTED, 0, "write_kv_rows: row not a multiple of 16 bytes"};
  const int32_t v = vecs(d, dt);
  write_rows_kernel<<<dim3(unsigned(n), unsigned(hkv)), row_threads(v), 0,
                      static_cast<cudaStream_t>(stream)>>>(kv, b, hkv, v, t0, n, static_cast<const uint4*>(src_k),
                                                           static_cast<const uint4*>(src_v));
  return launch_status("write_kv_rows launch");
}

Status append_kv_batch(const PagedKv& kv, int32_t batch, int32_t hkv, int32_t d, Scalar dt, const int32_t* pos,
                       const void* k_new, const void* v_new, void* stream, const void* const* kv_at) noexcept {
  if (!kv_default_layout(kv)) return Status{KVS_STATUS_UNSUPPORTED, 0, "append_kv_batch: kvsieve writes its own page layout only"};
  if (!whole_vectors(d, dt)) return Status{KVS_STATUS_UNSUPPORTED, 0, "append_kv_batch: row not a multiple of 16 bytes"};
  const int32_t v = vecs(d, dt);
  append_batch_kernel<<<dim3(unsigned(batch), unsigned(hkv)), row_threads(v), 0,
                        static_cast<cudaStream_t>(stream)>>>(kv, hkv, v, pos, static_cast<const uint4*>(k_new),
                                                             static_cast<const uint4*>(v_new), kv_at);
  return launch_status("append_kv_batch launch");
}

Status upload_step_args(const void* host, size_t bytes, void* dst, const PagedKv& kv, int32_t batch, int32_t hkv,
                        int32_t d, Scalar dt, size_t tables_at, size_t kv_at, void* stream,
                        StepArgsLaunch* launched) noexcept {
  const bool append = kv_at != kNoAppend;
  if (bytes % 16 || bytes > kStepArgsMax || tables_at % sizeof(void*) || tables_at + batch * sizeof(void*) > bytes ||
      size_t(batch) * sizeof(int32_t) > tables_at || (append && (kv_at % sizeof(void*) || kv_at + 2 * sizeof(void*) > bytes)))
    return Status{KVS_STATUS_INTERNAL, 0, "upload_step_args: argument block out of range"};
  StepArgsLaunch l;
  if (append) {
    if (!kv_default_layout(kv)) return Status{KVS_STATUS_UNSUPPORTED, 0, "upload_step_args: kvsieve writes its own page layout only"};
    if (!whole_vectors(d, dt)) return Status{KVS_STATUS_UNSUPPORTED, 0, "upload_step_args: row not a multiple of 16 bytes"};
    l.vecs = vecs(d, dt);
  }
  l.capacity = bytes <= 1024 ? 1024 : int32_t(kStepArgsMax);
  l.func = l.capacity == 1024 ? step_args_func<1024>() : step_args_func<kStepArgsMax>();
  l.grid_x = l.vecs ? unsigned(batch) : 1;
  l.grid_y = l.vecs ? unsigned(hkv) : 1;
  l.threads = row_threads(l.vecs);
  l.n16 = int32_t(bytes / 16);
  l.page_tokens = kv.page_tokens;
  l.page_shift = kv.page_shift;
  l.hkv = hkv;
  l.tables_at = int32_t(tables_at);
  l.kv_at = append ? int32_t(kv_at) : 0;
  l.dst = dst;
  const auto st = static_cast<cudaStream_t>(stream);
  const cudaError_t e = l.capacity == 1024 ? launch_step_args<1024>(l, host, bytes, st, nullptr, nullptr)
                                           : launch_step_args<kStepArgsMax>(l, host, bytes, st, nullptr, nullptr);
  if (e != cudaSuccess) return cuda_fail(e, "upload_step_args launch");
  if (launched) *launched = l;
  return Status{};
}

Status set_step_args(void* exec, void* node, const StepArgsLaunch& l, const void* host, size_t bytes) noexcept {
  if (!exec || !node || !l.func || bytes / 16 != size_t(l.n16) || bytes % 16)
    return Status{KVS_STATUS_INTERNAL, 0, "set_step_args: not the captured launch"};
  const cudaError_t e = l.capacity == 1024 ? launch_step_args<1024>(l, host, bytes, nullptr, exec, node)
                                           : launch_step_args<kStepArgsMax>(l, host, bytes, nullptr, exec, node);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not left for the next launch's check
    return cuda_fail(e, "cudaGraphExecKernelNodeSetParams(step arguments)");
  }
  return Status{};
}

Status gather_page_tables(const void* const* const* src, const int32_t* counts, int32_t batch, int32_t max_pages,
                          const void** dst, void* stream) noexcept {
  const unsigned gx = unsigned((max_pages + 255) / 256);
  gather_tables_kernel<<<dim3(gx, unsigned(batch)), 256, 0, static_cast<cudaStream_t>(stream)>>>(src, counts, max_pages, dst);
  return launch_status("gather_page_tables launch");
}

}  // namespace kvs::cuda
