// SPDX-License-Identifier: Apache-2.0
// Quest's page bound, shared by the method and its tests.
#pragma once

namespace kvs {
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
}  // namespace kvs
