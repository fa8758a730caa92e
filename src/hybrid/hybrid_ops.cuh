// SPDX-License-Identifier: Apache-2.0
// The hybrid placement's own kernel: the exact LSE merge of the step's GPU attention states with
// the state its host part computed (read in place from pinned memory), written in the caller's
// dtype. Conventions of backends/cuda/cuda_attention.cuh (stream-ordered, Status, no allocation).
#pragma once
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"

namespace kvs::cuda {

struct CombineArgs {
  // Up to 3 fp32 states on the device: o [B * Hq, d], lse [B * Hq] (natural log; -inf = empty).
  const float* dev_o[3] = {nullptr, nullptr, nullptr};
  const float* dev_lse[3] = {nullptr, nullptr, nullptr};
  int32_t num_dev = 0;
  // The host part's state (pinned host memory, read in place): o [B * Hq, d], lse [B * Hq];
  // session b's rows are used only where host_on[b] != 0. Null: none.
  const float* host_o = nullptr;
  const float* host_lse = nullptr;
  const uint8_t* host_on = nullptr;  // [B], device-readable (pinned)
  // Session b's device states are used only where dev_on[b] != 0 (device-readable); null: always.
  const uint8_t* dev_on = nullptr;
  int32_t batch = 0, heads = 0, head_dim = 0;
  void* o = nullptr;                 // [B * Hq, d] in o_dtype (F32, BF16 or F16)
  Scalar o_dtype = Scalar::F32;
  float* lse = nullptr;              // [B * Hq] fp32, or null; base 2 where lse_base2[b]
  const uint8_t* lse_base2 = nullptr;  // [B] device-readable, or null (natural log)
};

Status combine_states(const CombineArgs& a, void* stream) noexcept;

// ---- The static set's ring (Method::static_keys) ----
// A session's ring of one layer holds the first S tokens in slots [0, S) and the last W tokens
// t >= S in slots S + (t - S) % W, as pages of kRingPageTokens slots in kvsieve's page layout
// (kv_layout.cuh), contiguous from `base`, page_bytes apart.
constexpr int32_t kRingPageTokens = 64, kRingPageShift = 6;
// The slot of token t (-1: the ring does not hold it).
KVS_KV_HD int64_t ring_slot(int64_t t, int64_t S, int64_t W) { return t < S ? t : W > 0 ? S + (t - S) % W : -1; }

struct RingSession {
  void* base = nullptr;
  int32_t S = 0, W = 0;
  int32_t n = 0;                   // the layer's tokens after this step's append (the new one is n - 1)
  int32_t sinks = 0, recent = 0;   // this step's static set: [0, sinks) and [n - recent, n)
};
constexpr int kRingBatch = 32;
struct RingStep {
  RingSession s[kRingBatch];
  int32_t count = 0;               // sessions in this launch: batch rows b0 .. b0 + count - 1
  int32_t b0 = 0;
  int32_t hkv = 0, head_dim = 0;
  Scalar dtype = Scalar::BF16;     // of the KV (bf16 or fp16)
  int32_t max_pages = 0;           // page table entries per session
  int32_t idx_cap = 0;             // row stride of idx
  int64_t page_bytes = 0;
  const void* k_new = nullptr;     // [B][Hkv][d], device
  const void* v_new = nullptr;
  const void** table = nullptr;    // [B * max_pages], device: written
  int32_t* idx = nullptr;          // [B * Hkv][idx_cap], device: this step's static slots per KV head
  int32_t* cnt = nullptr;          // [B * Hkv], device
};
// One launch per kRingBatch sessions: writes the new token's K/V rows into their slots (when the
// ring holds the token), the sessions' page tables and the static set's slot lists.
Status ring_step(const RingStep& a, void* stream) noexcept;

}  // namespace kvs::cuda
