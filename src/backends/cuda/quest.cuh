// SPDX-License-Identifier: Apache-2.0
// Quest on CUDA (docs/methods.md; CPU reference src/methods/quest/quest.cpp): per-page key bounds
// kept on the device, and the decode-time page selection from them.
//
// Conventions as in cuda_attention.cuh (device pointers unless "host", enqueued on `stream`, no
// sync, no allocation, noexcept, Status); the KV cache is the paged layout of kv_layout.cuh.
// head_dim d: 64, 128 or 256. KV dtype: BF16 or F16.
//
// Bounds layout (one device buffer per sequence): [cap_pages][Hkv][2][d] in the KV dtype, the
// element-wise max (first d) then min (next d) of the stored keys of each Quest page of
// `page_size` tokens. The values are stored keys, so they are exact: the upper bound
// U_p = sum_i max(q_i M_i, q_i m_i) is never below the page's true max_j q.k_j. Each page's 2d
// elements start 16-byte aligned when the buffer does (it must).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kv_layout.cuh"

namespace kvs::cuda {

// Recomputes the bounds of the Quest pages overlapping tokens [t0, t1) of sequence b of `kv`
// (pages t0/page_size .. (t1-1)/page_size), each from all of its tokens < t1. Use t0 = 0 after a
// prefill and t1 - t0 = 1 after each append; the bounds of other pages are not touched.
// Requires 0 <= t0 <= t1 <= kv.max_pages * kv.page_tokens (t0 == t1: nothing to do),
// 1 <= page_size <= 4096, bounds 16-byte aligned with room for page (t1-1)/page_size.
// One launch: a warp per (page, KV head), 16-byte loads, max/min in the KV dtype (exact).
Status quest_update_bounds(const AttnShape& shape, const PagedKv& kv, Scalar kv_dtype, int32_t b,
                           int32_t t0, int32_t t1, int32_t page_size, void* bounds,
                           void* stream) noexcept;

// One decode step of Quest for a batch. For sequence b: n_b = clamp(lengths[b], 0, max_length),
// pages_b = ceil(n_b / page_size), want_b = min(clamp(budget_keys[b] / page_size, 1, pages_b),
// max_want) pages (the current, last page counted in: Quest's kernel-path page budget). A negative
// budget_keys[b] = -k asks for quest.cpp's page_budget=fit rounding instead: with c_b the tokens
// of the current page, want_b = min(1 + (k - c_b) / page_size, pages_b, max_want) where k >= c_b,
// else want_b = 1 and only the newest k tokens of the current page are listed. Pages
// 0..pages_b-2 are scored by U_p from bounds[b] (device array [B] of device pointers to the
// buffers above), either summed over the query group (per_query_head = false: H = Hkv rows, one
// page set per KV head) or per query head (true: H = Hq rows, query head h*G+g reads KV head h).
// The want_b - 1 best (ties: lower page) plus the last page are chosen, and their tokens are
// written ascending to out_idx[(b*H + r) * max_selected + i], i < out_cnt[b*H + r]; the rest of
// each row is -1. A sequence of length 0 lists nothing. Requires max_selected >= max_want *
// page_size (host: every list fits) and max_length >= 1.
// Query: [B, Hq, d], F32 or the KV dtype (by address or through q.at, as in cuda_attention.cuh).
// The bound is computed as
//   U_p = sum_i P_i M_i + N_i m_i,  P_i = sum_g max(q_gi, 0), N_i = sum_g min(q_gi, 0)
// (equal to the sum of the per-head bounds since M >= m), on tensor cores: P|N split into two
// 16-bit parts (hi + lo, relative error <= 2^-18 per term for bf16, 2^-22 for fp16) against the
// exact bounds, fp32 accumulation. With fp16 KV, |P_i| and |N_i| must stay below 65504.
// Steps (summed mode, rows whose scores fit in 16 CTAs' shared memory): 1 launch scoring and
// selecting in a thread-block cluster per row (the same scores and picks as the steps below), 1
// launch expanding pages to tokens. Otherwise: 1 launch scoring (each bound read once for the
// whole group, 16-byte loads), the row top-k of topk.cuh over the page scores (rows padded with
// +inf past each sequence's candidates so one host-side k = max_want - 1 serves every budget), 1
// launch expanding pages to tokens. The top-k is a programmatic dependent launch of the scoring;
// with pdl (see cuda_attention.cuh) the scoring (fused or not) and the expansion are too, the
// scoring reading q before the stream's previous kernel ends.
size_t quest_select_workspace_bytes(const AttnShape& shape, int32_t max_length, int32_t page_size,
                                    int32_t max_want) noexcept;
Status quest_select(const AttnShape& shape, const Query& q, Scalar kv_dtype, const void* const* bounds,
                    const int32_t* lengths, const int32_t* budget_keys, int32_t max_length,
                    int32_t page_size, int32_t max_want, bool per_query_head, int32_t* out_idx,
                    int32_t* out_cnt, int32_t max_selected, const Workspace& ws, void* stream,
                    bool pdl = false) noexcept;

namespace detail {
// Tiles of 8 pages each warp of the scoring kernel walks (0 = automatic). Benchmarking only.
bool set_quest_tiles_per_warp(int tiles) noexcept;
// The summed mode's fused scoring and top-k (one thread-block cluster per row): -1 = automatic
// (the default; the environment's KVS_QUEST_CLUSTER when set), 0 = never (score kernel + topk_rows),
// 1, 2, 4, 8 or 16 = that cluster size where the row's slices fit. Tests and benchmarks.
bool set_quest_cluster(int cluster) noexcept;
// The cluster size of the last quest_select call's fused kernel (0: the unfused kernels).
int quest_last_cluster() noexcept;
}  // namespace detail

}  // namespace kvs::cuda
