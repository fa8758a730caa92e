// SPDX-License-Identifier: Apache-2.0
// The row-wise top-k's cluster select (topk.cuh, topk_rows; the method is described at the top of
// topk.cu), as device code shared by topk_rows' kernel and by kernels that produce a row's scores
// in shared memory themselves and select from there (csattention's fused reduce and top-k).
// Device-only; include from .cu files after cooperative_groups.h.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kvs::cuda::topk_detail {

namespace cg = cooperative_groups;

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// =================================================================================================
// Row-wise top-k
// =================================================================================================
constexpr int kRowsThreads = 1024;
constexpr int kTile = kRowsThreads * 4;          // elements per block step (4 per thread)
constexpr int kBins = 2048;                      // digits 0, 1: 11 bits; digit 2: 10 bits
constexpr int kMaxCluster = 16;
constexpr int kCacheBytesMax = 176 * 1024;       // keys kept in shared memory up to this size
constexpr int kRowsVariants = 4;                 // (vector loads) x (key cache)
// Rows up to this length are selected by one CTA each (topk_rows' small kernel, 16 keys per thread
// in registers): 8 rows of 32768 took 20.1 us there against 15.0 us on clusters of 8 (H100).
constexpr int kSmallMaxLen = kRowsThreads * 16;

// Order-preserving key: larger float -> larger key; NaN -> 0 (below -inf = 0x007fffff); -0 -> +0,
// or -0 -> 0 like NaN when `absent` (topk_rows' neg_zero_absent: -0 marks an absent score).
__device__ __forceinline__ uint32_t ord_key(float x, bool absent = false) {
  uint32_t u = __float_as_uint(x);
  if (x != x) return 0u;
  if (u == 0x80000000u) {
    if (absent) return 0u;
    u = 0u;
  }
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct RowsArgs {
  const float* scores;
  int64_t stride;
  const int32_t* lengths;
  const int32_t* row_k;  // null, or device [rows]: row r keeps clamp(row_k[r], 0, k) (k = the capacity)
  int32_t max_len, k;
  int32_t* out_idx;
  int32_t* out_cnt;
  bool absent;  // -0 scores rank with NaN, below every other value
};

// Row r's length: lengths[r] (or max_len) clamped to [0, max_len].
__device__ __forceinline__ int row_len_of(const RowsArgs& a, int row) {
  const int len = a.lengths ? a.lengths[row] : a.max_len;
  return min(max(len, 0), a.max_len);
}

// CTA `rank` of a cluster of C owns the slice [beg, end) of a row of len keys (a multiple of 4
// keys per slice but the last): the slice a producer fills into the key cache for rows_select.
__device__ __forceinline__ void select_slice(int len, int C, int rank, int64_t* beg, int64_t* end) {
  const int64_t chunk = (ceil_div(len, C) + 3) & ~int64_t(3);
  *beg = min(int64_t(len), rank * chunk);
  *end = min(int64_t(len), *beg + chunk);
}

// Row r's k: the capacity a.k, or clamp(row_k[r], 0, a.k) when per-row counts are given (read
// after pdl_wait, like the lengths).
__device__ __forceinline__ int row_k_of(const RowsArgs& a, int row) {
  return a.row_k ? min(max(a.row_k[row], 0), a.k) : a.k;
}

// Threshold state: T's top `nbits` bits are `prefix`; `rem` keys with those bits are still to take
// (the lowest indices among them); done: the selection is final.
struct SelState {
  uint32_t prefix;
  int32_t nbits;
  int32_t rem;
  int32_t done;
};

// Split cluster barrier: arrive (release) early, wait (acquire) only where the other CTAs' writes
// or presence are needed, so the wait overlaps independent work.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Exclusive scan of one value per thread over the block (kRowsThreads threads); *total = sum.
// Ends with a barrier, so `sw` can be reused right away.
__device__ __forceinline__ uint32_t block_excl_scan(uint32_t v, uint32_t* sw, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sw[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = sw[lane];  // kRowsThreads / 32 == 32 warps
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    sw[lane] = w;
  }
  __syncthreads();
  const uint32_t excl = x - v + (warp ? sw[warp - 1] : 0u);
  *total = sw[31];
  __syncthreads();
  return excl;
}

// Four consecutive scores [i, i+4) of a row as keys; elements at or past `end` are not loaded.
template <bool VEC>
__device__ __forceinline__ float4 load4(const float* src, int64_t i, int64_t end) {
  if (VEC && i + 3 < end) return __ldg(reinterpret_cast<const float4*>(src + i));
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (i < end) v.x = __ldg(src + i);
  if (i + 1 < end) v.y = __ldg(src + i + 1);
  if (i + 2 < end) v.z = __ldg(src + i + 2);
  if (i + 3 < end) v.w = __ldg(src + i + 3);
  return v;
}
__device__ __forceinline__ uint4 keys4(const float4& v, bool absent) {
  return make_uint4(ord_key(v.x, absent), ord_key(v.y, absent), ord_key(v.z, absent), ord_key(v.w, absent));
}
__device__ __forceinline__ uint32_t comp(const uint4& k, int j) {
  return j == 0 ? k.x : j == 1 ? k.y : j == 2 ? k.z : k.w;
}

// Calls f(key, index) for every element of [beg, end): from the shared-memory key cache (FROM_CACHE)
// or from global memory (U block steps of loads in flight; STORE also fills the cache).
template <bool VEC, bool FROM_CACHE, bool STORE, typename F>
__device__ __forceinline__ void for_each_key(const float* src, uint32_t* cache, int64_t beg,
                                             int64_t end, bool absent, F&& f) {
  const int64_t n = end - beg;
  if constexpr (FROM_CACHE) {
    for (int64_t i = int64_t(threadIdx.x) * 4; i < n; i += kTile) {
      const uint4 k = *reinterpret_cast<const uint4*>(cache + i);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i + j < n) f(comp(k, j), beg + i + j);
    }
  } else {
    constexpr int U = 4;
    for (int64_t i0 = beg + int64_t(threadIdx.x) * 4; i0 < end; i0 += int64_t(kTile) * U) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = load4<VEC>(src, i0 + int64_t(u) * kTile, end);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = i0 + int64_t(u) * kTile;
        if (i >= end) break;
        const uint4 k = keys4(v[u], absent);
        if constexpr (STORE) {
          if (i + 3 < end) *reinterpret_cast<uint4*>(cache + (i - beg)) = k;
          else
            for (int j = 0; i + j < end; ++j) cache[i - beg + j] = comp(k, j);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (i + j < end) f(comp(k, j), i + j);
      }
    }
  }
}

// The digit of pass p and the test that a key still matches the threshold's higher digits.
__device__ __forceinline__ uint32_t digit_of(uint32_t key, int pass) {
  return pass == 0 ? key >> 21 : pass == 1 ? (key >> 10) & 2047u : key & 1023u;
}
__device__ __forceinline__ uint32_t high_bits(uint32_t key, int nbits) {
  return nbits >= 32 ? key : key >> (32 - nbits);
}

// Finds the threshold digit of this pass from the cluster's histogram (nb bins; rank r holds bins
// [r * nb/C, (r+1) * nb/C) at their own index) and returns the updated state (the same in every
// CTA). Thread t reads bins [nb - 4 - 4t, nb - 4t) with one 16-byte load, so prefix sums over
// threads are suffix sums over digits (the count of keys with a larger digit).
__device__ inline SelState resolve_digit(cg::cluster_group& cl, uint32_t* g, int C, int nb, SelState st,
                                  uint32_t* sw, SelState* sst) {
  const int tid = threadIdx.x;
  const int base = nb - 4 - 4 * tid, slice = nb / C;
  uint4 q = make_uint4(0u, 0u, 0u, 0u);
  if (base >= 0) q = *reinterpret_cast<const uint4*>(cl.map_shared_rank(g + base, unsigned(base / slice)));
  const uint32_t h[4] = {q.w, q.z, q.y, q.x};  // digits base + 3, base + 2, base + 1, base
  const uint32_t v = h[0] + h[1] + h[2] + h[3];
  uint32_t total;
  const uint32_t excl = block_excl_scan(v, sw, &total);
  const uint32_t rem = uint32_t(st.rem);
  if (excl < rem && rem <= excl + v) {  // exactly one thread
    uint32_t above = excl, d = 0, bin = 0;
    bool found = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // compile-time indices: h stays in registers
      if (found) continue;
      if (rem <= above + h[j]) {
        d = uint32_t(base + 3 - j), bin = h[j], found = true;
      } else {
        above += h[j];
      }
    }
    const int w = nb == 2048 ? 11 : 10;
    SelState n;
    n.prefix = (st.prefix << w) | d;
    n.nbits = st.nbits + w;
    n.rem = int32_t(rem - above);
    n.done = (uint32_t(n.rem) == bin) || n.nbits >= 32;
    *sst = n;
  }
  __syncthreads();
  return *sst;
}

// The cluster select of row `row` (every CTA of the cluster calls it; 1024 threads): writes the
// indices of its count = min(k of the row, its length, count_cap if >= 0) largest keys to
// a.out_idx[row * a.k ...] in ascending order, -1 past the count, and a.out_cnt[row].
// FILLED: `cache` already holds this CTA's slice (select_slice) as ord_key keys, and a.scores is
// not read; else the first pass reads the slice from a.scores (and fills `cache` when CACHE).
template <bool VEC, bool CACHE, bool FILLED>
__device__ __forceinline__ void rows_select(const RowsArgs& a, cg::cluster_group& cl, int row, uint32_t* cache,
                                            int count_cap) {
  static_assert(CACHE || !FILLED, "a filled slice lives in the key cache");
  constexpr int kWarps = kRowsThreads / 32;
  __shared__ uint32_t lhist[kBins];          // this slice's histogram of the current digit
  __shared__ __align__(16) uint32_t ghist[3][kBins];  // the cluster's histograms, a slice per rank
  __shared__ __align__(8) uint32_t gcnt[kMaxCluster][2];  // rank 0: (greater, equal) of every slice
  __shared__ uint32_t wcnt[kWarps][2];       // (greater, equal) count of every warp's segment
  __shared__ uint32_t sw[32];
  __shared__ uint32_t sred[2];
  __shared__ uint32_t sbefore[2];
  __shared__ SelState sst;
  const int C = int(cl.num_blocks()), rank = int(cl.block_rank());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int len = row_len_of(a, row);
  const int count = min(min(row_k_of(a, row), len), count_cap < 0 ? len : count_cap);
  int64_t beg, end;
  select_slice(len, C, rank, &beg, &end);
  const float* src = a.scores + int64_t(row) * a.stride;
  int32_t* out = a.out_idx + int64_t(row) * a.k;

  if (count > 0 && count < len) {
    for (int i = tid; i < kBins; i += kRowsThreads) {
      lhist[i] = 0;
      ghist[0][i] = 0;
      ghist[1][i] = 0;
      ghist[2][i] = 0;
    }
    if (tid < 2) sred[tid] = 0;
    __syncthreads();
    cluster_arrive();  // zeroed histograms; waited for before the first push

    // Threshold search. Each CTA also counts, from its own histograms, the keys of its slice above
    // the threshold (a larger digit at some pass) and equal to it (the final bin).
    SelState st{0u, 0, count, 0};
    uint32_t my_gt = 0, my_eq = 0;
    for (int pass = 0; pass < 3; ++pass) {
      const int mshift = 32 - st.nbits;  // pass > 0: 21 or 10
      const uint32_t prefix = st.prefix;
      auto hist = [&](uint32_t key, int64_t) {
        if (pass == 0 || (key >> mshift) == prefix) atomicAdd(&lhist[digit_of(key, pass)], 1u);
      };
      if (pass == 0 && !FILLED) {
        for_each_key<VEC, false, CACHE>(src, cache, beg, end, a.absent, hist);
      } else {
        if constexpr (CACHE) for_each_key<VEC, true, false>(src, cache, beg, end, a.absent, hist);
        else for_each_key<VEC, false, false>(src, cache, beg, end, a.absent, hist);
      }
      __syncthreads();
      if (pass == 0) cluster_wait();  // every CTA running, every histogram zeroed
      const int nb = pass == 2 ? 1024 : 2048, slice = nb / C;
      for (int i = tid; i < nb; i += kRowsThreads) {  // bin i into rank i / slice
        const uint32_t v = lhist[i];
        if (v) atomicAdd(cl.map_shared_rank(&ghist[pass][i], unsigned(i / slice)), v);
      }
      cl.sync();
      st = resolve_digit(cl, &ghist[pass][0], C, nb, st, sw, &sst);
      const uint32_t d = st.prefix & uint32_t(nb - 1);
      for (int i = tid; i < nb; i += kRowsThreads) {
        const uint32_t v = lhist[i];
        if (uint32_t(i) > d) my_gt += v;
        if (st.done && uint32_t(i) == d) my_eq = v;
        lhist[i] = 0;
      }
      __syncthreads();
      if (st.done) break;
    }
    const int nbits = st.nbits;
    const uint32_t prefix = st.prefix;
    const uint32_t rem = uint32_t(st.rem);

    // Slice counts to rank 0 (split barrier: the per-warp counts below overlap it).
    my_gt = __reduce_add_sync(0xffffffffu, my_gt);
    my_eq = __reduce_add_sync(0xffffffffu, my_eq);
    if (lane == 0 && (my_gt | my_eq)) {
      atomicAdd(&sred[0], my_gt);
      atomicAdd(&sred[1], my_eq);
    }
    __syncthreads();
    if (tid == 0) {
      uint32_t* gc = cl.map_shared_rank(&gcnt[0][0], 0);
      gc[2 * rank] = sred[0];
      gc[2 * rank + 1] = sred[1];
    }
    cluster_arrive();

    // Warp w owns a contiguous segment of the slice (whole 128-key steps), so output ranks follow
    // index order with warp-level scans only: count each segment, then write it.
    const int n = int(end - beg);
    const int iters = (n + 127) >> 7, per = (iters + kWarps - 1) / kWarps;
    const int it0 = min(iters, warp * per), it1 = min(iters, it0 + per);
    auto keys_at = [&](int it) -> uint4 {
      const int64_t i = beg + int64_t(it) * 128 + lane * 4;
      if constexpr (CACHE) {
        return i < end ? *reinterpret_cast<const uint4*>(cache + (i - beg)) : make_uint4(0u, 0u, 0u, 0u);
      } else {
        return keys4(load4<VEC>(src, i, end), a.absent);
      }
    };
    {
      uint32_t wg = 0, we = 0;
#pragma unroll 4
      for (int it = it0; it < it1; ++it) {
        const uint4 k = keys_at(it);
        const int64_t i = beg + int64_t(it) * 128 + lane * 4;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (i + j < end) {
            const uint32_t h = high_bits(comp(k, j), nbits);
            wg += h > prefix;
            we += h == prefix;
          }
        }
      }
      wg = __reduce_add_sync(0xffffffffu, wg);
      we = __reduce_add_sync(0xffffffffu, we);
      if (lane == 0) {
        wcnt[warp][0] = wg;
        wcnt[warp][1] = we;
      }
    }
    cluster_wait();  // every slice's counts are in rank 0
    if (warp == 0) {  // lane r < rank reads slice r's counts
      const uint2* gc = reinterpret_cast<const uint2*>(cl.map_shared_rank(&gcnt[0][0], 0));
      const uint2 c = lane < rank ? gc[lane] : make_uint2(0u, 0u);
      const uint32_t bg = __reduce_add_sync(0xffffffffu, c.x), be = __reduce_add_sync(0xffffffffu, c.y);
      if (lane == 0) {
        sbefore[0] = bg;
        sbefore[1] = be;
      }
    }
    __syncthreads();
    cluster_arrive();  // done with rank 0's shared memory; waited for before exiting

    // Write: a greater key goes to (greater keys before it) + min(equal keys before it, rem); an
    // equal key of rank r < rem goes to (greater keys before it) + r.
    uint32_t gb = sbefore[0], eb = sbefore[1];
    gb += __reduce_add_sync(0xffffffffu, lane < warp ? wcnt[lane][0] : 0u);
    eb += __reduce_add_sync(0xffffffffu, lane < warp ? wcnt[lane][1] : 0u);
    if (wcnt[warp][0] > 0 || (wcnt[warp][1] > 0 && eb < rem)) {
      uint4 nxt = it0 < it1 ? keys_at(it0) : make_uint4(0u, 0u, 0u, 0u);
      for (int it = it0; it < it1; ++it) {
        const uint4 k = nxt;
        if (it + 1 < it1) nxt = keys_at(it + 1);
        const int64_t i = beg + int64_t(it) * 128 + lane * 4;
        uint32_t fg = 0, fe = 0, ng = 0, ne = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (i + j < end) {
            const uint32_t h = high_bits(comp(k, j), nbits);
            if (h > prefix) fg |= 1u << j, ++ng;
            else if (h == prefix) fe |= 1u << j, ++ne;
          }
        }
        const uint32_t v = (ng << 16) | ne;
        uint32_t x = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
          if (lane >= o) x += y;
        }
        const uint32_t tot = __shfl_sync(0xffffffffu, x, 31), ex = x - v;
        uint32_t lg = gb + (ex >> 16), le = eb + (ex & 0xffffu);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (fg >> j & 1u) {
            out[lg + min(le, rem)] = int32_t(i + j);
            ++lg;
          } else if (fe >> j & 1u) {
            if (le < rem) out[lg + le] = int32_t(i + j);
            ++le;
          }
        }
        gb += tot >> 16;
        eb += tot & 0xffffu;
      }
    }
    cluster_wait();  // rank 0 must not exit while another CTA may still read its shared memory
  } else if (count > 0) {  // count == len: every key, in order
    for (int64_t t = beg + tid; t < end; t += kRowsThreads) out[t] = int32_t(t);
  }
  for (int64_t i = int64_t(count) + int64_t(rank) * kRowsThreads + tid; i < a.k;
       i += int64_t(C) * kRowsThreads)
    out[i] = -1;
  if (rank == 0 && tid == 0 && a.out_cnt) a.out_cnt[row] = count;
}

}  // namespace kvs::cuda::topk_detail
