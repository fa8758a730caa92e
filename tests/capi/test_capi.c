/* SPDX-License-Identifier: Apache-2.0 */
/* The public header compiled as C99 (-std=c99 -pedantic -Werror), linked against the shared
 * library: every entry point's error paths, and that a rejected call leaves the session unchanged;
 * batches (kvs_batch_*) against kvs_decode_batch on separate sessions; kvs_method_unsupported_reason.
 * Prints "N passed, M failed" and exits nonzero on any failure. */
#include <kvsieve/kvsieve.h>

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed = 0, failed = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (cond) {                                                       \
      ++passed;                                                       \
    } else {                                                          \
      ++failed;                                                       \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                 \
  } while (0)

/* Expects err to carry `code` and a message mentioning `word`; frees it. */
static void expect(kvs_error_t err, int32_t code, const char* word, int line) {
  const char* msg = kvs_error_message(err);
  if (err && kvs_error_code(err) == code && (!word || strstr(msg, word))) {
    ++passed;
  } else {
    ++failed;
    fprintf(stderr, "line %d: expected code %d mentioning '%s', got %d: %s\n", line, (int)code,
            word ? word : "", err ? (int)kvs_error_code(err) : 0, err ? msg : "(success)");
  }
  kvs_error_destroy(err);
}
#define EXPECT(call, code, word) expect((call), (code), (word), __LINE__)
#define OK(call)                                                                 \
  do {                                                                           \
    kvs_error_t e_ = (call);                                                     \
    if (e_) {                                                                    \
      ++failed;                                                                  \
      fprintf(stderr, "line %d: unexpected error: %s\n", __LINE__, kvs_error_message(e_)); \
      kvs_error_destroy(e_);                                                     \
    } else {                                                                     \
      ++passed;                                                                  \
    }                                                                            \
  } while (0)

enum { HQ = 4, HKV = 2, D = 16, N = 40 };

static kvs_tensor tensor(void* data, int ndim, int64_t* shape, kvs_dtype dt, int32_t device) {
  kvs_tensor t;
  t.data = data;
  t.device.device_type = device;
  t.device.device_id = 0;
  t.ndim = ndim;
  t.dtype = dt;
  t.shape = shape;
  t.strides = NULL;
  t.byte_offset = 0;
  return t;
}

static float frand(unsigned* s) {
  *s = *s * 1103515245u + 12345u;
  return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* A session of p's shape with every layer prefilled with the n tokens of (q, k, v) and indexed. */
static kvs_session_t prefilled(const kvs_session_params* p, float* q, float* k, float* v, int64_t n) {
  kvs_dtype f32 = {KVS_DTYPE_CODE_FLOAT, 32, 1};
  int64_t qs[3], ks[3];
  kvs_tensor tq, tk, tv;
  kvs_session_t s = NULL;
  uint32_t l;
  qs[0] = n, qs[1] = HQ, qs[2] = D;
  ks[0] = n, ks[1] = HKV, ks[2] = D;
  tq = tensor(q, 3, qs, f32, KVS_DEVICE_CPU);
  tk = tensor(k, 3, ks, f32, KVS_DEVICE_CPU);
  tv = tensor(v, 3, ks, f32, KVS_DEVICE_CPU);
  OK(kvs_session_create(p, &s));
  for (l = 0; l < p->num_layers; ++l) OK(kvs_session_prefill(s, l, &tq, &tk, &tv, NULL, NULL));
  OK(kvs_session_build_index(s, NULL));
  return s;
}

static double max_abs_diff(const float* a, const float* b, int n) {
  double m = 0;
  int i;
  for (i = 0; i < n; ++i) m = fmax(m, fabs((double)a[i] - (double)b[i]));
  return m;
}

/* kvs_batch_*: the happy path against kvs_decode_batch on separate sessions built from the same
 * prompts (random data, every layer, several tokens), then every error path. */
enum { BB = 3, NP = 33, STEPS = 3 };
static void test_batches(void) {
  static float pq[BB][NP * HQ * D], pk[BB][NP * HKV * D], pv[BB][NP * HKV * D];
  static float bq[BB * HQ * D], bk[BB * HKV * D], bv[BB * HKV * D];
  static float bo[BB * HQ * D], bl[BB * HQ], ro[BB * HQ * D], rl[BB * HQ];
  kvs_dtype f32 = {KVS_DTYPE_CODE_FLOAT, 32, 1};
  int64_t q3[3] = {BB, HQ, D}, kv3[3] = {BB, HKV, D}, l2[2] = {BB, HQ}, short3[3] = {BB - 1, HQ, D};
  kvs_tensor tq, tk, tv, to, tl, tro, trl, bad;
  kvs_session_params p;
  kvs_session_t bs[BB], rs[BB], pair[2], other = NULL, fresh = NULL;
  kvs_batch_t batch = NULL, b2 = NULL;
  kvs_session_stats st;
  unsigned seed = 99;
  int b, i, step;
  uint32_t layer;
  int64_t ntok = 0;
  double worst = 0;

  kvs_session_params_init(&p);
  p.num_layers = 2;
  p.num_q_heads = HQ;
  p.num_kv_heads = HKV;
  p.head_dim = D;
  p.kv_dtype = KVS_SCALAR_F32;
  p.num_threads = 2;
  p.method = "quest";
  p.method_params = "page_size=4";
  p.budget = 0.25;
  for (b = 0; b < BB; ++b) {
    for (i = 0; i < NP * HQ * D; ++i) pq[b][i] = frand(&seed);
    for (i = 0; i < NP * HKV * D; ++i) pk[b][i] = frand(&seed), pv[b][i] = frand(&seed);
    bs[b] = prefilled(&p, pq[b], pk[b], pv[b], NP);
    rs[b] = prefilled(&p, pq[b], pk[b], pv[b], NP);
  }
  tq = tensor(bq, 3, q3, f32, KVS_DEVICE_CPU);
  tk = tensor(bk, 3, kv3, f32, KVS_DEVICE_CPU);
  tv = tensor(bv, 3, kv3, f32, KVS_DEVICE_CPU);
  to = tensor(bo, 3, q3, f32, KVS_DEVICE_CPU);
  tl = tensor(bl, 2, l2, f32, KVS_DEVICE_CPU);
  tro = tensor(ro, 3, q3, f32, KVS_DEVICE_CPU);
  trl = tensor(rl, 2, l2, f32, KVS_DEVICE_CPU);

  /* happy path: plan once per token, decode every layer; the reference steps the same inputs
   * through kvs_decode_batch on the twin sessions */
  OK(kvs_batch_create(bs, BB, &batch));
  CHECK(batch != NULL && kvs_batch_size(batch) == BB);
  for (step = 0; step < STEPS; ++step) {
    OK(kvs_batch_plan(batch, NULL));
    for (layer = 0; layer < p.num_layers; ++layer) {
      for (i = 0; i < BB * HQ * D; ++i) bq[i] = 2.0f * frand(&seed);
      for (i = 0; i < BB * HKV * D; ++i) bk[i] = frand(&seed), bv[i] = frand(&seed);
      memset(bo, 0, sizeof bo);
      OK(kvs_batch_decode(batch, layer, &tq, &tk, &tv, &to, &tl, NULL));
      OK(kvs_decode_batch(rs, BB, layer, &tq, &tk, &tv, &tro, &trl, NULL));
      worst = fmax(worst, max_abs_diff(bo, ro, BB * HQ * D));
      worst = fmax(worst, max_abs_diff(bl, rl, BB * HQ));
      for (i = 0; i < BB * HQ; ++i) CHECK(isfinite(bl[i]));
    }
  }
  CHECK(worst < 1e-6);
  if (!(worst < 1e-6)) fprintf(stderr, "batch vs kvs_decode_batch: max |difference| = %g\n", worst);
  for (b = 0; b < BB; ++b) {
    OK(kvs_session_layer_tokens(bs[b], 1, &ntok));
    CHECK(ntok == NP + STEPS);
    st.struct_size = sizeof st;
    OK(kvs_session_get_stats(bs[b], &st));
    CHECK(st.decode_steps == STEPS * 2);
  }

  /* create: NULL array or out, count 0 or too large, NULL, repeated or mismatched sessions */
  EXPECT(kvs_batch_create(NULL, 1, &b2), KVS_STATUS_INVALID_ARGUMENT, "sessions");
  EXPECT(kvs_batch_create(bs, 1, NULL), KVS_STATUS_INVALID_ARGUMENT, "out");
  EXPECT(kvs_batch_create(bs, 0, &b2), KVS_STATUS_INVALID_ARGUMENT, "count");
  EXPECT(kvs_batch_create(bs, 65537, &b2), KVS_STATUS_INVALID_ARGUMENT, "count");
  pair[0] = bs[0];
  pair[1] = NULL;
  EXPECT(kvs_batch_create(pair, 2, &b2), KVS_STATUS_INVALID_ARGUMENT, "sessions[1]");
  pair[1] = bs[0];
  EXPECT(kvs_batch_create(pair, 2, &b2), KVS_STATUS_INVALID_ARGUMENT, "twice");
  p.num_q_heads = 2 * HQ; /* another shape */
  OK(kvs_session_create(&p, &other));
  pair[1] = other;
  EXPECT(kvs_batch_create(pair, 2, &b2), KVS_STATUS_INVALID_ARGUMENT, "sessions[1]");
  kvs_session_destroy(other);
  other = NULL;
  p.num_q_heads = HQ;
  p.method = "full"; /* another method */
  p.method_params = NULL;
  OK(kvs_session_create(&p, &other));
  pair[1] = other;
  EXPECT(kvs_batch_create(pair, 2, &b2), KVS_STATUS_INVALID_ARGUMENT, "method");
  kvs_session_destroy(other);
  other = NULL;
  p.method = "quest";
  p.method_params = "page_size=4";
  p.kv_dtype = KVS_SCALAR_BF16; /* another KV dtype */
  OK(kvs_session_create(&p, &other));
  pair[1] = other;
  EXPECT(kvs_batch_create(pair, 2, &b2), KVS_STATUS_INVALID_ARGUMENT, "sessions[1]");
  kvs_session_destroy(other);
  other = NULL;
  p.kv_dtype = KVS_SCALAR_F32;
  CHECK(b2 == NULL); /* outputs untouched on error */

  /* NULL batch handles */
  EXPECT(kvs_batch_plan(NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "batch");
  EXPECT(kvs_batch_decode(NULL, 0, &tq, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_ARGUMENT, "batch");
  CHECK(kvs_batch_size(NULL) == 0);
  kvs_batch_destroy(NULL);

  /* every layer was decoded under the last plan: decoding one again needs a new plan */
  EXPECT(kvs_batch_decode(batch, 0, &tq, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_STATE, "already decoded");
  /* a new batch over the same sessions has no plan yet */
  OK(kvs_batch_create(bs, BB, &b2));
  EXPECT(kvs_batch_decode(b2, 0, &tq, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_STATE, "plan");
  kvs_batch_destroy(b2);
  b2 = NULL;
  /* under a plan: an out-of-range layer, wrong or missing tensors are rejected and change nothing */
  OK(kvs_batch_plan(batch, NULL));
  EXPECT(kvs_batch_decode(batch, 2, &tq, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_ARGUMENT, "layer");
  EXPECT(kvs_batch_decode(batch, 0, NULL, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_ARGUMENT, "q");
  EXPECT(kvs_batch_decode(batch, 0, &tq, &tk, &tv, NULL, &tl, NULL), KVS_STATUS_INVALID_ARGUMENT, "o");
  bad = tensor(bq, 3, short3, f32, KVS_DEVICE_CPU);
  EXPECT(kvs_batch_decode(batch, 0, &bad, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_ARGUMENT, "q");
  bad = tensor(bk, 2, kv3, f32, KVS_DEVICE_CPU);
  EXPECT(kvs_batch_decode(batch, 0, &tq, &bad, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_ARGUMENT, "k_new");
  bad = tensor(bl, 2, l2, f32, KVS_DEVICE_CPU);
  bad.dtype.bits = 16;
  EXPECT(kvs_batch_decode(batch, 0, &tq, &tk, &tv, &to, &bad, NULL), KVS_STATUS_INVALID_ARGUMENT, "lse");
  OK(kvs_session_layer_tokens(bs[0], 0, &ntok));
  CHECK(ntok == NP + STEPS);
  OK(kvs_batch_decode(batch, 0, &tq, &tk, &tv, &to, NULL, NULL)); /* lse is optional */
  EXPECT(kvs_batch_decode(batch, 0, &tq, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_STATE, "layer 0");
  /* a plan whose layer 1 was not decoded is replaced by the next one */
  OK(kvs_batch_plan(batch, NULL));
  OK(kvs_batch_decode(batch, 0, &tq, &tk, &tv, &to, &tl, NULL));
  OK(kvs_session_layer_tokens(bs[2], 0, &ntok));
  CHECK(ntok == NP + STEPS + 2);
  OK(kvs_session_layer_tokens(bs[2], 1, &ntok));
  CHECK(ntok == NP + STEPS);

  /* plan checks every session and layer: a session never prefilled, one with a layer missing */
  OK(kvs_session_create(&p, &fresh));
  pair[0] = bs[0];
  pair[1] = fresh;
  OK(kvs_batch_create(pair, 2, &b2));
  CHECK(kvs_batch_size(b2) == 2);
  EXPECT(kvs_batch_plan(b2, NULL), KVS_STATUS_INVALID_STATE, NULL);
  {
    int64_t qs[3] = {NP, HQ, D}, ks[3] = {NP, HKV, D};
    kvs_tensor pq0 = tensor(pq[0], 3, qs, f32, KVS_DEVICE_CPU), pk0 = tensor(pk[0], 3, ks, f32, KVS_DEVICE_CPU);
    OK(kvs_session_prefill(fresh, 0, &pq0, &pk0, &pk0, NULL, NULL));
    OK(kvs_session_build_index(fresh, NULL));
  }
  EXPECT(kvs_batch_plan(b2, NULL), KVS_STATUS_INVALID_STATE, "layer 1");
  EXPECT(kvs_batch_decode(b2, 0, &tq, &tk, &tv, &to, &tl, NULL), KVS_STATUS_INVALID_STATE, "plan");
  kvs_batch_destroy(b2);

  /* the batch never owned its sessions: they outlive it and keep working */
  kvs_batch_destroy(batch);
  {
    int64_t qs2[2] = {HQ, D}, ks2[2] = {HKV, D};
    kvs_tensor q1 = tensor(bq, 2, qs2, f32, KVS_DEVICE_CPU), k1 = tensor(bk, 2, ks2, f32, KVS_DEVICE_CPU);
    kvs_tensor o1 = tensor(bo, 2, qs2, f32, KVS_DEVICE_CPU);
    OK(kvs_session_decode(bs[0], 1, &q1, &k1, &k1, &o1, NULL, NULL));
  }
  for (b = 0; b < BB; ++b) {
    kvs_session_destroy(bs[b]);
    kvs_session_destroy(rs[b]);
  }
  kvs_session_destroy(fresh);
}

/* kvs_method_unsupported_reason: NULL on the cpu for every method, a sentence for unknown backends,
 * NULL for an unknown method, and consistent with kvs_method_backends; hybrid runs every method
 * exactly where the build has CUDA (full runs on cuda). */
static void test_unsupported_reasons(void) {
  size_t i;
  for (i = 0; i < kvs_method_count(); ++i) {
    const char* m = kvs_method_name(i);
    const char* hybrid = kvs_method_unsupported_reason(m, KVS_BACKEND_HYBRID);
    const char* cuda = kvs_method_unsupported_reason(m, KVS_BACKEND_CUDA);
    CHECK(kvs_method_unsupported_reason(m, KVS_BACKEND_CPU) == NULL);
    CHECK(hybrid == NULL || strlen(hybrid) > 10);
    CHECK((hybrid == NULL) == (kvs_method_unsupported_reason("full", KVS_BACKEND_CUDA) == NULL));
    CHECK((cuda == NULL) == ((kvs_method_backends(m) >> KVS_BACKEND_CUDA) & 1u));
    CHECK(cuda == NULL || strlen(cuda) > 10);
    CHECK((hybrid == NULL) == ((kvs_method_backends(m) >> KVS_BACKEND_HYBRID) & 1u));
  }
  CHECK(kvs_method_unsupported_reason("nope", KVS_BACKEND_CPU) == NULL);
  CHECK(kvs_method_unsupported_reason("nope", KVS_BACKEND_HYBRID) == NULL);
  CHECK(kvs_method_unsupported_reason(NULL, KVS_BACKEND_HYBRID) == NULL);
  CHECK(kvs_method_unsupported_reason("full", 0) != NULL && strstr(kvs_method_unsupported_reason("full", 0), "backend"));
  CHECK(kvs_method_unsupported_reason("full", 7) != NULL && strstr(kvs_method_unsupported_reason("full", 7), "backend"));
  CHECK(kvs_method_unsupported_reason("full", -1) != NULL);
}

/* Issue 22 (hardening), findings 1 and 7: a negative tokens stride in kvs_trace_write, empty items
 * and repeated keys in method_params, output tensors whose strides overlap (o, lse; prefill's o);
 * every refused call leaves the session as it was. */
static void test_hardening(void) {
  kvs_dtype f32 = {KVS_DTYPE_CODE_FLOAT, 32, 1}, i32 = {KVS_DTYPE_CODE_INT, 32, 1};
  enum { T = 8 };
  static float tq_[T * HQ * D], tk_[T * HKV * D], hq_[N * HQ * D], hk_[N * HKV * D], hv_[N * HKV * D];
  static float o[HQ * D], oref[HQ * D], ot[HQ * D], lse[HQ], lref[HQ], po[N * HQ * D];
  int32_t toks[T];
  int64_t tq3[3] = {T, HQ, D}, tk3[3] = {T, HKV, D}, t1[1] = {T};
  int64_t neg[1] = {-1}, huge[1] = {(int64_t)1 << 62};
  int64_t qs3[3] = {N - 1, HQ, D}, ks3[3] = {N - 1, HKV, D}, qs2[2] = {HQ, D}, ks2[2] = {HKV, D}, ls1[1] = {HQ};
  int64_t zero2[2] = {0, 0}, zero_row[2] = {0, 1}, transposed[2] = {1, HQ}, zero1[1] = {0}, zero3[3] = {0, D, 1};
  const kvs_tensor *aq[1], *ak[1], *av[1];
  kvs_tensor q3, k3, v3, tok, pq, pk, pv, pout, dq, dk, dv, dout, dlse;
  kvs_trace_info info;
  kvs_session_params p;
  kvs_session_t s = NULL, ref = NULL;
  uint32_t layer0 = 0;
  const char* path = "kvs_capi_hardening.kvtrace";
  FILE* f;
  int64_t ntok = 0;
  unsigned seed = 22;
  int i, j;

  for (i = 0; i < T * HQ * D; ++i) tq_[i] = frand(&seed);
  for (i = 0; i < T * HKV * D; ++i) tk_[i] = frand(&seed);
  for (i = 0; i < T; ++i) toks[i] = 100 + i;
  for (i = 0; i < N * HQ * D; ++i) hq_[i] = frand(&seed);
  for (i = 0; i < N * HKV * D; ++i) hk_[i] = frand(&seed), hv_[i] = frand(&seed);

  /* Finding 1: the tokens tensor's stride is validated like q/k/v's (a negative one read before
   * the buffer: a segfault); one whose last element's offset overflows is refused too. */
  kvs_trace_info_init(&info);
  info.num_layers = 1;
  info.num_q_heads = HQ;
  info.num_kv_heads = HKV;
  info.head_dim = D;
  info.prefill_len = T - 1;
  info.dtype = KVS_SCALAR_F32;
  q3 = tensor(tq_, 3, tq3, f32, KVS_DEVICE_CPU);
  k3 = tensor(tk_, 3, tk3, f32, KVS_DEVICE_CPU);
  v3 = tensor(tk_, 3, tk3, f32, KVS_DEVICE_CPU);
  aq[0] = &q3, ak[0] = &k3, av[0] = &v3;
  tok = tensor(toks, 1, t1, i32, KVS_DEVICE_CPU);
  remove(path);
  tok.strides = neg;
  EXPECT(kvs_trace_write(path, &info, &layer0, 1, aq, ak, av, &tok), KVS_STATUS_INVALID_ARGUMENT, "tokens: negative");
  neg[0] = -((int64_t)1 << 40); /* far before the buffer: a certain segfault without the check */
  EXPECT(kvs_trace_write(path, &info, &layer0, 1, aq, ak, av, &tok), KVS_STATUS_INVALID_ARGUMENT, "tokens: negative");
  tok.strides = huge;
  EXPECT(kvs_trace_write(path, &info, &layer0, 1, aq, ak, av, &tok), KVS_STATUS_INVALID_ARGUMENT, "tokens: stride");
  f = fopen(path, "rb");
  CHECK(f == NULL); /* nothing written */
  if (f) fclose(f);
  tok.strides = NULL;
  OK(kvs_trace_write(path, &info, &layer0, 1, aq, ak, av, &tok));
  remove(path);

  /* Finding 7, C: method_params with an empty item or a key given twice is refused, naming the
   * position or the key; NULL, "" and blanks still mean "the defaults". */
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = HQ;
  p.num_kv_heads = HKV;
  p.head_dim = D;
  p.kv_dtype = KVS_SCALAR_F32;
  p.num_threads = 2;
  p.method = "quest";
  p.method_params = "page_size=16,page_size=32";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "'page_size' is given twice");
  p.method_params = " page_size = 16 , page_size=16";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "items 1 and 2");
  p.method_params = "page_size=16,,";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "item 2");
  p.method_params = ",page_size=16";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "item 1");
  p.method_params = "page_size=16,";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "item 2");
  p.method_params = "page_size=16, ,";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "empty");
  CHECK(s == NULL);
  p.method_params = "  ";
  OK(kvs_session_create(&p, &s));
  kvs_session_destroy(s);
  s = NULL;
  p.method_params = "";
  OK(kvs_session_create(&p, &s));
  kvs_session_destroy(s);
  s = NULL;

  /* Finding 7, C: an output whose strides put two elements at one address is refused, naming the
   * tensor, and the session is unchanged; an injective non-contiguous output (transposed) is
   * accepted and gets the same values as a contiguous one. */
  p.method = "full";
  p.method_params = NULL;
  pq = tensor(hq_, 3, qs3, f32, KVS_DEVICE_CPU);
  pk = tensor(hk_, 3, ks3, f32, KVS_DEVICE_CPU);
  pv = tensor(hv_, 3, ks3, f32, KVS_DEVICE_CPU);
  pout = tensor(po, 3, qs3, f32, KVS_DEVICE_CPU);
  pout.strides = zero3;
  OK(kvs_session_create(&p, &s));
  OK(kvs_session_create(&p, &ref));
  EXPECT(kvs_session_prefill(s, 0, &pq, &pk, &pv, &pout, NULL), KVS_STATUS_INVALID_ARGUMENT, "o:");
  OK(kvs_session_layer_tokens(s, 0, &ntok));
  CHECK(ntok == 0);
  OK(kvs_session_prefill(s, 0, &pq, &pk, &pv, NULL, NULL));
  OK(kvs_session_prefill(ref, 0, &pq, &pk, &pv, NULL, NULL));
  OK(kvs_session_build_index(s, NULL));
  OK(kvs_session_build_index(ref, NULL));
  dq = tensor(hq_ + (N - 1) * HQ * D, 2, qs2, f32, KVS_DEVICE_CPU);
  dk = tensor(hk_ + (N - 1) * HKV * D, 2, ks2, f32, KVS_DEVICE_CPU);
  dv = tensor(hv_ + (N - 1) * HKV * D, 2, ks2, f32, KVS_DEVICE_CPU);
  dout = tensor(o, 2, qs2, f32, KVS_DEVICE_CPU);
  dlse = tensor(lse, 1, ls1, f32, KVS_DEVICE_CPU);
  for (i = 0; i < HQ * D; ++i) o[i] = 12345.0f;
  dout.strides = zero2; /* every element at one address */
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "o: an output");
  dout.strides = zero_row; /* the heads overlap */
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "overlap");
  dout.strides = NULL;
  dlse.strides = zero1;
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "lse:");
  CHECK(o[0] == 12345.0f && o[HQ * D - 1] == 12345.0f); /* outputs untouched */
  OK(kvs_session_layer_tokens(s, 0, &ntok));
  CHECK(ntok == N - 1); /* no refused call appended a token */
  dlse.strides = NULL;
  dout.data = ot;
  dout.strides = transposed; /* column-major [HQ, D]: no overlap */
  OK(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, &dlse, NULL));
  dout.data = oref;
  dout.strides = NULL;
  dlse.data = lref;
  OK(kvs_session_decode(ref, 0, &dq, &dk, &dv, &dout, &dlse, NULL));
  for (i = 0; i < HQ; ++i)
    for (j = 0; j < D; ++j) CHECK(ot[j * HQ + i] == oref[i * D + j]);
  CHECK(memcmp(lse, lref, sizeof lse) == 0);
  kvs_session_destroy(s);
  kvs_session_destroy(ref);
}

/* Issue 22 (hardening), findings 4 and 6: loads copy unless kvs_load_params.flags has
 * KVS_LOAD_MMAP (unknown bits refused); the cpu backend refuses non-finite q/k/v, naming the tensor
 * and the first bad element, and leaves the session as it was. */
static void test_load_flags_and_finite(void) {
  static float q[N * HQ * D], k[N * HKV * D], v[N * HKV * D], o[HQ * D];
  kvs_dtype f32 = {KVS_DTYPE_CODE_FLOAT, 32, 1};
  int64_t q2[2] = {HQ, D}, k2[2] = {HKV, D};
  kvs_tensor dq, dk, dv, dout;
  kvs_session_params p;
  kvs_load_params lp;
  kvs_session_stats st;
  kvs_session_t s, copied = NULL, mapped = NULL, none = NULL;
  const char* path = "kvsieve_capi_load_flags.kvt";
  unsigned seed = 5;
  int64_t ntok = 0;
  int i;
  for (i = 0; i < N * HQ * D; ++i) q[i] = frand(&seed);
  for (i = 0; i < N * HKV * D; ++i) k[i] = frand(&seed), v[i] = frand(&seed);
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = HQ;
  p.num_kv_heads = HKV;
  p.head_dim = D;
  p.kv_dtype = KVS_SCALAR_F32;
  p.method = "full";
  s = prefilled(&p, q, k, v, N);
  OK(kvs_session_save(s, path, KVS_SAVE_INCLUDE_KV));

  kvs_load_params_init(&lp);
  CHECK(lp.flags == 0 && KVS_LOAD_MMAP == 1 && lp.kv_source == KVS_KV_OWNED);
  /* kv_source = KVS_KV_CALLER: the tables only (the file's KV is not read) */
  lp.kv_source = KVS_KV_CALLER;
  OK(kvs_session_load(path, &lp, &none));
  OK(kvs_session_layer_tokens(none, 0, &ntok));
  CHECK(ntok == 0);
  kvs_session_destroy(none);
  none = NULL;
  lp.kv_source = 2;
  EXPECT(kvs_session_load(path, &lp, &none), KVS_STATUS_INVALID_ARGUMENT, "params->kv_source");
  CHECK(none == NULL);
  lp.kv_source = KVS_KV_OWNED;
  lp.flags = 2;
  EXPECT(kvs_session_load(path, &lp, &none), KVS_STATUS_INVALID_ARGUMENT, "flags");
  CHECK(none == NULL);
  lp.flags = 0;
  OK(kvs_session_load(path, &lp, &copied));
  lp.flags = KVS_LOAD_MMAP;
  OK(kvs_session_load(path, &lp, &mapped));
  st.struct_size = sizeof st;
  OK(kvs_session_get_stats(copied, &st));
  CHECK(st.kv_bytes > 0 && st.kv_shared_bytes == 0);
  OK(kvs_session_get_stats(mapped, &st));
  CHECK(st.kv_bytes > 0 && st.kv_shared_bytes == st.kv_bytes);
  kvs_session_destroy(mapped);
  remove(path);  /* the copied session no longer needs the file */

  dq = tensor(q, 2, q2, f32, KVS_DEVICE_CPU);
  dk = tensor(k, 2, k2, f32, KVS_DEVICE_CPU);
  dv = tensor(v, 2, k2, f32, KVS_DEVICE_CPU);
  dout = tensor(o, 2, q2, f32, KVS_DEVICE_CPU);
  q[1 * D + 2] = (float)NAN;
  EXPECT(kvs_session_decode(copied, 0, &dq, &dk, &dv, &dout, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT,
         "q: element [1, 2] is NaN");
  q[1 * D + 2] = 0.5f;
  v[D + 3] = (float)INFINITY;
  EXPECT(kvs_session_decode(copied, 0, &dq, &dk, &dv, &dout, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT,
         "v_new: element [1, 3] is +inf");
  v[D + 3] = 0.5f;
  OK(kvs_session_layer_tokens(copied, 0, &ntok));
  CHECK(ntok == N);
  OK(kvs_session_decode(copied, 0, &dq, &dk, &dv, &dout, NULL, NULL));
  kvs_session_destroy(copied);
  kvs_session_destroy(s);
}

/* kv_source follows kv_memory; kvs_session_bind_kv's error paths through the C ABI from C99
 * (test_caller_kv.cpp checks what a session over a caller's cache computes). */
typedef char kvs_kv_source_follows_kv_memory[offsetof(kvs_session_params, kv_source) ==
                                                     offsetof(kvs_session_params, kv_memory) + 8 ? 1 : -1];
/* kv_source lies past the struct that ended at kv_memory (not in its tail padding), so an older
 * caller's struct_size leaves it at its default. */
typedef char kvs_kv_source_past_the_old_struct[offsetof(kvs_session_params, kv_source) >=
                                                       ((offsetof(kvs_session_params, kv_memory) + 4 + 7) / 8) * 8 ? 1 : -1];
/* The fields appended to kvs_load_params and kvs_paged_kv keep their places. */
typedef char kvs_load_kv_source_follows_kv_memory[offsetof(kvs_load_params, kv_source) ==
                                                         offsetof(kvs_load_params, kv_memory) + 4 ? 1 : -1];
typedef char kvs_paged_kv_layout_follows_pool_bytes[offsetof(kvs_paged_kv, layout) ==
                                                           offsetof(kvs_paged_kv, pool_bytes) + 8 ? 1 : -1];
typedef char kvs_paged_kv_v_pages_follows_reserved0[offsetof(kvs_paged_kv, v_pages) ==
                                                           offsetof(kvs_paged_kv, reserved0) + 4 ? 1 : -1];
static void test_bind_kv(void) {
  static float pool[2 * 2 * HKV * 256 * D];
  int32_t ids[1] = {1};
  kvs_paged_kv kv;
  kvs_session_params p;
  kvs_session_t s = NULL, owned = NULL;
  kvs_paged_kv_init(&kv);
  CHECK(kv.struct_size == sizeof kv && kv.pages == NULL && kv.num_tokens == 0);
  kvs_session_params_init(&p);
  CHECK(p.kv_source == KVS_KV_OWNED);
  p.num_layers = 1, p.num_q_heads = HQ, p.num_kv_heads = HKV, p.head_dim = D, p.num_threads = 1;
  p.kv_dtype = KVS_SCALAR_F32;
  OK(kvs_session_create(&p, &owned));
  p.kv_source = KVS_KV_CALLER;
  OK(kvs_session_create(&p, &s));
  kv.pages = pool, kv.num_pages = 2, kv.page_size = 256, kv.page_indices = ids, kv.num_page_indices = 1;
  kv.num_tokens = 10;
  EXPECT(kvs_session_bind_kv(NULL, 0, &kv, NULL), KVS_STATUS_INVALID_ARGUMENT, "s");
  EXPECT(kvs_session_bind_kv(s, 0, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "kv");
  EXPECT(kvs_session_bind_kv(owned, 0, &kv, NULL), KVS_STATUS_INVALID_STATE, "KVS_KV_CALLER");
  ids[0] = 2;
  EXPECT(kvs_session_bind_kv(s, 0, &kv, NULL), KVS_STATUS_INVALID_ARGUMENT, "kv->page_indices[0]");
  ids[0] = 1;
  kv.pool_bytes = sizeof pool / 2; /* one page of the two */
  EXPECT(kvs_session_bind_kv(s, 0, &kv, NULL), KVS_STATUS_INVALID_ARGUMENT, "kv->pool_bytes");
  kv.pool_bytes = sizeof pool;
  CHECK(kv.layout == KVS_KV_LAYOUT_HND && kv.v_pages == NULL && kv.v_pool_bytes == 0);
  kv.layout = KVS_KV_LAYOUT_NHD; /* the cuda backend's */
  EXPECT(kvs_session_bind_kv(s, 0, &kv, NULL), KVS_STATUS_UNSUPPORTED, "kv->layout");
  kv.layout = KVS_KV_LAYOUT_HND;
  OK(kvs_session_bind_kv(s, 0, &kv, NULL));
  kvs_session_destroy(s);
  kvs_session_destroy(owned);
}

/* The appended session fields keep their place (append-only layout), and kvs_session_truncate's
 * error paths through the C ABI; test_truncate.cpp checks what a rollback computes. */
typedef char kvs_lse_base_follows_budget_tokens[offsetof(kvs_session_params, lse_base) ==
                                                        offsetof(kvs_session_params, budget_tokens) + 8 ? 1 : -1];
typedef char kvs_max_rollback_follows_lse_base[offsetof(kvs_session_params, max_rollback) ==
                                                       offsetof(kvs_session_params, lse_base) + 8 ? 1 : -1];
static void test_truncate_and_lse_base(void) {
  static float q[N * HQ * D], k[N * HKV * D], v[N * HKV * D];
  unsigned seed = 11;
  int i;
  kvs_session_params p;
  kvs_session_t s;
  int64_t n = 0;
  for (i = 0; i < N * HQ * D; ++i) q[i] = frand(&seed);
  for (i = 0; i < N * HKV * D; ++i) k[i] = frand(&seed), v[i] = frand(&seed);
  kvs_session_params_init(&p);
  CHECK(p.lse_base == KVS_LSE_BASE_E && p.max_rollback == 0);
  p.num_layers = 2, p.num_q_heads = HQ, p.num_kv_heads = HKV, p.head_dim = D, p.num_threads = 1;
  p.method = "quest";
  s = prefilled(&p, q, k, v, N);
  EXPECT(kvs_session_truncate(NULL, 0), KVS_STATUS_INVALID_ARGUMENT, "s");
  EXPECT(kvs_session_truncate(s, -1), KVS_STATUS_INVALID_ARGUMENT, "num_tokens");
  EXPECT(kvs_session_truncate(s, N + 1), KVS_STATUS_INVALID_ARGUMENT, "num_tokens");
  OK(kvs_session_truncate(s, N));
  OK(kvs_session_truncate(s, N - 7));
  OK(kvs_session_layer_tokens(s, 1, &n));
  CHECK(n == N - 7);
  kvs_session_destroy(s);
  p.method = "csattention"; /* history kept only with max_rollback > 0 */
  s = prefilled(&p, q, k, v, N);
  EXPECT(kvs_session_truncate(s, N - 1), KVS_STATUS_INVALID_ARGUMENT, "max_rollback");
  kvs_session_destroy(s);
  p.lse_base = 7;
  s = NULL;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "lse_base");
  CHECK(s == NULL);
  p.lse_base = KVS_LSE_BASE_E;
  p.max_rollback = -3;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "max_rollback");
  CHECK(s == NULL);
}

static void log_fn(int32_t level, const char* line, void* user) {
  (void)level;
  (void)line;
  ++*(int*)user;
}

int main(void) {
  kvs_dtype f32 = {KVS_DTYPE_CODE_FLOAT, 32, 1}, i32 = {KVS_DTYPE_CODE_INT, 32, 1};
  static float q[N * HQ * D], k[N * HKV * D], v[N * HKV * D], o[HQ * D], lse[HQ], o2[HQ * D];
  unsigned seed = 7;
  int i;
  int64_t qs3[3] = {N, HQ, D}, ks3[3] = {N, HKV, D}, qs2[2] = {HQ, D}, ks2[2] = {HKV, D}, ls1[1] = {HQ};
  int64_t bad3[3] = {N, HQ + 1, D}, bad2[2] = {HKV, D + 1};
  kvs_tensor tq, tk, tv, dq, dk, dv, dout, dlse, bad;
  kvs_session_params p;
  kvs_session_t s = NULL, s2 = NULL;
  kvs_session_stats st;
  int64_t ntok = 0;
  size_t count = 0;
  int logged = 0;
  char* json = NULL;
  kvs_param_info info;

  for (i = 0; i < N * HQ * D; ++i) q[i] = frand(&seed);
  for (i = 0; i < N * HKV * D; ++i) k[i] = frand(&seed), v[i] = frand(&seed);

  /* versions, errors, registry */
  CHECK(strlen(kvs_version()) >= 5);
  CHECK(kvs_abi_version() == KVS_ABI_VERSION);
  OK(kvs_abi_check(KVS_ABI_VERSION));
  EXPECT(kvs_abi_check(KVS_ABI_VERSION + 1), KVS_STATUS_ABI_MISMATCH, "ABI");
  kvs_error_destroy(NULL);
  CHECK(kvs_error_code(NULL) == KVS_STATUS_OK);
  CHECK(strcmp(kvs_error_message(NULL), "") == 0);
  CHECK(kvs_method_count() >= 4);
  CHECK(kvs_method_name(kvs_method_count()) == NULL);
  CHECK(kvs_method_doc("quest") != NULL);
  CHECK(kvs_method_doc("nope") == NULL);
  CHECK(kvs_method_backends("full") & (1u << KVS_BACKEND_CPU));
  OK(kvs_method_param_count("quest", &count));
  CHECK(count >= 1);
  info.struct_size = sizeof info;
  OK(kvs_method_param("quest", 0, &info));
  CHECK(info.name && info.type && info.default_value && info.doc);
  EXPECT(kvs_method_param("quest", 99, &info), KVS_STATUS_INVALID_ARGUMENT, "i:");
  EXPECT(kvs_method_param_count("nope", &count), KVS_STATUS_INVALID_ARGUMENT, "nope");
  EXPECT(kvs_method_param_count(NULL, &count), KVS_STATUS_INVALID_ARGUMENT, "method");
  EXPECT(kvs_method_param("quest", 0, NULL), KVS_STATUS_INVALID_ARGUMENT, "out");
  kvs_set_log_callback(log_fn, &logged, KVS_LOG_DEBUG);

  /* create: every bad field is named */
  kvs_session_params_init(&p);
  p.num_layers = 2;
  p.num_q_heads = HQ;
  p.num_kv_heads = HKV;
  p.head_dim = D;
  p.kv_dtype = KVS_SCALAR_F32;
  p.num_threads = 2;
  EXPECT(kvs_session_create(NULL, &s), KVS_STATUS_INVALID_ARGUMENT, "params");
  EXPECT(kvs_session_create(&p, NULL), KVS_STATUS_INVALID_ARGUMENT, "out");
  p.struct_size = 8;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "struct_size");
  p.struct_size = sizeof p;
  p.num_q_heads = 3;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "num_q_heads");
  p.num_q_heads = HQ;
  p.head_dim = 300;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "head_dim");
  p.head_dim = D;
  p.kv_dtype = 9;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "kv_dtype");
  p.kv_dtype = KVS_SCALAR_F32;
  p.method = "nope";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "nope");
  p.method = "quest";
  p.method_params = "page_size=abc";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "page_size");
  p.method_params = "bogus=1";
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "bogus");
  p.method_params = NULL;
  p.budget = 1.5;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "budget");
  p.budget = 0.25;
  p.backend = 7;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "backend");
  p.backend = KVS_BACKEND_HYBRID; /* f32 KV: refused with or without CUDA and a device */
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_UNSUPPORTED, "backend");
  p.backend = KVS_BACKEND_CPU;
  p.gemm = 5;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "gemm");
  p.gemm = KVS_GEMM_AUTO;
  p.kv_memory = 9;
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, "kv_memory");
  p.kv_memory = KVS_DEVICE_CUDA_HOST; /* pinned host KV is the cuda backend's */
  EXPECT(kvs_session_create(&p, &s), KVS_STATUS_UNSUPPORTED, "kv_memory");
  CHECK(s == NULL);
  /* a caller built against a header before kv_memory: its struct ends there, and the bytes here
     (garbage to such a caller, an invalid kv_memory) are not read */
  p.kv_memory = 9;
  p.struct_size = (uint32_t)offsetof(kvs_session_params, kv_memory);
  OK(kvs_session_create(&p, &s));
  kvs_session_destroy(s);
  s = NULL;
  p.struct_size = sizeof p;
  p.kv_memory = KVS_DEVICE_CPU;
  OK(kvs_session_create(&p, &s));
  kvs_session_destroy(s);
  s = NULL;
  p.kv_memory = 0;
  OK(kvs_session_create(&p, &s));

  tq = tensor(q, 3, qs3, f32, KVS_DEVICE_CPU);
  tk = tensor(k, 3, ks3, f32, KVS_DEVICE_CPU);
  tv = tensor(v, 3, ks3, f32, KVS_DEVICE_CPU);

  /* decode and build before prefill */
  dq = tensor(q, 2, qs2, f32, KVS_DEVICE_CPU);
  dk = tensor(k, 2, ks2, f32, KVS_DEVICE_CPU);
  dv = tensor(v, 2, ks2, f32, KVS_DEVICE_CPU);
  dout = tensor(o, 2, qs2, f32, KVS_DEVICE_CPU);
  dlse = tensor(lse, 1, ls1, f32, KVS_DEVICE_CPU);
  EXPECT(kvs_session_build_index(s, NULL), KVS_STATUS_INVALID_STATE, "prefill");
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_STATE, "prefill");

  /* prefill errors: NULL session, layer, NULL tensors, shape, dtype, device; then success */
  EXPECT(kvs_session_prefill(NULL, 0, &tq, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "session");
  EXPECT(kvs_session_prefill(s, 2, &tq, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "layer");
  EXPECT(kvs_session_prefill(s, 0, NULL, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "q");
  EXPECT(kvs_session_prefill(s, 0, &tq, NULL, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "k");
  EXPECT(kvs_session_prefill(s, 0, &tq, &tk, NULL, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "v");
  bad = tensor(q, 3, bad3, f32, KVS_DEVICE_CPU);
  EXPECT(kvs_session_prefill(s, 0, &bad, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "q: expected shape");
  bad = tensor(q, 3, qs3, i32, KVS_DEVICE_CPU);
  EXPECT(kvs_session_prefill(s, 0, &bad, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "dtype");
  bad = tensor(k, 3, ks3, f32, KVS_DEVICE_CUDA);
  EXPECT(kvs_session_prefill(s, 0, &tq, &bad, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "host");
  bad = tensor(NULL, 3, ks3, f32, KVS_DEVICE_CPU);
  EXPECT(kvs_session_prefill(s, 0, &tq, &tk, &bad, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "data is NULL");
  {
    int64_t huge[3] = {(int64_t)1 << 61, HQ, D};
    bad = tensor(q, 3, huge, f32, KVS_DEVICE_CPU);
    EXPECT(kvs_session_prefill(s, 0, &bad, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "too large");
  }
  OK(kvs_session_layer_tokens(s, 0, &ntok));
  CHECK(ntok == 0); /* nothing changed */
  qs3[0] = N - 1; /* prompt: tokens 0..N-2; token N-1 is the decode step */
  ks3[0] = N - 1;
  OK(kvs_session_prefill(s, 0, &tq, &tk, &tv, NULL, NULL));
  OK(kvs_session_build_index(s, NULL));
  EXPECT(kvs_session_prefill(s, 0, &tq, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_STATE, "append");

  /* decode errors leave the layer unchanged */
  dq.data = q + (N - 1) * HQ * D;
  dk.data = k + (N - 1) * HKV * D;
  dv.data = v + (N - 1) * HKV * D;
  EXPECT(kvs_session_decode(s, 1, &dq, &dk, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_STATE, "layer 1");
  EXPECT(kvs_session_decode(s, 5, &dq, &dk, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "layer");
  EXPECT(kvs_session_decode(s, 0, NULL, &dk, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "q");
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &dv, NULL, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "o");
  bad = tensor(k, 2, bad2, f32, KVS_DEVICE_CPU);
  EXPECT(kvs_session_decode(s, 0, &dq, &bad, &dv, &dout, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "k_new");
  bad = tensor(v, 2, ks2, i32, KVS_DEVICE_CPU);
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &bad, &dout, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "v_new");
  bad = tensor(o, 2, qs2, f32, KVS_DEVICE_CUDA);
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &dv, &bad, &dlse, NULL), KVS_STATUS_INVALID_ARGUMENT, "o:");
  bad = tensor(lse, 1, qs2, f32, KVS_DEVICE_CPU);
  bad.shape = ks3; /* [N-1] */
  EXPECT(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, &bad, NULL), KVS_STATUS_INVALID_ARGUMENT, "lse");
  OK(kvs_session_layer_tokens(s, 0, &ntok));
  CHECK(ntok == N - 1);
  OK(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, &dlse, NULL));
  OK(kvs_session_layer_tokens(s, 0, &ntok));
  CHECK(ntok == N);
  for (i = 0; i < HQ; ++i) CHECK(isfinite(lse[i]));

  /* append, batch, stats, selection, save/load/fork argument errors */
  EXPECT(kvs_session_append(s, 1, &tq, &tk, &tv, NULL, NULL), KVS_STATUS_INVALID_STATE, "prefill");
  EXPECT(kvs_session_append(s, 0, &tq, &tk, NULL, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "v");
  EXPECT(kvs_decode_batch(NULL, 1, 0, &tq, &tk, &tv, &dout, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "sessions");
  EXPECT(kvs_decode_batch(&s, 0, 0, &tq, &tk, &tv, &dout, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "count");
  EXPECT(kvs_decode_batch(&s, 1, 0, &dq, &dk, &dv, &dout, NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, "3 dimensions");
  EXPECT(kvs_session_get_stats(s, NULL), KVS_STATUS_INVALID_ARGUMENT, "out");
  st.struct_size = 4;
  EXPECT(kvs_session_get_stats(s, &st), KVS_STATUS_INVALID_ARGUMENT, "struct_size");
  st.struct_size = sizeof st;
  OK(kvs_session_get_stats(s, &st));
  CHECK(st.tokens == N && st.decode_steps == 1 && st.kv_bytes > 0 && st.index_bytes > 0);
  CHECK(st.last_selected_keys > 0 && st.last_selected_keys <= N);
  EXPECT(kvs_session_last_selection(s, 0, HKV, NULL, 0, &count), KVS_STATUS_INVALID_ARGUMENT, "kv_head");
  EXPECT(kvs_session_last_selection(s, 0, 0, NULL, 4, &count), KVS_STATUS_INVALID_ARGUMENT, "out");
  EXPECT(kvs_session_last_selection(s, 0, 0, NULL, 0, NULL), KVS_STATUS_INVALID_ARGUMENT, "out_count");
  OK(kvs_session_last_selection(s, 0, 0, NULL, 0, &count));
  CHECK(count > 0 && count <= N);
  { double dv_ = 0; EXPECT(kvs_session_method_stat(s, "nothing", &dv_), KVS_STATUS_INVALID_ARGUMENT, "nothing"); }
  { /* the session-level phase timings, answered for every method; one decode step was timed */
    double up_ = -1, sel_ = -1, att_ = -1;
    OK(kvs_session_method_stat(s, "decode_update_seconds", &up_));
    OK(kvs_session_method_stat(s, "decode_select_seconds", &sel_));
    OK(kvs_session_method_stat(s, "decode_attend_seconds", &att_));
    CHECK(up_ >= 0 && sel_ >= 0 && att_ > 0);
  }
  EXPECT(kvs_session_layer_tokens(s, 9, &ntok), KVS_STATUS_INVALID_ARGUMENT, "layer");
  EXPECT(kvs_session_save(s, NULL, 0), KVS_STATUS_INVALID_ARGUMENT, "path");
  EXPECT(kvs_session_save(s, "/nonexistent-dir/x.kvt", 0), KVS_STATUS_IO, NULL);
  EXPECT(kvs_session_save(s, "x.kvt", 77), KVS_STATUS_INVALID_ARGUMENT, "flags");
  EXPECT(kvs_session_load(NULL, NULL, &s2), KVS_STATUS_INVALID_ARGUMENT, "path");
  EXPECT(kvs_session_load("/nonexistent-file.kvt", NULL, &s2), KVS_STATUS_IO, NULL);
  EXPECT(kvs_session_fork(NULL, &s2), KVS_STATUS_INVALID_ARGUMENT, "session");
  EXPECT(kvs_session_fork(s, NULL), KVS_STATUS_INVALID_ARGUMENT, "out");
  CHECK(s2 == NULL);
  EXPECT(kvs_tables_describe(NULL, &json), KVS_STATUS_INVALID_ARGUMENT, "path");
  EXPECT(kvs_trace_open(NULL, NULL), KVS_STATUS_INVALID_ARGUMENT, NULL);

  /* a fork decodes the same next token to the same output */
  OK(kvs_session_fork(s, &s2));
  dq.data = q;
  dk.data = k;
  dv.data = v;
  OK(kvs_session_decode(s, 0, &dq, &dk, &dv, &dout, NULL, NULL));
  dout.data = o2;
  OK(kvs_session_decode(s2, 0, &dq, &dk, &dv, &dout, NULL, NULL));
  CHECK(memcmp(o, o2, sizeof o) == 0);

  /* a copy on another placement (the cpu here; cuda where a GPU is, else UNSUPPORTED) decodes the
     next token to the same output */
  {
    kvs_session_t s3 = NULL;
    kvs_error_t e;
    EXPECT(kvs_session_to(NULL, KVS_BACKEND_CPU, 0, &s3), KVS_STATUS_INVALID_ARGUMENT, "session");
    EXPECT(kvs_session_to(s, KVS_BACKEND_CPU, 0, NULL), KVS_STATUS_INVALID_ARGUMENT, "out");
    EXPECT(kvs_session_to(s, 9, 0, &s3), KVS_STATUS_INVALID_ARGUMENT, "backend");
    CHECK(s3 == NULL);
    e = kvs_session_to(s, KVS_BACKEND_CUDA, 0, &s3);
    CHECK(e == NULL || kvs_error_code(e) == KVS_STATUS_UNSUPPORTED);
    kvs_error_destroy(e);
    kvs_session_destroy(s3);
    s3 = NULL;
    OK(kvs_session_to(s2, KVS_BACKEND_CPU, 0, &s3));
    dq.data = q;
    dk.data = k;
    dv.data = v;
    dout.data = o;
    OK(kvs_session_decode(s2, 0, &dq, &dk, &dv, &dout, NULL, NULL));
    dout.data = o2;
    OK(kvs_session_decode(s3, 0, &dq, &dk, &dv, &dout, NULL, NULL));
    CHECK(memcmp(o, o2, sizeof o) == 0);
    kvs_session_destroy(s3);
  }

  kvs_session_destroy(s);
  kvs_session_destroy(s2);
  kvs_session_destroy(NULL);

  test_batches();
  test_unsupported_reasons();
  test_hardening();
  test_load_flags_and_finite();
  test_truncate_and_lse_base();
  test_bind_kv();
  kvs_string_free(NULL);
  kvs_set_log_callback(NULL, NULL, KVS_LOG_WARN);

  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
