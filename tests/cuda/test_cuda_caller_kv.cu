// SPDX-License-Identifier: Apache-2.0
// kv_source = KVS_KV_CALLER on the cuda backend (kvs_session_bind_kv): sessions attending an
// engine's paged KV cache in GPU memory (FlashInfer's HND and NHD layouts, K and V in one pool or
// two, pages of 16 to 256 tokens handed out in a shuffled order) against sessions of the same method storing the same tokens themselves,
// step by step through the public C API: chunked prefill, an appended turn, decode steps as a batch
// of two sessions of different lengths (captured in CUDA graphs where the method allows), a
// rollback, and the errors specific to a caller's cache. Run by kvsieve_cuda_tests
// (--only-caller-kv alone).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "kvsieve/kvsieve.h"
#include "capi_check.hpp"
#include "session_pair.hpp"

namespace {

constexpr int kHq = 8, kHkv = 2, kD = 128;
bool g_small_caller = false;  // --small: shorter prompts

// How the engine lays out its pages (kvs_paged_kv.layout, v_pages).
struct Layout {
  bool nhd = false;    // [P][Hkv][d] instead of [Hkv][P][d]
  bool split = false;  // K and V in two pools (the V pool placed below the K pool: a negative distance)
  const char* name() const { return nhd ? (split ? "NHD, two pools" : "NHD") : (split ? "HND, two pools" : "HND"); }
};

// An engine's cache of one layer for several sequences: a device pool of bf16 pages in `lay`'s
// layout with a host mirror, pages handed out in a shuffled order.
struct EnginePool {
  int P;
  int64_t num_pages;
  Layout lay;
  std::vector<uint16_t> host;  // K and V pages; two pools: the V pool, a gap, the K pool
  uint16_t* dev = nullptr;
  std::vector<int32_t> free_pages;
  int64_t gap;  // two pools: elements between the V pool's end and the K pool
  EnginePool(int P_, int64_t pages, Layout l = {}, int64_t gap_ = 384) : P(P_), num_pages(pages), lay(l), gap(gap_) {
    host.assign(size_t(k_base() + pages * page_elems()), 0x7fc0);  // NaN where nothing was written
    cudaMalloc(&dev, host.size() * 2);
    cudaMemcpy(dev, host.data(), host.size() * 2, cudaMemcpyHostToDevice);
    free_pages.resize(size_t(pages));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), std::mt19937(uint32_t(P)));
  }
  ~EnginePool() { cudaFree(dev); }
  int64_t half() const { return int64_t(kHkv) * P * kD; }
  int64_t page_elems() const { return lay.split ? half() : 2 * half(); }  // one pool page
  int64_t k_base() const { return lay.split ? num_pages * page_elems() + gap : 0; }  // (gap 384: 768 bytes apart)
  int64_t row(int h, int64_t slot) const { return (lay.nhd ? slot * kHkv + h : int64_t(h) * P + slot) * kD; }
  int64_t k_at(int64_t page, int h, int64_t slot) const { return k_base() + page * page_elems() + row(h, slot); }
  int64_t v_at(int64_t page, int h, int64_t slot) const {
    return lay.split ? page * page_elems() + row(h, slot) : k_at(page, h, slot) + half();
  }
  void fill(kvs_paged_kv& kv) const {
    kv.pages = dev + k_base();
    kv.num_pages = num_pages;
    kv.page_size = P;
    kv.layout = lay.nhd ? KVS_KV_LAYOUT_NHD : KVS_KV_LAYOUT_HND;
    kv.v_pages = lay.split ? dev : nullptr;
    kv.pool_bytes = uint64_t(num_pages * page_elems() * 2);
    kv.v_pool_bytes = lay.split ? kv.pool_bytes : 0;
  }
};

// One sequence in the pool: its page table and token count.
struct EngineSeq {
  EnginePool* pool;
  std::vector<int32_t> table;
  int64_t tokens = 0;
  // Token t's K/V rows ([Hkv][d] fp32) at position t (bf16), copied to the device page(s).
  void put(const float* k, const float* v, int64_t t) {
    const int P = pool->P;
    while (int64_t(table.size()) <= t / P) {
      table.push_back(pool->free_pages.back());
      pool->free_pages.pop_back();
    }
    const int64_t page = table[size_t(t / P)];
    uint16_t* h = pool->host.data();
    for (int hh = 0; hh < kHkv; ++hh)
      for (int j = 0; j < kD; ++j) {
        h[pool->k_at(page, hh, t % P) + j] = kvs::f32_to_bf16(k[hh * kD + j]);
        h[pool->v_at(page, hh, t % P) + j] = kvs::f32_to_bf16(v[hh * kD + j]);
      }
    const int64_t k0 = pool->k_at(page, 0, 0), v0 = pool->v_at(page, 0, 0);
    cudaMemcpy(pool->dev + k0, h + k0, size_t(pool->page_elems()) * 2, cudaMemcpyHostToDevice);
    if (pool->lay.split) cudaMemcpy(pool->dev + v0, h + v0, size_t(pool->page_elems()) * 2, cudaMemcpyHostToDevice);
    tokens = t + 1;
  }
  kvs_paged_kv binding() const {
    kvs_paged_kv kv;
    kvs_paged_kv_init(&kv);
    pool->fill(kv);
    kv.page_indices = table.data();
    kv.num_page_indices = int64_t(table.size());
    kv.num_tokens = tokens;
    return kv;
  }
  bool bind(kvs_session_t s, const char* what, cudaStream_t stream = nullptr) {
    const kvs_paged_kv kv = binding();
    return ok(kvs_session_bind_kv(s, 0, &kv, stream), what);
  }
};

struct Tokens {
  std::vector<float> q, k, v;
  const float* qt(int64_t t) const { return q.data() + t * kHq * kD; }
  const float* kt(int64_t t) const { return k.data() + t * kHkv * kD; }
  const float* vt(int64_t t) const { return v.data() + t * kHkv * kD; }
};
Tokens tokens(int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Tokens x;
  x.q.resize(size_t(T) * kHq * kD);
  x.k.resize(size_t(T) * kHkv * kD);
  x.v.resize(size_t(T) * kHkv * kD);
  for (auto& a : x.q) a = nd(rng);
  for (auto& a : x.k) a = nd(rng);
  for (auto& a : x.v) a = nd(rng);
  for (int64_t t = 0; t < T; t += 29)
    for (int i = 0; i < kHkv * kD; ++i) x.k[size_t(t) * kHkv * kD + i] *= 3.f;
  return x;
}

// Tokens [a, b) of x: into the owned session from device tensors, into the caller's session
// through the engine's cache (written, bound, then counted by a prefill or append with NULL k/v).
bool add(kvs_session_t own, kvs_session_t cal, EngineSeq& es, const Tokens& x, int64_t a, int64_t b, bool prompt) {
  const int64_t n = b - a;
  std::vector<float> q(x.qt(a), x.qt(b)), k(x.kt(a), x.kt(b)), v(x.vt(a), x.vt(b));
  float* dq = upload(q);
  uint16_t* dk = upload(to16(k, KVS_SCALAR_BF16));
  uint16_t* dv = upload(to16(v, KVS_SCALAR_BF16));
  Tensor tq(dq, KVS_DEVICE_CUDA, F32, {n, kHq, kD}), tk(dk, KVS_DEVICE_CUDA, dt16(KVS_SCALAR_BF16), {n, kHkv, kD}),
      tv(dv, KVS_DEVICE_CUDA, dt16(KVS_SCALAR_BF16), {n, kHkv, kD});
  bool good = ok(prompt ? kvs_session_prefill(own, 0, &tq.t, &tk.t, &tv.t, nullptr, nullptr)
                        : kvs_session_append(own, 0, &tq.t, &tk.t, &tv.t, nullptr, nullptr),
                 "owned prefill/append");
  for (int64_t t = a; t < b; ++t) es.put(x.kt(t), x.vt(t), t);
  good = good && es.bind(cal, "bind (prefill/append)") &&
         ok(prompt ? kvs_session_prefill(cal, 0, &tq.t, nullptr, nullptr, nullptr, nullptr)
                   : kvs_session_append(cal, 0, &tq.t, nullptr, nullptr, nullptr, nullptr),
            "caller prefill/append");
  cudaDeviceSynchronize();
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  return good;
}

struct Diff {
  double err = 0, lse = 0, overlap = 1;
  bool bits = true;
};

// One decode step of token ts[b] of xs[b] at position pos[b] for both batches: the owned sessions
// from k_new/v_new, the caller's from their cache (written and bound first).
void step(std::vector<kvs_session_t>& own, std::vector<kvs_session_t>& cal, std::vector<EngineSeq>& es,
          const std::vector<const Tokens*>& xs, const std::vector<int64_t>& ts, const std::vector<int64_t>& pos,
          cudaStream_t stream, Diff& df) {
  const int B = int(own.size());
  std::vector<float> q(size_t(B) * kHq * kD), k(size_t(B) * kHkv * kD), v(k.size());
  for (int b = 0; b < B; ++b) {
    const Tokens& x = *xs[size_t(b)];
    std::copy(x.qt(ts[size_t(b)]), x.qt(ts[size_t(b)] + 1), q.begin() + size_t(b) * kHq * kD);
    std::copy(x.kt(ts[size_t(b)]), x.kt(ts[size_t(b)] + 1), k.begin() + size_t(b) * kHkv * kD);
    std::copy(x.vt(ts[size_t(b)]), x.vt(ts[size_t(b)] + 1), v.begin() + size_t(b) * kHkv * kD);
  }
  std::vector<float> o1, l1;
  gpu_decode_batch(own, q, to16(k, KVS_SCALAR_BF16), to16(v, KVS_SCALAR_BF16), kHq, kHkv, kD, KVS_SCALAR_BF16, stream,
                   o1, l1);
  for (int b = 0; b < B; ++b) {
    es[size_t(b)].put(k.data() + size_t(b) * kHkv * kD, v.data() + size_t(b) * kHkv * kD, pos[size_t(b)]);
    es[size_t(b)].bind(cal[size_t(b)], "bind (decode)", stream);
  }
  float* dq = upload(q);
  float *dout = nullptr, *dlse = nullptr;
  cudaMalloc(&dout, o1.size() * 4);
  cudaMalloc(&dlse, l1.size() * 4);
  cudaMemset(dout, 0xff, o1.size() * 4);
  Tensor gq(dq, KVS_DEVICE_CUDA, F32, {B, kHq, kD}), go(dout, KVS_DEVICE_CUDA, F32, {B, kHq, kD}),
      gl(dlse, KVS_DEVICE_CUDA, F32, {B, kHq});
  ok(kvs_decode_batch(cal.data(), size_t(B), 0, &gq.t, nullptr, nullptr, &go.t, &gl.t, stream), "decode_batch caller");
  cudaStreamSynchronize(stream);
  std::vector<float> o2(o1.size()), l2(l1.size());
  cudaMemcpy(o2.data(), dout, o2.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(l2.data(), dlse, l2.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(dq);
  cudaFree(dout);
  cudaFree(dlse);
  df.bits &= std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0 && std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0;
  fold_errors(o2, o1, l2, l1, kD, df.err, df.lse);
  for (int b = 0; b < B; ++b)
    for (uint32_t h = 0; h < uint32_t(kHkv); ++h) {
      const auto s1 = last_keys(own[size_t(b)], h), s2 = last_keys(cal[size_t(b)], h);
      size_t common = 0;
      for (int32_t y : s2) common += std::binary_search(s1.begin(), s1.end(), y);
      df.overlap = std::min(df.overlap, s1.empty() ? 1.0 : double(common) / double(std::max(s1.size(), s2.size())));
    }
}

// retroinfer's GPU k-means sums in fp32 atomics, so each session builds a slightly different index:
// outputs close, selections mostly the same. The others must match the owned sessions to the bit
// (the same kernels over the same bytes; csattention's build sums in fixed point).
void run_method(const char* method, int P, const char* params = nullptr, Layout lay = {}) {
  const bool exact = std::string(method) != "retroinfer";
  // csattention on the cuda backend rolls back no further than its indexed tokens, which its list
  // update keeps at the layer's end: no rollback there.
  const int64_t back = std::string(method) == "csattention" ? 0 : 4;
  const int B = 2;
  const int64_t n0 = g_small_caller ? 600 : 1500, turn = 5, steps = 12;
  std::vector<Tokens> xs;
  for (int b = 0; b < B; ++b) xs.push_back(tokens(n0 + 37 * b + turn + steps + 8, uint32_t(7 + b)));
  EnginePool pool(P, (2 * (n0 + 100) + P) / P + 8, lay);
  std::vector<EngineSeq> es(B, EngineSeq{&pool});
  kvs_session_params p = one_layer_params(method, KVS_SCALAR_BF16, kHq, kHkv, kD, 0.1);
  p.method_params = params;
  p.backend = KVS_BACKEND_CUDA;
  std::vector<kvs_session_t> own(B), cal(B);
  bool good = true;
  for (int b = 0; b < B && good; ++b) {
    p.kv_source = KVS_KV_OWNED;
    good = ok(kvs_session_create(&p, &own[size_t(b)]), "create owned");
    p.kv_source = KVS_KV_CALLER;
    good = good && ok(kvs_session_create(&p, &cal[size_t(b)]), "create caller");
    const int64_t n = n0 + 37 * b;
    good = good && add(own[size_t(b)], cal[size_t(b)], es[size_t(b)], xs[size_t(b)], 0, n / 3, true) &&
           add(own[size_t(b)], cal[size_t(b)], es[size_t(b)], xs[size_t(b)], n / 3, n, true);
    good = good && ok(kvs_session_build_index(own[size_t(b)], nullptr), "build owned") &&
           ok(kvs_session_build_index(cal[size_t(b)], nullptr), "build caller");
    good = good && add(own[size_t(b)], cal[size_t(b)], es[size_t(b)], xs[size_t(b)], n, n + turn, false);
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  Diff df;
  std::vector<int64_t> pos(B);
  for (int b = 0; b < B; ++b) pos[size_t(b)] = n0 + 37 * b + turn;
  std::vector<const Tokens*> xp = {&xs[0], &xs[1]};
  for (int s = 0; good && s < int(steps); ++s) {
    step(own, cal, es, xp, pos, pos, stream, df);
    for (auto& x : pos) ++x;
  }
  // Rollback of `back` tokens on both; the engine writes new tokens over those positions.
  Diff rb;
  if (good) {
    for (int b = 0; b < B && back > 0; ++b) {
      ok(kvs_session_truncate(own[size_t(b)], pos[size_t(b)] - back), "truncate owned");
      ok(kvs_session_truncate(cal[size_t(b)], pos[size_t(b)] - back), "truncate caller");
      pos[size_t(b)] -= back;
    }
    const Tokens fresh = tokens(8, 99);
    std::vector<const Tokens*> fp = {&fresh, &fresh};
    for (int s = 0; s < 3; ++s) {
      std::vector<int64_t> ts = {s, s + 4};
      step(own, cal, es, fp, ts, pos, stream, rb);
      for (auto& x : pos) ++x;
    }
  }
  double graphs = 0;
  kvs_session_method_stat(cal[0], "cuda_graph_launches", &graphs);
  kvs_session_stats st;
  st.struct_size = sizeof st;
  kvs_session_get_stats(cal[0], &st);
  if (exact) {
    CAPI_CHECK(df.bits && rb.bits, "%s P=%d %s: outputs and lse equal to the owned sessions' bits (err %.3g, rollback %.3g)",
               method, P, lay.name(), df.err, rb.err);
    CAPI_CHECK(df.overlap == 1.0 && rb.overlap == 1.0, "%s P=%d %s: same selections (overlap %.3f / %.3f)", method, P,
               lay.name(), df.overlap, rb.overlap);
  } else {
    CAPI_CHECK(df.err < 2e-2 && rb.err < 2e-2 && df.lse < 2e-2, "%s P=%d: outputs close to the owned sessions' (err %.3g / %.3g, lse %.3g)",
               method, P, df.err, rb.err, df.lse);
    CAPI_CHECK(df.overlap > 0.9 && rb.overlap > 0.9, "%s P=%d: selections overlap %.3f / %.3f", method, P, df.overlap,
               rb.overlap);
  }
  CAPI_CHECK(st.kv_bytes == 0, "%s P=%d: the caller's session holds no KV (kv_bytes %lld)", method, P,
             (long long)st.kv_bytes);
  std::printf("  caller KV %s P=%d %s: bit-equal %d, err %.3g, lse %.3g, overlap %.3f, rollback err %.3g, graph launches %.0f\n",
              method, P, lay.name(), int(df.bits && rb.bits), df.err, df.lse, df.overlap, rb.err, graphs);
  cudaStreamDestroy(stream);
  for (auto s : own) kvs_session_destroy(s);
  for (auto s : cal) kvs_session_destroy(s);
}

// A saved index loaded into a session over the engine's cache (kvs_load_params.kv_source): bound,
// prefilled again with NULL k/v, it decodes as the saver's own reload does, to the bit.
void run_loaded(const char* method, int P, Layout lay) {
  const int64_t n = g_small_caller ? 600 : 1500, steps = 6;
  const Tokens x = tokens(n + steps + 4, 31);
  EnginePool pool(P, (n + steps + P) / P + 4, lay);
  EnginePool scratch_pool(P, (n + steps + P) / P + 4);
  EngineSeq es{&pool}, scratch{&scratch_pool};
  kvs_session_params p = one_layer_params(method, KVS_SCALAR_BF16, kHq, kHkv, kD, 0.1);
  p.backend = KVS_BACKEND_CUDA;
  kvs_session_t own = nullptr, cal0 = nullptr, ref = nullptr, cal = nullptr;
  bool good = ok(kvs_session_create(&p, &own), "create owned");
  p.kv_source = KVS_KV_CALLER;
  good = good && ok(kvs_session_create(&p, &cal0), "create caller");
  good = good && add(own, cal0, scratch, x, 0, n, true) && ok(kvs_session_build_index(own, nullptr), "build owned");
  const char* tables = "caller_kv_loaded_tables.kvs";
  const char* with_kv = "caller_kv_loaded_kv.kvs";
  good = good && ok(kvs_session_save(own, tables, KVS_SAVE_TABLES), "save tables") &&
         ok(kvs_session_save(own, with_kv, KVS_SAVE_INCLUDE_KV), "save with KV");
  kvs_load_params lp;
  kvs_load_params_init(&lp);
  lp.backend = KVS_BACKEND_CUDA;
  good = good && ok(kvs_session_load(with_kv, &lp, &ref), "load the saver's copy");
  lp.kv_source = KVS_KV_CALLER;
  good = good && ok(kvs_session_load(tables, &lp, &cal), "load tables into a caller session");
  Diff df;
  if (good) {
    for (int64_t t = 0; t < n; ++t) es.put(x.kt(t), x.vt(t), t);
    std::vector<float> q(x.qt(0), x.qt(n));
    float* dq = upload(q);
    Tensor tq(dq, KVS_DEVICE_CUDA, F32, {n, kHq, kD});
    good = es.bind(cal, "bind (loaded)") && ok(kvs_session_prefill(cal, 0, &tq.t, nullptr, nullptr, nullptr, nullptr),
                                               "prefill the loaded caller session");
    cudaDeviceSynchronize();
    cudaFree(dq);
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    std::vector<kvs_session_t> r{ref}, c{cal};
    std::vector<EngineSeq> e{es};
    std::vector<const Tokens*> xp{&x};
    for (int64_t s = 0; good && s < steps; ++s) {
      std::vector<int64_t> pos{n + s};
      step(r, c, e, xp, pos, pos, stream, df);
    }
    cudaStreamDestroy(stream);
  }
  const bool exact = std::string(method) != "retroinfer";
  CAPI_CHECK(good && (exact ? df.bits && df.overlap == 1.0 : df.err < 2e-2),
             "%s P=%d %s: tables loaded into a caller session decode as the saver's reload (bits %d, err %.3g, overlap %.3f)",
             method, P, lay.name(), int(df.bits), df.err, df.overlap);
  for (kvs_session_t h : {own, cal0, ref, cal}) kvs_session_destroy(h);
  std::remove(tables);
  std::remove(with_kv);
}

// The engine moves a layer's cache to other pools (another distance between its K and V pools)
// between graph replays: the rebound session decodes on as the owned one, to the bit. And a batch
// whose sessions read pools at different distances is refused (one page table, one V offset).
void run_rebind(const char* method) {
  const int64_t n = g_small_caller ? 600 : 1500;
  const int P = 16;
  const Tokens x = tokens(n + 16, 41);
  const Layout lay{true, true};
  EnginePool pa(P, (n + 16 + P) / P + 4, lay), pb(P, (n + 16 + P) / P + 4, lay, 384 + 128 * 37);
  std::vector<EngineSeq> es{EngineSeq{&pa}};
  kvs_session_params p = one_layer_params(method, KVS_SCALAR_BF16, kHq, kHkv, kD, 0.1);
  p.backend = KVS_BACKEND_CUDA;
  std::vector<kvs_session_t> own(1), cal(1);
  bool good = ok(kvs_session_create(&p, &own[0]), "create owned");
  p.kv_source = KVS_KV_CALLER;
  good = good && ok(kvs_session_create(&p, &cal[0]), "create caller") && add(own[0], cal[0], es[0], x, 0, n, true) &&
         ok(kvs_session_build_index(own[0], nullptr), "build owned") && ok(kvs_session_build_index(cal[0], nullptr), "build caller");
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  Diff before, after;
  std::vector<const Tokens*> xp{&x};
  int64_t pos = n;
  for (int s = 0; good && s < 4; ++s, ++pos) {
    std::vector<int64_t> ps{pos};
    step(own, cal, es, xp, ps, ps, stream, before);
  }
  double g0 = 0, g1 = 0;
  kvs_session_method_stat(cal[0], "cuda_graph_launches", &g0);
  EngineSeq moved{&pb};
  for (int64_t t = 0; t < pos; ++t) moved.put(x.kt(t), x.vt(t), t);
  es[0] = moved;
  for (int s = 0; good && s < 4; ++s, ++pos) {
    std::vector<int64_t> ps{pos};
    step(own, cal, es, xp, ps, ps, stream, after);
  }
  kvs_session_method_stat(cal[0], "cuda_graph_launches", &g1);
  CAPI_CHECK(good && before.bits && after.bits && after.overlap == 1.0 && g0 > 0 && g1 > g0,
             "%s: rebound to pools %lld elements further apart between graph replays, still the owned session's bits "
             "(before %d, after %d; graph launches %.0f then %.0f)",
             method, (long long)(pb.gap - pa.gap), int(before.bits), int(after.bits), g0, g1);

  // Two caller sessions bound to pools at different distances: a batch of them is refused.
  kvs_session_t other = nullptr;
  EnginePool pc(P, (n + 16 + P) / P + 4, lay);  // (pa's distance between its pools)
  EngineSeq eo{&pc};
  if (good && ok(kvs_session_create(&p, &other), "create a second caller")) {
    for (int64_t t = 0; t < n; ++t) eo.put(x.kt(t), x.vt(t), t);
    std::vector<float> q(x.qt(0), x.qt(n));
    float* dq = upload(q);
    Tensor tq(dq, KVS_DEVICE_CUDA, F32, {n, kHq, kD});
    good = eo.bind(other, "bind the second") &&
           ok(kvs_session_prefill(other, 0, &tq.t, nullptr, nullptr, nullptr, nullptr), "prefill the second") &&
           ok(kvs_session_build_index(other, nullptr), "build the second");
    cudaDeviceSynchronize();
    cudaFree(dq);
    eo.put(x.kt(n), x.vt(n), n);
    good = good && eo.bind(other, "bind the second's next token");
    // cal[0] reads pool pb (its token at pos is not bound yet: bind it first).
    es[0].put(x.kt(pos), x.vt(pos), pos);
    good = good && es[0].bind(cal[0], "bind the first's next token");
    std::vector<float> q2(size_t(2) * kHq * kD, 0.5f);
    float* dq2 = upload(q2);
    float* dout = nullptr;
    cudaMalloc(&dout, q2.size() * 4);
    Tensor gq(dq2, KVS_DEVICE_CUDA, F32, {2, kHq, kD}), go(dout, KVS_DEVICE_CUDA, F32, {2, kHq, kD});
    kvs_session_t both[2] = {cal[0], other};
    kvs_error_t e = kvs_decode_batch(both, 2, 0, &gq.t, nullptr, nullptr, &go.t, nullptr, stream);
    const std::string m = e ? kvs_error_message(e) : "";
    CAPI_CHECK(good && kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT && m.find("another V pool") != std::string::npos,
               "%s: a batch over pools at two distances: code %d, '%s'", method, kvs_error_code(e), m.c_str());
    kvs_error_destroy(e);
    int64_t t0 = 0, t1 = 0;
    kvs_session_layer_tokens(cal[0], 0, &t0);
    kvs_session_layer_tokens(other, 0, &t1);
    CAPI_CHECK(t0 == pos && t1 == n, "%s: the refused batch changed nothing (%lld, %lld tokens)", method, (long long)t0,
               (long long)t1);
    cudaStreamSynchronize(stream);
    cudaFree(dq2);
    cudaFree(dout);
    kvs_session_destroy(other);
  }
  cudaStreamDestroy(stream);
  kvs_session_destroy(own[0]);
  kvs_session_destroy(cal[0]);
}

void run_caller_errors() {
  kvs_session_params p = one_layer_params("quest", KVS_SCALAR_BF16, kHq, kHkv, kD, 0.1);
  p.backend = KVS_BACKEND_CUDA;
  p.kv_source = KVS_KV_CALLER;
  kvs_session_t s = nullptr;
  if (!ok(kvs_session_create(&p, &s), "create caller")) return;
  EnginePool pool(16, 8);
  EngineSeq es{&pool};
  const Tokens x = tokens(40, 5);
  for (int64_t t = 0; t < 20; ++t) es.put(x.kt(t), x.vt(t), t);
  kvs_paged_kv kv = es.binding();
  kv.pool_bytes = 0;
  auto expect = [&](kvs_error_t e, int code, const char* needle, const char* what) {
    const int c = kvs_error_code(e);
    const std::string m = e ? kvs_error_message(e) : "";
    CAPI_CHECK(c == code && m.find(needle) != std::string::npos, "%s: code %d, message '%s'", what, c, m.c_str());
    kvs_error_destroy(e);
  };
  {  // a pool in host memory
    std::vector<uint16_t> host(size_t(pool.num_pages * pool.page_elems()) + 128);
    auto hk = kv;
    auto* a = host.data();
    while (reinterpret_cast<uintptr_t>(a) % 256) ++a;
    hk.pages = a;
    expect(kvs_session_bind_kv(s, 0, &hk, nullptr), KVS_STATUS_INVALID_ARGUMENT, "kv->pages: expected memory of CUDA device",
           "host pool");
  }
  ok(kvs_session_bind_kv(s, 0, &kv, nullptr), "bind");
  {  // another page size than the first binding's
    auto k2 = kv;
    k2.page_size = 32;
    k2.num_page_indices = 1;
    expect(kvs_session_bind_kv(s, 0, &k2, nullptr), KVS_STATUS_INVALID_ARGUMENT, "kv->page_size: expected 16",
           "page size change");
  }
  {  // another layout than the first binding's; a V pool in host memory; a pool too small
    auto k2 = kv;
    k2.layout = KVS_KV_LAYOUT_NHD;
    expect(kvs_session_bind_kv(s, 0, &k2, nullptr), KVS_STATUS_INVALID_ARGUMENT, "kv->layout: expected KVS_KV_LAYOUT_HND",
           "layout change");
    std::vector<uint16_t> host(size_t(pool.num_pages * pool.half()) + 128);
    auto* a = host.data();
    while (reinterpret_cast<uintptr_t>(a) % 256) ++a;
    k2 = kv;
    k2.v_pages = a;
    expect(kvs_session_bind_kv(s, 0, &k2, nullptr), KVS_STATUS_INVALID_ARGUMENT,
           "kv->v_pages: expected memory of CUDA device", "host V pool");
    k2 = kv;
    uint16_t* apart = nullptr;  // a V pool apart from the K pool, 16-byte but not 256-byte aligned
    cudaMalloc(&apart, size_t(pool.num_pages * pool.half() + 64) * 2);
    k2.v_pages = apart + 8;
    expect(kvs_session_bind_kv(s, 0, &k2, nullptr), KVS_STATUS_INVALID_ARGUMENT, "kv->v_pages: expected a 256-byte",
           "unaligned V pool");
    cudaFree(apart);
    k2 = kv;
    k2.v_pages = pool.dev + pool.half();  // half a page from the K pool: the two overlap
    expect(kvs_session_bind_kv(s, 0, &k2, nullptr), KVS_STATUS_INVALID_ARGUMENT, "the V pool overlaps the K pool",
           "overlapping pools");
    k2 = kv;
    k2.v_pages = pool.dev + 128 * 8;
    k2.pool_bytes = uint64_t(pool.half()) * 2 * 3;  // 3 pages of K
    expect(kvs_session_bind_kv(s, 0, &k2, nullptr), KVS_STATUS_INVALID_ARGUMENT, "do not fit in kv->pool_bytes",
           "K pool too small");
  }
  {  // K/V tensors given to a caller's session
    std::vector<float> q(x.qt(0), x.qt(20)), k(x.kt(0), x.kt(20));
    float* dq = upload(q);
    float* dk = upload(k);
    Tensor tq(dq, KVS_DEVICE_CUDA, F32, {20, kHq, kD}), tk(dk, KVS_DEVICE_CUDA, F32, {20, kHkv, kD});
    expect(kvs_session_prefill(s, 0, &tq.t, &tk.t, &tk.t, nullptr, nullptr), KVS_STATUS_INVALID_ARGUMENT,
           "k: expected NULL", "prefill with k");
    ok(kvs_session_prefill(s, 0, &tq.t, nullptr, nullptr, nullptr, nullptr), "prefill caller");
    ok(kvs_session_build_index(s, nullptr), "build caller");
    // The next token is not in the binding yet: refused, nothing changes.
    std::vector<float> o(size_t(kHq) * kD);
    float* dout = upload(o);
    Tensor q1(dq, KVS_DEVICE_CUDA, F32, {kHq, kD}), to(dout, KVS_DEVICE_CUDA, F32, {kHq, kD});
    expect(kvs_session_decode(s, 0, &q1.t, nullptr, nullptr, &to.t, nullptr, nullptr), KVS_STATUS_INVALID_STATE,
           "needs 21 tokens", "decode past the binding");
    int64_t n = 0;
    kvs_session_layer_tokens(s, 0, &n);
    CAPI_CHECK(n == 20, "layer tokens after a refused decode: %lld", (long long)n);
    expect(kvs_session_save(s, "caller_kv_unused.kvs", KVS_SAVE_INCLUDE_KV), KVS_STATUS_UNSUPPORTED,
           "KVS_SAVE_INCLUDE_KV", "save with KV");
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dout);
  }
  kvs_session_destroy(s);
  {  // retroinfer reads pages of 256 tokens only; the hybrid backend keeps its own KV
    kvs_session_params r = one_layer_params("retroinfer", KVS_SCALAR_BF16, kHq, kHkv, kD, 0.1);
    r.backend = KVS_BACKEND_CUDA;
    r.kv_source = KVS_KV_CALLER;
    kvs_session_t rs = nullptr;
    if (ok(kvs_session_create(&r, &rs), "create retroinfer caller")) {
      expect(kvs_session_bind_kv(rs, 0, &kv, nullptr), KVS_STATUS_UNSUPPORTED, "pages of 256", "retroinfer P=16");
      EnginePool p256(256, 2, Layout{true, false});
      EngineSeq e256{&p256};
      for (int64_t t = 0; t < 20; ++t) e256.put(x.kt(t), x.vt(t), t);
      const kvs_paged_kv nk = e256.binding();
      expect(kvs_session_bind_kv(rs, 0, &nk, nullptr), KVS_STATUS_UNSUPPORTED, "in the HND layout", "retroinfer NHD");
      kvs_session_destroy(rs);
    }
    r.backend = KVS_BACKEND_HYBRID;
    kvs_session_t hs = nullptr;
    expect(kvs_session_create(&r, &hs), KVS_STATUS_UNSUPPORTED, "params->kv_source", "hybrid caller");
  }
}

}  // namespace

int run_caller_kv_passed() { return g_pass; }

// Returns failures.
int run_caller_kv_tests(bool small) {
  g_small_caller = small;
  run_caller_errors();
  for (const char* m : {"full", "exact_topk", "streaming", "quest", "csattention"}) {
    for (int P : {16, 256}) run_method(m, P);
    // The other layouts engines use: FlashInfer's NHD, and vLLM's K and V pools (NHD, HND).
    run_method(m, 16, nullptr, Layout{true, false});
    run_method(m, 16, nullptr, Layout{true, true});
    run_method(m, 256, nullptr, Layout{true, true});
    run_method(m, 64, nullptr, Layout{false, true});
  }
  run_method("quest", 64, "page_size=16");
  run_method("quest", 64, "page_size=16", Layout{true, true});
  for (const char* m : {"quest", "csattention", "exact_topk"}) run_loaded(m, 16, Layout{true, true});
  for (const char* m : {"full", "quest"}) run_rebind(m);
  run_loaded("quest", 256, Layout{});
  run_loaded("retroinfer", 256, Layout{});
  run_method("retroinfer", 256);
  std::printf("caller KV: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail;
}
