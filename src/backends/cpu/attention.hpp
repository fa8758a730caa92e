// SPDX-License-Identifier: Apache-2.0
// CPU attention kernels for one decode query per head: dense over a layer's keys [0, n), and
// gathered over index lists. Work is split over KV heads and chunks of keys; every chunk yields an
// attention state (o, lse) for each query head of its group, and the states are merged exactly
// (docs/architecture.md). A KV head's keys and values are read once for its whole GQA group.
#pragma once
#include <cstdint>
#include <vector>

#include "core/kv_store.hpp"
#include "core/thread_pool.hpp"

namespace kvs::cpu {

// q: [Hq][d] fp32, Hq = G * Hkv; o: [Hq][d] fp32; lse: [Hq] (natural log). scale multiplies q.k.
void attend_dense(const KVLayer& kv, const float* q, int G, int64_t n_keys, float scale, float* o,
                  float* lse, ThreadPool& pool);

// lists[h] for each KV head (size Hkv): token indices < kv.size(), no duplicates. An empty list
// gives the empty state (lse = -inf, o = 0).
void attend_gather_kv(const KVLayer& kv, const float* q, int G,
                      const std::vector<std::vector<int32_t>>& lists, float scale, float* o,
                      float* lse, ThreadPool& pool);

// Whether the G query heads of KV head h hold equal lists (lists[h * G, h * G + G) exist and match).
bool group_shares_list(const std::vector<std::vector<int32_t>>& lists, int h, int G);

// lists[hq] for each query head (size Hq). A KV head whose G lists are equal is attended as a
// group (its rows read once for the G heads).
void attend_gather_q(const KVLayer& kv, const float* q, int G,
                     const std::vector<std::vector<int32_t>>& lists, float scale, float* o,
                     float* lse, ThreadPool& pool);

// (o_a, lse_a) <- merge((o_a, lse_a), (o_b, lse_b)) for H heads of dimension d.
void merge_states(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int H, int d);

// Scores s[g][j] = scale * q_g . k_t for the G query heads of KV head h and keys t in [0, n).
// out: [G][n]. Used by exact_topk and by methods that need exact scores.
void score_keys(const KVLayer& kv, int h, const float* q_group, int G, int64_t n, float scale,
                float* out, ThreadPool& pool);

// Serial kernels over caller-provided rows (dtype t, d elements each), for methods that schedule
// their own tasks (HGCA's window and far part). q: [G][d], unscaled.
// attend_rows: o [G][d], lse [G] over rows k_rows[i], v_rows[i], i < n (n = 0: the empty state).
void attend_rows(DType t, int d, int G, const float* q, float scale, const std::byte* const* k_rows,
                 const std::byte* const* v_rows, int64_t n, float* o, float* lse);
// score_rows: out[g * ld + i] = scale * q_g . k_rows[i] (ld = 0: n, out [G][n]). A row's score is
// the same whichever range of rows a call covers when ranges start at multiples of 64 (the block
// kernel's blocks), so a method may score parts of its rows on several threads.
void score_rows(DType t, int d, int G, const float* q, float scale, const std::byte* const* k_rows, int64_t n,
                float* out, int64_t ld = 0);
// score_contig: out[g][i] = scale * q_g . row_i for n rows stored contiguously at rows (row i at
// rows + i * d elements of dtype t), with the block kernel's score pass (the SIMD kernels of the
// dense decode; several keys and heads per pass). out: [G][n]. For methods that score a matrix of
// centroids per step (a GEMV over n x d). ld as for score_rows.
void score_contig(DType t, int d, int G, const float* q, float scale, const std::byte* rows, int64_t n, float* out,
                  int64_t ld = 0);
// accumulate_rows: o[g] += sum_i w[g * ldw + i] * v_rows[i] for i < n (o: [G][d] fp32). With
// score_rows and exp_shift, attention over rows whose scores a method already holds (HGCA's window
// and its widened far set): the K rows are not read again.
void accumulate_rows(DType t, int d, int G, const float* w, int64_t ldw, const std::byte* const* v_rows, int64_t n,
                     float* o);
// Rows of scores to softmax weights in place: for g < G, x[g * ld + i] (i < n) becomes
// exp(x - lse_g), lse_g = log sum_i exp(x[g * ld + i]) written to lse[g] (n >= 1).
void softmax_rows(float* x, int G, int64_t n, int64_t ld, float* lse);
// max(x[0..n)), -inf for n = 0 (NaNs are skipped), in eight independent lanes.
float max_of(const float* x, int64_t n);
// The index of the first maximum of x[0..n) (NaNs are skipped; 0 when n = 0 or every value is NaN):
// max_of, then the first position holding it, eight values at a time. The k-means assignments'
// argmax over a row of centroid similarities, without a running maximum's dependency chain.
int64_t argmax(const float* x, int64_t n);
// x[i] <- exp(x[i] - m) for n values with the vectorised exponential of the softmax update (|rel
// err| < 2e-7; arguments are clamped to [-87.3, 88.3], so -inf gives ~1e-38, not 0); returns the
// sum of the results (fp32 SIMD partial sums added in fp64).
double exp_shift(float* x, int64_t n, float m);

}  // namespace kvs::cpu
