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
//
// A caller's cache (kvs_session_bind_kv) may be laid out otherwise, and the descriptor says how:
//   nhd:   a page's K is [P][Hkv][d] (FlashInfer's "NHD", vLLM's default) instead of [Hkv][P][d];
//   v_off: elements from a K row to its V row, 0 for the default Hkv * P * d (K and V in one page);
//          a cache with K and V in two pools of the same shape gives the pools' distance (it may be
//          negative), and the page pointers are those of the K pool.
// The kernels take the strides from kv_strides(); kvsieve's own pages are always the default.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvs::cuda {

struct PagedKv {
  const void* const* pages = nullptr;  // device [B * max_pages]: page i of sequence b at pages[b * max_pages + i]
  int32_t max_pages = 0;               // entries per sequence (row stride of `pages`)
  int32_t page_tokens = 0;             // P: a power of two in [16, 1024]
  int32_t page_shift = 0;              // log2(P)
  int32_t nhd = 0;                     // 1: a page's K (and V) is [P][Hkv][d]
  int64_t v_off = 0;                   // elements from a K row to its V row; 0: Hkv * P * d
};

#if defined(__CUDACC__)
#define KVS_KV_HD __host__ __device__ __forceinline__
#else
#define KVS_KV_HD inline
#endif

// Element strides of a page: between KV heads, between consecutive tokens of a head, K row to V row.
struct KvStrides {
  int64_t head, token, v;
};
KVS_KV_HD KvStrides kv_strides(const PagedKv& kv, int32_t hkv, int32_t d) {
  const int64_t P = kv.page_tokens;
  return KvStrides{kv.nhd ? int64_t(d) : P * d, kv.nhd ? int64_t(hkv) * d : int64_t(d),
                   kv.v_off ? kv.v_off : int64_t(hkv) * P * d};
}
// kvsieve's own layout (what write_kv_rows and the pinned-host paging move as whole pages).
KVS_KV_HD bool kv_default_layout(const PagedKv& kv) { return kv.nhd == 0 && kv.v_off == 0; }

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
  const KvStrides s = kv_strides(kv, hkv, d);
  return page + (is_v ? s.v : 0) + h * s.head + (t & (kv.page_tokens - 1)) * s.token;
}
#endif

}  // namespace kvs::cuda
