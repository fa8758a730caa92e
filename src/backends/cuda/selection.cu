// SPDX-License-Identifier: Apache-2.0
// Position-only selections on CUDA: see selection.cuh. A thread per output slot; the list of
// (b, h) is recomputed from n_b in every thread (a few integer operations), so one launch writes
// every slot, padding included.
#include "backends/cuda/selection.cuh"

#include <cuda_runtime.h>

#include <cstdint>

#include "kvsieve/kvsieve.h"

namespace kvs::cuda {
namespace {

constexpr int kThreads = 256;

struct WindowArgs {
  const int32_t* lengths;
  const int32_t* budget;
  int32_t H, sinks, window, max_selected;
  int32_t* out_idx;
  int32_t* out_cnt;
};

__global__ void __launch_bounds__(kThreads) window_kernel(WindowArgs a) {
  const int r = blockIdx.x, b = r / a.H;
  const int n = max(a.lengths[b], 0);
  // window = 0: sinks capped at budget / 8 (at least 1 where the budget is >= 2 keys, none at 1)
  // and the window the rest of the budget (streaming.cpp's streaming_sinks rule).
  int s = min(a.sinks, n), w = a.window;
  if (a.window == 0) {
    const int k = a.budget[b];
    s = min(s, k >= 2 ? max(1, k / 8) : 0);
    w = max(1, k - s);
  }
  const int start = max(s, n - w);  // first recent token (n - w may be negative)
  const int cnt = min(s + (n - start), a.max_selected);
  const int pos = blockIdx.y * kThreads + threadIdx.x;
  if (pos == 0) a.out_cnt[r] = cnt;
  if (pos >= a.max_selected) return;
  int v = -1;
  if (pos < cnt) v = pos < s ? pos : start + (pos - s);
  a.out_idx[size_t(r) * a.max_selected + pos] = v;
}

}  // namespace

Status window_select(int32_t B, int32_t H, const int32_t* lengths, const int32_t* budget_keys,
                     int32_t sinks, int32_t window, int32_t* out_idx, int32_t* out_cnt,
                     int32_t max_selected, void* stream) noexcept {
  if (B < 1 || H < 1 || int64_t(B) * H > (int64_t(1) << 31) - 1)
    return Status{KVS_STATUS_INVALID_ARGUMENT, 0, "window_select: B and H must be >= 1"};
  if (sinks < 0 || window < 0)
    return Status{KVS_STATUS_INVALID_ARGUMENT, 0, "window_select: sinks and window must be >= 0"};
  if (max_selected < 1 || (max_selected + kThreads - 1) / kThreads > 65535)
    return Status{KVS_STATUS_INVALID_ARGUMENT, 0, "window_select: max_selected must be in [1, 16M]"};
  if (lengths == nullptr || out_idx == nullptr || out_cnt == nullptr || (window == 0 && budget_keys == nullptr))
    return Status{KVS_STATUS_INVALID_ARGUMENT, 0, "window_select: null pointer argument"};
  WindowArgs a{lengths, budget_keys, H, sinks, window, max_selected, out_idx, out_cnt};
  dim3 grid(unsigned(int64_t(B) * H), unsigned((max_selected + kThreads - 1) / kThreads));
  window_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status{KVS_STATUS_BACKEND, int32_t(e), "window kernel launch"};
  return {};
}

}  // namespace kvs::cuda
