// SPDX-License-Identifier: Apache-2.0
// Small kernels over the paged device KV (kv_layout.cuh): writing rows into pages and assembling a
// batch's page table. Conventions of cuda_attention.cuh (device pointers, stream-ordered, Status,
// no allocation, graph-capturable).
#pragma once
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kv_layout.cuh"

namespace kvs::cuda {

// Writes rows [0, n) of src_k / src_v (each [n, Hkv, d] contiguous, KV dtype) as tokens t0 + i of
// sequence b of `kv` (whose pages must exist). One launch.
Status write_kv_rows(const PagedKv& kv, int32_t b, int32_t num_kv_heads, int32_t head_dim, Scalar dtype,
                     int32_t t0, int32_t n, const void* src_k, const void* src_v, void* stream) noexcept;

// The decode step's append for a batch: token pos[b] of sequence b (device int32 [B]) gets row b of
// k_new / v_new ([B, Hkv, d] contiguous, KV dtype). With kv_at (device [2]), their addresses are
// read from there when the kernel runs (a captured graph whose inputs move; k_new/v_new ignored).
// One launch; it lets a programmatic dependent launch that follows start at once (such a kernel
// waits for it before reading the KV: the `pdl` of cuda_attention.cuh).
Status append_kv_batch(const PagedKv& kv, int32_t batch, int32_t num_kv_heads, int32_t head_dim, Scalar dtype,
                       const int32_t* pos, const void* k_new, const void* v_new, void* stream,
                       const void* const* kv_at = nullptr) noexcept;

// Assembles a batch page table: dst[b * max_pages + i] = src[b][i] for i < counts[b] (device arrays:
// src [B] of device page tables, counts [B]); entries past counts[b] are set to nullptr.
Status gather_page_tables(const void* const* const* src, const int32_t* counts, int32_t batch, int32_t max_pages,
                          const void** dst, void* stream) noexcept;

}  // namespace kvs::cuda
