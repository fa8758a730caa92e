// SPDX-License-Identifier: Apache-2.0
// CSAttention's decode step on CUDA (csattention.cuh). Per step, for B sessions of TH table heads
// (a row = one session's table head):
//
//   pick     one launch: per row, one CTA finds the nearest centroid per (query head, subspace)
//            by a warp each and the distinct lists with their summed weights (on the scatter path
//            other CTAs set the row's accumulator to -0.0, "untouched"); the last CTAs run the
//            streaming update, a thread per list: tokens [ins_from, n) scored against the centroid
//            and try-inserted into the min-heap (csa::heap_try_insert), the evicted entry marked
//            dead in the list's token-ordered copy and the new token appended to it
//   reduce + top-k, fused (reduce_topk_kernel): a thread-block cluster per row, CTA r owning the
//            row's token slice r in shared memory; it reads its slice's run of every picked list
//            from the token-ordered copies (two warp searches per list), adds w * score + off with
//            shared-memory atomics, and the cluster selects the best `rest` (or rerank * rest)
//            touched keys with topk_detail::rows_select (topk_select.cuh)
//   or, when a row's slices do not fit in the cluster's shared memory (KVS_CSA_CLUSTER=0 forces it):
//   scatter  a persistent grid over (row, chunk) pairs: acc[token] += w * score + off over the
//            picked lists' entries (fp32 atomics; the CPU adds in list order, so sums may differ in
//            the last bits); `off` is the list minimum's term with missing=list_min
//   top-k    topk_rows over the accumulator rows with -0.0 ranked absent, per-row k = rest (or
//            the rerank's rerank * rest candidates)
//   rerank   (rerank > 0) exact logits of the candidates per query head, each head's softmax, the
//            summed weights, topk_rows of those
//   emit     CTAs per row over slices of the candidates, two passes (count kept, then write at the
//            slice's offset): sinks, the searched keys (untouched ones dropped; stored as the cached
//            search) or the cached keys, then the window, written ascending
//
// Every per-step value comes from the uploaded CsaSession array, so a captured step replays for
// later tokens; the grid shapes depend on host capacities only.
#include "backends/cuda/csattention.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/status.cuh"
#include "backends/cuda/topk.cuh"
#include "backends/cuda/topk_select.cuh"

#include <cooperative_groups.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace cg = cooperative_groups;

namespace kvs::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kInsertCtas = 16;  // per session: a thread per list, grid-stride
constexpr int kMaxEmitCtas = 32;  // per row
constexpr uint32_t kUntouched = 0x80000000u;  // -0.0f: no picked list holds the key

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

// ---- list values ----
template <bool F16>
__device__ __forceinline__ float val_at(const void* val, int64_t i) {
  if constexpr (F16) return __half2float(__ushort_as_half(static_cast<const uint16_t*>(val)[i]));
  else return static_cast<const float*>(val)[i];
}
// csa::worse: lower score, or equal score and a later token.
__device__ __forceinline__ bool worse(float va, int32_t ia, float vb, int32_t ib) {
  return va < vb || (va == vb && ia > ib);
}

// csa::heap_sift_down on one list (root = worst entry) from the root, interleaved with the lower
// bound of `key` among the n ascending tokens of si (none when si is null): the two chains of
// dependent loads advance one step each per iteration, so the search's latency hides under the
// sift's. Returns the lower bound (0 without si).
template <bool F16>
__device__ int sift_root_and_find(int32_t* idx, void* val, int64_t L, const int32_t* si, int n, int32_t key) {
  using S = std::conditional_t<F16, uint16_t, float>;
  S* v = static_cast<S*>(val);
  const int32_t xi = idx[0];
  const S xv = v[0];
  const float xf = val_at<F16>(val, 0);
  int64_t i = 0;
  bool sifting = L > 1;
  int lo = 0, hi = si ? n : 0;
  while (sifting || lo < hi) {
    // One step of the search: its load is issued beside the sift's.
    int mid = 0;
    int32_t at = 0;
    const bool searching = lo < hi;
    if (searching) {
      mid = (lo + hi) >> 1;
      at = si[mid];
    }
    if (sifting) {  // one level of the sift
      int64_t c = 2 * i + 1;
      if (c >= L) {
        sifting = false;
      } else {
        // The node's descendants three levels down (8 consecutive entries) into L2 now, so a path
        // through a cold heap waits for memory once every three levels (csattention.hpp does the same).
        if (const int64_t g = 8 * i + 7; g < L) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(idx + g));
          asm volatile("prefetch.global.L2 [%0];" ::"l"(v + g));
        }
        float cf = val_at<F16>(val, c);
        if (c + 1 < L) {
          const float rf = val_at<F16>(val, c + 1);
          if (worse(rf, idx[c + 1], cf, idx[c])) {
            ++c;
            cf = rf;
          }
        }
        if (!worse(cf, idx[c], xf, xi)) {
          sifting = false;
        } else {
          idx[i] = idx[c];
          v[i] = v[c];
          i = c;
        }
      }
    }
    if (searching) {
      if (at < key) lo = mid + 1;
      else hi = mid;
    }
  }
  idx[i] = xi;
  v[i] = xv;
  return lo;
}

// ---- streaming update ----
struct InsertArgs {
  CsaConfig cfg;
  const CsaSession* ss;  // device [B]
  int32_t hkv, G, d;
  PagedKv kv;
};

// ---- the token-ordered lists ----
template <bool F16>
using ScoreBits = std::conditional_t<F16, uint16_t, uint32_t>;
template <bool F16>
constexpr ScoreBits<F16> kDead = F16 ? ScoreBits<F16>(0xFFFFu) : ScoreBits<F16>(0xFFFFFFFFu);  // a NaN
template <bool F16>
__device__ __forceinline__ ScoreBits<F16> score_bits(float stored) {
  if constexpr (F16) return __half_as_ushort(__float2half_rn(stored));  // exact: `stored` is an fp16 value
  else return __float_as_uint(stored);
}
template <bool F16>
__device__ __forceinline__ float score_of(ScoreBits<F16> b) {
  if constexpr (F16) return __half2float(__ushort_as_half(b));
  else return __uint_as_float(b);
}

// The streaming update's change to list `list` in token order: `evicted` (the heap's former root,
// at position lo, its lower bound among the list's c = scnt[list] tokens: dead entries keep their
// tokens) marked dead, token t appended with its stored score; a full list is compacted first (its
// dead entries dropped, order kept: O(Lcap), once every Lcap - L evictions).
template <bool F16>
__device__ void token_list_replace(const CsaSession& s, int64_t list, int32_t evicted, int lo, int32_t t,
                                   float stored) {
  using B = ScoreBits<F16>;
  int32_t* si = s.sidx + list * s.Lcap;
  B* sv = static_cast<B*>(s.sval) + list * s.Lcap;
  int c = s.scnt[list];
  if (lo < c && si[lo] == evicted) sv[lo] = kDead<F16>;
  if (c >= s.Lcap) {
    int w = 0;
    for (int r = 0; r < c; ++r) {
      const B v = sv[r];
      if (v == kDead<F16>) continue;
      si[w] = si[r];
      sv[w] = v;
      ++w;
    }
    c = w;
  }
  if (c < s.Lcap) {
    si[c] = t;
    sv[c] = score_bits<F16>(stored);
    s.scnt[list] = c + 1;
  }
}

template <typename KT, bool F16>
__device__ void insert_list(const InsertArgs& a, const CsaSession& s, int b, int32_t from, int32_t to, int64_t id,
                            int64_t per_head) {
  const int h = int(id / per_head);
  const int sub = int((id / s.C) % a.cfg.m);
  const int64_t j = id % s.C;
  const int kvh = a.cfg.per_query_head ? h / a.G : h;
  const int off = a.cfg.off[sub], db = a.cfg.db[sub];
  const float* c = s.cent + int64_t(h) * s.C * a.d + int64_t(s.C) * off + j * db;
  const int64_t base = ((int64_t(h) * a.cfg.m + sub) * s.C + j) * s.L;
  int32_t* idx = s.idx + base;
  void* val = F16 ? static_cast<void*>(static_cast<uint16_t*>(s.val) + base)
                  : static_cast<void*>(static_cast<float*>(s.val) + base);
  const int64_t list = id;  // (h, sub, j) in [TH][m][C] order
  for (int32_t t = from; t < to; ++t) {
    const KT* k = kv_row<KT>(a.kv, a.hkv, a.d, b, kvh, t, 0) + off;
    float sc = 0.f;
    for (int i = 0; i < db; ++i) sc = __fadd_rn(sc, __fmul_rn(c[i], to_f32(k[i])));
    float stored;
    if constexpr (F16) {
      const __half hv = __float2half_rn(sc);
      stored = __half2float(hv);
      if (!(stored > val_at<F16>(val, 0))) continue;
      static_cast<uint16_t*>(val)[0] = __half_as_ushort(hv);
    } else {
      stored = sc;
      if (!(stored > val_at<F16>(val, 0))) continue;
      static_cast<float*>(val)[0] = sc;
    }
    const int32_t evicted = idx[0];
    idx[0] = t;
    // The sift and the evicted token's search in the token-ordered copy, side by side.
    const int32_t* si = s.sidx ? s.sidx + list * s.Lcap : nullptr;
    const int at = sift_root_and_find<F16>(idx, val, s.L, si, si ? s.scnt[list] : 0, evicted);
    if (s.sidx) token_list_replace<F16>(s, list, evicted, at, t, stored);
  }
}

// The CTAs of the pick kernel past its rows: kInsertCtas per session, a thread per list.
template <typename KT, bool F16>
__device__ void insert_block(const InsertArgs& a, int b, int cta) {
  const CsaSession s = a.ss[b];
  const int32_t from = s.ins_from, to = s.n;
  if (from >= to || s.search == 2) return;
  const int64_t per_head = int64_t(a.cfg.m) * s.C;
  for (int64_t id = int64_t(cta) * blockDim.x + threadIdx.x; id < per_head * a.cfg.TH; id += int64_t(kInsertCtas) * blockDim.x)
    insert_list<KT, F16>(a, s, b, from, to, id, per_head);
}

template <typename F>
Status with_types(Scalar kv, bool f16, F&& f) {
  if (kv == Scalar::BF16) return f16 ? f(__nv_bfloat16{}, std::true_type{}) : f(__nv_bfloat16{}, std::false_type{});
  return f16 ? f(__half{}, std::true_type{}) : f(__half{}, std::false_type{});
}

Status check_config(const CsaConfig& cfg, int32_t hq, int32_t hkv, int32_t d, Scalar kv_dtype) {
  if (kv_dtype != Scalar::BF16 && kv_dtype != Scalar::F16) return unsupported("csattention: KV dtype must be BF16 or F16");
  if (hq < 1 || hkv < 1 || hq % hkv || d < 1) return invalid("csattention: bad head counts or head_dim");
  if (cfg.m < 1 || cfg.m > kCsaMaxSubspaces) return unsupported("csattention: at most 64 subspaces on the cuda backend");
  int sum = 0;
  for (int b = 0; b < cfg.m; ++b) {
    if (cfg.db[b] < 1 || cfg.off[b] != sum) return invalid("csattention: subspaces must tile the head dim in order");
    sum += cfg.db[b];
  }
  if (sum != d) return invalid("csattention: subspace dims must sum to head_dim");
  if (cfg.TH != (cfg.per_query_head ? hq : hkv)) return invalid("csattention: TH must be Hkv, or Hq per query head");
  return {};
}

// ---- the search ----
struct PickArgs {
  CsaConfig cfg;
  const CsaSession* ss;
  int32_t hq, hkv, G, d, P;  // P: pick slots per row
  int32_t rows, fill_y;      // rows = B * TH; CTAs per row
  const void* q;
  const void* const* q_at;
  bool q_f32;
  float* acc;
  int64_t stride;
  int64_t* pk_base;
  float* pk_w;
  int32_t* pk_n;
  int32_t* row_len;
  int32_t* row_k;
};

template <typename KT>
__device__ __forceinline__ float load_q(const void* q, bool f32, int64_t i) {
  return f32 ? static_cast<const float*>(q)[i] : to_f32(static_cast<const KT*>(q)[i]);
}

// One launch for the work that precedes the scatter and is independent: per row, fill_y CTAs reset
// the accumulator and one picks the lists; then the streaming update's CTAs.
template <typename KT, bool F16>
__global__ void __launch_bounds__(kThreads) pick_kernel(PickArgs a, InsertArgs ia) {
  extern __shared__ float qv[];  // [gq][d]
  __shared__ int32_t pid[512];
  __shared__ float pw[512];
  const int fy = a.fill_y, nrow_ctas = a.rows * (fy + 1);
  if (int(blockIdx.x) >= nrow_ctas) {
    const int i = int(blockIdx.x) - nrow_ctas;
    insert_block<KT, F16>(ia, i / kInsertCtas, i % kInsertCtas);
    return;
  }
  const int row = int(blockIdx.x) / (fy + 1), yb = int(blockIdx.x) % (fy + 1), TH = a.cfg.TH;
  const int b = row / TH, h = row % TH;
  const CsaSession s = a.ss[b];
  const bool search = s.search == 1;
  if (yb < fy) {  // this CTA's slice of [0, w_begin) becomes untouched (fy = 0: no accumulators)
    float* acc = a.acc + int64_t(row) * a.stride;
    if (search) {
      const int64_t n = s.w_begin, per = (n + fy - 1) / fy;
      const int64_t beg = int64_t(yb) * per, end = min(n, beg + per);
      for (int64_t t = beg + threadIdx.x; t < end; t += blockDim.x) acc[t] = __uint_as_float(kUntouched);
    }
    return;
  }
  // The row's last CTA: the picks.
  if (threadIdx.x == 0) {
    a.row_len[row] = search ? s.w_begin : 0;
    // rerank: the best llround(rerank * rest) candidates go to the exact scores (csattention.cpp)
    a.row_k[row] = !search ? 0 : a.cfg.rerank > 0 ? int(llround(a.cfg.rerank * s.rest)) : s.rest;
  }
  if (!search) {
    if (threadIdx.x == 0) a.pk_n[row] = 0;
    return;
  }
  const int m = a.cfg.m, d = a.d, G = a.G;
  const bool one = a.cfg.per_query_head || a.cfg.group_sum;
  const int gq = one ? 1 : G;
  const void* qb = a.q_at ? *a.q_at : a.q;
  const int64_t q0 = int64_t(b) * a.hq * d;
  for (int i = threadIdx.x; i < gq * d; i += blockDim.x) {
    const int g = i / d, e = i % d;
    float x;
    if (a.cfg.per_query_head) {
      x = load_q<KT>(qb, a.q_f32, q0 + int64_t(h) * d + e);
    } else if (a.cfg.group_sum) {  // the group's summed query, in head order (csattention.cpp)
      x = 0.f;
      for (int gg = 0; gg < G; ++gg) x = __fadd_rn(x, load_q<KT>(qb, a.q_f32, q0 + int64_t(h * G + gg) * d + e));
    } else {
      x = load_q<KT>(qb, a.q_f32, q0 + int64_t(h * G + g) * d + e);
    }
    qv[i] = x;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const float* cent_h = s.cent + int64_t(h) * s.C * d;
  for (int task = warp; task < gq * m; task += warps) {
    const int g = task / m, sub = task % m;
    const int off = a.cfg.off[sub], db = a.cfg.db[sub];
    const float* qh = qv + g * d + off;
    const float* cb = cent_h + int64_t(s.C) * off;
    float best = -INFINITY;
    int bj = 0x7fffffff;
    for (int j = lane; j < s.C; j += 32) {
      const float* c = cb + int64_t(j) * db;
      float sc = 0.f;
      for (int i = 0; i < db; ++i) sc = __fadd_rn(sc, __fmul_rn(c[i], qh[i]));
      if (sc > best) {
        best = sc;
        bj = j;
      }
    }
    for (int o = 16; o; o >>= 1) {  // larger score, then the lower index
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oj = __shfl_xor_sync(0xffffffffu, bj, o);
      if (ob > best || (ob == best && oj < bj)) {
        best = ob;
        bj = oj;
      }
    }
    if (lane == 0) {
      if (bj == 0x7fffffff) bj = 0;  // every score -inf or NaN: the CPU keeps centroid 0
      float wt = a.cfg.w[sub];
      if (a.cfg.qnorm) {
        double nn = 0;
        for (int i = 0; i < db; ++i) nn += double(qh[i]) * qh[i];
        wt = __fmul_rn(wt, float(sqrt(nn)));
      } else if (a.cfg.group_sum && !a.cfg.per_query_head) {
        wt = __fmul_rn(wt, float(G));
      }
      pid[task] = sub * s.C + bj;
      pw[task] = wt;
    }
  }
  __syncthreads();
  // The distinct lists, each with the summed weight of the picks naming it (in pick order), in
  // parallel: a thread per pick (one thread doing it all took 20 us of dependent shared-memory
  // accesses). The lists' order is free: the scatter's atomics add in any order anyway.
  __shared__ int first[512];
  __shared__ int cnt;
  const int np = gq * m;
  if (threadIdx.x == 0) cnt = 0;
  for (int i = threadIdx.x; i < np; i += blockDim.x) {
    int f = 1;
    for (int j = 0; j < i; ++j) f &= pid[j] != pid[i];
    first[i] = f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < np; i += blockDim.x) {
    if (!first[i]) continue;
    float wsum = 0.f;
    for (int j = i; j < np; ++j)
      if (pid[j] == pid[i]) wsum = __fadd_rn(wsum, pw[j]);
    const int sub = pid[i] / s.C, cj = pid[i] % s.C;
    const int64_t base = ((int64_t(h) * m + sub) * s.C + cj) * s.L;
    const int64_t slot = int64_t(row) * a.P + atomicAdd(&cnt, 1);
    a.pk_base[slot] = base;
    a.pk_w[slot] = wsum;
  }
  __syncthreads();
  if (threadIdx.x == 0) a.pk_n[row] = cnt;
}

struct ScatterArgs {
  const CsaSession* ss;
  int32_t TH, P, rows, chunks;  // chunks: of each row's entries
  bool missing_min;
  float* acc;
  int64_t stride;
  const int64_t* pk_base;
  const float* pk_w;
  const int32_t* pk_n;
};

template <bool F16>
__global__ void __launch_bounds__(kThreads) scatter_kernel(ScatterArgs a) {
  __shared__ int64_t sb[512];
  __shared__ float sw[512], so[512];
  // A persistent grid over (row, chunk) pairs in row order: the CTAs work on about a grid's worth
  // of pairs at a time, so only a few rows' accumulators are written at once and they stay in L2
  // (at B = 8 all 64 rows at once, 32 MiB, ran at 60% of the atomic rate of one session).
  const int64_t pairs = int64_t(a.rows) * a.chunks;
  for (int64_t pr = blockIdx.x; pr < pairs; pr += gridDim.x) {
    const int row = int(pr / a.chunks), chunk = int(pr % a.chunks);
    const CsaSession s = a.ss[row / a.TH];
    if (s.search != 1) continue;
    const int np = a.pk_n[row];
    __syncthreads();  // the previous pair's reads of sb/sw/so are done
    // missing=list_min: the list's minimum (its root) read here, after the pick kernel's streaming
    // update has run (the CPU inserts the new key before it searches).
    for (int i = threadIdx.x; i < np; i += blockDim.x) {
      const int64_t base = a.pk_base[int64_t(row) * a.P + i];
      const float wsum = a.pk_w[int64_t(row) * a.P + i];
      sb[i] = base;
      sw[i] = wsum;
      so[i] = a.missing_min ? -__fmul_rn(wsum, val_at<F16>(s.val, base)) : 0.f;
    }
    __syncthreads();
    const int64_t L = s.L, total = int64_t(np) * L;
    const int64_t per = (total + a.chunks - 1) / a.chunks;
    const int64_t beg = int64_t(chunk) * per, end = min(total, beg + per);
    float* acc = a.acc + int64_t(row) * a.stride;
    const int32_t lo = s.s_end, hi = s.w_begin;
    // kU entries per thread per round, their loads issued before any atomic (memory-level parallelism).
    constexpr int kU = 8;
    for (int64_t e0 = beg + threadIdx.x; e0 < end; e0 += int64_t(blockDim.x) * kU) {
      int32_t tok[kU];
      float v[kU];
      int pk[kU];
  #pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t e = e0 + int64_t(u) * blockDim.x;
        tok[u] = -1;
        if (e < end) {
          const int p = int(e / L);
          const int64_t i = sb[p] + (e - int64_t(p) * L);
          pk[u] = p;
          // Streaming loads (evict first): the lists pass through once, the accumulators must stay
          // in L2 (at B = 8 they are 32 MiB and the lists 160 MiB).
          tok[u] = __ldcs(s.idx + i);
          if constexpr (F16) v[u] = __half2float(__ushort_as_half(__ldcs(static_cast<const unsigned short*>(s.val) + i)));
          else v[u] = __ldcs(static_cast<const float*>(s.val) + i);
        }
      }
  #pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (tok[u] < lo || tok[u] >= hi) continue;  // forced keys (sinks, window) are not searched
        // csattention.cpp: acc[t] += (w * V + off) + 0.0f (never -0.0, so "touched" stays exact)
        const int p = pk[u];
        atomicAdd(acc + tok[u], __fadd_rn(__fadd_rn(__fmul_rn(sw[p], v[u]), so[p]), 0.f));
      }
    }
  }
}

// ---- the fused reduce by key and top-k: a thread-block cluster per row ----
// CTA `rank` of the row's cluster owns the token slice [beg, end) of topk_detail::select_slice and
// keeps its fp32 sums in shared memory. It finds, in each picked list's token-ordered copy, the run
// of its slice's tokens (two warp searches) and adds that run's live entries with shared-memory
// atomics, so every list entry of the row is read once, by the CTA that owns its token. The sums
// become top-k keys in place (untouched keys absent), the cluster counts its touched keys, and the
// row's top min(k, touched) come from topk_detail::rows_select over the slices: no accumulator row
// in global memory, no L2 atomics, no second pass over the row.
// The first index i in [0, n) with a[i] >= key (n if none) in an ascending array, by a warp:
// 32-way probes narrow the range 32 times per dependent load (4 loads for 10^5 entries).
__device__ __forceinline__ int warp_lower_bound(const int32_t* a, int n, int32_t key, int lane) {
  int lo = 0, hi = n;  // the answer is in [lo, hi]
  while (hi - lo > 32) {
    const int step = (hi - lo + 31) / 32;
    const int pos = lo + lane * step;
    const bool less = pos < hi && __ldg(a + pos) < key;
    const int c = __popc(__ballot_sync(0xffffffffu, less));  // probes below key: lanes 0 .. c-1
    if (c == 0) return lo;
    const int nlo = lo + (c - 1) * step + 1;
    hi = min(hi, lo + c * step);
    lo = nlo;
  }
  const int pos = lo + lane;
  const bool less = pos < hi && __ldg(a + pos) < key;
  return lo + __popc(__ballot_sync(0xffffffffu, less));
}

struct FusedArgs {
  const CsaSession* ss;
  int32_t TH, P;
  bool missing_min;
  const int64_t* pk_base;
  const float* pk_w;
  const int32_t* pk_n;
  topk_detail::RowsArgs ra;  // lengths = row_len, row_k, k = kcap, out = the candidates; scores unused
};

template <bool F16>
__global__ void __launch_bounds__(topk_detail::kRowsThreads, 1) reduce_topk_kernel(const FusedArgs a) {
  namespace td = topk_detail;
  extern __shared__ uint4 dyn_smem[];
  float* sum = reinterpret_cast<float*>(dyn_smem);
  uint32_t* keys = reinterpret_cast<uint32_t*>(dyn_smem);
  __shared__ int64_t sb[512];
  __shared__ float sw[512], so[512];
  __shared__ int run[1024];  // per picked list: the first entry of token >= lo, then >= hi
  __shared__ uint32_t touched, local_touched;
  cg::cluster_group cl = cg::this_cluster();
  const int C = int(cl.num_blocks()), rank = int(cl.block_rank());
  const int row = int(blockIdx.x / unsigned(C)), tid = threadIdx.x;
  pdl_wait();  // the pick kernel's lists, weights and streaming update
  const CsaSession s = a.ss[row / a.TH];
  const int len = td::row_len_of(a.ra, row);  // w_begin on a search step, else 0
  int64_t beg, end;
  td::select_slice(len, C, rank, &beg, &end);
  const int n = int(end - beg);
  for (int i = tid; i < n; i += blockDim.x) keys[i] = kUntouched;
  const int np = s.search == 1 ? a.pk_n[row] : 0;
  for (int i = tid; i < np; i += blockDim.x) {
    const int64_t base = a.pk_base[int64_t(row) * a.P + i];
    const float wsum = a.pk_w[int64_t(row) * a.P + i];
    sb[i] = base;
    sw[i] = wsum;
    // missing=list_min: the list's minimum (its root), after the streaming update
    so[i] = a.missing_min ? -__fmul_rn(wsum, val_at<F16>(s.val, base)) : 0.f;
  }
  if (tid == 0) {
    touched = 0;
    local_touched = 0;
  }
  __syncthreads();
  // Searched keys only: forced ones (sinks, window) stay untouched, as in the scatter kernel.
  const int32_t lo = int32_t(max(int64_t(s.s_end), beg)), hi = int32_t(min(int64_t(s.w_begin), end));
  // Each picked list's run of tokens in [lo, hi) in its token-ordered copy: two searches per list
  // (a warp each), then the runs read by every warp in parts, so a CTA reads only its slice's
  // entries (each entry of the row is read by one CTA).
  const int lane = tid & 31, warp = tid >> 5, nwarps = int(blockDim.x >> 5);
  const int32_t L = s.L;
  for (int item = warp; item < 2 * np; item += nwarps) {
    const int p = item >> 1;
    const int64_t list = sb[p] / L;
    const int32_t key = (item & 1) ? hi : lo;
    const int pos = lo < hi ? warp_lower_bound(s.sidx + list * s.Lcap, s.scnt[list], key, lane) : 0;
    if (lane == 0) run[item] = pos;
  }
  __syncthreads();
  const int parts = np > 0 ? max(1, nwarps / np) : 1;
  using Bits = ScoreBits<F16>;
  for (int item = warp; item < np * parts; item += nwarps) {
    const int p = item / parts, part = item % parts;
    const int64_t list = sb[p] / L;
    const int r0 = run[2 * p], r1 = run[2 * p + 1], len = r1 - r0;
    const int i0 = r0 + int(int64_t(len) * part / parts), i1 = r0 + int(int64_t(len) * (part + 1) / parts);
    const int32_t* si = s.sidx + list * s.Lcap;
    const Bits* sv = static_cast<const Bits*>(s.sval) + list * s.Lcap;
    const float w = sw[p], o = so[p];
    constexpr int kU = 8;
    for (int i = i0 + lane; i < i1; i += 32 * kU) {
      int32_t tk[kU];
      Bits v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = i + 32 * u;
        tk[u] = j < i1 ? __ldg(si + j) : -1;
        v[u] = j < i1 ? sv[j] : kDead<F16>;
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        // Live entries of the slice only (the run is the slice's by construction; the bound check
        // keeps a corrupt copy from writing outside shared memory).
        if (v[u] != kDead<F16> && uint32_t(tk[u] - lo) < uint32_t(hi - lo))
          // csattention.cpp: acc[t] += (w * V + off) + 0.0f (never -0.0)
          atomicAdd(sum + (tk[u] - beg), __fadd_rn(__fadd_rn(__fmul_rn(w, score_of<F16>(v[u])), o), 0.f));
    }
  }
  __syncthreads();
  // The sums as keys (untouched: 0, below every other key), and the touched keys of the slice.
  uint32_t t = 0;
  for (int i = tid; i < n; i += blockDim.x) {
    const uint32_t k = td::ord_key(sum[i], /*absent=*/true);
    keys[i] = k;
    t += k != 0u;
  }
  t = __reduce_add_sync(0xffffffffu, t);
  if ((tid & 31) == 0 && t) atomicAdd(&local_touched, t);
  cl.sync();  // every CTA's `touched` zeroed (and its slice converted)
  if (tid < C && local_touched) atomicAdd(cl.map_shared_rank(&touched, unsigned(tid)), local_touched);
  cl.sync();  // every slice's count in every CTA's `touched`
  td::rows_select<false, true, true>(a.ra, cl, row, keys, int(touched));
}

struct EmitArgs {
  const CsaSession* ss;
  int32_t TH;
  const float* acc;
  int64_t stride;
  const int32_t* tk_idx;
  const int32_t* tk_cnt;
  int32_t kcap;
  int32_t* out_idx;
  int32_t* out_cnt;
  int32_t max_sel;
  int32_t* slice_cnt;  // [rows][EY]: keys each slice keeps
  int32_t EY;          // CTAs per row
  // rerank: rows with rr_k[row] > 0 emit tk_idx[rr_idx[j]], j < rr_cnt[row] (all kept)
  const int32_t* rr_idx;
  const int32_t* rr_cnt;
  const int32_t* rr_k;
  int32_t rr_cap;
};

// Block-wide exclusive scan of one flag per thread (kThreads threads); returns this thread's rank,
// *total the count.
__device__ __forceinline__ int block_rank(bool flag, int* total) {
  __shared__ int wsum[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned bal = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) wsum[warp] = __popc(bal);
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    before += w < warp ? wsum[w] : 0;
    all += wsum[w];
  }
  __syncthreads();
  *total = all;
  return before + __popc(bal & ((1u << lane) - 1u));
}

// The searched keys of a row: the top-k's output with untouched keys dropped (they reach it only
// when fewer than `rest` keys were touched), or the cached search within [s_end, w_begin).
struct Cands {
  const int32_t* cand;
  int nc;
  bool search;
};
__device__ __forceinline__ Cands row_cands(const EmitArgs& a, const CsaSession& s, int row, int h) {
  const bool search = s.search == 1;
  if (search) return {a.tk_idx + int64_t(row) * a.kcap, a.tk_cnt[row], true};
  return {s.cached + int64_t(h) * s.cached_cap, min(s.cached_cnt[h], s.cached_cap), false};
}
__device__ __forceinline__ bool kept(const EmitArgs& a, const CsaSession& s, int row, bool search, int32_t tok) {
  // acc null: the fused reduce and top-k kept touched keys only
  return search ? (!a.acc || __float_as_uint(a.acc[int64_t(row) * a.stride + tok]) != kUntouched)
                : (tok >= s.s_end && tok < s.w_begin);
}

// Pass 1: per (row, slice of the candidates), how many are kept (8 loads in flight per thread).
__global__ void __launch_bounds__(kThreads) emit_count_kernel(EmitArgs a) {
  const int row = blockIdx.x, ey = blockIdx.y, h = row % a.TH;
  const CsaSession s = a.ss[row / a.TH];
  int n = 0;
  if (s.search != 2) {
    const Cands c = row_cands(a, s, row, h);
    const int per = (c.nc + a.EY - 1) / a.EY, beg = ey * per, end = min(c.nc, beg + per);
    constexpr int kU = 8;
    for (int i0 = beg + threadIdx.x; i0 < end; i0 += blockDim.x * kU) {
      int32_t tok[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) tok[u] = i0 + u * int(blockDim.x) < end ? c.cand[i0 + u * blockDim.x] : -1;
#pragma unroll
      for (int u = 0; u < kU; ++u) n += tok[u] >= 0 && kept(a, s, row, c.search, tok[u]);
    }
  }
  __shared__ int red[kThreads / 32];
  for (int o = 16; o; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    int t = 0;
    for (int w = 0; w < kThreads / 32; ++w) t += red[w];
    a.slice_cnt[row * a.EY + ey] = t;
  }
}

// The last slice's part: the window after the `total` searched keys, the padding, the counts.
__device__ void emit_tail(const EmitArgs& a, const CsaSession& s, int row, int h, int32_t* out, int cap, int pos0,
                          int total, bool search) {
  int pos = min(pos0 + total, cap);
  const int nw = max(s.n - s.w_emit, 0);
  for (int t = threadIdx.x; t < nw; t += blockDim.x)
    if (pos + t < cap) out[pos + t] = s.w_emit + t;
  pos = min(pos + nw, cap);
  for (int t = pos + threadIdx.x; t < cap; t += blockDim.x) out[t] = -1;
  if (threadIdx.x == 0) {
    a.out_cnt[row] = pos;
    if (search) s.cached_cnt[h] = min(total, s.cached_cap);
  }
}

// Pass 2: each slice writes its kept keys at its offset (a plain copy when it drops none); the
// first slice writes the sinks, the last the window, the padding and the count.
__global__ void __launch_bounds__(kThreads) emit_kernel(EmitArgs a) {
  const int row = blockIdx.x, ey = blockIdx.y, h = row % a.TH;
  const CsaSession s = a.ss[row / a.TH];
  int32_t* out = a.out_idx + int64_t(row) * a.max_sel;
  const int cap = a.max_sel;
  if (s.search == 2) {  // no index: every key
    if (ey != 0) return;
    for (int t = threadIdx.x; t < cap; t += blockDim.x) out[t] = t < s.n ? t : -1;
    if (threadIdx.x == 0) a.out_cnt[row] = min(s.n, cap);
    return;
  }
  const int pos0 = min(s.s_emit, cap);
  if (ey == 0)
    for (int t = threadIdx.x; t < pos0; t += blockDim.x) out[t] = t;
  int32_t* cached = s.cached + int64_t(h) * s.cached_cap;
  if (a.rr_k && s.search == 1 && a.rr_k[row] > 0) {  // reranked: rr_idx indexes the candidates
    const int nr = a.rr_cnt[row], per = (nr + a.EY - 1) / a.EY, beg = ey * per, end = min(nr, beg + per);
    const int32_t* cand = a.tk_idx + int64_t(row) * a.kcap;
    const int32_t* ri = a.rr_idx + int64_t(row) * a.rr_cap;
    for (int i = beg + threadIdx.x; i < end; i += blockDim.x) {
      const int32_t tok = cand[ri[i]];
      if (pos0 + i < cap) out[pos0 + i] = tok;
      if (i < s.cached_cap) cached[i] = tok;
    }
    if (ey == a.EY - 1) emit_tail(a, s, row, h, out, cap, pos0, nr, true);
    return;
  }
  int off = 0, total = 0;
  for (int e = 0; e < a.EY; ++e) {
    const int c = a.slice_cnt[row * a.EY + e];
    off += e < ey ? c : 0;
    total += c;
  }
  const Cands c = row_cands(a, s, row, h);
  const int per = (c.nc + a.EY - 1) / a.EY, beg = ey * per, end = min(c.nc, beg + per);
  const int mine = a.slice_cnt[row * a.EY + ey];
  if (mine == end - beg) {
    for (int i = beg + threadIdx.x; i < end; i += blockDim.x) {
      const int32_t tok = c.cand[i];
      const int r = off + (i - beg);
      if (pos0 + r < cap) out[pos0 + r] = tok;
      if (c.search && r < s.cached_cap) cached[r] = tok;
    }
  } else {
    int done = 0;
    for (int c0 = beg; c0 < end; c0 += blockDim.x) {
      const int i = c0 + threadIdx.x;
      int32_t tok = -1;
      bool keep = false;
      if (i < end) {
        tok = c.cand[i];
        keep = kept(a, s, row, c.search, tok);
      }
      int t;
      const int r = off + done + block_rank(keep, &t);
      if (keep) {
        if (pos0 + r < cap) out[pos0 + r] = tok;
        if (c.search && r < s.cached_cap) cached[r] = tok;
      }
      done += t;
    }
  }
  if (ey == a.EY - 1) emit_tail(a, s, row, h, out, cap, pos0, total, c.search);
}

// ---- the exact rerank (rerank > 0; csattention.cpp rerank_exact) ----
// Rows whose top-k kept more than `rest` touched candidates score them exactly: per query head g of
// the row (the table head's own, or the group's G), l_g = scale * q_g . k_t; each head's softmax
// over the candidates; agg = the sum over heads; the best `rest` by agg (ties: lower token) stay.
struct RerankArgs {
  CsaConfig cfg;
  const CsaSession* ss;
  int32_t hq, hkv, G, GR, d, kcap, EY;
  const void* q;
  const void* const* q_at;
  bool q_f32;
  PagedKv kv;
  const float* acc;
  int64_t stride;
  const int32_t* tk_idx;
  const int32_t* tk_cnt;
  const int32_t* slice_cnt;
  float* lg;     // [rows][GR][kcap]
  float* stat;   // [rows][GR][2]: max, 1 / sum
  float* agg;    // [rows][kcap]
  int32_t* rr_k; // [rows]: rest when the row is reranked, else 0
};

// Whether the row reranks: a search step whose top-k kept more than `rest` touched keys.
__device__ __forceinline__ bool reranks(const RerankArgs& a, const CsaSession& s, int row) {
  if (s.search != 1 || s.rest <= 0) return false;
  int kept = 0;
  for (int e = 0; e < a.EY; ++e) kept += a.slice_cnt[row * a.EY + e];
  return kept > s.rest;
}

// A warp per candidate: its K row read once for the row's GR query heads.
template <typename KT>
__global__ void __launch_bounds__(kThreads) rerank_logits_kernel(RerankArgs a) {
  extern __shared__ float qs[];  // [GR][d]
  const int row = blockIdx.x, TH = a.cfg.TH, b = row / TH, h = row % TH;
  const CsaSession s = a.ss[b];
  if (!reranks(a, s, row)) return;
  const int d = a.d, GR = a.GR;
  const void* qb = a.q_at ? *a.q_at : a.q;
  const int qh0 = a.cfg.per_query_head ? h : h * a.G;
  for (int i = threadIdx.x; i < GR * d; i += blockDim.x)
    qs[i] = load_q<KT>(qb, a.q_f32, (int64_t(b) * a.hq + qh0 + i / d) * d + i % d);
  __syncthreads();
  const int kvh = a.cfg.per_query_head ? h / a.G : h;
  const int nc = a.tk_cnt[row];
  const int32_t* cand = a.tk_idx + int64_t(row) * a.kcap;
  const float* acc = a.acc ? a.acc + int64_t(row) * a.stride : nullptr;  // null: every candidate touched
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int i = blockIdx.y * warps + (threadIdx.x >> 5); i < nc; i += gridDim.y * warps) {
    const int32_t tok = cand[i];
    const bool absent = acc && __float_as_uint(acc[tok]) == kUntouched;
    const KT* k = kv_row<KT>(a.kv, a.hkv, d, b, kvh, tok, 0);
    for (int g = 0; g < GR; ++g) {
      float x = 0.f;
      if (!absent)
        for (int e = lane; e < d; e += 32) x = fmaf(qs[g * d + e], to_f32(k[e]), x);
      for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (lane == 0) a.lg[(int64_t(row) * GR + g) * a.kcap + i] = absent ? -INFINITY : a.cfg.scale * x;
    }
  }
}

// A CTA per (row, head): the head's max and softmax denominator over the candidates.
__global__ void __launch_bounds__(kThreads) rerank_stats_kernel(RerankArgs a) {
  const int row = blockIdx.x, g = blockIdx.y;
  const CsaSession s = a.ss[row / a.cfg.TH];
  if (!reranks(a, s, row)) return;
  const int nc = a.tk_cnt[row];
  const float* l = a.lg + (int64_t(row) * a.GR + g) * a.kcap;
  __shared__ float smax[kThreads / 32];
  __shared__ double ssum[kThreads / 32];
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < nc; i += blockDim.x) mx = fmaxf(mx, l[i]);
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) smax[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int w = 0; w < kThreads / 32; ++w) mx = fmaxf(mx, smax[w]);
  double z = 0;
  for (int i = threadIdx.x; i < nc; i += blockDim.x) z += double(expf(l[i] - mx));
  for (int o = 16; o; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
  if ((threadIdx.x & 31) == 0) ssum[threadIdx.x >> 5] = z;
  __syncthreads();
  if (threadIdx.x == 0) {
    z = 0;
    for (int w = 0; w < kThreads / 32; ++w) z += ssum[w];
    a.stat[(int64_t(row) * a.GR + g) * 2] = mx;
    a.stat[(int64_t(row) * a.GR + g) * 2 + 1] = float(1.0 / z);
  }
}

// CTAs per row: agg[i] = sum over heads of the candidate's softmax weight (an untouched candidate
// -1, below every weight); the row's rr_k.
__global__ void __launch_bounds__(kThreads) rerank_agg_kernel(RerankArgs a) {
  const int row = blockIdx.x;
  const CsaSession s = a.ss[row / a.cfg.TH];
  const bool rr = reranks(a, s, row);
  if (blockIdx.y == 0 && threadIdx.x == 0) a.rr_k[row] = rr ? s.rest : 0;
  if (!rr) return;
  const int nc = a.tk_cnt[row];
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < nc; i += gridDim.y * blockDim.x) {
    float v = 0.f;
    bool absent = false;
    for (int g = 0; g < a.GR; ++g) {
      const float l = a.lg[(int64_t(row) * a.GR + g) * a.kcap + i];
      absent |= l == -INFINITY;
      const float* st = a.stat + (int64_t(row) * a.GR + g) * 2;
      v = __fadd_rn(v, __fmul_rn(expf(l - st[0]), st[1]));
    }
    a.agg[int64_t(row) * a.kcap + i] = absent ? -1.f : v;
  }
}

// ---- the prompt-query sample ----
template <typename T>
__global__ void sample_kernel(const T* q, int32_t row_elems, int64_t i0, int64_t stride, float* dst) {
  const int64_t i = i0 + int64_t(blockIdx.x) * stride;
  const T* src = q + i * row_elems;
  float* o = dst + int64_t(blockIdx.x) * row_elems;
  for (int e = threadIdx.x; e < row_elems; e += blockDim.x) o[e] = to_f32(src[e]);
}

struct Layout {
  size_t acc, pk_base, pk_w, pk_n, row_len, row_k, tk_idx, tk_cnt, slice_cnt, topk, total;
  size_t rr_lg, rr_stat, rr_agg, rr_idx, rr_cnt, rr_k;  // the rerank's (rerank > 0)
  int64_t stride;
  int32_t rows, P, EY;
  int32_t kcap;  // the top-k's k: the candidates (rerank * rest, else rest)
  int32_t GR;    // heads scored per row by the rerank: 1 per query head, else G
};

// with_acc: the scatter path's accumulator rows (rows x max_length floats; not needed when the
// fused kernel reduces in shared memory: reduce_plan).
Layout make_layout(const CsaConfig& cfg, int32_t B, int32_t hq, int32_t hkv, int32_t max_length, int32_t max_rest,
                   bool with_acc) {
  Layout L{};
  const int G = hq / hkv;
  L.rows = B * cfg.TH;
  L.P = (cfg.per_query_head || cfg.group_sum ? 1 : G) * cfg.m;
  L.stride = (int64_t(max_length) + 3) & ~int64_t(3);
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o += align256(bytes);
    return at;
  };
  L.acc = take(with_acc ? size_t(L.rows) * size_t(L.stride) * 4 : 0);
  L.pk_base = take(size_t(L.rows) * L.P * 8);
  L.pk_w = take(size_t(L.rows) * L.P * 4);
  L.pk_n = take(size_t(L.rows) * 4);
  L.row_len = take(size_t(L.rows) * 4);
  L.row_k = take(size_t(L.rows) * 4);
  // Candidates: llround(rerank * rest) <= ceil(rerank * max_rest) for every row.
  L.kcap = int32_t(std::max<int64_t>(1, cfg.rerank > 0 ? int64_t(std::ceil(cfg.rerank * max_rest)) : max_rest));
  L.GR = cfg.per_query_head ? 1 : G;
  L.tk_idx = take(size_t(L.rows) * size_t(L.kcap) * 4);
  L.tk_cnt = take(size_t(L.rows) * 4);
  L.EY = int32_t(std::clamp<int64_t>((int64_t(L.kcap) + 2047) / 2048, 1, kMaxEmitCtas));
  L.slice_cnt = take(size_t(L.rows) * size_t(L.EY) * 4);
  if (cfg.rerank > 0) {
    L.rr_lg = take(size_t(L.rows) * L.GR * size_t(L.kcap) * 4);
    L.rr_stat = take(size_t(L.rows) * L.GR * 8);
    L.rr_agg = take(size_t(L.rows) * size_t(L.kcap) * 4);
    L.rr_idx = take(size_t(L.rows) * size_t(std::max(max_rest, 1)) * 4);
    L.rr_cnt = take(size_t(L.rows) * 4);
    L.rr_k = take(size_t(L.rows) * 4);
  }
  const size_t tb = std::max(topk_rows_workspace_bytes(L.rows, max_length, L.kcap),
                             topk_rows_workspace_bytes(L.rows, L.kcap, std::max(max_rest, 1)));
  L.topk = take(tb);
  L.total = o;
  return L;
}

// ---- the fused kernel's launch plan ----
// Clusters of reduce_topk_kernel<F16> that fit on a device at once (asked once per device, cluster
// size and shared memory in 16 KB steps). A device that refuses the kernel's attributes (less
// shared memory per CTA) runs the scatter path: no clusters fit.
ClusterOccupancy g_fused_occ[2];

template <bool F16>
int fused_occupancy(int dev, int ci, size_t smem) {
  return std::max(0, g_fused_occ[F16].clusters(reduce_topk_kernel<F16>, dev, ci, smem, topk_detail::kRowsThreads,
                                               topk_detail::kCacheBytesMax));
}

// KVS_CSA_CLUSTER (environment, read once; benchmarks): 0 = the scatter kernel and topk_rows
// always; 1, 2, 4, 8 or 16 = the fused kernel on clusters of that size where its slices fit;
// unset = automatic.
int fused_override() {
  static const int v = [] {
    const char* e = std::getenv("KVS_CSA_CLUSTER");
    return e && *e ? std::atoi(e) : -1;
  }();
  return v;
}

// The fused kernel's cluster size for `rows` rows of up to max_length keys (0: not used, the
// slices do not fit in shared memory), with its dynamic shared memory. A CTA reads its slice's
// share of the row's lists, so the work is the same whatever the cluster size: the fewest waves
// of clusters, then the larger cluster (smaller slices: a faster select, more searches in flight).
template <bool F16>
Status fused_plan(int32_t rows, int32_t max_length, int* cluster, size_t* smem) {
  *cluster = 0;
  *smem = 0;
  const int force = fused_override();
  if (force == 0) return {};
  int dev = 0;
  KVS_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
  double best = 0;
  for (int ci = 0; ci < 5; ++ci) {
    const int C = 1 << ci;
    if (force > 0 && C != force) continue;
    const int64_t chunk = (topk_detail::ceil_div(max_length, C) + 3) & ~int64_t(3);
    const size_t bytes = size_t(chunk) * 4;
    if (bytes > size_t(topk_detail::kCacheBytesMax)) continue;
    const int ncl = fused_occupancy<F16>(dev, ci, bytes);
    if (ncl <= 0) continue;
    const double cost = double(topk_detail::ceil_div(rows, ncl));
    if (*cluster == 0 || cost <= best) {
      best = cost;
      *cluster = C;
      *smem = bytes;
    }
  }
  return {};
}

// The step's reduce: the fused kernel's cluster size and dynamic shared memory, or 0 for the
// scatter kernel and topk_rows (which need the accumulator rows). The workspace size and the step
// ask it alike (same arguments, cached answers), so they agree on the layout.
Status reduce_plan(const CsaConfig& cfg, int32_t rows, int32_t max_length, int32_t max_rest, int* fc, size_t* fsmem) {
  *fc = 0;
  *fsmem = 0;
  if (max_rest <= 0) return {};
  return cfg.f16_scores ? fused_plan<true>(rows, max_length, fc, fsmem) : fused_plan<false>(rows, max_length, fc, fsmem);
}

}  // namespace

size_t csa_select_workspace_bytes(const CsaConfig& cfg, int32_t B, int32_t hq, int32_t hkv, int32_t max_length,
                                  int32_t max_rest) noexcept {
  if (B < 1 || hq < 1 || hkv < 1 || hq % hkv || cfg.m < 1 || cfg.TH < 1 || max_length < 1) return 0;
  int fc = 0;
  size_t fsmem = 0;
  if (!reduce_plan(cfg, B * cfg.TH, max_length, max_rest, &fc, &fsmem).ok()) fc = 0;  // the larger layout
  return make_layout(cfg, B, hq, hkv, max_length, max_rest, fc == 0).total;
}

Status csa_select(const CsaConfig& cfg, const CsaSession* sessions, int32_t B, int32_t hq, int32_t hkv, int32_t d,
                  const Query& q, const PagedKv& kv, Scalar kv_dtype, int32_t max_length, int32_t max_rest, int32_t* out_idx, int32_t* out_cnt, int32_t max_selected, const Workspace& ws,
                  void* stream) noexcept {
  if (Status s = check_config(cfg, hq, hkv, d, kv_dtype); !s.ok()) return s;
  if (!sessions || !out_idx || !out_cnt || (q.data == nullptr && q.at == nullptr)) return invalid("csa_select: null pointer");
  if (q.dtype != Scalar::F32 && q.dtype != kv_dtype) return invalid("csa_select: query must be F32 or the KV dtype");
  if (B < 1 || max_length < 1 || max_rest < 0 || max_selected < 1)
    return invalid("csa_select: capacities must be >= 1");
  // The reduce by key and the top-k fused in one cluster kernel when the row's slices fit in
  // shared memory (no accumulator rows then), else the scatter kernel and topk_rows.
  int fc = 0;
  size_t fsmem = 0;
  if (Status e = reduce_plan(cfg, B * cfg.TH, max_length, max_rest, &fc, &fsmem); !e.ok()) return e;
  const Layout L = make_layout(cfg, B, hq, hkv, max_length, max_rest, fc == 0);
  if (L.P > 512) return unsupported("csa_select: at most 512 picks (query heads per table head x subspaces)");
  const int G = hq / hkv;
  const int gq = cfg.per_query_head || cfg.group_sum ? 1 : G;
  const size_t qsmem = size_t(gq) * d * 4;
  if (qsmem > 48 * 1024) return unsupported("csa_select: query group too large (G * head_dim * 4 > 48 KiB)");
  if (ws.bytes < L.total || !ws.ptr) return invalid("csa_select: workspace smaller than csa_select_workspace_bytes");
  char* w = static_cast<char*>(ws.ptr);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  float* acc = fc == 0 ? reinterpret_cast<float*>(w + L.acc) : nullptr;
  auto* pk_base = reinterpret_cast<int64_t*>(w + L.pk_base);
  auto* pk_w = reinterpret_cast<float*>(w + L.pk_w);
  auto* pk_n = reinterpret_cast<int32_t*>(w + L.pk_n);
  auto* row_len = reinterpret_cast<int32_t*>(w + L.row_len);
  auto* row_k = reinterpret_cast<int32_t*>(w + L.row_k);
  auto* tk_idx = reinterpret_cast<int32_t*>(w + L.tk_idx);
  auto* tk_cnt = reinterpret_cast<int32_t*>(w + L.tk_cnt);

  return with_types(kv_dtype, cfg.f16_scores, [&](auto kt, auto f16) -> Status {
    using KT = decltype(kt);
    constexpr bool F16 = decltype(f16)::value;
    // 1. the streaming update of the step's new tokens (in the pick kernel's last CTAs)
    InsertArgs ia{};
    ia.cfg = cfg;
    ia.ss = sessions;
    ia.hkv = hkv;
    ia.G = G;
    ia.d = d;
    ia.kv = kv;
    // 2. picks, the accumulators reset, the streaming update
    PickArgs pa{};
    pa.cfg = cfg;
    pa.ss = sessions;
    pa.hq = hq;
    pa.hkv = hkv;
    pa.G = G;
    pa.d = d;
    pa.P = L.P;
    pa.q = q.data;
    pa.q_at = q.at;
    pa.q_f32 = q.dtype == Scalar::F32;
    pa.acc = acc;
    pa.stride = L.stride;
    pa.pk_base = pk_base;
    pa.pk_w = pk_w;
    pa.pk_n = pk_n;
    pa.row_len = row_len;
    pa.row_k = row_k;
    pa.rows = L.rows;
    pa.fill_y = int32_t(std::clamp<int64_t>((int64_t(max_length) + 16383) / 16384, 1, 64));
    if (fc > 0) pa.fill_y = 0;  // no accumulator rows to reset
    const unsigned ctas = unsigned(L.rows * (pa.fill_y + 1) + B * kInsertCtas);
    pick_kernel<KT, F16><<<ctas, kThreads, qsmem, st>>>(pa, ia);
    KVS_LAUNCH_CHECK("csattention pick kernel launch");
    float* const acc_used = acc;  // the emit and the rerank check "touched" on it (null: fused)
    if (fc > 0) {
      // 3-4. the row's touched keys reduced in its cluster's shared memory and the best `rest`
      // (or rerank * rest) of them selected there
      FusedArgs fa{};
      fa.ss = sessions;
      fa.TH = cfg.TH;
      fa.P = L.P;
      fa.missing_min = cfg.missing_min;
      fa.pk_base = pk_base;
      fa.pk_w = pk_w;
      fa.pk_n = pk_n;
      fa.ra.lengths = row_len;
      fa.ra.row_k = row_k;
      fa.ra.max_len = max_length;
      fa.ra.k = L.kcap;
      fa.ra.out_idx = tk_idx;
      fa.ra.out_cnt = tk_cnt;
      fa.ra.absent = true;
      KVS_CUDA_TRY(launch_kernel(reduce_topk_kernel<F16>, dim3(unsigned(int64_t(L.rows) * fc)),
                                 dim3(topk_detail::kRowsThreads), fsmem, st, /*pdl=*/true, fc, fa),
                   "csattention reduce_topk_kernel launch");
      KVS_LAUNCH_CHECK("csattention reduce_topk_kernel launch");
    } else {
      // 3. reduce by key (L2 atomics into accumulator rows)
      // About four CTAs per SM, each row's picked entries in chunks so that eight rows fill them (the
      // list length is the session's, read at run time: a captured step's grid cannot depend on it).
      int sms = 0;
      if (Status e = sm_count(&sms); !e.ok()) return e;
      const int32_t chunks = int32_t(std::clamp<int64_t>((int64_t(4) * sms + 7) / 8, 1,
                                                         std::max<int64_t>(1, int64_t(L.P) * max_length / kThreads)));
      ScatterArgs sa{sessions, cfg.TH, L.P, L.rows, chunks, cfg.missing_min, acc, L.stride, pk_base, pk_w, pk_n};
      const unsigned grid = unsigned(std::min<int64_t>(int64_t(L.rows) * chunks, int64_t(4) * sms));
      scatter_kernel<F16><<<grid, kThreads, 0, st>>>(sa);
      KVS_LAUNCH_CHECK("csattention scatter kernel launch");
      // 4. the best `rest` of each row, or its rerank * rest candidates (untouched keys absent)
      if (max_rest > 0) {
        if (Status s = topk_rows(acc, L.stride, row_len, L.rows, max_length, L.kcap, tk_idx, tk_cnt,
                                 Workspace{w + L.topk, L.total - L.topk}, stream, row_k, /*neg_zero_absent=*/true);
            !s.ok())
          return s;
      } else {
        KVS_CUDA_TRY(cudaMemsetAsync(tk_cnt, 0, size_t(L.rows) * 4, st), "cudaMemsetAsync(csattention counts)");
      }
    }
    auto* slice_cnt = reinterpret_cast<int32_t*>(w + L.slice_cnt);
    EmitArgs ea{sessions, cfg.TH, acc_used, L.stride, tk_idx, tk_cnt, L.kcap, out_idx, out_cnt, max_selected,
                slice_cnt, L.EY, nullptr, nullptr, nullptr, std::max(max_rest, 1)};
    emit_count_kernel<<<dim3(unsigned(L.rows), unsigned(L.EY)), kThreads, 0, st>>>(ea);
    KVS_LAUNCH_CHECK("csattention emit count kernel launch");
    // 5. the exact rerank of the candidates
    if (cfg.rerank > 0 && max_rest > 0) {
      RerankArgs ra{};
      ra.cfg = cfg;
      ra.ss = sessions;
      ra.hq = hq;
      ra.hkv = hkv;
      ra.G = G;
      ra.GR = L.GR;
      ra.d = d;
      ra.kcap = L.kcap;
      ra.EY = L.EY;
      ra.q = q.data;
      ra.q_at = q.at;
      ra.q_f32 = q.dtype == Scalar::F32;
      ra.kv = kv;
      ra.acc = acc_used;
      ra.stride = L.stride;
      ra.tk_idx = tk_idx;
      ra.tk_cnt = tk_cnt;
      ra.slice_cnt = slice_cnt;
      ra.lg = reinterpret_cast<float*>(w + L.rr_lg);
      ra.stat = reinterpret_cast<float*>(w + L.rr_stat);
      ra.agg = reinterpret_cast<float*>(w + L.rr_agg);
      ra.rr_k = reinterpret_cast<int32_t*>(w + L.rr_k);
      const size_t qs = size_t(L.GR) * d * 4;
      if (qs > 48 * 1024) return unsupported("csa_select: rerank query group too large (G * head_dim * 4 > 48 KiB)");
      const unsigned ry = unsigned(std::clamp<int64_t>((int64_t(L.kcap) + 255) / 256, 1, 128));
      rerank_logits_kernel<KT><<<dim3(unsigned(L.rows), ry), kThreads, qs, st>>>(ra);
      KVS_LAUNCH_CHECK("csattention rerank logits kernel launch");
      rerank_stats_kernel<<<dim3(unsigned(L.rows), unsigned(L.GR)), kThreads, 0, st>>>(ra);
      KVS_LAUNCH_CHECK("csattention rerank stats kernel launch");
      rerank_agg_kernel<<<dim3(unsigned(L.rows), unsigned(std::clamp<int64_t>((int64_t(L.kcap) + 4095) / 4096, 1, 64))),
                          kThreads, 0, st>>>(ra);
      KVS_LAUNCH_CHECK("csattention rerank agg kernel launch");
      auto* rr_idx = reinterpret_cast<int32_t*>(w + L.rr_idx);
      auto* rr_cnt = reinterpret_cast<int32_t*>(w + L.rr_cnt);
      if (Status s = topk_rows(ra.agg, L.kcap, tk_cnt, L.rows, L.kcap, std::max(max_rest, 1), rr_idx, rr_cnt,
                               Workspace{w + L.topk, L.total - L.topk}, stream, ra.rr_k);
          !s.ok())
        return s;
      ea.rr_idx = rr_idx;
      ea.rr_cnt = rr_cnt;
      ea.rr_k = ra.rr_k;
    }
    // 6. the selection rows
    emit_kernel<<<dim3(unsigned(L.rows), unsigned(L.EY)), kThreads, 0, st>>>(ea);
    KVS_LAUNCH_CHECK("csattention emit kernel launch");
    return {};
  });
}

Status csa_sample_rows(const void* q, Scalar q_dtype, int32_t n, int32_t row_elems, int64_t t0, int64_t stride,
                       float* dst, int32_t first, void* stream) noexcept {
  if (!q || !dst || n < 0 || row_elems < 1 || t0 < 0 || stride < 1 || first < 0)
    return invalid("csa_sample_rows: bad argument");
  const int64_t i0 = (stride - t0 % stride) % stride;
  if (i0 >= n) return {};
  const int64_t count = (n - 1 - i0) / stride + 1;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  float* o = dst + int64_t(first) * row_elems;
  switch (q_dtype) {
    case Scalar::F32: sample_kernel<<<unsigned(count), kThreads, 0, st>>>(static_cast<const float*>(q), row_elems, i0, stride, o); break;
    case Scalar::BF16:
      sample_kernel<<<unsigned(count), kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(q), row_elems, i0, stride, o);
      break;
    case Scalar::F16: sample_kernel<<<unsigned(count), kThreads, 0, st>>>(static_cast<const __half*>(q), row_elems, i0, stride, o); break;
    default: return invalid("csa_sample_rows: query dtype");
  }
  KVS_LAUNCH_CHECK("csattention sample kernel launch");
  return {};
}

}  // namespace kvs::cuda
