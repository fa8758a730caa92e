// SPDX-License-Identifier: Apache-2.0
// exact_topk on CUDA: see topk.cuh for the contracts.
//
// topk_rows: radix select on an order-preserving 32-bit key (NaN -> 0, the lowest; -0 -> +0). Rows
// of at most kSmallMaxLen scores: topk_small_kernel (one CTA, keys in registers). Longer rows: one
// thread-block cluster per row; CTA `rank` owns the contiguous slice [rank * chunk, +chunk) of the
// row (its keys cached in shared memory when they fit). Pass p histograms key digit p (bits
// 31..21, 20..10, 9..0) of the keys whose higher digits equal the threshold's digits found so far;
// each CTA adds its slice histogram into the cluster's histogram, whose bins are spread over the
// ranks' shared memory in contiguous slices (DSMEM atomics), and after a cluster barrier every CTA
// reads the whole histogram (one 16-byte remote load per thread) and finds the same threshold digit
// by suffix sums, so no CTA waits for another's decision. The selection is then
//   key > T, or key == T among the first `rem` such keys in index order
// (T known to nbits bits; when the threshold bin is taken whole the search stops early). Each CTA
// reads its slice's (greater, equal) counts off its own histograms (digits above the threshold
// digit, and the final bin), rank 0 collects them, and each CTA sums its predecessors'. Inside a
// CTA, warp w owns a contiguous segment of the slice: it counts its segment, then writes the
// selected indices of the segment at their ranks with warp scans, so the output comes out in
// ascending index order with no sort and no block-wide scan. Per-pass costs measured on an H100
// (1 x 128K, 16 CTAs): global pass 2.5 us, histogram exchange + barrier 1.2 us, resolve 1.2 us,
// cached pass 0.8 us, counts + write 4.4 us.
//
// topk_scores: grid (token chunk, KV head x query-group tile, sequence). A warp reads RPP = 32/TPR
// K rows per load (TPR = d/8 lanes per row, 16 bytes each), U loads in flight per lane, and dots
// each row with the group's GT query heads held in registers (8 elements x GT per lane); the GT
// partial sums are reduced across the TPR lanes by a butterfly that halves the head set at each
// step, so a lane ends with the full dot of one head. per_query_head writes the logits directly;
// the group mode writes base-2 logits [.., t, GT] to the workspace (L2 evict-last) with per-chunk
// (max, sum) softmax statistics, and a second kernel (a programmatic dependent launch) turns them
// into summed probabilities. topk_rows is launched as a programmatic dependent too, so it can
// follow the score pass without a launch gap.
//
// topk_group_select: for rows past kSmallMaxLen keys and groups of at most 8 heads, the second
// kernel and topk_rows are one cluster kernel (topk_group_select_kernel): each CTA turns the logits
// of its slice into summed probabilities straight into the key cache (the same arithmetic as the
// group-score kernel) and the cluster select runs on the filled slices, so the scores row is never
// written and read back (the exact_topk step on an H100: 1.5 us faster at 128K, 15 us at 512K and
// 16 us at 128K with 8 sequences; docs/perf.md).
#include "backends/cuda/topk.cuh"
#include "backends/cuda/topk_select.cuh"
#include "backends/cuda/kernel_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/status.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "kvsieve/kvsieve.h"

namespace cg = cooperative_groups;

namespace kvs::cuda {

namespace {

using namespace topk_detail;  // the row-wise cluster select (topk_select.cuh), shared with csattention.cu
using namespace kutil;        // Cvt (kernel_util.cuh)

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

constexpr float kLog2e = 1.4426950408889634f;

// grid (rows * C), cluster (C), block kRowsThreads; dynamic shared memory: the key cache (CACHE).
template <bool VEC, bool CACHE>
__global__ void __launch_bounds__(kRowsThreads, 1) topk_rows_kernel(const RowsArgs a) {
  extern __shared__ uint4 dyn_smem[];
  cg::cluster_group cl = cg::this_cluster();
  // Launched as a programmatic dependent (e.g. of the score pass): wait for the previous kernel.
  pdl_wait();
  rows_select<VEC, CACHE, false>(a, cl, int(blockIdx.x / cl.num_blocks()), reinterpret_cast<uint32_t*>(dyn_smem), -1);
}

// ---- Short rows: one CTA per row, the keys in registers ------------------------------------------
// For rows of at most kSmallMaxLen scores (Quest's page scores, a few thousand candidates): thread t
// holds the KPT consecutive keys [t * KPT, t * KPT + KPT) in registers, so there is no key cache, no
// cluster and no second read of the row. The threshold comes from up to four passes of 8-bit digits
// (256 bins: one warp finds the digit with a suffix scan over lanes); the write is one block scan of
// each thread's (greater, equal) counts, which are in index order because the keys are.
constexpr int kSmallThreads = kRowsThreads;  // block_excl_scan is written for 32 warps
constexpr int kSmallMaxKpt = kSmallMaxLen / kSmallThreads;

template <int KPT, bool VEC>
__global__ void __launch_bounds__(kSmallThreads, 1) topk_small_kernel(const RowsArgs a) {
  static_assert(KPT % 4 == 0 && KPT <= kSmallMaxKpt, "KPT: a multiple of 4, at most kSmallMaxKpt");
  __shared__ uint32_t hist[256];
  __shared__ uint32_t sw[32];
  __shared__ SelState sst;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row = blockIdx.x;
  pdl_wait();  // a programmatic dependent launch
  int len = a.lengths ? a.lengths[row] : a.max_len;
  len = min(max(len, 0), a.max_len);
  const int count = min(row_k_of(a, row), len);
  const float* src = a.scores + int64_t(row) * a.stride;
  int32_t* out = a.out_idx + int64_t(row) * a.k;

  if (count > 0 && count < len) {
    const int i0 = tid * KPT;
    const int nvalid = min(max(len - i0, 0), KPT);
    uint32_t key[KPT];
#pragma unroll
    for (int q = 0; q < KPT / 4; ++q) {
      const float4 v = load4<VEC>(src, i0 + 4 * q, len);
      key[4 * q] = ord_key(v.x, a.absent);
      key[4 * q + 1] = ord_key(v.y, a.absent);
      key[4 * q + 2] = ord_key(v.z, a.absent);
      key[4 * q + 3] = ord_key(v.w, a.absent);
    }
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
    // Tried and dropped (8 rows of 8602 scores on an H100, 10.7 to 12 us either way): starting the
    // digits below the bits the row's smallest and largest keys share, adding a thread's runs of one
    // bin once, and warp-aggregated atomics (__match_any_sync: 16 us). The kernel is latency-bound
    // (ncu: 16K cycles, 0.6% of the SM's issue rate, 44% of the stalls at barriers).
    SelState st{0u, 0, count, 0};
    while (!st.done) {  // four passes of 8 bits at most
      const int shift = 24 - st.nbits;
#pragma unroll
      for (int j = 0; j < KPT; ++j)
        if (j < nvalid && (st.nbits == 0 || (key[j] >> (32 - st.nbits)) == st.prefix))
          atomicAdd(&hist[(key[j] >> shift) & 255u], 1u);
      __syncthreads();
      if (warp == 0) {
        // Lane l holds bins [8l, 8l + 8); S = the keys in bins >= 8l (a suffix sum over lanes).
        uint32_t h[8], sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          h[j] = hist[8 * lane + j];
          hist[8 * lane + j] = 0;  // ready for the next pass (read only after the barrier below)
          sum += h[j];
        }
        uint32_t S = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const uint32_t y = __shfl_down_sync(0xffffffffu, S, o);
          if (lane + o < 32) S += y;
        }
        const uint32_t rem = uint32_t(st.rem);
        // S of lane 0 counts every key still in the running, >= rem: the ballot is never empty.
        const unsigned m = __ballot_sync(0xffffffffu, S >= rem);
        if (lane == 31 - __clz(m)) {
          uint32_t above = S - sum, bin = 0;
          int d = 0;
          bool found = false;
#pragma unroll
          for (int j = 7; j >= 0; --j) {  // compile-time indices: h stays in registers
            if (found) continue;
            if (rem <= above + h[j]) d = 8 * lane + j, bin = h[j], found = true;
            else above += h[j];
          }
          SelState n;
          n.prefix = (st.prefix << 8) | uint32_t(d);
          n.nbits = st.nbits + 8;
          n.rem = int32_t(rem - above);
          n.done = uint32_t(n.rem) == bin || n.nbits >= 32;
          sst = n;
        }
      }
      __syncthreads();
      st = sst;
    }
    // Write: a greater key goes to (greater keys before it) + min(equal keys before it, rem); an
    // equal key of rank r < rem goes to (greater keys before it) + r.
    const uint32_t prefix = st.prefix, rem = uint32_t(st.rem);
    uint32_t fg = 0, fe = 0, ng = 0, ne = 0;
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
      if (j < nvalid) {
        const uint32_t h = high_bits(key[j], st.nbits);
        if (h > prefix) fg |= 1u << j, ++ng;
        else if (h == prefix) fe |= 1u << j, ++ne;
      }
    }
    uint32_t total;
    const uint32_t ex = block_excl_scan((ng << 16) | ne, sw, &total);  // counts < 2^16 per row
    uint32_t lg = ex >> 16, le = ex & 0xffffu;
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
      if (fg >> j & 1u) {
        out[lg + min(le, rem)] = i0 + j;
        ++lg;
      } else if (fe >> j & 1u) {
        if (le < rem) out[lg + le] = i0 + j;
        ++le;
      }
    }
  } else if (count > 0) {  // count == len: every key, in order
    for (int t = tid; t < len; t += kSmallThreads) out[t] = t;
  }
  for (int i = count + tid; i < a.k; i += kSmallThreads) out[i] = -1;
  if (tid == 0 && a.out_cnt) a.out_cnt[row] = count;
}

// Benchmark knobs (detail::set_topk_tuning): 0 = automatic.
std::atomic<int> g_force_cluster{0}, g_force_chunk{0}, g_last_cluster{0};
// The group mode's logits on the tensor cores (topk_logits_mma_kernel) where they apply: off with
// KVS_TOPK_SCORE_MMA=0 or detail::set_topk_score_mma.
std::atomic<int> g_score_mma{-1};
bool score_mma_enabled() { return env_flag(g_score_mma, "KVS_TOPK_SCORE_MMA"); }

// =================================================================================================
// Score pass
// =================================================================================================
constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kMaxChunk = 8192;                       // tokens per CTA at most (page table in smem)
constexpr int kMinChunk = 256;                        // tokens per CTA at least (bounds the stats)
constexpr int kMaxChunkPages = kMaxChunk / 16 + 2;
constexpr int kGroupChunk = 2048;                     // tokens per CTA of the group-score kernel

// L2 policies: K is streamed once (evict first); the group logits are read back by the next kernel
// (evict last, so they can stay in L2 while K streams past).
__device__ __forceinline__ uint64_t policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 ld_stream16(const void* p, uint64_t pol) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "l"(pol));
  return r;
}
__device__ __forceinline__ void st_hint(float* p, float v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(p), "f"(v), "l"(pol));
}

struct ScoreArgs {
  const void* q;
  const void* const* q_at;  // null, or device: the query's address, read at run time (graphs)
  int32_t q_f32;
  PagedKv kv;
  const int32_t* lengths;
  int32_t max_len;
  int32_t B, Hq, Hkv, G, ngroups;
  int32_t chunk, nchunks;
  int32_t sinks, local;
  float qmul;       // scale (per-head logits) or scale * log2(e) (group mode, base-2 logits)
  float* out;       // per-head: the scores; group: the logits z [B, Hkv, ngroups, max_len, GT]
  float* part_m;    // group: per-chunk max   [B * Hq, nchunks] (base 2)
  float* part_l;    // group: per-chunk sum of 2^(z - max)
  float* scores;    // group: the scores [B, Hkv, max_len]
};

// The dots of GT heads, each partial over this lane's 8 elements, summed across the TPR lanes of
// the row. Step s exchanges half of the remaining heads with the lane at distance TPR >> (s+1): the
// lane with that bit set keeps the upper half. The lane ends with head c / (TPR / GT).
template <int GT, int TPR>
__device__ __forceinline__ float head_reduce(float (&v)[GT], int c) {
  int off = TPR / 2;
#pragma unroll
  for (int n = GT; n > 1; n >>= 1) {
    const bool upper = (c & off) != 0;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = upper ? v[i] : v[i + n / 2];
      const float keep = upper ? v[i + n / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
    off >>= 1;
  }
#pragma unroll
  for (int o = TPR / GT / 2; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  return v[0];
}

// grid (nchunks, Hkv * ngroups, B), block kScoreThreads: U loads of 16 bytes in flight per lane
// while the lane scores its previous U rows. (A per-warp cp.async ring of 4 x 4 tiles, 3 CTAs per
// SM, measured slower: 120 vs 113 us.)
template <typename T, int D, int GT, bool GROUP>
__global__ void __launch_bounds__(kScoreThreads, 2) topk_logits_kernel(const ScoreArgs a) {
  constexpr int TPR = D / 8, RPP = 32 / TPR, U = GT >= 8 ? 4 : 8, WT = U * RPP;
  constexpr int R = TPR / GT;  // lanes holding the same head after head_reduce
  static_assert(TPR >= GT, "a row needs at least GT lanes");
  __shared__ const T* spage[kMaxChunkPages];
  __shared__ float red_m[kScoreWarps * RPP][GT];
  __shared__ float red_l[kScoreWarps * RPP][GT];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = lane % TPR, rsub = lane / TPR;
  const int kvh = int(blockIdx.y) / a.ngroups, qg = int(blockIdx.y) % a.ngroups, b = blockIdx.z;
  const int g0 = qg * GT;
  const int len = min(max(a.lengths[b], 0), a.max_len);
  const int t0 = int(blockIdx.x) * a.chunk;
  const int t1 = min(len, t0 + a.chunk);
  if (t0 >= t1) return;
  const int shift = a.kv.page_shift, P = a.kv.page_tokens;
  const int pg0 = t0 >> shift, npg = ((t1 - 1) >> shift) - pg0 + 1;
  for (int i = threadIdx.x; i < npg; i += kScoreThreads)
    spage[i] = static_cast<const T*>(a.kv.pages[int64_t(b) * a.kv.max_pages + pg0 + i]);

  float qr[GT][8];
  const void* const qbase = a.q_at ? *a.q_at : a.q;
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    if (g0 + g < a.G) {
      const int64_t qrow = int64_t(b) * a.Hq + int64_t(kvh) * a.G + g0 + g;
      if (a.q_f32) {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(qbase) + qrow * D + c * 8);
        const float4 x = __ldg(p), y = __ldg(p + 1);
        qr[g][0] = x.x; qr[g][1] = x.y; qr[g][2] = x.z; qr[g][3] = x.w;
        qr[g][4] = y.x; qr[g][5] = y.y; qr[g][6] = y.z; qr[g][7] = y.w;
      } else {
        Cvt<T>::f32x8(__ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(qbase) + qrow * D + c * 8)), qr[g]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[g][e] *= a.qmul;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
    }
  }
  __syncthreads();

  const uint64_t pol_k = policy_evict_first();
  const uint64_t pol_z = policy_evict_last();
  const KvStrides ks = kv_strides(a.kv, a.Hkv, D);
  const int64_t hoff = int64_t(kvh) * ks.head + c * 8;  // head kvh's first K row in a page, this lane's column
  const int64_t tstride = ks.token;
  const int hsel = c / R;
  const bool writer = (c % R) == 0 && g0 + hsel < a.G;
  const int local_from = len - a.local;
  float run_m = -INFINITY, run_l = 0.f;
  float* zrow = nullptr;
  float* orow = nullptr;
  if (GROUP) zrow = a.out + ((int64_t(b) * a.Hkv + kvh) * a.ngroups + qg) * int64_t(a.max_len) * GT + hsel;
  else orow = a.out + (int64_t(b) * a.Hq + int64_t(kvh) * a.G + g0 + hsel) * int64_t(a.max_len);

  auto row_ptr = [&](int t) -> const T* { return spage[(t >> shift) - pg0] + hoff + int64_t(t & (P - 1)) * tstride; };
  // Two tiles of U rows per lane: the next tile's loads are in flight while this one is scored.
  uint4 u[U], un[U];
  auto load_tile = [&](int tb, uint4 (&dst)[U]) {
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int t = tb + i * RPP + rsub;
      dst[i] = t < t1 ? ld_stream16(row_ptr(t), pol_k) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  if (t0 + warp * WT < t1) load_tile(t0 + warp * WT, u);
  for (int tb = t0 + warp * WT; tb < t1; tb += kScoreWarps * WT) {
    if (tb + kScoreWarps * WT < t1) load_tile(tb + kScoreWarps * WT, un);
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int t = tb + i * RPP + rsub;
      float kf[8];
      Cvt<T>::f32x8(u[i], kf);
      float acc[GT];
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(qr[g][e], kf[e], s);
        acc[g] = s;
      }
      const float s = head_reduce<GT, TPR>(acc, c);
      if (writer && t < t1) {
        if constexpr (GROUP) {
          st_hint(zrow + int64_t(t) * GT, s, pol_z);
          if (s > run_m) {
            run_l = run_l * exp2f(run_m - s) + 1.f;
            run_m = s;
          } else {
            run_l += exp2f(s - run_m);
          }
        } else {
          const bool forced = t < a.sinks || t >= local_from;
          orow[t] = forced ? INFINITY : s;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < U; ++i) u[i] = un[i];
  }
  // The group-score kernel (a programmatic dependent launch) may start its prologue now; it waits
  // for this whole grid's results before reading them.
  pdl_launch_dependents();
  if constexpr (GROUP) {
    const int slot = warp * RPP + rsub;
    if (c % R == 0) {
      red_m[slot][hsel] = run_m;
      red_l[slot][hsel] = run_l;
    }
    __syncthreads();
    const int g = threadIdx.x;
    if (g < GT && g0 + g < a.G) {
      float M = -INFINITY;
      for (int s = 0; s < kScoreWarps * RPP; ++s) M = fmaxf(M, red_m[s][g]);
      float L = 0.f;
      if (M != -INFINITY)
        for (int s = 0; s < kScoreWarps * RPP; ++s)
          if (red_m[s][g] != -INFINITY) L += red_l[s][g] * exp2f(red_m[s][g] - M);
      const int64_t hrow = int64_t(b) * a.Hq + int64_t(kvh) * a.G + g0 + g;
      a.part_m[hrow * a.nchunks + blockIdx.x] = M;
      a.part_l[hrow * a.nchunks + blockIdx.x] = L;
    }
  }
}

// The group mode's logits on the tensor cores (d <= 128): the dense decode's tensor-core kernel
// (cuda_attention.cu) without its values. Each warp streams tiles of 16 keys through a private
// cp.async ring (STAGES deep, rows swizzled in shared memory), and S = q K^T comes from m16n8k16
// MMAs with the group's query heads as the rows (8 per CTA, zero past the group; q pre-scaled into
// base 2 and split into three parts exact in T). Lane (qr, qc) ends a tile
// with keys 2qc, 2qc + 1, 8 + 2qc, 9 + 2qc of head qr: written as the CUDA-core kernel writes them
// (z [.., t, ZT], ZT the group tile of the workspace layout), with the chunk's (max, sum) per head.
// The CUDA-core kernel read 268 MB of keys at 2.7 TB/s on an H200 (98 us at 128K, 8 KV heads).
constexpr int kMmaScoreWarps = 4, kMmaScoreStages = 3;
template <typename T, int D, int ZT>
__global__ void __launch_bounds__(kMmaScoreWarps * 32) topk_logits_mma_kernel(const ScoreArgs a) {
  constexpr int NW = kMmaScoreWarps, STAGES = kMmaScoreStages;
  constexpr int R = 16;          // keys per warp tile (<= P: a tile is in one page)
  constexpr int TILE = R * D;    // elements of one K tile
  constexpr int CPR = D / 8;     // 16-byte chunks per row
  constexpr int RPP = 32 / CPR;  // rows per copy pass
  constexpr int PASSES = R / RPP;
  constexpr int KS = D / 16;     // k-steps of QK^T
  static_assert(D <= 128 && ZT <= 8, "tensor-core logits: d <= 128, at most 8 heads a CTA");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float red_m[NW][8], red_l[NW][8];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int qr_ = lane >> 2, qc = lane & 3;
  const int kvh = int(blockIdx.y) / a.ngroups, qg = int(blockIdx.y) % a.ngroups, b = blockIdx.z;
  const int g0 = qg * ZT;
  const int len = min(max(a.lengths[b], 0), a.max_len);
  const int t0 = int(blockIdx.x) * a.chunk;
  const int t1 = min(len, t0 + a.chunk);
  if (t0 >= t1) return;

  // q in three parts (hi + mid + lo, each exact in T): with bf16 the products with the keys are
  // then as exact as the CUDA-core kernel's fp32 dots (two parts leave about 2^-17 of q, enough to
  // move a near-tie across the top-k's threshold). With fp16 the lower parts of a small q fall into
  // fp16's subnormals (about 22 bits of q kept), and q * scale * log2(e) must stay within fp16's
  // range (65504), as in the dense decode's tensor-core kernel.
  uint32_t qa_hi[KS][2], qa_mid[KS][2], qa_lo[KS][2];
  const bool live = qr_ < ZT && g0 + qr_ < a.G;
  {
    const int64_t row = int64_t(b) * a.Hq + int64_t(kvh) * a.G + g0 + min(qr_, a.G - 1 - g0);
    const void* const qbase = a.q_at ? *a.q_at : a.q;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int d0 = ks * 16 + h * 8 + qc * 2;
        float x0, x1;
        if (a.q_f32) {
          const float2 v = __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(qbase) + row * D + d0));
          x0 = v.x;
          x1 = v.y;
        } else {
          const T* qp = static_cast<const T*>(qbase) + row * D + d0;
          x0 = float(qp[0]);
          x1 = float(qp[1]);
        }
        x0 = live ? x0 * a.qmul : 0.f;
        x1 = live ? x1 * a.qmul : 0.f;
        const float h0 = Mma<T>::round(x0), h1 = Mma<T>::round(x1);
        const float m0 = Mma<T>::round(x0 - h0), m1 = Mma<T>::round(x1 - h1);
        qa_hi[ks][h] = Mma<T>::pack(h0, h1);
        qa_mid[ks][h] = Mma<T>::pack(m0, m1);
        qa_lo[ks][h] = Mma<T>::pack(x0 - h0 - m0, x1 - h1 - m1);
      }
  }

  const KvStrides kst = kv_strides(a.kv, a.Hkv, D);
  const int64_t hoff = int64_t(kvh) * kst.head;
  const int shift = a.kv.page_shift, pmask = a.kv.page_tokens - 1;
  const void* const* pages = a.kv.pages + int64_t(b) * a.kv.max_pages;
  const uint64_t pol_z = policy_evict_last();
  const int ntiles = (t1 - t0 + R - 1) / R;
  const int my_tiles = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  auto tile_base = [&](int j) { return t0 + (warp + j * NW) * R; };
  T* wsm = reinterpret_cast<T*>(smem_raw) + warp * STAGES * TILE;
  const int cc = lane % CPR, r0 = lane / CPR;
  auto issue = [&](int j, int stage) {
    const int tb = tile_base(j);
    const T* pg = static_cast<const T*>(pages[tb >> shift]) + hoff;
    T* ks = wsm + stage * TILE;
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int row = p * RPP + r0, t = tb + row;
      const bool ok = t < t1;
      const T* sp = pg + int64_t((ok ? t : tb) & pmask) * kst.token + cc * 8;
      cp_async16(ks + row * D + ((cc ^ (row & 7)) * 8), sp, ok);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < my_tiles) issue(s, s);
    cp_async_commit();
  }

  float* zrow = a.out + ((int64_t(b) * a.Hkv + kvh) * a.ngroups + qg) * int64_t(a.max_len) * ZT + qr_;
  float run_m = -INFINITY, run_l = 0.f;
  for (int j = 0; j < my_tiles; ++j) {
    __syncwarp();  // every lane is done reading the stage refilled below
    if (j + STAGES - 1 < my_tiles) issue(j + STAGES - 1, (j + STAGES - 1) % STAGES);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncwarp();  // other lanes' copies of tile j are visible to this lane's ldmatrix
    const T* ks = wsm + (j % STAGES) * TILE;
    float sc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk) {
        const int row = nb * 8 + (lane & 7);
        const int chunk = 4 * kk + (lane >> 3);
        uint32_t x0, x1, x2, x3;
        ldsm_x4(ks + row * D + ((chunk ^ (lane & 7)) * 8), x0, x1, x2, x3);
        Mma<T>::mma(sc[nb], qa_lo[2 * kk][0], qa_lo[2 * kk][1], x0, x1);  // smallest parts first
        Mma<T>::mma(sc[nb], qa_lo[2 * kk + 1][0], qa_lo[2 * kk + 1][1], x2, x3);
        Mma<T>::mma(sc[nb], qa_mid[2 * kk][0], qa_mid[2 * kk][1], x0, x1);
        Mma<T>::mma(sc[nb], qa_mid[2 * kk + 1][0], qa_mid[2 * kk + 1][1], x2, x3);
        Mma<T>::mma(sc[nb], qa_hi[2 * kk][0], qa_hi[2 * kk][1], x0, x1);
        Mma<T>::mma(sc[nb], qa_hi[2 * kk + 1][0], qa_hi[2 * kk + 1][1], x2, x3);
      }
    if (live) {
      const int tb = tile_base(j);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = tb + (i >> 1) * 8 + qc * 2 + (i & 1);
        if (t < t1) {
          const float s = sc[i >> 1][i & 1];
          st_hint(zrow + int64_t(t) * ZT, s, pol_z);
          if (s > run_m) {
            run_l = run_l * exp2f(run_m - s) + 1.f;
            run_m = s;
          } else {
            run_l += exp2f(s - run_m);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();  // the group-score kernel's prologue may start (it waits for this grid)
  // Each head's (max, sum) over the quad's lanes, then the warps.
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, run_m, o), l2 = __shfl_xor_sync(0xffffffffu, run_l, o);
    const float M = fmaxf(run_m, m2);
    float L = 0.f;
    if (M != -INFINITY) {
      if (run_m != -INFINITY) L += run_l * exp2f(run_m - M);
      if (m2 != -INFINITY) L += l2 * exp2f(m2 - M);
    }
    run_m = M;
    run_l = L;
  }
  if (qc == 0) {
    red_m[warp][qr_] = run_m;
    red_l[warp][qr_] = run_l;
  }
  __syncthreads();
  const int g = threadIdx.x;
  if (g < ZT && g0 + g < a.G) {
    float M = -INFINITY;
    for (int w = 0; w < NW; ++w) M = fmaxf(M, red_m[w][g]);
    float L = 0.f;
    if (M != -INFINITY)
      for (int w = 0; w < NW; ++w)
        if (red_m[w][g] != -INFINITY) L += red_l[w][g] * exp2f(red_m[w][g] - M);
    const int64_t hrow = int64_t(b) * a.Hq + int64_t(kvh) * a.G + g0 + g;
    a.part_m[hrow * a.nchunks + blockIdx.x] = M;
    a.part_l[hrow * a.nchunks + blockIdx.x] = L;
  }
}

// Loads the GT logits of one token (16-byte aligned when GT >= 4).
template <int GT>
__device__ __forceinline__ void load_z(const float* p, float (&z)[GT]) {
  if constexpr (GT >= 4) {
#pragma unroll
    for (int i = 0; i < GT / 4; ++i) {
      const float4 v = __ldcs(reinterpret_cast<const float4*>(p) + i);
      z[4 * i] = v.x; z[4 * i + 1] = v.y; z[4 * i + 2] = v.z; z[4 * i + 3] = v.w;
    }
  } else if constexpr (GT == 2) {
    const float2 v = __ldcs(reinterpret_cast<const float2*>(p));
    z[0] = v.x;
    z[1] = v.y;
  } else {
    z[0] = __ldcs(p);
  }
}

// Query head hrow's base-2 LSE over the nval chunks of the logits kernel, from their (max, sum)
// statistics (+inf when the head saw no key, so every probability comes out 0); one warp, every
// lane gets the result.
__device__ __forceinline__ float head_lse2(const ScoreArgs& a, int64_t hrow, int nval, int lane) {
  float M = -INFINITY, L = 0.f;
  for (int j0 = 0; j0 < nval; j0 += 32 * 8) {  // 8 statistics per lane loaded at once
    float pm[8], pl[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int j = j0 + q * 32 + lane;
      pm[q] = j < nval ? a.part_m[hrow * a.nchunks + j] : -INFINITY;
      pl[q] = j < nval ? a.part_l[hrow * a.nchunks + j] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float m = pm[q], l = pl[q];
      if (m > M) {
        L = L * exp2f(M - m) + l;
        M = m;
      } else if (m != -INFINITY) {
        L += l * exp2f(m - M);
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, M, o), l2 = __shfl_xor_sync(0xffffffffu, L, o);
    const float nm = fmaxf(M, m2);
    float nl = 0.f;
    if (nm != -INFINITY) {
      if (M != -INFINITY) nl += L * exp2f(M - nm);
      if (m2 != -INFINITY) nl += l2 * exp2f(m2 - nm);
    }
    M = nm;
    L = nl;
  }
  return L > 0.f ? M + log2f(L) : INFINITY;
}

// grid (ceil(max_len / kGroupChunk), Hkv, B), block kScoreThreads, dynamic smem G floats:
// each query head's base-2 LSE from the chunk statistics, then s_t = sum_g 2^(z_gt - lse_g).
// Launched as a programmatic dependent of the logits kernel: everything before pdl_wait
// overlaps that kernel's tail. Each thread loads all its logits before the LSE prologue, so the
// two round trips overlap.
template <int GT>
__global__ void __launch_bounds__(kScoreThreads) topk_group_scores_kernel(const ScoreArgs a) {
  constexpr int TPT = kGroupChunk / kScoreThreads;  // tokens per thread
  extern __shared__ float slse[];
  const int kvh = blockIdx.y, b = blockIdx.z;
  pdl_wait();
  pdl_launch_dependents();  // e.g. topk_rows: it waits for this grid
  const int len = min(max(a.lengths[b], 0), a.max_len);
  const int t0 = int(blockIdx.x) * kGroupChunk;
  if (t0 >= len) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* __restrict__ zb = a.out + (int64_t(b) * a.Hkv + kvh) * a.ngroups * int64_t(a.max_len) * GT;
  float z[TPT][GT];
  if (a.ngroups == 1) {
#pragma unroll
    for (int j = 0; j < TPT; ++j) {
      const int t = t0 + j * kScoreThreads + threadIdx.x;
      if (t < len) load_z<GT>(zb + int64_t(t) * GT, z[j]);
    }
  }
  const int nval = int(ceil_div(len, a.chunk));  // chunks of the logits kernel that held tokens
  for (int g = warp; g < a.G; g += kScoreWarps) {
    const float l2 = head_lse2(a, int64_t(b) * a.Hq + int64_t(kvh) * a.G + g, nval, lane);
    if (lane == 0) slse[g] = l2;
  }
  __syncthreads();
  const int local_from = len - a.local;
  float* __restrict__ srow = a.scores + (int64_t(b) * a.Hkv + kvh) * int64_t(a.max_len);
#pragma unroll
  for (int j = 0; j < TPT; ++j) {
    const int t = t0 + j * kScoreThreads + threadIdx.x;
    if (t >= len) break;
    float s = 0.f;
    if (a.ngroups == 1) {
#pragma unroll
      for (int i = 0; i < GT; ++i)
        if (i < a.G) s += exp2f(z[j][i] - slse[i]);
    } else {
      for (int qg = 0; qg < a.ngroups; ++qg) {
        float zz[GT];
        load_z<GT>(zb + (int64_t(qg) * a.max_len + t) * GT, zz);
#pragma unroll
        for (int i = 0; i < GT; ++i)
          if (qg * GT + i < a.G) s += exp2f(zz[i] - slse[qg * GT + i]);
      }
    }
    const bool forced = t < a.sinks || t >= local_from;
    srow[t] = forced ? INFINITY : s;
  }
}

// The group mode's last two steps in one cluster kernel, for groups of at most 8 heads (one group
// tile, GT = the logits' stride) and rows long enough for topk_rows' cluster path: grid (rows * C),
// cluster C, block kRowsThreads, dynamic shared memory the key cache of one slice (ra: the top-k's
// rows, row r = b * Hkv + kvh, lengths and per-row k as topk_rows takes them). Each CTA computes
// the group's LSEs from the chunk statistics (head_lse2, as topk_group_scores_kernel), turns the
// logits of its slice of the row (select_slice) into the summed probabilities with the same
// arithmetic (forced keys +inf) and keeps them in the key cache as ord_key keys; the cluster then
// selects over the filled slices (rows_select with FILLED). So the indices are those of
// topk_group_scores_kernel followed by topk_rows, and the scores never reach global memory.
// Launched as a programmatic dependent of the logits kernel.
template <int GT>
__global__ void __launch_bounds__(kRowsThreads, 1) topk_group_select_kernel(const ScoreArgs a, const RowsArgs ra) {
  extern __shared__ uint4 dyn_smem[];
  __shared__ float slse[GT];
  uint32_t* cache = reinterpret_cast<uint32_t*>(dyn_smem);
  cg::cluster_group cl = cg::this_cluster();
  const int row = int(blockIdx.x / cl.num_blocks());
  const int b = row / a.Hkv, kvh = row % a.Hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  pdl_wait();  // the logits and their statistics are complete past this point
  const int len = min(max(a.lengths[b], 0), a.max_len);
  const int nval = int(ceil_div(len, a.chunk));
  if (warp < a.G) {
    const float l2 = head_lse2(a, int64_t(b) * a.Hq + int64_t(kvh) * a.G + warp, nval, lane);
    if (lane == 0) slse[warp] = l2;
  }
  __syncthreads();
  int64_t beg, end;
  select_slice(row_len_of(ra, row), int(cl.num_blocks()), int(cl.block_rank()), &beg, &end);
  const float* __restrict__ zb = a.out + (int64_t(b) * a.Hkv + kvh) * int64_t(a.max_len) * GT;
  const int local_from = len - a.local;
  constexpr int U = 4;  // tokens per thread whose logits are loaded at once
  for (int64_t t0 = beg + threadIdx.x; t0 < end; t0 += int64_t(U) * kRowsThreads) {
    float z[U][GT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = t0 + int64_t(u) * kRowsThreads;
      if (t < end) load_z<GT>(zb + t * GT, z[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = t0 + int64_t(u) * kRowsThreads;
      if (t >= end) break;
      float sc = 0.f;
#pragma unroll
      for (int i = 0; i < GT; ++i)
        if (i < a.G) sc += exp2f(z[u][i] - slse[i]);
      const bool forced = t < a.sinks || t >= local_from;
      cache[t - beg] = ord_key(forced ? INFINITY : sc, ra.absent);
    }
  }
  __syncthreads();
  rows_select<false, true, true>(ra, cl, row, cache, -1);
}

int group_tile(int G) { return G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8; }

// Logits-kernel chunking: about 512 KB of K per CTA, the CTA count rounded down to whole waves.
struct ScorePlan {
  int chunk, nchunks;
};
int score_warp_tile(int D, int GT) { return (GT >= 8 ? 4 : 8) * (32 / (D / 8)); }
ScorePlan score_plan(int64_t rows, int max_len, int D, int GT, int sms, int occ) {
  const int wt = score_warp_tile(D, GT);
  const int64_t wave = int64_t(std::max(1, sms)) * std::max(1, occ);
  const int64_t ideal = int64_t(2048) * 128 / D;  // tokens of 512 KB
  const int64_t total0 = rows * ceil_div(max_len, ideal);
  const int64_t waves = std::max<int64_t>(1, (total0 + wave / 2) / wave);
  const int64_t per_row = std::max<int64_t>(1, waves * wave / rows);  // CTAs <= waves * wave
  int64_t chunk = ceil_div(ceil_div(max_len, per_row), wt) * wt;
  chunk = std::min<int64_t>(std::max<int64_t>(chunk, kMinChunk), kMaxChunk);
  return {int(chunk), int(ceil_div(max_len, chunk))};
}

struct ScoreLayout {
  size_t z, part_m, part_l, total;
};
ScoreLayout score_layout(const AttnShape& s, int32_t max_len) {
  const int G = s.num_q_heads / s.num_kv_heads, GT = group_tile(G), ng = (G + GT - 1) / GT;
  const size_t maxchunks = size_t(ceil_div(std::max(max_len, 1), kMinChunk));
  ScoreLayout L{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off += align_up(bytes, 256);
    return o;
  };
  L.z = take(size_t(s.batch) * s.num_kv_heads * ng * size_t(max_len) * GT * 4);
  L.part_m = take(size_t(s.batch) * s.num_q_heads * maxchunks * 4);
  L.part_l = take(size_t(s.batch) * s.num_q_heads * maxchunks * 4);
  L.total = off;
  return L;
}

Status check_score_shape(const AttnShape& s) {
  if (s.batch < 1) return invalid("batch must be >= 1");
  if (s.num_kv_heads < 1) return invalid("num_kv_heads must be >= 1");
  if (s.num_q_heads < 1 || s.num_q_heads % s.num_kv_heads != 0)
    return invalid("num_q_heads must be a positive multiple of num_kv_heads");
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256)
    return unsupported("head_dim must be 64, 128 or 256");
  if (!std::isfinite(s.scale)) return invalid("scale must be finite");
  if (s.batch > 65535) return unsupported("batch must be <= 65535");
  return {};
}

// The second kernel of the group mode: each query head's LSE from the chunk statistics, then the
// summed probabilities (a programmatic dependent launch).
template <int GT>
Status launch_group_scores(const ScoreArgs& a, cudaStream_t st) {
  const size_t smem = size_t(a.G) * 4;
  if (smem > 48 * 1024) return unsupported("topk_scores: too many query heads per KV head");
  KVS_CUDA_TRY(launch_kernel(topk_group_scores_kernel<GT>,
                             dim3(unsigned(ceil_div(a.max_len, kGroupChunk)), unsigned(a.Hkv), unsigned(a.B)),
                             dim3(kScoreThreads), smem, st, /*pdl=*/true, 1, a),
               "topk_group_scores_kernel launch");
  KVS_LAUNCH_CHECK("topk_group_scores_kernel launch");
  return {};
}
Status launch_group_scores_gt(const ScoreArgs& a, int GT, cudaStream_t st) {
  switch (GT) {
    case 1: return launch_group_scores<1>(a, st);
    case 2: return launch_group_scores<2>(a, st);
    case 4: return launch_group_scores<4>(a, st);
    default: return launch_group_scores<8>(a, st);
  }
}

// Points the group mode's outputs at their workspace slots.
void set_group_outputs(ScoreArgs& a, const Workspace& ws, const ScoreLayout& L) {
  char* base = static_cast<char*>(ws.ptr);
  a.out = reinterpret_cast<float*>(base + L.z);
  a.part_m = reinterpret_cast<float*>(base + L.part_m);
  a.part_l = reinterpret_cast<float*>(base + L.part_l);
}

// The score pass's first kernel: the logits (group mode, then a.out, a.part_* and a.chunk,
// a.nchunks describe them) or the per-head scores.
// The group mode's tensor-core logits (topk_logits_mma_kernel), for d <= 128 and groups of 4 or 8
// heads: chunks a multiple of the CTA's 64-key round (at least kMinChunk, so the workspace's chunk
// statistics hold them), as many CTAs as fill the device a few times over.
template <typename T, int D, int GT>
Status launch_logits_mma(ScoreArgs& a, const Workspace& ws, const ScoreLayout& L, cudaStream_t st) {
  constexpr int kSmem = kMmaScoreWarps * kMmaScoreStages * 16 * D * int(sizeof(T));  // 48 KB at d 128
  int sms = 0;
  if (Status e = sm_count(&sms); !e.ok()) return e;
  static std::atomic<int> occ_cache{0};
  int occ = occ_cache.load(std::memory_order_relaxed);
  if (occ == 0) {  // (with the static reductions the CTA needs more than the default 48 KB; set on the
                   // device current at the first launch, as setup_occupancy does for the decode kernels)
    KVS_CUDA_TRY(cudaFuncSetAttribute(topk_logits_mma_kernel<T, D, GT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                 "cudaFuncSetAttribute(topk_logits_mma_kernel)");
    KVS_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, topk_logits_mma_kernel<T, D, GT>,
                                                               kMmaScoreWarps * 32, kSmem),
                 "cudaOccupancyMaxActiveBlocksPerMultiprocessor(topk_logits_mma_kernel)");
    occ = std::max(occ, 1);
    occ_cache.store(occ, std::memory_order_relaxed);
  }
  const int64_t rows = int64_t(a.B) * a.Hkv * a.ngroups;
  constexpr int kRound = 16 * kMmaScoreWarps;
  const int64_t wave = int64_t(sms) * occ;
  // About four waves of CTAs, each at least kMinChunk keys. (One wave of longer chunks, as the
  // dense decode runs, measured 518 against 416 us a step at 512K on an H200, and 134.6 then
  // 158.0 against 137.6 us at 128K in two calls: a wave that just fits is fragile.)
  const int64_t per_row = std::max<int64_t>(1, 4 * wave / rows);
  int64_t chunk = ceil_div(ceil_div(std::max(a.max_len, 1), per_row), kRound) * kRound;
  if (const int fc = g_force_chunk.load(std::memory_order_relaxed); fc > 0) chunk = ceil_div(fc, kRound) * kRound;
  chunk = std::min<int64_t>(std::max<int64_t>(chunk, kMinChunk), kMaxChunk);
  a.chunk = int(chunk);
  a.nchunks = int(ceil_div(a.max_len, chunk));
  set_group_outputs(a, ws, L);
  topk_logits_mma_kernel<T, D, GT>
      <<<dim3(unsigned(a.nchunks), unsigned(a.Hkv * a.ngroups), unsigned(a.B)), kMmaScoreWarps * 32, kSmem, st>>>(a);
  KVS_LAUNCH_CHECK("topk_logits_mma_kernel launch");
  return {};
}

template <typename T, int D, int GT>
Status launch_logits(ScoreArgs& a, bool per_head, const Workspace& ws, const ScoreLayout& L, cudaStream_t st) {
  if constexpr (D <= 128 && GT >= 4)
    if (!per_head && score_mma_enabled()) return launch_logits_mma<T, D, GT>(a, ws, L, st);
  int sms = 0, occ = 0;
  if (Status e = sm_count(&sms); !e.ok()) return e;
  auto kern = per_head ? topk_logits_kernel<T, D, GT, false> : topk_logits_kernel<T, D, GT, true>;
  // Asked once per kernel (the query costs host time on every step otherwise); 0 = not asked yet.
  static std::atomic<int> occ_cache[2];
  occ = occ_cache[per_head].load(std::memory_order_relaxed);
  if (occ == 0) {
    KVS_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, kScoreThreads, 0),
                 "cudaOccupancyMaxActiveBlocksPerMultiprocessor(topk_logits_kernel)");
    occ_cache[per_head].store(std::max(occ, 1), std::memory_order_relaxed);
  }
  const int64_t rows = int64_t(a.B) * a.Hkv * a.ngroups;
  const int wt = score_warp_tile(D, GT);
  ScorePlan pl = score_plan(rows, a.max_len, D, GT, sms, occ);
  if (const int fc = g_force_chunk.load(std::memory_order_relaxed); fc > 0) {
    const int64_t c = std::min<int64_t>(std::max<int64_t>(ceil_div(fc, wt) * wt, kMinChunk), kMaxChunk);
    pl = {int(c), int(ceil_div(a.max_len, c))};
  }
  a.chunk = pl.chunk;
  a.nchunks = pl.nchunks;
  if (!per_head) set_group_outputs(a, ws, L);
  kern<<<dim3(unsigned(pl.nchunks), unsigned(a.Hkv * a.ngroups), unsigned(a.B)), kScoreThreads, 0, st>>>(a);
  KVS_LAUNCH_CHECK("topk_logits_kernel launch");
  return {};
}

template <typename T>
Status dispatch_logits(ScoreArgs& a, int D, int GT, bool per_head, const Workspace& ws, const ScoreLayout& L,
                       cudaStream_t st) {
#define KVS_CASE(D_, GT_) \
  if (D == D_ && GT == GT_) return launch_logits<T, D_, GT_>(a, per_head, ws, L, st);
  KVS_CASE(64, 1) KVS_CASE(64, 2) KVS_CASE(64, 4) KVS_CASE(64, 8)
  KVS_CASE(128, 1) KVS_CASE(128, 2) KVS_CASE(128, 4) KVS_CASE(128, 8)
  KVS_CASE(256, 1) KVS_CASE(256, 2) KVS_CASE(256, 4) KVS_CASE(256, 8)
#undef KVS_CASE
  return unsupported("head_dim must be 64, 128 or 256");
}

// ---- top-k launch planning ------------------------------------------------------------------------
using RowsKernel = void (*)(const RowsArgs);
RowsKernel rows_kernel(int variant) {
  switch (variant) {
    case 0: return topk_rows_kernel<false, false>;
    case 1: return topk_rows_kernel<false, true>;
    case 2: return topk_rows_kernel<true, false>;
    default: return topk_rows_kernel<true, true>;
  }
}

// Clusters of a kernel variant that fit on the device at once, per (device, variant, cluster size,
// shared memory rounded up to 16 KB): asked once (attributes set then), then read from here.
ClusterOccupancy g_occupancy[kRowsVariants];

Status cluster_occupancy(int dev, int variant, int ci, size_t smem, int* out) {
  *out = g_occupancy[variant].clusters(rows_kernel(variant), dev, ci, smem, kRowsThreads, kCacheBytesMax);
  if (*out < 0) return unsupported("topk_rows: the device refused the cluster kernel's attributes");
  return {};
}

// One CTA per row (topk_small_kernel), KPT = the fewest keys per thread that hold max_len; a
// programmatic dependent launch like the cluster kernel's.
Status launch_small(const RowsArgs& a, int rows, bool vec, cudaStream_t st) {
  const int need = int(ceil_div(std::max(a.max_len, 1), kSmallThreads));
  const int kpt = need <= 4 ? 4 : need <= 8 ? 8 : 16;
  RowsKernel kern = nullptr;
  switch (kpt) {
    case 4: kern = vec ? topk_small_kernel<4, true> : topk_small_kernel<4, false>; break;
    case 8: kern = vec ? topk_small_kernel<8, true> : topk_small_kernel<8, false>; break;
    default: kern = vec ? topk_small_kernel<16, true> : topk_small_kernel<16, false>; break;
  }
  KVS_CUDA_TRY(launch_kernel(kern, dim3(unsigned(rows)), dim3(kSmallThreads), 0, st, /*pdl=*/true, 1, a),
               "topk_small_kernel launch");
  KVS_LAUNCH_CHECK("topk_small_kernel launch");
  return {};
}

}  // namespace

// ---- public entry points -----------------------------------------------------------------------
size_t topk_rows_workspace_bytes(int32_t rows, int32_t max_len, int32_t k) noexcept {
  (void)rows;
  (void)max_len;
  (void)k;
  return 0;
}

Status topk_rows(const float* scores, int64_t row_stride, const int32_t* lengths, int32_t rows,
                 int32_t max_len, int32_t k, int32_t* out_idx, int32_t* out_cnt,
                 const Workspace& ws, void* stream, const int32_t* row_k, bool neg_zero_absent) noexcept {
  (void)ws;
  if (rows < 1) return invalid("topk_rows: rows must be >= 1");
  if (k < 0) return invalid("topk_rows: k must be >= 0");
  if (max_len < 0) return invalid("topk_rows: max_len must be >= 0");
  if (rows > 1 && row_stride < max_len) return invalid("topk_rows: row_stride must be >= max_len");
  if (row_stride < 0) return invalid("topk_rows: row_stride must be >= 0");
  if (!out_idx || (max_len > 0 && !scores)) return invalid("topk_rows: null pointer");
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  int dev = 0;
  KVS_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
  const bool vec = reinterpret_cast<uintptr_t>(scores) % 16 == 0 && row_stride % 4 == 0;

  const int force = g_force_cluster.load(std::memory_order_relaxed);
  RowsArgs a{};
  a.scores = scores;
  a.stride = row_stride;
  a.lengths = lengths;
  a.max_len = max_len;
  a.k = k;
  a.row_k = row_k;
  a.absent = neg_zero_absent;
  a.out_idx = out_idx;
  a.out_cnt = out_cnt;
  if (force <= 0 && max_len <= kSmallMaxLen) {
    g_last_cluster.store(0, std::memory_order_relaxed);
    return launch_small(a, rows, vec, st);
  }

  // Cluster size: the fewest waves of clusters times the slice each CTA reads (a key cache in
  // shared memory makes later passes cheap), plus a per-pass synchronisation cost growing with C.
  int best_ci = -1, best_var = 0;
  size_t best_smem = 0;
  int64_t best_cost = 0;
  for (int ci = 0; ci < 5; ++ci) {
    const int C = 1 << ci;
    const int64_t chunk = (ceil_div(std::max(max_len, 1), C) + 3) & ~int64_t(3);
    if (force > 0 && C != force) continue;
    if (force <= 0 && C > 1 && chunk < 1024) break;  // slices too small to be worth a cluster barrier
    const bool cache = chunk * 4 <= kCacheBytesMax;
    const size_t smem = cache ? size_t(chunk) * 4 : 0;
    const int variant = (vec ? 2 : 0) + (cache ? 1 : 0);
    int nclusters = 0;
    Status e = cluster_occupancy(dev, variant, ci, smem, &nclusters);
    if (!e.ok()) return e;
    if (nclusters <= 0) continue;
    const int64_t waves = ceil_div(rows, nclusters);
    const int64_t cost = waves * (chunk * (cache ? 1 : 4) + 4096 + 512 * C);
    if (best_ci < 0 || cost < best_cost) {
      best_ci = ci, best_var = variant, best_smem = smem, best_cost = cost;
    }
  }
  if (best_ci < 0) return unsupported("topk_rows: no cluster configuration fits this device");
  const int C = 1 << best_ci;
  g_last_cluster.store(C, std::memory_order_relaxed);
  if (int64_t(rows) * C > 0x7fffffffLL) return unsupported("topk_rows: too many rows");
  RowsKernel kern = rows_kernel(best_var);  // attributes set by cluster_occupancy
  KVS_CUDA_TRY(launch_kernel(kern, dim3(unsigned(int64_t(rows) * C)), dim3(kRowsThreads), best_smem, st, /*pdl=*/true,
                             C, a),
               "topk_rows_kernel launch");
  KVS_LAUNCH_CHECK("topk_rows_kernel launch");
  return {};
}

size_t topk_scores_workspace_bytes(const AttnShape& shape, int32_t max_length) noexcept {
  if (!check_score_shape(shape).ok() || max_length <= 0) return 0;
  return score_layout(shape, max_length).total;
}

namespace {
// topk_scores' argument checks and its kernels' arguments (everything but the workspace layout's
// pointers and the chunking, which the logits launch sets).
Status prepare_scores(const AttnShape& s, const Query& q, const PagedKv& kv, Scalar kv_dtype, const int32_t* lengths,
                      int32_t max_length, bool per_query_head, int32_t sinks, int32_t local, float* scores,
                      const Workspace& ws, ScoreArgs* out, int* GT, ScoreLayout* L) {
  Status e = check_score_shape(s);
  if (!e.ok()) return e;
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("KV dtype must be BF16 or F16");
  if (q.dtype != Scalar::F32 && q.dtype != kv_dtype) return invalid("query dtype must be F32 or the KV dtype");
  if (max_length < 0 || max_length > 0x7fffffff - kMaxChunk) return invalid("max_length out of range");
  if (sinks < 0 || local < 0) return invalid("sinks and local must be >= 0");
  if (max_length == 0) return {};
  if ((!q.data && !q.at) || !kv.pages || !lengths || !scores) return invalid("topk_scores: null pointer");
  if (reinterpret_cast<uintptr_t>(q.data) % 16 != 0) return invalid("q must be 16-byte aligned");
  const int32_t P = kv.page_tokens;
  if (P < 16 || P > 1024 || (P & (P - 1)) != 0 || kv.page_shift < 4 || kv.page_shift > 10 ||
      (1 << kv.page_shift) != P)
    return invalid("page_tokens must be a power of two in [16, 1024] and page_shift its log2");
  if (int64_t(kv.max_pages) * P < max_length) return invalid("max_length exceeds max_pages * page_tokens");
  const int G = s.num_q_heads / s.num_kv_heads, ng = (G + group_tile(G) - 1) / group_tile(G);
  *GT = group_tile(G);
  if (int64_t(s.num_kv_heads) * ng > 65535) return unsupported("too many KV heads x query groups");
  *L = score_layout(s, max_length);
  if (!per_query_head && (!ws.ptr || ws.bytes < L->total))
    return invalid("workspace too small (ask topk_scores_workspace_bytes)");

  ScoreArgs& a = *out;
  a = ScoreArgs{};
  a.q = q.data;
  a.q_at = q.at;
  a.q_f32 = q.dtype == Scalar::F32;
  a.kv = kv;
  a.lengths = lengths;
  a.max_len = max_length;
  a.B = s.batch;
  a.Hq = s.num_q_heads;
  a.Hkv = s.num_kv_heads;
  a.G = G;
  a.ngroups = ng;
  a.sinks = sinks;
  a.local = local;
  a.qmul = per_query_head ? s.scale : s.scale * kLog2e;
  a.out = scores;
  a.scores = scores;
  return {};
}

Status launch_logits_of(ScoreArgs& a, Scalar kv_dtype, int D, int GT, bool per_head, const Workspace& ws,
                        const ScoreLayout& L, cudaStream_t st) {
  return kv_dtype == Scalar::BF16 ? dispatch_logits<__nv_bfloat16>(a, D, GT, per_head, ws, L, st)
                                  : dispatch_logits<__half>(a, D, GT, per_head, ws, L, st);
}

// The fused select (topk_group_select_kernel): off with KVS_TOPK_FUSED=0 (environment, read once;
// a benchmark knob).
std::atomic<int> g_fused{-1};
bool fused_enabled() { return env_flag(g_fused, "KVS_TOPK_FUSED"); }

ClusterOccupancy g_fused_occupancy[4];  // per GT: 1, 2, 4, 8
using FusedKernel = void (*)(const ScoreArgs, const RowsArgs);
FusedKernel fused_kernel(int GT) {
  switch (GT) {
    case 1: return topk_group_select_kernel<1>;
    case 2: return topk_group_select_kernel<2>;
    case 4: return topk_group_select_kernel<4>;
    default: return topk_group_select_kernel<8>;
  }
}
int gt_index(int GT) { return GT == 1 ? 0 : GT == 2 ? 1 : GT == 4 ? 2 : 3; }

// The cluster size of the fused select: topk_rows' cost model over the sizes whose slices fit the
// key cache (the fused kernel has no other place for the keys); 0 when none fits.
void fused_plan(int dev, int GT, int64_t rows, int max_len, int* C_out, size_t* smem_out) {
  *C_out = 0;
  int64_t best_cost = 0;
  const int force = g_force_cluster.load(std::memory_order_relaxed);
  for (int ci = 0; ci < 5; ++ci) {
    const int C = 1 << ci;
    if (force > 0 && C != force) continue;
    const int64_t chunk = (ceil_div(std::max(max_len, 1), C) + 3) & ~int64_t(3);
    if (force <= 0 && C > 1 && chunk < 1024) break;
    if (chunk * 4 > kCacheBytesMax) continue;
    const size_t smem = size_t(chunk) * 4;
    const int n = g_fused_occupancy[gt_index(GT)].clusters(fused_kernel(GT), dev, ci, smem, kRowsThreads, kCacheBytesMax);
    if (n <= 0) continue;  // that size does not fit (or the device refused the attributes): unfused
    const int64_t cost = ceil_div(rows, n) * (chunk + 4096 + 512 * C);
    if (*C_out == 0 || cost < best_cost) {
      *C_out = C;
      *smem_out = smem;
      best_cost = cost;
    }
  }
}
}  // namespace

Status topk_scores(const AttnShape& s, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                   const int32_t* lengths, int32_t max_length, bool per_query_head,
                   int32_t sinks, int32_t local, float* scores, const Workspace& ws,
                   void* stream) noexcept {
  ScoreArgs a{};
  ScoreLayout L{};
  int GT = 1;
  Status e = prepare_scores(s, q, kv, kv_dtype, lengths, max_length, per_query_head, sinks, local, scores, ws, &a, &GT, &L);
  if (!e.ok() || max_length == 0) return e;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  e = launch_logits_of(a, kv_dtype, s.head_dim, GT, per_query_head, ws, L, st);
  if (!e.ok() || per_query_head) return e;
  return launch_group_scores_gt(a, GT, st);
}

Status topk_group_select(const AttnShape& s, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                         const int32_t* lengths, int32_t max_length, int32_t sinks, int32_t local,
                         const int32_t* row_len, const int32_t* row_k, int32_t k, float* scores,
                         int32_t* out_idx, int32_t* out_cnt, const Workspace& ws, void* stream) noexcept {
  if (k < 0) return invalid("topk_group_select: k must be >= 0");
  if (!out_idx) return invalid("topk_group_select: null pointer");
  ScoreArgs a{};
  ScoreLayout L{};
  int GT = 1;
  Status e = prepare_scores(s, q, kv, kv_dtype, lengths, max_length, false, sinks, local, scores, ws, &a, &GT, &L);
  if (!e.ok()) return e;
  const int64_t rows = int64_t(s.batch) * s.num_kv_heads;
  if (rows > 0x7fffffffLL) return unsupported("topk_group_select: too many rows");
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  int C = 0;
  size_t smem = 0;
  if (max_length > kSmallMaxLen && a.ngroups == 1 && fused_enabled()) {
    int dev = 0;
    KVS_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
    fused_plan(dev, GT, rows, max_length, &C, &smem);
    if (rows * C > 0x7fffffffLL) C = 0;  // more CTAs than one launch takes: unfused
  }
  if (C == 0) {  // the scores row in global memory, then topk_rows
    if (max_length > 0) {
      e = launch_logits_of(a, kv_dtype, s.head_dim, GT, false, ws, L, st);
      if (e.ok()) e = launch_group_scores_gt(a, GT, st);
      if (!e.ok()) return e;
    }
    return topk_rows(scores, max_length, row_len, int32_t(rows), max_length, k, out_idx, out_cnt, {}, stream, row_k);
  }
  e = launch_logits_of(a, kv_dtype, s.head_dim, GT, false, ws, L, st);
  if (!e.ok()) return e;
  RowsArgs ra{};
  ra.scores = a.out;  // not read (the slices are filled in shared memory)
  ra.stride = max_length;
  ra.lengths = row_len;
  ra.row_k = row_k;
  ra.max_len = max_length;
  ra.k = k;
  ra.out_idx = out_idx;
  ra.out_cnt = out_cnt;
  ra.absent = false;
  g_last_cluster.store(C, std::memory_order_relaxed);
  KVS_CUDA_TRY(launch_kernel(fused_kernel(GT), dim3(unsigned(rows * C)), dim3(kRowsThreads), smem, st, /*pdl=*/true, C,
                             a, ra),
               "topk_group_select_kernel launch");
  KVS_LAUNCH_CHECK("topk_group_select_kernel launch");
  return {};
}

namespace detail {
void set_topk_tuning(int cluster, int score_chunk) noexcept {
  g_force_cluster.store(cluster, std::memory_order_relaxed);
  g_force_chunk.store(score_chunk, std::memory_order_relaxed);
}
int32_t topk_rows_last_cluster() noexcept { return g_last_cluster.load(std::memory_order_relaxed); }
void set_topk_score_mma(bool on) noexcept { g_score_mma.store(on ? 1 : 0, std::memory_order_relaxed); }
}  // namespace detail

}  // namespace kvs::cuda
