// SPDX-License-Identifier: Apache-2.0
// exact_topk on CUDA: the score pass over the paged KV cache and a row-wise radix top-k.
//
// exact_topk (the oracle) scores every key of a sequence and attends only the best k of them. The
// two steps here are separate calls so that other methods can reuse the top-k on their own scores:
//   topk_scores: one pass over K (each K row read once for its whole query group) writes a score
//                per (sequence, head, token); forced tokens (sinks, local window) get +inf.
//   topk_rows:   the indices of the k largest scores of each row, in ascending index order, by a
//                radix select (histograms of 11, 11, 10 key bits), never a sort of the whole row.
// Conventions (Status, Scalar, AttnShape, Query, Workspace, device pointers, stream ordering, no
// host sync, no allocation, noexcept) are those of cuda_attention.cuh; the KV layout is
// kv_layout.cuh. Plain C++: compiles without nvcc.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kv_layout.cuh"

namespace kvs::cuda {

// ---- Row-wise top-k ------------------------------------------------------------------------------
// Row r in [0, rows) holds len_r = clamp(lengths ? lengths[r] : max_len, 0, max_len) scores at
// scores[r * row_stride + t], t < len_r (device fp32; lengths device int32 [rows] or null). Writes
// the indices t of the min(k, len_r) largest scores to out_idx[r * k + i] in ASCENDING index order;
// slots past the count are -1; out_cnt[r] = min(k, len_r) (device int32 [rows]; may be null).
// Order: NaN is lower than every other value (-inf included), -0 equals +0, +inf is allowed (forced
// keys); ties at the threshold value go to the lowest indices, so the result is deterministic.
// Limits: k >= 1 (k = 0 is accepted: only out_cnt[r] = 0 is written), rows >= 1, 0 <= max_len,
// row_stride >= max_len when rows > 1.
// How: rows of at most 16384 scores (max_len) take one CTA of 1024 threads each, the keys in
// registers (up to 16 per thread), four passes of 8-bit digits at most, one block scan to write.
// Longer rows take one thread-block cluster (1 to 16 CTAs of 1024 threads, chosen per (rows,
// max_len) from the device's cluster occupancy) per row; each CTA owns a contiguous slice of the row, keeps its keys
// in shared memory when they fit (up to 176 KB, else re-reads them from global/L2 each pass), and the
// cluster adds its slice histograms in distributed shared memory. Three histogram passes at most
// (fewer when the threshold bin is taken whole); each slice's counts come from its histograms; one
// write pass (warp scans place each selected index at its rank). One launch (a programmatic
// dependent launch: it may start while the previous kernel on the stream finishes, and waits for
// it), no workspace (workspace bytes = 0), fixed launch configuration for given (rows, max_len, k)
// on a given device; graph-capturable.
size_t topk_rows_workspace_bytes(int32_t rows, int32_t max_len, int32_t k) noexcept;
// row_k (optional, device int32 [rows]): row r keeps min(clamp(row_k[r], 0, k), len_r) instead,
// read at run time like the lengths (so one launch, or one captured graph, serves per-row budgets
// that change between calls); k is then the capacity and the output stride.
// neg_zero_absent: a score of -0.0 (bits 0x80000000) marks an absent element, ranked with NaN
// below every value (csattention's untouched keys); by default -0 equals +0.
Status topk_rows(const float* scores, int64_t row_stride, const int32_t* lengths, int32_t rows,
                 int32_t max_len, int32_t k, int32_t* out_idx, int32_t* out_cnt,
                 const Workspace& ws, void* stream, const int32_t* row_k = nullptr,
                 bool neg_zero_absent = false) noexcept;

// ---- Score pass of exact_topk ----------------------------------------------------------------------
// One query token per sequence b (q: [B, Hq, d]), keys of the paged cache `kv` (kv_layout.cuh) in
// kv_dtype (BF16 or F16); lengths: device int32 [B] (clamped to [0, max_length]); max_length must
// not exceed kv.max_pages * kv.page_tokens. Writes scores[(b * H + h) * max_length + t] for
// t < lengths[b] (nothing past it):
//   per_query_head = false: H = Hkv, s = sum_{g<G} softmax_{h*G+g}(scale * q_{h*G+g} . k_t)_t
//                           (each query head's softmax over all lengths[b] keys, forced ones
//                           included, exactly normalised)
//   per_query_head = true:  H = Hq, s = scale * q_h . k_t (the logit; same order as the softmax)
// Tokens t < sinks or t >= lengths[b] - local get +inf (forced: topk_rows then keeps them first).
// Query dtype F32 or kv_dtype; head dims 64, 128, 256; any G = Hq / Hkv >= 1 (groups of more than
// 8 heads read K once per 8 heads). Arithmetic fp32 (q pre-scaled, fp32 dot products and sums).
// max_length <= 2^31 - 8193. per_query_head = false needs a workspace: the group's fp32 logits,
// B * Hkv * ceil(G/8) * GT * max_length * 4 bytes (GT = G rounded up to 1, 2, 4 or 8, at most 8;
// i.e. 4 * Hq bytes per token when G is 1, 2, 4 or 8), plus per-chunk softmax statistics
// (B * Hq * ceil(max_length / 256) * 8 bytes); per_query_head = true needs none. Two launches at
// most (the second a programmatic dependent launch).
size_t topk_scores_workspace_bytes(const AttnShape& shape, int32_t max_length) noexcept;
Status topk_scores(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                   const int32_t* lengths, int32_t max_length, bool per_query_head,
                   int32_t sinks, int32_t local, float* scores, const Workspace& ws,
                   void* stream) noexcept;

// ---- Score pass and top-k in one call (exact_topk's group mode) -------------------------------------
// topk_scores(shape, q, kv, kv_dtype, lengths, max_length, per_query_head = false, sinks, local,
// scores, ws) followed by topk_rows(scores, max_length, row_len, B * Hkv, max_length, k, out_idx,
// out_cnt, {}, stream, row_k): the same indices and counts (row r = b * Hkv + h; row_len, row_k:
// device int32 [B * Hkv], as topk_rows takes them; row_len[b * Hkv + h] must not exceed lengths[b],
// which exact_topk keeps equal). Where the rows are longer than 16384 keys and G <= 8, the summed
// probabilities need not reach global memory: one cluster kernel computes each slice of a row from
// the logits in shared memory and selects there (the softmax sum and the top-k's first read in one
// pass), and `scores` ([B * Hkv, max_length] fp32) may be left unwritten. Elsewhere (and where no
// cluster size fits the slices in shared memory, past about 700K keys) the calls above run as they
// are. Workspace: topk_scores_workspace_bytes.
// KVS_TOPK_FUSED=0 in the environment (read once) takes the unfused path everywhere (benchmarks).
Status topk_group_select(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                         const int32_t* lengths, int32_t max_length, int32_t sinks, int32_t local,
                         const int32_t* row_len, const int32_t* row_k, int32_t k, float* scores,
                         int32_t* out_idx, int32_t* out_cnt, const Workspace& ws, void* stream) noexcept;

namespace detail {
// Benchmarks only, process-wide (0 = automatic): topk_rows' cluster size (1, 2, 4, 8 or 16) and
// the score pass's tokens per CTA.
void set_topk_tuning(int cluster, int score_chunk) noexcept;
// The cluster size of the last topk_rows or fused topk_group_select launch in this process.
int32_t topk_rows_last_cluster() noexcept;
// Tests and benchmarks, process-wide: the group mode's logits on the tensor cores (the default,
// for head_dim <= 128 and groups of 3 or more query heads) or on the CUDA cores (also
// KVS_TOPK_SCORE_MMA=0 in the environment).
void set_topk_score_mma(bool on) noexcept;
}  // namespace detail

}  // namespace kvs::cuda
