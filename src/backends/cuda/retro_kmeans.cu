// SPDX-License-Identifier: Apache-2.0
// RetroInfer's index build on the GPU (retro.cuh, retro_kmeans): segmented spherical k-means over
// the stored keys, read from the paged KV in place (centred on the fly, never copied).
//   mean     grid (row blocks, Hkv): the keys' mean per head (fp64 partial sums, atomics)
//   init     the initial centroids from the (centred) keys at the authors' positions
//   assign   grid (segments x row tiles, Hkv), 256 threads: a 128-row tile against the segment's
//            centroids in tiles of 64 (32 at d 256) on the tensor cores (assign_mma_kernel: 3xTF32, about fp32's
//            accuracy), keeping per row the largest inner product (lowest index on ties); the
//            CUDA-core kernel (assign_kernel: 64-row tiles, 4 x 4 fp32 outputs per thread) with
//            KVS_RETRO_KMEANS_MMA=0 or detail::set_retro_kmeans_mma(false)
//   update   the members' sums and counts (fp32 / int atomics), then the centroids: normalised
//            means (spherical passes) or means plus the keys' mean (the final pass)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "backends/cuda/kernel_util.cuh"
#include "backends/cuda/retro.cuh"
#include "backends/cuda/status.cuh"

namespace kvs::cuda {
namespace {
using kutil::mma_tf32;
using kutil::tf32_split;

std::atomic<int> g_kmeans_mma{-1};  // assign_mma_kernel (KVS_RETRO_KMEANS_MMA, detail::set_retro_kmeans_mma)

constexpr int kTile = 64;       // rows and centroids per tile of the assignment
constexpr int kThreads = 256;   // 16 x 16 threads, 4 x 4 outputs each

__device__ __forceinline__ float f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float f32(__nv_bfloat16 x) { return __bfloat162float(x); }

struct KArgs {
  PagedKv kv;
  int32_t hkv, d, t0, n, C;
  const float* mu;  // [hkv][d]: the mean subtracted (zeros when not centring)
};

// Centred key element i of row r (token t0 + r) of head h.
template <typename T>
__device__ __forceinline__ float xval(const KArgs& a, int h, int r, int i) {
  return f32(kv_row<T>(a.kv, a.hkv, a.d, 0, h, a.t0 + r, 0)[i]) - a.mu[h * a.d + i];
}

template <typename T>
__global__ void __launch_bounds__(kThreads) mean_kernel(const KArgs a, double* acc) {
  const int h = blockIdx.y;
  for (int i = threadIdx.x; i < a.d; i += kThreads) {
    double s = 0;
    for (int r = blockIdx.x; r < a.n; r += gridDim.x) s += f32(kv_row<T>(a.kv, a.hkv, a.d, 0, h, a.t0 + r, 0)[i]);
    atomicAdd(acc + h * a.d + i, s);
  }
}

__global__ void mean_finish_kernel(const double* acc, float* mu, int total, double n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) mu[i] = float(acc[i] / n);
}

// v[0, d) (written by this block, ss: each thread's part of its squared norm) scaled to unit length
// (the CPU's normalise: unchanged when the norm is 0). Every thread of the block calls it.
__device__ void scale_to_unit(float* v, int d, double ss) {
  __shared__ double red[32];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  double s = 0;
  for (int w = 0; w < int(blockDim.x) / 32; ++w) s += red[w];
  if (s <= 0) return;
  const float inv = float(1.0 / sqrt(s));
  for (int i = threadIdx.x; i < d; i += blockDim.x) v[i] *= inv;
}

// Initial centroid c of head h: the row the authors' rule names, centred (and normalised per
// segment unless raw_init).
template <typename T>
__global__ void init_kernel(const KArgs a, int segments, int raw_init, float* cent) {
  const int h = blockIdx.y, c = blockIdx.x;
  const int64_t n = a.n, C = a.C, m = n / segments, Cs = C / segments;
  int64_t idx;
  if (raw_init) {
    idx = int64_t(floor(double(c) * double(n) / double(C) + double(n) / (2.0 * double(C))));
    idx = idx < 0 ? 0 : idx > n - 1 ? n - 1 : idx;
  } else {
    const int64_t seg = c / Cs, cc = c % Cs;
    idx = int64_t(floor(double(cc) * double(m) / double(Cs) + double(m) / (2.0 * double(Cs))));
    idx = (idx < 0 ? 0 : idx > m - 1 ? m - 1 : idx) + seg * m;
  }
  float* out = cent + (int64_t(h) * C + c) * a.d;
  double ss = 0;
  for (int i = threadIdx.x; i < a.d; i += blockDim.x) {
    const float v = xval<T>(a, h, int(idx), i);
    out[i] = v;
    ss += double(v) * v;
  }
  if (!raw_init) scale_to_unit(out, a.d, ss);
}

// Rows [seg * m + tile * 64, ...) within the segment (m rows; global: seg = 0, m = n) against the
// centroids [seg * Cs, (seg + 1) * Cs).
template <typename T>
__global__ void __launch_bounds__(kThreads) assign_kernel(const KArgs a, int m, int Cs, int tiles, const float* cent,
                                                          int32_t* assign) {
  extern __shared__ float sh[];
  float* Xs = sh;                   // [d][64]
  float* Cm = sh + a.d * kTile;     // [d][64]
  __shared__ float bv[kTile][16];
  __shared__ int bi[kTile][16];
  const int h = blockIdx.y, seg = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int r0 = tile * kTile, rows = min(kTile, m - r0);
  if (rows <= 0) return;
  const int base = seg * m + r0, cb = seg * Cs;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  for (int e = threadIdx.x; e < kTile * a.d; e += kThreads) {
    const int r = e / a.d, i = e % a.d;
    Xs[i * kTile + r] = r < rows ? xval<T>(a, h, base + r, i) : 0.f;
  }
  float best[4];
  int bidx[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) best[i] = -INFINITY, bidx[i] = 0x7fffffff;
  const float* cg = cent + (int64_t(h) * a.C + cb) * a.d;
  for (int c0 = 0; c0 < Cs; c0 += kTile) {
    const int nc = min(kTile, Cs - c0);
    __syncthreads();
    for (int e = threadIdx.x; e < kTile * a.d; e += kThreads) {
      const int c = e / a.d, i = e % a.d;
      Cm[i * kTile + c] = c < nc ? cg[int64_t(c0 + c) * a.d + i] : 0.f;
    }
    __syncthreads();
    float acc[4][4] = {};
    for (int k = 0; k < a.d; ++k) {
      const float4 x = reinterpret_cast<const float4*>(Xs + k * kTile)[ty];
      const float4 y = reinterpret_cast<const float4*>(Cm + k * kTile)[tx];
      const float xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(xs[i], ys[j], acc[i][j]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = c0 + tx * 4 + j;
      if (c - c0 >= nc) break;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (acc[i][j] > best[i]) best[i] = acc[i][j], bidx[i] = c;  // increasing c: ties keep the lower
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) bv[ty * 4 + i][tx] = best[i], bi[ty * 4 + i][tx] = bidx[i];
  __syncthreads();
  if (threadIdx.x < rows) {
    const int r = threadIdx.x;
    float v = bv[r][0];
    int b = bi[r][0];
    for (int j = 1; j < 16; ++j)
      if (bv[r][j] > v || (bv[r][j] == v && bi[r][j] < b)) v = bv[r][j], b = bi[r][j];
    // Nothing compares above -inf (a NaN row): the segment's first centroid, as the CPU's loop.
    assign[int64_t(h) * a.n + base + r] = cb + (b == 0x7fffffff ? 0 : b);
  }
}

// assign_kernel on the tensor cores: 8 warps, 16 rows each, against CENTS centroids at a time
// (CENTS / 8 n-tiles of m16n8k8 tf32 MMAs). Both operands enter as big + small tf32 parts (3 MMAs:
// small*big, big*small, big*big; the centred key and the centroid keep about fp32's 24 bits), so
// the inner products are fp32's to a few ulps: near-ties may still pick the other centroid, as the
// fp32 sums' order does. The rows stay fp32 in shared memory (each warp splits its fragments); a
// centroid tile is split once, as it is stored, into (big, small) pairs, while the next tile's
// floats are already in registers (loaded during the MMAs). Rows padded to D + 4 elements
// (conflict-free fragments). CENTS = 64, or 32 at D = 256 (shared memory).
constexpr int kMmaRows = 128, kMmaThreads = 256;
template <int D>
inline constexpr int kMmaCents = D > 128 ? 32 : 64;
template <int D>
constexpr size_t mma_smem() {
  return size_t(kMmaRows) * (D + 4) * sizeof(float) + size_t(kMmaCents<D>) * (D + 4) * sizeof(uint2);
}
template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads) assign_mma_kernel(const KArgs a, int m, int Cs, int tiles,
                                                                 const float* cent, int32_t* assign) {
  constexpr int P = D + 4, CENTS = kMmaCents<D>, NB = CENTS / 8;
  constexpr int LPT = CENTS * D / (4 * kMmaThreads);  // float4s of a centroid tile per thread
  static_assert(LPT * 4 * kMmaThreads == CENTS * D, "tile / threads");
  extern __shared__ float4 sh4[];
  float* Xs = reinterpret_cast<float*>(sh4);                   // [kMmaRows][P] fp32
  uint2* Cb = reinterpret_cast<uint2*>(Xs + kMmaRows * P);     // [CENTS][P] (big, small)
  const int h = blockIdx.y, seg = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int r0 = tile * kMmaRows, rows = min(kMmaRows, m - r0);
  if (rows <= 0) return;
  const int base = seg * m + r0, cb = seg * Cs;
  const float* cg = cent + (int64_t(h) * a.C + cb) * D;
  float4 pre[LPT];
  auto fetch = [&](int c0) {
#pragma unroll
    for (int u = 0; u < LPT; ++u) {
      const int e = (threadIdx.x + u * kMmaThreads) * 4, c = e / D, i = e % D;
      pre[u] = c0 + c < Cs ? *reinterpret_cast<const float4*>(cg + int64_t(c0 + c) * D + i) : make_float4(0, 0, 0, 0);
    }
  };
  fetch(0);
  for (int e = threadIdx.x; e < kMmaRows * D; e += kMmaThreads) {
    const int r = e / D, i = e % D;
    Xs[r * P + i] = r < rows ? xval<T>(a, h, base + r, i) : 0.f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* x0 = Xs + (warp * 16 + g) * P;
  const float* x1 = x0 + 8 * P;
  float best[2] = {-INFINITY, -INFINITY};
  int bidx[2] = {0x7fffffff, 0x7fffffff};
  for (int c0 = 0; c0 < Cs; c0 += CENTS) {
    const int nc = min(CENTS, Cs - c0);
    __syncthreads();  // the last tile's fragments are read
#pragma unroll
    for (int u = 0; u < LPT; ++u) {
      const int e = (threadIdx.x + u * kMmaThreads) * 4, c = e / D, i = e % D;
      uint32_t b[4], sm[4];
      tf32_split(pre[u].x, b[0], sm[0]);
      tf32_split(pre[u].y, b[1], sm[1]);
      tf32_split(pre[u].z, b[2], sm[2]);
      tf32_split(pre[u].w, b[3], sm[3]);
      uint4* dst = reinterpret_cast<uint4*>(Cb + c * P + i);
      dst[0] = make_uint4(b[0], sm[0], b[1], sm[1]);
      dst[1] = make_uint4(b[2], sm[2], b[3], sm[3]);
    }
    __syncthreads();
    if (c0 + CENTS < Cs) fetch(c0 + CENTS);  // in flight during the MMAs below
    float acc[NB][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 8) {
      uint32_t ab[4], as[4];
      tf32_split(x0[k0 + t], ab[0], as[0]);
      tf32_split(x1[k0 + t], ab[1], as[1]);
      tf32_split(x0[k0 + t + 4], ab[2], as[2]);
      tf32_split(x1[k0 + t + 4], ab[3], as[3]);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const uint2* cr = Cb + (nb * 8 + g) * P + k0;
        const uint2 y0 = cr[t], y1 = cr[t + 4];
        mma_tf32(acc[nb], as, y0.x, y1.x);  // the small parts first
        mma_tf32(acc[nb], ab, y0.y, y1.y);
        mma_tf32(acc[nb], ab, y0.x, y1.x);
      }
    }
    // Each thread sees columns 2t, 2t + 1 of every n-tile, in increasing centroid order: a tie
    // keeps the lower index.
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = nb * 8 + 2 * t + j;
        if (c >= nc) continue;
        if (acc[nb][j] > best[0]) best[0] = acc[nb][j], bidx[0] = c0 + c;
        if (acc[nb][2 + j] > best[1]) best[1] = acc[nb][2 + j], bidx[1] = c0 + c;
      }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, best[i], o);
      const int b = __shfl_xor_sync(0xffffffffu, bidx[i], o);
      if (v > best[i] || (v == best[i] && b < bidx[i])) best[i] = v, bidx[i] = b;
    }
  if (t == 0)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp * 16 + g + 8 * i;
      // Nothing compares above -inf (a NaN row): the segment's first centroid, as the CPU's loop.
      if (r < rows) assign[int64_t(h) * a.n + base + r] = cb + (bidx[i] == 0x7fffffff ? 0 : bidx[i]);
    }
}

// Members' sums and counts of rows [0, rows).
template <typename T>
__global__ void __launch_bounds__(kThreads) sum_kernel(const KArgs a, int rows, const int32_t* assign, float* sum,
                                                       int* cnt) {
  const int h = blockIdx.y;
  const int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int r = int(e / a.d), i = int(e % a.d);
  if (r >= rows) return;
  const int c = assign[int64_t(h) * a.n + r];
  atomicAdd(sum + (int64_t(h) * a.C + c) * a.d + i, xval<T>(a, h, r, i));
  if (i == 0) atomicAdd(cnt + int64_t(h) * a.C + c, 1);
}

// Centroid (h, c) from its members: the normalised mean (final = 0; empty: unchanged), or the
// mean plus mu (final = 1; empty: the centroid plus mu).
__global__ void centroid_kernel(const KArgs a, const float* sum, const int* cnt, float* cent, int final_pass) {
  const int h = blockIdx.y, c = blockIdx.x;
  const int64_t at = (int64_t(h) * a.C + c) * a.d;
  const int k = cnt[int64_t(h) * a.C + c];
  if (final_pass) {
    for (int i = threadIdx.x; i < a.d; i += blockDim.x)
      cent[at + i] = (k > 0 ? float(double(sum[at + i]) / double(k)) : cent[at + i]) + a.mu[h * a.d + i];
    return;
  }
  if (k == 0) return;
  double ss = 0;
  for (int i = threadIdx.x; i < a.d; i += blockDim.x) {
    const float v = float(double(sum[at + i]) / double(k));
    cent[at + i] = v;
    ss += double(v) * v;
  }
  scale_to_unit(cent + at, a.d, ss);
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

struct Carve {
  size_t acc, mu, sum, cnt, total;
};
Carve carve(int32_t hkv, int32_t d, const RetroKMeans& k) {
  Carve c{};
  c.acc = 0;
  c.mu = c.acc + align_up(size_t(hkv) * d * 8);
  c.sum = c.mu + align_up(size_t(hkv) * d * 4);
  c.cnt = c.sum + align_up(size_t(hkv) * k.clusters * d * 4);
  c.total = c.cnt + align_up(size_t(hkv) * k.clusters * 4);
  return c;
}

template <typename T>
Status run(const KArgs& a0, const RetroKMeans& k, int32_t* assign, float* cent, char* w, const Carve& cv,
           cudaStream_t st) {
  KArgs a = a0;
  double* acc = reinterpret_cast<double*>(w + cv.acc);
  float* mu = reinterpret_cast<float*>(w + cv.mu);
  float* sum = reinterpret_cast<float*>(w + cv.sum);
  int* cnt = reinterpret_cast<int*>(w + cv.cnt);
  const size_t hd = size_t(a.hkv) * a.d;
  KVS_CUDA_TRY(cudaMemsetAsync(acc, 0, hd * 8, st), "retro kmeans memset");
  KVS_CUDA_TRY(cudaMemsetAsync(mu, 0, hd * 4, st), "retro kmeans memset");
  a.mu = mu;
  if (k.centre) {
    mean_kernel<T><<<dim3(unsigned(std::min(a.n, 512)), unsigned(a.hkv)), kThreads, 0, st>>>(a, acc);
    KVS_LAUNCH_CHECK("retro mean_kernel launch");
    mean_finish_kernel<<<unsigned((hd + 255) / 256), 256, 0, st>>>(acc, mu, int(hd), double(a.n));
    KVS_LAUNCH_CHECK("retro mean_finish_kernel launch");
  }
  init_kernel<T><<<dim3(unsigned(a.C), unsigned(a.hkv)), 128, 0, st>>>(a, k.segments, k.raw_init, cent);
  KVS_LAUNCH_CHECK("retro init_kernel launch");
  const size_t smem = size_t(2) * a.d * kTile * sizeof(float);
  auto assign_mma = a.d == 64 ? assign_mma_kernel<T, 64> : a.d == 128 ? assign_mma_kernel<T, 128> : assign_mma_kernel<T, 256>;
  const size_t smem_mma = a.d == 64 ? mma_smem<64>() : a.d == 128 ? mma_smem<128>() : mma_smem<256>();
  // The tensor-core kernel where the device's blocks hold its shared memory (Hopper's 227 KB do at
  // every d; a smaller opt-in limit falls back to the CUDA-core kernel).
  int dev = 0, optin = 0;
  KVS_CUDA_TRY(cudaGetDevice(&dev), "retro kmeans device");
  KVS_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "retro kmeans device");
  const bool mma = kutil::env_flag(g_kmeans_mma, "KVS_RETRO_KMEANS_MMA") && smem_mma <= size_t(optin);
  if (mma)
    KVS_CUDA_TRY(cudaFuncSetAttribute(assign_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_mma)),
                 "retro assign_mma_kernel attribute");
  else
    KVS_CUDA_TRY(cudaFuncSetAttribute(assign_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                 "retro assign_kernel attribute");
  const int m = a.n / k.segments, Cs = a.C / k.segments;
  auto pass = [&](int rows_per_seg, int cents, int segs, int rows, int final_pass) -> Status {
    if (mma) {
      const int tiles = (rows_per_seg + kMmaRows - 1) / kMmaRows;
      assign_mma<<<dim3(unsigned(segs * tiles), unsigned(a.hkv)), kMmaThreads, smem_mma, st>>>(a, rows_per_seg, cents,
                                                                                              tiles, cent, assign);
      KVS_LAUNCH_CHECK("retro assign_mma_kernel launch");
    } else {
      const int tiles = (rows_per_seg + kTile - 1) / kTile;
      assign_kernel<T><<<dim3(unsigned(segs * tiles), unsigned(a.hkv)), kThreads, smem, st>>>(a, rows_per_seg, cents,
                                                                                             tiles, cent, assign);
      KVS_LAUNCH_CHECK("retro assign_kernel launch");
    }
    KVS_CUDA_TRY(cudaMemsetAsync(sum, 0, size_t(a.hkv) * a.C * a.d * 4, st), "retro kmeans memset");
    KVS_CUDA_TRY(cudaMemsetAsync(cnt, 0, size_t(a.hkv) * a.C * 4, st), "retro kmeans memset");
    const int64_t elems = int64_t(rows) * a.d;
    sum_kernel<T><<<dim3(unsigned((elems + kThreads - 1) / kThreads), unsigned(a.hkv)), kThreads, 0, st>>>(
        a, rows, assign, sum, cnt);
    KVS_LAUNCH_CHECK("retro sum_kernel launch");
    centroid_kernel<<<dim3(unsigned(a.C), unsigned(a.hkv)), 128, 0, st>>>(a, sum, cnt, cent, final_pass);
    KVS_LAUNCH_CHECK("retro centroid_kernel launch");
    return {};
  };
  for (int it = 0; it + 1 < k.iterations; ++it) {
    Status e = pass(m, Cs, k.segments, k.segments * m, 0);
    if (!e.ok()) return e;
  }
  return pass(a.n, a.C, 1, a.n, 1);
}

// Page p0 + blockIdx.y to dst + blockIdx.y * words, 16 bytes a thread at a time.
__global__ void copy_pages_kernel(const void* const* pages, int32_t p0, size_t words, uint4* dst) {
  const uint4* src = static_cast<const uint4*>(pages[p0 + int32_t(blockIdx.y)]);
  uint4* out = dst + size_t(blockIdx.y) * words;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x)
    out[i] = src[i];
}

}  // namespace

namespace detail {
void set_retro_kmeans_mma(bool on) noexcept { g_kmeans_mma.store(on ? 1 : 0, std::memory_order_relaxed); }
bool retro_kmeans_mma() noexcept { return kutil::env_flag(g_kmeans_mma, "KVS_RETRO_KMEANS_MMA"); }
}  // namespace detail

Status retro_copy_pages(const PagedKv& kv, int32_t p0, int32_t np, size_t page_bytes, void* dst, void* stream) noexcept {
  if (!kv.pages || !dst) return invalid("retro_copy_pages: null argument");
  if (p0 < 0 || np < 1 || np > 65535 || (kv.max_pages > 0 && int64_t(p0) + np > kv.max_pages))
    return invalid("retro_copy_pages: pages out of the sequence's table");
  if (page_bytes == 0 || page_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0)
    return invalid("retro_copy_pages: page_bytes and dst must be multiples of 16 bytes");
  const size_t words = page_bytes / 16;
  const unsigned x = unsigned(std::min<size_t>((words + 255) / 256, 64));
  copy_pages_kernel<<<dim3(x, unsigned(np)), 256, 0, static_cast<cudaStream_t>(stream)>>>(kv.pages, p0, words,
                                                                                         static_cast<uint4*>(dst));
  KVS_LAUNCH_CHECK("retro copy_pages_kernel launch");
  return {};
}

size_t retro_kmeans_workspace_bytes(int32_t num_kv_heads, int32_t head_dim, const RetroKMeans& k) noexcept {
  if (num_kv_heads < 1 || head_dim < 1 || k.clusters < 1) return 0;
  return carve(num_kv_heads, head_dim, k).total;
}

Status retro_kmeans(const PagedKv& kv, Scalar kv_dtype, int32_t num_kv_heads, int32_t head_dim, int32_t t0,
                    const RetroKMeans& k, int32_t* assign, float* centroids, const Workspace& ws,
                    void* stream) noexcept {
  if (num_kv_heads < 1 || num_kv_heads > 65535) return invalid("retro_kmeans: num_kv_heads out of range");
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return unsupported("retro_kmeans: head_dim must be 64, 128 or 256");
  if (k.n < 1 || k.clusters < 1 || k.segments < 1 || k.clusters % k.segments != 0 || k.iterations < 1 ||
      k.n / k.segments < 1)
    return invalid("retro_kmeans: expected n >= segments >= 1, clusters a positive multiple of segments, iterations >= 1");
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("retro_kmeans: KV dtype must be BF16 or F16");
  if (!assign || !centroids || !kv.pages || t0 < 0) return invalid("retro_kmeans: null argument");
  const Carve cv = carve(num_kv_heads, head_dim, k);
  if (!ws.ptr || ws.bytes < cv.total) return invalid("retro_kmeans: workspace too small (ask retro_kmeans_workspace_bytes)");
  KArgs a{};
  a.kv = kv;
  a.hkv = num_kv_heads;
  a.d = head_dim;
  a.t0 = t0;
  a.n = k.n;
  a.C = k.clusters;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  char* w = static_cast<char*>(ws.ptr);
  if (kv_dtype == Scalar::BF16) return run<__nv_bfloat16>(a, k, assign, centroids, w, cv, st);
  return run<__half>(a, k, assign, centroids, w, cv, st);
}

}  // namespace kvs::cuda
