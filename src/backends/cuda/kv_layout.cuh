// SPDX-License-Identifier: Apache-2.0
// The device KV layout every CUDA kernel of kvsieve reads: paged, one page table per sequence.
//
// A page holds `page_tokens` (P) consecutive tokens of every KV head of one layer of one sequence,
// K first then V, each [Hkv][P][d] in the KV dtype (the host KV store's page layout, so a page
// crosses between host and device, and into a tables file, as one block):
//
//   page = K[Hkv][P][d] | V[Hkv][P][d]
//   K(b, h, t, j) = page(b, t / P)[           (h * P + t % P) * d + j ]
//   V(b, h, t, j) = page(b, t / P)[ Hkv*P*d + (h * P + t % P) * d + j ]
//   page(b, i)    = pages[b * max_pages + i]          (a device array of device pointers)
//
// Pages are 256-byte aligned; P is a power of two in [16, 1024]; a sequence's entries past its last
// page may hold anything (nullptr). This header is plain C++ for the descriptor and adds __device__
// accessors when compiled by nvcc.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvs::cuda {

struct PagedKv {
  const void* const* pages = nullptr;  // device [B * max_pages]: page i of sequence b at pages[b * max_pages + i]
  int32_t max_pages = 0;               // entries per sequence (row stride of `pages`)
  int32_t page_tokens = 0;             // P: a power of two in [16, 1024]
  int32_t page_shift = 0;              // log2(P)
};

// Bytes of one page: 2 * Hkv * P * d * element size.
inline size_t paged_kv_page_bytes(int32_t num_kv_heads, int32_t page_tokens, int32_t head_dim, int32_t elem_bytes) {
  return size_t(2) * size_t(num_kv_heads) * size_t(page_tokens) * size_t(head_dim) * size_t(elem_bytes);
}

#if defined(__CUDACC__)
// Element pointer of K (is_v = 0) or V (is_v = 1) row (b, h, t): d contiguous elements of T.
template <typename T>
__device__ __forceinline__ const T* kv_row(const PagedKv& kv, int32_t hkv, int32_t d, int32_t b, int32_t h,
                                           int32_t t, int is_v) {
  const T* page = static_cast<const T*>(kv.pages[int64_t(b) * kv.max_pages + (t >> kv.page_shift)]);
  const int32_t P = kv.page_tokens;
  return page + ((int64_t(is_v) * hkv + h) * P + (t & (P - 1))) * d;
}
#endif

}  // namespace kvs::cuda
