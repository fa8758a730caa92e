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

// The first launch of a decode step, which carries the step's argument block by value (no copy
// engine: a host-to-device copy of a few hundred bytes waits microseconds for one) and appends the
// new rows. It writes `bytes` (a multiple of 16, at most kStepArgsMax) of `host` to `dst`. Unless
// kv_at is kNoAppend, token pos[b] of each of `batch` sequences gets row b of k_new / v_new ([B,
// Hkv, d] contiguous, KV dtype), where pos is host[0..batch) (int32), sequence b's page table is the
// device pointer at host + tables_at + b * sizeof(void*), and k_new and v_new are the pointers at
// host + kv_at; only the page geometry of `kv` is read. The launch lets no dependent start early:
// those read `dst` before their pdl_wait. `launched` (optional) records the launch, so that a graph
// that captured it can be given another block (set_step_args).
constexpr size_t kStepArgsMax = 3584;
constexpr size_t kNoAppend = ~size_t(0);
struct StepArgsLaunch {
  const void* func = nullptr;  // the kernel (one per block capacity)
  int32_t capacity = 0;        // its block's bytes
  unsigned grid_x = 0, grid_y = 0, threads = 0;
  int32_t n16 = 0, page_tokens = 0, page_shift = 0, hkv = 0, vecs = 0, tables_at = 0, kv_at = 0;
  void* dst = nullptr;
};
Status upload_step_args(const void* host, size_t bytes, void* dst, const PagedKv& kv, int32_t batch,
                        int32_t num_kv_heads, int32_t head_dim, Scalar dtype, size_t tables_at, size_t kv_at,
                        void* stream, StepArgsLaunch* launched = nullptr) noexcept;
// Gives the captured launch `l` (the node `node` of the executable graph `exec`) the block `host`
// of `bytes` (as many as at its capture) for the graph's next launches.
Status set_step_args(void* exec, void* node, const StepArgsLaunch& l, const void* host, size_t bytes) noexcept;

// Assembles a batch page table: dst[b * max_pages + i] = src[b][i] for i < counts[b] (device arrays:
// src [B] of device page tables, counts [B]); entries past counts[b] are set to nullptr.
Status gather_page_tables(const void* const* const* src, const int32_t* counts, int32_t batch, int32_t max_pages,
                          const void** dst, void* stream) noexcept;

}  // namespace kvs::cuda
