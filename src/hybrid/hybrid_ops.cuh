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
  int32_t batch = 0, heads = 0, head_dim = 0;
  void* o = nullptr;                 // [B * Hq, d] in o_dtype (F32, BF16 or F16)
  Scalar o_dtype = Scalar::F32;
  float* lse = nullptr;              // [B * Hq] fp32, or null; base 2 where lse_base2[b]
  const uint8_t* lse_base2 = nullptr;  // [B] device-readable, or null (natural log)
};

Status combine_states(const CombineArgs& a, void* stream) noexcept;

}  // namespace kvs::cuda
