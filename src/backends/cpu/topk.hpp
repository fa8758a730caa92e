// SPDX-License-Identifier: Apache-2.0
// Top-k selection helpers (CPU).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
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

// Order-preserving uint32 image of a float (larger float, larger key; -0.0 below +0.0).
inline uint32_t float_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u ^ (uint32_t(int32_t(u) >> 31) | 0x80000000u);
}
inline float key_float(uint32_t k) {
  const uint32_t u = k ^ ((k & 0x80000000u) ? 0x80000000u : 0xFFFFFFFFu);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// The k-th largest of x[0, n) (1 <= k <= n; k <= 0 gives +inf, k > n gives -inf): the value std::nth_element with std::greater puts at
// position k - 1, for inputs without NaN or -0.0 (here -0.0 would rank below +0.0). A radix
// select on the order-preserving bit pattern (11 + 11 + 10 bits): no data-dependent branches.
// tmp: scratch (grown to n).
inline float kth_largest(const float* x, int64_t n, int64_t k, std::vector<uint32_t>& tmp) {
  // Outside 1 <= k <= n there is no k-th value: the bucket walk below would run off the histogram.
  if (n <= 0 || k <= 0) return std::numeric_limits<float>::infinity();   // admits nothing
  if (k > n) return -std::numeric_limits<float>::infinity();              // admits everything
  if (int64_t(tmp.size()) < n) tmp.resize(size_t(n));
  uint32_t* keys = tmp.data();
  uint32_t hist[4][2048];
  std::memset(hist, 0, sizeof(hist));
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int l = 0; l < 4; ++l) ++hist[l][float_key(x[i + l]) >> 21];
  for (; i < n; ++i) ++hist[0][float_key(x[i]) >> 21];
  int64_t kk = k;
  int b = 2047;
  for (;; --b) {
    const int64_t c = int64_t(hist[0][b]) + hist[1][b] + hist[2][b] + hist[3][b];
    if (kk <= c) break;
    kk -= c;
  }
  int64_t m = 0;
  for (i = 0; i < n; ++i) {
    const uint32_t key = float_key(x[i]);
    keys[m] = key;
    m += (key >> 21) == uint32_t(b);
  }
  uint32_t prefix = uint32_t(b) << 21;
  const int shifts[2] = {10, 0};
  const uint32_t masks[2] = {2047u, 1023u};
  for (int pass = 0; pass < 2; ++pass) {
    const int sh = shifts[pass];
    const uint32_t mk = masks[pass];
    std::memset(hist, 0, sizeof(hist));
    for (i = 0; i + 4 <= m; i += 4)
      for (int l = 0; l < 4; ++l) ++hist[l][(keys[i + l] >> sh) & mk];
    for (; i < m; ++i) ++hist[0][(keys[i] >> sh) & mk];
    int d = int(mk);
    for (;; --d) {
      const int64_t c = int64_t(hist[0][d]) + hist[1][d] + hist[2][d] + hist[3][d];
      if (kk <= c) break;
      kk -= c;
    }
    prefix |= uint32_t(d) << sh;
    if (pass == 0) {
      int64_t w = 0;
      for (i = 0; i < m; ++i) {
        const uint32_t key = keys[i];
        keys[w] = key;
        w += ((key >> sh) & mk) == uint32_t(d);
      }
      m = w;
    }
  }
  return key_float(prefix);
}

// Appends to out the tokens of the k best of n (token, score) pairs given in token-ascending
// order: scores descending, ties to the lower token, written in token order (all n when k >= n).
// The k-th score by kth_largest, then one pass. tmp: kth_largest's scratch.
inline void append_top_k(const int32_t* tok, const float* sc, int64_t n, int64_t k, std::vector<int32_t>& out,
                         std::vector<uint32_t>& tmp) {
  if (k <= 0) return;
  if (k >= n) {
    out.insert(out.end(), tok, tok + n);
    return;
  }
  const float vk = kth_largest(sc, n, k, tmp);
  int64_t above = 0;
  for (int64_t i = 0; i < n; ++i) above += sc[i] > vk;
  int64_t ties = k - above;
  for (int64_t i = 0; i < n; ++i) {
    const float v = sc[i];
    if (v > vk || (v == vk && ties-- > 0)) out.push_back(tok[i]);
  }
}
}  // namespace kvs::cpu
