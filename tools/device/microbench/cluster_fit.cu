// SPDX-License-Identifier: Apache-2.0
// How many thread-block clusters of C CTAs (C = 1..16, 1024 threads each, one CTA per SM by its
// shared memory) fit on the GPU at once: cudaOccupancyMaxActiveClusters for a kernel shaped like
// the top-k's cluster select (topk_select.cuh). A cluster must sit inside one GPC, so this is the
// GPC layout seen through the occupancy API (docs/perf.md, "Cluster sizes that fit").
//   nvcc -O2 -arch=sm_90a cluster_fit.cu -o cluster_fit && ./cluster_fit
#include <cuda_runtime.h>

#include <cstdio>

__global__ void __launch_bounds__(1024, 1) probe(int* p) {
  extern __shared__ int s[];
  if (p) p[threadIdx.x] = s[threadIdx.x];
}

int main() {
  const int big = 190 * 1024;  // dynamic shared memory that allows one CTA per SM
  if (cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess ||
      cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, big) != cudaSuccess) {
    std::printf("cudaFuncSetAttribute: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::printf("%d SMs; clusters of C CTAs (1024 threads) that fit at once, with 40 KB / 190 KB of shared memory per CTA\n", sms);
  for (int C = 1; C <= 16; ++C) {
    int n[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(unsigned(C));
      cfg.blockDim = dim3(1024);
      cfg.dynamicSmemBytes = i == 0 ? 40 * 1024 : big;
      cudaLaunchAttribute a{};
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = unsigned(C);
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = 1;
      cfg.attrs = &a;
      cfg.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&n[i], probe, &cfg) != cudaSuccess) n[i] = -1;
    }
    std::printf("C=%2d: %3d clusters (%3d CTAs) | %3d clusters (%3d CTAs)\n", C, n[0], n[0] * C, n[1], n[1] * C);
  }
  return 0;
}
