// SPDX-License-Identifier: Apache-2.0
// Quest on CUDA: see quest.cuh for the contract of each entry point.
//
// Bounds (quest_update_bounds): a warp per (Quest page, KV head); lanes of d/8 cover one key row
// with 16-byte loads, up to 8 rows in flight per lane, max/min in the KV dtype's own 2-wide
// instructions (exact), a shuffle tree over the rows, one 16-byte store of max and of min per lane.
//
// Selection (quest_select), three steps on the stream:
//  1. score_kernel, grid (page chunks, KV head, sequence). The CTA turns its group's queries into
//     the bound's "query" vector [P | N] of length 2d (P_i = sum_g max(q_gi, 0), N_i = sum_g
//     min(q_gi, 0) in the summed mode; one such vector per query head in the per-head mode), since
//     max(q M, q m) = max(q, 0) M + min(q, 0) m for M >= m. U_p is then a dot product of that vector
//     with the page's stored [M | m], i.e. a matrix product (query vectors x pages) that runs on
//     mma.sync m16n8k16: A = the query vectors split hi + lo in the KV dtype (rows 0-7 hi, 8-15 lo of
//     8 vectors; the two result rows are added), B = 8 pages' bounds straight from global memory
//     (each lane one 16-byte load per 32 elements; the k order inside a 32-element block is
//     permuted identically in A and B, which the dot product does not see). So each bound is read
//     once for the whole query group with 16-byte loads and no shuffles. The CTA's chunk 0 also
//     writes the row lengths for the top-k and pads each row past its candidates with +inf, so the
//     one host-side k = max_want - 1 picks the row's real want - 1 first (see expand_kernel).
//  2. topk_rows (topk.cuh): indices of the k best scores per row, ascending.
//  3. expand_kernel: per row, the first want - 1 picked pages (all below the +inf padding, which
//     sits at higher indices: ascending order puts them first; ties among real +inf scores resolve
//     to the lowest pages, as on the CPU) and the last page, expanded to tokens.
#include "backends/cuda/quest.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/status.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kvsieve/kvsieve.h"

#include "backends/cuda/topk.cuh"
#include "backends/cuda/topk_select.cuh"

namespace kvs::cuda {
namespace {



size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

std::atomic<int> g_tiles{0};  // detail::set_quest_tiles_per_warp
std::atomic<int> g_last_cluster{0};  // detail::quest_last_cluster

constexpr int kThreads = 128;  // 4 warps per CTA, both kernels

// ---- 16-bit element helpers --------------------------------------------------------------------
template <typename T>
struct Half2Of;
template <>
struct Half2Of<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr uint32_t kNegInf2 = 0xFF80FF80u, kPosInf2 = 0x7F807F80u;
};
template <>
struct Half2Of<__half> {
  using type = __half2;
  static constexpr uint32_t kNegInf2 = 0xFC00FC00u, kPosInf2 = 0x7C007C00u;
};

template <typename T>
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) {
  using T2 = typename Half2Of<T>::type;
  T2 x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  const T2 r = __hmax2(x, y);
  uint32_t o;
  memcpy(&o, &r, 4);
  return o;
}
template <typename T>
__device__ __forceinline__ uint32_t min2(uint32_t a, uint32_t b) {
  using T2 = typename Half2Of<T>::type;
  T2 x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  const T2 r = __hmin2(x, y);
  uint32_t o;
  memcpy(&o, &r, 4);
  return o;
}

__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <typename T>
__device__ __forceinline__ uint32_t bits16(T x) {
  uint16_t u;
  memcpy(&u, &x, 2);
  return u;
}

// x as the hi (lo = false) or lo (lo = true) part of a two-term 16-bit split: x ~ hi + lo.
template <typename T>
__device__ __forceinline__ uint32_t split_part(float x, bool lo) {
  const T hi = from_f32<T>(x);
  return lo ? bits16(from_f32<T>(x - to_f32(hi))) : bits16(hi);
}

// D += A (16x16, row) * B (16x8, col), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  }
}

// ---- 1. bounds -------------------------------------------------------------------------------
struct BoundsArgs {
  PagedKv kv;
  int32_t hkv, b, t1, ps, p_first, items;  // items = pages to rebuild * hkv
  int32_t contiguous;                      // every Quest page lies inside one KV page
  void* bounds;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) bounds_kernel(BoundsArgs a) {
  constexpr int L = D / 8;   // lanes per key row (16 bytes each)
  constexpr int R = 32 / L;  // rows per warp-wide load
  constexpr int U = 8;       // loads in flight per lane
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int item = blockIdx.x * (kThreads / 32) + warp;
  if (item >= a.items) return;
  const int p = a.p_first + item / a.hkv, h = item % a.hkv;
  const int r = lane / L, c = lane % L;
  const int tb = p * a.ps;
  const int cnt = min(a.ps, a.t1 - tb);  // >= 1: page p starts below t1
  uint32_t mx[4], mn[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    mx[w] = Half2Of<T>::kNegInf2;
    mn[w] = Half2Of<T>::kPosInf2;
  }
  const T* base = a.contiguous ? kv_row<T>(a.kv, a.hkv, D, a.b, h, tb, 0) : nullptr;
  const int64_t tstride = kv_strides(a.kv, a.hkv, D).token;
  for (int j0 = r; j0 < cnt; j0 += R * U) {
    uint4 u[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int j = j0 + k * R;
      if (j < cnt) {
        const T* row = a.contiguous ? base + j * tstride : kv_row<T>(a.kv, a.hkv, D, a.b, h, tb + j, 0);
        u[k] = __ldg(reinterpret_cast<const uint4*>(row) + c);
      }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (j0 + k * R < cnt) {
        const uint32_t w4[4] = {u[k].x, u[k].y, u[k].z, u[k].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          mx[w] = max2<T>(mx[w], w4[w]);
          mn[w] = min2<T>(mn[w], w4[w]);
        }
      }
    }
  }
#pragma unroll
  for (int off = L; off < 32; off <<= 1)
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      mx[w] = max2<T>(mx[w], __shfl_xor_sync(0xffffffffu, mx[w], off));
      mn[w] = min2<T>(mn[w], __shfl_xor_sync(0xffffffffu, mn[w], off));
    }
  if (r == 0) {
    uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(a.bounds) + (size_t(p) * a.hkv + h) * 2 * D);
    out[c] = make_uint4(mx[0], mx[1], mx[2], mx[3]);
    out[L + c] = make_uint4(mn[0], mn[1], mn[2], mn[3]);
  }
}

// ---- 2. page scores --------------------------------------------------------------------------
struct ScoreArgs {
  const void* q;
  const void* const* q_at;  // null, or device: the query's address, read at run time (graphs)
  int32_t q_f32;
  const void* const* bounds;
  const int32_t* lengths;
  const int32_t* budget;
  int32_t max_length, ps, max_want, k_host;
  int32_t hkv, G, V, RG;  // V query vectors per KV head (G per head, 1 summed), RG = ceil(V / 8)
  int32_t tiles;          // tiles of 8 pages per warp
  int32_t pdl;            // launched as a programmatic dependent: the query setup runs before the wait
  float* scores;          // [B * Hkv * V][S]
  int32_t S;
  int32_t* lens;  // [B * Hkv * V]
};

// Pages, page budget and picked-page count of sequence b (the CPU method's rules).
struct SeqPlan {
  int n, pages, want, first;  // first: tokens of the current page skipped (fit, budget < the page)
};
__device__ __forceinline__ SeqPlan seq_plan(const int32_t* lengths, const int32_t* budget, int b,
                                            int max_length, int ps, int max_want) {
  SeqPlan s;
  s.n = min(max(lengths[b], 0), max_length);
  s.pages = s.n / ps + (s.n % ps != 0);
  s.want = 0;
  s.first = 0;
  int k = budget[b];
  const bool fit = k < 0;  // page_budget=fit, k = -budget[b] (quest.cpp's rule)
  if (fit) k = -k;
  if (s.pages > 0) {
    if (fit) {
      const int cur = s.n - (s.pages - 1) * ps;
      if (k >= cur) s.want = min(1 + (k - cur) / ps, s.pages);
      else s.want = 1, s.first = cur - k;
      s.want = min(s.want, max_want);
    } else {
      s.want = min(min(max(k / ps, 1), s.pages), max_want);
    }
  }
  return s;
}

template <typename T>
__device__ __forceinline__ float load_q(const void* q, bool f32, size_t i) {
  return f32 ? static_cast<const float*>(q)[i] : to_f32(static_cast<const T*>(q)[i]);
}

// The bound's query vectors of KV head h of sequence b, vec[V][2D] = [P | N] (see the top), by
// the CTA's NT threads. Reads only the query.
template <typename T, int D, int NT>
__device__ __forceinline__ void query_vectors(const ScoreArgs& a, int b, int h, float* vec) {
  const bool f32 = a.q_f32 != 0;
  const void* qbase = a.q_at ? *a.q_at : a.q;
  const size_t q0 = (size_t(b) * a.hkv * a.G + size_t(h) * a.G) * D;
  // (Loops kept rolled: the first tile's loads hold their registers meanwhile.)
#pragma unroll 1
  for (int idx = threadIdx.x; idx < a.V * D; idx += NT) {
    const int v = idx / D, i = idx % D;
    const int g0 = a.V == 1 ? 0 : v, g1 = a.V == 1 ? a.G : v + 1;
    float P = 0.f, N = 0.f;
#pragma unroll 1
    for (int g = g0; g < g1; ++g) {
      const float x = load_q<T>(qbase, f32, q0 + size_t(g) * D + i);
      P += fmaxf(x, 0.f);
      N += fminf(x, 0.f);
    }
    vec[v * 2 * D + i] = P;
    vec[v * 2 * D + D + i] = N;
  }
}

// The A fragments of the query vectors, frag[RG][NM][32] (vec written and the CTA synchronised).
// Register r of lane l for k-step m holds row (l/4) + 8*(r&1) (row & 7 = vector, row >> 3 = hi/lo
// part) and elements e, e+1 with e = 32*(m/2) + 8*(l%4) + 4*(m%2) + 2*(r/2): the elements the B
// lanes with the same l%4 load for those k slots.
template <typename T, int D, int NT>
__device__ __forceinline__ void query_frags(const ScoreArgs& a, const float* vec, uint4* frag) {
  constexpr int NM = 2 * D / 16;
  uint32_t* fw = reinterpret_cast<uint32_t*>(frag);
#pragma unroll 1
  for (int w = threadIdx.x; w < a.RG * NM * 128; w += NT) {
    const int r = w & 3, l = (w >> 2) & 31, m = (w >> 7) % NM, rg = (w >> 7) / NM;
    const int row = (l >> 2) + 8 * (r & 1);
    const int v = rg * 8 + (row & 7);
    const int e = 32 * (m >> 1) + 8 * (l & 3) + 4 * (m & 1) + 2 * (r >> 1);
    float x0 = 0.f, x1 = 0.f;
    if (v < a.V) {
      x0 = vec[v * 2 * D + e];
      x1 = vec[v * 2 * D + e + 1];
    }
    const bool lo = row >= 8;
    fw[w] = split_part<T>(x0, lo) | (split_part<T>(x1, lo) << 16);
  }
}

// acc0 / acc1 += the products of N 32-element blocks of a tile (u: this lane's loads of blocks c0..
// c0+N-1) with the A fragments fr (frag + rg * NM * 32 + lane). The page scores of the vector group
// are then (acc0 + acc1) of rows gid (hi) and gid + 8 (lo): tile_scores.
template <typename T, int N>
__device__ __forceinline__ void tile_mma(const uint4* fr, int c0, const uint4 (&u)[N], float (&acc0)[4],
                                         float (&acc1)[4]) {
#pragma unroll
  for (int c = 0; c < N; ++c) {
    mma16816<T>(acc0, fr[(2 * (c0 + c)) * 32], u[c].x, u[c].y);
    mma16816<T>(acc1, fr[(2 * (c0 + c) + 1) * 32], u[c].z, u[c].w);
  }
}
// Vector gid's scores of the tile's pages 2*tig and 2*tig + 1.
__device__ __forceinline__ float2 tile_scores(const float (&acc0)[4], const float (&acc1)[4]) {
  return make_float2((acc0[0] + acc1[0]) + (acc0[2] + acc1[2]), (acc0[1] + acc1[1]) + (acc0[3] + acc1[3]));
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) score_kernel(ScoreArgs a) {
  constexpr int NM = 2 * D / 16;  // mma k-steps over the 2d-long [M | m]
  constexpr int NC = 2 * D / 32;  // 16-byte loads per lane per tile
  constexpr bool kPipe = D <= 128;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* frag = reinterpret_cast<uint4*>(smem);                          // [RG][NM][32] A fragments
  float* vec = reinterpret_cast<float*>(smem + size_t(a.RG) * NM * 512);  // [V][2D] P | N
  const int b = blockIdx.z, h = blockIdx.y;
  pdl_launch_dependents();  // the top-k may launch (and wait) once every CTA here has started
  const SeqPlan sp = seq_plan(a.lengths, a.budget, b, a.max_length, a.ps, a.max_want);
  const int ncand = max(sp.pages - 1, 0);
  const int row0 = (b * a.hkv + h) * a.V;
  const int tile0 = blockIdx.x * (kThreads / 32) * a.tiles;
  if (blockIdx.x != 0 && tile0 * 8 >= ncand) {  // CTA-uniform: nothing to score
    pdl_wait();
    return;
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gid = lane >> 2, tig = lane & 3;
  const uint4* bb = static_cast<const uint4*>(a.bounds[b]);
  // Lane (gid, tig) loads page (tile * 8 + gid)'s bounds: 16 bytes of every 32 elements.
  auto load_tile = [&](int t, uint4 (&u)[NC]) {
    const int p = (tile0 + t * (kThreads / 32) + warp) * 8 + gid;
    if (p < ncand) {
      const uint4* src = bb + (size_t(p) * a.hkv + h) * (D / 4) + tig;
#pragma unroll
      for (int c = 0; c < NC; ++c) u[c] = __ldg(src + 4 * c);
    } else {
#pragma unroll
      for (int c = 0; c < NC; ++c) u[c] = make_uint4(0u, 0u, 0u, 0u);
    }
  };
  // A plain launch sends the first tile's loads out before the query setup below, which then
  // hides under them; a programmatic dependent launch does the setup while the previous kernel
  // (the KV append, or a bounds fold that writes what the tiles read) finishes, then waits.
  uint4 cur[NC];
  if (!a.pdl) load_tile(0, cur);

  // Query vectors of this KV head's group.
  query_vectors<T, D, kThreads>(a, b, h, vec);
  pdl_wait();
  if (a.pdl) load_tile(0, cur);
  if (blockIdx.x == 0) {
    // Row lengths for the top-k: candidates, then k_host - (want - 1) +inf pads.
    const int len = sp.pages > 0 ? ncand + a.k_host - (sp.want - 1) : 0;
    for (int v = 0; v < a.V; ++v) {
      if (threadIdx.x == 0) a.lens[row0 + v] = len;
      float* row = a.scores + size_t(row0 + v) * a.S;
      for (int t = ncand + threadIdx.x; t < len; t += kThreads) row[t] = __int_as_float(0x7f800000);
    }
  }
  __syncthreads();
  query_frags<T, D, kThreads>(a, vec, frag);
  __syncthreads();

  for (int t = 0; t < a.tiles; ++t) {
    const int page0 = (tile0 + t * (kThreads / 32) + warp) * 8;
    if (page0 >= ncand) break;
    // The next tile's loads fly during this tile's products (register double buffer; at d = 256
    // it would take 128 registers, so there the next loads follow the products). Issuing two
    // tiles before the query setup instead measured no faster (123 registers, 4 CTAs per SM).
    uint4 nxt[NC];
    if constexpr (kPipe) {
      if (t + 1 < a.tiles) load_tile(t + 1, nxt);
    }
    for (int rg = 0; rg < a.RG; ++rg) {
      float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
      tile_mma<T>(frag + size_t(rg) * NM * 32 + lane, 0, cur, acc0, acc1);
      const int v = rg * 8 + gid;
      if (v < a.V) {
        // Rows gid (hi) and gid + 8 (lo) of columns 2*tig, 2*tig + 1: pages page0 + 2*tig + {0, 1}.
        const float2 sc = tile_scores(acc0, acc1);
        const int pc = page0 + 2 * tig;
        float* dst = a.scores + size_t(row0 + v) * a.S + pc;
        if (pc + 1 < ncand) *reinterpret_cast<float2*>(dst) = sc;
        else if (pc < ncand) dst[0] = sc.x;
      }
    }
    if (t + 1 < a.tiles) {
      if constexpr (kPipe) {
#pragma unroll
        for (int c = 0; c < NC; ++c) cur[c] = nxt[c];
      } else {
        load_tile(t + 1, cur);
      }
    }
  }
}

// ---- 2'. page scores and top-k fused (summed mode) ----------------------------------------------
// A thread-block cluster of C CTAs per (sequence, KV head) row. CTA r scores slice r of the row's
// candidate pages (topk_detail::select_slice) with the score kernel's arithmetic (same products,
// same order: bit-identical scores), keeps them in shared memory as top-k keys, and the cluster
// selects the row's want - 1 best pages there (topk_detail::rows_select, the same selection as
// topk_rows: ties to the lower page). The scores never reach global memory, and the row's padding
// with +inf is not needed: the select is told the row's count. Writes picked[row][k_host] like the
// top-k of the unfused path, for expand_kernel.
namespace td = topk_detail;
namespace cg = cooperative_groups;

template <typename T, int D>
__global__ void __launch_bounds__(td::kRowsThreads, 1) score_select_kernel(const ScoreArgs a, int32_t* picked) {
  constexpr int NT = td::kRowsThreads, NW = NT / 32;
  constexpr int NM = 2 * D / 16, NC = 2 * D / 32;
  constexpr int NCH = NC < 8 ? NC : 8;  // loads per lane in flight: 32 registers at most (1024 threads)
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* frag = reinterpret_cast<uint4*>(smem);                                 // [NM][32]
  float* vec = reinterpret_cast<float*>(smem + NM * 512);                        // [2D]
  uint32_t* keys = reinterpret_cast<uint32_t*>(smem + NM * 512 + 2 * D * 4);    // the slice's keys
  cg::cluster_group cl = cg::this_cluster();
  const int C = int(cl.num_blocks()), rank = int(cl.block_rank());
  const int row = int(blockIdx.x / unsigned(C)), b = row / a.hkv, h = row % a.hkv;
  const SeqPlan sp = seq_plan(a.lengths, a.budget, b, a.max_length, a.ps, a.max_want);
  const int ncand = max(sp.pages - 1, 0), want = sp.pages > 0 ? sp.want - 1 : 0;
  int64_t beg, end;
  td::select_slice(ncand, C, rank, &beg, &end);
  const bool score = want > 0 && want < ncand;  // else the select takes all or nothing, no scores

  // Query setup before the wait: it reads only the query (see the score kernel).
  if (score) query_vectors<T, D, NT>(a, b, h, vec);
  __syncthreads();
  if (score) query_frags<T, D, NT>(a, vec, frag);
  pdl_wait();  // the bounds (a fold or an append may write them just before)
  __syncthreads();
  if (score) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const uint4* bb = static_cast<const uint4*>(a.bounds[b]);
    const int ntiles = int((end - beg + 7) / 8);
    for (int t = warp; t < ntiles; t += NW) {
      const int page0 = int(beg) + 8 * t, p = page0 + gid;
      const uint4* src = bb + (size_t(p) * a.hkv + h) * (D / 4) + tig;
      float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c0 = 0; c0 < NC; c0 += NCH) {
        uint4 u[NCH];
#pragma unroll
        for (int c = 0; c < NCH; ++c) u[c] = p < end ? __ldg(src + 4 * (c0 + c)) : make_uint4(0u, 0u, 0u, 0u);
        tile_mma<T>(frag + lane, c0, u, acc0, acc1);
      }
      if (gid == 0) {  // vector 0 (the group's sum): pages page0 + 2*tig + {0, 1}
        const float2 sc = tile_scores(acc0, acc1);
        const int pc = page0 + 2 * tig;
        if (pc < end) keys[pc - beg] = td::ord_key(sc.x);
        if (pc + 1 < end) keys[pc + 1 - beg] = td::ord_key(sc.y);
      }
    }
  }
  pdl_launch_dependents();  // the expansion may launch (it waits for this kernel's end)
  __syncthreads();
  td::RowsArgs ra{};
  ra.max_len = ncand;  // no lengths array: the row's length is its candidate count
  ra.k = a.k_host;
  ra.out_idx = picked;
  td::rows_select<false, true, true>(ra, cl, row, keys, want);
}

// ---- 3. pages to tokens ----------------------------------------------------------------------
struct ExpandArgs {
  const int32_t* lengths;
  const int32_t* budget;
  const int32_t* picked;  // [rows][k_host] from the top-k (ascending pages)
  int32_t max_length, ps, max_want, k_host, H;
  int32_t* out_idx;
  int32_t* out_cnt;
  int32_t max_selected;
};

__global__ void __launch_bounds__(256) expand_kernel(ExpandArgs a) {
  pdl_wait();  // with pdl, a programmatic dependent launch: nothing is read or written before this
  pdl_launch_dependents();
  const int r = blockIdx.x, b = r / a.H;
  const SeqPlan sp = seq_plan(a.lengths, a.budget, b, a.max_length, a.ps, a.max_want);
  const int real = sp.pages > 0 ? sp.want - 1 : 0;           // picked pages before the last
  const int last_len = sp.pages > 0 ? sp.n - (sp.pages - 1) * a.ps - sp.first : 0;
  const int pos = blockIdx.y * 256 + threadIdx.x;
  if (pos == 0) a.out_cnt[r] = sp.pages > 0 ? real * a.ps + last_len : 0;
  if (pos >= a.max_selected) return;
  const int i = pos / a.ps, j = pos - i * a.ps;
  int v = -1;
  if (i < real) v = a.picked[size_t(r) * a.k_host + i] * a.ps + j;
  else if (i == real && j < last_len) v = (sp.pages - 1) * a.ps + sp.first + j;
  a.out_idx[size_t(r) * a.max_selected + pos] = v;
}

// ---- host side -------------------------------------------------------------------------------
Status check_common(const AttnShape& s, Scalar kv_dtype) {
  if (s.batch < 1 || s.batch > 65535) return invalid("batch must be in [1, 65535]");
  if (s.num_kv_heads < 1 || s.num_kv_heads > 65535) return invalid("num_kv_heads must be in [1, 65535]");
  if (s.num_q_heads < 1 || s.num_q_heads % s.num_kv_heads != 0)
    return invalid("num_q_heads must be a positive multiple of num_kv_heads");
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256)
    return unsupported("quest: head_dim must be 64, 128 or 256");
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("quest: KV dtype must be BF16 or F16");
  return {};
}

template <typename F>
Status with_type_dim(Scalar t, int d, F&& f) {
  auto by_dim = [&](auto tag) -> Status {
    using T = decltype(tag);
    switch (d) {
      case 64: return f(T{}, std::integral_constant<int, 64>{});
      case 128: return f(T{}, std::integral_constant<int, 128>{});
      case 256: return f(T{}, std::integral_constant<int, 256>{});
      default: return unsupported("quest: head_dim must be 64, 128 or 256");
    }
  };
  return t == Scalar::BF16 ? by_dim(__nv_bfloat16{}) : by_dim(__half{});
}

// Workspace layout of quest_select for `rows` score rows.
struct Layout {
  int max_pages = 0, k_host = 0, max_len = 0, S = 0;
  size_t scores = 0, lens = 0, picked = 0, topk = 0, topk_bytes = 0, total = 0;
};
Layout make_layout(int rows, int max_length, int ps, int max_want) {
  Layout L;
  L.max_pages = int((int64_t(max_length) + ps - 1) / ps);
  L.k_host = std::max(0, std::min(max_want, L.max_pages) - 1);
  if (L.k_host == 0) return L;  // every budget is the last page alone: no scoring, no top-k
  L.max_len = L.max_pages - 1 + L.k_host;
  L.S = int(align_up(size_t(L.max_len), 4));
  size_t off = 0;
  L.scores = off;
  off += align_up(size_t(rows) * L.S * 4, 256);
  L.lens = off;
  off += align_up(size_t(rows) * 4, 256);
  L.picked = off;
  off += align_up(size_t(rows) * L.k_host * 4, 256);
  L.topk = off;
  L.topk_bytes = topk_rows_workspace_bytes(rows, L.max_len, L.k_host);
  off += align_up(L.topk_bytes, 256);
  L.total = off;
  return L;
}

size_t score_smem_bytes(int d, int V) {
  const int RG = (V + 7) / 8;
  return size_t(RG) * (2 * d / 16) * 512 + size_t(V) * 2 * d * 4;
}

template <typename T, int D>
Status launch_score(ScoreArgs a, int B, int max_cand, cudaStream_t st) {
  auto kern = score_kernel<T, D>;
  const size_t smem = score_smem_bytes(D, a.V);
  if (smem > 48 * 1024) {
    int dev = 0, optin = 0;
    KVS_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
    KVS_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
    if (smem > size_t(optin)) return unsupported("quest_select: query group too large for shared memory");
    KVS_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cudaFuncSetAttribute(quest score)");
  }
  const int tiles_per_head = (max_cand + 7) / 8;
  int tiles = g_tiles.load(std::memory_order_relaxed);
  if (tiles <= 0) {
    // About one resident wave of warps over all (sequence, KV head, tile) work.
    int sms = 0, occ = 0;
    if (Status e = sm_count(&sms); !e.ok()) return e;
    // Occupancy per (kernel, shared memory size), cached: (smem << 32) | occ of the last query.
    static std::atomic<uint64_t> cached{0};
    const uint64_t c = cached.load(std::memory_order_relaxed);
    if (c != 0 && (c >> 32) == smem) {
      occ = int(c & 0xffffffffu);
    } else {
      KVS_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, kThreads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor(quest score)");
      cached.store((uint64_t(smem) << 32) | uint32_t(std::max(occ, 1)), std::memory_order_relaxed);
    }
    const int64_t warps = int64_t(std::max(1, sms)) * std::max(1, occ) * (kThreads / 32);
    const int64_t work = int64_t(B) * a.hkv * tiles_per_head;
    tiles = int(std::clamp<int64_t>((work + warps - 1) / warps, 1, 16));
  }
  a.tiles = tiles;
  const int per_cta = tiles * (kThreads / 32);
  dim3 grid(unsigned((tiles_per_head + per_cta - 1) / per_cta), unsigned(a.hkv), unsigned(B));
  KVS_CUDA_TRY(launch_kernel(kern, grid, dim3(kThreads), smem, st, a.pdl != 0, 1, a), "quest score kernel launch");
  return {};
}

// The fused kernel's cluster size for `rows` rows of up to max_cand candidate pages (0: not used),
// with its dynamic shared memory. Automatic: fused only for rows longer than the one-CTA top-k
// takes (above 16384 pages: 256K tokens in pages of 16), where the unfused path's top-k runs on
// clusters too and reads the scores back from global memory; shorter rows keep the score kernel,
// which spreads over every SM (the fused kernel runs a row on one cluster, 64 SMs for 8 rows:
// slower at 128K, docs/perf.md). Cluster size: waves of clusters times the pages a CTA scores, plus
// a per-pass synchronisation cost growing with the cluster size. KVS_QUEST_CLUSTER (environment,
// read once) or detail::set_quest_cluster: 0 = the unfused kernels, 1-16 = that cluster size.
std::atomic<int> g_cluster{-2};  // -2: not read from the environment yet; -1: automatic

int cluster_override() {
  int v = g_cluster.load(std::memory_order_relaxed);
  if (v == -2) {
    const char* e = std::getenv("KVS_QUEST_CLUSTER");
    v = e && *e ? std::atoi(e) : -1;
    int expected = -2;
    if (!g_cluster.compare_exchange_strong(expected, v, std::memory_order_relaxed)) v = expected;
  }
  return v;
}

template <typename T, int D>
Status fused_plan(int rows, int max_cand, int* cluster, size_t* smem) {
  static ClusterOccupancy occ;
  *cluster = 0;
  *smem = 0;
  const int force = cluster_override();
  if (force == 0 || max_cand < 1 || (force < 0 && max_cand <= td::kSmallMaxLen)) return {};
  int dev = 0;
  KVS_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
  const size_t fixed = size_t(2 * D / 16) * 512 + size_t(2 * D) * 4;  // fragments + vector
  // The key cache's limit less 16 KB: at d = 256 the fragments and the select's own 33 KB of static
  // shared memory would pass the 227 KB a CTA may have.
  const size_t max_bytes = fixed + td::kCacheBytesMax - 16 * 1024;
  int64_t best = 0;
  for (int ci = 0; ci < 5; ++ci) {
    const int C = 1 << ci;
    if (force > 0 && C != force) continue;
    const int64_t chunk = (td::ceil_div(max_cand, C) + 3) & ~int64_t(3);
    const size_t bytes = fixed + size_t(chunk) * 4;
    if (bytes > max_bytes) continue;
    const int n = occ.clusters(score_select_kernel<T, D>, dev, ci, bytes, td::kRowsThreads, max_bytes);
    if (n <= 0) continue;
    const int64_t cost = td::ceil_div(rows, n) * (chunk + 32 * C);
    if (*cluster == 0 || cost < best) {
      best = cost;
      *cluster = C;
      *smem = bytes;
    }
  }
  return {};
}

}  // namespace

namespace detail {
bool set_quest_cluster(int cluster) noexcept {
  if (cluster < -1 || cluster > 16 || (cluster > 0 && (cluster & (cluster - 1)) != 0)) return false;
  g_cluster.store(cluster, std::memory_order_relaxed);
  return true;
}
int quest_last_cluster() noexcept { return g_last_cluster.load(std::memory_order_relaxed); }

bool set_quest_tiles_per_warp(int tiles) noexcept {
  if (tiles < 0 || tiles > 64) return false;
  g_tiles.store(tiles, std::memory_order_relaxed);
  return true;
}
}  // namespace detail

Status quest_update_bounds(const AttnShape& shape, const PagedKv& kv, Scalar kv_dtype, int32_t b,
                           int32_t t0, int32_t t1, int32_t page_size, void* bounds, void* stream) noexcept {
  if (Status s = check_common(shape, kv_dtype); !s.ok()) return s;
  if (b < 0 || b >= shape.batch) return invalid("quest_update_bounds: b out of range");
  if (page_size < 1 || page_size > 4096) return invalid("quest_update_bounds: page_size must be in [1, 4096]");
  if (kv.pages == nullptr || kv.page_tokens < 16 || kv.page_tokens > 1024 ||
      (kv.page_tokens & (kv.page_tokens - 1)) != 0 || (1 << kv.page_shift) != kv.page_tokens || kv.max_pages < 1)
    return invalid("quest_update_bounds: bad PagedKv descriptor");
  if (t0 < 0 || t1 < t0 || int64_t(t1) > int64_t(kv.max_pages) * kv.page_tokens)
    return invalid("quest_update_bounds: need 0 <= t0 <= t1 <= max_pages * page_tokens");
  if (bounds == nullptr || (reinterpret_cast<uintptr_t>(bounds) & 15) != 0)
    return invalid("quest_update_bounds: bounds must be a 16-byte aligned device pointer");
  if (t0 == t1) return {};
  BoundsArgs a{};
  a.kv = kv;
  a.hkv = shape.num_kv_heads;
  a.b = b;
  a.t1 = t1;
  a.ps = page_size;
  a.p_first = t0 / page_size;
  const int64_t items = int64_t((t1 - 1) / page_size - a.p_first + 1) * a.hkv;
  if (items > (int64_t(1) << 31) - 4) return unsupported("quest_update_bounds: too many pages");
  a.items = int32_t(items);
  a.contiguous = kv.page_tokens % page_size == 0;
  a.bounds = bounds;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return with_type_dim(kv_dtype, shape.head_dim, [&](auto tag, auto dim) -> Status {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const unsigned blocks = unsigned((a.items + kThreads / 32 - 1) / (kThreads / 32));
    bounds_kernel<T, D><<<blocks, kThreads, 0, st>>>(a);
    KVS_LAUNCH_CHECK("quest bounds kernel launch");
    return Status{};
  });
}

size_t quest_select_workspace_bytes(const AttnShape& shape, int32_t max_length, int32_t page_size,
                                    int32_t max_want) noexcept {
  if (shape.batch < 1 || shape.num_kv_heads < 1 || shape.num_q_heads < 1 || max_length < 1 ||
      page_size < 1 || max_want < 1)
    return 0;
  size_t best = 0;
  for (int rows : {shape.batch * shape.num_kv_heads, shape.batch * shape.num_q_heads})
    best = std::max(best, make_layout(rows, max_length, page_size, max_want).total);
  return best;
}

Status quest_select(const AttnShape& shape, const Query& q, Scalar kv_dtype, const void* const* bounds,
                    const int32_t* lengths, const int32_t* budget_keys, int32_t max_length,
                    int32_t page_size, int32_t max_want, bool per_query_head, int32_t* out_idx,
                    int32_t* out_cnt, int32_t max_selected, const Workspace& ws, void* stream, bool pdl) noexcept {
  if (Status s = check_common(shape, kv_dtype); !s.ok()) return s;
  if ((q.data == nullptr && q.at == nullptr) || (q.dtype != Scalar::F32 && q.dtype != kv_dtype))
    return invalid("quest_select: query must be F32 or the KV dtype");
  if (bounds == nullptr || lengths == nullptr || budget_keys == nullptr || out_idx == nullptr || out_cnt == nullptr)
    return invalid("quest_select: null pointer argument");
  if (max_length < 1) return invalid("quest_select: max_length must be >= 1");
  if (page_size < 1 || page_size > 4096) return invalid("quest_select: page_size must be in [1, 4096]");
  if (max_want < 1) return invalid("quest_select: max_want must be >= 1");
  if (int64_t(max_selected) < int64_t(max_want) * page_size)
    return invalid("quest_select: max_selected must be >= max_want * page_size");
  const int G = shape.num_q_heads / shape.num_kv_heads;
  const int V = per_query_head ? G : 1;
  const int64_t rows64 = int64_t(shape.batch) * shape.num_kv_heads * V;
  if (rows64 > (int64_t(1) << 31) - 1 || (max_selected + 255) / 256 > 65535)
    return unsupported("quest_select: too many rows or max_selected too large");
  const int rows = int(rows64);
  const Layout L = make_layout(rows, max_length, page_size, max_want);
  if (ws.bytes < L.total || (L.total > 0 && ws.ptr == nullptr))
    return invalid("quest_select: workspace smaller than quest_select_workspace_bytes");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  char* w = static_cast<char*>(ws.ptr);
  int32_t* picked = L.k_host > 0 ? reinterpret_cast<int32_t*>(w + L.picked) : nullptr;
  int last_cluster = 0;
  if (L.k_host > 0) {
    ScoreArgs a{};
    a.q = q.data;
    a.q_at = q.at;
    a.q_f32 = q.dtype == Scalar::F32;
    a.bounds = bounds;
    a.lengths = lengths;
    a.budget = budget_keys;
    a.max_length = max_length;
    a.ps = page_size;
    a.max_want = max_want;
    a.k_host = L.k_host;
    a.pdl = pdl;
    a.hkv = shape.num_kv_heads;
    a.G = G;
    a.V = V;
    a.RG = (V + 7) / 8;
    a.scores = reinterpret_cast<float*>(w + L.scores);
    a.S = L.S;
    a.lens = reinterpret_cast<int32_t*>(w + L.lens);
    // Summed mode: scores and top-k fused in one cluster kernel when the row's slices fit in
    // shared memory; else (and per query head) the score kernel, then topk_rows.
    Status s = with_type_dim(kv_dtype, shape.head_dim, [&](auto tag, auto dim) -> Status {
      using T = decltype(tag);
      constexpr int D = decltype(dim)::value;
      int C = 0;
      size_t smem = 0;
      if (V == 1)
        if (Status e = fused_plan<T, D>(rows, L.max_pages - 1, &C, &smem); !e.ok()) return e;
      if (C > 0 && int64_t(rows) * C <= 0x7fffffffLL) {
        last_cluster = C;
        KVS_CUDA_TRY(launch_kernel(score_select_kernel<T, D>, dim3(unsigned(rows * C)), dim3(td::kRowsThreads), smem,
                                   st, pdl, C, a, picked),
                     "quest score_select kernel launch");
        return {};
      }
      if (Status e = launch_score<T, D>(a, shape.batch, L.max_pages - 1, st); !e.ok()) return e;
      return topk_rows(a.scores, L.S, a.lens, rows, L.max_len, L.k_host, picked, nullptr,
                       Workspace{w + L.topk, L.topk_bytes}, stream);
    });
    if (!s.ok()) return s;
  }
  g_last_cluster.store(last_cluster, std::memory_order_relaxed);
  ExpandArgs e{};
  e.lengths = lengths;
  e.budget = budget_keys;
  e.picked = picked;
  e.max_length = max_length;
  e.ps = page_size;
  e.max_want = std::min(max_want, std::max(1, L.max_pages));
  e.k_host = L.k_host;
  e.H = shape.num_kv_heads * V;
  e.out_idx = out_idx;
  e.out_cnt = out_cnt;
  e.max_selected = max_selected;
  dim3 grid(unsigned(rows), unsigned((max_selected + 255) / 256));
  KVS_CUDA_TRY(launch_kernel(expand_kernel, grid, dim3(256), 0, st, pdl, 1, e), "quest expand kernel launch");
  return {};
}

}  // namespace kvs::cuda
