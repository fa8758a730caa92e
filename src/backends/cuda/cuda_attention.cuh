// SPDX-License-Identifier: Apache-2.0
// CUDA kernels for decode attention over the paged KV layout (kv_layout.cuh): dense split-K
// ("flash-decoding"), gathered (index lists per KV head or per query head) and the exact merge of
// two attention states.
//
// This header is private to the library (src/), plain C++: no CUDA types cross it; a CUDA stream
// crosses as `void*` (a cudaStream_t; nullptr = the legacy default stream). It compiles without
// nvcc. Nothing here throws: every function is noexcept and returns a Status.
//
// Conventions shared by every function below
// ------------------------------------------
// - All pointers are DEVICE pointers unless the comment says "host". Every kernel is enqueued on
//   `stream` and returns without synchronizing; inputs, outputs and the workspace must stay alive
//   and untouched by other streams until the stream reaches that point. No call allocates or
//   synchronizes, so every call can be captured into a CUDA graph.
// - Shapes: B = batch (sequences), Hq = query heads, Hkv = KV heads, G = Hq / Hkv (any integer >= 1;
//   query head h reads KV head h / G), d = head dim (64, 128 or 256; others return UNSUPPORTED).
// - Query: [B, Hq, d] contiguous, dtype F32 or the KV dtype (bf16/fp16).
// - KV cache: the paged layout of kv_layout.cuh (PagedKv) in the KV dtype `kv_dtype` (BF16 or
//   F16, K and V alike): token t of sequence b lives in page kv.pages[b * kv.max_pages + t / P],
//   P = kv.page_tokens (a power of two in [16, 1024], kv.page_shift = log2(P)); a page is
//   K[Hkv][P][d] then V[Hkv][P][d]. Pages must be 16-byte aligned (the layout promises 256) and
//   their order in memory is free. Only the page-table entries of pages holding tokens a call reads
//   are dereferenced; the others may hold anything. One page must hold < 2^31 elements
//   (2 * Hkv * P * d).
// - Softmax: scores are `scale * dot(q_h, k_t)` (scale is a multiplier, typically 1/sqrt(d)).
//   Arithmetic is fp32 throughout (products, running max, sums, accumulators).
// - Output state: o [B, Hq, d] (dtype F32 or the KV dtype), lse [B, Hq] fp32, NATURAL log:
//   lse = log(sum_t exp(scale * q.k_t)). An empty key set gives lse = -inf, o = 0 (never NaN).
// - Workspace: functions that need scratch take a caller-owned device buffer; ask its size with the
//   matching *_workspace_bytes function (same shape, same device current). Size 0 means none
//   needed (a null pointer is then fine). Workspace use is stream-ordered: one workspace must not
//   serve two calls that can run concurrently.
// - pdl (optional, default false): launch the first kernel as a programmatic dependent launch
//   (sm_90) of the stream's previous kernel: it starts while that kernel runs and reads the query
//   (and nothing else) before that kernel has completed, then waits for it. Pass true only when
//   the previous launch on the stream does not write the query (kvsieve's own KV append does not);
//   a kernel's later launches in one call depend on its earlier ones this way regardless.
// - The current CUDA device (cudaGetDevice) must be the one owning every pointer.
// - Threading: every function is safe to call concurrently from several host threads
//   (@threadsafety any) given distinct outputs and workspaces.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cuda/kv_layout.cuh"

namespace kvs::cuda {

// Same numbers as KVS_SCALAR_* and kvs::DType, so a DType casts straight across.
enum class Scalar : int32_t { F32 = 1, F16 = 2, BF16 = 3 };

// Status of a call. `code` uses kvs_status numbers: 0 OK, 1 INVALID_ARGUMENT, 3 UNSUPPORTED,
// 11 BACKEND (a CUDA call or launch failed; `cuda_error` holds the cudaError_t). `message` is a
// static string naming the failed check or CUDA call (never null, never to be freed).
struct Status {
  int32_t code = 0;
  int32_t cuda_error = 0;
  const char* message = "ok";
  bool ok() const noexcept { return code == 0; }
};

// Shape and softmax scale shared by the attention calls.
struct AttnShape {
  int32_t batch = 0;         // B >= 1
  int32_t num_q_heads = 0;   // Hq, a multiple of Hkv
  int32_t num_kv_heads = 0;  // Hkv >= 1
  int32_t head_dim = 0;      // d: 64, 128 or 256
  float scale = 0.f;         // softmax scale multiplying q.k (e.g. 1/sqrt(d))
};

// Tensors whose address changes between replays of a captured graph are passed by reference: when
// `at` is set, the kernels read the address from that device location when they run (and `data`,
// `o`, `lse` are ignored); the caller writes it there (in stream order) before each launch.
struct Query {
  const void* data = nullptr;  // [B, Hq, d] contiguous, 16-byte aligned
  Scalar dtype = Scalar::F32;  // F32, or the KV dtype
  const void* const* at = nullptr;  // optional: device address holding `data`
};

struct Output {
  void* o = nullptr;           // [B, Hq, d] contiguous; every element is written
  Scalar dtype = Scalar::F32;  // F32, or the KV dtype
  float* lse = nullptr;        // [B, Hq] fp32, natural log (base 2 with lse_base2); every element is written
  void* const* at = nullptr;   // optional: device [2] holding `o` then `lse`
  bool lse_base2 = false;      // write log2 of the softmax denominator instead of ln
  // Optional (gathered decode only): a prior attention state over keys outside the lists, merged
  // into the result as one more part of the softmax (RetroInfer's estimation zone): o [B, Hq, d]
  // fp32, lse [B, Hq] fp32 natural log (-inf: none for that row; its o is then not read). The
  // result is then the attention over the listed keys and the prior together. Size the workspace
  // with gathered_decode_workspace_bytes(..., with_prior = true).
  const float* prior_o = nullptr;
  const float* prior_lse = nullptr;
};

struct Workspace {
  void* ptr = nullptr;  // device, 256-byte aligned (cudaMalloc's alignment)
  size_t bytes = 0;
};

// ---- 1. Dense decode -------------------------------------------------------------------------
// One query token per sequence attends to tokens [0, lengths[b]) of its own pages.
// lengths: device int32 [B]; max_length (host) must be >= every lengths[b] (larger lengths are
// clamped to max_length) and <= kv.max_pages * kv.page_tokens. Split-K over KV chunks, a CTA per
// (chunk, KV head, sequence) serving the whole query group (up to 8 heads; larger groups take
// ceil(G/8) CTAs) so K and V are read once per KV head; a second kernel merges the chunks (skipped
// when one chunk suffices; launched as a programmatic dependent launch so its start overlaps the
// first kernel's tail). Two launches at most, no host sync, no allocation. Groups of 3 or more
// heads (here and in gathered decode's per-KV-head lists) run on tensor cores (mma.sync, q and p
// split into hi+lo 16-bit parts, fp32 accumulation): with fp16 KV there, |q * scale * log2(e)| must
// stay below 65504.
size_t dense_decode_workspace_bytes(const AttnShape& shape, int32_t max_length) noexcept;
Status dense_decode(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                    const int32_t* lengths, int32_t max_length, const Output& out,
                    const Workspace& ws, void* stream, bool pdl = false) noexcept;

// ---- 2. Gathered decode ----------------------------------------------------------------------
// Like dense_decode, but each query head attends only to the tokens of one index list:
// - per_query_head = false (the default): one list per KV head, shared by its G query heads.
//   indices: device int32 [B, Hkv, max_selected], counts: device int32 [B, Hkv]; KV head h of
//   sequence b reads tokens indices[(b * Hkv + h) * max_selected + i], i < counts[b * Hkv + h].
// - per_query_head = true: one list per query head. indices [B, Hq, max_selected], counts [B, Hq];
//   query head h reads only its own list, over KV head h / G (K/V rows are then read once per
//   query head, not once per KV head).
// Each index must be a token of an existing page of that sequence, in [0, max_pages * P) (not
// checked on device: anything else is undefined); any order, duplicates count twice. Counts are
// clamped to [0, max_selected]; a count of 0 gives lse = -inf, o = 0 for the heads of that list.
// Slots at or past a count may hold anything (they may be loaded, never used as tokens).
size_t gathered_decode_workspace_bytes(const AttnShape& shape, int32_t max_selected,
                                       bool per_query_head = false, bool with_prior = false) noexcept;
Status gathered_decode(const AttnShape& shape, const Query& q, const PagedKv& kv, Scalar kv_dtype,
                       const int32_t* indices, const int32_t* counts, int32_t max_selected,
                       const Output& out, const Workspace& ws, void* stream,
                       bool per_query_head = false, bool pdl = false) noexcept;

// ---- 3. Merge of two attention states --------------------------------------------------------
// For each of `rows` rows (e.g. B * Hq): m = max(la, lb); lse = m + log(e^(la-m) + e^(lb-m));
// o = e^(la-lse) o_a + e^(lb-lse) o_b. All fp32, o_* [rows, head_dim] contiguous, lse_* [rows],
// natural log. An empty state (lse = -inf, o = 0) changes nothing; two empty states give -inf, 0.
// The output may alias either input (in-place merge). head_dim: any value >= 1.
Status merge_states(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b,
                    float* o, float* lse, int64_t rows, int32_t head_dim, void* stream) noexcept;

// ---- introspection / tuning (benchmarks and tests) -------------------------------------------
// Number of KV chunks dense decode uses for this shape on the current device (1 = no merge
// kernel). Returns 0 on an unsupported shape.
int32_t decode_num_splits(const AttnShape& shape, int32_t max_tokens, Scalar kv_dtype) noexcept;

namespace detail {
// Process-wide kernel variant for the bf16 dense path (0 = default). For benchmarking and tests
// only; not meant to be called by the library. Returns false for an unknown variant.
bool set_dense_variant(int variant) noexcept;
// Process-wide pipeline shape of gathered decode for bf16, d 128, groups of 4 (0 = the default,
// tensor cores with 4 warps x 2 stages; 1: CUDA cores 4 x 2; 2: CUDA cores 8 x 2; 3: tensor cores
// 4 x 3; 4: CUDA cores 4 x 4, the default before; 5: CUDA cores 2 x 4). For benchmarking only.
// Returns false for an unknown variant.
bool set_gather_variant(int variant) noexcept;
// Process-wide: launch the chunk-merge kernel as a programmatic dependent launch (default true)
// or as a plain launch. For benchmarking only.
void set_merge_pdl(bool on) noexcept;
// Process-wide: a chunk kernel launched with pdl waits for the previous kernel before its query
// set-up too (default false). For tests only.
void set_pdl_wait_first(bool on) noexcept;
// Process-wide: fewest keys per split of the split-K plan (<= 0: the default, 128). Query the
// workspace size after setting it. For benchmarking only.
void set_min_chunk(int32_t tokens) noexcept;
}  // namespace detail

}  // namespace kvs::cuda
