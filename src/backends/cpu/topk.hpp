// Top-k selection helpers (CPU).
#pragma once
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kvs::cpu {

// Appends to out the indices of the k largest scores among candidates (all of [0, n) when
// candidates is empty... use the overload below). Ties broken by lower index. Order unspecified.
inline void topk_of(const float* scores, std::vector<int32_t>& cand, int64_t k, std::vector<int32_t>& out) {
  k = std::min<int64_t>(k, int64_t(cand.size()));
  if (k <= 0) return;
  auto better = [&](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), better);
  out.insert(out.end(), cand.begin(), cand.begin() + k);
}

}  // namespace kvs::cpu
