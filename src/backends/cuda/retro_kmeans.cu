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
//   update   the rows sorted by (head, cluster) (a stable radix sort: a cluster's members in row
//            order), then one warp per cluster sums its members in fp64 in that order (as the
//            CPU's loop does) and writes the centroid: the normalised mean (spherical passes) or
//            the mean plus the keys' mean (the final pass)
// No atomics on floating-point values anywhere: the same keys give the same assignments and
// centroids bit for bit on every run (the mean's block partials are added in block order too).
#include <cub/device/device_radix_sort.cuh>
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

constexpr int kMeanBlocks = 512;  // row blocks of the mean: partial sums part [block][hkv][d]

template <typename T>
__global__ void __launch_bounds__(kThreads) mean_kernel(const KArgs a, double* part) {
  const int h = blockIdx.y;
  for (int i = threadIdx.x; i < a.d; i += kThreads) {
    double s = 0;
    for (int r = blockIdx.x; r < a.n; r += gridDim.x) s += f32(kv_row<T>(a.kv, a.hkv, a.d, 0, h, a.t0 + r, 0)[i]);
    part[(int64_t(blockIdx.x) * a.hkv + h) * a.d + i] = s;
  }
}

// mu [hkv][d] = the blocks' partial sums added in block order, over n.
__global__ void mean_finish_kernel(const double* part, int blocks, float* mu, int total, double n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  double s = 0;
  for (int b = 0; b < blocks; ++b) s += part[int64_t(b) * total + i];
  mu[i] = float(s / n);
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

// Sort keys of rows [0, rows) of every head: key = h * C + cluster, value = the row.
__global__ void sort_keys_kernel(const KArgs a, int rows, const int32_t* assign, uint32_t* keys, int32_t* vals) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= int64_t(a.hkv) * rows) return;
  const int h = int(e / rows), r = int(e % rows);
  keys[e] = uint32_t(h) * uint32_t(a.C) + uint32_t(assign[int64_t(h) * a.n + r]);
  vals[e] = r;
}

// The members of key k are sorted positions [first[k], last[k]) (both zeroed before: empty = none).
__global__ void bounds_kernel(const uint32_t* keys, int64_t N, int32_t* first, int32_t* last) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const uint32_t k = keys[i];
  if (i == 0 || keys[i - 1] != k) first[k] = int32_t(i);
  if (i == N - 1 || keys[i + 1] != k) last[k] = int32_t(i + 1);
}

// Centroid (h, c) = key blockIdx.x * 8 + warp, from its members (rows[first, last), in row order),
// summed in fp64 in that order: the normalised mean (final = 0; empty: unchanged), or the mean
// plus mu (final = 1; empty: the centroid plus mu). D = d / 32 elements per lane.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) members_kernel(const KArgs a, const int32_t* rows, const int32_t* first,
                                                           const int32_t* last, float* cent, int final_pass) {
  const int lane = threadIdx.x % 32;
  const int64_t key = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (key >= int64_t(a.hkv) * a.C) return;
  const int h = int(key / a.C);
  const int32_t f = first[key], l = last[key];
  const float* mu = a.mu + h * a.d;
  float* out = cent + key * a.d;
  double s[D];
#pragma unroll
  for (int q = 0; q < D; ++q) s[q] = 0;
  for (int32_t j = f; j < l; ++j) {
    const T* row = kv_row<T>(a.kv, a.hkv, a.d, 0, h, a.t0 + rows[j], 0);
#pragma unroll
    for (int q = 0; q < D; ++q) s[q] += double(f32(row[lane + 32 * q]) - mu[lane + 32 * q]);  // xval's value
  }
  const int k = l - f;
  if (final_pass) {
#pragma unroll
    for (int q = 0; q < D; ++q) {
      const int i = lane + 32 * q;
      out[i] = (k > 0 ? float(s[q] / double(k)) : out[i]) + mu[i];
    }
    return;
  }
  if (k == 0) return;
  float v[D];
  double ss = 0;
#pragma unroll
  for (int q = 0; q < D; ++q) {
    v[q] = float(s[q] / double(k));
    ss += double(v[q]) * v[q];
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = ss > 0 ? float(1.0 / sqrt(ss)) : 1.f;  // the CPU's normalise: unchanged at norm 0
#pragma unroll
  for (int q = 0; q < D; ++q) out[lane + 32 * q] = ss > 0 ? v[q] * inv : v[q];
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Bits of the sort keys h * C + c (at least 1).
int key_bits(int32_t hkv, int32_t C) {
  int b = 1;
  while (b < 32 && (uint64_t(1) << b) < uint64_t(hkv) * uint64_t(C)) ++b;
  return b;
}

struct Carve {
  size_t part, mu, keys, keys2, vals, vals2, first, last, temp, temp_bytes, total;
};
// The workspace: the mean's partials, mu, the sort's keys and values (two buffers each) for every row,
// each cluster's member bounds, the sort's own temporary storage. 0 bytes of temp: the size query
// failed (reported by retro_kmeans).
Carve carve(int32_t hkv, int32_t d, const RetroKMeans& k) {
  Carve c{};
  const size_t rows = size_t(hkv) * size_t(k.n), keys = size_t(hkv) * size_t(k.clusters);
  c.part = 0;
  c.mu = c.part + align_up(size_t(kMeanBlocks) * hkv * d * 8);
  c.keys = c.mu + align_up(size_t(hkv) * d * 4);
  c.keys2 = c.keys + align_up(rows * 4);
  c.vals = c.keys2 + align_up(rows * 4);
  c.vals2 = c.vals + align_up(rows * 4);
  c.first = c.vals2 + align_up(rows * 4);
  c.last = c.first + align_up(keys * 4);
  c.temp = c.last + align_up(keys * 4);
  size_t tb = 0;
  cub::DoubleBuffer<uint32_t> kb(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> vb(nullptr, nullptr);
  if (cub::DeviceRadixSort::SortPairs(nullptr, tb, kb, vb, int64_t(rows), 0, key_bits(hkv, k.clusters)) != cudaSuccess)
    tb = 0;
  c.temp_bytes = tb;
  c.total = c.temp + align_up(tb);
  return c;
}

template <typename T>
Status run(const KArgs& a0, const RetroKMeans& k, int32_t* assign, float* cent, char* w, const Carve& cv,
           cudaStream_t st) {
  KArgs a = a0;
  double* part = reinterpret_cast<double*>(w + cv.part);
  float* mu = reinterpret_cast<float*>(w + cv.mu);
  uint32_t* keys = reinterpret_cast<uint32_t*>(w + cv.keys);
  uint32_t* keys2 = reinterpret_cast<uint32_t*>(w + cv.keys2);
  int32_t* vals = reinterpret_cast<int32_t*>(w + cv.vals);
  int32_t* vals2 = reinterpret_cast<int32_t*>(w + cv.vals2);
  int32_t* first = reinterpret_cast<int32_t*>(w + cv.first);
  int32_t* last = reinterpret_cast<int32_t*>(w + cv.last);
  const size_t hd = size_t(a.hkv) * a.d;
  KVS_CUDA_TRY(cudaMemsetAsync(mu, 0, hd * 4, st), "retro kmeans memset");
  a.mu = mu;
  if (k.centre) {
    const int blocks = std::min(a.n, kMeanBlocks);
    mean_kernel<T><<<dim3(unsigned(blocks), unsigned(a.hkv)), kThreads, 0, st>>>(a, part);
    KVS_LAUNCH_CHECK("retro mean_kernel launch");
    mean_finish_kernel<<<unsigned((hd + 255) / 256), 256, 0, st>>>(part, blocks, mu, int(hd), double(a.n));
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
    const int64_t N = int64_t(a.hkv) * rows;
    sort_keys_kernel<<<unsigned((N + 255) / 256), 256, 0, st>>>(a, rows, assign, keys, vals);
    KVS_LAUNCH_CHECK("retro sort_keys_kernel launch");
    size_t tb = cv.temp_bytes;
    cub::DoubleBuffer<uint32_t> kb(keys, keys2);  // (the sorted pairs end in either buffer: Current())
    cub::DoubleBuffer<int32_t> vb(vals, vals2);
    KVS_CUDA_TRY(cub::DeviceRadixSort::SortPairs(w + cv.temp, tb, kb, vb, N, 0, key_bits(a.hkv, a.C), st),
                 "retro kmeans sort");
    KVS_CUDA_TRY(cudaMemsetAsync(first, 0, size_t(a.hkv) * a.C * 4, st), "retro kmeans memset");
    KVS_CUDA_TRY(cudaMemsetAsync(last, 0, size_t(a.hkv) * a.C * 4, st), "retro kmeans memset");
    bounds_kernel<<<unsigned((N + 255) / 256), 256, 0, st>>>(kb.Current(), N, first, last);
    KVS_LAUNCH_CHECK("retro bounds_kernel launch");
    const unsigned blocks = unsigned((int64_t(a.hkv) * a.C + kThreads / 32 - 1) / (kThreads / 32));
    auto members = a.d == 64 ? members_kernel<T, 2> : a.d == 128 ? members_kernel<T, 4> : members_kernel<T, 8>;
    members<<<blocks, kThreads, 0, st>>>(a, vb.Current(), first, last, cent, final_pass);
    KVS_LAUNCH_CHECK("retro members_kernel launch");
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
  if (int64_t(num_kv_heads) * k.n > INT32_MAX || int64_t(num_kv_heads) * k.clusters > INT32_MAX)
    return invalid("retro_kmeans: num_kv_heads x n and num_kv_heads x clusters must be below 2^31 (the sort's keys and rows)");
  if (!assign || !centroids || !kv.pages || t0 < 0) return invalid("retro_kmeans: null argument");
  const Carve cv = carve(num_kv_heads, head_dim, k);
  if (cv.temp_bytes == 0) return invalid("retro_kmeans: the sort's workspace size query failed");
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
