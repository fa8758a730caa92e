// SPDX-License-Identifier: Apache-2.0
// Kernel launches shared by the .cu files of this directory (nvcc only; private): programmatic
// dependent launch (PDL, sm_90) on the device side and one launch helper on the host side.
//
// A kernel launched with `pdl` may start while the stream's previous kernel still runs (once every
// CTA of that kernel has called pdl_launch_dependents or exited). pdl_wait then blocks until that
// kernel has completed and its writes are visible; after a plain launch both are no-ops. Every CTA
// of a kernel that may be launched with `pdl` calls pdl_wait before it reads anything the previous
// kernel writes and before it exits, so "this kernel completed" keeps implying "every earlier
// kernel of the stream completed" down a chain of such launches.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "backends/cuda/status.cuh"

namespace kvs::cuda {

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// kern<<<grid, block, smem, st>>>(args...) through cudaLaunchKernelEx: a programmatic dependent
// launch when `pdl`, on clusters of `cluster` CTAs along x when cluster > 1.
template <typename... P, typename... A>
cudaError_t launch_kernel(void (*kern)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, bool pdl,
                          int cluster, A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[2]{};
  unsigned n = 0;
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kern, std::forward<A>(args)...);
}

// Clusters of C CTAs of `kern` (block threads, smem dynamic bytes) that fit on the current device
// at once; 0 when that cluster size is not supported (the error is cleared: not sticky).
template <typename... P>
int max_active_clusters(void (*kern)(P...), int C, int threads, size_t smem) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(C), 1, 1);
  cfg.blockDim = dim3(unsigned(threads), 1, 1);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(C);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  return n;
}

// The clusters of one kernel that fit on a device at once (max_active_clusters), asked once per
// (device, cluster size 2^ci with ci in [0, 4], dynamic shared memory rounded up to 16 KB) and
// remembered, so that later calls make no CUDA call (e.g. while a graph is captured). Before the
// first question on a device the kernel's attributes are set once: non-portable cluster sizes (16)
// and `max_smem` bytes of dynamic shared memory. One instance per kernel, a static of the caller.
class ClusterOccupancy {
 public:
  static constexpr int kDevices = 16, kSizes = 5, kBuckets = 16;  // 16 x 16 KB: past any GPU's 227 KB

  // Clusters of 2^ci CTAs of `threads` threads and `smem` dynamic bytes that fit at once (0: that
  // size does not fit); -1 when the device refused the attributes (the error is cleared).
  template <typename... P>
  int clusters(void (*kern)(P...), int dev, int ci, size_t smem, int threads, size_t max_smem) noexcept {
    const int bucket = int((smem + 16 * 1024 - 1) / (16 * 1024));
    if (ci < 0 || ci >= kSizes || bucket >= kBuckets) return 0;
    const bool cached = dev >= 0 && dev < kDevices;
    if (cached) {  // slots hold clusters + 1; 0 = not asked yet
      if (const int v = occ_[dev][ci][bucket].load(std::memory_order_relaxed); v > 0) return v - 1;
      if (prepared_[dev].load(std::memory_order_acquire) == 2) return -1;
    }
    if (!cached || prepared_[dev].load(std::memory_order_acquire) == 0) {
      if (cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess ||
          cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem)) != cudaSuccess) {
        (void)cudaGetLastError();
        if (cached) prepared_[dev].store(2, std::memory_order_release);
        return -1;
      }
      if (cached) prepared_[dev].store(1, std::memory_order_release);
    }
    const int n = max_active_clusters(kern, 1 << ci, threads, size_t(bucket) * 16 * 1024);
    if (cached) occ_[dev][ci][bucket].store(n + 1, std::memory_order_relaxed);
    return n;
  }

 private:
  std::atomic<int> occ_[kDevices][kSizes][kBuckets] = {};
  std::atomic<int> prepared_[kDevices] = {};  // 0: not yet, 1: attributes set, 2: refused
};

// The current device's multiprocessor count, asked once per device (the query costs host time on
// every step otherwise).
inline Status sm_count(int* sms) {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  KVS_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev >= 0 && dev < 64 && (*sms = cache[dev].load(std::memory_order_relaxed)) > 0) return {};
  KVS_CUDA_TRY(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute(MultiProcessorCount)");
  if (dev >= 0 && dev < 64) cache[dev].store(*sms, std::memory_order_relaxed);
  return {};
}

}  // namespace kvs::cuda
