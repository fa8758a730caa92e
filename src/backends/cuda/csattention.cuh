// SPDX-License-Identifier: Apache-2.0
// CSAttention's decode step on CUDA (CPU reference: src/methods/csattention/csattention.cpp; the
// method: docs/methods/csattention.md): the streaming list update, the search (nearest centroid per
// subspace and query head, the picked lists reduced by key, the top of the sums) and the step's
// selection (sinks, searched keys, recent window), for a batch of sessions; and the prompt-query
// sample kept for the index build.
//
// Conventions as in cuda_attention.cuh (device pointers unless "host", enqueued on `stream`, no
// sync, no allocation, noexcept, Status); the KV cache is the paged layout of kv_layout.cuh.
//
// Tables of one session and layer (the tables file's layout, csattention.cpp):
//   cent [TH][C * d] fp32: table head h, subspace b: a C x db[b] block at offset C * off[b]
//   idx  [TH][m][C][L] int32, val [TH][m][C][L] fp16 bits or fp32: per (h, b, centroid j) a list of
//        L (token, stored score) entries kept as a binary min-heap under csa::worse (lower score,
//        or equal score and later token, is worse; the root is the worst entry)
//   sidx [lists][Lcap] int32, sval [lists][Lcap], scnt [lists]: the same lists in token order
//        (the device's copy for the search, lists = TH * m * C, Lcap > L): entries [0, scnt) with
//        ascending tokens, of which L are live; an entry evicted by the streaming update keeps its
//        token and gets the dead score (all bits set: NaN); new tokens are appended (they are
//        larger than every listed token), and a full list is compacted first (made by
//        csa_token_lists, csa_build.cuh).
// TH = Hkv (per-KV-head tables; table head h reads KV head h) or Hq (per_query_head: h reads KV
// head h / G).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kv_layout.cuh"

namespace kvs::cuda {

constexpr int kCsaMaxSubspaces = 64;

// What the sessions of a batch share (the method's parameters).
struct CsaConfig {
  int32_t m = 0;                      // subspaces (<= kCsaMaxSubspaces)
  int32_t off[kCsaMaxSubspaces] = {}; // first dim of subspace b
  int32_t db[kCsaMaxSubspaces] = {};  // its dims
  float w[kCsaMaxSubspaces] = {};     // w_b
  int32_t TH = 0;                     // table heads
  bool per_query_head = false;        // tables per query head
  bool group_sum = false;             // per KV head: the group's summed query picks (weight G)
  bool qnorm = false;                 // weight ||q^(b)||
  bool missing_min = false;           // a key absent from a picked list scores the list's minimum
  bool f16_scores = true;             // list scores fp16 (else fp32)
  double rerank = 0;                  // r > 0: exact rerank of the r * rest best candidates
  float scale = 1.f;                  // softmax scale of the rerank's logits
};

// One session's tables and step (device memory, uploaded per step: csa_select reads it at run time,
// so a captured step replays with new values).
struct CsaSession {
  const float* cent;
  int32_t* idx;
  void* val;
  int32_t* cached;      // [TH][cached_cap]: the period's last search, ascending tokens
  int32_t* cached_cnt;  // [TH]
  int32_t* sidx;        // the token-ordered lists (above)
  void* sval;
  int32_t* scnt;
  int32_t C, L, cached_cap, Lcap;
  int32_t n;            // tokens after the step's append
  int32_t ins_from;     // tokens [ins_from, n) enter the lists first (the streaming update)
  int32_t s_end, w_begin, s_emit, w_emit, rest;  // csa::StepKeys
  int32_t search;       // 1: search this step; 0: reuse the cached search; 2: attend every key (no index)
};

// One decode step for B sessions (sessions: device [B]): the streaming update of tokens
// [ins_from, n), then per session and table head the selection rows out_idx[(b * TH + h) *
// max_selected + i], i < out_cnt[b * TH + h] (ascending tokens; -1 past the count): sinks
// [0, s_emit), the searched keys, the window [w_emit, n). A search (search = 1) picks, per query
// head of the group (or the group's summed query, or the table head's own query head) and
// subspace, the centroid of largest c . q^(b) (the lowest index among equal ones), sums
// w * stored score (+ the list-minimum offset) per key over the distinct picked lists, and keeps
// the `rest` best keys of [s_end, w_begin) that any picked list holds (ties: lower token), storing
// them as the session's cached search; search = 0 emits the cached keys within [s_end, w_begin).
// With cfg.rerank = r > 0 the llround(r * rest) best are kept first and, when more than `rest` of
// them were touched, scored exactly (scale * q . k per query head of the row: the table head's own,
// or the group's G), each head's softmax taken over them, and the `rest` best by the summed weights
// kept (csattention.cpp rerank_exact).
// A searching session's token-ordered lists (sidx, sval, scnt, Lcap) must be current (the update
// keeps them so when they have room for the step's new tokens: csa_token_lists makes them afresh).
// Host capacities: max_rest >= every rest (the top-k's k), max_length >= every n, max_selected >=
// every row's count (a longer row is cut, never written out of bounds); the launch shapes depend on
// these, B and the config only (a captured step replays while they hold).
// G = Hq / Hkv picks per subspace at most 1 (per query head, group_sum) or G.
size_t csa_select_workspace_bytes(const CsaConfig& cfg, int32_t B, int32_t num_q_heads, int32_t num_kv_heads,
                                  int32_t max_length, int32_t max_rest) noexcept;
Status csa_select(const CsaConfig& cfg, const CsaSession* sessions, int32_t B, int32_t num_q_heads,
                  int32_t num_kv_heads, int32_t head_dim, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                  int32_t max_length, int32_t max_rest, int32_t* out_idx,
                  int32_t* out_cnt, int32_t max_selected, const Workspace& ws, void* stream) noexcept;

// The prompt-query sample (csattention.cpp on_prefill): rows i of q [n][Hq][d] (F32, BF16 or F16)
// whose token t0 + i is a multiple of `stride` are converted to fp32 and written to
// dst[(first + j) * Hq * d ...] in order, j = 0, 1, ... (the caller counts them). One launch.
Status csa_sample_rows(const void* q, Scalar q_dtype, int32_t n, int32_t row_elems, int64_t t0, int64_t stride,
                       float* dst, int32_t first, void* stream) noexcept;

}  // namespace kvs::cuda
