// SPDX-License-Identifier: Apache-2.0
// Quest's page bound, shared by the method and its tests.
#pragma once
#include <algorithm>
#include <cstdint>

#include "core/dtype.hpp"

namespace kvs {
// Pages a step attends for n tokens in pages of page_size, budget k keys, the current (last) page
// included: page_budget=fit (the current page of c tokens plus floor((k - c) / page_size) pages; a
// budget below the current page attends its newest k tokens: skip = c - k of its oldest are left
// out) or pages (the authors' k / page_size, at least 1). Shared by the cpu and cuda implementations
// (the cuda kernels restate it in quest.cu's seq_plan).
struct QuestPagePlan {
  int64_t want = 0;  // pages attended, the current one included
  int64_t skip = 0;  // oldest tokens of the current page left out (fit only)
};
inline QuestPagePlan quest_page_plan(int64_t n, int64_t k, int64_t page_size, bool fit) {
  const int64_t pages = (n + page_size - 1) / page_size, cur = n - (pages - 1) * page_size;
  if (!fit) return {std::clamp<int64_t>(k / page_size, 1, pages), 0};
  if (k >= cur) return {std::min<int64_t>(pages, 1 + (k - cur) / page_size), 0};
  return {1, cur - k};
}

// U_p = sum_i max(q_i M_i, q_i m_i) >= max_{j in page} q.k_j for M, m the element-wise max and min
// of the page's keys (Quest estimate.cu). Sixteen independent partial sums let the compiler
// vectorise the loop (a single float accumulator would serialise it).
inline float quest_upper_bound(const float* q, const float* page_max, const float* page_min, int d) {
  float part[16] = {};
  int i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; ++l) {
      const float a = q[i + l] * page_max[i + l], b = q[i + l] * page_min[i + l];
      part[l] += a > b ? a : b;
    }
  float u = 0.f;
  for (; i < d; ++i) {
    const float a = q[i] * page_max[i], b = q[i] * page_min[i];
    u += a > b ? a : b;
  }
  for (int l = 0; l < 16; ++l) u += part[l];
  return u;
}

// The page scores of one KV head: score[p] = the sum over g = 0 .. ng - 1, in that order, of
// quest_upper_bound(q + g * d, max_p, min_p, d) for pages p in [0, pages), page p's bounds of head h
// at bounds + (p * hkv + h) * 2 * d (max then min). Bit for bit the scalar composition: the AVX-512
// and AVX2 paths keep its 16 partial sums as vector lanes and add them in its order, and the
// group's heads share each page's loads.
void quest_page_scores(const float* q, int ng, const float* bounds, int64_t pages, int hkv, int h, int d, float* score);
// The same over bounds stored in a 16-bit KV dtype t (bf16 or fp16; the bounds of such a KV are its
// values, so they hold them exactly): the same scores, bit for bit, from half the bytes.
void quest_page_scores16(const float* q, int ng, const uint16_t* bounds, DType t, int64_t pages, int hkv, int h, int d,
                         float* score);
// The instruction set quest_page_scores uses: 1 scalar, 2 AVX2, 3 AVX-512 (what the machine has,
// at most the limit). quest_simd_limit(level) caps it process-wide (0: no cap; for tests), and so
// does KVS_QUEST_SIMD=1|2|3 in the environment (read once); false for a level outside 0..3.
int quest_simd_level();
bool quest_simd_limit(int level);
}  // namespace kvs
