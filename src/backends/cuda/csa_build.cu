// SPDX-License-Identifier: Apache-2.0
// CSAttention's index build on CUDA: see csa_build.cuh for the contract and the output layout.
//
// Steps on the stream:
//  1. kmeans_kernel, a CTA (512 threads) per (table head h, subspace b) problem:
//     - compaction: the pooled rows r * gq + g of the sample, each normalised (float64 norm, as the
//       CPU), the non-zero ones copied densely in row order into the workspace (a block scan per
//       chunk of 512 rows), so the rest works on npts points P[npts][db];
//     - k-means++: C - 1 passes, each updating D^2(x) = min(D^2, 2 - 2 x.c_new) of every point and
//       their float64 sum; the next seed is drawn proportionally to D^2 (a block scan of per-thread
//       sums, each thread owning points tid + 512 k, then the one thread whose range holds the
//       drawn value walks its points);
//     - updates, `iters` times: mini-batch epochs take the points in the order of a Feistel
//       permutation of [0, npts) (cycle walking; keyed per epoch), B at a time; Lloyd takes all
//       points at once. All threads assign their points (argmax x.c_j, lowest j on ties) and add
//       each point to its centroid's sum as 64-bit fixed point (x * 2^30) with atomics -- integer
//       sums do not depend on the order of the additions, so the build is deterministic -- and
//       count it; then a warp per touched centroid applies the update: Sculley's sequential
//       c <- (1 - 1/n) c + x / n over the batch's rows telescopes to c = (n0 c0 + sum x) / (n0 + K),
//       computed in float64 and projected back to the sphere (float64 norm); Lloyd normalises the
//       sum (an empty cluster keeps its centroid).
//     The centroids, the sums and the counts live in shared memory when they fit (200 KiB), else
//     in `cent` and the workspace (global memory is coherent inside the CTA across
//     __syncthreads). The assignment keeps each point in registers (float4, up to 64 dims, two
//     points per thread at db <= 16) and reads centroids as broadcast float4 from shared memory;
//     other shapes take a scalar path.
//  2. per table head h:
//     - score_kernel: a CTA per 64 tokens loads their key rows (KV head h or h / G) into shared
//       memory as fp32 (padded stride d + 1: conflict-free), then walks all m * C centroid rows in
//       chunks of 64; S[row][t] = sum_i c_i * k_i in dimension order with __fmul_rn/__fadd_rn (no
//       FMA contraction), rounded through fp16 (RNE) when f16_scores;
//     - topk_rows (topk.cuh) of each of the m * C rows with k = L: the L best by (score desc,
//       index asc) -- exactly the CPU build_list's set (ties at the threshold to the lowest tokens);
//     - the order: key = (order-preserving bits of the stored score: 16 for fp16, 32 for fp32; -0
//       taken as +0) << tb | (2^tb - 1 - token), tb = bits of N - 1, so ascending keys are ascending
//       "worse" order (lower score first, equal scores: larger token first), and the key decodes
//       back to (token, stored value). Lists of L <= 16384: list_sort_kernel, a CTA per list, the
//       keys gathered from S by the top-k's tokens and bitonic-sorted in shared memory, then idx/val
//       written; with fp16 scores the key is 32 bits, (score bits << 14) | (16383 - list position),
//       the position standing for the token (the top-k lists tokens ascending). Longer lists: key_kernel to global memory, cub::DeviceSegmentedRadixSort over the
//       m * C segments (only the 16 + tb or 32 + tb key bits), out_kernel.
#include "backends/cuda/csa_build.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/status.cuh"
#include "backends/cuda/topk.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/device/device_segmented_radix_sort.cuh>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstring>

namespace kvs::cuda {
namespace {

constexpr int kMaxM = 256;             // subspaces per head
constexpr int kMaxDb = 512;            // dims per subspace (a limit of this code, not of the method)
constexpr int kKmThreads = 512;        // k-means CTA
constexpr int kKmWarps = kKmThreads / 32;
constexpr size_t kKmSmemMax = 200 * 1024;    // k-means state in shared memory up to this size
constexpr int kScoreTokens = 64;       // tokens per score CTA
constexpr int kScoreRows = 64;         // centroid rows per shared-memory chunk
constexpr int kScoreThreads = 256;
constexpr int kSortSmem = 16384;       // lists up to this length sort in shared memory (128 KiB of keys)

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// ---- counter-based random numbers ------------------------------------------------------------
__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ uint64_t rnd(uint64_t key, uint64_t ctr) { return mix64(key ^ mix64(ctr)); }
__device__ __forceinline__ double unif01(uint64_t r) { return double(r >> 11) * 0x1.0p-53; }

// A pseudo-random permutation of [0, n): a balanced 4-round Feistel network on 2 * hb bits
// (2^(2 hb) < 4 n), cycle-walking past n (expected < 4 steps).
struct Perm {
  uint32_t n = 1, hb = 1, mask = 1;
  uint64_t key = 0;
};
__device__ __forceinline__ Perm make_perm(uint32_t n, uint64_t key) {
  Perm p;
  p.n = n;
  uint32_t bits = 2;
  while (bits < 32 && (uint64_t(1) << bits) < n) bits += 2;
  p.hb = bits / 2;
  p.mask = (1u << p.hb) - 1u;
  p.key = key;
  return p;
}
__device__ __forceinline__ uint32_t perm_apply(const Perm& p, uint32_t i) {
  uint32_t x = i;
  do {
    uint32_t l = x >> p.hb, r = x & p.mask;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t f = uint32_t(mix64(p.key + uint64_t(k) * 0x632BE59BD9B4E019ull + r)) & p.mask;
      const uint32_t nl = r;
      r = l ^ f;
      l = nl;
    }
    x = (l << p.hb) | r;
  } while (x >= p.n);
  return x;
}

// ---- block scans (exclusive prefix + total) over kKmThreads threads ------------------------------
template <typename T>
__device__ T block_excl_scan(T v, T& total, T* sh /* [kKmWarps] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  T ex = __shfl_up_sync(0xffffffffu, x, 1);
  if (lane == 0) ex = T(0);
  if (lane == 31) sh[warp] = x;
  __syncthreads();
  if (warp == 0) {
    T w = lane < kKmWarps ? sh[lane] : T(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kKmWarps) sh[lane] = w;
  }
  __syncthreads();
  const T before = warp ? sh[warp - 1] : T(0);
  total = sh[kKmWarps - 1];
  __syncthreads();  // sh may be reused right away
  return before + ex;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- 1. k-means --------------------------------------------------------------------------------
struct KmArgs {
  const float* q;            // [S][Hq][d]
  float* P;                  // ws: head h's rows at h * rows * d, subspace b's block at + rows * off[b]
  float* d2;                 // ws: [TH * m][rows]
  int32_t* cnt;              // ws: [TH * m][C], points absorbed per centroid (mini-batch)
  unsigned long long* sums;  // ws (when not in shared memory): like cent, [TH][C * d] fixed-point
  int32_t* bcnt;             // ws (when not in shared memory): [TH * m][C], points per centroid this batch
  float* cent;               // out: [TH][C * d]
  int64_t rows;              // S * gq
  int32_t S, Hq, d, G, gq, m, C, iters, batch, full, pq, in_smem;
  uint64_t seed;
  uint16_t off[kMaxM], db[kMaxM];
};

// Fixed point of the per-batch sums: x * 2^30 as a 64-bit integer, so that the atomic additions
// are associative and the sums (hence the centroids) do not depend on the order the threads add
// them in. |x_i| <= 1 (unit rows): 2^-30 resolution, no overflow below 2^33 rows per centroid.
constexpr float kFix = 1073741824.f;  // 2^30
constexpr double kUnfix = 1.0 / 1073741824.0;
__device__ __forceinline__ unsigned long long to_fix(float x) {
  return static_cast<unsigned long long>(__float2ll_rn(x * kFix));
}

// Nearest centroid (largest dot, lowest j on ties) of up to PPT points (pointers p[k], k < np),
// each held in registers as float4 (db % 4 == 0, db <= CH); c in shared memory, 16-byte aligned.
template <int CH, int PPT>
__device__ __forceinline__ void nearest_fast(const float* const (&p)[PPT], int np, int db, const float* c, int C,
                                             int (&out)[PPT]) {
  constexpr int V = CH / 4;
  const int dv = db >> 2;
  float4 x[PPT][V];
#pragma unroll
  for (int k = 0; k < PPT; ++k)
#pragma unroll
    for (int v = 0; v < V; ++v)
      x[k][v] = (k < np && v < dv) ? reinterpret_cast<const float4*>(p[k])[v] : make_float4(0.f, 0.f, 0.f, 0.f);
  float best[PPT];
#pragma unroll
  for (int k = 0; k < PPT; ++k) best[k] = -INFINITY, out[k] = 0;
  for (int j = 0; j < C; ++j) {
    const float4* cj = reinterpret_cast<const float4*>(c + size_t(j) * db);
    float s[PPT];
#pragma unroll
    for (int k = 0; k < PPT; ++k) s[k] = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if (v < dv) {
        const float4 cc = cj[v];
#pragma unroll
        for (int k = 0; k < PPT; ++k) {
          s[k] += x[k][v].x * cc.x;
          s[k] += x[k][v].y * cc.y;
          s[k] += x[k][v].z * cc.z;
          s[k] += x[k][v].w * cc.w;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < PPT; ++k)
      if (s[k] > best[k]) best[k] = s[k], out[k] = j;
  }
}

__device__ __forceinline__ int nearest_scalar(const float* x, int db, const float* c, int C) {
  float best = -INFINITY;
  int bj = 0;
  for (int j = 0; j < C; ++j) {
    const float* cj = c + size_t(j) * db;
    float s = 0.f;
    for (int i = 0; i < db; ++i) s += x[i] * cj[i];
    if (s > best) best = s, bj = j;
  }
  return bj;
}

// Adds point x (row of db floats) to centroid j's batch sum and count.
__device__ __forceinline__ void accumulate(const float* x, int db, int j, unsigned long long* sums, int32_t* bcnt) {
  atomicAdd(&bcnt[j], 1);
  unsigned long long* sj = sums + size_t(j) * db;
  for (int i = 0; i < db; ++i) atomicAdd(&sj[i], to_fix(x[i]));
}

// Assigns points pt(i), i < n, to their nearest centroids and adds each to its centroid's batch
// sum. CH = 0: the scalar path.
template <int CH, typename PtOf>
__device__ void assign_points(const float* P, int db, const float* c, int C, int n, unsigned long long* sums,
                              int32_t* bcnt, PtOf pt) {
  if constexpr (CH == 0) {
    for (int i = threadIdx.x; i < n; i += kKmThreads) {
      const float* x = P + size_t(pt(i)) * db;
      accumulate(x, db, nearest_scalar(x, db, c, C), sums, bcnt);
    }
  } else {
    constexpr int PPT = CH <= 16 ? 2 : 1;
    for (int i0 = threadIdx.x * PPT; i0 < n; i0 += kKmThreads * PPT) {
      const float* p[PPT];
      const int np = min(PPT, n - i0);
#pragma unroll
      for (int k = 0; k < PPT; ++k) p[k] = P + size_t(pt(k < np ? i0 + k : i0)) * db;
      int out[PPT];
      nearest_fast<CH, PPT>(p, np, db, c, C, out);
#pragma unroll
      for (int k = 0; k < PPT; ++k)
        if (k < np) accumulate(p[k], db, out[k], sums, bcnt);
    }
  }
}

// x . c in dimension order (float): float4 loads on the fast path (CH > 0: db % 4 == 0, x and c
// 16-byte aligned), scalar otherwise.
template <int CH>
__device__ __forceinline__ float seed_dot(const float* x, const float* c, int db) {
  float s = 0.f;
  if constexpr (CH > 0) {
#pragma unroll
    for (int v = 0; v < CH / 4; ++v)
      if (4 * v < db) {
        const float4 a = reinterpret_cast<const float4*>(x)[v], b = reinterpret_cast<const float4*>(c)[v];
        s += a.x * b.x;
        s += a.y * b.y;
        s += a.z * b.z;
        s += a.w * b.w;
      }
  } else {
    for (int i = 0; i < db; ++i) s += x[i] * c[i];
  }
  return s;
}

// Projects centroid c[0..db) back to the unit sphere (float64 norm, as kmeans.cpp); warp-wide.
__device__ __forceinline__ void warp_normalise(float* c, int db, int lane) {
  double s = 0;
  for (int i = lane; i < db; i += 32) s += double(c[i]) * c[i];
  s = warp_sum(s);
  if (s <= 0) return;
  const float inv = float(1.0 / sqrt(s));
  for (int i = lane; i < db; i += 32) c[i] *= inv;
}

template <int CH>
__global__ void __launch_bounds__(kKmThreads) kmeans_kernel(const __grid_constant__ KmArgs a) {
  extern __shared__ float4 smem4[];
  __shared__ double sh_d[kKmWarps];
  __shared__ int sh_i[kKmWarps];
  __shared__ int sh_chosen;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.x / a.m, b = blockIdx.x % a.m;
  const int db = a.db[b], off = a.off[b], C = a.C;
  const int64_t rows = a.rows;
  const int prob = blockIdx.x;
  float* P = a.P + size_t(h) * rows * a.d + size_t(rows) * off;
  float* d2 = a.d2 + size_t(prob) * rows;
  int32_t* cnt = a.cnt + size_t(prob) * C;
  float* cout = a.cent + size_t(h) * C * a.d + size_t(C) * off;
  // Centroids, batch sums and batch counts: shared memory (cent | sums | counts) or global.
  float* c = cout;
  unsigned long long* sums = a.sums + size_t(h) * C * a.d + size_t(C) * off;
  int32_t* bcnt = a.bcnt + size_t(prob) * C;
  if (a.in_smem) {
    c = reinterpret_cast<float*>(smem4);
    sums = reinterpret_cast<unsigned long long*>(smem4 + (size_t(C) * db + 3) / 4);
    bcnt = reinterpret_cast<int32_t*>(sums + size_t(C) * db);
  }

  // Compaction of the non-zero, normalised rows (row order r * gq + g).
  int npts = 0;
  for (int64_t base = 0; base < rows; base += kKmThreads) {
    const int64_t r = base + tid;
    const float* src = nullptr;
    double nn = 0;
    if (r < rows) {
      const int64_t s = r / a.gq;
      const int g = int(r % a.gq);
      const int qh = a.pq ? h : h * a.G + g;
      src = a.q + (size_t(s) * a.Hq + qh) * a.d + off;
      for (int i = 0; i < db; ++i) nn += double(src[i]) * src[i];
    }
    const int flag = nn > 0 ? 1 : 0;
    int total;
    const int pos = block_excl_scan<int>(flag, total, sh_i);
    if (flag) {
      const float inv = float(1.0 / sqrt(nn));
      float* dst = P + size_t(npts + pos) * db;
      for (int i = 0; i < db; ++i) dst[i] = src[i] * inv;
    }
    npts += total;
  }
  for (int j = tid; j < C; j += kKmThreads) cnt[j] = 0;
  __syncthreads();  // P complete

  if (npts == 0) {  // no direction at all: any unit centroids (kmeans.cpp's choice)
    for (int e = tid; e < C * db; e += kKmThreads) c[e] = (e % db) == (e / db) % db ? 1.f : 0.f;
  } else {
    // ---- k-means++ seeding ----
    const uint64_t key = a.seed + uint64_t(h) * 8191ull + uint64_t(b);
    {
      const int first = int(rnd(key, 0) % uint64_t(npts));
      for (int i = tid; i < db; i += kKmThreads) c[i] = P[size_t(first) * db + i];
    }
    // Thread tid owns points tid, tid + 512, ... (coalesced loads); the D^2 sampling walks the
    // points in (thread, k) order -- any fixed order samples proportionally to D^2.
    for (int j = 1; j <= C; ++j) {
      __syncthreads();  // centroid j - 1 written
      const float* cj = c + size_t(j - 1) * db;
      double mine = 0;
      for (int p = tid; p < npts; p += kKmThreads) {
        const float dot = seed_dot<CH>(P + size_t(p) * db, cj, db);
        const float v = float(fmax(0.0, 2.0 - 2.0 * double(dot)));
        const float nd = j == 1 ? v : fminf(d2[p], v);
        d2[p] = nd;
        mine += nd;
      }
      if (j == C) break;
      if (tid == 0) sh_chosen = INT_MAX;
      double total;
      const double ex = block_excl_scan<double>(mine, total, sh_d);  // syncs: sh_chosen visible
      int chosen;
      if (!(total > 0)) {
        chosen = int(rnd(key, uint64_t(j)) % uint64_t(npts));  // fewer distinct directions than centroids
      } else {
        const double u = unif01(rnd(key, uint64_t(j))) * total;
        if (mine > 0 && ex <= u && u < ex + mine) {
          double acc = ex;
          int pick = -1;
          for (int p = tid; p < npts; p += kKmThreads) {
            if (d2[p] > 0) pick = p;  // rounding fallback: the range's last point with weight
            acc += d2[p];
            if (acc > u) {
              pick = p;
              break;
            }
          }
          if (pick >= 0) atomicMin(&sh_chosen, pick);
        }
        __syncthreads();
        chosen = sh_chosen == INT_MAX ? npts - 1 : sh_chosen;
      }
      for (int i = tid; i < db; i += kKmThreads) c[size_t(j) * db + i] = P[size_t(chosen) * db + i];
    }
    __syncthreads();

    // ---- updates: a batch (mini-batch) or all points (Lloyd) per step ----
    // Sculley's sequential updates of centroid j by its batch rows x_1..x_K, c <- (1 - 1/n) c + x / n
    // with n = n0 + 1, ..., n0 + K, telescope to c = (n0 c0 + sum_k x_k) / (n0 + K): that closed
    // form is applied (float64, from the fixed-point sums), then the projection to the sphere.
    // Lloyd: c_j = sum of its points, normalised; an empty cluster keeps its centroid.
    const int B = a.full ? npts : max(1, min(a.batch, npts));
    for (int it = 1; it <= a.iters; ++it) {
      const Perm pm = make_perm(uint32_t(npts), rnd(key, 0x5EED000000000000ull + uint64_t(it)));
      for (int start = 0; start < npts; start += B) {
        const int nb = min(B, npts - start);
        for (int e = tid; e < C * db; e += kKmThreads) sums[e] = 0ull;
        for (int j = tid; j < C; j += kKmThreads) bcnt[j] = 0;
        __syncthreads();
        if (a.full) assign_points<CH>(P, db, c, C, nb, sums, bcnt, [](int i) { return i; });
        else assign_points<CH>(P, db, c, C, nb, sums, bcnt, [&](int i) { return int(perm_apply(pm, uint32_t(start + i))); });
        __syncthreads();
        for (int j = warp; j < C; j += kKmWarps) {
          const int K = bcnt[j];
          if (!K) continue;  // untouched (Lloyd: empty) -- keeps its centroid
          float* cj = c + size_t(j) * db;
          const unsigned long long* sj = sums + size_t(j) * db;
          if (a.full) {
            double s = 0;
            for (int i = lane; i < db; i += 32) {
              const double v = double(static_cast<long long>(sj[i])) * kUnfix;
              s += v * v;
            }
            s = warp_sum(s);
            if (s <= 0) continue;
            const double inv = 1.0 / sqrt(s);
            for (int i = lane; i < db; i += 32) cj[i] = float(double(static_cast<long long>(sj[i])) * kUnfix * inv);
          } else {
            const int n0 = cnt[j], n = n0 + K;
            for (int i = lane; i < db; i += 32)
              cj[i] = float((double(n0) * cj[i] + double(static_cast<long long>(sj[i])) * kUnfix) / double(n));
            __syncwarp();
            if (lane == 0) cnt[j] = n;
            warp_normalise(cj, db, lane);
          }
        }
        __syncthreads();
      }
    }
  }
  __syncthreads();
  if (a.in_smem)
    for (int e = tid; e < C * db; e += kKmThreads) cout[e] = c[e];
}

// ---- 2. scores -----------------------------------------------------------------------------------
struct ScoreArgs {
  PagedKv kv;
  const float* cent;  // head h's [C * d]
  float* S;           // [m * C][N]
  int32_t N, Hkv, d, C, m, kvh, f16;
  uint16_t off[kMaxM], db[kMaxM];
};

__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ void to_f32x8(const uint4& u, float* out) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_f32(e[i]);
}

// s = sum_i c[i] * k[i] in dimension order, no FMA; k in registers (db <= 32), c in shared memory
// (float4 reads when VEC: 16-byte aligned, db % 4 == 0).
template <bool VEC>
__device__ __forceinline__ float dot_regs(const float* c, const float (&k)[32], int db) {
  float s = 0.f;
  if constexpr (VEC) {
#pragma unroll
    for (int v = 0; v < 8; ++v)
      if (4 * v < db) {
        const float4 cc = reinterpret_cast<const float4*>(c)[v];
        s = __fadd_rn(s, __fmul_rn(cc.x, k[4 * v]));
        s = __fadd_rn(s, __fmul_rn(cc.y, k[4 * v + 1]));
        s = __fadd_rn(s, __fmul_rn(cc.z, k[4 * v + 2]));
        s = __fadd_rn(s, __fmul_rn(cc.w, k[4 * v + 3]));
      }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i)
      if (i < db) s = __fadd_rn(s, __fmul_rn(c[i], k[i]));
  }
  return s;
}

// A CTA per kScoreTokens tokens of one table head: their keys (fp32) in shared memory, then every
// centroid row in chunks of kScoreRows; thread (token tt, row group rg) computes rows rg, rg + 4, ...
// of the chunk, its key sub-vector held in registers (db <= 32) while the subspace stays the same.
template <typename T>
__global__ void __launch_bounds__(kScoreThreads) score_kernel(const __grid_constant__ ScoreArgs a) {
  extern __shared__ float4 sm4[];
  float* sm = reinterpret_cast<float*>(sm4);
  const int d = a.d, ks_stride = d + 1;
  float* ks = sm;                                // [kScoreTokens][d + 1]
  float* cs = sm + kScoreTokens * ks_stride;     // [kScoreRows][d] (16-byte aligned: 64 * 4 * (d + 1))
  const int t0 = blockIdx.x * kScoreTokens;
  const int nt = min(kScoreTokens, a.N - t0);
  if (d % 8 == 0) {  // 16-byte loads of the key rows
    const int d8 = d / 8;
    for (int e = threadIdx.x; e < kScoreTokens * d8; e += kScoreThreads) {
      const int tt = e / d8, i8 = e % d8;
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (tt < nt) to_f32x8<T>(__ldg(reinterpret_cast<const uint4*>(kv_row<T>(a.kv, a.Hkv, d, 0, a.kvh, t0 + tt, 0)) + i8), v);
#pragma unroll
      for (int i = 0; i < 8; ++i) ks[tt * ks_stride + i8 * 8 + i] = v[i];
    }
  } else {
    for (int e = threadIdx.x; e < kScoreTokens * d; e += kScoreThreads) {
      const int tt = e / d, i = e % d;
      ks[tt * ks_stride + i] = tt < nt ? to_f32(kv_row<T>(a.kv, a.Hkv, d, 0, a.kvh, t0 + tt, 0)[i]) : 0.f;
    }
  }
  const int tt = threadIdx.x % kScoreTokens, rg = threadIdx.x / kScoreTokens;
  const int rows = a.m * a.C;
  const float* k = ks + tt * ks_stride;
  float kr[32];
  int cur_b = -1;
  for (int r0 = 0; r0 < rows; r0 += kScoreRows) {
    const int nr = min(kScoreRows, rows - r0);
    __syncthreads();  // keys loaded / previous chunk consumed
    for (int rr = threadIdx.x / 32; rr < nr; rr += kScoreThreads / 32) {
      const int r = r0 + rr, b = r / a.C, j = r % a.C, db = a.db[b];
      const float* src = a.cent + size_t(a.C) * a.off[b] + size_t(j) * db;
      for (int i = threadIdx.x % 32; i < db; i += 32) cs[rr * d + i] = src[i];
    }
    __syncthreads();
    if (tt >= nt) continue;
    for (int rr = rg; rr < nr; rr += kScoreThreads / kScoreTokens) {
      const int r = r0 + rr, b = r / a.C, db = a.db[b];
      const float* cr = cs + rr * d;
      float s;
      if (db <= 32) {
        if (b != cur_b) {
          cur_b = b;
          const float* kb = k + a.off[b];
#pragma unroll
          for (int i = 0; i < 32; ++i) kr[i] = i < db ? kb[i] : 0.f;
        }
        s = (d % 4 == 0 && db % 4 == 0) ? dot_regs<true>(cr, kr, db) : dot_regs<false>(cr, kr, db);
      } else {
        const float* kb = k + a.off[b];
        s = 0.f;
        for (int i = 0; i < db; ++i) s = __fadd_rn(s, __fmul_rn(cr[i], kb[i]));
      }
      if (a.f16) s = __half2float(__float2half_rn(s));
      a.S[size_t(r) * a.N + t0 + tt] = s;
    }
  }
}

// ---- 3. list order ------------------------------------------------------------------------------
// Sort key of a list entry: (order-preserving bits of the stored score) << tb | (tmask - token),
// tmask = 2^tb - 1 >= N - 1: ascending keys = ascending "worse" order (lower score first, among
// equal scores the larger token first). The score bits are the fp16 bits (16) or the fp32 bits
// (32); -0 is taken as +0 (the two compare equal). The key decodes back to the stored value.
struct KeyFmt {
  int32_t tb;     // token bits
  int32_t f16;    // 16-bit score field, else 32
};
__device__ __forceinline__ unsigned long long make_key(float s, uint32_t t, const KeyFmt& f) {
  if (s == 0.f) s = 0.f;  // -0 orders as +0
  uint64_t ord;
  if (f.f16) {
    const uint32_t h = __half_as_ushort(__float2half_rn(s));  // exact: s is already fp16-rounded
    ord = (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
  } else {
    const uint32_t u = __float_as_uint(s);
    ord = (u & 0x80000000u) ? uint32_t(~u) : (u | 0x80000000u);
  }
  const uint64_t tmask = (uint64_t(1) << f.tb) - 1;
  return (ord << f.tb) | (tmask - t);
}
__device__ __forceinline__ void store_entry(unsigned long long key, const KeyFmt& f, int32_t* idx, void* val,
                                            int64_t e) {
  const uint64_t tmask = (uint64_t(1) << f.tb) - 1;
  idx[e] = int32_t(tmask - (key & tmask));
  const uint32_t ord = uint32_t(key >> f.tb);
  if (f.f16) {
    static_cast<uint16_t*>(val)[e] = uint16_t((ord & 0x8000u) ? (ord & 0x7FFFu) : (~ord & 0xFFFFu));
  } else {
    static_cast<float*>(val)[e] = __uint_as_float((ord & 0x80000000u) ? (ord & 0x7FFFFFFFu) : ~ord);
  }
}

// One CTA per list (L <= kSortSmem): the L keys (scores gathered from S by the top-k's tokens) in
// shared memory, padded to P2 = 2^ceil(log2 L) with ~0 (above every real key), a bitonic sort,
// then idx/val written. K = uint32 (fp16 scores only): the key holds the list position i instead
// of the token -- (ord16 << 14) | (16383 - i) -- since the top-k lists tokens ascending, position
// order is token order; the token is read back from the top-k output. Half the shared-memory
// traffic and footprint of the 64-bit keys (K = uint64: make_key's format).
template <typename K>
__global__ void __launch_bounds__(1024) list_sort_kernel(const float* S, int32_t N, const int32_t* tidx, int32_t L,
                                                         int32_t P2, KeyFmt f, int32_t* idx, void* val) {
  extern __shared__ float4 sort_smem4[];
  K* keys = reinterpret_cast<K*>(sort_smem4);
  constexpr bool k32 = sizeof(K) == 4;
  constexpr uint32_t kPosMask = kSortSmem - 1;  // 14 bits of list position
  const int64_t row = blockIdx.x;
  const int nt = blockDim.x;
  const int32_t* trow = tidx + row * L;
  for (int i = threadIdx.x; i < P2; i += nt) {
    K k = K(~K(0));
    if (i < L) {
      const uint32_t t = uint32_t(trow[i]);
      float s = S[size_t(row) * N + t];
      if constexpr (k32) {
        if (s == 0.f) s = 0.f;  // -0 orders as +0
        const uint32_t h = __half_as_ushort(__float2half_rn(s));
        const uint32_t ord = (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
        k = K((ord << 14) | (kPosMask - uint32_t(i)));
      } else {
        k = K(make_key(s, t, f));
      }
    }
    keys[i] = k;
  }
  __syncthreads();
  for (int k = 2; k <= P2; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < P2 / 2; i += nt) {
        const int lo = ((i & ~(j - 1)) << 1) | (i & (j - 1)), hi = lo + j;
        const bool up = (lo & k) == 0;
        const K a = keys[lo], b = keys[hi];
        if ((a > b) == up) keys[lo] = b, keys[hi] = a;
      }
      __syncthreads();
    }
  for (int i = threadIdx.x; i < L; i += nt) {
    if constexpr (k32) {
      const uint32_t key = uint32_t(keys[i]);
      const uint32_t pos = kPosMask - (key & kPosMask), ord = key >> 14;
      idx[row * L + i] = trow[pos];
      static_cast<uint16_t*>(val)[row * L + i] = uint16_t((ord & 0x8000u) ? (ord & 0x7FFFu) : (~ord & 0xFFFFu));
    } else {
      store_entry(keys[i], f, idx, val, row * L + i);
    }
  }
}

// Longer lists: keys to global memory, CUB's segmented radix sort, then idx/val.
__global__ void key_kernel(const float* S, int32_t N, const int32_t* tidx, int32_t L, int64_t total, KeyFmt f,
                           unsigned long long* keys) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / L;
    const uint32_t t = uint32_t(tidx[e]);
    keys[e] = make_key(S[size_t(row) * N + t], t, f);
  }
}

__global__ void offsets_kernel(int32_t* offs, int32_t n, int32_t L) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i <= n; i += gridDim.x * blockDim.x) offs[i] = i * L;
}

__global__ void out_kernel(const unsigned long long* keys, int64_t total, KeyFmt f, int32_t* idx, void* val) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x)
    store_entry(keys[e], f, idx, val, e);
}

// ---- host side -----------------------------------------------------------------------------------
struct Layout {
  size_t P = 0, d2 = 0, cnt = 0, sums = 0, bcnt = 0, S = 0, tidx = 0, kA = 0, kB = 0, offs = 0, cub = 0, topk = 0;
  size_t cub_bytes = 0, topk_bytes = 0, total = 0;
};

// Shape checks shared by the size function and the call; "" when fine.
const char* check_shape(const CsaBuildShape& s, int32_t S) {
  if (s.tokens < 1 || s.num_kv_heads < 1 || s.num_q_heads < 1 || s.head_dim < 1 || S < 1)
    return "csa_build: tokens, heads, head_dim and sample_rows must be >= 1";
  if (s.num_q_heads % s.num_kv_heads) return "csa_build: num_q_heads must be a multiple of num_kv_heads";
  if (s.table_heads != (s.per_query_head ? s.num_q_heads : s.num_kv_heads))
    return "csa_build: table_heads must be Hq with per_query_head, else Hkv";
  if (s.m < 1 || s.m > kMaxM || s.m > s.head_dim || !s.off || !s.db) return "csa_build: m must be in [1, min(256, d)] with off/db";
  int o = 0;
  for (int b = 0; b < s.m; ++b) {
    if (s.off[b] != o || s.db[b] < 1 || s.db[b] > kMaxDb) return "csa_build: subspaces must be contiguous, 1..512 dims each";
    o += s.db[b];
  }
  if (o != s.head_dim) return "csa_build: subspace sizes must sum to head_dim";
  if (4 * (size_t(kScoreTokens) * (s.head_dim + 1) + size_t(kScoreRows) * s.head_dim) > 227 * 1024)
    return "csa_build: head_dim too large for the score kernel's shared memory (d <= 443)";
  const int64_t gq = s.per_query_head ? 1 : s.num_q_heads / s.num_kv_heads;
  if (s.C < 1 || int64_t(s.C) > int64_t(S) * gq) return "csa_build: C must be in [1, sample_rows * group]";
  if (s.L < 1 || s.L > s.tokens) return "csa_build: L must be in [1, tokens]";
  if (int64_t(s.m) * s.C * s.L >= (int64_t(1) << 31) || int64_t(S) * gq >= (int64_t(1) << 31) ||
      int64_t(s.C) * s.head_dim >= (int64_t(1) << 31))
    return "csa_build: lists or sample too large (int32 counts)";
  return "";
}

int32_t token_bits(int32_t N) {
  int32_t tb = 1;
  while ((int64_t(1) << tb) < N) ++tb;
  return tb;
}
int32_t score_bits(const CsaBuildShape& s) { return s.f16_scores ? 16 : 32; }

Layout layout(const CsaBuildShape& s, int32_t S) {
  Layout l;
  const int64_t gq = s.per_query_head ? 1 : s.num_q_heads / s.num_kv_heads;
  const size_t rows = size_t(S) * size_t(gq), probs = size_t(s.table_heads) * s.m;
  const size_t lists = size_t(s.m) * s.C, items = lists * size_t(s.L);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t p = at;
    at = align_up(at + bytes, 256);
    return p;
  };
  l.P = take(4 * rows * s.table_heads * s.head_dim);
  l.d2 = take(4 * rows * probs);
  l.cnt = take(4 * size_t(s.C) * probs);
  l.sums = take(8 * size_t(s.C) * s.head_dim * s.table_heads);
  l.bcnt = take(4 * size_t(s.C) * probs);
  l.S = take(4 * lists * size_t(s.tokens));
  l.tidx = take(4 * items);
  if (s.L > kSortSmem) {  // lists sorted by CUB in global memory
    l.kA = take(8 * items);
    l.kB = take(8 * items);
    l.offs = take(4 * (lists + 1));
    size_t cb = 0;
    cub::DeviceSegmentedRadixSort::SortKeys(nullptr, cb, static_cast<const unsigned long long*>(nullptr),
                                            static_cast<unsigned long long*>(nullptr), int(items), int(lists),
                                            static_cast<const int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                            0, score_bits(s) + token_bits(s.tokens));
    l.cub_bytes = cb;
    l.cub = take(cb);
  }
  l.topk_bytes = topk_rows_workspace_bytes(int32_t(lists), s.tokens, s.L);
  l.topk = take(l.topk_bytes);
  l.total = at;
  return l;
}

template <int CH>
Status launch_kmeans(const KmArgs& a, int grid, size_t smem, cudaStream_t st) {
  if (smem > 48 * 1024)
    KVS_CUDA_TRY(cudaFuncSetAttribute(kmeans_kernel<CH>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                 "csa_build: cudaFuncSetAttribute (k-means)");
  kmeans_kernel<CH><<<grid, kKmThreads, smem, st>>>(a);
  return launch_status("csa_build: k-means launch");
}

template <typename T>
Status launch_scores(const ScoreArgs& a, cudaStream_t st) {
  const size_t smem = 4 * (size_t(kScoreTokens) * (a.d + 1) + size_t(kScoreRows) * a.d);
  if (smem > 48 * 1024)
    KVS_CUDA_TRY(cudaFuncSetAttribute(score_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                 "csa_build: cudaFuncSetAttribute (scores)");
  score_kernel<T><<<(a.N + kScoreTokens - 1) / kScoreTokens, kScoreThreads, smem, st>>>(a);
  return launch_status("csa_build: score launch");
}

}  // namespace

size_t csa_build_workspace_bytes(const CsaBuildShape& s, int32_t sample_rows) noexcept {
  if (*check_shape(s, sample_rows)) return 0;
  return layout(s, sample_rows).total;
}

Status csa_build(const CsaBuildShape& s, const CsaKmeans& km, const float* q_sample, int32_t sample_rows,
                 const PagedKv& kv, Scalar kv_dtype, float* cent, int32_t* idx, void* val,
                 const Workspace& ws, void* stream) noexcept {
  if (const char* why = check_shape(s, sample_rows); *why) return invalid(why);
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("csa_build: kv_dtype must be BF16 or F16");
  if (km.iters < 0 || km.batch < 1) return invalid("csa_build: iters must be >= 0 and batch >= 1");
  if (!q_sample || !cent || !idx || !val || !kv.pages || kv.page_tokens < 1 ||
      int64_t(s.tokens) > int64_t(kv.max_pages) * kv.page_tokens)
    return invalid("csa_build: null pointer or tokens past the page table");
  const Layout l = layout(s, sample_rows);
  if (ws.bytes < l.total || (l.total && !ws.ptr)) return invalid("csa_build: workspace too small");
  auto* st = static_cast<cudaStream_t>(stream);
  char* w = static_cast<char*>(ws.ptr);
  const int G = s.num_q_heads / s.num_kv_heads;

  // 1. k-means, a CTA per (h, b).
  KmArgs a{};
  a.q = q_sample;
  a.P = reinterpret_cast<float*>(w + l.P);
  a.d2 = reinterpret_cast<float*>(w + l.d2);
  a.cnt = reinterpret_cast<int32_t*>(w + l.cnt);
  a.sums = reinterpret_cast<unsigned long long*>(w + l.sums);
  a.bcnt = reinterpret_cast<int32_t*>(w + l.bcnt);
  a.cent = cent;
  a.gq = s.per_query_head ? 1 : G;
  a.rows = int64_t(sample_rows) * a.gq;
  a.S = sample_rows, a.Hq = s.num_q_heads, a.d = s.head_dim, a.G = G, a.m = s.m, a.C = s.C;
  a.iters = km.iters, a.batch = km.batch, a.full = km.full_batch, a.pq = s.per_query_head;
  a.seed = km.seed;
  int maxdb = 0, alldiv4 = 1;
  for (int b = 0; b < s.m; ++b) {
    a.off[b] = uint16_t(s.off[b]), a.db[b] = uint16_t(s.db[b]);
    maxdb = std::max(maxdb, s.db[b]);
    alldiv4 &= s.db[b] % 4 == 0;
  }
  // Shared memory: centroids (padded to 16 bytes), fixed-point batch sums, batch counts.
  const size_t km_smem = 16 * ((size_t(s.C) * maxdb + 3) / 4) + 8 * size_t(s.C) * maxdb + 4 * size_t(s.C);
  a.in_smem = km_smem <= kKmSmemMax;
  const size_t smem = a.in_smem ? km_smem : 0;
  const int grid = s.table_heads * s.m;
  Status st_km;
  if (!a.in_smem || !alldiv4 || maxdb > 64) st_km = launch_kmeans<0>(a, grid, smem, st);
  else if (maxdb <= 16) st_km = launch_kmeans<16>(a, grid, smem, st);
  else if (maxdb <= 32) st_km = launch_kmeans<32>(a, grid, smem, st);
  else st_km = launch_kmeans<64>(a, grid, smem, st);
  if (!st_km.ok()) return st_km;

  // 2. per table head: scores, top-L, ordering.
  const int32_t lists = s.m * s.C;
  const int64_t items = int64_t(lists) * s.L;
  float* S = reinterpret_cast<float*>(w + l.S);
  int32_t* tidx = reinterpret_cast<int32_t*>(w + l.tidx);
  const KeyFmt kf{token_bits(s.tokens), s.f16_scores ? 1 : 0};
  const bool smem_sort = s.L <= kSortSmem;
  int32_t P2 = 1;
  while (P2 < s.L) P2 <<= 1;
  const int sort_threads = std::min(1024, std::max(32, P2 / 2));
  const bool sort32 = s.f16_scores;  // 32-bit keys (score, list position) for fp16 scores
  const size_t sort_smem = size_t(P2) * (sort32 ? 4 : 8);
  if (smem_sort) {
    if (sort_smem > 48 * 1024) {
      if (sort32)
        KVS_CUDA_TRY(cudaFuncSetAttribute(list_sort_kernel<uint32_t>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(sort_smem)),
                     "csa_build: cudaFuncSetAttribute (list sort)");
      else
        KVS_CUDA_TRY(cudaFuncSetAttribute(list_sort_kernel<unsigned long long>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, int(sort_smem)),
                     "csa_build: cudaFuncSetAttribute (list sort)");
    }
  } else {
    offsets_kernel<<<(lists + 256) / 256, 256, 0, st>>>(reinterpret_cast<int32_t*>(w + l.offs), lists, s.L);
    KVS_LAUNCH_CHECK("csa_build: offsets launch");
  }
  ScoreArgs sa{};
  sa.kv = kv;
  sa.N = s.tokens, sa.Hkv = s.num_kv_heads, sa.d = s.head_dim, sa.C = s.C, sa.m = s.m, sa.f16 = s.f16_scores;
  for (int b = 0; b < s.m; ++b) sa.off[b] = a.off[b], sa.db[b] = a.db[b];
  const int eg = int(std::min<int64_t>((items + 255) / 256, 132 * 16));
  const size_t vb = s.f16_scores ? 2 : 4;
  for (int h = 0; h < s.table_heads; ++h) {
    sa.cent = cent + size_t(h) * s.C * s.head_dim;
    sa.S = S;
    sa.kvh = s.per_query_head ? h / G : h;
    const Status sc = kv_dtype == Scalar::BF16 ? launch_scores<__nv_bfloat16>(sa, st) : launch_scores<__half>(sa, st);
    if (!sc.ok()) return sc;
    const Status tk = topk_rows(S, s.tokens, nullptr, lists, s.tokens, s.L, tidx, nullptr,
                                Workspace{w + l.topk, l.topk_bytes}, stream);
    if (!tk.ok()) return tk;
    int32_t* idx_h = idx + size_t(h) * items;
    void* val_h = static_cast<char*>(val) + size_t(h) * items * vb;
    if (smem_sort) {
      if (sort32)
        list_sort_kernel<uint32_t><<<lists, sort_threads, sort_smem, st>>>(S, s.tokens, tidx, s.L, P2, kf, idx_h, val_h);
      else
        list_sort_kernel<unsigned long long>
            <<<lists, sort_threads, sort_smem, st>>>(S, s.tokens, tidx, s.L, P2, kf, idx_h, val_h);
      KVS_LAUNCH_CHECK("csa_build: list sort launch");
    } else {
      auto* kA = reinterpret_cast<unsigned long long*>(w + l.kA);
      auto* kB = reinterpret_cast<unsigned long long*>(w + l.kB);
      const int32_t* offs = reinterpret_cast<const int32_t*>(w + l.offs);
      key_kernel<<<eg, 256, 0, st>>>(S, s.tokens, tidx, s.L, items, kf, kA);
      KVS_LAUNCH_CHECK("csa_build: key launch");
      size_t cb = l.cub_bytes;
      KVS_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeys(w + l.cub, cb, static_cast<const unsigned long long*>(kA), kB,
                                                           int(items), int(lists), offs, offs + 1, 0,
                                                           score_bits(s) + kf.tb, st),
                   "csa_build: cub::DeviceSegmentedRadixSort::SortKeys");
      out_kernel<<<eg, 256, 0, st>>>(kB, items, kf, idx_h, val_h);
      KVS_LAUNCH_CHECK("csa_build: output launch");
    }
  }
  return Status{};
}

// ---- the token-ordered copy of the lists (csattention's fused search) ----
namespace {
// Lists sorted per call of cub: at most this many entries (bounds the workspace: about 12 or 16
// bytes each with cub's own buffers).
constexpr int64_t kTokenSortItems = int64_t(1) << 22;

struct TokenSortLayout {
  int64_t chunk;  // lists per sort
  size_t keys, vals, offs, cub, cub_bytes, total;
};
TokenSortLayout token_sort_layout(int64_t lists, int32_t L, bool f16) {
  TokenSortLayout t{};
  t.chunk = std::max<int64_t>(1, std::min<int64_t>(lists, kTokenSortItems / std::max(L, 1)));
  const size_t items = size_t(t.chunk) * size_t(L);
  size_t o = 0;
  auto take = [&](size_t b) {
    const size_t at = o;
    o = align_up(o + b, 256);
    return at;
  };
  t.keys = take(items * 4);
  t.vals = take(items * (f16 ? 2 : 4));
  t.offs = take(size_t(t.chunk + 1) * 4);
  size_t cb = 0;
  if (f16)
    cub::DeviceSegmentedRadixSort::SortPairs(nullptr, cb, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                             static_cast<const uint16_t*>(nullptr), static_cast<uint16_t*>(nullptr), int(items),
                                             int(t.chunk), static_cast<const int32_t*>(nullptr),
                                             static_cast<const int32_t*>(nullptr));
  else
    cub::DeviceSegmentedRadixSort::SortPairs(nullptr, cb, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                             static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr), int(items),
                                             int(t.chunk), static_cast<const int32_t*>(nullptr),
                                             static_cast<const int32_t*>(nullptr));
  t.cub_bytes = cb;
  t.cub = take(cb);
  t.total = o;
  return t;
}

__global__ void fill_kernel(int32_t* p, int64_t n, int32_t v) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) p[i] = v;
}
}  // namespace

size_t csa_token_lists_workspace_bytes(int64_t lists, int32_t L, bool f16_scores) noexcept {
  if (lists < 1 || L < 1) return 0;
  return token_sort_layout(lists, L, f16_scores).total;
}

Status csa_token_lists(int64_t lists, int32_t L, int32_t Lcap, bool f16, const int32_t* idx, const void* val,
                       int32_t* sidx, void* sval, int32_t* scnt, const Workspace& ws, void* stream) noexcept {
  if (lists < 1 || L < 1 || Lcap < L) return invalid("csa_token_lists: need lists >= 1 and 1 <= L <= Lcap");
  if (!idx || !val || !sidx || !sval || !scnt) return invalid("csa_token_lists: null pointer");
  const TokenSortLayout t = token_sort_layout(lists, L, f16);
  if (!ws.ptr || ws.bytes < t.total) return invalid("csa_token_lists: workspace smaller than csa_token_lists_workspace_bytes");
  char* w = static_cast<char*>(ws.ptr);
  auto* keys = reinterpret_cast<int32_t*>(w + t.keys);
  void* vals = w + t.vals;
  auto* offs = reinterpret_cast<int32_t*>(w + t.offs);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const size_t es = f16 ? 2 : 4;
  for (int64_t c0 = 0; c0 < lists; c0 += t.chunk) {
    const int64_t nl = std::min(t.chunk, lists - c0);
    const int items = int(nl * L);
    offsets_kernel<<<unsigned(std::min<int64_t>((nl + 256) / 256, 1024)), 256, 0, st>>>(offs, int32_t(nl), L);
    KVS_LAUNCH_CHECK("csattention token lists: offsets launch");
    size_t cb = t.cub_bytes;
    cudaError_t e;
    if (f16)
      e = cub::DeviceSegmentedRadixSort::SortPairs(w + t.cub, cb, idx + c0 * L, keys,
                                                   static_cast<const uint16_t*>(val) + c0 * L, static_cast<uint16_t*>(vals),
                                                   items, int(nl), offs, offs + 1, 0, 32, st);
    else
      e = cub::DeviceSegmentedRadixSort::SortPairs(w + t.cub, cb, idx + c0 * L, keys,
                                                   static_cast<const uint32_t*>(val) + c0 * L, static_cast<uint32_t*>(vals),
                                                   items, int(nl), offs, offs + 1, 0, 32, st);
    KVS_CUDA_TRY(e, "csattention token lists: cub::DeviceSegmentedRadixSort::SortPairs");
    KVS_CUDA_TRY(cudaMemcpy2DAsync(sidx + c0 * Lcap, size_t(Lcap) * 4, keys, size_t(L) * 4, size_t(L) * 4, size_t(nl),
                                   cudaMemcpyDeviceToDevice, st),
                 "csattention token lists: cudaMemcpy2DAsync (tokens)");
    KVS_CUDA_TRY(cudaMemcpy2DAsync(static_cast<char*>(sval) + size_t(c0) * Lcap * es, size_t(Lcap) * es, vals, size_t(L) * es,
                                   size_t(L) * es, size_t(nl), cudaMemcpyDeviceToDevice, st),
                 "csattention token lists: cudaMemcpy2DAsync (scores)");
  }
  fill_kernel<<<unsigned(std::min<int64_t>((lists + 255) / 256, 1024)), 256, 0, st>>>(scnt, lists, L);
  KVS_LAUNCH_CHECK("csattention token lists: counts launch");
  return {};
}

}  // namespace kvs::cuda
