// SPDX-License-Identifier: Apache-2.0
// CSAttention's index build on CUDA (docs/methods/csattention.md; CPU reference build_index in
// src/methods/csattention/csattention.cpp, k-means in kmeans.cpp, list rules in csattention.hpp).
//
// Conventions as in cuda_attention.cuh (device pointers unless "host", enqueued on `stream`, no
// sync, no allocation, noexcept, Status); the KV cache is the paged layout of kv_layout.cuh.
//
// What is built, per table head h (TH = Hkv, or Hq with per_query_head: table head h then reads KV
// head h / G) and per subspace b (dims [off[b], off[b] + db[b]) of the head):
//  1. C unit centroids by spherical k-means over the sampled queries' sub-vectors, normalised:
//     X rows r * gq + g (r < sample_rows, g < gq; gq = G pooling the group's query heads h*G+g in
//     per-KV-head mode, gq = 1 with per_query_head reading query head h). Zero sub-vectors stay
//     zero and take no part. Seeding is k-means++ over the non-zero rows (D^2 = 2 - 2 max_j x.c_j),
//     then `iters` epochs of Sculley's mini-batch updates (per-centroid rate 1/count, touched
//     centroids projected back to the sphere after each batch; the K sequential updates of a
//     centroid within a batch are applied in their exact closed form (n0 c + sum x) / (n0 + K))
//     over a fresh pseudo-random permutation of the rows, or `iters` full-batch Lloyd iterations
//     (c_j = normalised sum of its rows, empty clusters keep their centroid) when full_batch. The
//     algorithm is kmeans.cpp's; the random stream is not (a counter-based hash keyed by
//     seed + h * 8191 + b, as the CPU keys its mt19937_64). Sums are accumulated in fixed point,
//     so the whole build is deterministic.
//  2. For every centroid j: s_t = c_j^(b) . k_t^(b) over the raw key sub-vectors of tokens t < N,
//     fp32 products summed in dimension order without FMA contraction, stored as fp16
//     (round-to-nearest-even) when f16_scores; the list is the top L tokens by (stored score desc,
//     token asc), written in ascending "worse" order (csattention.hpp: lowest score first, among
//     equal scores the larger token first), so each list is sorted and therefore a valid min-heap
//     for the CPU's heap code and streaming try-insert. (A stored score of -0 comes out as +0.)
//
// Output layout (row-major, like the CPU LayerState):
//   cent [TH][C * d] fp32: head h's subspace b is the C x db[b] block at h * C * d + C * off[b].
//   idx  [TH][m][C][L] int32, val [TH][m][C][L] (uint16 fp16 bits when f16_scores, else fp32).
//
// Launches (no host sync, no allocation; graph-capturable): one k-means kernel (a CTA per (h, b)
// problem: compaction + normalisation of the rows, seeding, updates; the centroids and batch sums
// live in shared memory when they fit in 200 KiB, else in `cent` and the workspace), then per
// table head: the score kernel ([m*C][N] fp32 scores in the workspace), topk_rows (topk.cuh) with
// k = L, and the ordering of the lists: a CTA per list sorting 64-bit keys (ordered score bits, then the complemented token)
// in shared memory (bitonic, L <= 16384), or for longer lists the keys in global memory through
// CUB's segmented radix sort (DeviceSegmentedRadixSort: one pass sequence, no host round trip;
// DeviceSegmentedSort is avoided because above 500 segments it copies group sizes to the host and
// synchronises).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kv_layout.cuh"

namespace kvs::cuda {

struct CsaBuildShape {
  int32_t tokens = 0;        // N: keys of the sequence to index (>= 1, <= kv.max_pages * P)
  int32_t num_q_heads = 0;   // Hq, a multiple of Hkv
  int32_t num_kv_heads = 0;  // Hkv
  int32_t head_dim = 0;      // d, 1..443 (the score kernel keeps 64 key rows and 64 centroid rows in shared memory)
  int32_t table_heads = 0;   // TH = Hkv, or Hq with per_query_head
  bool per_query_head = false;
  int32_t m = 0;                 // subspaces, 1 <= m <= 256 and m <= d
  const int32_t* off = nullptr;  // HOST [m]: first dim of subspace b (off[0] = 0, contiguous)
  const int32_t* db = nullptr;   // HOST [m]: dims of subspace b (1..512; the sizes sum to d)
  int32_t C = 0;                 // centroids per subspace, 1 <= C <= sample_rows * gq (caller clamps)
  int32_t L = 0;                 // list length, 1 <= L <= tokens
  bool f16_scores = true;        // val as fp16 bits (uint16) else fp32
};

// iters >= 0 (0: seeding only), batch >= 1 (mini-batch size; unused with full_batch), seed: the
// layer-mixed seed (the CPU's seed * 0x9E3779B97F4A7C15 + layer * 1000003); h * 8191 + b is
// added per problem here.
struct CsaKmeans {
  int32_t iters = 10;
  int32_t batch = 1024;
  bool full_batch = false;
  uint64_t seed = 0;
};

// Workspace of csa_build for this shape and sample size (0 on an invalid shape). Holds, 256-byte
// aligned each: the normalised query rows (4 * sample_rows * Hq * d bytes in either mode), per
// (h, b) problem 4 bytes per pooled row (sample_rows * gq) and 8 per centroid, fixed-point
// centroid sums (8 * TH * C * d; used only when the k-means state overflows shared memory), the
// scores of one table head (4 * m * C * N bytes: 256 MiB at N = 128K, m * C = 512) and its lists'
// top-L tokens (4 * m * C * L); lists longer than 16384 add two arrays of 64-bit sort keys
// (16 * m * C * L), the segment offsets and CUB's scratch. Same device current as the call.
size_t csa_build_workspace_bytes(const CsaBuildShape& s, int32_t sample_rows) noexcept;

// q_sample: device fp32 [sample_rows][Hq][d] (the sampled prompt queries, sample_rows >= 1);
// kv: one sequence (B = 1: page table row 0) in the paged layout, kv_dtype BF16 or F16.
// Writes cent, idx and val as described above (every element). The workspace must have at least
// csa_build_workspace_bytes(s, sample_rows) bytes, 256-byte aligned.
Status csa_build(const CsaBuildShape& s, const CsaKmeans& km, const float* q_sample, int32_t sample_rows,
                 const PagedKv& kv, Scalar kv_dtype, float* cent, int32_t* idx, void* val,
                 const Workspace& ws, void* stream) noexcept;

// The token-ordered copy of `lists` heaps idx/val [lists][L] (fp16 bits or fp32 scores):
// sidx/sval [lists][Lcap] sorted by token, scnt[lists] = L (Lcap >= L). Sorts chunks of lists with
// cub (not for capture: it runs at index build, load and move). Workspace: the bytes below.
size_t csa_token_lists_workspace_bytes(int64_t lists, int32_t L, bool f16_scores) noexcept;
Status csa_token_lists(int64_t lists, int32_t L, int32_t Lcap, bool f16_scores, const int32_t* idx, const void* val,
                       int32_t* sidx, void* sval, int32_t* scnt, const Workspace& ws, void* stream) noexcept;

}  // namespace kvs::cuda
