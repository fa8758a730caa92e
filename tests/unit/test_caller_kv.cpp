// SPDX-License-Identifier: Apache-2.0
// kv_source = KVS_KV_CALLER (kvs_session_bind_kv) on the cpu backend: a session that attends the
// caller's paged KV cache must decode exactly as a session that stores the same tokens itself, for
// every method, through chunked prefill, an appended turn, decode steps, a rollback, a fork and a
// renumbering of the caller's pages; bad bindings and calls fail with errors naming the argument.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "capi_helpers.hpp"
#include "core/dtype.hpp"
#include "kvsieve/kvsieve.h"
#include "reference.hpp"
#include "session_steps.hpp"

using namespace kvt;

namespace {

constexpr uint32_t kLayers = 2;
constexpr int32_t kPage = 256;  // the cpu backend's page size
const char* const kMethods[] = {"full", "exact_topk", "streaming", "quest", "csattention",
                                "ctkvr", "lfps", "hgca", "retroinfer"};

// An engine's paged cache of one sequence, per layer: a pool of pages [2][Hkv][P][d] bf16 handed
// out in a shuffled order, so the sequence's pages are not contiguous.
struct EngineCache {
  int hkv, d;
  int64_t num_pages;
  std::vector<std::vector<uint16_t>> pool;  // [layer], 256-byte aligned by over-allocation below
  std::vector<std::vector<int32_t>> table;  // [layer]: the sequence's pages
  std::vector<int64_t> tokens;              // [layer]
  std::vector<int32_t> free_pages;
  EngineCache(int hkv_, int d_, int64_t pages) : hkv(hkv_), d(d_), num_pages(pages) {
    pool.resize(kLayers);
    for (auto& p : pool) p.assign(size_t(pages * page_elems() + 128), 0x7fc0);  // NaN where unwritten
    table.resize(kLayers);
    tokens.assign(kLayers, 0);
    free_pages.resize(size_t(pages));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    Rng r(99);
    for (size_t i = free_pages.size(); i > 1; --i) std::swap(free_pages[i - 1], free_pages[size_t(r.uniform(0, int64_t(i) - 1))]);
  }
  int64_t page_elems() const { return int64_t(2) * hkv * kPage * d; }
  uint16_t* base(uint32_t l) {
    auto* p = pool[l].data();
    while (reinterpret_cast<uintptr_t>(p) % 256) ++p;
    return p;
  }
  // Writes one token's K/V rows [Hkv][d] at position t of layer l (bf16, as an engine's
  // cache-append kernel would), taking a new page when t starts one.
  void put(uint32_t l, const float* k, const float* v, int64_t t) {
    const int64_t pi = t / kPage;
    while (int64_t(table[l].size()) <= pi) {
      REQUIRE(!free_pages.empty());
      table[l].push_back(free_pages.back());
      free_pages.pop_back();
    }
    uint16_t* page = base(l) + int64_t(table[l][size_t(pi)]) * page_elems();
    for (int h = 0; h < hkv; ++h)
      for (int j = 0; j < d; ++j) {
        page[(int64_t(h) * kPage + t % kPage) * d + j] = kvs::f32_to_bf16(k[h * d + j]);
        page[(int64_t(hkv + h) * kPage + t % kPage) * d + j] = kvs::f32_to_bf16(v[h * d + j]);
      }
    tokens[l] = t + 1;
  }
  void write(uint32_t l, TokenData& D, int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) put(l, D.kt(t), D.vt(t), t);
  }
  kvs_paged_kv desc(uint32_t l) {
    kvs_paged_kv kv;
    kvs_paged_kv_init(&kv);
    kv.pages = base(l);
    kv.num_pages = num_pages;
    kv.page_size = kPage;
    kv.page_indices = table[l].data();
    kv.num_page_indices = int64_t(table[l].size());
    kv.num_tokens = tokens[l];
    return kv;
  }
  void bind(kvs_session_t s, uint32_t l) {
    auto kv = desc(l);
    OK(kvs_session_bind_kv(s, l, &kv, nullptr));
  }
};

kvs_session_params params(const TokenData& D, const char* method, int32_t source) {
  kvs_session_params p = session_params(D, method, kLayers, 32);
  p.kv_source = source;
  return p;
}

// Tokens [a, b) into every layer of the owned session X and, through the cache, of the caller's C.
void chunk(kvs_session_t X, kvs_session_t C, EngineCache& E, TokenData& D, int64_t a, int64_t b, bool prompt) {
  const int64_t n = b - a;
  T q(D.qt(a), f32(), {n, D.hq, D.d}), k(D.kt(a), f32(), {n, D.hkv, D.d}), v(D.vt(a), f32(), {n, D.hkv, D.d});
  for (uint32_t l = 0; l < kLayers; ++l) {
    OK(prompt ? kvs_session_prefill(X, l, &q.t, &k.t, &v.t, nullptr, nullptr)
              : kvs_session_append(X, l, &q.t, &k.t, &v.t, nullptr, nullptr));
    E.write(l, D, a, b);
    E.bind(C, l);
    OK(prompt ? kvs_session_prefill(C, l, &q.t, nullptr, nullptr, nullptr, nullptr)
              : kvs_session_append(C, l, &q.t, nullptr, nullptr, nullptr, nullptr));
  }
}

// Token t of D decoded in every layer at position pos (with E: written into the cache and bound
// first; the session then counts it as its next token).
std::vector<StepOut> decode(kvs_session_t s, EngineCache* E, TokenData& D, int64_t t, int64_t pos) {
  std::vector<StepOut> out(kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto& st = out[l];
    st.o.assign(size_t(D.hq) * D.d, NAN);
    st.lse.assign(size_t(D.hq), NAN);
    T q(D.qt(t), f32(), {D.hq, D.d}), k(D.kt(t), f32(), {D.hkv, D.d}), v(D.vt(t), f32(), {D.hkv, D.d});
    T ot(st.o.data(), f32(), {D.hq, D.d}), lt(st.lse.data(), f32(), {D.hq});
    if (E) {
      // The token goes to position pos of the cache (after a rollback the engine overwrites).
      E->put(l, D.kt(t), D.vt(t), pos);
      E->bind(s, l);
      OK(kvs_session_decode(s, l, &q.t, nullptr, nullptr, &ot.t, &lt.t, nullptr));
    } else {
      OK(kvs_session_decode(s, l, &q.t, &k.t, &v.t, &ot.t, &lt.t, nullptr));
    }
    for (uint32_t h = 0; h < uint32_t(D.hkv); ++h) st.sel.push_back(selection(s, l, h));
  }
  return out;
}

}  // namespace

TEST_CASE("caller KV (cpu): every method decodes exactly as a session storing the same tokens") {
  Rng rng(3301);
  TokenData D(rng, 8, 2, 32, 620);  // room for positions up to 620 (decode writes token t at pos)
  TokenData N(rng, 8, 2, 32, 620);  // tokens decoded after the rollback
  const int64_t P = 502, A = 3, END = P + A + 15;
  for (const char* method : kMethods) {
    INFO(std::string(method));
    Sess X, C;
    auto px = params(D, method, KVS_KV_OWNED), pc = params(D, method, KVS_KV_CALLER);
    OK(kvs_session_create(&px, &X.s));
    OK(kvs_session_create(&pc, &C.s));
    EngineCache E(D.hkv, D.d, 12);
    chunk(X.s, C.s, E, D, 0, 300, true);  // chunked prefill
    chunk(X.s, C.s, E, D, 300, P, true);
    OK(kvs_session_build_index(X.s, nullptr));
    OK(kvs_session_build_index(C.s, nullptr));
    chunk(X.s, C.s, E, D, P, P + A, false);
    for (int64_t t = P + A; t < END; ++t) {
      INFO("token " << t);
      require_same(decode(X.s, nullptr, D, t, t), decode(C.s, &E, D, t, t));
    }
    for (uint32_t l = 0; l < kLayers; ++l) REQUIRE(layer_tokens(C.s, l) == END);

    // kvsieve holds none of the KV: only the index.
    kvs_session_stats sx, sc;
    sx.struct_size = sc.struct_size = sizeof sx;
    OK(kvs_session_get_stats(X.s, &sx));
    OK(kvs_session_get_stats(C.s, &sc));
    CHECK(sx.kv_bytes > 0);
    CHECK(sc.kv_bytes == 0);
    CHECK(sc.index_bytes == sx.index_bytes);

    // Rollback: both drop their last 6 tokens; the engine overwrites those positions.
    OK(kvs_session_truncate(X.s, END - 6));
    OK(kvs_session_truncate(C.s, END - 6));
    for (int64_t t = 0; t < 4; ++t) {
      INFO("after rollback, token " << t);
      require_same(decode(X.s, nullptr, N, t, END - 6 + t), decode(C.s, &E, N, t, END - 6 + t));
    }

    // The engine moves the sequence's first page elsewhere (same bytes): same steps.
    for (uint32_t l = 0; l < kLayers; ++l) {
      const int32_t from = E.table[l][0], to = E.free_pages.back();
      E.free_pages.pop_back();
      std::memcpy(E.base(l) + int64_t(to) * E.page_elems(), E.base(l) + int64_t(from) * E.page_elems(),
                  size_t(E.page_elems()) * 2);
      E.table[l][0] = to;
      E.bind(C.s, l);
    }
    // A fork reads the same cache; the original decodes on after it.
    Sess F;
    OK(kvs_session_fork(C.s, &F.s));
    const int64_t at = END - 2;
    require_same(decode(X.s, nullptr, N, 10, at), decode(C.s, &E, N, 10, at));
    OK(kvs_session_truncate(C.s, at));  // the fork decodes the same token at the same place
    require_same(decode(F.s, &E, N, 10, at), decode(C.s, &E, N, 10, at));
  }
}

TEST_CASE("caller KV (cpu): a saved index loads into a session over the caller's cache and decodes on") {
  // An engine restarts a session from its tables (kvs_load_params.kv_source = KVS_KV_CALLER): the
  // layers are bound to the engine's cache and prefilled again with NULL k/v; the loaded index is
  // kept, and the steps equal those of the session that saved it, to the bit.
  Rng rng(3303);
  TokenData D(rng, 8, 2, 32, 560);
  const int64_t P = 520, END = P + 8;
  const std::string tables = "caller_kv_load_tables.kvs", with_kv = "caller_kv_load_kv.kvs";
  for (const char* method : kMethods) {
    INFO(std::string(method));
    Sess X;
    auto px = params(D, method, KVS_KV_OWNED);
    OK(kvs_session_create(&px, &X.s));
    EngineCache E(D.hkv, D.d, 8);
    T q(D.qt(0), f32(), {P, D.hq, D.d}), k(D.kt(0), f32(), {P, D.hkv, D.d}), v(D.vt(0), f32(), {P, D.hkv, D.d});
    for (uint32_t l = 0; l < kLayers; ++l) {
      OK(kvs_session_prefill(X.s, l, &q.t, &k.t, &v.t, nullptr, nullptr));
      E.write(l, D, 0, P);
    }
    OK(kvs_session_build_index(X.s, nullptr));
    OK(kvs_session_save(X.s, tables.c_str(), KVS_SAVE_TABLES));
    OK(kvs_session_save(X.s, with_kv.c_str(), KVS_SAVE_INCLUDE_KV));
    for (const std::string& file : {tables, with_kv}) {
      INFO(file);
      kvs_load_params lp;
      kvs_load_params_init(&lp);
      CHECK(lp.kv_source == KVS_KV_OWNED);
      lp.kv_source = KVS_KV_CALLER;
      Sess C;
      OK(kvs_session_load(file.c_str(), &lp, &C.s));
      // The file's KV (if any) is not read: every layer waits for its tokens from the cache.
      CHECK(layer_tokens(C.s, 0) == 0);
      {
        std::vector<float> o(size_t(D.hq) * D.d);
        T q1(D.qt(P), f32(), {D.hq, D.d}), ot(o.data(), f32(), {D.hq, D.d});
        Err e{kvs_session_decode(C.s, 0, &q1.t, nullptr, nullptr, &ot.t, nullptr, nullptr)};
        CHECK(e.code() == KVS_STATUS_INVALID_STATE);
      }
      for (uint32_t l = 0; l < kLayers; ++l) {
        E.bind(C.s, l);
        T q0(D.qt(0), f32(), {200, D.hq, D.d}), q1(D.qt(200), f32(), {P - 200, D.hq, D.d});
        OK(kvs_session_prefill(C.s, l, &q0.t, nullptr, nullptr, nullptr, nullptr));
        OK(kvs_session_prefill(C.s, l, &q1.t, nullptr, nullptr, nullptr, nullptr));
        REQUIRE(layer_tokens(C.s, l) == P);
      }
      // A fresh copy of the saver (the same file, its own KV) steps beside the caller's session.
      Sess Y;
      OK(kvs_session_load(with_kv.c_str(), nullptr, &Y.s));
      kvs_session_stats sy, sc;
      sy.struct_size = sc.struct_size = sizeof sy;
      OK(kvs_session_get_stats(Y.s, &sy));
      OK(kvs_session_get_stats(C.s, &sc));
      CHECK(sc.kv_bytes == 0);
      CHECK(sy.kv_bytes > 0);
      CHECK(sc.index_bytes == sy.index_bytes);
      EngineCache F = E;  // (the engine's cache, per file: each pass writes the same tokens)
      for (int64_t t = P; t < END; ++t) {
        INFO("token " << t);
        require_same(decode(Y.s, nullptr, D, t, t), decode(C.s, &F, D, t, t));
      }
    }
  }
  {  // params->kv_source: checked as the caller's field, not the file's
    kvs_load_params lp;
    kvs_load_params_init(&lp);
    lp.kv_source = 3;
    Sess C;
    Err e{kvs_session_load(tables.c_str(), &lp, &C.s)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("params->kv_source") != std::string::npos);
    lp.kv_source = KVS_KV_CALLER;
    lp.kv_memory = KVS_DEVICE_CPU;
    Err m{kvs_session_load(tables.c_str(), &lp, &C.s)};
    CHECK(m.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(m.msg().find("params->kv_memory") != std::string::npos);
    lp.kv_memory = 0;
    lp.backend = KVS_BACKEND_HYBRID;
    Err h{kvs_session_load(tables.c_str(), &lp, &C.s)};
    CHECK(h.code() == KVS_STATUS_UNSUPPORTED);
    CHECK(h.msg().find("params->kv_source") != std::string::npos);
  }
  std::remove(tables.c_str());
  std::remove(with_kv.c_str());
}

const void* far_from(const void* p) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + (uintptr_t(1) << 30));
}

TEST_CASE("caller KV (cpu): bad bindings and calls fail naming the argument, and change nothing") {
  Rng rng(3302);
  TokenData D(rng, 4, 2, 32, 300);
  EngineCache E(D.hkv, D.d, 4);
  auto pc = params(D, "quest", KVS_KV_CALLER);
  Sess C;
  OK(kvs_session_create(&pc, &C.s));
  T q(D.qt(0), f32(), {8, D.hq, D.d}), k(D.kt(0), f32(), {8, D.hkv, D.d}), v(D.vt(0), f32(), {8, D.hkv, D.d});

  // Before any binding: nothing to attend.
  {
    Err e{kvs_session_prefill(C.s, 0, &q.t, nullptr, nullptr, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    CHECK(e.msg().find("kvs_session_bind_kv") != std::string::npos);
  }
  E.write(0, D, 0, 8);
  auto kv = E.desc(0);
  // K/V tensors are refused: the cache is the caller's.
  E.bind(C.s, 0);
  {
    Err e{kvs_session_prefill(C.s, 0, &q.t, &k.t, &v.t, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("k: expected NULL") != std::string::npos);
  }
  struct Bad {
    const char* field;
    void (*edit)(kvs_paged_kv&);
    int code;
  };
  const Bad bads[] = {
      {"kv->struct_size", [](kvs_paged_kv& x) { x.struct_size = 4; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->pages", [](kvs_paged_kv& x) { x.pages = nullptr; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->pages", [](kvs_paged_kv& x) { x.pages = static_cast<const char*>(x.pages) + 8; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->num_pages", [](kvs_paged_kv& x) { x.num_pages = 0; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->page_size", [](kvs_paged_kv& x) { x.page_size = 100; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->page_size", [](kvs_paged_kv& x) { x.page_size = 16; }, KVS_STATUS_UNSUPPORTED},
      {"kv->num_page_indices", [](kvs_paged_kv& x) { x.num_page_indices = 0; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->page_indices", [](kvs_paged_kv& x) { x.page_indices = nullptr; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->num_tokens", [](kvs_paged_kv& x) { x.num_tokens = -1; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->layout", [](kvs_paged_kv& x) { x.layout = 2; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->reserved0", [](kvs_paged_kv& x) { x.reserved0 = 1; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->v_pages", [](kvs_paged_kv& x) { x.v_pages = static_cast<const char*>(x.pages) + 8; }, KVS_STATUS_INVALID_ARGUMENT},
      {"kv->v_pages", [](kvs_paged_kv& x) { x.v_pages = x.pages; }, KVS_STATUS_INVALID_ARGUMENT},
      // The cpu backend reads kvsieve's own page layout only (HND, K and V in one page).
      {"kv->layout", [](kvs_paged_kv& x) { x.layout = KVS_KV_LAYOUT_NHD; }, KVS_STATUS_UNSUPPORTED},
      // (an address 1 GiB past the pool: never read, the backend refuses first)
      {"kv->v_pages: the cpu backend", [](kvs_paged_kv& x) { x.v_pages = far_from(x.pages); }, KVS_STATUS_UNSUPPORTED},
      {"kv->v_pages: the V pool overlaps", [](kvs_paged_kv& x) { x.v_pages = static_cast<const char*>(x.pages) + 256; },
       KVS_STATUS_INVALID_ARGUMENT},
      {"kv->v_pool_bytes: expected 0 without kv->v_pages", [](kvs_paged_kv& x) { x.v_pool_bytes = 64; },
       KVS_STATUS_INVALID_ARGUMENT},
      // Two pools of one tensor each: num_pages pages of half the bytes must fit in each.
      {"kv->v_pool_bytes", [](kvs_paged_kv& x) { x.v_pages = static_cast<const char*>(x.pages) + 256; x.v_pool_bytes = 64; },
       KVS_STATUS_INVALID_ARGUMENT},
  };
  for (const Bad& b : bads) {
    INFO(b.field);
    auto x = kv;
    b.edit(x);
    Err e{kvs_session_bind_kv(C.s, 0, &x, nullptr)};
    CHECK(e.code() == b.code);
    CHECK(e.msg().find(b.field) != std::string::npos);
  }
  {
    Err e{kvs_session_bind_kv(C.s, 0, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    Err l{kvs_session_bind_kv(C.s, kLayers, &kv, nullptr)};
    CHECK(l.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(l.msg().find("layer") != std::string::npos);
  }
  {  // a page index outside the pool
    std::vector<int32_t> ids = E.table[0];
    ids[0] = 4;
    auto x = kv;
    x.page_indices = ids.data();
    Err e{kvs_session_bind_kv(C.s, 0, &x, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("kv->page_indices[0]: expected 0..3, got 4") != std::string::npos);
  }
  // The binding before the failures still holds: the prefill of the 8 bound tokens works.
  OK(kvs_session_prefill(C.s, 0, &q.t, nullptr, nullptr, nullptr, nullptr));
  CHECK(layer_tokens(C.s, 0) == 8);
  {  // fewer tokens than the layer counts
    auto x = kv;
    x.num_tokens = 7;
    Err e{kvs_session_bind_kv(C.s, 0, &x, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("kv->num_tokens: expected 8..") != std::string::npos);
  }
  OK(kvs_session_build_index(C.s, nullptr));
  {  // a decode whose token is not bound yet changes nothing
    std::vector<float> o(size_t(D.hq) * D.d);
    T q1(D.qt(8), f32(), {D.hq, D.d}), ot(o.data(), f32(), {D.hq, D.d});
    Err e{kvs_session_decode(C.s, 0, &q1.t, nullptr, nullptr, &ot.t, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    CHECK(e.msg().find("needs 9 tokens") != std::string::npos);
    CHECK(layer_tokens(C.s, 0) == 8);
    E.write(0, D, 8, 9);
    E.bind(C.s, 0);
    OK(kvs_session_decode(C.s, 0, &q1.t, nullptr, nullptr, &ot.t, nullptr, nullptr));
    CHECK(layer_tokens(C.s, 0) == 9);
  }
  // Tables only: the KV is not kvsieve's to save; not movable to another backend.
  {
    Err e{kvs_session_save(C.s, "caller_kv_unused.kvs", KVS_SAVE_INCLUDE_KV)};
    CHECK(e.code() == KVS_STATUS_UNSUPPORTED);
    CHECK(e.msg().find("KVS_SAVE_INCLUDE_KV") != std::string::npos);
    kvs_session_t out = nullptr;
    Err t{kvs_session_to(C.s, KVS_BACKEND_CPU, 0, &out)};
    CHECK(t.code() == KVS_STATUS_UNSUPPORTED);
    CHECK(out == nullptr);
  }
  // An owned session has nothing to bind; bad kv_source values and combinations.
  {
    auto po = params(D, "quest", KVS_KV_OWNED);
    Sess X;
    OK(kvs_session_create(&po, &X.s));
    Err e{kvs_session_bind_kv(X.s, 0, &kv, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    auto p2 = params(D, "quest", 2);
    Sess Y;
    Err c{kvs_session_create(&p2, &Y.s)};
    CHECK(c.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(c.msg().find("params->kv_source") != std::string::npos);
    auto p3 = params(D, "quest", KVS_KV_CALLER);
    p3.kv_memory = KVS_DEVICE_CPU;
    Err m{kvs_session_create(&p3, &Y.s)};
    CHECK(m.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(m.msg().find("params->kv_memory") != std::string::npos);
    // A batch mixes no owned and caller sessions.
    kvs_session_t both[2] = {X.s, C.s};
    kvs_batch_t b = nullptr;
    Err bb{kvs_batch_create(both, 2, &b)};
    CHECK(bb.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(bb.msg().find("kv_source") != std::string::npos);
  }
}

TEST_CASE("caller KV (cpu): kvs_batch_plan / kvs_batch_decode over two sequences sharing one pool") {
  Rng rng(3303);
  TokenData A(rng, 8, 2, 32, 400), Bd(rng, 8, 2, 32, 400);
  TokenData* xs[2] = {&A, &Bd};
  const int64_t n0[2] = {300, 263};
  for (const char* method : {"full", "quest", "ctkvr"}) {
    INFO(std::string(method));
    Sess X[2], C[2];
    EngineCache E(A.hkv, A.d, 8);  // one pool: the two sequences' pages interleave
    EngineCache* Es[2] = {&E, &E};
    std::vector<std::vector<int32_t>> tables[2];
    for (int b = 0; b < 2; ++b) {
      auto px = params(A, method, KVS_KV_OWNED), pc = params(A, method, KVS_KV_CALLER);
      OK(kvs_session_create(&px, &X[b].s));
      OK(kvs_session_create(&pc, &C[b].s));
      E.table.assign(kLayers, {});
      E.tokens.assign(kLayers, 0);
      chunk(X[b].s, C[b].s, E, *xs[b], 0, n0[b], true);
      tables[b] = E.table;
      OK(kvs_session_build_index(X[b].s, nullptr));
      OK(kvs_session_build_index(C[b].s, nullptr));
    }
    kvs_session_t xs_[2] = {X[0].s, X[1].s}, cs_[2] = {C[0].s, C[1].s};
    kvs_batch_t bx = nullptr, bc = nullptr;
    OK(kvs_batch_create(xs_, 2, &bx));
    OK(kvs_batch_create(cs_, 2, &bc));
    for (int64_t step = 0; step < 6; ++step) {
      OK(kvs_batch_plan(bx, nullptr));
      OK(kvs_batch_plan(bc, nullptr));  // before the engine has written the token: plans need no binding
      for (uint32_t l = 0; l < kLayers; ++l) {
        std::vector<float> q, k, v;
        for (int b = 0; b < 2; ++b) {
          const int64_t t = n0[b] + step;
          q.insert(q.end(), xs[b]->qt(t), xs[b]->qt(t + 1));
          k.insert(k.end(), xs[b]->kt(t), xs[b]->kt(t + 1));
          v.insert(v.end(), xs[b]->vt(t), xs[b]->vt(t + 1));
          E.table[l] = tables[b][l];
          E.put(l, xs[b]->kt(t), xs[b]->vt(t), t);
          tables[b][l] = E.table[l];
          E.bind(cs_[b], l);
        }
        std::vector<float> o1(q.size()), o2(q.size(), NAN), l1(16), l2(16, NAN);
        T tq(q.data(), f32(), {2, A.hq, A.d}), tk(k.data(), f32(), {2, A.hkv, A.d}), tv(v.data(), f32(), {2, A.hkv, A.d});
        T to1(o1.data(), f32(), {2, A.hq, A.d}), to2(o2.data(), f32(), {2, A.hq, A.d});
        T tl1(l1.data(), f32(), {2, A.hq}), tl2(l2.data(), f32(), {2, A.hq});
        OK(kvs_batch_decode(bx, l, &tq.t, &tk.t, &tv.t, &to1.t, &tl1.t, nullptr));
        OK(kvs_batch_decode(bc, l, &tq.t, nullptr, nullptr, &to2.t, &tl2.t, nullptr));
        REQUIRE(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
        REQUIRE(std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0);
      }
    }
    kvs_batch_destroy(bx);
    kvs_batch_destroy(bc);
  }
}

TEST_CASE("decode_tokens: n rows are n decode steps, owned or over the caller's cache; row errors are named") {
  Rng rng(3304);
  TokenData D(rng, 8, 2, 32, 420);
  const int64_t P = 300, R = 4;
  for (const char* method : kMethods) {
    INFO(std::string(method));
    Sess X, Y, C;
    auto p = params(D, method, KVS_KV_OWNED), pc = params(D, method, KVS_KV_CALLER);
    OK(kvs_session_create(&p, &X.s));
    OK(kvs_session_create(&p, &Y.s));
    OK(kvs_session_create(&pc, &C.s));
    EngineCache E(D.hkv, D.d, 4);
    chunk(X.s, C.s, E, D, 0, P, true);
    T q0(D.qt(0), f32(), {P, D.hq, D.d}), k0(D.kt(0), f32(), {P, D.hkv, D.d}), v0(D.vt(0), f32(), {P, D.hkv, D.d});
    for (uint32_t l = 0; l < kLayers; ++l) OK(kvs_session_prefill(Y.s, l, &q0.t, &k0.t, &v0.t, nullptr, nullptr));
    for (kvs_session_t s : {X.s, Y.s, C.s}) OK(kvs_session_build_index(s, nullptr));
    for (int64_t round = 0; round < 3; ++round) {
      const int64_t t0 = P + round * R;
      for (uint32_t l = 0; l < kLayers; ++l) {
        INFO("round " << round << ", layer " << l);
        std::vector<float> ox(size_t(R) * D.hq * D.d, NAN), lx(size_t(R) * D.hq, NAN), oc = ox, lc = lx;
        T q(D.qt(t0), f32(), {R, D.hq, D.d}), k(D.kt(t0), f32(), {R, D.hkv, D.d}), v(D.vt(t0), f32(), {R, D.hkv, D.d});
        T tox(ox.data(), f32(), {R, D.hq, D.d}), tlx(lx.data(), f32(), {R, D.hq});
        T toc(oc.data(), f32(), {R, D.hq, D.d}), tlc(lc.data(), f32(), {R, D.hq});
        OK(kvs_session_decode_tokens(X.s, l, &q.t, &k.t, &v.t, &tox.t, &tlx.t, nullptr));
        E.write(l, D, t0, t0 + R);
        E.bind(C.s, l);
        OK(kvs_session_decode_tokens(C.s, l, &q.t, nullptr, nullptr, &toc.t, &tlc.t, nullptr));
        for (int64_t i = 0; i < R; ++i) {  // Y: one kvs_session_decode per row
          std::vector<float> o(size_t(D.hq) * D.d), ls(size_t(D.hq));
          T qi(D.qt(t0 + i), f32(), {D.hq, D.d}), ki(D.kt(t0 + i), f32(), {D.hkv, D.d}),
              vi(D.vt(t0 + i), f32(), {D.hkv, D.d}), to(o.data(), f32(), {D.hq, D.d}), tl(ls.data(), f32(), {D.hq});
          OK(kvs_session_decode(Y.s, l, &qi.t, &ki.t, &vi.t, &to.t, &tl.t, nullptr));
          REQUIRE(std::memcmp(o.data(), ox.data() + i * D.hq * D.d, o.size() * 4) == 0);
          REQUIRE(std::memcmp(ls.data(), lx.data() + i * D.hq, ls.size() * 4) == 0);
        }
        REQUIRE(ox == oc);
        REQUIRE(lx == lc);
        for (uint32_t h = 0; h < uint32_t(D.hkv); ++h) {
          REQUIRE(selection(X.s, l, h) == selection(Y.s, l, h));
          REQUIRE(selection(C.s, l, h) == selection(Y.s, l, h));
        }
      }
    }
    // Speculative drafts rejected: drop the last 2 rows of the last round, then agree again.
    OK(kvs_session_truncate(X.s, P + 3 * R - 2));
    OK(kvs_session_truncate(Y.s, P + 3 * R - 2));
    std::vector<float> o1(size_t(D.hq) * D.d), o2 = o1;
    T qn(D.qt(400), f32(), {D.hq, D.d}), kn(D.kt(400), f32(), {D.hkv, D.d}), vn(D.vt(400), f32(), {D.hkv, D.d});
    T t1(o1.data(), f32(), {D.hq, D.d}), t2(o2.data(), f32(), {D.hq, D.d});
    OK(kvs_session_decode(X.s, 0, &qn.t, &kn.t, &vn.t, &t1.t, nullptr, nullptr));
    OK(kvs_session_decode(Y.s, 0, &qn.t, &kn.t, &vn.t, &t2.t, nullptr, nullptr));
    REQUIRE(o1 == o2);
  }
}

TEST_CASE("decode_tokens: shape errors change nothing; a bad row after the first names the rows done") {
  Rng rng(3305);
  TokenData D(rng, 8, 2, 32, 320);
  auto p = params(D, "quest", KVS_KV_OWNED);
  Sess X;
  OK(kvs_session_create(&p, &X.s));
  T q0(D.qt(0), f32(), {300, D.hq, D.d}), k0(D.kt(0), f32(), {300, D.hkv, D.d}), v0(D.vt(0), f32(), {300, D.hkv, D.d});
  for (uint32_t l = 0; l < kLayers; ++l) OK(kvs_session_prefill(X.s, l, &q0.t, &k0.t, &v0.t, nullptr, nullptr));
  OK(kvs_session_build_index(X.s, nullptr));
  std::vector<float> o(size_t(4) * D.hq * D.d);
  T q(D.qt(300), f32(), {4, D.hq, D.d}), k(D.kt(300), f32(), {4, D.hkv, D.d}), v(D.vt(300), f32(), {4, D.hkv, D.d});
  T o4(o.data(), f32(), {4, D.hq, D.d}), o3(o.data(), f32(), {3, D.hq, D.d}), q2(D.qt(300), f32(), {D.hq, D.d});
  struct Case {
    const kvs_tensor *q, *k, *o;
    const char* needle;
  };
  for (const Case c : {Case{&q2.t, &k.t, &o4.t, "q: expected 3 dimensions"}, Case{&q.t, &k.t, &o3.t, "o: expected 4 rows"},
                       Case{&q.t, nullptr, &o4.t, "k_new: expected a tensor"}}) {
    INFO(c.needle);
    Err e{kvs_session_decode_tokens(X.s, 0, c.q, c.k, &v.t, c.o, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find(c.needle) != std::string::npos);
    CHECK(layer_tokens(X.s, 0) == 300);
  }
  {  // output rows that overlap (a zero row stride)
    T oz(o.data(), f32(), {4, D.hq, D.d}, true);
    oz.strides[0] = 0;
    Err e{kvs_session_decode_tokens(X.s, 0, &q.t, &k.t, &v.t, &oz.t, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("o: expected rows that do not overlap") != std::string::npos);
    CHECK(layer_tokens(X.s, 0) == 300);
  }
  {  // a caller's session whose binding holds one of the four rows: refused before the first
    auto pc = params(D, "quest", KVS_KV_CALLER);
    Sess C;
    OK(kvs_session_create(&pc, &C.s));
    EngineCache E(D.hkv, D.d, 4);
    for (uint32_t l = 0; l < kLayers; ++l) {
      E.write(l, D, 0, 300);
      E.bind(C.s, l);
      OK(kvs_session_prefill(C.s, l, &q0.t, nullptr, nullptr, nullptr, nullptr));
    }
    OK(kvs_session_build_index(C.s, nullptr));
    E.write(0, D, 300, 301);
    E.bind(C.s, 0);
    Err e{kvs_session_decode_tokens(C.s, 0, &q.t, nullptr, nullptr, &o4.t, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_STATE);
    CHECK(e.msg().find("needs 304 tokens in the caller's KV cache, its binding has 301") != std::string::npos);
    CHECK(layer_tokens(C.s, 0) == 300);
  }
  std::vector<float> bad(D.q.begin() + 300 * D.hq * D.d, D.q.begin() + 304 * D.hq * D.d);
  bad[size_t(2) * D.hq * D.d + 5] = NAN;  // row 2 of q
  T qb(bad.data(), f32(), {4, D.hq, D.d});
  Err e{kvs_session_decode_tokens(X.s, 0, &qb.t, &k.t, &v.t, &o4.t, nullptr, nullptr)};
  CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(e.msg().find("kvs_session_decode_tokens: row 2: ") == 0);
  CHECK(e.msg().find("rows 0..1 were decoded: layer 0 holds 302 tokens") != std::string::npos);
  CHECK(layer_tokens(X.s, 0) == 302);
}
