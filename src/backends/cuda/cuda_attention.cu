// SPDX-License-Identifier: Apache-2.0
// CUDA decode-attention kernels: see cuda_attention.cuh for the contract of each entry point.
//
// Dense/gathered decode (flash-decoding): grid (split, KV head x query-group, sequence). A CTA
// streams one chunk of its KV head's keys through a per-warp cp.async pipeline (16-byte copies,
// STAGES deep, each warp private so no CTA barrier inside the loop) and keeps an online softmax
// for up to GT query heads of the group in registers, so K and V cross HBM once per KV head.
// Keys come from the paged layout of kv_layout.cuh. A warp tile (at most 16 keys, aligned to its
// size) never crosses a page (P >= 16), so dense decode looks one page pointer up per tile, one
// tile ahead of its use; gathered decode looks one up per key (lane i of the warp owns key i of a
// tile and shares the row pointer by shuffle), the index two tiles and the page one tile ahead.
// Thread layout in a warp: TPR = d/8 lanes cover one key row (8 elements = 16 bytes each), the
// warp covers RPP = 32/TPR rows per copy, ROWS copies per tile. Scores are kept in base 2
// (q pre-multiplied by scale*log2(e)) and converted to a natural-log LSE on output.
// Each chunk writes a normalized partial (o, lse); a merge kernel combines the chunks exactly.
// When one chunk covers the whole context the first kernel writes the final output directly.
#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kernel_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/status.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvsieve/kvsieve.h"

namespace kvs::cuda {

static_assert(int(Scalar::F32) == KVS_SCALAR_F32 && int(Scalar::F16) == KVS_SCALAR_F16 &&
                  int(Scalar::BF16) == KVS_SCALAR_BF16,
              "Scalar must match kvs_scalar numbers");

namespace {

using namespace kutil;  // Cvt, fast_exp2, cp.async, ldmatrix, Mma, split2 (kernel_util.cuh)

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMinChunk = 128;     // fewest keys a split is worth
constexpr int kMaxSplits = 1024;   // cap on chunks per (sequence, head)
constexpr int kMaxCtasPerSm = 16;  // 2048 threads / 128: bound used for workspace sizing
size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// 8 query elements starting at p (16-byte aligned), as float times mul.
template <typename T>
__device__ __forceinline__ void load_q8(const void* p, bool f32, float mul, float (&out)[8]) {
  if (f32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
    Cvt<T>::f32x8(__ldg(reinterpret_cast<const uint4*>(p)), out);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] *= mul;
}

// Programmatic dependent launch (launch.cuh): the chunk kernel lets the merge kernel launch once
// every CTA is past its main loop; the merge kernel waits for the chunk kernel's completion (and
// memory flush) before reading anything.

// ---- decode kernels --------------------------------------------------------------------------
struct DecodeArgs {
  const void* q;
  int32_t q_f32;
  const void* const* pages;  // page table [B * max_pages] (kv_layout.cuh)
  int32_t max_pages;
  int32_t page_shift;        // log2(P)
  int32_t head_stride;       // elements between KV heads in a page (kv_strides): P * d, or d (NHD)
  int32_t token_stride;      // elements between a head's consecutive tokens: d, or Hkv * d (NHD)
  int64_t v_off;             // elements from a K row to its V row: Hkv * P * d, or the caller's
  const int32_t* lengths;    // dense: [B]; gathered: counts [B * Hkv] or [B * Hq] (per_q)
  const int32_t* indices;    // gathered: [B, Hkv or Hq, max_tokens]
  int32_t max_tokens;        // max_length or max_selected
  int32_t per_q;             // gathered: one list per query head (GT == 1 kernels only)
  int32_t B, Hq, Hkv, G, ngroups;
  float qmul;  // scale * log2(e)
  int32_t lse_base2;  // the final lse in base 2 (the partials of a split stay natural)
  int32_t nsplit, chunk;
  int32_t direct;  // chunks write the final output (nsplit == 1 and no prior), else partials
  const float* prior_o;    // optional prior state merged by the merge kernel (Output::prior_*)
  const float* prior_lse;
  void* o;  // final output (direct)
  int32_t o_f32;
  float* lse;
  float* o_part;    // [B * Hq, nsplit, D]
  float* lse_part;  // [B * Hq, nsplit]
  const void* const* q_at;  // null, or device: the query's address, read at run time (graphs)
  void* const* o_at;        // null, or device [2]: o then lse addresses, read at run time
  int32_t pdl;              // host: the chunk kernel is a programmatic dependent launch
  int32_t wait_first;       // wait for the previous kernel before the query set-up too (knob)
};

// The caller's tensors: a captured graph passes their addresses in device memory (q_at, o_at), so
// one graph serves tensors that move between steps. Read where used (no copy of the arguments: a
// modified copy would live in registers instead of the constant bank).
__device__ __forceinline__ const void* q_of(const DecodeArgs& a) { return a.q_at ? *a.q_at : a.q; }
__device__ __forceinline__ void* o_of(const DecodeArgs& a) { return a.o_at ? a.o_at[0] : a.o; }
__device__ __forceinline__ float* lse_of(const DecodeArgs& a) {
  return a.o_at ? static_cast<float*>(a.o_at[1]) : a.lse;
}

// First element of the page holding token t of sequence b.
template <typename T>
__device__ __forceinline__ const T* page_of(const DecodeArgs& a, int b, int t) {
  const auto* tab = reinterpret_cast<const unsigned long long*>(a.pages);
  return reinterpret_cast<const T*>(__ldg(tab + (int64_t(b) * a.max_pages + (t >> a.page_shift))));
}

// Row pointer shared by shuffle from the lane that owns the row.
template <typename T>
__device__ __forceinline__ const T* shfl_ptr(const T* p, int src_lane) {
  return reinterpret_cast<const T*>(
      __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(p), src_lane));
}

template <int D>
struct Geo {
  static constexpr int TPR = D / 8;     // lanes per key row
  static constexpr int RPP = 32 / TPR;  // rows per warp copy
  static constexpr int ROWS = 4;        // copies per tile per lane
  static constexpr int R = RPP * ROWS;  // keys per warp tile (<= 16 <= P: a tile is in one page)
};

template <typename T, int D, int GT, int NW, int STAGES>
constexpr int decode_smem_bytes() {
  constexpr int pipe = NW * STAGES * 2 * Geo<D>::R * D * int(sizeof(T));
  constexpr int red = NW * GT * (D + 2) * 4;
  return pipe > red ? pipe : red;
}

// Final step of a chunk CTA: red_m/red_l [NW*GT] and red_acc [NW*GT, D] (at the start of shared
// memory, filled by every warp, barrier done) are merged over the warps and written out, either
// as the final output (direct) or as this chunk's normalized partial. Heads past the group
// are skipped.
template <typename T, int D, int GT, int NW>
__device__ __forceinline__ void cta_epilogue(const DecodeArgs& a, const float* red_m,
                                             const float* red_l, const float* red_acc, int b,
                                             int kvh, int g0, int split) {
  for (int e = threadIdx.x; e < GT * D; e += NW * 32) {
    const int g = e / D, dim = e % D;
    if (g0 + g >= a.G) continue;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, red_m[w * GT + g]);
    float L = 0.f, O = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = exp2f(red_m[w * GT + g] - M);
        L += red_l[w * GT + g] * f;
        O += red_acc[(w * GT + g) * D + dim] * f;
      }
    }
    const bool empty = !(L > 0.f);
    const float ov = empty ? 0.f : O / L;
    const float lv2 = empty ? -INFINITY : M + log2f(L);  // base 2
    const float lv = lv2 * kLn2;
    const int64_t row = int64_t(b) * a.Hq + kvh * a.G + g0 + g;
    if (a.direct) {
      if (a.o_f32) static_cast<float*>(o_of(a))[row * D + dim] = ov;
      else static_cast<T*>(o_of(a))[row * D + dim] = Cvt<T>::from(ov);
      if (dim == 0) lse_of(a)[row] = a.lse_base2 ? lv2 : lv;
    } else {
      a.o_part[(row * a.nsplit + split) * D + dim] = ov;
      if (dim == 0) a.lse_part[row * a.nsplit + split] = lv;
    }
  }
}

// A CTA whose chunk is empty (start >= end): in direct mode it still owns the final output.
template <typename T, int D, int GT, int NW>
__device__ __forceinline__ void cta_write_empty(const DecodeArgs& a, int b, int kvh, int g0) {
  if (!a.direct) return;  // split mode: the merge kernel ignores chunks past the length
  for (int e = threadIdx.x; e < GT * D; e += NW * 32) {
    const int g = e / D, dim = e % D;
    if (g0 + g >= a.G) continue;
    const int64_t row = int64_t(b) * a.Hq + kvh * a.G + g0 + g;
    if (a.o_f32) static_cast<float*>(o_of(a))[row * D + dim] = 0.f;
    else static_cast<T*>(o_of(a))[row * D + dim] = Cvt<T>::from(0.f);
    if (dim == 0) lse_of(a)[row] = -INFINITY;
  }
}

// Key source of one CTA: which tokens its chunk holds and where their rows are. Shared by both
// decode kernels. A warp tile is R consecutive chunk slots starting at an R-aligned slot tb; lane
// i < R owns slot tb + i for the gathered lookups.
template <typename T, int D, bool GATHER, int R>
struct KeySource {
  const DecodeArgs& a;
  int b, head_off, pmask, tstride;
  const int32_t* idx;  // gathered: this CTA's list
  int end;             // chunk end (exclusive), clamped to the length / count

  // Gathered: the lane's token index of the tile at tb, -1 past `bound` or for lanes >= R.
  __device__ __forceinline__ int load_index(int tb, int lane, int bound) const {
    const int s = tb + lane;
    return (lane < R && s < bound) ? __ldg(idx + s) : -1;
  }
  // Gathered: the lane's row pointer (K half) for token index ix, nullptr for ix < 0.
  __device__ __forceinline__ const T* row_of(int ix) const {
    return ix >= 0 ? page_of<T>(a, b, ix) + head_off + (ix & pmask) * tstride : nullptr;
  }
  // Dense: the page of the tile at tb (tb < end).
  __device__ __forceinline__ const T* tile_page(int tb) const { return page_of<T>(a, b, tb); }
  // Source of tile row `row`: dense from the tile's page, gathered from the owning lane.
  // Returns false when the row is past the chunk (then *src is a readable dummy, not read).
  __device__ __forceinline__ bool row_src(int tb, int row, const T* pg_or_rowp, const T** src) const {
    if constexpr (GATHER) {
      const T* p = shfl_ptr(pg_or_rowp, row);
      *src = p ? p : static_cast<const T*>(a.q);
      return p != nullptr;
    } else {
      const int t = tb + row;
      *src = pg_or_rowp + head_off + (t & pmask) * tstride;  // inside the page even past `end`
      return t < end;
    }
  }
};

// Opens a CTA's chunk [start, start + chunk) after the wait: the key count of list `lrow` (gathered)
// or of sequence b (dense), clamped; returns the chunk's end (src.end). Gathered, the lane's index
// of each of the first STAGES tiles is loaded before the count arrives (every slot below
// max_tokens is readable): the count and index loads share one round trip.
template <bool GATHER, int STAGES, typename Src, typename TileBase>
__device__ __forceinline__ int open_chunk(const DecodeArgs& a, Src& src, int b, int64_t lrow, int start, int lane,
                                          TileBase tile_base, int (&ixp)[STAGES]) {
  int len;
  if constexpr (GATHER) {
    src.idx = a.indices + lrow * a.max_tokens;
    len = a.lengths[lrow];
    const int bound = min(a.max_tokens, start + a.chunk);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) ixp[s] = src.load_index(tile_base(s), lane, bound);
  } else {
    len = a.lengths[b];
  }
  len = min(max(len, 0), a.max_tokens);
  src.end = min(len, start + a.chunk);
  return src.end;
}

template <typename T, int D, int GT, bool GATHER, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32) decode_chunk_kernel(const DecodeArgs a) {
  using G_ = Geo<D>;
  constexpr int TPR = G_::TPR, RPP = G_::RPP, ROWS = G_::ROWS, R = G_::R;
  constexpr int TILE = R * D;  // elements of one K (or V) tile
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = lane % TPR, rsub = lane / TPR;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / a.ngroups, qg = blockIdx.y % a.ngroups;
  const int b = blockIdx.z;
  const int g0 = qg * GT;
  const int start = split * a.chunk;
  auto tile_base = [&](int j) { return start + (warp + j * NW) * R; };

  if (a.wait_first) pdl_wait();
  // Query heads of this CTA, pre-scaled into base 2. Heads past the group get q = 0 (discarded).
  float qr[GT][8];
  const void* const qbase = q_of(a);
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    if (g0 + g < a.G) {
      const int64_t row = int64_t(b) * a.Hq + kvh * a.G + g0 + g;
      const char* qp = static_cast<const char*>(qbase) +
                       (row * D + c * 8) * (a.q_f32 ? 4 : int64_t(sizeof(T)));
      load_q8<T>(qp, a.q_f32 != 0, a.qmul, qr[g]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) qr[g][j] = 0.f;
    }
  }

  // As a programmatic dependent launch (a.pdl) the query loads above ran while the previous kernel
  // (the KV append, the selection) finished; nothing below may be read before it has.
  pdl_wait();
  KeySource<T, D, GATHER, R> src{a, b, kvh * a.head_stride, (1 << a.page_shift) - 1, a.token_stride, nullptr, 0};
  int ixp[STAGES];  // gathered: the lane's index of the first STAGES tiles
  const int64_t lrow = a.per_q ? int64_t(b) * a.Hq + kvh * a.G + g0 : int64_t(b) * a.Hkv + kvh;
  const int end = open_chunk<GATHER, STAGES>(a, src, b, lrow, start, lane, tile_base, ixp);

  if (start >= end) {  // uniform over the CTA
    cta_write_empty<T, D, GT, NW>(a, b, kvh, g0);
    return;
  }

  const int ntiles = (end - start + R - 1) / R;
  const int my_tiles = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  T* wsm = reinterpret_cast<T*>(smem_raw) + warp * STAGES * 2 * TILE;

  // pg: dense, the tile's page; gathered, the lane's row pointer.
  auto issue = [&](int j, int stage, const T* pg) {
    const int tb = tile_base(j);
    T* ks = wsm + stage * 2 * TILE;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = r * RPP + rsub;
      const T* p;
      const bool ok = src.row_src(tb, row, pg, &p);
      cp_async16(ks + row * D + c * 8, p + c * 8, ok);
      cp_async16(ks + TILE + row * D + c * 8, ok ? p + a.v_off + c * 8 : p, ok);
    }
  };

  const T* pg_next;  // dense: page of tile j + STAGES - 1; gathered: row pointer of that tile
  int ix_next = -1;  // gathered: index of tile j + STAGES
  {
    const T* pg[STAGES];
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if constexpr (GATHER) {
        if (tile_base(s) + lane >= end) ixp[s] = -1;
        pg[s] = src.row_of(ixp[s]);
      } else {
        pg[s] = s < my_tiles ? src.tile_page(tile_base(s)) : nullptr;
      }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < my_tiles) issue(s, s, pg[s]);
      cp_async_commit();
    }
    pg_next = pg[STAGES - 1];
    if constexpr (GATHER) ix_next = src.load_index(tile_base(STAGES), lane, end);
  }

  float m[GT], l[GT], acc[GT][8];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  }

  for (int j = 0; j < my_tiles; ++j) {
    __syncwarp();  // the stage refilled below was read in iteration j-1
    const int jn = j + STAGES - 1;
    if (jn < my_tiles) issue(jn, jn % STAGES, pg_next);
    cp_async_commit();
    // Look-ups for the next tiles: their latency hides behind this tile's arithmetic.
    if constexpr (GATHER) {
      pg_next = src.row_of(ix_next);
      ix_next = src.load_index(tile_base(jn + 2), lane, end);
    } else {
      if (jn + 1 < my_tiles) pg_next = src.tile_page(tile_base(jn + 1));
    }
    cp_async_wait<STAGES - 1>();  // tile j's group has landed (each lane reads only its own copies)

    const T* ks = wsm + (j % STAGES) * 2 * TILE;
    const T* vs = ks + TILE;
    const int tb = tile_base(j);

    float s[ROWS][GT];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float kf[8];
      Cvt<T>::f32x8(*reinterpret_cast<const uint4*>(ks + (r * RPP + rsub) * D + c * 8), kf);
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float t = qr[g][0] * kf[0];
#pragma unroll
        for (int e = 1; e < 8; ++e) t = fmaf(qr[g][e], kf[e], t);
        s[r][g] = t;
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int g = 0; g < GT; ++g)
#pragma unroll
        for (int off = TPR / 2; off > 0; off >>= 1)
          s[r][g] += __shfl_xor_sync(0xffffffffu, s[r][g], off);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (tb + r * RPP + rsub >= end)
#pragma unroll
        for (int g = 0; g < GT; ++g) s[r][g] = -INFINITY;

#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float tmax = s[0][g];
#pragma unroll
      for (int r = 1; r < ROWS; ++r) tmax = fmaxf(tmax, s[r][g]);
      const float mn = fmaxf(m[g], tmax);
      const float mu = mn == -INFINITY ? 0.f : mn;
      if (mn > m[g]) {  // rescale only when the running max grows (rare after the first tiles)
        const float corr = fast_exp2(m[g] - mu);
        l[g] *= corr;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] *= corr;
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        s[r][g] = fast_exp2(s[r][g] - mu);
        l[g] += s[r][g];
      }
      m[g] = mn;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float vf[8];
      Cvt<T>::f32x8(*reinterpret_cast<const uint4*>(vs + (r * RPP + rsub) * D + c * 8), vf);
#pragma unroll
      for (int g = 0; g < GT; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(s[r][g], vf[e], acc[g][e]);
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();

  // Merge the RPP row groups of the warp (lanes c, c+TPR, ...): butterfly, every lane ends merged.
#pragma unroll
  for (int off = TPR; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float mu = mn == -INFINITY ? 0.f : mn;
      const float ca = exp2f(m[g] - mu), cb = exp2f(mo - mu);
      l[g] = l[g] * ca + lo * cb;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        acc[g][e] = acc[g][e] * ca + __shfl_xor_sync(0xffffffffu, acc[g][e], off) * cb;
      m[g] = mn;
    }
  }

  // Merge the warps through shared memory (the pipeline buffers are free now).
  __syncthreads();
  float* red_m = reinterpret_cast<float*>(smem_raw);
  float* red_l = red_m + NW * GT;
  float* red_acc = red_l + NW * GT;
  if (rsub == 0) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red_acc[(warp * GT + g) * D + c * 8 + e] = acc[g][e];
      if (c == 0) {
        red_m[warp * GT + g] = m[g];
        red_l[warp * GT + g] = l[g];
      }
    }
  }
  __syncthreads();
  cta_epilogue<T, D, GT, NW>(a, red_m, red_l, red_acc, b, kvh, g0, split);
}

template <typename T, int D, bool GATHER, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32) decode_chunk_mma_kernel(const DecodeArgs a) {
  constexpr int GT = 8;          // query heads per CTA (MMA rows 0..7)
  constexpr int R = 16;          // keys per warp tile (<= P: a tile is in one page)
  constexpr int TILE = R * D;    // elements of one K (or V) tile
  constexpr int CPR = D / 8;     // 16-byte chunks per row
  constexpr int RPP = 32 / CPR;  // rows per copy pass
  constexpr int PASSES = R / RPP;
  constexpr int KS = D / 16;     // k-steps of QK^T
  constexpr int NB = D / 8;      // 8-wide output column blocks of PV
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int qr_ = lane >> 2, qc = lane & 3;  // fragment row / column pair
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / a.ngroups, qg = blockIdx.y % a.ngroups;
  const int b = blockIdx.z;
  const int g0 = qg * GT;
  const int start = split * a.chunk;
  auto tile_base = [&](int j) { return start + (warp + j * NW) * R; };

  if (a.wait_first) pdl_wait();
  // A fragments of q (pre-scaled into base 2), hi and lo parts; head g0 + qr_ (zero past G).
  uint32_t qa_hi[KS][2], qa_lo[KS][2];
  {
    const bool live = g0 + qr_ < a.G;
    const int64_t row = int64_t(b) * a.Hq + kvh * a.G + g0 + min(qr_, a.G - 1 - g0);
    const void* const qbase = q_of(a);
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
        split2<T>(x0, x1, qa_hi[ks][h], qa_lo[ks][h]);
      }
  }

  pdl_wait();  // a programmatic dependent launch: the query setup above overlapped the previous kernel
  KeySource<T, D, GATHER, R> src{a, b, kvh * a.head_stride, (1 << a.page_shift) - 1, a.token_stride, nullptr, 0};
  int ixp[STAGES];  // gathered: the lane's index of the first STAGES tiles
  // Per-KV-head lists only (per-query-head lists run the CUDA-core kernel with GT = 1).
  const int end = open_chunk<GATHER, STAGES>(a, src, b, int64_t(b) * a.Hkv + kvh, start, lane, tile_base, ixp);
  if (start >= end) {
    cta_write_empty<T, D, GT, NW>(a, b, kvh, g0);
    return;
  }

  const int ntiles = (end - start + R - 1) / R;
  const int my_tiles = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  T* wsm = reinterpret_cast<T*>(smem_raw) + warp * STAGES * 2 * TILE;
  const int cc = lane % CPR, r0 = lane / CPR;

  // pg: dense, the tile's page; gathered, the lane's row pointer.
  auto issue = [&](int j, int stage, const T* pg) {
    const int tb = tile_base(j);
    T* ks = wsm + stage * 2 * TILE;
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int row = p * RPP + r0;
      const T* sp;
      const bool ok = src.row_src(tb, row, pg, &sp);
      const int dst = row * D + ((cc ^ (row & 7)) * 8);
      cp_async16(ks + dst, sp + cc * 8, ok);
      cp_async16(ks + TILE + dst, ok ? sp + a.v_off + cc * 8 : sp, ok);
    }
  };

  const T* pg_next;  // dense: page of tile j + STAGES - 1; gathered: row pointer of that tile
  int ix_next = -1;  // gathered: index of tile j + STAGES
  {
    const T* pg[STAGES];
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if constexpr (GATHER) {
        if (tile_base(s) + lane >= end) ixp[s] = -1;
        pg[s] = src.row_of(ixp[s]);
      } else {
        pg[s] = s < my_tiles ? src.tile_page(tile_base(s)) : nullptr;
      }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < my_tiles) issue(s, s, pg[s]);
      cp_async_commit();
    }
    pg_next = pg[STAGES - 1];
    if constexpr (GATHER) ix_next = src.load_index(tile_base(STAGES), lane, end);
  }

  float m = -INFINITY, l = 0.f;  // head g0 + qr_; l is this lane's partial sum (quad-reduced at end)
  float acc[NB][2];
#pragma unroll
  for (int j = 0; j < NB; ++j) acc[j][0] = acc[j][1] = 0.f;

  for (int j = 0; j < my_tiles; ++j) {
    __syncwarp();  // every lane is done reading the stage refilled below
    const int jn = j + STAGES - 1;
    if (jn < my_tiles) issue(jn, jn % STAGES, pg_next);
    cp_async_commit();
    if constexpr (GATHER) {
      pg_next = src.row_of(ix_next);
      ix_next = src.load_index(tile_base(jn + 2), lane, end);
    } else {
      if (jn + 1 < my_tiles) pg_next = src.tile_page(tile_base(jn + 1));
    }
    cp_async_wait<STAGES - 1>();
    __syncwarp();  // other lanes' copies of tile j are visible to this lane's ldmatrix

    const T* ks = wsm + (j % STAGES) * 2 * TILE;
    const T* vs = ks + TILE;
    const int tb = tile_base(j);

    // S = Q K^T for 2 blocks of 8 keys: sc[nb] = scores of keys nb*8 + 2qc, +1 for head qr_.
    float sc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk) {
        const int row = nb * 8 + (lane & 7);
        const int chunk = 4 * kk + (lane >> 3);
        uint32_t x0, x1, x2, x3;
        ldsm_x4(ks + row * D + ((chunk ^ (lane & 7)) * 8), x0, x1, x2, x3);
        Mma<T>::mma(sc[nb], qa_hi[2 * kk][0], qa_hi[2 * kk][1], x0, x1);
        Mma<T>::mma(sc[nb], qa_lo[2 * kk][0], qa_lo[2 * kk][1], x0, x1);
        Mma<T>::mma(sc[nb], qa_hi[2 * kk + 1][0], qa_hi[2 * kk + 1][1], x2, x3);
        Mma<T>::mma(sc[nb], qa_lo[2 * kk + 1][0], qa_lo[2 * kk + 1][1], x2, x3);
      }
    float s4[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = tb + (i >> 1) * 8 + qc * 2 + (i & 1);
      if (tok >= end) s4[i] = -INFINITY;
    }
    float tmax = fmaxf(fmaxf(s4[0], s4[1]), fmaxf(s4[2], s4[3]));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    const float mn = fmaxf(m, tmax);
    const float mu = mn == -INFINITY ? 0.f : mn;
    if (mn > m) {
      const float corr = fast_exp2(m - mu);
      l *= corr;
#pragma unroll
      for (int jb = 0; jb < NB; ++jb) {
        acc[jb][0] *= corr;
        acc[jb][1] *= corr;
      }
    }
    m = mn;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s4[i] = fast_exp2(s4[i] - mu);
      l += s4[i];
    }
    // P as the A operand: keys 2qc,+1 (block 0) and 8+2qc,+1 (block 1) of row qr_.
    uint32_t pa_hi0, pa_lo0, pa_hi2, pa_lo2;
    split2<T>(s4[0], s4[1], pa_hi0, pa_lo0);
    split2<T>(s4[2], s4[3], pa_hi2, pa_lo2);
#pragma unroll
    for (int jj = 0; jj < NB / 2; ++jj) {
      const int trow = ((lane >> 3) & 1) * 8 + (lane & 7);
      const int chunk = 2 * jj + (lane >> 4);
      uint32_t y0, y1, y2, y3;
      ldsm_x4_trans(vs + trow * D + ((chunk ^ (lane & 7)) * 8), y0, y1, y2, y3);
      Mma<T>::mma(acc[2 * jj], pa_hi0, pa_hi2, y0, y1);
      Mma<T>::mma(acc[2 * jj], pa_lo0, pa_lo2, y0, y1);
      Mma<T>::mma(acc[2 * jj + 1], pa_hi0, pa_hi2, y2, y3);
      Mma<T>::mma(acc[2 * jj + 1], pa_lo0, pa_lo2, y2, y3);
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  __syncthreads();
  float* red_m = reinterpret_cast<float*>(smem_raw);
  float* red_l = red_m + NW * GT;
  float* red_acc = red_l + NW * GT;
#pragma unroll
  for (int jb = 0; jb < NB; ++jb) {
    red_acc[(warp * GT + qr_) * D + jb * 8 + qc * 2] = acc[jb][0];
    red_acc[(warp * GT + qr_) * D + jb * 8 + qc * 2 + 1] = acc[jb][1];
  }
  if (qc == 0) {
    red_m[warp * GT + qr_] = m;
    red_l[warp * GT + qr_] = l;
  }
  __syncthreads();
  cta_epilogue<T, D, GT, NW>(a, red_m, red_l, red_acc, b, kvh, g0, split);
}

template <typename T, int D, int NW, int STAGES>
constexpr int mma_smem_bytes() {
  constexpr int pipe = NW * STAGES * 2 * 16 * D * int(sizeof(T));
  constexpr int red = NW * 8 * (D + 2) * 4;
  return pipe > red ? pipe : red;
}
// How the merge kernel finds a row's key count: dense lengths [B], per-KV-head counts [B, Hkv],
// per-query-head counts [B, Hq].
enum ListMode : int { kDense = 0, kPerKvHead = 1, kPerQHead = 2 };

// (m, l) pairs of a log-sum-exp in pieces: the sum of e^(x - m) over a set is l; -inf, 0 is empty.
__device__ __forceinline__ void lse_combine(float& m, float& l, float m2, float l2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;  // both empty
  l = l * expf(m - M) + l2 * expf(m2 - M);
  m = M;
}

// Combines the chunk partials of one (sequence, query head) row. grid B*Hq, block 128. It runs as
// the chunk kernel's programmatic dependent: its CTAs wait at pdl_wait for the partials, so what
// follows is the merge's whole latency. Every load goes out at once (the row's key count, one lse
// per thread for the row's LSE, and the lse and o partial of this thread's first U splits; slots
// past the count hold stale values and are masked once the count is known), the LSE is reduced
// in (max, sum) pairs by shuffles and one shared-memory exchange, then the weighted sum.
template <typename T, int D>
__global__ void __launch_bounds__(128) decode_merge_kernel(const DecodeArgs a, int mode) {
  constexpr int TPRm = D / 4, P = 128 / TPRm, U = 8;
  __shared__ float2 red[4];
  __shared__ float4 part[128];
  pdl_wait();  // the chunk kernel's partials are complete and visible past this point
  const int64_t row = blockIdx.x;
  const int b = int(row / a.Hq), h = int(row % a.Hq);
  const int tid = threadIdx.x, cc = tid % TPRm, pr = tid / TPRm;
  const int raw_len = mode == kDense      ? a.lengths[b]
                      : mode == kPerKvHead ? a.lengths[b * a.Hkv + h / a.G]
                                           : a.lengths[row];
  const float* lp = a.lse_part + row * a.nsplit;
  const float4* op = reinterpret_cast<const float4*>(a.o_part + row * a.nsplit * D);
  const float lt = tid < a.nsplit ? lp[tid] : -INFINITY;
  float ls[U];
  float4 x[U];
#pragma unroll
  for (int i = 0; i < U; ++i) {
    const int s = pr + P * i;
    if (s < a.nsplit) {
      ls[i] = lp[s];
      x[i] = op[s * TPRm + cc];
    } else {
      ls[i] = -INFINITY;
      x[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  const int len = min(max(raw_len, 0), a.max_tokens);
  const int ns = min((len + a.chunk - 1) / a.chunk, a.nsplit);

  float m = tid < ns ? lt : -INFINITY, l = m == -INFINITY ? 0.f : 1.f;
  for (int s = tid + 128; s < ns; s += 128) lse_combine(m, l, lp[s], 1.f);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
    lse_combine(m, l, m2, l2);
  }
  if ((tid & 31) == 0) red[tid >> 5] = make_float2(m, l);
  __syncthreads();
  m = red[0].x;
  l = red[0].y;
#pragma unroll
  for (int w = 1; w < 4; ++w) lse_combine(m, l, red[w].x, red[w].y);
  // The prior state (Output::prior_*) is one more part of the softmax.
  const float prior = a.prior_lse ? a.prior_lse[row] : -INFINITY;
  if (prior != -INFINITY) lse_combine(m, l, prior, 1.f);
  const bool empty = !(l > 0.f);
  const float lse = empty ? -INFINITY : m + logf(l);

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float lsv, const float4& v) {
    const float w = expf(lsv - lse);
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
  };
  if (!empty) {
#pragma unroll
    for (int i = 0; i < U; ++i)
      if (pr + P * i < ns) add(ls[i], x[i]);
    for (int s = pr + P * U; s < ns; s += P) add(lp[s], op[s * TPRm + cc]);  // more than U * P splits
    if (pr == 0 && prior != -INFINITY) add(prior, reinterpret_cast<const float4*>(a.prior_o + row * D)[cc]);
  }
  part[tid] = acc;
  __syncthreads();
  if (pr == 0) {
    for (int p = 1; p < P; ++p) {
      const float4 y = part[p * TPRm + cc];
      acc.x += y.x; acc.y += y.y; acc.z += y.z; acc.w += y.w;
    }
    if (a.o_f32) {
      reinterpret_cast<float4*>(static_cast<float*>(o_of(a)) + row * D)[cc] = acc;
    } else {
      T* o = static_cast<T*>(o_of(a)) + row * D + cc * 4;
      o[0] = Cvt<T>::from(acc.x);
      o[1] = Cvt<T>::from(acc.y);
      o[2] = Cvt<T>::from(acc.z);
      o[3] = Cvt<T>::from(acc.w);
    }
    if (tid == 0) lse_of(a)[row] = a.lse_base2 ? lse * kLog2e : lse;
  }
}

// ---- kernel configurations and launch --------------------------------------------------------
// Benchmark knob (bf16 dense only): 0 = the default selection below; 1 = CUDA-core kernel with
// 4 warps x 4 stages for every group size (the first version); 2 / 3 = tensor-core kernel with
// 4 warps x 3 / 4 stages for every group size (d = 256: 2 warps x 4 stages for 3, as 4 x 4
// exceeds the shared memory of an SM).
constexpr int kNumVariants = 4;
std::atomic<int> g_variant{0};
std::atomic<bool> g_merge_pdl{true};
std::atomic<bool> g_pdl_wait_first{false};  // detail::set_pdl_wait_first
std::atomic<int> g_min_chunk{kMinChunk};  // fewest keys a split is worth (benchmark knob)
constexpr int kNumGatherVariants = 6;
std::atomic<int> g_gather_variant{0};  // gathered bf16, d 128, G 4: pipeline shape (benchmark knob)

// CTAs per SM (> 0) for kernel fn, or -cudaError_t. Set up once per instantiation and process
// (assumes every GPU in the process is the same model).
template <typename Fn>
int setup_occupancy(Fn fn, int threads, int smem) {
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return -int(e);
  int n = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, smem);
  if (e != cudaSuccess) return -int(e);
  return std::max(n, 1);
}

// CUDA-core kernel: GT query heads per CTA.
template <typename T, int D, int GT, bool GATHER, int NW, int STAGES>
struct DecodeKernel {
  static constexpr int kGroupTile = GT;
  static constexpr int kThreads = NW * 32;
  static constexpr int kSmem = decode_smem_bytes<T, D, GT, NW, STAGES>();
  static constexpr int kTileTokens = Geo<D>::R * NW;
  static constexpr const char* kName = "decode_chunk_kernel";
  static constexpr void (*kernel)(DecodeArgs) = decode_chunk_kernel<T, D, GT, GATHER, NW, STAGES>;
  static int occupancy() {
    static const int occ = setup_occupancy(kernel, kThreads, kSmem);
    return occ;
  }
};

// Tensor-core kernel: 8 query heads per CTA (fewer are padded).
template <typename T, int D, bool GATHER, int NW, int STAGES>
struct MmaDecodeKernel {
  static constexpr int kGroupTile = 8;
  static constexpr int kThreads = NW * 32;
  static constexpr int kSmem = mma_smem_bytes<T, D, NW, STAGES>();
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA exceeds the SM's");
  static constexpr int kTileTokens = 16 * NW;
  static constexpr const char* kName = "decode_chunk_mma_kernel";
  static constexpr void (*kernel)(DecodeArgs) = decode_chunk_mma_kernel<T, D, GATHER, NW, STAGES>;
  static int occupancy() {
    static const int occ = setup_occupancy(kernel, kThreads, kSmem);
    return occ;
  }
};

// The kernel used for (T, D, group tile, gather) under the current variant; calls f(K{}).
// Defaults, from the side-by-side runs in docs/perf.md: dense decode runs the tensor-core
// kernel for groups of 3+ heads (G=4: 141 vs 148 us, G=8: 143 vs 231 us at 128K on an H200) and
// the CUDA-core one (8 warps x 3 stages) for G <= 2 (MHA: 483 vs 491 us); the tensor-core kernel
// runs 4 warps x 4 stages for d <= 128 (paged, 128K, G=4 on an H100: 194.9 vs 197.3 us with
// pages of 256, 201.4 vs 205.7 with pages of 16, against 4 x 3) and 4 x 3 for d = 256 (4 x 4
// would exceed an SM's shared memory). Gathered decode runs the CUDA-core kernel (4 x 4) for groups
// of 1 or 2 heads (and for per-query-head lists, GT = 1), the tensor-core kernel with 4 warps x 2
// stages for 4 (5% of 128K and 512K in 16-token runs on an H100: 26.9 vs 30.4 and 60.7 vs 64.3 us
// against the CUDA-core 4 x 4, the best of six shapes, bench/cuda_sdpa_compare.py --gathered-only)
// and 4 x 3 for 8.
template <typename T, int D, int GT, bool GATHER, typename F>
Status with_kernel(F&& f) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && !GATHER) {
    switch (g_variant.load(std::memory_order_relaxed)) {
      case 1: return f(DecodeKernel<T, D, GT, GATHER, 4, 4>{});
      case 2: return f(MmaDecodeKernel<T, D, GATHER, 4, 3>{});
      case 3: return f(MmaDecodeKernel<T, D, GATHER, (D == 256 ? 2 : 4), 4>{});
      default: break;
    }
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16> && GATHER && D == 128 && GT == 4) {
    switch (g_gather_variant.load(std::memory_order_relaxed)) {  // benchmark knob: pipeline shapes
      case 1: return f(DecodeKernel<T, D, GT, GATHER, 4, 2>{});
      case 2: return f(DecodeKernel<T, D, GT, GATHER, 8, 2>{});
      case 3: return f(MmaDecodeKernel<T, D, GATHER, 4, 3>{});
      case 4: return f(DecodeKernel<T, D, GT, GATHER, 4, 4>{});
      case 5: return f(DecodeKernel<T, D, GT, GATHER, 2, 4>{});
      default: break;
    }
  }
  if constexpr (GATHER) {
    if constexpr (GT == 8) return f(MmaDecodeKernel<T, D, GATHER, 4, 3>{});
    else if constexpr (GT == 4) return f(MmaDecodeKernel<T, D, GATHER, 4, 2>{});
    else return f(DecodeKernel<T, D, GT, GATHER, 4, 4>{});
  } else {
    if constexpr (GT >= 4) return f(MmaDecodeKernel<T, D, GATHER, 4, (D == 256 ? 3 : 4)>{});
    else return f(DecodeKernel<T, D, GT, GATHER, 8, 3>{});
  }
}

int group_tile(int G) { return G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8; }

struct Plan {
  int nsplit, chunk;
};
Plan make_plan(int heads_ctas, int max_tokens, int sms, int occ, int tile_tokens) {
  if (max_tokens <= 0) return {1, tile_tokens};
  int ns = std::max(1, sms * occ / std::max(1, heads_ctas));  // one full wave, never more
  const int min_chunk = g_min_chunk.load(std::memory_order_relaxed);
  ns = std::min(ns, std::max(1, (max_tokens + min_chunk - 1) / min_chunk));
  ns = std::min(ns, kMaxSplits);
  int chunk = (max_tokens + ns - 1) / ns;
  chunk = (chunk + tile_tokens - 1) / tile_tokens * tile_tokens;
  ns = (max_tokens + chunk - 1) / chunk;
  return {ns, chunk};
}

// Partials of nsplit splits (none when one split writes the output directly: nsplit 1, no prior).
size_t split_bytes(const AttnShape& s, int nsplit, bool prior = false) {
  if (nsplit <= 1 && !prior) return 0;
  nsplit = std::max(nsplit, 1);
  const size_t rows = size_t(s.batch) * s.num_q_heads;
  return align_up(rows * nsplit * s.head_dim * 4, 256) + align_up(rows * nsplit * 4, 256);
}

Status check_shape(const AttnShape& s) {
  if (s.batch < 1) return invalid("batch must be >= 1");
  if (s.num_kv_heads < 1) return invalid("num_kv_heads must be >= 1");
  if (s.num_q_heads < 1 || s.num_q_heads % s.num_kv_heads != 0)
    return invalid("num_q_heads must be a positive multiple of num_kv_heads");
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256)
    return unsupported("head_dim must be 64, 128 or 256");
  if (!(std::isfinite(s.scale))) return invalid("scale must be finite");
  if (s.batch > 65535) return unsupported("batch must be <= 65535");
  if (s.num_q_heads > 65535) return unsupported("num_q_heads must be <= 65535");
  return {};
}

template <typename K, typename T, int D>
Status launch_decode(DecodeArgs a, const AttnShape& s, const Workspace& ws, cudaStream_t st,
                     int mode) {
  a.ngroups = (a.G + K::kGroupTile - 1) / K::kGroupTile;
  const int occ = K::occupancy();
  if (occ < 0) return cuda_fail(cudaError_t(-occ), "decode kernel setup");
  int sms = 0;
  Status e = sm_count(&sms);
  if (!e.ok()) return e;
  const int heads_ctas = s.batch * s.num_kv_heads * a.ngroups;
  const Plan p = make_plan(heads_ctas, a.max_tokens, sms, occ, K::kTileTokens);
  a.nsplit = p.nsplit;
  a.chunk = p.chunk;
  a.direct = p.nsplit == 1 && !a.prior_lse;
  if (!a.direct) {
    const size_t need = split_bytes(s, p.nsplit, a.prior_lse != nullptr);
    if (ws.ptr == nullptr || ws.bytes < need) return invalid("workspace too small (ask *_workspace_bytes)");
    const size_t rows = size_t(s.batch) * s.num_q_heads;
    a.o_part = static_cast<float*>(ws.ptr);
    a.lse_part = reinterpret_cast<float*>(static_cast<char*>(ws.ptr) +
                                          align_up(rows * p.nsplit * s.head_dim * 4, 256));
  }
  if (s.num_kv_heads * a.ngroups > 65535) return unsupported("num_kv_heads too large");
  KVS_CUDA_TRY(launch_kernel(K::kernel, dim3(p.nsplit, s.num_kv_heads * a.ngroups, s.batch), dim3(K::kThreads),
                             K::kSmem, st, a.pdl != 0, 1, a),
               K::kName);
  if (!a.direct) {
    const unsigned rows = unsigned(s.batch) * unsigned(s.num_q_heads);
    // A programmatic dependent launch (unless detail::set_merge_pdl(false)): the merge grid is
    // launched while the chunk grid drains.
    KVS_CUDA_TRY(launch_kernel(decode_merge_kernel<T, D>, dim3(rows), dim3(128), 0, st,
                               g_merge_pdl.load(std::memory_order_relaxed), 1, a, mode),
                 "decode_merge_kernel launch");
  }
  return {};
}

template <typename T, int D, int GT, bool GATHER>
Status pick_variant(const DecodeArgs& a, const AttnShape& s, const Workspace& ws, cudaStream_t st,
                    int mode) {
  return with_kernel<T, D, GT, GATHER>([&](auto k) {
    return launch_decode<decltype(k), T, D>(a, s, ws, st, mode);
  });
}

template <typename T, bool GATHER>
Status dispatch_dim(const DecodeArgs& a, const AttnShape& s, const Workspace& ws, cudaStream_t st) {
  const int mode = !GATHER ? kDense : a.per_q ? kPerQHead : kPerKvHead;
  const int gt = mode == kPerQHead ? 1 : group_tile(a.G);
#define KVS_CASE(D_, GT_) \
  if (s.head_dim == D_ && gt == GT_) return pick_variant<T, D_, GT_, GATHER>(a, s, ws, st, mode);
  KVS_CASE(64, 1) KVS_CASE(64, 2) KVS_CASE(64, 4) KVS_CASE(64, 8)
  KVS_CASE(128, 1) KVS_CASE(128, 2) KVS_CASE(128, 4) KVS_CASE(128, 8)
  KVS_CASE(256, 1) KVS_CASE(256, 2) KVS_CASE(256, 4) KVS_CASE(256, 8)
#undef KVS_CASE
  return unsupported("head_dim must be 64, 128 or 256");
}

Status decode_common(const AttnShape& s, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                     const int32_t* lens, const int32_t* indices, int32_t max_tokens,
                     const Output& out, const Workspace& ws, void* stream, bool gather,
                     bool per_q, bool pdl) {
  Status e = check_shape(s);
  if (!e.ok()) return e;
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("KV dtype must be BF16 or F16");
  if (q.dtype != Scalar::F32 && q.dtype != kv_dtype) return invalid("query dtype must be F32 or the KV dtype");
  if (out.dtype != Scalar::F32 && out.dtype != kv_dtype) return invalid("output dtype must be F32 or the KV dtype");
  if ((!q.data && !q.at) || (!out.o && !out.at) || (!out.lse && !out.at)) return invalid("q, o and lse must be non-null");
  if (reinterpret_cast<uintptr_t>(q.data) % 16 != 0) return invalid("q must be 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(out.o) % 16 != 0) return invalid("o must be 16-byte aligned");
  if (max_tokens < 0) return invalid("max length / max selected must be >= 0");
  if (!lens) return invalid("lengths/counts must be non-null");
  if (!out.prior_o != !out.prior_lse) return invalid("prior_o and prior_lse must be both set or both null");
  if (reinterpret_cast<uintptr_t>(out.prior_o) % 16 != 0) return invalid("prior_o must be 16-byte aligned");
  if (max_tokens > 0) {
    if (!kv.pages) return invalid("kv.pages must be non-null");
    if (gather && !indices) return invalid("indices must be non-null");
    const int32_t P = kv.page_tokens;
    if (P < 16 || P > 1024 || (P & (P - 1)) != 0) return invalid("page_tokens must be a power of two in [16, 1024]");
    if (kv.page_shift < 0 || kv.page_shift > 30 || (int32_t(1) << kv.page_shift) != P)
      return invalid("page_shift must be log2(page_tokens)");
    if (kv.max_pages < 1) return invalid("max_pages must be >= 1");
    if (2 * int64_t(s.num_kv_heads) * P * s.head_dim >= (int64_t(1) << 31))
      return unsupported("a page must hold < 2^31 elements");
    if (kv.v_off % 8 != 0) return invalid("kv.v_off must be a multiple of 8 elements (16 bytes)");
    if (!gather && int64_t(max_tokens) > int64_t(kv.max_pages) * P)
      return invalid("max_length must be <= max_pages * page_tokens");
  }

  DecodeArgs a{};
  a.q = q.data;
  a.q_f32 = q.dtype == Scalar::F32;
  a.pages = kv.pages;
  a.max_pages = kv.max_pages;
  a.page_shift = max_tokens > 0 ? kv.page_shift : 4;
  if (max_tokens > 0) {
    const KvStrides ks = kv_strides(kv, s.num_kv_heads, s.head_dim);
    a.head_stride = int32_t(ks.head);
    a.token_stride = int32_t(ks.token);
    a.v_off = ks.v;
  }
  a.lengths = lens;
  a.indices = indices;
  a.max_tokens = max_tokens;
  a.per_q = gather && per_q;
  a.B = s.batch;
  a.Hq = s.num_q_heads;
  a.Hkv = s.num_kv_heads;
  a.G = s.num_q_heads / s.num_kv_heads;
  a.qmul = s.scale * kLog2e;  // a.ngroups is set by the launcher from its kernel's group tile
  a.o = out.o;
  a.o_f32 = out.dtype == Scalar::F32;
  a.lse = out.lse;
  a.lse_base2 = out.lse_base2;
  a.prior_o = out.prior_o;
  a.prior_lse = out.prior_lse;
  a.q_at = q.at;
  a.o_at = out.at;
  a.pdl = pdl;
  a.wait_first = g_pdl_wait_first.load(std::memory_order_relaxed);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (kv_dtype == Scalar::BF16)
    return gather ? dispatch_dim<__nv_bfloat16, true>(a, s, ws, st)
                  : dispatch_dim<__nv_bfloat16, false>(a, s, ws, st);
  return gather ? dispatch_dim<__half, true>(a, s, ws, st) : dispatch_dim<__half, false>(a, s, ws, st);
}

// Upper bound of split_bytes over every kernel choice: the most splits come with the fewest CTAs
// per head (ceil(G/8) query groups, or Hq lists) and the highest occupancy; rounding a chunk up
// to a tile only lowers the count, so the unrounded plan (tile 1) bounds it.
size_t decode_ws_bound(const AttnShape& s, int32_t max_tokens, bool per_q, bool prior = false) {
  if (!check_shape(s).ok()) return 0;
  if (max_tokens <= 0) return split_bytes(s, 1, prior);  // one (empty) split: partials only with a prior
  int sms = 0;
  if (!sm_count(&sms).ok()) return 0;
  const int G = s.num_q_heads / s.num_kv_heads;
  const int heads_ctas = per_q ? s.batch * s.num_q_heads : s.batch * s.num_kv_heads * ((G + 7) / 8);
  const Plan p = make_plan(heads_ctas, max_tokens, sms, kMaxCtasPerSm, 1);
  return split_bytes(s, p.nsplit, prior);
}

// ---- merge of two states ---------------------------------------------------------------------
// One warp per row; lanes read both LSEs before lane 0 overwrites (in-place safe).
__global__ void __launch_bounds__(256) merge_states_kernel(const float* o_a, const float* lse_a,
                                                           const float* o_b, const float* lse_b,
                                                           float* o, float* lse, int64_t rows,
                                                           int d) {
  const int64_t row = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float la = lse_a[row], lb = lse_b[row];
  const float mx = fmaxf(la, lb);
  float wa = 0.f, wb = 0.f, l = -INFINITY;
  if (mx != -INFINITY) {
    const float ea = expf(la - mx), eb = expf(lb - mx);  // la or lb may be -inf: e = 0
    l = mx + logf(ea + eb);
    wa = expf(la - l);
    wb = expf(lb - l);
  }
  __syncwarp();
  for (int j = lane; j < d; j += 32) {
    const int64_t i = row * d + j;
    // A side with weight 0 (an empty state) is never read, so even a NaN there cannot leak.
    float v = 0.f;
    if (wa != 0.f) v += wa * o_a[i];
    if (wb != 0.f) v += wb * o_b[i];
    o[i] = v;
  }
  __syncwarp();
  if (lane == 0) lse[row] = l;
}

// Occupancy, tile and group tile of the dense kernel pick_variant would launch.
template <int D, int GT>
void plan_info(bool bf16, int* occ, int* tile, int* gtile) {
  auto f = [&](auto k) {
    using K = decltype(k);
    *occ = K::occupancy();
    *tile = K::kTileTokens;
    *gtile = K::kGroupTile;
    return Status{};
  };
  if (bf16) with_kernel<__nv_bfloat16, D, GT, false>(f);
  else with_kernel<__half, D, GT, false>(f);
}

}  // namespace

// ---- public entry points ---------------------------------------------------------------------
size_t dense_decode_workspace_bytes(const AttnShape& shape, int32_t max_length) noexcept {
  return decode_ws_bound(shape, max_length, false);
}

Status dense_decode(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                    const int32_t* lengths, int32_t max_length, const Output& out,
                    const Workspace& ws, void* stream, bool pdl) noexcept {
  if (out.prior_lse || out.prior_o) return invalid("dense_decode takes no prior state (gathered_decode does)");
  return decode_common(shape, q, kv, kv_dtype, lengths, nullptr, max_length, out, ws, stream,
                       false, false, pdl);
}

size_t gathered_decode_workspace_bytes(const AttnShape& shape, int32_t max_selected,
                                       bool per_query_head, bool with_prior) noexcept {
  return decode_ws_bound(shape, max_selected, per_query_head, with_prior);
}

Status gathered_decode(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                       const int32_t* indices, const int32_t* counts, int32_t max_selected,
                       const Output& out, const Workspace& ws, void* stream,
                       bool per_query_head, bool pdl) noexcept {
  return decode_common(shape, q, kv, kv_dtype, counts, indices, max_selected, out, ws, stream,
                       true, per_query_head, pdl);
}

Status merge_states(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b,
                    float* o, float* lse, int64_t rows, int32_t head_dim, void* stream) noexcept {
  if (rows < 0 || head_dim < 1) return invalid("rows must be >= 0 and head_dim >= 1");
  if (rows == 0) return {};
  if (!o_a || !lse_a || !o_b || !lse_b || !o || !lse) return invalid("merge_states: null pointer");
  const int64_t blocks = (rows + 7) / 8;
  if (blocks > 0x7fffffffLL) return unsupported("merge_states: too many rows");
  merge_states_kernel<<<unsigned(blocks), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      o_a, lse_a, o_b, lse_b, o, lse, rows, head_dim);
  KVS_LAUNCH_CHECK("merge_states_kernel launch");
  return {};
}

int32_t decode_num_splits(const AttnShape& s, int32_t max_tokens, Scalar kv_dtype) noexcept {
  if (!check_shape(s).ok()) return 0;
  int sms = 0;
  if (!sm_count(&sms).ok()) return 0;
  const int G = s.num_q_heads / s.num_kv_heads, gt = group_tile(G);
  int occ = 0, tile = 0, gtile = 1;
  const bool bf = kv_dtype == Scalar::BF16;
#define KVS_CASE(D_, GT_) \
  if (s.head_dim == D_ && gt == GT_) plan_info<D_, GT_>(bf, &occ, &tile, &gtile);
  KVS_CASE(64, 1) KVS_CASE(64, 2) KVS_CASE(64, 4) KVS_CASE(64, 8)
  KVS_CASE(128, 1) KVS_CASE(128, 2) KVS_CASE(128, 4) KVS_CASE(128, 8)
  KVS_CASE(256, 1) KVS_CASE(256, 2) KVS_CASE(256, 4) KVS_CASE(256, 8)
#undef KVS_CASE
  if (occ <= 0) return 0;
  const int ngroups = (G + gtile - 1) / gtile;
  return make_plan(s.batch * s.num_kv_heads * ngroups, max_tokens, sms, occ, tile).nsplit;
}

namespace detail {
bool set_dense_variant(int variant) noexcept {
  if (variant < 0 || variant >= kNumVariants) return false;
  g_variant.store(variant, std::memory_order_relaxed);
  return true;
}
bool set_gather_variant(int variant) noexcept {
  if (variant < 0 || variant >= kNumGatherVariants) return false;
  g_gather_variant.store(variant, std::memory_order_relaxed);
  return true;
}
void set_merge_pdl(bool on) noexcept { g_merge_pdl.store(on, std::memory_order_relaxed); }
void set_pdl_wait_first(bool on) noexcept { g_pdl_wait_first.store(on, std::memory_order_relaxed); }
void set_min_chunk(int32_t tokens) noexcept {
  g_min_chunk.store(tokens > 0 ? tokens : kMinChunk, std::memory_order_relaxed);
}
}  // namespace detail

}  // namespace kvs::cuda
