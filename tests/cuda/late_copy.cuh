// SPDX-License-Identifier: Apache-2.0
// Tests of programmatic dependent launches (a call with pdl = true): the launch before the call is
// a kernel that spins ~20 us on the GPU clock and only then copies up to three regions from
// staged copies into buffers the test has poisoned. A call that read any of those buffers before
// that kernel completed would see the poison.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace {  // one copy per test file (a __global__ in a header)

struct LateCopy {
  void* dst[3] = {};
  const void* src[3] = {};
  size_t bytes[3] = {};
};

__global__ void late_copy_kernel(LateCopy c) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < 20000);
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x, n = size_t(gridDim.x) * blockDim.x;
  for (int r = 0; r < 3; ++r)
    for (size_t i = tid; i < c.bytes[r]; i += n)
      static_cast<unsigned char*>(c.dst[r])[i] = static_cast<const unsigned char*>(c.src[r])[i];
}

// Poisons the destinations (0xff bytes: NaN for 16-bit floats, -1 for int32), then launches the late
// copy; all on `st`. Returns the first CUDA error.
inline cudaError_t enqueue_late_copy(const LateCopy& c, cudaStream_t st) {
  for (int r = 0; r < 3; ++r)
    if (c.bytes[r])
      if (cudaError_t e = cudaMemsetAsync(c.dst[r], 0xff, c.bytes[r], st); e != cudaSuccess) return e;
  late_copy_kernel<<<264, 256, 0, st>>>(c);
  return cudaGetLastError();
}

}  // namespace
