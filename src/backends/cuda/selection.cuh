// SPDX-License-Identifier: Apache-2.0
// Position-only token selections on CUDA (no scoring): StreamingLLM's sinks + recent window
// (docs/methods.md; CPU reference src/methods/streaming/streaming.cpp).
//
// Conventions as in cuda_attention.cuh: device pointers unless "host", enqueued on `stream`, no
// sync, no allocation, noexcept, Status.
#pragma once
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"

namespace kvs::cuda {

// StreamingLLM for a batch: for every (b, h < H) the tokens [0, s') then [max(s', n_b - w_b), n_b)
// ascending, with n_b = max(lengths[b], 0); window > 0: s' = min(sinks, n_b), w_b = window;
// window = 0: s' = min(sinks, n_b, k >= 2 ? max(1, k / 8) : 0) with k = budget_keys[b] (the sinks
// scaled into the budget) and w_b = max(1, k - s') (the budget minus the sinks). Every head of a sequence gets the same list (H = Hkv for the gathered decode's per-KV-
// head lists). out_idx [B, H, max_selected] (-1 past the count), out_cnt [B, H] = the count.
// max_selected (host) must be >= every count (e.g. sinks + window, or sinks + the largest
// budget); a longer list is cut to its first max_selected tokens (never written out of bounds).
// budget_keys may be null when window > 0. One launch.
Status window_select(int32_t B, int32_t H, const int32_t* lengths, const int32_t* budget_keys,
                     int32_t sinks, int32_t window, int32_t* out_idx, int32_t* out_cnt,
                     int32_t max_selected, void* stream) noexcept;

}  // namespace kvs::cuda
