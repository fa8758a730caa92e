// SPDX-License-Identifier: Apache-2.0
// RetroInfer's decode step (retro.cuh). Four launches per step (five past kZoneSmemMax):
//   1. logits   grid (chunks of 256 clusters, Hkv, B): scale * q_g . centroid for the group's G
//               query heads (a thread per cluster), and per chunk and head the softmax's running
//               (max, sum) pair.
//  (1b. dist    only when a head's clusters do not fit the zones kernel's shared memory: the same
//               grid writes each cluster's distance to global memory; otherwise zones does it.)
//   2. zones    grid (Hkv, B), 1024 threads: the chunk pairs combined into each head's softmax and
//               each cluster's distance (the group's summed softmax, as an fp32 key ordered as its
//               bits), kept in shared memory with the zones; the retrieval zone by a radix select
//               on the keys (counted: the top r; or weighted by cluster size: the longest
//               rank-order prefix that fits the room), the estimation zone by a counted radix
//               select; ties at a threshold go to the lower cluster id (warp scans in id order), so
//               the zones are the CPU's rank-order zones; then the exact list: steady zone, the
//               place of each retrieval cluster's rows (roff), the best rows of the next cluster by
//               exact score (scaled mode), the unclustered tail and sinks.
//   3. estimate grid (chunks, Hkv, B): per chunk, the retrieval clusters' positions copied into the
//               list at their places, and the estimation clusters' weighted value means (eqs. 2-4:
//               e^(logit - M) * size * mean) and weights, as partial sums.
//   4. merge    grid (G, Hkv, B): the partial sums into the zone's state (o, lse) per query head.
// The CPU reference computes the same quantities in another order (distances and sums round
// differently), so near-ties may rank differently; tests compare within that.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "backends/cuda/launch.cuh"
#include "backends/cuda/retro.cuh"
#include "backends/cuda/status.cuh"

namespace kvs::cuda {
namespace {

constexpr int kChunk = 256;           // clusters per CTA of the logits and estimate kernels
constexpr int kChunkThreads = 256;
constexpr int kZoneThreads = 1024;
constexpr int kZoneWarps = kZoneThreads / 32;
static_assert(kZoneWarps == 32, "warps_before reads one warp total per lane");
constexpr int kZoneHists = 8;  // radix histograms of block_select, each shared by 4 warps
constexpr int kMaxGD = 2048;          // G * d: the query group held in shared memory
constexpr uint32_t kNoKey = 0xffffffffu;  // an empty cluster: never ranked

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float load_q(const Query& q, const void* base, int64_t i) {
  if (q.dtype == Scalar::F32) return static_cast<const float*>(base)[i];
  if (q.dtype == Scalar::F16) return __half2float(static_cast<const __half*>(base)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

__device__ __forceinline__ long long lmin(long long x, long long y) { return x < y ? x : y; }

// Online log-sum-exp pair (max, sum of e^(x - max)); -inf, 0 is empty.
__device__ __forceinline__ void lse_add(float& m, float& l, float m2, float l2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;
  l = l * __expf(m - M) + l2 * __expf(m2 - M);
  m = M;
}

struct Args {
  const RetroSession* sessions;
  Query q;
  PagedKv kv;
  int32_t B, Hq, Hkv, G, d;
  float scale;
  int32_t mask_before;
  int32_t Cc, Pm, nch;  // capacities: clusters, part rows, chunks
  int32_t* idx;
  int32_t* cnt;
  int32_t max_sel;
  float* est_o;
  float* est_lse;
  // workspace
  float* logits;    // [rows][G][Cc]
  float2* cstats;   // [rows][nch][G] (max, sum)
  float* gmax;      // [rows][G]: the softmax max M_g
  uint32_t* keys;   // [rows][Cc]
  uint8_t* zone;    // [rows][Cc]: 0 none, 1 retrieval, 2 part, 3 estimation
  float* estp;      // [rows][nch][G][d + 1]: numerators, then the weight sum
  uint32_t* pkeys;  // [rows][Pm]: exact scores of the part cluster's rows (ordered bits)
  int32_t zone_smem;  // the zones kernel computes the keys into its shared memory (no dist kernel)
  int32_t* roff;      // [rows][Cc]: a retrieval cluster's first place in the list after the steady sinks
};

__device__ __forceinline__ bool indexed(const RetroSession& s) { return s.mode >= kRetroPaper && s.C > 0; }

// ---- 1. logits and 2. distances ----------------------------------------------------------------
// Row elements [8i, 8i + 8) of a d-vector as floats.
template <typename M>
__device__ __forceinline__ void load8(const M* row, int i, float (&x)[8]) {
  if constexpr (sizeof(M) == 4) {
    const float4 u = reinterpret_cast<const float4*>(row)[2 * i], v = reinterpret_cast<const float4*>(row)[2 * i + 1];
    x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w, x[4] = v.x, x[5] = v.y, x[6] = v.z, x[7] = v.w;
  } else {
    const uint4 u = reinterpret_cast<const uint4*>(row)[i];
    const M* e = reinterpret_cast<const M*>(&u);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = to_f32(e[j]);
  }
}

// A thread per cluster: its logits for the G query heads (in groups of 8 heads, the row re-read
// from L1 per group), then per warp and head the softmax pair, combined per chunk.
template <typename M, int D>
__global__ void __launch_bounds__(kChunkThreads) logits_kernel(const Args a) {
  constexpr int NW = kChunkThreads / 32;
  __shared__ __align__(16) float qs[kMaxGD];
  __shared__ float2 red[NW][64];
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const RetroSession& s = a.sessions[b];
  const int c0 = chunk * kChunk;
  if (!indexed(s) || c0 >= s.C) return;
  const int G = a.G, row = b * a.Hkv + h;
  const void* qb = a.q.at ? *a.q.at : a.q.data;
  for (int i = threadIdx.x; i < G * D; i += kChunkThreads)
    qs[i] = load_q(a.q, qb, (int64_t(b) * a.Hq + int64_t(h) * G) * D + i) * a.scale;
  __syncthreads();
  const int c = c0 + threadIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool valid = c < s.C;
  const bool counted = valid && (!a.mask_before || s.size[int64_t(h) * s.cs + c] > 0);
  const M* cent = static_cast<const M*>(s.cent) + (int64_t(h) * s.cs + (valid ? c : 0)) * D;
  float* out = a.logits + int64_t(row) * G * a.Cc;
  for (int g0 = 0; g0 < G; g0 += 8) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
    for (int i = 0; i < D / 8; ++i) {
      float x[8];
      load8(cent, i, x);
#pragma unroll
      for (int gg = 0; gg < 8; ++gg)
        if (g0 + gg < G) {
          const float4 qa = reinterpret_cast<const float4*>(qs + (g0 + gg) * D + 8 * i)[0];
          const float4 qb4 = reinterpret_cast<const float4*>(qs + (g0 + gg) * D + 8 * i)[1];
          acc[gg] = fmaf(qa.x, x[0], fmaf(qa.y, x[1], fmaf(qa.z, x[2], fmaf(qa.w, x[3], acc[gg]))));
          acc[gg] = fmaf(qb4.x, x[4], fmaf(qb4.y, x[5], fmaf(qb4.z, x[6], fmaf(qb4.w, x[7], acc[gg]))));
        }
    }
#pragma unroll
    for (int gg = 0; gg < 8; ++gg) {
      const int g = g0 + gg;
      if (g >= G) break;
      if (valid) out[int64_t(g) * a.Cc + c] = acc[gg];
      float m = counted ? acc[gg] : -INFINITY;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float l = counted ? __expf(acc[gg] - m) : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      if (lane == 0) red[warp][g] = make_float2(m, l);
    }
  }
  __syncthreads();
  for (int g = threadIdx.x; g < G; g += kChunkThreads) {
    float m = -INFINITY, l = 0.f;
    for (int w = 0; w < NW; ++w) lse_add(m, l, red[w][g].x, red[w][g].y);
    a.cstats[(int64_t(row) * a.nch + chunk) * G + g] = make_float2(m, l);
  }
}

// Elements [16 / sizeof(M) * i, ...) of a row (16 bytes) as floats (read-only data: the meta index
// does not change during a step).
template <typename M>
__device__ __forceinline__ void load_piece(const M* row, int i, float* x) {
  if constexpr (sizeof(M) == 4) {
    const float4 u = __ldg(reinterpret_cast<const float4*>(row) + i);
    x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w;
  } else {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(row) + i);
    const M* e = reinterpret_cast<const M*>(&u);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = to_f32(e[j]);
  }
}

template <typename M, int D>
struct RowSplit {
  static constexpr int kPieces = D * int(sizeof(M)) / 16;   // 16-byte pieces per row
  static constexpr int kLpr = kPieces < 32 ? kPieces : 32;  // lanes per row
  static constexpr int kPpl = kPieces / kLpr;               // pieces per lane
  static constexpr int kEpp = 16 / int(sizeof(M));          // elements per piece
  static constexpr int kEl = kPpl * kEpp;                   // elements per lane
};

// Each head's softmax over the clusters from the logits kernel's chunk pairs, a warp per head (the
// CTA's warps take the heads in turn): M[g] its maximum, inv[g] 1 / its sum; gmax (when set) gets M.
__device__ __forceinline__ void head_softmax(const Args& a, int row, int nchs, float* M, float* inv, float* gmax) {
  const int G = a.G, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = warp; g < G; g += int(blockDim.x / 32)) {
    float m = -INFINITY, l = 0.f;
    for (int k = lane; k < nchs; k += 32) {
      const float2 p = a.cstats[(int64_t(row) * a.nch + k) * G + g];
      lse_add(m, l, p.x, p.y);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
      lse_add(m, l, m2, l2);
    }
    if (lane == 0) {
      M[g] = m;
      inv[g] = l > 0.f ? 1.f / l : 0.f;
      if (gmax) gmax[int64_t(row) * G + g] = m;
    }
  }
}

// A cluster's key from its summed softmax (ordered bits, >= +0); an empty cluster never ranks.
__device__ __forceinline__ uint32_t cluster_key(int32_t size, float dsum) {
  return size > 0 ? __float_as_uint(fmaxf(dsum, 0.f)) : kNoKey;
}

// Each head's softmax from the chunk pairs, then a thread per cluster: its distance (the group's
// summed softmax) as ordered bits (>= +0); empty clusters never rank. Only when the keys do not fit
// the zones kernel's shared memory (zone_smem = 0); otherwise that kernel computes them itself
// (zone_keys, the same arithmetic).
__global__ void __launch_bounds__(kChunkThreads) dist_kernel(const Args a) {
  __shared__ float M[64], inv[64];
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const RetroSession& s = a.sessions[b];
  const int c0 = chunk * kChunk;
  if (!indexed(s) || c0 >= s.C) return;
  const int G = a.G, row = b * a.Hkv + h;
  head_softmax(a, row, (s.C + kChunk - 1) / kChunk, M, inv, chunk == 0 ? a.gmax : nullptr);
  __syncthreads();
  const int c = c0 + threadIdx.x;
  if (c >= s.C) return;
  const float* lg = a.logits + int64_t(row) * G * a.Cc;
  float dsum = 0.f;
  for (int g = 0; g < G; ++g) dsum += __expf(lg[int64_t(g) * a.Cc + c] - M[g]) * inv[g];
  const uint32_t k = cluster_key(s.size[int64_t(h) * s.cs + c], dsum);
  a.keys[int64_t(row) * a.Cc + c] = k;
}

// ---- 2. zones and the exact list ---------------------------------------------------------------
using Scan = cub::BlockScan<long long, kZoneThreads>;
using Reduce = cub::BlockReduce<long long, kZoneThreads>;

struct ZoneSmem {
  union {
    Scan::TempStorage scan;
    Reduce::TempStorage reduce;
  };
  int hist[256];
  int whist[kZoneHists][256];
  float M[64], inv[64];  // zone_keys: each head's softmax maximum and 1 / sum
  long long wsum[kZoneWarps];  // warps_before's buffer
  uint32_t T;
  long long above, lim;
  long long carry, carry2;
  int part;
};

// Threshold of the top `target` (by weight, or by count when w is null) of the keys, largest
// first: T is the largest key value with W(key >= T) > target, above = W(key > T) <= target, lim =
// target - above (the weight of the ties at T taken, lowest index first, while their running sum
// stays within lim). Everything fits (W(all) <= target): T = 0 and lim huge. kNoKey never counts.
__device__ void block_select(const uint32_t* keys, int n, const int32_t* w, long long target, ZoneSmem& sm) {
  uint32_t prefix = 0, mask = 0;
  long long above = 0;
  bool all = false;
  for (int pass = 0; pass < 4 && !all; ++pass) {
    const int shift = 24 - 8 * pass;
    // Four warps share a histogram (fewer to clear and add up per pass), summed per digit after.
    for (int i = threadIdx.x; i < kZoneHists * 256; i += kZoneThreads) (&sm.whist[0][0])[i] = 0;
    __syncthreads();
    // A warp whose counted keys share one digit (the first passes: distances share their top
    // bits) adds their sum with one atomic instead of 32 colliding ones.
    int* wh = sm.whist[threadIdx.x / 32 % kZoneHists];
    auto count = [&](int i) {
      const uint32_t k = i < n ? keys[i] : kNoKey;
      const bool in = k != kNoKey && (k & mask) == prefix;
      const int dg = int((k >> shift) & 255u), v = in ? (w ? __ldg(w + i) : 1) : 0;
      const unsigned act = __ballot_sync(0xffffffffu, in);
      if (!act) return;
      const int d0 = __shfl_sync(0xffffffffu, dg, __ffs(act) - 1);
      if (__all_sync(0xffffffffu, !in || dg == d0)) {
        const int sum = __reduce_add_sync(0xffffffffu, v);
        if (threadIdx.x % 32 == 0) atomicAdd(&wh[d0], sum);
      } else if (in) {
        atomicAdd(&wh[dg], v);
      }
    };
    for (int base = 0; base < n; base += 4 * kZoneThreads) {  // uniform bounds (warp votes); four keys in flight
#pragma unroll
      for (int j = 0; j < 4; ++j) count(base + j * kZoneThreads + int(threadIdx.x));
    }
    __syncthreads();
    if (threadIdx.x < 256) {
      int t = 0;
#pragma unroll
      for (int j = 0; j < kZoneHists; ++j) t += sm.whist[j][threadIdx.x];
      sm.hist[threadIdx.x] = t;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Warp 0 finds the first digit from the top where the running weight passes the target:
      // lane l holds digits 255 - 8l down to 248 - 8l.
      const int lane = threadIdx.x;
      long long v[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += (v[j] = sm.hist[255 - 8 * lane - j]);
      long long pre = sum;  // inclusive prefix over lanes (higher digits first)
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(0xffffffffu, pre, o);
        if (lane >= o) pre += y;
      }
      long long acc = above + pre - sum;
      int dg = -1;
      long long at = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (dg < 0 && acc + v[j] > target) dg = 255 - 8 * lane - j, at = acc;
        acc += v[j];
      }
      const unsigned hit = __ballot_sync(0xffffffffu, dg >= 0);
      if (hit == 0) {
        if (lane == 0) sm.lim = 1;  // scratch: everything fits
      } else if (lane == __ffs(hit) - 1) {
        sm.lim = 0;
        sm.above = at;
        sm.T = uint32_t(dg);
      }
    }
    __syncthreads();
    all = sm.lim != 0;
    if (!all) {
      prefix |= sm.T << shift;
      mask |= 255u << shift;
      above = sm.above;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (all) {
      sm.T = 0;
      sm.above = 0;
      sm.lim = (long long)1 << 62;
    } else {
      sm.T = prefix;
      sm.above = above;
      sm.lim = target - above;
    }
  }
  __syncthreads();
}

// The id-order walks of the zones kernel give each warp a contiguous block of cluster ids, read
// kRoundIds consecutive ids at a time (kLaneIds consecutive ones per lane; a contiguous range per
// thread would put a warp's reads in one shared-memory bank); a cluster's place in id order is its
// warp's prefix, the warp's earlier rounds, the lanes before it (a warp scan) and its lane's ids
// before it.
struct WarpBlock {
  int begin, end;  // this warp's ids [begin, end)
};
constexpr int kLaneIds = 4;               // consecutive ids per lane in a round
constexpr int kRoundIds = 32 * kLaneIds;  // ids per warp round
__device__ __forceinline__ WarpBlock warp_block(int C) {
  const int per = (C + kZoneWarps * kRoundIds - 1) / (kZoneWarps * kRoundIds) * kRoundIds;  // ids per warp
  const int b = min(C, int(threadIdx.x / 32) * per);
  return {b, min(C, b + per)};
}

// Inclusive scan over the warp's lanes.
template <typename V>
__device__ __forceinline__ V warp_incl(V x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const V y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

__device__ __forceinline__ long long warp_sum(long long x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Every warp passes its total (any lane: the same value); returns the sum of the warps before it,
// and the block's total in *all. buf: kZoneWarps entries of shared memory, free on entry and exit.
__device__ __forceinline__ long long warps_before(long long total, long long* buf, long long* all) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) buf[warp] = total;
  __syncthreads();
  const long long x = buf[lane];  // kZoneWarps == 32
  const long long inc = warp_incl(x);
  *all = __shfl_sync(0xffffffffu, inc, 31);
  const long long before = __shfl_sync(0xffffffffu, inc - x, warp);
  __syncthreads();
  return before;
}

// One id-order walk of the CTA: every thread calls it. value(c) is cluster c's share (0 past the
// warp's block; V: int, or two 32-bit counts packed in an unsigned long long whose sums stay
// below 2^32 in each half); visit(c, before, v) is called for each id of the warp's block with
// the sum of the shares of the ids before it in id order (over the whole CTA). Returns the CTA's
// total. buf: warps_before's buffer.
template <typename V, typename Value, typename Visit>
__device__ __forceinline__ long long walk_ids(const WarpBlock& wb, long long* buf, Value value, Visit visit) {
  const int lane = threadIdx.x % 32;
  long long t = 0;
  for (int c0 = wb.begin + kLaneIds * lane; c0 < wb.end; c0 += kRoundIds)
#pragma unroll
    for (int j = 0; j < kLaneIds; ++j) t += (long long)value(c0 + j);
  long long all;
  long long run = warps_before(warp_sum(t), buf, &all);
  for (int r0 = wb.begin; r0 < wb.end; r0 += kRoundIds) {
    const int cl = r0 + kLaneIds * lane;
    V v[kLaneIds], lv = 0;
#pragma unroll
    for (int j = 0; j < kLaneIds; ++j) lv += (v[j] = value(cl + j));
    const V inc = warp_incl(lv);
    long long before = run + (long long)(inc - lv);
    run += (long long)__shfl_sync(0xffffffffu, inc, 31);
#pragma unroll
    for (int j = 0; j < kLaneIds; ++j) {
      if (cl + j >= wb.end) break;
      visit(cl + j, before, v[j]);
      before += (long long)v[j];
    }
  }
  return all;
}

extern __shared__ uint32_t zkeys[];  // the zones kernel's dynamic shared memory: the keys (zone_smem)

// The dist kernel's work inside the zones kernel (zone_smem): each head's softmax from the chunk
// pairs (a warp per head), then every cluster's key into shared memory, and the heads' maxima for
// the estimate kernels.
__device__ void zone_keys(const Args& a, const RetroSession& s, int row, int h, ZoneSmem& sm) {
  const int G = a.G, tid = threadIdx.x;
  head_softmax(a, row, (s.C + kChunk - 1) / kChunk, sm.M, sm.inv, a.gmax);
  __syncthreads();
  const float* lg = a.logits + int64_t(row) * G * a.Cc;
  const int C = s.C;
  const int32_t* size = s.size + int64_t(h) * s.cs;
  constexpr int U = 4;  // clusters per thread in flight
  for (int c0 = tid; c0 < C; c0 += U * kZoneThreads) {
    int32_t z[U];
    float dsum[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * kZoneThreads;
      z[u] = c < C ? __ldg(size + c) : 0;
      dsum[u] = 0.f;
    }
    for (int g = 0; g < G; ++g) {
      const float* lgg = lg + int64_t(g) * a.Cc;
      float x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = c0 + u * kZoneThreads < C ? __ldg(lgg + c0 + u * kZoneThreads) : 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) dsum[u] += __expf(x[u] - sm.M[g]) * sm.inv[g];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * kZoneThreads;
      if (c < C) zkeys[c] = cluster_key(z[u], dsum[u]);
    }
  }
  __syncthreads();
}

template <typename T, int D>
__global__ void __launch_bounds__(kZoneThreads) zones_kernel(const Args a) {
  __shared__ ZoneSmem sm;
  __shared__ RetroSession ss;  // the session's fields: read from shared memory after every store
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int row = b * a.Hkv + h, G = a.G;
  if (tid == 0) ss = a.sessions[b];
  __syncthreads();
  const RetroSession& s = ss;
  int32_t* out = a.idx + int64_t(row) * a.max_sel;
  int32_t* st = s.stats ? s.stats + int64_t(h) * kRetroStats : nullptr;
  const int64_t cap = a.max_sel;  // writes past the capacity are dropped (the host sizes it)
  if (!indexed(s)) {
    // Nothing indexed: [0, n), or the sinks and the most recent tokens.
    const int sk = s.mode == kRetroStreaming ? s.sk : s.n, lw = s.mode == kRetroStreaming ? s.lw : 0;
    for (int i = tid; i < sk + lw && i < cap; i += kZoneThreads) out[i] = s.tok_base + (i < sk ? i : s.n - lw + (i - sk));
    if (tid == 0) {
      if (s.wave_cnt) s.wave_cnt[h] = 0;
      a.cnt[row] = int32_t(lmin(sk + lw, cap));
      if (s.sel_sum) atomicAdd(s.sel_sum, double(lmin(sk + lw, cap)) / a.Hkv);
      if (st)
        for (int i = 0; i < kRetroStats; ++i) st[i] = i == 6 ? sk + lw : 0;
    }
    return;
  }
  const int C = s.C;
  const int32_t* size = s.size + int64_t(h) * s.cs;
  const int32_t* start = s.start + int64_t(h) * s.cs;
  const int32_t* pos = s.pos + int64_t(h) * s.rs;
  // With zone_smem the keys and the zones live in shared memory (the final zones also written to
  // global memory for the estimate kernel).
  uint8_t* const gzone = a.zone + int64_t(row) * a.Cc;
  uint8_t* zone = a.zone_smem ? reinterpret_cast<uint8_t*>(zkeys + a.Cc) : gzone;
  const uint32_t* keys = a.zone_smem ? zkeys : a.keys + int64_t(row) * a.Cc;
  if (a.zone_smem) zone_keys(a, s, row, h, sm);

  long long nc_part = 0;
  for (int c = tid; c < C; c += kZoneThreads) nc_part += keys[c] != kNoKey;
  const long long nc = Reduce(sm.reduce).Sum(nc_part);
  __syncthreads();
  __shared__ long long s_nc;
  if (tid == 0) s_nc = nc;
  __syncthreads();
  const long long ncand = s_nc;

  // Retrieval zone: the top r (paper) or the longest rank-order prefix within the room (session).
  const bool session = s.mode >= kRetroSession, scaled = s.mode == kRetroScaled;
  const long long r_target = session ? s.room : lmin(s.r_fixed, ncand);
  block_select(keys, C, session ? size : nullptr, r_target, sm);
  const uint32_t T1 = sm.T;
  const long long lim1 = sm.lim;
  // Ties at T1 in id order: the first that does not fit is the part cluster; the others before
  // it join the zone.
  const WarpBlock wb = warp_block(C);
  if (tid == 0) sm.part = -1;
  __syncthreads();
  long long used_part = 0, r_part = 0;
  walk_ids<int>(
      wb, sm.wsum,
      [&](int c) -> int { return c < wb.end && keys[c] == T1 ? (session ? __ldg(size + c) : 1) : 0; },
      [&](int c, long long before, int w) {
        const uint32_t k = keys[c];
        const bool tie = k != kNoKey && k == T1;
        const bool in1 = k != kNoKey && (k > T1 || (tie && before + w <= lim1));
        if (tie && before <= lim1 && before + w > lim1) sm.part = c;  // the first tie that does not fit
        zone[c] = in1 ? 1 : 0;
        if (in1) used_part += __ldg(size + c), ++r_part;
      });
  __syncthreads();
  const long long used1 = Reduce(sm.reduce).Sum(used_part);
  __syncthreads();
  const long long r = Reduce(sm.reduce).Sum(r_part);
  __shared__ long long s_used, s_r;
  if (tid == 0) s_used = used1, s_r = r;
  __syncthreads();
  long long used = s_used;
  const long long rr = s_r;
  // Part of the next cluster (scaled): its rows of highest exact score fill the room.
  int part = -1;
  long long pm = 0;
  if (scaled && used < s.room && rr < ncand && sm.part >= 0) {
    part = sm.part;
    pm = lmin(s.room - used, size[part]);
  }
  const long long er = rr + (part >= 0 ? 1 : 0);
  const long long k2 = session ? lmin(ncand, er + s.e) : lmin(ncand, (long long)s.r_fixed + s.e);

  // Estimation zone: ranks [er, k2) = the top k2 less the retrieval zone and the part cluster.
  __syncthreads();
  block_select(keys, C, nullptr, k2, sm);
  const uint32_t T2 = sm.T;
  const long long lim2 = sm.lim;
  const long long sk = s.sk;
  long long est_c = 0, est_t = 0;
  {
    // In id order: the ties at T2 before a cluster (taken while within lim2; low 32 bits), and the
    // rows of the retrieval clusters before it (its rows' place in the list; high 32 bits).
    int32_t* roff = a.roff + int64_t(row) * a.Cc;
    walk_ids<unsigned long long>(
        wb, sm.wsum,
        [&](int c) -> unsigned long long {
          if (c >= wb.end) return 0;
          return (keys[c] == T2 ? 1ull : 0ull) + (zone[c] == 1 ? (unsigned long long)__ldg(size + c) << 32 : 0ull);
        },
        [&](int c, long long before, unsigned long long) {
          const long long tb = before & 0xffffffffll, ab = before >> 32;
          const uint32_t k = keys[c];
          const bool tie = k != kNoKey && k == T2;
          const bool in2 = k != kNoKey && (k > T2 || (tie && tb + 1 <= lim2));
          const int z = zone[c] == 1 ? 1 : c == part ? 2 : in2 ? 3 : 0;
          zone[c] = uint8_t(z);
          if (a.zone_smem) gzone[c] = uint8_t(z);  // the final zones, for the estimate kernel
          if (z == 3) ++est_c, est_t += __ldg(size + c);
          if (z == 1) roff[c] = int32_t(ab);  // its rows' place after the steady sinks: the estimate kernel copies them
        });
  }
  __syncthreads();
  const long long est_clusters = Reduce(sm.reduce).Sum(est_c);
  __syncthreads();
  const long long est_tokens = Reduce(sm.reduce).Sum(est_t);
  __syncthreads();
  if (s.wave_ids) {  // the clusters whose rows this step reads, in id order (the wave buffer's LRU)
    int32_t* ids = s.wave_ids + int64_t(h) * s.wave_cap;
    const long long all = walk_ids<int>(
        wb, sm.wsum, [&](int c) -> int { return c < wb.end && (zone[c] == 1 || zone[c] == 2); },
        [&](int c, long long before, int v) {
          if (v && before < s.wave_cap) ids[before] = c;
        });
    if (tid == 0) s.wave_cnt[h] = int32_t(lmin(all, s.wave_cap));
    __syncthreads();
  }

  // The part cluster's best pm rows by exact score (max over the group of q . k), ties to the
  // earlier row.
  long long at = sk + used;
  if (part >= 0) {
    const int m = size[part], p0 = start[part];
    // A cluster of at most kZoneThreads rows keeps its scores in shared memory (the histograms'
    // space, free now) and is ranked by comparisons; a larger one by the radix select.
    const bool small = m <= kZoneThreads;
    uint32_t* pk = small ? reinterpret_cast<uint32_t*>(&sm.whist[0][0]) : a.pkeys + int64_t(row) * a.Pm;
    const void* qb = a.q.at ? *a.q.at : a.q.data;
    const int warp = tid / 32, lane = tid % 32;
    constexpr int E = D / 32;
    for (int j = warp; j < m; j += kZoneThreads / 32) {
      const T* kr = kv_row<T>(a.kv, a.Hkv, D, b, h, pos[p0 + j], 0);
      float x[E];
#pragma unroll
      for (int i = 0; i < E; ++i) x[i] = to_f32(kr[lane * E + i]);
      float best = -INFINITY;
      for (int g = 0; g < G; ++g) {
        float p = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i)
          p = fmaf(load_q(a.q, qb, (int64_t(b) * a.Hq + int64_t(h) * G + g) * D + lane * E + i), x[i], p);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
        best = fmaxf(best, p);
      }
      if (lane == 0) {  // ordered bits: larger float, larger key
        const uint32_t u = __float_as_uint(best + 0.f);  // -0 as +0: equal scores tie (lower row)
        pk[j] = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
      }
    }
    __syncthreads();
    if (small) {
      // Row j is taken when fewer than pm rows rank before it: a larger score, or an equal one at
      // an earlier row (the radix select's rule); taken rows in row order.
      bool in = false;
      if (tid < m) {
        const uint32_t kj = pk[tid];
        int rank = 0;
        for (int i = 0; i < m; ++i) {
          const uint32_t ki = pk[i];
          rank += ki > kj || (ki == kj && i < int(tid));
        }
        in = rank < pm;
      }
      long long ex;
      Scan(sm.scan).ExclusiveSum(in ? 1ll : 0ll, ex);
      if (in && at + ex < cap) out[at + ex] = __ldg(pos + p0 + tid);
      __syncthreads();
    } else {
    block_select(pk, m, nullptr, pm, sm);
    const uint32_t T3 = sm.T;
    const long long lim3 = sm.lim;
    if (tid == 0) sm.carry = 0, sm.carry2 = 0;
    __syncthreads();
    for (int base = 0; base < m; base += kZoneThreads) {
      const int j = base + tid;
      const uint32_t k = j < m ? pk[j] : 0u;
      const bool tie = j < m && k == T3;
      const long long v = tie ? 1 : 0;
      long long ex, ex2;
      Scan(sm.scan).ExclusiveSum(v, ex);
      const long long before = sm.carry + ex;
      const bool in = j < m && (k > T3 || (tie && before + v <= lim3));
      __syncthreads();
      Scan(sm.scan).ExclusiveSum(in ? 1ll : 0ll, ex2);
      if (in && at + sm.carry2 + ex2 < cap) out[at + sm.carry2 + ex2] = pos[p0 + j];
      __syncthreads();
      if (tid == kZoneThreads - 1) sm.carry = before + v, sm.carry2 += ex2 + (in ? 1 : 0);
      __syncthreads();
    }
    }
    used += pm;
    at += pm;
  }
  // Fill (scaled): the unclustered tail before the local window, most recent first, then the
  // sinks past the scaled ones; then the steady zone.
  long long tb = s.lb, sb = s.sinks_end;
  if (scaled) {
    const long long tail = lmin(s.room - used, (long long)s.lb - s.indexed_end);
    tb = s.lb - tail;
    used += tail;
    const long long head = lmin(s.room - used, (long long)s.sinks_end - s.sk);
    sb = s.sinks_end - head;
    used += head;
  }
  const int32_t base = s.tok_base;
  for (long long i = tid; i < sk && i < cap; i += kZoneThreads) out[i] = base + int32_t(i);
  for (long long t = tb + tid; t < s.n && at + (t - tb) < cap; t += kZoneThreads) out[at + (t - tb)] = base + int32_t(t);
  at += s.n - tb;
  for (long long t = sb + tid; t < s.sinks_end && at + (t - sb) < cap; t += kZoneThreads)
    out[at + (t - sb)] = base + int32_t(t);
  at += s.sinks_end - sb;
  if (tid == 0) {
    a.cnt[row] = int32_t(lmin(at, cap));
    if (s.sel_sum) atomicAdd(s.sel_sum, double(lmin(at, cap)) / a.Hkv);
    if (st) {
      st[0] = int32_t(rr);
      st[1] = int32_t(s_used);
      st[2] = int32_t(est_clusters);
      st[3] = int32_t(est_tokens);
      st[4] = int32_t(pm + (s.lb - tb) + (s.sinks_end - sb));
      st[5] = session ? int32_t(s.room - used) : 0;
      if (s.unused_sum && session) s.unused_sum[h] += double(s.room - used);  // across steps and layers
      st[6] = int32_t(sk + (s.n - s.lb));
      st[7] = 0;
    }
  }
}

// ---- 3. estimation partial sums -------------------------------------------------------------
// Per chunk: the estimation clusters listed in id order (one ballot per 32 clusters, all loads at
// once), their weights e^(logit - M_g) for 8 heads at a time in shared memory; then the value-mean
// rows are read whole (RowSplit lanes per row, kSlots rows at once, four per slot in flight), each
// lane accumulating its elements for the 8 heads, and the slots' sums are added in slot order.
constexpr int kEstThreads = 128;
template <typename M, int D>
__global__ void __launch_bounds__(kEstThreads) estimate_kernel(const Args a) {
  using RS = RowSplit<M, D>;
  constexpr int kWarps = kEstThreads / 32, kSlots = kEstThreads / RS::kLpr, U = 4;
  static_assert(kChunk == 2 * kEstThreads, "two clusters per thread");
  __shared__ int list[kChunk];
  __shared__ float wsh[kChunk][8];
  __shared__ float csz[kChunk];
  __shared__ int wcount[2][kWarps];
  __shared__ float red[kSlots][D];
  __shared__ int ret[kChunk];
  __shared__ int nret;
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const RetroSession& s = a.sessions[b];
  const int c0 = chunk * kChunk, G = a.G, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row = b * a.Hkv + h;
  float* part = a.estp + (int64_t(row) * a.nch + chunk) * G * (D + 1);
  if (!indexed(s) || c0 >= s.C) return;
  const int c1 = min(c0 + kChunk, s.C);
  const uint8_t* zone = a.zone + int64_t(row) * a.Cc;
  const int ca = c0 + tid, cb = c0 + kEstThreads + tid;
  const int za = ca < c1 ? zone[ca] : 0, zb = cb < c1 ? zone[cb] : 0;
  const bool ina = za == 3, inb = zb == 3;
  const unsigned bala = __ballot_sync(0xffffffffu, ina), balb = __ballot_sync(0xffffffffu, inb);
  if (lane == 0) wcount[0][warp] = __popc(bala), wcount[1][warp] = __popc(balb);
  // The chunk's retrieval clusters (any order): their rows' positions copied into the exact list
  // at the places the zones kernel gave them, a warp per cluster.
  if (tid == 0) nret = 0;
  __syncthreads();
  if (za == 1) ret[atomicAdd(&nret, 1)] = ca;
  if (zb == 1) ret[atomicAdd(&nret, 1)] = cb;
  __syncthreads();
  {
    const int32_t* sz = s.size + int64_t(h) * s.cs;
    const int32_t* st = s.start + int64_t(h) * s.cs;
    const int32_t* pos = s.pos + int64_t(h) * s.rs;
    const int32_t* roff = a.roff + int64_t(row) * a.Cc;
    int32_t* out = a.idx + int64_t(row) * a.max_sel;
    const long long sk = s.sk, cap = a.max_sel;
    for (int i = warp; i < nret; i += kWarps) {
      const int c = ret[i];
      const int m = __ldg(sz + c), p0 = __ldg(st + c);
      const long long d = sk + roff[c];
      for (int j = lane; j < m; j += 32)
        if (d + j < cap) out[d + j] = __ldg(pos + p0 + j);
    }
  }
  int offa = 0, offb = 0, na = 0, nb = 0;  // the list: the first half's clusters, then the second's
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    offa += w < warp ? wcount[0][w] : 0;
    offb += w < warp ? wcount[1][w] : 0;
    na += wcount[0][w];
    nb += wcount[1][w];
  }
  const int nl = na + nb;
  const unsigned below = (1u << lane) - 1u;
  if (ina) list[offa + __popc(bala & below)] = ca;
  if (inb) list[na + offb + __popc(balb & below)] = cb;
  __syncthreads();
  const int32_t* size = s.size + int64_t(h) * s.cs;
  for (int i = tid; i < nl; i += kEstThreads) csz[i] = float(size[list[i]]);
  const M* vm = static_cast<const M*>(s.vmeta) + int64_t(h) * s.cs * D;
  const float* lg = a.logits + int64_t(row) * G * a.Cc;
  const float* gm = a.gmax + int64_t(row) * G;
  // 16-bit meta rows are value means: weight e^(logit - M) * size; fp32 rows are value sums.
  constexpr bool kMeans = sizeof(M) == 2;
  const int slot = tid / RS::kLpr, piece = tid % RS::kLpr;
  for (int g0 = 0; g0 < G; g0 += 8) {
    const int ng = min(8, G - g0);
    __syncthreads();
    for (int i = tid; i < nl * 8; i += kEstThreads) {
      const int li = i / 8, gg = i % 8;
      wsh[li][gg] = gg < ng ? __expf(lg[int64_t(g0 + gg) * a.Cc + list[li]] - gm[g0 + gg]) : 0.f;
    }
    __syncthreads();
    float acc[8][RS::kEl];
#pragma unroll
    for (int gg = 0; gg < 8; ++gg)
#pragma unroll
      for (int e = 0; e < RS::kEl; ++e) acc[gg][e] = 0.f;
    for (int i0 = slot; i0 < nl; i0 += kSlots * U) {
      float x[U][RS::kEl];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * kSlots;
        const M* r = vm + int64_t(list[i < nl ? i : i0]) * D;
#pragma unroll
        for (int p = 0; p < RS::kPpl; ++p) load_piece(r, p * RS::kLpr + piece, &x[u][p * RS::kEpp]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * kSlots;
        if (i >= nl) break;
        const float sz = kMeans ? csz[i] : 1.f;
#pragma unroll
        for (int gg = 0; gg < 8; ++gg) {
          if (gg >= ng) break;
          const float wt = wsh[i][gg];
#pragma unroll
          for (int e = 0; e < RS::kEl; ++e) acc[gg][e] = fmaf(wt, x[u][e] * sz, acc[gg][e]);
        }
      }
    }
#pragma unroll
    for (int gg = 0; gg < 8; ++gg) {
      if (gg >= ng) break;
#pragma unroll
      for (int p = 0; p < RS::kPpl; ++p)
#pragma unroll
        for (int e = 0; e < RS::kEpp; ++e) red[slot][(p * RS::kLpr + piece) * RS::kEpp + e] = acc[gg][p * RS::kEpp + e];
      __syncthreads();
      for (int e = tid; e < D; e += kEstThreads) {
        float t = 0.f;
#pragma unroll
        for (int j = 0; j < kSlots; ++j) t += red[j][e];
        part[(g0 + gg) * (D + 1) + e] = t;
      }
      __syncthreads();
    }
    if (tid < ng) {
      float den = 0.f;
      for (int i = 0; i < nl; ++i) den = fmaf(wsh[i][tid], csz[i], den);
      part[(g0 + tid) * (D + 1) + D] = den;
    }
  }
}

// ---- 4. the estimation zone's state -----------------------------------------------------------
// grid (G, Hkv, B), a thread per dimension: the chunks' partial sums in chunk order, sixteen loads
// in flight. A programmatic dependent launch of the estimate kernel: it waits for it first.
__device__ __forceinline__ float sum_chunks(const float* p, int64_t stride, int n) {
  float t = 0.f;
  int c = 0;
  for (; c + 16 <= n; c += 16) {
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = p[(c + j) * stride];
#pragma unroll
    for (int j = 0; j < 16; ++j) t += v[j];
  }
  for (; c < n; ++c) t += p[c * stride];
  return t;
}

__global__ void __launch_bounds__(kEstThreads) est_merge_kernel(const Args a) {
  pdl_wait();
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, G = a.G, D = a.d;
  const int row = b * a.Hkv + h;
  const RetroSession& s = a.sessions[b];
  const int nchs = indexed(s) ? (s.C + kChunk - 1) / kChunk : 0;
  const float* base = a.estp + int64_t(row) * a.nch * G * (D + 1) + int64_t(g) * (D + 1);
  const int64_t stride = int64_t(G) * (D + 1);
  const int64_t qrow = int64_t(b) * a.Hq + int64_t(h) * G + g;
  const float den = sum_chunks(base + D, stride, nchs);
  for (int e = threadIdx.x; e < D; e += kEstThreads) {
    const float num = sum_chunks(base + e, stride, nchs);
    a.est_o[qrow * D + e] = den > 0.f ? num / den : 0.f;
  }
  if (threadIdx.x == 0) a.est_lse[qrow] = den > 0.f ? a.gmax[int64_t(row) * G + g] + logf(den) : -INFINITY;
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct Carve {
  size_t logits, cstats, gmax, keys, zone, estp, pkeys, roff, total;
};
Carve carve(const AttnShape& s, int32_t Cc, int32_t Pm) {
  const size_t rows = size_t(s.batch) * s.num_kv_heads, G = size_t(s.num_q_heads / s.num_kv_heads);
  const size_t nch = (size_t(Cc) + kChunk - 1) / kChunk;
  Carve c{};
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t o = at;
    at += align_up(bytes, 256);
    return o;
  };
  c.logits = take(rows * G * size_t(Cc) * 4);
  c.cstats = take(rows * nch * G * 8);
  c.gmax = take(rows * G * 4);
  c.keys = take(rows * size_t(Cc) * 4);
  c.zone = take(rows * size_t(Cc));
  c.estp = take(rows * nch * G * (size_t(s.head_dim) + 1) * 4);
  c.pkeys = take(rows * size_t(Pm) * 4);
  c.roff = take(rows * size_t(Cc) * 4);
  c.total = at;
  return c;
}

// The zones kernel keeps the keys and the zones in shared memory up to this many bytes (5 bytes a
// cluster: 36864 clusters per KV head, contexts of about 590K tokens in clusters of 16); past it
// they stay in global memory, the keys written by the dist kernel.
constexpr size_t kZoneSmemMax = 180 * 1024;
std::atomic<bool> g_zone_global{false};  // detail::set_retro_zone_global (tests)

// Whether zones_kernel<T, D> may take kZoneSmemMax dynamic bytes; asked once per instantiation and
// process (assumes every GPU in the process is the same model).
template <typename T, int D>
bool zone_smem_allowed() {
  static std::atomic<int> state{0};  // 0: not asked, 1: allowed, 2: refused
  int v = state.load(std::memory_order_acquire);
  if (v == 0) {
    const cudaError_t e =
        cudaFuncSetAttribute(zones_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kZoneSmemMax));
    if (e != cudaSuccess) (void)cudaGetLastError();
    v = e == cudaSuccess ? 1 : 2;
    state.store(v, std::memory_order_release);
  }
  return v == 1;
}

template <typename M, typename T, int D>
Status launch_all(Args a, cudaStream_t st) {
  const dim3 chunks(unsigned(a.nch), unsigned(a.Hkv), unsigned(a.B));
  const size_t zsm = (size_t(a.Cc) * (sizeof(uint32_t) + 1) + 15) / 16 * 16;
  a.zone_smem = zsm <= kZoneSmemMax && !g_zone_global.load(std::memory_order_relaxed) && zone_smem_allowed<T, D>();
  logits_kernel<M, D><<<chunks, kChunkThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro logits_kernel launch");
  if (!a.zone_smem) {
    dist_kernel<<<chunks, kChunkThreads, 0, st>>>(a);
    KVS_LAUNCH_CHECK("retro dist_kernel launch");
  }
  zones_kernel<T, D><<<dim3(unsigned(a.Hkv), unsigned(a.B)), kZoneThreads, a.zone_smem ? zsm : 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro zones_kernel launch");
  estimate_kernel<M, D><<<chunks, kEstThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro estimate_kernel launch");
  KVS_CUDA_TRY(launch_kernel(est_merge_kernel, dim3(unsigned(a.G), unsigned(a.Hkv), unsigned(a.B)), dim3(kEstThreads),
                             0, st, /*pdl=*/true, 1, a),
               "retro est_merge_kernel launch");
  return {};
}

template <typename M, typename T>
Status by_dim(const Args& a, cudaStream_t st) {
  switch (a.d) {
    case 64: return launch_all<M, T, 64>(a, st);
    case 128: return launch_all<M, T, 128>(a, st);
    case 256: return launch_all<M, T, 256>(a, st);
  }
  return unsupported("head_dim must be 64, 128 or 256");
}

template <typename T>
Status by_meta(const Args& a, Scalar meta, cudaStream_t st) {
  if (meta == Scalar::F32) return by_dim<float, T>(a, st);
  if (meta == Scalar::F16) return by_dim<__half, T>(a, st);
  return by_dim<__nv_bfloat16, T>(a, st);
}

}  // namespace

namespace detail {
void set_retro_zone_global(bool on) noexcept { g_zone_global.store(on, std::memory_order_relaxed); }
}  // namespace detail

size_t retro_select_workspace_bytes(const AttnShape& shape, int32_t max_clusters, int32_t max_cluster_rows) noexcept {
  if (shape.batch < 1 || shape.num_kv_heads < 1 || shape.num_q_heads % shape.num_kv_heads != 0) return 0;
  return carve(shape, std::max<int32_t>(max_clusters, 1), std::max<int32_t>(max_cluster_rows, 1)).total;
}

Status retro_select(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                    const RetroSession* sessions, const RetroConfig& cfg, int32_t max_clusters,
                    int32_t max_cluster_rows, int32_t* idx, int32_t* cnt, int32_t max_selected, float* est_o,
                    float* est_lse, const Workspace& ws, void* stream) noexcept {
  if (shape.batch < 1 || shape.num_kv_heads < 1 || shape.num_q_heads < 1 ||
      shape.num_q_heads % shape.num_kv_heads != 0)
    return invalid("retro_select: bad shape");
  const int G = shape.num_q_heads / shape.num_kv_heads;
  if (G > 64 || G * shape.head_dim > kMaxGD) return unsupported("retro_select: query group * head_dim must be <= 2048");
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("retro_select: KV dtype must be BF16 or F16");
  if (!sessions || !idx || !cnt || !est_o || !est_lse || max_selected < 1) return invalid("retro_select: null argument");
  if (max_clusters < 0 || max_cluster_rows < 0) return invalid("retro_select: negative capacity");
  const int32_t Cc = std::max<int32_t>(max_clusters, 1), Pm = std::max<int32_t>(max_cluster_rows, 1);
  const Carve c = carve(shape, Cc, Pm);
  if (!ws.ptr || ws.bytes < c.total) return invalid("retro_select: workspace too small (ask retro_select_workspace_bytes)");
  char* w = static_cast<char*>(ws.ptr);
  Args a{};
  a.sessions = sessions;
  a.q = q;
  a.kv = kv;
  a.B = shape.batch;
  a.Hq = shape.num_q_heads;
  a.Hkv = shape.num_kv_heads;
  a.G = G;
  a.d = shape.head_dim;
  a.scale = shape.scale;
  a.mask_before = cfg.mask_before;
  a.Cc = Cc;
  a.Pm = Pm;
  a.nch = (Cc + kChunk - 1) / kChunk;
  a.idx = idx;
  a.cnt = cnt;
  a.max_sel = max_selected;
  a.est_o = est_o;
  a.est_lse = est_lse;
  a.logits = reinterpret_cast<float*>(w + c.logits);
  a.cstats = reinterpret_cast<float2*>(w + c.cstats);
  a.gmax = reinterpret_cast<float*>(w + c.gmax);
  a.keys = reinterpret_cast<uint32_t*>(w + c.keys);
  a.zone = reinterpret_cast<uint8_t*>(w + c.zone);
  a.estp = reinterpret_cast<float*>(w + c.estp);
  a.pkeys = reinterpret_cast<uint32_t*>(w + c.pkeys);
  a.roff = reinterpret_cast<int32_t*>(w + c.roff);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (kv_dtype == Scalar::BF16) return by_meta<__nv_bfloat16>(a, cfg.meta, st);
  return by_meta<__half>(a, cfg.meta, st);
}


// ---- the wave buffer ----------------------------------------------------------------------------
namespace {

__global__ void wave_table_kernel(PagedKv kv, const RetroSession* sessions, const void** table, int32_t stride) {
  const int b = blockIdx.x;
  const RetroSession& s = sessions[b];
  const int32_t cp = s.cache_page_count;
  const void** row = table + int64_t(b) * stride;
  const bool own = s.own_table && s.own_table != row;
  for (int j = threadIdx.x; j < stride; j += blockDim.x) {
    const int32_t i = j - cp - kv.max_pages;  // staging
    const void* p = j < cp                  ? s.cache_pages[j]
                    : j - cp < kv.max_pages ? kv.pages[int64_t(b) * kv.max_pages + (j - cp)]
                    : i < s.stage_page_count ? s.stage_pages[i]
                                             : nullptr;
    row[j] = p;
    if (own && j < s.own_cap) s.own_table[j] = p;
  }
  if (own)
    for (int j = stride + threadIdx.x; j < s.own_cap; j += blockDim.x) s.own_table[j] = nullptr;
}

// A CTA per move at a time (grid-stride over *count): the rows' K and V copied in 16-byte pieces
// (or 2-byte ones when a row is not a multiple of 16 bytes), then their virtual positions.
__global__ void wave_moves_kernel(PagedKv kv, int32_t hkv, int32_t d, const int32_t* pos, int32_t rs, int32_t* vpos,
                                  int32_t* tok2v, int32_t T, int32_t ts, int32_t tok_base, PagedKv stage,
                                  const int64_t* stage_map, uint32_t epoch, const WaveMove* moves,
                                  const int32_t* count) {
  const int32_t n = *count;
  const bool wide = (d * 2) % 16 == 0;
  const int per = wide ? d * 2 / 16 : d;  // pieces per row
  for (int32_t m = blockIdx.x; m < n; m += gridDim.x) {
    const WaveMove mv = moves[m];
    const int32_t* p = pos + int64_t(mv.h) * rs + mv.row0;
    if (mv.block >= 0)
      for (int e = threadIdx.x; e < mv.rows * 2 * per; e += blockDim.x) {
        const int r = e / (2 * per), is_v = (e / per) & 1, i = e % per;
        const uint16_t* src = nullptr;
        if (stage_map && p[r] < T) {
          const int64_t sm = stage_map[int64_t(mv.h) * ts + p[r]];
          if (uint32_t(uint64_t(sm) >> 32) == epoch) src = kv_row<uint16_t>(stage, hkv, d, 0, mv.h, int32_t(sm & 0xffffffff), is_v);
        }
        if (!src) src = kv_row<uint16_t>(kv, hkv, d, 0, mv.h, tok_base + p[r], is_v);
        uint16_t* dst = const_cast<uint16_t*>(kv_row<uint16_t>(kv, hkv, d, 0, mv.h, mv.block * kWaveBlockRows + r, is_v));
        if (wide) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
        else dst[i] = src[i];
      }
    for (int r = threadIdx.x; r < mv.rows; r += blockDim.x) {
      const int32_t v = mv.block >= 0 ? mv.block * kWaveBlockRows + r : tok_base + p[r];
      vpos[int64_t(mv.h) * rs + mv.row0 + r] = v;
      if (tok2v && p[r] < T) tok2v[int64_t(mv.h) * ts + p[r]] = v;
    }
  }
}

// 32 listed entries per warp: the misses found by a ballot take consecutive slots (one atomic per
// warp), then the warp copies their rows four at a time (a lane per 16-byte piece of K and V, two
// for d > 128), the loads of the four issued before the stores.
constexpr int kStageTile = 256;  // list entries per CTA of the staging kernel (8 warps x 32)
__global__ void __launch_bounds__(256) wave_stage_kernel(PagedKv kv, int32_t row, int32_t hkv, int32_t d, int32_t* idx,
                                                         const int32_t* cnt, int32_t max_sel, int32_t T, int32_t ts,
                                                         int32_t tok_base, int32_t stage_base, int32_t stage_cap, int64_t* stage_map,
                                                         int32_t* stage_tok, int32_t* stage_cnt, uint32_t epoch) {
  const int h = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = int64_t(row) * hkv + h;
  const int32_t n = min(max(cnt[r], 0), max_sel);
  int32_t* l = idx + r * max_sel;
  const int per = d * 2 / 16;  // 16-byte pieces of one of K and V
  for (int64_t tile = blockIdx.y; tile * kStageTile < n; tile += gridDim.y) {
  const int64_t i = tile * kStageTile + warp * 32 + lane;
  int32_t v = 0, t = -1;
  if (i < n) {
    v = l[i];
    t = v - tok_base;
  }
  const bool miss = i < n && t >= 0 && t < T;
  const unsigned bal = __ballot_sync(0xffffffffu, miss);
  if (!bal) continue;
  int32_t base = 0;
  if (lane == 0) base = atomicAdd(stage_cnt + h, __popc(bal));
  base = __shfl_sync(0xffffffffu, base, 0);
  const int32_t j = base + __popc(bal & ((1u << lane) - 1u));
  if (miss && j < stage_cap) {
    l[i] = stage_base + j;
    stage_map[int64_t(h) * ts + t] = int64_t((uint64_t(epoch) << 32) | uint32_t(j));
    stage_tok[int64_t(h) * stage_cap + j] = t;
  }
  unsigned m = bal;
  while (m) {
    uint4 x[4][2];
    int32_t src_v[4], dst[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      dst[u] = -1;
      if (!m) continue;
      const int src = __ffs(m) - 1;
      m &= m - 1;
      src_v[u] = __shfl_sync(0xffffffffu, v, src);
      const int32_t jj = base + __popc(bal & ((1u << src) - 1u));
      if (jj >= stage_cap) continue;
      dst[u] = stage_base + jj;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int e = lane + 32 * q;
        if (e < 2 * per)
          x[u][q] = reinterpret_cast<const uint4*>(kv_row<uint16_t>(kv, hkv, d, row, h, src_v[u], e / per))[e % per];
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int e = lane + 32 * q;
        if (dst[u] >= 0 && e < 2 * per)
          reinterpret_cast<uint4*>(const_cast<uint16_t*>(kv_row<uint16_t>(kv, hkv, d, row, h, dst[u], e / per)))[e % per] =
              x[u][q];
      }
  }
  }  // tiles
}

constexpr int kRemapTile = 1024;  // list entries per CTA of the remap
__global__ void wave_remap_kernel(int32_t row, int32_t hkv, int32_t* idx, const int32_t* cnt, int32_t max_sel,
                                  const int32_t* tok2v, int32_t T, int32_t ts, int32_t tok_base) {
  const int h = blockIdx.x;
  const int64_t r = int64_t(row) * hkv + h;
  const int32_t n = min(max(cnt[r], 0), max_sel);
  int32_t* l = idx + r * max_sel;
  const int32_t* m = tok2v + int64_t(h) * ts;
  for (int64_t tile = blockIdx.y; tile * kRemapTile < n; tile += gridDim.y)
    for (int64_t i = tile * kRemapTile + threadIdx.x; i < n && i < (tile + 1) * kRemapTile; i += blockDim.x) {
      const int32_t t = l[i] - tok_base;
      if (t >= 0 && t < T) l[i] = m[t];
    }
}

// The rows [r0, r1) and tokens [t0, t1) an index update appended (retro_wave_extend), per KV head
// (blockIdx.y).
__global__ void wave_extend_kernel(const int32_t* pos, int32_t rs, int32_t* vpos, int32_t r0, int32_t r1, int32_t tok_base,
                                   int32_t* tok2v, int64_t* stage_map, int32_t ts, int32_t t0, int32_t t1) {
  const int64_t h = blockIdx.y;
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < max(r1 - r0, t1 - t0); i += gridDim.x * blockDim.x) {
    if (i < r1 - r0) vpos[h * rs + r0 + i] = tok_base + pos[h * rs + r0 + i];
    if (i < t1 - t0) {
      if (tok2v) tok2v[h * ts + t0 + i] = tok_base + t0 + i;
      if (stage_map) stage_map[h * ts + t0 + i] = 0;
    }
  }
}

}  // namespace

Status retro_wave_table(const PagedKv& kv, int32_t batch, const RetroSession* sessions, const void** table,
                        int32_t stride, void* stream) noexcept {
  if (batch < 1 || !sessions || !table || stride < 1) return invalid("retro_wave_table: bad argument");
  wave_table_kernel<<<batch, 256, 0, static_cast<cudaStream_t>(stream)>>>(kv, sessions, table, stride);
  return launch_status("retro_wave_table");
}

Status retro_wave_stage(const PagedKv& kv, Scalar kv_dtype, int32_t row, int32_t num_kv_heads, int32_t head_dim,
                        int32_t* idx, const int32_t* cnt, int32_t max_selected, int32_t T, int32_t ts,
                        int32_t tok_base, int32_t stage_base, int32_t stage_cap, int64_t* stage_map, int32_t* stage_tok,
                        int32_t* stage_cnt, uint32_t epoch, void* stream) noexcept {
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("retro_wave_stage: KV dtype must be BF16 or F16");
  if (head_dim % 8 != 0 || head_dim > 256) return unsupported("retro_wave_stage: head_dim must be a multiple of 8, <= 256");
  if (!idx || !cnt || !stage_map || !stage_tok || !stage_cnt || num_kv_heads < 1 || max_selected < 1 || ts < T)
    return invalid("retro_wave_stage: bad argument");
  if (T < 1 || stage_cap < 1) return Status{};
  const dim3 grid(unsigned(num_kv_heads), unsigned(std::min(65535, (max_selected + kStageTile - 1) / kStageTile)));
  wave_stage_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(kv, row, num_kv_heads, head_dim, idx, cnt,
                                                                         max_selected, T, ts, tok_base, stage_base,
                                                                         stage_cap, stage_map, stage_tok, stage_cnt,
                                                                         epoch);
  return launch_status("retro_wave_stage");
}

Status retro_wave_moves(const PagedKv& kv, Scalar kv_dtype, int32_t num_kv_heads, int32_t head_dim,
                        const int32_t* pos, int32_t rs, int32_t* vpos, int32_t* tok2v, int32_t T, int32_t ts,
                        int32_t tok_base, const PagedKv& stage, const int64_t* stage_map, uint32_t epoch,
                        const WaveMove* moves, const int32_t* count, int32_t max_moves, void* stream) noexcept {
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("retro_wave_moves: KV dtype must be BF16 or F16");
  if (!pos || !vpos || !moves || !count || num_kv_heads < 1 || head_dim < 1 || ts < T)
    return invalid("retro_wave_moves: bad argument");
  if (max_moves < 1) return Status{};
  const int grid = std::min<int32_t>(max_moves, 264);  // 2048 CTAs measured slower (the bus is the limit)
  wave_moves_kernel<<<grid, 128, 0, static_cast<cudaStream_t>(stream)>>>(kv, num_kv_heads, head_dim, pos, rs, vpos,
                                                                          tok2v, T, ts, tok_base, stage, stage_map, epoch,
                                                                          moves, count);
  return launch_status("retro_wave_moves");
}

Status retro_wave_remap(int32_t row, int32_t num_kv_heads, int32_t* idx, const int32_t* cnt, int32_t max_selected,
                        const int32_t* tok2v, int32_t T, int32_t ts, int32_t tok_base, void* stream) noexcept {
  if (!idx || !cnt || !tok2v || num_kv_heads < 1 || max_selected < 1 || ts < T)
    return invalid("retro_wave_remap: bad argument");
  const dim3 grid(unsigned(num_kv_heads), unsigned(std::min(65535, (max_selected + kRemapTile - 1) / kRemapTile)));
  wave_remap_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(row, num_kv_heads, idx, cnt, max_selected,
                                                                         tok2v, T, ts, tok_base);
  return launch_status("retro_wave_remap");
}

Status retro_wave_extend(int32_t num_kv_heads, const int32_t* pos, int32_t rs, int32_t* vpos, int32_t r0, int32_t r1,
                         int32_t tok_base, int32_t* tok2v, int64_t* stage_map, int32_t ts, int32_t t0, int32_t t1,
                         void* stream) noexcept {
  if (!pos || !vpos || num_kv_heads < 1 || r0 < 0 || r1 < r0 || r1 > rs || t0 < 0 || t1 < t0 || ((tok2v || stage_map) && t1 > ts))
    return invalid("retro_wave_extend: bad argument");
  const int32_t n = std::max(r1 - r0, t1 - t0);
  if (n == 0) return Status{};
  const dim3 grid(unsigned(std::min(1024, (n + 255) / 256)), unsigned(num_kv_heads));
  wave_extend_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(pos, rs, vpos, r0, r1, tok_base, tok2v,
                                                                          stage_map, ts, t0, t1);
  return launch_status("retro_wave_extend");
}

}  // namespace kvs::cuda
