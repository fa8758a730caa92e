// SPDX-License-Identifier: Apache-2.0
// Micro-benchmark behind csattention's reduce by key on CUDA (docs/methods/csattention.md): the
// rate of fp32 adds of list entries (token, value) into one accumulator row per table head,
//   global   atomicAdd into an fp32 row in global memory (L2 atomics: the scatter kernel)
//   dsmem    a thread-block cluster of C CTAs per row, CTA r owning tokens [r*S, (r+1)*S) in shared
//            memory; each CTA reads 1/C of the row's entries and adds every one into its owner's
//            shared memory (distributed shared memory atomics)
//   local    the same cluster and shares, each CTA adding only the entries it owns (the bound with
//            no traffic between CTAs; not a correct reduce)
// Entries: `lists` lists of L = N/10 distinct random tokens per row (csattention's defaults at
// 128K: 8 rows x 32 lists x 13107). Results and what they decided: docs/perf.md ("The reduce by key
// in shared memory"). Build: nvcc -O3 -arch=sm_90a -std=c++17 reduce_by_key.cu -o rbk
// Run: ./rbk [N] [rows] [lists]
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace cg = cooperative_groups;

#define CK(x)                                                               \
  do {                                                                      \
    cudaError_t e_ = (x);                                                   \
    if (e_ != cudaSuccess) {                                                \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e_));                  \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

__global__ void global_kernel(const int* tok, const float* val, long long per_row, float* acc, int N, int chunks) {
  const int row = blockIdx.y;
  const long long per = (per_row + chunks - 1) / chunks;
  const long long beg = blockIdx.x * per, end = min(per_row, beg + per);
  const int* t = tok + row * per_row;
  const float* v = val + row * per_row;
  float* a = acc + (long long)row * N;
  for (long long i = beg + threadIdx.x; i < end; i += blockDim.x) atomicAdd(a + __ldcs(t + i), __ldcs(v + i));
}

template <bool REMOTE>
__global__ void cluster_kernel(const int* tok, const float* val, long long per_row, float* out, int N) {
  extern __shared__ float sacc[];
  cg::cluster_group cl = cg::this_cluster();
  const int C = cl.num_blocks(), r = cl.block_rank();
  const int row = blockIdx.x / C;
  const int S = (N + C - 1) / C;
  for (int i = threadIdx.x; i < S; i += blockDim.x) sacc[i] = 0.f;
  cl.sync();
  const long long per = (per_row + C - 1) / C;
  const long long beg = r * per, end = min(per_row, beg + per);
  const int* t = tok + row * per_row;
  const float* v = val + row * per_row;
  constexpr int U = 4;
  for (long long i0 = beg + threadIdx.x; i0 < end; i0 += (long long)blockDim.x * U) {
    int tk[U];
    float vv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = i0 + (long long)u * blockDim.x;
      tk[u] = i < end ? __ldcs(t + i) : -1;
      vv[u] = i < end ? __ldcs(v + i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (tk[u] < 0) continue;
      const int owner = tk[u] / S, at = tk[u] - owner * S;
      if (REMOTE) atomicAdd(cl.map_shared_rank(sacc + at, owner), vv[u]);
      else if (owner == r) atomicAdd(sacc + at, vv[u]);
    }
  }
  cl.sync();
  for (int i = threadIdx.x; i < S && r * S + i < N; i += blockDim.x) out[(long long)row * N + r * S + i] = sacc[i];
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? std::atoi(argv[1]) : 131072;
  const int rows = argc > 2 ? std::atoi(argv[2]) : 8;
  const int lists = argc > 3 ? std::atoi(argv[3]) : 32;
  const int L = N / 10;
  const long long per_row = (long long)lists * L;
  std::vector<int> ht(rows * per_row);
  std::vector<float> hv(rows * per_row);
  std::mt19937 rng(1);
  std::vector<int> perm(N);
  for (int i = 0; i < N; ++i) perm[i] = i;
  for (int r = 0; r < rows; ++r)
    for (int l = 0; l < lists; ++l) {
      for (int j = 0; j < L; ++j) std::swap(perm[j], perm[j + rng() % (N - j)]);
      for (int j = 0; j < L; ++j) {
        ht[(r * lists + l) * (long long)L + j] = perm[j];
        hv[(r * lists + l) * (long long)L + j] = float(rng() % 1000) / 1000.f;
      }
    }
  int *dt;
  float *dv, *acc, *out;
  CK(cudaMalloc(&dt, ht.size() * 4));
  CK(cudaMalloc(&dv, hv.size() * 4));
  CK(cudaMalloc(&acc, (size_t)rows * N * 4));
  CK(cudaMalloc(&out, (size_t)rows * N * 4));
  CK(cudaMemcpy(dt, ht.data(), ht.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv.data(), hv.size() * 4, cudaMemcpyHostToDevice));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time = [&](auto&& launch) {
    std::vector<float> ms;
    for (int i = 0; i < 12; ++i) {
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (i >= 2) ms.push_back(t * 1000.f);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double adds = double(rows) * per_row;
  for (int chunks : {sms * 4 / rows, sms * 8 / rows}) {
    const float us = time([&] {
      cudaMemsetAsync(acc, 0, (size_t)rows * N * 4);
      global_kernel<<<dim3(chunks, rows), 256>>>(dt, dv, per_row, acc, N, chunks);
    });
    const float us0 = time([&] { cudaMemsetAsync(acc, 0, (size_t)rows * N * 4); });
    std::printf("global  N=%d rows=%d lists=%d chunks=%d: %.1f us (memset %.1f) %.1f G adds/s\n", N, rows, lists,
                chunks, us, us0, adds / (us - us0) / 1e3);
  }
  for (int C : {4, 8, 16}) {
    const int S = (N + C - 1) / C;
    const size_t smem = size_t(S) * 4;
    if (smem > 227 * 1024) continue;
    for (int threads : {512, 1024}) {
      for (int remote = 1; remote >= 0; --remote) {
        auto k = remote ? cluster_kernel<true> : cluster_kernel<false>;
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(rows * C);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = C;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        const float us = time([&] { CK(cudaLaunchKernelEx(&cfg, k, (const int*)dt, (const float*)dv, per_row, out, N)); });
        std::printf("%s   N=%d rows=%d lists=%d C=%d threads=%d: %.1f us %.1f G adds/s\n", remote ? "dsmem" : "local", N,
                    rows, lists, C, threads, us, adds / us / 1e3 / (remote ? 1 : C));
      }
    }
  }
  // check: dsmem result equals the global result up to summation order
  {
    const int C = 16, S = (N + C - 1) / C;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(rows * C);
    cfg.blockDim = dim3(1024);
    cfg.dynamicSmemBytes = size_t(S) * 4;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim = {unsigned(C), 1, 1};
    cfg.attrs = at;
    cfg.numAttrs = 1;
    if (size_t(S) * 4 <= 227 * 1024) {
      CK(cudaMemset(acc, 0, (size_t)rows * N * 4));
      global_kernel<<<dim3(64, rows), 256>>>(dt, dv, per_row, acc, N, 64);
      CK(cudaLaunchKernelEx(&cfg, cluster_kernel<true>, (const int*)dt, (const float*)dv, per_row, out, N));
      CK(cudaDeviceSynchronize());
      std::vector<float> a((size_t)rows * N), b((size_t)rows * N);
      CK(cudaMemcpy(a.data(), acc, a.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), out, b.size() * 4, cudaMemcpyDeviceToHost));
      double md = 0;
      for (size_t i = 0; i < a.size(); ++i) md = std::max(md, (double)std::abs(a[i] - b[i]));
      std::printf("check C=16: max |global - dsmem| = %.3g\n", md);
    }
  }
  return 0;
}
