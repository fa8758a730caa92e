// SPDX-License-Identifier: Apache-2.0
// RetroInfer's decode step on CUDA (CPU reference: src/methods/retroinfer/retroinfer.cpp; the
// method: docs/methods/retroinfer.md): per session and KV head, the cluster ranking (the group's
// summed softmax over the centroids), the zones (retrieval clusters attended exactly with the
// steady zone, the estimation zone from centroids, sizes and value means), the exact selection
// list and the estimation zone's attention state, which the gathered attention merges in
// (Output::prior_*).
//
// Conventions as in cuda_attention.cuh (device pointers unless "host", enqueued on `stream`, no
// sync, no allocation, noexcept, Status).
//
// Meta index of one session and layer (device; the CPU method's WaveHead, docs "Layout"), per KV
// head h at offset h * cs (rows: h * cs * d; positions: h * rs), cs >= C and rs >= R: room per
// head for the clusters an update appends, so that an update sends only its own:
//   cent  [Hkv][cs][d]  centroids in the meta dtype (F32, F16 or BF16), the first C of each head
//   vmeta [Hkv][cs][d]  value means (16-bit meta dtype) or value sums (F32)
//   size  [Hkv][cs] int32, start [Hkv][cs] int32 (first row of the cluster), pos [Hkv][rs] int32
//   (original token positions, cluster by cluster, ascending inside a cluster; the first R).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cuda/cuda_attention.cuh"
#include "backends/cuda/kv_layout.cuh"

namespace kvs::cuda {

// How a session's step is laid out (RetroSession::mode).
enum RetroMode : int32_t {
  kRetroAll = 0,        // nothing indexed, no budget scaling: attend [0, n)
  kRetroStreaming = 1,  // nothing indexed, budget=session scaled: [0, sk) and [n - lw, n)
  kRetroPaper = 2,      // budget=paper: the top r_fixed clusters, fixed steady zone
  kRetroSession = 3,    // budget=session, steady_share = 0: whole clusters within room
  kRetroScaled = 4,     // budget=session scaled: whole clusters, part of the next, then fill
};

// Figures of a step per KV head (RetroSession::stats): retrieval clusters, retrieval tokens,
// estimation clusters, estimation tokens, fill tokens (part rows, tail, extra sinks), budget
// unused (session modes), steady tokens, 0.
constexpr int kRetroStats = 8;

// One session's step (device memory, uploaded per step).
struct RetroSession {
  const void* cent;
  const void* vmeta;
  const int32_t* size;
  const int32_t* start;
  const int32_t* pos;
  int32_t C, R;          // clusters and rows per KV head (0: nothing indexed)
  int32_t cs, rs;        // a KV head's stride in clusters (size, start, cent, vmeta) and in rows (pos)
  int32_t mode;          // RetroMode
  int32_t n;             // tokens after the step's append
  int32_t sk, lb;        // steady zone: [0, sk) and [lb, n)
  int32_t sinks_end;     // min(sinks, n): the fill may add sinks [sb, sinks_end)
  int32_t indexed_end;   // tokens [sinks, indexed_end) are clustered
  int32_t room;          // session modes: exact keys for clusters and fill (>= 0)
  int32_t r_fixed, e;    // paper: retrieval clusters; every indexed mode: estimation clusters
  int32_t lw;            // kRetroStreaming: the recent window
  int32_t* stats;        // optional [Hkv][kRetroStats]: the step's figures per KV head (above)
  double* unused_sum;    // optional [Hkv]: budget unused (session modes) added up over steps
  double* sel_sum;       // optional [1]: the exact list lengths (mean over KV heads) added up over steps
  // The wave buffer (retroinfer_cuda.cpp; all zero without it). The step's page table holds the
  // session's block-cache pages ahead of its own: token t is virtual position tok_base + t, and
  // `pos` holds each list row's virtual position (its cache slot while cached). The zones kernel
  // adds tok_base to every token it lists and writes the ids of the clusters it reads rows of
  // (retrieval zone and part cluster, in id order) to wave_ids [Hkv][wave_cap], counts to
  // wave_cnt [Hkv]; retro_wave_table writes the step's table.
  int32_t tok_base;
  int32_t wave_cap;
  int32_t* wave_ids;
  int32_t* wave_cnt;
  const void* const* cache_pages;  // device [cache_page_count]
  int32_t cache_page_count;
  const void* const* stage_pages;  // device [stage_page_count]: after the sequence's pages (wave_misses=stage)
  int32_t stage_page_count;
  int32_t own_cap;                 // entries of own_table
  const void** own_table;          // optional: the session's copy of its row of the step's table
};

struct RetroConfig {
  Scalar meta = Scalar::F32;  // dtype of cent and vmeta
  bool mask_before = false;   // empty clusters left out of the softmax (else dropped after the sum)
};

// Workspace for a batch whose sessions have at most max_clusters clusters per head and clusters of
// at most max_cluster_rows rows.
size_t retro_select_workspace_bytes(const AttnShape& shape, int32_t max_clusters, int32_t max_cluster_rows) noexcept;

// The step for B sessions (sessions: device [B]): selection rows idx[(b * Hkv + h) * max_selected
// + i], i < cnt[b * Hkv + h] (any order; -1 past the count is not written), and the estimation
// zone's state est_o [B, Hq, d] fp32, est_lse [B, Hq] (natural log; -inf, o = 0 where the zone is
// empty). max_clusters / max_cluster_rows: host bounds over the batch (as for the workspace). A
// list longer than max_selected is cut there (the host sizes it so that none is).
Status retro_select(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                    const RetroSession* sessions, const RetroConfig& cfg, int32_t max_clusters,
                    int32_t max_cluster_rows, int32_t* idx, int32_t* cnt, int32_t max_selected, float* est_o,
                    float* est_lse, const Workspace& ws, void* stream) noexcept;

namespace detail {
// Process-wide: the zones kernel reads the cluster keys from global memory, written by a separate
// kernel (the path of more clusters than its shared memory holds, about 650K tokens in clusters of
// 16), whatever the cluster count. For tests only.
void set_retro_zone_global(bool on) noexcept;
// Process-wide: retro_kmeans assigns on the tensor cores (default; 3xTF32) or, off, on the CUDA
// cores in fp32 (the environment's KVS_RETRO_KMEANS_MMA=0 does the same). For tests and benchmarks.
void set_retro_kmeans_mma(bool on) noexcept;
bool retro_kmeans_mma() noexcept;  // the switch as it stands (the environment's, or the last set)
}  // namespace detail

// ---- the wave buffer (KV in pinned host memory) -------------------------------------------------
// The step's page table: row b (stride entries) = session b's cache pages, then its pages from
// kv (max_pages entries of row b), then its staging pages, then null; the first own_cap entries
// also written to the session's own_table where set.
Status retro_wave_table(const PagedKv& kv, int32_t batch, const RetroSession* sessions, const void** table,
                        int32_t stride, void* stream) noexcept;

// Block-cache moves of one session's layer, read from `moves` (host-mapped memory may do):
// rows [row0, row0 + rows) of KV head h's lists (rows <= kWaveBlockRows) enter cache block `block`
// (their K and V rows copied there from their token positions, their virtual positions set to
// block * kWaveBlockRows + i), or leave the cache (block < 0: virtual positions back to
// tok_base + position). kv: the session's own table (B = 1, cache pages first); pos: token
// positions [Hkv][rs]; vpos: virtual positions [Hkv][rs] (rs: RetroSession::rs). *count moves
// (device or mapped memory).
constexpr int32_t kWaveBlockRows = 8;
struct WaveMove {
  int32_t h, row0, rows, block;
};
// tok2v (optional, [Hkv][ts], ts >= T): each clustered token's virtual position, kept as vpos is
// (T tokens per head: positions t < T of every row moved).
// stage_map (optional): rows staged by this step (epoch) are copied from their staging slot j,
// row j of stage (B = 1: the staging pages).
Status retro_wave_moves(const PagedKv& kv, Scalar kv_dtype, int32_t num_kv_heads, int32_t head_dim,
                        const int32_t* pos, int32_t rs, int32_t* vpos, int32_t* tok2v, int32_t T, int32_t ts,
                        int32_t tok_base, const PagedKv& stage, const int64_t* stage_map, uint32_t epoch,
                        const WaveMove* moves, const int32_t* count, int32_t max_moves, void* stream) noexcept;

// The execution buffer (wave_misses=stage): each listed token t in [0, T) of session row `row`
// (virtual position tok_base + t: not cached) has its K and V rows copied, a warp per row, into
// staging slot j (virtual position stage_base + j, j < stage_cap, taken in any order by a counter
// per KV head: stage_cnt [Hkv], zeroed before) and its list entry replaced by that position;
// stage_map [Hkv][ts] (ts >= T; epoch << 32 | j) and stage_tok [Hkv][stage_cap] (t) record the
// slots for the step's admissions and for reading the list back. kv: the step's table.
Status retro_wave_stage(const PagedKv& kv, Scalar kv_dtype, int32_t row, int32_t num_kv_heads, int32_t head_dim,
                        int32_t* idx, const int32_t* cnt, int32_t max_selected, int32_t T, int32_t ts,
                        int32_t tok_base, int32_t stage_base, int32_t stage_cap, int64_t* stage_map, int32_t* stage_tok,
                        int32_t* stage_cnt, uint32_t epoch, void* stream) noexcept;

// After the moves of the step (misses admitted before the attention): each listed token t in
// [0, T) (virtual position tok_base + t) of session row `row` (lists idx[(row * Hkv + h) *
// max_selected + i], i < cnt) replaced by tok2v[h][t] (stride ts), its cache slot when admitted.
Status retro_wave_remap(int32_t row, int32_t num_kv_heads, int32_t* idx, const int32_t* cnt, int32_t max_selected,
                        const int32_t* tok2v, int32_t T, int32_t ts, int32_t tok_base, void* stream) noexcept;

// An index update that appended clusters (rows [r0, r1) of every KV head, tokens [t0, t1)), none
// of them cached: vpos[h][r] = tok_base + pos[h][r] (stride rs), and where given tok2v[h][t] =
// tok_base + t and stage_map[h][t] = 0 (stride ts). The rows and tokens before are left as they are.
Status retro_wave_extend(int32_t num_kv_heads, const int32_t* pos, int32_t rs, int32_t* vpos, int32_t r0, int32_t r1,
                         int32_t tok_base, int32_t* tok2v, int64_t* stage_map, int32_t ts, int32_t t0, int32_t t1,
                         void* stream) noexcept;

}  // namespace kvs::cuda

namespace kvs::cuda {

// ---- the index build: segmented spherical k-means (the CPU's retro::segmented_kmeans) ----------
// Over the keys of tokens [t0, t0 + n) of every KV head of one sequence (kv: B = 1), in fp32 from
// the stored keys: centred by their mean (centre), C centroids, `segments` segments of
// m = n / segments rows and C / segments centroids, iterations - 1 spherical passes inside each
// segment (assign to the largest inner product, lowest index on ties; centroids the normalised
// member means, an empty cluster keeps its centroid; the n mod segments remainder rows take no
// part), then one global assignment of every row against all C centroids and the un-normalised
// member means plus the mean. Initial centroids: the (centred) rows floor(c n / C + n / (2 C)) of
// the whole run (raw_init), or per segment the rows floor(c m / Cs + m / (2 Cs)) normalised.
// Outputs: assign [Hkv][n] int32 in [0, C), centroids [Hkv][C][d] fp32. Each cluster's members are
// summed in fp64 in row order, as the CPU does, and nothing depends on the order threads run in:
// the same keys give the same outputs bit for bit on every run. The assignment's inner products
// (3xTF32 on the tensor cores, or fp32) differ from the CPU's (oneDNN's fp32 GEMM) by rounding, so
// a near-tie may assign differently there.
struct RetroKMeans {
  int32_t n = 0, clusters = 0, segments = 1, iterations = 10;
  bool centre = true, raw_init = true;
};
size_t retro_kmeans_workspace_bytes(int32_t num_kv_heads, int32_t head_dim, const RetroKMeans& k) noexcept;
Status retro_kmeans(const PagedKv& kv, Scalar kv_dtype, int32_t num_kv_heads, int32_t head_dim, int32_t t0,
                    const RetroKMeans& k, int32_t* assign, float* centroids, const Workspace& ws,
                    void* stream) noexcept;

// Pages [p0, p0 + np) of one sequence's paged KV (kv: B = 1), page_bytes each (a multiple of 16),
// copied back to back to dst: device memory, or mapped pinned host memory by its device address
// (an index update's tokens read back in stream order, without waiting for the stream).
Status retro_copy_pages(const PagedKv& kv, int32_t p0, int32_t np, size_t page_bytes, void* dst, void* stream) noexcept;

}  // namespace kvs::cuda
