/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvsieve: sparse-attention decoding over a KV cache, behind a stable C ABI.
 *
 * Conventions (see docs/api.md for the full reference):
 *  - Every fallible call returns kvs_error_t: NULL on success, otherwise an owned error object the
 *    caller frees with kvs_error_destroy(). On error, outputs are left untouched.
 *  - Parameter structs start with `uint32_t struct_size`; fill them with kvs_X_params_init() and only
 *    then change fields. Fields are only ever appended.
 *  - Tensors are described by kvs_tensor, laid out exactly like DLPack's DLTensor. NULL strides mean
 *    C-contiguous. Inputs are borrowed for the duration of the call (for asynchronous CUDA work: until
 *    the stream passed with the call has completed). Outputs (o, lse) whose strides put two
 *    elements at one address are refused (KVS_STATUS_INVALID_ARGUMENT).
 *  - Every log-sum-exp crossing this API is a natural logarithm (base e), unless the session was
 *    created with kvs_session_params.lse_base = KVS_LSE_BASE_2 (then base 2, as FlashInfer's).
 *  - Thread safety is tagged on each function:
 *      @threadsafety any              callable from any thread at any time
 *      @threadsafety concurrent-const concurrent calls on one object are fine if none mutates it
 *      @threadsafety exclusive        the caller serialises all calls on the object
 *
 * This header is C99. No STL, no FILE*, no CUDA or oneDNN types: a CUDA stream crosses as void*.
 */
#ifndef KVSIEVE_KVSIEVE_H
#define KVSIEVE_KVSIEVE_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#if defined(KVS_BUILDING_LIBRARY)
#define KVS_API __declspec(dllexport)
#else
#define KVS_API __declspec(dllimport)
#endif
#else
#define KVS_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Versions                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

#define KVS_VERSION_MAJOR 0
#define KVS_VERSION_MINOR 1
#define KVS_VERSION_PATCH 0
/* ABI version: bumped with every incompatible change of this header; equals the SONAME. */
#define KVS_ABI_VERSION 0

/** "MAJOR.MINOR.PATCH" of the loaded library. @threadsafety any */
KVS_API const char* kvs_version(void);
/** MAJOR*10000 + MINOR*100 + PATCH of the loaded library. @threadsafety any */
KVS_API uint32_t kvs_version_number(void);
/** ABI version of the loaded library. @threadsafety any */
KVS_API uint32_t kvs_abi_version(void);

/* ---------------------------------------------------------------------------------------------- */
/* Errors                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/** Error codes. Values are explicit and never reused. */
typedef enum kvs_status {
  KVS_STATUS_OK = 0,
  KVS_STATUS_INVALID_ARGUMENT = 1, /* a NULL, a wrong shape, dtype, device, layer, value */
  KVS_STATUS_OUT_OF_MEMORY = 2,
  KVS_STATUS_UNSUPPORTED = 3,      /* valid request the build or method cannot do (e.g. no CUDA) */
  KVS_STATUS_INVALID_STATE = 4,    /* call out of order (decode before prefill, ...) */
  KVS_STATUS_IO = 5,               /* open/read/write/rename failed */
  KVS_STATUS_FORMAT_MAGIC = 6,     /* not a kvsieve file */
  KVS_STATUS_FORMAT_VERSION = 7,   /* unknown major format version */
  KVS_STATUS_FORMAT_TRUNCATED = 8, /* file shorter than its directory says */
  KVS_STATUS_FORMAT_CHECKSUM = 9,  /* a section's checksum does not match */
  KVS_STATUS_FORMAT_INVALID = 10,  /* inconsistent header, sizes or values */
  KVS_STATUS_BACKEND = 11,         /* CUDA / oneDNN / BLAS failure; see kvs_error_backend_code */
  KVS_STATUS_ABI_MISMATCH = 12,
  KVS_STATUS_INTERNAL = 13
} kvs_status;

typedef struct kvs_error_s* kvs_error_t;

/** The code of an error (KVS_STATUS_OK for NULL). @threadsafety concurrent-const */
KVS_API int32_t kvs_error_code(const struct kvs_error_s* err);
/** UTF-8 message naming the offending argument and what was expected ("" for NULL). Valid until
 *  kvs_error_destroy. @threadsafety concurrent-const */
KVS_API const char* kvs_error_message(const struct kvs_error_s* err);
/** The backend's own code (cudaError_t, dnnl_status_t, errno), 0 if none. @threadsafety concurrent-const */
KVS_API int64_t kvs_error_backend_code(const struct kvs_error_s* err);
/** Frees an error; NULL is a no-op. @threadsafety exclusive */
KVS_API void kvs_error_destroy(kvs_error_t err);

/** Fails with KVS_STATUS_ABI_MISMATCH when the loaded library was built for another ABI than the
 *  header the caller compiled against. Call as kvs_abi_check(KVS_ABI_VERSION). @threadsafety any */
KVS_API kvs_error_t kvs_abi_check(uint32_t header_abi_version);

/** Frees a string the library returned as owned (e.g. from kvs_tables_describe). NULL is a no-op.
 *  @threadsafety exclusive (on the string) */
KVS_API void kvs_string_free(char* s);

/* ---------------------------------------------------------------------------------------------- */
/* Tensors: layout-identical to DLPack's DLTensor (DLPack >= 0.6)                                 */
/* ---------------------------------------------------------------------------------------------- */

typedef enum kvs_device_type {
  KVS_DEVICE_CPU = 1,       /* kDLCPU */
  KVS_DEVICE_CUDA = 2,      /* kDLCUDA */
  KVS_DEVICE_CUDA_HOST = 3  /* kDLCUDAHost: pinned host memory, readable by CPU kernels */
} kvs_device_type;

typedef struct kvs_device {
  int32_t device_type; /* kvs_device_type */
  int32_t device_id;
} kvs_device;

typedef enum kvs_dtype_code {
  KVS_DTYPE_CODE_INT = 0,   /* kDLInt */
  KVS_DTYPE_CODE_UINT = 1,  /* kDLUInt */
  KVS_DTYPE_CODE_FLOAT = 2, /* kDLFloat */
  KVS_DTYPE_CODE_BFLOAT = 4 /* kDLBfloat */
} kvs_dtype_code;

typedef struct kvs_dtype {
  uint8_t code;   /* kvs_dtype_code */
  uint8_t bits;   /* 16, 32, ... */
  uint16_t lanes; /* 1 */
} kvs_dtype;

typedef struct kvs_tensor {
  void* data;
  kvs_device device;
  int32_t ndim;
  kvs_dtype dtype;
  int64_t* shape;       /* ndim entries */
  int64_t* strides;     /* ndim entries, in elements; NULL = C-contiguous */
  uint64_t byte_offset; /* added to data */
} kvs_tensor;

/** Storage/element types by name, used where a plain enum is clearer than a kvs_dtype. */
typedef enum kvs_scalar_type {
  KVS_SCALAR_F32 = 1,
  KVS_SCALAR_F16 = 2,
  KVS_SCALAR_BF16 = 3
} kvs_scalar_type;

/* ---------------------------------------------------------------------------------------------- */
/* Logging                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

typedef enum kvs_log_level {
  KVS_LOG_DEBUG = 0,
  KVS_LOG_INFO = 1,
  KVS_LOG_WARN = 2,
  KVS_LOG_ERROR = 3,
  KVS_LOG_OFF = 4
} kvs_log_level;

/** Receives whole lines (no trailing newline). May be called from library worker threads. */
typedef void (*kvs_log_fn)(int32_t level, const char* line, void* user_data);

/** Installs the process-wide log sink atomically (NULL restores the default: warnings and errors
 *  to stderr). Messages below min_level are dropped before formatting. @threadsafety any */
KVS_API void kvs_set_log_callback(kvs_log_fn fn, void* user_data, int32_t min_level);

/* ---------------------------------------------------------------------------------------------- */
/* Method registry                                                                                */
/* ---------------------------------------------------------------------------------------------- */

typedef struct kvs_param_info {
  uint32_t struct_size;
  const char* name;          /* static strings, valid for the life of the process */
  const char* type;          /* "int", "float", "bool", "string", or "enum:a|b|c" */
  const char* default_value; /* as text */
  const char* doc;           /* one line */
} kvs_param_info;

/** Number of registered methods. @threadsafety any */
KVS_API size_t kvs_method_count(void);
/** Name of method i (0 <= i < count), NULL if out of range. @threadsafety any */
KVS_API const char* kvs_method_name(size_t i);
/** One-line description of a method, NULL if unknown. @threadsafety any */
KVS_API const char* kvs_method_doc(const char* method);
/** Backends the method supports, as a bit mask of (1 << kvs_backend). 0 if unknown. @threadsafety any */
KVS_API uint32_t kvs_method_backends(const char* method);
/** Why `method` cannot run on `backend` (a kvs_backend) in this build: a sentence naming the
 *  reason, or NULL when it can (or the method is unknown: see kvs_method_doc). The string is static.
 *  @threadsafety any */
KVS_API const char* kvs_method_unsupported_reason(const char* method, int32_t backend);
/** Number of parameters of a method; fails on an unknown method. @threadsafety any */
KVS_API kvs_error_t kvs_method_param_count(const char* method, size_t* out_count);
/** Parameter i of a method; out->struct_size must be set by the caller. @threadsafety any */
KVS_API kvs_error_t kvs_method_param(const char* method, size_t i, kvs_param_info* out);

/* ---------------------------------------------------------------------------------------------- */
/* Sessions                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

typedef enum kvs_backend {
  KVS_BACKEND_CPU = 1,
  KVS_BACKEND_CUDA = 2,
  KVS_BACKEND_HYBRID = 3
} kvs_backend;

typedef enum kvs_gemm_provider {
  KVS_GEMM_AUTO = 0, /* KVS_GEMM environment variable ("onednn"/"openblas"), else oneDNN */
  KVS_GEMM_ONEDNN = 1,
  KVS_GEMM_OPENBLAS = 2
} kvs_gemm_provider;

/** The base of the log-sum-exp a decode step writes (kvs_session_params.lse_base). Base 2 is
 *  lse_e / ln 2, for kernels that merge attention states in base 2 (FlashInfer's merge_state). */
typedef enum kvs_lse_base {
  KVS_LSE_BASE_E = 0, /* natural log (the default) */
  KVS_LSE_BASE_2 = 1  /* log2: lse_e * log2(e) */
} kvs_lse_base;

/** Who stores a session's K/V (kvs_session_params.kv_source). */
typedef enum kvs_kv_source {
  KVS_KV_OWNED = 0, /* kvsieve stores the K/V given to prefill, append and decode (the default) */
  KVS_KV_CALLER = 1 /* the caller's paged KV cache (an inference engine's), declared per layer with
                       kvs_session_bind_kv; kvsieve keeps only its method's index and reads the
                       keys and values in place */
} kvs_kv_source;

typedef struct kvs_session_params {
  uint32_t struct_size;   /* sizeof(kvs_session_params) */
  uint32_t num_layers;    /* 1 .. 4096 */
  uint32_t num_q_heads;   /* a multiple of num_kv_heads, <= 8192 */
  uint32_t num_kv_heads;  /* 1 .. 1024 */
  uint32_t head_dim;      /* 8 .. 256 */
  float softmax_scale;    /* 0 = 1/sqrt(head_dim) */
  int32_t kv_dtype;       /* kvs_scalar_type of the stored K/V; default BF16 */
  int32_t backend;        /* kvs_backend; default CPU */
  int32_t device_id;      /* CUDA device for the cuda/hybrid backends */
  uint32_t num_threads;   /* CPU worker threads, <= 1024; 0 = all hardware threads */
  int32_t gemm;           /* kvs_gemm_provider */
  const char* method;     /* registry name; NULL = "full". Copied. */
  const char* method_params; /* "key=value,key=value" (see kvs_method_param); NULL = defaults. Copied. */
  double budget;          /* fraction of the context in (0, 1]; 0 = unset */
  int64_t budget_tokens;  /* absolute number of exact keys; 0 = unset. Wins over budget. */
  /* Fields below were appended after 0.1.0: a caller built against 0.1.0's header passes the
   * smaller struct_size and gets their defaults. */
  int32_t lse_base;       /* kvs_lse_base of the lse that decode writes; default KVS_LSE_BASE_E.
                             The sessions of one cuda batch must share it. */
  int64_t max_rollback;   /* tokens kvs_session_truncate must be able to drop exactly (at least) on
                             methods whose index keeps history (csattention, ctkvr, lfps, hgca,
                             retroinfer): the cpu backend keeps up to two copies of the method's
                             index and the queries of the last 2 * max_rollback tokens (docs/api.md,
                             "Rollback"). 0 (the default) keeps none; >= 0, <= 2^20. full,
                             exact_topk, streaming and quest roll back to any length without it. */
  /* Where the KV cache lives (kvs_device_type), 0 = the backend's own memory. The cuda backend
   * takes KVS_DEVICE_CUDA (GPU memory, the default) or KVS_DEVICE_CUDA_HOST: pinned host memory
   * mapped into the GPU's address space, which the kernels read over the bus (PCIe / NVLink-C2C),
   * for contexts larger than GPU memory; the method's index stays on the GPU. The cpu backend
   * takes KVS_DEVICE_CPU only. */
  int32_t kv_memory;
  /* Fields below were appended after kv_memory. reserved0 keeps them out of the tail padding of
   * the struct that ended at kv_memory (its sizeof was already a multiple of 8), so struct_size
   * tells the two apart. Leave it 0. */
  int32_t reserved0;
  /* Who stores the K/V (kvs_kv_source): KVS_KV_OWNED (0, the default) or KVS_KV_CALLER, the
   * caller's own paged KV cache (kvs_session_bind_kv; cpu and cuda backends). */
  int32_t kv_source;
} kvs_session_params;

/** Fills defaults (struct_size included). @threadsafety any */
KVS_API void kvs_session_params_init(kvs_session_params* p);

typedef struct kvs_session_s* kvs_session_t;

/** Creates a session (owned; free with kvs_session_destroy). @threadsafety any */
KVS_API kvs_error_t kvs_session_create(const kvs_session_params* params, kvs_session_t* out);
/** Frees a session; NULL is a no-op. Sessions forked from it stay valid. @threadsafety exclusive */
KVS_API void kvs_session_destroy(kvs_session_t s);

/** Appends a chunk of one layer's prompt: q [n, Hq, d], k and v [n, Hkv, d] (n >= 1). A prompt may
 *  come in several chunks (chunked prefill) until kvs_session_build_index indexes the layer; after
 *  that, use kvs_session_append. o (optional, NULL to skip) [n, Hq, d] receives causal attention of
 *  the chunk over the prompt so far.
 *  stream: a cudaStream_t for the cuda backend (NULL = default stream); ignored on the CPU.
 *  @threadsafety exclusive */
KVS_API kvs_error_t kvs_session_prefill(kvs_session_t s, uint32_t layer, const kvs_tensor* q,
                                        const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                                        void* stream);

/** Builds the method's index over every prefilled layer (a no-op for index-free methods).
 *  @threadsafety exclusive */
KVS_API kvs_error_t kvs_session_build_index(kvs_session_t s, void* stream);

/** One decode step of one layer: appends k_new, v_new [Hkv, d], selects, attends with q [Hq, d] and
 *  writes o [Hq, d] and, when lse is not NULL, lse [Hq] (fp32; natural log, or base 2 when the
 *  session's lse_base is KVS_LSE_BASE_2). o may be fp32/fp16/bf16.
 *  @threadsafety exclusive */
KVS_API kvs_error_t kvs_session_decode(kvs_session_t s, uint32_t layer, const kvs_tensor* q,
                                       const kvs_tensor* k_new, const kvs_tensor* v_new,
                                       const kvs_tensor* o, const kvs_tensor* lse, void* stream);

/** Several decode steps of one layer in one call: n tokens (speculative decoding's drafts to
 *  verify, or a chunk decoded token by token), q [n, Hq, d], k_new, v_new [n, Hkv, d] (NULL with
 *  kv_source = KVS_KV_CALLER: the n tokens bound already), o [n, Hq, d], lse [n, Hq] or NULL. Row i
 *  is exactly the i-th of n kvs_session_decode calls: the token is appended, the method selects
 *  for it and it attends the context and the rows before it (sparse, at the session's budget;
 *  kvs_session_append gives exact causal attention instead). The rows are checked for shape,
 *  dtype and device before the first step (1 <= n <= 65536). A step that fails after the first
 *  leaves the steps before it done (their outputs written); the error message names the row and
 *  the layer's length, and kvs_session_truncate drops them. Rejected drafts: kvs_session_truncate.
 *  @threadsafety exclusive */
KVS_API kvs_error_t kvs_session_decode_tokens(kvs_session_t s, uint32_t layer, const kvs_tensor* q,
                                              const kvs_tensor* k_new, const kvs_tensor* v_new,
                                              const kvs_tensor* o, const kvs_tensor* lse, void* stream);

/** Appends several tokens of one layer (a new chat turn): q [n, Hq, d], k, v [n, Hkv, d]; o
 *  (optional) [n, Hq, d] receives exact causal attention over the whole context. Methods update
 *  their index as their spec prescribes. @threadsafety exclusive */
KVS_API kvs_error_t kvs_session_append(kvs_session_t s, uint32_t layer, const kvs_tensor* q,
                                       const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o,
                                       void* stream);

/* ---- A KV cache the caller owns (engine integration) ------------------------------------------ */

/** How a page of a caller's KV cache orders its tokens and heads (kvs_paged_kv.layout), in
 *  FlashInfer's terms: "HND", [num_kv_heads][page_size][head_dim], or "NHD",
 *  [page_size][num_kv_heads][head_dim]. */
typedef enum kvs_kv_layout {
  KVS_KV_LAYOUT_HND = 0, /* head-major (the default) */
  KVS_KV_LAYOUT_NHD = 1  /* token-major: vLLM's default, FlashInfer's default */
} kvs_kv_layout;

/** One layer's KV cache as an inference engine keeps it: a pool of pages and the pages of this
 *  sequence in token order (token t is slot t % page_size of pool page
 *  page_indices[t / page_size]). A page holds page_size consecutive tokens of every KV head, in
 *  the session's kv_dtype, laid out as `layout` says:
 *    K and V in one tensor (v_pages NULL), pages:
 *      HND: [num_pages][2][num_kv_heads][page_size][head_dim]  (keys of the page, then its values)
 *      NHD: [num_pages][2][page_size][num_kv_heads][head_dim]
 *    (FlashInfer's paged_kv_cache with kv_layout "HND" or "NHD", vLLM's FlashInfer backend);
 *    K and V in two tensors of the same shape, pages (keys) and v_pages (values):
 *      HND: [num_pages][num_kv_heads][page_size][head_dim] each
 *      NHD: [num_pages][page_size][num_kv_heads][head_dim] each
 *    (vLLM's FlashAttention backend: kv_cache[0] and kv_cache[1] of its
 *    [2][num_blocks][block_size][num_kv_heads][head_size] cache). The cpu backend reads HND pages
 *    with K and V in one tensor only. */
typedef struct kvs_paged_kv {
  uint32_t struct_size;        /* sizeof(kvs_paged_kv) (kvs_paged_kv_init) */
  const void* pages;           /* the pool (the K pool when v_pages is set): GPU memory of the
                                  session's device (cuda backend, 256-byte aligned), or host memory
                                  (cpu backend, 16-byte aligned) */
  int64_t num_pages;           /* pages in the pool, >= 1 */
  int32_t page_size;           /* tokens per page, the same in every binding of a session: a power
                                  of two in 16..1024 on the cuda backend, 256 on the cpu backend */
  const int32_t* page_indices; /* host memory, copied: the sequence's pool pages in token order,
                                  each in [0, num_pages) */
  int64_t num_page_indices;    /* >= ceil(num_tokens / page_size) */
  int64_t num_tokens;          /* tokens of this sequence the cache holds in this layer now */
  uint64_t pool_bytes;         /* bytes the pool spans from `pages`, or 0 (not known): when given,
                                  num_pages pages must fit in it (the Python binding always gives it) */
  int32_t layout;              /* kvs_kv_layout: KVS_KV_LAYOUT_HND (0, the default) or
                                  KVS_KV_LAYOUT_NHD; the same in every binding of a session */
  int32_t reserved0;           /* 0 */
  const void* v_pages;         /* NULL: K and V in one tensor, `pages`; else the V pool, of the K
                                  pool's shape and page numbering, apart from it (cuda backend,
                                  256-byte aligned) */
  uint64_t v_pool_bytes;       /* bytes the V pool spans, or 0 (not known); as pool_bytes; 0
                                  without v_pages */
} kvs_paged_kv;

/** Fills defaults (struct_size; everything else 0). @threadsafety any */
KVS_API void kvs_paged_kv_init(kvs_paged_kv* kv);

/** Sessions with kv_source = KVS_KV_CALLER: declares where layer `layer`'s K/V are now. kvsieve
 *  keeps no copy: prefill, append and decode then take NULL k/v (k_new/v_new) and count the next
 *  tokens of the bound cache as theirs, its method indexing and attending them in place. A binding
 *  holds until the next one for the layer; bind again whenever the engine's page table grows or
 *  changes (typically once per layer per step, after the engine has written the new token's K/V).
 *  The caller must keep the pool alive and must not change the K/V of tokens the session has
 *  counted (the index describes them) until they are dropped (kvs_session_truncate) or the session
 *  is destroyed; pages may be renumbered between bindings.
 *  kv->num_tokens: at least the layer's tokens (kvs_session_layer_tokens); a prefill, append or
 *  decode needs the tokens it adds to be bound already.
 *  stream: a cudaStream_t (cuda backend; NULL = default stream) that orders the page-table upload
 *  before the decode calls on the same stream; ignored on the cpu backend.
 *  Errors: KVS_STATUS_INVALID_ARGUMENT (a field, naming it and what was expected),
 *  KVS_STATUS_INVALID_STATE (a session that owns its KV), KVS_STATUS_UNSUPPORTED (a page size or
 *  layout the backend or the method does not read). On error the previous binding stays.
 *  @threadsafety exclusive */
KVS_API kvs_error_t kvs_session_bind_kv(kvs_session_t s, uint32_t layer, const kvs_paged_kv* kv,
                                        void* stream);

/** Rollback: keeps the first num_tokens tokens of every layer and drops the rest, KV and index
 *  alike, so that decoding continues exactly as if the dropped tokens had never been appended
 *  (speculative decoding's rejected drafts; transformers' Cache.crop(num_tokens)). A layer holding
 *  num_tokens or fewer is left as it is. To drop the last m tokens of a session whose layers hold
 *  N each, pass N - m.
 *  num_tokens: 0 .. the tokens of the longest layer. How far back a layer can go depends on its
 *  method: full, exact_topk, streaming and quest to any length (0 empties the layer, which is then
 *  prefilled and indexed again); methods whose index keeps history (csattention, ctkvr, lfps, hgca,
 *  retroinfer) back to the oldest point kvs_session_params.max_rollback keeps (never below the
 *  prompt the index was built on, nor before the last prefill, build or load); the error message
 *  names the allowed range. Errors: KVS_STATUS_INVALID_ARGUMENT (num_tokens out of range),
 *  KVS_STATUS_INVALID_STATE (a layer loaded without KV and not prefilled again),
 *  KVS_STATUS_UNSUPPORTED (a backend without rollback). On error nothing changes.
 *  Statistics (decode_steps, selected keys) keep counting the work done. @threadsafety exclusive */
KVS_API kvs_error_t kvs_session_truncate(kvs_session_t s, int64_t num_tokens);

/** One layer's decode step for `count` sessions of the same shape, method and backend: q [B, Hq, d],
 *  k_new, v_new [B, Hkv, d], o [B, Hq, d], lse [B, Hq] or NULL, B = count. All or nothing: inputs are
 *  validated for every session before any state changes. @threadsafety exclusive (each session) */
KVS_API kvs_error_t kvs_decode_batch(kvs_session_t* sessions, size_t count, uint32_t layer,
                                     const kvs_tensor* q, const kvs_tensor* k_new,
                                     const kvs_tensor* v_new, const kvs_tensor* o,
                                     const kvs_tensor* lse, void* stream);

/* ---- Batches: plan once per token, decode per layer ------------------------------------------ */

/** A batch of sessions decoded together, in a fixed order (the B dimension of the step tensors).
 *  The sessions stay the caller's and must outlive the batch; they may still be used on their own
 *  between tokens. */
typedef struct kvs_batch_s* kvs_batch_t;

/** Creates a batch of `count` (1..65536) distinct sessions of the same shape, KV dtype, softmax
 *  scale, method, backend and device. @threadsafety any */
KVS_API kvs_error_t kvs_batch_create(kvs_session_t* sessions, size_t count, kvs_batch_t* out);
/** NULL-safe. The sessions are not destroyed. @threadsafety exclusive */
KVS_API void kvs_batch_destroy(kvs_batch_t b);
/** Once per token, before that token's kvs_batch_decode calls: checks every session and layer
 *  (prefilled and indexed), reserves room for one more token in every layer (no allocation happens
 *  in the decode calls that follow, so the cuda backend can capture them in a graph) and sizes the
 *  workspaces. Host work only; stream (a cudaStream_t, NULL = default) orders any upload of page
 *  tables. A plan whose layers were not all decoded is replaced by the next plan.
 *  @threadsafety exclusive (each session) */
KVS_API kvs_error_t kvs_batch_plan(kvs_batch_t b, void* stream);
/** One layer's decode step for the planned token, exactly as kvs_decode_batch (q [B, Hq, d], k_new,
 *  v_new [B, Hkv, d], o [B, Hq, d], lse [B, Hq] or NULL), each layer at most once per plan.
 *  @threadsafety exclusive (each session) */
KVS_API kvs_error_t kvs_batch_decode(kvs_batch_t b, uint32_t layer, const kvs_tensor* q,
                                     const kvs_tensor* k_new, const kvs_tensor* v_new,
                                     const kvs_tensor* o, const kvs_tensor* lse, void* stream);
/** The number of sessions. @threadsafety concurrent-const */
KVS_API size_t kvs_batch_size(kvs_batch_t b);

typedef enum kvs_save_flags {
  KVS_SAVE_TABLES = 0,     /* index tables only */
  KVS_SAVE_INCLUDE_KV = 1  /* tables and the KV cache */
} kvs_save_flags;

/** Writes the session (parameters, method tables, optionally KV) atomically to path.
 *  @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_session_save(kvs_session_t s, const char* path, uint32_t flags);

typedef enum kvs_load_flags {
  /* KV pages point into a read-only memory map of the file instead of being copied (as llama.cpp's
   * use_mmap): no copy and no anonymous memory for the KV, but the file is live. While a session
   * loaded with it, or a fork of one, exists, the caller must not truncate, shrink or write the
   * file (truncation kills the process with SIGBUS at the next decode, a write changes outputs).
   * Replacing it by rename (as kvs_session_save does) is safe. */
  KVS_LOAD_MMAP = 1
} kvs_load_flags;

typedef struct kvs_load_params {
  uint32_t struct_size;
  int32_t backend;      /* 0 = as saved */
  int32_t device_id;
  uint32_t num_threads; /* 0 = all hardware threads */
  int32_t gemm;
  uint32_t flags;       /* kvs_load_flags; 0 = copy everything out of the file */
  int32_t kv_memory;    /* as kvs_session_params.kv_memory; 0 = the backend's own memory */
  int32_t kv_source;    /* as kvs_session_params.kv_source: KVS_KV_OWNED (0, the default) or
                           KVS_KV_CALLER, the tables of a session over the caller's KV cache (the
                           file's KV, if any, is not read: bind the layers and prefill them again) */
} kvs_load_params;

/** Fills defaults (struct_size included; flags 0). @threadsafety any */
KVS_API void kvs_load_params_init(kvs_load_params* p);

/** Loads a session saved by kvs_session_save (params may be NULL). Every checksum and header value
 *  is verified; the KV pages and the index are copied, so the file may change or go once this
 *  returns (with KVS_LOAD_MMAP the KV pages are mapped instead: see its hazard). A file without KV
 *  yields a session whose layers must be prefilled again with the same lengths before decode (the
 *  loaded index is kept); so does params->kv_source = KVS_KV_CALLER, whose prefill with NULL k/v
 *  counts the tokens of the bound cache (kvs_session_bind_kv). @threadsafety any */
KVS_API kvs_error_t kvs_session_load(const char* path, const kvs_load_params* params,
                                     kvs_session_t* out);

/** A new session sharing s's current KV prefix read-only (copy-on-write after). The method index is
 *  copied. Either may be destroyed first. @threadsafety concurrent-const (on s) */
KVS_API kvs_error_t kvs_session_fork(kvs_session_t s, kvs_session_t* out);

/** A new session with s's state (every layer's KV, the method index, the layer states and the
 *  statistics) on another backend or device: KVS_BACKEND_CPU or KVS_BACKEND_CUDA (device_id: the
 *  CUDA device; 0 for the cpu). s is unchanged; the two are independent afterwards. The state goes
 *  through the tables format in memory (no file): it costs one host copy of the KV and the index
 *  (to the cpu, the new session's KV pages are that copy; to a GPU, a further copy up), and the
 *  result decodes as a session saved with KVS_SAVE_INCLUDE_KV and loaded with that backend would.
 *  Errors: KVS_STATUS_INVALID_ARGUMENT (backend, device_id, out), KVS_STATUS_UNSUPPORTED (no such
 *  backend in this build, or the method has no implementation there),
 *  KVS_STATUS_INVALID_STATE (a layer loaded without KV and not prefilled again),
 *  KVS_STATUS_OUT_OF_MEMORY. Synchronises s's work on a GPU. @threadsafety concurrent-const (on s) */
KVS_API kvs_error_t kvs_session_to(kvs_session_t s, int32_t backend, int32_t device_id, kvs_session_t* out);

typedef struct kvs_session_stats {
  uint32_t struct_size;
  int64_t tokens;             /* tokens of the longest layer */
  int64_t decode_steps;       /* decode calls, all layers */
  uint64_t kv_bytes;          /* KV held by this session (shared pages included) */
  uint64_t kv_shared_bytes;   /* part of kv_bytes shared with other sessions or a mapped file */
  uint64_t index_bytes;       /* method tables */
  uint64_t workspace_bytes;   /* scratch */
  double last_selected_keys;  /* exact keys attended in the last decode step, mean over KV heads */
  double mean_selected_keys;  /* same, averaged over every decode step so far */
  double last_selected_fraction; /* last_selected_keys / context length */
} kvs_session_stats;

/** @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_session_get_stats(kvs_session_t s, kvs_session_stats* out);

/** Number of tokens in a layer. @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_session_layer_tokens(kvs_session_t s, uint32_t layer, int64_t* out);

/** The exact keys that the last decode step of `layer` attended for `kv_head` (union over the group
 *  for per-query-head methods), ascending. Writes min(count, capacity) indices to out (may be NULL
 *  with capacity 0) and the full count to *out_count. @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_session_last_selection(kvs_session_t s, uint32_t layer, uint32_t kv_head,
                                               int32_t* out, size_t capacity, size_t* out_count);

/** A statistic by name: the method's own (e.g. "dedup_coefficient"), or one of the session's CPU
 *  decode phase timings "decode_update_seconds", "decode_select_seconds", "decode_attend_seconds"
 *  (wall seconds summed over all steps and layers), or "rollback_history_bytes" (cpu: what the
 *  history kept for kvs_session_truncate holds now), or a backend's own (docs/api.md; hybrid:
 *  "hybrid_split", "hybrid_static_keys", "hybrid_host_keys"). Fails for a name neither has.
 *  @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_session_method_stat(kvs_session_t s, const char* name, double* out);

/* ---------------------------------------------------------------------------------------------- */
/* Tables files                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

/** Verifies a tables file and describes it as JSON (header, parameters, sections with sizes and
 *  checksum status, memory by part). *out_json is owned: free with kvs_string_free. Corruption is
 *  reported inside the JSON ("ok": false, "error": ...) and as the returned error: the one function
 *  that fills its output on error (so a caller can show what was readable); free both.
 *  @threadsafety any */
KVS_API kvs_error_t kvs_tables_describe(const char* path, char** out_json);

/* ---------------------------------------------------------------------------------------------- */
/* Traces (safetensors, format "kvsieve-trace" v1; see docs/formats.md)                           */
/* ---------------------------------------------------------------------------------------------- */

typedef struct kvs_trace_s* kvs_trace_t;

typedef struct kvs_trace_info {
  uint32_t struct_size;
  uint32_t num_layers;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  int64_t prefill_len;
  int64_t total_len;      /* T */
  uint32_t num_present_layers;
  float softmax_scale;
  int32_t dtype;          /* kvs_scalar_type of the tensors */
  const char* source;     /* free text; owned by the trace (or the caller when writing) */
} kvs_trace_info;

/** Fills defaults (struct_size included). @threadsafety any */
KVS_API void kvs_trace_info_init(kvs_trace_info* info);

/** Opens (memory-maps) and validates a trace. @threadsafety any */
KVS_API kvs_error_t kvs_trace_open(const char* path, kvs_trace_t* out);
/** Closes a trace; NULL is a no-op. Views from kvs_trace_tensor die with it. @threadsafety exclusive */
KVS_API void kvs_trace_destroy(kvs_trace_t t);
/** @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_trace_get_info(kvs_trace_t t, kvs_trace_info* out);
/** The i-th present layer's index (0 <= i < num_present_layers). @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_trace_layer_index(kvs_trace_t t, uint32_t i, uint32_t* out_layer);
/** A view of tensor `name` ("q", "k", "v" of a present layer, or "tokens" [T] int32 when the
 *  trace has them; layer is then ignored); the view (data, shape) stays valid while the trace is
 *  open. @threadsafety concurrent-const */
KVS_API kvs_error_t kvs_trace_tensor(kvs_trace_t t, uint32_t layer, const char* name,
                                     kvs_tensor* out);

/** Writes a trace atomically. layers[i] is the layer index of q[i], k[i], v[i] (each [T, H, d], host
 *  memory (CPU or CUDA_HOST), any strides, all of info->dtype). tokens may be NULL or [T] int32
 *  (a non-negative stride).
 *  @threadsafety any */
KVS_API kvs_error_t kvs_trace_write(const char* path, const kvs_trace_info* info,
                                    const uint32_t* layers, size_t num_layers_present,
                                    const kvs_tensor* const* q, const kvs_tensor* const* k,
                                    const kvs_tensor* const* v, const kvs_tensor* tokens);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVSIEVE_KVSIEVE_H */
