// SPDX-License-Identifier: Apache-2.0
/* SWIG interface of the Java binding (package org.kvsieve). Only the public C ABI is used.
 *
 *  - Session, Batch, Trace and Tensor are SWIG proxies of owned native objects: AutoCloseable, close()
 *    is idempotent (SWIG's delete() zeroes the pointer), and %newobject marks every function that
 *    returns an owned object so the proxy frees it. A Batch keeps its Session objects reachable (the
 *    C ABI wants the sessions to outlive the batch) and checks before each call that none was closed.
 *  - A kvs_error_t becomes org.kvsieve.KvsException(code, message, backendCode, details); details is
 *    null except where the failed call still described something (tablesDescribe of a corrupt file).
 *  - Owned C strings (kvs_tables_describe's JSON) are %newobject with kvs_string_free as newfree; the
 *    wrapper frees them on the error path too.
 *  - Tensors are direct NIO buffers; Tensor.of(...) (bindings/java/src) checks direct, byte order,
 *    dtype against the buffer class and capacity before the native side takes the address.
 */
%module(package="org.kvsieve") KvsNative

%{
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <kvsieve/kvsieve.h>

typedef struct kvs_session_s kvs_session_s;
typedef struct kvs_trace_s kvs_trace_s;
typedef struct kvs_batch_s kvs_batch_s;

/* The error of the call that just returned on this thread, thrown by the %exception block right
 * after it (never visible outside one wrapper call). */
static __thread kvs_error_t kvsj_pending = NULL;
/* What the failed call could still report (kvs_tables_describe's JSON of a corrupt file), owned
 * (kvs_string_free); thrown with kvsj_pending as KvsException.details(). */
static __thread char* kvsj_pending_details = NULL;
static int kvsj_check(kvs_error_t e) {
  if (!e) return 0;
  kvs_error_destroy(kvsj_pending);
  kvs_string_free(kvsj_pending_details);
  kvsj_pending = e;
  kvsj_pending_details = NULL;
  return 1;
}
static void kvsj_throw(JNIEnv* jenv) {
  kvs_error_t e = kvsj_pending;
  char* details = kvsj_pending_details;
  kvsj_pending = NULL;
  kvsj_pending_details = NULL;
  jclass cls = (*jenv)->FindClass(jenv, "org/kvsieve/KvsException");
  if (!cls) { kvs_error_destroy(e); kvs_string_free(details); return; }
  jmethodID ctor = (*jenv)->GetMethodID(jenv, cls, "<init>", "(ILjava/lang/String;JLjava/lang/String;)V");
  jstring msg = (*jenv)->NewStringUTF(jenv, kvs_error_message(e));
  jstring det = details ? (*jenv)->NewStringUTF(jenv, details) : NULL;
  jobject ex = ctor && msg && (det || !details)
                   ? (*jenv)->NewObject(jenv, cls, ctor, (jint)kvs_error_code(e), msg,
                                        (jlong)kvs_error_backend_code(e), det)
                   : NULL;
  kvs_error_destroy(e);
  kvs_string_free(details);
  if (ex) (*jenv)->Throw(jenv, (jthrowable)ex);
}

/* A kvs_tensor over a direct buffer, with its own copy of the shape. */
typedef struct kvsj_tensor {
  kvs_tensor t;
  int64_t shape[8];
} kvsj_tensor;

static const kvs_tensor* kvsj_t(kvsj_tensor* t) { return t ? &t->t : NULL; }
%}

/* $cleanup: the freearg typemaps (the UTF-8 copies of String arguments, pinned long[] elements) run
 * on the error path too, as they do after a successful call. */
%exception {
  $action
  if (kvsj_pending) { $cleanup kvsj_throw(jenv); return $null; }
}

%include <stdint.i>

/* java.nio.Buffer -> its address (direct buffers only; the Java side checked the rest). */
%typemap(jni) void* DIRECT_BUFFER "jobject"
%typemap(jtype) void* DIRECT_BUFFER "java.nio.Buffer"
%typemap(jstype) void* DIRECT_BUFFER "java.nio.Buffer"
%typemap(javain) void* DIRECT_BUFFER "$javainput"
%typemap(in) void* DIRECT_BUFFER {
  $1 = $input ? (*jenv)->GetDirectBufferAddress(jenv, $input) : NULL;
  if (!$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "buffer: expected a direct NIO buffer");
    return $null;
  }
}

/* long[] -> (const int64_t*, int) */
%typemap(jni) (const long long* SHAPE, int NDIM) "jlongArray"
%typemap(jtype) (const long long* SHAPE, int NDIM) "long[]"
%typemap(jstype) (const long long* SHAPE, int NDIM) "long[]"
%typemap(javain) (const long long* SHAPE, int NDIM) "$javainput"
%typemap(in) (const long long* SHAPE, int NDIM) {
  if (!$input) { SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "shape: expected an array"); return $null; }
  $2 = (int)(*jenv)->GetArrayLength(jenv, $input);
  $1 = (long long*)(*jenv)->GetLongArrayElements(jenv, $input, 0);
}
%typemap(freearg) (const long long* SHAPE, int NDIM) {
  if ($1) (*jenv)->ReleaseLongArrayElements(jenv, $input, (jlong*)$1, JNI_ABORT);
}

/* long[] of session handles (Session.getCPtr) -> (kvs_session_t*, size_t) */
%typemap(jni) (const long long* HANDLES, int COUNT) "jlongArray"
%typemap(jtype) (const long long* HANDLES, int COUNT) "long[]"
%typemap(jstype) (const long long* HANDLES, int COUNT) "long[]"
%typemap(javain) (const long long* HANDLES, int COUNT) "$javainput"
%typemap(in) (const long long* HANDLES, int COUNT) {
  if (!$input) { SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "sessions: expected an array"); return $null; }
  $2 = (int)(*jenv)->GetArrayLength(jenv, $input);
  $1 = (long long*)(*jenv)->GetLongArrayElements(jenv, $input, 0);
}
%typemap(freearg) (const long long* HANDLES, int COUNT) {
  if ($1) (*jenv)->ReleaseLongArrayElements(jenv, $input, (jlong*)$1, JNI_ABORT);
}

/* int[] -> (const int32_t*, int64_t): a caller's page indices (kvs_session_bind_kv), copied by the library */
%typemap(jni) (const int32_t* PAGE_IDS, int64_t COUNT) "jintArray"
%typemap(jtype) (const int32_t* PAGE_IDS, int64_t COUNT) "int[]"
%typemap(jstype) (const int32_t* PAGE_IDS, int64_t COUNT) "int[]"
%typemap(javain) (const int32_t* PAGE_IDS, int64_t COUNT) "$javainput"
%typemap(in) (const int32_t* PAGE_IDS, int64_t COUNT) {
  if (!$input) { SWIG_JavaThrowException(jenv, SWIG_JavaNullPointerException, "pageIndices: expected an array"); return $null; }
  $2 = (int64_t)(*jenv)->GetArrayLength(jenv, $input);
  $1 = (int32_t*)(*jenv)->GetIntArrayElements(jenv, $input, 0);
}
%typemap(freearg) (const int32_t* PAGE_IDS, int64_t COUNT) {
  if ($1) (*jenv)->ReleaseIntArrayElements(jenv, $input, (jint*)$1, JNI_ABORT);
}

/* Every owned object is AutoCloseable; close() = SWIG's idempotent delete(). */
%typemap(javainterfaces) struct kvs_session_s, struct kvs_trace_s, struct kvs_batch_s, struct kvsj_tensor "AutoCloseable"
%typemap(javacode) struct kvs_trace_s %{
  /** Frees the native object; idempotent. */
  @Override public void close() { delete(); }
%}

%rename(Session) kvs_session_s;
%rename(Trace) kvs_trace_s;
%rename(Tensor) kvsj_tensor;
%rename(Batch) kvs_batch_s;
%rename(SessionStats) kvs_session_stats;
%rename("%(lowercamelcase)s", %$isvariable) "";
%ignore kvs_session_stats::struct_size;
%nodefaultctor kvs_session_s;
%nodefaultctor kvs_trace_s;
%nodefaultctor kvsj_tensor;
%nodefaultctor kvs_batch_s;
%javamethodmodifiers kvsj_tensor::kvsj_tensor "protected";
%javamethodmodifiers kvs_batch_s::kvs_batch_s "protected";
%javamethodmodifiers kvs_session_s::bindKvBuffer "private";
%javamethodmodifiers kvs_session_s::bindKvPools "private";
%javamethodmodifiers kvs_batch_s::planNative "private";
%javamethodmodifiers kvs_batch_s::decodeNative "private";
%javamethodmodifiers kvs_batch_s::sizeNative "private";
%javamethodmodifiers kvs_session_s::toBackend "private";
%javamethodmodifiers kvs_session_s::forkNative "private";
%javamethodmodifiers kvs_session_s::decodeBatchNative "private";
%javamethodmodifiers kvsj_tables_describe "
  /** Verifies a tables file (Session.save) and describes it as JSON text: header, parameters,
   *  sections with sizes and checksum status, memory by part (kvs_tables_describe). Throws
   *  KvsException naming the path for a missing or corrupt file; for a corrupt one, its details()
   *  holds the JSON of what was readable (\"ok\": false). */
  public";

%newobject kvs_session_s::forkNative;
%newobject kvs_session_s::toBackend;
%newobject kvs_session_s::load;
%newobject kvs_session_s::stats;
%newobject kvs_trace_s::open;

typedef struct kvs_session_stats {
  int64_t tokens;
  int64_t decode_steps;
  uint64_t kv_bytes;
  uint64_t kv_shared_bytes;
  uint64_t index_bytes;
  uint64_t workspace_bytes;
  double last_selected_keys;
  double mean_selected_keys;
  double last_selected_fraction;
} kvs_session_stats;


%typemap(javacode) struct kvsj_tensor %{
  private java.nio.Buffer buffer; // keeps the memory alive while the tensor exists

  /** Frees the descriptor (not the buffer); idempotent. */
  @Override public void close() { delete(); buffer = null; }

  /** Describes a direct buffer as a tensor, from its position, without copying. Checks: direct,
   *  native byte order, dtype against the buffer's element type (FloatBuffer: F32; ShortBuffer: F16 or
   *  BF16; ByteBuffer: any), and that position..limit holds the shape. */
  public static Tensor of(java.nio.Buffer buffer, DType dtype, long... shape) {
    Tensors.check(buffer, dtype, shape);
    Tensor t = new Tensor(buffer, dtype.code, dtype.bits, Tensors.bytePosition(buffer), shape);
    t.buffer = buffer;
    return t;
  }
%}

%extend kvsj_tensor {
  kvsj_tensor(void* DIRECT_BUFFER, int code, int bits, int64_t byte_offset, const long long* SHAPE, int NDIM) {
    kvsj_tensor* t = (kvsj_tensor*)calloc(1, sizeof *t);
    if (!t) { kvsj_check(kvs_abi_check(~0u)); return NULL; }
    if (NDIM > 8) NDIM = 8;
    t->t.data = DIRECT_BUFFER;
    t->t.device.device_type = KVS_DEVICE_CPU;
    t->t.ndim = NDIM;
    t->t.dtype.code = (uint8_t)code;
    t->t.dtype.bits = (uint8_t)bits;
    t->t.dtype.lanes = 1;
    for (int i = 0; i < NDIM; ++i) t->shape[i] = SHAPE[i];
    t->t.shape = t->shape;
    t->t.strides = NULL;
    t->t.byte_offset = (uint64_t)byte_offset;
    return t;
  }
  ~kvsj_tensor() { free($self); }
}

%typemap(javacode) struct kvs_session_s %{
  /** Frees the session now; idempotent. Forks stay valid. */
  @Override public void close() { delete(); }

  /** Options of a new session; see kvs_session_params in include/kvsieve/kvsieve.h. */
  public static Builder builder(int numLayers, int numQHeads, int numKvHeads, int headDim) {
    return new Builder(numLayers, numQHeads, numKvHeads, headDim);
  }

  /** The exact keys the last decode step of a layer attended for a KV head, ascending. */
  public int[] lastSelection(long layer, long kvHead) {
    long n = selectionCount(layer, kvHead);
    java.nio.IntBuffer buf = java.nio.ByteBuffer.allocateDirect((int) Math.max(4, n * 4))
        .order(java.nio.ByteOrder.nativeOrder()).asIntBuffer();
    selectionInto(layer, kvHead, buf, n);
    int[] out = new int[(int) n];
    buf.get(out);
    return out;
  }

  // The pools bound per layer (bindKv with a buffer), kept reachable while the library reads them.
  private final java.util.Map<Long, java.nio.Buffer> boundPools = new java.util.HashMap<>();

  /** Sessions built with kvFromCaller(true), Backend.CPU: layer `layer`'s K/V are in the caller's page
   *  pool, a direct buffer from its position to its limit holding numPages pages of
   *  [2][numKvHeads][256][headDim] in the session's kv dtype (FlashInfer's HND layout; a FloatBuffer
   *  for F32, a ShortBuffer or ByteBuffer of bf16/f16 bits), this sequence's pages in token order,
   *  numTokens tokens held (kvs_session_bind_kv). The session keeps a reference to the buffer until
   *  the layer is bound again. For a pool in GPU memory, bind its device address
   *  (bindKv(layer, long address, ...)). */
  public void bindKv(long layer, java.nio.Buffer pool, long numPages, int pageSize, int[] pageIndices, long numTokens) {
    if (pool == null) throw new NullPointerException("pool: expected a direct buffer");
    if (!pool.isDirect()) throw new IllegalArgumentException("pool: expected a direct buffer");
    final int elem = pool instanceof java.nio.ByteBuffer ? 1
        : pool instanceof java.nio.ShortBuffer || pool instanceof java.nio.CharBuffer ? 2
        : pool instanceof java.nio.FloatBuffer || pool instanceof java.nio.IntBuffer ? 4
        : pool instanceof java.nio.LongBuffer || pool instanceof java.nio.DoubleBuffer ? 8 : 0;
    if (elem == 0) throw new IllegalArgumentException("pool: expected a Byte, Short, Float or Int buffer");
    bindKvBuffer(layer, pool, (long) pool.position() * elem, (long) pool.remaining() * elem, numPages, pageSize,
                 pageIndices, numTokens);
    boundPools.put(layer, pool);
  }

  /** Sessions built with kvFromCaller(true), Backend.CUDA: layer `layer`'s K/V are in the caller's
   *  page pools in GPU memory, by device address: K and V in one pool at kPages (vPages 0), pages
   *  [numPages][2][numKvHeads][pageSize][headDim] (HND) or [numPages][2][pageSize][numKvHeads][headDim]
   *  (NHD), as FlashInfer's paged KV cache; or two pools of one shape, K at kPages and V at vPages,
   *  pages [numPages][numKvHeads][pageSize][headDim] (HND) or [numPages][pageSize][numKvHeads][headDim]
   *  (NHD), as vLLM's FlashAttention backend keeps them. poolBytes and vPoolBytes: the bytes each
   *  pool spans (the allocation's size: numPages is checked against it), or 0 when not known. The
   *  layout is the same in every binding of a session (kvs_session_bind_kv). */
  /** Sessions built with kvFromCaller(true): layer `layer`'s K/V are in the caller's page pool
   *  [numPages][2][numKvHeads][pageSize][headDim] (FlashInfer's HND layout) at address `pages` (GPU
   *  memory for Backend.CUDA, host memory for Backend.CPU, whose pages hold 256 tokens), this
   *  sequence's pages in token order, numTokens tokens held (kvs_session_bind_kv); the pool's size
   *  is not checked (the form below takes it). */
  public void bindKv(long layer, long pages, long numPages, int pageSize, int[] pageIndices, long numTokens,
                     long stream) {
    bindKvPools(layer, pages, 0, numPages, pageSize, KvLayout.HND.value, 0, 0, pageIndices, numTokens, stream);
  }

  public void bindKv(long layer, long kPages, long vPages, long numPages, int pageSize, KvLayout layout,
                     long poolBytes, long vPoolBytes, int[] pageIndices, long numTokens, long stream) {
    if (layout == null) throw new NullPointerException("layout: expected KvLayout.HND or KvLayout.NHD");
    if (poolBytes < 0 || vPoolBytes < 0)
      throw new IllegalArgumentException("poolBytes, vPoolBytes: expected >= 0 (0: not known)");
    bindKvPools(layer, kPages, vPages, numPages, pageSize, layout.value, poolBytes, vPoolBytes, pageIndices,
                numTokens, stream);
  }

  /** A new session sharing this one's KV prefix copy-on-write (kvs_session_fork); either may be
   *  closed first. A fork of a session over the caller's cache reads the same pools (and keeps the
   *  buffers bound with bindKv reachable) until its layers are bound anew. */
  public Session fork() {
    Session f = forkNative();
    f.boundPools.putAll(boundPools);
    return f;
  }

  /** A copy of this session's state (KV, index, layer states, statistics) on another backend and
   *  device (kvs_session_to); this session is unchanged. */
  public Session to(Backend backend, int deviceId) { return toBackend(backend.value, deviceId); }

  /** One layer's decode step for several sessions of one shape, method and backend in one call
   *  (kvs_decode_batch; Python's kvsieve.decode_batch): q [B, Hq, d], kNew, vNew [B, Hkv, d], o
   *  [B, Hq, d], lse [B, Hq] F32 or null, row b belonging to sessions[b]. All or nothing: the
   *  library checks every session's inputs before any state changes. A null array or session
   *  (NullPointerException), an empty array (IllegalArgumentException) or a closed session
   *  (IllegalStateException) is refused before any native call; the library's errors are
   *  KvsException. For many tokens, Batch plans once per token instead. */
  public static void decodeBatch(Session[] sessions, long layer, Tensor q, Tensor kNew, Tensor vNew, Tensor o,
                                 Tensor lse, long stream) {
    if (sessions == null) throw new NullPointerException("sessions: expected an array, got null");
    if (sessions.length == 0) throw new IllegalArgumentException("sessions: expected at least one session");
    long[] handles = new long[sessions.length];
    for (int i = 0; i < sessions.length; ++i) {
      if (sessions[i] == null) throw new NullPointerException("sessions[" + i + "]: expected a session, got null");
      handles[i] = getCPtr(sessions[i]);
      if (handles[i] == 0)
        throw new IllegalStateException("sessions[" + i + "]: expected an open session, got a closed one");
    }
    try {
      decodeBatchNative(handles, layer, q, kNew, vNew, o, lse, stream);
    } finally {
      java.lang.ref.Reference.reachabilityFence(sessions); // no finalizer frees one during the call
    }
  }

  public static final class Builder {
    private final int numLayers, numQHeads, numKvHeads, headDim;
    private String method = "full", methodParams = null;
    private double budget = 0, softmaxScale = 0;
    private long budgetTokens = 0, maxRollback = 0;
    private int lseBase = 0, kvMemory = 0, kvSource = 0;
    private ScalarType kvDtype = ScalarType.BF16;
    private Backend backend = Backend.CPU;
    private int deviceId = 0, numThreads = 0;

    Builder(int l, int hq, int hkv, int d) { numLayers = l; numQHeads = hq; numKvHeads = hkv; headDim = d; }
    public Builder method(String m) { method = m; return this; }
    public Builder methodParams(String p) { methodParams = p; return this; }
    public Builder budget(double b) { budget = b; return this; }
    public Builder budgetTokens(long t) { budgetTokens = t; return this; }
    public Builder kvDtype(ScalarType t) { kvDtype = t; return this; }
    public Builder backend(Backend b) { backend = b; return this; }
    public Builder deviceId(int id) { deviceId = id; return this; }
    public Builder numThreads(int n) { numThreads = n; return this; }
    public Builder softmaxScale(double s) { softmaxScale = s; return this; }
    /** true: decode's lse in base 2 (lse_e / ln 2, for base-2 kernels such as FlashInfer's merge);
     *  false (the default): natural log. The sessions of one cuda batch must share it. */
    public Builder lseBase2(boolean on) { lseBase = on ? 1 : 0; return this; }
    /** Tokens truncate() must be able to drop on methods whose index keeps history (csattention,
     *  ctkvr, lfps, hgca, retroinfer); 0 (the default): none (kvs_session_params.max_rollback). */
    public Builder maxRollback(long tokens) { maxRollback = tokens; return this; }
    /** Where the KV cache lives (kvs_session_params.kv_memory): true with Backend.CUDA keeps it in
     *  pinned host memory the GPU kernels read over the bus (KVS_DEVICE_CUDA_HOST); false (the
     *  default): the backend's own memory. */
    public Builder kvInPinnedHostMemory(boolean on) { kvMemory = on ? 3 : 0; return this; }
    /** true: the session attends the caller's paged KV cache, bound per layer with bindKv
     *  (kvs_session_params.kv_source = KVS_KV_CALLER; prefill, append and decode then take null
     *  k/v); false (the default): the session stores its K/V. */
    public Builder kvFromCaller(boolean on) { kvSource = on ? 1 : 0; return this; }
    /** Creates the session; throws KvsException naming the bad field. */
    public Session create() {
      return new Session(numLayers, numQHeads, numKvHeads, headDim, softmaxScale, kvDtype.value, backend.value,
                         deviceId, numThreads, method, methodParams, budget, budgetTokens, lseBase, maxRollback,
                         kvMemory, kvSource);
    }
  }
%}

%extend kvs_session_s {
  kvs_session_s(uint32_t num_layers, uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim,
                double softmax_scale, int32_t kv_dtype, int32_t backend, int32_t device_id, uint32_t num_threads,
                const char* method, const char* method_params, double budget, int64_t budget_tokens,
                int32_t lse_base, int64_t max_rollback, int32_t kv_memory, int32_t kv_source) {
    kvs_session_params p;
    kvs_session_params_init(&p);
    p.num_layers = num_layers;
    p.num_q_heads = num_q_heads;
    p.num_kv_heads = num_kv_heads;
    p.head_dim = head_dim;
    p.softmax_scale = (float)softmax_scale;
    p.kv_dtype = kv_dtype;
    p.backend = backend;
    p.device_id = device_id;
    p.num_threads = num_threads;
    p.method = method;
    p.method_params = method_params;
    p.budget = budget;
    p.budget_tokens = budget_tokens;
    p.lse_base = lse_base;
    p.max_rollback = max_rollback;
    p.kv_memory = kv_memory;
    p.kv_source = kv_source;
    kvs_session_t s = NULL;
    kvsj_check(kvs_session_create(&p, &s));
    return s;
  }
  ~kvs_session_s() { kvs_session_destroy($self); }

  static kvs_session_s* load(const char* path) {
    kvs_session_t s = NULL;
    kvsj_check(kvs_session_load(path, NULL, &s));
    return s;
  }
  /* mmap: map the KV pages from the file instead of copying them (the file must then stay as it is
     while the session or a fork of it lives). */
  static kvs_session_s* load(const char* path, bool mmap) {
    kvs_load_params p;
    kvs_load_params_init(&p);
    p.flags = mmap ? KVS_LOAD_MMAP : 0u;
    kvs_session_t s = NULL;
    kvsj_check(kvs_session_load(path, &p, &s));
    return s;
  }
  /* kvFromCaller: the method's tables only, for a session over the caller's KV cache
     (kvs_load_params.kv_source = KVS_KV_CALLER): bind each layer (bindKv) and prefill it again with
     null k and v to the saved length; the loaded index is kept. */
  static kvs_session_s* load(const char* path, bool mmap, bool kv_from_caller) {
    kvs_load_params p;
    kvs_load_params_init(&p);
    p.flags = mmap ? KVS_LOAD_MMAP : 0u;
    p.kv_source = kv_from_caller ? KVS_KV_CALLER : KVS_KV_OWNED;
    kvs_session_t s = NULL;
    kvsj_check(kvs_session_load(path, &p, &s));
    return s;
  }
  void prefill(uint32_t layer, kvsj_tensor* q, kvsj_tensor* k, kvsj_tensor* v, kvsj_tensor* o, int64_t stream) {
    kvsj_check(kvs_session_prefill($self, layer, kvsj_t(q), kvsj_t(k), kvsj_t(v), kvsj_t(o), (void*)(intptr_t)stream));
  }
  void buildIndex(int64_t stream) { kvsj_check(kvs_session_build_index($self, (void*)(intptr_t)stream)); }
  void decode(uint32_t layer, kvsj_tensor* q, kvsj_tensor* k_new, kvsj_tensor* v_new, kvsj_tensor* o,
              kvsj_tensor* lse, int64_t stream) {
    kvsj_check(kvs_session_decode($self, layer, kvsj_t(q), kvsj_t(k_new), kvsj_t(v_new), kvsj_t(o), kvsj_t(lse),
                                  (void*)(intptr_t)stream));
  }
  /* n decode steps of one layer (kvs_session_decode_tokens): q [n, Hq, d], kNew, vNew [n, Hkv, d] (null
     over the caller's KV cache), o [n, Hq, d], lse [n, Hq] or null; row i = the i-th of n decode calls. */
  void decodeTokens(uint32_t layer, kvsj_tensor* q, kvsj_tensor* k_new, kvsj_tensor* v_new, kvsj_tensor* o,
                    kvsj_tensor* lse, int64_t stream) {
    kvsj_check(kvs_session_decode_tokens($self, layer, kvsj_t(q), kvsj_t(k_new), kvsj_t(v_new), kvsj_t(o),
                                         kvsj_t(lse), (void*)(intptr_t)stream));
  }
  void append(uint32_t layer, kvsj_tensor* q, kvsj_tensor* k, kvsj_tensor* v, kvsj_tensor* o, int64_t stream) {
    kvsj_check(kvs_session_append($self, layer, kvsj_t(q), kvsj_t(k), kvsj_t(v), kvsj_t(o), (void*)(intptr_t)stream));
  }
  /* The general form (the cuda backend): K and V in one pool (vPages 0) or two, in either layout
     (kvs_kv_layout: 0 HND, 1 NHD); Session.bindKv(long, long, long, long, int, KvLayout, ...) wraps it. */
  void bindKvPools(uint32_t layer, int64_t pages, int64_t v_pages, int64_t num_pages, int32_t page_size,
                   int32_t layout, int64_t pool_bytes, int64_t v_pool_bytes, const int32_t* PAGE_IDS, int64_t COUNT,
                   int64_t num_tokens, int64_t stream) {
    kvs_paged_kv kv;
    kvs_paged_kv_init(&kv);
    kv.pages = (const void*)(intptr_t)pages;
    kv.v_pages = (const void*)(intptr_t)v_pages;
    kv.pool_bytes = (uint64_t)pool_bytes;
    kv.v_pool_bytes = (uint64_t)v_pool_bytes;
    kv.layout = layout;
    kv.num_pages = num_pages;
    kv.page_size = page_size;
    kv.page_indices = PAGE_IDS;
    kv.num_page_indices = COUNT;
    kv.num_tokens = num_tokens;
    kvsj_check(kvs_session_bind_kv($self, layer, &kv, (void*)(intptr_t)stream));
  }
  /* The same with the pool in a direct NIO buffer (Session.bindKv(long, Buffer, ...) checks it and
     keeps it alive; pool_bytes: the bytes from its position to its limit). */
  void bindKvBuffer(uint32_t layer, void* DIRECT_BUFFER, int64_t pool_offset, int64_t pool_bytes, int64_t num_pages,
                    int32_t page_size, const int32_t* PAGE_IDS, int64_t COUNT, int64_t num_tokens) {
    kvs_paged_kv kv;
    kvs_paged_kv_init(&kv);
    kv.pages = (const char*)DIRECT_BUFFER + pool_offset;
    kv.pool_bytes = (uint64_t)pool_bytes;
    kv.num_pages = num_pages;
    kv.page_size = page_size;
    kv.page_indices = PAGE_IDS;
    kv.num_page_indices = COUNT;
    kv.num_tokens = num_tokens;
    kvsj_check(kvs_session_bind_kv($self, layer, &kv, NULL));
  }
  /* Rollback: keeps the first numTokens tokens of every layer (kvs_session_truncate). */
  void truncate(int64_t num_tokens) { kvsj_check(kvs_session_truncate($self, num_tokens)); }
  void save(const char* path, bool include_kv) {
    kvsj_check(kvs_session_save($self, path, include_kv ? KVS_SAVE_INCLUDE_KV : KVS_SAVE_TABLES));
  }
  kvs_session_s* forkNative() {
    kvs_session_t s = NULL;
    kvsj_check(kvs_session_fork($self, &s));
    return s;
  }
  kvs_session_s* toBackend(int32_t backend, int32_t device_id) {
    kvs_session_t s = NULL;
    kvsj_check(kvs_session_to($self, backend, device_id, &s));
    return s;
  }
  kvs_session_stats* stats() {
    kvs_session_stats* st = (kvs_session_stats*)calloc(1, sizeof *st);
    if (!st) return NULL;
    st->struct_size = sizeof *st;
    if (kvsj_check(kvs_session_get_stats($self, st))) { free(st); return NULL; }
    return st;
  }
  int64_t layerTokens(uint32_t layer) {
    int64_t n = 0;
    kvsj_check(kvs_session_layer_tokens($self, layer, &n));
    return n;
  }
  double methodStat(const char* name) {
    double v = 0;
    kvsj_check(kvs_session_method_stat($self, name, &v));
    return v;
  }
  int64_t selectionCount(uint32_t layer, uint32_t kv_head) {
    size_t n = 0;
    kvsj_check(kvs_session_last_selection($self, layer, kv_head, NULL, 0, &n));
    return (int64_t)n;
  }
  static void decodeBatchNative(const long long* HANDLES, int COUNT, uint32_t layer, kvsj_tensor* q,
                                kvsj_tensor* k_new, kvsj_tensor* v_new, kvsj_tensor* o, kvsj_tensor* lse,
                                int64_t stream) {
    kvs_session_t* hs = (kvs_session_t*)calloc(COUNT > 0 ? (size_t)COUNT : 1, sizeof *hs);
    if (!hs) { kvsj_check(kvs_abi_check(~0u)); return; } /* as Tensor: an error object to throw */
    for (int i = 0; i < COUNT; ++i) hs[i] = (kvs_session_t)(uintptr_t)HANDLES[i];
    kvsj_check(kvs_decode_batch(hs, (size_t)COUNT, layer, kvsj_t(q), kvsj_t(k_new), kvsj_t(v_new), kvsj_t(o),
                                kvsj_t(lse), (void*)(intptr_t)stream));
    free(hs);
  }
  void selectionInto(uint32_t layer, uint32_t kv_head, void* DIRECT_BUFFER, int64_t capacity) {
    size_t n = 0;
    kvsj_check(kvs_session_last_selection($self, layer, kv_head, (int32_t*)DIRECT_BUFFER, (size_t)capacity, &n));
  }
}

%extend kvs_trace_s {
  ~kvs_trace_s() { kvs_trace_destroy($self); }
  static kvs_trace_s* open(const char* path) {
    kvs_trace_t t = NULL;
    kvsj_check(kvs_trace_open(path, &t));
    return t;
  }
  int64_t totalLen() {
    kvs_trace_info in;
    kvs_trace_info_init(&in);
    kvsj_check(kvs_trace_get_info($self, &in));
    return in.total_len;
  }
}

%typemap(javacode) struct kvs_batch_s %{
  // The sessions, kept reachable while the batch exists: the native batch holds their handles, and
  // the C ABI wants them to outlive it (a Session collected first would be freed by its finalizer).
  private Session[] sessions;

  /** A batch of distinct sessions of one shape, KV dtype, softmax scale, method, backend and device,
   *  decoded together: plan() once per token, then decode() once per layer with [B, ...] tensors,
   *  row b belonging to sessions[b]. The batch keeps the sessions reachable; closing one of them
   *  makes plan() and decode() throw IllegalStateException. Throws KvsException (INVALID_ARGUMENT)
   *  for a repeated or mismatched session. */
  public static Batch of(Session... sessions) {
    if (sessions == null) throw new NullPointerException("sessions: expected an array, got null");
    if (sessions.length == 0) throw new IllegalArgumentException("sessions: expected at least one session");
    long[] handles = new long[sessions.length];
    for (int i = 0; i < sessions.length; ++i) {
      if (sessions[i] == null) throw new NullPointerException("sessions[" + i + "]: expected a session, got null");
      handles[i] = Session.getCPtr(sessions[i]);
      if (handles[i] == 0)
        throw new IllegalStateException("sessions[" + i + "]: expected an open session, got a closed one");
    }
    Batch b = new Batch(handles);
    b.sessions = sessions.clone();
    return b;
  }

  private void checkOpen() {
    if (swigCPtr == 0 || sessions == null)
      throw new IllegalStateException("batch: expected an open batch, got a closed one");
    for (int i = 0; i < sessions.length; ++i)
      if (Session.getCPtr(sessions[i]) == 0)
        throw new IllegalStateException("batch: sessions[" + i + "]: expected an open session, got a closed one");
  }

  /** Once per token, before that token's decode calls: checks every session and layer (prefilled
   *  and indexed) and reserves room for one more token. stream: a cudaStream_t (0 = default). */
  public void plan(long stream) { checkOpen(); planNative(stream); }

  /** One layer's decode step of the planned token: q [B, Hq, d], kNew, vNew [B, Hkv, d], o
   *  [B, Hq, d], lse [B, Hq] F32 or null. Each layer at most once per plan (KvsException
   *  INVALID_STATE otherwise, and without a plan). */
  public void decode(long layer, Tensor q, Tensor kNew, Tensor vNew, Tensor o, Tensor lse, long stream) {
    checkOpen();
    decodeNative(layer, q, kNew, vNew, o, lse, stream);
  }

  /** The number of sessions (B). */
  public long size() { checkOpen(); return sizeNative(); }

  /** The sessions, in batch order (empty once closed). */
  public Session[] sessions() { return sessions == null ? new Session[0] : sessions.clone(); }

  /** Frees the batch (not its sessions) and lets go of them; idempotent. */
  @Override public synchronized void close() { delete(); sessions = null; }
%}

%extend kvs_batch_s {
  kvs_batch_s(const long long* HANDLES, int COUNT) {
    kvs_batch_t b = NULL;
    kvs_session_t* hs = (kvs_session_t*)calloc(COUNT > 0 ? (size_t)COUNT : 1, sizeof *hs);
    if (!hs) { kvsj_check(kvs_abi_check(~0u)); return NULL; } /* as Tensor: an error object to throw */
    for (int i = 0; i < COUNT; ++i) hs[i] = (kvs_session_t)(uintptr_t)HANDLES[i];
    kvsj_check(kvs_batch_create(hs, (size_t)COUNT, &b));
    free(hs);
    return b;
  }
  ~kvs_batch_s() { kvs_batch_destroy($self); }
  void planNative(int64_t stream) { kvsj_check(kvs_batch_plan($self, (void*)(intptr_t)stream)); }
  void decodeNative(uint32_t layer, kvsj_tensor* q, kvsj_tensor* k_new, kvsj_tensor* v_new, kvsj_tensor* o,
                    kvsj_tensor* lse, int64_t stream) {
    kvsj_check(kvs_batch_decode($self, layer, kvsj_t(q), kvsj_t(k_new), kvsj_t(v_new), kvsj_t(o), kvsj_t(lse),
                                (void*)(intptr_t)stream));
  }
  int64_t sizeNative() { return (int64_t)kvs_batch_size($self); }
}

/* The proxies are declared after their typemaps (javacode, javainterfaces) so that these apply. */
struct kvsj_tensor {};
struct kvs_session_s {};
struct kvs_trace_s {};
struct kvs_batch_s {};

/* Registry, versions and tables files. */
%rename(version) kvs_version;
%rename(versionNumber) kvs_version_number;
%rename(abiVersion) kvs_abi_version;
%rename(methodCount) kvs_method_count;
%rename(methodName) kvs_method_name;
%rename(methodDoc) kvs_method_doc;
%rename(methodBackends) kvs_method_backends;
%rename(methodUnsupportedReason) kvs_method_unsupported_reason;
%rename(methodParamCount) kvsj_method_param_count;
%rename(methodParamField) kvsj_method_param_field;
%rename(tablesDescribe) kvsj_tables_describe;
%javamethodmodifiers kvsj_method_param_field "private";
/* The JSON is owned: the proxy's string is a copy, the C string is freed after it. */
%newobject kvsj_tables_describe;
%typemap(newfree) char* kvsj_tables_describe "kvs_string_free($1);"
%inline %{
const char* kvs_version(void);
uint32_t kvs_version_number(void);
uint32_t kvs_abi_version(void);
size_t kvs_method_count(void);
const char* kvs_method_name(size_t i);
const char* kvs_method_doc(const char* method);
uint32_t kvs_method_backends(const char* method);
const char* kvs_method_unsupported_reason(const char* method, int32_t backend);

/* The number of parameters of a method (kvs_method_param_count); KvsException for an unknown one. */
int64_t kvsj_method_param_count(const char* method) {
  size_t n = 0;
  kvsj_check(kvs_method_param_count(method, &n));
  return (int64_t)n;
}
/* One field of parameter i of a method (0 name, 1 type, 2 default_value, 3 doc): static strings. */
const char* kvsj_method_param_field(const char* method, int64_t i, int32_t field) {
  kvs_param_info info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  if (kvsj_check(kvs_method_param(method, (size_t)i, &info))) return NULL;
  switch (field) {
    case 0: return info.name;
    case 1: return info.type;
    case 2: return info.default_value;
    default: return info.doc;
  }
}
/* Verifies a tables file and describes it as JSON text (kvs_tables_describe). On error the library
 * may still have described what was readable: that JSON goes with the exception (details()). */
char* kvsj_tables_describe(const char* path) {
  char* json = NULL;
  if (kvsj_check(kvs_tables_describe(path, &json))) {
    kvsj_pending_details = json;
    return NULL;
  }
  return json;
}
%}
%pragma(java) modulecode=%{
  /** The names of every registered method, in registry order (methodCount / methodName). */
  public static java.util.List<String> methodNames() {
    long n = methodCount();
    java.util.List<String> out = new java.util.ArrayList<>((int) n);
    for (long i = 0; i < n; ++i) out.add(methodName(i));
    return java.util.Collections.unmodifiableList(out);
  }

  /** The parameters of a method, in registry order (kvs_method_param); throws KvsException
   *  (INVALID_ARGUMENT, naming it) for an unknown method. */
  public static java.util.List<ParamInfo> methodParams(String method) {
    long n = methodParamCount(method);
    java.util.List<ParamInfo> out = new java.util.ArrayList<>((int) n);
    for (long i = 0; i < n; ++i)
      out.add(new ParamInfo(field(method, i, 0), field(method, i, 1), field(method, i, 2), field(method, i, 3)));
    return java.util.Collections.unmodifiableList(out);
  }

  private static String field(String method, long i, int f) {
    String s = methodParamField(method, i, f);
    return s == null ? "" : s;
  }

  /** Every registered method with its description, backends and parameters, in registry order
   *  (Python's kvsieve.methods()). */
  public static java.util.List<MethodInfo> methods() {
    java.util.List<MethodInfo> out = new java.util.ArrayList<>();
    for (String name : methodNames()) {
      long mask = methodBackends(name);
      java.util.EnumSet<Backend> backends = java.util.EnumSet.noneOf(Backend.class);
      for (Backend b : Backend.values())
        if ((mask & (1L << b.value)) != 0) backends.add(b);
      String doc = methodDoc(name);
      out.add(new MethodInfo(name, doc == null ? "" : doc, backends, methodParams(name)));
    }
    return java.util.Collections.unmodifiableList(out);
  }

  /** Why a method cannot run on a backend in this build (a sentence), or null when it can (or the
   *  method is unknown: see methodDoc). */
  public static String methodUnsupportedReason(String method, Backend backend) {
    if (backend == null) throw new NullPointerException("backend: expected a Backend, got null");
    return methodUnsupportedReason(method, backend.value);
  }
%}

/* The JNI library loads with the first use of any class of the binding. */
%pragma(java) jniclasscode=%{
  static {
    String explicit = System.getProperty("org.kvsieve.jni");
    if (explicit != null) System.load(explicit); else System.loadLibrary("kvsieve_jni");
  }
%}
