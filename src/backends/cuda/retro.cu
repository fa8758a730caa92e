// SPDX-License-Identifier: Apache-2.0
// RetroInfer's decode step (retro.cuh). Five launches per step:
//   1. logits   grid (chunks of 256 clusters, Hkv, B): scale * q_g . centroid for the group's G
//               query heads (a thread per cluster), and per chunk and head the softmax's running
//               (max, sum) pair.
//   2. dist     the same grid: the chunk pairs combined into each head's softmax; the distance of
//               each cluster (the group's summed softmax, as an fp32 key ordered as its bits).
//   3. zones    grid (Hkv, B), 1024 threads: the retrieval zone by a radix select on the keys
//               (counted: the top r; or weighted by cluster size: the longest rank-order prefix
//               that fits the room),
//               the estimation zone by a counted radix select; ties at a threshold go to the lower
//               cluster id (a block scan in id order), so the zones are the CPU's rank-order zones;
//               then the exact list: steady zone, the retrieval clusters' positions, the best rows
//               of the next cluster by exact score (scaled mode), the unclustered tail and sinks.
//   4. estimate grid (chunks, Hkv, B): per chunk, the estimation clusters' weighted value means
//               (eqs. 2-4: e^(logit - M) * size * mean) and weights, as partial sums.
//   5. merge    grid (G, Hkv, B): the partial sums into the zone's state (o, lse) per query head.
// The CPU reference computes the same quantities in another order (distances and sums round
// differently), so near-ties may rank differently; tests compare within that.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
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
constexpr int kMaxGD = 2048;          // G * d: the query group held in shared memory
constexpr uint32_t kNoKey = 0xffffffffu;  // an empty cluster: never ranked

__device__ __forceinline__ float to_f32(float x) { return x; }
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
  const bool counted = valid && (!a.mask_before || s.size[int64_t(h) * s.C + c] > 0);
  const M* cent = static_cast<const M*>(s.cent) + (int64_t(h) * s.C + (valid ? c : 0)) * D;
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

// Each head's softmax from the chunk pairs, then a thread per cluster: its distance (the group's
// summed softmax) as ordered bits (>= +0); empty clusters never rank.
__global__ void __launch_bounds__(kChunkThreads) dist_kernel(const Args a) {
  __shared__ float M[64], inv[64];
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const RetroSession& s = a.sessions[b];
  const int c0 = chunk * kChunk;
  if (!indexed(s) || c0 >= s.C) return;
  const int G = a.G, row = b * a.Hkv + h;
  const int nchs = (s.C + kChunk - 1) / kChunk;
  for (int g = threadIdx.x; g < G; g += kChunkThreads) {
    float m = -INFINITY, l = 0.f;
    for (int k = 0; k < nchs; ++k) {
      const float2 p = a.cstats[(int64_t(row) * a.nch + k) * G + g];
      lse_add(m, l, p.x, p.y);
    }
    M[g] = m;
    inv[g] = l > 0.f ? 1.f / l : 0.f;
    if (chunk == 0) a.gmax[int64_t(row) * G + g] = m;
  }
  __syncthreads();
  const int c = c0 + threadIdx.x;
  if (c >= s.C) return;
  const float* lg = a.logits + int64_t(row) * G * a.Cc;
  uint32_t k = kNoKey;
  if (s.size[int64_t(h) * s.C + c] > 0) {
    float dsum = 0.f;
    for (int g = 0; g < G; ++g) dsum += __expf(lg[int64_t(g) * a.Cc + c] - M[g]) * inv[g];
    k = __float_as_uint(fmaxf(dsum, 0.f));
  }
  a.keys[int64_t(row) * a.Cc + c] = k;
}

// ---- 2. zones and the exact list ---------------------------------------------------------------
using Scan = cub::BlockScan<long long, kZoneThreads>;
using Reduce = cub::BlockReduce<long long, kZoneThreads>;

struct ZoneSmem {
  union {
    Scan::TempStorage scan;
    cub::BlockScan<unsigned long long, kZoneThreads>::TempStorage scan_u;
    Reduce::TempStorage reduce;
  };
  int hist[256];
  int whist[kZoneWarps][256];
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
    // Keys share their top digits (distances are small positive floats), so each warp counts into
    // its own histogram (same-address atomics stay within a warp), summed per digit after.
    for (int i = threadIdx.x; i < kZoneWarps * 256; i += kZoneThreads) (&sm.whist[0][0])[i] = 0;
    __syncthreads();
    int* wh = sm.whist[threadIdx.x / 32];
    for (int i = threadIdx.x; i < n; i += kZoneThreads) {
      const uint32_t k = keys[i];
      if (k != kNoKey && (k & mask) == prefix) atomicAdd(&wh[(k >> shift) & 255], w ? w[i] : 1);
    }
    __syncthreads();
    if (threadIdx.x < 256) {
      int t = 0;
      for (int j = 0; j < kZoneWarps; ++j) t += sm.whist[j][threadIdx.x];
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

template <typename T, int D>
__global__ void __launch_bounds__(kZoneThreads) zones_kernel(const Args a) {
  __shared__ ZoneSmem sm;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int row = b * a.Hkv + h, G = a.G;
  const RetroSession& s = a.sessions[b];
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
  const int32_t* size = s.size + int64_t(h) * C;
  const int32_t* start = s.start + int64_t(h) * C;
  const int32_t* pos = s.pos + int64_t(h) * s.R;
  uint32_t* keys = a.keys + int64_t(row) * a.Cc;
  uint8_t* zone = a.zone + int64_t(row) * a.Cc;

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
  // Each thread walks a contiguous range of cluster ids; one scan over the threads gives the ties
  // before its range (in id order).
  const int per = (C + kZoneThreads - 1) / kZoneThreads, cb = min(C, tid * per), ce = min(C, cb + per);
  if (tid == 0) sm.part = -1;
  __syncthreads();
  long long used_part = 0, r_part = 0;
  {
    long long v = 0, before;
    for (int c = cb; c < ce; ++c)
      if (keys[c] == T1) v += session ? size[c] : 1;
    Scan(sm.scan).ExclusiveSum(v, before);
    for (int c = cb; c < ce; ++c) {
      const uint32_t k = keys[c];
      const bool tie = k != kNoKey && k == T1;
      const long long w = tie ? (session ? size[c] : 1) : 0;
      const bool in1 = k != kNoKey && (k > T1 || (tie && before + w <= lim1));
      if (tie && before <= lim1 && before + w > lim1) sm.part = c;  // the first tie that does not fit
      zone[c] = in1 ? 1 : 0;
      if (in1) used_part += size[c], ++r_part;
      before += w;
    }
  }
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
    // Ties at T2 (low 32 bits) and retrieval rows (high) before this thread's range, in one scan.
    unsigned long long v = 0, before;
    for (int c = cb; c < ce; ++c)
      v += (keys[c] == T2 ? 1ull : 0ull) + (zone[c] == 1 ? (unsigned long long)size[c] << 32 : 0ull);
    __syncthreads();
    cub::BlockScan<unsigned long long, kZoneThreads>(sm.scan_u).ExclusiveSum(v, before);
    long long ties = (long long)(before & 0xffffffffull), at = (long long)(before >> 32);
    for (int c = cb; c < ce; ++c) {
      const uint32_t k = keys[c];
      const bool tie = k != kNoKey && k == T2;
      const bool in2 = k != kNoKey && (k > T2 || (tie && ties + 1 <= lim2));
      ties += tie;
      const int z = zone[c] == 1 ? 1 : c == part ? 2 : in2 ? 3 : 0;
      zone[c] = uint8_t(z);
      if (z == 3) ++est_c, est_t += size[c];
      if (z == 1) {  // the cluster's positions after the steady sinks, eight loads in flight
        const int m = size[c];
        const int32_t* src = pos + start[c];
        int32_t* dst = out + sk + at;
        const long long room_left = cap - sk - at;
        for (int j0 = 0; j0 < m; j0 += 8) {
          int32_t t[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) t[j] = j0 + j < m ? src[j0 + j] : 0;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (j0 + j < m && j0 + j < room_left) dst[j0 + j] = t[j];
        }
        at += m;
      }
    }
  }
  __syncthreads();
  const long long est_clusters = Reduce(sm.reduce).Sum(est_c);
  __syncthreads();
  const long long est_tokens = Reduce(sm.reduce).Sum(est_t);
  __syncthreads();
  if (s.wave_ids) {  // the clusters whose rows this step reads, in id order (the wave buffer's LRU)
    long long v = 0, before;
    for (int c = cb; c < ce; ++c) v += zone[c] == 1 || zone[c] == 2;
    Scan(sm.scan).ExclusiveSum(v, before);
    int32_t* ids = s.wave_ids + int64_t(h) * s.wave_cap;
    for (int c = cb; c < ce; ++c)
      if (zone[c] == 1 || zone[c] == 2) {
        if (before < s.wave_cap) ids[before] = c;
        ++before;
      }
    if (tid == kZoneThreads - 1) s.wave_cnt[h] = int32_t(lmin(before, s.wave_cap));
    __syncthreads();
  }

  // The part cluster's best pm rows by exact score (max over the group of q . k), ties to the
  // earlier row.
  long long at = sk + used;
  if (part >= 0) {
    const int m = size[part], p0 = start[part];
    uint32_t* pk = a.pkeys + int64_t(row) * a.Pm;
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
// Per chunk: the estimation clusters listed, their weights e^(logit - M_g) for 8 heads at a time
// in shared memory, then a thread per dimension accumulates the 8 heads' numerators (each meta
// element read once per 8 heads) and the first 8 threads the weight sums.
constexpr int kEstThreads = 128;
template <typename M>
__global__ void __launch_bounds__(kEstThreads) estimate_kernel(const Args a) {
  __shared__ int list[kChunk];
  __shared__ float wsh[kChunk][8];
  __shared__ float csz[kChunk];
  __shared__ int nlist;
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const RetroSession& s = a.sessions[b];
  const int c0 = chunk * kChunk, G = a.G, D = a.d;
  const int row = b * a.Hkv + h;
  float* part = a.estp + (int64_t(row) * a.nch + chunk) * G * (D + 1);
  if (!indexed(s) || c0 >= s.C) return;
  const int c1 = min(c0 + kChunk, s.C);
  const uint8_t* zone = a.zone + int64_t(row) * a.Cc;
  if (threadIdx.x < 32) {  // the chunk's estimation clusters in id order (so the sums' order is fixed)
    int at = 0;
    for (int c = c0 + int(threadIdx.x); c - int(threadIdx.x) < c1; c += 32) {
      const bool in = c < c1 && zone[c] == 3;
      const unsigned bal = __ballot_sync(0xffffffffu, in);
      if (in) list[at + __popc(bal & ((1u << threadIdx.x) - 1u))] = c;
      at += __popc(bal);
    }
    if (threadIdx.x == 0) nlist = at;
  }
  __syncthreads();
  const int nl = nlist;
  const int32_t* size = s.size + int64_t(h) * s.C;
  for (int i = threadIdx.x; i < nl; i += kEstThreads) csz[i] = float(size[list[i]]);
  const M* vm = static_cast<const M*>(s.vmeta) + int64_t(h) * s.C * D;
  const float* lg = a.logits + int64_t(row) * G * a.Cc;
  const float* gm = a.gmax + int64_t(row) * G;
  // 16-bit meta rows are value means: weight e^(logit - M) * size; fp32 rows are value sums.
  constexpr bool kMeans = sizeof(M) == 2;
  for (int g0 = 0; g0 < G; g0 += 8) {
    const int ng = min(8, G - g0);
    __syncthreads();
    for (int i = threadIdx.x; i < nl * 8; i += kEstThreads) {
      const int li = i / 8, gg = i % 8;
      wsh[li][gg] = gg < ng ? __expf(lg[int64_t(g0 + gg) * a.Cc + list[li]] - gm[g0 + gg]) : 0.f;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < D; e += kEstThreads) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int i0 = 0; i0 < nl; i0 += 8) {
        float x[8];  // eight rows' loads in flight at once
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = i0 + j < nl ? to_f32(vm[int64_t(list[i0 + j]) * D + e]) : 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (i0 + j >= nl) break;
          const float xv = kMeans ? x[j] * csz[i0 + j] : x[j];
#pragma unroll
          for (int gg = 0; gg < 8; ++gg) acc[gg] = fmaf(wsh[i0 + j][gg], xv, acc[gg]);
        }
      }
      for (int gg = 0; gg < ng; ++gg) part[(g0 + gg) * (D + 1) + e] = acc[gg];
    }
    if (threadIdx.x < ng) {
      float den = 0.f;
      for (int i = 0; i < nl; ++i) den = fmaf(wsh[i][threadIdx.x], csz[i], den);
      part[(g0 + threadIdx.x) * (D + 1) + D] = den;
    }
  }
}

// ---- 4. the estimation zone's state -----------------------------------------------------------
// grid (G, Hkv, B), a thread per dimension: the chunks' partial sums (eight loads in flight).
__global__ void __launch_bounds__(kEstThreads) est_merge_kernel(const Args a) {
  const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z, G = a.G, D = a.d;
  const int row = b * a.Hkv + h;
  const RetroSession& s = a.sessions[b];
  const int nchs = indexed(s) ? (s.C + kChunk - 1) / kChunk : 0;
  const float* base = a.estp + int64_t(row) * a.nch * G * (D + 1) + int64_t(g) * (D + 1);
  const int64_t stride = int64_t(G) * (D + 1);
  const int64_t qrow = int64_t(b) * a.Hq + int64_t(h) * G + g;
  float den = 0.f;
#pragma unroll 8
  for (int c = 0; c < nchs; ++c) den += base[c * stride + D];
  for (int e = threadIdx.x; e < D; e += kEstThreads) {
    float num = 0.f;
#pragma unroll 8
    for (int c = 0; c < nchs; ++c) num += base[c * stride + e];
    a.est_o[qrow * D + e] = den > 0.f ? num / den : 0.f;
  }
  if (threadIdx.x == 0) a.est_lse[qrow] = den > 0.f ? a.gmax[int64_t(row) * G + g] + logf(den) : -INFINITY;
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct Carve {
  size_t logits, cstats, gmax, keys, zone, estp, pkeys, total;
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
  c.total = at;
  return c;
}

template <typename M, typename T, int D>
Status launch_all(const Args& a, cudaStream_t st) {
  const dim3 chunks(unsigned(a.nch), unsigned(a.Hkv), unsigned(a.B));
  logits_kernel<M, D><<<chunks, kChunkThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro logits_kernel launch");
  dist_kernel<<<chunks, kChunkThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro dist_kernel launch");
  zones_kernel<T, D><<<dim3(unsigned(a.Hkv), unsigned(a.B)), kZoneThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro zones_kernel launch");
  estimate_kernel<M><<<chunks, kEstThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro estimate_kernel launch");
  est_merge_kernel<<<dim3(unsigned(a.G), unsigned(a.Hkv), unsigned(a.B)), kEstThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("retro est_merge_kernel launch");
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
__global__ void wave_moves_kernel(PagedKv kv, int32_t hkv, int32_t d, const int32_t* pos, int32_t R, int32_t* vpos,
                                  int32_t* tok2v, int32_t T, int32_t tok_base, PagedKv stage,
                                  const int64_t* stage_map, uint32_t epoch, const WaveMove* moves,
                                  const int32_t* count) {
  const int32_t n = *count;
  const bool wide = (d * 2) % 16 == 0;
  const int per = wide ? d * 2 / 16 : d;  // pieces per row
  for (int32_t m = blockIdx.x; m < n; m += gridDim.x) {
    const WaveMove mv = moves[m];
    const int32_t* p = pos + int64_t(mv.h) * R + mv.row0;
    if (mv.block >= 0)
      for (int e = threadIdx.x; e < mv.rows * 2 * per; e += blockDim.x) {
        const int r = e / (2 * per), is_v = (e / per) & 1, i = e % per;
        const uint16_t* src = nullptr;
        if (stage_map && p[r] < T) {
          const int64_t sm = stage_map[int64_t(mv.h) * T + p[r]];
          if (uint32_t(uint64_t(sm) >> 32) == epoch) src = kv_row<uint16_t>(stage, hkv, d, 0, mv.h, int32_t(sm & 0xffffffff), is_v);
        }
        if (!src) src = kv_row<uint16_t>(kv, hkv, d, 0, mv.h, tok_base + p[r], is_v);
        uint16_t* dst = const_cast<uint16_t*>(kv_row<uint16_t>(kv, hkv, d, 0, mv.h, mv.block * kWaveBlockRows + r, is_v));
        if (wide) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
        else dst[i] = src[i];
      }
    for (int r = threadIdx.x; r < mv.rows; r += blockDim.x) {
      const int32_t v = mv.block >= 0 ? mv.block * kWaveBlockRows + r : tok_base + p[r];
      vpos[int64_t(mv.h) * R + mv.row0 + r] = v;
      if (tok2v && p[r] < T) tok2v[int64_t(mv.h) * T + p[r]] = v;
    }
  }
}

// 32 listed entries per warp: the misses found by a ballot take consecutive slots (one atomic per
// warp), then the warp copies their rows four at a time (a lane per 16-byte piece of K and V, two
// for d > 128), the loads of the four issued before the stores.
constexpr int kStageTile = 256;  // list entries per CTA of the staging kernel (8 warps x 32)
__global__ void __launch_bounds__(256) wave_stage_kernel(PagedKv kv, int32_t row, int32_t hkv, int32_t d, int32_t* idx,
                                                         const int32_t* cnt, int32_t max_sel, int32_t T, int32_t tok_base,
                                                         int32_t stage_base, int32_t stage_cap, int64_t* stage_map,
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
    stage_map[int64_t(h) * T + t] = int64_t((uint64_t(epoch) << 32) | uint32_t(j));
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
                                  const int32_t* tok2v, int32_t T, int32_t tok_base) {
  const int h = blockIdx.x;
  const int64_t r = int64_t(row) * hkv + h;
  const int32_t n = min(max(cnt[r], 0), max_sel);
  int32_t* l = idx + r * max_sel;
  const int32_t* m = tok2v + int64_t(h) * T;
  for (int64_t tile = blockIdx.y; tile * kRemapTile < n; tile += gridDim.y)
    for (int64_t i = tile * kRemapTile + threadIdx.x; i < n && i < (tile + 1) * kRemapTile; i += blockDim.x) {
      const int32_t t = l[i] - tok_base;
      if (t >= 0 && t < T) l[i] = m[t];
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
                        int32_t* idx, const int32_t* cnt, int32_t max_selected, int32_t T, int32_t tok_base,
                        int32_t stage_base, int32_t stage_cap, int64_t* stage_map, int32_t* stage_tok,
                        int32_t* stage_cnt, uint32_t epoch, void* stream) noexcept {
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("retro_wave_stage: KV dtype must be BF16 or F16");
  if (head_dim % 8 != 0 || head_dim > 256) return unsupported("retro_wave_stage: head_dim must be a multiple of 8, <= 256");
  if (!idx || !cnt || !stage_map || !stage_tok || !stage_cnt || num_kv_heads < 1 || max_selected < 1)
    return invalid("retro_wave_stage: bad argument");
  if (T < 1 || stage_cap < 1) return Status{};
  const dim3 grid(unsigned(num_kv_heads), unsigned(std::min(65535, (max_selected + kStageTile - 1) / kStageTile)));
  wave_stage_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(kv, row, num_kv_heads, head_dim, idx, cnt,
                                                                         max_selected, T, tok_base, stage_base,
                                                                         stage_cap, stage_map, stage_tok, stage_cnt,
                                                                         epoch);
  return launch_status("retro_wave_stage");
}

Status retro_wave_moves(const PagedKv& kv, Scalar kv_dtype, int32_t num_kv_heads, int32_t head_dim,
                        const int32_t* pos, int32_t R, int32_t* vpos, int32_t* tok2v, int32_t T, int32_t tok_base,
                        const PagedKv& stage, const int64_t* stage_map, uint32_t epoch, const WaveMove* moves,
                        const int32_t* count, int32_t max_moves, void* stream) noexcept {
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("retro_wave_moves: KV dtype must be BF16 or F16");
  if (!pos || !vpos || !moves || !count || num_kv_heads < 1 || head_dim < 1) return invalid("retro_wave_moves: bad argument");
  if (max_moves < 1) return Status{};
  const int grid = std::min<int32_t>(max_moves, 264);  // 2048 CTAs measured slower (the bus is the limit)
  wave_moves_kernel<<<grid, 128, 0, static_cast<cudaStream_t>(stream)>>>(kv, num_kv_heads, head_dim, pos, R, vpos,
                                                                          tok2v, T, tok_base, stage, stage_map, epoch,
                                                                          moves, count);
  return launch_status("retro_wave_moves");
}

Status retro_wave_remap(int32_t row, int32_t num_kv_heads, int32_t* idx, const int32_t* cnt, int32_t max_selected,
                        const int32_t* tok2v, int32_t T, int32_t tok_base, void* stream) noexcept {
  if (!idx || !cnt || !tok2v || num_kv_heads < 1 || max_selected < 1) return invalid("retro_wave_remap: bad argument");
  const dim3 grid(unsigned(num_kv_heads), unsigned(std::min(65535, (max_selected + kRemapTile - 1) / kRemapTile)));
  wave_remap_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(row, num_kv_heads, idx, cnt, max_selected,
                                                                         tok2v, T, tok_base);
  return launch_status("retro_wave_remap");
}

}  // namespace kvs::cuda
