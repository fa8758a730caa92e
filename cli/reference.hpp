// SPDX-License-Identifier: Apache-2.0
// Exact attention in float64, the yardstick of `kvsieve eval` (and of `synth --stats`): the query of
// token t over keys 0..t, read from the trace in its stored dtype (so both sides see the same
// rounded inputs) and accumulated in double precision.
#pragma once

#include <cstdint>
#include <vector>

#include "common.hpp"

namespace kvcli {

struct ExactAttention {
  int64_t n = 0;              // keys 0..n-1 were attended (n = t + 1)
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  std::vector<double> prob;   // [q_heads, n]: softmax weights
  std::vector<double> out;    // [q_heads, head_dim]: o*
  std::vector<double> lse;    // [q_heads]: natural-log log-sum-exp of the scaled logits
  std::vector<int32_t> rank;  // [kv_heads, n] (if requested): rank of key j by the group's
                              // summed softmax, 0 = highest; ties broken by lower index

  const double* probs(int64_t q_head) const { return prob.data() + q_head * n; }
  const double* output(int64_t q_head) const { return out.data() + q_head * head_dim; }
  const int32_t* ranks(int64_t kv_head) const { return rank.data() + kv_head * n; }
};

// Computes exact attention of query row t of `q` ([T, Hq, d]) over rows 0..t of `k` and `v`
// ([T, Hkv, d]); query head h reads KV head h / (Hq / Hkv). Work is split over fixed key chunks, so
// the result does not depend on `threads`.
void exact_attention(const StridedArray& q, const StridedArray& k, const StridedArray& v, int64_t t,
                     double scale, bool want_ranks, unsigned threads, ExactAttention& out);

}  // namespace kvcli
