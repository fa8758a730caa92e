// Quest's page bound, shared by the method and its tests.
#pragma once

namespace kvs {
// U_p = sum_i max(q_i M_i, q_i m_i) >= max_{j in page} q.k_j for M, m the element-wise max and min
// of the page's keys (Quest estimate.cu).
inline float quest_upper_bound(const float* q, const float* page_max, const float* page_min, int d) {
  float u = 0.f;
  for (int i = 0; i < d; ++i) {
    const float a = q[i] * page_max[i], b = q[i] * page_min[i];
    u += a > b ? a : b;
  }
  return u;
}
}  // namespace kvs
